"""Watching a VRAM budget while calls run: who went over it or made the allocator retry, and what
each component of a measured call needed above the weights.

A :class:`BudgetWatch` is told when each component starts (``component_starts``, from the residency
group's switch) and when a call ends or fails; it tells what it learns through the callbacks it was
given (see :mod:`.adaptive`, which plans again from them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from . import _device
from .retention import RetentionBudget

logger = logging.getLogger(__name__)


class BudgetWatch:
    """A VRAM budget watched at each switch between components.

    It calls ``on_over_budget(component, overshoot, retried)`` when ``component`` was short of room,
    seen when another component starts: the device's peak allocated memory went ``overshoot``
    bytes past ``vram_budget`` while it ran, or (``retried``) the caching allocator ran out under
    a cap on the process (``set_per_process_memory_fraction``, a smaller GPU) and freed its cache
    to retry. Under a cap the peak never passes the budget: the retries, each a device
    synchronisation in the middle of the component's work, are the only sign. The peak
    statistics are reset after each, so that the next overshoot shows. They are reset as the
    watch starts too, so that an earlier workload's peak (the pipeline run resident before, say) neither
    counts against the budget nor hides an overshoot below it.

    With ``on_first_call``, the first whole call is measured: from ``call_start`` to
    ``call_start`` again after ``call_end`` ran (named, not taken from the first activation,
    which may come from outside a call: a component loaded at enable or at wake). The peak is
    reset (and the allocator's cache emptied) each time another component starts, and what
    each one needed above the weights (its reserved peak less the weight bytes loaded when it
    ended: the call's tensors, its activations, the allocator's fragmentation) is told once, as
    ``on_first_call({component: bytes}, retried)``, when the next call starts (or as the pipeline call
    returns, see :meth:`end_call`). A call that never reaches ``call_end`` (latents as output)
    does not count. While measuring, a peak over the budget is measured, not
    told, and retries are not told either (with ``retries_while_measuring``, they are, as
    ``on_first_call``'s second argument: the components that retried); ``on_first_step(component,
    bytes)`` is told what a streamed component needed in its first pass (see :meth:`first_pass_ran`)."""

    def __init__(
        self,
        device: torch.device,
        retention: RetentionBudget,
        loaded_bytes: Callable[[], int],
        vram_budget: int,
        on_over_budget: Callable[[str, int, bool], None],
        *,
        on_first_call: Callable[[dict[str, int], tuple[str, ...]], None] | None = None,
        on_first_step: Callable[[str, int], None] | None = None,
        call_start: str | None = None,
        call_end: str | None = None,
        retries_while_measuring: bool = False,
    ) -> None:
        """``loaded_bytes()``: the weight bytes on the device now (what a peak holds besides a
        component's needs); ``retention``: the budget whose cache kept over its limit a retry may
        blame."""
        self.device = device
        self.retention = retention
        self.loaded_bytes = loaded_bytes
        self.vram_budget = vram_budget
        self.on_over_budget = on_over_budget
        self.on_first_call = on_first_call
        self.on_first_step = on_first_step
        # Called as each call starts, until it returns True (done).
        self.on_call_start: Callable[[], bool] | None = None
        # What each component of the measured call needed above the weights, so far.
        self._measured: dict[str, int] = {}
        # The component whose call is under way (resident ones included): the peak seen when
        # another one starts is that one's. Unless its measurement was closed before (see
        # measure_running_until_here).
        self.running: str | None = None
        self._closed: str | None = None
        self._call_start = call_start
        self._call_end = call_end
        self.retries_while_measuring = retries_while_measuring
        self._call_started = self._call_end_ran = False
        if on_first_call is not None:
            # Cache an earlier workload left behind would take room the call is measured to need.
            _device.empty_cache(self.device)
        _device.reset_peak_allocated(self.device)
        # The allocator's count of out-of-memory retries when last read, and the components that
        # retried since the call began (see component_starts).
        self._retries_seen = _device.allocator_retries(self.device)
        self._retried: dict[str, None] = {}

    @property
    def measures_next_call(self) -> bool:
        """Whether the next whole call is measured (see :class:`BudgetWatch`)."""
        return self.on_first_call is not None

    @property
    def wants_timed_steps(self) -> bool:
        """Whether a step timed from here on would be used: in a measured call, whose plan is chosen
        from its timing, or while the steps are to be timed again under a plan (``on_call_start``,
        see ``retiming.Retime``). Otherwise nothing reads it but the report, and timing a step costs
        the host two events a block (10 ms a call for SDXL's UNet, whose steps wait on the host)."""
        return self.on_first_call is not None or self.on_call_start is not None

    def stop_measuring(self) -> None:
        """Measure no call, and time no step again: the plan in place was made from figures
        measured before (see ``adaptive.begin_call``). Retries seen under the plan before, in a
        measured call that never ran whole (one returning latents), are that call's: told now,
        they would go to this plan."""
        self.on_first_call = None
        self.on_first_step = None
        self.on_call_start = None
        self.drop_retries()

    def end_call(self) -> None:
        """The pipeline call returned: what its last component needed, overshot or retried is read
        now, and what the call taught is told now, rather than when the next call's first component
        starts: the next call may be of another shape, planned otherwise."""
        if self.running is None:
            return
        measured = self.on_first_call is not None
        self.component_starts(self._call_start)
        self.running = None
        if measured:
            # The measured call's peaks were measured, not overshot: the next call starts afresh.
            _device.reset_peak_allocated(self.device)

    def abort_call(self) -> None:
        """The pipeline call raised: what it measured so far is dropped (a call measured from here
        starts over at its first component), and what it retried or overshot is not told."""
        self.running = self._closed = None
        self._retried = {}
        self._measured = {}
        self._call_started = self._call_end_ran = False
        self._retries_seen = _device.allocator_retries(self.device)
        _device.reset_peak_allocated(self.device)

    def component_starts(self, component: str) -> bool:
        """Check the peak as ``component`` starts; True when a measured component just ended, and the
        peak is to be reset once the room for ``component`` is made (see :meth:`measure_from_here`)."""
        peak = _device.peak_allocated(self.device)
        if peak is None:
            return False
        ran, self.running = self.running, component
        closed, self._closed = self._closed, None
        retries, seen = _device.allocator_retries(self.device), self._retries_seen
        self._retries_seen = retries
        allocator_retried = retries is not None and seen is not None and retries > seen
        if self.on_first_call is None:
            kept_for = self.retention.kept_over_limit
            if allocator_retried:
                if kept_for is not None:
                    # The cache kept over the room of the component it was kept for did not fit
                    # what ran since: give it back there from now on, rather than plan more room.
                    self.retention.learn_release_before(kept_for)
                    self.retention.kept_over_limit = None
                    logger.info(
                        "The allocator retried while %r ran, with the cache kept as %r started: releasing it there",
                        ran,
                        kept_for,
                    )
                else:
                    self._retried[ran or component] = None
            if peak > self.vram_budget:
                self.on_over_budget(ran or component, peak - self.vram_budget, False)
                # Planned for: from here on a peak over the budget is a new one (a component
                # outgrowing the room it was just given, or another going over by less).
                _device.reset_peak_allocated(self.device)
            # Retries are told once a call, as it returns (see end_call) or as the next one
            # starts: a component that runs
            # between the steps of another (a resident ControlNet) switches at every step, and
            # the plan made for the first retries applies only at the next switch that evicts.
            if self._call_start is None or component == self._call_start:
                retried, self._retried = self._retried, {}
                for short in retried:
                    self.on_over_budget(short, 0, True)
                # Unset while it runs: one that raises is not called again at every call.
                on_call_start, self.on_call_start = self.on_call_start, None
                if on_call_start is not None and not on_call_start():
                    self.on_call_start = on_call_start
            return False
        # While measuring, a peak over the budget is measured like any other.
        if self.retries_while_measuring and allocator_retried:
            self._retried[ran or component] = None
        if component == ran:
            return False
        if ran is not None and ran != closed:
            need = self._need_above_weights(peak)
            self._measured[ran] = max(self._measured.get(ran, 0), need)
        self._watch_first_call(component)
        return self.on_first_call is not None

    def measured_so_far(self) -> dict[str, int]:
        """What each component of the measured call under way needed above the weights so far, the
        one running included (what it needed until now)."""
        measured = dict(self._measured)
        peak = _device.peak_allocated(self.device)
        if self.running is not None and self.running != self._closed and peak is not None:
            measured[self.running] = max(measured.get(self.running, 0), self._need_above_weights(peak))
        return measured

    def measure_running_until_here(self) -> None:
        """End the running component's measurement here, as the next component's start would: a
        plan about to be applied (see ``dry_run_plans.estimate_at_start``) may offload weights it
        ran beside, which its peak holds (a reset of CUDA's peak keeps what is allocated) and the
        weights loaded would no longer count, so that a later reading would take them for its need."""
        self._measured = self.measured_so_far()
        self._closed = self.running

    def _need_above_weights(self, peak_allocated: int) -> int:
        # Reserved, not allocated: blocks the allocator holds but cannot reuse (fragmentation)
        # count against the budget's cap as much as tensors do; a plan made from allocated peaks
        # hit the cap (and the allocator's synchronising retries).
        return (_device.peak_reserved(self.device) or peak_allocated) - self.loaded_bytes()

    def first_pass_ran(self, component: str) -> None:
        """A streamed component's first pass (a denoiser's first step) ran. In a measured call, what
        it needed above the weights is told now (``on_first_step``), so that its other steps can
        keep what that leaves room for, rather than stream every block to the call's end."""
        if self.on_first_call is None or self.on_first_step is None or component != self.running:
            return
        peak = _device.peak_allocated(self.device)
        if peak is not None:
            self.on_first_step(component, self._need_above_weights(peak))

    def measure_from_here(self) -> None:
        # Only while measuring: each component's own peak, from what is left once the others are
        # evicted, their cache given back so that it counts for no one. (After, peaks are reset
        # only when an overshoot is told, and otherwise left to whoever reads them, a benchmark say.)
        _device.empty_cache(self.device)
        _device.reset_peak_allocated(self.device)

    def _watch_first_call(self, component: str) -> None:
        if component == self._call_start:
            if not self._call_end_ran:
                if not self._call_started:
                    self._measured = {}  # what ran before the call (a component loaded at enable)
                self._call_started = True
                return
            on_first_call, self.on_first_call = self.on_first_call, None
            # Told with what was measured, for the one plan of the measured call's shape: told as
            # the next call starts, they would go to that call's plan, which may be another shape's.
            retried, self._retried = self._retried, {}
            on_first_call(self._measured, tuple(retried))
        elif component == self._call_end and self._call_started:
            self._call_end_ran = True

    def drop_retries(self) -> None:
        """Retries seen so far are nobody's shortfall: the plan they happened under is given up (an
        estimate its own call disproved, see ``adaptive.learn_activations``)."""
        self._retried = {}
        self.forget_retries()

    def forget_retries(self) -> None:
        """Allocations that retried until now are no component's shortfall (loads made at once
        for a new plan, say)."""
        self._retries_seen = _device.allocator_retries(self.device)
