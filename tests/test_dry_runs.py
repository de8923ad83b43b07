"""Needs estimated by dry runs on the meta device: close to what the device was measured to need,
the same with repeated blocks replayed, and a first call planned from them as its denoiser starts,
exact, its denoiser's blocks kept from its first step on and through the decoding."""

from __future__ import annotations

import itertools
import logging
import operator
import weakref
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, FirstBlockCacheConfig, FluxTransformer2DModel, UNet2DConditionModel
from diffusers.utils import scale_lora_layers, unscale_lora_layers
from torch import nn
from torch.overrides import TorchFunctionMode

from diffusers_residency import (
    BudgetTooSmallError,
    _device,
    adaptive,
    dry_run_plans,
    dry_runs,
    kept_blocks,
    live_bytes,
    replayed_blocks,
)
from diffusers_residency.bench.architectures import ARCHITECTURES
from diffusers_residency.bench.builders import call_kwargs, pipeline_output
from diffusers_residency.call_shapes import shape_parts
from diffusers_residency.casts import guessed_casts
from diffusers_residency.components import module_components, offload_sequence
from diffusers_residency.dry_runs import CallDryRuns, DecoderDryRun, ForwardDryRun, dry_run_need, meta_twin
from diffusers_residency.pipeline import pipeline_state
from diffusers_residency.pipeline_residency import DRY_RUN, PipelineResidency, replan_in_place
from diffusers_residency.planner import PREFETCH_CHOICES
from diffusers_residency.plans import ResidencyPlan
from diffusers_residency.profile import CACHE_VARIABLE

from .helpers import PipelineCase, sdxl_in_float16
from .test_changing_weights import lora_state_dict
from .test_profile import _budget, _measure_on_the_cpu, _run

GB = 10**9


def _full_on_meta(cls: type, name: str, dtype: torch.dtype) -> torch.nn.Module:
    with torch.device("meta"):
        return cls.from_config(ARCHITECTURES["full"][name]).to(dtype)


