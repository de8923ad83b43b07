"""Offloading modes measured side by side on one pipeline, in one process.

Each mode sets the pipeline up from the same starting point (weights on the host, nothing hooked),
runs its calls, every one timed, and tears itself down. Outputs are compared bit for bit with
the resident mode's, so a speed figure never hides a wrong pixel.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from diffusers import DiffusionPipeline

from .. import _device
from ..hooks import replays_cuda_graphs
from ..pipeline import disable_pinned_offload, enable_pinned_offload, residency_plan, residency_report
from ..planner import default_reserve
from ..text import first_line
from .compiling import CompileSettings, compile_denoiser, cuda_graphs_recorded, graphs_compiled, uncompile
from .host_memory import PeakAnonymous, anonymous_bytes, drop_page_cache, process_memory
from .phases import stamped_call
from .timing import calls_to_steady, host_cpu_ticks, steal_fraction, timed_calls
from .trace import FIRST_CALL_TRACES, summary_or_reason, traced_call, traced_first_call

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Mode:
    """How to put a host-resident pipeline under one offloading scheme, and how to undo it.

    ``setup`` gets the VRAM budget the run is capped at (None: the whole device); only a mode that
    plans for a budget uses it, the others simply run under the cap or run out of memory."""

    name: str
    setup: Callable[[DiffusionPipeline, torch.device, int | None], None]
    teardown: Callable[[DiffusionPipeline], None]
    # accelerate's sequential offload moves weights through the meta device and cannot run on the
    # CPU (nor be undone there).
    needs_accelerator: bool = False
    # False for a mode whose teardown only frees the device (mmgp rewrites every module's forward
    # and moves the weights into pinned buffers of its own, with no way back): every mode after it
    # would measure a pipeline it changed, so it runs once, after all the others.
    undoable: bool = True


class ModeUnavailable(RuntimeError):
    """A mode that cannot run in this process (a package missing, a device it does not support):
    reported as that mode's result, without a traceback."""


def _resident(pipe: DiffusionPipeline, device: torch.device, budget: int | None) -> None:
    pipe.to(device)


def _to_host(pipe: DiffusionPipeline) -> None:
    pipe.to("cpu")


# The ways of running one more call after the timed ones (``--trace``): under the profiler, and
# stamped at each component's entries with no profiler.
AFTER_TIMED_CALLS = {"after": traced_call, "phases": stamped_call}


# The pinned modes: all masters in RAM; masters beyond --host-budget served from the checkpoint
# files with their page cache warm (as enabling left it); the same, the page cache dropped after
# enabling, before the first call.
PINNED_MODES = ("pinned", "pinned_files", "pinned_files_cold")


def pinned_mode(
    activation_reserve: int | str | None = None,
    components: Mapping[str, str] | None = None,
    host_budget: int | str | None = None,
    name: str = "pinned",
) -> Mode:
    """``enable_pinned_offload`` planned for the run's budget (``"auto"`` when there is none), with
    the policies ``components`` names kept as given; for the ``pinned_files`` modes (see
    PINNED_MODES), with ``host_budget``."""
    if name not in PINNED_MODES:
        raise ValueError(f"{name!r} is not one of {PINNED_MODES}")
    if (name == "pinned") != (host_budget is None):
        raise ValueError(f"{name} runs {'without' if name == 'pinned' else 'with'} a host budget (--host-budget)")

    def setup(pipe: DiffusionPipeline, device: torch.device, budget: int | None) -> None:
        vram_budget = "auto" if budget is None else budget
        enable_pinned_offload(
            pipe,
            device,
            components=components,
            vram_budget=vram_budget,
            activation_reserve=activation_reserve,
            host_budget=host_budget,
        )
        if name == "pinned_files_cold":
            drop_page_cache(pipe.name_or_path)

    return Mode(name, setup, disable_pinned_offload)


def _needs_host_budget(pipe: DiffusionPipeline, device: torch.device, budget: int | None) -> None:
    raise ModeUnavailable("needs --host-budget")


def _model_cpu_offload(pipe: DiffusionPipeline, device: torch.device, budget: int | None) -> None:
    pipe.enable_model_cpu_offload(device=device)


def _sequential_cpu_offload(pipe: DiffusionPipeline, device: torch.device, budget: int | None) -> None:
    pipe.enable_sequential_cpu_offload(device=device)


def _remove_model_cpu_offload(pipe: DiffusionPipeline) -> None:
    pipe.remove_all_hooks()
    pipe.to("cpu")


