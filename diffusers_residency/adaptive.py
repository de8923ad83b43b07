"""Plans that learn from calls: what the first call of each shape measured, what overshoots and
allocator retries taught, steps timed again under the plan; and the residency profile that keeps
those figures per call shape, so that a shape seen before, in this process or an earlier one, is
planned right from its first call.

A pipeline call is seen whole here (see ``pipeline``'s call wrapper): :func:`begin_call` plans for
the call's shape before its first component runs, :func:`end_call` closes what the call measured
once it returns, so that what one shape taught never lands in another shape's plan.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from .budget_watch import BudgetWatch
from .casts import lossless_round_trip, warm_casts
from .dry_runs import CallDryRuns
from .hooks import StagingHook
from .plans import BudgetTooSmallError, ComponentPlan, ResidencyPlan
from .policy import Policy
from .profile import CallFigures, ResidencyProfile, covering_shape, shape_parts, write_profile
from .residency import ResidencyGroup
from .retiming import Retime, step_timings, steps_timed, timing_so_far
from .step_timing import StepTiming
from .text import format_bytes

logger = logging.getLogger(__name__)

# Kept on top of what a component was measured to need above its weights, as a fraction of the
# budget: the next call's activations may differ a little (another prompt length, say).
RESERVE_MARGIN = 0.02
# How a plan made from estimates says where they come from: a larger call shape's figures (see
# begin_call), or dry runs of the call under way (see estimate_at_start).
ESTIMATED = "estimated"
COVERING = f"{ESTIMATED} from calls of"
DRY_RUN = f"{ESTIMATED} by dry runs of this call's denoiser and decoder"
# How a plan made again for allocator retries says why (see learn_overshoot).
RETRIED = "The allocator ran out of room under its cap and retried"


# The attribute of a pipeline that holds its PipelineResidency.
STATE_ATTR = "_pinned_residency"


@dataclass
class PipelineResidency:
    """What ``enable_pinned_offload`` set up on one pipeline."""

    group: ResidencyGroup
    hooks: dict[str, StagingHook]
    plan: ResidencyPlan
    # The plan for given per-component activations, with everything else as enabled (and the
    # policies given pinned besides).
    replan: Callable[..., ResidencyPlan]
    # Whether calls are measured: the first of each call shape measures each component's
    # activations (no reserve given, and a plan that does not keep everything on the device).
    measuring: bool = False
    # The first and last components of model_cpu_offload_seq: the ones that begin and end a call.
    call_start: str | None = None
    call_end: str | None = None
    # Per component, the calls it was planned more room in for allocator retries, and the
    # components no plan could give more room to for them (see learn_overshoot).
    retry_replans: dict[str, int] = field(default_factory=dict)
    retries_left_alone: set[str] = field(default_factory=set)
    # What calls measured, per call shape, and the file it is kept in (None: not kept); None when
    # nothing is measured (no budget, a reserve given, or a plan that keeps everything).
    profile: ResidencyProfile | None = None
    profile_file: Path | None = None
    # Encoders hooked whole from a profile's figures (see pipeline._hooked_whole): enabled again,
    # they stay so, whether or not the profile is found again.
    hooked_whole: tuple[str, ...] = ()
    # The shape of the call under way, or of the last one (see begin_call), and the shapes whose
    # figures this process measured (the others came from the profile).
    shape: str | None = None
    measured_shapes: set[str] = field(default_factory=set)
    # Shapes an estimate failed (its call ran out of memory, or measured needs that fit no plan): the
    # least on the device for them from then on.
    estimates_failed: set[str] = field(default_factory=set)
    # Set while a pipeline call is under way (see calls._wrap_call): calls within it are not
    # planned for on their own. Pipelines are not thread-safe, and neither is this.
    in_call: bool = False
    # What estimates a measured call's needs before they are measured (None: the pipeline's calls
    # are not denoiser then decoder).
    dry_runs: CallDryRuns | None = None

    @property
    def active(self) -> bool:
        """False once every hook is gone, e.g. after ``pipe.remove_all_hooks()``."""
        return bool(self.group.units)


def apply_plan(state: PipelineResidency, plan: ResidencyPlan) -> None:
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
        group.budget_watch = None
    elif group.budget_watch is None or group.budget_watch.vram_budget != plan.budget:
        _watch(state, measure=state.measuring)


def _watch(state: PipelineResidency, *, measure: bool, estimated: bool = False) -> None:
    """Watch the budget for overshoots and retries and, with ``measure``, measure the next whole call
    (``estimated``: under a plan from a larger shape's figures, see begin_call)."""
    group = state.group
    group.budget_watch = BudgetWatch(
        group.device,
        group.retention,
        group.loaded_bytes,
        state.plan.budget,
        lambda component, overshoot, retried: learn_overshoot(state, component, overshoot, retried),
        on_first_call=(lambda measured, retried: learn_activations(state, measured, retried)) if measure else None,
        on_first_step=(lambda component, need: learn_first_step(state, component, need)) if measure else None,
        call_start=state.call_start,
        call_end=state.call_end,
        # Under an estimate a component is not given the most room, and under a cap a retry is
        # all that shows it was short: told as the call returns, for the plan of its shape.
        retries_while_measuring=estimated,
    )


def replan_in_place(
    state: PipelineResidency,
    activations: Mapping[str, int],
    timings: Mapping[str, StepTiming] | None = None,
    chosen: Sequence[ComponentPlan] | None = None,
) -> ResidencyPlan:
    """The plan for ``activations`` (and ``timings``, by default the plan's) on the hooks in place:
    components that stream keep streaming (their blocks have hooks of their own; with every block
    resident, one is as good as resident), the others may move between staged and resident, not to
    streaming (they have no block hooks). ``chosen``: the plan made before for these figures (see
    plan_residency).

    Raises :class:`BudgetTooSmallError` when nothing fits."""
    streaming, whole = _hooked(state)
    timings = state.plan.timings if timings is None else timings
    plan = state.replan(activations, streaming, whole, timings, chosen=chosen)
    return replace(plan, source="measured", shape=state.shape)


def _time_steps_again(state: PipelineResidency, plan: ResidencyPlan) -> None:
    """Time the steps again under ``plan``, from the next call start on (see :class:`~.retiming.Retime`)."""
    if state.group.budget_watch is not None:
        replan = functools.partial(_replan_for_timings, state)
        state.group.budget_watch.on_call_start = Retime(state, plan, steps_timed(state.group), replan)


def _replan_for_timings(state: PipelineResidency, timings: Mapping[str, StepTiming]) -> ResidencyPlan:
    # The same activations as the plan in place: it fits (timings choose among fitting plans).
    plan = replan_in_place(state, state.plan.activations, timings)
    apply_plan(state, plan)
    return plan


def learn_overshoot(state: PipelineResidency, component: str, overshoot: int, retried: bool) -> None:
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
    what = f"Peak device memory went {format_bytes(overshoot)} over vram_budget" if overshoot else RETRIED
    for margin in margins:
        need = plan.activation_bytes_of(component) + overshoot + margin
        try:
            new_plan = replan_in_place(state, {**plan.activations, component: need})
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
    apply_plan(state, new_plan)
    logger.warning(
        "%s while %r ran; planned again with %s for its activations: %s",
        what,
        component,
        format_bytes(need),
        new_plan.summary(),
    )


def learn_activations(state: PipelineResidency, measured: Mapping[str, int], retried: Sequence[str] = ()) -> None:
    """The first call of a shape ran with the least on the device (or under a plan estimated from a
    larger shape's figures) and measured what each component needed above the weights, and how long
    a step of a streamed per-step component computes and loads.
    Plan for those figures, each need with a margin, and apply the plan.

    Measured, not guessed: what a call needs varies across components far more than across calls
    (an SDXL VAE decoding at 1024x1024 in float32 needs about 5 GB, its UNet a fraction of that),
    and one reserve for all would either waste the denoiser's room or leave the decoder short.

    The components that made the allocator retry under an estimate (``retried``) get the margin
    :func:`learn_overshoot` would give them in this same plan, where it fits: a timed plan of
    FLUX.1-dev takes the host tens of milliseconds (``bench.planning``), and the call's caller waits
    for what is planned as it returns."""
    plan = state.plan
    margin = int(plan.budget * RESERVE_MARGIN)
    activations = {**plan.activations, **{name: need + margin for name, need in measured.items()}}
    with_retries = {**activations, **{name: activations.get(name, plan.reserve) + margin for name in retried}}
    needs = ", ".join(f"{name} {format_bytes(need)}" for name, need in measured.items())
    # A component whose step this call did not time (a call of fewer than three steps) keeps the
    # timing the plan had, or takes the latest one timed, in an earlier call.
    timings = {**plan.timings, **step_timings(state.group, state.plan)}
    new_plan = None
    for planned in (with_retries, activations) if retried else (activations,):
        try:
            new_plan = replan_in_place(state, planned, timings)
            break
        except BudgetTooSmallError:
            continue
    if new_plan is None:
        logger.warning(
            "%s measured %s above the weights; with margins no plan fits vram_budget %s, so the plan it "
            "ran under stays. Raise vram_budget.",
            _first_call(state),
            needs,
            format_bytes(plan.budget),
        )
        if plan.source.startswith(ESTIMATED):
            # The estimate did not bound this shape's needs: the least on the device from here on,
            # as a measuring call leaves it, and nothing kept as this shape's figures (nor learned
            # from retries under the estimate).
            state.estimates_failed.add(state.shape)
            _apply_least_plan(state)
            state.group.budget_watch.drop_retries()
            return
    else:
        apply_plan(state, new_plan)
        state.group.load_resident_ahead()
        if new_plan.timings:
            _time_steps_again(state, new_plan)
        logger.info(
            "%s measured, above the weights: %s. Plan for vram_budget %s: %s",
            _first_call(state),
            needs,
            format_bytes(plan.budget),
            new_plan.summary(),
        )
    for name in retried:
        if new_plan is not None and planned is with_retries:
            # Counted as learn_overshoot counts its first: a shape measured anew starts with none
            # counted and none left alone (see begin_call).
            state.retry_replans[name] = 1
            logger.warning(
                "%s while %r ran; planned with %s for its activations", RETRIED, name, format_bytes(planned[name])
            )
        else:
            # The margins found no room together: each is tried on its own, as later retries are.
            learn_overshoot(state, name, 0, True)


def _first_call(state: PipelineResidency) -> str:
    return f"The first call of {state.shape}" if state.shape else "The first call"


def learn_first_step(state: PipelineResidency, component: str, need: int) -> None:
    """A measured call's per-step ``component`` ran its first step, streaming every block, and
    needed ``need`` bytes above the weights. For the call's other steps it keeps the blocks its own
    moment has room for: staged, so that they leave the device to the components after it, whose
    needs are not known yet."""
    sizes = next(s for s in state.plan.sizes if s.name == component)
    if not sizes.per_step or component in state.plan.activations:
        return
    streaming, whole = _hooked(state)
    activations = {**state.plan.activations, component: need + int(state.plan.budget * RESERVE_MARGIN)}
    try:
        plan = state.replan(activations, streaming, whole, least=True)
    except BudgetTooSmallError:
        return  # its own need leaves no room for more than the measuring plan: it keeps that
    apply_plan(state, plan)
    logger.info("%r's first step needed %s above the weights; its other steps keep %d blocks",
                component, format_bytes(need), len(plan[component].staged_blocks))  # fmt: skip


def estimate_at_start(state: PipelineResidency, decoder_need: int, component: str, args: tuple, kwargs: dict) -> None:
    """Told the inputs of each component that starts in a call measured with dry runs at hand (see
    begin_call, which estimated the decoder's ``decoder_need``): as the denoiser first starts,
    estimate its need from a dry run of its inputs, and plan the rest of the call for that, the
    decoder's estimate, and what the components that ran before it (text encoders) were measured
    to need. The denoiser's steps then keep what the
    budget has room for from the first one on, and the decoder finds room beside what stays,
    rather than the call streaming every block and loading what stays once it returns. The call
    is measured all the same, and its plan made again from what it measured."""
    runs, watch = state.dry_runs, state.group.budget_watch
    if runs is None or watch is None or not watch.measures_next_call:
        state.group.forget_estimates()  # set for a setup or a call that is gone
        return
    if component != runs.denoiser or component == watch.running:
        return
    state.group.estimate_from_inputs = None
    need = runs.forward.need(args, kwargs)
    if need is None:
        return
    margin = int(state.plan.budget * RESERVE_MARGIN)
    estimates = {component: need, runs.decoder.name: decoder_need}
    needs = {**watch.measured_so_far(), **estimates}
    try:
        activations = {**state.plan.activations, **{name: bytes_ + margin for name, bytes_ in needs.items()}}
        plan = replan_in_place(state, activations)
    except BudgetTooSmallError:
        return  # measured with the least on the device, as a call without estimates
    apply_plan(state, replace(plan, source=DRY_RUN))
    # Under an estimate a retry is all that shows a component was short (see _watch).
    watch.retries_while_measuring = True
    state.group.make_room_to_retry = functools.partial(make_room_to_retry, state)
    if component not in plan.timings and plan[component].policy is Policy.STREAMED:
        state.group.plan_from_timed_step = functools.partial(plan_from_timed_step, state)
    logger.info(
        "Dry runs estimate for calls of %s, above the weights: %s. Planned for them: %s",
        state.shape,
        ", ".join(f"{name} {format_bytes(bytes_)}" for name, bytes_ in estimates.items()),
        state.plan.summary(),
    )


def plan_from_timed_step(state: PipelineResidency, component: str) -> None:
    """The denoiser of a call planned from dry runs (see estimate_at_start) timed a step under that
    plan: plan its other steps for that timing. With no step timed, a plan keeps the most resident
    bytes, which for FLUX.1-dev at 16 GB is every double-stream block in one run, the bus idle
    through them; a timed plan spreads fewer out and keeps a shallower window (see planner). Asked
    as each step begins until the device has run the step timed (the second): the host never waits
    for it."""
    if state.dry_runs is None or component != state.dry_runs.denoiser:
        return
    sizes = next(s for s in state.plan.sizes if s.name == component)
    timing = timing_so_far(state.group, sizes)
    if timing is None:
        return
    state.group.plan_from_timed_step = None
    streaming, whole = _hooked(state)
    # Components hooked whole keep their policy: one made staged would stay on the device until the
    # next switch, after the steps this plan is for.
    kept_as_planned = {name: state.plan[name].policy for name in whole}
    try:
        plan = state.replan(state.plan.activations, {**streaming, **kept_as_planned}, whole,
                            {**state.plan.timings, component: timing})  # fmt: skip
    except BudgetTooSmallError:
        return  # the activations planned for fit no plan with these hooks: the plan in place stays
    apply_plan(state, replace(plan, source=state.plan.source, shape=state.shape))
    logger.info("%r timed a step under the dry runs' estimate for calls of %s; its other steps are planned for it: %s",
                component, state.shape, plan.summary())  # fmt: skip


def make_room_to_retry(state: PipelineResidency, component: str) -> None:
    """``component`` ran out of device memory in its forward or a decode (see
    retry_with_room.retried_with_room) in a call planned from dry runs: their estimate fell short
    (of the denoiser's step, of the decoder's final decode, or of one a step-end callback made for
    a preview). Make the most room the budget has for it to run again, once: the least plan, every
    other component's units off the device (for the decoder, the denoiser's trunk and the blocks
    the plan kept), the allocator's cache given back, and its need measured from here. The call
    then returns what it would have, a little later, where it would otherwise fail on its first
    call; its plan is made again from what it measured."""
    group = state.group
    group.make_room_to_retry = group.plan_from_timed_step = None
    state.estimates_failed.add(state.shape)
    logger.info("%r ran out of device memory under the dry runs' estimate for calls of %s; running it again "
                "with the rest of the pipeline off the device", component, state.shape)  # fmt: skip
    _apply_least_plan(state)
    for other in dict.fromkeys(unit.component for unit in group.units):
        if other != component:
            group.offload_component(other)
    for unit in group.units_of(component):
        if unit.stream is not None:
            unit.stream.forget_unfinished_pass()
            break
    watch = group.budget_watch
    if watch is not None:
        watch.measure_from_here()
        # The estimate is given up: the call is measured from here as one that had none, whose
        # needs, measured, cover its retries (the failed attempt's, and any under the estimate).
        watch.drop_retries()
        watch.retries_while_measuring = False


def _hooked(state: PipelineResidency) -> tuple[dict[str, Policy], list[str]]:
    """What the hooks in place allow: the components that stream (their blocks have hooks of their
    own), pinned so, and those that can only move whole."""
    streaming = {p.name: Policy.STREAMED for p in state.plan.components if p.policy is Policy.STREAMED}
    whole = [p.name for p in state.plan.components if p.policy is not Policy.STREAMED]
    return streaming, whole


def _apply_least_plan(state: PipelineResidency) -> None:
    """The measuring plan, with the least on the device, on the hooks in place."""
    streaming, whole = _hooked(state)
    apply_plan(state, state.replan({}, streaming, whole, least=True))


def begin_call(state: PipelineResidency, shape: str) -> None:
    """A pipeline call of ``shape`` starts. A shape measured before (in this process, or in the
    profile) gets the plan for its figures, and nothing is measured. A new one smaller than one
    measured before (see ``profile.covering_shape``) gets the plan for the larger one's figures,
    which fit it, and is measured under that plan; any other new one is measured as the first call
    was, with the least on the device. A call of the shape in place changes nothing.

    What was learned for one shape stays with it: a measurement armed for another shape (one that
    never ran whole, returning latents) starts over, and what retries taught is learned anew."""
    if state.profile is None or shape == state.shape:
        return
    state.shape = shape
    state.group.forget_estimates()
    state.retry_replans.clear()
    state.retries_left_alone.clear()
    shapes = state.profile.shapes
    if shape in shapes:
        source = "measured" if shape in state.measured_shapes else "from the residency profile"
        if _plan_from_figures(state, shapes[shape], source, estimated=False):
            return
    covering = None if shape in state.estimates_failed else covering_shape(shapes, shape)
    if covering is not None and _plan_from_figures(state, shapes[covering], f"{COVERING} {covering}", estimated=True):
        return
    state.group.retention.set_release_before(learned_for=state.shape)
    _apply_least_plan(state)
    _watch(state, measure=True)
    parts = shape_parts(shape)
    runs = state.dry_runs
    estimable = runs is not None and parts is not None and shape not in state.estimates_failed
    decoder_need = runs.decoder.need(parts) if estimable else None
    if decoder_need is not None:
        state.group.estimate_from_inputs = functools.partial(estimate_at_start, state, decoder_need)
    logger.info("Calls of %s not measured yet: this one measures each component, with the least on the device%s",
                state.shape, " until its denoiser starts" if decoder_need is not None else "")  # fmt: skip


def _plan_from_figures(state: PipelineResidency, figures: CallFigures, source: str, *, estimated: bool) -> bool:
    """Plan the call under way (of ``state.shape``) from ``figures``: those measured for its shape,
    or (``estimated``) those of a larger shape, under which the call is measured for a plan of its
    own. False when they fit no plan with the policies in place."""
    try:
        plan = replan_in_place(state, figures.activations, figures.timings, figures.plan or None)
    except BudgetTooSmallError:  # figures saved for other policies given (components=)
        logger.warning("The figures %s fit no plan with these policies; measuring this call of %s", source, state.shape)
        return False
    group = state.group
    group.retention.set_release_before(figures.release_before, learned_for=state.shape)
    plan = replace(plan, source=source, shape=state.shape)
    apply_plan(state, plan)
    if estimated:
        _watch(state, measure=True, estimated=True)
    else:
        if group.budget_watch is not None:
            group.budget_watch.stop_measuring()
        if figures.timings and not figures.retimed:
            # Saved before its step was timed again under its plan: time it now.
            _time_steps_again(state, plan)
    group.load_resident_ahead()
    logger.info("Planned for calls of %s from figures %s: %s", state.shape, source, plan.summary())
    return True


def plan_ahead(state: PipelineResidency, guessed_casts: Mapping[str, tuple[torch.dtype, ...]]) -> None:
    """As a pipeline is enabled with a profile from an earlier process: plan for the call shape it
    holds first (a service's first call is most often of its usual shape), make the casts its calls
    make and undo (see :func:`warm_casts`), and start loading what
    that plan keeps resident, as a resident pipeline's ``.to(device)`` loads its weights before
    its first call rather than in it. A first call of that shape then finds its plan in place and
    its resident weights loaded; one of another shape plans for itself as it starts (see
    begin_call), and the loads made here are partly undone. Without a profile, make the
    ``guessed_casts``, those the pipeline's code is expected to make (see casts.guessed_casts)."""
    shape = state.profile.first_shape() if state.profile is not None else None
    if shape is None:
        warm_casts(state.group, guessed_casts, guessed=True)
    else:
        warm_casts(state.group, state.profile.shapes[shape].casts)
        begin_call(state, shape)


def abort_call(state: PipelineResidency, error: BaseException) -> None:
    """The pipeline call raised ``error``: nothing it measured is kept, and the next call plans for
    its shape again (measuring it afresh if it is still new, with the least on the device if this
    call ran out of memory under an estimate)."""
    state.group.forget_estimates()
    if state.group.budget_watch is not None:
        state.group.budget_watch.abort_call()
    if (
        isinstance(error, torch.OutOfMemoryError)
        and state.shape is not None
        and state.plan.source.startswith(ESTIMATED)
    ):
        state.estimates_failed.add(state.shape)
    state.shape = None


def end_call(state: PipelineResidency) -> None:
    """The pipeline call returned: tell now what it measured, overshot or retried (rather than as
    the next call starts, which may be of another shape), and keep the figures its shape has now."""
    state.group.forget_estimates()  # a call that never reached its denoiser (prompt embeddings)
    watch = state.group.budget_watch
    if watch is not None:
        watch.end_call()
    if state.profile is None or state.shape is None or not state.plan.source:
        return
    if watch is not None and watch.measures_next_call:
        return  # a call measured under an estimate that never ran whole: its shape is still unmeasured
    known = state.profile.shapes.get(state.shape)
    made = {name: lossless_round_trip(dtypes) for name, dtypes in state.group.casts_in_call.items()}
    # Merged: a call that cast a component not at all (one returning latents never decodes) leaves
    # what was known of it.
    casts = {**(known.casts if known is not None else {}), **{name: trip for name, trip in made.items() if trip}}
    figures = CallFigures(
        dict(state.plan.activations),
        dict(state.plan.timings),
        state.group.retention.confirmed_release_before(),
        retimed=not isinstance(watch.on_call_start if watch is not None else None, Retime),
        plan=state.plan.components,
        casts=casts,
    )
    if known == figures:
        return
    state.profile.shapes[state.shape] = figures
    state.measured_shapes.add(state.shape)
    if state.profile_file is not None:
        try:
            write_profile(state.profile_file, state.profile)
        except OSError as exc:
            logger.warning(
                "Could not save the residency profile to %s (%s); the next process measures again",
                state.profile_file,
                exc,
            )
            state.profile_file = None
