"""``enable_pinned_offload`` / ``disable_pinned_offload`` / ``residency_report`` on a DiffusionPipeline.

Every ``nn.Module`` component gets a :class:`~diffusers_residency.hooks.StagingHook`, resident ones
too: diffusers' ``_execution_device`` returns ``pipe.device`` (the CPU, once weights sit on host
masters) as soon as it meets a component without ``_hf_hook``. The hooks are never put in
``pipe._all_hooks``: ``maybe_free_model_hooks()``, at the end of most pipeline calls, re-runs
``enable_model_cpu_offload()`` whenever that list is non-empty.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
from accelerate.hooks import remove_hook_from_module
from diffusers import DiffusionPipeline
from torch import nn

from .hooks import StagingHook, attach_staging_hook, check_attachable
from .report import ResidencyReport, report_for
from .residency import Policy, ResidencyGroup
from .staging import module_tensors, refuse_meta_tensors, refuse_staged_elsewhere

logger = logging.getLogger(__name__)

_STATE_ATTR = "_pinned_residency"
# Pipeline methods that may write into weights in place, text encoders' included (their LoRA is
# merged by a function, not a component method the hooks could wrap): run with every component
# offloaded, so the writes land in the masters. See hooks.IN_PLACE_WEIGHT_METHODS.
_IN_PLACE_PIPELINE_METHODS = ("fuse_lora", "unfuse_lora", "load_lora_weights")


@dataclass
class PipelineResidency:
    """What ``enable_pinned_offload`` set up on one pipeline."""

    group: ResidencyGroup
    hooks: dict[str, StagingHook]

    @property
    def active(self) -> bool:
        """False once every hook is gone, e.g. after ``pipe.remove_all_hooks()``."""
        return bool(self.group.units)


def pipeline_state(pipe: DiffusionPipeline) -> PipelineResidency | None:
    """What ``enable_pinned_offload`` set up on ``pipe``, or None (also once every hook was removed)."""
    state = pipe.__dict__.get(_STATE_ATTR)
    if state is not None and not state.active:
        _forget(pipe)
        return None
    return state


def _forget(pipe: DiffusionPipeline) -> None:
    for name in (_STATE_ATTR, "to", *_IN_PLACE_PIPELINE_METHODS):
        pipe.__dict__.pop(name, None)


def _module_components(pipe: DiffusionPipeline) -> dict[str, nn.Module]:
    """nn.Module components in call order: ``model_cpu_offload_seq`` first, then the rest."""
    modules = {name: c for name, c in pipe.components.items() if isinstance(c, nn.Module)}
    sequence = (pipe.model_cpu_offload_seq or "").split("->")
    ordered = {name: modules[name] for name in sequence if name in modules}
    ordered.update(modules)
    return ordered


def _default_policy(pipe: DiffusionPipeline, name: str) -> Policy:
    if name in pipe._exclude_from_cpu_offload:
        return Policy.RESIDENT
    if name not in (pipe.model_cpu_offload_seq or "").split("->"):
        # Outside the sequence means called inside the denoising loop (a ControlNet, say): staging it
        # would swap it against the denoiser at every step.
        logger.info("%r is not in model_cpu_offload_seq; keeping it resident", name)
        return Policy.RESIDENT
    return Policy.STAGED


def _policies(
    pipe: DiffusionPipeline, modules: Mapping[str, nn.Module], components: Mapping[str, str] | None
) -> dict[str, Policy]:
    components = dict(components or {})
    unknown = sorted(set(components) - set(modules))
    if unknown:
        raise ValueError(
            f"components names {unknown}, which are not nn.Module components of {type(pipe).__name__}; "
            f"choose from {sorted(modules)}"
        )
    return {
        name: Policy.parse(components[name], name) if name in components else _default_policy(pipe, name)
        for name in modules
    }


def _refuse_shared_weights(modules: Mapping[str, nn.Module]) -> None:
    """Two components that share weights (but are not one module) cannot each own their storages."""
    owner: dict[int, str] = {}
    seen: set[int] = set()
    for name, module in modules.items():
        if id(module) in seen:
            continue
        seen.add(id(module))
        for tensor in module_tensors((module,)):
            other = owner.setdefault(id(tensor), name)
            if other != name:
                raise ValueError(f"components {other!r} and {name!r} share weights; pinned offload stages each weight once")


def _same_setup(previous: PipelineResidency, group: ResidencyGroup, modules: Mapping[str, nn.Module]) -> bool:
    """Whether a new enable keeps the device, the pinning (and its budget) and the modules of the previous one."""
    return (
        previous.group.device == group.device
        and previous.group.pin_memory == group.pin_memory
        and previous.group.pin_budget == group.pin_budget
        and {id(hook.unit.module) for hook in previous.hooks.values()} == {id(m) for m in modules.values()}
    )


def _load_excluded(pipe: DiffusionPipeline, state: PipelineResidency) -> None:
    # diffusers keeps these on the device because pipelines may use them without calling them.
    for name in pipe._exclude_from_cpu_offload:
        if name in state.hooks:
            state.group.activate(state.hooks[name].unit)


def enable_pinned_offload(
    pipe: DiffusionPipeline,
    device: str | torch.device | None = None,
    *,
    components: Mapping[str, str] | None = None,
    pin_memory: bool | None = None,
    pin_budget: int | float | None = None,
) -> None:
    """Stage the pipeline's components on ``device`` from pinned host masters.

    Args:
        device: where to compute; ``None`` takes the current accelerator (a ``RuntimeError`` where
            there is none). ``"cpu"`` runs the same mechanism unpinned, for machines without a GPU.
        components: component name -> ``"staged"`` (on the device only while in use; the default
            for components in ``model_cpu_offload_seq``) or ``"resident"`` (loaded once, kept; the
            default for ``_exclude_from_cpu_offload`` and for components outside the sequence).
        pin_memory: pin the host masters; defaults to whether ``device`` is an accelerator. Masters
            are weights' own host memory, page-locked in place where the platform allows (CUDA);
            weights on the device are copied down once into blocks sized to them.
        pin_budget: the most host memory the package keeps page-locked in this process, every
            pipeline's masters counted, in bytes or as a fraction of physical RAM (default 0.75).
            Masters beyond it stay pageable: loads still work, at the pageable copy rate, and the
            report's ``pageable GB`` column shows them.

    Calling it again reconfigures the pipeline: with the same device and pinning only the policies
    change and the masters are kept; otherwise pinned offload is disabled and set up anew. All
    arguments are checked before anything changes.
    """
    previous = pipeline_state(pipe)
    group = ResidencyGroup(device, pin_memory=pin_memory, pin_budget=pin_budget)
    modules = _module_components(pipe)
    policies = _policies(pipe, modules, components)
    ours = [hook.unit.stager for hook in previous.hooks.values()] if previous else []
    for name, module in modules.items():
        check_attachable(module, name, previous.group if previous else None)
        refuse_meta_tensors((module,), f"Component {name!r}")
        refuse_staged_elsewhere((module,), f"Component {name!r}", ours)
    _refuse_shared_weights(modules)

    if previous is not None and _same_setup(previous, group, modules):
        # Only the policies change: keep the masters rather than giving them up and pinning again.
        for name, hook in previous.hooks.items():
            hook.unit.policy = policies[name]
        _load_excluded(pipe, previous)
        return
    if previous is not None:
        disable_pinned_offload(pipe)
    hooks: dict[str, StagingHook] = {}
    attached: dict[int, str] = {}
    try:
        for name, module in modules.items():
            if id(module) in attached:
                logger.info("%r is the same module as %r; staging it once", name, attached[id(module)])
                continue
            hooks[name] = attach_staging_hook(module, group, name=name, policy=policies[name])
            attached[id(module)] = name
        state = PipelineResidency(group=group, hooks=hooks)
        _load_excluded(pipe, state)
    except BaseException:
        for name in hooks:
            remove_hook_from_module(modules[name])
        raise

    original_to = pipe.to
    pipe.__dict__[_STATE_ATTR] = state
    pipe.__dict__["to"] = lambda *args, **kwargs: _guarded_pipeline_to(pipe, original_to, *args, **kwargs)
    for name in _IN_PLACE_PIPELINE_METHODS:
        if hasattr(pipe, name):
            pipe.__dict__[name] = _offloaded_first(pipe, state, getattr(pipe, name))
    logger.info(
        "Pinned offload on %s: %s",
        group.device,
        ", ".join(f"{name} ({hook.unit.policy.value}, {hook.unit.stager.staged_bytes / 1e9:.2f} GB)" for name, hook in hooks.items()),
    )


def disable_pinned_offload(pipe: DiffusionPipeline) -> None:
    """Remove every staging hook. Each component keeps bit-identical weights on the device it had
    before ``enable_pinned_offload``. A no-op on a pipeline without pinned offload."""
    state = pipeline_state(pipe)
    if state is None:
        return
    failures = []
    for name, hook in state.hooks.items():
        module = hook.unit.module
        if getattr(module, "_hf_hook", None) is hook:
            try:
                remove_hook_from_module(module)
            except Exception as exc:  # the others are still detached; this one keeps its hook
                failures.append((name, exc))
    if failures:
        name, exc = failures[0]
        raise RuntimeError(
            f"could not move {[n for n, _ in failures]} back to the device they were on; they are still "
            "staged, on their host masters. Free device memory and call disable_pinned_offload() again."
        ) from exc
    _forget(pipe)


def residency_report(pipe: DiffusionPipeline) -> ResidencyReport:
    """Per component: policy, staged bytes, where they are, loads, load time and rate, cache decisions."""
    state = pipeline_state(pipe)
    if state is None:
        raise RuntimeError("Pinned offload is not enabled on this pipeline; call pipe.enable_pinned_offload() first.")
    return report_for(state.group)


def _offloaded_first(
    pipe: DiffusionPipeline, state: PipelineResidency, method: Callable[..., Any]
) -> Callable[..., Any]:
    @functools.wraps(method)
    def offloaded_first(*args: Any, **kwargs: Any) -> Any:
        for hook in state.hooks.values():
            hook.unit.stager.offload_for_writing()  # each is loaded again at its next forward
        result = method(*args, **kwargs)
        _load_excluded(pipe, state)
        return result

    return offloaded_first


def _guarded_pipeline_to(
    pipe: DiffusionPipeline, original_to: Callable[..., DiffusionPipeline], *args: Any, **kwargs: Any
) -> DiffusionPipeline:
    """``pipe.to(dtype)`` casts through the masters; a device move while enabled is refused, because
    diffusers' own ``to`` would move every weight, masters included, behind the hooks' back."""
    if pipeline_state(pipe) is not None:
        moves = kwargs.get("device") is not None or any(not isinstance(a, torch.dtype) for a in args)
        if moves:
            raise RuntimeError(
                "This pipeline has pinned offload enabled, which places its weights itself. "
                "Call pipe.disable_pinned_offload() before pipe.to(device)."
            )
    return original_to(*args, **kwargs)
