"""The benchmark's tables: one row per run, every call's time, ratios per round, compiled runs."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import replace

from ..text import format_bytes, size_unit
from .modes import ModeResult
from .timing import STEADY_WITHIN


def run_label(mode: str, budget: int | None, round_: int | None = None) -> str:
    """``pinned @ 16.00 GB``, with `` (round 2)`` when a round is given (there are several)."""
    return f"{mode} @ {'unlimited' if budget is None else format_bytes(budget)}" + (f" (round {round_})" if round_ else "")


def gb(value: int | None) -> str:
    return "-" if value is None else f"{value / 1e9:.2f}"


def _agreement(result: ModeResult) -> str:
    if result.exact is None:
        return "reference" if result.mode == "resident" else "-"
    if result.exact:
        return "yes"
    verdict = "within tolerance" if result.matches_resident else "NO"
    detail = "another shape" if result.max_abs_diff is None else f"max diff {result.max_abs_diff:.1e}"
    return f"{verdict}, {detail}"


def _resident_by_round(
    results: list[ModeResult], figure: Callable[[ModeResult], float | None] = lambda r: r.seconds_per_call
) -> dict[int, float]:
    """``figure`` of the first resident run of each round (its time by default): what that round's
    ratios are taken against."""
    resident: dict[int, float] = {}
    for r in results:
        if r.mode == "resident" and not r.error and figure(r):
            resident.setdefault(r.round, figure(r))
    return resident


def call_seconds(r: ModeResult, index: int) -> str:
    return f"{r.call_seconds[index]:.3f}" if index < len(r.call_seconds) else "-"


def format_table(results: list[ModeResult], weight_bytes: int | None, *, ratios: bool = True) -> str:
    """The results, one row per run; ``weight_bytes`` (None: unknown) is what host RSS is compared with.
    Without ``ratios`` (a CPU run, whose times and memory say nothing of a GPU's), no ratio is shown,
    and sizes are in the unit that fits the pipeline's weights (MB for the tiny ones)."""
    resident_by_round = _resident_by_round(results)
    several = any(r.round > 1 for r in results)
    unit, size = ("GB", 1e9) if ratios or not weight_bytes else size_unit(weight_bytes)

    def sized(value: int | None) -> str:
        return "-" if value is None else f"{value / size:.2f}"

    header = (
        "mode", "budget", "call 1 s", "call 2 s", "steady s/call", "steady from call", "x resident",
        f"peak alloc {unit}", f"peak reserved {unit}", "within budget", "alloc retries", "setup s", f"host RSS {unit}",
        "RSS x weights", f"loaded {unit}/call", "load GB/s", "hooks' host s/call", "equal to resident",
    )  # fmt: skip
    rows = []
    for r in results:
        mode = f"{r.mode} (round {r.round})" if several else r.mode
        budget = "-" if r.budget_bytes is None else format_bytes(r.budget_bytes)
        within = {None: "-", True: "yes", False: "NO"}[r.within_budget]
        if r.error:
            reserved = sized(r.peak_reserved_bytes)
            allocated = sized(r.peak_allocated_bytes)
            rows.append((mode, budget, r.error, *("-",) * 4, allocated, reserved, *("-",) * (len(header) - 9)))
            continue
        resident = resident_by_round.get(r.round)
        rows.append(
            (
                mode,
                budget,
                call_seconds(r, 0),
                call_seconds(r, 1),
                f"{r.seconds_per_call:.3f}",
                "-" if r.calls_to_steady is None else str(r.calls_to_steady),
                "-" if not resident or not ratios else f"{r.seconds_per_call / resident:.2f}",
                sized(r.peak_allocated_bytes),
                sized(r.peak_reserved_bytes),
                within,
                "-" if r.alloc_retries is None else str(r.alloc_retries),
                f"{r.setup_seconds:.2f}",
                sized(r.host_rss_bytes),
                "-" if r.host_rss_bytes is None or not weight_bytes or not ratios else f"{r.host_rss_bytes / weight_bytes:.2f}",
                sized(r.loaded_bytes_per_call),
                "-" if r.load_gbps is None else f"{r.load_gbps:.1f}",
                "-" if r.host_seconds_per_call is None else f"{r.host_seconds_per_call:.3f}",
                _agreement(r),
            )
        )
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def format_host_memory(results: list[ModeResult], weight_bytes: int | None) -> str:
    """Each run's host memory in GB: its resident set after setup and at the process's peak, its
    anonymous part (see .host_memory) after setup and at its peak from setup to the last call; and
    how fast loads from masters in RAM and from files went. The peak's ratio is to the resident
    run's of the same round, as a user comparing the two would take it."""
    resident_peaks = _resident_by_round(results, lambda r: r.peak_host_rss_bytes)
    several = any(r.round > 1 for r in results)
    header = (
        "mode", "budget", "steady s/call", "host RSS GB", "peak RSS GB (VmHWM)", "peak RSS x resident",
        "anonymous GB after setup", "anonymous GB peak", "anonymous peak x weights", "load GB/s", "file GB/s",
    )  # fmt: skip
    rows = [
        (
            run_label(r.mode, r.budget_bytes, r.round if several else None),
            "-" if r.budget_bytes is None else format_bytes(r.budget_bytes),
            f"{r.seconds_per_call:.3f}",
            gb(r.host_rss_bytes),
            gb(r.peak_host_rss_bytes),
            "-"
            if r.peak_host_rss_bytes is None or r.round not in resident_peaks
            else f"{r.peak_host_rss_bytes / resident_peaks[r.round]:.2f}",
            gb(r.host_anonymous_bytes),
            gb(r.peak_host_anonymous_bytes),
            "-" if not weight_bytes or r.peak_host_anonymous_bytes is None else f"{r.peak_host_anonymous_bytes / weight_bytes:.2f}",
            "-" if r.load_gbps is None else f"{r.load_gbps:.1f}",
            "-" if r.read_gbps is None else f"{r.read_gbps:.1f}",
        )
        for r in results
        if not r.error
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _line_per_run(results: list[ModeResult], describe: Callable[[ModeResult], str]) -> str:
    """One line per run: its label and ``describe(run)``, or its error."""
    several = any(r.round > 1 for r in results)
    lines = []
    for r in results:
        label = run_label(r.mode, r.budget_bytes, r.round if several else None)
        lines.append(f"- {label}: {r.error if r.error else describe(r)}")
    return "\n".join(lines)


def format_calls(results: list[ModeResult]) -> str:
    """Every call's seconds, one line per run: the first calls are what a user meets first; and the
    share of the host's CPU its hypervisor gave other guests meanwhile, where the kernel tells, and
    with --host-probe the host's speed then (see .host_speed)."""

    def calls(r: ModeResult) -> str:
        notes = []
        if r.calls_to_steady is not None:
            notes.append(f"steady from call {r.calls_to_steady}")
        elif len(r.call_seconds) > 1:
            notes.append(f"never within {STEADY_WITHIN}x of steady")
        if r.host_steal_fraction is not None:
            notes.append(f"host CPU stolen {100 * r.host_steal_fraction:.1f}%")
        if r.host_loop_ms is not None:
            notes.append(f"host loop {r.host_loop_ms:.2f} ms")
        told = f" ({'; '.join(notes)})" if notes else ""
        return f"{', '.join(f'{s:.3f}' for s in r.call_seconds)} s{told}"

    return _line_per_run(results, calls)


def format_shape_calls(results: list[ModeResult], shapes: list[tuple[int, int]]) -> str:
    """With ``--shapes``: each run's calls grouped by shape (call ``i`` had shape ``i`` modulo their
    number; a shape the sequence names twice is one group), the slowest of each shape's calls
    after its first, over the median of those: a plan per shape keeps that near 1.00x, whatever the
    shapes between; and for the pinned modes, what those later calls loaded and how fast."""

    def by_shape(r: ModeResult) -> str:
        calls: dict[tuple[int, int], list[float]] = {}
        loads: dict[tuple[int, int], list[tuple[int, float] | None]] = {}
        for index, seconds in enumerate(r.call_seconds):
            shape = shapes[index % len(shapes)]
            calls.setdefault(shape, []).append(seconds)
            loads.setdefault(shape, []).append(r.call_loads[index] if index < len(r.call_loads) else None)
        parts = []
        for (height, width), times in calls.items():
            later = times[1:]
            spread = f", later ones at most {max(later) / statistics.median(later):.2f}x their median" if len(later) > 1 else ""
            loaded = _loads_of(loads[height, width][1:])
            parts.append(f"{height}x{width}: {', '.join(f'{t:.3f}' for t in times)} s{spread}{loaded}")
        return "; ".join(parts)

    return _line_per_run(results, by_shape)


def _loads_of(loads: list[tuple[int, float] | None]) -> str:
    """What calls loaded and how fast, for a line of :func:`format_shape_calls` (None: a call whose
    loads the run did not record): a call of one shape slower than others of it, under the same
    plan, loads more bytes or loads them slower."""
    known = [load for load in loads if load is not None]
    if not known:
        return ""
    sizes = [loaded for loaded, _ in known]
    size = _span(format_bytes(min(sizes)), format_bytes(max(sizes)))
    rates = [loaded / seconds / 1e9 for loaded, seconds in known if seconds > 0]
    return f", loading {size} a call" + (f" at {_span(f'{min(rates):.1f}', f'{max(rates):.1f}')} GB/s" if rates else "")


def _span(low: str, high: str) -> str:
    """A range as printed: one value where both ends print alike."""
    return low if low == high else f"{low} to {high}"


def format_round_ratios(results: list[ModeResult]) -> str:
    """Each mode's ratio to resident in every round, and their median: empty for a single round."""
    if not any(r.round > 1 for r in results):
        return ""
    resident_by_round = _resident_by_round(results)
    ratios: dict[str, list[float]] = {}
    for r in results:
        if r.mode != "resident" and not r.error and r.round in resident_by_round:
            ratios.setdefault(run_label(r.mode, r.budget_bytes), []).append(r.seconds_per_call / resident_by_round[r.round])
    return "\n".join(
        f"- {label}: {', '.join(f'{x:.2f}' for x in values)} (median {statistics.median(values):.2f})"
        for label, values in ratios.items()
    )


def judged_by_compile_spread(results: list[ModeResult]) -> tuple[list[ModeResult], float | None]:
    """With the resident mode compiled more than once, how far its later compiles are from the
    first (the reference) is what compiling alone changes in the output: the tolerance compile
    itself needs. A compiled mode no further from the reference than that is within tolerance,
    whatever COMPILED_TOLERANCE says. Returns the results so judged, and that spread (None when
    the resident mode ran once)."""
    later = [r.max_abs_diff for r in results if r.mode == "resident" and r.max_abs_diff is not None]
    if not later:
        return results, None
    spread = max(later)
    judged = [
        replace(r, within_tolerance=True) if r.exact is False and r.max_abs_diff is not None and r.max_abs_diff <= spread else r
        for r in results
    ]
    return judged, spread


def format_compile_table(results: list[ModeResult]) -> str:
    shown = [r for r in results if not r.error and r.first_call_seconds is not None]
    cuda_graphs = any(r.cuda_graphs_recorded_while_timed is not None for r in shown)
    header = ["mode", "budget", "first call s (compiling)", "warm s/call", "graphs compiled while timed"]
    header += ["CUDA graphs recorded while timed"] if cuda_graphs else []
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for r in shown:
        budget = "-" if r.budget_bytes is None else format_bytes(r.budget_bytes)
        cells = [r.mode, budget, f"{r.first_call_seconds:.2f}", f"{r.seconds_per_call:.3f}"]
        cells += [str(r.graphs_compiled_while_timed)] + ([str(r.cuda_graphs_recorded_while_timed)] if cuda_graphs else [])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
