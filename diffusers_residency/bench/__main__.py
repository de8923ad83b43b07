"""``python -m diffusers_residency.bench``: resident, pinned offload and diffusers' offloading modes, side by side.

With no arguments it builds a tiny FLUX pipeline (real classes, random weights, no download) and runs
it on the current accelerator, or on the CPU where there is none. ``--scale full`` builds the
published FLUX.1-dev architecture (about 34 GB of bf16 weights) on the GPU instead; ``--pipeline``
picks SDXL, SD3 or Wan 2.1 instead; ``--checkpoint DIR`` loads a saved pipeline.

``--budgets 30GB,16GB`` runs every mode once per budget, each under a device-memory cap of that size
(as a smaller GPU would be); ``--modes pinned,group_offload_leaf@16GB`` runs a mode named with
``@`` at that budget only. A mode that runs out of memory is reported as such. ``mmgp`` (CUDA only;
``pip install mmgp==3.8.2 optimum-quanto==0.2.7``) cannot be undone, so it runs once, after the
others.

Every call is timed, the first ones included: the table gives each mode's first two calls, its
steady s/call (the mean of the ``--calls`` after ``--warmup``) and the call it is steady from, and
lists every call under it. ``--fresh-process`` runs each mode, per budget and round, in a process of
its own that builds the pipeline again: host memory, the allocator and first calls as a first run
meets them. Residency profiles (``DIFFUSERS_RESIDENCY_CACHE``) start from a new empty folder unless
``--profile-dir`` names one. The table is printed; ``--out`` gets ``results.json`` and, with
matplotlib installed, ``results.png`` (s/call against peak memory, one point per mode and budget).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import diffusers
import torch
import transformers
from tqdm.auto import tqdm

from .. import _device
from ..text import format_bytes
from ..weights import module_tensors, storage_bytes
from .arguments import DTYPES, component_policies, parse_arguments, parse_budget
from .builders import build_pipeline, call_kwargs, pipeline_output
from .compiling import DENOISERS, CompileSettings
from .first_calls import FIRST_CALL_CRITERIA, FRESH_PROCESSES, format_first_calls
from .host_speed import summary
from .modes import ModeResult, run_mode
from .plot import draw
from .processes import Children, profile_cache, write_child_result
from .quantizing import quantize_nf4
from .schemes import MODES, PINNED_MODES, Mode, pinned_mode
from .tables import (
    call_seconds,
    format_calls,
    format_compile_table,
    format_host_memory,
    format_round_ratios,
    format_shape_calls,
    format_table,
    judged_by_compile_spread,
    run_label,
)
from .trace import FIRST_CALL_TRACES

# A run's output as later runs are compared with it: a tensor here, or the file a child saved it to.
Output = TypeVar("Output", torch.Tensor, Path)


def _runs(
    modes: str,
    budgets: str,
    activation_reserve: str | None,
    rounds: int = 1,
    components: dict[str, str] | None = None,
    host_budget: str | None = None,
) -> list[tuple[Mode, int | None, int]]:
    """(mode, budget, round) in the order they run: budget by budget, modes in the order given,
    all of it ``rounds`` times over; a mode named ``mode@budget`` runs at that budget only. A mode
    that cannot be undone runs last, and only once."""
    if rounds < 1:
        raise SystemExit(f"--rounds must be 1 or more, not {rounds}")
    every = [parse_budget(b) for b in budgets.split(",")]
    specs: list[tuple[Mode, list[int | None]]] = []
    for spec in modes.split(","):
        name, at, only = spec.partition("@")
        if name not in MODES:
            raise SystemExit(f"unknown mode {name!r}; choose from {', '.join(MODES)}")
        if name in PINNED_MODES:
            if name != "pinned" and host_budget is None:
                raise SystemExit(f"{name} serves masters from files beyond a host budget: give --host-budget too")
            mode = pinned_mode(activation_reserve, components, None if name == "pinned" else host_budget, name)
        else:
            mode = MODES[name]
        specs.append((mode, [parse_budget(only)] if at else every))
    caps = dict.fromkeys(cap for _, mode_caps in specs for cap in mode_caps)
    runs = [(mode, cap) for cap in caps for mode, mode_caps in specs if cap in mode_caps]
    final = [run for run in runs if not run[0].undoable]
    if len(final) > 1:
        raise SystemExit(
            f"{', '.join(run_label(mode.name, cap) for mode, cap in final)}: a mode that cannot be undone runs once per "
            f"process, after the others; name one budget for it, e.g. --modes ...,{final[0][0].name}@16GB"
        )
    if final and runs[-1][0].undoable:
        print(f"note: {final[0][0].name} cannot be undone, so it runs after the other modes", file=sys.stderr)
    undoable = [run for run in runs if run[0].undoable]
    # One that cannot be undone runs after the last round: its ratio is taken against that round's resident.
    return [(mode, cap, r) for r in range(1, rounds + 1) for mode, cap in undoable] + [(*run, rounds) for run in final]


# Where torch reads the caching allocator's settings from (PYTORCH_ALLOC_CONF is newer torch's
# device-generic name). torch's generic and CUDA-specific settings rank them differently, so every
# one that is set is named.
_ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


def allocator_settings() -> str:
    """The caching allocator's configuration from the environment. Peaks and timings under a cap
    depend on it (``expandable_segments:True`` above all), so the results say which was used."""
    settings = [f"{name}={os.environ[name]}" for name in _ALLOC_CONF_VARIABLES if os.environ.get(name)]
    return "; ".join(settings) or "default allocator settings"


def environment_line(device: torch.device) -> str:
    return (
        f"torch {torch.__version__}, diffusers {diffusers.__version__}, python {platform.python_version()}, "
        f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else device}, {allocator_settings()}"
    )


def _weight_bytes(pipe: diffusers.DiffusionPipeline) -> int:
    """Unique bytes behind every parameter and buffer of the pipeline's modules (quantized bytes for
    quantized weights)."""
    return storage_bytes(module_tensors(c for c in pipe.components.values() if isinstance(c, torch.nn.Module)))


def _source(args: argparse.Namespace) -> str:
    source = str(args.checkpoint or f"{args.scale} {args.pipeline}")
    return f"{source}, denoiser in {args.quantize}" if args.quantize else source


def _pipeline(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> tuple[diffusers.DiffusionPipeline, _Calls]:
    """The pipeline on the host, and one call of it as every mode makes it."""
    print(f"building {_source(args)} ({dtype}) ...", file=sys.stderr, flush=True)
    # Build where the resident mode runs (random init on a GPU takes seconds), then start every
    # mode from the host, as a pipeline loaded from disk would.
    if args.checkpoint:
        pipe = diffusers.DiffusionPipeline.from_pretrained(args.checkpoint, torch_dtype=dtype)
    else:
        pipe = build_pipeline(args.pipeline, args.scale, dtype=dtype, device=device)
    if args.quantize:
        quantize_nf4(next(pipe.components[name] for name in DENOISERS if name in pipe.components), dtype)
    pipe.set_progress_bar_config(disable=True)
    pipe.to("cpu")
    return pipe, _Calls(pipe, args)


class _Calls:
    """A call of the pipeline as every mode makes it; with ``--shapes``, each call the next shape,
    from the first again for each mode (see :meth:`restart`)."""

    def __init__(self, pipe: diffusers.DiffusionPipeline, args: argparse.Namespace) -> None:
        self.pipe, self.args = pipe, args
        self.shapes = args.shapes or [(args.height, args.width)]
        self.made = 0

    def restart(self) -> None:
        self.made = 0

    def __call__(self) -> torch.Tensor:
        height, width = self.shapes[self.made % len(self.shapes)]
        self.made += 1
        kwargs = call_kwargs(self.args.pipeline, self.args.scale, steps=self.args.steps, height=height, width=width)
        return pipeline_output(self.pipe, kwargs)


def _run_mode(
    args: argparse.Namespace,
    pipe: diffusers.DiffusionPipeline,
    call: _Calls,
    device: torch.device,
    run: tuple[Mode, int | None, int],
    reference: torch.Tensor | None,
) -> tuple[ModeResult, torch.Tensor | None]:
    """``run_mode`` as the command line asks for it."""
    mode, budget, _ = run
    call.restart()  # every mode's first call, the one compared with resident's, has the first shape
    compile_settings = CompileSettings(args.compile, args.compile_backend, args.compile_mode) if args.compile else None
    return run_mode(pipe, mode, device, call, warmup=args.warmup, calls=args.calls, reference=reference, budget=budget,
                    compile=compile_settings, trace=args.trace)  # fmt: skip


def _child(args: argparse.Namespace, run: tuple[Mode, int | None, int], device: torch.device, dtype: torch.dtype) -> int:
    """A child of --fresh-process: its one run on a pipeline of its own, written where the parent reads it."""
    pipe, call = _pipeline(args, device, dtype)
    reference = None if args.reference is None else torch.load(args.reference)
    result, output = _run_mode(args, pipe, call, device, run, reference)
    write_child_result(args.child_out, result, output, _weight_bytes(pipe))
    return 0


def _measure(
    runs: list[tuple[Mode, int | None, int]],
    several: bool,
    measure: Callable[[int, Output | None], tuple[ModeResult, Output | None]],
) -> list[ModeResult]:
    """Every run in turn, each compared with the first resident run's output."""
    results: list[ModeResult] = []
    reference = None
    progress = tqdm(runs, desc="bench", unit="mode", file=sys.stderr)
    for index, (mode, budget, round_) in enumerate(progress):
        labelled = run_label(mode.name, budget, round_ if several else None)
        progress.set_postfix_str(labelled)
        result, output = measure(index, reference)
        if mode.name == "resident" and reference is None and output is not None:
            reference = output
        results.append(replace(result, round=round_))
        first = call_seconds(result, 0)
        progress.write(f"{labelled}: {result.error or f'call 1 {first} s, steady {result.seconds_per_call:.3f} s/call'}")
    return results


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # `diffusers-residency bench ...`
        argv = argv[1:]
    args = parse_arguments(argv, __doc__.splitlines()[0])
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    if args.verbose:
        # The package's loggers alone: at the root, DEBUG lets in every library's (matplotlib's font
        # search, some 170 lines a run).
        logging.getLogger("diffusers_residency").setLevel(logging.DEBUG)
    if not args.verbose:
        # The builders' own chatter: the tiny pipelines' prompts truncated to their short sequence,
        # image processors missing torchvision, save and load progress bars.
        for library in (diffusers.utils.logging, transformers.utils.logging):
            library.set_verbosity_error()
            library.disable_progress_bar()
    device = _device.resolve_device(args.device or _device.current_accelerator() or "cpu")
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if _device.is_accelerator(device) else torch.float32)
    runs = _runs(
        args.modes, args.budgets, args.activation_reserve, args.rounds, component_policies(args.components), args.host_budget
    )
    if args.only_run is not None:
        return _child(args, runs[args.only_run], device, dtype)
    if runs[0][0].name != "resident":
        print("note: without 'resident' first, outputs are not checked against a reference", file=sys.stderr)
    with profile_cache(args.profile_dir) as profiles:
        if args.fresh_process:
            with tempfile.TemporaryDirectory(prefix="diffusers_residency_bench_") as folder:
                host_speed: list[tuple[float, float]] | None = [] if args.host_probe else None
                children = Children(argv, runs, Path(folder), host_speed)
                results = _measure(runs, args.rounds > 1, children)
            weight_bytes = children.weight_bytes
        else:
            pipe, call = _pipeline(args, device, dtype)
            weight_bytes = _weight_bytes(pipe)

            def here(index: int, reference: torch.Tensor | None) -> tuple[ModeResult, torch.Tensor | None]:
                return _run_mode(args, pipe, call, device, runs[index], reference)

            results = _measure(runs, args.rounds > 1, here)

    weights = "unknown bytes" if weight_bytes is None else format_bytes(weight_bytes)
    called = call_kwargs(args.pipeline, args.scale, steps=args.steps, height=args.height, width=args.width)
    size = f"{called['height']}x{called['width']}"
    if args.shapes:
        size = "shapes in turn " + ", ".join(f"{height}x{width}" for height, width in args.shapes)
    setting = (
        f"{_source(args)}, {weights} of weights, {dtype}, {called['num_inference_steps']} steps, "
        f"{size}, {args.warmup} + {args.calls} calls per mode, every one "
        f"timed, steady figures over the last {args.calls}, {FRESH_PROCESSES + ', ' if args.fresh_process else ''}"
        f"residency profiles in {profiles}"
    )
    environment = environment_line(device)
    speed = _device.is_accelerator(device)
    if not speed:
        print(
            "On the CPU this run checks function, not speed: every mode runs, and its output is compared bit for bit "
            "with resident's. Its times say nothing of a GPU's, so no ratio is shown.\n"
        )
    print(f"{setting}\n{environment}\n")
    if args.compile:
        results, spread = judged_by_compile_spread(results)
        if spread is not None:
            print(f"Compiled again, the resident pipeline differs from its first compile by up to {spread:.1e}: "
                  "compiled modes that differ by no more are counted within tolerance.\n")  # fmt: skip
    print(format_table(results, weight_bytes, ratios=speed))
    print(f"\nevery call in order, the first ones included:\n\n{format_calls(results)}")
    if args.host_probe and host_speed:
        print(f"\n{summary([milliseconds for _, milliseconds in host_speed], slow=1.5)}, timed by the parent over the run")
    if args.shapes:
        print(f"\nevery call by shape:\n\n{format_shape_calls(results, args.shapes)}")
    print(f"\nhost memory (anonymous: RssAnon plus mlocked pages):\n\n{format_host_memory(results, weight_bytes)}")
    ratios = format_round_ratios(results) if speed else ""
    if ratios:
        print(f"\nx resident in each round (against the resident mode of the same round):\n\n{ratios}")
    # Only a process's first call carries its warm-up: in one process, later modes' first calls do not.
    first_calls = format_first_calls(results) if args.fresh_process and speed else ""
    if first_calls:
        print(f"\nfirst calls ({FIRST_CALL_CRITERIA}):\n\n{first_calls}")
    if args.compile:
        how = ", ".join(filter(None, (args.compile, args.compile_backend, args.compile_mode)))
        print(f"\nwith the denoiser compiled ({how}):\n")
        print(format_compile_table(results))
    latest = {(r.mode, r.budget_bytes): r for r in results}  # of each mode and budget, its last round
    for result in latest.values():
        budget = "unlimited" if result.budget_bytes is None else format_bytes(result.budget_bytes)
        if result.plan:
            print(f"\nresidency_plan() of the {result.mode} mode at {budget}:\n\n```\n{result.plan}\n```")
        if result.report:
            print(f"\nresidency_report() after its calls:\n\n```\n{result.report}\n```")
    for result in results:  # every round's: each is a call of its own
        if result.trace:
            where = run_label(result.mode, result.budget_bytes, result.round if args.rounds > 1 else None)
            print(f"\n{_traced_call_title(args.trace)}, {where}:\n\n```\n{result.trace}\n```")
    _write(args.out, setting, environment, results, plot=speed)
    inexact = list(dict.fromkeys(r.mode for r in results if r.exact is False))
    if inexact and device.type == "cpu":
        print(
            f"\nnote: {', '.join(inexact)} differ from resident in the last bits. On the CPU, matrix kernels' "
            "results depend on where the weights sit (64-byte alignment); a mode that copies weights to new "
            "addresses changes them. Pinned offload keeps each weight's alignment, so it is exact there too."
        )
    # The exit status answers for this package's mode; diffusers' modes are measured, not vouched for.
    failed = any(
        r.mode in PINNED_MODES and (r.error or r.matches_resident is False or r.within_budget is False) for r in results
    )
    return 1 if failed else 0


def _traced_call_title(trace: str) -> str:
    """What the call whose summary follows was: the first traced, or one more traced or stamped."""
    if trace in FIRST_CALL_TRACES:
        return "the first call traced"
    return "one more call stamped" if trace == "phases" else "one more call traced"


def _write(out: Path, setting: str, environment: str, results: list[ModeResult], *, plot: bool) -> None:
    """``results.json`` and, with ``plot`` (a device that has memory figures to plot), ``results.png``."""
    out.mkdir(parents=True, exist_ok=True)
    data = {"setting": setting, "environment": environment, "results": [r.as_dict() for r in results]}
    (out / "results.json").write_text(json.dumps(data, indent=2))
    written = [out / "results.json"]
    try:
        if plot:
            written.append(draw(data, out / "results.png"))
    except ImportError:
        print("\nnote: matplotlib is not installed, so no results.png; draw it later with "
              f"python -m diffusers_residency.bench.plot {out / 'results.json'}", file=sys.stderr)
    print(f"\nwrote {', '.join(str(p) for p in written)}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
