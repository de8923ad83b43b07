"""Stage a module's weights on a device from one host master per storage.

Inference does not write to weights, so a module that leaves the device needs no device-to-host copy:
its parameters and buffers are *rebound* to host masters taken once, at attach time, and the device
copy is simply dropped. Loading allocates device storage, copies each master on a side stream and
rebinds the tensors to the device copy.

Bookkeeping is per *storage*, not per tensor: two parameters that share a storage (tied embeddings,
views, fused projections sliced into q/k/v) get one master and one device copy, and every tensor
keeps its dtype, shape, stride and storage offset within it. Two masters for one storage would
untie tied weights and let each side go stale on its own.
"""

from __future__ import annotations

import bisect
import logging
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import torch
from torch import nn

from . import _device, file_reads, files, pinning
from .retention import RetentionBudget
from .weights import (
    Wrappers,
    flat_bytes,
    module_stored_tensors,
    module_tensors,
    refuse_shared_quantization_state,
    refuse_unstageable_tensors,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Where each storage's copy starts in a load's device buffer: the caching allocator's own rounding
# (see ModuleStager._placed).
_DEVICE_ALIGNMENT = 512
# Masters further apart than this in one page-locked block are copied apart (see ModuleStager._placed).
_MOST_BYTES_COPIED_BETWEEN = 4096

# When a stager lets go of the masters kept from before its last conversion (see
# ModuleStager.convert): at a load, once it has loaded this many times since, and more than twice as
# often as it ever did between two conversions. A component cast and cast back inside each call
# (SDXL's VAE) loads about as often between its casts at every call: once, or once per tile or
# slice, or once per preview decode between calls. One that goes on loading without a cast was cast
# for good, and would hold its old masters (and page-locked memory under the pin budget) forever.
LOADS_KEEPING_CONVERSIONS = 2


@dataclass(frozen=True)
class TensorBinding:
    """One tensor's place in its storage: enough to rebuild it over any copy of the storage's bytes."""

    target: torch.Tensor
    inference: bool
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int

    def view_over(self, backing: torch.Tensor) -> torch.Tensor:
        """This tensor over ``backing``, a flat byte tensor that may start inside its storage."""
        offset = backing.storage_offset() // self.dtype.itemsize + self.storage_offset
        return torch.empty(0, dtype=self.dtype, device=backing.device).set_(
            backing.untyped_storage(), offset, self.shape, self.stride
        )


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
    # The registration that keeps the master page-locked, when this package made it so.
    pin: pinning.HostPin | None = None

    @property
    def nbytes(self) -> int:
        return self.master.numel()

    @property
    def mapped(self) -> bool:
        return self.mapped_from is not None


# The stager holding masters of each tensor, process-wide: id(tensor) -> (tensor, stager), both
# weakly. Keyed by id because tensors compare element-wise; the tensor reference tells a reused id
# from the same tensor.
_STAGED_BY: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def staged_by(tensor: torch.Tensor) -> ModuleStager | None:
    """The open stager that holds a master of ``tensor``, if any."""
    tensor_ref, stager_ref = _STAGED_BY.get(id(tensor), (None, None))
    stager = stager_ref() if stager_ref is not None else None
    if tensor_ref is None or tensor_ref() is not tensor or stager is None or stager.closed:
        return None
    return stager


def refuse_staged_elsewhere(
    modules: Iterable[nn.Module], what: str, allowed: Collection[ModuleStager] = (), exclude: Iterable[nn.Module] = ()
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


def _snapshot(
    tensors: Iterable[torch.Tensor], pin_budget: int | None, previous: tuple[StorageGroup, ...] = ()
) -> tuple[tuple[StorageGroup, ...], bool]:
    """Group every tensor by storage and take one host master per storage; also say whether a host
    storage was copied into a master (its memory goes back to malloc once the tensors are rebound).

    A host storage becomes its own master, page-locked in place when ``pin_budget`` (bytes, None for
    no pinning) allows; a device storage, or a host storage whose pages could not be locked in
    place, is copied once into one host block sized to the copies. Masters of ``previous`` that the
    tensors still live in are kept as they are, registration and alignment included, so a snapshot
    after a small change (a LoRA layer added) copies and pins only what is new.
    """
    # A tensor keeps the inference-ness it had when first staged: one replaced under inference mode
    # (a cast inside a call) is an inference tensor now, and rebinding it so would keep it one.
    was_inference = {id(binding.target): binding.inference for group in previous for binding in group.bindings}
    # Masters that view a checkpoint file (asleep at level 2) are slices of one mapping of the whole
    # file. A tensor in such a mapping goes with the view it lies in, placed within it, rather than
    # being grouped by its storage, the file's, which would take the whole file as one master.
    views_in: dict[int, list[StorageGroup]] = {}
    for group in sorted((group for group in previous if group.mapped), key=lambda group: group.master.data_ptr()):
        views_in.setdefault(group.master.untyped_storage().data_ptr(), []).append(group)
    in_view: dict[tuple, StorageGroup] = {}
    grouped: dict[tuple, tuple[torch.Tensor, list[TensorBinding]]] = {}
    for local in tensors:
        storage = local.untyped_storage()
        view = _view_holding(local, views_in.get(storage.data_ptr(), ())) if views_in else None
        if view is not None:
            key = ("mapped", id(view))
            in_view[key] = view
            offset = (local.data_ptr() - view.master.data_ptr()) // local.element_size()
        else:
            key = (local.device, storage.data_ptr()) if storage.nbytes() else ("empty", id(local))
            offset = local.storage_offset()
        binding = TensorBinding(
            target=local,
            inference=was_inference.get(id(local), local.is_inference()),
            dtype=local.dtype,
            shape=tuple(local.shape),
            stride=tuple(local.stride()),
            storage_offset=offset,
        )
        grouped.setdefault(key, (local, []))[1].append(binding)

    kept = {(group.master.data_ptr(), group.nbytes): group for group in previous if group.master.device.type == "cpu"}
    previous_alignments = {id(binding.target): group.alignment for group in previous for binding in group.bindings}
    wholes, alignments = [], []
    settled: dict[int, StorageGroup] = {}
    for index, (key, (source, bindings)) in enumerate(grouped.items()):
        view = in_view.get(key)
        if view is not None:
            wholes.append(view.master)
            alignments.append(view.alignment)
            settled[index] = replace(view, bindings=tuple(bindings))
            continue
        storage = source.untyped_storage()
        whole = flat_bytes(storage)
        wholes.append(whole.detach())
        alignment = previous_alignments.get(id(bindings[0].target), _device.host_alignment(whole))
        if any(alignment % binding.dtype.itemsize for binding in bindings):
            alignment = _device.host_alignment(whole)
        alignments.append(alignment)
        previous_group = kept.get((whole.data_ptr(), whole.numel())) if whole.device.type == "cpu" else None
        if previous_group is not None:
            settled[index] = replace(previous_group, bindings=tuple(bindings))
    if pin_budget is not None:
        masters = _pinned_masters(wholes, alignments, settled.keys(), pin_budget)
    else:
        # Unpinned (the CPU device): a device storage still gets a host copy, never pinned.
        to_copy = [i for i, w in enumerate(wholes) if i not in settled and w.device.type != "cpu"]
        copies = pinning.copy_to_host([wholes[i] for i in to_copy], [alignments[i] for i in to_copy], 0, pin=False)
        masters = dict(zip(to_copy, copies))

    copied_host = any(
        wholes[i].device.type == "cpu" and master.data.data_ptr() != wholes[i].data_ptr() for i, master in masters.items()
    )
    groups = []
    for index, (source, bindings) in enumerate(grouped.values()):
        if index in settled:
            groups.append(settled[index])
            continue
        whole = wholes[index]
        # An empty storage has no bytes to lock, and must not make the unit look pageable.
        empty_pinned = pin_budget is not None and not whole.numel()
        master = masters.get(index, pinning.HostMaster(whole, None, pinned=empty_pinned))
        groups.append(
            StorageGroup(
                master=master.data,
                bindings=tuple(bindings),
                alignment=alignments[index],
                pinned=master.pinned,
                pin=master.pin,
            )
        )
    return tuple(groups), copied_host


def _view_holding(tensor: torch.Tensor, views: Sequence[StorageGroup]) -> StorageGroup | None:
    """Among ``views`` (groups whose masters view one checkpoint file, by address), the one that holds
    every byte of ``tensor`` at a place its dtype can start at, if any."""
    start = tensor.data_ptr()
    extent = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride())) + 1 if tensor.numel() else 0
    end = start + extent * tensor.element_size()
    # Views of one file do not overlap: only the last one starting at or before the tensor can hold it.
    index = bisect.bisect_right(views, start, key=lambda group: group.master.data_ptr()) - 1
    if index < 0:
        return None
    group = views[index]
    first = group.master.data_ptr()
    return group if end <= first + group.nbytes and (start - first) % tensor.element_size() == 0 else None


