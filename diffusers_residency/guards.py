"""What an enabled pipeline's own methods may not do behind pinned offload's back.

The guards stand in for those methods in the pipeline instance's ``__dict__``, so that disabling
drops them all at once and a pipeline without pinned offload never meets them: ``to(device)``
would move every weight, masters included; the LoRA methods that write into weights must write
into the masters; a copy must not share hooks with the original, and a pickle cannot hold them.
diffusers' other offloaders, which would stack on ours or remove it and then refuse, are guarded
on the class instead (see :func:`guard_other_offloads`): a pipeline built from staged components
meets them too, whenever it was built.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
from diffusers import DiffusionPipeline
from torch import nn

from ._device import current_accelerator
from .hooks import GROUP_OFFLOAD_METHOD, IN_PLACE_WEIGHT_METHODS, VERSIONED_WRITE_METHODS, call_then, offloaded_first
from .retry_with_room import RETRIED_METHODS

# Pipeline methods that may write into weights in place, text encoders' included (their LoRA is
# merged by a function, not a component method the hooks could wrap): run with every component
# offloaded, so the writes land in the masters. See hooks.IN_PLACE_WEIGHT_METHODS.
IN_PLACE_PIPELINE_METHODS = ("fuse_lora", "unfuse_lora", "load_lora_weights")
# diffusers' own offloading, enabled over ours: group offloading would stack its hooks on ours, and
# model or sequential offloading removes every hook before it finds out it has no accelerator.
OTHER_OFFLOADS = ("enable_group_offload", "enable_model_cpu_offload", "enable_sequential_cpu_offload")
GUARDED = ("to", *IN_PLACE_PIPELINE_METHODS, "__deepcopy__", "__reduce_ex__")
# The attribute of an enabled pipeline that holds its setup (a pipeline_residency.PipelineResidency).
STATE_ATTR = "_pinned_residency"
# What attaching a staging hook sets on a module's instance: accelerate's hook and wrapped forward,
# and the hook's own guards (see hooks.StagingHook.init_hook).
_HOOK_ATTRIBUTES = (
    "_hf_hook", "_old_forward", "forward", "to", "_apply", "compile", *IN_PLACE_WEIGHT_METHODS,
    *VERSIONED_WRITE_METHODS, GROUP_OFFLOAD_METHOD, "__reduce_ex__", *RETRIED_METHODS,
)


def guard_pipeline(
    pipe: DiffusionPipeline,
    lock: AbstractContextManager,
    enabled: Callable[[], bool],
    offload_all: Callable[[], None],
    after_writing: Callable[[], None],
    reload: Callable[[], None],
    hooked_modules: Callable[[], Iterable[nn.Module]],
    state_attribute: str,
) -> None:
    """Put the guards on ``pipe``. ``lock`` is held by pipeline calls (see calls._wrap_call):
    what writes the weights or copies them takes it too. ``enabled`` tells whether pinned offload is
    still on (its hooks may have been removed by other means); ``offload_all`` offloads every
    component for writing, ``after_writing`` follows a method that wrote into the weights, and
    ``reload`` (part of it) loads what must stay on the device again after a copy; ``hooked_modules``
    are the modules that carry staging hooks, and ``state_attribute`` the instance attribute holding
    the setup."""
    original_to = pipe.to
    pipe.__dict__["to"] = lambda *args, **kwargs: _guarded_to(enabled, original_to, *args, **kwargs)
    for name in IN_PLACE_PIPELINE_METHODS:
        if hasattr(pipe, name):
            # Each component loads again at its next forward.
            pipe.__dict__[name] = offloaded_first(getattr(pipe, name), lock, offload_all, after_writing)

    def copy_without_offload(memo: dict[int, Any]) -> DiffusionPipeline:
        with lock:
            offload_all()  # the copy's weights come from the masters, all of them on the host
            copying = functools.partial(_copy_without_offload, pipe, memo, hooked_modules(), state_attribute)
            return call_then(copying, reload, "copying the pipeline")

    def reduce(protocol: int) -> Any:
        if enabled():  # once the hooks are gone (remove_all_hooks), this drops the guards too
            _refuse_pickling()
        return object.__reduce_ex__(pipe, protocol)

    pipe.__dict__["__deepcopy__"] = copy_without_offload
    pipe.__dict__["__reduce_ex__"] = reduce


def unguard_pipeline(pipe: DiffusionPipeline) -> None:
    for name in GUARDED:
        pipe.__dict__.pop(name, None)


def guard_other_offloads(cls: type[DiffusionPipeline], staged: Callable[[DiffusionPipeline], bool]) -> None:
    """Put on ``cls`` (``DiffusionPipeline``) guards for diffusers' own offloading methods, for every
    pipeline ``staged`` says pinned offload stages components of: the one it was enabled on, and
    one built from its components (``from_pipe``, before or after enabling), whose offloading would
    take the same hooks off or stack on them. Group offloading stacks its hooks on ours (disable
    ours first); model and sequential offloading remove our hooks first and refuse after, where
    there is no accelerator, so that case is refused here, before anything changes. Otherwise they
    replace pinned offload (through ``remove_all_hooks()``, which disables it)."""
    for name in OTHER_OFFLOADS:
        own = cls.__dict__.get(name)  # a pipeline's own (AudioLDM2's model offload), not inherited
        if own is not None and not getattr(own, "_checks_pinned_offload", False):
            setattr(cls, name, _checked_other_offload(own, staged))


def _checked_other_offload(
    method: Callable[..., Any], staged: Callable[[DiffusionPipeline], bool]
) -> Callable[..., Any]:
    @functools.wraps(method)
    def checked(pipe: DiffusionPipeline, *args: Any, **kwargs: Any) -> Any:
        if staged(pipe):
            if method.__name__ == "enable_group_offload":
                raise RuntimeError(
                    "This pipeline has pinned offload enabled; group offloading would stack its hooks on it. "
                    "Call pipe.disable_pinned_offload() before pipe.enable_group_offload()."
                )
            device = kwargs.get("device", args[1] if len(args) > 1 else None)
            accelerator = current_accelerator()
            wanted = None if device is None else torch.device(device).type
            if wanted != "cpu" and (accelerator is None or wanted not in (None, accelerator.type)):
                raise RuntimeError(
                    f"{method.__name__}() needs {wanted or 'an accelerator'} and this process has "
                    f"{accelerator.type if accelerator else 'none'}; pinned offload stays enabled (it also runs "
                    "on device='cpu')."
                )
        return method(pipe, *args, **kwargs)

    checked._checks_pinned_offload = True
    return checked


def _guarded_to(
    enabled: Callable[[], bool], original_to: Callable[..., DiffusionPipeline], *args: Any, **kwargs: Any
) -> DiffusionPipeline:
    """``pipe.to(dtype)`` casts through the masters; a device move while enabled is refused, because
    diffusers' own ``to`` would move every weight, masters included, behind the hooks' back."""
    if enabled():
        moves = kwargs.get("device") is not None or any(not isinstance(a, torch.dtype) for a in args)
        if moves:
            raise RuntimeError(
                "This pipeline has pinned offload enabled, which places its weights itself. "
                "Call pipe.disable_pinned_offload() before pipe.to(device)."
            )
    return original_to(*args, **kwargs)


def _copy_without_offload(
    pipe: DiffusionPipeline, memo: dict[int, Any], hooked: Iterable[nn.Module], state_attribute: str
) -> DiffusionPipeline:
    """``copy.deepcopy(pipe)`` of a pipeline whose components are all offloaded: an independent
    pipeline without pinned offload, its weights copies of the host masters. The hooks, guards and
    setup are hidden while it is copied, so that the copy shares none of them (its ``to`` and LoRA
    methods would otherwise be the original's closures) and copies no stream or pinned buffer."""
    hidden = [(pipe, {name: pipe.__dict__.pop(name) for name in (state_attribute, *GUARDED) if name in pipe.__dict__})]
    hidden += [
        (module, {name: module.__dict__.pop(name) for name in _HOOK_ATTRIBUTES if name in module.__dict__})
        for module in hooked
    ]
    try:
        return copy.deepcopy(pipe, memo)
    finally:
        for owner, attributes in hidden:
            owner.__dict__.update(attributes)


def _refuse_pickling() -> None:
    raise TypeError(
        "This pipeline has pinned offload enabled: its hooks hold streams and page-locked memory, which do not "
        "pickle. Call pipe.disable_pinned_offload() before pickling or torch.save(pipe), or copy.deepcopy(pipe) "
        "for a copy without offloading."
    )
