"""Taking host masters: a module's tensors grouped by storage, one master per storage (see
``masters``), page-locked in place where the pin budget allows, copied into one host block where
not, and kept from the masters taken before where the tensors still live in them.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from . import _device, pinning
from .masters import StorageGroup, TensorBinding
from .weights import flat_bytes

if TYPE_CHECKING:
    from .host_copy import HostCopy


def snapshot(
    tensors: Iterable[torch.Tensor],
    pin_budget: int | None,
    previous: tuple[StorageGroup, ...] = (),
    host_copy: HostCopy | None = None,
) -> tuple[tuple[StorageGroup, ...], bool]:
    """Group every tensor by storage and take one host master per storage; also say whether a host
    storage was copied into a master (its memory goes back to malloc once the tensors are rebound).

    A host storage becomes its own master, page-locked in place when ``pin_budget`` (bytes, None for
    no pinning) allows; a device storage, or a host storage whose pages could not be locked in
    place, is copied once into one host block sized to the copies. Masters of ``previous`` that the
    tensors still live in are kept as they are, registration and alignment included, so a snapshot
    after a small change (a LoRA layer added) copies and pins only what is new. A host storage in
    ``host_copy`` is its own master, read by loads from that copy (see shared_masters).
    """
    # A tensor keeps the inference-ness it had when first staged: one replaced under inference mode
    # (a cast inside a call) is an inference tensor now, and rebinding it so would keep it one.
    was_inference = {id(binding.target): binding.inference for group in previous for binding in group.bindings}
    # Masters that view a checkpoint file (asleep at level 2, or served from files) are views of its
    # mapping (each a storage of its own over it, see checkpoints). A tensor in such a view goes with
    # the view it lies in, placed within it, and keeps it as its master, mapped.
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
        in_copy = host_copy.shared_view(whole) if host_copy is not None and whole.device.type == "cpu" else None
        if previous_group is not None:
            settled[index] = replace(previous_group, bindings=tuple(bindings))
        elif in_copy is not None:
            read_from, pin = in_copy
            settled[index] = StorageGroup(
                whole.detach(), tuple(bindings), alignment, pinned=pin is not None, pin=pin, read_from=read_from
            )
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
