"""Reading masters from checkpoint files: back into page-locked memory of their own, by threads, each
piece locked as it fills (``ReadBack``); or straight to the device through a ring of page-locked
slots (``copy_from_files``), which a wake does first and reads the masters back after.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from . import _device
from .files import (
    READ_THREADS,
    MappedBytes,
    OpenFile,
    bytes_of,
    files_of,
    fill_from_file,
    read_into,
    refuse_short_read,
)
from .pages import written_pages
from .pinning import (
    LOCKED,
    PAGE,
    HostMaster,
    HostPin,
    align_up,
    block_bytes,
    claim_range,
    new_block,
    register_claimed,
    slot,
)

# Masters read back from their files (see ReadBack) go in pieces of about this size, each
# page-locked as soon as it is full while threads fill the next ones; smaller, down to the smaller
# figure, for a unit too small to give every thread a piece that size: one thread fills a piece,
# and a unit in one piece (a CLIP text encoder, a VAE) would be read at one thread's rate. Each
# piece starts on a huge page (below), so a small piece pads more of its unit: up to 2 MiB each.
_PIECE_BYTES = 256 << 20
_SMALLEST_PIECE_BYTES = 16 << 20
# Pieces start on huge-page boundaries, so that locking one never splits a huge page of the next.
_HUGE_PAGE = 2 << 20
# A load from masters mapped from files goes through a ring of this many page-locked slots of this
# size (see copy_from_files): 1 GiB in all, enough to keep the bus busy, and slots of 16 to 64 MiB
# ran about as fast (docs/measurements.md).
_RING_SLOT_BYTES = 32 << 20
_RING_SLOTS = 32


class _Piece:
    """A run of read-back masters registered as one range: where it lies in the block, and which."""

    def __init__(self, number: int, start: int, size: int, members: list[int]) -> None:
        self.number, self.start, self.size, self.members = number, start, size, members


def _back_to_back(sources: Sequence[MappedBytes], members: Sequence[int]) -> list[list[int]]:
    """``members`` (indices into ``sources``) in runs that one read fills: in file order, each run
    lying back to back in one file and in its mapping; a source without a file is a run alone."""
    runs: list[list[int]] = [[i] for i in members if sources[i].file is None]
    in_files = sorted((i for i in members if sources[i].file is not None), key=lambda i: (id(sources[i].file), sources[i].offset))
    for i in in_files:
        source = sources[i]
        if runs and sources[runs[-1][-1]].file is not None:
            last = sources[runs[-1][-1]]
            length = last.view.numel()
            if (
                source.file is last.file
                and source.offset == last.offset + length
                and source.view.data_ptr() == last.view.data_ptr() + length
            ):
                runs[-1].append(i)
                continue
        runs.append([i])
    return runs


_pools: dict[str, tuple[int, ThreadPoolExecutor]] = {}
_pools_lock = threading.Lock()


def _thread_pool(name: str) -> ThreadPoolExecutor:
    """The reader threads of one kind of work, made once per process (a fork does not copy the
    parent's threads), each pool first come first served."""
    with _pools_lock:
        entry = _pools.get(name)
        if entry is None or entry[0] != os.getpid():
            entry = _pools[name] = (os.getpid(), ThreadPoolExecutor(READ_THREADS, thread_name_prefix=name))
        return entry[1]


def _reader_pool() -> ThreadPoolExecutor:
    """The threads that fill read-backs, shared by all of them: the masters of every unit a wake
    brought back are read in the background, one unit after the other (see
    ``ModuleStager.read_ahead``)."""
    return _thread_pool("read_back")


def _ring_pool() -> ThreadPoolExecutor:
    """The threads that fill the ring of :func:`copy_from_files`: a pool apart from the read-backs',
    so that a load waiting on its ring never queues behind a read-back running in the background."""
    return _thread_pool("ring")


class ReadBack:
    """Masters mapped from checkpoint files, being read back into memory of their own: where each
    one's bytes go is known at once, the bytes arrive piece by piece.

    One private anonymous mapping holds them all, in pieces of about ``_PIECE_BYTES`` (fewer bytes
    for a small unit, so that every thread has one to fill) laid out by
    :func:`block_bytes` and starting on huge-page boundaries. Threads fill the pieces and lock each
    one they fill (see :meth:`_fill_piece`); :meth:`wait_for` returns once a piece is locked. A load
    copies each piece to the device as soon as it is locked, while the threads fill the next ones:
    the copies hide behind the reads instead of following them. Each piece is a registration of its
    own: a master never spans two, so a copy from it never crosses from one registered range into
    another.

    Whoever starts one calls :meth:`finish` or :meth:`abandon`.
    """

    def __init__(
        self,
        sources: Sequence[MappedBytes],
        alignments: Sequence[int],
        budget: int,
        *,
        pin: bool,
        device: torch.device | None = None,
    ) -> None:
        """``device``: the one whose context the pieces are locked in (see
        ``_device.register_host_memory``), the device the masters are copied to."""
        for file in files_of(sources):
            file.refuse_if_changed()
        self._pin, self._device = pin, device
        self._sources = list(sources)
        total = sum(source.view.numel() for source in sources)
        piece_bytes = min(_PIECE_BYTES, max(_SMALLEST_PIECE_BYTES, total // READ_THREADS))
        self.pieces: list[_Piece] = []
        members: list[int] = []
        filled = span = 0
        self._offsets: list[int] = []
        for index, source in enumerate([*sources, None]):
            if members and (source is None or filled + source.view.numel() > piece_bytes):
                within, size = block_bytes([sources[i].view.numel() for i in members], [alignments[i] for i in members])
                self.pieces.append(_Piece(len(self.pieces), span, size, members))
                self._offsets.extend(span + offset for offset in within)
                span = align_up(span + size, _HUGE_PAGE)
                members, filled = [], 0
            if source is not None:
                members.append(index)
                filled += source.view.numel()
        self.piece_of = [piece for piece in self.pieces for _ in piece.members]
        self._mapping, self._block, self._start = new_block(max(span, PAGE))
        self.slots = [slot(self._block, offset, source.view.numel()) for offset, source in zip(self._offsets, sources)]
        # Each piece's registration, set by the thread that locks it: not the result of its future,
        # which the pool's thread may still hold for a moment after the future is done, keeping the
        # piece locked after abandon() has returned.
        self._piece_pins: list[HostPin | None] = [None] * len(self.pieces)
        # Pieces waited for so far, in order (see wait_for).
        self._waited = 0
        self._claimed = [False] * len(self.pieces)
        self._fills: list[Future[None]] = []
        try:
            # Claimed in piece order here, locked as they fill (see _fill_piece): the budget goes to
            # pieces in that order, whichever thread fills them first.
            if pin:
                for piece in self.pieces:
                    self._claimed[piece.number] = claim_range(*self._addresses(piece), budget)
            readers = _reader_pool()
            for piece in self.pieces:
                self._fills.append(readers.submit(self._fill_piece, piece))
        except BaseException:
            self.abandon()
            raise

    def _fill_piece(self, piece: _Piece) -> None:
        """Fill one piece and lock it, on a reader thread: each run of masters back to back in a file
        with one scatter read (see :func:`read_into`), where this process never wrote to their mapped
        pages, the rest one master at a time (see :func:`fill_from_file`).

        Locked here rather than by the thread that copies: registering a whole pipeline keeps that
        thread busy for most of a wake, in step with the reads, so its copies would trail them
        (docs/measurements.md). The driver takes
        registrations from several threads at once: 8 GiB in 256 MiB pieces went in at 49-62 GB/s
        from one to sixteen threads there."""
        try:
            for run in _back_to_back(self._sources, piece.members):
                first, last = self._sources[run[0]], self._sources[run[-1]]
                if first.file is None or written_pages(first.view.data_ptr(), last.view.data_ptr() + last.view.numel()):
                    for i in run:
                        fill_from_file(self.slots[i], self._sources[i])
                    continue
                targets = [self._block[self._offsets[i] : self._offsets[i] + self._sources[i].view.numel()] for i in run]
                if not read_into(first.file, first.offset, targets):
                    refuse_short_read(first.file, first.offset, sum(len(target) for target in targets))
                # Written while it was read: the bytes may be a mix. (A read-back runs in the
                # background after a wake, while the caller may be saving into the same folder.)
                first.file.refuse_if_changed()
        except BaseException:
            self._unclaim(piece)
            raise
        if self._claimed[piece.number]:
            self._piece_pins[piece.number] = register_claimed(*self._addresses(piece), (self._mapping,), self._device)

    def _addresses(self, piece: _Piece) -> tuple[int, int]:
        """Where the piece starts and ends in this process's memory."""
        start = self._start + piece.start
        return start, start + piece.size

    def _unclaim(self, piece: _Piece) -> None:
        if self._claimed[piece.number]:
            self._claimed[piece.number] = False
            LOCKED.remove(*self._addresses(piece))

    def wait_for(self, index: int) -> None:
        """Return once the piece holding master ``index`` is full and, where pinned, page-locked
        (and every piece before it)."""
        while self._waited <= self.piece_of[index].number:
            self._fills[self._waited].result()
            self._waited += 1

    def done(self) -> bool:
        """Whether every piece has been filled (or failed): :meth:`finish` would not wait."""
        return all(fill.done() for fill in self._fills)

    def finish(self) -> list[HostMaster]:
        """Wait for every piece; the masters, each with the registration that locks it, if any."""
        if self.slots:
            self.wait_for(len(self.slots) - 1)
        return [
            HostMaster(self.slots[i], pin, pinned=pin is not None or (self._pin and not self.slots[i].numel()))
            for piece, pin in zip(self.pieces, self._piece_pins)
            for i in piece.members
        ]

    def abandon(self) -> None:
        """Cancel the pieces not started, wait for those being filled, and unlock what was locked.
        Copies still reading the pieces must have ended (they read page-locked memory about to be
        unregistered)."""
        for piece, fill in zip(self.pieces, self._fills):
            if fill.cancel():
                self._unclaim(piece)  # never to be filled
        for piece in self.pieces[len(self._fills) :]:
            self._unclaim(piece)  # never submitted: the constructor failed
        wait(self._fills)
        self._fills, self._waited, self._piece_pins = [], 0, [None] * len(self.pieces)


def finish_or_unlock(reading: ReadBack) -> list[HostMaster]:
    """``reading.finish()``, for a read-back nothing copies from yet: if it fails, the pieces
    locked so far are unlocked at once, not whenever the traceback holding them goes."""
    try:
        return reading.finish()
    except BaseException:
        reading.abandon()
        raise


@dataclass(frozen=True)
class _RingChunk:
    """At most one ring slot of bytes lying back to back in a file and in its mapping, from
    ``offset`` in the file and ``address`` in the mapping (``file`` None: one source without a
    file), and where each source's share goes: ``parts`` holds ``(source, start in the source,
    bytes, start in the slot)``."""

    file: OpenFile | None
    offset: int
    address: int
    nbytes: int
    parts: tuple[tuple[int, int, int, int], ...]


def _ring_chunks(sources: Sequence[MappedBytes], slot_bytes: int) -> list[_RingChunk]:
    """The sources cut into slot-sized chunks, runs of sources back to back in a file sharing
    chunks."""
    chunks = []
    for run in _back_to_back(sources, range(len(sources))):
        first = sources[run[0]]
        sizes = [sources[i].view.numel() for i in run]
        starts = [0]
        for size in sizes[:-1]:
            starts.append(starts[-1] + size)
        total, next_source = starts[-1] + sizes[-1], 0
        for begin in range(0, total, slot_bytes):
            end = min(begin + slot_bytes, total)
            while starts[next_source] + sizes[next_source] <= begin:
                next_source += 1
            parts = []
            within = next_source
            while within < len(run) and starts[within] < end:
                low, high = max(begin, starts[within]), min(end, starts[within] + sizes[within])
                if low < high:
                    parts.append((run[within], low - starts[within], high - low, low - begin))
                within += 1
            chunks.append(
                _RingChunk(first.file, first.offset + begin, first.view.data_ptr() + begin, end - begin, tuple(parts))
            )
    return chunks


class Ring:
    """Page-locked slots that copies from checkpoint files go through (see :func:`copy_from_files`):
    threads read the files into the slots, the calling thread queues the copies out of them, and a
    slot is read into again once its last copy has run.

    A level-2 wake makes one for its call and closes it after. Masters kept in the files for good
    (a host budget, see :mod:`.host_budget`) load at every call, a streamed block at every step: they
    share one ring held while they are staged, so that mapping and page-locking a gigabyte is not
    paid at each load. ``budget`` and ``pin`` say whether the slots may be page-locked (each by the
    thread that first fills it, in ``device``'s context); a copy out of a slot that is not waits
    for itself.
    """

    def __init__(
        self, slot_bytes: int, slot_count: int, budget: int, *, pin: bool, device: torch.device | None = None
    ) -> None:
        self.slot_bytes = _slot_size(slot_bytes)
        self.device = device
        self._mapping, block, start = new_block(slot_count * self.slot_bytes)
        self._slots = [slot(block, k * self.slot_bytes, self.slot_bytes) for k in range(slot_count)]
        self._spans = [(start + k * self.slot_bytes, start + (k + 1) * self.slot_bytes) for k in range(slot_count)]
        # Claimed here in order, registered by the thread that fills the slot first (see ReadBack).
        self._claimed = [pin and claim_range(*span, budget) for span in self._spans]
        self._pins: list[HostPin | None] = [None] * slot_count
        # The event of the last copy out of each slot, where that copy did not wait for itself.
        self._copied: list[torch.Event | None] = [None] * slot_count
        self._asynchronous = device is not None and _device.is_accelerator(device)
        # The slot the next copy starts at; the copy queued last (by id of its first source and
        # its length) and, for each copy, the sources of the one that followed it (see copy).
        self._cursor = 0
        self._last: tuple[int, int] | None = None
        self._following: dict[tuple[int, int] | None, list[MappedBytes]] = {}
        # The copy being read ahead: its sources, chunks, first slot and the fills under way.
        self._ahead: tuple[list[MappedBytes], list[_RingChunk], int, list[Future[bool]]] | None = None
        # The thread and stream that loads through a kept ring run on (see submit), made on first use.
        self._loader: ThreadPoolExecutor | None = None
        self._stream = _device.new_copy_stream(device) if self._asynchronous else None

    @property
    def nbytes(self) -> int:
        return len(self._slots) * self.slot_bytes

    def _fill(self, chunk: _RingChunk, k: int, sources: Sequence[MappedBytes]) -> bool:
        """Fill slot ``k`` with ``chunk`` once its last copy has run, on a reader thread; whether it
        was read from the file (rather than copied from views that this process wrote)."""
        copied = self._copied[k]
        if copied is not None:
            copied.synchronize()
        slot = self._slots[k]
        # Read from the file where this process never wrote to the chunk's mapped pages, else
        # copied from the views (see fill_from_file).
        from_file = chunk.file is not None and not written_pages(chunk.address, chunk.address + chunk.nbytes)
        if from_file:
            if not read_into(chunk.file, chunk.offset, [bytes_of(slot[: chunk.nbytes])]):
                refuse_short_read(chunk.file, chunk.offset, chunk.nbytes)
        else:
            for source, begin, size, at in chunk.parts:
                slot[at : at + size].copy_(sources[source].view[begin : begin + size])
        if self._claimed[k]:
            self._claimed[k] = False
            self._pins[k] = register_claimed(*self._spans[k], (self._mapping,), self.device)
        return from_file

    def _read_ahead(self, sources: Sequence[MappedBytes], start: int) -> None:
        """Start filling the slots from ``start`` on with the first chunks of ``sources``, the copy
        that followed the one just queued last time (see :meth:`copy`)."""
        chunks = _ring_chunks(sources, self.slot_bytes)
        count = len(self._slots)
        fills = [
            _ring_pool().submit(self._fill, chunk, (start + index) % count, sources)
            for index, chunk in enumerate(chunks[:count])
        ]
        self._ahead = (list(sources), chunks, start, fills)

    def _take_read_ahead(self, sources: Sequence[MappedBytes]) -> tuple[list[_RingChunk], int, list[Future[bool]]]:
        """The fills :meth:`_read_ahead` started for ``sources``, with their chunks and first slot; or
        none (and the slots they fill freed) where it read ahead another copy."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and len(ahead[0]) == len(sources) and all(a is b for a, b in zip(ahead[0], sources)):
            return ahead[1], ahead[2], ahead[3]
        if ahead is not None:
            for fill in ahead[3]:
                fill.cancel()
            wait(ahead[3])
        return _ring_chunks(sources, self.slot_bytes), self._cursor, []

    def copy(self, sources: Sequence[MappedBytes], targets: Sequence[torch.Tensor]) -> None:
        """Copy each source's bytes into its target (a flat byte tensor on the ring's device, the
        same size), queued on the current stream. Returns once every copy is queued; the slots are
        read into again only after their copies ran. Raises if a file changed since its masters
        were mapped, before or while it is read (see :meth:`OpenFile.refuse_if_changed`).

        The ring learns which copy follows which (a streamed block's loads come in the same order
        at every step) and, once a copy's chunks are all read, starts reading the next one's into
        the slots its copies free: the next load finds its first chunks read while this one's
        copies ran, where it would otherwise wait for a chunk's read before its first copy. A chunk
        read ahead from the file whose pages this process has written since is read again."""
        files = files_of(sources)
        for file in files:
            file.refuse_if_changed()
        key = (id(sources[0]), len(sources)) if sources else None
        if self._last is not None:
            self._following[self._last] = list(sources)
        chunks, start, ahead = self._take_read_ahead(sources)
        count = len(self._slots)
        readers = _ring_pool()
        fills: dict[int, Future[bool]] = dict(enumerate(ahead))
        try:
            for index in range(len(fills), min(count, len(chunks))):
                fills[index] = readers.submit(self._fill, chunks[index], (start + index) % count, sources)
            for index, chunk in enumerate(chunks):
                k = (start + index) % count
                from_file = fills[index].result()
                del fills[index]  # only once it has run: an interrupted wait leaves it to the cleanup
                if index < len(ahead) and from_file and written_pages(chunk.address, chunk.address + chunk.nbytes):
                    self._fill(chunk, k, sources)  # written since it was read ahead: the views hold the bytes
                locked = self._pins[k] is not None
                for source, begin, size, at in chunk.parts:
                    targets[source][begin : begin + size].copy_(self._slots[k][at : at + size], non_blocking=locked)
                self._copied[k] = None
                if locked and self._asynchronous:
                    self._copied[k] = torch.Event(device=self.device)
                    self._copied[k].record()
                if index + count < len(chunks):
                    fills[index + count] = readers.submit(self._fill, chunks[index + count], k, sources)
            for file in files:
                file.refuse_if_changed()  # written while it was read: the bytes copied may be a mix
        finally:
            for pending in fills.values():
                pending.cancel()
            wait(fills.values())
        self._cursor = (start + len(chunks)) % count
        self._last = key
        following = self._following.get(key)
        if following is not None:
            self._read_ahead(following, self._cursor)

    def submit(
        self, sources: Sequence[MappedBytes], targets: Sequence[torch.Tensor], after: torch.Event | None
    ) -> Future[tuple[torch.Event | None, float]]:
        """:meth:`copy` on the ring's own thread and stream, after ``after`` (an event of the stream
        the load was queued on: where its device storage is free to write); its result is an event
        that the copies are done by (None on the CPU, where they are) and the seconds the thread
        took. Loads through one ring run one after the other, in the order submitted.

        A load from files waits for reads of the page cache, while a load from masters in RAM only
        queues copies: run by the thread that queues the compute, it held that thread for the
        reads, and the device, left with nothing queued, waited too (docs/measurements.md). Here the
        reads run beside the compute; the unit's first forward waits for its event."""
        if self._loader is None:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="ring_loader")

        def load() -> tuple[torch.Event | None, float]:
            started = time.perf_counter()
            if self._stream is None:
                self.copy(sources, targets)
                return None, time.perf_counter() - started
            if after is not None:
                self._stream.wait_event(after)
            with self._stream:
                self.copy(sources, targets)
            done = torch.Event(device=self.device)
            done.record(self._stream)
            return done, time.perf_counter() - started

        return self._loader.submit(load)

    def close(self) -> None:
        """Wait for the loads submitted, stop reading ahead, wait for every copy out of the slots,
        then unlock them (the mapping goes with the ring)."""
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None
        self._take_read_ahead([])
        self._following.clear()
        for copied in self._copied:
            if copied is not None:
                copied.synchronize()
        self._copied = [None] * len(self._slots)
        for k, span in enumerate(self._spans):
            if self._claimed[k]:
                self._claimed[k] = False
                LOCKED.remove(*span)
        self._pins = [None] * len(self._slots)  # unlocks them (HostPin's finalizer)


