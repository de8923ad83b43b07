"""Host masters and what is bound to them: one master per storage, and each tensor's place in it.

Bookkeeping is per *storage*, not per tensor: two parameters that share a storage (tied embeddings,
views, fused projections sliced into q/k/v) get one master and one device copy, and every tensor
keeps its dtype, shape, stride and storage offset within it. Two masters for one storage would
untie tied weights and let each side go stale on its own.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from . import files, pinning
from .pages import written_spans
from .weights import MergingLayers, Wrappers, module_stored_tensors

logger = logging.getLogger(__name__)


class Owner(Protocol):
    """What the registry of staged tensors needs of a stager."""

    closed: bool


# What a group's tensors are viewed over: a flat byte tensor (a master, a load's storage), or a
# storage of the group's bytes alone (a slice of a load's one buffer, see placement).
Backing = torch.Tensor | torch.UntypedStorage


@dataclass(frozen=True)
class TensorBinding:
    """One tensor's place in its storage: enough to rebuild it over any copy of the storage's bytes."""

    target: torch.Tensor
    inference: bool
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int

    def view_over(self, backing: Backing, into: torch.Tensor | None = None) -> torch.Tensor:
        """This tensor over ``backing``: a flat byte tensor that may start inside its storage, or a
        storage of the group's bytes alone. ``into``: a tensor of this dtype and inference-ness on
        the backing's device to set over it, rather than a new one (unchecked: a load binds with it)."""
        if isinstance(backing, torch.UntypedStorage):
            storage, offset = backing, self.storage_offset
        else:
            storage, offset = backing.untyped_storage(), backing.storage_offset() // self.dtype.itemsize + self.storage_offset
        if into is None:
            into = torch.empty(0, dtype=self.dtype, device=storage.device)
        return into.set_(storage, offset, self.shape, self.stride)


@dataclass(frozen=True)
class StorageGroup:
    """The host master of one storage (a flat byte tensor) and every tensor that lives in it.

    ``mapped_from`` is set for a master that is a view of a memory-mapped checkpoint file rather than
    memory of its own: its pages come from the page cache and can be dropped by the kernel at any time.
    """

    master: torch.Tensor
    bindings: tuple[TensorBinding, ...]
    # The storage's address modulo 64 when it was attached, kept for CPU copies (see _device).
    alignment: int
    mapped_from: files.MappedBytes | None = None
    pinned: bool = False
    # The registration that keeps the master page-locked, when this package made it so (for a master
    # read from the host's copy, that copy's).
    pin: pinning.HostPin | None = None
    # Where loads read the master's bytes, when not from the master: its place in the host's copy
    # that the ranks of a host share, page-locked there (see shared_masters), for as long as this
    # rank has not written the master.
    read_from: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.master.numel()

    @property
    def source(self) -> torch.Tensor:
        """The bytes a load copies."""
        return self.master if self.read_from is None else self.read_from

    @property
    def mapped(self) -> bool:
        return self.mapped_from is not None


# The stager holding masters of each tensor, process-wide: id(tensor) -> (tensor, stager), both
# weakly. Keyed by id because tensors compare element-wise; the tensor reference tells a reused id
# from the same tensor, and drops its entry as the tensor goes (a pipeline deleted while enabled
# never releases its own).
_STAGED_BY: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def _drop_entry(tensor_ref: weakref.ref, key: int) -> None:
    # Only the entry this reference made: the id may be another tensor's already.
    if _STAGED_BY.get(key, (None,))[0] is tensor_ref:
        _STAGED_BY.pop(key, None)


def staged_by(tensor: torch.Tensor) -> Owner | None:
    """The open stager that holds a master of ``tensor``, if any."""
    tensor_ref, stager_ref = _STAGED_BY.get(id(tensor), (None, None))
    stager = stager_ref() if stager_ref is not None else None
    if tensor_ref is None or tensor_ref() is not tensor or stager is None or stager.closed:
        return None
    return stager


def refuse_staged_elsewhere(
    modules: Iterable[nn.Module], what: str, allowed: Collection[Owner] = (), exclude: Iterable[nn.Module] = ()
) -> None:
    """Raise, before anything changes, if a weight is staged by another stager (a script's group on
    a block of a component that a pipeline already stages, say): two stagers rebinding one tensor
    would each undo the other."""
    for tensor in module_stored_tensors(modules, exclude):
        owner = staged_by(tensor)
        if owner is not None and owner not in allowed:
            raise ValueError(
                f"{what} has weights that another staging group already stages (a module enclosing it, or "
                "inside it). Detach that one first (disable_pinned_offload() or detach_staging_hook())."
            )


