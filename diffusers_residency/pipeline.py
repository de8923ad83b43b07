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
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from accelerate.hooks import remove_hook_from_module
from diffusers import DiffusionPipeline
from torch import nn

from . import _device
from .hooks import StagingHook, attach_block_streaming, attach_staging_hook, check_attachable
from .planner import (
    BudgetTooSmallError,
    ComponentSizes,
    ResidencyPlan,
    StepTiming,
    default_reserve,
    format_bytes,
    parse_bytes,
    plan_as_given,
    plan_residency,
)
from .report import ResidencyReport, report_for
from .residency import Policy, ResidencyGroup
from .staging import module_tensors, refuse_meta_tensors, refuse_staged_elsewhere, storage_bytes
from .streaming import repeated_blocks

logger = logging.getLogger(__name__)

_STATE_ATTR = "_pinned_residency"
# Pipeline methods that may write into weights in place, text encoders' included (their LoRA is
# merged by a function, not a component method the hooks could wrap): run with every component
# offloaded, so the writes land in the masters. See hooks.IN_PLACE_WEIGHT_METHODS.
_IN_PLACE_PIPELINE_METHODS = ("fuse_lora", "unfuse_lora", "load_lora_weights")
# Kept on top of what a component was measured to need above its weights, as a fraction of the
# budget: the next call's activations may differ a little (another prompt length, say).
RESERVE_MARGIN = 0.02
# How far a step timed under the plan may be from the one the plan was made for before it is planned
# for again (see _Retime), as a fraction of the latter's compute or load time per byte.
RETIME_TOLERANCE = 0.1
# The components diffusers' pipelines call at every denoising step, by the names they all use.
_PER_STEP_COMPONENTS = ("transformer", "transformer_2", "unet")


@dataclass
class PipelineResidency:
    """What ``enable_pinned_offload`` set up on one pipeline."""

    group: ResidencyGroup
    hooks: dict[str, StagingHook]
    plan: ResidencyPlan
    # The plan for given per-component activations, with everything else as enabled (and the
    # policies given pinned besides).
    replan: Callable[..., ResidencyPlan]
    # Whether the first call measures each component's activations (no reserve given, and a plan
    # that does not keep everything on the device).
    measuring: bool = False
    # The first and last components of model_cpu_offload_seq: the ones that begin and end a call.
    call_start: str | None = None
    call_end: str | None = None
    # Per component, the calls it was planned more room in for allocator retries, and the
    # components no plan could give more room to for them (see _learn_overshoot).
    retry_replans: dict[str, int] = field(default_factory=dict)
    retries_left_alone: set[str] = field(default_factory=set)

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


def _offload_sequence(pipe: DiffusionPipeline) -> list[str]:
    """The components ``model_cpu_offload_seq`` names, in the order a call runs them."""
    return (pipe.model_cpu_offload_seq or "").split("->")


def _module_components(pipe: DiffusionPipeline) -> dict[str, nn.Module]:
    """nn.Module components in call order: ``model_cpu_offload_seq`` first, then the rest."""
    modules = {name: c for name, c in pipe.components.items() if isinstance(c, nn.Module)}
    sequence = _offload_sequence(pipe)
    ordered = {name: modules[name] for name in sequence if name in modules}
    ordered.update(modules)
    return ordered


def _default_policy(pipe: DiffusionPipeline, name: str) -> Policy:
    if name in pipe._exclude_from_cpu_offload:
        return Policy.RESIDENT
    if name not in _offload_sequence(pipe):
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


def _component_sizes(pipe: DiffusionPipeline, modules: Mapping[str, nn.Module]) -> list[ComponentSizes]:
    return [
        ComponentSizes(
            name=name,
            nbytes=storage_bytes(module_tensors((module,))),
            block_bytes=tuple(storage_bytes(module_tensors((block,))) for _, block in repeated_blocks(module)),
            per_step=name in _PER_STEP_COMPONENTS,
        )
        for name, module in modules.items()
    ]


