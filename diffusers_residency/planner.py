"""Decide, from sizes and a VRAM budget alone, which components stay on the device, which are staged
whole, and which stream their blocks. Pure functions over plain numbers: no tensor, no device.

The cost the plan minimises is bytes over the bus per call. A component the pipeline calls once per
denoising step (the transformer or UNet) costs its non-resident bytes at *every* step; the others
(text encoders, VAE) cost theirs once per call. So the per-step component gets the device first:

1. Everything fits (weights plus the activation reserve): everything stays resident, and nothing
   moves after the first call.
2. Otherwise the once-per-call components give up their room: those with repeated blocks stream
   them through a small window, the others are staged whole. The per-step component stays
   resident if it fits beside the largest of those transient needs; then once-per-call components
   are made resident again, smallest first, while the room lasts.
3. If the per-step component does not fit, it streams too: its trunk (embeddings, norms,
   projections) and as many of its blocks as the room allows stay resident, and the rest stream,
   one block computing while the next :data:`PREFETCH_BLOCKS` load. Which blocks stay is chosen for
   the bus, see :func:`_resident_block_choices`: the largest ones (the window's slots are as large
   as the largest streamed block), spread evenly through the order (the copy stream then has work
   while each resident block computes).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum

# One block computing and two in flight keep the copy stream busy behind the compute; a deeper
# window buys no bandwidth once the bus is saturated, and the room it would take serves better as
# resident blocks, which are never moved at all.
PREFETCH_BLOCKS = 2
# Activation reserve when the caller gives none: a tenth of the budget, at least 3 GiB. The floor
# is what a FLUX.1-dev call at 1024x1024 needs above its weights (the VAE decoding at full
# resolution): 2.6 GB on the H200 machine (peak 36.34 GB allocated, resident, over 33.74 GB of
# weights), plus room for the allocator's rounding. A call that needs more raises the reserve for
# the calls after it (see pipeline._learn_reserve).
DEFAULT_RESERVE_FRACTION = 0.1
MIN_RESERVE_BYTES = 3 << 30

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class Policy(str, Enum):
    """Where a component's weights live between its uses."""

    STAGED = "staged"  # on the device only while in use, loaded whole
    RESIDENT = "resident"  # loaded on first use, kept
    STREAMED = "streamed"  # trunk and some blocks kept, the other blocks loaded around their use

    @classmethod
    def parse(cls, value: str | Policy, what: str) -> Policy:
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(repr(p.value) for p in cls)
            raise ValueError(f"{what}: unknown residency policy {value!r}; use one of {choices}") from None


