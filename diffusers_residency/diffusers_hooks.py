"""What the package reads of diffusers' own model hooks: the registry a model keeps them in and the
names they register under, both private to diffusers, so read in this one place. Its layerwise
casting moves each weight it casts to storage of its own at every forward (see
ResidencyUnit.load), and computes in a dtype of its own (see dry_runs.meta_twin); its group
offloading leaves dead hooks beside ours (see hooks.check_attachable)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# The attribute of a diffusers model (or submodule) that holds its registry of hooks.
DIFFUSERS_REGISTRY_ATTR = "_diffusers_hook"
LAYERWISE_CASTING_HOOK = "layerwise_casting"
GROUP_OFFLOADING_HOOK = "group_offloading"


def registered_hook(module: nn.Module, name: str) -> Any | None:
    """The diffusers hook registered on ``module`` itself under ``name``, or None."""
    registry = getattr(module, DIFFUSERS_REGISTRY_ATTR, None)
    return registry.get_hook(name) if registry is not None else None


def casts_layerwise(module: nn.Module) -> bool:
    """Whether diffusers' layerwise casting is on anywhere in ``module`` (asked at loads: it stops
    at the first layer cast)."""
    return any(registered_hook(sub, LAYERWISE_CASTING_HOOK) is not None for sub in module.modules())


def compute_dtypes(module: nn.Module) -> dict[str, torch.dtype]:
    """The dtype diffusers' layerwise casting computes in, per submodule of ``module`` (by name)
    that it casts."""
    hooks = ((name, registered_hook(sub, LAYERWISE_CASTING_HOOK)) for name, sub in module.named_modules())
    return {name: hook.compute_dtype for name, hook in hooks if hook is not None}