def _over(binding: TensorBinding, master: torch.Tensor) -> bool:
    """Whether the binding's tensor is still bound to ``master`` as it was (its place and layout)."""
    tensor = binding.target
    return (
        tensor.data_ptr() == master.data_ptr() + binding.storage_offset * binding.dtype.itemsize
        and tensor.dtype == binding.dtype
        and tensor.shape == binding.shape
        and tensor.stride() == binding.stride
    )


def _pinned_masters(
    wholes: list[torch.Tensor], alignments: list[int], settled: Iterable[int], pin_budget: int
) -> dict[int, pinning.HostMaster]:
    """Masters for the storages not ``settled`` yet: large host ones locked in place, the rest copied
    into one pinned block while the budget lasts; what the budget cannot hold stays (or becomes)
    pageable."""
    settled = set(settled)
    on_host = [i for i, w in enumerate(wholes) if i not in settled and w.device.type == "cpu" and w.numel()]
    in_place = [i for i, owned in zip(on_host, pinning.owns_its_pages([wholes[i] for i in on_host])) if owned]
    masters = dict(zip(in_place, pinning.pin_in_place([wholes[i] for i in in_place], pin_budget)))
    unpinned_host = [i for i in on_host if i not in masters or not masters[i].pinned]
    on_device = [i for i, w in enumerate(wholes) if i not in settled and w.device.type != "cpu"]
    to_copy = unpinned_host + on_device
    room = pin_budget - pinning.locked_bytes()
    _, block = pinning.block_bytes([wholes[i].numel() for i in to_copy], [alignments[i] for i in to_copy])
    if unpinned_host and (block > room or not _device.can_register_host_memory()):
        # Copying host memory that cannot be pinned in place only pays if the copy gets pinned.
        to_copy = on_device
    sources, source_alignments = [wholes[i] for i in to_copy], [alignments[i] for i in to_copy]
    copies = pinning.copy_to_host(sources, source_alignments, pin_budget, pin=True)
    masters.update(zip(to_copy, copies))
    return masters


# Bound tensors, each with its view over a backing: ordinary tensors, and inference tensors.
_Views = tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]


class DeviceSlots:
    """Device storages that one component's streamed blocks load into, handed from the block dropped
    to the block loading next.

    Left to the caching allocator, a dropped block's storages go back to its cache while the block
    that computes allocates its activations, which split those cached blocks to serve their own,
    smaller requests; the next block's weights then find no free block of their size, and the
    allocator reserves new segments. Under a VRAM budget that memory is room the activation reserve
    has to cover instead of resident blocks (docs/benchmarks.md has the reserved and allocated
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


def _fills_storage(group: StorageGroup) -> bool:
    """Whether the group's single tensor is contiguous and covers its storage byte for byte."""
    (binding,) = group.bindings
    contiguous = torch.empty(binding.shape, device="meta").stride()
    numel = torch.Size(binding.shape).numel()
    return (
        binding.storage_offset == 0
        and (binding.stride == contiguous or numel <= 1)
        and numel * binding.dtype.itemsize == group.nbytes
    )


