"""Plans that learn from calls: what the first call of each shape measured, what overshoots and
allocator retries taught, steps timed again under the plan; and the residency profile that keeps
those figures per call shape, so that a shape seen before, in this process or an earlier one, is
planned right from its first call.

A pipeline call is seen whole here (see ``pipeline``'s call wrapper): :func:`begin_call` plans for
the call's shape before its first component runs, :func:`end_call` closes what the call measured
once it returns, so that what one shape taught never lands in another shape's plan. A new shape's
first call is planned from estimates as it runs (see ``dry_run_plans``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from .block_timing import can_time_blocks, estimated_step, warm_encoders, warm_kernels
from .budget_watch import BudgetWatch
from .call_shapes import covering_shape, shape_parts
from .casts import lossless_round_trip, warm_casts
from .dry_run_plans import estimate_at_start, make_room_to_retry
from .pipeline_residency import (
    AT_ENABLE,
    COVERING,
    ESTIMATED,
    RESERVE_MARGIN,
    PipelineResidency,
    apply_least_plan,
    apply_plan,
    hooked_policies,
    replan_in_place,
)
from .plans import BudgetTooSmallError, ResidencyPlan
from .policy import Policy
from .profile import CallFigures, write_profile
from .retiming import Retime, step_timings, steps_timed
from .step_timing import StepTiming
from .text import format_bytes

logger = logging.getLogger(__name__)

# How a plan made again for allocator retries says why (see learn_overshoot).
RETRIED = "The allocator ran out of room under its cap and retried"


def watch_budget(state: PipelineResidency) -> None:
    """Watch the budget of a pipeline just enabled under one, for overshoots and retries, measuring
    its next call if its calls are measured."""
    if state.plan.budget is not None:
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
    need = plan.activation_bytes_of(component) + overshoot
    new_plan, planned = _first_that_fits(state, [{**plan.activations, component: need + m} for m in margins])
    if new_plan is None:
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
        format_bytes(planned[component]),
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
    for what is planned as it returns. The margin goes on the room the estimate gave them where
    that is more than they measured: a retry says that room was short, whatever the peak read, and
    under a cap the peak reads what the cap let through, the cache freed to retry not counted
    (SDXL's VAE at 1024x1024, given 6.60 GB under an 8 GB cap, read 5.39 GB; planned from that,
    it retried in the next two calls too)."""
    plan = state.plan
    margin = int(plan.budget * RESERVE_MARGIN)
    activations = {**plan.activations, **{name: need + margin for name, need in measured.items()}}
    short_of = {name: max(activations.get(name, plan.reserve), plan.activation_bytes_of(name)) for name in retried}
    with_retries = {**activations, **{name: room + margin for name, room in short_of.items()}}
    # Where the margin finds no room: at least the room that retried, rather than the capped peak.
    at_room = {**activations, **short_of}
    needs = ", ".join(f"{name} {format_bytes(need)}" for name, need in measured.items())
    # A component whose step this call did not time (a call of fewer than three steps) keeps the
    # timing the plan had, or takes the latest one timed, in an earlier call.
    timings = {**plan.timings, **step_timings(state.group, state.plan)}
    candidates = (with_retries, at_room, activations) if retried else (activations,)
    # Each tried once: finding that a plan does not fit takes the planner as long as making one.
    distinct = [c for i, c in enumerate(candidates) if c not in candidates[:i]]
    new_plan, planned = _first_that_fits(state, distinct, timings)
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
            apply_least_plan(state)
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
        if planned is with_retries:
            # Counted as learn_overshoot counts its first: a shape measured anew starts with none
            # counted and none left alone (see begin_call).
            state.retry_replans[name] = 1
            logger.warning(
                "%s while %r ran; planned with %s for its activations", RETRIED, name, format_bytes(planned[name])
            )
        else:
            # The margins found no room together: each is tried on its own, as later retries are.
            learn_overshoot(state, name, 0, True)


def _first_that_fits(
    state: PipelineResidency,
    candidates: Sequence[Mapping[str, int]],
    timings: Mapping[str, StepTiming] | None = None,
) -> tuple[ResidencyPlan | None, Mapping[str, int] | None]:
    """The plan on the hooks in place for the first of ``candidates`` (activations, the roomiest
    first) that fits, and those activations; None and None when none does."""
    for activations in candidates:
        try:
            return replan_in_place(state, activations, timings), activations
        except BudgetTooSmallError:
            continue
    return None, None


def _first_call(state: PipelineResidency) -> str:
    return f"The first call of {state.shape}" if state.shape else "The first call"


