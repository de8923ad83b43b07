"""The benchmark CLI end to end on the tiny pipeline: runs per budget, failures reported, JSON and PNG."""

from __future__ import annotations

import json

from diffusers_residency.bench.__main__ import format_table, main
from diffusers_residency.bench.modes import ModeResult


def test_runs_per_budget_report_failures_and_write_json_and_png(tmp_path, capsys) -> None:
    status = main(
        [
            "bench",  # as `diffusers-residency bench ...` passes it
            "--modes", "resident,pinned,group_offload_block,sequential_cpu_offload@1MB",
            "--budgets", "unlimited",
            "--activation-reserve", "1000",
            "--calls", "1",
            "--out", str(tmp_path),
        ]
    )  # fmt: skip
    assert status == 0
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    runs = [(r["mode"], r["budget_bytes"]) for r in results]
    assert runs == [("resident", None), ("pinned", None), ("group_offload_block", None), ("sequential_cpu_offload", 10**6)]
    assert results[1]["exact"] is True and results[1]["plan"]
    assert results[3]["error"] == "needs an accelerator"
    assert (tmp_path / "results.png").stat().st_size > 0
    assert "| pinned |" in capsys.readouterr().out


def test_compiled_denoiser_is_timed_and_never_recompiles(tmp_path, capsys) -> None:
    argv = ["--modes", "resident,pinned,resident", "--compile", "regional", "--compile-backend", "eager"]
    assert main([*argv, "--calls", "2", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert all(r["first_call_seconds"] > 0 and r["graphs_compiled_while_timed"] == 0 for r in results), results
    assert all(r["exact"] is not False for r in results), "each mode starts from the plain modules again"
    assert "first call s (compiling)" in capsys.readouterr().out


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
