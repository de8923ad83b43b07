"""A streamed component's denoising step: its timing as a call measured it, and the step simulated
for a choice of resident blocks and window depth, from which the planner picks the shortest."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepTiming:
    """Seconds per byte a streamed per-step component's blocks take to compute (the device time of a
    step over its block bytes) and to load (host-to-device), as a call measured them, or
    (``estimated``) as blocks of it timed at enable did (see ``block_timing``); and how the step's
    compute divides among its blocks (``compute_shares``, in block order, summing to one), where
    it was timed block by block.

    Bytes say little of a block's compute: a FLUX.1-dev double-stream block holds 2.4x the weights
    of a single-stream one for about the same work, so a step simulated with compute in proportion
    to bytes hides a double block's load behind compute it does not have, and misjudges which
    blocks to keep and how many to load ahead (docs/vram-budget.md)."""

    compute_per_byte: float
    load_per_byte: float
    estimated: bool = False
    compute_shares: tuple[float, ...] | None = None


def compute_shares(seconds: Sequence[float]) -> tuple[float, ...] | None:
    """Blocks' compute ``seconds`` as parts of their sum (None where they sum to nothing)."""
    total = sum(seconds)
    return tuple(block / total for block in seconds) if total > 0 else None


def simulated_step_seconds(
    block_bytes: Sequence[int], kept: frozenset[int], prefetch_blocks: int, timing: StepTiming
) -> float:
    """One denoising step of a streamed component, simulated on its two streams: blocks compute in
    order, each for its share of the step's compute (``timing.compute_shares``; without them, or
    with shares of another count of blocks, in proportion to its bytes); a streamed block computes
    once its load is done. Loads run one at a time, issued as the block stream issues them (at a
    block's entry, the window's next streamed blocks), and each starts only once the compute queued
    before it is done (the copy stream waits for it, see ``_device.TimedCopy``). Blocks in ``kept``
    never load. Three passes are run and the middle one timed: the window wraps into the next step."""
    count = len(block_bytes)
    is_kept = [i in kept for i in range(count)]
    streamed = [i for i in range(count) if not is_kept[i]]
    if len(streamed) <= prefetch_blocks + 1:
        # A window as large as every streamed block keeps them all: after the first pass, none loads.
        return sum(block_bytes) * timing.compute_per_byte
    # A planner simulates hundreds of choices per plan: the per-block figures are worked out once,
    # and loads are counted by their place among the streamed occurrences of the three passes.
    shares = timing.compute_shares
    if shares is not None and len(shares) == count:
        step = sum(block_bytes) * timing.compute_per_byte
        compute = [share * step for share in shares]
    else:
        compute = [nbytes * timing.compute_per_byte for nbytes in block_bytes]
    load = [block_bytes[i] * timing.load_per_byte for i in streamed] * 3
    occurrences = len(load)
    load_done = [0.0] * occurrences
    compute_done = copy_done = 0.0
    pass_ends = []
    issued = 0  # the first ``issued`` streamed occurrences have their loads issued
    reached = 0  # streamed occurrences up to the current one, itself included
    for _ in range(3):
        for i in range(count):
            # At the entry of an occurrence: its own load if not issued yet, then the window's.
            # (Comparisons rather than min and max: this loop runs some 10^5 times per plan.)
            if is_kept[i]:
                window_end = reached + prefetch_blocks + 1
            else:
                reached += 1
                window_end = reached + prefetch_blocks
            if window_end > occurrences:
                window_end = occurrences
            while issued < window_end:
                copy_done = (copy_done if copy_done > compute_done else compute_done) + load[issued]
                load_done[issued] = copy_done
                issued += 1
            if not is_kept[i] and load_done[reached - 1] > compute_done:
                compute_done = load_done[reached - 1]
            compute_done += compute[i]
        pass_ends.append(compute_done)
    return pass_ends[1] - pass_ends[0]