def learn_first_step(state: PipelineResidency, component: str, need: int) -> None:
    """A measured call's per-step ``component`` ran its first step, streaming every block, and
    needed ``need`` bytes above the weights. For the call's other steps it keeps the blocks its own
    moment has room for: staged, so that they leave the device to the components after it, whose
    needs are not known yet."""
    sizes = state.plan.sizes_of(component)
    if not sizes.per_step or component in state.plan.activations:
        return
    streaming, whole = hooked_policies(state)
    activations = {**state.plan.activations, component: need + int(state.plan.budget * RESERVE_MARGIN)}
    try:
        plan = state.replan(activations, streaming, whole, least=True)
    except BudgetTooSmallError:
        return  # its own need leaves no room for more than the measuring plan: it keeps that
    apply_plan(state, plan)
    logger.info("%r's first step needed %s above the weights; its other steps keep %d blocks",
                component, format_bytes(need), len(plan[component].staged_blocks))  # fmt: skip


def begin_call(state: PipelineResidency, shape: str) -> None:
    """A pipeline call of ``shape`` starts. A shape measured before (in this process, or in the
    profile) gets the plan for its figures, and nothing is measured. A new one smaller than one
    measured before (see ``call_shapes.covering_shape``) gets the plan for the larger one's figures,
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
    parts = shape_parts(shape)
    runs = state.dry_runs
    estimable = runs is not None and parts is not None and shape not in state.estimates_failed
    decoder_need = runs.decoder.need(parts) if estimable else None
    if decoder_need is not None and state.plan.source == AT_ENABLE:
        # The plan made at enable stays until the denoiser starts, and the call plans from its own
        # dry runs then: the blocks it loaded at enable are on the device as the first step
        # reaches those of them that the call's plan keeps, rather than each loaded in that step.
        _watch(state, measure=True, estimated=True)
        # The text encoders run with the reserve for their need: one that runs out of memory runs
        # again with the rest off the device, as a component short of a dry run's estimate does.
        state.group.make_room_to_retry = functools.partial(make_room_to_retry, state)
        on_device = "under the plan made at enable"
    else:
        apply_least_plan(state)
        _watch(state, measure=True)
        on_device = "with the least on the device"
    if decoder_need is not None:
        state.group.estimate_from_inputs = functools.partial(estimate_at_start, state, decoder_need)
    logger.info("Calls of %s not measured yet: this one measures each component, %s%s", state.shape, on_device,
                " until its denoiser starts" if decoder_need is not None else "")  # fmt: skip


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
    make and undo (see :func:`warm_casts`), run one block of each of the denoiser's layouts and
    its trunk's modules (see ``block_timing.warm_kernels``; without a profile, see
    :func:`_plan_default_call`), start loading what that plan keeps resident, as a resident
    pipeline's ``.to(device)`` loads its weights before its first call rather than in it, and run
    its encoders once (see ``block_timing.warm_encoders``). A first call of that shape then
    finds its plan in place and its resident weights loaded; one of another shape plans for itself
    as it starts (see begin_call), and the loads made here are partly undone. Without a profile,
    make the ``guessed_casts``, those the pipeline's code is expected to make (see
    casts.guessed_casts)."""
    _expect_block_orders(state)
    shape = state.profile.first_shape() if state.profile is not None else None
    if shape is None:
        warm_casts(state.group, guessed_casts, guessed=True)
        _plan_default_call(state)
    else:
        warm_casts(state.group, state.profile.shapes[shape].casts)
        runs = state.dry_runs
        if runs is not None and runs.default_step_need is not None:
            warm_kernels(state.group, runs.denoiser, runs.forward.default_blocks)
        begin_call(state, shape)
        if runs is not None:
            warm_encoders(state.group, runs.forward.default_encoder_inputs, runs.forward.default_encoder_blocks)


def _expect_block_orders(state: PipelineResidency) -> None:
    """Have the streamed denoiser and decoder load their blocks ahead in the order the dry runs of
    the default call ran them (see ``BlockStream.expect_order``), so that a process's first call
    loads them in turn, with a profile or without."""
    runs = state.dry_runs
    if runs is None or runs.default_step_need is None:
        # The default call did not reach its denoiser on the meta device (an image to encode
        # first, or code that reads values), or its dry run stopped part way: not a call's order.
        return
    orders = {runs.denoiser: runs.forward.default_blocks}
    if runs.decoder.need({}) is not None:  # made at enable: the record of a decode run whole
        orders[runs.decoder.name] = runs.decoder.default_blocks
    for name, blocks_run in orders.items():
        stream = state.group.stream_of(name)
        if stream is not None:
            stream.expect_order(blocks_run.run_order, blocks_run.blocks)