def claim(owner: Owner, groups: Iterable[StorageGroup]) -> None:
    """Record ``owner`` as the stager holding masters of every tensor bound in ``groups``."""
    me = weakref.ref(owner)
    for group in groups:
        for binding in group.bindings:
            key = id(binding.target)
            _STAGED_BY[key] = (weakref.ref(binding.target, functools.partial(_drop_entry, key=key)), me)


def release(owner: Owner, groups: Iterable[StorageGroup]) -> None:
    """Forget ``owner`` as the stager of the tensors bound in ``groups`` (those it still holds)."""
    for group in groups:
        for binding in group.bindings:
            if staged_by(binding.target) is owner:
                del _STAGED_BY[id(binding.target)]


def _bind_through_scratch(places: Iterable[tuple[TensorBinding, Backing]]) -> None:
    """Bind each binding's tensor to its place over its backing, under the caller's inference mode.

    ``.data =`` takes the storage and layout of the tensor it is given, not that tensor: one scratch
    tensor per dtype, set over each place in turn, binds them all. A view made for each, as the
    masters' are (those are kept, see MasterBindings._master_views), costs an empty device tensor
    apiece, half the host time of binding a load, and a load binds at every step of a streamed block."""
    scratch: dict[torch.dtype, torch.Tensor] = {}
    for binding, backing in places:
        scratch[binding.dtype] = view = binding.view_over(backing, scratch.get(binding.dtype))
        binding.target.data = view


def bound_as_taken(binding: TensorBinding, master: torch.Tensor) -> bool:
    """Whether the binding's tensor is still bound to ``master`` as it was (its place and layout)."""
    tensor = binding.target
    return (
        tensor.data_ptr() == master.data_ptr() + binding.storage_offset * binding.dtype.itemsize
        and tensor.dtype == binding.dtype
        and tensor.shape == binding.shape
        and tensor.stride() == binding.stride
    )


def fills_storage(group: StorageGroup) -> bool:
    """Whether the group's single tensor is contiguous and covers its storage byte for byte."""
    (binding,) = group.bindings
    contiguous = torch.empty(binding.shape, device="meta").stride()
    numel = torch.Size(binding.shape).numel()
    return (
        binding.storage_offset == 0
        and (binding.stride == contiguous or numel <= 1)
        and numel * binding.dtype.itemsize == group.nbytes
    )


# Bound tensors, each with its view over a backing: ordinary tensors, and inference tensors.
Views = tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]


def bound_ids(groups: Iterable[StorageGroup]) -> frozenset[int]:
    """The ids of the tensors bound in ``groups``."""
    return frozenset(id(binding.target) for group in groups for binding in group.bindings)


