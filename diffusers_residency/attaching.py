"""The attach/detach API: stage any one module through a :class:`~.residency.ResidencyGroup` with a
:class:`~.hooks.StagingHook` (a component whole, or its repeated blocks streamed), and take the hooks
off again. ``enable_pinned_offload`` attaches its components with these; scripts call them directly.
"""

from __future__ import annotations

import numbers
from collections.abc import Collection

from accelerate.hooks import add_hook_to_module, remove_hook_from_module
from torch import nn

from .diffusers_hooks import GROUP_OFFLOADING_HOOK, registered_hook
from .hooks import StagingHook
from .plans import PREFETCH_BLOCKS
from .policy import Policy
from .residency import ResidencyGroup, ResidencyUnit
from .retry_with_room import retried_with_room
from .streaming import BlockStream, repeated_blocks


def check_attachable(module: nn.Module, name: str, group: ResidencyGroup | None = None) -> None:
    """Raise, before anything changes, if ``module`` is already under another offloading scheme.

    Two schemes that both replace ``forward`` and both move weights fight over the same tensors, and
    removing them out of order leaves dead hooks. A hook of ``group`` itself is fine: it is replaced.
    """
    for path, sub in module.named_modules():
        where = f"{name}.{path}" if path else name
        hook = getattr(sub, "_hf_hook", None)
        if hook is not None and not (isinstance(hook, StagingHook) and hook.group is group):
            if isinstance(hook, StagingHook):
                raise ValueError(
                    f"{where!r} is already staged by another pipeline or group. Disable that one first "
                    "(disable_pinned_offload() or detach_staging_hook())."
                )
            raise ValueError(
                f"{where!r} already has an accelerate hook ({type(hook).__name__}). Remove it first, "
                "e.g. pipe.remove_all_hooks() after enable_model_cpu_offload()/enable_sequential_cpu_offload(), "
                "or accelerate.hooks.remove_hook_from_module(module, recurse=True)."
            )
        if registered_hook(sub, GROUP_OFFLOADING_HOOK) is not None:
            raise ValueError(
                f"{where!r} has diffusers group offloading enabled. Pinned offload replaces it; "
                "reload the component (or remove its group offloading) before enabling pinned offload."
            )


def attach_staging_hook(
    module: nn.Module,
    group: ResidencyGroup,
    *,
    name: str | None = None,
    policy: str | Policy = Policy.STAGED,
) -> StagingHook:
    """Stage ``module`` (a component, or a submodule such as one transformer block) through ``group``.

    Hooks attached to one group share its device, copy stream and retention budget; a *staged*
    module evicts the group's other staged modules when it loads, a *resident* one stays once loaded.
    Undo with :func:`detach_staging_hook`.
    """
    name = name or type(module).__name__
    if Policy.parse(policy, name) is Policy.STREAMED:
        raise ValueError(f"{name!r}: a module streams through attach_block_streaming(), not attach_staging_hook()")
    check_attachable(module, name, group)
    _refuse_a_taken_name(group, name, module)
    _replace_hook_of_group(module)
    unit = group.add(name, module, policy)
    return _hook_component(module, StagingHook(group, unit))


