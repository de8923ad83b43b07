"""Residency profiles: figures measured per call shape, kept across pipelines and processes, and
never used for a setup they were not measured for."""

from __future__ import annotations

import inspect
import json
import logging
import multiprocessing
import os
import stat
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from diffusers_residency import (
    _device,
    adaptive,
    components,
    conversions,
    load_residency_profile,
    pipeline_residency,
    residency_profile,
    save_residency_profile,
    sleep,
    wake_up,
)
from diffusers_residency.bench.builders import build_pipeline, call_kwargs, pipeline_output
from diffusers_residency.bench.first_calls import PROFILE_SOURCE, PROFILED_PLAN_SAYS
from diffusers_residency.call_shapes import covering_shape
from diffusers_residency.casts import guessed_casts
from diffusers_residency.components import component_sizes, default_reserve_for, module_components, offload_sequence
from diffusers_residency.dry_runs import CallDryRuns
from diffusers_residency.pipeline import pipeline_state
from diffusers_residency.planner import default_reserve, plan_residency
from diffusers_residency.plans import BudgetTooSmallError, ComponentPlan, ComponentSizes, ResidencyPlan
from diffusers_residency.policy import Policy
from diffusers_residency.profile import (
    FORMAT,
    CallFigures,
    ResidencyProfile,
    profile_path,
    read_profile,
    write_profile,
)
from diffusers_residency.step_timing import StepTiming

from .helpers import (
    PipelineCase,
    assert_warmed_once_per_layout,
    dtypes_compared,
    record_block_runs,
    sdxl_in_float16,
    vae_through_bfloat16,
)

MB = 10**6


def _budget(case: PipelineCase, whole: tuple[str, ...] = ()) -> int:
    """A budget under which the tiny pipeline cannot keep everything with the default reserve, so
    its calls are measured: the weights of the least plan (with the components ``whole`` staged
    whole) plus 3 GiB."""
    sizes = component_sizes(case.pipe, module_components(case.pipe))
    sizes = [replace(s, block_bytes=()) if s.name in whole else s for s in sizes]
    least = plan_residency(sizes, 10**12, 3 << 30, least=True)
    return least.peak_weight_bytes + (3 << 30)


def _measure_on_the_cpu(case: PipelineCase, monkeypatch: pytest.MonkeyPatch, need: int = 1000) -> None:
    """The CPU reports no peak: the one a CUDA allocator would, each component needing ``need``
    bytes above what is loaded (read as the next one starts, or as the call returns)."""
    monkeypatch.setattr(_device, "peak_allocated", lambda device: pipeline_state(case.pipe).group.loaded_bytes() + need)


def _run(case: PipelineCase, size: int = 32) -> torch.Tensor:
    return pipeline_output(case.pipe, call_kwargs("flux", height=size, width=size))


def _measured_calls(case: PipelineCase) -> list[bool]:
    """Per call of ``case.pipe`` from now on, whether it was a measuring call (the least on the device)."""
    state = pipeline_state(case.pipe)
    measuring: list[bool] = []
    case.pipe.text_encoder.register_forward_pre_hook(lambda *_: measuring.append(state.group.measures_next_call))
    return measuring


def _flux() -> PipelineCase:
    return PipelineCase("flux")


def _measured_pipeline(
    monkeypatch: pytest.MonkeyPatch, whole: tuple[str, ...] = (), made: Callable[[], PipelineCase] = _flux
) -> tuple[PipelineCase, int]:
    """A tiny pipeline (FLUX unless ``made`` makes another) enabled under a budget that measures its
    calls (see :func:`_budget`), after its first (measuring) call, exact; and that budget."""
    case = made()
    budget = _budget(case, whole)
    case.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    _measure_on_the_cpu(case, monkeypatch)
    assert torch.equal(case.run(), case.reference)
    return case, budget


def test_a_new_pipeline_with_a_saved_profile_plans_its_first_call_from_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # Room beside the reserve for the text encoders whole, which a measuring call streams.
    first, budget = _measured_pipeline(monkeypatch, whole=("text_encoder", "text_encoder_2"))
    learned = first.pipe.residency_plan()
    assert learned.source == "measured" and learned["transformer"].resident_blocks, str(learned)
    profile = residency_profile(first.pipe)
    assert list(profile.shapes) == [learned.shape] and "1 call shape(s)" in str(profile)

    assert profile.shapes[learned.shape].plan == learned.components, "the plan is kept with its figures"

    second = PipelineCase("flux")  # built and loaded the same way: what a new process would hold
    # The plan kept is handed to the planner, to be taken as it is (see the planner's own test).
    handed = []
    real = components.plan_residency
    monkeypatch.setattr(components, "plan_residency", lambda *a, **kw: handed.append(kw.get("chosen")) or real(*a, **kw))
    runs = record_block_runs(monkeypatch)
    second.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    assert_warmed_once_per_layout(runs, second.pipe)  # and left offloaded (below)
    # Planned as enabled, before any call, and what the plan keeps resident is loaded then.
    planned = second.pipe.residency_plan()
    assert handed[-1] == learned.components
    # The source and the text the benchmark tells a run planned from a profile by.
    assert planned.source == PROFILE_SOURCE and PROFILED_PLAN_SAYS in str(planned)
    assert planned.activations == learned.activations
    group = pipeline_state(second.pipe).group
    # The text encoders that the first pipeline streamed, because its estimate at enable had no room
    # to stage them (see the next test) and its measuring call hooked them by blocks, and which its
    # figures keep whole, are hooked whole now; the VAE, which decodes the
    # latents (a larger image needs more room), is not, and keeps the plan learned, as the rest does.
    streamed = {p.name for p in learned.components if p.policy is Policy.STREAMED}
    whole = {p.name for p in planned.components if p.name in streamed and p.policy is not Policy.STREAMED}
    assert whole and whole == {"text_encoder", "text_encoder_2"} & streamed, (str(learned), str(planned))
    assert all(len(group.units_of(name)) == 1 for name in whole) and "vae" in streamed
    assert all(planned[p.name] == p for p in learned.components if p.name not in whole)
    resident = [unit for unit in group.units if unit.policy is Policy.RESIDENT]
    assert resident and all(unit.stager.loaded for unit in resident)
    assert not any(unit.stager.loaded for unit in group.units if unit.policy is not Policy.RESIDENT)
    measuring = _measured_calls(second)
    handed.clear()
    assert torch.equal(second.run(), second.reference)
    monkeypatch.setattr(components, "plan_residency", real)
    assert measuring == [False], "no measuring call"
    assert handed == [], "the first call, of the shape planned for, plans nothing"
    assert second.pipe.residency_plan() is planned
    # Enabled again as it is, it keeps its setup, masters included, and its hooks.
    setup = pipeline_state(second.pipe)
    second.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    assert pipeline_state(second.pipe) is setup and all(len(group.units_of(name)) == 1 for name in whole)
    # Its weights now on masters and device copies, it still finds its profile: no measuring call.
    assert residency_profile(second.pipe).key == profile.key
    measuring = _measured_calls(second)
    assert torch.equal(second.run(), second.reference)
    assert measuring == [False]
    # A policy given now is the one it gets, whatever was hooked whole before.
    second.pipe.enable_pinned_offload("cpu", vram_budget=budget, components={"text_encoder_2": "streamed"})
    assert second.pipe.residency_plan()["text_encoder_2"].policy is Policy.STREAMED
    assert torch.equal(second.run(), second.reference)

    third = PipelineCase("flux")  # another budget: the profile is not for it
    third.pipe.enable_pinned_offload("cpu", vram_budget=budget - (512 << 20))
    measuring = _measured_calls(third)
    assert torch.equal(third.run(), third.reference)
    assert measuring == [True]

    # A budget a few megabytes off ("auto" moves so between processes) shares the profile (its
    # budget is keyed to 256 MiB). (Here the 4 MiB less leave no room beside the reserve for the
    # second text encoder whole: hooked by blocks, it streams, and the plan kept is made again.)
    fourth = PipelineCase("flux")
    fourth.pipe.enable_pinned_offload("cpu", vram_budget=budget - (4 << 20))
    measuring = _measured_calls(fourth)
    assert torch.equal(fourth.run(), fourth.reference)
    kept = fourth.pipe.residency_plan()
    assert measuring == [False] and kept.source == "from the residency profile"
    assert kept.activations == learned.activations and kept["text_encoder_2"].policy is Policy.STREAMED


def test_with_no_profile_the_encoders_an_estimate_stages_are_hooked_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """A first process has no figures, but dry runs estimate its decoder at the default size: the
    encoders the plan for that estimate stages are hooked whole from the first process on, as a
    process with a profile hooks them (streamed, their blocks would load one by one at every call);
    its calls are exact and, once measured, it stages them. An encoder whose whole that plan
    streams stays hooked by blocks."""
    case = PipelineCase("sdxl")
    budget = _budget(case)
    case.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    state = pipeline_state(case.pipe)
    assert state.profile is not None and state.profile.first_shape() is None, "no profile"
    group = state.group
    encoders = ("text_encoder", "text_encoder_2")
    assert state.hooked_whole == encoders and all(len(group.units_of(name)) == 1 for name in encoders)
    assert all(len(group.units_of(name)) > 1 for name in ("unet", "vae")), "models stay hooked by blocks"
    _measure_on_the_cpu(case, monkeypatch)
    for _ in range(2):
        assert torch.equal(case.run(), case.reference)
    plan = case.pipe.residency_plan()
    assert plan.source == "measured" and all(plan[name].policy is not Policy.STREAMED for name in encoders), str(plan)

    # Not every encoder: FLUX's T5 encoder, whole, takes more room than the estimate's plan leaves
    # it, and is hooked by blocks.
    flux = PipelineCase("flux")
    flux.pipe.enable_pinned_offload("cpu", vram_budget=_budget(flux))
    state = pipeline_state(flux.pipe)
    assert "text_encoder_2" not in state.hooked_whole and len(state.group.units_of("text_encoder_2")) > 1
    assert torch.equal(flux.run(), flux.reference)


