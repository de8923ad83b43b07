"""The ring of page-locked slots that loads from checkpoint files go through to the device: threads
read the files into the slots, copies out of them are queued, a slot is read into again once its
copy has run. A level-2 wake makes one for the wake; masters kept in files under a host budget share
one for good, which reads the next load ahead.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from . import _device
from .file_reads import HUGE_PAGE, back_to_back_runs, thread_pool
from .files import MappedBytes, OpenFile, bytes_of, files_of, read_into, refuse_short_read
from .pages import PAGE, align_up, written_pages
from .pinning import LOCKED, HostPin, claim_range, new_block, register_claimed, slot

# A load from masters mapped from files goes through a ring of this many page-locked slots of this
# size (see copy_from_files): 1 GiB in all, enough to keep the bus busy, and slots of 16 to 64 MiB
# ran about as fast (docs/measurements.md).
_RING_SLOT_BYTES = 32 << 20
_RING_SLOTS = 32
# A kept ring's slots are at least this fraction of the largest load it serves (see ring_shape).
_MOST_CHUNKS = 64


def _ring_pool() -> ThreadPoolExecutor:
    """The threads that fill the rings (see :class:`Ring`): a pool apart from the read-backs',
    so that a load waiting on its ring never queues behind a read-back running in the background."""
    return thread_pool("ring")


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
    for run in back_to_back_runs(sources, range(len(sources))):
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
        with torch.inference_mode(False):  # filled by reader threads, outside inference mode (see ReadBack)
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

    def _read_ahead(self, sources: Sequence[MappedBytes], start: int, slots: int) -> None:
        """Start filling at most ``slots`` slots from ``start`` on with the first chunks of
        ``sources``, the copy that followed the one being queued last time (see :meth:`copy`)."""
        chunks = _ring_chunks(sources, self.slot_bytes)
        count = len(self._slots)
        fills = [
            _ring_pool().submit(self._fill, chunk, (start + index) % count, sources)
            for index, chunk in enumerate(chunks[:slots])
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
        at every step) and starts reading the next one's first chunks ahead: as this copy starts,
        into the slots it leaves free, else once its chunks are all read, into the slots its copies
        free. The next load finds its first chunks read, where it would otherwise wait for a
        chunk's read before its first copy, and the bus with it. A chunk
        read ahead is taken only where it came from the file and its pages are still the file's;
        one copied from written views, or whose pages were written since, is copied again."""
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
        following = self._following.get(key)
        room = count - len(chunks)
        try:
            for index in range(len(fills), min(count, len(chunks))):
                fills[index] = readers.submit(self._fill, chunks[index], (start + index) % count, sources)
            if following is not None and room > 0:
                # The next copy's reads start now, in the slots this one leaves free, queued behind
                # this one's on the reader threads: its first chunks are read by the time this
                # copy's last one is on the bus, which would otherwise idle for a read at each load.
                self._read_ahead(following, (start + len(chunks)) % count, room)
            for index, chunk in enumerate(chunks):
                k = (start + index) % count
                from_file = fills[index].result()
                del fills[index]  # only once it has run: an interrupted wait leaves it to the cleanup
                if index < len(ahead) and (not from_file or written_pages(chunk.address, chunk.address + chunk.nbytes)):
                    # Read ahead from views this process wrote (which may have been written again
                    # since), or from the file before its pages were written: the views hold the bytes.
                    self._fill(chunk, k, sources)
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
        if following is not None and room <= 0:
            self._read_ahead(following, self._cursor, count)

    def close(self) -> None:
        """Stop reading ahead, wait for every copy out of the slots, then unlock them (the mapping
        goes with the ring)."""
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
    """A ring slot's bytes for chunks of ``nbytes``: whole huge pages (see HUGE_PAGE), or whole
    pages for a slot smaller than one (a small unit's ring)."""
    return align_up(nbytes, HUGE_PAGE if nbytes >= HUGE_PAGE else PAGE)


def ring_shape(loads: Sequence[tuple[int, bool]]) -> tuple[int, int]:
    """Slot bytes and slot count of a kept ring for ``loads``, each ``(bytes, at every step)``.

    A load that comes at every step gets room for two (1 GiB each at most), and a slot more each:
    holding one, the next load's reads began only as the copies of the one before freed its slots,
    and the bus idled for a chunk's read at every load; holding two, they run while this one's
    copies do (see :meth:`Ring.copy`). The slot more: a load whose weights lie in two runs of its
    file (a block of two dtypes) is cut into a chunk more than its bytes need, which would leave no
    room. Slots are sized by those loads, so that a small streamed block does not make the ring as
    large as two of the largest load read once, but are at least a ``_MOST_CHUNKS``-th of the
    largest, so that one is not read in thousands of chunks (each a read, a copy and an event)."""
    loads = [(nbytes, every_step) for nbytes, every_step in loads if nbytes > 0]
    if not loads:
        return 1, 0
    largest = max(nbytes for nbytes, _ in loads)
    stepping = [nbytes for nbytes, every_step in loads if every_step]
    slot_bytes = min(max(max(stepping or [largest]), -(-largest // _MOST_CHUNKS)), _RING_SLOT_BYTES)
    most = max(1, (_RING_SLOTS * _RING_SLOT_BYTES) // _slot_size(slot_bytes))
    return slot_bytes, max(
        2 * (min(most, -(-nbytes // slot_bytes)) + 1) if every_step else min(most, -(-nbytes // slot_bytes))
        for nbytes, every_step in loads
    )


def ring_bytes(shape: tuple[int, int]) -> int:
    """The host memory of a kept ring of this shape (see :func:`ring_shape`)."""
    return _slot_size(shape[0]) * shape[1]


def new_ring(shape: tuple[int, int], budget: int, *, pin: bool, device: torch.device | None = None) -> Ring:
    """A kept ring of this shape (see :func:`ring_shape`), shared by the loads it was made for."""
    return Ring(*shape, budget, pin=pin, device=device)


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
