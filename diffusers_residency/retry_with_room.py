"""Running a component again, with room made, when it runs out of device memory in a call planned
from estimates, rather than failing the call on an estimate that fell short (see
``dry_run_plans.make_room_to_retry``, which makes the room); and telling when running it again could
change its output, where the error is raised as it came.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import torch
from torch import nn

from .diffusers_hooks import DIFFUSERS_REGISTRY_ATTR
from .residency import ResidencyGroup

logger = logging.getLogger(__name__)

# Entry points of a component that run again, besides its forward (see hooks._hook_component): a
# decoder's, which reads its latents and writes nothing but its output, and whose hook diffusers
# calls inside it (apply_forward_hook), not around it.
RETRIED_METHODS = ("decode",)


def retried_with_room(
    method: Callable[..., Any], group: ResidencyGroup, component: str, module: nn.Module
) -> Callable[..., Any]:
    """``method`` of ``component`` (``module``), run once more when it runs out of device memory
    while ``group`` can make room for a retry (``make_room_to_retry``, set under a plan made from
    estimates), rather than the call failing on an estimate that fell short; unless the attempt
    may have changed state that a second one would change again (see :func:`_why_not_run_again`)."""

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except torch.OutOfMemoryError:
            make_room = group.make_room_to_retry
            if make_room is None:
                raise
            unsafe = _why_not_run_again(module, kwargs)
            if unsafe is not None:
                logger.warning(
                    "%r ran out of device memory under an estimate, and is not run again: %s", component, unsafe
                )
                raise
        # Out of the except block: the failed attempt's tensors, which its traceback holds until
        # then, are freed before the room is made.
        make_room(component)
        return method(*args, **kwargs)

    return run


def _why_not_run_again(module: nn.Module, kwargs: dict[str, Any]) -> str | None:
    """Why a forward of ``module`` that raised part way may not run again on the same inputs, or
    None. diffusers' stateful hooks (its caches) keep what the attempt's first layers computed, and
    a second attempt would skip or reuse work on that (FirstBlockCache then fails, pyramid
    attention broadcast counts the step twice); a registry laid out otherwise than diffusers' own is
    taken for one. A LoRA scale is applied to the adapters in place as the forward starts and
    undone as it ends: in a ``finally`` where diffusers' ``apply_lora_scale`` wraps the forward,
    and otherwise (every model of diffusers 0.35, two of 0.42) not at all on an error, when a
    second attempt would apply it over the first."""
    for sub in module.modules():
        registry = getattr(sub, DIFFUSERS_REGISTRY_ATTR, None)
        if registry is None:
            continue
        hooks = getattr(registry, "hooks", None)
        if not isinstance(hooks, dict) or any(getattr(hook, "_is_stateful", True) for hook in hooks.values()):
            return f"a stateful diffusers hook ({type(sub).__name__}) holds what the attempt computed"
    scaled = any(isinstance(value, dict) and value.get("scale", 1.0) != 1.0 for value in kwargs.values())
    if scaled and not _undoes_lora_scale_on_error(type(module)) and _has_adapters(module):
        return "it was given a LoRA scale, which its forward leaves applied when it raises"
    return None


def _undoes_lora_scale_on_error(cls: type) -> bool:
    """Whether ``cls.forward`` is wrapped by diffusers' ``apply_lora_scale`` (every wrapper it makes
    shares one code object), which undoes the scale in a ``finally``."""
    try:
        from diffusers.utils import apply_lora_scale
    except ImportError:  # diffusers before it: scales undone only when the forward returns
        return False
    wrapper_code = apply_lora_scale("joint_attention_kwargs")(lambda self: None).__code__
    return getattr(getattr(cls, "forward", None), "__code__", None) is wrapper_code


def _has_adapters(module: nn.Module) -> bool:
    """Whether ``module`` holds peft's adapter layers, the only ones a LoRA scale changes."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return False
    return any(isinstance(sub, BaseTunerLayer) for sub in module.modules())
