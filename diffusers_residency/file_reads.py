"""Reading masters back from checkpoint files into page-locked memory of their own, by threads, each
piece locked as it fills (``ReadBack``), and what reading files takes: runs of weights back to back
in a file, the reader threads. A wake first copies the files to the device through a ring of slots
(see :mod:`.ring`) and reads the masters back after.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from .files import (
    READ_THREADS,
    MappedBytes,
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
HUGE_PAGE = 2 << 20


class _Piece:
    """A run of read-back masters registered as one range: where it lies in the block, and which."""

    def __init__(self, number: int, start: int, size: int, members: list[int]) -> None:
        self.number, self.start, self.size, self.members = number, start, size, members


def back_to_back_runs(sources: Sequence[MappedBytes], members: Sequence[int]) -> list[list[int]]:
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


def thread_pool(name: str) -> ThreadPoolExecutor:
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
    return thread_pool("read_back")


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
                span = align_up(span + size, HUGE_PAGE)
                members, filled = [], 0
            if source is not None:
                members.append(index)
                filled += source.view.numel()
        self.piece_of = [piece for piece in self.pieces for _ in piece.members]
        self._mapping, self._block, self._start = new_block(max(span, PAGE))
        # Filled by reader threads, outside inference mode: made inside it (a call under
        # torch.inference_mode() waking a pipeline), a slot would be an inference tensor, which only
        # inference mode may write.
        with torch.inference_mode(False):
            self.slots = [slot(self._block, offset, s.view.numel()) for offset, s in zip(self._offsets, sources)]
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
            for run in back_to_back_runs(self._sources, piece.members):
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
