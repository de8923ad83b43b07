"""``python -m diffusers_residency.bench.host_speed``: the host's single-thread speed over time.

A pipeline whose kernels the host launches about as fast as the device runs them (SDXL's UNet at
1024x1024 on an H100) takes as long as its host does: a call is slow when the host is. The
benchmark's fresh processes cannot tell a slower call from a slower host. This probe times a fixed
pure-Python loop at every interval and prints each time as it goes, with the wall clock, so that a
run beside the benchmark (in a process of its own, which takes no GIL from the process measured,
and one core a few per cent of the time) says how fast the host was while each mode ran. At the end
it sums the samples up: the fastest, the median, the slowest, and the share that took more than
``--slow`` times the fastest.

``python -m diffusers_residency.bench --fresh-process --host-probe`` takes the same samples in the
parent while each child runs, and gives each mode the median of those taken during its steady calls.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

# About 20 ms of Python on a current server core: short beside the interval, long beside a timer tick.
DEFAULT_ITERATIONS = 300_000
# Seconds between two samples: the loop then takes a few per cent of one core.
SAMPLE_SECONDS = 0.5


def loop_milliseconds(iterations: int = DEFAULT_ITERATIONS) -> float:
    """How long the host takes to add up ``iterations`` integers in a Python loop, in milliseconds."""
    started = time.perf_counter()
    total = 0
    for i in range(iterations):
        total += i
    return (time.perf_counter() - started) * 1000.0


def sample_while_running(process: subprocess.Popen, samples: list[tuple[float, float]]) -> int:
    """Time the loop every :data:`SAMPLE_SECONDS` until ``process`` exits, appending (wall clock,
    milliseconds) to ``samples``; return its exit status. The parent of a benchmark's fresh
    processes has nothing else to do meanwhile, and no GIL of the child's to take. Interrupted
    (Ctrl-C), it kills the child first, as ``subprocess.run`` would."""
    try:
        while process.poll() is None:
            samples.append((time.time(), loop_milliseconds()))
            try:
                process.wait(timeout=SAMPLE_SECONDS)
            except subprocess.TimeoutExpired:
                continue
    except BaseException:
        process.kill()
        process.wait()
        raise
    return process.returncode


def median_between(samples: Sequence[tuple[float, float]], start: float, end: float) -> float | None:
    """The median milliseconds of the samples taken from wall clock ``start`` to ``end`` (None: none was)."""
    inside = [milliseconds for taken, milliseconds in samples if start <= taken <= end]
    return statistics.median(inside) if inside else None


def summary(samples: Sequence[float], slow: float) -> str:
    """The fastest, median and slowest loop, and the share of samples over ``slow`` times the fastest."""
    fastest = min(samples)
    share = sum(sample > slow * fastest for sample in samples) / len(samples)
    return (
        f"host loop over {len(samples)} samples: fastest {fastest:.2f} ms, median {statistics.median(samples):.2f} ms, "
        f"slowest {max(samples):.2f} ms; {share:.0%} took more than {slow:g}x the fastest"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], prog="python -m diffusers_residency.bench.host_speed")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to sample (default 60)")
    parser.add_argument("--interval", type=float, default=SAMPLE_SECONDS, help="seconds between samples (default 0.5)")
    parser.add_argument("--iterations", type=int, default=DEFAULT_ITERATIONS, help="iterations of the timed loop")
    parser.add_argument("--slow", type=float, default=1.5, help="what counts as slow, times the fastest (default 1.5)")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.interval < 0 or args.iterations < 1 or args.slow <= 1:
        parser.error("--seconds and --iterations must be positive, --interval not negative, --slow above 1")
    samples: list[float] = []
    ends = time.monotonic() + args.seconds
    # Started in the background beside a run, it is stopped with SIGTERM (a background job of a
    # script ignores SIGINT): sum up what was sampled all the same.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        while not samples or time.monotonic() < ends:
            samples.append(loop_milliseconds(args.iterations))
            print(f"{time.time():.2f} {samples[-1]:.2f}", flush=True)
            time.sleep(args.interval)
    except KeyboardInterrupt:
        pass
    print(summary(samples, args.slow), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