def attach_block_streaming(
    module: nn.Module,
    group: ResidencyGroup,
    *,
    name: str | None = None,
    resident_blocks: Collection[int] = (),
    prefetch_blocks: int = PREFETCH_BLOCKS,
) -> StagingHook:
    """Stream ``module``'s repeated blocks (see :func:`~diffusers_residency.streaming.repeated_blocks`)
    through ``group``: its trunk and the blocks at positions ``resident_blocks`` (in definition
    order, from 0) stay on the device once loaded; each other block loads just before it runs, with
    the next ``prefetch_blocks`` streamed ones loading behind it.
    Every block gets a staging hook of its own; :func:`detach_staging_hook` on ``module`` removes them all.
    """
    name = name or type(module).__name__
    if not isinstance(prefetch_blocks, numbers.Integral) or isinstance(prefetch_blocks, bool) or prefetch_blocks < 0:
        raise ValueError(f"prefetch_blocks is how many blocks load ahead, a whole number from 0, not {prefetch_blocks!r}")
    blocks = repeated_blocks(module)
    if len(blocks) <= prefetch_blocks:
        raise ValueError(
            f"{name!r} ({type(module).__name__}) has {len(blocks)} repeated blocks (sharing no weight with each "
            f"other or the rest of it), too few to stream with {prefetch_blocks} loading ahead; stage it whole instead"
        )
    resident_blocks = frozenset(resident_blocks)
    # True is 1 to Python, and no position.
    outside = [
        i
        for i in resident_blocks
        if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < len(blocks)
    ]
    if outside:
        raise ValueError(
            f"resident_blocks {sorted(outside, key=repr)} are not positions of {name!r}'s {len(blocks)} blocks; "
            f"give indices from 0 to {len(blocks) - 1}"
        )
    check_attachable(module, name, group)
    _refuse_a_taken_name(group, name, module)
    _replace_hook_of_group(module)
    block_modules = tuple(block for _, block in blocks)
    trunk = group.add(name, module, Policy.STREAMED, exclude=block_modules)
    units: list[ResidencyUnit] = [trunk]
    try:
        for index, (path, block) in enumerate(blocks):
            policy = Policy.RESIDENT if index in resident_blocks else Policy.STREAMED
            units.append(group.add(f"{name}.{path}", block, policy, component=name))
        stream = BlockStream(name, units[1:], prefetch_blocks, group)
        for unit in units[1:]:
            unit.stream = stream
            add_hook_to_module(unit.module, StagingHook(group, unit))
        hook = _hook_component(module, StagingHook(group, trunk))
    except BaseException:
        for unit in reversed(units):
            if getattr(unit.module, "_hf_hook", None) is not None:
                remove_hook_from_module(unit.module)
            elif unit in group.units:
                group.remove(unit)
        raise
    return hook


def _hook_component(module: nn.Module, hook: StagingHook) -> StagingHook:
    """Attach ``hook`` to a component's ``module`` and retry its forward with room (see
    retried_with_room): a denoiser's step writes nothing but its output, and what it consumes of its
    inputs (the UNet pops T2I-Adapter residuals off a list) it consumes of the copies that
    ``pre_forward`` passes on (``send_to_device`` rebuilds lists and dicts), so that a second
    attempt finds the caller's whole. The forward that runs the hook is accelerate's, set after
    ``init_hook``: wrapped here, and dropped when the hook is detached (accelerate itself restores
    only the class's forward of an fx graph; for others it sets the module's own over the one
    detaching puts back)."""
    add_hook_to_module(module, hook)
    hook._wrap(module, "forward", retried_with_room(module.forward, hook.group, hook.unit.component, module))
    return hook


def detach_staging_hook(module: nn.Module) -> None:
    """Remove the staging hook; the module keeps bit-identical weights, back on the device it had.
    A streamed module's blocks go with it: one block alone is refused, as its stream would go on
    loading it."""
    hook = getattr(module, "_hf_hook", None)
    if not isinstance(hook, StagingHook):
        raise ValueError(f"{type(module).__name__} has no staging hook to detach")
    _refuse_a_block_of_a_stream(hook)
    remove_hook_from_module(module)


def _replace_hook_of_group(module: nn.Module) -> None:
    """Remove the staging hook ``module`` has from the group it is attached to again (see
    check_attachable), unless it is one block of a streamed module."""
    hook = getattr(module, "_hf_hook", None)
    if isinstance(hook, StagingHook):
        _refuse_a_block_of_a_stream(hook)
        remove_hook_from_module(module)


def _refuse_a_block_of_a_stream(hook: StagingHook) -> None:
    """One block's hook does not go alone: its stream would go on loading the block, through a
    stager closed with the hook."""
    unit = hook.unit
    if unit.stream is not None and unit.name != unit.component:
        raise ValueError(
            f"{unit.name!r} is a block of the streamed {unit.component!r}: detach {unit.component!r} itself, "
            "which takes every block's hook with it, before staging the block another way"
        )


def _refuse_a_taken_name(group: ResidencyGroup, name: str, module: nn.Module) -> None:
    """Two modules under one name would be one component to the group: staged, neither would evict
    the other, and detaching one would take the other's hook (see StagingHook.detach_hook)."""
    if any(unit.name == name and unit.module is not module for unit in group.units):
        raise ValueError(
            f"{name!r} already names another module in this group; give each module a name of its own (name=...)"
        )
