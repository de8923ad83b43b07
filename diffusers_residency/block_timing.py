"""A streamed denoiser's step estimated before any call: one block of each layout, given inputs of
the shapes a dry run of the pipeline's default call gave it (see ``dry_runs``), run and timed on the
device as the pipeline is enabled.

With no step timed, a plan keeps the most resident bytes (see ``planner``): every FLUX.1-dev
double-stream block in one run, the bus idle behind them. The step a first call times then picks
other blocks, spread out, and the ones loaded at enable give way during that call's steps
(docs/benchmarks.md). Timed at enable, the plan made then is already one a timed step would choose,
so the first call's timed step keeps it (see ``planner._in_place_if_as_good``) and its blocks are on
the device from the first step on. The call still times its own steps, and plans from those.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch.utils._pytree import tree_map

from . import _device
from .plans import ComponentSizes
from .replayed_blocks import BlockInputs, TensorSpec
from .residency import ResidencyGroup, ResidencyUnit
from .step_timing import StepTiming, compute_shares

logger = logging.getLogger(__name__)

# On an accelerator, runs of a block before it is timed (the first loads its kernels and picks its
# GEMM algorithms, which a first call pays whatever the plan), and runs timed, their median taken:
# one run moves with the clock's ramp from idle. The CPU has neither: one run, timed.
WARMUP_RUNS = 2
TIMED_RUNS = 3


def estimated_step(group: ResidencyGroup, sizes: ComponentSizes, inputs: BlockInputs) -> StepTiming | None:
    """Streamed per-step component ``sizes``'s step, estimated from one block of each key in
    ``inputs`` timed on ``group``'s device: its blocks' compute seconds over the step's blocks
    (summed, and as each block's share), and the load of the blocks timed (each loaded twice, the
    second load timed: a process's first copies may include the copy path's own start). None where
    a block of it did not run in the dry run, the component is compiled (timed eager, it would
    misstate the step), or the timing fails (short of memory under a cap, say): the plan is then
    made as without it. The trunk's work between blocks, which a timed step counts, is left out
    (see docs/vram-budget.md)."""
    stream = group.stream_of(sizes.name)
    if stream is None or sorted(inputs.keys) != list(range(len(stream.blocks))):
        return None
    # A compiled component (its trunk) runs its blocks compiled too: any unit compiled counts.
    if any(_is_compiled(unit.module) for unit in group.units_of(sizes.name)):
        return None
    blocks: list[ResidencyUnit] = list(stream.blocks)
    seconds: dict[Hashable, float] = {}
    loaded = load_seconds = 0.0
    for key, (position, specs) in inputs.first.items():
        block = blocks[position]
        try:
            seconds[key], block_loaded, block_seconds = _timed(block, specs, group.device)
        except Exception as error:  # any failure means no estimate, never a failed enable
            logger.info("No step estimate for %r: timing its block %r failed (%s)", sizes.name, block.name, error)
            return None
        loaded, load_seconds = loaded + block_loaded, load_seconds + block_seconds
    if not loaded or load_seconds <= 0:
        return None
    per_block = [seconds[inputs.keys[position]] for position in range(len(blocks))]
    shares = compute_shares(per_block)
    return StepTiming(sum(per_block) / sum(sizes.block_bytes), load_seconds / loaded, True, shares)


def _is_compiled(module: torch.nn.Module) -> bool:
    forward = getattr(module, "_old_forward", None)
    return getattr(module, "_compiled_call_impl", None) is not None or hasattr(forward, "_torchdynamo_orig_callable")


def _timed(block: ResidencyUnit, specs: tuple[tuple, dict], device: torch.device) -> tuple[float, int, float]:
    """``block``'s compute seconds on inputs of ``specs``, and the bytes and seconds of its timed
    load. Its forward is the module's own, under the hooks (``_old_forward``): a stream entered
    outside a call would count the run as a pass of a step. The block is left offloaded, bound to
    its masters, whatever happens."""
    stager = block.stager
    stager.load()
    stager.offload()
    before = stager.loaded_bytes, stager.load_seconds
    try:
        stager.load()  # the compute stream waits for its copy
        args, kwargs = _materialized(specs, device)
        forward: Callable[..., Any] = getattr(block.module, "_old_forward", block.module.forward)
        on_accelerator = _device.is_accelerator(device)
        with torch.no_grad():
            for _ in range(WARMUP_RUNS if on_accelerator else 0):
                forward(*args, **kwargs)
            runs = []
            for _ in range(TIMED_RUNS if on_accelerator else 1):
                start = _device.compute_timestamp(device)
                forward(*args, **kwargs)
                runs.append((start, _device.compute_timestamp(device)))
        compute = statistics.median(_device.seconds_between(*run) for run in runs)
        return compute, stager.loaded_bytes - before[0], stager.load_seconds - before[1]
    finally:
        stager.offload()


def _materialized(specs: tuple[tuple, dict], device: torch.device) -> tuple[tuple, dict]:
    """Tensors on ``device`` for the specs' shapes and dtypes: random normal ones for floating
    point (a generator of their own: the process's is the user's, and seeds their calls), zeros
    for the rest. (Zeros where a block reads integers or flags, an all-False mask or zero lengths,
    could change its work: FLUX's, SD3's and SDXL's blocks take none.)"""
    generator = torch.Generator(device=device).manual_seed(0)

    def made(leaf: Any) -> Any:
        if not isinstance(leaf, TensorSpec):
            return leaf
        if leaf.dtype.is_floating_point:
            return torch.randn(leaf.shape, dtype=leaf.dtype, device=device, generator=generator)
        return torch.zeros(leaf.shape, dtype=leaf.dtype, device=device)

    return tree_map(made, specs)