def _resolve_budget(
    vram_budget: int | str | None, reserve: int | str | None, device: torch.device, modules: Mapping[str, nn.Module]
) -> tuple[int, int] | None:
    """The budget and activation reserve in bytes, or None where there is nothing to plan for."""
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
            storage_bytes(t for t in module_tensors((m,)) if _device.same_device(t.device, device)) for m in modules.values()
        )
        budget = memory.free + memory.cached + held
    else:
        budget = parse_bytes(vram_budget)
    reserve_bytes = default_reserve(budget) if reserve is None else parse_bytes(reserve, "activation_reserve")
    if reserve_bytes >= budget:
        raise ValueError(
            f"activation_reserve ({format_bytes(reserve_bytes)}) leaves nothing of vram_budget ({format_bytes(budget)}) "
            "for weights; lower the reserve or raise the budget"
        )
    return budget, reserve_bytes


def _planner(
    pipe: DiffusionPipeline,
    modules: Mapping[str, nn.Module],
    components: Mapping[str, str] | None,
    budget: tuple[int, int] | None,
) -> Callable[..., ResidencyPlan]:
    """The plan for these components as a function of per-component activations, of policies to pin
    besides the user's, of components that can only move whole, and of ``least`` (see
    :func:`~diffusers_residency.planner.plan_residency`): planned again when a call says what its
    components need."""
    sizes = _component_sizes(pipe, modules)
    chosen = _policies(pipe, modules, components)
    if budget is None:
        return lambda activations, pinned, whole=(), timings=None, least=False: plan_as_given(sizes, chosen)
    # The user's choices, and the components diffusers keeps on the device, are fixed; the planner
    # places the rest.
    fixed = {name: policy for name, policy in chosen.items() if name in (components or {}) or policy is Policy.RESIDENT}
    budget_bytes, reserve = budget

    def plan(
        activations: Mapping[str, int],
        pinned: Mapping[str, Policy],
        whole: Collection[str] = (),
        timings: Mapping[str, StepTiming] | None = None,
        least: bool = False,
    ) -> ResidencyPlan:
        # A component with no block hooks shows the planner no blocks: it cannot stream.
        planned = [replace(s, block_bytes=()) if s.name in whole else s for s in sizes]
        return plan_residency(
            planned, budget_bytes, reserve, {**fixed, **pinned}, activations, timings=timings, least=least
        )

    return plan


def _replan_in_place(
    state: PipelineResidency, activations: Mapping[str, int], timings: Mapping[str, StepTiming] | None = None
) -> ResidencyPlan:
    """The plan for ``activations`` (and ``timings``, by default the plan's) on the hooks in place:
    components that stream keep streaming (their blocks have hooks of their own; with every block
    resident, one is as good as resident), the others may move between staged and resident, not to
    streaming (they have no block hooks).

    Raises :class:`BudgetTooSmallError` when nothing fits."""
    streaming = {p.name: Policy.STREAMED for p in state.plan.components if p.policy is Policy.STREAMED}
    whole = [p.name for p in state.plan.components if p.policy is not Policy.STREAMED]
    return state.replan(activations, streaming, whole, state.plan.timings if timings is None else timings)


@dataclass
class _Retime:
    """Asked as each call starts (ResidencyGroup.on_call_start) after the measuring call's plan is
    applied: once every timed component has timed a step under the plan in place, plan again for
    those steps if one moved by more than RETIME_TOLERANCE from what the plan was made for. True
    once done; False, to be asked again at the next call start, while some step was not timed yet
    (a call-start component may run twice in one call, as the text encoders do under true CFG, and
    a call of fewer than three steps times none).

    The measuring call keeps the least on the device, and under a tight cap the allocator's retries
    (each a device synchronisation) fell inside its timed step: FLUX.1-dev at 8 GB on the H200
    machine timed 0.434 s of compute for a step that computes in 0.170 s, and the plan took the
    bus for the compute's equal."""

    state: PipelineResidency
    # The plan the steps are to be timed under, and each component's steps timed when it was applied.
    plan: ResidencyPlan
    steps_timed: dict[str, int]

    def __call__(self) -> bool:
        state = self.state
        if state.plan is not self.plan:
            # Planned again since (a component that retried under the cap, told as this call
            # started): the steps timed meanwhile may be stretched by those retries too.
            self.plan, self.steps_timed = state.plan, _steps_timed(state)
            return False
        planned = state.plan.timings
        steps_timed = _steps_timed(state)
        if not all(steps_timed.get(name, 0) > self.steps_timed.get(name, 0) for name in planned):
            return False
        timed = {name: timing for name, timing in _step_timings(state).items() if name in planned}
        moved = [
            name
            for name, timing in timed.items()
            if abs(timing.compute_per_byte - planned[name].compute_per_byte) > RETIME_TOLERANCE * planned[name].compute_per_byte
            or abs(timing.load_per_byte - planned[name].load_per_byte) > RETIME_TOLERANCE * planned[name].load_per_byte
        ]
        if moved:
            # The same activations as the plan in place: it fits (timings choose among fitting plans).
            new_plan = _replan_in_place(state, state.plan.activations, {**planned, **timed})
            _apply_policies(state, new_plan)
            logger.info("%s timed again under the plan; planned again: %s", moved, _plan_summary(new_plan))
        return True