def test_casts_calls_make_and_undo_are_made_as_a_pipeline_is_enabled_from_its_profile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SDXL in float16 casts its VAE to float32 to decode, and back, in every call. The profile keeps
    those casts, and a pipeline enabled from it makes them before its first call: that call
    converts nothing, as later calls do, and gives what resident gives."""
    first, budget = _measured_pipeline(monkeypatch, made=sdxl_in_float16)
    (figures,) = residency_profile(first.pipe).shapes.values()
    assert figures.casts == {"vae": (torch.float32, torch.float16)}

    second = sdxl_in_float16()
    second.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    assert second.pipe.vae.dtype == torch.float16, "cast back, as calls leave it"
    vae = second.pipe.residency_report()["vae"]
    assert vae.pageable_bytes == 4 * vae.weight_bytes, "float16 and float32 masters, and the float16 ones' copy"
    compared = dtypes_compared(monkeypatch)
    assert torch.equal(second.run(), second.reference)
    assert compared and set(compared) == {torch.uint8}, "the float16 masters' bytes alone: nothing converted"

    # Without a profile, the casts guessed from the pipeline's code are made all the same.
    third = sdxl_in_float16()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DIFFUSERS_RESIDENCY_NO_PROFILES", "1")
        third.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    assert residency_profile(third.pipe).shapes == {}
    assert third.pipe.residency_report()["vae"].pageable_bytes == 4 * vae.weight_bytes
    compared.clear()
    assert torch.equal(third.run(), third.reference)
    assert compared and set(compared) == {torch.uint8}


def test_guessed_casts_are_those_of_pipelines_that_upcast_a_float16_vae_asking_for_it() -> None:
    """SDXL's pipeline reads its VAE's ``force_upcast``; SD3's VAE asks for it too, but its pipeline
    never reads it, and upcasting it at enable would only take host memory."""
    sdxl, sd3 = sdxl_in_float16(), PipelineCase("sd3", dtype=torch.float16)
    assert sd3.pipe.vae.config.force_upcast
    assert guessed_casts(sdxl.pipe) == {"vae": (torch.float32, torch.float16)}
    assert guessed_casts(sd3.pipe) == {}
    sdxl.pipe.vae.register_to_config(force_upcast=False)
    assert guessed_casts(sdxl.pipe) == {}
    sd3.pipe.enable_pinned_offload("cpu", vram_budget=_budget(sd3))
    vae = sd3.pipe.residency_report()["vae"]
    assert vae.pageable_bytes == vae.weight_bytes, "nothing cast at enable"
    # A float32 SDXL's pipeline never upcasts: the guess is there, the cast is not made.
    in_float32 = PipelineCase("sdxl")
    assert guessed_casts(in_float32.pipe) == {"vae": (torch.float32, torch.float16)}
    in_float32.pipe.enable_pinned_offload("cpu", vram_budget=_budget(in_float32))
    vae = in_float32.pipe.residency_report()["vae"]
    assert vae.pageable_bytes == vae.weight_bytes, "not float16: nothing cast at enable"
    assert torch.equal(in_float32.run(), in_float32.reference)


@pytest.mark.parametrize("budget", ["a budget", "no budget"])
def test_casts_guessed_at_enable_are_let_go_after_a_call_that_does_not_make_them(
    budget: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A pipeline returning latents never decodes: the float32 masters made at enable for a decode
    would take host memory for good. The first call that does not cast the VAE lets them go; a
    later call that decodes makes them again, and gives what resident gives. Enabled again after
    calls, the round trip kept from them is not made once more."""
    case = sdxl_in_float16()
    case.pipe.enable_pinned_offload("cpu", vram_budget=_budget(case) if budget == "a budget" else None)
    vae = case.pipe.residency_report()["vae"]
    assert vae.pageable_bytes == 4 * vae.weight_bytes
    pipeline_output(case.pipe, {**call_kwargs("sdxl", "tiny"), "output_type": "latent"})
    assert case.pipe.residency_report()["vae"].pageable_bytes == vae.weight_bytes, "let go"
    assert torch.equal(case.run(), case.reference)
    assert case.pipe.residency_report()["vae"].pageable_bytes == 4 * vae.weight_bytes, "made by the call"
    pipeline_output(case.pipe, {**call_kwargs("sdxl", "tiny"), "output_type": "latent"})
    assert case.pipe.residency_report()["vae"].pageable_bytes == 4 * vae.weight_bytes, "made by a call: kept"

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="diffusers_residency.casts"):
        case.pipe.enable_pinned_offload("cpu", vram_budget=_budget(case) if budget == "a budget" else None)
    assert "Casting 'vae'" not in caplog.text, "kept from the calls before"
    assert torch.equal(case.run(), case.reference)


