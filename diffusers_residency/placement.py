"""Where a load's copies go on the device: one buffer for a unit's storages, placed so that masters
side by side in one page-locked block go in one copy (``place_copies``); and device storage handed
from one streamed block to the next (``DeviceSlots``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from . import _device, file_reads, pinning, ring
from .masters import Backing, StorageGroup

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

    addresses = [group.source.data_ptr() for group in groups]
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

    Slots are keyed by layout (the one buffer's size, or the storages' sizes and on the CPU their
    alignment), which the blocks of one class share. A block of another layout (FLUX.1's
    single-stream blocks after its double-stream ones) finds none, and the slots of other layouts
    are dropped, so the allocator serves it from their memory rather than from more: the pool never
    holds more than the window of blocks the planner made room for.
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


class DeviceCopies:
    """Queueing a load's copies: device storage (one buffer, or one storage per group, or a block's
    from :class:`DeviceSlots`), the copies from the masters, those from checkpoint files, and the
    storage each group's tensors are bound to. Part of :class:`~.staging.ModuleStager`, whose
    masters, copy stream and pin budget it uses."""

    device: torch.device
    pin_memory: bool
    pin_budget: int | None
    one_buffer: bool
    _groups: tuple[StorageGroup, ...]
    _maps_files: bool
    _copy: _device.TimedCopy
    _device_storages: list[torch.Tensor]
    # How the last load's storage was laid out, for DeviceSlots (see _device_storage).
    _slot_layout: tuple
    _placement: tuple[tuple, tuple[int, ...], int, tuple[tuple[int, int], ...]]
    # _placed for the current masters, reset where they change (see ModuleStager._groups).
    _current_placement: tuple[tuple[int, ...], int, tuple[tuple[int, int], ...]] | None
    file_ring: ring.Ring | None
    read_bytes: int
    read_seconds: float

    def _layout(self) -> tuple:
        """What device storage this stager's loads need: equal layouts can share :class:`DeviceSlots`."""
        if _device.is_accelerator(self.device):
            return tuple(group.nbytes for group in self._groups)
        # On the CPU the copy's alignment is part of its place (see _device.allocate_device_storage).
        return tuple((group.nbytes, group.alignment) for group in self._groups)

    def _placed(
        self, groups: tuple[StorageGroup, ...] | None = None, locked_in: list[object | None] | None = None
    ) -> tuple[tuple[int, ...], int, tuple[tuple[int, int], ...]]:
        """Where each group's copy goes in a load's one device buffer (see placement.place_copies),
        for ``groups`` and their ``locked_in`` (the current masters and their registrations unless
        given), made once per layout and masters' addresses.

        Blocks of a component load one allocation per storage instead (the group makes their
        stagers so): under a VRAM budget their storages come and go while activations come and go
        too, and a buffer of a whole block (hundreds of MB for FLUX.1-dev's) needs a free range that
        size, which a capped device may not have (docs/benchmarks-history.md). So do units under diffusers'
        layerwise casting (see ResidencyGroup.add), and every device but the CPU and CUDA (see
        _device.slices_storages)."""
        current = groups is None or (groups is self._groups and locked_in is None)
        if current and self._current_placement is not None:
            return self._current_placement
        groups = self._groups if groups is None else groups
        key = (self._layout(), tuple(group.source.data_ptr() for group in groups))
        # Keyed by addresses alone: a read-back's pieces (see _copy_to_device) become the
        # registrations of the same ranges, or stay pageable, where a copy may span groups too.
        # Keyed by sizes and addresses, not the groups: holding those would keep masters let go alive.
        if self._placement[0] != key:
            locked_in = [group.pin for group in groups] if locked_in is None else locked_in
            placed = place_copies(groups, locked_in, accelerated=_device.is_accelerator(self.device))
            self._placement = (key, *placed)
        if current:
            self._current_placement = self._placement[1:]
        return self._placement[1:]

    def _copy_to_device(self, slots: DeviceSlots | None, reading: file_reads.ReadBack | None) -> list[Backing]:
        """Allocate the device storage, queue the copies into it and return a storage per group to
        bind; with ``reading``, each copy from a master being read back waits for its piece, and the
        groups take the masters read back once all are queued; without, masters mapped from files
        are copied from the files (see ring.copy_from_files) and stay mapped."""
        groups, locked_in, arriving = self._groups, None, None
        reads_files = reading is None and self._maps_files
        from_files = [i for i, group in enumerate(groups) if group.mapped] if reads_files else []
        if reading is not None:
            groups, locked_in, arriving = self._arriving_from(reading)
        one_buffer = self.one_buffer and _device.slices_storages(self.device)
        offsets, total, runs = self._placed(groups, locked_in) if one_buffer else ((), 0, ())
        with torch.inference_mode(False):
            storages = self._device_storage(groups, slots, total if one_buffer else None)
            # A load from the files is not timed: its time is the files' read, not the bus's, and
            # the load rate feeds the plan of streamed components (see StepTiming).
            in_buffer = offsets if one_buffer else None
            with self._copy.running(timed=reading is None and not from_files):
                self._copy_from_masters(groups, storages, in_buffer, runs, bool(from_files), arriving, reading)
                if from_files:
                    self._copy_from_files([groups[i] for i in from_files], storages, in_buffer, from_files)
            if reading is not None:
                masters = reading.finish()
                self._groups = tuple(
                    group if read is None else replace(group, pinned=masters[read].pinned, pin=masters[read].pin)
                    for group, read in zip(groups, arriving)
                )
            return storages if not one_buffer else _storage_per_group(storages[0], offsets, groups)

    def _arriving_from(
        self, reading: file_reads.ReadBack
    ) -> tuple[tuple[StorageGroup, ...], list[object | None], list[int | None]]:
        """The groups over the pieces of ``reading`` where their masters are being read back, each
        one's registration (or piece), and its place in the read-back (None: not read back)."""
        groups = self._groups
        arriving: list[int | None] = [None] * len(groups)
        locked_in = [group.pin for group in groups]
        for read, index in enumerate(i for i, group in enumerate(groups) if group.mapped):
            locked_in[index], arriving[index] = reading.piece_of[read], read
        groups = tuple(
            group if read is None else replace(group, master=reading.slots[read], mapped_from=None)
            for group, read in zip(groups, arriving)
        )
        return groups, locked_in, arriving

    def _device_storage(
        self, groups: tuple[StorageGroup, ...], slots: DeviceSlots | None, buffer_bytes: int | None
    ) -> list[torch.Tensor]:
        """Storage to load into: a dropped block's from ``slots``, else one buffer of ``buffer_bytes``,
        else one storage per group; held by the stager from here on (see ``_device_storages``).

        A dropped block's storage fits when it was laid out the same: one buffer of the same size
        (its groups' places in it depend on where their masters lie on the host, see
        :func:`place_copies`, so equal groups alone do not make equal buffers), or storages of the
        same sizes (see :meth:`_layout`)."""
        self._slot_layout = self._layout() if buffer_bytes is None else ("one buffer", buffer_bytes)
        storages = slots.take(self._slot_layout) if slots is not None else None
        if storages is None and buffer_bytes is not None:
            storages = [_device.allocate_device_storage(buffer_bytes, self.device, alignment=0)]
        elif storages is None:
            storages = [_device.allocate_device_storage(g.nbytes, self.device, alignment=g.alignment) for g in groups]
        self._device_storages = storages
        return storages

    def _copy_from_masters(
        self,
        groups: tuple[StorageGroup, ...],
        storages: list[torch.Tensor],
        offsets: tuple[int, ...] | None,
        runs: tuple[tuple[int, int], ...],
        skip_mapped: bool,
        arriving: list[int | None] | None,
        reading: file_reads.ReadBack | None,
    ) -> None:
        """Queue the copies from the masters (with ``skip_mapped``, all but those mapped from files):
        by ``runs`` to ``offsets`` in one buffer (``storages`` holds it alone; see :meth:`_placed`),
        or with ``offsets`` None into a storage per group; each copy of a master being read back
        waits for its piece (``arriving``, in ``reading``)."""
        if offsets is not None:
            (buffer,) = storages
            for first, last in runs:
                if skip_mapped and groups[first].mapped:
                    continue  # a run of its own (see _placed), copied from the files
                if arriving is not None and arriving[first] is not None:
                    reading.wait_for(arriving[first])
                begin, end = offsets[first], offsets[last] + groups[last].nbytes
                master = groups[first].source
                source = master if first == last else pinning.host_span(master.data_ptr(), end - begin)
                buffer[begin:end].copy_(source, non_blocking=self.pin_memory)
            return
        for index, (storage, group) in enumerate(zip(storages, groups)):
            if skip_mapped and group.mapped:
                continue  # copied from the files
            if arriving is not None and arriving[index] is not None:
                reading.wait_for(arriving[index])
            storage.copy_(group.source, non_blocking=self.pin_memory)

    def _copy_from_files(
        self,
        mapped: list[StorageGroup],
        storages: list[torch.Tensor],
        offsets: tuple[int, ...] | None,
        indices: list[int],
    ) -> None:
        """Queue the copies of the ``mapped`` groups (at ``indices`` among the load's groups) from
        their checkpoint files, through the ring of page-locked slots (see
        ring.copy_from_files): to ``offsets`` in the one buffer, or into their own storages.
        Their masters stay mapped, to be read back after (see FileBackedMasters.read_ahead)."""
        if offsets is not None:
            (buffer,) = storages
            targets = [buffer[offsets[i] : offsets[i] + group.nbytes] for i, group in zip(indices, mapped)]
        else:
            targets = [storages[i] for i in indices]
        started = time.perf_counter()
        ring.copy_from_files(
            [group.mapped_from for group in mapped],
            targets,
            self.pin_budget or 0,
            pin=self.pin_budget is not None,
            device=self.device,
            ring=self.file_ring,
        )
        self.read_seconds += time.perf_counter() - started
        self.read_bytes += sum(group.nbytes for group in mapped)


def _storage_per_group(
    buffer: torch.Tensor, offsets: tuple[int, ...], groups: tuple[StorageGroup, ...]
) -> list[torch.UntypedStorage]:
    """A storage of its own for each group's bytes in a load's one buffer.

    A slice of an untyped storage is a storage of its own over those bytes that holds a reference
    to the whole: each weight keeps a storage of its own, as it had on the host (safetensors
    refuses to save tensors that share one, and a later snapshot groups by storage), and the buffer
    lives until the last of them is let go. Made once the copies are queued: host time they hide."""
    whole, start = buffer.untyped_storage(), buffer.storage_offset()
    return [whole[start + at : start + at + group.nbytes] for at, group in zip(offsets, groups)]