def _steps_timed(state: PipelineResidency) -> dict[str, int]:
    """How many steps each streamed component has timed so far (see BlockStream.steps_timed)."""
    return {unit.component: unit.stream.steps_timed for unit in state.group.units if unit.stream is not None}


def _step_timings(state: PipelineResidency) -> dict[str, StepTiming]:
    """What the last call measured of each streamed per-step component's step: its blocks' compute
    seconds per block byte (the step the report shows, latest), and its loads' seconds per byte."""
    rows = {row.name: row for row in report_for(state.group).components}
    timings = {}
    for sizes in state.plan.sizes:
        row = rows.get(sizes.name) if sizes.per_step and state.plan[sizes.name].policy is Policy.STREAMED else None
        if row is None or row.step_compute_seconds is None or not row.loaded_bytes or row.load_seconds <= 0:
            continue
        timings[sizes.name] = StepTiming(
            compute_per_byte=row.step_compute_seconds[1] / sum(sizes.block_bytes),
            load_per_byte=row.load_seconds / row.loaded_bytes,
        )
    return timings


def _plan_summary(plan: ResidencyPlan) -> str:
    return ", ".join(
        f"{p.name} {p.policy.value}"
        + (f" ({len(p.resident_blocks)} blocks resident, {len(p.staged_blocks)} staged)" if p.policy is Policy.STREAMED else "")
        for p in plan.components
    )


def _learn_overshoot(state: PipelineResidency, component: str, overshoot: int, retried: bool) -> None:
    """``component`` needed more room than the plan gave it: the device's peak went ``overshoot``
    bytes over the budget while it ran, or (``retried``) the allocator ran out under a cap and had
    to free its cache and synchronise to go on. Count that, with a margin, and plan again. A retry
    says nothing of how much was missing: the margin alone is added, doubled at each call of the
    component that retries again (one margin once the doubled one finds no room), until none does.
    (SDXL's VAE decoding at 1024x1024 under an 8 GB cap retried twice a call, some 45 ms, with its
    measured need planned to the byte; it took three margins, so three calls with retries at one
    margin each, two when they double.) Retries that no plan has room for are warned about once,
    then left alone: they come at every call."""
    plan = state.plan
    margin = int(plan.budget * RESERVE_MARGIN)
    margins = [margin]
    if retried:
        if component in state.retries_left_alone:
            return
        times = state.retry_replans.get(component, 0)
        state.retry_replans[component] = times + 1
        # Doubled while the room lasts, then one margin at a time.
        margins = [margin << times, margin] if times else margins
    what = (
        f"Peak device memory went {format_bytes(overshoot)} over vram_budget"
        if overshoot
        else "The allocator ran out of room under its cap and retried"
    )
    for margin in margins:
        need = plan.activation_bytes_of(component) + overshoot + margin
        try:
            new_plan = _replan_in_place(state, {**plan.activations, component: need})
            break
        except BudgetTooSmallError:
            continue
    else:
        if retried:
            # Told once: the same retries come at every call, and nothing can be done about them.
            state.retries_left_alone.add(component)
        logger.warning(
            "%s while %r ran, and no plan leaves it more room; raise vram_budget (%s).",
            what,
            component,
            format_bytes(plan.budget),
        )
        return
    _apply_policies(state, new_plan)
    logger.warning(
        "%s while %r ran; planned again with %s for its activations: %s",
        what,
        component,
        format_bytes(need),
        _plan_summary(new_plan),
    )


