"""One more pipeline call stamped at every entry into a component, with no profiler: how long each
entry took on the device (events on the compute stream) and on the host (the clock).

A profiled call (see :mod:`.trace`) runs its host several times slower, so a call whose pace the
host sets looks more bound by the host than it is, and its device idles where it would not. SDXL's
UNet at 1024x1024 on an H100 is such a call: its host launches a step in about the time the
device runs it. Stamps cost two event records and two clock reads per entry, and the call runs at
its timed pace. Side by side, a resident and a pinned mode's stamps say where the pinned call's
extra time goes: which of the denoiser's steps, the text encoders, the decode, or the stretches
between components (casts, a release of the allocator's cache, the pipeline's own work).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from diffusers import DiffusionPipeline

from .. import _device
from ..text import text_table
from .trace import component_entries


@dataclass(frozen=True)
class StampedEntry:
    """One entry into a component, not counting entries made inside another's. ``device_ms`` is
    the span between its two stamps on the device's timeline, time the device waited for the host
    (or a copy) in it included: not the time it was busy."""

    component: str
    device_ms: float
    host_ms: float


@dataclass(frozen=True)
class CallPhases:
    """A stamped call: its length on the device and the host's clock, its entries in order, and
    the components whose forward was not stamped (compiled whole; see ``component_entries``)."""

    wall_ms: float
    device_ms: float
    entries: tuple[StampedEntry, ...]
    unstamped: tuple[str, ...] = ()

    def __str__(self) -> str:
        by_component: dict[str, list[StampedEntry]] = {}
        for entry in self.entries:
            by_component.setdefault(entry.component, []).append(entry)
        outside = self.device_ms - sum(entry.device_ms for entry in self.entries)
        lines = [
            (
                f"one call stamped: {self.wall_ms:.1f} ms wall, {self.device_ms:.1f} ms on the device, "
                f"{outside:.1f} ms of it outside any component's entries"
            ),
            *text_table((("component", "entries", "device ms", "host ms"), *_rows(by_component))),
        ]
        for name, entries in by_component.items():
            if len(entries) > 1:
                each = ", ".join(f"{entry.device_ms:.1f}" for entry in entries)
                lines.append(f"{name}, each entry on the device: {each} ms")
        if self.unstamped:
            lines.append(f"compiled whole, so not stamped (counted outside): {', '.join(self.unstamped)}")
        return "\n".join(lines)


def _rows(by_component: dict[str, list[StampedEntry]]) -> list[tuple[str, ...]]:
    return [
        (name, str(len(entries)), f"{sum(e.device_ms for e in entries):.1f}", f"{sum(e.host_ms for e in entries):.1f}")
        for name, entries in by_component.items()
    ]


def stamped_call(pipe: DiffusionPipeline, call: Callable[[], object], device: torch.device) -> CallPhases:
    """Run ``call`` once with a device stamp and a clock reading at each entry into and exit from a
    component (an entry made while another is open counts as part of that one)."""
    stamps: list[tuple[str, torch.Event | float, torch.Event | float, float, float]] = []
    open_entries = 0

    def stamped(method: Callable, name: str) -> Callable:
        def entered(*args, **kwargs):
            nonlocal open_entries
            open_entries += 1
            outermost = open_entries == 1
            if outermost:
                start, started = _device.compute_timestamp(device), time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                open_entries -= 1
                if outermost:
                    stamps.append((name, start, _device.compute_timestamp(device), started, time.perf_counter()))

        return entered

    with component_entries(pipe, stamped) as unstamped:
        _device.synchronize(device)
        # The clock is read before the stamp and after the one that ends the call, so that the
        # wall time holds the device's: on the CPU both are the clock, nanoseconds apart.
        started, began = time.perf_counter(), _device.compute_timestamp(device)
        call()
        ended = _device.compute_timestamp(device)
        _device.synchronize(device)
        wall_ms = (time.perf_counter() - started) * 1000
    entries = tuple(
        StampedEntry(name, _device.seconds_between(start, end) * 1000, (host_end - host_start) * 1000)
        for name, start, end, host_start, host_end in stamps
    )
    return CallPhases(wall_ms, _device.seconds_between(began, ended) * 1000, entries, unstamped)
