"""A dry run's repeated blocks (see ``streaming.repeated_blocks``), each run for real only once per
class, tensors' shapes and inputs' signature: the others of that key return tensors of the shapes
it returned and count what it held, rather than dispatching the same operations again (see
``dry_runs``). What each block was given can be recorded on the way, for blocks timed at enable
(see ``block_timing``), and what each module of the trunk was given, for its kernels run then.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map

from .live_bytes import PLAIN_ARGUMENTS, LiveBytes
from .streaming import repeated_blocks


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's shape and dtype, where a dry run's tensor stood: kept instead of the meta tensor,
    which the dry run's count of live bytes would see as still alive."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _spec(leaf: Any) -> Any:
    return TensorSpec(tuple(leaf.shape), leaf.dtype) if isinstance(leaf, torch.Tensor) else leaf


def _specs(args: tuple, kwargs: Mapping[str, Any]) -> tuple[tuple, dict]:
    return tree_map(_spec, (args, dict(kwargs)))


_KEPT_LEAVES = (torch.Tensor, *PLAIN_ARGUMENTS)


def _keepable(args: tuple, kwargs: Mapping[str, Any]) -> bool:
    """Whether inputs hold only tensors and plain values: an object that pytree does not open would
    keep its meta tensors alive through the dry run, and hand them to the real module at enable."""
    return all(isinstance(leaf, _KEPT_LEAVES) for leaf in tree_leaves((args, kwargs)))


def kept_specs(args: tuple, kwargs: Mapping[str, Any]) -> tuple[tuple, dict] | None:
    """Inputs as :class:`TensorSpec` and plain values, to run a module on at enable; None where they
    hold anything else (see :func:`_keepable`)."""
    return _specs(args, kwargs) if _keepable(args, kwargs) else None


@dataclass
class BlockInputs:
    """What a dry run gave a component's repeated blocks: each block's key (its layout and inputs'
    signature, see :func:`_replayed`) by position, in the order they first ran, and for each key
    the first block given it, with its inputs as :class:`TensorSpec` (no key's inputs that hold
    other objects: a decoder-style text encoder's layers are given the dry run's KV cache); and,
    where asked, what it gave the modules of its trunk."""

    keys: dict[int, Hashable] = field(default_factory=dict)
    first: dict[Hashable, tuple[int, tuple[tuple, dict]]] = field(default_factory=dict)
    # How many repeated blocks the module has, run or not.
    blocks: int = 0
    # The trunk's modules that ran (see :func:`trunk_modules`), by layout and inputs' signature:
    # the first given each, as its path in the module and its inputs. None where they are not
    # recorded: only a denoiser's and encoders' are run ahead (see ``block_timing.warm_kernels``).
    trunk: dict[Hashable, tuple[str, tuple[tuple, dict]]] | None = None

    def record(self, position: int, key: Hashable, args: tuple, kwargs: dict) -> None:
        self.keys[position] = key
        if key not in self.first and (specs := kept_specs(args, kwargs)) is not None:
            self.first[key] = (position, specs)

    @property
    def every_key_kept(self) -> bool:
        """Whether a block of each key can be run on what the dry run gave it."""
        return all(key in self.first for key in self.keys.values())

    def record_trunk(self, path: str, layout: tuple, args: tuple, kwargs: dict) -> None:
        """Inputs holding anything but tensors and plain values are not kept (see :func:`_keepable`)."""
        if self.trunk is None or not _keepable(args, kwargs):
            return
        key = (layout, signature(args, kwargs))
        if key not in self.trunk:
            self.trunk[key] = (path, _specs(args, kwargs))

    @property
    def run_order(self) -> tuple[tuple[int, type], ...]:
        """The blocks that ran, each as its position and class (a key's layout's first item, see
        :func:`replaying_repeats`), in the order each first ran."""
        return tuple((position, key[0][0]) for position, key in self.keys.items())


def signature(args: tuple, kwargs: Mapping[str, Any]) -> tuple:
    """What a block's memory may depend on in its inputs: their structure (keyword names included),
    tensors' shapes and dtypes, and the types and values of plain ones (a flag, a size, a dtype:
    ``True``, ``1`` and ``1.0`` are equal, and promote a tensor they multiply to different dtypes)."""
    leaves, spec = tree_flatten((args, dict(kwargs)))
    return (str(spec), *(_described(leaf) for leaf in leaves))


def _described(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return tuple(leaf.shape), leaf.dtype
    return (type(leaf), leaf) if isinstance(leaf, PLAIN_ARGUMENTS) else type(leaf)


def replaying_repeats(twin: nn.Module, counter: LiveBytes, record: BlockInputs | None = None) -> Callable[[], None]:
    """Run each repeated block (see ``streaming.repeated_blocks``) for real only the first time a
    block of its class and tensors' shapes sees inputs of their shapes; later ones return new
    tensors of the shapes it returned, and count the most it held above what was alive as it
    started, above what is alive as they start (a UNet's skip connections pile up along its down
    blocks). A denoiser's dozens of blocks would otherwise cost the host a second of dispatch. (A
    UNet's blocks of one class differ in their channels: their tensors' shapes tell them apart.)
    ``record``: told each block's inputs, by its position, and each trunk module's (see
    :func:`trunk_modules`). Returns the undo."""
    seen: dict[tuple, tuple[Any, int]] = {}
    layouts = block_layouts(twin)
    handles = []
    if record is not None:
        record.blocks = len(layouts)
    if record is not None and record.trunk is not None:
        for path, module, layout in trunk_modules(twin):
            told = functools.partial(_told_trunk_module, record, path, layout)
            handles.append(module.register_forward_pre_hook(told, with_kwargs=True))
    for position, (block, layout) in enumerate(layouts):
        told = None if record is None else functools.partial(record.record, position)
        block.forward = functools.partial(_replayed, counter, seen, layout, told, block.forward)

    def undo() -> None:
        for block, _ in layouts:
            block.__dict__.pop("forward", None)
        for handle in handles:
            handle.remove()

    return undo


def trunk_modules(module: nn.Module) -> list[tuple[str, nn.Module, tuple]]:
    """The outermost modules of ``module``'s trunk (what is outside its repeated blocks) that hold
    no block, each with its path and layout (see :func:`_layout`): a UNet's ``conv_in``, the
    resnets and samplers between its transformer blocks and its ``conv_out``, a transformer's
    embedders and output projection. Their kernels are a call's as much as the blocks' are (see
    ``block_timing.warm_kernels``). A module holding a block, by any path, is not one (running it
    would run the block), nor a ``ModuleList`` or ``ModuleDict``, which are never called: their
    items are looked into instead. A module reachable by two paths is listed once."""
    blocks = {id(block) for _, block in repeated_blocks(module)}
    seen: set[int] = set()
    found: list[tuple[str, nn.Module, tuple]] = []

    def look_into(path: str, parent: nn.Module) -> None:
        for name, child in parent.named_children():
            if id(child) in seen or id(child) in blocks:
                continue
            seen.add(id(child))
            child_path = f"{path}.{name}" if path else name
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)) or any(id(m) in blocks for m in child.modules()):
                look_into(child_path, child)
            else:
                found.append((child_path, child, _layout(child)))

    look_into("", module)
    return found


def _told_trunk_module(
    record: BlockInputs, path: str, layout: tuple, module: nn.Module, args: tuple, kwargs: dict
) -> None:
    record.record_trunk(path, layout, args, kwargs)


# Each twin's repeated blocks with their layouts (class, and tensors' names and shapes), worked out
# once, as the twin is made (at enable), rather than from every block's state dict in each dry run,
# which a first call waits for. A twin's tensors keep their shapes (a quantized one's ``to(dtype)``
# changes only their dtype).
_LAYOUTS: weakref.WeakKeyDictionary[nn.Module, list[tuple[nn.Module, tuple]]] = weakref.WeakKeyDictionary()


def block_layouts(twin: nn.Module) -> list[tuple[nn.Module, tuple]]:
    layouts = _LAYOUTS.get(twin)
    if layouts is None:
        layouts = _LAYOUTS[twin] = [(block, _layout(block)) for _, block in repeated_blocks(twin)]
    return layouts


def _layout(module: nn.Module) -> tuple:
    """A module's class, and its tensors' names and shapes."""
    return type(module), tuple((name, tensor.shape) for name, tensor in module.state_dict().items())


def _replayed(
    counter: LiveBytes,
    seen: dict[tuple, tuple[Any, int]],
    layout: tuple,
    record: Callable[[tuple, tuple, dict], None] | None,
    forward: Callable,
    *args: Any,
    **kwargs: Any,
) -> Any:
    key = (layout, signature(args, kwargs))
    if record is not None:
        record(key, args, kwargs)
    entry = counter.live
    if key not in seen:
        peak_before, counter.peak = counter.peak, entry
        out = forward(*args, **kwargs)
        shapes = tree_map(lambda t: (t.shape, t.dtype) if isinstance(t, torch.Tensor) else t, out)
        seen[key] = (shapes, counter.peak - entry)
        counter.peak = max(counter.peak, peak_before)
        return out
    shapes, held = seen[key]
    counter.peak = max(counter.peak, entry + held)
    return tree_map(
        lambda leaf: torch.empty(leaf[0], dtype=leaf[1], device="meta") if _is_spec(leaf) else leaf,
        shapes,
        is_leaf=_is_spec,
    )


def _is_spec(leaf: Any) -> bool:
    return isinstance(leaf, tuple) and len(leaf) == 2 and isinstance(leaf[0], torch.Size)
