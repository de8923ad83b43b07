"""Timing a mode's calls one by one, from which call on they are steady, and how much of the
host's CPU its hypervisor took meanwhile.

A user meets the first calls too: set-up work a mode defers (allocations, pinning, compiling)
lands on them, so the benchmark times every call and says how many it takes to reach the steady
figure, not the steady figure alone.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .. import _device

# How close to the steady figure a call must be to count as steady (see calls_to_steady).
STEADY_WITHIN = 1.05


def calls_to_steady(call_seconds: Sequence[float], steady_calls: int) -> int | None:
    """The 1-based index of the first call from which every call is within STEADY_WITHIN (either
    way) of the median of the last ``steady_calls``: how many calls a user waits for the speed the
    steady figure promises. None with fewer than two calls, or when even the last call is outside."""
    if len(call_seconds) < 2:
        return None
    steady = statistics.median(call_seconds[-steady_calls:])
    settled = None
    for index in range(len(call_seconds), 0, -1):
        if not steady / STEADY_WITHIN <= call_seconds[index - 1] <= steady * STEADY_WITHIN:
            break
        settled = index
    return settled


def timed_calls(
    call: Callable[[], torch.Tensor],
    device: torch.device,
    n: int,
    seconds: list[float],
    after_each: Callable[[], None] | None = None,
) -> torch.Tensor | None:
    """Call ``n`` times, appending each call's seconds (up to the device's last kernel) to
    ``seconds``, then running ``after_each`` outside the timed span; return the first output (None
    when ``n`` is 0)."""
    first = None
    for _ in range(n):
        started = time.perf_counter()
        output = call()
        _device.synchronize(device)
        seconds.append(time.perf_counter() - started)
        if after_each is not None:
            after_each()
        first = output if first is None else first
    return first


def host_cpu_ticks(stat: Path = Path("/proc/stat")) -> tuple[int, int] | None:
    """The host's CPU time so far, in ticks: the part a hypervisor gave other guests while this one
    had work (``steal``), and all of it; None where the kernel does not tell (off Linux)."""
    try:
        fields = stat.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if fields[:1] != ["cpu"] or len(fields) < 9:
        return None
    # user nice system idle iowait irq softirq steal: guest time is counted in user already.
    ticks = [int(value) for value in fields[1:9]]
    return ticks[7], sum(ticks)


def steal_fraction(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of the host's CPU time between two :func:`host_cpu_ticks` that was stolen: on a
    virtual machine, a process slow for want of CPU shows it here and not in its own figures."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])
