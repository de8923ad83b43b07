"""A first call of a new shape planned from estimates as it runs, rather than with the least on the
device: as the denoiser starts, a dry run of its inputs (see ``dry_runs``) and the decoder's estimate
plan the rest of the call; once a step is timed, its other steps are planned for that timing; and
should an estimate fall short, the component that ran out of memory runs again with the most room.
The call is measured all the same, and its plan made again from what it measured (see ``adaptive``).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import replace

from .pipeline_residency import (
    AT_ENABLE,
    DRY_RUN,
    RESERVE_MARGIN,
    PipelineResidency,
    apply_least_plan,
    apply_plan,
    hooked_policies,
    replan_in_place,
)
from .plans import BudgetTooSmallError
from .policy import Policy
from .retiming import timing_so_far
from .text import format_bytes

logger = logging.getLogger(__name__)


def estimate_at_start(state: PipelineResidency, decoder_need: int, component: str, args: tuple, kwargs: dict) -> None:
    """Told the inputs of each component that starts in a call measured with dry runs at hand (see
    adaptive.begin_call, which estimated the decoder's ``decoder_need``): as the denoiser first starts,
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
    watch.measure_running_until_here()  # the text encoder that ran last, before a plan moves weights
    need = runs.forward.need(args, kwargs)
    if need is None:
        _without_estimates(state)
        return
    margin = int(state.plan.budget * RESERVE_MARGIN)
    estimates = {component: need, runs.decoder.name: decoder_need}
    needs = {**watch.measured_so_far(), **estimates}
    # A step estimated at enable is for the default call's inputs (see block_timing): a call of
    # another shape plans without it until its own step is timed.
    same_inputs = runs.forward.gets_default_inputs(args, kwargs)
    timings = {name: step for name, step in state.plan.timings.items() if same_inputs or not step.estimated}
    try:
        activations = {**state.plan.activations, **{name: bytes_ + margin for name, bytes_ in needs.items()}}
        plan = replan_in_place(state, activations, timings)
    except BudgetTooSmallError:
        _without_estimates(state)
        return
    apply_plan(state, replace(plan, source=DRY_RUN))
    # Under an estimate a retry is all that shows a component was short (see adaptive._watch).
    watch.retries_while_measuring = True
    state.group.make_room_to_retry = functools.partial(make_room_to_retry, state)
    timed = component in plan.timings and not plan.timings[component].estimated
    if not timed and plan[component].policy is Policy.STREAMED:
        state.group.plan_from_timed_step = functools.partial(plan_from_timed_step, state)
    logger.info(
        "Dry runs estimate for calls of %s, above the weights: %s. Planned for them: %s",
        state.shape,
        ", ".join(f"{name} {format_bytes(bytes_)}" for name, bytes_ in estimates.items()),
        state.plan.summary(),
    )


def _without_estimates(state: PipelineResidency) -> None:
    """The denoiser that started has no estimate, or none that fits: the call is measured from
    here with the least on the device, as a call without estimates is (from its start), rather
    than under the plan made at enable, which estimated another call."""
    if state.plan.source == AT_ENABLE:
        apply_least_plan(state)
        # As with no estimate from the call's start: nothing runs again with room (there is no
        # estimate to fall short), and retries under the least plan are nobody's shortfall.
        state.group.make_room_to_retry = None
        watch = state.group.budget_watch
        watch.drop_retries()
        watch.retries_while_measuring = False


def plan_from_timed_step(state: PipelineResidency, component: str) -> None:
    """The denoiser of a call planned from dry runs (see estimate_at_start) timed a step under that
    plan: plan its other steps for that timing. With no step timed, a plan keeps the most resident
    bytes, which for FLUX.1-dev at 16 GB is every double-stream block in one run, the bus idle
    through them; a timed plan spreads fewer out and keeps a shallower window (see planner). Asked
    as each step begins until the device has run the step timed (the second): the host never waits
    for it."""
    if state.dry_runs is None or component != state.dry_runs.denoiser:
        return
    sizes = state.plan.sizes_of(component)
    timing = timing_so_far(state.group, sizes)
    if timing is None:
        return
    state.group.plan_from_timed_step = None
    streaming, whole = hooked_policies(state)
    # Components hooked whole keep their policy: one made staged would stay on the device until the
    # next switch, after the steps this plan is for.
    kept_as_planned = {name: state.plan[name].policy for name in whole}
    try:
        plan = state.replan(state.plan.activations, {**streaming, **kept_as_planned}, whole,
                            {**state.plan.timings, component: timing}, incumbent=state.plan.components)  # fmt: skip
    except BudgetTooSmallError:
        return  # the activations planned for fit no plan with these hooks: the plan in place stays
    apply_plan(state, replace(plan, source=state.plan.source, shape=state.shape))
    logger.info("%r timed a step under the dry runs' estimate for calls of %s; its other steps are planned for it: %s",
                component, state.shape, plan.summary())  # fmt: skip


def make_room_to_retry(state: PipelineResidency, component: str) -> None:
    """``component`` ran out of device memory in its forward or a decode (see
    retry_with_room.retried_with_room) in a call planned from dry runs: their estimate fell short
    (of the denoiser's step, of the decoder's final decode, or of one a step-end callback made for
    a preview); or under the plan made at enable, a text encoder's reserve did. Make the most room
    the budget has for it to run again, once: the least plan, every other component's units off
    the device (for the decoder, the denoiser's trunk and the blocks the plan kept), the
    allocator's cache given back, and its need measured from here. The call then returns what it
    would have, a little later, where it would otherwise fail on its first call; its plan is made
    again from what it measured."""
    group = state.group
    group.make_room_to_retry = group.plan_from_timed_step = None
    if state.plan.source != AT_ENABLE:
        # Under the plan made at enable, what fell short is a text encoder's reserve, not a dry run.
        state.estimates_failed.add(state.shape)
    logger.info("%r ran out of device memory under the estimate %s; running it again with the rest of the "
                "pipeline off the device", component, f"for calls of {state.shape}" if state.shape else "made at enable")  # fmt: skip
    apply_least_plan(state)
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
