"""What a residency plan is: per component, where its weights live (resident, staged whole, or
streamed block by block through a window), and the figures it was made from; and the bytes such a
plan puts on the device at each moment of a call. Plain numbers, no tensor: :mod:`.planner` searches
among these plans, the hooks apply them, the residency profile stores them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .policy import Policy
from .step_timing import StepTiming
from .text import format_bytes, size_unit, text_table

if TYPE_CHECKING:  # host_budget places masters from a plan: it imports this module
    from .host_budget import HostPlacement

# One block computing and two in flight keep the copy stream busy behind the compute; a deeper
# window buys no bandwidth once the bus is saturated, and the room it would take serves better as
# resident blocks, which are never moved at all.
PREFETCH_BLOCKS = 2


@dataclass(frozen=True)
class ComponentSizes:
    """What the planner knows of one component.

    ``block_bytes`` are its repeated blocks in forward order (empty when it has none it can stream);
    ``per_step`` marks the component the pipeline calls at every denoising step; ``unsaved_bytes``
    are those of its tensors that no checkpoint holds (non-persistent buffers, a quantized weight's
    parts), which a host budget cannot serve from files (see host_budget), and
    ``block_unsaved_bytes`` those of each block (empty: none).
    """

    name: str
    nbytes: int
    block_bytes: tuple[int, ...] = ()
    per_step: bool = False
    unsaved_bytes: int = 0
    block_unsaved_bytes: tuple[int, ...] = ()

    def servable_block_bytes(self, position: int) -> int:
        """Bytes of one block that its checkpoint files hold."""
        unsaved = self.block_unsaved_bytes[position] if self.block_unsaved_bytes else 0
        return self.block_bytes[position] - unsaved

    @property
    def trunk_bytes(self) -> int:
        return self.nbytes - sum(self.block_bytes)

    @property
    def streamable(self) -> bool:
        return len(self.block_bytes) > PREFETCH_BLOCKS


@dataclass(frozen=True)
class ComponentPlan:
    """Where one component's weights live. For a streamed component, ``resident_blocks``: the
    positions (in definition order) of the blocks that stay on the device across calls;
    ``staged_blocks``: those kept only while the component runs (loaded when first reached in a
    call, dropped when a component that is not resident starts); ``prefetch_blocks``: how many of
    the other, streamed, blocks load ahead of the one running."""

    name: str
    policy: Policy
    resident_blocks: frozenset[int] = frozenset()
    prefetch_blocks: int = 0
    staged_blocks: frozenset[int] = frozenset()

    def resident_bytes(self, sizes: ComponentSizes) -> int:
        """Bytes this component keeps on the device across calls."""
        if self.policy is Policy.RESIDENT:
            return sizes.nbytes
        if self.policy is Policy.STREAMED:
            return sizes.trunk_bytes + blocks_bytes(sizes.block_bytes, self.resident_blocks)
        return 0

    def transient_bytes(self, sizes: ComponentSizes) -> int:
        """Bytes it adds on the device only while it runs."""
        if self.policy is Policy.STAGED:
            return sizes.nbytes
        if self.policy is Policy.STREAMED:
            staged = blocks_bytes(sizes.block_bytes, self.staged_blocks)
            return staged + window_bytes(sizes.block_bytes, self.resident_blocks | self.staged_blocks, self.prefetch_blocks)
        return 0


def blocks_bytes(block_bytes: Sequence[int], positions: Iterable[int]) -> int:
    # A timed plan sums the blocks of thousands of candidate plans: map, not a generator.
    return sum(map(block_bytes.__getitem__, positions))


def window_bytes(block_bytes: Sequence[int], kept: frozenset[int], prefetch_blocks: int) -> int:
    # One block computing and ``prefetch_blocks`` loading, each slot as large as the largest streamed block.
    streamed = [nbytes for index, nbytes in enumerate(block_bytes) if index not in kept]
    return (1 + prefetch_blocks) * max(streamed, default=0)


@dataclass(frozen=True)
class ResidencyPlan:
    """A plan for every component, and the figures it was made from: ``activations`` are the bytes
    each component was measured to need above the weights while it runs (a call's tensors, the
    allocator's rounding, a margin); ``reserve`` stands in for a component not measured."""

    budget: int | None
    reserve: int
    components: tuple[ComponentPlan, ...]
    sizes: tuple[ComponentSizes, ...] = field(repr=False, default=())
    activations: Mapping[str, int] = field(default_factory=dict)
    timings: Mapping[str, StepTiming] = field(default_factory=dict)
    # Where ``activations`` and ``timings`` come from, said when the plan prints: "measured" in this
    # process, "from the residency profile", or "" (the reserve stands in, or a measuring call's
    # plan); and the call shape they are for.
    source: str = ""
    shape: str | None = None
    # Which masters a host budget serves from checkpoint files, and why (see host_budget).
    host: HostPlacement | None = None

    def __getitem__(self, name: str) -> ComponentPlan:
        for plan in self.components:
            if plan.name == name:
                return plan
        raise KeyError(name)

    @functools.cached_property
    def _sizes_by_name(self) -> dict[str, ComponentSizes]:
        return {s.name: s for s in self.sizes}

    @property
    def resident_weight_bytes(self) -> int:
        """Weight bytes the plan keeps on the device across calls."""
        return resident_bytes_of(self.components, self._sizes_by_name)

    @property
    def transient_weight_bytes(self) -> int:
        """The most weight bytes any one component adds while it runs."""
        return _transient(self.components, self._sizes_by_name)

    def sizes_of(self, name: str) -> ComponentSizes:
        """The sizes component ``name``'s plan was made for."""
        return self._sizes_by_name[name]

    def transient_bytes_of(self, name: str) -> int:
        """The weight bytes component ``name`` adds while it runs."""
        return self[name].transient_bytes(self._sizes_by_name[name])

    def activation_bytes_of(self, name: str) -> int:
        """What component ``name`` needs above the weights while it runs: measured, else the reserve."""
        return self.activations.get(name, self.reserve)

    def weight_room(self, name: str) -> int:
        """The most weight bytes the device may hold while component ``name`` runs."""
        return self.budget - self.activation_bytes_of(name)

    @property
    def peak_weight_bytes(self) -> int:
        """The most weight bytes the plan puts on the device at once."""
        return self.resident_weight_bytes + self.transient_weight_bytes

    @property
    def keeps_everything(self) -> bool:
        """Whether every weight stays on the device across calls: then nothing moves after the first."""
        by_name = self._sizes_by_name
        return all(p.resident_bytes(by_name[p.name]) == by_name[p.name].nbytes for p in self.components)

    @property
    def peak_bytes(self) -> int:
        """The most the plan expects on the device at any moment of a call, activations included."""
        return call_peak(self.components, footprint_of(self._sizes_by_name), self.activation_bytes_of)

    def summary(self) -> str:
        """One line for the log: each component's policy, and a streamed one's blocks kept."""
        return ", ".join(
            f"{p.name} {p.policy.value}"
            + (
                f" ({len(p.resident_blocks)} blocks resident, {len(p.staged_blocks)} staged)"
                if p.policy is Policy.STREAMED
                else ""
            )
            for p in self.components
        )

    def __str__(self) -> str:
        by_name = self._sizes_by_name
        unit, size = size_unit(max((s.nbytes for s in self.sizes), default=0))
        rows = [
            ("component", "policy", unit, f"resident {unit}", "blocks resident/staged/streamed", "prefetch", f"activations {unit}")
        ]
        for plan in self.components:
            sizes = by_name[plan.name]
            blocks = "-"
            if plan.policy is Policy.STREAMED:
                resident, staged = len(plan.resident_blocks), len(plan.staged_blocks)
                blocks = f"{resident}/{staged}/{len(sizes.block_bytes) - resident - staged}"
            activations = f"{self.activations[plan.name] / size:.3f}" if plan.name in self.activations else "-"
            rows.append(
                (
                    plan.name,
                    plan.policy.value,
                    f"{sizes.nbytes / size:.3f}",
                    f"{plan.resident_bytes(sizes) / size:.3f}",
                    blocks,
                    str(plan.prefetch_blocks) if plan.policy is Policy.STREAMED else "-",
                    activations if self.budget is not None else "-",
                )
            )
        table = text_table(rows)
        budget = "none" if self.budget is None else format_bytes(self.budget)
        head = f"vram budget {budget}, peak weights {format_bytes(self.peak_weight_bytes)}"
        if self.budget is not None:
            measured = all(p.name in self.activations for p in self.components)
            head += f", peak with activations {format_bytes(self.peak_bytes)}, " + (
                "activations measured" if measured else f"activation reserve {format_bytes(self.reserve)} where not measured"
            )
        timed = [name for name, step in self.timings.items() if not step.estimated]
        estimated = [name for name, step in self.timings.items() if step.estimated]
        if timed:
            head += f", resident blocks of {', '.join(timed)} chosen from a timed step"
        if estimated:
            head += f", resident blocks of {', '.join(estimated)} chosen from a step estimated from blocks timed"
        if self.source:
            head += f"; figures {self.source}" + (f" for calls of {self.shape}" if self.shape else "")
        return "\n".join([head, *table, *(self.host.lines() if self.host is not None else ())])


class BudgetTooSmallError(ValueError):
    pass


def resident_bytes_of(plans: Sequence[ComponentPlan], by_name: Mapping[str, ComponentSizes]) -> int:
    """Weight bytes ``plans`` keep on the device across calls, all components together."""
    return sum(p.resident_bytes(by_name[p.name]) for p in plans)


def _transient(plans: Sequence[ComponentPlan], by_name: Mapping[str, ComponentSizes]) -> int:
    return max((p.transient_bytes(by_name[p.name]) for p in plans), default=0)


Footprint = Callable[["ComponentPlan"], tuple[int, int]]


def footprint_of(by_name: Mapping[str, ComponentSizes]) -> Footprint:
    """A component plan's (resident, transient) weight bytes, each plan's worked out once: a timed
    plan asks whether tens of thousands of candidates fit, each made of the same few plans."""
    known: dict[ComponentPlan, tuple[int, int]] = {}

    def footprint(plan: ComponentPlan) -> tuple[int, int]:
        found = known.get(plan)
        if found is None:
            sizes = by_name[plan.name]
            found = known[plan] = (plan.resident_bytes(sizes), plan.transient_bytes(sizes))
        return found

    return footprint


def call_peak(plans: Sequence[ComponentPlan], footprint: Footprint, activations: Callable[[str], int]) -> int:
    """The most on the device at any moment of a call: what stays, plus the running component's
    transient weights and activations, at its largest.

    A resident component evicts nothing when it starts (it may run interleaved with others, a
    ControlNet inside the denoising loop), so while it runs the transient weights of whichever
    component ran before it may still be there: its moment counts the largest of them."""
    bytes_of = [footprint(plan) for plan in plans]
    # A resident component's own transient bytes are 0: the largest of the others' is the largest.
    most_transient = max((transient for _, transient in bytes_of), default=0)
    moments = (
        (most_transient if plan.policy is Policy.RESIDENT else transient) + activations(plan.name)
        for plan, (_, transient) in zip(plans, bytes_of)
    )
    return sum(stays for stays, _ in bytes_of) + max(moments, default=0)
