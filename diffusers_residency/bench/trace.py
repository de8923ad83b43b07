"""One pipeline call under ``torch.profiler``, summed up per component: where the host's time went
and how long the device waited for it.

A call whose host issues kernels more slowly than the device runs them is bound by the host: any
host time spent staging weights (see ``residency_report()``'s ``host s``) shows as the device
idling. The s/call of the benchmark cannot say where that happens; a trace can. Each component's
forward (and a VAE's ``decode``) runs inside a profiler range, and for each component the summary
gives the host time inside its ranges, the device time of its kernels and copies, and the device's
idle time within them; the length of each entry of a component entered more than once (a
denoiser's steps, where a first step that loads or plans shows); then the longest stretches the
device sat idle during the call, with the component the host was in and the host operations that
ran meanwhile; then, where Python was traced (``python_functions=True``), the functions of this
package the host spent longest in, and its device synchronisations and cache releases: where a
first call's planning and measuring go.

The ranges are added for the traced call only: a ``record_function`` in every forward would cost
every call something.
"""

from __future__ import annotations

import collections
import json
import logging
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import torch
from diffusers import DiffusionPipeline
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from .. import _device
from ..text import first_line, text_table

logger = logging.getLogger(__name__)

# Methods a component is entered through: a VAE decodes through ``decode``, not ``forward``.
_ENTRY_METHODS = ("forward", "encode", "decode")
_PREFIX = "component:"
_CALL = "pipeline call"
# Device idle stretches shorter than this are launch latency, not the host falling behind.
_GAP_MIN_US = 1000.0
_GAPS_SHOWN = 5
# Host operations shorter than this are not named in a gap (there are thousands a call).
_OP_MIN_US = 300.0
# Device events by what they are counted as.
_DEVICE_WORK = {"kernel": "kernel", "gpu_memset": "kernel", "gpu_memcpy": "copy"}
# Traced Python functions shown: this package's own (not the benchmark's), and the runtime calls
# that wait for the device or give its memory back.
_PACKAGE_FILES = "diffusers_residency/"
_BENCH_FILES = "diffusers_residency/bench/"
_WAITING_BUILTINS = ("synchronize", "emptyCache", "empty_cache")
_FUNCTIONS_SHOWN = 15
# Runtime calls that hold the host this long are waits, not the microseconds a launch takes.
_WAIT_MIN_US = 300.0
_WAITS_SHOWN = 8
_RUNTIME = ("cuda_runtime", "cuda_driver")

Interval = tuple[float, float]

# The benchmark's ways of tracing a first call: with Python traced too, and without.
FIRST_CALL_TRACES = ("first", "first-device")


@dataclass(frozen=True)
class ComponentTrace:
    """One component's share of the traced call, over all its entries (a denoiser's every step).
    Device figures are None without an accelerator."""

    name: str
    entries: int
    host_ms: float
    kernel_ms: float | None
    copy_ms: float | None
    device_idle_ms: float | None


@dataclass(frozen=True)
class DeviceGap:
    """A stretch of the call with nothing running on the device."""

    ms: float
    at_ms: float  # from the start of the call
    component: str | None  # the component the host was in, if any
    host_ops: tuple[tuple[str, float], ...]  # the longest host operations meanwhile, with their ms


@dataclass(frozen=True)
class FunctionTime:
    """A traced Python function's calls and host time within the call (a recursive one's outermost
    calls only)."""

    name: str  # as the profiler names it: "path/to/module.py(line): function"
    calls: int
    ms: float


@dataclass(frozen=True)
class RuntimeWait:
    """Runtime (or driver) calls of one name that each held the host ``_WAIT_MIN_US`` or more, made
    in one component, with what the device ran meanwhile. A synchronisation shows here, and so does
    a kernel's first launch in a process: CUDA loads kernels as they are first launched (its default
    lazy loading), and a load may wait for the whole device. Copies running through such a wait,
    with no kernel beside them, are compute held back behind copies queued ahead."""

    name: str
    component: str | None
    calls: int
    ms: float
    copy_ms: float  # device copies running meanwhile
    kernel_ms: float  # device kernels running meanwhile