# Integer dtypes by item size, widest first: comparing tensors through them compares bits, not
# values (0.0 and -0.0 differ, a NaN equals itself).
_BITS_BY_ITEMSIZE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _as_bits(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors (of one dtype and layout) as integers of their bits: for contiguous ones, the
    widest integers that tile all their bytes. ``torch.equal`` on the host takes about as long per
    element whatever its width, so float16 weights compared as 8-byte words take a quarter of the
    time they take as 2-byte ones (SDXL's VAE casts compare 0.5 GB at each call)."""
    if all(t.is_contiguous() for t in tensors):
        flat = [t.reshape(-1).view(torch.uint8) for t in tensors]
        for size, bits in _BITS_BY_ITEMSIZE.items():
            if all(f.numel() % size == 0 and f.storage_offset() % size == 0 for f in flat):
                return tuple(f.view(bits) for f in flat)
    bits = _BITS_BY_ITEMSIZE[tensors[0].dtype.itemsize]
    return tuple(t.view(bits) for t in tensors)


def _same_bits(kept: torch.Tensor, fresh: torch.Tensor) -> bool:
    """Whether ``kept`` can stand for ``fresh``: same dtype and layout, and the same bits throughout."""
    if kept.dtype != fresh.dtype or kept.shape != fresh.shape or kept.stride() != fresh.stride():
        return False
    if kept.dtype.itemsize not in _BITS_BY_ITEMSIZE:
        return False
    return torch.equal(*_as_bits(kept, fresh))


def _conversion_key(source: torch.Tensor, dtype: torch.dtype) -> tuple:
    """Where a converted tensor came from (its bytes' address and layout), and the dtype it went to."""
    return (source.data_ptr(), source.dtype, tuple(source.shape), source.stride(), dtype)


class ModuleStager:
    """Load a module (or a group of modules) onto a device on demand, from immutable host masters.

    ``load()`` allocates device storage on the compute stream (or takes it from :class:`DeviceSlots`),
    copies every master on the copy stream and makes the compute stream wait for it: the host does not
    wait for the copy. ``offload()`` rebinds every tensor to its master and drops the device storage
    (or gives it to the slots): no device-to-host copy and no host allocation.
    Out of memory on load releases the retained allocator cache and retries once. Whatever fails,
    every tensor is left bound to valid storage: the device copy if the load completed, else the master.
    """

    def __init__(
        self,
        modules: nn.Module | Iterable[nn.Module],
        device: torch.device,
        *,
        pin_memory: bool,
        pin_budget: int | float | None = None,
        copy_stream: torch.Stream | None = None,
        retention: RetentionBudget | None = None,
        exclude: Iterable[nn.Module] = (),
        one_buffer: bool | Callable[[], bool] = True,
    ) -> None:
        self.modules = (modules,) if isinstance(modules, nn.Module) else tuple(modules)
        if not self.modules or not all(isinstance(m, nn.Module) for m in self.modules):
            raise TypeError("ModuleStager needs at least one nn.Module")
        # Submodules whose tensors are not this stager's (blocks streamed by stagers of their own).
        self.exclude = tuple(exclude)
        refuse_unstageable_tensors(self.modules, "The module")
        refuse_shared_quantization_state(self.modules)
        refuse_staged_elsewhere(self.modules, "The module", exclude=self.exclude)
        self.closed = False
        self.device = device
        self.pin_memory = pin_memory
        # Bytes this process may keep page-locked when this stager pins a master; None: never pin.
        self.pin_budget = pinning.resolve_pin_budget(pin_budget) if pin_memory else None
        self.retention = retention
        # Whether a load may take one device buffer for all its storages (see _placed): asked at
        # each load, for what may change between two (diffusers' layerwise casting enabled late).
        self._one_buffer_wanted = one_buffer if callable(one_buffer) else lambda: one_buffer
        # What the last load did.
        self.one_buffer = self._one_buffer_wanted()
        self.loaded = False
        self.loads = 0
        # Moved by all timed loads (all but those that read their masters back from files), a figure
        # that survives retakes.
        self.loaded_bytes = 0
        # Device storage of a load, one per group: held from allocation on, so a failure path can
        # synchronise before dropping it, and, for a load into DeviceSlots, while loaded, so that
        # the offload can hand it to the next block's load.
        self._device_storages: list[torch.Tensor] = []
        # Each tensor's binding, the address the last load bound it to and its version counter then
        # (None for an inference tensor, which has none), and the wrappers' counters: at offload, a
        # tensor with a new layout was replaced while loaded, and one where the load put it whose
        # counter (or its wrapper's) moved was written in place.
        self._loaded_state: tuple[tuple[TensorBinding, int, int | None], ...] = ()
        self._loaded_wrapper_versions: tuple[int | None, ...] = ()
        self._copy = _device.TimedCopy(device, copy_stream)
        # A read-back of masters mapped from files, with the groups it reads: started when a load
        # copied them from the files (see read_ahead), taken by the next load, by a forward or an
        # offload once done, or waited for by unmap_masters.
        self._reading_ahead: tuple[tuple[StorageGroup, ...], file_reads.ReadBack] | None = None
        # Whether a load from masters mapped from files starts reading them back as soon as its
        # copies are done; a wake sets it False while it loads, and reads them back after.
        self.reads_back_after_loading = True
        # Where each group's copy goes in a load's buffer, the buffer's size, and the copies that
        # fill it (see _placed), for a layout and the masters' addresses.
        self._placement: tuple[tuple, tuple[int, ...], int, tuple[tuple[int, int], ...]] = ((), (), 0, ())
        # The views over the current and the kept masters, each with the groups it was made for, by
        # id of those (see _master_views).
        self._master_views_by: dict[int, tuple[tuple[StorageGroup, ...], _Views]] = {}
        self._groups, copied_host = _snapshot(self.tensors(), self.pin_budget)
        # Wrapper subclasses (quantized weights) whose device follows their bound inner tensors.
        self._wrappers = Wrappers.among(module_tensors(self.modules, self.exclude))
        # Masters the last conversion (see convert()) left, and a view of each tensor it converted,
        # on both sides, by where it came from: the way back finds its master among them.
        self._kept_groups: tuple[StorageGroup, ...] = ()
        self._kept_conversions: dict[tuple, torch.Tensor] = {}
        self._loads_at_conversion: int | None = None
        self._most_loads_between_conversions = 0
        self._claim_tensors()
        self.rebind_masters()
        if copied_host:  # their originals were freed by the rebinding just done
            _device.release_freed_host_heap()
        if retention is not None:
            retention.grow(self.staged_bytes)

    @property
    def _groups(self) -> tuple[StorageGroup, ...]:
        return self._current_groups

    @_groups.setter
    def _groups(self, groups: tuple[StorageGroup, ...]) -> None:
        self._current_groups = groups
        # Whether a load has masters to read back from files: found here, where the masters change,
        # and not at every load (a streamed block loads at every step).
        self._maps_files = any(group.mapped for group in groups)
        # A read of masters that are no longer the current ones (taken again after a cast) would
        # hold its memory, unused, until the next load: stopped here, where the masters change.
        if self._reading_ahead is not None and self._reading_ahead[0] is not groups:
            self.drop_read_ahead()

    @property
    def maps_files(self) -> bool:
        """Whether some masters are views of checkpoint files (see :meth:`map_masters`)."""
        return self._maps_files

    def tensors(self) -> Iterator[torch.Tensor]:
        """The plain tensors behind the modules' parameters and buffers that this stager holds
        masters of (see weights.stored_tensors)."""
        return module_stored_tensors(self.modules, self.exclude)

    @property
    def staged_bytes(self) -> int:
        """Unique bytes behind the modules' tensors: what one load moves."""
        return sum(group.nbytes for group in self._groups)

    @property
    def tensor_count(self) -> int:
        return sum(len(group.bindings) for group in self._groups)

    @property
    def load_seconds(self) -> float:
        return self._copy.seconds

    @property
    def pinned(self) -> bool:
        return all(group.pinned for group in self._groups)

    def host_bytes(self) -> dict[str, int]:
        """Master bytes by where they live: ``pinned`` or ``pageable`` memory, or ``mapped`` from a file;
        masters kept from before the last conversion (see :meth:`convert`) included."""
        held = {"pinned": 0, "pageable": 0, "mapped": 0}
        for group in self._groups + self._kept_groups:
            kind = "mapped" if group.mapped else "pinned" if group.pinned else "pageable"
            held[kind] += group.nbytes
        return held

    def _views_over(self, backings: Iterable[torch.Tensor]) -> _Views:
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

    def _assign(self, views: _Views, keep: frozenset[int] = frozenset()) -> None:
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

    def _bind(self, backings: Iterable[torch.Tensor]) -> None:
        self._assign(self._views_over(backings))

    def _master_views(self) -> _Views:
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

    def rebind_masters(self) -> None:
        """Bind every tensor to its master, whatever it is bound to now (after a failed move)."""
        self._assign(self._master_views())
        self._device_storages = []
        self._loaded_state, self._loaded_wrapper_versions = (), ()
        self.loaded = False

    def _layout(self) -> tuple:
        """What device storage this stager's loads need: equal layouts can share :class:`DeviceSlots`."""
        if _device.is_accelerator(self.device):
            return tuple(group.nbytes for group in self._groups)
        # On the CPU the copy's alignment is part of its place (see _device.allocate_device_storage).
        return tuple((group.nbytes, group.alignment) for group in self._groups)

    def _placed(
        self, groups: tuple[StorageGroup, ...] | None = None, locked_in: list[object | None] | None = None
    ) -> tuple[tuple[int, ...], int, tuple[tuple[int, int], ...]]:
        """Where each group's copy starts in the one device buffer a load allocates (``one_buffer``),
        the buffer's size, and the copies that fill it: ranges of groups ``(first, last)``, each
        one host-to-device copy.

        One allocation per load rather than one per storage: the caching allocator gives a storage
        of 10 MB or more a segment of its own, and releasing its cache then frees each with a
        ``cudaFree`` of its own (about 70 us each on the H200 machine: most of a level-1 sleep of a
        pipeline with 700 such weights); every allocation is host time in the load, too. Each copy
        still gets a storage of its own (see :meth:`_copy_to_device`), starting on the allocator's
        512-byte rounding, so kernels see the alignment a storage allocated alone would have; on
        the CPU at its master's address modulo 64 (see _device.allocate_device_storage).

        Masters side by side in one page-locked block (see pinning.copy_to_host: each starts on
        the same 512-byte rounding; ``locked_in`` names each one's registration, or the piece of a
        read-back it arrives in, for ``groups`` other than the current ones) keep their distances
        in the buffer, and go in one copy: SDXL's 2643 storages, copied one by one, moved below the
        bus's rate on the H200 machine, and its four blocks, in four copies, at it. The bytes
        between two such masters (under a page; padding of the block) are copied too, into padding
        of the buffer.

        Blocks of a component load one allocation per storage instead (the group makes their
        stagers so): under a VRAM budget their storages come and go while activations come and go
        too, and a buffer of a whole block (hundreds of MB for FLUX.1-dev's) needs a free range that
        size. At 16 GB, FLUX.1-dev's transformer then ran out of room under the cap and retried
        where storages of their own fit (docs/benchmarks.md). So do units under diffusers' layerwise
        casting (see StagedUnit.load), and every device but the CPU and CUDA (see
        _device.slices_storages)."""
        groups = self._groups if groups is None else groups
        layout = self._layout()
        addresses = tuple(group.master.data_ptr() for group in groups)
        if self._placement[0] != (layout, addresses):
            accelerated = _device.is_accelerator(self.device)

            def start_at_or_after(end: int, group: StorageGroup) -> int:
                if accelerated:
                    return -(-end // _DEVICE_ALIGNMENT) * _DEVICE_ALIGNMENT
                return end + (group.alignment - end) % _device.CPU_ALIGNMENT

            # Keyed by addresses alone: a read-back's pieces (see _copy_to_device) become the
            # registrations of the same ranges, or stay pageable, where a copy may span groups too.
            locked_in = [group.pin for group in groups] if locked_in is None else locked_in
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
            # Keyed by sizes and addresses, not the groups: holding those would keep masters let go alive.
            self._placement = ((layout, addresses), tuple(offsets), end, tuple((a, b) for a, b in runs))
        return self._placement[1:]

    def read_ahead(self) -> None:
        """Start reading the masters mapped from checkpoint files back into memory of their own, in
        the background, for the next load, offload or :meth:`unmap_masters` to take. A no-op when
        none are mapped or a read is under way.

        A load copies masters mapped from files straight to the device (see
        file_reads.copy_from_files) and leaves them mapped: a wake takes the files' bytes to the
        device first and reads the masters back after, rather than reading them all before the
        first copy. Until then a level-1 sleep or an eviction would have nothing but the page cache
        to rebind to, hence the read here."""
        if self._reading_ahead is None and self._maps_files:
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

    def _copy_to_device(self, slots: DeviceSlots | None, reading: file_reads.ReadBack | None) -> list[torch.Tensor]:
        """Allocate the device storage, queue the copies into it and return a storage per group to
        bind; with ``reading``, each copy from a master being read back waits for its piece, and the
        groups take the masters read back once all are queued; without, masters mapped from files
        are copied from the files (see file_reads.copy_from_files) and stay mapped."""
        groups, locked_in, arriving = self._groups, None, None
        from_files = [i for i, group in enumerate(groups) if group.mapped] if reading is None and self._maps_files else []
        if reading is not None:
            # Each group's place in the read-back, if it has one: its copy waits for that piece.
            arriving = [None] * len(groups)
            locked_in = [group.pin for group in groups]
            for read, index in enumerate(i for i, group in enumerate(groups) if group.mapped):
                locked_in[index], arriving[index] = reading.piece_of[read], read
            groups = tuple(
                group if read is None else replace(group, master=reading.slots[read], mapped_from=None)
                for group, read in zip(groups, arriving)
            )
        one_buffer = self.one_buffer and _device.slices_storages(self.device)
        offsets, total, runs = self._placed(groups, locked_in) if one_buffer else ((), 0, ())
        with torch.inference_mode(False):
            storages = slots.take(self._layout()) if slots is not None else None
            if storages is None and one_buffer:
                storages = [_device.allocate_device_storage(total, self.device, alignment=0)]
            elif storages is None:
                storages = [_device.allocate_device_storage(g.nbytes, self.device, alignment=g.alignment) for g in groups]
            self._device_storages = storages
            # A load from the files is not timed: its time is the files' read, not the bus's, and
            # the load rate feeds the plan of streamed components (see StepTiming).
            with self._copy.running(timed=reading is None and not from_files):
                if one_buffer:
                    (buffer,) = storages
                    for first, last in runs:
                        if from_files and groups[first].mapped:
                            continue  # a run of its own (see _placed), copied from the files below
                        if arriving is not None and arriving[first] is not None:
                            reading.wait_for(arriving[first])
                        begin, end = offsets[first], offsets[last] + groups[last].nbytes
                        master = groups[first].master
                        source = master if first == last else pinning.host_span(master.data_ptr(), end - begin)
                        buffer[begin:end].copy_(source, non_blocking=self.pin_memory)
                else:
                    for index, (storage, group) in enumerate(zip(storages, groups)):
                        if from_files and group.mapped:
                            continue  # copied from the files below
                        if arriving is not None and arriving[index] is not None:
                            reading.wait_for(arriving[index])
                        storage.copy_(group.master, non_blocking=self.pin_memory)
                if from_files:
                    file_reads.copy_from_files(
                        [groups[i].mapped_from for i in from_files],
                        [buffer[offsets[i] : offsets[i] + groups[i].nbytes] if one_buffer else storages[i] for i in from_files],
                        self.pin_budget or 0,
                        pin=self.pin_budget is not None,
                        device=self.device,
                    )
            if reading is not None:
                masters = reading.finish()
                self._groups = tuple(
                    group if read is None else replace(group, pinned=masters[read].pinned, pin=masters[read].pin)
                    for group, read in zip(groups, arriving)
                )
            if not one_buffer:
                return storages
            # A slice of an untyped storage is a storage of its own over those bytes that holds a
            # reference to the whole: each weight keeps a storage of its own, as it had on the host
            # (safetensors refuses to save tensors that share one, and a later snapshot groups by
            # storage), and the buffer lives until the last of them is let go. Made once the copies
            # are queued: host time they hide.
            whole, start = buffer.untyped_storage(), buffer.storage_offset()
            return [flat_bytes(whole[start + at : start + at + group.nbytes]) for at, group in zip(offsets, groups)]

    def _load_once(self, slots: DeviceSlots | None) -> None:
        if self.loads and not self._maps_files and self._reading_ahead is None:
            # The masters were current at the last load, and nearly always still are: the copies
            # are queued first, and the modules are checked while the device runs them. Checked
            # before, SDXL's UNet spent 12 ms on the host (its 1680 tensors walked and compared,
            # its 1930 modules searched for layerwise casting) before its first byte moved: the
            # 1.10x of its wake over the bus's bound on the H200 machine. A change found after
            # (a parameter replaced while offloaded, layerwise casting enabled) throws the copy
            # away and loads again. Masters read back or mapped from files are checked before:
            # the load itself changes them.
            try:
                backings = self._copy_to_device(slots, None)
                current = self.one_buffer == self._one_buffer_wanted() and self.masters_current()
            except BaseException:
                # Nothing is bound to the copies yet, but a weight replaced while offloaded has no
                # master yet either: the failed load's fallback (see _load) rebinds every tensor to
                # its master, and would put the old weight back.
                self.retake_masters()
                raise
            if current:
                self._bind_loaded(backings, slots, timed=True, from_files=False)
                return
            logger.debug("Modules changed since their last load: copying again")
            self._copy.join()  # the storage's next user waits for the copy into it
            self._device_storages = []
            self.loaded_bytes += self.staged_bytes  # moved all the same: the load rate counts it
            del backings
        self.retake_masters()
        self.one_buffer = self._one_buffer_wanted()
        reading = self._read_back()
        from_files = reading is None and self._maps_files
        try:
            backings = self._copy_to_device(slots, reading)
        except BaseException:
            if reading is not None:
                try:
                    _device.synchronize(self.device)  # the copies queued so far read pieces about to be unlocked
                except Exception:
                    # A device that cannot be waited for has failed; its copies will not read again.
                    logger.debug("Device synchronisation failed before unlocking masters read back", exc_info=True)
                finally:
                    reading.abandon()
            raise
        self._bind_loaded(backings, slots, timed=reading is None and not from_files, from_files=from_files)

    def _bind_loaded(
        self, backings: list[torch.Tensor], slots: DeviceSlots | None, *, timed: bool, from_files: bool
    ) -> None:
        """Bind the modules' tensors to the storage a load's copies were queued into."""
        self._bind(backings)
        if slots is None:
            # From here on the bound views keep the buffer alive, and let it go once they have all
            # moved to storage of their own (layerwise casting does, at every forward). A buffer to
            # be handed to the next block is held here instead, at most a window of blocks' worth.
            self._device_storages = []
        self._loaded_state = tuple(
            (b, b.target.data_ptr(), None if b.inference else b.target._version)
            for g in self._groups
            for b in g.bindings
        )
        self._loaded_wrapper_versions = self._wrappers.versions() if self._wrappers.tensors else ()
        self.loaded = True
        self.loads += 1
        if timed:
            self.loaded_bytes += self.staged_bytes
        if from_files and self.reads_back_after_loading:
            try:
                self.read_ahead()
            except Exception:
                # The load stands: the masters stay mapped, and the offload checks their files.
                logger.warning("Could not start reading masters back from their checkpoint files", exc_info=True)

    def _fall_back_to_masters(self) -> None:
        """After a failure: wait for in-flight copies into the storage about to be dropped, rebind the
        masters, and give the allocator's cache back so a retry (or the next component) finds room."""
        try:
            _device.synchronize(self.device)
        except Exception:
            logger.debug("Device synchronisation failed while restoring host masters", exc_info=True)
        self.rebind_masters()
        if self.retention is not None:
            self.retention.release(reason="failed-load")
        else:
            _device.empty_cache(self.device)

    def load(self, *, ahead: bool = False, slots: DeviceSlots | None = None) -> None:
        """Bring the weights onto the device, into storage from ``slots`` when it has some of their
        layout; a no-op when they are there (the compute stream then waits for them, unless
        ``ahead``: loaded before they are needed, :meth:`ready` is called where they are).

        Weights replaced or added while offloaded (a LoRA adapter injected, projections fused, a
        submodule cast) get masters first (see :meth:`retake_masters`); masters of unchanged
        storages are reused as they are, so that copies only what is new."""
        if self.loaded:
            if not ahead:
                self.ready()
            return
        if self._kept_groups and self._loads_since_conversion() >= max(
            LOADS_KEEPING_CONVERSIONS, 2 * self._most_loads_between_conversions + 1
        ):
            # No copy still reads the kept masters: the last one that did was queued before the
            # conversion, and the first load after it waited for that copy to end (TimedCopy.running
            # collects the previous copy before queueing the next).
            self.forget_conversions()
        self._load(ahead, slots)

    def ready(self) -> None:
        """Make the compute stream wait for the last load's copy (on the device, not the host). Called
        before every forward of a loaded unit, which also takes masters read back since it was
        loaded from the files, once that read is done (see :meth:`_settle_mapped_masters`)."""
        if self._reading_ahead is not None and self._reading_ahead[1].done():
            self._settle_mapped_masters()
        self._copy.join()

    def _load(self, ahead: bool, slots: DeviceSlots | None) -> None:
        try:
            self._load_once(slots)
        except torch.OutOfMemoryError:
            logger.info(
                "Out of memory staging %d bytes on %s; releasing the retained cache and retrying once",
                self.staged_bytes,
                self.device,
            )
            self._fall_back_to_masters()
            try:
                self._load_once(slots)
            except BaseException:
                self._fall_back_to_masters()
                raise
        except BaseException:
            self._fall_back_to_masters()
            raise
        if not ahead:
            self.ready()

    def offload(self, *, slots: DeviceSlots | None = None) -> None:
        """Rebind every tensor to its host master and drop the device copy, or give its storage to
        ``slots``; a tensor replaced while loaded keeps its new value and gets a master of its own.

        No synchronisation is needed: the device storage was allocated on the compute stream, so the
        allocator hands its blocks only to later work on that stream, which runs after the reads
        already queued there; a copy into storage from ``slots`` first waits for that compute.
        """
        if not self.loaded:
            return
        # A copy made ahead and never used: order it before the compute work that may get its
        # storage next.
        self.ready()
        if self._maps_files:
            self._settle_mapped_masters()
        replaced, written = self._changed_while_loaded()
        if written:
            replaced |= self._keep_writes(written)
        storages, self._device_storages = self._device_storages, []
        if not replaced:
            self.rebind_masters()
            # Only storage that none of the modules' tensors still reaches is handed on: a parameter
            # replaced while loaded by one over the same storage (``nn.Parameter(w.detach())``)
            # would get the next block's weights copied into it.
            # Just rebound, every bound tensor is on its master: only their identity is left to check.
            if slots is not None and storages and self._holds_only_bound_tensors():
                slots.give(self._layout(), storages)
            return
        # Tensors replaced while loaded (layers cast to a storage dtype, weights assigned through
        # `.data`) are the module's weights now, and rebinding them to their masters would undo
        # that: keep them, bind the rest, and take masters for them (a copy of those alone).
        logger.info("%d tensors were replaced while loaded; taking masters for them", len(replaced))
        self._assign(self._master_views(), keep=replaced)
        self._loaded_state, self._loaded_wrapper_versions = (), ()
        self.loaded = False
        self.retake_masters()

    def mapped_files(self) -> list[files.OpenFile]:
        """The checkpoint files that masters are mapped from."""
        return files.files_of(group.mapped_from for group in self._groups if group.mapped)

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

    def _changed_while_loaded(self) -> tuple[frozenset[int], list[torch.Tensor]]:
        """Tensors given a new dtype, shape or stride since the last load (by id), and tensors
        written in place where the load put them (``load_state_dict``, ``copy_``, an optimizer step:
        their version counters, or their wrapper's, moved).

        A tensor elsewhere with its old layout is neither: diffusers' layerwise casting casts each
        weight up and back down at every forward, leaving equal values in new storage, which the
        masters still hold. Nor is a write through ``.data``, which no counter sees."""
        in_written_wrappers = self._wrappers.written_since(self._loaded_wrapper_versions)
        replaced, written = set(), []
        for binding, address, version in self._loaded_state:
            target = binding.target
            at_address = target.data_ptr() == address
            if at_address and id(target) not in in_written_wrappers and (version is None or target._version == version):
                continue  # nearly every tensor: untouched
            if (
                target.dtype != binding.dtype
                or tuple(target.shape) != binding.shape
                or tuple(target.stride()) != binding.stride
            ):
                replaced.add(id(target))
            elif at_address:
                written.append(target)
        return frozenset(replaced), written

    def _keep_writes(self, written: list[torch.Tensor]) -> frozenset[int]:
        """Copy tensors written in place while loaded back into their masters: the one device-to-host
        copy an offload makes, and only of what changed. Returns those whose master is mapped from a
        file, which is not written: they are kept like replaced tensors and get masters of their own."""
        mapped = {id(b.target) for group in self._groups if group.mapped for b in group.bindings}
        ordinary, _ = self._master_views()
        views = {id(target): view for target, view in ordinary}
        logger.info("%d tensors were written in place while loaded; copying them back to their masters", len(written))
        with torch.no_grad():
            for target in written:
                if id(target) not in mapped:
                    views[id(target)].copy_(target)
        return frozenset(id(target) for target in written if id(target) in mapped)

    def offload_for_writing(self) -> None:
        """Offload, and wait until no copy still reads the masters: they are about to be written."""
        self.offload()
        self._copy.wait()

    def masters_current(self, tensors: list[torch.Tensor] | None = None) -> bool:
        """Whether the modules still hold exactly the tensors the masters were taken for, each with the
        storage, dtype and layout it had then (``tensors``: the modules' tensors, if already listed)."""
        return self._bound_to(self._groups, tensors)

    def _bound_to(self, groups: tuple[StorageGroup, ...], tensors: list[torch.Tensor] | None = None) -> bool:
        """Whether the modules hold exactly the tensors of ``groups``, each over its group's master."""
        if not all(_over(binding, group.master) for group in groups for binding in group.bindings):
            return False
        return self._holds_only_bound_tensors(tensors, groups)

    def _holds_only_bound_tensors(
        self, tensors: list[torch.Tensor] | None = None, groups: tuple[StorageGroup, ...] | None = None
    ) -> bool:
        """Whether the modules' tensors are exactly the ones the masters (of ``groups``, else the
        current ones) were taken for (none added, none replaced by another object)."""
        groups = self._groups if groups is None else groups
        bound = {id(binding.target) for group in groups for binding in group.bindings}
        return bound == {id(t) for t in (self.tensors() if tensors is None else tensors)}

    def retake_masters(self) -> None:
        """Take new masters after the modules' tensors were replaced (a dtype cast such as SDXL's VAE
        upcast, a device move, new parameters). Expects the stager offloaded; a no-op if nothing changed.
        Storages still on their masters keep them, page-locked as they were."""
        let_go = self._retake()
        if let_go:
            self._wait_before_letting_go(let_go)

    def _wait_before_letting_go(self, groups: tuple[StorageGroup, ...]) -> None:
        # The last load may still be copying from these masters, and letting them go may unlock and
        # free them. (Held by ``groups`` until this returns.)
        self._copy.wait()

    def _retake(self) -> tuple[StorageGroup, ...]:
        """:meth:`retake_masters`, returning the groups whose masters it let go, for the caller to
        wait for copies still reading them (see :meth:`_wait_before_letting_go`) before dropping them."""
        self._require_offloaded("retake_masters()")
        tensors = list(self.tensors())  # walked once: a cast retakes the masters of every block
        if self.masters_current(tensors):
            return ()
        if any(t.is_meta for t in tensors):
            refuse_unstageable_tensors(self.modules, "The module")
        old = self._groups
        before = self.staged_bytes
        self._groups, copied_host = _snapshot(tensors, self.pin_budget, self._groups + self._kept_groups)
        self._wrappers = Wrappers.among(module_tensors(self.modules, self.exclude))
        active = {id(group.master) for group in self._groups}
        self._kept_groups = tuple(group for group in self._kept_groups if id(group.master) not in active)
        try:
            self._claim_tensors()
            self.rebind_masters()
            if copied_host:
                # A trim walks all of malloc's heap (milliseconds): only when copies into masters
                # freed the originals. (Conversion results dropped for kept masters leave holes too,
                # of the same sizes at every call, which the next call's conversions fill.)
                _device.release_freed_host_heap()
            if self.retention is not None:
                self.retention.resize(before, self.staged_bytes)
        except BaseException:
            # The old masters go with ``old`` when this raises, and the last load may still be
            # copying from them: the same wait as for masters let go on success.
            self._wait_before_letting_go(old)
            raise
        logger.debug("Retook host masters: %d -> %d bytes", before, self.staged_bytes)
        return tuple(group for group in old if id(group.master) not in active)

    def convert(
        self, apply: Callable[[Callable[[torch.Tensor], torch.Tensor]], T], fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> T:
        """Run a conversion of the modules (``apply``: ``nn.Module._apply``, ``fn``: what ``.to(dtype)``
        or ``.half()`` gives it) over the masters, and take its results as the new masters.

        Pipelines cast a component and back inside every call: SDXL upcasts its VAE to float32 to
        decode and casts it back to float16. Taking every result as a new master page-locked fresh
        host memory twice a call, at about 0.5 s per GiB on the H200 machine. So the masters from
        before the last conversion are kept, and a result with the same bits as one of them (the
        float16 weights, on the way back) is bound to it instead. Each result is still computed and
        compared, never assumed: a master written in place since (a LoRA fused into it) fails the
        comparison, and the fresh result is taken.
        """
        self.offload()
        before = self._groups
        # Masters that view a checkpoint file (asleep at level 2) are slices of the file's mapping,
        # not storages of their own: bound to one, the weights would keep the file as their master.
        own = {id(b.target): (b, group.master) for group in before if not group.mapped for b in group.bindings}
        # (where the source was bound, its master, the tensor that takes the result)
        converted: list[tuple[TensorBinding, torch.Tensor, torch.Tensor]] = []

        def reusing(tensor: torch.Tensor) -> torch.Tensor:
            result = fn(tensor)
            bound = own.get(id(tensor))
            if bound is None or not isinstance(result, torch.Tensor) or result is tensor or result.device.type != "cpu":
                # Not a host copy of one of this stager's tensors: a block's (staged on its own), a
                # DTensor (its shard is what is bound), a mapped master's, a tensor the conversion
                # left as it was, or one it moved to a device. Taken by retake_masters as it comes.
                return result
            kept = self._kept_conversions.get(_conversion_key(tensor, result.dtype))
            if kept is not None and _same_bits(kept, result):
                result = kept
            # The module keeps a parameter and takes its new data; a buffer is replaced.
            converted.append((*bound, tensor if isinstance(tensor, nn.Parameter) else result))
            return result

        kept_before = self._kept_groups
        result = apply(reusing)
        if converted and self._kept_groups and self._bound_to(self._kept_groups, list(self.tensors())):
            self._swap_kept_masters()
            return result
        let_go = self._retake()
        if not converted:
            # Nothing to keep from this one (a cast to the dtype it has): what was kept stands.
            if let_go:
                self._wait_before_letting_go(let_go)
            return result
        bound = {id(b.target): (b, group.master) for group in self._groups for b in group.bindings}
        kept_conversions = {}
        with torch.inference_mode(False):
            for source_binding, source_master, target in converted:
                if id(target) not in bound:
                    continue
                binding, master = bound[id(target)]
                source, now = source_binding.view_over(source_master), binding.view_over(master)
                kept_conversions[_conversion_key(source, now.dtype)] = now
                kept_conversions[_conversion_key(now, source.dtype)] = source
        masters = {id(group.master) for group in self._groups}
        kept = tuple(group for group in before if id(group.master) not in masters and not group.mapped)
        # All of them (the usual case) is the very tuple their cached master views were made for.
        self._kept_groups = before if len(kept) == len(before) else kept
        self._kept_conversions = kept_conversions
        # Kept masters are not let go: a cast and its way back wait for no copy (the device may
        # still be loading the blocks that ran just before the cast; the host converts meanwhile).
        held = masters | {id(group.master) for group in self._kept_groups}
        dropped = tuple(group for group in before + kept_before if id(group.master) not in held)
        if dropped:
            self._wait_before_letting_go(dropped)
        self._count_conversion()
        return result

    def _swap_kept_masters(self) -> None:
        """Make the kept masters current and the current ones kept, after a conversion that bound
        every tensor to a kept master: the second cast of a pair, such as SDXL's VAE going back to
        float16, or, from the second call on, going up to float32 again. Nothing to group, pin or
        rebind, no view to make, and no master let go; the kept conversions hold both ways already."""
        before = self.staged_bytes
        self._groups, self._kept_groups = self._kept_groups, self._groups
        if self.retention is not None:
            self.retention.resize(before, self.staged_bytes)
        self._count_conversion()

    def _count_conversion(self) -> None:
        if self._loads_at_conversion is not None:
            self._most_loads_between_conversions = max(self._most_loads_between_conversions, self._loads_since_conversion())
        self._loads_at_conversion = self.loads

    def _loads_since_conversion(self) -> int:
        return self.loads - (self._loads_at_conversion or 0)

    def forget_conversions(self) -> None:
        """Let go of the masters kept from before the last conversion (their memory, if nothing else holds it)."""
        self._kept_groups = ()
        self._kept_conversions = {}
        # Their views, too: they hold the masters' memory.
        self._master_views_by = {key: entry for key, entry in self._master_views_by.items() if entry[0] is self._groups}

    def map_masters(self, sources: Mapping[int, files.MappedBytes]) -> int:
        """Swap masters for byte-identical views of a memory-mapped checkpoint, freeing their memory.

        ``sources`` maps ``id(tensor)`` to that tensor's bytes in the file. A storage qualifies when
        it holds one tensor that fills it exactly and the file holds the same bytes: equality is
        checked here, so a weight changed since loading (a fused LoRA, a cast) keeps its own master
        rather than coming back stale. Expects the stager offloaded; returns the bytes whose master
        memory was released.
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
            and _fills_storage(group)
            and _over(group.bindings[0], group.master)  # else its master is no longer its value
        }
        same = files.hold_the_same_bytes([self._groups[i].master for i in candidates], list(candidates.values()))
        groups = list(self._groups)
        released = 0
        for (index, source), equal in zip(candidates.items(), same):
            if equal:
                groups[index] = replace(groups[index], master=source.view, mapped_from=source, pinned=False, pin=None)
                released += groups[index].nbytes
        self._swap_masters(tuple(groups))
        return released

    def unmap_masters(self, *, pin: bool = True) -> None:
        """Give masters mapped from a file memory of their own again (see file_reads.ReadBack), so
        the file is not read at every load: the read :meth:`read_ahead` started, waited for, else a
        new one; page-locked when this stager pins and ``pin`` (``close()`` passes False: the memory
        is about to be handed back to the module as it was)."""
        self._require_offloaded("unmap_masters()")
        self._copy.wait()
        reading = self._read_back(pin=pin)
        if reading is None and self._maps_files:
            reading = self._new_read_back(pin=pin)
        if reading is not None:
            self._swap_masters(self._over_masters_read_back(file_reads.finished(reading)))

    def _swap_masters(self, groups: tuple[StorageGroup, ...]) -> None:
        """Take ``groups`` (the same tensors over other masters) and bind the tensors to them, but
        those replaced since they were bound (``param.data = ...`` while asleep): binding them would
        undo that, and the next load takes masters for them."""
        replaced = frozenset(
            id(binding.target) for group in self._groups for binding in group.bindings if not _over(binding, group.master)
        )
        self._groups = groups
        self._assign(self._master_views(), keep=replaced)

    def _claim_tensors(self) -> None:
        me = weakref.ref(self)
        for group in self._groups:
            for binding in group.bindings:
                _STAGED_BY[id(binding.target)] = (weakref.ref(binding.target), me)

    def _require_offloaded(self, what: str) -> None:
        if self.loaded:
            raise RuntimeError(f"{what} needs the stager offloaded first")

    def close(self) -> None:
        """Leave every tensor on a host master of its own and forget the device; the stager is
        unusable after."""
        self.offload()
        self.unmap_masters(pin=False)
        self._copy.wait()
        self.forget_conversions()
        # Unlock the masters now rather than whenever the stager is collected: the tensors keep
        # the memory, pageable again, as it was before the stager pinned it.
        self._groups = tuple(
            replace(group, pinned=group.pinned and group.pin is None, pin=None) for group in self._groups
        )
        self._master_views_by = {}
        if self.retention is not None:
            self.retention.shrink(self.staged_bytes)
            self.retention = None
        for group in self._groups:
            for binding in group.bindings:
                if staged_by(binding.target) is self:
                    del _STAGED_BY[id(binding.target)]
        self.closed = True