def _learn_activations(state: PipelineResidency, measured: Mapping[str, int]) -> None:
    """The first call ran with the least on the device and measured what each component needed
    above the weights, and how long a step of a streamed per-step component computes and loads.
    Plan for those figures, each need with a margin, and apply the plan.

    Measured, not guessed: what a call needs varies across components far more than across calls
    (an SDXL VAE decoding at 1024x1024 in float32 needs about 5 GB, its UNet a fraction of that),
    and one reserve for all would either waste the denoiser's room or leave the decoder short."""
    plan = state.plan
    margin = int(plan.budget * RESERVE_MARGIN)
    activations = {**plan.activations, **{name: need + margin for name, need in measured.items()}}
    needs = ", ".join(f"{name} {format_bytes(need)}" for name, need in measured.items())
    try:
        new_plan = _replan_in_place(state, activations, _step_timings(state))
    except BudgetTooSmallError:
        logger.warning(
            "The first call measured %s above the weights; with margins no plan fits vram_budget %s, so the "
            "measuring plan stays (the least on the device). Raise vram_budget.",
            needs,
            format_bytes(plan.budget),
        )
        return
    _apply_policies(state, new_plan)
    if new_plan.timings:
        state.group.on_call_start = _Retime(state, new_plan, _steps_timed(state))
    logger.info(
        "The first call measured, above the weights: %s. Plan for vram_budget %s: %s",
        needs,
        format_bytes(plan.budget),
        _plan_summary(new_plan),
    )


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


def _same_setup(
    previous: PipelineResidency, group: ResidencyGroup, modules: Mapping[str, nn.Module], plan: ResidencyPlan
) -> bool:
    """Whether a new enable keeps the device, the pinning (and its budget), the modules and the
    streamed components of the previous one: then only policies change, and the masters stay."""
    streamed = {p.name for p in plan.components if p.policy is Policy.STREAMED}
    return (
        previous.group.device == group.device
        and previous.group.pin_memory == group.pin_memory
        and previous.group.pin_budget == group.pin_budget
        and {id(hook.unit.module) for hook in previous.hooks.values()} == {id(m) for m in modules.values()}
        # every hook still attached (one may have been detached on its own) and still in the group
        and all(getattr(h.unit.module, "_hf_hook", None) is h and h.unit in previous.group.units for h in previous.hooks.values())
        and streamed == {p.name for p in previous.plan.components if p.policy is Policy.STREAMED}
    )