@dataclass(frozen=True)
class CallTrace:
    wall_ms: float
    device_busy_ms: float | None
    components: tuple[ComponentTrace, ...]
    gaps: tuple[DeviceGap, ...]
    # The ms of each entry, in order, of the components entered more than once.
    entry_ms: tuple[tuple[str, tuple[float, ...]], ...] = ()
    functions: tuple[FunctionTime, ...] = ()
    waits: tuple[RuntimeWait, ...] = ()

    def __str__(self) -> str:
        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value:.1f}"

        busy = "" if self.device_busy_ms is None else f", device busy {self.device_busy_ms:.1f} ms"
        header = ("component", "entries", "host ms", "kernel ms", "copy ms", "device idle ms")
        rows = [
            (c.name, str(c.entries), ms(c.host_ms), ms(c.kernel_ms), ms(c.copy_ms), ms(c.device_idle_ms))
            for c in self.components
        ]
        lines = [f"one call traced: {self.wall_ms:.1f} ms wall{busy}", *text_table((header, *rows))]
        for name, entries in self.entry_ms:
            lines.append(f"{name}, each entry: " + ", ".join(f"{entry:.1f}" for entry in entries) + " ms")
        if self.gaps:
            lines.append(f"longest device idle stretches (over {_GAP_MIN_US / 1000:.0f} ms):")
        for gap in self.gaps:
            ops = ", ".join(f"{name} {op_ms:.1f} ms" for name, op_ms in gap.host_ops) or "no long host operation"
            lines.append(f"  {gap.ms:.1f} ms at +{gap.at_ms:.1f} ms, host in {gap.component or '-'}: {ops}")
        if self.waits:
            over = f"each over {_WAIT_MIN_US / 1000:.1f} ms"
            lines.append(f"runtime calls that held the host ({over}), and what the device ran meanwhile:")
        for wait in self.waits:
            lines.append(
                f"  {wait.ms:.1f} ms in {wait.calls} {wait.name}, host in {wait.component or '-'}: "
                f"copies {wait.copy_ms:.1f} ms, kernels {wait.kernel_ms:.1f} ms"
            )
        if self.functions:
            lines.append("host time in this package's functions and in device waits (Python traced, so slowed):")
        for function in self.functions:
            lines.append(f"  {function.ms:.1f} ms in {function.calls} calls: {function.name}")
        return "\n".join(lines)


def traced_call(
    pipe: DiffusionPipeline, call: Callable[[], object], device: torch.device, *, python_functions: bool = False
) -> CallTrace:
    """Run ``call`` once under the profiler, with a range around every entry into a component; with
    ``python_functions``, every Python call traced too (which slows the host: the functions' times
    say where the host went, not how long that takes untraced)."""
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with component_entries(pipe, _ranged), profile(activities=activities, with_stack=python_functions) as profiler:
        started = time.perf_counter()
        with record_function(_CALL):
            call()
            _device.synchronize(device)
        wall_ms = (time.perf_counter() - started) * 1000
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        profiler.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    return summarise(events, wall_ms, with_device=device.type == "cuda")


def summary_or_reason(
    describe: Callable[[DiffusionPipeline, Callable[[], object], torch.device], object],
    pipe: DiffusionPipeline,
    call: Callable[[], object],
    device: torch.device,
) -> str:
    """One more call as ``describe`` runs and sums it up (:func:`traced_call`, or
    :func:`~.phases.stamped_call`), or why there is none: a failure leaves the timed figures be."""
    try:
        return str(describe(pipe, call, device))
    except Exception as exc:
        logger.warning("%s failed", getattr(describe, "__name__", "describing a call"), exc_info=True)
        return f"no trace: {first_line(exc)}"


def traced_first_call(
    pipe: DiffusionPipeline,
    call: Callable[[], torch.Tensor],
    device: torch.device,
    seconds: list[float],
    *,
    python_functions: bool,
) -> tuple[str, torch.Tensor]:
    """The first call under the profiler: its summary and its output, its time appended to
    ``seconds`` (the profiler's own cost included: it is where a first call's excess goes that this
    shows, not its length). With ``python_functions``, Python is traced too, to show the planning
    and measuring a first call does; without, the host's waits keep their own length. A failure
    fails the mode, as an untraced first call's would."""
    outputs: list[torch.Tensor] = []
    traced = traced_call(pipe, lambda: outputs.append(call()), device, python_functions=python_functions)
    seconds.append(traced.wall_ms / 1000)
    return str(traced), outputs[0]


