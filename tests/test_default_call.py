"""A pipeline's call with its defaults, run on the meta device as the pipeline is enabled: its
denoiser's inputs for the default shape, whose dry run a first call of that shape then finds made;
the pipeline left as it was; a pipeline whose call cannot run there estimated as its denoiser starts,
as before."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
from diffusers import FluxPipeline

from diffusers_residency import _device, dry_runs, retry_with_room
from diffusers_residency.bench.builders import call_kwargs, pipeline_output
from diffusers_residency.dry_runs import ForwardDryRun
from diffusers_residency.pipeline import pipeline_state
from diffusers_residency.pipeline_residency import AT_ENABLE, DRY_RUN, PipelineResidency
from diffusers_residency.plans import ResidencyPlan
from diffusers_residency.policy import Policy

from .helpers import PipelineCase
from .test_profile import _budget, _measure_on_the_cpu


def _default_call(kind: str) -> dict:
    """The benchmark's tiny call of ``kind`` with its size and prompt length left to the pipeline."""
    kwargs = call_kwargs(kind)
    for name in ("height", "width", "max_sequence_length"):
        kwargs.pop(name, None)
    return kwargs


def _counting_dry_runs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The class of every module a dry run is made of from here on."""
    made: list[str] = []
    real = dry_runs.dry_run_need

    def counting(twin: torch.nn.Module, *args: object) -> int | None:
        made.append(type(twin).__name__)
        return real(twin, *args)

    monkeypatch.setattr(dry_runs, "dry_run_need", counting)
    return made


@pytest.mark.parametrize("kind", ["flux", "sdxl", "sd3", "sd15"])
def test_a_first_call_of_the_default_shape_finds_its_denoisers_estimate_made_at_enable(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = PipelineCase(kind)
    reference = pipeline_output(case.pipe, _default_call(kind))
    case.pipe.enable_pinned_offload("cpu", vram_budget=_budget(case))
    _measure_on_the_cpu(case, monkeypatch)
    state = pipeline_state(case.pipe)
    denoiser = case.pipe.components[state.dry_runs.denoiser]
    inputs: list[tuple[tuple, dict]] = []
    denoiser.register_forward_pre_hook(lambda _, args, kwargs: inputs.append((args, kwargs)), with_kwargs=True)
    plans: list[ResidencyPlan] = []
    case.pipe.vae.decoder.register_forward_pre_hook(lambda *_: plans.append(state.plan))
    made = _counting_dry_runs(monkeypatch)

    assert torch.equal(pipeline_output(case.pipe, _default_call(kind)), reference)
    assert plans[0].source == DRY_RUN, "planned from the estimates as its denoiser started"
    assert type(denoiser).__name__ not in made, "its denoiser's dry run was made at enable"
    # The estimate made at enable is the one the inputs the call gave make.
    assert state.dry_runs.forward.need(*inputs[0]) == ForwardDryRun(denoiser).need(*inputs[0]) is not None
    # The size the default call told is the one the call made, and the call's shape is keyed by it.
    height, width = state.dry_runs.default_size
    assert tuple(reference.shape[-2:]) == (height, width)
    assert f"height={height} width={width}" in case.pipe.residency_plan().shape


def test_a_call_of_another_shape_makes_its_denoisers_dry_run_as_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    case = PipelineCase("flux")  # its tiny call is 32x32, its default 1024x1024
    case.pipe.enable_pinned_offload("cpu", vram_budget=_budget(case))
    _measure_on_the_cpu(case, monkeypatch)
    made = _counting_dry_runs(monkeypatch)
    assert torch.equal(case.run(), case.reference)
    assert made.count("FluxTransformer2DModel") == 1


def test_the_default_call_leaves_the_pipeline_as_it_was(capfd: pytest.CaptureFixture[str]) -> None:
    case = PipelineCase("sdxl")
    scheduler = case.pipe.scheduler
    before = {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in vars(scheduler).items()}
    attributes = dict(vars(case.pipe))
    capfd.readouterr()
    case.pipe.enable_pinned_offload("cpu", vram_budget=_budget(case))
    assert capfd.readouterr().err == "", "no progress bar, no warning"
    assert case.pipe.scheduler is scheduler and vars(scheduler).keys() == before.keys()
    for name, value in vars(scheduler).items():
        assert torch.equal(value, before[name]) if isinstance(value, torch.Tensor) else value == before[name], name
    assert all(vars(case.pipe)[name] is value for name, value in attributes.items())
    assert pipeline_state(case.pipe).dry_runs.forward._needs, "the default call's estimate was made"
    assert torch.equal(case.run(), case.reference)


class _ReadingValues(FluxPipeline):
    """A pipeline whose call reads a tensor's value before its denoiser, which no meta tensor has."""

    def __call__(self, *args: object, **kwargs: object) -> object:
        if torch.ones(1, device=self._execution_device).item() != 1:
            raise AssertionError("unreachable")
        return super().__call__(*args, **kwargs)


