"""Where a load's copies go on the device: one buffer for a unit's storages, placed so that masters
side by side in one page-locked block go in one copy (``place_copies``); and device storage handed
from one streamed block to the next (``DeviceSlots``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _device
from .masters import StorageGroup

# Where each storage's copy starts in a load's device buffer: the caching allocator's own rounding.
_DEVICE_ALIGNMENT = 512
# Masters further apart than this in one page-locked block are copied apart.
_MOST_BYTES_COPIED_BETWEEN = 4096


def place_copies(
    groups: Sequence[StorageGroup], locked_in: Sequence[object | None], *, accelerated: bool
) -> tuple[tuple[int, ...], int, tuple[tuple[int, int], ...]]:
    """Where each group's copy starts in the one device buffer a load allocates, the buffer's size,
    and the copies that fill it: ranges of groups ``(first, last)``, each one host-to-device copy.

    One allocation per load rather than one per storage: the caching allocator gives a storage of
    10 MB or more a segment of its own, and releasing its cache then frees each with a ``cudaFree``
    of its own (most of a level-1 sleep of a pipeline with 700 such weights); every allocation is
    host time in the load, too. Each copy still gets a storage of its own (see
    ``ModuleStager._copy_to_device``), starting on the allocator's 512-byte rounding, so kernels see
    the alignment a storage allocated alone would have; on the CPU (not ``accelerated``) at its
    master's address modulo 64 (see _device.allocate_device_storage).

    Masters side by side in one page-locked block (see pinning.copy_to_host: each starts on the same
    512-byte rounding; ``locked_in`` names each one's registration, or the piece of a read-back it
    arrives in) keep their distances in the buffer, and go in one copy: a pipeline's thousands of
    small storages, copied one by one, move below the bus's rate (docs/measurements.md). The bytes
    between two such masters (under a page; padding of the block) are copied too, into padding of
    the buffer."""

    def start_at_or_after(end: int, group: StorageGroup) -> int:
        if accelerated:
            return -(-end // _DEVICE_ALIGNMENT) * _DEVICE_ALIGNMENT
        return end + (group.alignment - end) % _device.CPU_ALIGNMENT

    addresses = [group.master.data_ptr() for group in groups]
    offsets: list[int] = []
    runs: list[list[int]] = []
    end = 0
    previous: StorageGroup | None = None
    for index, (group, address) in enumerate(zip(groups, addresses)):
        if previous is not None and locked_in[index] is not None and locked_in[index] is locked_in[index - 1]:
            # In the same registered range as the one before: page-locked memory throughout.
            gap = address - (addresses[index - 1] + previous.nbytes)
            start = end + gap
            if 0 <= gap < _MOST_BYTES_COPIED_BETWEEN and start == start_at_or_after(start, group):
                offsets.append(start)
                runs[-1][1] = index
                end, previous = start + group.nbytes, group
                continue
        offsets.append(start_at_or_after(end, group))
        runs.append([index, index])
        end, previous = offsets[-1] + group.nbytes, group
    return tuple(offsets), end, tuple((a, b) for a, b in runs)


class DeviceSlots:
    """Device storages that one component's streamed blocks load into, handed from the block dropped
    to the block loading next.

    Left to the caching allocator, a dropped block's storages go back to its cache while the block
    that computes allocates its activations, which split those cached blocks to serve their own,
    smaller requests; the next block's weights then find no free block of their size, and the
    allocator reserves new segments. Under a VRAM budget that memory is room the activation reserve
    has to cover instead of resident blocks (docs/benchmarks-history.md has the reserved and allocated
    peaks). Storages kept here never return to that cache while the component streams.

    Slots are keyed by layout (the storages' sizes, and on the CPU their alignment), which the blocks
    of one class share. A block of another layout (FLUX.1's single-stream blocks after its
    double-stream ones) finds none, and the slots of other layouts are dropped, so the allocator
    serves it from their memory rather than from more: the pool never holds more than the window of
    blocks the planner made room for.
    """

    def __init__(self) -> None:
        self._free: dict[tuple, list[list[torch.Tensor]]] = {}

    def take(self, layout: tuple) -> list[torch.Tensor] | None:
        """Storages of ``layout`` to load into, or None (allocate new ones)."""
        free = self._free.get(layout)
        if free:
            return free.pop()
        self._free.clear()
        return None

    def give(self, layout: tuple, storages: list[torch.Tensor]) -> None:
        """Keep the storages of a dropped block for the next load. The caller has ordered the compute
        stream after their last copy; the next copy into them waits for that compute (see TimedCopy)."""
        self._free.setdefault(layout, []).append(storages)

    def clear(self) -> None:
        """Give every slot not taken back to the allocator."""
        self._free.clear()
