"""``python -m diffusers_residency.bench.planning``: how long the planner takes the host, for a
published pipeline's sizes at each budget. No device, no weights: the pipeline is built on the meta
device, and the plans are made from the figures a measured call gives them.

A first call plans on the host while the device waits: as its denoiser's timed step ends (the
rest of its steps are planned for it), and as it returns (the plan for what it measured); a later
call plans once more where its steps, timed again under that plan, moved (see ``retiming``). All
three are timed steps' plans, the slowest the planner makes, and the first of them, in a fresh
process, meets no simulation made before. So each budget is timed as a process meets it: the
planner's caches emptied, the planning enabling a pipeline does (the choices of resident blocks
listed, and a first plan with no figure), then a plan for the estimated figures, one for the
measured ones (the VAE's larger), and one for a step timed again 15 % longer. No block runs here,
so each block computes in proportion to its bytes, not for its timed share of the step (see
``step_timing.StepTiming``): the plans, and so the trials searched, are not quite a device's.

A plan made at enable with no step timed keeps the most resident bytes, and a first call's timed
step then loads other blocks (see ``block_timing``): for each budget, the bytes it loads so, with no
step at enable and with one estimated some percent off the step timed.

A first call also estimates on the host, by dry runs on the meta device (see ``dry_runs``): its
decoder's need at the default size as the pipeline is enabled, and its denoiser's as the denoiser
first starts, from its inputs, which are made here in the shapes the pipeline gives them at
1024x1024 (with these, the estimates are those the H200's runs printed).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable, Mapping, Sequence

import torch
from diffusers import DiffusionPipeline

from .. import kept_blocks
from ..casts import guessed_casts
from ..components import component_sizes, default_reserve_for, module_components, offload_sequence
from ..dry_runs import CallDryRuns, ForwardDryRun
from ..planner import PREFETCH_CHOICES, plan_residency
from ..plans import ComponentSizes
from ..policy import Policy
from ..step_timing import StepTiming
from ..text import format_bytes, parse_bytes, text_table
from .builders import build_pipeline

_MB = 10**6
# What a first call at 1024x1024 measured above the weights, per component (docs/benchmarks.md), the
# denoiser's step seconds (all its blocks' compute) and the bus's bytes per second; the VAE's need
# as the dry runs estimated it, and as the call measured it with its margins.
FIGURES = {
    "flux": (
        {"text_encoder": 409 * _MB, "text_encoder_2": 623 * _MB, "transformer": 1454 * _MB},
        ("vae", 3222 * _MB, 4064 * _MB),
        ("transformer", 0.174, 54.6e9),
    ),
    "sdxl": (
        {"text_encoder": 249 * _MB, "text_encoder_2": 234 * _MB, "unet": 690 * _MB},
        ("vae", 6611 * _MB, 6760 * _MB),
        ("unet", 0.061, 53.9e9),
    ),
}
_DEFAULT_BUDGETS = {"flux": "8GB,16GB,30GB", "sdxl": "8GB"}
# The reserve for a component no figure names (none here: every one is named).
_RESERVE = 3 << 30
# A step timed again this much longer than the one planned for: past retiming.RETIME_TOLERANCE, so
# planned for again.
_RETIMED = 1.15


# How far off a step estimated at enable (see ``block_timing``) is taken to be, in compute per byte.
ESTIMATE_ERRORS = (-0.1, -0.05, 0.05, 0.1)


def loaded_at_timed_step(sizes: Sequence[ComponentSizes], budget: int, kind: str, error: float | None) -> int:
    """Bytes of the denoiser's blocks that a first call's timed step makes resident beyond those the
    plan made at enable keeps: loaded in that call. The plan at enable is made with no step
    (``error`` None) or from one estimated ``error`` off the step timed; the timed step's plan keeps
    it where it is as good (see ``planner._in_place_if_as_good``). Both for the estimated figures."""
    others, (decoder, estimated, _), (denoiser, step, bus) = FIGURES[kind]
    by_name = {s.name: s for s in sizes}
    streaming = {s.name: Policy.STREAMED for s in sizes if s.streamable}
    activations: Mapping[str, int] = {**others, decoder: estimated}

    def timing(seconds: float) -> dict[str, StepTiming]:
        return {denoiser: StepTiming(seconds / sum(by_name[denoiser].block_bytes), 1 / bus)}

    at_enable = plan_residency(sizes, budget, _RESERVE, streaming, activations,
                               timings=None if error is None else timing(step * (1 + error)))  # fmt: skip
    timed = plan_residency(sizes, budget, _RESERVE, streaming, activations, timings=timing(step),
                           incumbent=at_enable.components)  # fmt: skip
    loaded = timed[denoiser].resident_blocks - at_enable[denoiser].resident_blocks
    return sum(by_name[denoiser].block_bytes[i] for i in loaded)


def _dtype(kind: str) -> torch.dtype:
    return torch.float16 if kind == "sdxl" else torch.bfloat16


def meta_pipeline(kind: str, scale: str = "full") -> DiffusionPipeline:
    return build_pipeline(kind, scale, dtype=_dtype(kind), device="meta")


def meta_sizes(pipe: DiffusionPipeline) -> list[ComponentSizes]:
    """The planner's view of a pipeline built on the meta device. Its tensors have no storage there:
    each parameter and buffer counts its own bytes once (tied ones are one)."""
    return component_sizes(pipe, module_components(pipe), _tensor_bytes)


def _tensor_bytes(tensors) -> int:
    return sum({id(t): t.numel() * t.element_size() for t in tensors}.values())


def timed_plans(sizes: Sequence[ComponentSizes], budget: int, kind: str) -> tuple[float, float, float, float]:
    """Seconds of the planning at enable, and of the three plans a fresh process's first calls make
    (see the module)."""
    others, (decoder, estimated, measured), (denoiser, step, bus) = FIGURES[kind]
    blocks = next(s for s in sizes if s.name == denoiser).block_bytes
    # As the pipeline replans once a call is under way, what streams keeps streaming: here every
    # component with blocks, the most the planner searches (enabled, a pipeline hooks whole the
    # encoders the plan for its estimate stages, SDXL's two at 8 GB, which its plans then move whole).
    streaming = {s.name: Policy.STREAMED for s in sizes if s.streamable}

    def plan(decoder_need: int, step_seconds: float) -> Callable[[], object]:
        activations: Mapping[str, int] = {**others, decoder: decoder_need}
        timing = {denoiser: StepTiming(compute_per_byte=step_seconds / sum(blocks), load_per_byte=1 / bus)}
        return lambda: plan_residency(sizes, budget, _RESERVE, streaming, activations, timings=timing)

    def enable() -> None:
        # As components.planner_for and the plan enable_pinned_offload makes first, with nothing fixed.
        kept_blocks.prepare_block_choices(sizes, PREFETCH_CHOICES)
        plan_residency(sizes, budget, default_reserve_for(list(sizes), budget, {}), {}, {})

    kept_blocks.clear_caches()
    return (
        _seconds(enable),
        _seconds(plan(estimated, step)),
        _seconds(plan(measured, step)),
        _seconds(plan(measured, step * _RETIMED)),
    )


def _step_inputs(kind: str) -> dict[str, object]:
    """The denoiser's inputs at its first step of a 1024x1024 call with guidance, as meta tensors."""
    dtype = _dtype(kind)

    def meta(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="meta")

    if kind == "flux":
        tokens, text = 4096, 512
        return dict(hidden_states=meta(1, tokens, 64), encoder_hidden_states=meta(1, text, 4096),
                    pooled_projections=meta(1, 768), timestep=meta(1), img_ids=meta(tokens, 3), txt_ids=meta(text, 3),
                    guidance=meta(1, dtype=torch.float32), joint_attention_kwargs=None, return_dict=False)  # fmt: skip
    return dict(sample=meta(2, 4, 128, 128), timestep=meta(dtype=torch.int64), encoder_hidden_states=meta(2, 77, 2048),
                timestep_cond=None, cross_attention_kwargs=None, return_dict=False,
                added_cond_kwargs={"text_embeds": meta(2, 1280), "time_ids": meta(2, 6)})  # fmt: skip


