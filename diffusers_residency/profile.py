"""Residency profiles: what calls measured of a pipeline under a budget, kept across processes.

A plan is only as good as the figures it is made from: each component's activations above its
weights and, for a streamed denoiser, how long a step computes and loads. A process learns them in
its first calls of each call shape; a profile keeps them, per shape, so that the next process plans
its first call from them instead of measuring again. Figures hold only for the pipeline, the
device, the budget and the library they were measured with, so a profile is keyed by all of these
and one measured elsewhere is never used.

Profiles live in a cache folder (``DIFFUSERS_RESIDENCY_CACHE``, else the platform's cache folder)
unless ``DIFFUSERS_RESIDENCY_NO_PROFILES`` is set; a service can also save one and ship it
(``save_residency_profile`` / ``load_residency_profile`` in :mod:`.pipeline`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import _device
from .plans import ComponentPlan
from .policy import Policy
from .step_timing import StepTiming

logger = logging.getLogger(__name__)

CACHE_VARIABLE = "DIFFUSERS_RESIDENCY_CACHE"
NO_PROFILES_VARIABLE = "DIFFUSERS_RESIDENCY_NO_PROFILES"
# Bumped when what a profile holds changes meaning: an older file is then refused as stale.
# 2: plans kept with their figures, and the policies given keyed. 3: videos per prompt and the
# prompt embeddings' shape in call shapes (a shape may stand for a smaller one's calls). 4: a call
# leaving its size to the pipeline's default keyed by that size (see call_shapes.call_shape). 5: a
# step's compute shares by block, and plans chosen with them (see step_timing.StepTiming).
FORMAT = 5

def cache_folder() -> Path | None:
    """Where profiles are kept, or None when ``DIFFUSERS_RESIDENCY_NO_PROFILES`` turns them off.

    Read at each use, not at import: a program (the benchmark) may point it elsewhere after."""
    if os.environ.get(NO_PROFILES_VARIABLE, "").strip().lower() not in ("", "0", "false", "no"):
        return None
    if os.environ.get(CACHE_VARIABLE):
        try:
            return Path(os.environ[CACHE_VARIABLE]).expanduser()
        except RuntimeError:  # "~name" of no user: no home folder to expand it to
            logger.warning("%s=%s names no home folder; residency profiles are off", CACHE_VARIABLE, os.environ[CACHE_VARIABLE])
            return None
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "diffusers_residency"


@dataclass(frozen=True)
class CallFigures:
    """What calls of one shape measured: each component's bytes above the weights while it ran
    (margins included), each streamed denoiser's step timing, and the components before which the
    allocator's cache is to be given back rather than kept (see ``RetentionBudget``); the plan
    made for those figures, which a first call from them takes as it is (see ``plan_residency``);
    and the casts such a call made of a component and undid, losing nothing (SDXL's VAE: to float32
    to decode, and back to float16; see ``casts.lossless_round_trip``), which a pipeline
    enabled from them makes before its first call."""

    activations: Mapping[str, int]
    timings: Mapping[str, StepTiming] = field(default_factory=dict)
    release_before: frozenset[str] = frozenset()
    # Whether the step was timed again under the plan made for the measuring call's timing (which
    # retries under a cap can stretch); a plan from figures not retimed times it again.
    retimed: bool = True
    plan: tuple[ComponentPlan, ...] = ()
    casts: Mapping[str, tuple[torch.dtype, ...]] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {
            "activations": dict(self.activations),
            # An estimated step (see block_timing) says so: a plan from it times its step again.
            "timings": {name: _timing_as_json(t) for name, t in self.timings.items()},
            "release_before": sorted(self.release_before),
            "retimed": self.retimed,
            "plan": [
                [p.name, p.policy.value, sorted(p.resident_blocks), sorted(p.staged_blocks), p.prefetch_blocks]
                for p in self.plan
            ],
            "casts": {name: [str(dtype).removeprefix("torch.") for dtype in dtypes] for name, dtypes in self.casts.items()},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CallFigures:
        activations = {str(name): int(nbytes) for name, nbytes in data["activations"].items()}
        timings = {str(name): _timing_from_json(name, timing) for name, timing in data["timings"].items()}
        if not all(0 <= nbytes <= _MOST_BYTES for nbytes in activations.values()):
            raise ValueError(f"an activation figure that is negative or over {_MOST_BYTES} bytes")
        per_byte = [f for t in timings.values() for f in (t.compute_per_byte, t.load_per_byte)]
        if not all(0 <= figure <= _MOST_SECONDS_PER_BYTE for figure in per_byte):
            raise ValueError(f"a timing that is negative, over {_MOST_SECONDS_PER_BYTE} s a byte or not a number")
        # Shares that do not sum to one would simulate a step of other compute than the one timed.
        shares = [t.compute_shares for t in timings.values() if t.compute_shares is not None]
        if not all(all(0 <= share <= 1 for share in each) and abs(sum(each) - 1) <= 1e-6 for each in shares):
            raise ValueError("blocks' shares of a step's compute that are not parts of one")
        plan = tuple(
            ComponentPlan(str(name), Policy(policy), frozenset(map(int, kept)), int(depth), frozenset(map(int, staged)))
            for name, policy, kept, staged, depth in data["plan"]
        )
        release_before, retimed = frozenset(map(str, data["release_before"])), bool(data["retimed"])
        # Files of format 3 written before casts were kept have none.
        casts = {str(name): tuple(map(_dtype, dtypes)) for name, dtypes in data.get("casts", {}).items()}
        return cls(activations, timings, release_before, retimed, plan, casts)


def _timing_as_json(timing: StepTiming) -> list[Any]:
    """[c, load], then "estimated" for a step estimated at enable (see block_timing), then the
    blocks' compute shares where the step has them."""
    marks = ["estimated"] if timing.estimated else []
    shares = [list(timing.compute_shares)] if timing.compute_shares is not None else []
    return [timing.compute_per_byte, timing.load_per_byte, *marks, *shares]


