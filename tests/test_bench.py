"""The benchmark CLI end to end on the tiny pipeline: runs per budget, failures reported, JSON and PNG."""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
import tempfile
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from diffusers_residency.bench import __main__ as bench_main
from diffusers_residency.bench import first_calls, host_speed, processes
from diffusers_residency.bench.__main__ import _runs, environment_line, main
from diffusers_residency.bench.builders import build_pipeline
from diffusers_residency.bench.modes import AFTER_TIMED_CALLS, ModeResult, run_mode
from diffusers_residency.bench.phases import stamped_call
from diffusers_residency.bench.schemes import MMGP_INSTALL, MODES, Mode, ModeUnavailable, mmgp_budgets
from diffusers_residency.bench.tables import (
    format_calls,
    format_compile_table,
    format_host_memory,
    format_round_ratios,
    format_shape_calls,
    format_table,
    judged_by_compile_spread,
    run_label,
)
from diffusers_residency.bench.timing import calls_to_steady, host_cpu_ticks, steal_fraction
from diffusers_residency.bench.trace import summarise, traced_call
from diffusers_residency.text import format_bytes, parse_bytes

from .helpers import PipelineCase

pytestmark = pytest.mark.slow


def test_runs_per_budget_report_failures_and_write_json_and_png(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "mmgp", None)  # CI has no mmgp; and the CPU must not import it
    status = main(
        [
            "bench",  # as `diffusers-residency bench ...` passes it
            "--modes", "resident,mmgp@1MB,pinned,group_offload_block,sequential_cpu_offload@1MB",
            "--budgets", "unlimited",
            "--activation-reserve", "1000",
            "--calls", "1",
            "--out", str(tmp_path),
        ]
    )  # fmt: skip
    assert status == 0
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    runs = [(r["mode"], r["budget_bytes"]) for r in results]
    assert runs == [
        ("resident", None),
        ("pinned", None),
        ("group_offload_block", None),
        ("sequential_cpu_offload", 10**6),
        ("mmgp", 10**6),  # moved last: it cannot be undone
    ]
    assert results[1]["exact"] is True and results[1]["plan"]
    assert results[3]["error"] == results[4]["error"] == "needs an accelerator"
    assert not (tmp_path / "results.png").exists(), "the CPU has no memory figures to plot"
    captured = capsys.readouterr()
    assert "| pinned |" in captured.out
    assert "On the CPU this run checks function, not speed" in captured.out
    pinned_row = next(line for line in captured.out.splitlines() if line.startswith("| pinned |")).split(" | ")
    assert pinned_row[6] == "-" and pinned_row[13] == "-", "no x resident, no RSS x weights on the CPU"
    assert "default" not in captured.out.splitlines()[2], "the steps and size called with, not 'default'"
    assert "truncated because `max_sequence_length`" not in captured.err, "the builders' chatter is silenced"
    assert "mmgp cannot be undone" in captured.err


