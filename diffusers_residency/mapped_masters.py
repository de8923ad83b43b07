"""Masters mapped from checkpoint files (a level-2 sleep's): swapping them in, checking their files,
and reading them back into memory of their own, ahead of need or when asked.

A load copies masters mapped from files straight to the device (see ring.copy_from_files)
and leaves them mapped; :meth:`FileBackedMasters.read_ahead` then reads them back in the background.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from . import _device, file_reads, files, pinning
from .masters import StorageGroup, bound_as_taken, fills_storage
from .ring import Ring
from .weights import flat_bytes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FileBacking:
    """Masters kept in checkpoint files for good (under a host budget, see :mod:`.host_budget`):
    the bytes of each tensor in the files, by ``id`` of the tensor, checked equal to it; and the ring
    of page-locked slots that the loads of every such unit of a pipeline share."""

    sources: Mapping[int, files.MappedBytes]
    ring: Ring


class FileBackedMasters:
    """Masters that view checkpoint files. Part of :class:`~.staging.ModuleStager`, whose masters,
    copy stream and pin budget it uses."""

    device: torch.device
    pin_budget: int | None
    _groups: tuple[StorageGroup, ...]
    _maps_files: bool
    _reading_ahead: tuple[tuple[StorageGroup, ...], file_reads.ReadBack] | None
    _copy: _device.TimedCopy
    file_backing: FileBacking | None

    @property
    def file_ring(self) -> Ring | None:
        """The ring this unit's loads from files go through, where its masters stay in the files."""
        return None if self.file_backing is None else self.file_backing.ring

    @property
    def maps_files(self) -> bool:
        """Whether some masters are views of checkpoint files (see :meth:`map_masters`)."""
        return self._maps_files

    def mapped_files(self) -> list[files.OpenFile]:
        """The checkpoint files that masters are mapped from."""
        return files.files_of(group.mapped_from for group in self._groups if group.mapped)

    def read_ahead(self) -> None:
        """Start reading the masters mapped from checkpoint files back into memory of their own, in
        the background, for the next load, offload or :meth:`unmap_masters` to take. A no-op when
        none are mapped or a read is under way.

        A load copies masters mapped from files straight to the device (see
        ring.copy_from_files) and leaves them mapped: a wake takes the files' bytes to the
        device first and reads the masters back after, rather than reading them all before the
        first copy. Until then a level-1 sleep or an eviction would have nothing but the page cache
        to rebind to, hence the read here. Masters kept in the files for good (``file_backing``)
        are never read back."""
        if self._reading_ahead is None and self._maps_files and self.file_backing is None:
            self._reading_ahead = (self._groups, self._new_read_back(pin=True))

    def drop_read_ahead(self) -> None:
        """Stop a read started by :meth:`read_ahead` that nothing took (the masters are about to be
        mapped from the files again)."""
        ahead, self._reading_ahead = self._reading_ahead, None
        if ahead is not None:
            ahead[1].abandon()

    def _read_back(self, *, pin: bool = True) -> file_reads.ReadBack | None:
        """The read-back started by :meth:`read_ahead` if it reads the current masters (and locks
        pages, when ``pin``), taken from it; None otherwise, and one that reads other masters
        (retaken since) or locks pages when asked not to is stopped. A load copies each piece as it
        arrives, and the masters are taken once every copy is queued; a load that fails leaves
        them mapped, as they were."""
        ahead, self._reading_ahead = self._reading_ahead, None
        if ahead is not None:
            if ahead[0] is self._groups and pin:
                return ahead[1]
            ahead[1].abandon()
        return None

    def _new_read_back(self, *, pin: bool) -> file_reads.ReadBack:
        mapped = [group for group in self._groups if group.mapped]
        budget = self.pin_budget if pin else None
        return file_reads.ReadBack(
            [group.mapped_from for group in mapped],
            [group.alignment for group in mapped],
            budget or 0,
            pin=budget is not None,
            device=self.device,
        )

    def _settle_mapped_masters(self) -> None:
        """For a loaded unit whose masters are mapped from files: take the masters read back since
        it was loaded from them (see :meth:`read_ahead`) if that read is done, without waiting for
        one under way. Called by an offload, and before a forward once the read is done.

        Masters left mapped are as good as their files, which are checked here: where one changed
        (a save into the same folder), the mapping no longer holds the weights, but the device copy,
        loaded before, does, and the masters are copied from it."""
        ahead = self._reading_ahead
        if ahead is not None and (ahead[0] is not self._groups or ahead[1].done()):
            reading = self._read_back()  # stops one that reads other masters
            if reading is not None:
                try:
                    self._groups = self._over_masters_read_back(reading.finish())
                    return
                except Exception:
                    reading.abandon()
                    logger.warning("Could not read masters back from their checkpoint files", exc_info=True)
        if not any(file.changed() for file in self.mapped_files()):
            return
        self.drop_read_ahead()
        logger.warning(
            "Copying %d bytes of masters from the device: their checkpoint files changed",
            self.host_bytes()["mapped"],
        )
        self._groups = self._over_masters_read_back(self._copies_of_mapped_on_host())

    def _copies_of_mapped_on_host(self) -> list[pinning.HostMaster]:
        """Host copies of the loaded device bytes of every group whose master is mapped from a file
        (each such group holds one tensor that fills its storage; see :meth:`map_masters`)."""
        sources, alignments = [], []
        for group in self._groups:
            if group.mapped:
                binding = group.bindings[0]
                start = (binding.target.storage_offset() - binding.storage_offset) * binding.dtype.itemsize
                sources.append(flat_bytes(binding.target.untyped_storage(), start, group.nbytes))
                alignments.append(group.alignment)
        return pinning.copy_to_host(sources, alignments, self.pin_budget or 0, pin=self.pin_budget is not None)

    def _over_masters_read_back(self, masters: list[pinning.HostMaster]) -> tuple[StorageGroup, ...]:
        """The groups, each mapped one over its master read back (``masters``, in group order)."""
        read_back = iter(masters)
        groups = []
        for group in self._groups:
            if group.mapped:
                master = next(read_back)
                group = replace(group, master=master.data, mapped_from=None, pinned=master.pinned, pin=master.pin)
            groups.append(group)
        return tuple(groups)

    def map_masters(self, sources: Mapping[int, files.MappedBytes], *, compare: bool = True) -> int:
        """Swap masters for byte-identical views of a memory-mapped checkpoint, freeing their memory.

        ``sources`` maps ``id(tensor)`` to that tensor's bytes in the file. A storage qualifies when
        it holds one tensor that fills it exactly and the file holds the same bytes: equality is
        checked here, so a weight changed since loading (a fused LoRA, a cast) keeps its own master
        rather than coming back stale (``compare=False``: the caller compared them). Expects the
        stager offloaded; returns the bytes whose master memory was released.
        """
        self._require_offloaded("map_masters()")
        self.drop_read_ahead()  # of masters still mapped, which stay so
        self._copy.wait()  # the masters released here may still be read by the last load
        self.forget_conversions()
        candidates = {
            index: sources[id(group.bindings[0].target)]
            for index, group in enumerate(self._groups)
            if len(group.bindings) == 1
            and id(group.bindings[0].target) in sources
            and not group.mapped
            and fills_storage(group)
            and bound_as_taken(group.bindings[0], group.master)  # else its master is no longer its value
        }
        masters = [self._groups[i].master for i in candidates]
        same = files.hold_the_same_bytes(masters, list(candidates.values())) if compare else [True] * len(masters)
        groups = list(self._groups)
        released = 0
        for (index, source), equal in zip(candidates.items(), same):
            if equal:
                groups[index] = replace(
                    groups[index], master=source.view, mapped_from=source, pinned=False, pin=None, read_from=None
                )
                released += groups[index].nbytes
        self._swap_masters(tuple(groups))
        return released

    def unmap_masters(self, *, pin: bool = True) -> None:
        """Give masters mapped from a file memory of their own again (see file_reads.ReadBack), so
        the file is not read at every load: the read :meth:`read_ahead` started, waited for, else a
        new one; page-locked when this stager pins and ``pin`` (``close()`` passes False: the memory
        is about to be handed back to the module as it was). A no-op for masters kept in the files
        for good (``file_backing``): the files are their home, at a level-1 sleep as after
        ``close()``, where they stay the module's weights, as ``from_pretrained`` left them."""
        self._require_offloaded("unmap_masters()")
        if self.file_backing is not None:
            return
        self._copy.wait()
        reading = self._read_back(pin=pin)
        if reading is None and self._maps_files:
            reading = self._new_read_back(pin=pin)
        if reading is not None:
            self._swap_masters(self._over_masters_read_back(file_reads.finish_or_unlock(reading)))