def _timing_from_json(name: str, timing: Any) -> StepTiming:
    """The step :func:`_timing_as_json` wrote, checked for its form (its figures are checked by
    the caller)."""
    if not isinstance(timing, list) or len(timing) < 2:
        raise ValueError(f"timing {timing!r} of {name!r} is no list of [c, load, \"estimated\"?, [shares]?]")
    rest = timing[2:]
    estimated = rest[:1] == ["estimated"]
    rest = rest[estimated:]
    shares = rest[0] if len(rest) == 1 and isinstance(rest[0], list) and rest[0] else None
    if (rest and shares is None) or not all(type(share) in (int, float) for share in shares or ()):
        raise ValueError(f"timing {timing!r} of {name!r} is no list of [c, load, \"estimated\"?, [shares]?]")
    shares = None if shares is None else tuple(map(float, shares))
    return StepTiming(float(timing[0]), float(timing[1]), estimated, shares)


def _step_said(figures: CallFigures) -> str:
    if not figures.timings:
        return ""
    return " (step estimated)" if all(t.estimated for t in figures.timings.values()) else " (step timed)"


def _dtype(name: str) -> torch.dtype:
    """The floating-point dtype a profile names as ``str(dtype)`` does, less ``torch.``: casts of
    weights are made to those alone (``nn.Module.to`` refuses integers)."""
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{name!r} is no floating-point torch dtype")
    return dtype


# The largest figures a profile may hold. Far past any device (an exabyte; a second a byte), they
# only keep a figure written by hand finite through the planner's sums: a step simulated from a
# timing of 1e308 s a byte overflows to infinity, then to NaN, and no choice is the shortest.
_MOST_BYTES = 1 << 60
_MOST_SECONDS_PER_BYTE = 1.0


@dataclass
class ResidencyProfile:
    """The figures learned for one pipeline under one budget, per call shape, and what they hold
    for (``key``: the pipeline's class and components, the device, the budget, the versions)."""

    key: Mapping[str, str]
    shapes: dict[str, CallFigures] = field(default_factory=dict)
    # Shapes whose figures a call disproved in this process (it ran out of memory under them): a
    # write leaves out the file's figures for them too, or the next process would plan from them.
    dropped: set[str] = field(default_factory=set)

    def first_shape(self) -> str | None:
        """The call shape kept first: a pipeline enabled from the profile plans for it (a service's
        first call is most often of its usual shape)."""
        return next(iter(self.shapes), None)

    def as_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "key": dict(self.key),
            "shapes": {shape: figures.as_json() for shape, figures in self.shapes.items()},
        }

    def __str__(self) -> str:
        head = f"residency profile for {self.key.get('pipeline')} at vram_budget {self.key.get('budget')} bytes"
        lines = [f"{head}, {len(self.shapes)} call shape(s)"]
        for shape, figures in self.shapes.items():
            needs = ", ".join(f"{name} {nbytes / 1e9:.2f} GB" for name, nbytes in figures.activations.items())
            lines.append(f"  {shape or '(no arguments)'}: {needs}" + _step_said(figures))
        return "\n".join(lines)