class MasterBindings:
    """A stager's masters and the tensors bound to them: views over the masters, binding to them
    or to a load's device storage, and the checks that what is bound is what was taken.

    Part of :class:`~.staging.ModuleStager`, which holds the state it reads: ``modules``,
    ``exclude``, ``_groups`` (the current masters), ``_current_bound_ids``, ``_kept_groups`` and
    ``_sources_copy`` (see :mod:`.conversions`), ``_master_views_by``, ``_wrappers``,
    ``_merging`` and ``_loaded_state``; and the methods of its other parts that keep masters apart
    from a copy that ranks share (see :class:`~.host_copy.HostCopyReads`)."""

    modules: tuple[nn.Module, ...]
    exclude: tuple[nn.Module, ...]
    _groups: tuple[StorageGroup, ...]
    _kept_groups: tuple[StorageGroup, ...]
    _sources_copy: tuple[tuple[StorageGroup, ...], tuple[torch.Tensor, ...]] | None
    _master_views_by: dict[int, tuple[tuple[StorageGroup, ...], Views]]
    _wrappers: Wrappers
    _merging: MergingLayers
    _loaded_state: tuple[tuple[TensorBinding, int, int | None], ...]
    _loaded_wrapper_versions: tuple[int | None, ...]
    _loaded_merges: tuple[tuple[str, ...], ...]
    # bound_ids(_groups), made where the masters change.
    _current_bound_ids: frozenset[int]

    def tensors(self) -> Iterator[torch.Tensor]:
        """The plain tensors behind the modules' parameters and buffers that this stager holds
        masters of (see weights.stored_tensors)."""
        return module_stored_tensors(self.modules, self.exclude)

    @property
    def weight_bytes(self) -> int:
        """Unique bytes behind the modules' tensors: what one load moves."""
        return sum(group.nbytes for group in self._groups)

    @property
    def tensor_count(self) -> int:
        return sum(len(group.bindings) for group in self._groups)

    @property
    def pinned(self) -> bool:
        return all(group.pinned for group in self._groups)

    @property
    def loaded_versionless(self) -> bool:
        """Whether some tensor bound by the last load has no version counter (an inference tensor):
        a write into it in place while loaded goes unseen at the offload (see _changed_while_loaded)."""
        return any(version is None for _, _, version in self._loaded_state)

    def masters(self) -> Iterator[torch.Tensor]:
        """Every host master held, those kept from before the last conversion included."""
        for group in self._groups + self._kept_groups:
            yield group.master

    def host_bytes(self) -> dict[str, int]:
        """Master bytes by where they live: ``pinned`` or ``pageable`` memory, or ``mapped`` from a file;
        masters kept from before the last conversion (see :meth:`convert`) included, and the
        pageable copy of the masters a conversion compares with."""
        held = {"pinned": 0, "pageable": 0, "mapped": 0}
        for group in self._groups + self._kept_groups:
            kind = "mapped" if group.mapped else "pinned" if group.pinned else "pageable"
            held[kind] += group.nbytes
        if self._sources_copy is not None:
            held["pageable"] += sum(copy.numel() for copy in self._sources_copy[1])
        return held

    def written_mapped_bytes(self) -> int:
        """Bytes of the masters mapped from checkpoint files that this process wrote since (a weight
        written in place while offloaded): its private copies of those pages, held in RAM."""
        total = 0
        for group in self._groups:
            if group.mapped:
                start = group.master.data_ptr()
                total += sum(end - begin for begin, end in written_spans(start, start + group.nbytes) or ())
        return total

    def _views_over(self, backings: Iterable[Backing]) -> Views:
        """Every bound tensor with its view over its group's backing, ordinary tensors and inference
        tensors apart.

        A view must match its target's inference-ness. Ordinary parameters get ordinary views even
        when the pipeline runs under inference mode: inference tensors would be refused by autograd
        and by in-place updates (LoRA fusing) once the call is over. Tensors that already are
        inference tensors (diffusers' own offload moved them under inference mode) need inference
        views, or their next view or slice fails on a missing version counter."""
        ordinary, inference = [], []
        with torch.inference_mode(False):
            for backing, group in zip(backings, self._groups):
                for binding in group.bindings:
                    if binding.inference:
                        inference.append((binding, backing))
                    else:
                        ordinary.append((binding.target, binding.view_over(backing)))
        if inference:
            with torch.inference_mode():
                inference = [(binding.target, binding.view_over(backing)) for binding, backing in inference]
        return ordinary, inference

    def _assign(self, views: Views, keep: frozenset[int] = frozenset()) -> None:
        ordinary, inference = views
        with torch.inference_mode(False):
            for target, view in ordinary:
                if id(target) not in keep:
                    target.data = view
        if inference:
            with torch.inference_mode():
                for target, view in inference:
                    if id(target) not in keep:
                        target.data = view
        if self._wrappers.tensors:
            self._wrappers.follow()

    def _bind(self, backings: Iterable[Backing]) -> None:
        """Bind every tensor to its place in its group's backing (a load's device storage), each
        with the inference-ness of its views (see :meth:`_views_over`)."""
        places = [(binding, backing) for backing, group in zip(backings, self._groups) for binding in group.bindings]
        with torch.inference_mode(False):
            _bind_through_scratch(place for place in places if not place[0].inference)
        inference = [place for place in places if place[0].inference]
        if inference:
            with torch.inference_mode():
                _bind_through_scratch(inference)
        if self._wrappers.tensors:
            self._wrappers.follow()

    def _master_views(self) -> Views:
        """The views over the masters, made once per set of masters: an offload rebinds every tensor
        (every block that streams, at every step), and making a view costs many times what binding
        one does. Binding shares the view's storage and copies its shape; the view itself is never
        changed, so it serves every offload until the masters change."""
        entry = self._master_views_by.get(id(self._groups))
        if entry is None or entry[0] is not self._groups:
            entry = (self._groups, self._views_over(group.master for group in self._groups))
            # The kept masters' views stay too: a cast and its way back swap the two sets.
            kept = self._master_views_by.get(id(self._kept_groups))
            self._master_views_by = {id(self._groups): entry}
            if kept is not None and kept[0] is self._kept_groups:
                self._master_views_by[id(self._kept_groups)] = kept
        return entry[1]

    def masters_current(self, tensors: list[torch.Tensor] | None = None) -> bool:
        """Whether the modules still hold exactly the tensors the masters were taken for, each with the
        storage, dtype and layout it had then (``tensors``: the modules' tensors, if already listed
        by :meth:`tensors`, each once)."""
        return self._bound_to(self._groups, tensors)

    def _bound_to(self, groups: tuple[StorageGroup, ...], tensors: list[torch.Tensor] | None = None) -> bool:
        """Whether the modules hold exactly the tensors of ``groups``, each over its group's master."""
        if not all(bound_as_taken(binding, group.master) for group in groups for binding in group.bindings):
            return False
        return self._holds_only_bound_tensors(tensors, groups)

    def _holds_only_bound_tensors(
        self, tensors: list[torch.Tensor] | None = None, groups: tuple[StorageGroup, ...] | None = None
    ) -> bool:
        """Whether the modules' tensors are exactly the ones the masters (of ``groups``, else the
        current ones) were taken for (none added, none replaced by another object). ``tensors``, if
        given, lists each once, as :meth:`tensors` does."""
        if groups is None or groups is self._groups:
            bound = self._current_bound_ids
        else:
            bound = bound_ids(groups)
        # Each tensor comes once (see tensors()): all of them bound, and as many, is the same set.
        # Asked at every load of a streamed block: no set of the modules' tensors is built.
        count = 0
        for tensor in self.tensors() if tensors is None else tensors:
            if id(tensor) not in bound:
                return False
            count += 1
        return count == len(bound)

    def _changed_while_loaded(self) -> tuple[frozenset[int], list[torch.Tensor], list[torch.Tensor]]:
        """Tensors given a new dtype, shape or stride since the last load (by id), tensors
        written in place (``load_state_dict``, ``copy_``, an optimizer step: their version
        counters, or their wrapper's, moved), where the load put them or after a move, and tensors
        moved elsewhere with their old layout and no write: diffusers' layerwise casting does that
        to each weight it casts, up and back down at every forward, leaving equal values in new
        storage (see ModuleStager.offload); its ``.data =`` leaves the counter as it was.
        A write through ``.data`` where the load put them is none of these: no counter sees it,
        but for an adapter merged into its base weights, or unmerged, which its layer tells (see
        MergingLayers)."""
        written_unseen = self._wrappers.written_since(self._loaded_wrapper_versions)
        if self._loaded_merges:
            written_unseen |= self._merging.written_since(self._loaded_merges)
        replaced, written, moved = set(), [], []
        for binding, address, version in self._loaded_state:
            target = binding.target
            at_address = target.data_ptr() == address
            if at_address and id(target) not in written_unseen and (version is None or target._version == version):
                continue  # nearly every tensor: untouched
            if (
                target.dtype != binding.dtype
                or tuple(target.shape) != binding.shape
                or tuple(target.stride()) != binding.stride
            ):
                replaced.add(id(target))
            elif (
                at_address
                or id(target) in written_unseen
                or (version is not None and target._version != version)
            ):
                written.append(target)
            else:
                moved.append(target)
        return frozenset(replaced), written, moved

    def _keep_writes(self, written: list[torch.Tensor]) -> frozenset[int]:
        """Copy tensors written in place while loaded back into their masters: the one device-to-host
        copy an offload makes, and only of what changed. Returns those whose master is mapped from a
        file, which is not written: they are kept like replaced tensors and get masters of their own."""
        in_place = {id(target) for target in written}
        # The host's copy that ranks share is never written: those masters get copies of their own first.
        groups = self._own_copies(lambda group: any(id(binding.target) in in_place for binding in group.bindings))
        if groups is not None:
            self._groups = groups
        mapped = {id(b.target) for group in self._groups if group.mapped for b in group.bindings}
        ordinary, inference = self._master_views()
        logger.info("%d tensors were written while loaded; copying them back to their masters", len(written))
        # Inference tensors (moved to storage of their own while loaded: their writes in place are
        # not seen) are written through their inference views, in inference mode.
        for views, mode in ((ordinary, torch.no_grad), (inference, torch.inference_mode)):
            by_target = {id(target): view for target, view in views}
            with mode():
                for target in written:
                    if id(target) in by_target and id(target) not in mapped:
                        by_target[id(target)].copy_(target)
        return frozenset(id(target) for target in written if id(target) in mapped)

    def _swap_masters(self, groups: tuple[StorageGroup, ...]) -> None:
        """Take ``groups`` (the same tensors over other masters) and bind the tensors to them, but
        those replaced since they were bound (``param.data = ...`` while asleep): binding them would
        undo that, and the next load takes masters for them."""
        replaced = frozenset(
            id(binding.target) for group in self._groups for binding in group.bindings if not bound_as_taken(binding, group.master)
        )
        self._groups = groups
        self._assign(self._master_views(), keep=replaced)
