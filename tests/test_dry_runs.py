"""Needs estimated by dry runs on the meta device: close to what the device was measured to need,
the same with repeated blocks replayed, and a first call planned from them as its denoiser starts,
exact, its denoiser's blocks kept from its first step on and through the decoding."""

from __future__ import annotations

import itertools
import weakref
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL, FluxTransformer2DModel

from diffusers_residency import _device, adaptive, dry_runs
from diffusers_residency.adaptive import DRY_RUN, PipelineResidency
from diffusers_residency.bench.architectures import ARCHITECTURES
from diffusers_residency.bench.builders import call_kwargs, pipeline_output
from diffusers_residency.casts import guessed_casts
from diffusers_residency.components import module_components, offload_sequence
from diffusers_residency.dry_runs import CallDryRuns, DecoderDryRun, ForwardDryRun, dry_run_need, meta_twin
from diffusers_residency.pipeline import pipeline_state
from diffusers_residency.plans import ResidencyPlan
from diffusers_residency.profile import CACHE_VARIABLE, shape_parts

from .helpers import PipelineCase, sdxl_in_float16
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
    replayed = ForwardDryRun(denoiser).need(*inputs[0])
    monkeypatch.setattr(dry_runs, "repeated_blocks", lambda module: [])
    every_block = ForwardDryRun(denoiser).need(*inputs[0])
    assert replayed == every_block > 0


def test_the_decoder_is_estimated_for_the_calls_size_and_in_the_dtype_its_pipeline_decodes_in(flux: PipelineCase) -> None:
    decoder = CallDryRuns.of(flux.pipe, module_components(flux.pipe), offload_sequence(flux.pipe), {}).decoder
    small, large = decoder.need(_parts(32)), decoder.need(_parts(64))
    default = decoder.need({**_parts(32), "height": None, "width": None})
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
    sdxl = sdxl_in_float16()
    decoding = CallDryRuns.of(sdxl.pipe, module_components(sdxl.pipe), offload_sequence(sdxl.pipe), guessed_casts(sdxl.pipe))
    assert decoding.decoder.dtype == torch.float32, "SDXL casts its float16 VAE to float32 to decode"
    as_stored = DecoderDryRun("vae", sdxl.pipe.vae, decoding.decoder.scale_factor, 1024, torch.float16)
    assert decoding.decoder.need(_parts(32)) > 1.8 * as_stored.need(_parts(32))


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
    assert torch.equal(_run(flux), flux.reference)

    first = plans_in_step[0]
    assert {plan.source for plan in plans_in_step} == {DRY_RUN}, "planned before the first step ran"
    margin = int(budget * 0.02)
    assert first.activations["transformer"] == ForwardDryRun(flux.pipe.transformer).need(*inputs[0]) + margin
    assert first.activations["vae"] == state.dry_runs.decoder.need(shape_parts(first.shape)) + margin
    assert first.activations["text_encoder_2"] == 1000 + margin, "the text encoders as measured"
    assert first["transformer"].resident_blocks == frozenset(range(len(blocks))), "room for every block"
    assert [block.stager.loads for block in blocks] == [1] * len(blocks), "each loaded once, in the first step"
    assert loaded_while_decoding and all(loaded_while_decoding), "kept while the decoder ran"
    assert "Dry runs estimate" in caplog.text
    assert state.group.estimate_from_inputs is None, "asked for nothing after the call"
    plan = flux.pipe.residency_plan()
    assert plan.source == "measured" and plan.activations["transformer"] == 1000 + margin
    assert torch.equal(_run(flux), flux.reference)


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


def test_a_call_short_of_memory_under_dry_run_estimates_leaves_its_shape_to_a_measuring_call(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _measured(flux, monkeypatch)
    # The device running out of room in the denoiser's first block, once its plan is in place.
    first_block = state.group.units_of("transformer")[1].module
    hook = first_block.register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(torch.OutOfMemoryError("short")))
    with pytest.raises(torch.OutOfMemoryError):
        _run(flux)
    hook.remove()
    assert state.plan.source == DRY_RUN and state.estimates_failed == {state.plan.shape}
    assert state.group.estimate_from_inputs is None
    sources: list[str] = []
    first_block.register_forward_pre_hook(lambda *_: sources.append(state.plan.source))
    assert torch.equal(_run(flux), flux.reference)
    assert set(sources) == {""}, "measured with the least on the device, no estimate"
    assert flux.pipe.residency_plan().source == "measured"


def test_a_decoder_short_of_memory_under_dry_run_estimates_decodes_again_with_the_rest_off_the_device(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="diffusers_residency")
    state = _measured(flux, monkeypatch)
    # The device running out of room in the decoder, the first time it runs in each call.
    decoding: list[tuple[str, list[str]]] = []
    failed_inputs: list[weakref.ref] = []

    def short_at_first(_: torch.nn.Module, args: tuple) -> None:
        loaded = [unit.name for unit in state.group.units if unit.component != "vae" and unit.stager.loaded]
        decoding.append((state.plan.source, loaded))
        if len(decoding) % 2:
            failed_inputs.append(weakref.ref(args[0]))  # made by the attempt (conv_in's output)
            raise torch.OutOfMemoryError("short")

    freed_first: list[bool] = []
    make_room = adaptive.make_room_to_retry
    monkeypatch.setattr(
        adaptive, "make_room_to_retry", lambda *a: freed_first.append(failed_inputs[0]() is None) or make_room(*a)
    )
    # And the allocator retrying at every switch under the estimate (as a cap it is short under
    # makes it): given up with the estimate, not told.
    retries = itertools.count()
    monkeypatch.setattr(_device, "allocator_retries", lambda device: next(retries) if len(decoding) < 2 else None)
    hook = flux.pipe.vae.decoder.mid_block.register_forward_pre_hook(short_at_first)
    assert torch.equal(_run(flux), flux.reference)
    assert freed_first == [True], "the failed attempt's tensors were let go before the room was made"
    assert next(retries) > 3 and "retried" not in caplog.text
    (source, kept), (retried_under, left) = decoding
    assert source == DRY_RUN and any(name.startswith("transformer.") for name in kept), "blocks kept for the decode"
    assert retried_under == "" and left == [], "decoded again with the least plan, the rest off the device"
    assert "ran out of device memory under the dry runs' estimate" in caplog.text
    assert state.group.make_room_to_retry is None and state.group.estimate_from_inputs is None
    assert flux.pipe.residency_plan().source == "measured", "planned from what the call measured"
    assert state.estimates_failed == {state.plan.shape}

    # Under a measured plan a decoder short of memory is the budget's doing: no room is made, the
    # call fails as it would without pinned offload.
    decoding.clear()
    with pytest.raises(torch.OutOfMemoryError):
        _run(flux)
    assert len(decoding) == 1
    hook.remove()
    assert torch.equal(_run(flux), flux.reference)

    # Short again with all the room made: decoded twice, then the call fails.
    attempts: list[str] = []
    flux.pipe.vae.decoder.mid_block.register_forward_pre_hook(
        lambda *_: attempts.append(state.plan.source) or (_ for _ in ()).throw(torch.OutOfMemoryError("short"))
    )
    with pytest.raises(torch.OutOfMemoryError):
        _run(flux, size=48)  # a new shape, planned from dry runs
    assert attempts == [DRY_RUN, ""]


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