def _slot_size(nbytes: int) -> int:
    """A ring slot's bytes for chunks of ``nbytes``: whole huge pages (see _HUGE_PAGE), or whole
    pages for a slot smaller than one (a small unit's ring)."""
    return align_up(nbytes, _HUGE_PAGE if nbytes >= _HUGE_PAGE else PAGE)


def _ring_shape(largest: int) -> tuple[int, int]:
    """Slot bytes and count of a ring for loads of at most ``largest`` bytes: 1 GiB at most."""
    return max(1, min(largest, _RING_SLOT_BYTES)), min(_RING_SLOTS, max(1, -(-largest // _RING_SLOT_BYTES)))


def ring_bytes(largest: int) -> int:
    """The host memory of a ring for loads of at most ``largest`` bytes (see :func:`new_ring`)."""
    slot_bytes, slot_count = _ring_shape(largest)
    return _slot_size(slot_bytes) * slot_count


def new_ring(largest: int, budget: int, *, pin: bool, device: torch.device | None = None) -> Ring:
    """A ring for loads of at most ``largest`` bytes, to be shared by them (see :class:`Ring`)."""
    return Ring(*_ring_shape(largest), budget, pin=pin, device=device)


def copy_from_files(
    sources: Sequence[MappedBytes],
    targets: Sequence[torch.Tensor],
    budget: int,
    *,
    pin: bool,
    device: torch.device | None = None,
    ring: Ring | None = None,
) -> None:
    """Copy each source's bytes into its target (a flat byte tensor on ``device``, the same size)
    through ``ring``, or through a ring made for this call (page-locked while ``pin`` and
    ``budget`` allow) and closed when every copy has run.

    A level-2 wake that read the masters into new memory of their own and copied them from there
    moved each byte through host memory four times: the kernel zeroes each new page, the read
    copies into it (reading the page cache and writing), and the device reads it back, and the
    host's memory bandwidth set the pace (2.3x a level-1 wake; docs/measurements.md). Through at
    most 1 GiB of slots the zeroing and the locking of every page go: the masters are read back
    into memory of their own afterwards, off the wake's path (see ``ModuleStager.read_ahead``).
    Nothing is left locked or reading when it raises."""
    if ring is not None:
        ring.copy(sources, targets)
        return
    chunks = _ring_chunks(sources, _RING_SLOT_BYTES)
    if not chunks:
        return
    ring = Ring(max(chunk.nbytes for chunk in chunks), min(_RING_SLOTS, len(chunks)), budget, pin=pin, device=device)
    try:
        ring.copy(sources, targets)
    finally:
        if ring._asynchronous:
            # Every copy out of the slots has run before they are unlocked and unmapped, one
            # interrupted before its event was recorded included.
            torch.accelerator.current_stream(device).synchronize()
        ring.close()