# Configuration entries that say how a model was saved or loaded, not what it is: the dtype it was
# loaded in (the weights' own dtypes are keyed apart) and the version that saved it.
_NOT_ARCHITECTURE = ("transformers_version", "dtype", "torch_dtype")
# Budgets are keyed to this granularity: "auto" reads what the device has free, which moves by a
# few megabytes from one process to the next, and a profile keyed to the byte would never be reused.
BUDGET_GRANULARITY = 256 << 20


def _config(module: nn.Module) -> Any:
    """A module's architecture as plain data: diffusers' models carry ``config`` (a dict),
    transformers' a ``PretrainedConfig``. Entries that say where and by what it was saved
    (``_name_or_path``, the library's version) are left out: the same checkpoint copied elsewhere
    is the same model."""
    config = getattr(module, "config", None)
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    kept = {k: v for k, v in dict(config or {}).items() if not k.startswith("_") and k not in _NOT_ARCHITECTURE}
    kept["attention"] = _attention(module)
    return json.loads(json.dumps(kept, default=str, sort_keys=True))


def _attention(module: nn.Module) -> str:
    """The attention a module's forward runs, which changes what it needs above the weights (an
    unfused kernel holds the attention matrix): transformers' ``_attn_implementation``, or the
    classes of a diffusers model's attention processors, each with the backend it dispatches to
    (``set_attention_backend``; None for the one active where it runs)."""
    implementation = getattr(getattr(module, "config", None), "_attn_implementation", None)
    processors = getattr(module, "attn_processors", None) if implementation is None else None
    if not isinstance(processors, Mapping):
        return str(implementation)
    kinds = {f"{type(p).__name__}:{getattr(p, '_attention_backend', None)}" for p in processors.values()}
    return ",".join(sorted(kinds))


def profile_key(
    pipeline: str,
    modules: Mapping[str, nn.Module],
    budget: int,
    device: torch.device,
    device_name: str,
    device_bytes: int | None,
    pin_memory: bool,
    policies: Mapping[str, str],
) -> dict[str, str]:
    """What a profile's figures hold for. Components are hashed from their class, configuration,
    attention kernel, dtypes and their tensors' bytes: the same checkpoint loaded again matches,
    another architecture or dtype does not (a fine-tune of the same one does: its calls need the
    same). ``policies``: those the caller gave (``components=``), which the
    plan kept with the figures keeps. Not keyed: a VAE's tiling or slicing switched on after loading."""
    import diffusers
    import transformers

    from . import __version__
    from .weights import module_stored_tensors, module_tensors

    components = []
    for name, module in modules.items():
        dtypes = sorted({str(t.dtype) for t in module_tensors((module,))})
        # The tensors' own bytes, not their storages': staged, a weight is a view of a master that
        # holds others too, and the key must not change as a pipeline is enabled again.
        nbytes = sum(stored.nbytes for stored in module_stored_tensors((module,)))
        components.append([name, type(module).__name__, _config(module), dtypes, nbytes])
    digest = hashlib.sha256(json.dumps(components, sort_keys=True).encode()).hexdigest()[:16]
    return {
        "pipeline": pipeline,
        "components": digest,
        "device": f"{device.type}: {device_name}",
        "device_memory": str(device_bytes),
        "budget": f"{round(budget / BUDGET_GRANULARITY) * BUDGET_GRANULARITY}",
        "pinned": str(pin_memory),
        "policies": ",".join(f"{name}={policy}" for name, policy in sorted(policies.items())),
        "torch": torch.__version__.split("+")[0],
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "diffusers_residency": __version__,
    }


def profile_path(folder: Path, key: Mapping[str, str]) -> Path:
    digest = hashlib.sha256(json.dumps(dict(key), sort_keys=True).encode()).hexdigest()[:20]
    return folder / "profiles" / f"{key['pipeline']}-{digest}.json"


