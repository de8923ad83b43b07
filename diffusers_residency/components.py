"""A pipeline's components as the planner sees them: their call order, the policies given or
defaulted, their sizes and blocks, the budget and activation reserve resolved from the arguments of
``enable_pinned_offload``, and the function that plans for them again as calls measure."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import replace

import torch
from diffusers import DiffusionPipeline
from torch import nn

from . import _device, kept_blocks
from .checkpoints import saved_weights
from .host_budget import HostPlacement
from .planner import PREFETCH_CHOICES, default_reserve, plan_as_given, plan_residency
from .plans import BudgetTooSmallError, ComponentPlan, ComponentSizes, ResidencyPlan
from .policy import Policy
from .step_timing import StepTiming
from .streaming import repeated_blocks
from .text import format_bytes, parse_bytes
from .weights import module_stored_tensors, module_tensors, storage_bytes

logger = logging.getLogger(__name__)

# The components diffusers' pipelines call at every denoising step, by the names they all use.
_PER_STEP_COMPONENTS = ("transformer", "transformer_2", "unet")


def offload_sequence(pipe: DiffusionPipeline) -> list[str]:
    """The components ``model_cpu_offload_seq`` names, in the order a call runs them."""
    return (pipe.model_cpu_offload_seq or "").split("->")


def module_components(pipe: DiffusionPipeline) -> dict[str, nn.Module]:
    """nn.Module components in call order: ``model_cpu_offload_seq`` first, then the rest."""
    modules = {name: c for name, c in pipe.components.items() if isinstance(c, nn.Module)}
    sequence = offload_sequence(pipe)
    ordered = {name: modules[name] for name in sequence if name in modules}
    ordered.update(modules)
    return ordered


def _default_policy(pipe: DiffusionPipeline, name: str) -> Policy:
    if name in pipe._exclude_from_cpu_offload:
        return Policy.RESIDENT
    if name not in offload_sequence(pipe):
        # Outside the sequence means called inside the denoising loop (a ControlNet, say): staging it
        # would swap it against the denoiser at every step.
        logger.info("%r is not in model_cpu_offload_seq; keeping it resident", name)
        return Policy.RESIDENT
    return Policy.STAGED


def component_policies(
    pipe: DiffusionPipeline, modules: Mapping[str, nn.Module], components: Mapping[str, str] | None
) -> dict[str, Policy]:
    if components is not None and not isinstance(components, Mapping):
        raise TypeError(
            f"components maps component names to policies, e.g. {{'vae': 'resident', 'transformer': 'streamed'}}; "
            f"got {type(components).__name__} {components!r}"
        )
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


def component_sizes(
    pipe: DiffusionPipeline,
    modules: Mapping[str, nn.Module],
    tensor_bytes: Callable[[Iterable[torch.Tensor]], int] = storage_bytes,
) -> list[ComponentSizes]:
    """The planner's view of each component. ``tensor_bytes``: what a set of tensors takes on the
    device (their storages' bytes; a pipeline built on the meta device, whose tensors have none,
    counts them otherwise)."""
    return [_sizes_of(pipe, name, module, tensor_bytes) for name, module in modules.items()]


def _sizes_of(
    pipe: DiffusionPipeline, name: str, module: nn.Module, tensor_bytes: Callable[[Iterable[torch.Tensor]], int]
) -> ComponentSizes:
    saved = {id(tensor) for tensor in saved_weights((module,))}

    def unsaved_bytes(part: nn.Module) -> int:
        return tensor_bytes(t for t in module_stored_tensors((part,)) if id(t) not in saved)

    blocks = [block for _, block in repeated_blocks(module)]
    return ComponentSizes(
        name=name,
        nbytes=tensor_bytes(module_tensors((module,))),
        block_bytes=tuple(tensor_bytes(module_tensors((block,))) for block in blocks),
        per_step=name in _PER_STEP_COMPONENTS,
        unsaved_bytes=unsaved_bytes(module),
        block_unsaved_bytes=tuple(unsaved_bytes(block) for block in blocks),
    )


def resolve_budget(
    vram_budget: int | str | None, reserve: int | str | None, device: torch.device, modules: Mapping[str, nn.Module]
) -> tuple[int, int | None] | None:
    """The budget and the activation reserve given, in bytes (None: the default, which depends on
    the plan), or None where there is nothing to plan for."""
    # Checked whether or not there is a budget to plan for: a bad value is refused, never ignored.
    reserve_bytes = None if reserve is None else parse_bytes(reserve, "activation_reserve")
    if vram_budget is None:
        return None
    if isinstance(vram_budget, str) and vram_budget.strip().lower() == "auto":
        memory = _device.read_memory_telemetry(device)
        if memory is None:
            logger.info("%s reports no free memory; vram_budget='auto' plans nothing there", device)
            return None
        # What is free now, plus what this process's allocator holds unused, plus what the
        # components hold there: they move to host masters.
        held = sum(
            storage_bytes(t for t in module_tensors((m,)) if _device.same_device(t.device, device))
            for m in modules.values()
        )
        budget = memory.free + memory.cached + held
    else:
        budget = parse_bytes(vram_budget)
        memory = _device.read_memory_telemetry(device)
        if memory is not None and budget > memory.total:
            # Planned for, room the device does not have would run out mid-call rather than here.
            raise ValueError(
                f"vram_budget {format_bytes(budget)} is more than {device} has ({format_bytes(memory.total)}); "
                "give at most that, or 'auto' for what it has free"
            )
    if reserve_bytes is None:
        return budget, None
    if reserve_bytes >= budget:
        raise ValueError(
            f"activation_reserve ({format_bytes(reserve_bytes)}) leaves nothing of vram_budget ({format_bytes(budget)}) "
            "for weights; lower the reserve or raise the budget"
        )
    return budget, reserve_bytes


def default_reserve_for(sizes: list[ComponentSizes], budget: int, fixed: Mapping[str, Policy]) -> int:
    """The activation reserve when none is given: :func:`~diffusers_residency.planner.default_reserve`,
    but never more than the least plan leaves of the budget. A small pipeline under a small budget
    (SD 1.5 on a 4 GB card) is then planned rather than refused, and its first call measures what
    its components really need."""
    try:
        least = plan_residency(sizes, budget, 0, fixed, least=True)
    except BudgetTooSmallError:
        return 0  # the weights alone do not fit: the plan's own error says how much they need
    return min(default_reserve(budget), budget - least.peak_weight_bytes)


def planner_for(
    pipe: DiffusionPipeline,
    modules: Mapping[str, nn.Module],
    components: Mapping[str, str] | None,
    budget: tuple[int, int | None] | None,
) -> Callable[..., ResidencyPlan]:
    """The plan for these components as a function of per-component activations, of policies to pin
    besides the user's, of components that can only move whole, of ``least``, of a plan ``chosen``
    before and of the plan in place (see :func:`~diffusers_residency.planner.plan_residency`):
    planned again when a call says what its components need. Under a budget, the choices of
    resident blocks its timed plans weigh are listed here, at enable (see
    :func:`~.kept_blocks.prepare_block_choices`)."""
    sizes = component_sizes(pipe, modules)
    policies = component_policies(pipe, modules, components)
    if budget is None:
        return lambda *args, **kwargs: plan_as_given(sizes, policies)
    # The user's choices, and the components diffusers keeps on the device, are fixed; the planner
    # places the rest.
    fixed = {
        name: policy for name, policy in policies.items() if name in (components or {}) or policy is Policy.RESIDENT
    }
    budget_bytes, reserve = budget
    if reserve is None:
        reserve = default_reserve_for(sizes, budget_bytes, fixed)
    searched = [s for s in sizes if fixed.get(s.name, Policy.STREAMED) is Policy.STREAMED]
    kept_blocks.prepare_block_choices(searched, PREFETCH_CHOICES)

    def plan(
        activations: Mapping[str, int],
        pinned: Mapping[str, Policy],
        whole: Collection[str] = (),
        timings: Mapping[str, StepTiming] | None = None,
        least: bool = False,
        chosen: Sequence[ComponentPlan] | None = None,
        incumbent: Sequence[ComponentPlan] = (),
    ) -> ResidencyPlan:
        # A component with no block hooks shows the planner no blocks: it cannot stream.
        planned = [replace(s, block_bytes=()) if s.name in whole else s for s in sizes]
        fixed_here = {**fixed, **pinned}
        return plan_residency(
            planned, budget_bytes, reserve, fixed_here, activations,
            timings=timings, least=least, chosen=chosen, incumbent=incumbent,
        )  # fmt: skip

    return plan


def placing_on_host(replan: Callable[..., ResidencyPlan], placement: HostPlacement) -> Callable[..., ResidencyPlan]:
    """``replan``, each plan carrying the host placement made at enable (which stays for good)."""
    return lambda *args, **kwargs: replace(replan(*args, **kwargs), host=placement)
