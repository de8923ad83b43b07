"""Counting what a dry run on the meta device would hold on the device: the bytes of the tensors
alive at once (see ``dry_runs``)."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages that the operations run under it create, while they are
    alive, and the most alive at once. Storages it was told of (weights, inputs) are not counted
    again when an operation returns a view of them.

    An operation that made new tensors is not run again for inputs of the same layout: tensors of
    the layouts it made stand for its outputs. Meta kernels are functions of their inputs' layouts,
    and many are Python (a group norm's, decomposed, takes a millisecond), while a UNet calls the
    same few operations on the same few layouts: half of SDXL's UNet's dry run, which a first call
    waits for with the device idle, went to running them again."""

    def __init__(self, known: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self._sizes: dict[int, int] = {id(tensor.untyped_storage()): 0 for tensor in known}
        self.live = self.peak = 0
        # Per operation and inputs' layouts (see _key): the layouts of the new tensors it returned,
        # or None where it returned anything else (a host tensor, a number).
        self._made: dict[tuple, Any] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        key = _key(func, args, kwargs)
        made = self._made.get(key) if key is not None else None
        if made is not None:
            out = tree_map(_empty_as, made, is_leaf=lambda leaf: isinstance(leaf, _Layout))
        else:
            # Keyed, every tensor argument is on the meta device: a layout made directly will do.
            out = _MADE_DIRECTLY.get(func, func)(*args, **kwargs) if key is not None else func(*args, **kwargs)
            if key is not None and key not in self._made:
                self._made[key] = _new_tensor_layouts(out, (args, kwargs))
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                storage = leaf.untyped_storage()
                if id(storage) not in self._sizes:
                    # A storage's Python object lives exactly as long as the storage (torch keeps
                    # it with the storage), so its finalizer says when the memory would be freed.
                    self._sizes[id(storage)] = storage.nbytes()
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, id(storage))
        return out

    def _freed(self, key: int) -> None:
        self.live -= self._sizes.pop(key)


# Arguments that say the same thing wherever they are equal and of one type (a dimension, an
# epsilon, a dtype: 1, 1.0 and True are equal, but an operation promotes them differently).
PLAIN_ARGUMENTS = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


class _NoLayoutKey(Exception):
    """An argument that is no meta tensor nor plain value: the operation is run."""


@functools.cache
def _makes_new_tensors_only(func: Any) -> bool:
    """Whether ``func`` may be reused: it writes into no argument (it may resize one) and returns
    no view of one (views are cheap to make, and share their input's storage)."""
    schema = getattr(func, "_schema", None)
    return schema is not None and not schema.is_mutable and not any(result.alias_info for result in schema.returns)


def _key(func: Any, args: tuple, kwargs: dict) -> tuple | None:
    """What ``func``'s outputs' layouts depend on, or None where that is not known."""
    if not _makes_new_tensors_only(func):
        return None
    try:
        # The default dtype too: a factory function with no dtype makes tensors of it.
        key = (func, torch.get_default_dtype(), _layout_key(args), _layout_key(kwargs))
        hash(key)  # a symbolic size is unhashable
    except (_NoLayoutKey, TypeError, RuntimeError):  # RuntimeError: a nested tensor has no strides
        return None
    return key


def _layout_key(value: Any) -> Any:
    """``value`` with each tensor as its layout (class, shape, strides, dtype): what an operation's
    outputs' layouts depend on. A tensor off the meta device has values that may shape them (a
    boolean mask indexing a meta tensor)."""
    if isinstance(value, torch.Tensor):
        if not value.is_meta:
            raise _NoLayoutKey
        return (type(value), value.shape, value.stride(), value.dtype)
    if isinstance(value, PLAIN_ARGUMENTS):
        return (type(value), value)
    if isinstance(value, (tuple, list)):
        return (type(value), *(_layout_key(item) for item in value))
    if isinstance(value, dict):
        return (dict, *((name, _layout_key(item)) for name, item in sorted(value.items())))
    raise _NoLayoutKey


@dataclass(frozen=True)
class _Layout:
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype


def _new_tensor_layouts(out: Any, inputs: Any) -> Any:
    """The layouts of ``out``'s tensors, or None unless each is a plain meta tensor (no subclass,
    which an empty tensor would not stand for) over a storage of its own that it fills (not a view
    of an input, nor of another output)."""
    taken = {id(leaf.untyped_storage()) for leaf in tree_flatten(inputs)[0] if isinstance(leaf, torch.Tensor)}
    for leaf in tree_flatten(out)[0]:
        if (
            type(leaf) not in (torch.Tensor, torch.nn.Parameter)
            or not leaf.is_meta
            or id(leaf.untyped_storage()) in taken
        ):
            return None
        taken.add(id(leaf.untyped_storage()))
        if leaf.storage_offset() or leaf.untyped_storage().nbytes() != _strided_bytes(leaf):
            return None
    return tree_map(lambda leaf: _Layout(leaf.shape, leaf.stride(), leaf.dtype), out)


def _strided_bytes(tensor: torch.Tensor) -> int:
    if tensor.numel() == 0:
        return 0
    extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return extent * tensor.element_size()


def _empty_as(layout: _Layout) -> torch.Tensor:
    return torch.empty_strided(layout.shape, layout.stride, dtype=layout.dtype, device="meta")


def _native_group_norm(
    input: torch.Tensor, weight: Any, bias: Any, batch: int, channels: int, inner: int, groups: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``aten.native_group_norm``'s outputs on the meta device, in the layouts its decomposition
    (``torch._refs.native_group_norm``) makes of an input with a contiguous tensor's strides: the
    normalised input in its shape, dtype and strides; the mean and reciprocal deviation per sample
    and group, in its dtype. Other inputs (channels last, or a size-1 dimension with a stride of
    its own, whose strides the output follows) are decomposed."""
    out = torch.empty(input.shape, dtype=input.dtype, device="meta")
    if out.stride() != input.stride():
        return torch.ops.aten.native_group_norm.default(input, weight, bias, batch, channels, inner, groups, eps)
    stats = torch.empty((batch, groups), dtype=input.dtype, device="meta")
    return out, stats, torch.empty_like(stats)


# Operations whose meta kernels are Python decompositions that take the host a millisecond or more
# a layout, made directly (checked against the decompositions in the tests): an SDXL UNet's step
# meets fourteen group norm layouts, a fifth of its dry run.
_MADE_DIRECTLY = {torch.ops.aten.native_group_norm.default: _native_group_norm}