def test_a_profile_loaded_by_hand_makes_its_casts_but_not_for_a_component_asleep(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pipeline whose casts of its VAE are not guessed (its config does not ask for them) that a
    step callback casts up and back: the profile keeps the round trip, and loading it makes it."""

    def kwargs() -> dict:  # a fresh generator each call
        return {**call_kwargs("sdxl", "tiny"), "callback_on_step_end": _vae_up_and_back}

    def build() -> PipelineCase:
        case = sdxl_in_float16()
        case.pipe.vae.register_to_config(force_upcast=False)
        case.reference = pipeline_output(case.pipe, kwargs())
        case.pipe.vae.to(torch.float32)  # ordinary tensors again (see sdxl_in_float16)
        case.pipe.vae.to(torch.float16)
        return case

    first = build()
    budget = _budget(first)
    first.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    _measure_on_the_cpu(first, monkeypatch)
    assert torch.equal(pipeline_output(first.pipe, kwargs()), first.reference)
    (figures,) = residency_profile(first.pipe).shapes.values()
    assert figures.casts == {"vae": (torch.float32, torch.float16)}
    file = pipeline_state(first.pipe).profile_file

    second = build()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DIFFUSERS_RESIDENCY_NO_PROFILES", "1")
        second.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    vae = second.pipe.residency_report()["vae"]
    assert vae.pageable_bytes == vae.weight_bytes, "not guessed: nothing cast at enable"
    sleep(second.pipe)
    assert load_residency_profile(second.pipe, file)
    assert second.pipe.residency_report()["vae"].pageable_bytes == vae.weight_bytes, "asleep: not cast"
    wake_up(second.pipe)
    assert load_residency_profile(second.pipe, file)
    assert second.pipe.residency_report()["vae"].pageable_bytes == 4 * vae.weight_bytes
    compared = dtypes_compared(monkeypatch)
    assert torch.equal(pipeline_output(second.pipe, kwargs()), second.reference)
    assert compared and set(compared) == {torch.uint8}, "the float16 masters' bytes alone: nothing converted"


def _vae_up_and_back(pipe, step: int, timestep, callback_kwargs: dict) -> dict:
    if step == 0:
        pipe.vae.to(dtype=torch.float32)
        pipe.vae.to(dtype=torch.float16)
    return callback_kwargs


def test_a_profile_loaded_inside_a_call_leaves_the_casts_to_that_call(monkeypatch: pytest.MonkeyPatch) -> None:
    first, budget = _measured_pipeline(monkeypatch, made=sdxl_in_float16)
    file = pipeline_state(first.pipe).profile_file

    second = sdxl_in_float16()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DIFFUSERS_RESIDENCY_NO_PROFILES", "1")
        second.pipe.enable_pinned_offload("cpu", vram_budget=budget)

    def loading(pipe, step: int, timestep, callback_kwargs: dict) -> dict:
        if step == 0:
            assert load_residency_profile(pipe, file)
        return callback_kwargs

    loaded = pipeline_output(second.pipe, {**call_kwargs("sdxl", "tiny"), "callback_on_step_end": loading})
    assert torch.equal(loaded, second.reference)
    casts = pipeline_state(second.pipe).group.casts_in_call
    assert casts == {"vae": [torch.float16, torch.float32, torch.float16]}, "the call's own casts alone"


def test_a_call_that_casts_nothing_or_casts_again_leaves_the_round_trip_kept_and_the_file_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    case = sdxl_in_float16()
    case.pipe.enable_pinned_offload("cpu", vram_budget=_budget(case))
    _measure_on_the_cpu(case, monkeypatch)
    for _ in range(2):
        assert torch.equal(case.run(), case.reference)
    writes = []
    real = adaptive.write_profile
    monkeypatch.setattr(adaptive, "write_profile", lambda *a: writes.append(a) or real(*a))

    pipeline_output(case.pipe, {**call_kwargs("sdxl", "tiny"), "output_type": "latent"})
    # Up and back once more, as an img2img call's encode does before its decode.
    pipeline_output(case.pipe, {**call_kwargs("sdxl", "tiny"), "callback_on_step_end": _vae_up_and_back})
    assert torch.equal(case.run(), case.reference)
    (figures,) = residency_profile(case.pipe).shapes.values()
    assert figures.casts == {"vae": (torch.float32, torch.float16)}
    assert writes == [], "the same figures: nothing to write"
    assert pipeline_state(case.pipe).group.casts_in_call == {"vae": [torch.float16, torch.float32, torch.float16]}


def test_a_cast_that_fails_at_enable_is_undone_and_left_to_the_first_call(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The host running out of memory (injected where the masters are converted) while a profile's
    casts are made at enable: the component is cast back, the enable goes on, and the first call
    casts it itself."""
    _, budget = _measured_pipeline(monkeypatch, made=sdxl_in_float16)

    second = sdxl_in_float16()
    real = conversions.ConversionReuse.convert
    going_up: list[object] = []

    def out_of_memory_going_up(self, apply, fn, *, dtype=None, call=None):
        if dtype == torch.float32:
            going_up.append(self)
            if len(going_up) == 3:  # two of the VAE's blocks are in float32 by then
                raise MemoryError("injected: no host memory for the float32 masters")
        return real(self, apply, fn, dtype=dtype, call=call)

    with monkeypatch.context() as patch:
        patch.setattr(conversions.ConversionReuse, "convert", out_of_memory_going_up)
        second.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    assert "Could not cast 'vae' before the first call" in caplog.text
    assert {p.dtype for p in second.pipe.vae.parameters()} == {torch.float16}
    assert torch.equal(second.run(), second.reference)

    # Failing the way back too, it says what to do.
    third = sdxl_in_float16()
    going_up.clear()
    with monkeypatch.context() as patch:
        patch.setattr(conversions.ConversionReuse, "convert", out_of_memory_going_up)
        patch.setattr(third.pipe.vae, "post_quant_conv", _FailsToCastBack(third.pipe.vae.post_quant_conv))
        with pytest.raises(RuntimeError, match=r"pipe.vae.to\(dtype=torch.float16\) before calling the pipeline"):
            third.pipe.enable_pinned_offload("cpu", vram_budget=budget)


class _FailsToCastBack(torch.nn.Module):
    """Wraps a module whose cast to float16 fails, as a cast back would with no host memory left."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def _apply(self, fn, recurse=True):
        if fn(torch.zeros((), dtype=torch.float32)).dtype == torch.float16:
            raise MemoryError("injected: no host memory to cast back")
        return super()._apply(fn, recurse)

    def forward(self, *args):
        return self.inner(*args)


def _float32_inside(case: PipelineCase) -> PipelineCase:
    """``case`` with one of its VAE's weights kept in float32, as ``_keep_in_fp32_modules`` keeps some."""
    case.pipe.vae.post_quant_conv.to(torch.float32)
    case.reference = case.run()
    case.pipe.vae.post_quant_conv.to(torch.float32)  # the call cast it back with the rest
    return case


_EDITED = {"a profile edited to float8": ["float8_e4m3fn", "float16"], "a profile edited to nothing": []}


@pytest.mark.parametrize("how", ["through bfloat16", "a weight in float32 inside", *_EDITED])
def test_casts_that_would_change_weights_are_not_made_at_enable(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """A round trip through a narrower dtype is not kept; one kept is not made for a component
    whose weights are not all in the dtype it begins in, nor through a dtype that a file names and
    that does not hold every value of it. The first call then makes its own casts, and gives what
    resident gives."""
    build = _float32_inside if how == "a weight in float32 inside" else (lambda case: case)
    first = build(sdxl_in_float16())
    budget = _budget(first)
    first.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    _measure_on_the_cpu(first, monkeypatch)
    kwargs = {**call_kwargs("sdxl", "tiny"), "callback_on_step_end": vae_through_bfloat16}
    pipeline_output(first.pipe, kwargs) if how == "through bfloat16" else first.run()
    (figures,) = residency_profile(first.pipe).shapes.values()
    assert figures.casts == ({} if how == "through bfloat16" else {"vae": (torch.float32, torch.float16)})
    file = pipeline_state(first.pipe).profile_file
    if how in _EDITED:
        data = json.loads(file.read_text())
        (shape,) = data["shapes"].values()
        shape["casts"] = {"vae": _EDITED[how]}
        file.write_text(json.dumps(data))

    second = build(sdxl_in_float16())
    second.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    assert second.pipe.residency_plan().source == "from the residency profile"
    vae = second.pipe.residency_report()["vae"]
    assert vae.pageable_bytes == vae.weight_bytes, "nothing cast at enable"
    assert torch.equal(second.run(), second.reference)


def test_each_call_shape_is_measured_once_and_planned_for_from_then_on(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    references = {size: _run(flux, size) for size in (32, 48)}
    budget = _budget(flux)
    flux.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    needs = {32: 1000, 48: 9000}
    size = [32]
    monkeypatch.setattr(
        _device, "peak_allocated", lambda device: pipeline_state(flux.pipe).group.loaded_bytes() + needs[size[0]]
    )
    measuring = _measured_calls(flux)
    plans = {}
    for size[0] in (32, 48, 32, 48, 48, 32):
        assert torch.equal(_run(flux, size[0]), references[size[0]])
        plans.setdefault(size[0], flux.pipe.residency_plan())
        assert flux.pipe.residency_plan().components == plans[size[0]].components
    assert measuring == [True, True, False, False, False, False], "each shape measured once, the first time"
    margin = int(budget * 0.02)
    assert plans[32].activations["transformer"] == 1000 + margin and plans[48].activations["transformer"] == 9000 + margin
    assert set(residency_profile(flux.pipe).shapes) == {plans[32].shape, plans[48].shape}


def test_policies_given_key_the_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    # A plan kept for a text encoder the caller staged is no plan for a setup that fixes nothing.
    first = PipelineCase("flux")
    budget = _budget(first)
    first.pipe.enable_pinned_offload("cpu", vram_budget=budget, components={"text_encoder": "staged"})
    _measure_on_the_cpu(first, monkeypatch)
    assert torch.equal(first.run(), first.reference)
    assert first.pipe.residency_plan()["text_encoder"].policy is Policy.STAGED
    assert residency_profile(first.pipe).key["policies"] == "text_encoder=staged"

    second = PipelineCase("flux")
    second.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    measuring = _measured_calls(second)
    assert torch.equal(second.run(), second.reference)
    assert measuring == [True], "measured: the profile was for other policies"
    assert residency_profile(second.pipe).key["policies"] == ""


def test_a_profile_saved_and_loaded_explicitly_plans_a_pipeline_with_profiles_turned_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, budget = _measured_pipeline(monkeypatch)
    shipped = tmp_path / "shipped.json"
    save_residency_profile(first.pipe, shipped)

    monkeypatch.setenv("DIFFUSERS_RESIDENCY_NO_PROFILES", "1")
    second = PipelineCase("flux")
    second.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    assert pipeline_state(second.pipe).profile_file is None, "turned off: nothing read or written"
    assert load_residency_profile(second.pipe, shipped)
    measuring = _measured_calls(second)
    assert torch.equal(second.run(), second.reference)
    assert measuring == [False] and second.pipe.residency_plan().source == "from the residency profile"
    with pytest.raises(FileNotFoundError, match="no residency profile"):
        load_residency_profile(second.pipe, tmp_path / "missing.json")


def test_a_profile_measured_for_another_setup_is_refused_and_the_log_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    first, budget = _measured_pipeline(monkeypatch)
    saved = tmp_path / "profile.json"
    save_residency_profile(first.pipe, saved)
    data = json.loads(saved.read_text())
    data["key"]["device"] = "cuda: NVIDIA H200"
    data["key"]["diffusers_residency"] = "0.0.1"
    saved.write_text(json.dumps(data))

    second = PipelineCase("flux")
    second.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    before = dict(residency_profile(second.pipe).shapes)
    assert load_residency_profile(second.pipe, saved) is False
    assert "measured for another setup" in caplog.text and "NVIDIA H200" in caplog.text and "0.0.1" in caplog.text
    assert residency_profile(second.pipe).shapes == before, "nothing taken from it"

    # A component cast to another dtype is another checkpoint as far as its figures go.
    key = dict(residency_profile(second.pipe).key)
    second.pipe.disable_pinned_offload()
    second.pipe.vae.to(torch.float64)
    second.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    assert residency_profile(second.pipe).key["components"] != key["components"]


def test_a_profile_of_another_setup_in_the_cache_folder_is_named_with_what_differs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The file of another setup has a name of its own (a digest of its key): never read as this
    # one's, it is named in the log with how it differs.
    first, budget = _measured_pipeline(monkeypatch)
    own = pipeline_state(first.pipe).profile_file
    data = json.loads(own.read_text())
    data["key"]["torch"] = "2.0.0"
    other = profile_path(own.parent.parent, data["key"])
    other.write_text(json.dumps(data))
    own.unlink()

    second = PipelineCase("flux")
    with caplog.at_level("INFO", logger="diffusers_residency.profile"):
        second.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    said = [r.getMessage() for r in caplog.records if "No residency profile for this setup" in r.getMessage()]
    assert len(said) == 1 and other.name in said[0] and "torch '2.0.0' here" in said[0], said
    assert not residency_profile(second.pipe).shapes, "nothing taken from it"
    caplog.clear()
    second.pipe.disable_pinned_offload()
    with caplog.at_level("INFO", logger="diffusers_residency.profile"):
        first.pipe.disable_pinned_offload()
        # Another budget (one the default reserve leaves measured), whose file was never written.
        first.pipe.enable_pinned_offload("cpu", vram_budget=budget - (512 << 20))
    assert "budget" in caplog.text and "torch '2.0.0' here" in caplog.text, "the closest named: both differ"


def test_the_attention_a_diffusers_model_runs_keys_its_profile() -> None:
    from diffusers.models.attention_processor import AttnProcessor

    case = sdxl_in_float16()
    budget = _budget(case)
    case.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    fused = dict(residency_profile(case.pipe).key)
    case.pipe.disable_pinned_offload()
    case.pipe.unet.set_attn_processor(AttnProcessor())  # the attention matrix held, not fused
    case.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    assert residency_profile(case.pipe).key["components"] != fused["components"]


def test_a_profile_file_is_readable_as_the_umask_allows(tmp_path: Path) -> None:
    for umask, mode in ((0o022, 0o644), (0o077, 0o600)):
        path = tmp_path / f"{umask:o}" / "P.json"
        previous = os.umask(umask)
        try:
            write_profile(path, ResidencyProfile({"pipeline": "P"}, {"s": CallFigures({"vae": 1})}))
        finally:
            os.umask(previous)
        assert stat.S_IMODE(path.stat().st_mode) == mode
        assert [p.name for p in path.parent.iterdir()] == ["P.json"], "no temporary file left behind"


def _with_figures(activation: str = "1000", timing: str = "[1.0, 1.0]") -> bytes:
    """A profile of one shape whose figures are written as given, as JSON text."""
    figures = {"activations": {"vae": 1000}, "timings": {"transformer": 1}, "release_before": [], "retimed": True}
    text = json.dumps({"format": FORMAT, "key": {}, "shapes": {"s": {**figures, "plan": []}}})
    text = text.replace('"vae": 1000', f'"vae": {activation}')
    return text.replace('"transformer": 1', f'"transformer": {timing}').encode()


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        f'{{"format": {FORMAT}, "key": {{}}}}'.encode(),
        b'{"format": 1, "key": {}, "shapes": {}}',
        b'{"format": 99, "key": {}, "shapes": {}}',
        b"\xff\xfe",
        _with_figures(activation="1e400"),  # read as infinity: no int
        _with_figures(activation="-1000"),
        _with_figures(timing="[NaN, 1.0]"),
        _with_figures(timing="[0.0, 1.7e308]"),  # finite, but a step simulated from it is not
        _with_figures(activation=str(10**400)),  # an int, too large to plan with
        b"[" * 100_000,  # deeper than the JSON decoder's stack
        _with_figures(timing='[1e-9, 1e-9, "estimatd"]'),
        _with_figures(timing='[1e-9, 1e-9, "estimated", 1]'),
        _with_figures(timing='"10"'),
        _with_figures(timing="1e-9"),
        _with_figures(timing="[1e-9, 1e-9, [0.5, 1.5]]"),
        _with_figures(timing='[1e-9, 1e-9, [0.5, "0.5"]]'),
        _with_figures(timing='[1e-9, 1e-9, [1.0], "estimated"]'),
        _with_figures(timing="[1e-9, 1e-9, [1.0], [1.0]]"),
        _with_figures(timing="[1e-9, 1e-9, [true, false]]"),
        _with_figures(timing="[1e-9, 1e-9, []]"),
        _with_figures(timing="[1e-9, 1e-9, [0.5, 0.4]]"),
    ],
    ids=["not json", "no shapes", "old format", "new format", "not text", "infinite", "negative", "nan", "huge timing",
         "huge activation", "deep", "misspelt mark", "four items", "a string", "a number", "share over one",
         "share as text", "mark after shares", "shares twice", "shares as flags", "no shares",
         "shares short of one"],  # fmt: skip
)
def test_a_corrupt_profile_is_ignored_with_a_warning_never_a_crash(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, content: bytes
) -> None:
    budget = _budget(flux)
    flux.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    file = pipeline_state(flux.pipe).profile_file
    flux.pipe.disable_pinned_offload()
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_bytes(content)
    flux.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    assert "not a valid profile" in caplog.text or "could not be read" in caplog.text
    _measure_on_the_cpu(flux, monkeypatch)
    measuring = _measured_calls(flux)
    assert torch.equal(flux.run(), flux.reference)
    assert measuring == [True]
    assert read_profile(file, residency_profile(flux.pipe).key).shapes, "replaced by a whole profile once measured"


def test_an_unwritable_cache_folder_warns_once_and_the_calls_go_on(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("DIFFUSERS_RESIDENCY_CACHE", str(blocked))  # a folder cannot be made under a file
    flux.pipe.enable_pinned_offload("cpu", vram_budget=_budget(flux))
    _measure_on_the_cpu(flux, monkeypatch)
    for _ in range(2):
        assert torch.equal(flux.run(), flux.reference)
    assert caplog.text.count("Could not save the residency profile") == 1
    assert residency_profile(flux.pipe).shapes, "still kept for this process"


@pytest.mark.parametrize("folder", ["a" * 300, "~no-such-user-here/cache"], ids=["name too long", "no such home"])
def test_a_cache_folder_the_system_refuses_warns_and_enabling_goes_on(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture, folder: str
) -> None:
    monkeypatch.setenv("DIFFUSERS_RESIDENCY_CACHE", folder if folder.startswith("~") else str(tmp_path / folder))
    flux.pipe.enable_pinned_offload("cpu", vram_budget=_budget(flux))
    assert torch.equal(flux.run(), flux.reference)
    assert "could not be read" in caplog.text or "names no home folder" in caplog.text


def _write_many(path: str, writer: int) -> None:
    key = {"pipeline": "P", "budget": "1"}
    for index in range(30):
        shape = f"writer={writer} call={index}"
        write_profile(Path(path), ResidencyProfile(key, {shape: CallFigures({"vae": index})}))


@pytest.mark.slow
def test_concurrent_writers_leave_one_whole_profile(tmp_path: Path) -> None:
    path = tmp_path / "profiles" / "P.json"
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_write_many, args=(str(path), writer)) for writer in range(3)]
    for process in writers:
        process.start()
    while any(process.is_alive() for process in writers):
        if path.exists():  # every read finds a whole profile: the old one or the new, never a part
            assert read_profile(path, {"pipeline": "P", "budget": "1"}) is not None
    for process in writers:
        process.join(timeout=120)
        assert process.exitcode == 0
    profile = read_profile(path, {"pipeline": "P", "budget": "1"})
    assert profile is not None and profile.shapes, "a whole, valid profile"
    assert {shape.split()[0] for shape in profile.shapes} <= {"writer=0", "writer=1", "writer=2"}
    assert [p.name for p in path.parent.iterdir()] == ["P.json"], "no temporary file left behind"


