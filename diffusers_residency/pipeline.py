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
import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from accelerate.hooks import remove_hook_from_module
from diffusers import DiffusionPipeline
from torch import nn

from .adaptive import plan_ahead, watch_budget
from .attaching import attach_block_streaming, attach_staging_hook, check_attachable
from .calls import wrap_every_pipeline_call
from .casts import guessed_casts, leaves_as_it_is, warm_casts
from .components import module_components, offload_sequence, placing_on_host, planner_for, resolve_budget
from .default_call import is_encoder
from .dry_runs import CallDryRuns
from .guards import guard_pipeline, unguard_pipeline
from .hooks import StagingHook
from .host_budget import file_backing, file_sources, place_on_host, resolve_host_budget
from .masters import refuse_staged_elsewhere
from .pipeline_residency import RESERVE_MARGIN, STATE_ATTR, PipelineResidency, apply_plan
from .planner import default_reserve
from .plans import BudgetTooSmallError, ResidencyPlan
from .policy import Policy
from .profile import ResidencyProfile, read_profile, starting_profile, write_profile
from .report import ResidencyReport, report_for
from .residency import ResidencyGroup
from .shared_masters import failures_told, refuse_unsharable, share_host_weights
from .step_timing import StepTiming
from .weights import module_tensors, refuse_shared_quantization_state, refuse_unstageable_tensors

logger = logging.getLogger(__name__)


def pipeline_state(pipe: DiffusionPipeline) -> PipelineResidency | None:
    """What ``enable_pinned_offload`` set up on ``pipe``, or None (also once every hook was removed)."""
    state = pipe.__dict__.get(STATE_ATTR)
    if state is not None and not state.active_in(pipe):
        _forget(pipe)
        return None
    return state


def _forget(pipe: DiffusionPipeline) -> None:
    pipe.__dict__.pop(STATE_ATTR, None)
    unguard_pipeline(pipe)


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
        # each under the name it had (two swapped are another setup: policies are given by name)
        and all(modules.get(name) is hook.unit.module for name, hook in previous.hooks.items())
        # every hook still attached (one may have been detached on its own) and still in the group
        and all(getattr(h.unit.module, "_hf_hook", None) is h and h.unit in previous.group.units for h in previous.hooks.values())
        and streamed == {p.name for p in previous.plan.components if p.policy is Policy.STREAMED}
        and previous.plan.host.served == plan.host.served
    )


def _load_excluded(pipe: DiffusionPipeline, state: PipelineResidency) -> None:
    # diffusers keeps these on the device because pipelines may use them without calling them. One
    # asleep stays so: reloaded after a deepcopy or a LoRA method, it would hold device memory
    # while the pipeline sleeps (its wake or next call loads it).
    for name in pipe._exclude_from_cpu_offload:
        if name in state.hooks and not state.hooks[name].unit.sleep_level:
            state.group.activate(state.hooks[name].unit)


def _written(pipe: DiffusionPipeline, state: PipelineResidency) -> None:
    """After a pipeline method wrote into the weights (every component offloaded for it)."""
    state.group.own_copies_of_written()
    _load_excluded(pipe, state)


def _hooked_whole(
    profile: ResidencyProfile,
    replan: Callable[..., ResidencyPlan],
    encoders: Collection[str],
    whole_before: Collection[str],
    dry_runs: CallDryRuns | None,
) -> list[str]:
    """The ``encoders`` to hook whole rather than block by block: those that the plan for the
    figures of the profile's first call shape (the one ``plan_ahead`` plans for) does not stream,
    or, with no profile, the plan for what ``dry_runs`` estimate of a call of the pipeline's default
    size (its decoder's need; the activation reserve for the others, and for every component where
    no dry run estimates one); and, enabled again, those hooked whole so before.

    Hooks are attached once, here, and later plans keep them (see ``pipeline_residency.replan_in_place``):
    hooked by blocks, a component streams for good; hooked whole, it never streams. A process with
    no profile hooks whole what its estimate stages, as one with a profile would: streamed instead,
    SDXL's second text encoder at 8 GB loads its 33 blocks one by one at every call, each waiting for
    its copy behind a compute too short to hide it, where a process with a profile loads it in one.
    Encoders only (see :func:`_encoders`): what they need does not grow with the image, where a VAE
    decoding a larger one needs more room, which a whole hook would take at its moment for every
    later shape. A call of a shape the profile lacks is measured under the least plan these hooks
    allow, with the activation reserve for each component: an encoder whose whole leaves no room
    for that stays hooked by blocks."""
    unmeasured = replan({}, {})
    sizes = {s.name: s for s in unmeasured.sizes}
    candidates = set(whole_before)
    first = profile.first_shape()
    activations: Mapping[str, int] = {}
    timings: Mapping[str, StepTiming] = {}
    if first is not None:
        activations, timings = profile.shapes[first].activations, profile.shapes[first].timings
    elif dry_runs is not None and (need := dry_runs.decoder.need({})) is not None:
        activations = {dry_runs.decoder.name: need + int(unmeasured.budget * RESERVE_MARGIN)}
    try:
        plan = replan(activations, {}, timings=timings)
        candidates |= {p.name for p in plan.components if p.policy is not Policy.STREAMED}
    except BudgetTooSmallError:
        pass  # figures for other policies given, or a need no plan fits: no candidate from them
    whole: list[str] = []
    for name in sorted(candidates & set(encoders), key=lambda name: sizes[name].nbytes):
        if not sizes[name].per_step:
            try:
                replan({}, {}, [*whole, name], least=True)
            except BudgetTooSmallError:
                continue
            whole.append(name)
    return whole


