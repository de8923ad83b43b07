"""Offloading modes measured side by side on one pipeline, in one process.

Each mode sets the pipeline up from the same starting point (weights on the host, nothing hooked),
runs warm-up calls, then timed calls, and tears itself down. Outputs are compared bit for bit with
the resident mode's, so a speed figure never hides a wrong pixel.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from diffusers import DiffusionPipeline

from .. import _device
from ..pipeline import disable_pinned_offload, enable_pinned_offload, residency_report

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Mode:
    """How to put a host-resident pipeline under one offloading scheme, and how to undo it."""

    name: str
    setup: Callable[[DiffusionPipeline, torch.device], None]
    teardown: Callable[[DiffusionPipeline], None]


def _resident(pipe: DiffusionPipeline, device: torch.device) -> None:
    pipe.to(device)


def _to_host(pipe: DiffusionPipeline) -> None:
    pipe.to("cpu")


def _model_cpu_offload(pipe: DiffusionPipeline, device: torch.device) -> None:
    pipe.enable_model_cpu_offload(device=device)


def _remove_model_cpu_offload(pipe: DiffusionPipeline) -> None:
    pipe.remove_all_hooks()
    pipe.to("cpu")


def _group_offload_leaf(pipe: DiffusionPipeline, device: torch.device) -> None:
    # Streams are what make it fast; the CPU has none, and diffusers refuses them there.
    stream = _device.is_accelerator(device)
    pipe.enable_group_offload(onload_device=device, offload_type="leaf_level", use_stream=stream)


def _remove_group_offload(pipe: DiffusionPipeline) -> None:
    # diffusers has no public way to remove group offloading; these are the hook names it registers
    # (see diffusers.hooks.group_offloading._maybe_remove_and_reapply_group_offloading).
    from diffusers.hooks import HookRegistry
    from diffusers.hooks.group_offloading import (
        _GROUP_OFFLOADING,
        _LAYER_EXECUTION_TRACKER,
        _LAZY_PREFETCH_GROUP_OFFLOADING,
    )

    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            registry = HookRegistry.check_if_exists_or_initialize(component)
            for name in (_GROUP_OFFLOADING, _LAYER_EXECUTION_TRACKER, _LAZY_PREFETCH_GROUP_OFFLOADING):
                registry.remove_hook(name, recurse=True)
    pipe.to("cpu")


MODES: dict[str, Mode] = {
    "resident": Mode("resident", _resident, _to_host),
    "pinned": Mode("pinned", lambda pipe, device: enable_pinned_offload(pipe, device), disable_pinned_offload),
    "model_cpu_offload": Mode("model_cpu_offload", _model_cpu_offload, _remove_model_cpu_offload),
    "group_offload_leaf": Mode("group_offload_leaf", _group_offload_leaf, _remove_group_offload),
}


@dataclass(frozen=True)
class ModeResult:
    mode: str
    seconds_per_call: float
    peak_allocated_bytes: int | None
    setup_seconds: float
    exact: bool | None
    # Resident set size of the process right after setup: what the mode costs in host memory.
    host_rss_bytes: int | None = None
    loaded_bytes_per_call: int | None = None
    load_gbps: float | None = None
    report: str | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _settle(device: torch.device) -> None:
    gc.collect()
    _device.synchronize(device)
    _device.empty_cache(device)
    if _device.is_accelerator(device):
        torch.accelerator.reset_peak_memory_stats(device)


def host_rss_bytes() -> int | None:
    """The process's resident set size (Linux only)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def _peak_allocated(device: torch.device) -> int | None:
    return int(torch.accelerator.max_memory_allocated(device)) if _device.is_accelerator(device) else None


def run_mode(
    pipe: DiffusionPipeline,
    mode: Mode,
    device: torch.device,
    call: Callable[[], torch.Tensor],
    *,
    warmup: int,
    calls: int,
    reference: torch.Tensor | None,
) -> tuple[ModeResult, torch.Tensor | None]:
    """Set the mode up, run ``warmup`` then ``calls`` timed calls, tear it down; return the figures
    and the first output (the reference for the modes after it when this is the resident mode)."""
    _settle(device)
    started = time.perf_counter()
    try:
        mode.setup(pipe, device)
        _device.synchronize(device)
        setup_seconds = time.perf_counter() - started
        rss = host_rss_bytes()
        first = None
        for _ in range(warmup):
            output = call()
            first = output if first is None else first
        _device.synchronize(device)
        if _device.is_accelerator(device):
            torch.accelerator.reset_peak_memory_stats(device)
        before_loads = _pinned_loads(pipe) if mode.name == "pinned" else None
        timings = []
        for _ in range(calls):
            started = time.perf_counter()
            output = call()
            _device.synchronize(device)
            timings.append(time.perf_counter() - started)
            first = output if first is None else first
        peak = _peak_allocated(device)
        loaded, gbps = _pinned_traffic(pipe, before_loads, calls) if before_loads is not None else (None, None)
        report = str(residency_report(pipe)) if before_loads is not None else None
    except torch.OutOfMemoryError as exc:
        logger.warning("%s ran out of memory: %s", mode.name, exc)
        mode.teardown(pipe)
        return ModeResult(mode.name, float("nan"), _peak_allocated(device), float("nan"), None, error="out of memory"), None
    mode.teardown(pipe)
    exact = None if reference is None else bool(torch.equal(first, reference))
    result = ModeResult(
        mode=mode.name,
        seconds_per_call=sum(timings) / len(timings),
        peak_allocated_bytes=peak,
        setup_seconds=setup_seconds,
        exact=exact,
        host_rss_bytes=rss,
        loaded_bytes_per_call=loaded,
        load_gbps=gbps,
        report=report,
    )
    return result, first


def _pinned_loads(pipe: DiffusionPipeline) -> dict[str, tuple[int, float]]:
    return {c.name: (c.loads, c.load_seconds) for c in residency_report(pipe).components}


def _pinned_traffic(
    pipe: DiffusionPipeline, before: dict[str, tuple[int, float]], calls: int
) -> tuple[int, float | None]:
    """Bytes loaded per timed call and the effective host-to-device rate over those loads."""
    moved = 0
    seconds = 0.0
    for component in residency_report(pipe).components:
        loads, load_seconds = before[component.name]
        moved += (component.loads - loads) * component.staged_bytes
        seconds += component.load_seconds - load_seconds
    return moved // max(calls, 1), (moved / seconds / 1e9 if seconds > 0 else None)