def test_the_cache_folder_follows_the_variables() -> None:
    from diffusers_residency.profile import cache_folder

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DIFFUSERS_RESIDENCY_CACHE", "/somewhere/else")
        assert cache_folder() == Path("/somewhere/else")
        patch.setenv("DIFFUSERS_RESIDENCY_NO_PROFILES", "1")
        assert cache_folder() is None
        patch.delenv("DIFFUSERS_RESIDENCY_CACHE")
        patch.setenv("DIFFUSERS_RESIDENCY_NO_PROFILES", "0")
        patch.setenv("XDG_CACHE_HOME", "/xdg")
        assert cache_folder() in (Path("/xdg/diffusers_residency"), Path.home() / "Library" / "Caches" / "diffusers_residency")
    assert profile_path(Path("/c"), {"pipeline": "FluxPipeline", "budget": "1"}).parent == Path("/c/profiles")


@pytest.mark.parametrize("budget", ["2GB", 1_500_000])
def test_a_small_budget_for_a_small_pipeline_is_planned_not_refused(flux: PipelineCase, budget: str | int) -> None:
    # The default reserve (3 GiB at least) would leave nothing of these budgets for weights.
    flux.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    plan = flux.pipe.residency_plan()
    assert plan.reserve < plan.budget and plan.peak_bytes <= plan.budget, str(plan)
    for _ in range(2):
        assert torch.equal(flux.run(), flux.reference)


@pytest.mark.slow
def test_sd15_under_its_size_plus_1_gb_is_planned_with_the_room_its_weights_leave_and_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Stable Diffusion 1.5 at its published size, as on a card of its size plus 1 GB (4 GB for its
    # 2.1 GB in float16; float32 here, which the CPU computes fast), called small, so that the
    # test stays short. The CPU reports no peak: each component is taken to need 0.1 GB above the
    # weights, as a device would report it.
    pipe = build_pipeline("sd15", "full", dtype=torch.float32)

    def calls() -> dict:
        return call_kwargs("sd15", "full", steps=2, height=64, width=64)

    reference = pipeline_output(pipe, calls())
    sizes = component_sizes(pipe, module_components(pipe))
    budget = sum(s.nbytes for s in sizes) + 10**9
    with pytest.raises(BudgetTooSmallError):  # the uncapped default reserve leaves no room for weights
        plan_residency(sizes, budget, default_reserve(budget))
    reserve = default_reserve_for(sizes, budget, {})
    assert 10**9 < reserve < budget
    pipe.enable_pinned_offload("cpu", vram_budget=budget)
    monkeypatch.setattr(_device, "peak_allocated", lambda device: pipeline_state(pipe).group.loaded_bytes() + 10**8)
    for _ in range(2):
        assert torch.equal(pipeline_output(pipe, calls()), reference)
    plan = pipe.residency_plan()
    assert plan.source == "measured" and plan.peak_bytes <= budget, str(plan)
    assert plan["unet"].resident_blocks, "room for some of the UNet once its need is measured"


def test_a_call_that_never_runs_whole_leaves_nothing_in_another_shapes_figures(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A call returning latents never decodes: its measurement is not whole, and a call of another
    # shape after it must not inherit what it measured.
    budget = _budget(flux)
    flux.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    need = [50_000]
    monkeypatch.setattr(_device, "peak_allocated", lambda device: pipeline_state(flux.pipe).group.loaded_bytes() + need[0])
    pipeline_output(flux.pipe, {**call_kwargs("flux", height=48, width=48), "output_type": "latent"})
    need[0] = 1000
    with pytest.raises(RuntimeError, match="stop"):
        hook = flux.pipe.vae.decoder.register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("stop")))
        try:
            _run(flux, 32)  # raises in the VAE: measured nothing whole either
        finally:
            hook.remove()
    assert torch.equal(_run(flux, 32), flux.reference)
    margin = int(budget * 0.02)
    figures = residency_profile(flux.pipe).shapes[flux.pipe.residency_plan().shape]
    assert set(figures.activations.values()) == {1000 + margin}, figures


