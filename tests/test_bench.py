"""The benchmark CLI end to end on the tiny pipeline: runs per budget, failures reported, JSON and PNG."""

from __future__ import annotations

import json

from diffusers_residency.bench.__main__ import main


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
