"""``python -m diffusers_residency.bench``: resident, pinned offload and diffusers' offloading modes, side by side.

With no arguments it builds a tiny FLUX pipeline (real classes, random weights, no download) and runs
it on the current accelerator, or on the CPU where there is none. ``--scale full`` builds the
published FLUX.1-dev architecture (about 34 GB of bf16 weights) on the GPU instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
from pathlib import Path

import diffusers
import torch

from .. import _device
from .builders import PIPELINE_KINDS, build_pipeline, call_kwargs, pipeline_output
from .modes import MODES, ModeResult, run_mode

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m diffusers_residency.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", choices=PIPELINE_KINDS, default="flux")
    parser.add_argument("--scale", choices=("tiny", "full"), default="tiny")
    parser.add_argument("--device", default=None, help="default: the current accelerator, else cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default: bfloat16 on an accelerator, float32 on cpu")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--calls", type=int, default=2, help="timed calls per mode")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("-v", "--verbose", action="store_true", help="log the package's decisions")
    return parser.parse_args(argv)


def _gb(value: int | None) -> str:
    return "-" if value is None else f"{value / 1e9:.2f}"


def format_table(results: list[ModeResult], weight_bytes: int) -> str:
    resident = next((r.seconds_per_call for r in results if r.mode == "resident"), None)
    header = (
        "mode", "s/call", "x resident", "peak alloc GB", "setup s", "host RSS GB", "RSS x weights",
        "loaded GB/call", "load GB/s", "exact",
    )  # fmt: skip
    rows = []
    for r in results:
        if r.error:
            rows.append((r.mode, r.error, "-", _gb(r.peak_allocated_bytes), *("-",) * (len(header) - 4)))
            continue
        rows.append(
            (
                r.mode,
                f"{r.seconds_per_call:.3f}",
                "-" if not resident else f"{r.seconds_per_call / resident:.2f}",
                _gb(r.peak_allocated_bytes),
                f"{r.setup_seconds:.2f}",
                _gb(r.host_rss_bytes),
                "-" if r.host_rss_bytes is None else f"{r.host_rss_bytes / weight_bytes:.2f}",
                _gb(r.loaded_bytes_per_call),
                "-" if r.load_gbps is None else f"{r.load_gbps:.1f}",
                {None: "reference" if r.mode == "resident" else "-", True: "yes", False: "NO"}[r.exact],
            )
        )
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _weight_bytes(pipe: diffusers.DiffusionPipeline) -> int:
    """Unique bytes behind every parameter and buffer of the pipeline's modules."""
    modules = [c for c in pipe.components.values() if isinstance(c, torch.nn.Module)]
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for m in modules
        for t in (*m.parameters(), *m.buffers())
    }
    return sum(storages.values())


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    device = _device.resolve_device(args.device or torch.accelerator.current_accelerator() or "cpu")
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if _device.is_accelerator(device) else torch.float32)
    modes = [MODES[name] for name in args.modes.split(",")]
    if modes[0].name != "resident":
        print("note: without 'resident' first, outputs are not checked against a reference", file=sys.stderr)

    print(f"building {args.scale} {args.pipeline} ({dtype}) ...", file=sys.stderr, flush=True)
    # Build where the resident mode runs (random init on a GPU takes seconds), then start every
    # mode from the host, as a pipeline loaded from disk would.
    pipe = build_pipeline(args.pipeline, args.scale, dtype=dtype, device=device)
    pipe.set_progress_bar_config(disable=True)
    weight_bytes = _weight_bytes(pipe)
    kwargs = dict(steps=args.steps, height=args.height, width=args.width)

    def call() -> torch.Tensor:
        return pipeline_output(pipe, call_kwargs(args.pipeline, args.scale, **kwargs))

    results: list[ModeResult] = []
    reference = None
    for index, mode in enumerate(modes, 1):
        print(f"[{index}/{len(modes)}] {mode.name}: {args.warmup} warm-up + {args.calls} timed calls ...", file=sys.stderr, flush=True)
        result, output = run_mode(pipe, mode, device, call, warmup=args.warmup, calls=args.calls, reference=reference)
        if mode.name == "resident":
            reference = output
        results.append(result)
        print(f"    {result.seconds_per_call:.3f} s/call", file=sys.stderr, flush=True)

    setting = (
        f"{args.scale} {args.pipeline}, {weight_bytes / 1e9:.2f} GB of weights, {dtype}, {args.steps or 'default'} steps, "
        f"{args.height or 'default'}x{args.width or 'default'}, {args.warmup} warm-up + {args.calls} timed calls per mode"
    )
    environment = (
        f"torch {torch.__version__}, diffusers {diffusers.__version__}, python {platform.python_version()}, "
        f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else device}"
    )
    print(f"{setting}\n{environment}\n")
    print(format_table(results, weight_bytes))
    for result in results:
        if result.report:
            print(f"\nresidency_report() after the {result.mode} mode's calls:\n\n```\n{result.report}\n```")
    if args.json:
        args.json.write_text(
            json.dumps({"setting": setting, "environment": environment, "results": [r.as_dict() for r in results]}, indent=2)
        )
    inexact = [r.mode for r in results if r.exact is False]
    if inexact and device.type == "cpu":
        print(
            f"\nnote: {', '.join(inexact)} differ from resident in the last bits. On the CPU, matrix kernels' "
            "results depend on where the weights sit (64-byte alignment); a mode that copies weights to new "
            "addresses changes them. Pinned offload keeps each weight's alignment, so it is exact there too."
        )
    # The exit status answers for this package's mode; diffusers' modes are measured, not vouched for.
    return 1 if "pinned" in inexact else 0


if __name__ == "__main__":
    sys.exit(main())
