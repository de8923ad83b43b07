"""Which of a streamed component's blocks stay on the device: the choices of resident blocks worth
weighing, the search among them (the most bytes, or the shortest simulated step), and the blocks
staged while it runs in the room the rest of the plan leaves. The planner (see :mod:`.planner`) asks
this for each streamed component at each of its passes, a timed plan of the per-step one for some
two thousand candidates: each is checked against the other components' part of the call's peak,
worked out once per search.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace

from .plans import ComponentPlan, ComponentSizes, blocks_bytes, call_peak, footprint_of, window_bytes
from .policy import Policy
from .step_timing import StepTiming, simulated_step_seconds

# Simulated steps within this fraction of the shortest count as equal (see with_resident_blocks):
# a timed step moves by more than that from one call or process to the next, and between near-equal
# choices it would pick another set of resident blocks each time.
STEP_TIE = 0.02


class Room:
    """The device's room under ``budget`` during a call: whether plans fit, and how many transient
    bytes a streamed component may take beside the others."""

    def __init__(self, by_name: Mapping[str, ComponentSizes], budget: int, need: Callable[[str], int]) -> None:
        self.footprint = footprint_of(by_name)
        self.budget = budget
        self.need = need
        # Simulated steps by component, resident blocks, window depth and the transient room its
        # staged blocks were chosen for (all a step depends on, with the timing, one per component
        # in a plan): a timed plan's searches meet most of their two thousand or so trials again.
        self.steps: dict[tuple[str, frozenset[int], int, int], float] = {}

    def peak(self, plans: Mapping[str, ComponentPlan]) -> int:
        return call_peak(list(plans.values()), self.footprint, self.need)

    def fits(self, plans: Mapping[str, ComponentPlan]) -> bool:
        return self.peak(plans) <= self.budget

    def _others(
        self, plans: Mapping[str, ComponentPlan], name: str
    ) -> tuple[list[tuple[ComponentPlan, tuple[int, int]]], int, int]:
        """The plans but ``name``'s with their (resident, transient) bytes, the resident bytes they
        keep together, and the largest transient bytes among them."""
        others = [(plan, self.footprint(plan)) for other, plan in plans.items() if other != name]
        others_stay = sum(stays for _, (stays, _) in others)
        return others, others_stay, max((transient for _, (_, transient) in others), default=0)

    def fits_as(self, plans: Mapping[str, ComponentPlan], name: str) -> Callable[[int, int], bool]:
        """Whether ``plans`` fit with streamed component ``name`` keeping (resident, transient) weight
        bytes, the others as they are: :meth:`fits` with the others' part worked out once, for a
        search over hundreds of sets of ``name``'s resident blocks."""
        others, others_stay, others_transient = self._others(plans, name)
        # The largest moment of a component that is not resident, and the largest need of one that
        # is (its moment adds the largest transient bytes, the streamed component's included).
        streaming_moment = max(
            (transient + self.need(p.name) for p, (_, transient) in others if p.policy is not Policy.RESIDENT),
            default=None,
        )
        resident_need = max((self.need(p.name) for p, _ in others if p.policy is Policy.RESIDENT), default=None)
        own_need, budget = self.need(name), self.budget - others_stay

        def fits(resident: int, transient: int) -> bool:
            moment = transient + own_need
            if streaming_moment is not None:
                moment = max(moment, streaming_moment)
            if resident_need is not None:
                moment = max(moment, resident_need + max(others_transient, transient))
            return resident + moment <= budget

        return fits

    def transient_room_as(self, plans: Mapping[str, ComponentPlan], name: str) -> Callable[[int], int]:
        """:meth:`transient_room` of streamed component ``name`` as a function of its resident
        bytes, the others as they are, worked out once for a search over its resident blocks."""
        others, others_stay, others_transient = self._others(plans, name)
        # The largest moment of another component (whatever name takes), and the largest need
        # that name's transient bytes share a moment with.
        moments = [
            (others_transient if p.policy is Policy.RESIDENT else transient) + self.need(p.name)
            for p, (_, transient) in others
        ]
        largest_moment = max(moments, default=None)
        need = max([self.need(name), *(self.need(p.name) for p, _ in others if p.policy is Policy.RESIDENT)])
        left_of_resident = self.budget - others_stay

        def transient_room(resident: int) -> int:
            left = left_of_resident - resident
            return -1 if largest_moment is not None and largest_moment > left else left - need

        return transient_room

    def transient_room(self, plans: Mapping[str, ComponentPlan], name: str) -> int:
        """The most transient bytes streamed component ``name`` may take with the others as in
        ``plans``, or -1 where another's moment overflows whatever it takes: :func:`call_peak`
        solved for its transient bytes (its resident ones, and the others', stay as they are).
        Its own moment, and each resident component's (which keeps every transient byte of the
        one before it), bound them."""
        bytes_of = {other: self.footprint(plan) for other, plan in plans.items()}
        left = self.budget - sum(stays for stays, _ in bytes_of.values())
        others_transient = max((transient for other, (_, transient) in bytes_of.items() if other != name), default=0)
        room = left - self.need(name)
        for other, plan in plans.items():
            if other == name:
                continue
            if plan.policy is Policy.RESIDENT:
                if others_transient + self.need(other) > left:
                    return -1
                room = min(room, left - self.need(other))
            elif bytes_of[other][1] + self.need(other) > left:
                return -1
        return room


