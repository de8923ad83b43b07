"""The processes a benchmark run is made of: the residency-profile cache they share, and with
``--fresh-process`` each (mode, budget, round) in a Python process of its own.

In one process a mode runs after the others: the host memory they left, the caching allocator's
cache and kernels already loaded flatter its first calls and its memory figures. A child builds the
identical pipeline (the builders are seeded), runs its one mode as the benchmark would, and writes
what it measured; the parent only starts children and reads what they wrote.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch

from .host_speed import median_between, sample_while_running
from .modes import ModeResult
from .schemes import Mode

# Where the package looks for residency profiles saved by earlier runs.
PROFILE_CACHE_VARIABLE = "DIFFUSERS_RESIDENCY_CACHE"

_RESULT = "result.json"
_OUTPUT = "output.pt"


@contextlib.contextmanager
def profile_cache(folder: Path | None) -> Iterator[Path]:
    """Point the package's residency-profile cache at ``folder``, or at a new empty folder removed
    afterwards, for the run (children of --fresh-process inherit it): profiles an earlier run saved
    would otherwise change what is measured without saying so."""
    previous = os.environ.get(PROFILE_CACHE_VARIABLE)
    with contextlib.ExitStack() as stack:
        if folder is None:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="diffusers_residency_profiles_")))
        os.environ[PROFILE_CACHE_VARIABLE] = str(folder)
        try:
            yield folder
        finally:
            if previous is None:
                del os.environ[PROFILE_CACHE_VARIABLE]
            else:
                os.environ[PROFILE_CACHE_VARIABLE] = previous


def write_child_result(folder: Path, result: ModeResult, output: torch.Tensor | None, weight_bytes: int) -> None:
    """What a child leaves for the parent in ``folder``: its result and pipeline size as JSON, and its
    first output (the reference for later children when the mode is resident)."""
    folder.mkdir(parents=True, exist_ok=True)
    if output is not None:
        torch.save(output, folder / _OUTPUT)
    # Written last: a child that dies before this has no result, whatever else it wrote.
    (folder / _RESULT).write_text(json.dumps({"weight_bytes": weight_bytes, "result": result.as_dict()}))


def _result(data: dict[str, Any]) -> ModeResult:
    """A ModeResult back from its ``as_dict`` (less the properties it adds; JSON made the tuples lists)."""
    names = {field.name for field in fields(ModeResult)}
    values = {name: value for name, value in data.items() if name in names}
    loads = tuple(tuple(load) for load in values.get("call_loads", ()))
    wall = values.get("steady_wall")
    return ModeResult(
        **{**values, "call_seconds": tuple(values["call_seconds"]), "call_loads": loads, "steady_wall": wall and tuple(wall)}
    )


class Children:
    """Runs the benchmark's runs one per child process, each child re-invoked with the parent's own
    arguments plus hidden ones that pick its run and where it writes, under ``folder``. With
    ``host_speed`` (a list), the parent times the host's loop while each child runs (see
    :mod:`.host_speed`), into that list, and gives each result the median of the samples taken
    during its steady calls."""

    def __init__(
        self,
        argv: Sequence[str],
        runs: Sequence[tuple[Mode, int | None, int]],
        folder: Path,
        host_speed: list[tuple[float, float]] | None = None,
    ) -> None:
        self.argv = list(argv)
        self.runs = runs
        self.folder = folder
        self.host_speed = host_speed
        # The pipeline's weight bytes, as the last child to finish counted them (None until one has).
        self.weight_bytes: int | None = None

    def __call__(self, index: int, reference: Path | None) -> tuple[ModeResult, Path | None]:
        """Run ``index`` of the runs in a child, its output compared with the one saved at ``reference``;
        return its result and where its output was saved. A child that crashes is an error result."""
        folder = self.folder / f"run-{index}"
        command = [sys.executable, "-m", "diffusers_residency.bench", *self.argv]
        command += ["--only-run", str(index), "--child-out", str(folder)]
        command += [] if reference is None else ["--reference", str(reference)]
        sys.stdout.flush()
        sys.stderr.flush()
        # The child's stdout and stderr are the parent's: its warnings and tracebacks show as they come.
        if self.host_speed is None:
            returncode = subprocess.run(command, check=False).returncode
        else:
            returncode = sample_while_running(subprocess.Popen(command), self.host_speed)
        if returncode != 0 or not (folder / _RESULT).exists():
            mode, budget, _ = self.runs[index]
            nan = float("nan")
            return ModeResult(mode.name, nan, None, nan, None, budget, error=f"process failed (exit {returncode})"), None
        data = json.loads((folder / _RESULT).read_text())
        self.weight_bytes = data["weight_bytes"]
        output = folder / _OUTPUT
        result = _result(data["result"])
        if self.host_speed is not None and result.steady_wall is not None:
            result = replace(result, host_loop_ms=median_between(self.host_speed, *result.steady_wall))
        return result, output if output.exists() else None
