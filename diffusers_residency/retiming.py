"""Steps timed again under the plan a measuring call chose, and planned for again if they moved.

The measuring call keeps the least on the device, and under a tight cap the allocator's retries
(each a device synchronisation) fall inside its timed step, which then overstates the compute by
more than twice (docs/measurements.md): the plan made from it is checked against steps timed under
itself, once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .plans import ComponentSizes, ResidencyPlan
from .policy import Policy
from .report import report_for
from .residency import ResidencyGroup
from .step_timing import StepTiming, compute_shares

if TYPE_CHECKING:
    from .pipeline_residency import PipelineResidency

logger = logging.getLogger(__name__)

# How far a step timed under the plan may be from the one the plan was made for before it is planned
# for again, as a fraction of the latter's compute or load time per byte.
RETIME_TOLERANCE = 0.1


@dataclass
class Retime:
    """Asked as each call starts and as it returns (BudgetWatch.on_call_start) after the measuring
    call's plan is applied: once every timed component has timed a step under the plan in place,
    plan again for those steps (``replan``, which applies the plan it makes) if one moved by more
    than RETIME_TOLERANCE from what the plan was made for. True once done; False, to be asked again
    at the next call start, while some step was not timed yet (a call-start component may run
    twice in one call, as the text encoders do under true CFG, and a call of fewer than three steps
    times none)."""

    state: PipelineResidency
    # The plan the steps are to be timed under, and each component's steps timed when it was applied.
    plan: ResidencyPlan
    steps_timed: dict[str, int]
    replan: Callable[[Mapping[str, StepTiming]], ResidencyPlan]

    def __call__(self) -> bool:
        state = self.state
        if state.plan is not self.plan:
            # Planned again since (a component that retried under the cap, told as this call
            # started): the steps timed meanwhile may be stretched by those retries too.
            self.plan, self.steps_timed = state.plan, steps_timed(state.group)
            return False
        planned = state.plan.timings
        timed_so_far = steps_timed(state.group)
        if not all(timed_so_far.get(name, 0) > self.steps_timed.get(name, 0) for name in planned):
            return False
        timed = {name: timing for name, timing in step_timings(state.group, state.plan).items() if name in planned}
        # A step estimated at enable (see block_timing) gives way to the one timed, however close.
        moved = [name for name, timing in timed.items() if planned[name].estimated or _moved(timing, planned[name])]
        if moved:
            new_plan = self.replan({**planned, **timed})
            logger.info("%s timed again under the plan; planned again: %s", moved, new_plan.summary())
        return True


def _moved(timing: StepTiming, planned: StepTiming) -> bool:
    # The blocks' shares are left out: a block's share moves with its neighbours' (a step's last
    # block counts the trunk's work up to the next), and the totals say whether the pace changed.
    return (
        abs(timing.compute_per_byte - planned.compute_per_byte) > RETIME_TOLERANCE * planned.compute_per_byte
        or abs(timing.load_per_byte - planned.load_per_byte) > RETIME_TOLERANCE * planned.load_per_byte
    )


def steps_timed(group: ResidencyGroup) -> dict[str, int]:
    """How many steps each streamed component has timed so far (see BlockStream.steps_timed)."""
    return {unit.component: unit.stream.steps_timed for unit in group.units if unit.stream is not None}


def step_timings(group: ResidencyGroup, plan: ResidencyPlan) -> dict[str, StepTiming]:
    """What the last call measured of each streamed per-step component's step under ``plan``: its
    blocks' compute seconds per block byte (the step the report shows, latest) and each block's
    share of them, and its loads' seconds per byte."""
    rows = {row.name: row for row in report_for(group).components}
    timings = {}
    for sizes in plan.sizes:
        row = rows.get(sizes.name) if sizes.per_step and plan[sizes.name].policy is Policy.STREAMED else None
        if row is None or row.step_compute_seconds is None or not row.loaded_bytes or row.load_seconds <= 0:
            continue
        timings[sizes.name] = StepTiming(
            compute_per_byte=row.step_compute_seconds[1] / sum(sizes.block_bytes),
            load_per_byte=row.load_seconds / row.loaded_bytes,
            compute_shares=group.stream_of(sizes.name).step_compute_shares(),
        )
    return timings


def timing_so_far(group: ResidencyGroup, sizes: ComponentSizes) -> StepTiming | None:
    """Streamed per-step component ``sizes``'s step as timed so far, read without waiting for the
    device: the first step timed in its activation under way (None until the device has run it)
    and its loads done (a load still copying is left out, with its bytes). For a plan made in the
    middle of a call (see ``dry_run_plans.plan_from_timed_step``)."""
    units = group.units_of(sizes.name)
    stream = group.stream_of(sizes.name)
    block_seconds = None if stream is None else stream.step_so_far()
    if block_seconds is None:
        return None
    done = [unit.stager for unit in units if not unit.stager.load_in_flight]
    loaded, seconds = sum(s.loaded_bytes for s in done), sum(s.load_seconds for s in done)
    if not loaded or seconds <= 0:
        return None
    compute = sum(block_seconds)
    return StepTiming(compute / sum(sizes.block_bytes), seconds / loaded, compute_shares=compute_shares(block_seconds))