def _flux_step_inputs(pixels: int) -> dict[str, torch.Tensor]:
    tokens, bf16 = (pixels // 16) ** 2, torch.bfloat16
    return {
        "hidden_states": torch.empty(1, tokens, 64, dtype=bf16, device="meta"),
        "encoder_hidden_states": torch.empty(1, 512, 4096, dtype=bf16, device="meta"),
        "pooled_projections": torch.empty(1, 768, dtype=bf16, device="meta"),
        "timestep": torch.empty(1, dtype=bf16, device="meta"),
        "img_ids": torch.empty(tokens, 3, dtype=bf16, device="meta"),
        "txt_ids": torch.empty(512, 3, dtype=bf16, device="meta"),
        "guidance": torch.empty(1, dtype=bf16, device="meta"),
    }


def _parts(size: int) -> dict:
    return {"height": size, "width": size, "num_images_per_prompt": 1, "batch": 1}


def _measured(case: PipelineCase, monkeypatch: pytest.MonkeyPatch, **options: object) -> PipelineResidency:
    """``case``'s pipeline enabled (with ``options``) under a budget that measures its calls, each
    component measured to need 1000 bytes above the weights (see ``_measure_on_the_cpu``); its state."""
    case.pipe.enable_pinned_offload("cpu", vram_budget=_budget(case), **options)
    _measure_on_the_cpu(case, monkeypatch)
    return pipeline_state(case.pipe)


def test_estimates_of_full_sized_components_cover_what_the_device_was_measured_to_need() -> None:
    # Measured on the H200 at 1024x1024 (docs/measurements.md), the allocator's reserved peak less
    # the weights: run alone, FLUX.1-dev's transformer 0.646 GB a step, its VAE 3.046 GB, SDXL's VAE
    # in float32 (as its pipeline casts it to decode) 5.962 GB; in a measuring call, the
    # transformer 0.764 GB and the VAE 3.21 GB. An estimate may be above (the first call keeps a
    # little more room than it needs), not below (it would be short of room), and not far above.
    transformer = _full_on_meta(FluxTransformer2DModel, "flux_transformer", torch.bfloat16)
    step = ForwardDryRun(transformer).need((), {**_flux_step_inputs(1024), "return_dict": False})
    assert 0.764 * GB <= step <= 1.6 * 0.646 * GB, step
    for name, dtype, channels, measured in (("flux_vae", torch.bfloat16, 16, 3.21), ("sdxl_vae", torch.float32, 4, 5.962)):
        vae = _full_on_meta(AutoencoderKL, name, dtype)
        latents = torch.empty(1, channels, 128, 128, dtype=dtype, device="meta")
        need = dry_run_need(meta_twin(vae), lambda twin: twin.decode(latents, return_dict=False), [latents])
        assert measured * GB <= need <= 1.1 * measured * GB, (name, need)


@pytest.mark.parametrize("kind", ["flux", "sdxl"])
def test_replaying_repeated_blocks_changes_no_estimate(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    case = PipelineCase(kind)
    denoiser = case.pipe.transformer if kind == "flux" else case.pipe.unet
    inputs: list[tuple[tuple, dict]] = []
    denoiser.register_forward_pre_hook(lambda _, args, kwargs: inputs.append((args, kwargs)), with_kwargs=True)
    case.run()
    forward = ForwardDryRun(denoiser)
    # The blocks' layouts were worked out as the dry run was made (at enable): a dry run, at a first
    # call, reads no block's state dict.
    with monkeypatch.context() as patch:
        patch.setattr(torch.nn.Module, "state_dict", lambda *a, **k: pytest.fail("a state dict read in a dry run"))
        replayed = forward.need(*inputs[0])
    monkeypatch.setattr(replayed_blocks, "repeated_blocks", lambda module: [])
    every_block = ForwardDryRun(denoiser).need(*inputs[0])
    assert replayed == every_block > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_vae_is_estimated_wider_only_where_its_pipeline_casts_it_to_decode(dtype: torch.dtype) -> None:
    # SDXL's pipeline upcasts a float16 VAE to float32 to decode; a bfloat16 one decodes as it is.
    case = sdxl_in_float16() if dtype == torch.float16 else PipelineCase("sdxl", dtype=dtype)
    case.pipe.enable_pinned_offload("cpu", vram_budget=_budget(case))
    decoder = pipeline_state(case.pipe).dry_runs.decoder
    vae = case.pipe.vae
    as_stored = DecoderDryRun("vae", vae, decoder.scale_factor, decoder.default_size, dtype).need(_parts(32))
    if dtype == torch.float16:
        widened = 2 * sum(parameter.numel() for parameter in vae.parameters())
        assert decoder.dtype == torch.float32 and decoder.need(_parts(32)) > as_stored + widened
    else:
        assert decoder.dtype == dtype and decoder.need(_parts(32)) == as_stored
    assert torch.equal(case.run(), case.reference)


class _Scaled(torch.nn.Module):
    def forward(self, x: torch.Tensor, factor: object) -> torch.Tensor:
        return x.to(factor, copy=True) if isinstance(factor, torch.dtype) else x * factor


class _ScaledTwice(torch.nn.Module):
    _repeated_blocks = ["_Scaled"]

    def __init__(self, factors: tuple[object, object]) -> None:
        super().__init__()
        self.factors = factors
        self.blocks = torch.nn.ModuleList(_Scaled() for _ in range(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.blocks[0](x, self.factors[0]), self.blocks[1](x, self.factors[1])


# An int8 tensor times True stays int8, times 1.0 (an equal key) is float32; cast to each dtype.
@pytest.mark.parametrize("factors", [(True, 1.0), (torch.int8, torch.float32)])
def test_a_block_replays_only_for_plain_arguments_of_the_same_type_and_value(factors: tuple[object, object]) -> None:
    x = torch.empty(1000, dtype=torch.int8, device="meta")
    need = dry_run_need(_ScaledTwice(factors), lambda twin: twin(x), [x])
    assert need == int((1000 + 1000 + 4000) * dry_runs.ALLOCATOR_FACTOR), "the float32 output counted as float32"


def test_the_decoder_is_estimated_for_the_calls_size_and_in_the_dtype_its_pipeline_decodes_in(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoder = CallDryRuns.of(flux.pipe, module_components(flux.pipe), offload_sequence(flux.pipe), {}).decoder
    # The default size's decode was estimated as the dry runs were made (at enable), not in a call.
    with monkeypatch.context() as patch:
        patch.setattr(dry_runs, "dry_run_need", lambda *a: pytest.fail("a default-size decode estimated in a call"))
        default = decoder.need({**_parts(32), "height": None, "width": None})
    small, large = decoder.need(_parts(32)), decoder.need(_parts(64))
    assert default is not None and default == decoder.need(_parts(decoder.default_size))
    # One side given: SD 1.5 takes its default for both, FLUX for the other; the estimate covers either.
    assert decoder.need({**_parts(32), "width": None}) == default
    larger = 2 * decoder.default_size
    assert decoder.need({**_parts(larger), "width": None}) == decoder.need(_parts(larger))
    assert decoder.need({**_parts(larger), "height": float(larger), "width": None}) is None, "a size it cannot read"
    assert 3.5 * small <= large <= 4 * small, "the decoder's tensors grow with its pixels"
    assert meta_twin(torch.nn.Linear(4, 4)) is None, "no config to build it from"
    for given in ({"num_frames": 5}, {"image": [32, 32]}, {"latents": [1, 16, 16, 64]}):
        assert decoder.need({**_parts(32), **given}) is None, "a call that encodes or conditions is not followed"
    assert decoder.need({**_parts(32), "max_area": 64 * 64}) is None, "sized by its area (FLUX Kontext), not 32x32"
    sdxl = sdxl_in_float16()
    decoding = CallDryRuns.of(sdxl.pipe, module_components(sdxl.pipe), offload_sequence(sdxl.pipe), guessed_casts(sdxl.pipe))
    assert decoding.decoder.dtype == torch.float32, "SDXL casts its float16 VAE to float32 to decode"
    factor = decoding.decoder.scale_factor
    as_stored = DecoderDryRun("vae", sdxl.pipe.vae, factor, 1024, torch.float16)
    assert decoding.decoder.need(_parts(32)) > 1.8 * as_stored.need(_parts(32))
    # Its weights held in float32 while it decodes, two bytes more each than planned; cast a layer
    # at a time (layerwise casting), they are not.
    layerwise = DecoderDryRun("vae", sdxl.pipe.vae, factor, 1024, torch.float32)
    widened = 2 * sum(parameter.numel() for parameter in sdxl.pipe.vae.parameters())
    assert decoding.decoder.need(_parts(32)) == layerwise.need(_parts(32)) + widened


def test_the_dry_runs_made_at_enable_log_no_warning_of_diffusers(flux: PipelineCase) -> None:
    # diffusers' ModelMixin.to warns at every dtype cast; its loggers do not propagate to caplog's.
    from diffusers.utils import logging as diffusers_logging

    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = warnings.append
    diffusers_logging.get_logger("diffusers").addHandler(handler)
    try:
        flux.pipe.enable_pinned_offload("cpu", vram_budget=_budget(flux))
    finally:
        diffusers_logging.get_logger("diffusers").removeHandler(handler)
    assert pipeline_state(flux.pipe).dry_runs is not None
    assert [record.getMessage() for record in warnings] == []


def test_the_decoder_is_estimated_as_its_vae_is_set_to_decode_sliced_or_tiled(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoder = CallDryRuns.of(flux.pipe, module_components(flux.pipe), offload_sequence(flux.pipe), {}).decoder
    two_images = {**_parts(64), "batch": 2}
    whole = decoder.need(two_images)
    vae = flux.pipe.vae
    vae.enable_slicing()  # after the dry run was set up, as a user would
    sliced = decoder.need(two_images)
    assert sliced < 0.6 * whole, "one image at a time"
    vae.enable_tiling()
    vae.tile_sample_min_size, vae.tile_latent_min_size = 16, 8  # tiles smaller than the image
    tiled = decoder.need(two_images)
    assert tiled < 0.5 * sliced, "a tile at a time"
    monkeypatch.setattr(dry_runs, "TILE_BLENDS", ())
    blending = DecoderDryRun("vae", vae, decoder.scale_factor, decoder.default_size, decoder.dtype)
    assert blending.need(two_images) == tiled, "the blends left out of the twin change no estimate"
    vae.tile_sample_min_size, vae.tile_latent_min_size = np.int64(32), np.int64(16)  # sizes of numpy's too
    assert decoder.need(two_images) > tiled, "larger tiles"
    vae.disable_tiling()
    vae.disable_slicing()
    assert decoder.need(two_images) == whole


def test_a_first_call_is_planned_from_dry_runs_as_its_denoiser_starts_and_keeps_its_blocks(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="diffusers_residency")
    state = _measured(flux, monkeypatch)
    budget = state.plan.budget
    blocks = state.group.units_of("transformer")[1:]
    inputs: list[tuple[tuple, dict]] = []
    flux.pipe.transformer.register_forward_pre_hook(lambda _, args, kwargs: inputs.append((args, kwargs)), with_kwargs=True)
    # Read in the first block: the transformer's own forward pre-hooks run before its staging hook.
    plans_in_step: list[ResidencyPlan] = []
    blocks[0].module.register_forward_pre_hook(lambda *_: plans_in_step.append(state.plan))
    loaded_while_decoding: list[bool] = []
    flux.pipe.vae.decoder.register_forward_pre_hook(lambda *_: loaded_while_decoding.extend(b.stager.loaded for b in blocks))
    loads_at_enable = [block.stager.loads for block in blocks]  # blocks timed at enable (see block_timing)
    assert torch.equal(_run(flux), flux.reference)

    first = plans_in_step[0]
    assert {plan.source for plan in plans_in_step} == {DRY_RUN}, "planned before the first step ran"
    margin = int(budget * 0.02)
    assert first.activations["transformer"] == ForwardDryRun(flux.pipe.transformer).need(*inputs[0]) + margin
    assert first.activations["vae"] == state.dry_runs.decoder.need(shape_parts(first.shape)) + margin
    assert first.activations["text_encoder_2"] == 1000 + margin, "the text encoders as measured"
    assert first["transformer"].resident_blocks == frozenset(range(len(blocks))), "room for every block"
    loads_in_call = [block.stager.loads - at_enable for block, at_enable in zip(blocks, loads_at_enable)]
    assert loads_in_call == [1] * len(blocks), "each loaded once, in the first step"
    assert loaded_while_decoding and all(loaded_while_decoding), "kept while the decoder ran"
    assert "Dry runs estimate" in caplog.text
    assert state.group.estimate_from_inputs is None, "asked for nothing after the call"
    plan = flux.pipe.residency_plan()
    assert plan.source == "measured" and plan.activations["transformer"] == 1000 + margin
    assert torch.equal(_run(flux), flux.reference)


def test_a_decoder_that_retried_under_the_dry_runs_estimate_gets_more_than_that_room(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under a cap, a decoder short of the estimate's room makes the allocator retry, and its peak
    # reads what the cap let through: here 1000 bytes, less than the estimate gave it.
    state = _measured(flux, monkeypatch)
    retries = [0]
    monkeypatch.setattr(_device, "allocator_retries", lambda device: retries[0])
    flux.pipe.vae.decoder.register_forward_hook(lambda *_: retries.__setitem__(0, retries[0] + 2))
    estimated: list[int] = []
    flux.pipe.vae.decoder.register_forward_pre_hook(lambda *_: estimated.append(state.plan.activation_bytes_of("vae")))
    assert torch.equal(_run(flux), flux.reference)
    margin = int(state.plan.budget * 0.02)
    room = estimated[0]
    assert room > 1000 + margin, "the estimate gave the decoder more room than its peak read"
    plan = flux.pipe.residency_plan()
    assert plan.source == "measured" and plan.activations["vae"] == room + margin, str(plan)
    assert plan.activations["transformer"] == 1000 + margin, "the others as measured"
    assert torch.equal(_run(flux), flux.reference)


def test_a_first_call_planned_from_dry_runs_plans_its_other_steps_for_the_first_step_it_timed(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # With no step timed, a plan keeps the most resident bytes; the steps after the first one
    # timed (the second: from the third on, on the CPU, whose clock is read as it passes) are
    # planned for that timing, the call still planned from the dry runs, then measured.
    caplog.set_level("INFO", logger="diffusers_residency")
    kwargs = {"steps": 5, "height": 32, "width": 32}
    reference = pipeline_output(flux.pipe, call_kwargs("flux", **kwargs))
    kept_blocks.clear_caches()
    state = _measured(flux, monkeypatch)
    # The choices of resident blocks the call's searches weigh, the transformer's at every window
    # depth its timed plans try, were listed as it was enabled.
    budget, sizes = state.plan.budget, {s.name: s for s in state.plan.sizes}
    listed = kept_blocks.resident_block_choices.cache_info()
    for depth in PREFETCH_CHOICES:
        kept_blocks.resident_block_choices(sizes["transformer"], depth)
    assert kept_blocks.resident_block_choices.cache_info().misses == listed.misses
    blocks = state.group.units_of("transformer")[1:]
    # An estimate that leaves room for some of the transformer's blocks, not all: the largest need,
    # a block's bytes at a time, whose plan keeps fewer than every block.
    margin, smallest = int(budget * 0.02), min(sizes["transformer"].block_bytes)
    measured = {name: 1000 + margin for name in ("text_encoder", "text_encoder_2", "vae")}

    def resident_blocks(need: int) -> int:
        try:
            plan = replan_in_place(state, {**measured, "transformer": need + margin})
        except BudgetTooSmallError:
            return 0
        return len(plan["transformer"].resident_blocks)

    need = next(n for n in range(budget - margin, 0, -smallest) if 0 < resident_blocks(n) < len(blocks))
    monkeypatch.setattr(state.dry_runs.forward, "need", lambda args, kwargs: need)
    plans_in_step: list[ResidencyPlan] = []
    # Read in the second block, its step's first one having entered (and planned, as a pass begins).
    blocks[1].module.register_forward_pre_hook(lambda *_: plans_in_step.append(state.plan))
    assert torch.equal(pipeline_output(flux.pipe, call_kwargs("flux", **kwargs)), reference)

    assert len(plans_in_step) == 5 and {plan.source for plan in plans_in_step} == {DRY_RUN}
    searched = kept_blocks.resident_block_choices.cache_info()
    assert searched.misses == listed.misses and searched.hits > listed.hits
    untimed, timed = plans_in_step[:2], plans_in_step[2:]
    assert all(not plan.timings for plan in untimed), "no step timed before the second ran"
    assert 0 < len(untimed[0]["transformer"].resident_blocks) < len(blocks), str(untimed[0])
    stream = blocks[0].stream
    first_step, _ = stream.step_compute_seconds()
    compute_per_byte = first_step / sum(sizes["transformer"].block_bytes)
    assert all(plan.timings["transformer"].compute_per_byte == compute_per_byte for plan in timed)
    shares = [plan.timings["transformer"].compute_shares for plan in timed]
    assert len(shares[0]) == len(blocks) and sum(shares[0]) == pytest.approx(1) and shares.count(shares[0]) == 3
    assert all(plan.activations == untimed[0].activations for plan in timed), "the estimates planned for, as before"
    assert "timed a step under the dry runs' estimate" in caplog.text
    assert state.group.plan_from_timed_step is None
    assert flux.pipe.residency_plan().source == "measured"
    assert torch.equal(pipeline_output(flux.pipe, call_kwargs("flux", **kwargs)), reference)

    # A new, larger shape is planned from dry runs again, for a step timed in its own call.
    larger = {**kwargs, "height": 48, "width": 48}
    plans_in_step.clear()
    pipeline_output(flux.pipe, call_kwargs("flux", **larger))
    assert plans_in_step[0].source == DRY_RUN and not plans_in_step[0].timings
    stream.step_compute_seconds()  # the steps this call timed, read
    planned_for = plans_in_step[2].timings["transformer"].compute_per_byte * sum(sizes["transformer"].block_bytes)
    second_call_first_step = sum(stream._latest_steps[0])
    assert planned_for == pytest.approx(second_call_first_step, rel=1e-9) and second_call_first_step != first_step


def test_a_first_call_of_sd15_at_its_default_size_is_planned_from_dry_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    # SD 1.5's pipeline has no default_sample_size: its calls default to the UNet's sample size.
    case = PipelineCase("sd15")
    state = _measured(case, monkeypatch)
    budget = state.plan.budget
    decoder = state.dry_runs.decoder
    assert (state.dry_runs.denoiser, decoder.default_size) == ("unet", 16 * case.pipe.vae_scale_factor)
    plans: list[ResidencyPlan] = []
    case.pipe.vae.decoder.register_forward_pre_hook(lambda *_: plans.append(state.plan))
    kwargs = call_kwargs("sd15")
    del kwargs["height"], kwargs["width"]
    assert torch.equal(pipeline_output(case.pipe, kwargs), case.reference), "the reference call's 32x32"
    (plan,) = plans
    assert plan.source == DRY_RUN
    assert plan.activations["vae"] == decoder.need(_parts(32)) + int(budget * 0.02)
    assert case.pipe.residency_plan().source == "measured"


def test_the_default_size_is_the_one_the_pipelines_call_makes_not_one_worked_out_from_its_attributes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # PRX's default_sample_size is in pixels where FLUX's and SDXL's are in latents: times its
    # vae_scale_factor, as for those, it would be that many times too large. SD 1.5's call ignores
    # the attribute (its UNet's sample size sets its default): given one, its call still tells.
    case = PipelineCase("sd15")
    case.pipe.default_sample_size = 64
    state = _measured(case, monkeypatch)
    assert state.dry_runs.default_size == (32, 32), "what check_inputs was given in the default call"
    assert state.dry_runs.decoder.default_size == 32, "not 64 x the VAE's factor"
    kwargs = call_kwargs("sd15")
    del kwargs["height"], kwargs["width"]
    assert torch.equal(pipeline_output(case.pipe, kwargs), case.reference), "the reference call's 32x32"
    assert "height=32 width=32" in case.pipe.residency_plan().shape


@pytest.mark.parametrize(
    "check_inputs",
    [lambda *args, **kwargs: None, operator.itemgetter(0)],  # given no size by name; no signature to read
    ids=["told-nothing", "no-signature"],
)
def test_a_default_call_that_tells_no_size_leaves_the_one_worked_out_from_the_attributes(
    check_inputs: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    # FLUX.2's call hands check_inputs its height and width before filling them in; a call that
    # cannot run on the meta device tells nothing either. Enabling never fails for it.
    case = PipelineCase("sd15")
    case.pipe.check_inputs = check_inputs
    state = _measured(case, monkeypatch)
    assert state.dry_runs.forward.default_size is None
    assert state.dry_runs.default_size == (32, 32) == (state.dry_runs.decoder.default_size,) * 2


@pytest.mark.parametrize("told", [True, False], ids=["size-told", "told-nothing"])
def test_a_decode_of_the_default_call_is_estimated_with_its_output_size_arguments_at_their_defaults(
    flux: PipelineCase, told: bool
) -> None:
    # FLUX Kontext's max_area (1024x1024 by default) sets its output's size from its height and
    # width's aspect: left at its default, a call of the size its default call told is that call.
    # Where the default call told nothing, the size worked out from the attributes is not the one
    # max_area makes, and such a call is not followed.
    from diffusers import FluxKontextPipeline

    kontext = FluxKontextPipeline.from_pipe(flux.pipe)
    if not told:
        kontext.check_inputs = lambda *args, **kwargs: None
    runs = CallDryRuns.of(kontext, module_components(kontext), offload_sequence(kontext), {})
    decoder = runs.decoder
    side = decoder.default_size
    at_default = {"height": side, "width": side, "max_area": 1024**2}
    if told:
        assert runs.default_size == (1024, 1024) and side == 1024, "max_area's, not the attributes' 256"
        assert decoder.default_outputs == {"max_area": 1024**2}
        assert decoder.need(at_default) == decoder.need({}) is not None
        assert decoder.need({**at_default, "max_area": 512**2}) is None, "its size is not its height and width"
        assert decoder.need({**at_default, "height": side // 2, "width": side // 2}) is None
    else:
        assert decoder.default_outputs == {} and decoder.need(at_default) is None


def test_a_denoiser_no_dry_run_can_copy_is_measured_as_before(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="diffusers_residency")
    state = _measured(flux, monkeypatch)
    # As for a transformer with adapters loaded: its tensors are not those its config builds.
    state.dry_runs = replace(state.dry_runs, forward=ForwardDryRun(torch.nn.Linear(4, 4)))
    sources: list[str] = []
    state.group.units_of("transformer")[1].module.register_forward_pre_hook(lambda *_: sources.append(state.plan.source))
    assert torch.equal(_run(flux), flux.reference)
    assert DRY_RUN not in sources and sources[0] == "", "the least on the device, then its first step's plan"
    assert "first step needed" in caplog.text and "Dry runs estimate" not in caplog.text
    assert flux.pipe.residency_plan().source == "measured"


@pytest.mark.parametrize("short_of_memory", [False, True])
def test_a_denoiser_computing_from_float8_storage_is_estimated_in_its_compute_dtype(
    short_of_memory: bool, flux: PipelineCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    transformer = flux.pipe.transformer
    transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    reference = _run(flux)
    state = _measured(flux, monkeypatch)
    assert {tensor.dtype for tensor in state.dry_runs.forward._twin.parameters()} == {torch.float32}
    # A feed-forward layer of the second block running out of memory in its matrix product, the
    # first time under the estimate: cast to float32 by its hook, and not cast back (that happens
    # as its forward returns).
    layer = state.group.units_of("transformer")[2].module.ff.net[0].proj
    sources: list[str] = []
    left_cast_up: list[torch.dtype] = []

    class ShortInTheLayer(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.linear and args[1] is layer.weight:
                sources.append(state.plan.source)
                if short_of_memory and len(sources) == 1:
                    raise torch.OutOfMemoryError("short")
            return func(*args, **(kwargs or {}))

    make_room = dry_run_plans.make_room_to_retry
    monkeypatch.setattr(
        dry_run_plans, "make_room_to_retry", lambda *a: left_cast_up.append(layer.weight.dtype) or make_room(*a)
    )
    with ShortInTheLayer():
        assert torch.equal(_run(flux), reference)
    assert sources[0] == DRY_RUN and (sources[1] == "") == short_of_memory
    assert left_cast_up == ([torch.float32] if short_of_memory else [])
    assert flux.pipe.residency_plan().source == "measured"
    assert torch.equal(_run(flux), reference)
    assert {tensor.dtype for name, tensor in transformer.named_parameters() if ".ff." in name} == {torch.float8_e4m3fn}


def _first_step_inputs(case: PipelineCase) -> tuple[tuple, dict]:
    """The arguments ``case``'s transformer is given in its first step, resident."""
    seen: list[tuple[tuple, dict]] = []
    hook = case.pipe.transformer.register_forward_pre_hook(
        lambda _, args, kwargs: seen.append((args, kwargs)), with_kwargs=True
    )
    _run(case)
    hook.remove()
    return seen[0]


def test_layers_cast_layerwise_are_estimated_holding_a_copy_of_their_weights_as_they_run(flux: PipelineCase) -> None:
    args, kwargs = _first_step_inputs(flux)
    plain = ForwardDryRun(flux.pipe.transformer).need(args, kwargs)
    flux.pipe.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    assert ForwardDryRun(flux.pipe.transformer).need(args, kwargs) > plain, "the compute dtype's copies counted"
    # A VAE under layerwise casting decodes in the dtype it computes in, not its storage dtype.
    flux.pipe.vae.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    decoder = CallDryRuns.of(flux.pipe, module_components(flux.pipe), offload_sequence(flux.pipe), {}).decoder
    assert decoder.dtype == torch.bfloat16 and decoder.need(_parts(32)) is not None


def test_a_denoiser_with_a_dora_adapter_is_measured_as_before(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    # DoRA's forward makes matrices the size of each adapted layer's weights: not estimated.
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_v"], use_dora=True, init_lora_weights=False)
    flux.pipe.transformer.add_adapter(config)
    reference = _run(flux)
    state = _measured(flux, monkeypatch)
    assert state.dry_runs.forward._twin is None
    sources: list[str] = []
    first_block = state.group.units_of("transformer")[1].module
    first_block.register_forward_pre_hook(lambda *_: sources.append(state.plan.source))
    assert torch.equal(_run(flux), reference)
    assert sources[0] == "", "measured with the least on the device"


def test_the_same_inputs_give_the_same_estimated_plan_in_another_pipeline(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    plans = []
    for process in range(2):
        # A cache folder each, as two machines: the second finds no profile of the first.
        monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path / str(process)))
        case = PipelineCase("flux")
        state = _measured(case, monkeypatch)
        case.pipe.vae.decoder.register_forward_pre_hook(lambda *_, state=state: plans.append(state.plan))
        assert torch.equal(case.run(), case.reference)
    assert plans[0].source == DRY_RUN and plans[0].components == plans[1].components
    assert plans[0].activations == plans[1].activations


# Where a component runs out of device memory in the tests below: in the denoiser's first block,
# once its stream has entered it (a pass begun), and in the decoder's middle block.
_SHORT_IN = {
    "transformer": lambda pipe: pipeline_state(pipe).group.units_of("transformer")[1].module.norm1,
    "vae": lambda pipe: pipe.vae.decoder.mid_block,
}


@pytest.mark.parametrize("component", list(_SHORT_IN))
def test_a_component_short_of_memory_under_dry_run_estimates_runs_again_with_the_rest_off_the_device(
    component: str, flux: PipelineCase, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="diffusers_residency")
    larger = _run(flux, size=48)  # resident
    state = _measured(flux, monkeypatch)
    # Each time the block runs: the plan's source and the other components' units on the device.
    attempts: list[tuple[str, list[str]]] = []
    failed_inputs: list[weakref.ref] = []
    shortfalls = [1]  # how many more times it runs out of room

    def short(_: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        loaded = [unit.name for unit in state.group.units if unit.component != component and unit.stager.loaded]
        attempts.append((state.plan.source, loaded))
        if shortfalls[0]:
            shortfalls[0] -= 1
            # Made by the attempt (by its component's first layers).
            failed_inputs.append(weakref.ref((*args, *kwargs.values())[0]))
            raise torch.OutOfMemoryError("short")

    freed_first: list[bool] = []
    make_room = dry_run_plans.make_room_to_retry
    monkeypatch.setattr(
        dry_run_plans, "make_room_to_retry", lambda *a: freed_first.append(failed_inputs[0]() is None) or make_room(*a)
    )
    # And the allocator retrying at every switch under the estimate (as a cap it is short under
    # makes it): given up with the estimate, not told.
    retries = itertools.count()
    monkeypatch.setattr(_device, "allocator_retries", lambda device: next(retries) if len(attempts) < 2 else None)
    _SHORT_IN[component](flux.pipe).register_forward_pre_hook(short, with_kwargs=True)
    assert torch.equal(_run(flux), flux.reference)
    assert freed_first == [True], "the failed attempt's tensors were let go before the room was made"
    assert next(retries) > 3 and "retried" not in caplog.text
    (source, kept), (retried_under, left), *later = attempts
    # Under the estimate the text encoders stay (the denoiser's step), and so do the denoiser's blocks
    # (the decode).
    assert source == DRY_RUN and kept and (component != "vae" or any(name.startswith("transformer.") for name in kept))
    assert retried_under == "" and left == [], "run again with the least plan, the rest off the device"
    assert all(source != DRY_RUN for source, _ in later), "the estimate is given up for the rest of the call"
    assert f"{component!r} ran out of device memory under the estimate for calls of" in caplog.text
    assert state.group.make_room_to_retry is None and state.group.estimate_from_inputs is None
    assert flux.pipe.residency_plan().source == "measured", "planned from what the call measured"
    assert state.estimates_failed == {state.plan.shape}

    # Under a measured plan a component short of memory is the budget's doing: no room is made,
    # the call fails as it would without pinned offload.
    attempts.clear()
    shortfalls[0] = 1
    with pytest.raises(torch.OutOfMemoryError):
        _run(flux)
    assert len(attempts) == 1
    assert torch.equal(_run(flux), flux.reference)

    # Short again with all the room made: run twice, then the call fails, and leaves its shape to
    # a call measured with the least on the device, no estimate.
    attempts.clear()
    shortfalls[0] = 2
    with pytest.raises(torch.OutOfMemoryError):
        _run(flux, size=48)  # a new shape, planned from dry runs
    assert [source for source, _ in attempts] == [DRY_RUN, ""]
    assert len(state.estimates_failed) == 2
    assert state.group.estimate_from_inputs is None and state.group.make_room_to_retry is None
    attempts.clear()
    assert torch.equal(_run(flux, size=48), larger)
    assert {source for source, _ in attempts} == {""}, "measured with the least on the device, no estimate"
    assert flux.pipe.residency_plan().source == "measured"
    assert torch.equal(_run(flux, size=48), larger)


def _short_in_the_second_block(state: PipelineResidency, times: int = 2) -> list[str]:
    """The denoiser's second block running out of device memory the first ``times`` times it
    starts; the plan's source at each start."""
    attempts: list[str] = []

    def short(*_: object) -> None:
        attempts.append(state.plan.source)
        if len(attempts) <= times:
            raise torch.OutOfMemoryError("short")

    state.group.units_of("transformer")[2].module.register_forward_pre_hook(short)
    return attempts


def _with_a_lora(case: PipelineCase) -> dict:
    """``case``'s pipeline with a LoRA on its transformer; the call kwargs that scale it by 0.5."""
    case.pipe.load_lora_weights(lora_state_dict(case), adapter_name="style")
    return _scaled_by_half()


def _scaled_by_half() -> dict:
    return {**call_kwargs("flux"), "joint_attention_kwargs": {"scale": 0.5}}


@pytest.mark.parametrize("kept_by", ["a first block cache", "a lora scale left applied on an error"])
def test_a_step_short_of_memory_that_may_have_changed_state_is_not_run_again(
    kept_by: str, flux: PipelineCase, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if kept_by == "a first block cache":
        # Its hook on the first block keeps that block's output, which a second attempt would read.
        flux.pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.05))
        kwargs = call_kwargs("flux")
    else:
        plain = FluxTransformer2DModel.forward.__wrapped__

        def forward_as_in_diffusers_0_35(self, *args, joint_attention_kwargs=None, **kwargs):
            # The scale applied in place, and undone only when the forward returns.
            attention_kwargs = dict(joint_attention_kwargs or {})
            scale = attention_kwargs.pop("scale", 1.0)
            scale_lora_layers(self, scale)
            output = plain(self, *args, joint_attention_kwargs=attention_kwargs, **kwargs)
            unscale_lora_layers(self, scale)
            return output

        monkeypatch.setattr(FluxTransformer2DModel, "forward", forward_as_in_diffusers_0_35)
    state = _measured(flux, monkeypatch)
    if kept_by != "a first block cache":
        kwargs = _with_a_lora(flux)
    attempts = _short_in_the_second_block(state)
    with pytest.raises(torch.OutOfMemoryError):
        pipeline_output(flux.pipe, kwargs)
    assert attempts == [DRY_RUN], "raised as it came, as before the estimate could be run again"
    assert "'transformer' ran out of device memory under an estimate, and is not run again" in caplog.text
    assert len(state.estimates_failed) == 1 and state.group.make_room_to_retry is None


def test_a_step_with_a_lora_scale_its_forward_undoes_on_an_error_runs_again_exact(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    kwargs = _with_a_lora(flux)
    reference = pipeline_output(flux.pipe, kwargs)
    flux.pipe.unload_lora_weights()
    state = _measured(flux, monkeypatch)
    kwargs = _with_a_lora(flux)  # loaded while enabled: the dry runs' copies are built without it
    attempts = _short_in_the_second_block(state, times=1)
    assert torch.equal(pipeline_output(flux.pipe, kwargs), reference)
    assert attempts[:2] == [DRY_RUN, ""], "run again, under the least plan"


def test_a_denoiser_with_a_lora_loaded_before_enabling_is_estimated_from_its_base_layers(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = pipeline_output(flux.pipe, _with_a_lora(flux))
    state = _measured(flux, monkeypatch)
    twin = state.dry_runs.forward._twin
    assert twin is not None and not any("lora" in name for name, _ in twin.named_parameters())
    sources: list[str] = []
    first_block = state.group.units_of("transformer")[1].module
    first_block.register_forward_pre_hook(lambda *_: sources.append(state.plan.source))
    assert torch.equal(pipeline_output(flux.pipe, _scaled_by_half()), reference)
    assert sources[0] == DRY_RUN
    assert torch.equal(pipeline_output(flux.pipe, _scaled_by_half()), reference)


@pytest.mark.parametrize("short_in_step", [1, 2])
def test_a_denoiser_step_run_again_counts_as_a_first_step_whichever_step_it_was(
    short_in_step: int, flux: PipelineCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = pipeline_output(flux.pipe, call_kwargs("flux", steps=4))
    state = _measured(flux, monkeypatch)
    blocks = [unit.module for unit in state.group.units_of("transformer")[1:]]
    # The first and last blocks' entries, each first one with the blocks its plan keeps staged; the
    # first step's need told as the second step starts (see BudgetWatch.first_pass_ran).
    ran: list[str | tuple[str, int]] = []
    blocks[0].register_forward_pre_hook(lambda *_: ran.append(("first", len(state.plan["transformer"].staged_blocks))))

    def short(*_: object) -> None:
        # Inside the first block, once its stream has entered it (the pass has begun).
        if len([entry for entry in ran if entry[0] == "first"]) == short_in_step and "short" not in ran:
            ran.append("short")
            raise torch.OutOfMemoryError("short")

    blocks[0].norm1.register_forward_pre_hook(short)
    blocks[-1].register_forward_pre_hook(lambda *_: ran.append("last"))
    learn = adaptive.learn_first_step
    monkeypatch.setattr(adaptive, "learn_first_step", lambda *a: ran.append("told") or learn(*a))
    assert torch.equal(pipeline_output(flux.pipe, call_kwargs("flux", steps=4)), reference)
    # Told once, as the step after the one run again starts: from a whole step's need, measured
    # from the room made (not from the pass cut short, nor before the step ran again).
    after = ran[ran.index("short"):]
    assert after.count("told") == 1 and after.index("told") == after.index("last") + 2, ran
    (_, streamed), *after_told = [entry for entry in after[after.index("told") - 1:] if entry[0] == "first"]
    assert streamed == 0 and after_told and all(staged > 0 for _, staged in after_told), "the steps after keep blocks"


def test_a_preview_decoded_again_under_dry_run_estimates_is_exact_and_the_steps_after_the_next_keep_blocks(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    def previewing() -> dict:
        def preview(pipe, step: int, timestep: torch.Tensor, tensors: dict) -> dict:
            if step == 0:  # a preview of the first step's latents, decoded in the call
                latents = pipe._unpack_latents(tensors["latents"], 32, 32, pipe.vae_scale_factor)
                pipe.vae.decode(latents.to(pipe.vae.dtype), return_dict=False)
            return {}

        return {**call_kwargs("flux", steps=5), "callback_on_step_end": preview}

    reference = pipeline_output(flux.pipe, previewing())
    state = _measured(flux, monkeypatch)
    ran: list[tuple[str, str, int]] = []
    first_block = state.group.units_of("transformer")[1].module
    first_block.register_forward_pre_hook(
        lambda *_: ran.append(("step", state.plan.source, len(state.plan["transformer"].staged_blocks)))
    )

    def short_under_the_estimate(*_: object) -> None:
        ran.append(("decode", state.plan.source, 0))
        if state.plan.source == DRY_RUN:
            raise torch.OutOfMemoryError("short")

    flux.pipe.vae.decoder.mid_block.register_forward_pre_hook(short_under_the_estimate)
    assert torch.equal(pipeline_output(flux.pipe, previewing()), reference)
    assert [(what, source) for what, source, _ in ran[:3]] == [("step", DRY_RUN), ("decode", DRY_RUN), ("decode", "")]
    steps = [staged for what, _, staged in ran[3:] if what == "step"]
    # The step after the preview streams every block, as a first step; the steps after it keep blocks.
    assert steps[0] == steps[1] == 0 and all(steps[2:]) and len(steps) == 4, ran


@pytest.mark.parametrize("with_profile", [False, True])
def test_a_first_call_loads_blocks_ahead_in_the_order_the_default_calls_dry_runs_ran_them(
    with_profile: bool, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SDXL's UNet defines its mid block after its up blocks, and its VAE decodes with its decoder's
    blocks alone: from enable on, each streams in the order a call runs it, the first pass of a
    process with a profile or without."""
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path))
    if with_profile:  # an earlier process measured the call and saved its figures
        earlier = PipelineCase("sdxl")
        _measured(earlier, monkeypatch, components={"unet": "streamed", "vae": "streamed"})
        assert torch.equal(earlier.run(), earlier.reference)
        assert pipeline_state(earlier.pipe).profile.shapes, "saved"
    case = PipelineCase("sdxl")
    state = _measured(case, monkeypatch, components={"unet": "streamed", "vae": "streamed"})
    assert (state.profile.first_shape() is not None) == with_profile
    streams = {name: state.group.units_of(name)[1].stream for name in ("unet", "vae")}
    at_enable = {name: stream.order for name, stream in streams.items()}
    definition = {name: tuple(block.name for block in stream.blocks) for name, stream in streams.items()}
    assert all(at_enable[name] != definition[name] for name in streams), "the run order is not definition order"
    ran: dict[str, list[str]] = {name: [] for name in streams}
    for name, stream in streams.items():
        for block in stream.blocks:
            block.module.register_forward_pre_hook(lambda *_, name=name, block=block: ran[name].append(block.name))
    with caplog.at_level(logging.INFO, logger="diffusers_residency.streaming"):
        for _ in range(2):
            assert torch.equal(case.run(), case.reference)
    assert "in an order of its own" not in caplog.text, "the first pass ran in the order expected"
    for name, stream in streams.items():
        assert stream.order == at_enable[name]
        assert tuple(dict.fromkeys(ran[name])) == at_enable[name], name


def test_a_decode_whose_dry_run_stopped_part_way_streams_in_definition_order_until_a_pass_is_seen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The blocks recorded before a dry run failed are no call's order: the decoder's stays
    definition order at enable (the UNet's, run whole, is still the one run), and its first decode
    learns the order as before."""
    twin_of = dry_runs.meta_twin

    def failing_in_the_decoder(module: nn.Module) -> nn.Module | None:
        twin = twin_of(module)
        if isinstance(module, AutoencoderKL):
            twin.decoder.up_blocks[1].register_forward_pre_hook(lambda *_: operator.truediv(1, 0))
        return twin

    monkeypatch.setattr(dry_runs, "meta_twin", failing_in_the_decoder)
    case = PipelineCase("sdxl")
    state = _measured(case, monkeypatch, components={"unet": "streamed", "vae": "streamed"})
    assert state.dry_runs.decoder.need({}) is None and state.dry_runs.decoder.default_blocks.keys, "stopped part way"
    unet, vae = (state.group.units_of(name)[1].stream for name in ("unet", "vae"))
    assert vae.order == tuple(block.name for block in vae.blocks)
    assert unet.order != tuple(block.name for block in unet.blocks)
    for _ in range(2):
        assert torch.equal(case.run(), case.reference)
    assert all(".decoder." in name for name in vae.order), vae.order


def test_an_expected_order_is_ignored_where_it_is_not_of_the_streams_blocks_or_a_pass_was_recorded(
    flux: PipelineCase,
) -> None:
    """An order from a module of other blocks (another count, a position beyond them, another class
    at a position) leaves definition order; a pass recorded leaves its own."""
    flux.pipe.enable_pinned_offload("cpu", components={"transformer": "streamed"}, vram_budget=None)
    stream = pipeline_state(flux.pipe).group.units_of("transformer")[1].stream
    definition, count = stream.order, len(stream.blocks)
    backwards = tuple((at, type(stream.blocks[at].module)) for at in range(count - 1, -1, -1))
    for foreign, blocks in (
        (backwards, count + 1),
        (((count, type(stream.blocks[0].module)),), count),
        (((0, nn.Linear),), count),
    ):
        stream.expect_order(foreign, blocks)
        assert stream.order == definition, foreign
    assert torch.equal(flux.run(), flux.reference)
    stream.expect_order(backwards, count)  # the first pass recorded its own
    assert stream.order == definition
    assert torch.equal(flux.run(), flux.reference)


def test_a_streamed_decoder_decoding_again_learns_the_order_of_a_whole_pass(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _measured(flux, monkeypatch, components={"vae": "streamed"})
    failed: list[str] = []

    def short_once_under_the_estimate(*_: object) -> None:
        if not failed and state.plan.source == DRY_RUN:
            failed.append(state.plan.source)
            raise torch.OutOfMemoryError("short")

    # Part way through the decoder's blocks, the first the stream ever runs.
    flux.pipe.vae.decoder.up_blocks[0].register_forward_pre_hook(short_once_under_the_estimate)
    for _ in range(2):  # the order a first pass recorded is taken as the second starts
        assert torch.equal(_run(flux), flux.reference)
    assert failed == [DRY_RUN]
    blocks = state.group.units_of("vae")[1:]
    decoding = {block.name for block in blocks if ".decoder." in block.name}
    assert set(blocks[0].stream.order) == decoding, "every block the decode ran, not those before the retry"


def test_operations_run_once_per_layout_change_no_estimate(monkeypatch: pytest.MonkeyPatch) -> None:
    # Full-sized SDXL UNet and VAE (on the meta device): an operation seen before on inputs of the
    # same layouts returns tensors of the layouts it made, and every estimate is what running them
    # all gives.
    unet = _full_on_meta(UNet2DConditionModel, "sdxl_unet", torch.float16)
    half = torch.float16
    step = (
        (torch.empty(2, 4, 128, 128, dtype=half, device="meta"), torch.tensor(999.0)),
        {
            "encoder_hidden_states": torch.empty(2, 77, 2048, dtype=half, device="meta"),
            "added_cond_kwargs": {
                "text_embeds": torch.empty(2, 1280, dtype=half, device="meta"),
                "time_ids": torch.empty(2, 6, dtype=half, device="meta"),
            },
            "return_dict": False,
        },
    )
    vae = meta_twin(_full_on_meta(AutoencoderKL, "sdxl_vae", torch.float32))
    latents = torch.empty(1, 4, 128, 128, device="meta")

    def needs() -> tuple[int | None, int | None]:
        decode = dry_run_need(vae, lambda twin: twin.decode(latents, return_dict=False), [latents])
        return ForwardDryRun(unet).need(*step), decode

    runs: list[bool] = []
    layouts = live_bytes._new_tensor_layouts
    monkeypatch.setattr(live_bytes, "_new_tensor_layouts", lambda *a: runs.append(True) or layouts(*a))
    dispatched: list[bool] = []
    dispatch = live_bytes.LiveBytes.__torch_dispatch__
    monkeypatch.setattr(
        live_bytes.LiveBytes, "__torch_dispatch__", lambda *a, **k: dispatched.append(True) or dispatch(*a, **k)
    )
    remembered = needs()
    assert 0 < len(runs) < len(dispatched) / 2, (len(runs), len(dispatched))

    def no_key(value: object) -> None:
        raise live_bytes._NoLayoutKey

    monkeypatch.setattr(live_bytes, "_layout_key", no_key)
    assert remembered == needs()
    assert all(need is not None and need > GB / 2 for need in remembered), remembered


def test_an_operation_returning_a_view_or_a_host_tensor_runs_every_time() -> None:
    # Only new meta tensors filling storages of their own stand in for a run: a view shares its
    # input's storage (counted once), and a tensor on the host has values the code may read.
    weight = torch.empty(4, 4, device="meta")
    counter = live_bytes.LiveBytes([weight])
    with counter:
        views = [weight.t(), weight.t()]
        host = [torch.arange(3), torch.arange(3)]
        made = [weight + 1, weight + 1]
    assert all(view.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr() for view in views)
    assert counter.peak == 2 * 16 * 4 + 2 * 3 * 8  # the views count nothing, the rest once each
    assert host[1].tolist() == [0, 1, 2]
    assert made[0].untyped_storage() is not made[1].untyped_storage()


class _Wrapper(torch.Tensor):
    """A tensor subclass wrapping another, as quantized weights' classes do."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> _Wrapper:
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        unwrap = lambda value: value.inner if isinstance(value, _Wrapper) else value  # noqa: E731
        out = func(*[unwrap(arg) for arg in args], **{name: unwrap(value) for name, value in (kwargs or {}).items()})
        return _Wrapper(out) if isinstance(out, torch.Tensor) else out


def _promoting_scalars() -> list[torch.Tensor]:
    x = torch.empty(1000, dtype=torch.int64, device="meta")
    return [x * 2, x * 2.0, torch.full((10,), 1, device="meta"), torch.full((10,), True, device="meta")]


def _masks_on_the_host() -> list[torch.Tensor]:
    x = torch.empty(8, 1000, device="meta")
    return [x[torch.ones(8, dtype=torch.bool)], x[torch.arange(8) < 4]]


def _default_dtype_changed() -> list[torch.Tensor]:
    first = torch.empty(1000, device="meta")
    torch.set_default_dtype(torch.float64)
    try:
        return [first, torch.empty(1000, device="meta")]
    finally:
        torch.set_default_dtype(torch.float32)


def _subclass_outputs() -> list[torch.Tensor]:
    wrapped = _Wrapper(torch.empty(64, 64, device="meta"))
    return [wrapped + 1, wrapped + 1]


def _nested_on_the_host() -> list[torch.Tensor]:
    nested = torch.nested.nested_tensor([torch.zeros(2, 3), torch.zeros(4, 3)])
    return [nested * 2, nested * 2]


@pytest.mark.parametrize(
    "run", [_promoting_scalars, _masks_on_the_host, _default_dtype_changed, _subclass_outputs, _nested_on_the_host]
)
def test_operations_are_reused_only_where_nothing_but_layouts_shapes_their_outputs(
    run: Callable[[], list[torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # What an operation returns may hang on a scalar's type (1 and 1.0 are equal keys), a host
    # tensor's values, the default dtype, or its inputs' class: each such call runs as it would
    # without reuse, and counts the same bytes.
    def outcome() -> tuple[list[tuple], int]:
        counter = live_bytes.LiveBytes([])
        with counter:
            outputs = run()
        return [(type(out), out.dtype, out.is_nested or tuple(out.shape)) for out in outputs], counter.peak

    reused = outcome()

    def no_key(value: object) -> None:
        raise live_bytes._NoLayoutKey

    monkeypatch.setattr(live_bytes, "_layout_key", no_key)
    assert reused == outcome()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(2, 32, 16, 16), (1, 64, 8), (2, 32, 4, 4, 4), (2, 32, 1, 1), (0, 32, 4, 4)])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("channels_last", [False, True])
def test_a_group_norm_made_directly_has_the_layouts_its_decomposition_makes(
    dtype: torch.dtype, shape: tuple[int, ...], affine: bool, channels_last: bool
) -> None:
    x = torch.empty(shape, dtype=dtype, device="meta")
    if channels_last and len(shape) == 4:
        # Channels last's strides, those of a size-1 dimension too (contiguous all the same).
        strides = torch.empty(shape[0], *shape[2:], shape[1], device="meta").permute(0, 3, 1, 2).stride()
        x = torch.empty_strided(shape, strides, dtype=dtype, device="meta")
    weight = bias = torch.empty(shape[1], dtype=dtype, device="meta") if affine else None
    inner = int(np.prod(shape[2:]))
    args = (x, weight, bias, shape[0], shape[1], inner, 8, 1e-5)
    decomposed = torch.ops.aten.native_group_norm.default(*args)
    counter = live_bytes.LiveBytes([x])
    with counter:
        direct = torch.ops.aten.native_group_norm.default(*args)
    for made, expected in zip(direct, decomposed, strict=True):
        assert (made.shape, made.stride(), made.dtype) == (expected.shape, expected.stride(), expected.dtype)
        assert made.untyped_storage().nbytes() == expected.untyped_storage().nbytes()
    assert counter.peak == sum(out.untyped_storage().nbytes() for out in decomposed)


class _WithTable(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.empty(1000, device="meta"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table[: len(x)] + x  # a view of the buffer, then a new tensor


def test_a_twin_cast_again_has_its_new_buffers_known_as_weights() -> None:
    # A cast makes a module's buffers anew: the weights a dry run knows are listed again.
    twin = _WithTable()
    x = torch.empty(10, device="meta")
    assert dry_run_need(twin, lambda twin: twin(x), [x]) == int(2 * 40 * dry_runs.ALLOCATOR_FACTOR)
    dry_runs._cast(twin, torch.float16)
    x = x.half()
    assert dry_run_need(twin, lambda twin: twin(x), [x]) == int(2 * 20 * dry_runs.ALLOCATOR_FACTOR)
