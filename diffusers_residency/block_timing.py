"""A streamed denoiser's step estimated before any call: one block of each layout, given inputs of
the shapes a dry run of the pipeline's default call gave it (see ``dry_runs``), run and timed on the
device as the pipeline is enabled. The same inputs serve to run, untimed, what a first call would
otherwise be the first to run (see :func:`warm_kernels` and :func:`warm_encoders`).

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
from collections.abc import Callable, Hashable, Mapping
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


# Units to run ahead, each with its modules to run on it: a name for the log, the module, its inputs' specs.
_Runs = list[tuple[ResidencyUnit, list[tuple[str, torch.nn.Module, tuple[tuple, dict]]]]]


def estimated_step(group: ResidencyGroup, sizes: ComponentSizes, inputs: BlockInputs) -> StepTiming | None:
    """Streamed per-step component ``sizes``'s step, estimated from one block of each key in
    ``inputs`` timed on ``group``'s device: its blocks' compute seconds over the step's blocks
    (summed, and as each block's share), and the load of the blocks timed (each loaded twice, the
    second load timed: a process's first copies may include the copy path's own start). None where
    a block of it did not run in the dry run (or ran on what cannot be kept, see
    ``replayed_blocks.BlockInputs``), the component is compiled (timed eager, it would misstate the
    step), or the timing fails (short of memory under a cap, say): the plan is then made as without
    it. The trunk's work between blocks, which a timed step counts, is left out (see
    docs/vram-budget.md)."""
    if not can_time_blocks(group, sizes.name, inputs):
        return None
    blocks = _runnable_blocks(group, sizes.name, inputs, every_block=True)
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


def can_time_blocks(group: ResidencyGroup, name: str, inputs: BlockInputs) -> bool:
    """Whether :func:`estimated_step` runs streamed component ``name``'s blocks on ``inputs``
    (where it returns None without running any, :func:`warm_kernels` is to run them)."""
    return inputs.every_key_kept and _runnable_blocks(group, name, inputs, every_block=True) is not None


def warm_kernels(group: ResidencyGroup, name: str, inputs: BlockInputs, with_blocks: bool = True) -> None:
    """Run one block of each key in ``inputs`` of streamed component ``name`` once on ``group``'s
    device, untimed (unless ``with_blocks`` is False: they were just timed, see
    :func:`estimated_step`), then each module of its trunk that ran in the dry run (see
    ``replayed_blocks.trunk_modules``), once per layout and inputs, as a plan is put in place at
    enable, read from a residency profile or made from the dry runs.

    Under CUDA's lazy module loading a kernel's first launch loads its module, and that load may
    synchronise the context: in a first call it then waits for every copy queued ahead of it (the
    resident blocks loaded ahead, the staged ones), where a resident pipeline's first call has none
    queued; and a library sets up each new shape as it first meets it (cuDNN's convolutions and
    attention: the longest waits of a traced first call, docs/benchmarks.md). Timing the blocks
    runs them (``estimated_step``); nothing else runs the trunk's modules (a UNet's resnets and
    samplers: most of its convolutions) before the first call. On the CPU there is nothing to load,
    and the runs cost little: they are made there too, so that one path serves every device. A
    failure costs only the warm-up."""
    if any(unit.sleep_level for unit in group.units_of(name)):
        return  # a sleeping pipeline loads nothing until it wakes
    blocks = _runnable_blocks(group, name, inputs, every_block=False)
    if blocks is None:
        return
    firsts = [(blocks[position], specs) for position, specs in inputs.first.values()] if with_blocks else []
    runs = [(block, [(block.name, block.module, specs)]) for block, specs in firsts]
    trunk = next((unit for unit in group.units_of(name) if unit.stream is None), None)
    if inputs.trunk and trunk is not None:
        modules = [(f"{name}.{path}", trunk.module.get_submodule(path), specs) for path, specs in inputs.trunk.values()]
        runs.append((trunk, modules))  # loaded once for them all
    _run_ahead(runs, group.device)


def warm_encoders(
    group: ResidencyGroup, inputs: Mapping[str, tuple[tuple, dict]], blocks: Mapping[str, BlockInputs]
) -> None:
    """Run each encoder of ``inputs`` once on ``group``'s device, untimed, on inputs of the specs
    the default call's dry run first gave it (see ``default_call.DefaultCall.encoder_inputs``): a
    text encoder's first attention is otherwise set up in a first call, behind the copies queued
    ahead of it (see :func:`warm_kernels`). One hooked whole (staged or resident) runs whole; one
    streamed runs as a streamed denoiser does, one block of each layout and its trunk's modules,
    on what the dry run gave each (``blocks``): run whole, each of its blocks would load for it
    (FLUX.1-dev's T5 under a budget). Not one compiled, or asleep. Run once the plan's resident
    weights are loaded ahead (see ``adaptive.plan_ahead``): one the plan keeps resident runs where
    it is, loaded once (into segments of its own, see ``ResidencyGroup.load_resident_ahead``), and
    its run waits at enable for the copies queued before it."""
    for name, specs in inputs.items():
        units = group.units_of(name)
        if group.stream_of(name) is not None:
            if name in blocks:
                warm_kernels(group, name, blocks[name])
        elif len(units) == 1 and not units[0].sleep_level and not _is_compiled(units[0].module):
            _run_ahead([(units[0], [(name, units[0].module, specs)])], group.device)
    if group.budget_watch is not None:
        # What ran here is no call's: its retries are no component's shortfall (as after the loads
        # ahead), and its peak, with the plan's resident weights loaded, no overshoot of call 1's.
        group.budget_watch.forget_retries()
        _device.reset_peak_allocated(group.device)


def _run_ahead(runs: _Runs, device: torch.device) -> None:
    """Run each unit's modules once on their inputs' specs, the unit loaded for them all and left
    as it was found: enabled again after calls, what a call left loaded (a trunk) stays so."""
    for unit, modules in runs:
        loaded_before, running = unit.stager.loaded, unit.name
        try:
            unit.stager.load()
            for running, module, specs in modules:
                _run(module, specs, device, runs=1)
        except Exception as error:  # never a failed enable; the other units are still run
            logger.info("Kernels of %r not run ahead: %r failed (%s)", unit.component, running, error)
        finally:
            if not loaded_before:
                unit.stager.offload()


def _runnable_blocks(
    group: ResidencyGroup, name: str, inputs: BlockInputs, *, every_block: bool
) -> list[ResidencyUnit] | None:
    """Streamed component ``name``'s blocks, where they are the blocks of the dry run that gave
    ``inputs`` (as many), ``every_block`` of them ran in it where asked (a step is timed from all
    of them; a warm-up needs none that a call does not run, a vision tower's in a text encoder),
    and the component is not compiled (run eager, its blocks would neither time as its calls do
    nor load its calls' kernels); else None."""
    stream = group.stream_of(name)
    if stream is None or inputs.blocks != len(stream.blocks):
        return None
    if every_block and sorted(inputs.keys) != list(range(len(stream.blocks))):
        return None
    # A compiled component (its trunk) runs its blocks compiled too: any unit compiled counts.
    if any(_is_compiled(unit.module) for unit in group.units_of(name)):
        return None
    return list(stream.blocks)


def _is_compiled(module: torch.nn.Module) -> bool:
    forward = getattr(module, "_old_forward", None)
    return getattr(module, "_compiled_call_impl", None) is not None or hasattr(forward, "_torchdynamo_orig_callable")


def _timed(block: ResidencyUnit, specs: tuple[tuple, dict], device: torch.device) -> tuple[float, int, float]:
    """``block``'s compute seconds on inputs of ``specs``, and the bytes and seconds of its timed
    load. The block is left offloaded, bound to its masters, whatever happens."""
    stager = block.stager
    stager.load()
    stager.offload()
    before = stager.loaded_bytes, stager.load_seconds
    try:
        stager.load()  # the compute stream waits for its copy
        on_accelerator = _device.is_accelerator(device)
        _run(block.module, specs, device, runs=WARMUP_RUNS if on_accelerator else 0)
        compute = _run(block.module, specs, device, runs=TIMED_RUNS if on_accelerator else 1)
        return compute, stager.loaded_bytes - before[0], stager.load_seconds - before[1]
    finally:
        stager.offload()


def _run(module: torch.nn.Module, specs: tuple[tuple, dict], device: torch.device, runs: int) -> float:
    """Run ``module``, its weights loaded, ``runs`` times on inputs of ``specs``; the median seconds
    of a run (0.0 for none). A block's forward is the module's own, under the hooks
    (``_old_forward``): a stream entered outside a call would count the run as a pass of a step."""
    if not runs:
        return 0.0
    args, kwargs = _materialized(specs, device)
    forward: Callable[..., Any] = getattr(module, "_old_forward", module.forward)
    timed = []
    with torch.no_grad():
        for _ in range(runs):
            start = _device.compute_timestamp(device)
            forward(*args, **kwargs)
            timed.append((start, _device.compute_timestamp(device)))
    return statistics.median(_device.seconds_between(*run) for run in timed)


def _materialized(specs: tuple[tuple, dict], device: torch.device) -> tuple[tuple, dict]:
    """Tensors on ``device`` for the specs' shapes and dtypes: random normal ones for floating
    point (a generator of their own: the process's is the user's, and seeds their calls), zeros
    for the rest. (Zeros where a module reads integers or flags, an all-False mask or zero lengths,
    could change its work: FLUX's, SD3's and SDXL's blocks take none, and a trunk's timestep
    embedding given integer steps does the same work for zeros.) A device given as an argument
    was the dry run's meta device: ``device`` here."""
    generator = torch.Generator(device=device).manual_seed(0)

    def made(leaf: Any) -> Any:
        if isinstance(leaf, torch.device):
            return device
        if not isinstance(leaf, TensorSpec):
            return leaf
        if leaf.dtype.is_floating_point:
            return torch.randn(leaf.shape, dtype=leaf.dtype, device=device, generator=generator)
        return torch.zeros(leaf.shape, dtype=leaf.dtype, device=device)

    return tree_map(made, specs)