def test_compiled_denoiser_is_timed_and_never_recompiles(tmp_path, capsys) -> None:
    argv = ["--modes", "resident,pinned,resident", "--compile", "regional", "--compile-backend", "eager"]
    assert main([*argv, "--calls", "2", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert all(r["first_call_seconds"] > 0 and r["graphs_compiled_while_timed"] == 0 for r in results), results
    assert all(r["exact"] is not False for r in results), "each mode starts from the plain modules again"
    assert all(r["cuda_graphs_recorded_while_timed"] is None for r in results), "no CUDA graphs on the CPU"
    out = capsys.readouterr().out
    assert "first call s (compiling)" in out and "CUDA graphs recorded" not in out


def test_verbose_logs_the_packages_decisions_and_no_other_librarys_debug_lines(tmp_path, monkeypatch) -> None:
    # As a process of its own starts it: the root logger with no handler yet (pytest gives it some).
    monkeypatch.setattr(logging.root, "handlers", [])
    package, root_level = logging.getLogger("diffusers_residency"), logging.root.level
    argv = ["--device", "cpu", "--modes", "resident", "--warmup", "0", "--calls", "1", "-v"]
    try:
        assert main([*argv, "--out", str(tmp_path)]) == 0
        assert package.isEnabledFor(logging.DEBUG)
        assert not logging.getLogger("matplotlib.font_manager").isEnabledFor(logging.DEBUG)
    finally:
        package.setLevel(logging.NOTSET)
        logging.root.setLevel(root_level)


def test_every_call_is_timed_the_first_included_and_the_table_shows_the_first_calls(tmp_path, capsys) -> None:
    argv = ["--device", "cpu", "--modes", "resident,pinned", "--warmup", "2", "--calls", "2"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    out = capsys.readouterr().out
    header, _, *rows = out[out.index("| mode |") :].split("\n\n")[0].splitlines()
    assert header.startswith("| mode | budget | call 1 s | call 2 s | steady s/call | steady from call | x resident |")
    assert "| host RSS MB |" in header and "| loaded MB/call |" in header, "the tiny pipeline's sizes, in MB on the CPU"
    assert header.count("s/call |") == 2, "one steady s/call column, and the hooks' host s/call"
    for r, row in zip(results, rows, strict=True):
        seconds = r["call_seconds"]
        assert len(seconds) == 4 and all(s > 0 for s in seconds), "the warm-up calls are timed too"
        assert r["seconds_per_call"] == pytest.approx(sum(seconds[2:]) / 2), "the steady figure is the last calls'"
        assert r["calls_to_steady"] == calls_to_steady(seconds, 2)
        steady_from = "-" if r["calls_to_steady"] is None else str(r["calls_to_steady"])
        cells = [f"{seconds[0]:.3f}", f"{seconds[1]:.3f}", f"{r['seconds_per_call']:.3f}", steady_from]
        assert row.split(" | ")[2:6] == cells
        assert f"- {r['mode']} @ unlimited: {', '.join(f'{s:.3f}' for s in seconds)} s" in out
        # Linux tells the host's stolen CPU time, over the same calls.
        assert 0.0 <= r["host_steal_fraction"] <= 1.0
        assert f"host CPU stolen {100 * r['host_steal_fraction']:.1f}%)" in out
    assert results[1]["exact"] is True
    assert "first calls (" not in out, "the pinned run's call 1 was not its process's first"


def test_stolen_cpu_is_the_share_of_the_hosts_ticks_between_two_readings(tmp_path) -> None:
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  100 0 50 800 10 0 0 40 30 0\ncpu0 50 0 25 400 5 0 0 20 15 0\n")
    before = host_cpu_ticks(stat)
    assert before == (40, 1000), "guest time is in user time already"
    stat.write_text("cpu  150 0 60 900 10 0 0 80 30 0\n")
    assert steal_fraction(before, host_cpu_ticks(stat)) == pytest.approx(40 / 200)
    assert steal_fraction(before, before) is None, "no time between them"
    stat.write_text("intr 1 2 3\n")
    assert host_cpu_ticks(stat) is None and host_cpu_ticks(tmp_path / "missing") is None
    assert steal_fraction(None, before) is None


@pytest.mark.parametrize(
    ("seconds", "steady_calls", "steady_from"),
    [
        ((5.12, 2.71, 2.66, 2.65), 2, 2),  # the first call pays for the set-up
        ((1.0, 1.0, 1.0), 2, 1),  # steady from the start
        ((3.0, 1.0, 1.6, 1.0, 1.0), 2, 4),  # a slow call after a fast one: steady only after it
        ((0.5, 1.0, 1.0), 2, 2),  # a call faster than the steady figure is not steady either
        ((1.05, 0.96, 1.0), 1, 1),  # 1.05x either way is within
        ((1.0, 1.0, 2.0, 1.0), 3, 4),  # the median of the last calls, not their mean
        ((1.0, 1.0, 1.2), 2, None),  # even the last call is over 1.05x off the last two's median
        ((2.0,), 1, None),  # one call: nothing to settle from
    ],
)
def test_calls_to_steady_is_the_first_call_from_which_every_call_is_within_5_percent_of_steady(
    seconds: tuple[float, ...], steady_calls: int, steady_from: int | None
) -> None:
    assert calls_to_steady(seconds, steady_calls) == steady_from


def test_the_table_shows_a_dash_for_a_call_that_did_not_run_and_lists_every_call() -> None:
    results = [
        ModeResult("resident", 1.0, 1, 1.0, None, call_seconds=(1.0,)),
        ModeResult(
            "pinned", 2.0, 1, 1.0, True, budget_bytes=8 * 10**9, call_seconds=(5.0, 2.1, 2.0), calls_to_steady=2,
            host_steal_fraction=0.125,
        ),
        ModeResult("pinned", 2.0, 1, 1.0, True, budget_bytes=2 * 10**6, call_seconds=(2.0, 2.0, 3.0)),
        ModeResult("group_offload_leaf", float("nan"), None, float("nan"), None, error="out of memory"),
    ]
    rows = [row.split(" | ")[1:7] for row in format_table(results, weight_bytes=1).splitlines()[2:]]
    assert rows == [  # a budget in its own unit: a tiny pipeline's 2 MB is not "0.00" GB
        ["-", "1.000", "-", "1.000", "-", "1.00"],
        ["8.00 GB", "5.000", "2.100", "2.000", "2", "2.00"],
        ["2.00 MB", "2.000", "2.000", "2.000", "-", "2.00"],
        ["-", "out of memory", "-", "-", "-", "-"],
    ]
    assert format_calls(results).splitlines() == [
        "- resident @ unlimited: 1.000 s",
        "- pinned @ 8.00 GB: 5.000, 2.100, 2.000 s (steady from call 2; host CPU stolen 12.5%)",
        "- pinned @ 2.00 MB: 2.000, 2.000, 3.000 s (never within 1.05x of steady)",
        "- group_offload_leaf @ unlimited: out of memory",
    ]


def test_shapes_in_turn_each_call_the_next_and_a_table_groups_the_calls_by_shape(tmp_path, capsys, monkeypatch) -> None:
    sizes = []
    real = bench_main.call_kwargs

    def recorded(*args, **kwargs):
        sizes.append((kwargs["height"], kwargs["width"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_main, "call_kwargs", recorded)
    argv = ["--device", "cpu", "--modes", "resident,pinned@3MB", "--shapes", "32x32,48x32"]
    argv += ["--warmup", "1", "--calls", "4"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    each_mode = [(32, 32), (48, 32), (32, 32), (48, 32), (32, 32)]
    assert sizes[:10] == each_mode * 2, "each mode's calls take the shapes in turn, from the first"
    out = capsys.readouterr().out
    assert "shapes in turn 32x32, 48x32" in out and "every call by shape:" in out
    resident, pinned = json.loads((tmp_path / "results.json").read_text())["results"]
    assert pinned["exact"] is True
    # Under 3 MB the tiny pipeline streams: every call of the pinned mode loads, and says so.
    assert resident["call_loads"] == [] and len(pinned["call_loads"]) == 5
    assert all(loaded > 0 and seconds > 0 for loaded, seconds in pinned["call_loads"]), pinned["call_loads"]
    later = [pinned["call_loads"][index] for index in (2, 4)]
    rates = [loaded / seconds / 1e9 for loaded, seconds in later]
    sizes_loaded = sorted({format_bytes(loaded) for loaded, _ in later})
    assert f"a call at {min(rates):.1f}" in out and f"loading {sizes_loaded[0]}" in out
    results = [ModeResult("pinned", 2.0, 1, 1.0, True, call_seconds=(5.0, 3.0, 2.0, 1.0, 2.2, 1.1))]
    assert format_shape_calls(results, [(32, 32), (48, 32)]) == (
        "- pinned @ unlimited: 32x32: 5.000, 2.000, 2.200 s, later ones at most 1.05x their median; "
        "48x32: 3.000, 1.000, 1.100 s, later ones at most 1.05x their median"
    )
    # A shape the sequence names twice is one shape: its calls from both places are one group.
    assert format_shape_calls(results, [(32, 32), (48, 32), (32, 32)]) == (
        "- pinned @ unlimited: 32x32: 5.000, 2.000, 1.000, 1.100 s, later ones at most 1.82x their median; "
        "48x32: 3.000, 2.200 s"
    )
    # What each shape's later calls loaded and how fast, the first left out; a call that loaded
    # nothing counts for the bytes, not the rate.
    loads = ((4 * 10**9, 1.0), (2 * 10**9, 1.0), (4 * 10**9, 0.08), (2 * 10**9, 0.04), (5 * 10**9, 0.125), (0, 0.0))
    loaded = [replace(results[0], call_loads=loads)]
    assert format_shape_calls(loaded, [(32, 32), (48, 32)]) == (
        "- pinned @ unlimited: 32x32: 5.000, 2.000, 2.200 s, later ones at most 1.05x their median, "
        "loading 4.00 GB to 5.00 GB a call at 40.0 to 50.0 GB/s; "
        "48x32: 3.000, 1.000, 1.100 s, later ones at most 1.05x their median, "
        "loading 0 B to 2.00 GB a call at 50.0 GB/s"
    )
    with pytest.raises(SystemExit):
        main(["--shapes", "32x32", "--height", "64"])
    with pytest.raises(SystemExit):
        main(["--shapes", "32by32"])


@pytest.mark.parametrize("counts", [["--warmup", "-1"], ["--calls", "0"]])
def test_calls_without_a_steady_figure_are_refused(counts: list[str], capsys) -> None:
    with pytest.raises(SystemExit):
        main(counts)
    assert "--calls 1 or more" in capsys.readouterr().err


def test_fresh_process_runs_each_mode_in_a_process_of_its_own_with_exact_results(tmp_path, monkeypatch, capsys) -> None:
    commands = []
    subprocess_run = subprocess.run

    def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
        commands.append(command)
        return subprocess_run(command, **kwargs)

    def no_pipeline_here(*args, **kwargs):
        raise AssertionError("the parent builds no pipeline: every child builds its own")

    monkeypatch.setattr(processes.subprocess, "run", run)
    monkeypatch.setattr(bench_main, "build_pipeline", no_pipeline_here)
    argv = ["--device", "cpu", "--fresh-process", "--modes", "resident,pinned", "--warmup", "1", "--calls", "1"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    assert [command[command.index("--only-run") + 1] for command in commands] == ["0", "1"]
    assert "--reference" not in commands[0] and "--reference" in commands[1], "the resident output is the reference"
    data = json.loads((tmp_path / "results.json").read_text())
    resident, pinned = data["results"]
    assert (resident["mode"], resident["exact"], pinned["mode"], pinned["exact"]) == ("resident", None, "pinned", True)
    for r in (resident, pinned):
        assert len(r["call_seconds"]) == 2 and all(s > 0 for s in r["call_seconds"]) and r["error"] is None
        assert r["seconds_per_call"] == r["call_seconds"][1]
    # Each call's loads come back from the child too: the first call loads what the plan keeps.
    assert resident["call_loads"] == [] and len(pinned["call_loads"]) == 2 and pinned["call_loads"][0][0] > 0
    assert pinned["plan"] and pinned["host_rss_bytes"] > 0
    assert "each mode in a fresh process" in data["setting"] and not data["setting"].startswith("tiny flux, unknown")
    out = capsys.readouterr().out
    assert "| pinned | - | " in out and "- pinned @ unlimited: " in out
    # Each process's first call, its plan not a profile's; held to the resident one's only where times
    # say something of speed (see test_first_calls_are_held_to_the_resident_first_call_of_their_round...).
    assert pinned["first_plan_source"] != first_calls.PROFILE_SOURCE and resident["first_plan_source"] is None
    assert "first calls (" not in out and "x resident in each round" not in out, "no ratio on the CPU"


def test_with_host_probe_each_mode_gets_the_host_speed_the_parent_timed_during_its_steady_calls(
    tmp_path, monkeypatch, capsys
) -> None:
    """The parent times the host's loop while each child runs; each child tells when its steady
    calls ran (wall clock), and gets the median of the samples taken then."""
    monkeypatch.setattr(host_speed, "SAMPLE_SECONDS", 0.001)
    argv = ["--device", "cpu", "--fresh-process", "--host-probe", "--modes", "resident,pinned", "--calls", "3"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    out = capsys.readouterr().out
    for r in data["results"]:
        start, end = r["steady_wall"]
        assert start < end and r["host_loop_ms"] > 0
        assert f"host loop {r['host_loop_ms']:.2f} ms)" in out
    assert "took more than 1.5x the fastest, timed by the parent over the run" in out


def test_host_probe_without_fresh_processes_is_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--host-probe"])
    assert "give --fresh-process" in capsys.readouterr().err


def test_a_child_process_that_fails_is_an_error_row(tmp_path, monkeypatch, capfd) -> None:
    crashing = tmp_path / "python"
    crashing.write_text("#!/bin/sh\necho 'child crashed on purpose' >&2\nexit 3\n")
    crashing.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(crashing))
    argv = ["--device", "cpu", "--fresh-process", "--modes", "resident,pinned", "--calls", "1"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 1, "the pinned mode failed"
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [(r["mode"], r["error"]) for r in data["results"]] == [
        ("resident", "process failed (exit 3)"),
        ("pinned", "process failed (exit 3)"),
    ]
    assert data["setting"].startswith("tiny flux, unknown bytes of weights,"), "no child lived to count them"
    captured = capfd.readouterr()
    assert "| pinned | - | process failed (exit 3) | - |" in captured.out
    assert captured.err.count("child crashed on purpose") == 2, "a child's stderr is the parent's"


def _recording_resident(seen: list[tuple[str | None, list[str]]]) -> Mode:
    """The resident mode, noting the profile cache it runs under and what that folder holds then."""
    resident = MODES["resident"]

    def setup(pipe, device: torch.device, budget: int | None) -> None:
        folder = os.environ.get(processes.PROFILE_CACHE_VARIABLE)
        seen.append((folder, sorted(os.listdir(folder)) if folder else []))
        resident.setup(pipe, device, budget)

    return replace(resident, setup=setup)


def test_each_run_gets_a_new_empty_profile_cache_unless_profile_dir_names_one(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv(processes.PROFILE_CACHE_VARIABLE, str(tmp_path / "from the environment"))
    seen: list[tuple[str | None, list[str]]] = []
    monkeypatch.setitem(MODES, "resident", _recording_resident(seen))
    argv = ["--device", "cpu", "--modes", "resident", "--warmup", "0", "--calls", "1", "--out", str(tmp_path / "out")]
    assert main(argv) == main(argv) == 0
    (first, first_held), (second, second_held) = seen
    assert first != second and first_held == second_held == [], "a new empty folder per run"
    assert all(Path(folder).parent == Path(tempfile.gettempdir()) and not Path(folder).exists() for folder in (first, second))
    assert f"residency profiles in {second}" in capsys.readouterr().out
    assert os.environ[processes.PROFILE_CACHE_VARIABLE] == str(tmp_path / "from the environment"), "restored after"

    saved = tmp_path / "profiles"
    saved.mkdir()
    (saved / "flux.json").write_text("{}")
    assert main([*argv, "--profile-dir", str(saved)]) == 0
    assert seen[2] == (str(saved), ["flux.json"])
    assert (saved / "flux.json").exists(), "a folder given is the user's: it is kept"
    assert f"residency profiles in {saved}" in capsys.readouterr().out


def test_a_compiled_mode_is_held_to_a_tolerance_and_an_eager_one_to_bit_equality() -> None:
    def result(mode: str, exact: bool | None, diff: float | None, close: bool | None) -> ModeResult:
        return ModeResult(mode, 1.0, 1, 1.0, exact, max_abs_diff=diff, within_tolerance=close)

    results = [
        result("resident", None, None, None),
        result("pinned", False, 4e-3, True),  # compiled, within tolerance
        result("pinned", False, 2e-1, False),  # compiled, too far
        result("pinned", False, 1e-7, None),  # eager: any difference is a failure
    ]
    assert [r.matches_resident for r in results] == [None, True, False, False]
    rows = format_table(results, weight_bytes=1).splitlines()[2:]
    assert [row.rsplit("|", 2)[1].strip() for row in rows] == [
        "reference",
        "within tolerance, max diff 4.0e-03",
        "NO, max diff 2.0e-01",
        "NO, max diff 1.0e-07",
    ]


def test_compiled_modes_are_judged_by_how_far_two_compiles_of_resident_are_apart() -> None:
    def result(mode: str, exact: bool | None, diff: float | None, close: bool | None) -> ModeResult:
        return ModeResult(mode, 1.0, 1, 1.0, exact, max_abs_diff=diff, within_tolerance=close)

    once = [result("resident", None, None, None), result("pinned", False, 2.3e-2, False)]
    assert judged_by_compile_spread(once) == (once, None)
    twice = [*once, result("resident", False, 2.5e-2, False), result("pinned", False, 3e-2, False)]
    judged, spread = judged_by_compile_spread(twice)
    assert spread == 2.5e-2
    assert [r.matches_resident for r in judged] == [None, True, True, False]


def _names(runs: list[tuple[Mode, int | None, int]]) -> list[tuple[str, int | None]]:
    return [(mode.name, budget) for mode, budget, _ in runs]


def test_a_mode_that_cannot_be_undone_runs_after_every_other_mode(capsys) -> None:
    runs = _runs("resident,mmgp@16GB,pinned", "unlimited,16GB", None)
    assert _names(runs) == [
        ("resident", None),
        ("pinned", None),
        ("resident", 16 * 10**9),
        ("pinned", 16 * 10**9),
        ("mmgp", 16 * 10**9),
    ]
    assert "note: mmgp cannot be undone, so it runs after the other modes" in capsys.readouterr().err

    assert _names(_runs("resident,mmgp", "unlimited", None)) == [("resident", None), ("mmgp", None)]
    assert capsys.readouterr().err == "", "no note when it already runs last"


def test_rounds_repeat_the_modes_in_turn_and_take_each_ratio_within_its_round() -> None:
    runs = _runs("resident,pinned@8GB,mmgp@8GB", "unlimited", None, rounds=2)
    assert [(mode.name, budget, r) for mode, budget, r in runs] == [
        ("resident", None, 1), ("pinned", 8 * 10**9, 1), ("resident", None, 2), ("pinned", 8 * 10**9, 2), ("mmgp", 8 * 10**9, 2),
    ], "a mode that cannot be undone still runs once, last, in the last round"  # fmt: skip
    # The machine slows down between the rounds: each ratio is against the resident of its round.
    results = [
        ModeResult("resident", 1.0, 1, 1.0, None, round=1),
        ModeResult("pinned", 1.2, 1, 1.0, True, budget_bytes=8 * 10**9, round=1),
        ModeResult("resident", 2.0, 1, 1.0, True, round=2),
        ModeResult("pinned", 2.2, 1, 1.0, True, budget_bytes=8 * 10**9, round=2),
    ]
    rows = [row.split(" | ")[:7] for row in format_table(results, weight_bytes=1).splitlines()[2:]]
    assert [row[6] for row in rows] == ["1.00", "1.20", "1.00", "1.10"]
    assert rows[3][0] == "| pinned (round 2)"
    assert format_round_ratios(results) == "- pinned @ 8.00 GB: 1.20, 1.10 (median 1.15)"
    assert format_round_ratios(results[:2]) == "", "nothing to add for one round"


def test_first_calls_are_held_to_the_resident_first_call_of_their_round_and_read_back_from_json(
    tmp_path, capsys
) -> None:
    GB8 = 8 * 10**9
    measured = "vram budget 8.00 GB; figures measured for calls of height=64 width=64"
    profile = first_calls.PROFILE_SOURCE

    def pinned(round_: int, seconds: tuple[float, ...], steady: float, **kw) -> ModeResult:
        return ModeResult("pinned", steady, 1, 1.0, True, budget_bytes=GB8, round=round_, call_seconds=seconds, **kw)

    results = [
        ModeResult("resident", 1.0, 1, 1.0, None, round=1, call_seconds=(3.0, 1.0, 1.0)),
        ModeResult("resident", 1.0, 1, 1.0, True, round=1, call_seconds=(9.0, 1.0)),  # not the round's first
        pinned(1, (3.2, 1.04), 1.0, plan=measured, first_plan_source=""),
        ModeResult("group-leaf", 2.0, 1, 1.0, True, round=1, call_seconds=(9.0, 2.0, 2.0)),  # not this package's
        ModeResult("resident", 2.0, 1, 1.0, True, round=2, call_seconds=(3.0, 2.0, 2.0)),
        # Started from a profile, planned again from what its calls measured: judged as planned at call 1.
        pinned(2, (3.2, 2.2), 2.0, plan=measured, first_plan_source=profile),
        pinned(2, (2.4,), 2.0, plan=measured, first_plan_source=profile),  # one call: no call 2
        pinned(2, (9.9, 9.9), 2.0, plan=measured, first_plan_source=profile, error="out of memory"),
        pinned(3, (2.0, 2.0), 2.0, plan=measured, first_plan_source=profile),  # no resident run in round 3
    ]
    checks = first_calls.first_call_checks(results)
    # Round 1 measured: excess 2.2 s against 0.3 x 1.0 + (3.0 - 1.0); round 2 planned from a
    # profile: excess 1.2 s, and 0.4 s, against 0.05 x 2.0 + (3.0 - 2.0).
    assert [(c.label, c.profiled) for c in checks] == [
        ("pinned @ 8.00 GB (round 1)", False),
        ("pinned @ 8.00 GB (round 2)", True),
        ("pinned @ 8.00 GB (round 2)", True),
    ]
    assert [round(c.excess, 9) for c in checks] == [2.2, 1.2, 0.4]
    assert [round(c.allowed, 9) for c in checks] == [2.3, 1.1, 1.1]
    lines = first_calls.format_first_calls(results).splitlines()
    assert "2.300 s: met, by 0.100 s; call 2 1.040x steady (within 1.05x)" in lines[0]
    assert "1.100 s: not met, by 0.100 s; call 2 1.100x steady (over 1.05x); steady 1.00x resident" in lines[1]
    assert "1.100 s: met, by 0.700 s; call 2 -; steady 1.00x resident" in lines[2]
    # The same read back from a results.json, as the bench writes it; a run whose modes shared one
    # process is read with a note (only its first mode's call 1 was the process's first).
    rows = [r.as_dict() for r in results]
    for setting, noted in (("tiny sdxl, ..., each mode in a fresh process, ...", False), ("tiny sdxl, ...", True)):
        (tmp_path / "results.json").write_text(json.dumps({"setting": setting, "results": rows}))
        assert first_calls.main([str(tmp_path / "results.json")]) == 0
        captured = capsys.readouterr()
        assert captured.out.splitlines() == lines
        assert ("shared one process" in captured.err) is noted
    # A results.json from before first_plan_source: told by the last plan's text.
    old = [{k: v for k, v in row.items() if k != "first_plan_source"} for row in rows]
    old[5]["plan"] = f"vram budget 8.00 GB; {first_calls.PROFILED_PLAN_SAYS} for calls of height=64 width=64"
    checks = first_calls.first_call_checks([types.SimpleNamespace(**row) for row in old])
    assert [c.profiled for c in checks] == [False, True, False]


def test_the_host_memory_table_takes_each_peak_against_the_resident_peak_of_its_round() -> None:
    GB = 10**9
    results = [
        ModeResult("resident", 1.0, 1, 1.0, None, round=1, peak_host_rss_bytes=40 * GB),
        ModeResult("pinned", 1.0, 1, 1.0, True, round=1, peak_host_rss_bytes=42 * GB),
        ModeResult("resident", 1.0, 1, 1.0, True, round=2, peak_host_rss_bytes=20 * GB),
        ModeResult("pinned", 1.0, 1, 1.0, True, round=2, peak_host_rss_bytes=30 * GB),
        ModeResult("pinned", 1.0, 1, 1.0, True, round=3),  # no resident run in round 3, no peak read
    ]
    rows = [row.split(" | ") for row in format_host_memory(results, weight_bytes=GB).splitlines()]
    column = rows[0].index("peak RSS x resident")
    assert [row[column] for row in rows[2:]] == ["1.00", "1.05", "1.00", "1.50", "-"]
    with pytest.raises(SystemExit, match="--rounds must be 1 or more"):
        _runs("resident", "unlimited", None, rounds=0)


@pytest.mark.parametrize(
    ("modes", "budgets", "asked"),
    [
        ("resident,mmgp", "unlimited,16GB", "mmgp @ unlimited, mmgp @ 16.00 GB"),
        ("mmgp@8GB,resident,mmgp@16GB", "unlimited", "mmgp @ 8.00 GB, mmgp @ 16.00 GB"),
        ("mmgp,mmgp", "unlimited", "mmgp @ unlimited, mmgp @ unlimited"),
    ],
)
def test_a_mode_that_cannot_be_undone_is_refused_more_than_one_run(modes: str, budgets: str, asked: str) -> None:
    with pytest.raises(SystemExit, match="cannot be undone runs once per process") as refused:
        _runs(modes, budgets, None)
    assert str(refused.value).startswith(f"{asked}:")
    assert "mmgp@16GB" in str(refused.value), "says how to ask for one run"


def test_mmgp_on_the_cpu_needs_an_accelerator_and_never_imports_mmgp(monkeypatch) -> None:
    # Importing mmgp would raise here, and its setup refuses the CPU with another message.
    monkeypatch.setitem(sys.modules, "mmgp", None)

    def call() -> torch.Tensor:
        raise AssertionError("the mode must not run")

    result, output = run_mode(
        object(), MODES["mmgp"], torch.device("cpu"), call, warmup=1, calls=1, reference=None, budget=10**9
    )
    assert output is None
    assert (result.mode, result.error, result.budget_bytes) == ("mmgp", "needs an accelerator", 10**9)


def test_mmgp_not_installed_says_how_to_install_it(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "mmgp", None)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    with pytest.raises(ModeUnavailable, match="needs mmgp") as unavailable:
        MODES["mmgp"].setup(object(), torch.device("cuda", 0), None)
    assert str(unavailable.value).endswith(MMGP_INSTALL)
    assert MMGP_INSTALL == "pip install mmgp==3.8.2 optimum-quanto==0.2.7"
    # mmgp moves weights to the current CUDA device, whichever the run was asked for.
    with pytest.raises(ModeUnavailable, match="current CUDA device only, not cuda:1"):
        MODES["mmgp"].setup(object(), torch.device("cuda", 1), None)


def test_an_unavailable_mode_is_a_result_and_is_torn_down() -> None:
    torn_down = []

    def setup(pipe: object, device: torch.device, budget: int | None) -> None:
        raise ModeUnavailable("needs something: pip install something")

    mode = Mode("unavailable", setup, torn_down.append)
    pipe = object()
    result, output = run_mode(pipe, mode, torch.device("cpu"), torch.zeros, warmup=1, calls=1, reference=None)
    assert output is None
    assert result.error == "needs something: pip install something"
    assert torn_down == [pipe]


def test_a_component_a_failed_call_left_cast_is_cast_back_for_the_next_mode() -> None:
    case = PipelineCase("flux")

    def upcasts_then_fails(pipe, device: torch.device, budget: int | None) -> None:
        pipe.vae.to(torch.float64)  # as SDXL's call upcasts its VAE, out of memory before casting back
        raise torch.OutOfMemoryError("injected")

    failed, _ = run_mode(case.pipe, Mode("fails", upcasts_then_fails, lambda pipe: None), torch.device("cpu"),
                         case.run, warmup=1, calls=1, reference=case.reference)  # fmt: skip
    assert failed.error == "out of memory"
    assert {p.dtype for p in case.pipe.vae.parameters()} == {torch.float32}
    resident, output = run_mode(case.pipe, MODES["resident"], torch.device("cpu"), case.run, warmup=1, calls=1,
                                reference=case.reference)  # fmt: skip
    assert resident.exact and torch.equal(output, case.reference)


def test_mmgp_budget_is_the_cap_less_the_default_activation_reserve_in_mib() -> None:
    assert mmgp_budgets(None) is None, "no cap: mmgp's no-budget profile"
    # 16 GB less the 3 GiB minimum reserve; 40 GB less a tenth; mmgp counts in MiB.
    assert mmgp_budgets(16 * 10**9) == {"*": (16 * 10**9 - 3 * 2**30) // 2**20} == {"*": 12186}
    assert mmgp_budgets(40 * 10**9) == {"*": 34332}
    # Below the reserve: the smallest budget, since mmgp reads 0 as no budget at all.
    assert mmgp_budgets(2 * 10**9) == {"*": 1}


def test_mmgp_teardown_releases_its_manager_and_the_default_device(monkeypatch) -> None:
    released = []
    manager = types.SimpleNamespace(release=lambda: released.append(True))
    monkeypatch.setitem(sys.modules, "mmgp.offload", types.SimpleNamespace(last_offload_obj=manager))
    torch.set_default_device("meta")  # offload.all leaves "cuda"; meta stands in for it on the CPU
    try:
        MODES["mmgp"].teardown(object())
        assert torch.empty(1).device == torch.device("cpu")
    finally:
        torch.set_default_device(None)
    assert released == [True]
    assert MODES["mmgp"].undoable is False and MODES["mmgp"].needs_accelerator


@pytest.mark.parametrize(
    ("variables", "named"),
    [
        ({}, "default allocator settings"),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"),
        ({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}, "PYTORCH_ALLOC_CONF=expandable_segments:False"),
        (
            {"PYTORCH_ALLOC_CONF": "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"},
            "PYTORCH_ALLOC_CONF=expandable_segments:True; PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128",
        ),
    ],
)
def test_the_environment_line_names_the_allocator_settings(monkeypatch, variables: dict[str, str], named: str) -> None:
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    line = environment_line(torch.device("cpu"))
    assert line.startswith(f"torch {torch.__version__}, ")
    assert line.endswith(f"device cpu, {named}")


def test_a_traced_call_is_summed_per_component_and_its_ranges_come_off(tmp_path, capsys) -> None:
    case = PipelineCase("flux")
    case.pipe.enable_pinned_offload("cpu", vram_budget=None)
    hooked_forward = case.pipe.transformer.__dict__["forward"]  # accelerate's, on the instance
    before = {name: dict(c.__dict__) for name, c in case.pipe.components.items() if isinstance(c, torch.nn.Module)}

    trace = traced_call(case.pipe, case.run, torch.device("cpu"))

    entries = {c.name: c.entries for c in trace.components}
    steps = len(case.pipe.scheduler.timesteps)
    assert entries == {"text_encoder": 1, "text_encoder_2": 1, "transformer": steps, "vae": 1}, entries
    assert all(c.host_ms > 0 and c.kernel_ms is None for c in trace.components)
    assert trace.device_busy_ms is None and trace.gaps == ()
    assert "one call traced" in str(trace)
    # Each step's length, for the one component entered more than once; no Python traced unasked.
    ((name, step_ms),) = trace.entry_ms
    transformer = next(c for c in trace.components if c.name == "transformer")
    assert name == "transformer" and len(step_ms) == steps and sum(step_ms) == pytest.approx(transformer.host_ms)
    assert trace.functions == ()
    # The ranges were added for that call only.
    assert case.pipe.transformer.__dict__["forward"] is hooked_forward
    for name, component in case.pipe.components.items():
        if isinstance(component, torch.nn.Module):
            assert {k: component.__dict__.get(k) for k in ("forward", "encode", "decode")} == {
                k: before[name].get(k) for k in ("forward", "encode", "decode")
            }, name
    assert torch.equal(case.run(), case.reference)

    assert main(["--modes", "resident,pinned", "--calls", "1", "--trace", "--rounds", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for round_ in (1, 2):  # every round's trace, not only the last one's
        assert f"one more call traced, resident @ unlimited (round {round_})" in out
        assert f"one more call traced, pinned @ unlimited (round {round_})" in out
    assert all(r["trace"] for r in json.loads((tmp_path / "results.json").read_text())["results"])


def test_a_stamped_call_times_each_entry_and_its_stamps_come_off(tmp_path, capsys) -> None:
    case = PipelineCase("flux")
    case.pipe.enable_pinned_offload("cpu", vram_budget=None)
    hooked_forward = case.pipe.transformer.__dict__["forward"]  # accelerate's, on the instance

    phases = stamped_call(case.pipe, case.run, torch.device("cpu"))

    steps = len(case.pipe.scheduler.timesteps)
    names = [entry.component for entry in phases.entries]
    assert names == ["text_encoder", "text_encoder_2", *["transformer"] * steps, "vae"], names
    assert all(entry.device_ms > 0 and entry.host_ms > 0 for entry in phases.entries)
    assert sum(entry.device_ms for entry in phases.entries) <= phases.device_ms <= phases.wall_ms
    text = str(phases)
    assert "one call stamped" in text and "transformer, each entry on the device: " in text
    assert "text_encoder, each entry" not in text, "entries listed only for a component entered more than once"
    assert case.pipe.transformer.__dict__["forward"] is hooked_forward, "the stamps were for that call only"
    assert torch.equal(case.run(), case.reference)
    # An entry made inside another's (the VAE's forward encodes, then decodes) is part of that one.
    image = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        nested = stamped_call(case.pipe, lambda: case.pipe.vae(image), torch.device("cpu"))
    assert [entry.component for entry in nested.entries] == ["vae"]

    assert main(["--modes", "resident,pinned", "--calls", "1", "--trace", "phases", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "one more call stamped, resident @ unlimited" in out and "one more call stamped, pinned @ unlimited" in out
    assert "one more call traced" not in out


def test_the_first_call_can_be_the_traced_one(tmp_path, capsys) -> None:
    assert main(["--modes", "resident,pinned", "--warmup", "1", "--calls", "1", "--trace", "first", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "the first call traced, resident @ unlimited" in out and "the first call traced, pinned @ unlimited" in out
    assert "one more call traced" not in out
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [len(r["call_seconds"]) for r in results] == [2, 2], "the traced call is the first warm-up call, timed"
    assert all(r["trace"] and r["exact"] is not False for r in results)
    # The first call's Python is traced: the pinned mode's shows where the package's hooks went.
    pinned = next(r["trace"] for r in results if r["mode"] == "pinned")
    assert "host time in this package's functions" in pinned and "diffusers_residency/hooks.py(" in pinned
    with pytest.raises(SystemExit):
        main(["--trace", "first", "--warmup", "0", "--out", str(tmp_path)])
    assert "give --warmup 1 or more" in capsys.readouterr().err


def test_the_first_call_can_be_traced_without_python(tmp_path, capsys) -> None:
    args = ["--modes", "pinned", "--warmup", "1", "--calls", "1", "--trace", "first-device", "--out", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "the first call traced, pinned @ unlimited" in out
    (result,) = json.loads((tmp_path / "results.json").read_text())["results"]
    assert len(result["call_seconds"]) == 2 and "one call traced" in result["trace"]
    assert "host time in this package's functions" not in result["trace"], "Python is not traced"
    # The traced call's loads are its own, as they are the other calls': its weights' first load.
    assert len(result["call_loads"]) == 2 and result["call_loads"][0][0] > 0, result["call_loads"]
    with pytest.raises(SystemExit):
        main(["--trace", "first-device", "--warmup", "0", "--out", str(tmp_path)])
    assert "--trace first-device traces a warm-up call" in capsys.readouterr().err


def test_a_python_trace_sums_the_packages_functions_and_device_waits_outermost_calls_only() -> None:
    planner, hook = "diffusers_residency/planner.py(10): plan", "diffusers_residency/hooks.py(5): pre_forward"
    sync, other_sync = (f"<built-in method synchronize of torch.Event object at 0x7f0{i}>" for i in range(2))
    events = [
        _span("python_function", planner, 0, 10),  # recursive, starting with the call below: counted in it
        _span("python_function", planner, 0, 30),
        _span("python_function", planner, 5, 10),  # recursive: inside the call above, not counted again
        _span("python_function", planner, 40, 20),
        _span("python_function", hook, 100, 1),
        _span("python_function", hook, 102, 1),
        _span("python_function", sync, 20, 8),
        _span("python_function", other_sync, 70, 2),  # another event's: the same function
        _span("python_function", "diffusers_residency/bench/trace.py(1): entered", 0, 200),  # the bench's own
        _span("python_function", "diffusers/models/attention.py(3): forward", 0, 200),  # not this package's
        _span("python_function", "<built-in function len>", 0, 50),
    ]

    functions = summarise(events, 1.0, with_device=False).functions

    assert [(f.name, f.calls, f.ms) for f in functions] == [
        (planner, 2, 0.05),
        ("<built-in method synchronize of torch.Event object>", 2, 0.01),
        (hook, 2, 0.002),
    ]


def _span(cat: str, name: str, ts: int, dur: int, correlation: int | None = None) -> dict:
    event = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}
    if correlation is not None:
        event["args"] = {"correlation": correlation}
    return event


def _launch(correlation: int, ts: int, name: str = "cudaLaunchKernel", cat: str = "cuda_runtime") -> dict:
    """The host's runtime call that queued the device event of the same correlation id."""
    return _span(cat, name, ts, 5, correlation)


def test_a_trace_with_device_events_counts_each_components_work_idle_time_and_the_longest_gaps() -> None:
    # Microseconds, as torch.profiler exports them. Two transformer steps and a VAE decode whose
    # forward enters its own decode (counted once). Device work belongs to the range its launch
    # was made in, wherever it runs; the profiler's device-side ranges (one per stream) are ignored.
    events = [
        _span("user_annotation", "pipeline call", 0, 100_000),
        _span("user_annotation", "component:transformer", 1_000, 20_000),
        _span("user_annotation", "component:transformer", 30_000, 20_000),
        _span("user_annotation", "component:vae", 60_000, 30_000),
        _span("user_annotation", "component:vae", 61_000, 1_000),
        _span("gpu_user_annotation", "component:transformer", 4_000, 1_000),
        _launch(1, 1_500),
        _span("kernel", "gemm", 2_000, 10_000, 1),
        _launch(6, 4_000, "cudaMemcpyAsync"),
        _span("gpu_memcpy", "Memcpy HtoD", 5_000, 4_000, 6),  # behind a kernel
        _launch(2, 14_000),
        _span("kernel", "gemm", 15_000, 7_000, 2),  # runs past the range it was launched in
        _launch(7, 25_000, "cudaMemcpyAsync"),
        _span("gpu_memcpy", "Memcpy HtoD", 26_000, 2_000, 7),  # launched between the steps: no component's
        _launch(3, 30_500),
        _span("kernel", "gemm", 31_000, 20_000, 3),
        _launch(8, 31_000, "cuLaunchKernelEx", "cuda_driver"),
        _span("kernel", "gemm", 51_000, 1_000, 8),
        _launch(4, 61_500),
        _span("kernel", "conv", 62_000, 1_000, 4),
        _launch(5, 65_000),
        _span("kernel", "conv", 70_000, 12_000, 5),
        _span("cpu_op", "aten::to", 64_000, 2_000),
        _span("cpu_op", "aten::view", 65_000, 100),  # too short to name
    ]
    trace = summarise(events, 100.0, with_device=True)

    transformer, vae = trace.components
    assert (transformer.name, transformer.entries, transformer.host_ms) == ("transformer", 2, 40.0)
    assert (transformer.kernel_ms, transformer.copy_ms, transformer.device_idle_ms) == (38.0, 4.0, 5.0)
    assert (vae.name, vae.entries, vae.host_ms) == ("vae", 1, 30.0)
    assert (vae.kernel_ms, vae.copy_ms, vae.device_idle_ms) == (13.0, 0.0, 17.0)
    assert trace.device_busy_ms == 53.0
    # The call's edges count: the host turning the output into an image after the last kernel.
    assert [(g.ms, g.at_ms, g.component) for g in trace.gaps] == [
        (18.0, 82.0, "vae"),
        (10.0, 52.0, None),
        (7.0, 63.0, "vae"),
        (4.0, 22.0, None),
        (3.0, 12.0, "transformer"),
    ]
    assert trace.gaps[2].host_ops == (("aten::to", 2.0),)
    assert "7.0 ms at +63.0 ms, host in vae: aten::to 2.0 ms" in str(trace)


def test_runtime_calls_that_hold_the_host_are_summed_with_what_the_device_ran_meanwhile() -> None:
    # A kernel's first launch loading its module while a copy queued ahead runs, twice in one
    # component; a synchronisation beside a kernel; launches too short to be waits.
    events = [
        _span("user_annotation", "pipeline call", 0, 100_000),
        _span("user_annotation", "component:unet", 0, 50_000),
        _span("user_annotation", "component:vae", 60_000, 30_000),
        _launch(1, 1_000, "cudaMemcpyAsync"),
        _span("gpu_memcpy", "Memcpy HtoD", 2_000, 10_000, 1),
        _span("cuda_runtime", "cudaLaunchKernel", 3_000, 4_000),  # held the host 4 ms, copying throughout
        _span("cuda_runtime", "cudaLaunchKernel", 10_000, 4_000),  # 2 ms of it beside the copy
        _launch(2, 14_000),
        _span("kernel", "conv", 14_500, 1_000, 2),
        _launch(3, 61_000),
        _span("kernel", "conv", 61_500, 5_000, 3),
        _span("cuda_runtime", "cudaDeviceSynchronize", 62_000, 5_000),
        _span("cuda_runtime", "cudaLaunchKernel", 70_000, 200),  # a launch, not a wait
    ]

    trace = summarise(events, 100.0, with_device=True)

    assert [(w.name, w.component, w.calls, w.ms, w.copy_ms, w.kernel_ms) for w in trace.waits] == [
        ("cudaLaunchKernel", "unet", 2, 8.0, 6.0, 0.0),
        ("cudaDeviceSynchronize", "vae", 1, 5.0, 0.0, 4.5),
    ]
    assert "8.0 ms in 2 cudaLaunchKernel, host in unet: copies 6.0 ms, kernels 0.0 ms" in str(trace)
    assert summarise(events, 100.0, with_device=False).waits == (), "waits come with the device's events"


def test_a_component_compiled_whole_is_not_ranged_and_not_compiled_again() -> None:
    case = PipelineCase("flux")
    case.pipe.transformer.compile(backend="eager")
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    case.run()
    compiled = counters["stats"]["unique_graphs"]

    trace = traced_call(case.pipe, case.run, torch.device("cpu"))

    assert {c.name for c in trace.components} == {"text_encoder", "text_encoder_2", "vae"}
    assert counters["stats"]["unique_graphs"] == compiled, "the traced call compiled nothing new"
    assert "forward" not in case.pipe.transformer.__dict__
    # Stamped, its steps fall outside any component's entries, and the summary says so.
    phases = stamped_call(case.pipe, case.run, torch.device("cpu"))
    assert [e.component for e in phases.entries] == ["text_encoder", "text_encoder_2", "vae"]
    assert phases.unstamped == ("transformer",)
    assert "compiled whole, so not stamped (counted outside): transformer" in str(phases)
    assert counters["stats"]["unique_graphs"] == compiled


@pytest.mark.parametrize("trace", sorted(AFTER_TIMED_CALLS))
def test_a_trace_that_fails_leaves_the_timed_figures_be(monkeypatch, trace) -> None:
    case = PipelineCase("flux")

    def failing(*args, **kwargs):
        raise RuntimeError("profiler unavailable")

    monkeypatch.setitem(AFTER_TIMED_CALLS, trace, failing)
    result, output = run_mode(
        case.pipe, MODES["resident"], torch.device("cpu"), case.run, warmup=0, calls=1, reference=None, trace=trace
    )
    assert result.error is None and result.seconds_per_call > 0 and output is not None
    assert result.trace == "no trace: RuntimeError: profiler unavailable"


def test_sleep_wake_benchmark_runs_every_operation_and_writes_json(tmp_path, capsys) -> None:
    from diffusers_residency.bench import sleep_wake

    assert sleep_wake.main(["--scale", "tiny", "--cycles", "1", "--json", str(tmp_path / "sleep.json")]) == 0
    results = json.loads((tmp_path / "sleep.json").read_text())
    table = capsys.readouterr().out
    operations = (
        "reference level-1 sleep", "level-1 wake", "switch to sdxl (flux sleeps", "switch to flux (sdxl sleeps",
        "switch to sdxl, cache kept", "switch to flux, cache kept", "level-2 sleep", "level-2 wake",
    )  # fmt: skip
    for operation in operations:
        assert any(key.startswith(operation) for key in results), operation
        assert f"| {operation}" in table
    assert "|   of which sdxl's wake into that cache" in table
    assert results["level_2_mapped_bytes"] > 0, "level 2 was measured on a pipeline that slept at level 2"


def test_the_pinned_mode_keeps_the_policies_named_on_the_command_line(tmp_path) -> None:
    argv = ["--modes", "resident,pinned", "--components", "transformer = resident", "--calls", "1"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    pinned = json.loads((tmp_path / "results.json").read_text())["results"][1]
    policies = {line.split()[0]: line.split()[1] for line in pinned["plan"].splitlines()[2:]}
    # Without a plan on the CPU, the others are staged, as in model_cpu_offload_seq.
    assert policies["transformer"] == "resident" and policies["vae"] == "staged", pinned["plan"]
    assert pinned["exact"] is True


def test_a_compile_mode_without_a_compile_is_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--compile-mode", "reduce-overhead"])
    assert "--compile regional or --compile whole" in capsys.readouterr().err


def test_the_compile_table_counts_cuda_graphs_only_where_a_mode_recorded_them() -> None:
    compiled = {"first_call_seconds": 2.0, "graphs_compiled_while_timed": 0}
    plain = [ModeResult("resident", 1.0, 1, 1.0, None, **compiled), ModeResult("pinned", 1.0, 1, 1.0, True, **compiled)]
    assert "CUDA graphs" not in format_compile_table(plain)
    graphs = [replace(r, cuda_graphs_recorded_while_timed=n) for r, n in zip(plain, (0, 3))]
    header, _, *rows = format_compile_table(graphs).splitlines()
    assert header.endswith("| CUDA graphs recorded while timed |")
    assert [row.split(" | ")[-1] for row in rows] == ["0 |", "3 |"]
    assert format_compile_table([replace(plain[1], budget_bytes=512 * 10**6)]).splitlines()[2].split(" | ")[1] == "512.00 MB"


@pytest.mark.parametrize(
    ("spec", "says"),
    [("unet", "name=policy pairs"), ("unet=", "name=policy pairs"), ("=staged", "name=policy pairs"),
     ("unet=staged,", "name=policy pairs"), ("unet=kept", "unknown residency policy 'kept'")],
)  # fmt: skip
def test_components_given_badly_are_refused_with_the_form_expected(spec: str, says: str) -> None:
    with pytest.raises(SystemExit, match=says):
        main(["--components", spec])


def test_a_plan_made_at_enable_from_a_step_estimated_within_a_tenth_is_the_one_a_timed_step_keeps() -> None:
    from diffusers_residency.bench import planning

    sizes = planning.meta_sizes(planning.meta_pipeline("flux"))
    budget = parse_bytes("16GB")
    assert planning.loaded_at_timed_step(sizes, budget, "flux", None) > 4 * 10**9, "with no step, blocks by bytes"
    assert [planning.loaded_at_timed_step(sizes, budget, "flux", error) for error in (-0.1, 0.1)] == [0, 0]


def test_the_planners_host_time_is_timed_on_sizes_counted_on_the_meta_device(capsys) -> None:
    from diffusers_residency.bench import planning
    from diffusers_residency.components import component_sizes, module_components

    # Counted on the meta device, where tensors have no storage, as the pipeline counts storages.
    pipe = build_pipeline("sdxl", dtype=torch.float16)
    assert planning.meta_sizes(planning.meta_pipeline("sdxl", "tiny")) == component_sizes(pipe, module_components(pipe))

    assert planning.main(["--pipeline", "sdxl", "--budgets", "8GB,12GB"]) == 0
    out = capsys.readouterr().out
    assert "full sdxl, 6.94 GB of weights" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("8.00 GB", "12.00 GB"))][:2]
    assert len(rows) == 2 and all(len(row) == 6 and all(float(s) > 0 for s in row[2:]) for row in rows), out
    assert "timed step loads beyond the plan made at enable's" in out, out
    # The dry runs of the inputs made here estimate what those of the H200's 1024x1024 calls did.
    assert "vae        " in out and "6.61 GB" in out and "662.42 MB" in out, out


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--budgets", "30XB"], "budget='30XB' is not a size"),
        (["--budgets", "unlimited,0"], "budget must be positive"),
        (["--modes", "resident,pinned@foo"], "budget='foo' is not a size"),
        (["--activation-reserve", "zz"], "--activation-reserve='zz' is not a size"),
        (["--host-budget", "zz"], "--host-budget='zz' is not a size"),
        (["--steps", "0"], "--steps, --height and --width take 1 or more"),
        (["--device", "mps"], "is not a device weights can be staged on"),  # on neither a CPU nor a CUDA machine
    ],
)
def test_bad_arguments_are_refused_before_any_mode_runs(argv: list[str], says: str, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--out", str(tmp_path)])
    assert exit_.value.code == 2 and says in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "nothing ran"


def test_budgets_are_labelled_in_the_unit_they_read_in_and_rounds_apart() -> None:
    assert run_label("pinned", 10**6) == "pinned @ 1.00 MB"
    assert run_label("pinned", 16 * 10**9, 2) == "pinned @ 16.00 GB (round 2)"
    results = [ModeResult("resident", 1.0, 1, 1.0, None, round=r) for r in (1, 2)]
    rows = format_host_memory(results, weight_bytes=None).splitlines()[2:]
    assert [row.split(" | ")[0] for row in rows] == ["| resident @ unlimited (round 1)", "| resident @ unlimited (round 2)"]


def test_a_tiny_pipelines_files_start_their_tensor_data_64_byte_aligned() -> None:
    # As fresh allocations are, whatever header length the safetensors writer chose: the CPU's
    # kernels can round differently with alignment, and copies of a pipeline must compute as it does.
    pipe = build_pipeline("flux", "tiny")
    files = list(Path(pipe._builder_checkpoint_dir.name).rglob("*.safetensors"))
    assert files
    for path in files:
        (length,) = struct.unpack("<Q", path.read_bytes()[:8])
        assert (8 + length) % 64 == 0, path
