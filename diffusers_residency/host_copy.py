"""Loads from the copy of the weights that the ranks of a host share, and this rank's writes kept
apart from it (see :mod:`.shared_masters`, which makes the copy at enable).

A rank's tensors are bound to its private mapping of the copy's file, and its loads read its shared
mapping, page-locked: :class:`HostCopy` tells, for a master, where its bytes are in the shared one.
A master this rank writes no longer matches the shared mapping, and gets a copy of its own that its
loads read from then on (:class:`HostCopyReads`, part of the stager).
"""

from __future__ import annotations

import bisect
import logging
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch

from . import pinning
from .masters import StorageGroup
from .pages import drop_pages, written_spans
from .pinning import HostPin, slot
from .weights import Wrappers, stored_tensors

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MappedCopy:
    """One component's file as this rank maps it: privately (where its tensors are bound), and shared
    (where loads read), page-locked by ``pin`` when the pin budget allowed. The private mapping is
    held here, not only by the tensors over it: were they all to leave it, its addresses, which
    tell a master in the host's copy, could be given to other memory."""

    private: memoryview
    shared: memoryview
    pin: HostPin | None

    @property
    def start(self) -> int:
        return address_of(self.private)


class HostCopy:
    """The host's copy of a pipeline's weights as this rank maps it (see the module's docstring):
    the ranks that share it, and where a load reads each master that lies in it."""

    def __init__(self, ranks: tuple[int, ...], copies: Iterable[MappedCopy]) -> None:
        self.ranks = ranks
        self._copies = sorted(copies, key=lambda copy: copy.start)
        self._starts = [copy.start for copy in self._copies]

    def shared_view(self, master: torch.Tensor) -> tuple[torch.Tensor, HostPin | None] | None:
        """``master``'s bytes in the shared mapping and its registration, if ``master`` lies in a
        private mapping of the host's copy; else None."""
        address = master.data_ptr()
        index = bisect.bisect_right(self._starts, address) - 1
        if index < 0 or not master.numel():
            return None
        copy = self._copies[index]
        offset = address - self._starts[index]
        if offset + master.numel() > len(copy.private):
            return None
        return slot(copy.shared, offset, master.numel()), copy.pin