def _spread(positions: Sequence[int], count: int) -> list[int]:
    """``count`` of ``positions``, evenly spaced, the first one included."""
    return [positions[i * len(positions) // count] for i in range(count)]


# Room for the choices of some thirty pipelines' components at each depth (a few MB at most).
@functools.lru_cache(maxsize=256)
def resident_block_choices(sizes: ComponentSizes, prefetch_blocks: int) -> tuple[tuple[frozenset[int], int, int], ...]:
    """Every set of resident blocks worth considering for a streamed component, as (positions,
    resident bytes, transient bytes), the most resident bytes first (then the smallest window).

    The window's slots are as large as the largest *streamed* block, so each choice starts from a
    slot size: every block larger than it stays resident, some of the blocks of that size do, and
    then smaller ones, largest first. On FLUX.1-dev, whose double-stream blocks are 2.4x its
    single-stream ones, keeping every double block resident shrinks the window from 2 GB to 0.85 GB,
    room that goes to more resident blocks.

    Within blocks of one size, the resident ones are spread evenly through the order (the first
    block included, which cache hooks always run). A resident run computes with no new block to
    load once the window is full, so a long resident prefix idles the copy stream for most of its
    compute at every step; short runs between streamed blocks keep it busy behind them.
    """
    blocks = sizes.block_bytes
    classes = sorted(set(blocks), reverse=True)
    positions = {size: [i for i, nbytes in enumerate(blocks) if nbytes == size] for size in classes}

    def filled(sizes_in_order: Sequence[int], count: int) -> list[int]:
        chosen = []
        for size in sizes_in_order:
            take = min(count, len(positions[size]))
            chosen += _spread(positions[size], take) if take else []
            count -= take
        return chosen

    choices: dict[frozenset[int], tuple[int, int]] = {}
    for slot_class, slot in enumerate(classes):
        required = filled(classes[:slot_class], len(blocks))
        smaller = classes[slot_class + 1 :]
        # All of the slot's size resident is a choice of the next slot size, unless none is smaller.
        for of_slot in range(len(positions[slot]) + (not smaller)):
            for of_smaller in range(sum(len(positions[size]) for size in smaller) + 1):
                resident = frozenset(required + filled((slot,), of_slot) + filled(smaller, of_smaller))
                choices[resident] = (blocks_bytes(blocks, resident), window_bytes(blocks, resident, prefetch_blocks))
    ranked = sorted(choices.items(), key=lambda item: (-item[1][0], item[1][1], sorted(item[0])))
    return tuple((resident, resident_bytes, transient) for resident, (resident_bytes, transient) in ranked)


# A streamed component's choice in a search over its resident blocks: the blocks, the window's
# depth, and the blocks' bytes.
_Trial = tuple[frozenset[int], int, int]


def with_resident_blocks(
    plans: dict[str, ComponentPlan],
    name: str,
    by_name: Mapping[str, ComponentSizes],
    room: Room,
    timing: StepTiming | None,
    depths: Sequence[int],
) -> dict[str, ComponentPlan]:
    """``plans`` with streamed component ``name``'s resident blocks (and window depth, one of
    ``depths``) chosen to fit: the most bytes, or with a timing the shortest simulated step (among
    steps within :data:`STEP_TIE` of it, the first depth, then the most bytes); its staged blocks
    are left to :func:`stage_blocks`."""
    sizes, plan = by_name[name], replace(plans[name], staged_blocks=frozenset())
    fits = room.fits_as(plans, name)
    fitting = (
        (resident, depth, resident_bytes)
        for depth in depths
        for resident, resident_bytes, transient in resident_block_choices(sizes, depth)
        if fits(sizes.trunk_bytes + resident_bytes, transient)
    )

    def chosen(resident: frozenset[int], depth: int, _resident_bytes: int) -> dict[str, ComponentPlan]:
        return {**plans, name: replace(plan, resident_blocks=resident, prefetch_blocks=depth)}

    if timing is None:
        first = next(fitting, None)
        return plans if first is None else chosen(*first)
    seconds = _step_seconds_of(plans, name, by_name, room, timing)
    # No step is shorter than its compute alone (less the simulation's rounding, some 1e-14 of
    # it): once the choice among the steps simulated so far is within STEP_TIE of that, it is
    # within STEP_TIE of the shortest of all, and the trials before it are not, so no trial after
    # it can change the choice. With room for every block the search stops at the first trial
    # rather than simulating every fitting one.
    within_tie_of_any = sum(sizes.block_bytes) * timing.compute_per_byte * (1 - 1e-12) * (1 + STEP_TIE)
    timed: list[tuple[float, _Trial]] = []
    for trial in fitting:
        timed.append((seconds(*trial), trial))
        if timed[-1][0] <= within_tie_of_any and _chosen(timed)[0] <= within_tie_of_any:
            break
    return chosen(*_chosen(timed)[1]) if timed else plans


def _chosen(timed: Sequence[tuple[float, _Trial]]) -> tuple[float, _Trial]:
    """The first of the timed trials whose step is within STEP_TIE of the shortest."""
    shortest = min(step for step, _ in timed)
    return next(item for item in timed if item[0] <= shortest * (1 + STEP_TIE))


def _step_seconds_of(
    plans: dict[str, ComponentPlan],
    name: str,
    by_name: Mapping[str, ComponentSizes],
    room: Room,
    timing: StepTiming,
) -> Callable[[frozenset[int], int, int], float]:
    """Streamed component ``name``'s simulated step as a function of its resident blocks, window
    depth and resident block bytes (a :data:`_Trial`), with the staged blocks the others in
    ``plans`` leave room for where it runs at every step (see :func:`stage_blocks`).

    Each trial is staged from its own plan and the transient room the others leave it, as
    :func:`stage_blocks` would stage the whole plan with it: a per-step component staged before it
    changes only its own transient bytes, within its own room, which the trial (checked to fit as
    a whole, see :meth:`Room.fits_as`) leaves its moment within the budget, so that this one's
    room is the same either way."""
    sizes, plan = by_name[name], replace(plans[name], staged_blocks=frozenset())
    transient_room = room.transient_room_as(plans, name)

    def seconds(resident: frozenset[int], depth: int, resident_bytes: int) -> float:
        room_left = transient_room(sizes.trunk_bytes + resident_bytes)
        key = (name, resident, depth, room_left)
        found = room.steps.get(key)
        if found is None:
            trial = replace(plan, resident_blocks=resident, prefetch_blocks=depth)
            staged = _staged(trial, sizes, room_left) if sizes.per_step else trial
            found = room.steps[key] = plan_step_seconds(staged, sizes, timing)
        return found

    return seconds


def plan_step_seconds(plan: ComponentPlan, sizes: ComponentSizes, timing: StepTiming) -> float:
    """A streamed plan's simulated step (see :func:`~.step_timing.simulated_step_seconds`)."""
    return _simulated_step_seconds(
        sizes.block_bytes, plan.resident_blocks | plan.staged_blocks, plan.prefetch_blocks, timing
    )


# Trials of a timed plan (see planner.plan_residency) that differ in their resident blocks often
# keep the same blocks once staged ones are counted (half of them for FLUX.1-dev at 12 and 16 GB),
# and a plan made again for other figures (a call's measured ones after its estimated ones, steps
# timed again) meets many of them again.
_simulated_step_seconds = functools.lru_cache(maxsize=4096)(simulated_step_seconds)


def stage_blocks(
    plans: dict[str, ComponentPlan],
    by_name: Mapping[str, ComponentSizes],
    room: Room,
    only: Collection[str] | None = None,
) -> dict[str, ComponentPlan]:
    """Keep, while each streamed per-step component runs, as many of its streamed blocks as fit,
    largest first: each one kept moves once per call instead of once per step. Once-per-call
    components keep none (they gain nothing: each of their blocks moves once a call either way, and
    a streamed one loads behind the compute). Components are staged in plan order, each in the room
    the ones before it left."""
    for name, plan in plans.items():
        sizes = by_name[name]
        if plan.policy is Policy.STREAMED and sizes.per_step and (only is None or name in only):
            plans = {**plans, name: _staged(plan, sizes, room.transient_room(plans, name))}
    return plans


@functools.lru_cache(maxsize=4096)
def _staged(plan: ComponentPlan, sizes: ComponentSizes, transient_room: int) -> ComponentPlan:
    """Streamed ``plan`` with the blocks staged that its ``transient_room`` (see
    :meth:`Room.transient_room`) leaves room for. Staging changes only its transient bytes, and the
    plans around it fit exactly while those stay within that room.

    Blocks of one size are taken as a run: while some of that size still stream, the window keeps
    its slot size and each one more kept only adds its bytes, so the most that fit follow from the
    room. The last one of a size may shrink the window's slots: it is tried on its own."""
    streamed = [i for i in range(len(sizes.block_bytes)) if i not in plan.resident_blocks]
    for size in sorted({sizes.block_bytes[i] for i in streamed}, reverse=True):
        run = [i for i in streamed if sizes.block_bytes[i] == size]
        spare = transient_room - plan.transient_bytes(sizes)
        # Blocks with no bytes (a repeated block without weights) all fit where the rest does.
        fitting = spare // size if size else (len(run) if spare >= 0 else 0)
        count = max(0, min(len(run) - 1, fitting))
        if count == len(run) - 1 and (whole_run := _staging(plan, run)).transient_bytes(sizes) <= transient_room:
            plan = whole_run
        elif count:
            plan = _staging(plan, run[:count])
    return plan


def _staging(plan: ComponentPlan, blocks: Collection[int]) -> ComponentPlan:
    """``plan`` with ``blocks`` staged too."""
    return replace(plan, staged_blocks=plan.staged_blocks | frozenset(blocks))


def prepare_block_choices(sizes: Sequence[ComponentSizes], depths: Sequence[int]) -> None:
    """List now (as a pipeline is enabled) the choices of resident blocks that a timed search of each
    per-step component weighs at each window depth. The plan made at enable lists those at the
    default depth; the others would be listed by a first call's first timed plan, while the device
    waits for it."""
    for component in sizes:
        if component.per_step and component.streamable:
            for depth in depths:
                resident_block_choices(component, depth)


def clear_caches() -> None:
    """Forget every choice, staging and simulated step worked out so far, as a fresh process starts
    without them (for timing the planner as a first call meets it)."""
    for cached in (resident_block_choices, _simulated_step_seconds, _staged):
        cached.cache_clear()
