"""Offloading modes measured side by side on one pipeline, in one process.

Each mode (an offloading scheme of :mod:`.schemes`) sets the pipeline up from the same starting
point (weights on the host, nothing hooked), runs its calls, every one timed, and tears itself down. Outputs are compared bit for bit with
the resident mode's, so a speed figure never hides a wrong pixel.
"""

from __future__ import annotations

import gc
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from diffusers import DiffusionPipeline

from .. import _device
from ..hooks import replays_cuda_graphs
from ..pipeline import residency_plan, residency_report
from ..text import first_line
from .compiling import CompileSettings, compile_denoiser, cuda_graphs_recorded, graphs_compiled, uncompile
from .host_memory import PeakAnonymous, anonymous_bytes, process_memory
from .phases import stamped_call
from .schemes import PINNED_MODES, Mode, ModeUnavailable
from .timing import calls_to_steady, host_cpu_ticks, steal_fraction, timed_calls
from .trace import FIRST_CALL_TRACES, summary_or_reason, traced_call, traced_first_call

logger = logging.getLogger(__name__)


# The ways of running one more call after the timed ones (``--trace``): under the profiler, and
# stamped at each component's entries with no profiler.
AFTER_TIMED_CALLS = {"after": traced_call, "phases": stamped_call}


@dataclass(frozen=True)
class ModeResult:
    mode: str
    # The steady figure: the mean of the last `calls` calls (those after the `warmup` first ones).
    seconds_per_call: float
    peak_allocated_bytes: int | None
    setup_seconds: float
    exact: bool | None
    # The cap the mode ran under (None: the whole device).
    budget_bytes: int | None = None
    # What the caching allocator held at the peak: tensors and cached blocks too fragmented to serve
    # the next request. A cap counts this, not the allocated peak.
    peak_reserved_bytes: int | None = None
    # Times the caching allocator ran out under the cap, synchronised the device to free its cache
    # and retried, over the steady calls: each one stalls the copies and the compute alike.
    alloc_retries: int | None = None
    # Every call's seconds, in order, the first ones included: what a user meets before the steady
    # figure; and from which call on they are steady (see calls_to_steady). The other figures
    # per call, and the peaks, are the steady calls' (the last `calls`, after the `warmup` first).
    call_seconds: tuple[float, ...] = ()
    calls_to_steady: int | None = None
    # For the pinned modes, each call's bytes loaded from the masters in host memory and seconds of
    # loading, in the same order (loads from checkpoint files left out, as from `load_gbps`): whether
    # a call is slow for what it loads or for how fast (a plan per call shape loads its own bytes).
    call_loads: tuple[tuple[int, float], ...] = ()
    # Over those calls, the share of the host's CPU time its hypervisor gave other guests (see
    # .timing.steal_fraction): what tells a process slow for its machine from one slow for its mode.
    host_steal_fraction: float | None = None
    # The wall clock (time.time()) as the steady calls began and ended; with --host-probe, the median
    # milliseconds of the host-speed loop the parent timed meanwhile (see .host_speed): what tells a
    # process slow for a slow host from one slow for its mode, where no CPU time was stolen.
    steady_wall: tuple[float, float] | None = None
    host_loop_ms: float | None = None
    # With --compile: the first call (tracing and compiling included), and graphs compiled during
    # the steady calls (recompilations: 0 when the weights' moves do not invalidate the graphs).
    first_call_seconds: float | None = None
    graphs_compiled_while_timed: int | None = None
    # With --compile-mode reduce-overhead (or another that replays CUDA graphs): CUDA graphs
    # recorded during the steady calls (0 when the weights come back where they were captured).
    cuda_graphs_recorded_while_timed: int | None = None
    # Resident set size of the process right after setup: what the mode costs in host memory.
    host_rss_bytes: int | None = None
    # Its anonymous part (RssAnon plus mlocked pages, see .host_memory) right after setup, and the
    # most of it sampled from setup to the last call: what a host budget bounds.
    host_anonymous_bytes: int | None = None
    peak_host_anonymous_bytes: int | None = None
    # The process's peak resident set size (VmHWM) at the end of the run, the pipeline's loading
    # included: anonymous pages and the files' pages it mapped alike.
    peak_host_rss_bytes: int | None = None
    loaded_bytes_per_call: int | None = None
    load_gbps: float | None = None
    # Over the steady calls, the rate of loads from masters served from checkpoint files (read into
    # the ring and copied to the device), for the pinned modes that have any.
    read_gbps: float | None = None
    # Host time in the package's hooks per steady call (residency_report()'s `host s`), waits for
    # the device inside them included: on a call whose host is slower than its device, it adds to
    # the call's time nearly in full.
    host_seconds_per_call: float | None = None
    report: str | None = None
    plan: str | None = None
    # Where the figures of the plan the first call ran under came from (ResidencyPlan.source: "from
    # the residency profile" in a process that started from one); the plan above is the last one,
    # which a replan since may have made from what the calls measured.
    first_plan_source: str | None = None
    # With --trace: one more call under the profiler, or stamped, summed up per component (see
    # .trace, .phases); or the first call under the profiler.
    trace: str | None = None
    error: str | None = None
    # The largest elementwise difference from the resident output (0.0 when exact), and, for a
    # compiled mode, whether that is within COMPILED_TOLERANCE.
    max_abs_diff: float | None = None
    within_tolerance: bool | None = None
    # Which pass over the modes it was measured in (see --rounds): its ratio to resident is taken
    # against the resident mode of the same round.
    round: int = 1

    @property
    def matches_resident(self) -> bool | None:
        """Equal to the resident output: bit for bit, or within COMPILED_TOLERANCE when compiled."""
        if self.exact is None:
            return None
        return self.exact or bool(self.within_tolerance)

    @property
    def within_budget(self) -> bool | None:
        if self.budget_bytes is None or self.peak_allocated_bytes is None:
            return None
        return self.peak_allocated_bytes <= self.budget_bytes

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "within_budget": self.within_budget}


