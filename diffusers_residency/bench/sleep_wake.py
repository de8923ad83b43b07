"""``python -m diffusers_residency.bench.sleep_wake``: sleep and wake, measured against the bus and
against the reference design, in one process.

- the pinned host-to-device rate, measured here with one large copy: the bound a wake is held to;
- level-1 sleep and wake of a resident pipeline (``pipe.sleep()`` / ``pipe.wake_up()``);
- the same done vLLM's way, beside it: every weight copied device-to-host into newly allocated
  pinned memory at each sleep, and copied back at each wake;
- level-2 sleep and wake from the pipeline's own safetensors files, in the page cache;
- switching one device between two pipelines with :class:`AwakeRotation`, giving the cache back
  at each switch (the default) and keeping it (``keep_cache=True``).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from diffusers import DiffusionPipeline

from .. import _device
from ..pipeline import pipeline_state
from ..sleep_mode import AwakeRotation, sleep, wake_up
from ..weights import flat_bytes, module_stored_tensors, module_tensors, storage_bytes
from .builders import build_pipeline

GB = 1e9


def _timed(device: torch.device, action: Callable[[], object]) -> float:
    _device.synchronize(device)
    started = time.perf_counter()
    action()
    _device.synchronize(device)
    return time.perf_counter() - started


def pinned_rate(device: torch.device, nbytes: int = 2**32) -> float:
    """Bytes per second of one large pinned host-to-device copy (best of three)."""
    best = _best_copy_seconds(device, nbytes)
    _device.empty_cache(device)  # the copy's buffers went with the frame that made them
    return nbytes / best


def _best_copy_seconds(device: torch.device, nbytes: int) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=_device.is_accelerator(device))
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return min(_timed(device, lambda: target.copy_(host, non_blocking=True)) for _ in range(3))


def weight_bytes(pipe: DiffusionPipeline) -> int:
    return storage_bytes(module_tensors(c for c in pipe.components.values() if isinstance(c, torch.nn.Module)))


class ReferenceSleep:
    """Level-1 sleep as vLLM's allocator does it: each weight's storage is copied device-to-host into
    newly allocated pinned memory at every sleep, and back into new device memory at every wake."""

    def __init__(self, pipe: DiffusionPipeline, device: torch.device) -> None:
        self.device = device
        self.storages: dict[tuple, list[torch.Tensor]] = {}
        for component in pipe.components.values():
            if isinstance(component, torch.nn.Module):
                for local in module_stored_tensors((component,)):
                    self.storages.setdefault(local.untyped_storage().data_ptr(), []).append(local)

    def _move(self, make: Callable[[int], torch.Tensor]) -> None:
        for tensors in self.storages.values():
            storage = tensors[0].untyped_storage()
            backing = make(storage.nbytes())
            backing.copy_(flat_bytes(storage), non_blocking=True)
            for tensor in tensors:
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=backing.device).set_(
                    backing.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride()
                )

    def sleep(self) -> None:
        pin = _device.is_accelerator(self.device)
        self._move(lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=pin))
        _device.synchronize(self.device)
        _device.empty_cache(self.device)

    def wake(self) -> None:
        self._move(lambda n: torch.empty(n, dtype=torch.uint8, device=self.device))

    def release_host_cache(self) -> None:
        """Give back the pinned memory the sleeps allocated: PyTorch's host allocator keeps freed
        blocks (rounded up to powers of two) for reuse, which would hold FLUX.1-dev's weights in
        host RAM a second time for the rest of the run and starve the level-2 measurement of the
        page cache its files are read from."""
        if not _device.is_accelerator(self.device):
            return
        # torch.accelerator has it from 2.12 on; CUDA builds had it under torch._C before.
        empty_host_cache = getattr(torch.accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
        if empty_host_cache is not None:
            empty_host_cache()


def _best_of_cycles(device: torch.device, cycles: int, *actions: Callable[[], object]) -> list[float]:
    """Run ``actions`` one after the other, ``cycles`` times over: each one's best time."""
    times: list[list[float]] = [[] for _ in actions]
    for _ in range(cycles):
        for action, taken in zip(actions, times):
            taken.append(_timed(device, action))
    return [min(taken) for taken in times]