@contextmanager
def component_entries(
    pipe: DiffusionPipeline, wrap: Callable[[Callable, str], Callable]
) -> Iterator[tuple[str, ...]]:
    """Each entry into each component (its ``forward``, ``encode``, ``decode``) goes through
    ``wrap(method, component_name)`` for as long as the context lasts: a profiler range around it
    here, device stamps in :mod:`.phases`. Gives the components whose forward is left alone.

    The bound methods are wrapped on the instance (where accelerate's hooks put their own forward),
    and the instance attribute is put back, or removed, afterwards. The forward of a component
    compiled whole (``module.compile()``) is left alone: dynamo would compile the wrapper anew
    (compile time in the traced call) and drop the range anyway; that component gets no row."""
    replaced: list[tuple[nn.Module, str, object, Callable]] = []
    compiled_whole: list[str] = []
    for name, component in pipe.components.items():
        if not isinstance(component, nn.Module):
            continue
        if getattr(component, "_compiled_call_impl", None) is not None:
            compiled_whole.append(name)
        for method in _ENTRY_METHODS:
            if method == "forward" and name in compiled_whole:
                continue
            original = getattr(component, method, None)
            if original is None:
                continue
            wrapper = wrap(original, name)
            replaced.append((component, method, component.__dict__.get(method), wrapper))
            setattr(component, method, wrapper)
    try:
        yield tuple(compiled_whole)
    finally:
        for component, method, own, wrapper in reversed(replaced):
            if component.__dict__.get(method) is not wrapper:
                continue  # replaced again meanwhile: what replaced it stays
            if own is None:
                del component.__dict__[method]
            else:
                setattr(component, method, own)


def _ranged(method: Callable, component: str) -> Callable:
    label = _PREFIX + component

    def entered(*args, **kwargs):
        with record_function(label):
            return method(*args, **kwargs)

    return entered