def timed_dry_runs(pipe: DiffusionPipeline, kind: str) -> tuple[tuple[str, float, int | None], ...]:
    """(what, seconds, the estimate in bytes) of making the dry runs at enable (the decode of the
    default size and the denoiser's step of the default call estimated with them, see
    ``default_call``), of the decoder's estimate as a first call of that size starts, and of the
    denoiser's as a first call of a shape not estimated at enable starts (a fresh dry run)."""
    made: list[CallDryRuns | None] = []
    enable = _seconds(
        lambda: made.append(CallDryRuns.of(pipe, module_components(pipe), offload_sequence(pipe), guessed_casts(pipe)))
    )
    runs = made[0]
    if runs is None:
        raise RuntimeError(f"no dry runs for {kind}'s pipeline")
    needs: list[int | None] = []
    decoder = _seconds(lambda: needs.append(runs.decoder.need({"height": 1024, "width": 1024})))
    fresh = ForwardDryRun(pipe.components[runs.denoiser])
    denoiser = _seconds(lambda: needs.append(fresh.need((), _step_inputs(kind))))
    return (
        ("at enable", enable, None),
        (runs.decoder.name, decoder, needs[0]),
        (f"{runs.denoiser}, another shape", denoiser, needs[1]),
    )


def _seconds(call: Callable[[], object]) -> float:
    # A collection of the garbage left by what ran before (0.3 s over the meta pipeline's objects)
    # would land in whichever call next allocates enough: made first, it is no one's.
    gc.collect()
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diffusers_residency.bench.planning", description=__doc__)
    parser.add_argument("--pipeline", choices=sorted(FIGURES), default="flux")
    parser.add_argument("--budgets", help="comma-separated, e.g. 8GB,16GB (default: the benchmark's for it)")
    args = parser.parse_args(argv)
    budgets = [parse_bytes(b) for b in (args.budgets or _DEFAULT_BUDGETS[args.pipeline]).split(",")]
    pipe = meta_pipeline(args.pipeline)
    sizes = meta_sizes(pipe)
    rows = [("budget", "at enable s", "estimated figures s", "measured figures s", "timed again s")]
    for budget in budgets:
        rows.append((format_bytes(budget), *(f"{s:.4f}" for s in timed_plans(sizes, budget, args.pipeline))))
    print(f"full {args.pipeline}, {format_bytes(sum(s.nbytes for s in sizes))} of weights; torch {torch.__version__}, "
          f"python {sys.version.split()[0]}")  # fmt: skip
    print("\n".join(text_table(rows)))
    given_way = [("budget", "no step at enable", *(f"step {error:+.0%} at enable" for error in ESTIMATE_ERRORS))]
    for budget in budgets:
        loaded = (loaded_at_timed_step(sizes, budget, args.pipeline, error) for error in (None, *ESTIMATE_ERRORS))
        given_way.append((format_bytes(budget), *(format_bytes(nbytes) for nbytes in loaded)))
    print("denoiser blocks a first call's timed step loads beyond the plan made at enable's:")
    print("\n".join(text_table(given_way)))
    dry = [("dry run", "s", "estimate")]
    for what, seconds, need in timed_dry_runs(pipe, args.pipeline):
        dry.append((what, f"{seconds:.4f}", "-" if need is None else format_bytes(need)))
    print("\n".join(text_table(dry)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