def test_a_call_within_a_call_is_planned_as_the_outer_one(flux: PipelineCase, monkeypatch: pytest.MonkeyPatch) -> None:
    class Subclassed(type(flux.pipe)):
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs)

    flux.pipe.__class__ = Subclassed
    flux.pipe.enable_pinned_offload("cpu", vram_budget=_budget(flux))
    _measure_on_the_cpu(flux, monkeypatch)
    measuring = _measured_calls(flux)
    for _ in range(3):
        assert torch.equal(flux.run(), flux.reference)
    assert measuring == [True, False, False]
    assert "height=32 width=32" in flux.pipe.residency_plan().shape, "read from the outer call's keyword arguments"
    # Given no size, by its parent's arguments: the size its default call makes.
    kwargs = {**call_kwargs("flux", height=32, width=32), "output_type": "latent"}
    del kwargs["height"], kwargs["width"]
    flux.pipe(**kwargs)
    height, width = pipeline_state(flux.pipe).default_size
    assert f"height={height} width={width}" in flux.pipe.residency_plan().shape


@pytest.mark.parametrize(
    ("one", "other", "same"),
    [
        ({"height": 512}, {"height": np.int64(512)}, True),
        ({"height": 512}, {"height": torch.tensor(512)}, True),
        ({}, {"height": None}, True),
        ({"guidance_scale": 3.5}, {"guidance_scale": 7.0}, True),
        ({"height": 512}, {"height": 1024}, False),
        ({"prompt": "a"}, {"prompt": ["a", "b"]}, False),
        ({"guidance_scale": 1.0}, {"guidance_scale": 5.0}, False),
        ({"latents": torch.zeros(1, 4, 8, 8)}, {"latents": torch.zeros(1, 4, 16, 16)}, False),
        # Lists of images by every size in them, not the first one's.
        ({"ip_adapter_image": [np.zeros((8, 8, 3))] * 2}, {"ip_adapter_image": [np.zeros((8, 8, 3))] * 2}, True),
        (
            {"ip_adapter_image": [np.zeros((8, 8, 3)), np.zeros((4, 4, 3))]},
            {"ip_adapter_image": [np.zeros((8, 8, 3)), np.zeros((16, 16, 3))]},
            False,
        ),
        (  # how many of each size
            {"ip_adapter_image": [np.zeros((8, 8, 3)), np.zeros((4, 4, 3)), np.zeros((4, 4, 3))]},
            {"ip_adapter_image": [np.zeros((8, 8, 3)), np.zeros((8, 8, 3)), np.zeros((4, 4, 3))]},
            False,
        ),
        ({"guidance_scale": np.float64(7.0)}, {"guidance_scale": 7.0}, True),
    ],
)
def test_call_shapes_tell_apart_what_changes_memory_and_nothing_else(one: dict, other: dict, same: bool) -> None:
    from diffusers import StableDiffusionXLPipeline

    from diffusers_residency.call_shapes import call_shape

    signature = inspect.signature(StableDiffusionXLPipeline.__call__)
    assert (call_shape(signature, (), one) == call_shape(signature, (), other)) == same


@pytest.mark.parametrize(
    ("pipeline", "given", "keyed_at_default"),
    [
        ("StableDiffusionXLPipeline", {}, True),
        ("StableDiffusionXLPipeline", {"height": None, "width": None}, True),
        ("StableDiffusionXLPipeline", {"height": 1024}, False),  # one side given: filled in differently
        ("StableDiffusionXLPipeline", {"width": 1024}, False),
        ("StableDiffusionXLPipeline", {"height": 0, "width": 0}, True),  # read as `height or default`
        ("StableDiffusionXLPipeline", {"height": np.int64(0), "width": 0}, True),
        ("WanPipeline", {"height": 0, "width": 0}, False),  # defaults to 480x832: 0 is a size asked for
        ("StableDiffusionXLPipeline", {"latents": torch.zeros(1, 4, 128, 96)}, False),  # they set the size
        ("PixArtSigmaPipeline", {"use_resolution_binning": True}, True),  # its default
        ("PixArtSigmaPipeline", {"use_resolution_binning": False}, False),  # not the default call's
        ("PixArtSigmaPipeline", {"use_resolution_binning": np.True_}, True),  # numpy's bool read as one
        ("OmniGenPipeline", {"use_input_image_size_as_output": True}, False),
        ("OmniGenPipeline", {"input_images": [[np.zeros((8, 8, 3))]]}, False),  # images given: not the default call
    ],
)
def test_a_call_leaving_its_size_to_the_pipeline_is_keyed_by_the_default_calls_size(
    pipeline: str, given: dict, keyed_at_default: bool
) -> None:
    import diffusers

    from diffusers_residency.call_shapes import call_shape

    signature = inspect.signature(getattr(diffusers, pipeline).__call__)
    explicit = call_shape(signature, (), {**given, "height": 1024, "width": 768})
    assert (call_shape(signature, (), given, (1024, 768)) == explicit) == keyed_at_default
    assert call_shape(signature, (), given) != explicit, "with no default size known, left as given"


def test_a_subclass_passing_its_arguments_on_is_keyed_by_its_parents_arguments() -> None:
    import functools

    from diffusers import StableDiffusionXLPipeline

    from diffusers_residency.call_shapes import call_shape, call_signature

    class PassingOn(StableDiffusionXLPipeline):
        def __call__(self, *args, **kwargs):
            kwargs.setdefault("guidance_scale", 0.0)  # a distilled model's: no guidance unless asked
            return super().__call__(*args, **kwargs)

    class Naming(StableDiffusionXLPipeline):
        def __call__(self, prompt=None, strength=0.5, **kwargs):
            return super().__call__(prompt, **kwargs)

    class Taking(StableDiffusionXLPipeline):
        def __call__(self):
            return super().__call__("a cat")

    class Partial(StableDiffusionXLPipeline):
        __call__ = functools.partialmethod(StableDiffusionXLPipeline.__call__, guidance_scale=2.0)

    class PassingOnToPartial(Partial):
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs)

    def without_wraps(function):
        def wrapper(*args, **kwargs):  # self among args
            return function(*args, **kwargs)

        return wrapper

    class Decorated(StableDiffusionXLPipeline):
        __call__ = without_wraps(StableDiffusionXLPipeline.__call__)

    class Static(StableDiffusionXLPipeline):
        __call__ = staticmethod(lambda prompt=None, height=None, width=None: None)

    class PassingOnToStatic(Static):
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs)

    parents = inspect.signature(StableDiffusionXLPipeline.__call__).parameters
    assert call_signature(PassingOn).parameters.keys() == parents.keys(), "the parent's names"
    assert call_signature(Decorated).parameters.keys() == parents.keys(), "self in *args: the parent's names"
    assert all(p.default in (None, inspect.Parameter.empty) for p in call_signature(PassingOn).parameters.values())
    class NamingOverPassingOn(PassingOn):
        def __call__(self, prompt=None, *args, strength=0.5, **kwargs):
            return super().__call__(prompt, *args, **kwargs)

    for naming in (Naming, NamingOverPassingOn):
        signature = call_signature(naming)
        own = [name for name in inspect.signature(naming.__call__).parameters if name not in ("args", "kwargs")]
        read = [name for name in signature.parameters if name != "args"]
        assert read[: len(own)] == own, "its own arguments first, as it names them"
        assert signature.parameters.keys() - {"args"} == parents.keys() | {"strength"}, "then the parent's others"
        assert signature.parameters["strength"].default == 0.5 and signature.parameters["height"].default is None
        explicit = call_shape(signature, ("a cat",), {"height": 1024, "width": 768})
        assert "height=1024" in explicit, "a size passed on is keyed"
        assert call_shape(signature, ("a cat",), {}, (1024, 768)) == explicit, "left to the default size, as its parent's"
        assert call_shape(signature, ("a cat", 0.7), {}, (1024, 768)) == explicit, "by position, its own names first"
    class NamingKeywordOnly(StableDiffusionXLPipeline):
        def __call__(self, *args, strength=0.5, **kwargs):
            return super().__call__(*args, **kwargs)

    def keyword_only_wrapper(function):
        def wrapper(*args, strength=0.5, **kwargs):  # self among args
            return function(*args, **kwargs)

        return wrapper

    class DecoratedNamingKeywordOnly(StableDiffusionXLPipeline):
        __call__ = keyword_only_wrapper(StableDiffusionXLPipeline.__call__)

    class ChainedNamingKeywordOnly(PassingOn):  # positional arguments passed on twice
        def __call__(self, *args, strength=0.5, **kwargs):
            return super().__call__(*args, **kwargs)

    for naming in (NamingKeywordOnly, DecoratedNamingKeywordOnly, ChainedNamingKeywordOnly):
        signature = call_signature(naming)
        assert signature.parameters.keys() - {"strength"} == parents.keys(), "the parent's names, and its own"
        assert signature.parameters["strength"].default == 0.5
        explicit = call_shape(signature, ("a cat",), {"height": 1024, "width": 768})
        assert "height=1024" in explicit
        assert call_shape(signature, ("a cat", None, 1024, 768), {}) == explicit, "by position, the parent's names"
        assert call_shape(signature, ("a cat",), {"strength": 0.7}, (1024, 768)) == explicit

    class PositionalOnly(StableDiffusionXLPipeline):
        def __call__(self, prompt=None, /, **kwargs):
            return super().__call__(prompt, **kwargs)

    class NamingOverPositionalOnly(PositionalOnly):
        def __call__(self, *args, strength=0.5, **kwargs):
            return super().__call__(*args, **kwargs)

    signature = call_signature(NamingOverPositionalOnly)  # its self taken by position only, as its prompt
    assert call_shape(signature, ("a cat",), {"height": 1024, "width": 768}).startswith("height=1024 width=768")
    assert call_signature(Taking) == inspect.signature(Taking.__call__), "taking nothing is passing nothing on"
    for no_function in (PassingOnToPartial, PassingOnToStatic):
        assert call_signature(no_function) == inspect.signature(no_function.__call__), "no function: no names read"
    signature = call_signature(PassingOn)
    explicit = call_shape(signature, (), {"height": 1024, "width": 768})
    assert call_shape(signature, (), {}, (1024, 768)) == explicit, "left to the default size, as its parent's calls"
    assert call_shape(signature, ("a", None, 1024, 768), {}) == explicit, "positional arguments by the parent's names"
    # Its own default is not its parent's: a call asking for guidance is another shape (twice the batch).
    assert call_shape(signature, (), {}, (1024, 768)) != call_shape(signature, (), {"guidance_scale": 7.0}, (1024, 768))


