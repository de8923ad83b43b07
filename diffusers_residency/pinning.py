"""Page-locked host memory for masters: locked where it already is, counted against a budget, not rounded up.

``tensor.pin_memory()`` copies into PyTorch's caching host allocator, which rounds every block up to
a power of two and keeps freed blocks for reuse: a pipeline's weights end up in host RAM twice for a
while (the original and the copy) and up to twice over for good (the rounding), and pinning costs
about 0.5 s per GiB. Registering the pages a weight already occupies (``cudaHostRegister``) locks
them where they are, about ten times faster, with no second copy and no rounding up. That is done for
large weights whose pages hold nothing else; small ones, weights in the malloc heap, weights that are not on the host (a
pipeline built on the device) and weights whose pages cannot be registered are copied, once, into
a block sized to their bytes (slots padded to 512 bytes, the block to whole pages) that is
registered in turn, and their old memory is freed.

Page locking is process-wide and the pages cannot be swapped out, so it is bounded: every masters'
registration counts against a pin budget; what does not fit stays pageable. Loads from pageable
masters still work, at the pageable copy rate, and the report says which bytes are pinned.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import mmap
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import _device
from .machine_memory import machine_memory_limit
from .pages import PAGE, align_up, give_back_read_pages, private_file_mappings

logger = logging.getLogger(__name__)

# The default pin budget, as a fraction of the memory the process may have (physical RAM, or a
# container's limit): what is locked cannot be paged out, so the rest keeps a quarter to work in.
DEFAULT_PIN_FRACTION = 0.75
# Masters copied into a block start at multiples of this, which keeps DMA reads aligned.
_SLOT_ALIGNMENT = 512
# Only storages at least this large, outside the malloc heap, are locked in place. Registration
# works on whole pages, and a page that is only partly registered breaks every copy that touches
# it, either way: a host tensor that starts in a registered page and ends in an unregistered one
# fails to copy with "invalid argument", to the device and from it (docs/measurements.md). So a
# weight is locked where it is only when its first and last pages can hold nothing else: glibc
# serves a large request from its main heap (the "[heap]" mapping) whenever a free chunk there is
# big enough, beside other allocations, so that heap is excluded (see owns_its_pages); outside it,
# an allocation larger than a thread arena's 64 MiB heap is a mapping of its own.
IN_PLACE_MIN_BYTES = 64 << 20


def resolve_pin_budget(pin_budget: int | float | None) -> int:
    """Bytes the package may keep page-locked in this process: ``None`` for the default (75 % of
    what :func:`machine_memory_limit` allows), a float in (0, 1] for a fraction of it, or an int
    number of bytes."""
    if pin_budget is None:
        return int(DEFAULT_PIN_FRACTION * machine_memory_limit())
    if isinstance(pin_budget, bool) or not isinstance(pin_budget, (int, float)):
        raise TypeError(f"pin_budget must be bytes (int) or a fraction of RAM (float), not {pin_budget!r}")
    if isinstance(pin_budget, float):
        if not 0.0 < pin_budget <= 1.0:
            raise ValueError(f"pin_budget as a fraction of RAM must be in (0, 1], not {pin_budget}")
        return int(pin_budget * machine_memory_limit())
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
    return register_claimed(start, end, tensors) if claim_range(start, end, budget) else None


def claim_range(start: int, end: int, budget: int) -> bool:
    """Count a range as locked if it fits ``budget`` and overlaps none locked: before it is
    registered, so that ranges claimed in order on one thread and registered later on others (see
    ReadBack) get the budget in that order, and two registrations at once cannot both take the
    last of it."""
    with LOCKED.lock:
        if LOCKED.locked_bytes + (end - start) > budget or LOCKED.overlaps(start, end):
            return False
        LOCKED.add(start, end)
        return True


def register_claimed(
    start: int, end: int, tensors: tuple[torch.Tensor, ...], device: torch.device | None = None
) -> HostPin | None:
    """Register a range :func:`claim_range` counted, in ``device``'s context (see
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
    return start - start % PAGE, align_up(start + tensor.numel(), PAGE)


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
        offsets.append(align_up(total, _SLOT_ALIGNMENT) + alignment)
        total = offsets[-1] + size
    return offsets, max(align_up(total, PAGE), PAGE)  # a mapping cannot be empty


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
    mapping, block, start = new_block(span)
    host_pin = _pin_range(start, start + span, (mapping,), budget) if pin else None
    masters = []
    mappings = private_file_mappings() if any(source.device.type == "cpu" for source in sources) else []
    for source, offset in zip(sources, offsets):
        data = slot(block, offset, source.numel())
        data.copy_(source)
        if mappings and source.device.type == "cpu":
            # A weight of a file mapping: the copy read its pages in, and nothing needs them now.
            give_back_read_pages(source.data_ptr(), source.data_ptr() + source.numel(), mappings)
        masters.append(HostMaster(data, host_pin, pinned=host_pin is not None or (pin and not source.numel())))
    return masters


def new_block(span: int) -> tuple[mmap.mmap, memoryview, int]:
    """A private anonymous mapping of ``span`` bytes, its memoryview and its address.

    Backed by huge pages where the kernel allows: fewer page faults while it fills, and fewer pages
    to lock (filling ran 1.7x and locking 2.3x as fast: docs/measurements.md)."""
    mapping = mmap.mmap(-1, span, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel built without transparent huge pages
            pass
    block = memoryview(mapping)
    return mapping, block, torch.frombuffer(block[:1], dtype=torch.uint8).data_ptr()


def slot(block: memoryview, offset: int, size: int) -> torch.Tensor:
    return torch.frombuffer(block[offset : offset + size], dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