class HostCopyReads:
    """Part of :class:`~.staging.ModuleStager`: what keeps the masters read from the host's copy
    (``StorageGroup.read_from``) apart from the writes of this rank. It reads the stager's
    ``_groups``, ``_wrappers``, ``pin_budget``, ``_reads_host_copy`` (whether any master is read from
    the copy), ``_shared_versions``, ``_wrapper_versions``, ``tensors()`` and ``_swap_masters`` (see
    masters.MasterBindings)."""

    _groups: tuple[StorageGroup, ...]
    _wrappers: Wrappers
    pin_budget: int | None
    _reads_host_copy: bool
    # id(tensor) -> the tensor (weakly), its version counter when it was bound to a master read from
    # the host's copy, and that master's address: a counter moved since is a write of this rank,
    # whatever the tensor was bound to meanwhile and whatever changed the groups (a retake, a cast
    # and its way back, a level-2 sleep keep groups as they were). WRITTEN where the master's pages
    # were written already. None until the first groups are noted, at enable.
    _shared_versions: dict[int, tuple[weakref.ref, int, int]] | None
    # id(wrapper) -> the wrapper subclass tensor (weakly) and its version counter when first seen:
    # a write into one (torchao's copy_) moves its counter, not its inner tensors' (see Wrappers).
    _wrapper_versions: dict[int, tuple[weakref.ref, int]]
    WRITTEN = -1

    def _note_shared_versions(self) -> None:
        """Record the counters of tensors newly bound to masters read from the host's copy (called as
        the groups change), and forget those of tensors gone. A tensor bound anew, to a master this
        rank wrote already (a parameter made anew over a written weight, a buffer a cast made a new
        view of, ``b.data = a.data``), counts as written: its own counter has not moved. Told from
        the page table, once per such master; not at enable, where nothing was written yet."""
        check_pages = self._shared_versions is not None
        if self._shared_versions is None:
            self._shared_versions = {}
        for group in self._groups:
            if group.read_from is None:
                continue
            start = group.master.data_ptr()
            written = None
            for binding in group.bindings:
                target = binding.target
                entry = self._shared_versions.get(id(target))
                if binding.inference or (entry is not None and entry[0]() is target and entry[2] == start):
                    continue
                if written is None:
                    written = check_pages and self._wrote(group)
                version = self.WRITTEN if written else target._version
                self._shared_versions[id(target)] = (weakref.ref(target), version, start)
        for key in [key for key, (reference, _, _) in self._shared_versions.items() if reference() is None]:
            del self._shared_versions[key]

    def _note_wrapper_versions(self) -> None:
        """Record the counters of wrapper subclasses first seen (called as the wrappers are found)."""
        for wrapper, version in zip(self._wrappers.tensors, self._wrappers.versions()):
            entry = self._wrapper_versions.get(id(wrapper))
            if version is not None and (entry is None or entry[0]() is not wrapper):
                self._wrapper_versions[id(wrapper)] = (weakref.ref(wrapper), version)

    def _copy_written_in_place(self) -> None:
        """Offloaded, before a load reads them: masters read from the host's copy that a tensor was
        written into in place since (``load_state_dict``, ``copy_``: its version counter moved, or
        its wrapper's) get copies of their own (see :meth:`_own_copies`); so do those of inference
        tensors, which have no counter, if their bytes changed (see :meth:`_wrote`, at every
        load: models built under inference mode are rare). A write through ``.data`` moves no
        counter, and is not seen (docs/multi-gpu.md)."""
        versions = self._shared_versions or {}
        in_written_wrappers = set()
        if self._wrappers.tensors:
            for wrapper, now in zip(self._wrappers.tensors, self._wrappers.versions()):
                reference, then = self._wrapper_versions.get(id(wrapper), (None, None))
                if reference is not None and reference() is wrapper and now != then:
                    in_written_wrappers.update(id(inner) for inner in stored_tensors(wrapper))

        def written(group: StorageGroup) -> bool:
            for binding in group.bindings:
                target = binding.target
                if binding.inference:
                    return self._wrote(group)
                reference, version, _ = versions.get(id(target), (None, None, None))
                if id(target) in in_written_wrappers or (
                    reference is not None and reference() is target and target._version != version
                ):
                    return True
            return False

        self._bind_own_copies(written)

    def copy_written_pages(self) -> None:
        """Offloaded, after a method wrote into the weights (``fuse_lora()``): masters read from the
        host's copy whose pages this rank wrote, whichever way (peft merges through ``.data``, which
        moves no version counter), get copies of their own. Costs a read of this rank's page table
        over those masters (``pages.written_spans``)."""
        if self._reads_host_copy:
            self._bind_own_copies(self._wrote)

    @staticmethod
    def _wrote(group: StorageGroup) -> bool:
        """Whether this rank wrote into ``group``'s master, read from the host's copy: its bytes
        differ from the copy's in the pages of it that are this rank's own (the page table). The
        page table alone cannot tell: a page the master shares with a neighbour in the file becomes
        this rank's own when the neighbour is written, the master's bytes in it unchanged (a 128 MB
        weight next to one written in place was taken for written on the GPU). Only those pages
        are compared: a master of inference tensors is asked at every load."""
        start = group.master.data_ptr()
        spans = written_spans(start, start + group.nbytes)
        if spans is None:  # the page table cannot be read: every byte
            spans = [(start, start + group.nbytes)]
        copy = group.read_from
        return any(
            copy is None or not torch.equal(group.master[low - start : high - start], copy[low - start : high - start])
            for low, high in spans
        )

    def _bind_own_copies(self, chosen: Callable[[StorageGroup], bool]) -> None:
        """:meth:`_own_copies` of the ``chosen`` groups, bound (offloaded); then the pages their old
        masters wholly cover in the private mapping are dropped, those of a master that no tensor
        lies in any more: the written ones would hold the same bytes a second time (the rest are
        the host's, mapped again if read). A tensor the swap left where it was (replaced while
        offloaded by one over the same bytes) keeps its master's pages."""
        old = {id(group.master): group.master for group in self._groups}
        groups = self._own_copies(chosen)
        if groups is None:
            return
        self._swap_masters(groups)
        kept = {id(group.master) for group in groups}
        left = sorted(
            (master.data_ptr(), master.data_ptr() + master.numel()) for key, master in old.items() if key not in kept
        )
        starts = [start for start, _ in left]
        still_read = set()
        for tensor in self.tensors():
            index = bisect.bisect_right(starts, tensor.data_ptr()) - 1
            if index >= 0 and tensor.data_ptr() < left[index][1]:
                still_read.add(index)
        for index, (start, end) in enumerate(left):
            if index not in still_read:
                drop_pages(start, end)

    def _own_copies(self, chosen: Callable[[StorageGroup], bool]) -> tuple[StorageGroup, ...] | None:
        """The groups, the ``chosen`` ones among those read from the host's copy over copies of their
        masters in memory of this rank's own (page-locked within the budget), which loads read from
        then on: this rank wrote them, the host's copy, which the other ranks read, must not change,
        and loads from it would not see the write. None if none was chosen. Binds nothing: the
        caller does, as it may (while loaded, the offload binds them)."""
        chosen_indices = [i for i, group in enumerate(self._groups) if group.read_from is not None and chosen(group)]
        if not chosen_indices:
            return None
        groups = list(self._groups)
        copies = pinning.copy_to_host(
            [groups[i].master for i in chosen_indices],
            [groups[i].alignment for i in chosen_indices],
            self.pin_budget or 0,
            pin=self.pin_budget is not None,
        )
        for index, copy in zip(chosen_indices, copies):
            groups[index] = replace(groups[index], master=copy.data, read_from=None, pinned=copy.pinned, pin=copy.pin)
        logger.info("%d masters written by this rank: copied out of the host's shared copy", len(chosen_indices))
        return tuple(groups)


def address_of(mapping: memoryview) -> int:
    """Where a mapping starts in this process."""
    return torch.frombuffer(mapping[:1], dtype=torch.uint8).data_ptr()
