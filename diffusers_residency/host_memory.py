"""Host memory for masters: page-locked where it already is, counted against a budget, not rounded up.

``tensor.pin_memory()`` copies into PyTorch's caching host allocator, which rounds every block up to
a power of two and keeps freed blocks for reuse: a pipeline's weights end up in host RAM twice for a
while (the original and the copy) and up to twice over for good (the rounding), and pinning costs
about 0.5 s per GiB. Registering the pages a weight already occupies (``cudaHostRegister``) locks
them where they are, about ten times faster, with no second copy and no rounding up. That is done for
large weights whose pages hold nothing else; small ones, weights in the malloc heap, weights that are not on the host (a
pipeline built on the device) and weights whose pages cannot be registered are copied, once, into
a block sized to their bytes (slots padded to 512 bytes, the block to whole pages) that is
registered in turn, and their old memory is freed.

Masters that a level-2 sleep swapped for views of the checkpoint files are read back from the files
into such blocks by threads, each piece locked as it fills (``ReadBack``).

Page locking is process-wide and the pages cannot be swapped out, so it is bounded: every masters'
registration counts against a pin budget; what does not fit stays pageable. Loads from pageable
masters still work, at the pageable copy rate, and the report says which bytes are pinned.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from . import _device

logger = logging.getLogger(__name__)

_PAGE = mmap.PAGESIZE
# The default pin budget, as a fraction of physical RAM: what is locked cannot be paged out, so the
# rest of the system keeps a quarter to work in.
DEFAULT_PIN_FRACTION = 0.75
# Masters copied into a block start at multiples of this, which keeps DMA reads aligned.
_SLOT_ALIGNMENT = 512
# Only storages at least this large, outside the malloc heap, are locked in place. Registration
# works on whole pages, and a page that is only partly registered breaks every copy that touches
# it, either way: a host tensor that starts in a registered page and ends in an unregistered one
# fails to copy with "invalid argument" (measured on the H200 machine, to the device, and from it
# into a pipeline's output allocated by malloc in the last page of a weight locked in place). So a
# weight is locked where it is only when its first and last pages can hold nothing else: glibc
# serves a large request from its main heap (the "[heap]" mapping) whenever a free chunk there is
# big enough, beside other allocations, so that heap is excluded (see owns_its_pages); outside it,
# an allocation larger than a thread arena's 64 MiB heap is a mapping of its own.
IN_PLACE_MIN_BYTES = 64 << 20
# Masters read back from their files (see ReadBack) go in pieces of about this size, each
# page-locked as soon as it is full while threads fill the next ones; smaller, down to the smaller
# figure, for a unit too small to give every thread a piece that size: one thread fills a piece,
# and a unit in one piece (a CLIP text encoder, a VAE) would be read at one thread's rate. Each
# piece starts on a huge page (below), so a small piece pads more of its unit: up to 2 MiB each.
_PIECE_BYTES = 256 << 20
_SMALLEST_PIECE_BYTES = 16 << 20
# Pieces start on huge-page boundaries, so that locking one never splits a huge page of the next.
_HUGE_PAGE = 2 << 20
# Reading the page cache is a copy the kernel makes on the calling thread: one thread read 6.1 GB/s
# on the H200 machine, sixteen 44 GB/s.
_READ_THREADS = max(1, min(16, os.cpu_count() or 1))
# A load from masters mapped from files goes through a ring of this many page-locked slots of this
# size (see copy_from_files). On the H200 machine, FLUX.1-dev's transformer (23.8 GB) went from
# the page cache to the device at 29-32 GB/s through 32 slots of 32 MiB, and about as fast through
# slots of 16 or 64 MiB; FLUX.1-dev's wake ran at 22 GB/s reading into new memory first.
_RING_SLOT_BYTES = 32 << 20
_RING_SLOTS = 32


def _align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def resolve_pin_budget(pin_budget: int | float | None) -> int:
    """Bytes the package may keep page-locked in this process: ``None`` for the default (75 % of
    physical RAM), a float in (0, 1] for a fraction of physical RAM, or an int number of bytes."""
    if pin_budget is None:
        return int(DEFAULT_PIN_FRACTION * physical_memory_bytes())
    if isinstance(pin_budget, bool) or not isinstance(pin_budget, (int, float)):
        raise TypeError(f"pin_budget must be bytes (int) or a fraction of RAM (float), not {pin_budget!r}")
    if isinstance(pin_budget, float):
        if not 0.0 < pin_budget <= 1.0:
            raise ValueError(f"pin_budget as a fraction of RAM must be in (0, 1], not {pin_budget}")
        return int(pin_budget * physical_memory_bytes())
    if pin_budget < 0:
        raise ValueError(f"pin_budget must be at least 0 bytes, not {pin_budget}")
    return pin_budget


class _LockedRanges:
    """The page ranges this process has registered through this module, and their total.

    Registering a range that overlaps one already registered fails, and a failed CUDA runtime call
    poisons the next kernel launch (see ``_device.register_host_memory``), so overlaps are ruled out
    here, before the call. One sorted list of ``(start, end)`` pairs, changed by single calls:
    ``_unpin`` runs from finalizers, which the garbage collector may start in the middle of any
    method here, and two parallel lists could be caught half updated. The garbage collector may
    also start them on another thread (one of ReadBack's readers), hence the lock; reentrant,
    since on the same thread a finalizer may start while the lock is held.
    """

    def __init__(self) -> None:
        self._ranges: list[tuple[int, int]] = []
        self.locked_bytes = 0
        self.lock = threading.RLock()

    def overlaps(self, start: int, end: int) -> bool:
        with self.lock:
            index = bisect.bisect_left(self._ranges, (end,))
            return index > 0 and self._ranges[index - 1][1] > start

    def add(self, start: int, end: int) -> None:
        with self.lock:
            bisect.insort(self._ranges, (start, end))
            self.locked_bytes += end - start

    def remove(self, start: int, end: int) -> None:
        with self.lock:
            self._ranges.remove((start, end))
            self.locked_bytes -= end - start

    def ranges(self) -> list[tuple[int, int]]:
        return list(self._ranges)


LOCKED = _LockedRanges()


def locked_bytes() -> int:
    """Host bytes page-locked by this package in this process, over every pipeline."""
    return LOCKED.locked_bytes


class HostPin:
    """One registered page range; unregistered when the last master inside it is dropped.

    The finalizer holds the tensors whose pages the range covers, so their memory cannot be freed
    (and reused or unmapped) while it is still registered. It does not run at interpreter exit:
    the driver releases every registration with the process, and the runtime may be gone by then.
    """

    def __init__(self, start: int, end: int, tensors: tuple[torch.Tensor, ...], device: torch.device | None) -> None:
        self._finalizer = weakref.finalize(self, _unpin, start, end, tensors, device)
        self._finalizer.atexit = False


def _unpin(start: int, end: int, tensors: tuple[torch.Tensor, ...], device: torch.device | None) -> None:
    LOCKED.remove(start, end)
    _device.unregister_host_memory(start, device)


def _pin_range(start: int, end: int, tensors: tuple[torch.Tensor, ...], budget: int) -> HostPin | None:
    return _register_claimed(start, end, tensors) if _claim(start, end, budget) else None


def _claim(start: int, end: int, budget: int) -> bool:
    """Count a range as locked if it fits ``budget`` and overlaps none locked: before it is
    registered, so that ranges claimed in order on one thread and registered later on others (see
    ReadBack) get the budget in that order, and two registrations at once cannot both take the
    last of it."""
    with LOCKED.lock:
        if LOCKED.locked_bytes + (end - start) > budget or LOCKED.overlaps(start, end):
            return False
        LOCKED.add(start, end)
        return True


def _register_claimed(
    start: int, end: int, tensors: tuple[torch.Tensor, ...], device: torch.device | None = None
) -> HostPin | None:
    """Register a range :func:`_claim` counted, in ``device``'s context (see
    ``_device.register_host_memory``); the claim is given back if that fails or raises."""
    try:
        registered = _device.register_host_memory(start, end - start, device)
    except BaseException:
        LOCKED.remove(start, end)
        raise
    if not registered:
        LOCKED.remove(start, end)
        return None
    return HostPin(start, end, tensors, device)


@dataclass(frozen=True)
class HostMaster:
    """A master's bytes and, when they are page-locked, the registration that keeps them so."""

    data: torch.Tensor
    pin: HostPin | None
    # Page-locked: by ``pin``, or already before the package saw it (memory from pin_memory()).
    pinned: bool