def parse_bytes(value: int | str, what: str = "vram_budget") -> int:
    """Bytes from an int or a string such as ``"24GB"``, ``"24 GiB"`` or ``"512MB"``."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{what} must be bytes (an int), a string such as '24GB', or 'auto'; got {value!r}")
    if isinstance(value, int):
        number, unit = value, ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(f"{what}={value!r} is not a size; write e.g. '24GB', '16GiB', '8000MB' or bytes as an int")
        number, unit = float(match.group(1)), match.group(2).lower()
    nbytes = int(number * _UNITS[unit])
    if nbytes <= 0:
        raise ValueError(f"{what} must be positive, got {value!r}")
    return nbytes


def format_bytes(nbytes: int) -> str:
    """Bytes in the largest decimal unit that keeps a digit before the point: "23.80 GB", "512.0 kB"."""
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes} B"


def default_reserve(budget: int) -> int:
    return max(MIN_RESERVE_BYTES, int(budget * DEFAULT_RESERVE_FRACTION))


@dataclass(frozen=True)
class ComponentSizes:
    """What the planner knows of one component.

    ``block_bytes`` are its repeated blocks in forward order (empty when it has none it can stream);
    ``per_step`` marks the component the pipeline calls at every denoising step.
    """

    name: str
    nbytes: int
    block_bytes: tuple[int, ...] = ()
    per_step: bool = False

    @property
    def trunk_bytes(self) -> int:
        return self.nbytes - sum(self.block_bytes)

    @property
    def streamable(self) -> bool:
        return len(self.block_bytes) > PREFETCH_BLOCKS


@dataclass(frozen=True)
class ComponentPlan:
    """Where one component's weights live. ``resident_blocks``: for a streamed component, the
    positions (in definition order) of the blocks that stay on the device; ``prefetch_blocks``: how
    many streamed blocks load ahead of the one running."""

    name: str
    policy: Policy
    resident_blocks: frozenset[int] = frozenset()
    prefetch_blocks: int = 0

    def resident_bytes(self, sizes: ComponentSizes) -> int:
        """Bytes this component keeps on the device across calls."""
        if self.policy is Policy.RESIDENT:
            return sizes.nbytes
        if self.policy is Policy.STREAMED:
            return sizes.trunk_bytes + sum(sizes.block_bytes[i] for i in self.resident_blocks)
        return 0

    def transient_bytes(self, sizes: ComponentSizes) -> int:
        """Bytes it adds on the device only while it runs."""
        if self.policy is Policy.STAGED:
            return sizes.nbytes
        if self.policy is Policy.STREAMED:
            return _window_bytes(sizes.block_bytes, self.resident_blocks, self.prefetch_blocks)
        return 0


def _window_bytes(block_bytes: Sequence[int], resident: frozenset[int], prefetch_blocks: int) -> int:
    # One block computing and ``prefetch_blocks`` loading, each slot as large as the largest streamed block.
    streamed = (nbytes for index, nbytes in enumerate(block_bytes) if index not in resident)
    return (1 + prefetch_blocks) * max(streamed, default=0)


@dataclass(frozen=True)
class ResidencyPlan:
    """A plan for every component, and the figures it was made from."""

    budget: int | None
    reserve: int
    components: tuple[ComponentPlan, ...]
    sizes: tuple[ComponentSizes, ...] = field(repr=False, default=())

    def __getitem__(self, name: str) -> ComponentPlan:
        for plan in self.components:
            if plan.name == name:
                return plan
        raise KeyError(name)

    @property
    def resident_weight_bytes(self) -> int:
        """Weight bytes the plan keeps on the device across calls."""
        return _resident(self.components, self.sizes)

    @property
    def transient_weight_bytes(self) -> int:
        """The most weight bytes any one component adds while it runs."""
        return _transient(self.components, self.sizes)

    def transient_bytes_of(self, name: str) -> int:
        """The weight bytes component ``name`` adds while it runs."""
        return self[name].transient_bytes(next(s for s in self.sizes if s.name == name))

    @property
    def peak_weight_bytes(self) -> int:
        """The most weight bytes the plan puts on the device at once."""
        return self.resident_weight_bytes + self.transient_weight_bytes

    def __str__(self) -> str:
        by_name = {s.name: s for s in self.sizes}
        rows = [("component", "policy", "GB", "resident GB", "blocks resident/streamed", "prefetch")]
        for plan in self.components:
            sizes = by_name[plan.name]
            blocks = "-"
            if plan.policy is Policy.STREAMED:
                resident = len(plan.resident_blocks)
                blocks = f"{resident}/{len(sizes.block_bytes) - resident}"
            rows.append(
                (
                    plan.name,
                    plan.policy.value,
                    f"{sizes.nbytes / 1e9:.3f}",
                    f"{plan.resident_bytes(sizes) / 1e9:.3f}",
                    blocks,
                    str(plan.prefetch_blocks) if plan.policy is Policy.STREAMED else "-",
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        table = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        budget = "none" if self.budget is None else format_bytes(self.budget)
        head = (
            f"vram budget {budget}, activation reserve {format_bytes(self.reserve)}, "
            f"peak weights {format_bytes(self.peak_weight_bytes)}"
        )
        return "\n".join([head, *table])


class BudgetTooSmallError(ValueError):
    pass


def _resident(plans: Sequence[ComponentPlan], sizes: Sequence[ComponentSizes]) -> int:
    by_name = {s.name: s for s in sizes}
    return sum(p.resident_bytes(by_name[p.name]) for p in plans)


def _transient(plans: Sequence[ComponentPlan], sizes: Sequence[ComponentSizes]) -> int:
    by_name = {s.name: s for s in sizes}
    return max((p.transient_bytes(by_name[p.name]) for p in plans), default=0)


def _peak(plans: Sequence[ComponentPlan], sizes: Sequence[ComponentSizes]) -> int:
    return _resident(plans, sizes) + _transient(plans, sizes)


def _streamed(sizes: ComponentSizes) -> ComponentPlan:
    return ComponentPlan(sizes.name, Policy.STREAMED, frozenset(), PREFETCH_BLOCKS)


def _away(sizes: ComponentSizes) -> ComponentPlan:
    """The cheapest way to keep a component off the device between its uses: streamed when its
    trunk and window take less room than the whole of it, else staged."""
    streamed = _streamed(sizes)
    if sizes.streamable and streamed.resident_bytes(sizes) + streamed.transient_bytes(sizes) < sizes.nbytes:
        return streamed
    return ComponentPlan(sizes.name, Policy.STAGED)


def _spread(positions: Sequence[int], count: int) -> list[int]:
    """``count`` of ``positions``, evenly spaced, the first one included."""
    return [positions[i * len(positions) // count] for i in range(count)]


@functools.lru_cache(maxsize=64)
def _resident_block_choices(sizes: ComponentSizes, prefetch_blocks: int) -> tuple[tuple[frozenset[int], int, int], ...]:
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
                choices[resident] = (sum(blocks[i] for i in resident), _window_bytes(blocks, resident, prefetch_blocks))
    ranked = sorted(choices.items(), key=lambda item: (-item[1][0], item[1][1], sorted(item[0])))
    return tuple((resident, resident_bytes, transient) for resident, (resident_bytes, transient) in ranked)


def _checked(sizes: Sequence[ComponentSizes], fixed: Mapping[str, Policy]) -> dict[str, Policy]:
    unknown = sorted(set(fixed) - {s.name for s in sizes})
    if unknown:
        raise ValueError(f"fixed policies for unknown components {unknown}")
    for s in sizes:
        if fixed.get(s.name) is Policy.STREAMED and not s.streamable:
            raise ValueError(
                f"{s.name!r} cannot stream: it has no repeated blocks (more than {PREFETCH_BLOCKS}) to stream; "
                "make it 'staged' or 'resident'"
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
) -> ResidencyPlan:
    """Plan every component for ``budget`` bytes of device memory, ``reserve`` of them kept for
    activations. ``fixed`` pins a component's policy (a user's choice, or a component that must stay
    resident); a fixed ``streamed`` component still gets its resident prefix chosen here.

    Raises :class:`BudgetTooSmallError` when even streaming everything streamable does not fit.
    """
    fixed = _checked(sizes, fixed or {})
    capacity = budget - reserve
    by_name = {s.name: s for s in sizes}

    def fixed_plan(s: ComponentSizes) -> ComponentPlan:
        return _as_given(s, fixed[s.name])

    def finish(plans: dict[str, ComponentPlan]) -> ResidencyPlan:
        return ResidencyPlan(budget, reserve, tuple(plans[s.name] for s in sizes), tuple(sizes))

    def most(s: ComponentSizes) -> ComponentPlan:
        # A fixed streamed component at its most: every block resident.
        if s.name not in fixed:
            return ComponentPlan(s.name, Policy.RESIDENT)
        plan = fixed_plan(s)
        return replace(plan, resident_blocks=frozenset(range(len(s.block_bytes)))) if plan.policy is Policy.STREAMED else plan

    resident = {s.name: most(s) for s in sizes}
    if _peak(list(resident.values()), sizes) <= capacity:
        return finish(resident)

    free = [s for s in sizes if s.name not in fixed]
    plans = {s.name: fixed_plan(s) if s.name in fixed else _away(s) for s in sizes}
    if _peak(list(plans.values()), sizes) > capacity:
        raise BudgetTooSmallError(
            f"vram_budget {format_bytes(budget)} is too small: with every component streamed or staged but "
            f"those you fixed, the weights need {format_bytes(_peak(list(plans.values()), sizes))} at once, "
            f"and {format_bytes(reserve)} is reserved for activations. Raise the budget to at least "
            f"{format_bytes(_peak(list(plans.values()), sizes) + reserve)}, or lower activation_reserve, or "
            "fix fewer components as resident."
        )
    # The per-step components first: whole if they fit, else as many resident blocks as fit. Only
    # then the once-per-call ones, smallest first, with what is left: a byte they take from a
    # per-step component would be streamed at every step to save one load per call.
    for group in ([s for s in free if s.per_step], sorted((s for s in free if not s.per_step), key=lambda s: s.nbytes)):
        for s in group:
            trial = {**plans, s.name: ComponentPlan(s.name, Policy.RESIDENT)}
            if _peak(list(trial.values()), sizes) <= capacity:
                plans = trial
        plans = _grow_streamed(plans, by_name, capacity)
    return finish(plans)


def _grow_streamed(
    plans: dict[str, ComponentPlan], by_name: Mapping[str, ComponentSizes], capacity: int
) -> dict[str, ComponentPlan]:
    """Give each streamed component, per-step ones first, the most resident block bytes that fit."""
    streamed = [name for name, p in plans.items() if p.policy is Policy.STREAMED]
    streamed.sort(key=lambda name: not by_name[name].per_step)
    all_sizes = list(by_name.values())
    for name in streamed:
        sizes, plan = by_name[name], plans[name]
        others = [p for other, p in plans.items() if other != name]
        other_resident, other_transient = _resident(others, all_sizes), _transient(others, all_sizes)
        for resident, block_bytes, transient in _resident_block_choices(sizes, plan.prefetch_blocks):
            if other_resident + sizes.trunk_bytes + block_bytes + max(other_transient, transient) <= capacity:
                plans = {**plans, name: replace(plan, resident_blocks=resident)}
                break
    return plans