def test_a_subclass_passing_its_arguments_on_is_keyed_by_the_parent_its_super_call_reaches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # In a class with two parents, the first's super().__call__ reaches the second, not the class
    # the first inherits from: a call's positional arguments are the second's.
    from diffusers import StableDiffusionPipeline

    class PassingOn(StableDiffusionPipeline):
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs)

    class ByArea(StableDiffusionPipeline):
        def __call__(self, prompt=None, max_area=None, **kwargs):
            side = round(max_area**0.5)
            return super().__call__(prompt, height=side, width=side, **kwargs)

    class Both(PassingOn, ByArea):
        pass

    case = PipelineCase("sd15")
    pipe = Both(**case.pipe.components)
    pipe.enable_pinned_offload("cpu", vram_budget=_budget(case))
    monkeypatch.setattr(_device, "peak_allocated", lambda device: pipeline_state(pipe).group.loaded_bytes() + 1000)
    kwargs = call_kwargs("sd15")
    prompt, side = kwargs.pop("prompt"), kwargs.pop("height")
    del kwargs["width"]
    with torch.inference_mode():
        output = pipe(prompt, side * side, **kwargs, return_dict=False)[0]
    assert torch.equal(output, case.reference)
    assert f"max_area={side * side}" in pipe.residency_plan().shape, "the area by ByArea's name, not a height"


def test_a_call_given_no_size_and_one_given_the_default_size_are_measured_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # SD 1.5's tiny pipeline makes 32x32 images when given no size: its UNet's sample size times
    # its VAE's scale factor.
    case = PipelineCase("sd15")
    case.pipe.enable_pinned_offload("cpu", vram_budget=_budget(case))
    _measure_on_the_cpu(case, monkeypatch)
    measuring = _measured_calls(case)
    assert call_kwargs("sd15")["height"] == call_kwargs("sd15")["width"] == 32
    for size_given in (False, True, False):
        kwargs = call_kwargs("sd15")  # a generator of its own for each call
        if not size_given:
            del kwargs["height"], kwargs["width"]
        assert torch.equal(pipeline_output(case.pipe, kwargs), case.reference)
    # Its text encoder runs twice a call: the prompt, then the negative one.
    assert measuring == [True, True, False, False, False, False], "one shape, measured once"
    assert "height=32 width=32" in case.pipe.residency_plan().shape
    assert set(residency_profile(case.pipe).shapes) == {case.pipe.residency_plan().shape}


def test_a_binned_call_is_a_shape_of_its_own_whose_decode_is_not_estimated_from_its_size(flux: PipelineCase) -> None:
    # PixArt bins by default: a 32x32 call makes the latents of the nearest of its model's sizes.
    from diffusers import PixArtSigmaPipeline

    from diffusers_residency.call_shapes import call_shape, shape_parts

    signature = inspect.signature(PixArtSigmaPipeline.__call__)
    binned = call_shape(signature, (), {"height": 32, "width": 32})
    assert binned != call_shape(signature, (), {"height": 32, "width": 32, "use_resolution_binning": False})
    decoder = CallDryRuns.of(flux.pipe, module_components(flux.pipe), offload_sequence(flux.pipe), {}).decoder
    assert decoder.need(shape_parts(binned)) is None
    numpy_true = call_shape(signature, (), {"height": 32, "width": 32, "use_resolution_binning": np.True_})
    assert numpy_true == binned and decoder.need(shape_parts(numpy_true)) is None, "numpy's True is True"
    unbinned = {**shape_parts(binned), "use_resolution_binning": False}
    assert decoder.need(unbinned) == decoder.need({**unbinned, "use_resolution_binning": None}) is not None


@pytest.mark.parametrize(
    ("known", "new", "covering"),
    [
        ({"height": 1024, "width": 1024}, {"height": 768, "width": 768}, True),
        ({"height": 1024, "width": 1024}, {"height": 1024, "width": 768}, True),
        ({"height": 1024, "width": 1024}, {"height": 1280, "width": 768}, False),  # taller: larger somewhere
        ({"height": 1024, "width": 1024, "num_images_per_prompt": 2}, {"height": 768, "width": 768}, True),
        ({"height": 1024, "width": 1024, "prompt": ["a", "b"]}, {"height": 768, "width": 768, "prompt": ["a"]}, True),
        ({"height": 1024, "width": 1024}, {}, False),  # left to the pipeline's default: no size to compare
        ({"height": 1024, "width": 1024}, {"height": 768, "width": 768, "guidance_scale": 1.0}, False),
        ({"height": 1024, "width": 1024}, {"height": 768, "width": 768, "negative_prompt": "x"}, False),
        ({"height": 1024, "image": np.zeros((8, 8, 3))}, {"height": 768, "image": np.zeros((4, 4, 3))}, False),
        # Embeddings given: their sequence length counts, not max_sequence_length (which the pipeline ignores).
        (
            {"height": 1024, "max_sequence_length": 512, "prompt_embeds": torch.zeros(1, 77, 8)},
            {"height": 768, "max_sequence_length": 256, "prompt_embeds": torch.zeros(1, 512, 8)},
            False,
        ),
        ({"height": 1024, "num_videos_per_prompt": 1}, {"height": 768, "num_videos_per_prompt": 2}, False),
        ({"height": 1024, "num_videos_per_prompt": 2}, {"height": 768, "num_videos_per_prompt": 1}, True),
    ],
)
def test_a_shape_is_covered_by_a_larger_one_alike_in_everything_else(known: dict, new: dict, covering: bool) -> None:
    from diffusers import FluxPipeline, StableDiffusionXLPipeline, WanPipeline

    from diffusers_residency.call_shapes import call_shape, shape_parts

    pipeline = WanPipeline if "num_videos_per_prompt" in known else FluxPipeline if "max_sequence_length" in known else StableDiffusionXLPipeline
    signature = inspect.signature(pipeline.__call__)
    known_shape, new_shape = call_shape(signature, (), known), call_shape(signature, (), new)
    assert shape_parts(known_shape) is not None and shape_parts(new_shape) is not None
    assert (covering_shape([known_shape], new_shape) == known_shape) == covering
    if covering:
        assert covering_shape([new_shape], known_shape) is None, "never a smaller one"


def test_the_smallest_covering_shape_is_taken_and_strings_that_are_no_shapes_are_skipped() -> None:
    shapes = ["height=1280 width=1280 batch=1", "not a shape", "height=1024 width=1024 batch=1", 'height="x" width=1 batch=1']
    assert covering_shape(shapes, "height=768 width=768 batch=1") == "height=1024 width=1024 batch=1"
    assert covering_shape(shapes, "height=768 width=768 batch=true") is None, "a flag is no size"
    assert covering_shape(shapes, "garbage") is None
    # A size that is no number, the same in both: compared as equal, not multiplied.
    assert covering_shape(['height="x" width=1024 batch=1'], 'height="x" width=768 batch=1') == 'height="x" width=1024 batch=1'


def _plans_at_call_start(case: PipelineCase) -> list[str]:
    """Per call of ``case.pipe`` from now on, the source of the plan its first component ran under
    (empty: a measuring call's plan, the least on the device); the plans themselves in ``.plans``."""
    state = pipeline_state(case.pipe)
    sources = _Sources()
    case.pipe.text_encoder.register_forward_pre_hook(lambda *_: sources.seen(state.plan))
    return sources


class _Sources(list):
    def __init__(self) -> None:
        super().__init__()
        self.plans = []

    def seen(self, plan) -> None:
        self.append(plan.source)
        self.plans.append(plan)