def test_a_pipeline_whose_call_reads_values_is_estimated_as_its_denoiser_starts(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    case = PipelineCase("flux")
    pipe = _ReadingValues(**case.pipe.components)
    pipe.set_progress_bar_config(disable=True)
    case.pipe = pipe
    caplog.set_level(logging.DEBUG, logger="diffusers_residency.default_call")
    pipe.enable_pinned_offload("cpu", vram_budget=_budget(case))
    assert "_ReadingValues's call cannot run on the meta device" in caplog.text
    _measure_on_the_cpu(case, monkeypatch)
    made = _counting_dry_runs(monkeypatch)
    reference = case.reference
    assert torch.equal(pipeline_output(pipe, call_kwargs("flux")), reference)
    assert made.count("FluxTransformer2DModel") == 1
    assert pipe.residency_plan().source == "measured"


def _budget_keeping_half_the_transformer(case: PipelineCase) -> int:
    """A budget under which the tiny FLUX's calls are measured, with room for about half its
    transformer's blocks to stay."""
    return _budget(case) + case.pipe.transformer.num_parameters() * 4 // 2


def _transformer_blocks(case: PipelineCase) -> list:
    return pipeline_state(case.pipe).group.units_of("transformer")[1:]


def _enabled_with_the_plan_made_at_enable(case: PipelineCase, monkeypatch: pytest.MonkeyPatch) -> PipelineResidency:
    """``case`` enabled with room for about half its transformer, its calls measured on the CPU
    (see ``_measure_on_the_cpu``); its state, under the plan made at enable."""
    case.pipe.enable_pinned_offload("cpu", vram_budget=_budget_keeping_half_the_transformer(case))
    state = pipeline_state(case.pipe)
    assert state.plan.source == AT_ENABLE
    _measure_on_the_cpu(case, monkeypatch)
    return state


def test_a_pipeline_enabled_with_no_profile_loads_what_the_default_calls_plan_keeps_resident(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    case = PipelineCase("flux")
    state = _enabled_with_the_plan_made_at_enable(case, monkeypatch)
    blocks = _transformer_blocks(case)
    resident = [block for block in blocks if block.policy is Policy.RESIDENT]
    assert resident and len(resident) < len(blocks)
    assert [block.stager.loaded for block in blocks] == [block.policy is Policy.RESIDENT for block in blocks]
    loaded_as_encoding: list[list[bool]] = []
    case.pipe.text_encoder.register_forward_pre_hook(
        lambda *_: loaded_as_encoding.append([block.stager.loaded for block in resident])
    )
    plans: list[ResidencyPlan] = []
    case.pipe.vae.decoder.register_forward_pre_hook(lambda *_: plans.append(state.plan))
    assert torch.equal(case.run(), case.reference)
    assert loaded_as_encoding == [[True] * len(resident)], "kept through the text encoders, not made room for"
    assert plans[0].source == DRY_RUN and case.pipe.residency_plan().source == "measured"


def test_a_first_call_no_dry_run_follows_measures_with_the_least_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    case = PipelineCase("flux")
    kwargs = call_kwargs("flux")
    latents = case.pipe(**{**kwargs, "output_type": "latent"}, return_dict=False)[0]
    reference = pipeline_output(case.pipe, {**call_kwargs("flux"), "latents": latents})
    _enabled_with_the_plan_made_at_enable(case, monkeypatch)
    loaded_as_encoding: list[bool] = []
    case.pipe.text_encoder.register_forward_pre_hook(
        lambda *_: loaded_as_encoding.extend(block.stager.loaded for block in _transformer_blocks(case))
    )
    # Latents given: no dry run follows the call, which is measured as without estimates.
    assert torch.equal(pipeline_output(case.pipe, {**call_kwargs("flux"), "latents": latents}), reference)
    assert loaded_as_encoding and not any(loaded_as_encoding)
    assert case.pipe.residency_plan().source == "measured"


def test_a_denoiser_with_no_estimate_under_the_plan_made_at_enable_is_measured_with_the_least_on_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    case = PipelineCase("flux")
    state = _enabled_with_the_plan_made_at_enable(case, monkeypatch)
    # As for a transformer with adapters loaded since: its tensors are not those its config builds.
    state.dry_runs = replace(state.dry_runs, forward=ForwardDryRun(torch.nn.Linear(4, 4)))
    in_step: list[tuple[str, list[bool], bool]] = []
    first_block = _transformer_blocks(case)[0].module
    first_block.register_forward_pre_hook(
        lambda *_: in_step.append((
            state.plan.source,
            [b.policy is Policy.RESIDENT for b in _transformer_blocks(case)],
            state.group.make_room_to_retry is None,
        ))
    )
    assert torch.equal(case.run(), case.reference)
    source, resident, no_room_to_make = in_step[0]
    assert source == "" and not any(resident), "the least plan from the denoiser's start"
    assert no_room_to_make, "no estimate to fall short: nothing runs again with room"
    assert case.pipe.residency_plan().source == "measured"


def test_a_quantized_text_encoder_makes_the_default_calls_inputs_in_the_dtype_it_computes_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    quantization = pytest.importorskip("torchao.quantization")
    case = PipelineCase("flux", dtype=torch.bfloat16)
    quantization.quantize_(case.pipe.text_encoder_2, quantization.Int8WeightOnlyConfig())
    reference = pipeline_output(case.pipe, _default_call("flux"))
    case.pipe.enable_pinned_offload("cpu", vram_budget=_budget(case))
    assert pipeline_state(case.pipe).dry_runs.default_step_need is not None, "the bfloat16 transformer's copy ran"
    _measure_on_the_cpu(case, monkeypatch)
    made = _counting_dry_runs(monkeypatch)
    assert torch.equal(pipeline_output(case.pipe, _default_call("flux")), reference)
    assert "FluxTransformer2DModel" not in made, "the call's inputs are those made at enable, bfloat16 embeddings"


def test_the_last_text_encoders_need_is_measured_before_the_denoisers_plan_offloads_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    case = PipelineCase("flux")
    case.pipe.enable_pinned_offload("cpu", vram_budget=_budget_keeping_half_the_transformer(case))
    state = pipeline_state(case.pipe)
    group = state.group
    # A peak as a CUDA allocator keeps one: the most held while the encoders ran, which offloading
    # after does not lower; each needing 1000 bytes above what is loaded.
    peak = [0]

    def record(*_: object) -> None:
        peak[0] = max(peak[0], group.loaded_bytes() + 1000)

    for encoder in (case.pipe.text_encoder, case.pipe.text_encoder_2):
        for module in encoder.modules():
            module.register_forward_pre_hook(record)
            module.register_forward_hook(record)
    monkeypatch.setattr(_device, "peak_allocated", lambda device: max(peak[0], group.loaded_bytes() + 1000))
    # A reset keeps what is allocated, the weights loaded among it.
    monkeypatch.setattr(_device, "reset_peak_allocated", lambda device: peak.__setitem__(0, group.loaded_bytes()))
    # No estimate for the denoiser: the least plan from its start offloads the blocks loaded at enable.
    state.dry_runs = replace(state.dry_runs, forward=ForwardDryRun(torch.nn.Linear(4, 4)))
    assert torch.equal(case.run(), case.reference)
    assert state.plan.activations["text_encoder_2"] == 1000 + int(state.plan.budget * 0.02), str(state.plan)


def _short_in_text_encoder(case: PipelineCase, times: int) -> list[list[bool]]:
    """Make ``case``'s T5 encoder run out of device memory at its first block ``times`` times;
    each attempt's transformer blocks on the device."""
    attempts: list[list[bool]] = []

    def short(*_: object) -> None:
        attempts.append([block.stager.loaded for block in _transformer_blocks(case)])
        if len(attempts) <= times:
            raise torch.OutOfMemoryError("short")

    case.pipe.text_encoder_2.encoder.block[0].register_forward_pre_hook(short)
    return attempts


def test_a_text_encoder_short_of_memory_under_the_plan_made_at_enable_runs_again_with_the_rest_off_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    case = PipelineCase("flux")
    _enabled_with_the_plan_made_at_enable(case, monkeypatch)
    attempts = _short_in_text_encoder(case, times=1)
    assert torch.equal(case.run(), case.reference)
    assert any(attempts[0]) and not any(attempts[1]), "run again with the blocks loaded at enable off the device"
    assert case.pipe.residency_plan().source == "measured"


def test_a_first_call_short_of_memory_under_the_plan_made_at_enable_leaves_the_next_one_the_least_on_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    case = PipelineCase("flux")
    larger = pipeline_output(case.pipe, call_kwargs("flux", height=48, width=48))
    _enabled_with_the_plan_made_at_enable(case, monkeypatch)
    # Where running it again could change its output (a stateful hook in it), nothing is run again.
    monkeypatch.setattr(retry_with_room, "_why_not_run_again", lambda *_: "it holds a cache")
    attempts = _short_in_text_encoder(case, times=1)
    with pytest.raises(torch.OutOfMemoryError):
        case.run()
    assert case.pipe.residency_plan().source == "" and not any(block.stager.loaded for block in _transformer_blocks(case))
    assert torch.equal(pipeline_output(case.pipe, call_kwargs("flux", height=48, width=48)), larger)
    assert any(attempts[0]) and not any(attempts[1]), "the next call's encoders ran with the least on the device"


def test_a_text_encoder_short_of_memory_outside_a_call_under_the_plan_made_at_enable_runs_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    case = PipelineCase("flux")
    with torch.inference_mode():
        expected = case.pipe.encode_prompt(prompt="a horse", prompt_2=None)
    _enabled_with_the_plan_made_at_enable(case, monkeypatch)
    attempts = _short_in_text_encoder(case, times=1)
    with torch.inference_mode():
        embeddings = case.pipe.encode_prompt(prompt="a horse", prompt_2=None)
    assert all(torch.equal(got.cpu(), want) for got, want in zip(embeddings, expected))
    assert any(attempts[0]) and not any(attempts[1]), "run again with the blocks loaded at enable off the device"
    assert case.pipe.residency_plan().source == ""
    assert torch.equal(case.run(), case.reference)