def _plan_default_call(state: PipelineResidency) -> None:
    """With no profile, as a pipeline whose calls are measured is enabled: plan for a call of its
    default shape from the dry runs made of it (see ``dry_runs.CallDryRuns``), the components they
    do not estimate (text encoders) given the reserve, and start loading what that plan keeps
    resident. A first call whose shape the dry runs follow keeps this plan until its denoiser
    starts (see begin_call); the blocks loaded here that the call's own plan keeps then cost it no
    load, as a resident pipeline's weights loaded by ``.to(device)`` cost its first call none.
    Where the plan streams some of the denoiser's blocks, they are chosen for its step estimated
    from blocks of it timed now (see ``block_timing``), as the call's timed step would choose them;
    its trunk's modules run once too, and its blocks where none were timed (see
    ``block_timing.warm_kernels``), then its encoders (see ``block_timing.warm_encoders``)."""
    runs, budget = state.dry_runs, state.plan.budget
    if runs is None or budget is None or not state.measuring:
        return
    needs = {runs.denoiser: runs.default_step_need, runs.decoder.name: runs.decoder.need({})}
    if None in needs.values():
        return
    margin = int(budget * RESERVE_MARGIN)
    activations = {name: need + margin for name, need in needs.items()}
    # No plan is in place to keep (see plan_residency's incumbent): nothing is loaded before this one.
    streaming, whole = hooked_policies(state)
    try:
        plan = state.replan(activations, streaming, whole)
        timed = _times_blocks(state, plan) and can_time_blocks(state.group, runs.denoiser, runs.forward.default_blocks)
        step = estimated_step(state.group, plan.sizes_of(runs.denoiser), runs.forward.default_blocks) if timed else None
        if step is not None:
            plan = state.replan(activations, streaming, whole, {runs.denoiser: step})
    except BudgetTooSmallError:
        return  # a first call measures with the least on the device, as without estimates
    apply_plan(state, replace(plan, source=AT_ENABLE))
    # Before the loads are queued, which a kernel's first launch may wait for.
    warm_kernels(state.group, runs.denoiser, runs.forward.default_blocks, with_blocks=not timed)
    state.group.load_resident_ahead()
    warm_encoders(state.group, runs.forward.default_encoder_inputs, runs.forward.default_encoder_blocks)
    # A text encoder run outside a pipeline call (``pipe.encode_prompt``) that needs more than the
    # reserve runs again with the rest off the device too (see begin_call).
    state.group.make_room_to_retry = functools.partial(make_room_to_retry, state)
    estimates = ", ".join(f"{name} {format_bytes(need)}" for name, need in needs.items())
    if step is not None:
        block_bytes = sum(plan.sizes_of(runs.denoiser).block_bytes)
        estimates += (f"; {runs.denoiser}'s step {step.compute_per_byte * block_bytes:.3f} s of compute, loads at "
                      f"{format_bytes(int(1 / step.load_per_byte))}/s, from blocks of it timed")  # fmt: skip
    logger.info("Planned at enable for a call of the default shape, estimated above the weights: %s. %s",
                estimates, plan.summary())  # fmt: skip


def _times_blocks(state: PipelineResidency, plan: ResidencyPlan) -> bool:
    """Whether the denoiser's step is to be estimated from its blocks timed now (see
    ``block_timing``): where ``plan`` streams some of them, so that the plan at enable is chosen as
    a timed step would choose it."""
    denoiser = state.dry_runs.denoiser
    sizes, planned = plan.sizes_of(denoiser), plan[denoiser]
    streams = planned.policy is Policy.STREAMED and len(planned.resident_blocks) < len(sizes.block_bytes)
    return bool(sizes.per_step and streams)


def abort_call(state: PipelineResidency, error: BaseException) -> None:
    """The pipeline call raised ``error``: nothing it measured is kept, and the next call plans for
    its shape again (measuring it afresh if it is still new, with the least on the device if this
    call ran out of memory under an estimate).

    Out of memory under figures measured for its shape (in this process or an earlier one), the
    call says those figures no longer hold: another process took device memory since, say. Planned
    from them again, every call of the shape would run out the same way; the figures are dropped
    instead, and the next call of the shape measures afresh with the least on the device."""
    state.group.forget_estimates()
    if state.group.budget_watch is not None:
        state.group.budget_watch.abort_call()
    shape = state.shape
    if isinstance(error, torch.OutOfMemoryError) and shape is not None:
        if state.plan.source.startswith(ESTIMATED):
            state.estimates_failed.add(shape)
        elif state.plan.source and state.profile is not None and state.profile.shapes.pop(shape, None) is not None:
            state.measured_shapes.discard(shape)
            state.profile.dropped.add(shape)
            _save_profile(state)
            logger.warning(
                "A call of %s ran out of device memory under the plan from its figures (%s); the next call "
                "of it measures again",
                shape,
                state.plan.source,
            )
    if isinstance(error, torch.OutOfMemoryError) and state.plan.source == AT_ENABLE:
        apply_least_plan(state)  # short of room: the next call measures as usual rather than failing alike
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
    state.profile.dropped.discard(state.shape)  # measured again: another process's figures may stand
    state.measured_shapes.add(state.shape)
    _save_profile(state)


def _save_profile(state: PipelineResidency) -> None:
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