# What a compiled mode may differ from the compiled resident mode by (tests/test_gpu.py asks the
# same): bfloat16's relative precision. Inductor's kernels for one graph need not round alike from
# one compile to the next, so bit equality is not asked of compiled modes.
COMPILED_TOLERANCE = {"rtol": 1.6e-2, "atol": 1e-2}


def _settle(device: torch.device) -> None:
    gc.collect()
    _device.synchronize(device)
    _device.empty_cache(device)
    if _device.is_accelerator(device):
        torch.accelerator.reset_peak_memory_stats(device)


def host_rss_bytes() -> int | None:
    """The process's resident set size (Linux only)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def run_mode(
    pipe: DiffusionPipeline,
    mode: Mode,
    device: torch.device,
    call: Callable[[], torch.Tensor],
    *,
    warmup: int,
    calls: int,
    reference: torch.Tensor | None,
    budget: int | None = None,
    compile: CompileSettings | None = None,
    trace: str | None = None,
) -> tuple[ModeResult, torch.Tensor | None]:
    """Cap the device at ``budget``, set the mode up (and compile its denoiser, as ``compile``
    says), run ``warmup`` then ``calls`` calls, every one timed, the steady figures taken over the
    last ``calls`` (with ``trace="after"``, one more under the profiler, see :mod:`.trace`; with
    ``"phases"``, one more stamped at each component's entries, see :mod:`.phases`; with
    ``"first"`` or ``"first-device"``, the first call under the profiler, a warm-up call, Python
    traced with the former), tear it down; return the figures and the
    first output (the reference for the modes after it when this is the resident mode)."""
    if mode.needs_accelerator and not _device.is_accelerator(device):
        return ModeResult(mode.name, float("nan"), None, float("nan"), None, budget, error="needs an accelerator"), None
    _settle(device)
    dtypes = _floating_dtypes(pipe)
    _device.cap_device_memory(device, budget)
    pinned = mode.name in PINNED_MODES
    sampler = PeakAnonymous().start()
    started = time.perf_counter()
    try:
        mode.setup(pipe, device, budget)
        _device.synchronize(device)
        setup_seconds = time.perf_counter() - started
        first_plan_source = residency_plan(pipe).source if pinned else None
        rss, anonymous = host_rss_bytes(), anonymous_bytes()
        if compile is not None:
            compile_denoiser(pipe, compile)
        seconds: list[float] = []
        # Loads so far, read before the first call and after each one, outside its time (see
        # call_loads).
        loads_so_far: list[tuple[int, float]] = []

        def note_loads() -> None:
            loads_so_far.append(_counters(pipe)[:2])

        after_each = note_loads if pinned else None
        if after_each is not None:
            after_each()
        ticks = host_cpu_ticks()
        first_traced = trace in FIRST_CALL_TRACES
        traced, first = (
            traced_first_call(pipe, call, device, seconds, python_functions=trace == "first")
            if first_traced
            else (None, None)
        )
        if first_traced and after_each is not None:
            after_each()
        output = timed_calls(call, device, warmup - first_traced, seconds, after_each)
        first = output if first is None else first
        graphs = graphs_compiled() if compile is not None else None
        # Inductor's graph trees are CUDA's only.
        count_cuda_graphs = compile is not None and device.type == "cuda" and replays_cuda_graphs(compile.kwargs())
        recorded = cuda_graphs_recorded(device) if count_cuda_graphs else None
        if _device.is_accelerator(device):
            torch.accelerator.reset_peak_memory_stats(device)
        before = _counters(pipe) if pinned else None
        retries = _device.allocator_retries(device)
        steady_from = time.time()
        output = timed_calls(call, device, calls, seconds, after_each)
        steady_wall = (steady_from, time.time())
        steal = steal_fraction(ticks, host_cpu_ticks())
        first = output if first is None else first
        peak, peak_reserved = _device.peak_allocated(device), _device.peak_reserved(device)
        retries = None if retries is None else _device.allocator_retries(device) - retries
        graphs = None if graphs is None else graphs_compiled() - graphs
        recorded = None if recorded is None else cuda_graphs_recorded(device) - recorded
        loaded, gbps, host, read_gbps = _traffic(pipe, before, calls) if pinned else (None, None, None, None)
        peak_anonymous = sampler.stop()
        report = str(residency_report(pipe)) if pinned else None
        plan = str(residency_plan(pipe)) if pinned else None
        if trace in AFTER_TIMED_CALLS:
            traced = summary_or_reason(AFTER_TIMED_CALLS[trace], pipe, call, device)
    except Exception as exc:  # a mode that fails is a result too (diffusers' modes fail on some paths)
        oom = isinstance(exc, torch.OutOfMemoryError)
        unavailable = isinstance(exc, ModeUnavailable)
        if oom or unavailable:
            error = "out of memory" if oom else str(exc)
        else:
            error = f"failed: {first_line(exc)}"
        logger.warning("%s %s", mode.name, error, exc_info=not (oom or unavailable))
        sampler.stop()
        peak, peak_reserved = _device.peak_allocated(device), _device.peak_reserved(device)
        _tear_down(pipe, mode, device, compile, dtypes)
        result = ModeResult(
            mode.name, float("nan"), peak, float("nan"), None, budget, peak_reserved_bytes=peak_reserved, error=error
        )
        return result, None
    _tear_down(pipe, mode, device, compile, dtypes)
    comparable = reference is not None and first.shape == reference.shape
    exact = None if reference is None else comparable and bool(torch.equal(first, reference))
    diff = float((first.float() - reference.float()).abs().max()) if comparable else None
    close = None
    if compile is not None and reference is not None:
        close = comparable and bool(torch.allclose(first.float(), reference.float(), **COMPILED_TOLERANCE))
    result = ModeResult(
        mode=mode.name,
        seconds_per_call=statistics.fmean(seconds[warmup:]),
        peak_allocated_bytes=peak,
        setup_seconds=setup_seconds,
        exact=exact,
        budget_bytes=budget,
        peak_reserved_bytes=peak_reserved,
        alloc_retries=retries,
        call_seconds=tuple(seconds),
        calls_to_steady=calls_to_steady(seconds, calls),
        call_loads=tuple(
            (after[0] - before[0], after[1] - before[1]) for before, after in zip(loads_so_far, loads_so_far[1:])
        ),
        host_steal_fraction=steal,
        steady_wall=steady_wall,
        first_call_seconds=seconds[0] if compile is not None else None,
        graphs_compiled_while_timed=graphs,
        cuda_graphs_recorded_while_timed=recorded,
        host_rss_bytes=rss,
        host_anonymous_bytes=anonymous,
        peak_host_anonymous_bytes=peak_anonymous,
        peak_host_rss_bytes=process_memory().get("VmHWM"),
        loaded_bytes_per_call=loaded,
        load_gbps=gbps,
        read_gbps=read_gbps,
        host_seconds_per_call=host,
        report=report,
        plan=plan,
        first_plan_source=first_plan_source,
        trace=traced,
        max_abs_diff=diff,
        within_tolerance=close,
    )
    return result, first


def _tear_down(
    pipe: DiffusionPipeline,
    mode: Mode,
    device: torch.device,
    compile: CompileSettings | None,
    dtypes: dict[str, set[torch.dtype]],
) -> None:
    mode.teardown(pipe)
    if compile is not None:
        uncompile(pipe)
    _device.cap_device_memory(device, None)
    _restore_dtypes(pipe, dtypes)


def _floating_dtypes(pipe: DiffusionPipeline) -> dict[str, set[torch.dtype]]:
    """Each module component's floating-point parameter dtypes."""
    modules = {name: c for name, c in getattr(pipe, "components", {}).items() if isinstance(c, torch.nn.Module)}
    return {name: {p.dtype for p in module.parameters() if p.is_floating_point()} for name, module in modules.items()}


