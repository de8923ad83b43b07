"""The call that measures: fast after the denoiser's first step, and the plan it makes loaded
before the next call needs it."""

from __future__ import annotations

import pytest
import torch

from diffusers_residency import _device
from diffusers_residency.bench.builders import call_kwargs, pipeline_output
from diffusers_residency.dry_runs import CallDryRuns
from diffusers_residency.pipeline import pipeline_state
from diffusers_residency.policy import Policy

from .helpers import PipelineCase
from .test_profile import _budget, _measure_on_the_cpu, _measured_pipeline

STEPS = 4


def _run(case: PipelineCase) -> torch.Tensor:
    return pipeline_output(case.pipe, call_kwargs("flux", steps=STEPS))


def test_after_its_first_step_the_denoiser_of_a_measuring_call_keeps_its_blocks(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="diffusers_residency")
    reference = _run(flux)
    # As for a pipeline whose calls no dry run follows (a video pipeline's).
    monkeypatch.setattr(CallDryRuns, "of", classmethod(lambda cls, *args: None))
    flux.pipe.enable_pinned_offload("cpu", vram_budget=_budget(flux))
    state = pipeline_state(flux.pipe)
    blocks = state.group.units_of("transformer")[1:]
    assert all(block.policy is Policy.STREAMED for block in blocks), "the measuring plan streams every block"
    _measure_on_the_cpu(flux, monkeypatch)
    policies_in_step: list[list[Policy]] = []
    flux.pipe.transformer.register_forward_pre_hook(lambda *_: policies_in_step.append([b.policy for b in blocks]))
    loads = [block.stager.loads for block in blocks]
    moved: list[int] = []  # by the denoiser's steps: read as the VAE starts decoding
    loaded_while_decoding: list[bool] = []

    def decoding(*_: object) -> None:
        moved.extend(block.stager.loads - before for block, before in zip(blocks, loads))
        loaded_while_decoding.extend(block.stager.loaded for block in blocks)

    flux.pipe.vae.decoder.register_forward_pre_hook(decoding)
    assert torch.equal(_run(flux), reference)

    assert policies_in_step[0] == [Policy.STREAMED] * len(blocks)
    assert all(policy is Policy.STAGED for policy in policies_in_step[-1]), "kept from the second step on"
    # Each block moved in the first step (the first ones once more, loaded ahead as it ended),
    # and then stayed: not once per step.
    assert max(moved) <= 2 < STEPS, moved
    assert loaded_while_decoding and not any(loaded_while_decoding), "dropped: the VAE is measured with all the room"
    assert "first step needed" in caplog.text


def test_the_plan_a_measuring_call_makes_is_loaded_as_it_returns(flux: PipelineCase, monkeypatch: pytest.MonkeyPatch) -> None:
    reference = _run(flux)
    flux.pipe.enable_pinned_offload("cpu", vram_budget=_budget(flux))
    _measure_on_the_cpu(flux, monkeypatch)
    assert torch.equal(_run(flux), reference)
    state = pipeline_state(flux.pipe)
    resident = [unit for unit in state.group.units if unit.policy is Policy.RESIDENT]
    assert resident and all(unit.stager.loaded for unit in resident), "loaded before the next call"
    assert not any(unit.stager.loaded for unit in state.group.units if unit.evictable), "the others made room first"
    loads = {unit.name: unit.stager.loads for unit in resident}
    assert torch.equal(_run(flux), reference)
    assert all(unit.stager.loads == loads[unit.name] for unit in resident), "not loaded again"


def test_a_call_of_a_shape_planned_from_a_profile_loads_its_resident_units_before_its_first_component(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, budget = _measured_pipeline(monkeypatch)

    second = PipelineCase("flux")
    second.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    group = pipeline_state(second.pipe).group
    loaded_at_start: list[bool] = []
    second.pipe.text_encoder.register_forward_pre_hook(
        lambda *_: loaded_at_start.append(all(u.stager.loaded for u in group.units if u.policy is Policy.RESIDENT))
    )
    monkeypatch.setattr(_device, "peak_allocated", lambda device: group.loaded_bytes() + 1000)
    assert torch.equal(second.run(), second.reference)
    assert loaded_at_start[0], "every resident unit was loading before the call's first component ran"
