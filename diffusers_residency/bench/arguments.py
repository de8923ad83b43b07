"""The benchmark's command line: its arguments, checked before anything is built."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .. import _device
from ..policy import Policy
from ..text import parse_bytes
from .builders import PIPELINE_KINDS
from .modes import AFTER_TIMED_CALLS
from .processes import PROFILE_CACHE_VARIABLE
from .schemes import MODES
from .trace import FIRST_CALL_TRACES

# What a plain run compares; sequential offload and block-level group offload are slow enough
# (seconds per denoising step at full scale) to be asked for by name.
DEFAULT_MODES = ("resident", "pinned", "model_cpu_offload", "group_offload_leaf")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_arguments(argv: list[str] | None, description: str) -> argparse.Namespace:
    """The command line's arguments, checked: a bad one stops the run before any pipeline is built."""
    parser = argparse.ArgumentParser(prog="python -m diffusers_residency.bench", description=description)
    parser.add_argument("--pipeline", choices=PIPELINE_KINDS, default="flux")
    parser.add_argument("--scale", choices=("tiny", "full"), default="tiny")
    parser.add_argument("--device", default=None, help="default: the current accelerator, else cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default: bfloat16 on an accelerator, float32 on cpu")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument(
        "--shapes",
        default=None,
        help="call shapes in turn, e.g. 1024x1024,768x768,1280x1280 (height x width; instead of --height/--width): "
        "each call takes the next, and a table gives every shape's calls",
    )
    parser.add_argument("--checkpoint", type=Path, default=None, help="a pipeline folder saved with save_pretrained")
    parser.add_argument(
        "--quantize",
        choices=("nf4",),
        default=None,
        help="quantize the denoiser's linear layers before every mode (nf4: bitsandbytes 4-bit, CUDA only)",
    )
    parser.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help=f"comma-separated, from {', '.join(MODES)}; 'mode@16GB' runs it at that budget only",
    )
    parser.add_argument("--budgets", default="unlimited", help="comma-separated VRAM caps, e.g. unlimited,30GB,16GB")
    parser.add_argument("--activation-reserve", default=None, help="for the pinned mode, e.g. 3GB (default: its own)")
    parser.add_argument(
        "--host-budget",
        default=None,
        help="for the pinned_files modes: host memory for masters, e.g. 16GB; beyond it they are served from the "
        "checkpoint files (with --checkpoint); pinned_files_cold drops their page cache before the first call",
    )
    parser.add_argument(
        "--components",
        default=None,
        help="for the pinned mode, policies kept as given, e.g. unet=staged,vae=resident (default: the plan's)",
    )
    parser.add_argument("--compile", choices=("regional", "whole"), default=None, help="compile the denoiser in every mode")
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument(
        "--compile-mode",
        default=None,
        help="torch.compile's mode, e.g. reduce-overhead (CUDA graphs: the table counts their recordings)",
    )
    parser.add_argument("--warmup", type=int, default=1, help="calls per mode before the steady ones (timed too)")
    parser.add_argument("--calls", type=int, default=2, help="calls per mode after those, the steady figures' own")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the modes this many times over, in turn, each ratio to resident taken within its round "
        "(a machine whose speed drifts between modes skews a ratio taken across them)",
    )
    parser.add_argument(
        "--trace",
        nargs="?",
        const="after",
        choices=(*AFTER_TIMED_CALLS, *FIRST_CALL_TRACES),
        default=None,
        help="after its timed calls, run each mode once more under torch.profiler and print where the host's "
        "time went and how long the device waited for it, per component; '--trace first' runs the first call "
        "under it instead (a warm-up call), Python traced too: where a first call's excess goes; what that call "
        "measures for a plan, its time and the host-memory peak then carry the profiler's cost too; "
        "'--trace first-device' traces the first call without Python, so that the host's waits are its own "
        "(a kernel's first launch, a synchronisation); '--trace phases' runs one more call with no profiler, "
        "stamped at each entry into a component, and prints each component's time on the device and the host "
        "and each denoising step's on the device (a profiled host is slower: a call whose pace the host sets "
        "is timed here as it runs)",
    )
    parser.add_argument(
        "--fresh-process",
        action="store_true",
        help="run each mode, per budget and round, in a Python process of its own that builds the pipeline again: "
        "host memory, the allocator and the first calls as a first run meets them",
    )
    parser.add_argument(
        "--host-probe",
        action="store_true",
        help="with --fresh-process: time a fixed Python loop in the parent every half second while each child runs "
        "(python -m diffusers_residency.bench.host_speed), and give each mode the median over its steady calls: "
        "a pipeline whose pace the host sets is slow whenever its host is",
    )
    parser.add_argument(
        "--profile-dir",
        type=Path,
        default=None,
        help=f"the residency-profile cache ({PROFILE_CACHE_VARIABLE}) for the whole run, fresh processes included: "
        "by default a new empty folder per run; give a folder to start from profiles saved by an earlier run",
    )
    # Internal to --fresh-process: what the parent passes a child (the run it makes, where it writes
    # its result, the resident output it compares with).
    parser.add_argument("--only-run", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--reference", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="folder for results.json and results.png")
    parser.add_argument("-v", "--verbose", action="store_true", help="log the package's decisions")
    args = parser.parse_args(argv)
    if args.compile_mode is not None and args.compile is None:
        parser.error("--compile-mode applies to a compiled denoiser: give --compile regional or --compile whole too")
    if args.warmup < 0 or args.calls < 1:
        parser.error("--warmup takes 0 or more, --calls 1 or more: the steady figures are the latter's")
    if args.trace in FIRST_CALL_TRACES and args.warmup < 1:
        parser.error(f"--trace {args.trace} traces a warm-up call, not a steady one: give --warmup 1 or more")
    if any(value is not None and value < 1 for value in (args.steps, args.height, args.width)):
        parser.error("--steps, --height and --width take 1 or more")
    if args.host_probe and not args.fresh_process:
        parser.error("--host-probe times the host from the parent while each mode runs in a child: give --fresh-process")
    # Sizes and the device are checked here, once, rather than failing each mode that uses them.
    at_budgets = [spec.partition("@")[2] for spec in args.modes.split(",") if "@" in spec]
    try:
        for budget in [*args.budgets.split(","), *at_budgets]:
            parse_budget(budget)
        for flag, value in (("--activation-reserve", args.activation_reserve), ("--host-budget", args.host_budget)):
            if value is not None:
                parse_bytes(value, flag)
        if args.device is not None:
            _device.resolve_device(args.device)
    except (TypeError, ValueError, RuntimeError) as exc:
        parser.error(str(exc))
    if args.shapes is not None:
        if args.height is not None or args.width is not None:
            parser.error("--shapes gives each call's height and width: leave --height and --width out")
        try:
            args.shapes = [tuple(int(side) for side in shape.lower().split("x")) for shape in args.shapes.split(",")]
        except ValueError:
            args.shapes = None
        if not args.shapes or any(len(shape) != 2 or min(shape) <= 0 for shape in args.shapes):
            parser.error("--shapes takes heights and widths such as 1024x1024,768x768")
    return args


def parse_budget(text: str) -> int | None:
    return None if text.strip().lower() in ("unlimited", "none", "") else parse_bytes(text, "budget")


def component_policies(spec: str | None) -> dict[str, str] | None:
    """``--components unet=staged,vae=resident`` as ``enable_pinned_offload(components=...)`` takes it."""
    if spec is None:
        return None
    pairs = [tuple(part.strip() for part in item.partition("=")) for item in spec.split(",")]
    if not all(name and sep and policy for name, sep, policy in pairs):
        raise SystemExit(f"--components takes name=policy pairs separated by commas, e.g. unet=staged; not {spec!r}")
    try:
        return {name: Policy.parse(policy, f"--components {name}").value for name, _, policy in pairs}
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
