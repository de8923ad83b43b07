"""Failure paths leave every weight on valid storage and the pipeline usable, its next output exact.

A CPU cannot run out of device memory on demand, so out-of-memory errors are injected at the one
point where device storage is allocated (``_device.allocate_device_storage``).
"""

from __future__ import annotations

import pytest
import torch

from diffusers_residency import _device
from diffusers_residency._device import MemoryTelemetry

from .helpers import PipelineCase, assert_no_meta_or_foreign_device


class OutOfMemoryOnAllocation:
    """Raise torch.OutOfMemoryError on the next ``failures`` allocations for a given component."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, failures: int) -> None:
        self.failures = failures
        self.raised = 0
        self.allocations = 0
        real = _device.allocate_device_storage

        def allocate(nbytes: int, device: torch.device, **kwargs) -> torch.Tensor:
            self.allocations += 1
            if self.raised < self.failures:
                self.raised += 1
                raise torch.OutOfMemoryError("injected: out of device memory")
            return real(nbytes, device, **kwargs)

        monkeypatch.setattr(_device, "allocate_device_storage", allocate)


def test_out_of_memory_on_first_attempt_retries_once(flux: PipelineCase, monkeypatch: pytest.MonkeyPatch) -> None:
    flux.pipe.enable_pinned_offload(device="cpu")
    oom = OutOfMemoryOnAllocation(monkeypatch, failures=1)
    assert torch.equal(flux.run(), flux.reference)
    assert oom.raised == 1
    report = flux.pipe.residency_report()
    assert report["text_encoder"].loads == 1
    assert torch.equal(flux.run(), flux.reference)


def test_out_of_memory_on_both_attempts_raises_and_leaves_masters_bound(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    flux.pipe.enable_pinned_offload(device="cpu")
    flux.run()  # the VAE ends loaded: the failing call must first evict it cleanly
    with monkeypatch.context() as patch:
        oom = OutOfMemoryOnAllocation(patch, failures=2)
        with pytest.raises(torch.OutOfMemoryError):
            flux.run()
        assert oom.raised == 2
    report = flux.pipe.residency_report()
    assert not any(c.loaded for c in report.components)
    assert_no_meta_or_foreign_device(flux.pipe)
    assert torch.equal(flux.run(), flux.reference)
    assert torch.equal(flux.run(), flux.reference)


def test_out_of_memory_after_a_weight_changed_between_calls_keeps_the_change(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    flux.pipe.enable_pinned_offload(device="cpu")
    assert torch.equal(flux.run(), flux.reference)
    # CLIP's final norm; the text encoder is offloaded, and the first to load in the next call.
    norm = [m for m in flux.pipe.text_encoder.modules() if isinstance(m, torch.nn.LayerNorm)][-1]
    norm.weight.data = norm.weight.detach() * 2
    with monkeypatch.context() as patch:
        oom = OutOfMemoryOnAllocation(patch, failures=1)
        changed = flux.run()
        assert oom.raised == 1
    assert not torch.equal(changed, flux.reference)
    flux.pipe.disable_pinned_offload()
    assert torch.equal(flux.run(), changed), "resident, with the same change"


def test_exception_inside_a_forward(flux: PipelineCase, monkeypatch: pytest.MonkeyPatch) -> None:
    flux.pipe.enable_pinned_offload(device="cpu")
    block = flux.pipe.transformer.transformer_blocks[0]
    with monkeypatch.context() as patch:

        def broken(*args, **kwargs):
            raise RuntimeError("injected failure inside the transformer")

        patch.setattr(block, "forward", broken)
        with pytest.raises(RuntimeError, match="injected failure"):
            flux.run()
    assert_no_meta_or_foreign_device(flux.pipe)
    assert torch.equal(flux.run(), flux.reference)


def test_missing_telemetry_releases_at_every_boundary(flux: PipelineCase) -> None:
    flux.pipe.enable_pinned_offload(device="cpu")  # a CPU has no allocator telemetry
    assert torch.equal(flux.run(), flux.reference)
    report = flux.pipe.residency_report()
    # text_encoder -> text_encoder_2 -> transformer -> vae: three boundaries, each released.
    assert sum(c.releases for c in report.components) == 3
    assert sum(c.retains for c in report.components) == 0


def test_retained_cache_within_budget(flux: PipelineCase, monkeypatch: pytest.MonkeyPatch) -> None:
    ample = MemoryTelemetry(reserved=2 * 10**6, allocated=10**6, free=90 * 10**9, total=100 * 10**9)
    monkeypatch.setattr(_device, "read_memory_telemetry", lambda device: ample)
    flux.pipe.enable_pinned_offload(device="cpu", vram_budget=None)  # staged per model_cpu_offload_seq
    assert torch.equal(flux.run(), flux.reference)
    assert torch.equal(flux.run(), flux.reference)
    report = flux.pipe.residency_report()
    assert sum(c.retains for c in report.components) == 7  # 3 boundaries in the first call, 4 in the second
    assert sum(c.releases for c in report.components) == 0
