"""A streamed component's denoising step: its timing as a call measured it, and the step simulated
for a choice of resident blocks and window depth, from which the planner picks the shortest."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepTiming:
    """Seconds per byte a streamed per-step component's blocks take to compute (the device time of a
    step over its block bytes) and to load (host-to-device), as a call measured them."""

    compute_per_byte: float
    load_per_byte: float


def simulated_step_seconds(
    block_bytes: Sequence[int], kept: frozenset[int], prefetch_blocks: int, timing: StepTiming
) -> float:
    """One denoising step of a streamed component, simulated on its two streams: blocks compute in
    order, each for its bytes times ``compute_per_byte``; a streamed block computes once its load is
    done. Loads run one at a time, issued as the block stream issues them (at a block's entry, the
    window's next streamed blocks), and each starts only once the compute queued before it is done
    (the copy stream waits for it, see ``_device.TimedCopy``). Blocks in ``kept`` never load.
    Three passes are run and the middle one timed: the window wraps into the next step."""
    count = len(block_bytes)
    streamed = [t for t in range(3 * count) if t % count not in kept]
    if len(streamed) <= 3 * (prefetch_blocks + 1):
        # A window as large as every streamed block keeps them all: after the first pass, none loads.
        return sum(block_bytes) * timing.compute_per_byte
    load_done: dict[int, float] = {}
    compute_done = copy_done = 0.0
    pass_ends = []
    issued = 0  # occurrences streamed[:issued] have their loads issued
    after = 0  # streamed[after] is the first streamed occurrence past the current one
    for t in range(3 * count):
        i = t % count
        while after < len(streamed) and streamed[after] <= t:
            after += 1
        # At the entry of occurrence t: its own load if not issued yet, then the window's.
        window_end = min(len(streamed), after + prefetch_blocks + (i in kept))
        while issued < window_end:
            u = streamed[issued]
            copy_done = max(copy_done, compute_done) + block_bytes[u % count] * timing.load_per_byte
            load_done[u] = copy_done
            issued += 1
        compute_done = max(compute_done, load_done.get(t, 0.0)) + block_bytes[i] * timing.compute_per_byte
        if i == count - 1:
            pass_ends.append(compute_done)
    return pass_ends[1] - pass_ends[0]