def _encoders(modules: Mapping[str, nn.Module], given: Collection[str]) -> list[str]:
    """The encoders among the components (see ``default_call.is_encoder``), but those given a policy."""
    return [name for name, module in modules.items() if is_encoder(module) and name not in given]


def enable_pinned_offload(
    pipe: DiffusionPipeline,
    device: str | torch.device | None = None,
    *,
    components: Mapping[str, str] | None = None,
    vram_budget: int | str | None = "auto",
    activation_reserve: int | str | None = None,
    pin_memory: bool | None = None,
    pin_budget: int | float | None = None,
    host_budget: int | float | str | None = None,
    offload_folder: str | os.PathLike | None = None,
    share_host_masters: bool = False,
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
            same for every component. Default: measured per component, in the first call of each
            call shape under a budget that cannot keep everything on the device (or, from a
            residency profile, in an earlier process); that call runs with the least on the device
            until its denoiser starts, then under a plan from dry runs of the denoiser's inputs and
            of a decode of the call's size (see :mod:`.dry_runs`; calls they do not follow, until
            the denoiser's first step is measured), and after it the plan keeps the most that fits
            what each component was measured to need (see :mod:`.adaptive`). Until then, and for
            a component not measured, a tenth of the budget, at least 3 GiB, but no more than the
            measuring plan's weights leave. Either way a component whose peak goes over the budget
            gets more room from the next call on.
        pin_memory: pin the host masters; defaults to whether ``device`` is an accelerator. Masters
            are weights' own host memory, page-locked in place where the platform allows (CUDA);
            weights on the device are copied down once into blocks sized to them.
        pin_budget: the most host memory the package keeps page-locked in this process, every
            pipeline's masters counted, in bytes or as a fraction of the memory the process may have
            (physical RAM, or a container's cgroup limit where lower; default 0.75).
            Masters beyond it stay pageable: loads still work, at the pageable copy rate, and the
            report's ``pageable GB`` column shows them.
        host_budget: the most host memory the masters may take, in bytes, a string such as
            ``"16GB"``, a fraction of the memory the process may have, or ``"auto"`` (what the
            machine and the cgroups over the process allow, less a margin); None (the default):
            every master in RAM. Beyond it, the masters loaded least often (components kept on
            the device, then those loaded once per call, then a denoiser's streamed blocks) are
            served from the pipeline's safetensors files, mapped, and load through a ring of
            page-locked slots (see :mod:`.host_budget`).
        offload_folder: where weights served from files are written once when the pipeline was
            not loaded from files, or they changed since (without it, such a pipeline is refused
            a ``host_budget`` it cannot meet from RAM).
        share_host_masters: under ``torch.distributed``, keep one host copy of the weights per host,
            mapped by each of its ranks, instead of one per rank (data-parallel serving, one
            pipeline per GPU). Collective: every rank enables the same pipeline, loaded on the host,
            from the same checkpoint (checked byte for byte). Each rank's writes stay its own (see
            :mod:`.shared_masters`).

    Calling it again reconfigures the pipeline: with the same device and pinning only the policies
    change and the masters are kept; otherwise pinned offload is disabled and set up anew. All
    arguments are checked before anything changes.
    """
    previous = pipeline_state(pipe)
    enable_again = functools.partial(
        _enable_again,
        device=device,
        components=components,
        vram_budget=vram_budget,
        activation_reserve=activation_reserve,
        pin_memory=pin_memory,
        pin_budget=pin_budget,
        host_budget=host_budget,
        offload_folder=offload_folder,
        share_host_masters=share_host_masters,
    )
    # A rank that fails here tells the others, which would otherwise wait for it to share.
    with failures_told(share_host_masters):
        group = ResidencyGroup(device, pin_memory=pin_memory, pin_budget=pin_budget)
        modules = module_components(pipe)
        ours = [unit.stager for unit in previous.group.units] if previous else []
        for name, module in modules.items():
            check_attachable(module, name, previous.group if previous else None)
            refuse_unstageable_tensors((module,), f"Component {name!r}")
            refuse_staged_elsewhere((module,), f"Component {name!r}", ours)
        refuse_shared_quantization_state(modules.values())
        _refuse_shared_weights(modules)
        budget = resolve_budget(vram_budget, activation_reserve, group.device, modules)
        host = resolve_host_budget(host_budget)
        if offload_folder is not None and not isinstance(offload_folder, (str, os.PathLike)):
            raise TypeError(f"offload_folder is a folder's path, not {offload_folder!r}")
        if share_host_masters:
            refuse_unsharable(modules, enabled=previous is not None, host_budget=host)
        replan = planner_for(pipe, modules, components, budget)
        plan = replan({}, {})
        # Served from files at enable, for good: placed from the plan before any call is measured,
        # with the casts its calls are expected to make.
        expected = guessed_casts(pipe).items()
        casts = {name: trip for name, trip in expected if name in modules and leaves_as_it_is(modules[name], trip)}
        placement = place_on_host(plan, host, casts)
        replan = placing_on_host(replan, placement)
        plan = replace(plan, host=placement)
        sequence = [name for name in offload_sequence(pipe) if name in modules]
        # A call is told apart from the next only by its first component starting after its last ran:
        # with one component in the sequence, no call would ever end, so nothing is measured.
        # A default reserve capped by a small budget is no estimate of what the components need: measure.
        capped = budget is not None and plan.reserve < default_reserve(budget[0])
        measuring = (
            budget is not None
            and activation_reserve is None
            and (not plan.keeps_everything or capped)
            and len(set(sequence)) > 1
        )
        profile, profile_file, hooked_whole, dry_runs = None, None, [], None
        if measuring:
            given = {name: Policy.parse(value, name).value for name, value in (components or {}).items()}
            profile, profile_file = starting_profile(
                type(pipe).__name__, modules, budget[0], group.device, group.pin_memory, given
            )
            dry_runs = CallDryRuns.of(pipe, modules, sequence, casts)
            whole_before = previous.hooked_whole if previous is not None else ()
            hooked_whole = _hooked_whole(profile, replan, _encoders(modules, given), whole_before, dry_runs)
            plan = replan({}, {}, hooked_whole, least=True)
    wrap_every_pipeline_call()

    if share_host_masters:
        group.host_copy = share_host_weights(modules, group.pin_budget if group.pin_memory else None, group.device)
    if previous is not None and _same_setup(previous, group, modules, plan):
        # Only the policies change: keep the masters rather than giving them up and pinning again.
        previous.replan = replan
        previous.measuring = measuring
        previous.profile, previous.profile_file, previous.shape = profile, profile_file, None
        previous.hooked_whole = tuple(hooked_whole)
        previous.dry_runs = dry_runs
        previous.enable_again = enable_again
        previous.staged_names = {name: id(module) for name, module in modules.items()}
        previous.group.forget_estimates()  # set for the setup before, if any
        previous.measured_shapes.clear()
        previous.estimates_failed.clear()
        # What retries taught was for the budget and plan before: learned again for these.
        previous.retry_replans.clear()
        previous.retries_left_alone.clear()
        previous.group.retention.forget_releases()
        previous.group.budget_watch = None  # watched again for the new plan, the peak reset
        apply_plan(previous, plan)
        watch_budget(previous)
        _load_excluded(pipe, previous)
        plan_ahead(previous, guessed_casts(pipe))
        return
    sources = file_sources(pipe, modules, placement, offload_folder)
    if previous is not None:
        disable_pinned_offload(pipe)
    hooks: dict[str, StagingHook] = {}
    attached: dict[int, str] = {}
    backing = {}
    try:
        # The ring is made once the previous setup is gone: its slots count against the pin budget.
        backing = file_backing(sources, placement, budget=group.pin_budget, pin=group.pin_memory, device=group.device)
        group.file_backing = backing
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
            profile=profile,
            profile_file=profile_file,
            hooked_whole=tuple(hooked_whole),
            dry_runs=dry_runs,
            enable_again=enable_again,
            staged_names={name: id(module) for name, module in modules.items()},
        )
        group.call_order = tuple(modules)
        apply_plan(state, plan)
        watch_budget(state)
        _load_excluded(pipe, state)
    except BaseException:
        for name in hooks:
            remove_hook_from_module(modules[name])
        for served in backing.values():
            served.ring.close()
        raise

    pipe.__dict__[STATE_ATTR] = state

    def offload_all() -> None:
        for name in state.hooks:
            state.group.offload_component(name, for_writing=True)

    guard_pipeline(
        pipe,
        lock=group.call_lock,
        enabled=lambda: pipeline_state(pipe) is not None,
        offload_all=offload_all,
        after_writing=lambda: _written(pipe, state),
        reload=lambda: _load_excluded(pipe, state),
        hooked_modules=lambda: [unit.module for unit in state.group.units],
        state_attribute=STATE_ATTR,
    )
    plan_ahead(state, guessed_casts(pipe))
    logger.info("Pinned offload on %s:\n%s", group.device, state.plan)


def _enable_again(pipe: DiffusionPipeline, *, components: Mapping[str, str] | None, **arguments: Any) -> None:
    """``enable_pinned_offload`` as it was called, for a component replaced since (see
    PipelineResidency.staging_replaced); components named then that are gone (set to None) left out."""
    if components is not None:
        present = module_components(pipe)
        components = {name: policy for name, policy in components.items() if name in present}
    enable_pinned_offload(pipe, components=components, **arguments)


def disable_pinned_offload(pipe: DiffusionPipeline) -> None:
    """Remove every staging hook. Each component keeps bit-identical weights on the device it had
    before ``enable_pinned_offload``. A no-op on a pipeline without pinned offload."""
    state = pipeline_state(pipe)
    if state is None:
        return
    failures = []
    for name, hook in state.hooks.items():
        module = hook.unit.module
        current = getattr(module, "_hf_hook", None)
        # A hook attached again in the group by a script (attach_staging_hook) goes too.
        if isinstance(current, StagingHook) and current.group is state.group:
            try:
                remove_hook_from_module(module)
            except Exception as exc:  # the others are still detached; this one keeps its hook
                failures.append((name, exc))
    if failures:
        name, exc = failures[0]
        if isinstance(exc, torch.OutOfMemoryError):
            raise RuntimeError(
                f"could not move {[n for n, _ in failures]} back to the device they were on; they are still "
                "staged, on their host masters. Free device memory and call disable_pinned_offload() again."
            ) from exc
        # Not for want of memory (a checkpoint file a level-2 sleep mapped changed since): say why.
        raise RuntimeError(
            f"could not give {[n for n, _ in failures]} back their weights; they are still staged: {exc}"
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


def _profile_of(pipe: DiffusionPipeline) -> ResidencyProfile:
    state = pipeline_state(pipe)
    if state is None or state.profile is None:
        raise RuntimeError(
            "This pipeline has no residency profile: calls are measured only under a vram_budget with no "
            "activation_reserve given, where the plan cannot keep everything on the device. Call "
            "pipe.enable_pinned_offload(vram_budget=...) first."
        )
    return state.profile


def residency_profile(pipe: DiffusionPipeline) -> ResidencyProfile:
    """What calls measured so far, per call shape, with what it holds for (device, budget, versions);
    printing it gives a summary. Kept in the cache folder as calls measure (see :mod:`.profile`)."""
    return _profile_of(pipe)


def save_residency_profile(pipe: DiffusionPipeline, path: str | os.PathLike) -> None:
    """Write the pipeline's residency profile to ``path`` (a JSON file), e.g. to ship it with a
    service's image so that its first calls are planned from it."""
    write_profile(Path(path), _profile_of(pipe))


def load_residency_profile(pipe: DiffusionPipeline, path: str | os.PathLike) -> bool:
    """Plan from the figures in ``path`` (saved by :func:`save_residency_profile`) for the call
    shapes it holds, from the next call on. A profile measured for another setup (GPU, budget,
    architecture, dtype, library version) is not used: the log says why, and this returns False."""
    profile = _profile_of(pipe)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no residency profile at {path}")
    loaded = read_profile(path, profile.key)
    if loaded is None:
        return False
    profile.shapes.update(loaded.shapes)
    state = pipeline_state(pipe)
    state.measured_shapes.difference_update(loaded.shapes)
    state.shape = None  # the next call plans for its shape again, from these figures if it has them
    first = loaded.first_shape()
    if first is not None:
        warm_casts(state.group, loaded.shapes[first].casts)
    return True