def read_profile(path: Path, key: Mapping[str, str]) -> ResidencyProfile | None:
    """The profile at ``path`` if it holds for ``key``. A file that is missing gives None quietly;
    one that cannot be read, is malformed, or was measured for something else (another GPU, budget,
    architecture, dtype or version) gives None with a warning that says which."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        logger.warning("Residency profile %s could not be read (%s); planning without it", path, exc)
        return None
    try:
        data = json.loads(raw.decode())
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, this version reads {FORMAT}")
        stored = {str(k): str(v) for k, v in data["key"].items()}
        shapes = {str(shape): CallFigures.from_json(figures) for shape, figures in data["shapes"].items()}
    # OverflowError: a figure too large for an int (1e400 reads as infinity); RecursionError: arrays
    # nested deeper than the JSON decoder's stack.
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError) as exc:
        logger.warning("Residency profile %s is not a valid profile (%s); ignoring it", path, exc)
        return None
    differ = _differences(stored, key)
    if differ:
        logger.warning("Residency profile %s was measured for another setup (%s); not using it", path, "; ".join(differ))
        return None
    return ResidencyProfile(dict(key), shapes)


def _differences(stored: Mapping[str, str], key: Mapping[str, str]) -> list[str]:
    return [f"{name} {stored.get(name)!r} here {value!r}" for name, value in key.items() if stored.get(name) != value]


# The most recent profiles of the same pipeline class read for what makes them another setup's: a
# cache folder gathers one per budget, GPU and version, and enabling should not read them all.
_OTHER_PROFILES_READ = 16


def _closest_other(file: Path, key: Mapping[str, str]) -> tuple[Path, list[str]] | None:
    """Where ``key`` has no profile of its own (``file``): the profile of the same pipeline class in
    that folder that differs from it the least, and how, for the log to say why it is not used."""
    try:
        # Inside the try: a path the system refuses (a name too long, a folder it may not enter)
        # raises from exists() too, and is told where the profile is read or written.
        if file.exists():
            return None
        others = sorted(file.parent.glob(f"{key['pipeline']}-*.json"), key=lambda path: path.stat().st_mtime)
    except OSError:
        return None
    closest = None
    for path in others[-_OTHER_PROFILES_READ:]:
        try:
            stored = {str(k): str(v) for k, v in json.loads(path.read_bytes())["key"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
            continue  # not told here: a file that is no profile is told where it is read as one
        differ = _differences(stored, key)
        if differ and (closest is None or len(differ) < len(closest[1])):
            closest = (path, differ)
    return closest


def write_profile(path: Path, profile: ResidencyProfile) -> None:
    """Write ``profile`` to ``path`` atomically (a reader sees the old file or the new one, never
    a part), with the shapes the file held when read (ours win where both have one; those it
    dropped are left out). Two processes writing at once can still lose each other's new shapes:
    measured again later."""
    on_disk = read_profile(path, profile.key)
    saved = on_disk.shapes if on_disk else {}
    kept = {shape: figures for shape, figures in saved.items() if shape not in profile.dropped}
    merged = ResidencyProfile(profile.key, {**kept, **profile.shapes})
    path.parent.mkdir(parents=True, exist_ok=True)
    # Readable by others as the umask allows, as any cache file (a profile is shipped with images
    # and shared), where mkstemp would make it private; and made so by the kernel as it is created,
    # not by setting the process's umask, which other threads share.
    temporary = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(descriptor, "w") as file:
            json.dump(merged.as_json(), file, indent=1)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def starting_profile(
    pipeline_class: str,
    modules: Mapping[str, nn.Module],
    budget: int,
    device: torch.device,
    pin_memory: bool,
    policies: Mapping[str, str],
) -> tuple[ResidencyProfile, Path | None]:
    """The residency profile a setup starts from (the one saved in the cache folder, if any, or an
    empty one), and the file it is kept in (None when profiles are turned off)."""
    memory = _device.read_memory_telemetry(device)
    model, total = _device.device_model(device), memory and memory.total
    key = profile_key(pipeline_class, modules, budget, device, model, total, pin_memory, policies)
    folder = cache_folder()
    if folder is None:
        return ResidencyProfile(key), None
    file = profile_path(folder, key)
    saved = read_profile(file, key)
    if saved is not None:
        logger.info("Residency profile %s: call shapes measured before are planned from their first call", file)
    elif (other := _closest_other(file, key)) is not None:
        logger.info("No residency profile for this setup in %s: %s was measured for another one (%s)",
                    file.parent, other[0].name, "; ".join(other[1]))  # fmt: skip
    return saved or ResidencyProfile(key), file