def _switch_times(
    device: torch.device, rotation: AwakeRotation, cycles: int, after: Callable[[str], object] = lambda name: None
) -> dict[str, list[float]]:
    """Each switch of ``rotation`` to ``sdxl`` and back to ``flux``, ``cycles`` times over, timed;
    ``after`` is called with the name switched to after each."""
    times: dict[str, list[float]] = {"flux": [], "sdxl": []}
    for _ in range(cycles):
        for name in ("sdxl", "flux"):
            times[name].append(_timed(device, lambda: rotation.use(name)))
            after(name)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diffusers_residency.bench.sleep_wake", description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=("tiny", "full"), default="tiny")
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    device = _device.resolve_device(_device.current_accelerator() or "cpu")
    dtype = {"flux": torch.bfloat16, "sdxl": torch.float16}
    rows: list[tuple[str, str, str, str]] = []
    results: dict[str, float] = {}

    def note(key: str, seconds: float, bound: float | None, detail: str) -> None:
        results[key] = seconds
        ratio = "-" if bound is None else f"{seconds / bound:.2f}x bound"
        rows.append((key, f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.3f} s", ratio, detail))
        print(f"  {key}: {rows[-1][1]} ({ratio})", file=sys.stderr, flush=True)

    rate = pinned_rate(device, 2**32 if args.scale == "full" else 2**26)
    results["pinned_h2d_gbps"] = rate / GB
    print(f"pinned host-to-device: {rate / GB:.1f} GB/s; building {args.scale} flux ...", file=sys.stderr, flush=True)
    flux = build_pipeline("flux", args.scale, dtype=dtype["flux"], device=device)
    flux_bytes = weight_bytes(flux)
    bound = flux_bytes / rate

    def held_by_flux() -> int:
        """Device bytes the pipeline holds: the allocator's figure where there is one."""
        if _device.is_accelerator(device):
            return int(torch.accelerator.memory_allocated(device)) - baseline
        return flux.residency_report().device_bytes

    baseline = int(torch.accelerator.memory_allocated(device)) - flux_bytes if _device.is_accelerator(device) else 0
    reference = ReferenceSleep(flux, device)
    ref_sleep, ref_wake = _best_of_cycles(device, 1, reference.sleep, reference.wake)
    reference.release_host_cache()
    note("reference level-1 sleep (D2H into new pinned memory)", ref_sleep, None, "vLLM's way")
    note("reference level-1 wake", ref_wake, bound, f"{flux_bytes / GB:.1f} GB")
    del reference

    first = _timed(device, lambda: sleep(flux))
    note("first level-1 sleep (takes the pinned masters)", first, None, "once per pipeline")
    wake_up(flux)
    held_before = held_by_flux()
    l1_sleep, l1_wake = _best_of_cycles(device, args.cycles, lambda: sleep(flux), lambda: wake_up(flux))
    sleep(flux)
    held_asleep = held_by_flux()
    wake_up(flux)
    note("level-1 sleep", l1_sleep, None, f"device memory held asleep: {100 * held_asleep / held_before:.2f} % of awake")
    # Where a level-1 sleep spends its time: rebinding every tensor, then freeing the cached segments.
    group = pipeline_state(flux).group
    tensors = sum(unit.stager.tensor_count for unit in group.units)
    rebind = _timed(device, lambda: [group.sleep(unit, 1) for unit in group.units])
    segments = torch.accelerator.memory_stats(device).get("segment.all.current", 0) if _device.is_accelerator(device) else 0
    release = _timed(device, lambda: _device.empty_cache(device))
    note("  of which rebinding to the masters", rebind, None, f"{tensors} tensors")
    note("  of which releasing the allocator cache", release, None, f"{segments} segments freed")
    wake_up(flux)
    note("level-1 wake", l1_wake, bound, f"{flux_bytes / GB:.1f} GB at {flux_bytes / l1_wake / GB:.1f} GB/s")
    results["reference_over_ours_sleep"] = ref_sleep / l1_sleep

    print("building sdxl ...", file=sys.stderr, flush=True)
    sdxl = build_pipeline("sdxl", args.scale, dtype=dtype["sdxl"], device=device)
    sdxl_bytes = weight_bytes(sdxl)
    rotation = AwakeRotation({"flux": flux, "sdxl": sdxl})
    cached = {"flux": 0, "sdxl": 0}  # the most a switch left in the allocator's cache

    def note_cached(name: str) -> None:
        memory = _device.read_memory_telemetry(device)
        cached[name] = max(cached[name], memory.cached if memory is not None else 0)

    rotation.use("flux")
    switches = _switch_times(device, rotation, args.cycles, after=note_cached)
    for name, other, nbytes in (("sdxl", "flux", sdxl_bytes), ("flux", "sdxl", flux_bytes)):
        detail = f"{nbytes / GB:.1f} GB; at most {cached[name] / GB:.1f} GB left cached"
        note(f"switch to {name} ({other} sleeps, {name} wakes)", min(switches[name]), nbytes / rate, detail)
    # Where a switch to SDXL spends its time: the steps of rotation.use("sdxl"), timed one by one.
    steps = (
        ("flux's sleep, its memory left in the cache", lambda: sleep(flux, release_cache=False), None),
        ("sdxl's wake into that cache", functools.partial(wake_up, sdxl), sdxl_bytes / rate),
        ("releasing the rest of the cache", lambda: pipeline_state(flux).group.retention.release(reason="switch"), None),
    )
    for label, step, step_bound in steps:
        note(f"  of which {label}", _timed(device, step), step_bound, "one switch")
    rotation.awake = "sdxl"  # what the steps did by hand
    rotation.use("flux")  # as the switches left them, for what follows
    sleep(sdxl)
    sdxl_wake = _timed(device, functools.partial(wake_up, sdxl))
    note("  sdxl's wake alone", sdxl_wake, sdxl_bytes / rate, f"{sdxl_bytes / GB:.1f} GB")
    sleep(sdxl)
    # The same switches keeping the cache (keep_cache=True): each wakes into memory already held.
    rotation.keep_cache = True
    kept = _switch_times(device, rotation, args.cycles)
    reserved = torch.accelerator.memory_reserved(device) if _device.is_accelerator(device) else 0
    for name, other, nbytes in (("sdxl", "flux", sdxl_bytes), ("flux", "sdxl", flux_bytes)):
        detail = f"{nbytes / GB:.1f} GB; {reserved / GB:.1f} GB reserved after these switches"
        note(f"switch to {name}, cache kept (keep_cache=True)", min(kept[name]), nbytes / rate, detail)
    # Level 2 reads FLUX.1-dev's masters back from the page cache into new host memory: SDXL's
    # masters would only take room from both.
    sleep(sdxl)  # asleep already: gives the cache back
    del rotation, sdxl
    gc.collect()

    with tempfile.TemporaryDirectory(dir=".") as directory:
        print("saving flux for level 2 ...", file=sys.stderr, flush=True)
        flux.save_pretrained(directory)
        flux.register_to_config(_name_or_path=directory)
        # A level-2 wake copies from the files and reads the masters back after it returns: the
        # level-1 sleep just after it waits for that read, and the level-1 wake after that shows
        # whether the masters came back as they were.
        l2_sleep, l2_wake, settle, rewake = _best_of_cycles(
            device,
            args.cycles,
            lambda: sleep(flux, level=2),
            lambda: wake_up(flux),
            lambda: sleep(flux),
            lambda: wake_up(flux),
        )
        sleep(flux, level=2)
        mapped = sum(c.mapped_bytes for c in flux.residency_report().components)
        wake_up(flux)
        sleep(flux)
        still_mapped = sum(c.mapped_bytes for c in flux.residency_report().components)
        results["level_2_mapped_bytes"] = mapped
        note("level-2 sleep (checks every byte against the files)", l2_sleep, None, f"{mapped / GB:.1f} GB now mapped from files")
        note("level-2 wake (page cache -> pinned slots -> device)", l2_wake, bound, f"{l2_wake / l1_wake:.1f}x level-1 wake")
        note("  then a level-1 sleep (waits for the masters read back)", settle, None, f"{still_mapped / GB:.1f} GB mapped after it")
        note("  then a level-1 wake", rewake, bound, f"{rewake / l1_wake:.2f}x level-1 wake")

    print(f"\n{args.scale} flux ({flux_bytes / GB:.1f} GB) and sdxl ({sdxl_bytes / GB:.1f} GB), "
          f"pinned host-to-device {rate / GB:.1f} GB/s, best of {args.cycles}\n")
    print("| operation | time | vs bytes / pinned rate | detail |")
    print("| --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