def _restore_dtypes(pipe: DiffusionPipeline, before: dict[str, set[torch.dtype]]) -> None:
    # A call that fails midway can leave a component cast: SDXL upcasts its VAE to float32 inside
    # the call and casts it back at the end, which a call out of memory never reaches. Every mode
    # after it would then run another pipeline (and diffusers' modes fail on the dtype mismatch).
    after = _floating_dtypes(pipe)
    for name, dtypes in before.items():
        if len(dtypes) == 1 and after.get(name) != dtypes:
            (dtype,) = dtypes
            logger.warning("%s was left in %s; cast back to %s for the next mode", name, sorted(map(str, after[name])), dtype)
            pipe.components[name].to(dtype=dtype)


def _counters(pipe: DiffusionPipeline) -> tuple[int, float, float, int, float]:
    """Bytes loaded, seconds of loading, host seconds in the package's hooks, and bytes and seconds
    of loads from checkpoint files, so far."""
    components = residency_report(pipe).components
    return (
        sum(c.loaded_bytes for c in components),
        sum(c.load_seconds for c in components),
        sum(c.host_seconds for c in components),
        sum(c.read_bytes for c in components),
        sum(c.read_seconds for c in components),
    )


def _traffic(
    pipe: DiffusionPipeline, before: tuple[int, float, float, int, float], calls: int
) -> tuple[int, float | None, float, float | None]:
    """Per steady call, the bytes loaded (from files too) and the host seconds in the package's
    hooks; and the effective rates of the loads from masters in RAM and from files."""
    moved, seconds, host, read, reading = (now - then for now, then in zip(_counters(pipe), before))
    calls = max(calls, 1)
    rate = moved / seconds / 1e9 if seconds > 0 else None
    return (moved + read) // calls, rate, host / calls, (read / reading / 1e9 if reading > 0 else None)