def summarise(events: list[dict], wall_ms: float, *, with_device: bool) -> CallTrace:
    """Sum a Chrome trace of one call (``torch.profiler``'s export) up per component.

    Device work belongs to the component whose range its launch was made in: a kernel or copy and
    the runtime call that queued it share a correlation id. (The profiler's device-side ranges
    cannot stand in: it makes one per stream a range queued work on, and none for a range that
    queued nothing.) A component's device idle time is the time within its host ranges when
    nothing ran on the device."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    # Outer ranges first where two start together: one that starts inside another counts in it.
    host_ranges = sorted((e for e in spans if e.get("cat") == "user_annotation"), key=_outer_first)
    entries: dict[str, list[Interval]] = {}
    for event in host_ranges:
        label = event["name"]
        if not label.startswith(_PREFIX):
            continue
        ranges = entries.setdefault(label[len(_PREFIX) :], [])
        if ranges and event["ts"] < ranges[-1][1]:
            continue  # entered from inside its own range (a VAE's forward calls its decode): counted there
        ranges.append((event["ts"], event["ts"] + event["dur"]))
    device = [e for e in spans if e.get("cat") in _DEVICE_WORK]
    busy = _union((e["ts"], e["ts"] + e["dur"]) for e in device)
    launched = {
        e["args"]["correlation"]: e["ts"]
        for e in spans
        if e.get("cat") in _RUNTIME and "correlation" in e.get("args", {})
    }
    work: dict[tuple[str, str], list[Interval]] = collections.defaultdict(list)
    for event in device:
        launch = launched.get(event.get("args", {}).get("correlation"))
        owner = None if launch is None else _owner(entries, launch)
        if owner is not None:
            work[owner, _DEVICE_WORK[event["cat"]]].append((event["ts"], event["ts"] + event["dur"]))

    def device_ms(name: str, ranges: list[Interval], kind: str) -> float | None:
        if not with_device:
            return None
        if kind == "idle":
            return sum((end - start) - _length(_clip(busy, start, end)) for start, end in ranges) / 1000
        return _length(_union(work[name, kind])) / 1000

    components = tuple(
        ComponentTrace(
            name,
            len(ranges),
            _length(ranges) / 1000,
            device_ms(name, ranges, "kernel"),
            device_ms(name, ranges, "copy"),
            device_ms(name, ranges, "idle"),
        )
        for name, ranges in entries.items()
    )
    entry_ms = tuple(
        (name, tuple((end - start) / 1000 for start, end in ranges))
        for name, ranges in entries.items()
        if len(ranges) > 1
    )
    functions = _function_times(spans)
    call = next((e for e in host_ranges if e["name"] == _CALL), None)
    if not with_device or call is None:
        return CallTrace(wall_ms, None, components, (), entry_ms, functions)
    start, end = call["ts"], call["ts"] + call["dur"]
    inside = _clip(busy, start, end)
    gaps = _gaps(inside, start, end, entries, spans)
    waits = _runtime_waits(spans, entries, device)
    return CallTrace(wall_ms, _length(inside) / 1000, components, gaps, entry_ms, functions, waits)


def _function_times(spans: list[dict]) -> tuple[FunctionTime, ...]:
    """The traced Python functions of this package, and the runtime's device waits, by host time
    (a built-in method's calls on every object of its type together). A call made from inside
    another call of the same function is counted in that one."""
    calls: dict[str, list[Interval]] = collections.defaultdict(list)
    for event in sorted((e for e in spans if e.get("cat") == "python_function"), key=_outer_first):
        name = event["name"]
        own = name.startswith(_PACKAGE_FILES) and not name.startswith(_BENCH_FILES)
        if not own and not (name.startswith("<built-in") and any(word in name for word in _WAITING_BUILTINS)):
            continue
        ranges = calls[_builtin_name(name)]
        if ranges and event["ts"] < ranges[-1][1]:
            continue
        ranges.append((event["ts"], event["ts"] + event["dur"]))
    times = [FunctionTime(name, len(ranges), _length(ranges) / 1000) for name, ranges in calls.items()]
    return tuple(sorted(times, key=lambda f: -f.ms)[:_FUNCTIONS_SHOWN])


def _runtime_waits(
    spans: list[dict], entries: dict[str, list[Interval]], device: list[dict]
) -> tuple[RuntimeWait, ...]:
    """The runtime calls that held the host, by name and component, the longest first."""
    copies = _union((e["ts"], e["ts"] + e["dur"]) for e in device if _DEVICE_WORK[e["cat"]] == "copy")
    kernels = _union((e["ts"], e["ts"] + e["dur"]) for e in device if _DEVICE_WORK[e["cat"]] == "kernel")
    held: dict[tuple[str, str | None], list[Interval]] = collections.defaultdict(list)
    for event in spans:
        if event.get("cat") in _RUNTIME and event["dur"] >= _WAIT_MIN_US:
            held[event["name"], _owner(entries, event["ts"])].append((event["ts"], event["ts"] + event["dur"]))

    def meanwhile(busy: list[Interval], calls: list[Interval]) -> float:
        return sum(_length(_clip(busy, start, end)) for start, end in calls) / 1000

    waits = [
        RuntimeWait(name, owner, len(calls), _length(calls) / 1000, meanwhile(copies, calls), meanwhile(kernels, calls))
        for (name, owner), calls in held.items()
    ]
    return tuple(sorted(waits, key=lambda w: -w.ms)[:_WAITS_SHOWN])


def _outer_first(event: dict) -> tuple[float, float]:
    return event["ts"], -event["dur"]


def _builtin_name(name: str) -> str:
    # "<built-in method synchronize of torch.Event object at 0x7f...>": the address says nothing, and
    # the events of a ring are one function.
    return name.split(" at 0x")[0] + ">" if name.startswith("<built-in") and " at 0x" in name else name


def _owner(entries: dict[str, list[Interval]], moment: float) -> str | None:
    """The component whose range ``moment`` falls in (the innermost, where one calls another)."""
    found = [(start, name) for name, ranges in entries.items() for start, end in ranges if start <= moment <= end]
    return max(found)[1] if found else None


def _gaps(
    busy: list[Interval], call_start: float, call_end: float, entries: dict[str, list[Interval]], spans: list[dict]
) -> tuple[DeviceGap, ...]:
    # The call's edges count: the host preparing inputs before the first kernel, and turning the
    # output into an image after the last, are idle device time too.
    edges = [(call_start, call_start), *busy, (call_end, call_end)]
    idle = [(a_end, b_start) for (_, a_end), (b_start, _) in pairwise(edges) if b_start - a_end >= _GAP_MIN_US]
    ops = [e for e in spans if e.get("cat") == "cpu_op" and e["dur"] >= _OP_MIN_US]
    gaps = []
    for start, end in sorted(idle, key=lambda gap: gap[0] - gap[1])[:_GAPS_SHOWN]:
        overlap: collections.Counter[str] = collections.Counter()
        for op in ops:
            shared = min(op["ts"] + op["dur"], end) - max(op["ts"], start)
            if shared > 0:
                overlap[op["name"]] += shared
        gaps.append(
            DeviceGap(
                ms=(end - start) / 1000,
                at_ms=(start - call_start) / 1000,
                component=_owner(entries, start),
                host_ops=tuple((name, us / 1000) for name, us in overlap.most_common(3)),
            )
        )
    return tuple(gaps)


def _union(intervals) -> list[Interval]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _clip(intervals: list[Interval], start: float, end: float) -> list[Interval]:
    return [(max(a, start), min(b, end)) for a, b in intervals if b > start and a < end]


def _length(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in intervals)