def _page_span(tensor: torch.Tensor) -> tuple[int, int]:
    start = tensor.data_ptr()
    return start - start % _PAGE, _align_up(start + tensor.numel(), _PAGE)


def _locked_elsewhere(host: torch.Tensor) -> bool:
    """Whether the memory was page-locked before the package saw it (``pin_memory()``, another library).

    ``is_pinned()`` asks the driver about one address only: a weight that merely starts in a page
    this package registered for a neighbouring weight would pass, and copying it would fail on its
    unregistered pages. So ranges of this package's own never count, and both ends are asked.
    """
    start, end = _page_span(host)
    return not LOCKED.overlaps(start, end) and host.is_pinned() and host[-1:].is_pinned()


def _malloc_heap_range() -> tuple[int, int] | None:
    """The main malloc heap's address range (the ``[heap]`` line of ``/proc/self/maps``), if any."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if line.rstrip().endswith("[heap]"):
                    start, end = line.split()[0].split("-")
                    return int(start, 16), int(end, 16)
    except OSError:
        pass
    return None


def owns_its_pages(hosts: Sequence[torch.Tensor]) -> list[bool]:
    """For each flat host byte tensor, whether the pages it spans can hold nothing but it, so locking
    them in place cannot lock part of another allocation (see ``IN_PLACE_MIN_BYTES``)."""
    heap = _malloc_heap_range()
    owned = []
    for host in hosts:
        start, end = _page_span(host)
        in_heap = heap is not None and start < heap[1] and end > heap[0]
        owned.append(host.numel() >= IN_PLACE_MIN_BYTES and not in_heap)
    return owned


def pin_in_place(hosts: Sequence[torch.Tensor], budget: int) -> list[HostMaster]:
    """Register the pages of flat host byte tensors where they are, within ``budget``; memory that is
    page-locked already is left as it is. The caller vouches that nothing else lives in those pages
    (:func:`owns_its_pages`, or a mapping of its own).

    Tensors whose pages overlap (consecutive weights of one memory-mapped file) are registered
    together as one run: a page can be registered only once.
    A run that does not fit the budget, or cannot be registered, stays pageable as it is.
    """
    masters = [HostMaster(host, None, pinned=_locked_elsewhere(host)) for host in hosts]
    order = sorted((i for i, master in enumerate(masters) if not master.pinned), key=lambda i: hosts[i].data_ptr())
    runs: list[tuple[int, int, list[int]]] = []
    for index in order:
        start, end = _page_span(hosts[index])
        if runs and start < runs[-1][1]:
            runs[-1] = (runs[-1][0], max(end, runs[-1][1]), [*runs[-1][2], index])
        else:
            runs.append((start, end, [index]))
    for start, end, members in runs:
        pin = _pin_range(start, end, tuple(hosts[i] for i in members), budget)
        if pin is not None:
            for i in members:
                masters[i] = HostMaster(hosts[i], pin, pinned=True)
    return masters


def block_bytes(sizes: Sequence[int], alignments: Sequence[int]) -> tuple[list[int], int]:
    """Where each copy goes in a block, and the block's size: each copy starts on a 512-byte slot
    boundary plus its ``alignments`` entry (below 64), and the block ends on a page boundary."""
    offsets = []
    total = 0
    for size, alignment in zip(sizes, alignments):
        offsets.append(_align_up(total, _SLOT_ALIGNMENT) + alignment)
        total = offsets[-1] + size
    return offsets, max(_align_up(total, _PAGE), _PAGE)  # a mapping cannot be empty


def host_span(address: int, nbytes: int) -> torch.Tensor:
    """A flat byte tensor over ``nbytes`` of host memory at ``address``, owning none of it: one copy
    source spanning several masters that lie side by side in one block (see
    ``staging.ModuleStager._placed``). Their own tensors keep the memory alive; torch has no tensor
    over a raw range, so the range goes through a ctypes array."""
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)


def copy_to_host(
    sources: Sequence[torch.Tensor], alignments: Sequence[int], budget: int, *, pin: bool
) -> list[HostMaster]:
    """Copy flat byte tensors (on the device, or host memory that could not be pinned in place) into
    one host block sized by :func:`block_bytes`, page-locked if ``pin`` and within ``budget``.

    The block is a private anonymous mapping of its own, so the registered pages hold nothing but
    masters, and are unmapped with the last master in them. Each master is a storage of its own
    over its slot: tensors bound to it group by that storage, as the weights did, when masters are
    taken again. Each copy starts at its ``alignments`` entry modulo 64, the address its storage
    had, which keeps CPU results bit-identical (see ``_device.allocate_device_storage``).
    """
    if not sources:
        return []
    offsets, span = block_bytes([source.numel() for source in sources], alignments)
    mapping, block, start = _new_block(span)
    host_pin = _pin_range(start, start + span, (mapping,), budget) if pin else None
    masters = []
    for source, offset in zip(sources, offsets):
        data = _slot(block, offset, source.numel())
        data.copy_(source)
        masters.append(HostMaster(data, host_pin, pinned=host_pin is not None or (pin and not source.numel())))
    return masters


def _new_block(span: int) -> tuple[mmap.mmap, memoryview, int]:
    """A private anonymous mapping of ``span`` bytes, its memoryview and its address.

    Backed by huge pages where the kernel allows: fewer page faults while it fills, and fewer pages
    to lock. On the H200 machine, filling 8 GiB from the page cache ran at 27.6 GB/s against 16.6,
    and locking it took 0.022 s per GiB against 0.051."""
    mapping = mmap.mmap(-1, span, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel built without transparent huge pages
            pass
    block = memoryview(mapping)
    return mapping, block, torch.frombuffer(block[:1], dtype=torch.uint8).data_ptr()


def _slot(block: memoryview, offset: int, size: int) -> torch.Tensor:
    return torch.frombuffer(block[offset : offset + size], dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)


class OpenFile:
    """A file open for reading, closed once nothing reads it any more.

    Masters read their file through the descriptor, not its path: the path could be given a new
    file (a checkpoint saved again) while their mapping still shows the old one. ``mapping_path``
    names the same open file, for mapping it.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        weakref.finalize(self, os.close, self.fd)
        by_descriptor = f"/proc/self/fd/{self.fd}"
        self.mapping_path = by_descriptor if os.path.exists(by_descriptor) else self.path
        self._stamp = self._stat()

    def _stat(self) -> tuple[int, int]:
        status = os.fstat(self.fd)
        return status.st_size, status.st_mtime_ns

    def changed(self) -> bool:
        """Whether the file was written since it was opened. Written in place (``save_pretrained``
        into the same folder rewrites each file), its mapping shows the new bytes at the old places;
        cut short, touching the mapping past the new end kills the process (SIGBUS)."""
        return self._stat() != self._stamp

    def refuse_if_changed(self) -> None:
        """Raise if the file :meth:`changed`."""
        if self.changed():
            raise RuntimeError(
                f"{self.path} changed since the pipeline was put to sleep at level 2, which keeps its "
                "weights only in that file; they cannot be brought back from it. Restore the file, "
                "or load the pipeline again (and leave the files of a pipeline asleep at level 2 as "
                "they are)."
            )


