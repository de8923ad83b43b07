"""The allocator settings the package switches around the loads it keeps (see
``_device.segments_of_their_own``): which loads, and the settings string it switches to and back."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from diffusers_residency import _device, sleep, wake_up
from diffusers_residency.pipeline import pipeline_state
from diffusers_residency.policy import Policy

from .helpers import RESERVE, PipelineCase, streaming_budget


@pytest.mark.parametrize(
    ("settings", "switched"),
    [
        ("expandable_segments:True", "expandable_segments:False"),
        (
            "max_split_size_mb:512, expandable_segments:True,garbage_collection_threshold:0.8",
            "max_split_size_mb:512,expandable_segments:False,garbage_collection_threshold:0.8",
        ),
        ("expandable_segments:False", None),
        ("max_split_size_mb:512", None),
        ("", None),
    ],
)
def test_expandable_segments_are_switched_off_with_every_other_setting_kept(settings: str, switched: str | None) -> None:
    assert _device.without_expandable_segments(settings) == switched


def _no_cuda_allocator(monkeypatch: pytest.MonkeyPatch, cached_free: int) -> list[str]:
    """Stand in for the CUDA allocator this machine lacks: its figures (``cached_free`` bytes free in
    its cache) and its setter, which notes each settings string it is given."""
    set_to: list[str] = []
    monkeypatch.setattr(_device, "_set_allocator_settings", set_to.append)
    telemetry = _device.MemoryTelemetry(reserved=(8 << 30) + cached_free, allocated=8 << 30, free=1 << 30, total=80 << 30)
    monkeypatch.setattr(_device, "read_memory_telemetry", lambda device: telemetry)
    return set_to


def test_the_settings_are_switched_back_even_when_the_load_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    set_to = _no_cuda_allocator(monkeypatch, cached_free=0)
    settings = "expandable_segments:True,max_split_size_mb:512"
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: settings, raising=False)
    with pytest.raises(RuntimeError, match="out of memory"):
        with _device.segments_of_their_own(torch.device("cuda", 0)):
            raise RuntimeError("out of memory")
    assert set_to == ["expandable_segments:False,max_split_size_mb:512", settings]
    set_to.clear()
    with _device.segments_of_their_own(torch.device("cpu")):
        pass
    assert set_to == [], "nothing to switch on the CPU"
    set_to = _no_cuda_allocator(monkeypatch, cached_free=1 << 30)
    with _device.segments_of_their_own(torch.device("cuda", 0)):
        pass
    assert set_to == [], "a cache holding free memory is reused, in its expandable segments"
    set_to = _no_cuda_allocator(monkeypatch, cached_free=0)
    settings = "max_split_size_mb:512"
    with _device.segments_of_their_own(torch.device("cuda", 0)):
        pass
    assert set_to == [], "nothing to switch without expandable segments"


def test_a_second_thread_joins_the_switch_and_the_last_to_close_switches_back(monkeypatch: pytest.MonkeyPatch) -> None:
    set_to = _no_cuda_allocator(monkeypatch, cached_free=0)
    settings = "expandable_segments:True"
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: settings, raising=False)
    first, second = (_device.segments_of_their_own(torch.device("cuda", 0)) for _ in range(2))
    first.__enter__()
    settings = "expandable_segments:False"  # as the allocator now reads, switched
    second.__enter__()
    first.__exit__(None, None, None)  # the first thread done, the second still loading
    assert set_to == ["expandable_segments:False"]
    second.__exit__(None, None, None)
    assert set_to == ["expandable_segments:False", "expandable_segments:True"], "switched back once, as it was"


@pytest.mark.parametrize(
    ("environment", "switched"),
    [
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
        ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, True),
        ({"PYTORCH_ALLOC_CONF": "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
        # Which of the two the allocator read depends on the torch version: nothing is switched.
        ({"PYTORCH_ALLOC_CONF": "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, False),
        ({}, False),
    ],
)
def test_without_a_way_to_read_the_settings_back_they_come_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, environment: dict[str, str], switched: bool
) -> None:
    set_to = _no_cuda_allocator(monkeypatch, cached_free=0)
    monkeypatch.delattr(torch._C, "_accelerator_getAllocatorSettings", raising=False)
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with _device.segments_of_their_own(torch.device("cuda", 0)):
        pass
    assert set_to == (["expandable_segments:False", "expandable_segments:True"] if switched else [])


def _loads_noted(monkeypatch: pytest.MonkeyPatch, flux: PipelineCase) -> list[tuple[str, bool]]:
    """Each load of the pipeline's units from here on: (unit, whether it ran in segments of its own)."""
    group = pipeline_state(flux.pipe).group
    inside = [False]
    real = _device.segments_of_their_own

    @contextlib.contextmanager
    def noting(device: torch.device) -> Iterator[None]:
        inside[0] = True
        try:
            with real(device):
                yield
        finally:
            inside[0] = False

    monkeypatch.setattr(_device, "segments_of_their_own", noting)
    loads: list[tuple[str, bool]] = []
    for unit in group.units:
        load = unit.stager.load
        monkeypatch.setattr(unit.stager, "load", lambda *a, _name=unit.name, _load=load, **kw: (loads.append((_name, inside[0])), _load(*a, **kw))[1])
    return loads


def test_a_wake_loads_its_resident_components_in_segments_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    flux = PipelineCase("flux")
    flux.pipe.enable_pinned_offload("cpu", vram_budget=None, components={"transformer": "resident", "text_encoder": "resident"})
    assert torch.equal(flux.run(), flux.reference)
    group = pipeline_state(flux.pipe).group
    resident = {unit.name for unit in group.units if unit.policy is Policy.RESIDENT}
    sleep(flux.pipe)
    loads = _loads_noted(monkeypatch, flux)
    wake_up(flux.pipe)
    assert {name for name, kept in loads if kept} == resident, loads
    assert all(name not in resident for name, kept in loads if not kept), loads
    loads.clear()
    assert torch.equal(flux.run(), flux.reference)
    assert loads and not any(kept for _, kept in loads), "loads within a call keep the expandable segments"


def test_the_resident_units_a_plan_loads_ahead_take_segments_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    flux = PipelineCase("flux")
    flux.pipe.enable_pinned_offload("cpu", vram_budget=streaming_budget(flux), activation_reserve=RESERVE)
    assert torch.equal(flux.run(), flux.reference)
    group = pipeline_state(flux.pipe).group
    assert any(unit.policy is Policy.STREAMED and unit.stream is not None for unit in group.units), "some blocks stream"
    sleep(flux.pipe)
    loads = _loads_noted(monkeypatch, flux)
    for unit in group.units:
        unit.sleep_level = 0  # as if offloaded rather than asleep: the plan's loads, not a wake
    group.load_resident_ahead()
    resident = {unit.name for unit in group.units if unit.policy is Policy.RESIDENT}
    assert loads and all(kept for _, kept in loads) and {name for name, _ in loads} == resident, loads
    assert torch.equal(flux.run(), flux.reference)