def _apply_policies(state: PipelineResidency, plan: ResidencyPlan) -> None:
    """Give the units of an unchanged setup the policies of ``plan``; evictions follow at the next switch."""
    for component in plan.components:
        if component.name not in state.hooks:
            continue
        units = state.group.units_of(component.name)
        units[0].policy = component.policy
        for index, block in enumerate(units[1:]):
            policy = (
                Policy.RESIDENT
                if index in component.resident_blocks
                else Policy.STAGED
                if index in component.staged_blocks
                else Policy.STREAMED
            )
            if block.policy is not Policy.STREAMED and policy is Policy.STREAMED and block.stager.loaded:
                # Now streamed: its room goes to the blocks that now stay, before they load (and the
                # stream drops only blocks it loaded itself).
                block.stager.offload()
            block.policy = policy
        if units[0].policy is Policy.STREAMED:
            units[1].stream.replan(component.prefetch_blocks)
    state.plan = plan
    group = state.group
    group.weight_room = None if plan.budget is None else plan.weight_room
    if plan.budget is None:
        group.retention.reserved_limit = None  # under a budget, set at each switch (evict_others)
    if plan.budget is None:
        group.unwatch_budget()
    elif group.vram_budget != plan.budget:
        group.watch_budget(
            plan.budget,
            lambda component, overshoot, retried: _learn_overshoot(state, component, overshoot, retried),
            on_first_call=(lambda measured: _learn_activations(state, measured)) if state.measuring else None,
            call_start=state.call_start,
            call_end=state.call_end,
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
    vram_budget: int | str | None = "auto",
    activation_reserve: int | str | None = None,
    pin_memory: bool | None = None,
    pin_budget: int | float | None = None,
) -> None:
    """Stage the pipeline's components on ``device`` from pinned host masters.

    Args:
        device: where to compute; ``None`` takes the current accelerator (a ``RuntimeError`` where
            there is none). ``"cpu"`` runs the same mechanism unpinned, for machines without a GPU.
        components: component name -> ``"resident"`` (loaded once, kept), ``"staged"`` (on the
            device only while in use, loaded whole) or ``"streamed"`` (trunk and the blocks the
            planner picks kept, the other blocks loaded as they run). Named components keep the
            policy given; the others follow the plan for ``vram_budget``.
        vram_budget: device memory the pipeline may use, weights and activations together: bytes,
            a string such as ``"24GB"``, ``"auto"`` (the default: what the device has free now, plus
            what the components hold there) or ``None`` (no plan: components in
            ``model_cpu_offload_seq`` are staged, the others resident, as diffusers' model offload
            does). A device that reports no free memory (the CPU) plans nothing under ``"auto"``.
            ``pipe.residency_plan()`` shows the plan.
        activation_reserve: the part of ``vram_budget`` kept free for what a component needs above
            its weights while it runs (a call's tensors, activations, the allocator's slack), the
            same for every component. Default: measured per component, in the first call under a
            budget that cannot keep everything on the device; that call runs with the least on the
            device, then the plan keeps the most that fits what each component was measured to
            need (see :func:`_learn_activations`). Until then, and for a component not measured, a
            tenth of the budget, at least 3 GiB. Either way a component whose peak goes over the
            budget gets more room from the next call on.
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
    ours = [unit.stager for unit in previous.group.units] if previous else []
    for name, module in modules.items():
        check_attachable(module, name, previous.group if previous else None)
        refuse_meta_tensors((module,), f"Component {name!r}")
        refuse_staged_elsewhere((module,), f"Component {name!r}", ours)
    _refuse_shared_weights(modules)
    budget = _resolve_budget(vram_budget, activation_reserve, group.device, modules)
    replan = _planner(pipe, modules, components, budget)
    plan = replan({}, {})
    sequence = [name for name in _offload_sequence(pipe) if name in modules]
    # A call is told apart from the next only by its first component starting after its last ran:
    # with one component in the sequence, no call would ever end, so nothing is measured.
    measuring = (
        budget is not None and activation_reserve is None and not plan.keeps_everything and len(set(sequence)) > 1
    )
    if measuring:
        plan = replan({}, {}, least=True)

    if previous is not None and _same_setup(previous, group, modules, plan):
        # Only the policies change: keep the masters rather than giving them up and pinning again.
        previous.replan = replan
        previous.measuring = measuring
        # What retries taught was for the budget and plan before: learned again for these.
        previous.retry_replans.clear()
        previous.retries_left_alone.clear()
        previous.group.retention.release_over_limit_before.clear()
        previous.group.unwatch_budget()  # watched again for the new plan, the peak reset
        _apply_policies(previous, plan)
        _load_excluded(pipe, previous)
        return
    if previous is not None:
        disable_pinned_offload(pipe)
    hooks: dict[str, StagingHook] = {}
    attached: dict[int, str] = {}
    try:
        for component in plan.components:
            name, module = component.name, modules[component.name]
            if id(module) in attached:
                logger.info("%r is the same module as %r; staging it once", name, attached[id(module)])
                continue
            if component.policy is Policy.STREAMED:
                hooks[name] = attach_block_streaming(
                    module,
                    group,
                    name=name,
                    resident_blocks=component.resident_blocks,
                    prefetch_blocks=component.prefetch_blocks,
                )
            else:
                hooks[name] = attach_staging_hook(module, group, name=name, policy=component.policy)
            attached[id(module)] = name
        state = PipelineResidency(
            group=group,
            hooks=hooks,
            plan=plan,
            replan=replan,
            measuring=measuring,
            call_start=sequence[0] if sequence else None,
            call_end=sequence[-1] if sequence else None,
        )
        group.call_order = tuple(modules)
        _apply_policies(state, plan)
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
    logger.info("Pinned offload on %s:\n%s", group.device, plan)


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


def residency_plan(pipe: DiffusionPipeline) -> ResidencyPlan:
    """The plan in force (as ``enable_pinned_offload`` made it, or as calls since had it replanned):
    each component's policy and, for streamed ones, which blocks stay resident and how many load
    ahead; printing it gives a table."""
    state = pipeline_state(pipe)
    if state is None:
        raise RuntimeError("Pinned offload is not enabled on this pipeline; call pipe.enable_pinned_offload() first.")
    return state.plan


def _offloaded_first(
    pipe: DiffusionPipeline, state: PipelineResidency, method: Callable[..., Any]
) -> Callable[..., Any]:
    @functools.wraps(method)
    def offloaded_first(*args: Any, **kwargs: Any) -> Any:
        for name in state.hooks:
            state.group.offload_component(name, for_writing=True)  # each loads again at its next forward
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