@dataclass(frozen=True)
class MappedBytes:
    """A master's bytes in a checkpoint file: a flat view of them in a private memory mapping of the
    file, and, when known, the open file and where in it they lie."""

    view: torch.Tensor
    file: OpenFile | None = None
    offset: int = 0


def files_of(sources: Iterable[MappedBytes]) -> list[OpenFile]:
    """The open files the sources lie in, each once."""
    return list({id(source.file): source.file for source in sources if source.file is not None}.values())


# For each value of a pagemap entry's top byte, 1 where the page is the process's own copy.
_WRITTEN_BY_TOP_BYTE = bytes(1 if (top & 0x40) or (top & 0xA0) == 0x80 else 0 for top in range(256))


def _written_pages(start: int, end: int) -> bool:
    """Whether this process wrote to any page of a private file mapping between addresses ``start``
    and ``end`` (or cannot tell): a written page is the process's own copy, no longer the file's
    (``/proc/self/pagemap``: present without the file-page bit, or swapped out; a page never written
    is either not present or a page of the file)."""
    start, end = start - start % _PAGE, _align_up(end, _PAGE)
    if end <= start:
        return False  # no bytes, no pages
    expected = 8 * ((end - start) // _PAGE)
    # Asked for every chunk a load from the files reads (see copy_from_files), by sixteen threads
    # at once: plain descriptor calls and a byte translation stay off the GIL that the thread
    # queueing the copies needs, where a Python file object and tensor arithmetic took it for a
    # few hundred microseconds a chunk.
    try:
        pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            entries = os.pread(pagemap, expected, 8 * (start // _PAGE))
        finally:
            os.close(pagemap)
    except OSError:
        return True
    if len(entries) != expected:
        return True
    # The flags are in each little-endian entry's last byte: present (bit 63), swapped (62), a
    # page of the file (61).
    return 1 in entries[7::8].translate(_WRITTEN_BY_TOP_BYTE)


def _view_written(view: torch.Tensor) -> bool:
    return _written_pages(view.data_ptr(), view.data_ptr() + view.numel())


def _fill(slot: torch.Tensor, source: MappedBytes) -> None:
    """Copy a master's bytes into ``slot``: with ``pread`` from its file where this process never
    wrote to its mapped view, else from the view.

    Copying from the view makes the kernel fault in every 4 KiB page of the mapping and, at the
    end, unmap them; reading the file copies out of the page cache with neither. On the H200 machine,
    8 GiB went in at 12.4 GB/s through a mapping, and at 20.3 GB/s read by 16 threads into pieces
    locked as they filled."""
    if source.file is None or _view_written(source.view):
        slot.copy_(source.view)
    elif not _read(source.file, source.offset, [_bytes_of(slot)]):
        _refuse_short(source.file, source.offset, slot.numel())


def _refuse_short(file: OpenFile, offset: int, nbytes: int) -> None:
    file.refuse_if_changed()
    raise RuntimeError(f"{file.path} ends before the {nbytes} bytes at {offset}")


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview over a flat byte tensor's memory (``preadv`` reads into buffers)."""
    return memoryview((ctypes.c_uint8 * tensor.numel()).from_address(tensor.data_ptr())).cast("B")


# The most buffers one preadv takes (the kernel's UIO_MAXIOV).
_MOST_BUFFERS_PER_READ = 1024


def _read(file: OpenFile, offset: int, targets: Sequence[memoryview]) -> bool:
    """Fill ``targets`` in turn from consecutive bytes of ``file`` at ``offset`` (a scatter read,
    ``preadv``); False if the file ends first. One call for many weights lying back to back in the
    file: per-weight calls cost their Python overhead a thousand times a component, under the GIL
    that every reader thread shares."""
    pending = [target for target in targets if len(target)]
    first = 0
    while first < len(pending):
        done = os.preadv(file.fd, pending[first : first + _MOST_BUFFERS_PER_READ], offset)
        if done <= 0:
            return False
        offset += done
        while first < len(pending) and done >= len(pending[first]):
            done -= len(pending[first])
            first += 1
        if done:
            pending[first] = pending[first][done:]
    return True


def _holds(master: torch.Tensor, source: MappedBytes, scratch: torch.Tensor) -> bool:
    """Whether ``source`` holds the same bytes as ``master``, read from its file a chunk at a time
    into ``scratch`` where it has one (see :func:`_fill` for why not through the view)."""
    if master.numel() != source.view.numel():
        return False
    if source.file is None or _view_written(source.view):
        return _equal_bytes(master, source.view)
    for start in range(0, master.numel(), scratch.numel()):
        chunk = master[start : start + scratch.numel()]
        if not _read(source.file, source.offset + start, [_bytes_of(scratch[: chunk.numel()])]) or not _equal_bytes(
            chunk, scratch[: chunk.numel()]
        ):
            return False
    return True


_LIBC = ctypes.CDLL(None)
_LIBC.memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_LIBC.memcmp.restype = ctypes.c_int


def _equal_bytes(first: torch.Tensor, second: torch.Tensor) -> bool:
    """``torch.equal`` for two flat byte tensors of one size, by ``memcmp``: ``torch.equal`` runs its
    own intra-op threads, and called from every reader thread at once, those teams would compete
    for the same cores; ``memcmp`` stays on the thread that calls it (and ctypes lets go of the GIL)."""
    return not first.numel() or _LIBC.memcmp(first.data_ptr(), second.data_ptr(), first.numel()) == 0


def hold_the_same_bytes(masters: Sequence[torch.Tensor], sources: Sequence[MappedBytes]) -> list[bool]:
    """For each master, whether its source in a checkpoint file holds the same bytes, compared by
    threads (a level-2 sleep compares every weight; through the views, FLUX.1-dev's 33.7 GB took
    10 s on the H200 machine)."""
    scratches = threading.local()

    def holds(pair: tuple[torch.Tensor, MappedBytes]) -> bool:
        if not hasattr(scratches, "tensor"):
            scratches.tensor = torch.empty(_PIECE_BYTES // 4, dtype=torch.uint8)
        return _holds(*pair, scratches.tensor)

    with ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="hold_the_same_bytes") as readers:
        return list(readers.map(holds, zip(masters, sources)))


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
            entry = _pools[name] = (os.getpid(), ThreadPoolExecutor(_READ_THREADS, thread_name_prefix=name))
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
        piece_bytes = min(_PIECE_BYTES, max(_SMALLEST_PIECE_BYTES, total // _READ_THREADS))
        self.pieces: list[_Piece] = []
        members: list[int] = []
        filled = span = 0
        self._offsets: list[int] = []
        for index, source in enumerate([*sources, None]):
            if members and (source is None or filled + source.view.numel() > piece_bytes):
                within, size = block_bytes([sources[i].view.numel() for i in members], [alignments[i] for i in members])
                self.pieces.append(_Piece(len(self.pieces), span, size, members))
                self._offsets.extend(span + offset for offset in within)
                span = _align_up(span + size, _HUGE_PAGE)
                members, filled = [], 0
            if source is not None:
                members.append(index)
                filled += source.view.numel()
        self.piece_of = [piece for piece in self.pieces for _ in piece.members]
        self._mapping, self._block, self._start = _new_block(max(span, _PAGE))
        self.slots = [_slot(self._block, offset, source.view.numel()) for offset, source in zip(self._offsets, sources)]
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
                    self._claimed[piece.number] = _claim(*self._addresses(piece), budget)
            readers = _reader_pool()
            for piece in self.pieces:
                self._fills.append(readers.submit(self._fill_piece, piece))
        except BaseException:
            self.abandon()
            raise

    def _fill_piece(self, piece: _Piece) -> None:
        """Fill one piece and lock it, on a reader thread: each run of masters back to back in a file
        with one scatter read (see :func:`_read`), where this process never wrote to their mapped
        pages, the rest one master at a time (see :func:`_fill`).

        Locked here rather than by the thread that copies: registering FLUX.1-dev's 33.7 GB kept
        that thread busy for about 1.0 s of a 1.4-1.6 s wake on the H200 machine (beside sixteen
        readers), in step with the reads, so its copies trailed them. The driver takes
        registrations from several threads at once: 8 GiB in 256 MiB pieces went in at 49-62 GB/s
        from one to sixteen threads there."""
        try:
            for run in _back_to_back(self._sources, piece.members):
                first, last = self._sources[run[0]], self._sources[run[-1]]
                if first.file is None or _written_pages(first.view.data_ptr(), last.view.data_ptr() + last.view.numel()):
                    for i in run:
                        _fill(self.slots[i], self._sources[i])
                    continue
                targets = [self._block[self._offsets[i] : self._offsets[i] + self._sources[i].view.numel()] for i in run]
                if not _read(first.file, first.offset, targets):
                    _refuse_short(first.file, first.offset, sum(len(target) for target in targets))
                # Written while it was read: the bytes may be a mix. (A read-back runs in the
                # background after a wake, while the caller may be saving into the same folder.)
                first.file.refuse_if_changed()
        except BaseException:
            self._unclaim(piece)
            raise
        if self._claimed[piece.number]:
            self._piece_pins[piece.number] = _register_claimed(*self._addresses(piece), (self._mapping,), self._device)

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


def finished(reading: ReadBack) -> list[HostMaster]:
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


def copy_from_files(
    sources: Sequence[MappedBytes],
    targets: Sequence[torch.Tensor],
    budget: int,
    *,
    pin: bool,
    device: torch.device | None = None,
) -> None:
    """Copy each source's bytes into its target (a flat byte tensor on ``device``, the same size)
    through a ring of slots: threads read the files into the slots, this thread queues the copies
    out of them on the current stream, and a slot is read into again once its copy has run.
    Returns when every copy has run.

    A level-2 wake that read the masters into new memory of their own and copied them from there
    moved each byte through host memory four times: the kernel zeroes each new page, the read
    copies into it (reading the page cache and writing), and the device reads it back, and the
    host's memory bandwidth set the pace (1.5 s for FLUX.1-dev's 33.7 GB on the H200 machine, 2.3x
    its level-1 wake). Through at most 1 GiB of slots, mapped and page-locked once per call,
    the zeroing and the locking of every page go: the masters are read back into memory of their
    own afterwards, off the wake's path (see ``ModuleStager.read_ahead``).

    Slots are page-locked while ``pin`` and ``budget`` allow (each by the thread that first fills
    it, in ``device``'s context); a copy out of a slot that is not waits for itself. Raises if a
    file changed since its masters were mapped, before or while it is read (see
    :meth:`OpenFile.refuse_if_changed`); nothing is left locked or reading when it raises."""
    files = files_of(sources)
    for file in files:
        file.refuse_if_changed()
    chunks = _ring_chunks(sources, _RING_SLOT_BYTES)
    if not chunks:
        return
    slot_bytes = _align_up(max(chunk.nbytes for chunk in chunks), _HUGE_PAGE)
    slot_count = min(_RING_SLOTS, len(chunks))
    mapping, block, start = _new_block(slot_count * slot_bytes)
    slots = [_slot(block, k * slot_bytes, slot_bytes) for k in range(slot_count)]
    spans = [(start + k * slot_bytes, start + (k + 1) * slot_bytes) for k in range(slot_count)]
    claimed = [False] * slot_count
    pins: list[HostPin | None] = [None] * slot_count
    # The event of the last copy out of each slot, where that copy did not wait for itself.
    copied: list[torch.Event | None] = [None] * slot_count
    asynchronous = device is not None and _device.is_accelerator(device)

    def fill(index: int) -> None:
        chunk, k = chunks[index], index % slot_count
        if copied[k] is not None:
            copied[k].synchronize()
        slot = slots[k]
        # Read from the file where this process never wrote to the chunk's mapped pages, else
        # copied from the views (see _fill).
        if chunk.file is not None and not _written_pages(chunk.address, chunk.address + chunk.nbytes):
            if not _read(chunk.file, chunk.offset, [_bytes_of(slot[: chunk.nbytes])]):
                _refuse_short(chunk.file, chunk.offset, chunk.nbytes)
        else:
            for source, begin, size, at in chunk.parts:
                slot[at : at + size].copy_(sources[source].view[begin : begin + size])
        if claimed[k]:
            claimed[k] = False
            pins[k] = _register_claimed(*spans[k], (mapping,), device)

    readers = _ring_pool()
    fills: dict[int, Future[None]] = {}
    try:
        # Claimed here in order, registered by the thread that fills the slot first (see ReadBack).
        for k, span in enumerate(spans):
            claimed[k] = pin and _claim(*span, budget)
        for index in range(slot_count):
            fills[index] = readers.submit(fill, index)
        for index, chunk in enumerate(chunks):
            fills[index].result()
            del fills[index]  # only once it has run: an interrupted wait leaves it to the cleanup
            k = index % slot_count
            locked = pins[k] is not None
            for source, begin, size, at in chunk.parts:
                targets[source][begin : begin + size].copy_(slots[k][at : at + size], non_blocking=locked)
            copied[k] = None
            if locked and asynchronous:
                copied[k] = torch.Event(device=device)
                copied[k].record()
            if index + slot_count < len(chunks):
                fills[index + slot_count] = readers.submit(fill, index + slot_count)
        for file in files:
            file.refuse_if_changed()  # written while it was read: the bytes copied may be a mix
    finally:
        for pending in fills.values():
            pending.cancel()
        wait(fills.values())
        if asynchronous:
            # Every copy out of the slots has run before they are unlocked and unmapped, one
            # interrupted before its event was recorded included.
            torch.accelerator.current_stream(device).synchronize()
        for k, span in enumerate(spans):
            if claimed[k]:
                LOCKED.remove(*span)
        pins.clear()  # unlocks them (HostPin's finalizer)
