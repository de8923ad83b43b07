"""Decide, from sizes and a VRAM budget alone, which components stay on the device, which are staged
whole, and which stream their blocks. Pure functions over plain numbers: no tensor, no device.

The cost the plan minimises is bytes over the bus per call. A component the pipeline calls once per
denoising step (the transformer or UNet) costs its non-resident bytes at *every* step; the others
(text encoders, VAE) cost theirs once per call. So the per-step component gets the device first.

What must fit is every moment of a call: while a component runs, the device holds what stays
resident, that component's own transient weights (whole, or its window of blocks) and its
*activations*, which differ a lot between components (an SDXL VAE decoding at 1024x1024 in float32
needs about 5 GB above its weights, the UNet far less). Each component's activations are measured
in a first call (see ``pipeline``); until then, and for a component never measured, the activation
reserve stands in for them.

1. Everything fits (weights plus activations): everything stays resident, and nothing moves after
   the first call.
2. Otherwise the once-per-call components give up their room: those with repeated blocks stream
   them through a small window, the others are staged whole. The per-step component stays
   resident if it fits beside the largest of those transient needs; then once-per-call components
   are made resident again, smallest first, while the room lasts.
3. If the per-step component does not fit, it streams too: its trunk (embeddings, norms,
   projections) and as many of its blocks as the room allows stay resident, and the rest stream,
   one block computing while the next :data:`PREFETCH_BLOCKS` load. Which blocks stay is chosen for
   the bus, see :func:`~.kept_blocks.resident_block_choices`: the largest ones (the window's slots
   are as large as the largest streamed block), spread evenly through the order (the copy stream
   then has work while each resident block computes).
   Once a first call has timed a step of the per-step component (each block's compute, and loads
   per byte), the choice is the one whose step a simulation of the two streams finishes first:
   resident bytes alone can pick a long run of resident blocks during which the bus idles (every FLUX.1-dev
   double-stream block resident, then 38 single-stream blocks to stream behind a third of the
   compute), slower than fewer resident bytes spread out. See
   :func:`~.step_timing.simulated_step_seconds`.
   Once every component is planned, the same simulation chooses how many of its blocks load ahead
   (:data:`PREFETCH_CHOICES`), the others' room left as it is: one, where the bus is the bound,
   gives a window slot to blocks that stay.
4. A per-step component that streams keeps, while it runs, as many of its other blocks as its own
   moment of the call has room for (*staged* blocks): loaded when first reached, dropped when a
   component that is not resident starts, so they move once per call instead of once per step.
   Resident blocks are bounded by the other components' moments too (an SDXL UNet's resident
   blocks are on the device while the VAE decodes); staged blocks by their own component's, and
   by those of resident components, which evict nothing when they start.
5. Last, a once-per-call component planned to stream with no block resident is staged whole where
   its whole fits beside everything else as planned: its blocks move once per call either way, in
   one load instead of one each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from . import kept_blocks
from .plans import (
    PREFETCH_BLOCKS,
    BudgetTooSmallError,
    ComponentPlan,
    ComponentSizes,
    ResidencyPlan,
    resident_bytes_of,
)
from .policy import Policy
from .step_timing import StepTiming
from .text import format_bytes

# The depths a timed plan chooses from at its end (see plan_residency), the default first, by the
# simulated step: where each block's load outlasts the compute before it, one block in flight keeps
# the bus as busy as two (the next copy is queued behind the one running), and the slot it frees
# holds blocks that do not move at every step; a large block loading behind a short compute needs
# the deeper window.
PREFETCH_CHOICES = (PREFETCH_BLOCKS, 1)
# Activation reserve when the caller gives none, for a component not measured yet: a tenth of the
# budget, at least 3 GiB. The floor is what a FLUX.1-dev call at 1024x1024 needs above its weights
# (the VAE decoding at full resolution: 2.6 GB, docs/measurements.md), plus room for the
# allocator's rounding. It decides whether a
# budget keeps everything on the device and whether the least-on-the-device plan of a measuring
# call fits (see adaptive.learn_activations).
DEFAULT_RESERVE_FRACTION = 0.1
MIN_RESERVE_BYTES = 3 << 30


def default_reserve(budget: int) -> int:
    return max(MIN_RESERVE_BYTES, int(budget * DEFAULT_RESERVE_FRACTION))


def _streamed(sizes: ComponentSizes) -> ComponentPlan:
    return ComponentPlan(sizes.name, Policy.STREAMED, frozenset(), PREFETCH_BLOCKS)


def _off_device_between_uses(sizes: ComponentSizes) -> ComponentPlan:
    """The cheapest way to keep a component off the device between its uses: streamed when its
    trunk and window take less room than the whole of it, else staged."""
    streamed = _streamed(sizes)
    if sizes.streamable and streamed.resident_bytes(sizes) + streamed.transient_bytes(sizes) < sizes.nbytes:
        return streamed
    return ComponentPlan(sizes.name, Policy.STAGED)


def _checked(sizes: Sequence[ComponentSizes], fixed: Mapping[str, Policy]) -> dict[str, Policy]:
    unknown = sorted(set(fixed) - {s.name for s in sizes})
    if unknown:
        raise ValueError(f"fixed policies for unknown components {unknown}")
    for s in sizes:
        if fixed.get(s.name) is Policy.STREAMED and not s.streamable:
            raise ValueError(
                f"{s.name!r} cannot stream: it has no repeated blocks (more than {PREFETCH_BLOCKS}, sharing no "
                "weight with each other or the rest of it) to stream; make it 'staged' or 'resident'"
            )
    return dict(fixed)


def _as_given(sizes: ComponentSizes, policy: Policy) -> ComponentPlan:
    return _streamed(sizes) if policy is Policy.STREAMED else ComponentPlan(sizes.name, policy)


def plan_as_given(sizes: Sequence[ComponentSizes], policies: Mapping[str, Policy]) -> ResidencyPlan:
    """The plan with no budget: each component as ``policies`` says, streamed ones with no resident block."""
    policies = _checked(sizes, policies)
    return ResidencyPlan(None, 0, tuple(_as_given(s, policies[s.name]) for s in sizes), tuple(sizes))


def plan_residency(
    sizes: Sequence[ComponentSizes],
    budget: int,
    reserve: int,
    fixed: Mapping[str, Policy] | None = None,
    activations: Mapping[str, int] | None = None,
    *,
    timings: Mapping[str, StepTiming] | None = None,
    least: bool = False,
    chosen: Sequence[ComponentPlan] | None = None,
    incumbent: Sequence[ComponentPlan] = (),
) -> ResidencyPlan:
    """Plan every component for ``budget`` bytes of device memory. ``activations`` are the bytes each
    component needs above the weights while it runs; ``reserve`` stands in for a component they do
    not name. ``fixed`` pins a component's policy (a user's choice, or a component that must stay
    resident); a fixed ``streamed`` component still gets its resident blocks chosen here.
    ``timings``: per-step components' measured step (see :class:`StepTiming`); with one, its
    resident blocks are chosen for the shortest simulated step rather than for the most bytes.

    With ``least``, every component that is not fixed keeps the least it can on the device (streamed
    with no resident block, or staged): the plan under which a call's activations can be measured,
    each component having the most room it can have.

    ``chosen``: the components of a plan made before for the same figures (a residency profile
    keeps it), taken as they are where they still fit and keep ``fixed``, unless everything fits
    now: a timed plan weighs every fitting choice of resident blocks, several hundred simulated
    steps for FLUX.1-dev at 16 GB, which a first call from a profile would otherwise pay. (A profile holds
    for budgets within 256 MiB of one another: the plan kept may leave up to that much unused.)

    ``incumbent``: the plan in place, planned again for new figures. It stays, its staged blocks
    chosen again, where it is as good for them as the new plan and the new plan would move a timed
    component's resident blocks (see :func:`_in_place_if_as_good`).

    Raises :class:`BudgetTooSmallError` when even streaming everything streamable does not fit.
    """
    fixed = _checked(sizes, fixed or {})
    activations = dict(activations or {})
    timings = dict(timings or {})
    by_name = {s.name: s for s in sizes}
    room = kept_blocks.Room(by_name, budget, lambda name: activations.get(name, reserve))
    fits = room.fits

    def as_plan(plans: Mapping[str, ComponentPlan]) -> ResidencyPlan:
        return ResidencyPlan(budget, reserve, tuple(plans[s.name] for s in sizes), tuple(sizes), activations, timings)

    def most_resident(s: ComponentSizes) -> ComponentPlan:
        # A fixed streamed component at its most: every block resident.
        if s.name not in fixed:
            return ComponentPlan(s.name, Policy.RESIDENT)
        plan = _as_given(s, fixed[s.name])
        return (
            replace(plan, resident_blocks=frozenset(range(len(s.block_bytes))))
            if plan.policy is Policy.STREAMED
            else plan
        )

    resident = {s.name: most_resident(s) for s in sizes}
    if fits(resident) and not least:
        return as_plan(resident)
    if chosen is not None and not least and _still_holds(chosen, by_name, fixed):
        if fits(plans := {p.name: p for p in chosen}):
            return as_plan(plans)

    free = [s for s in sizes if s.name not in fixed]
    plans = {s.name: _as_given(s, fixed[s.name]) if s.name in fixed else _off_device_between_uses(s) for s in sizes}
    if not fits(plans):
        peak = room.peak(plans)
        needs = (
            f"{format_bytes(peak)} at its largest moment for its weights alone. Raise the budget above that by "
            "what its calls need above the weights"
            if reserve == 0 and not activations
            else f"{format_bytes(peak)} at its largest moment, weights and activations "
            f"({format_bytes(reserve)} reserved for a component not measured) together. Raise the budget to at "
            f"least {format_bytes(peak)}"
        )
        raise BudgetTooSmallError(
            f"vram_budget {format_bytes(budget)} is too small: with every component streamed or staged but those "
            f"you fixed, a call needs {needs}, or lower activation_reserve, or fix fewer components as resident."
        )
    if least:
        # A per-step component whose activations a measuring call already measured (its first
        # step) keeps, for the rest of that call, the blocks its own moment has room for; the
        # others' moments are still unknown, and staged blocks leave them all their room.
        return as_plan(kept_blocks.stage_blocks(plans, by_name, room, only=activations.keys()))
    # The per-step components first: whole if they fit, else as many resident blocks as fit. Only
    # then the once-per-call ones, smallest first, with what is left: a byte they take from a
    # per-step component would be streamed at every step to save one load per call.
    for group in ([s for s in free if s.per_step], sorted((s for s in free if not s.per_step), key=lambda s: s.nbytes)):
        for s in group:
            trial = {**plans, s.name: ComponentPlan(s.name, Policy.RESIDENT)}
            if fits(trial):
                plans = trial
        plans = _grow_streamed(plans, by_name, room, timings)
    plans = _with_depths(kept_blocks.stage_blocks(plans, by_name, room), by_name, room, timings)
    whole = _staged_whole_where_room(plans, free, room)
    if whole != plans:
        # Their trunks, resident while they streamed, leave room at every moment of the call.
        grown = kept_blocks.stage_blocks(_grow_streamed(whole, by_name, room, timings), by_name, room)
        plans = _with_depths(grown, by_name, room, timings)
    if incumbent and timings and _still_holds(incumbent, by_name, fixed):
        plans = _in_place_if_as_good(incumbent, plans, by_name, room, timings) or plans
    return as_plan(plans)


def _in_place_if_as_good(
    incumbent: Sequence[ComponentPlan],
    plans: dict[str, ComponentPlan],
    by_name: Mapping[str, ComponentSizes],
    room: kept_blocks.Room,
    timings: Mapping[str, StepTiming],
) -> dict[str, ComponentPlan] | None:
    """The plan in place, its staged blocks chosen again for the room of the new figures, if it fits
    them, keeps resident all but at most one block's bytes of what the new ``plans`` keep, all
    components together, and streams no timed component that they do not, each one that both
    stream with a simulated step no longer than under ``plans`` by more than STEP_TIE, and the new
    plans move the resident blocks of one of those; else None (the new plans, then, change only
    what loads once per call, and keeping the plan in place would save no load).

    Hysteresis: a step timed a few per cent apart (the whole call's median after the first step's
    timing, a step timed again) moves the shortest step among near-equal choices of resident
    blocks, and choices of nearby sizes spread their blocks over mostly different positions: for
    FLUX.1-dev at 16 GB, a step 10 % longer swaps some 2.5 GB of resident blocks, loaded while
    the call waits, for a step no more than 2 % shorter (and a text encoder's few blocks resident
    in the room the transformer's left). Resident bytes are compared because what is not
    resident loads at every call: where every block of a per-step component is kept, resident or
    staged, the steps tie whatever the split (SDXL's UNet at 8 GB kept 13 resident blocks where
    its new plan kept 18, 0.40 GB more loaded a call), and a plan made for larger figures keeps
    less of the once-per-call components resident too."""
    kept = kept_blocks.stage_blocks(
        {p.name: replace(p, staged_blocks=frozenset()) for p in incumbent}, by_name, room
    )
    if kept == plans or not room.fits(kept):
        return None
    block = max((nbytes for sizes in by_name.values() for nbytes in sizes.block_bytes), default=0)
    if resident_bytes_of(kept.values(), by_name) < resident_bytes_of(plans.values(), by_name) - block:
        return None
    moved = False  # whether the new plans move a timed component's resident blocks: else none to keep
    for name, timing in timings.items():
        if name not in plans or kept[name].policy is not Policy.STREAMED:
            continue
        if plans[name].policy is not Policy.STREAMED:
            return None
        step = kept_blocks.plan_step_seconds(plans[name], by_name[name], timing)
        if kept_blocks.plan_step_seconds(kept[name], by_name[name], timing) > step * (1 + kept_blocks.STEP_TIE):
            return None
        moved = moved or kept[name].resident_blocks != plans[name].resident_blocks
    return kept if moved else None


def _with_depths(
    plans: dict[str, ComponentPlan],
    by_name: Mapping[str, ComponentSizes],
    room: kept_blocks.Room,
    timings: Mapping[str, StepTiming],
) -> dict[str, ComponentPlan]:
    """For each timed streamed component, the window's depth and the resident blocks that go with
    it (see :data:`PREFETCH_CHOICES`), with the staged blocks they leave room for. Chosen once the
    once-per-call components took their room: chosen before, a shallower window's slot would go to
    them, not to blocks of this one."""
    for name, timing in timings.items():
        if name in plans and plans[name].policy is Policy.STREAMED:
            plans = kept_blocks.with_resident_blocks(plans, name, by_name, room, timing, PREFETCH_CHOICES)
            plans = kept_blocks.stage_blocks(plans, by_name, room)
    return plans


def _staged_whole_where_room(
    plans: dict[str, ComponentPlan], free: Sequence[ComponentSizes], room: kept_blocks.Room
) -> dict[str, ComponentPlan]:
    """Stage whole each once-per-call component planned to stream with no block resident, smallest
    first, where its whole fits beside everything else as planned. Its blocks move once per call
    either way; streamed, each with a load, an offload and a hook of its own, and each waiting for
    its copy behind a compute too short to hide it (SDXL's second text encoder: 33 blocks). Asked
    last, so that it takes only room that no other component's plan wanted. (A component with
    resident blocks moves fewer bytes streamed, and keeps streaming.)"""
    for sizes in sorted((s for s in free if not s.per_step), key=lambda s: s.nbytes):
        plan = plans[sizes.name]
        if plan.policy is Policy.STREAMED and not plan.resident_blocks:
            trial = {**plans, sizes.name: ComponentPlan(sizes.name, Policy.STAGED)}
            if room.fits(trial):
                plans = trial
    return plans


def _still_holds(
    chosen: Sequence[ComponentPlan], by_name: Mapping[str, ComponentSizes], fixed: Mapping[str, Policy]
) -> bool:
    """Whether ``chosen`` plans each of these components once, with the policies ``fixed`` pins;
    streams only components with blocks to stream, each block resident or staged at most once, with
    a window; and names blocks of no other component (a profile may have been edited by hand)."""
    if sorted(p.name for p in chosen) != sorted(by_name):
        return False
    for plan in chosen:
        if plan.name in fixed and plan.policy is not fixed[plan.name]:
            return False
        if plan.policy is not Policy.STREAMED:
            if plan.resident_blocks or plan.staged_blocks:
                return False
            continue
        positions = range(len(by_name[plan.name].block_bytes))
        kept = plan.resident_blocks | plan.staged_blocks
        if not by_name[plan.name].streamable or plan.prefetch_blocks < 1 or not kept <= set(positions):
            return False
        if plan.resident_blocks & plan.staged_blocks:
            return False
    return True


def _grow_streamed(
    plans: dict[str, ComponentPlan],
    by_name: Mapping[str, ComponentSizes],
    room: kept_blocks.Room,
    timings: Mapping[str, StepTiming],
) -> dict[str, ComponentPlan]:
    """Give each streamed component, per-step ones first, the resident blocks that fit: the most
    bytes, or with a timing the shortest simulated step (the most bytes among equals), its staged
    blocks (see :func:`~.kept_blocks.stage_blocks`) counted as kept."""
    streamed = [name for name, p in plans.items() if p.policy is Policy.STREAMED]
    streamed.sort(key=lambda name: not by_name[name].per_step)
    for name in streamed:
        plans = kept_blocks.with_resident_blocks(
            plans, name, by_name, room, timings.get(name), (plans[name].prefetch_blocks,)
        )
    return plans