def test_a_new_shape_smaller_than_one_measured_is_planned_from_its_figures_then_measured(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    references = {size: _run(flux, size) for size in (32, 48, 64)}
    budget = _budget(flux)
    flux.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    needs = {32: 1000, 48: 9000, 64: 20_000}
    size = [48]
    monkeypatch.setattr(
        _device, "peak_allocated", lambda device: pipeline_state(flux.pipe).group.loaded_bytes() + needs[size[0]]
    )
    sources = _plans_at_call_start(flux)
    assert torch.equal(_run(flux, 48), references[48])
    large = flux.pipe.residency_plan()
    assert large.source == "measured" and large["transformer"].resident_blocks, str(large)

    # 32x32 is new, and smaller: planned from 48x48's figures, which fit it, not measured with the
    # least on the device; measured under that plan all the same, and planned for what it needed.
    size[0] = 32
    assert torch.equal(_run(flux, 32), references[32])
    assert sources[-1] == f"estimated from calls of {large.shape}"
    assert sources.plans[-1].components == large.components, "the larger shape's plan, blocks kept and all"
    small = flux.pipe.residency_plan()
    margin = int(budget * 0.02)
    assert small.source == "measured" and small.shape != large.shape
    assert set(small.activations.values()) == {1000 + margin}, str(small)
    assert residency_profile(flux.pipe).shapes[small.shape].activations == small.activations
    assert torch.equal(_run(flux, 32), references[32])
    assert sources[-1] == "measured" and flux.pipe.residency_plan() is small, "measured once: planned for from then on"

    # 64x64 is larger than any measured: no figures bound it, so it is measured with the least.
    size[0] = 64
    assert torch.equal(_run(flux, 64), references[64])
    assert sources[-1] == ""
    assert set(flux.pipe.residency_plan().activations.values()) == {20_000 + margin}


def test_a_call_sized_by_its_max_area_is_a_shape_of_its_own(flux: PipelineCase, monkeypatch: pytest.MonkeyPatch) -> None:
    # FLUX Kontext sizes its output from max_area; height and width give only the aspect ratio.
    from diffusers import FluxKontextPipeline

    kontext = FluxKontextPipeline(**flux.pipe.components)
    areas = (32 * 32, 64 * 64)
    call = lambda area: {**call_kwargs("flux", height=32, width=32), "max_area": area}  # noqa: E731 (a fresh generator)
    references = {area: pipeline_output(kontext, call(area)) for area in areas}
    assert references[32 * 32].shape != references[64 * 64].shape
    kontext.enable_pinned_offload("cpu", vram_budget=_budget(flux))
    flux.pipe = kontext
    _measure_on_the_cpu(flux, monkeypatch)
    sources = _plans_at_call_start(flux)
    for area in areas:
        assert torch.equal(pipeline_output(kontext, call(area)), references[area])
    assert list(sources) == ["", ""], "the larger area measured as a shape of its own, not planned from the smaller's"
    assert len(residency_profile(kontext).shapes) == 2
    assert covering_shape([kontext.residency_plan().shape], sources.plans[0].shape or "") is None


def _measured_at_48(case: PipelineCase, monkeypatch: pytest.MonkeyPatch) -> tuple[int, str, list[str]]:
    """``case`` enabled under a measuring budget, after one measured call of 48x48: the budget, that
    call's shape, and the sources of the plans the calls from now on start under."""
    budget = _budget(case)
    case.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    _measure_on_the_cpu(case, monkeypatch)
    _run(case, 48)
    return budget, case.pipe.residency_plan().shape, _plans_at_call_start(case)


def test_a_call_under_an_estimate_that_never_runs_whole_keeps_no_figures(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, large, sources = _measured_at_48(flux, monkeypatch)
    pipeline_output(flux.pipe, {**call_kwargs("flux", height=32, width=32), "output_type": "latent"})
    assert sources == [f"estimated from calls of {large}"]
    assert len(residency_profile(flux.pipe).shapes) == 1, "an estimate is not kept as figures of the smaller shape"
    assert torch.equal(_run(flux, 32), flux.reference)
    assert len(residency_profile(flux.pipe).shapes) == 2 and flux.pipe.residency_plan().source == "measured"


def _retrying_while_the_transformer_runs(case: PipelineCase, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The allocator retrying under its cap each time the transformer runs while the list returned
    holds True (a CPU has no allocator to retry): seen as the next component starts, and so the
    transformer's."""
    retries, retrying = [0], [False]
    monkeypatch.setattr(_device, "allocator_retries", lambda device: retries[0])
    case.pipe.transformer.register_forward_hook(lambda *_: retries.__setitem__(0, retries[0] + retrying[0]))
    return retrying


def test_an_estimate_its_call_disproves_is_not_kept_and_the_shape_gets_the_most_room(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A reserve the budget does not cap (as at real budgets): a plan for the least on the device
    # fits once retries add a margin to it, which is what must not be learned here.
    monkeypatch.setattr(components, "default_reserve_for", lambda *args, **kwargs: 1 << 30)
    references = {size: _run(flux, size) for size in (32, 48)}
    budget = _budget(flux)
    flux.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    needs = {48: 1000, 32: 10 * budget}  # the smaller call needs more than the budget has: no plan fits
    size = [48]
    monkeypatch.setattr(
        _device, "peak_allocated", lambda device: pipeline_state(flux.pipe).group.loaded_bytes() + needs[size[0]]
    )
    retrying = _retrying_while_the_transformer_runs(flux, monkeypatch)
    sources = _plans_at_call_start(flux)
    assert torch.equal(_run(flux, 48), references[48])
    large = flux.pipe.residency_plan()
    size[0], retrying[0] = 32, True
    with caplog.at_level("WARNING", logger="diffusers_residency.adaptive"):
        assert torch.equal(_run(flux, 32), references[32])
    retrying[0] = False
    assert sources[-1].startswith("estimated from calls of") and "no plan fits" in caplog.text
    after = flux.pipe.residency_plan()
    assert after.source == "" and not after.resident_weight_bytes - _least(flux).resident_weight_bytes, str(after)
    assert "retried" not in caplog.text, "retries under a plan given up teach nothing"
    assert set(residency_profile(flux.pipe).shapes) == {large.shape}, "the larger shape's figures are not the smaller's"
    assert torch.equal(_run(flux, 32), references[32])
    assert sources[-1] == "" and set(residency_profile(flux.pipe).shapes) == {large.shape}
    # Another shape between two calls of this one: it is not estimated again.
    size[0] = 48
    assert torch.equal(_run(flux, 48), references[48])
    size[0] = 32
    assert torch.equal(_run(flux, 32), references[32])
    assert sources[-2:] == ["measured", ""]
    assert set(residency_profile(flux.pipe).shapes) == {large.shape}


def _least(case: PipelineCase):
    state = pipeline_state(case.pipe)
    streaming = {p.name: Policy.STREAMED for p in state.plan.components if p.policy is Policy.STREAMED}
    return state.replan({}, streaming, [n for n in (p.name for p in state.plan.components) if n not in streaming], least=True)


@pytest.mark.parametrize(("error", "estimated_again"), [(torch.OutOfMemoryError, False), (KeyboardInterrupt, True)])
def test_a_call_under_an_estimate_that_runs_out_of_memory_leaves_its_shape_to_a_measuring_call(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch, error: type[BaseException], estimated_again: bool
) -> None:
    budget, large, sources = _measured_at_48(flux, monkeypatch)
    hook = flux.pipe.transformer.register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(error("short")))
    with pytest.raises(error):
        _run(flux, 32)
    hook.remove()
    assert sources[-1] == f"estimated from calls of {large}"
    assert torch.equal(_run(flux, 32), flux.reference)
    # Out of memory, the estimate may have left too little room: measured with the most. Cut short
    # otherwise (interrupted, a callback raising), it says nothing of the room.
    assert sources[-1] == (f"estimated from calls of {large}" if estimated_again else "")
    assert flux.pipe.residency_plan().source == "measured"
    flux.pipe.enable_pinned_offload("cpu", vram_budget=budget - (512 << 20))
    assert not pipeline_state(flux.pipe).estimates_failed, "what fell short under another plan is tried again"


@pytest.mark.parametrize("from_profile", [False, True])
def test_a_call_out_of_memory_under_its_shapes_own_figures_leaves_the_next_to_measure_again(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, from_profile: bool
) -> None:
    budget = _budget(flux)
    flux.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    _measure_on_the_cpu(flux, monkeypatch)
    assert torch.equal(flux.run(), flux.reference)
    if from_profile:  # the figures of an earlier process
        flux.pipe.disable_pinned_offload()
        flux.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    sources = _plans_at_call_start(flux)
    for error in (KeyboardInterrupt, torch.OutOfMemoryError):
        hook = flux.pipe.transformer.register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(error("short")))
        with pytest.raises(error):
            flux.run()
        hook.remove()
        assert sources[-1] == ("from the residency profile" if from_profile else "measured")
        # Interrupted, the call says nothing of the room; out of memory, that its figures no longer hold.
        assert bool(residency_profile(flux.pipe).shapes) is (error is KeyboardInterrupt)
    assert "ran out of device memory under the plan from its figures" in caplog.text
    # Nor does the cache file: a process started now would plan from them.
    state = pipeline_state(flux.pipe)
    assert not read_profile(state.profile_file, state.profile.key).shapes
    assert torch.equal(flux.run(), flux.reference)
    assert sources[-1] == "", "measured again, with the least on the device"
    assert torch.equal(flux.run(), flux.reference)
    assert sources[-1] == "measured"


def test_retries_under_an_estimate_that_never_runs_whole_go_to_no_other_shape(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    resident = _run(flux, 48)
    _, large, _ = _measured_at_48(flux, monkeypatch)
    measured = residency_profile(flux.pipe).shapes[large]
    retrying = _retrying_while_the_transformer_runs(flux, monkeypatch)
    retrying[0] = True
    pipeline_output(flux.pipe, {**call_kwargs("flux", height=32, width=32), "output_type": "latent"})
    retrying[0] = False
    assert torch.equal(_run(flux, 48), resident)
    plan = flux.pipe.residency_plan()
    assert plan.source == "measured" and plan.activations == measured.activations, str(plan)
    assert residency_profile(flux.pipe).shapes[large] == measured


def _measured_at_48_retrying_on_demand(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch
) -> tuple[torch.Tensor, int, list[bool]]:
    """The tiny FLUX pipeline under :func:`_budget`, its 48x48 calls measured (exact), with the
    allocator retrying while the transformer runs once the list returned holds True; and the
    resident 48x48 output and the budget."""
    reference_48 = _run(flux, 48)
    budget = _budget(flux)
    flux.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    _measure_on_the_cpu(flux, monkeypatch)
    retrying = _retrying_while_the_transformer_runs(flux, monkeypatch)
    assert torch.equal(_run(flux, 48), reference_48)
    return reference_48, budget, retrying


def test_retries_under_an_estimate_are_learned_for_its_shape_as_its_call_returns(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    reference_48, budget, retrying = _measured_at_48_retrying_on_demand(flux, monkeypatch)
    large = flux.pipe.residency_plan()
    retrying[0] = True
    state = pipeline_state(flux.pipe)
    replans, replan = [], state.replan
    monkeypatch.setattr(state, "replan", lambda *args, **kwargs: replans.append(args) or replan(*args, **kwargs))
    with caplog.at_level("WARNING", logger="diffusers_residency.adaptive"):
        assert torch.equal(_run(flux, 32), flux.reference)
    retrying[0] = False
    assert "retried while 'transformer' ran" in caplog.text
    assert len(replans) == 2, "planned as it began, and once as it returned: the retries' margin in that plan"
    margin = int(budget * 0.02)
    small = flux.pipe.residency_plan()
    # Measured (1000 bytes and a margin), then a margin more for the retries: this shape's figures.
    assert small.activations["transformer"] == 1000 + 2 * margin, str(small)
    assert residency_profile(flux.pipe).shapes[small.shape].activations == small.activations
    caplog.clear()
    with caplog.at_level("WARNING", logger="diffusers_residency.adaptive"):
        assert torch.equal(_run(flux, 48), reference_48)
    assert "retried" not in caplog.text, "nothing left over for the next call, of another shape"
    assert flux.pipe.residency_plan().activations == large.activations
    assert residency_profile(flux.pipe).shapes[large.shape].activations == large.activations


def test_retries_whose_margin_finds_no_room_beside_what_was_measured_are_tried_alone_and_left_alone(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The call under an estimate measures needs that leave room for their margins but not for the
    # retries' margin on top: it is planned for what it measured, and the retries are told as
    # later ones are (learn_overshoot), which finds no room either and leaves them alone.
    _, budget, retrying = _measured_at_48_retrying_on_demand(flux, monkeypatch)
    state = pipeline_state(flux.pipe)
    margin = int(budget * pipeline_residency.RESERVE_MARGIN)
    low = _largest_need_with_no_room_for_a_margin_more(state)
    _measure_on_the_cpu(flux, monkeypatch, need=low)
    plan = _planned_after_a_call_at_32_retrying(flux, retrying, caplog)
    assert plan.activations["transformer"] == low + margin, str(plan)
    assert "no plan leaves it more room" in caplog.text
    assert state.retries_left_alone == {"transformer"}


def _planned_after_a_call_at_32_retrying(
    flux: PipelineCase, retrying: list[bool], caplog: pytest.LogCaptureFixture
) -> ResidencyPlan:
    """The plan after a 32x32 call (exact) with the allocator retrying while the transformer runs
    (see _retrying_while_the_transformer_runs), its warnings captured."""
    retrying[0] = True
    with caplog.at_level("WARNING", logger="diffusers_residency.adaptive"):
        assert torch.equal(_run(flux, 32), flux.reference)
    retrying[0] = False
    return flux.pipe.residency_plan()


def _largest_need_with_no_room_for_a_margin_more(state: pipeline_residency.PipelineResidency) -> int:
    """The largest need of every component that a plan fits with its margin, the transformer's
    with no room for one margin more."""
    margin = int(state.plan.budget * pipeline_residency.RESERVE_MARGIN)
    names = [p.name for p in state.plan.components]

    def fits(need: int, extra: int) -> bool:
        try:
            pipeline_residency.replan_in_place(
                state, {**{n: need + margin for n in names}, "transformer": need + margin + extra}
            )
            return True
        except BudgetTooSmallError:
            return False

    low, high = 0, state.plan.budget
    while high - low > 1:
        low, high = ((low + high) // 2, high) if fits((low + high) // 2, 0) else (low, (low + high) // 2)
    assert fits(low, 0) and not fits(low, margin)
    return low


def test_a_retry_under_a_larger_shapes_figures_keeps_the_room_it_had_where_no_margin_more_fits(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The smaller call runs under the larger shape's figures, retries, and reads less than that
    # room (as a peak under a cap does): planned with the room it retried under, not its reading.
    reference_48 = _run(flux, 48)
    budget = _budget(flux)
    flux.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    state = pipeline_state(flux.pipe)
    margin = int(budget * pipeline_residency.RESERVE_MARGIN)
    low = _largest_need_with_no_room_for_a_margin_more(state)
    _measure_on_the_cpu(flux, monkeypatch, need=low)
    retrying = _retrying_while_the_transformer_runs(flux, monkeypatch)
    assert torch.equal(_run(flux, 48), reference_48)
    assert flux.pipe.residency_plan().activations["transformer"] == low + margin
    _measure_on_the_cpu(flux, monkeypatch, need=1000)
    plan = _planned_after_a_call_at_32_retrying(flux, retrying, caplog)
    assert plan.activations["transformer"] == low + margin, str(plan)
    assert plan.activations["text_encoder"] == 1000 + margin, "the others as measured"
    assert "no plan leaves it more room" in caplog.text and state.retries_left_alone == {"transformer"}
    assert torch.equal(_run(flux, 32), flux.reference)


def test_a_kept_plan_is_taken_where_it_still_fits_and_planned_again_where_not() -> None:
    sizes = (
        ComponentSizes("text_encoder", 300 * MB, (100 * MB,) * 3),
        ComponentSizes("transformer", 1000 * MB, (200 * MB,) * 5, per_step=True),
    )
    made = plan_residency(sizes, 900 * MB, 100 * MB)
    transformer = made["transformer"]
    assert transformer.policy is Policy.STREAMED and transformer.resident_blocks, str(made)

    def with_transformer(**changes) -> tuple[ComponentPlan, ...]:
        return tuple(replace(p, **changes) if p.name == "transformer" else p for p in made.components)

    # Fewer blocks resident than the planner keeps, still fitting: taken as it is.
    kept = with_transformer(resident_blocks=frozenset(), staged_blocks=frozenset())
    assert plan_residency(sizes, 900 * MB, 100 * MB, chosen=kept).components == kept
    # Where everything fits, everything stays: the plan kept was for less room.
    roomy = plan_residency(sizes, 2000 * MB, 100 * MB, chosen=kept)
    assert {p.policy for p in roomy.components} == {Policy.RESIDENT}
    # No longer fitting (a smaller budget), against a policy now fixed, or not a plan of these
    # components (a block out of range, one both resident and staged, no window): planned again.
    smaller = plan_residency(sizes, 700 * MB, 100 * MB, chosen=made.components)
    assert smaller.components != made.components and smaller.peak_bytes <= 700 * MB
    assert made["text_encoder"].policy is not Policy.RESIDENT, str(made)
    fixed = plan_residency(sizes, 1200 * MB, 100 * MB, {"text_encoder": Policy.RESIDENT}, chosen=kept)
    assert fixed["text_encoder"].policy is Policy.RESIDENT and fixed.peak_bytes <= 1200 * MB
    malformed = (
        with_transformer(resident_blocks=frozenset({-1})),
        with_transformer(resident_blocks=frozenset({5})),
        with_transformer(resident_blocks=frozenset({0}), staged_blocks=frozenset({0})),
        with_transformer(resident_blocks=frozenset(), staged_blocks=frozenset(), prefetch_blocks=0),
    )
    for chosen in malformed:
        assert plan_residency(sizes, 900 * MB, 100 * MB, chosen=chosen).components == made.components, chosen


def test_casts_survive_the_file_one_without_them_has_none_and_a_name_that_is_no_dtype_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    key = {"pipeline": "P"}
    figures = CallFigures({"vae": 5}, casts={"vae": (torch.float32, torch.float16)})
    path = tmp_path / "p.json"
    write_profile(path, ResidencyProfile(key, {"s": figures}))
    assert read_profile(path, key).shapes["s"] == figures
    data = json.loads(path.read_text())
    del data["shapes"]["s"]["casts"]  # as written before casts were kept
    path.write_text(json.dumps(data))
    assert read_profile(path, key).shapes["s"] == replace(figures, casts={})
    for name in ("Tensor", "int8"):
        data["shapes"]["s"]["casts"] = {"vae": [name, "float16"]}
        path.write_text(json.dumps(data))
        assert read_profile(path, key) is None and f"{name!r} is no floating-point torch dtype" in caplog.text


def test_a_kept_plan_survives_the_file_and_an_older_format_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plan = (
        ComponentPlan("text_encoder", Policy.STAGED),
        ComponentPlan("transformer", Policy.STREAMED, frozenset({0, 3}), 1, frozenset({1})),
    )
    key = {"pipeline": "P"}
    path = tmp_path / "p.json"
    for shares, estimated in ((None, False), ((0.25, 0.75), True), ((1.0,), False)):
        timing = StepTiming(1e-9, 2e-11, estimated, shares)
        figures = CallFigures({"transformer": 5}, {"transformer": timing}, frozenset({"vae"}), True, plan)
        write_profile(path, ResidencyProfile(key, {"s": figures}))
        assert read_profile(path, key).shapes["s"] == figures
    # Before plans were kept (format 1), the policies given were not keyed either: a plan made
    # again from those figures might not be the one the policies given now ask for.
    data = json.loads(path.read_text())
    del data["shapes"]["s"]["plan"]
    path.write_text(json.dumps({**data, "format": 1}))
    assert read_profile(path, key) is None and f"format 1, this version reads {FORMAT}" in caplog.text
