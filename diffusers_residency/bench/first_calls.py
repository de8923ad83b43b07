"""``python -m diffusers_residency.bench.first_calls results.json``: each run's first calls held to
what a user may expect of them, against the resident run of the same round.

A first call carries the CUDA libraries' warm-up whatever the mode, so a mode's call 1 is judged by
its excess over its own steady time, against the resident run's own first-call excess: at most
that plus 0.3x the steady time where the mode measured its plan in the call, 0.05x where it
planned from a residency profile. Call 2 is to be within 1.05x of steady. The bench prints these
after its tables when each mode ran in a process of its own (only a process's first call carries
its warm-up); this module also reads them back from a ``results.json`` written before.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from .tables import run_label

# Shares of the steady time a first call may add beyond the resident run's own first-call excess:
# measuring its plan in the call, or starting from a residency profile.
MEASURING_SHARE = 0.3
PROFILED_SHARE = 0.05
# Call 2 within this of steady.
SECOND_CALL_WITHIN = 1.05
# How the bench's setting line says each mode ran in a process of its own (--fresh-process).
FRESH_PROCESSES = "each mode in a fresh process"
# A plan's source when its figures came from a residency profile (see ResidencyPlan.source), and how
# the printed plan says so: a results.json from before ModeResult.first_plan_source has only the
# last plan's text to tell by.
PROFILE_SOURCE = "from the residency profile"
PROFILED_PLAN_SAYS = f"figures {PROFILE_SOURCE}"


@dataclass(frozen=True)
class FirstCallCheck:
    """One run's first two calls, and the resident run's of its round."""

    label: str
    call_seconds: tuple[float, ...]
    steady_seconds: float
    resident_first_seconds: float
    resident_steady_seconds: float
    profiled: bool

    @property
    def excess(self) -> float:
        return self.call_seconds[0] - self.steady_seconds

    @property
    def share(self) -> float:
        return PROFILED_SHARE if self.profiled else MEASURING_SHARE

    @property
    def allowed(self) -> float:
        return self.share * self.steady_seconds + self.resident_first_seconds - self.resident_steady_seconds

    @property
    def second_call_ratio(self) -> float | None:
        return self.call_seconds[1] / self.steady_seconds if len(self.call_seconds) > 1 else None

    def __str__(self) -> str:
        verdict = "met" if self.excess <= self.allowed else "not met"
        second = self.second_call_ratio
        if second is None:
            second_call = "-"
        else:
            second_call = (
                f"{second:.3f}x steady ({'within' if second <= SECOND_CALL_WITHIN else 'over'} {SECOND_CALL_WITHIN}x)"
            )
        return (
            f"- {self.label}, {'profile' if self.profiled else 'no profile'}: call 1 excess "
            f"{self.call_seconds[0]:.3f} - {self.steady_seconds:.3f} = {self.excess:.3f} s; allowed {self.share} x "
            f"{self.steady_seconds:.3f} + ({self.resident_first_seconds:.3f} - {self.resident_steady_seconds:.3f}) = "
            f"{self.allowed:.3f} s: {verdict}, by {abs(self.allowed - self.excess):.3f} s; call 2 {second_call}; "
            f"steady {self.steady_seconds / self.resident_steady_seconds:.2f}x resident"
        )


def first_call_checks(results: list[Any]) -> list[FirstCallCheck]:
    """A check for every run of this package's modes (those with a plan; results as the bench makes
    them, or their ``results.json`` rows read back), against the first resident run of its round."""
    resident = {}
    for r in results:
        if r.mode == "resident" and not r.error and r.call_seconds:
            resident.setdefault(r.round, r)
    rounds = any(r.round > 1 for r in results)
    checks = []
    for r in results:
        reference = resident.get(r.round)
        if not r.plan or r.error or not r.call_seconds or reference is None:
            continue
        checks.append(
            FirstCallCheck(
                label=run_label(r.mode, r.budget_bytes, r.round if rounds else None),
                call_seconds=tuple(r.call_seconds),
                steady_seconds=r.seconds_per_call,
                resident_first_seconds=reference.call_seconds[0],
                resident_steady_seconds=reference.seconds_per_call,
                profiled=_planned_from_profile(r),
            )
        )
    return checks


def _planned_from_profile(result: Any) -> bool:
    source = getattr(result, "first_plan_source", None)
    return source == PROFILE_SOURCE if source is not None else PROFILED_PLAN_SAYS in (result.plan or "")


FIRST_CALL_CRITERIA = (
    f"call 1's excess over steady within {MEASURING_SHARE}x steady, {PROFILED_SHARE}x planned from a profile, "
    f"beyond the resident mode's own in the same round; call 2 within {SECOND_CALL_WITHIN}x of steady"
)


def format_first_calls(results: list[Any]) -> str:
    return "\n".join(str(check) for check in first_call_checks(results))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m diffusers_residency.bench.first_calls results.json", file=sys.stderr)
        return 2
    data = json.loads(Path(argv[0]).read_text())
    if FRESH_PROCESSES not in data["setting"]:
        print(
            "note: the modes of this run shared one process, so only the first mode's call 1 carried the "
            "process's warm-up; run the bench with --fresh-process for first calls to compare",
            file=sys.stderr,
        )
    print(format_first_calls([SimpleNamespace(**row) for row in data["results"]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