def _group_offload(offload_type: str) -> Callable[[DiffusionPipeline, torch.device, int | None], None]:
    def setup(pipe: DiffusionPipeline, device: torch.device, budget: int | None) -> None:
        # Streams are what make it fast; the CPU has none, and diffusers refuses them there.
        stream = _device.is_accelerator(device)
        extra = {} if offload_type == "leaf_level" else {"num_blocks_per_group": 1}
        pipe.enable_group_offload(onload_device=device, offload_type=offload_type, use_stream=stream, **extra)

    return setup


def _remove_group_offload(pipe: DiffusionPipeline) -> None:
    # diffusers has no public way to remove group offloading; these are the hook names it registers
    # (see diffusers.hooks.group_offloading._maybe_remove_and_reapply_group_offloading).
    from diffusers.hooks import HookRegistry
    from diffusers.hooks.group_offloading import (
        _GROUP_OFFLOADING,
        _LAYER_EXECUTION_TRACKER,
        _LAZY_PREFETCH_GROUP_OFFLOADING,
    )

    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            registry = HookRegistry.check_if_exists_or_initialize(component)
            for name in (_GROUP_OFFLOADING, _LAYER_EXECUTION_TRACKER, _LAZY_PREFETCH_GROUP_OFFLOADING):
                registry.remove_hook(name, recurse=True)
    pipe.to("cpu")


# What the mmgp mode was written against: offload.all's arguments and budget rules change between
# releases, and mmgp 3.8.2 needs optimum-quanto 0.2.7.
MMGP_INSTALL = "pip install mmgp==3.8.2 optimum-quanto==0.2.7"

# mmgp's budgets are in MiB (offload.py: ONE_MB = 1048576).
_MIB = 1 << 20


def mmgp_budgets(budget: int | None) -> dict[str, int] | None:
    """mmgp's ``budgets`` for a run capped at ``budget`` bytes.

    No cap: None, mmgp's "no budget" profile (each model moves to the device whole when called).
    A cap: one budget for every model (``"*"``; mmgp moves one model at a time, text encoders and
    VAE aside), the cap less the activation reserve the pinned mode keeps by default, so both
    modes leave the same room for activations. At least 1 MiB: mmgp reads 0 as no budget at all.
    """
    if budget is None:
        return None
    return {"*": max(1, (budget - default_reserve(budget)) // _MIB)}


def _mmgp(pipe: DiffusionPipeline, device: torch.device, budget: int | None) -> None:
    # mmgp moves weights to "cuda", the current device, whatever the pipeline was asked to run on.
    if not _device.same_device(device, torch.device("cuda")):
        raise ModeUnavailable(f"mmgp runs on the current CUDA device only, not {device}")
    try:
        from mmgp import offload
    except ImportError as exc:
        raise ModeUnavailable(f"needs mmgp ({exc}): {MMGP_INSTALL}") from exc
    # mmgp prints its banner and plans on stdout, where the benchmark prints its results.
    with contextlib.redirect_stdout(sys.stderr):
        offload.all(
            pipe,
            pinnedMemory=True,
            quantizeTransformer=False,
            budgets=mmgp_budgets(budget),
            # mmgp casts float32 weights to bfloat16 by default, which would have a float32 run
            # move half the bytes the other modes move.
            convertWeightsFloatTo=pipe.dtype,
        )


def _release_mmgp(pipe: DiffusionPipeline) -> None:
    # Frees the device memory mmgp holds; the hooks and pinned weights stay (mmgp has no way to
    # remove them), which is why this mode runs last.
    offload = sys.modules.get("mmgp.offload")
    manager = None if offload is None else offload.last_offload_obj
    if manager is not None:
        manager.release()
    # offload.all leaves "cuda" as the process's default device.
    torch.set_default_device(None)


MODES: dict[str, Mode] = {
    "resident": Mode("resident", _resident, _to_host),
    "pinned": pinned_mode(),
    # Made from --host-budget (see PINNED_MODES).
    "pinned_files": Mode("pinned_files", _needs_host_budget, disable_pinned_offload),
    "pinned_files_cold": Mode("pinned_files_cold", _needs_host_budget, disable_pinned_offload),
    "model_cpu_offload": Mode("model_cpu_offload", _model_cpu_offload, _remove_model_cpu_offload),
    "sequential_cpu_offload": Mode(
        "sequential_cpu_offload", _sequential_cpu_offload, _remove_model_cpu_offload, needs_accelerator=True
    ),
    "group_offload_block": Mode("group_offload_block", _group_offload("block_level"), _remove_group_offload),
    "group_offload_leaf": Mode("group_offload_leaf", _group_offload("leaf_level"), _remove_group_offload),
    "mmgp": Mode("mmgp", _mmgp, _release_mmgp, needs_accelerator=True, undoable=False),
}


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
