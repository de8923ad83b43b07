"""When to give the caching allocator's memory back at a component boundary.

``enable_model_cpu_offload()`` calls ``empty_cache()`` after every component. That returns blocks the
very next component would have reused, and the next load pays ``cudaMalloc`` (and ``cudaFree``
waits for the whole device) again: a reload with the cache flushed took three times as long as
with it kept (docs/measurements.md). Keeping the cache forever is no better when
several pipelines or another process share the device. So the cache is kept while it stays within a
budget derived from what the stagers hold and what was actually observed, and while the device still
has physical headroom.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from . import _device

logger = logging.getLogger(__name__)

# Seed headroom over the staged bytes: retained blocks include fragmentation and activations freed at
# the same boundary, so the staged weights alone under-bound the working set. Observations take over
# from this seed at the first boundary that outgrows it.
STAGED_BYTES_MULTIPLIER = 2.0
# Margin over the largest cached-but-unallocated figure seen at a boundary. That peak already
# includes the workload's transient memory, so the margin only covers call-to-call variation.
OBSERVED_PEAK_MARGIN = 1.25
# Ceiling on the budget, so a large staged total or one odd observation can never let this process
# sit on most of a device that other processes or pipelines need.
MAX_CAPACITY_FRACTION = 0.25
# Release whenever less than this fraction of the device is physically free, whatever the budget.
MIN_FREE_FRACTION = 0.05
# Releases at a boundary learned from one retry are made this many times, then the cache is kept
# there once more, to see: one retry is no proof (another process allocating on the device makes
# the allocator retry too), and a release kept for good costs a device synchronisation and the
# memory mapped again at every call (SDXL at 8 GB ran up to twice as slow a call that way).
RELEASES_BEFORE_RETEST = 2


@dataclass(frozen=True)
class RetentionDecision:
    """What one boundary decided, and the figures it decided on (for logs and reports)."""

    released: bool
    reason: str
    cached: int = 0
    budget: int = 0
    free: int = 0
    total: int = 0


class RetentionBudget:
    """A bound on the allocator cache kept between components, shared by one pipeline's stagers.

    The budget is the larger of the staged bytes times :data:`STAGED_BYTES_MULTIPLIER` and the
    largest cached figure observed at a boundary times :data:`OBSERVED_PEAK_MARGIN`, capped at
    :data:`MAX_CAPACITY_FRACTION` of the device. Stagers grow it when they attach and shrink it when
    they detach. A boundary keeps the cache while it is within budget and at least
    :data:`MIN_FREE_FRACTION` of the device is free; cache over ``reserved_limit`` is released
    only before the components in ``release_over_limit_before``. Missing telemetry releases, as
    does any failure path (``release()``).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # Under a VRAM budget, the most the allocator may hold at a boundary: the budget less what
        # the component starting needs above its weights (set at each switch). Cache above it sits
        # in the room that component's activations were planned to take. It is kept all the same
        # until the allocator is seen to need it back (see release_over_limit_before): it reuses a
        # dropped block's memory for the next component's activations wherever its free blocks
        # fit them (any size, with expandable segments), and a release costs a device
        # synchronisation and, for the next loads and activations, all that memory mapped again
        # (SDXL at 8 GB ran visibly slower that way). Where the free blocks
        # do not fit, the allocator fails under a cap, frees its cache and retries, synchronising
        # mid-call.
        self.reserved_limit: int | None = None
        # Components the cache over reserved_limit is released for as they start: the allocator
        # retried after the boundary into them kept it (see kept_over_limit).
        self.release_over_limit_before: set[str] = set()
        # Of those, the ones learned from one retry in this process, with the releases left before
        # the cache is kept there again (see RELEASES_BEFORE_RETEST); and the ones being kept again,
        # which a second retry confirms. Only confirmed ones go into a residency profile.
        self._unconfirmed: dict[str, int] = {}
        self._retesting: set[str] = set()
        # Those two as learned for each call shape set before (see set_release_before), and the
        # shape they are for now: calls alternating two shapes each learn their own.
        self._learning: dict[str | None, tuple[dict[str, int], set[str]]] = {}
        self._learning_for: str | None = None
        # The component the last boundary that evicted anything kept cache over reserved_limit
        # for, if it did. Switches that evict nothing leave it: the cache kept there is still
        # held while the components after it run (FLUX.1 at 30 GB: kept as the transformer
        # starts, among the T5's dropped blocks, it left the VAE short after it).
        self.kept_over_limit: str | None = None
        self.weight_bytes = 0
        self.observed_cached_peak = 0
        self.releases = 0
        self.retains = 0

    def grow(self, weight_bytes: int) -> None:
        self.weight_bytes += weight_bytes

    def shrink(self, weight_bytes: int) -> None:
        self.weight_bytes = max(0, self.weight_bytes - weight_bytes)

    def resize(self, old_bytes: int, new_bytes: int) -> None:
        self.shrink(old_bytes)
        self.grow(new_bytes)

    def budget_for(self, total: int) -> int:
        seed = int(self.weight_bytes * STAGED_BYTES_MULTIPLIER)
        learned = int(self.observed_cached_peak * OBSERVED_PEAK_MARGIN)
        return min(max(seed, learned), int(total * MAX_CAPACITY_FRACTION))

    def _decide(self, starting: str | None) -> RetentionDecision:
        try:
            memory = _device.read_memory_telemetry(self.device)
        except Exception as exc:  # a backend whose allocator does not report
            return RetentionDecision(released=True, reason=f"no-telemetry ({exc})")
        if memory is None:
            return RetentionDecision(released=True, reason="no-telemetry")
        # Decide against the budget as it stood, then learn from the observation, so a one-off
        # over-budget boundary releases once and raises the budget for the boundaries after it.
        budget = self.budget_for(memory.total)
        figures = dict(cached=memory.cached, budget=budget, free=memory.free, total=memory.total)
        self.observed_cached_peak = max(self.observed_cached_peak, memory.cached)
        over_limit = self.reserved_limit is not None and memory.reserved > self.reserved_limit and memory.cached > 0
        if over_limit and (starting is None or starting in self.release_over_limit_before):
            return RetentionDecision(released=True, reason="over-vram-budget", **figures)
        if memory.cached > budget:
            return RetentionDecision(released=True, reason="cached-over-budget", **figures)
        if memory.free < memory.total * MIN_FREE_FRACTION:
            return RetentionDecision(released=True, reason="low-free-memory", **figures)
        if over_limit:
            self.kept_over_limit = starting
            return RetentionDecision(released=False, reason="over-vram-budget-kept", **figures)
        return RetentionDecision(released=False, reason="within-budget", **figures)

    def at_boundary(self, starting: str | None = None) -> RetentionDecision:
        """Decide, at a component boundary, whether to release the cache, and do it. ``starting``:
        the component about to run, whose room ``reserved_limit`` leaves."""
        if self.kept_over_limit in self._retesting:
            # Kept there again, and no retry since (a retry is told before this boundary, see
            # BudgetWatch.component_starts): the release was not needed. Learned anew if it ever is.
            self._retesting.discard(self.kept_over_limit)
        self.kept_over_limit = None
        decision = self._decide(starting)
        self._apply(decision)
        if decision.reason == "over-vram-budget" and starting in self._unconfirmed:
            self._unconfirmed[starting] -= 1
            if not self._unconfirmed[starting]:
                # Kept at the next boundary into it: a retry after that confirms the release.
                del self._unconfirmed[starting]
                self.release_over_limit_before.discard(starting)
                self._retesting.add(starting)
        return decision

    def learn_release_before(self, component: str) -> None:
        """The allocator retried after the boundary into ``component`` kept cache over
        ``reserved_limit``: release it there from now on. Learned from one retry, the release is
        made :data:`RELEASES_BEFORE_RETEST` times and then tried without once; a retry then
        confirms it, and only then does a residency profile keep it (see
        :meth:`confirmed_release_before`)."""
        self.release_over_limit_before.add(component)
        if component in self._retesting:
            self._retesting.discard(component)
        else:
            self._unconfirmed[component] = RELEASES_BEFORE_RETEST

    def confirmed_release_before(self) -> frozenset[str]:
        """The boundaries that release cache over ``reserved_limit`` but those learned from a single
        retry: what a residency profile keeps for later processes."""
        return frozenset(self.release_over_limit_before - self._unconfirmed.keys())

    def set_release_before(self, components: Iterable[str] = (), *, learned_for: str | None = None) -> None:
        """Release over ``reserved_limit`` before ``components`` (confirmed ones: a residency
        profile's for the call shape ``learned_for``), and before those that one retry taught for
        that shape in this process, still being confirmed; what is being learned for the shape
        before is kept for when it comes back."""
        self._learning[self._learning_for] = (self._unconfirmed, self._retesting)
        self._learning_for = learned_for
        self._unconfirmed, self._retesting = self._learning.pop(learned_for, ({}, set()))
        self.release_over_limit_before = set(components) | self._unconfirmed.keys()

    def forget_releases(self) -> None:
        """Release nowhere over ``reserved_limit``, and forget what retries taught, for every shape."""
        self.release_over_limit_before = set()
        self._unconfirmed, self._retesting = {}, set()
        self._learning, self._learning_for = {}, None

    def release(self, reason: str = "forced") -> RetentionDecision:
        """Release the cache unconditionally (failure paths, sleep)."""
        decision = RetentionDecision(released=True, reason=reason)
        self._apply(decision)
        return decision

    def _apply(self, decision: RetentionDecision) -> None:
        logger.debug(
            "%s allocator cache on %s (%s): cached=%d budget=%d staged=%d observed_peak=%d free=%d total=%d",
            "Releasing" if decision.released else "Retaining",
            self.device,
            decision.reason,
            decision.cached,
            decision.budget,
            self.weight_bytes,
            self.observed_cached_peak,
            decision.free,
            decision.total,
        )
        if decision.released:
            self.releases += 1
            _device.empty_cache(self.device)
        else:
            self.retains += 1
