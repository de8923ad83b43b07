"""A streamed denoiser's step estimated at enable from one block of each layout timed on the device
(here the CPU), with the inputs the default call's dry run gave it: the plan made at enable chosen
from it, the blocks left as the plan wants them, the process's random numbers untouched, a call of
another shape planned without it, and no estimate kept in a residency profile."""

from __future__ import annotations

import logging
from collections.abc import Hashable

import pytest
import torch
from diffusers.hooks import FirstBlockCacheConfig

from diffusers_residency import _device, block_timing, dry_runs
from diffusers_residency.bench.builders import call_kwargs, pipeline_output
from diffusers_residency.pipeline import pipeline_state
from diffusers_residency.pipeline_residency import AT_ENABLE, DRY_RUN
from diffusers_residency.plans import ResidencyPlan
from diffusers_residency.policy import Policy
from diffusers_residency.profile import CallFigures
from diffusers_residency.replayed_blocks import BlockInputs, TensorSpec, trunk_modules
from diffusers_residency.streaming import repeated_blocks

from .helpers import (
    PipelineCase,
    assert_warmed_once_per_layout,
    record_block_runs,
    sdxl_in_float16,
    warmed_encoders,
)
from .test_default_call import _budget_keeping_half_the_transformer, _default_call, _transformer_blocks
from .test_profile import _budget, _measure_on_the_cpu, _measured_pipeline


def _input_shapes(case: PipelineCase, kwargs: dict, modules: dict[Hashable, torch.nn.Module]) -> dict[Hashable, list]:
    """The shapes of the tensors each of ``modules`` is first given in a resident call of ``kwargs``, by key."""
    shapes: dict[Hashable, list] = {}

    def told(key: Hashable):
        def hook(_module: torch.nn.Module, args: tuple, module_kwargs: dict) -> None:
            leaves = torch.utils._pytree.tree_leaves((args, module_kwargs))
            shapes.setdefault(key, [(tuple(t.shape), t.dtype) for t in leaves if isinstance(t, torch.Tensor)])

        return hook

    handles = [module.register_forward_pre_hook(told(key), with_kwargs=True) for key, module in modules.items()]
    try:
        case.pipe(**kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return shapes


def _block_input_shapes(case: PipelineCase, kwargs: dict) -> dict[Hashable, list]:
    """The shapes of the tensors each transformer block is given in a resident call of ``kwargs``, by position."""
    blocks = [*case.pipe.transformer.transformer_blocks, *case.pipe.transformer.single_transformer_blocks]
    return _input_shapes(case, kwargs, dict(enumerate(blocks)))


def test_the_default_calls_dry_run_records_what_each_block_is_given() -> None:
    case = PipelineCase("flux")
    kwargs = {**_default_call("flux"), "num_inference_steps": 1, "output_type": "latent"}
    real = _block_input_shapes(case, kwargs)
    case.pipe.enable_pinned_offload("cpu", vram_budget=_budget_keeping_half_the_transformer(case))
    recorded = pipeline_state(case.pipe).dry_runs.forward.default_blocks
    doubles = len(case.pipe.transformer.transformer_blocks)
    assert sorted(recorded.keys) == sorted(real) == list(range(len(real)))
    # One key for the double-stream blocks, one for the single-stream ones: one block of each is timed.
    assert [position for position, _ in recorded.first.values()] == [0, doubles]
    for position, specs in recorded.first.values():
        leaves = torch.utils._pytree.tree_leaves(specs)
        assert [(s.shape, s.dtype) for s in leaves if isinstance(s, TensorSpec)] == real[position]


def test_the_default_calls_dry_run_records_what_each_module_of_the_trunk_is_given() -> None:
    case = PipelineCase("flux")
    kwargs = {**_default_call("flux"), "num_inference_steps": 1, "output_type": "latent"}
    trunk = {path: module for path, module, _ in trunk_modules(case.pipe.transformer)}
    real = _input_shapes(case, kwargs, trunk)
    case.pipe.enable_pinned_offload("cpu", vram_budget=_budget_keeping_half_the_transformer(case))
    recorded = pipeline_state(case.pipe).dry_runs.forward.default_blocks.trunk
    # Every module of the trunk that a call runs, once each (no two of FLUX's share a layout).
    assert sorted(path for path, _ in recorded.values()) == sorted(real)
    assert {"x_embedder", "context_embedder", "time_text_embed", "proj_out"} <= set(real)
    for path, specs in recorded.values():
        leaves = torch.utils._pytree.tree_leaves(specs)
        assert [(s.shape, s.dtype) for s in leaves if isinstance(s, TensorSpec)] == real[path], path


def test_the_default_calls_dry_run_records_what_each_encoder_is_first_given() -> None:
    """What FLUX's text encoders are first given in a call of the default shape, as in a real one:
    their token ids, padded to one length whatever the prompt."""
    case = PipelineCase("flux")
    kwargs = {**_default_call("flux"), "num_inference_steps": 1, "output_type": "latent"}
    encoders = {name: getattr(case.pipe, name) for name in ("text_encoder", "text_encoder_2")}
    real = _input_shapes(case, kwargs, encoders)
    case.pipe.enable_pinned_offload("cpu", vram_budget=_budget_keeping_half_the_transformer(case))
    recorded = pipeline_state(case.pipe).dry_runs.forward.default_encoder_inputs
    assert recorded.keys() == real.keys() == encoders.keys(), "nothing for the denoiser or the decoder"
    for name, specs in recorded.items():
        leaves = torch.utils._pytree.tree_leaves(specs)
        assert [(s.shape, s.dtype) for s in leaves if isinstance(s, TensorSpec)] == real[name], name
    assert recorded["text_encoder"][1] == {"output_hidden_states": False}, "plain arguments kept as given"


def test_a_unets_trunk_modules_and_blocks_hold_each_of_its_weights_once() -> None:
    """A UNet's blocks are its transformer blocks: its resnets, samplers and convolutions in and out
    are the trunk's, run whole where they hold no block."""
    unet = PipelineCase("sdxl").pipe.unet
    blocks = repeated_blocks(unet)
    trunk = trunk_modules(unet)
    held = [id(tensor) for _, module in blocks for tensor in module.parameters()]
    held += [id(tensor) for _, module, _ in trunk for tensor in module.parameters()]
    assert sorted(held) == sorted(id(tensor) for tensor in unet.parameters())
    paths = [path for path, _, _ in trunk]
    assert {"conv_in", "time_embedding", "down_blocks.0", "down_blocks.1.resnets.0", "conv_out"} <= set(paths), paths
    assert not any(isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)) for _, module, _ in trunk)


def test_a_unet_enabled_from_a_profile_runs_its_trunk_modules_once_each_and_calls_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SDXL's trunk modules take what a UNet passes between its blocks (an up block the skip
    connections' tuple, a resnet the time embedding): each runs once per layout and inputs as a
    float16 SDXL is enabled from a profile, and its calls stay exact."""
    _, budget = _measured_pipeline(monkeypatch, made=sdxl_in_float16)
    second = sdxl_in_float16()
    made = record_block_runs(monkeypatch)
    second.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    assert_warmed_once_per_layout(made, second.pipe)
    ran = {path for path, _ in pipeline_state(second.pipe).dry_runs.forward.default_blocks.trunk.values()}
    assert {"conv_in", "down_blocks.0", "up_blocks.1", "conv_out"} <= ran, ran
    assert torch.equal(second.run(), second.reference)


def test_a_unet_enabled_without_a_profile_runs_its_trunk_modules_once_each_after_its_timed_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without a profile the blocks run at enable to be timed, and the trunk's modules after them,
    before the plan's loads are queued; the trunk is left as the plan wants it, and calls exact."""
    case = sdxl_in_float16()
    made = record_block_runs(monkeypatch)
    case.pipe.enable_pinned_offload("cpu", vram_budget=_budget(case))
    state = pipeline_state(case.pipe)
    assert state.plan.source == AT_ENABLE and state.plan.timings["unet"].estimated, str(state.plan)
    inputs = state.dry_runs.forward.default_blocks
    trunk = [case.pipe.unet.get_submodule(path) for path, _ in inputs.trunk.values()]
    before = warmed_encoders(case.pipe)
    ran = [module for module, runs in made if runs]  # on the CPU a block is timed in one run, none before
    assert len(ran) == len(inputs.first) + len(trunk) + len(before) and len(trunk) > 1 and before, made
    after_blocks = ran[len(inputs.first) :]
    assert all(a is b for a, b in zip(after_blocks, trunk + before)), "each trunk module once, after the blocks"
    unet_trunk = next(unit for unit in state.group.units_of("unet") if unit.stream is None)
    assert unet_trunk.stager.loaded == (unet_trunk.policy is Policy.RESIDENT)
    _measure_on_the_cpu(case, monkeypatch)
    assert torch.equal(case.run(), case.reference)


def test_a_block_that_fails_to_be_timed_leaves_the_trunk_run_and_is_not_run_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A block whose timing fails (short of memory under a cap, say) gives no estimate; the trunk's
    modules still run, and the block is not run once more to fail again."""
    from diffusers.models.attention import BasicTransformerBlock

    case = sdxl_in_float16()
    ran: list[torch.nn.Module] = []
    run = block_timing._run

    def failing_blocks(module, specs, device, runs: int) -> float:
        if isinstance(module, BasicTransformerBlock):
            raise RuntimeError("out of memory")
        ran.append(module)
        return run(module, specs, device, runs)

    monkeypatch.setattr(block_timing, "_run", failing_blocks)
    case.pipe.enable_pinned_offload("cpu", vram_budget=_budget(case))
    state = pipeline_state(case.pipe)
    assert "unet" not in state.plan.timings, "no estimate"
    trunk = [case.pipe.unet.get_submodule(path) for path, _ in state.dry_runs.forward.default_blocks.trunk.values()]
    trunk += warmed_encoders(case.pipe)
    assert len(ran) == len(trunk) > 1 and all(a is b for a, b in zip(ran, trunk)), ran
    _measure_on_the_cpu(case, monkeypatch)
    assert torch.equal(case.run(), case.reference)


def test_blocks_under_a_diffusers_cache_enabled_before_are_not_run_at_enable_and_calls_stay_exact(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A first-block cache's hooks on the blocks keep their state per cache context, which only a
    call sets: run outside one, a block raises. The plan at enable is made without a step
    estimate, the trunk's modules still run, and nothing run at enable reaches the cache's state."""
    case = PipelineCase("flux")
    case.pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.05))
    reference = case.run()
    made = record_block_runs(monkeypatch)
    with caplog.at_level(logging.INFO, logger=block_timing.__name__):
        case.pipe.enable_pinned_offload("cpu", vram_budget=_budget(case))
    state = pipeline_state(case.pipe)
    assert "transformer" not in state.plan.timings and "No cache context is set" in caplog.text, caplog.text
    trunk = [case.pipe.transformer.get_submodule(path) for path, _ in state.dry_runs.forward.default_blocks.trunk.values()]
    trunk += warmed_encoders(case.pipe)
    ran = [module for module, runs in made if runs]  # on the CPU a block is timed in one run, none before
    assert len(ran) == len(trunk) > 1 and all(a is b for a, b in zip(ran, trunk)), made
    _measure_on_the_cpu(case, monkeypatch)
    assert torch.equal(case.run(), reference)
    assert torch.equal(case.run(), reference)


def test_a_streamed_text_encoder_runs_one_block_of_each_layout_and_its_trunk_at_enable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FLUX's T5 streamed would load each of its blocks to be run whole: it runs as a streamed
    denoiser does, one block of each layout and its trunk's modules, on what the default call's dry
    run gave each; its CLIP encoder, hooked whole, runs whole. Both are left as the plan wants them."""
    case = PipelineCase("flux")
    made = record_block_runs(monkeypatch)
    budget = _budget_keeping_half_the_transformer(case)
    case.pipe.enable_pinned_offload("cpu", vram_budget=budget, components={"text_encoder_2": "streamed"})
    state = pipeline_state(case.pipe)
    ran = [module for module, runs in made if runs]
    t5 = case.pipe.text_encoder_2
    assert not any(m is t5 for m in ran), "not run whole"
    recorded = state.dry_runs.forward.default_encoder_blocks["text_encoder_2"]
    blocks = [unit.module for unit in state.group.stream_of("text_encoder_2").blocks]
    trunk = [t5.get_submodule(path) for path, _ in recorded.trunk.values()]
    of_t5 = [m for m in ran if any(m is part for part in t5.modules())]
    assert len(recorded.first) == 2 and len(of_t5) == 2 + len(trunk), made  # its first block has a layout of its own
    assert all(any(m is block for block in blocks) for m in of_t5[:2]) and trunk and of_t5[2:] == trunk, made
    assert case.pipe.text_encoder in ran
    for unit in [*state.group.units_of("text_encoder"), *state.group.units_of("text_encoder_2")]:
        assert unit.stager.loaded == (unit.policy is Policy.RESIDENT), unit.name
    assert torch.equal(case.run(), case.reference)


def test_an_encoder_that_fails_to_run_at_enable_leaves_the_others_run(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    case = sdxl_in_float16()
    ran: list[torch.nn.Module] = []
    run = block_timing._run

    def failing_first_encoder(module, specs, device, runs: int) -> float:
        if module is case.pipe.text_encoder:
            raise RuntimeError("out of memory")
        ran.append(module)
        return run(module, specs, device, runs)

    monkeypatch.setattr(block_timing, "_run", failing_first_encoder)
    with caplog.at_level(logging.INFO, logger=block_timing.__name__):
        case.pipe.enable_pinned_offload("cpu", vram_budget=_budget(case))
    assert "Kernels of 'text_encoder' not run ahead: 'text_encoder' failed (out of memory)" in caplog.text
    assert ran[-1] is case.pipe.text_encoder_2, "the encoder after it still runs"
    clip = pipeline_state(case.pipe).group.units_of("text_encoder")[0]
    assert clip.stager.loaded == (clip.policy is Policy.RESIDENT), "left as the plan wants it"
    _measure_on_the_cpu(case, monkeypatch)
    assert torch.equal(case.run(), case.reference)


@pytest.mark.parametrize("with_profile", [False, True], ids=["without-a-profile", "from-a-profile"])
def test_an_encoder_the_plan_keeps_resident_is_loaded_once_at_enable_and_run_there(
    monkeypatch: pytest.MonkeyPatch, with_profile: bool
) -> None:
    """Its run comes after the plan's loads ahead, where it is already loaded: not loaded, run,
    offloaded and loaded again."""
    policies = {"text_encoder": "resident"}
    if with_profile:
        first = sdxl_in_float16()
        budget = _budget(first)
        first.pipe.enable_pinned_offload("cpu", vram_budget=budget, components=policies)
        _measure_on_the_cpu(first, monkeypatch)
        assert torch.equal(first.run(), first.reference)
    case = sdxl_in_float16()
    made = record_block_runs(monkeypatch)
    case.pipe.enable_pinned_offload("cpu", vram_budget=budget if with_profile else _budget(case), components=policies)
    clip = pipeline_state(case.pipe).group.units_of("text_encoder")[0]
    assert clip.policy is Policy.RESIDENT and clip.stager.loaded and clip.stager.loads == 1, clip.stager.loads
    assert any(module is case.pipe.text_encoder for module, runs in made if runs), made
    _measure_on_the_cpu(case, monkeypatch)
    assert torch.equal(case.run(), case.reference)


def test_enabled_again_after_calls_a_pipeline_keeps_the_trunk_its_calls_left_loaded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, budget = _measured_pipeline(monkeypatch)
    case = PipelineCase("flux")
    case.pipe.enable_pinned_offload("cpu", vram_budget=budget)  # from the profile just saved
    assert torch.equal(case.run(), case.reference)
    state = pipeline_state(case.pipe)
    trunk = next(unit for unit in state.group.units_of("transformer") if unit.stream is None)
    assert trunk.stager.loaded
    made = record_block_runs(monkeypatch)
    case.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    assert made and trunk.stager.loaded, "its modules run again, on the trunk as it was"
    loaded = trunk.stager.loaded_bytes
    assert torch.equal(case.run(), case.reference)
    assert trunk.stager.loaded_bytes == loaded, "the next call loads no trunk"


def test_a_device_a_module_was_given_in_the_dry_run_is_the_one_it_runs_on() -> None:
    specs = ((TensorSpec((2, 3), torch.float32),), {"device": torch.device("meta"), "scale": 0.5})
    args, kwargs = block_timing._materialized(specs, torch.device("cpu"))
    assert args[0].device == torch.device("cpu") and args[0].shape == (2, 3)
    assert kwargs == {"device": torch.device("cpu"), "scale": 0.5}


def test_trunk_inputs_holding_an_object_that_pytree_does_not_open_are_not_kept() -> None:
    class Holder:
        def __init__(self) -> None:
            self.mask = torch.empty(2, device="meta")

    layout = (torch.nn.Linear, ())
    hidden = torch.empty(2, 3, device="meta")
    recorded = BlockInputs(trunk={})
    recorded.record_trunk("held", layout, (hidden,), {"mask": Holder()})
    recorded.record_trunk("plain", layout, (hidden,), {"device": hidden.device, "scale": 0.5})
    assert [path for path, _ in recorded.trunk.values()] == ["plain"]
    unrecorded = BlockInputs()  # a decoder's: its trunk is not run ahead
    unrecorded.record_trunk("plain", layout, (hidden,), {})
    assert unrecorded.trunk is None


def test_block_inputs_holding_an_object_are_not_kept_and_time_no_step() -> None:
    """A decoder-style text encoder's layers are given the dry run's KV cache: kept, its meta
    tensors would reach the real layer at enable (and a layer that ran would fill the cache)."""

    class Cache:
        def __init__(self) -> None:
            self.keys = [torch.empty(2, device="meta")]

    hidden = torch.empty(2, 3, device="meta")
    recorded = BlockInputs()
    recorded.record(0, "layer", (hidden,), {"cache": Cache()})
    recorded.record(1, "layer", (hidden,), {"cache": None})
    recorded.record(2, "other", (hidden,), {"cache": Cache()})
    assert recorded.keys == {0: "layer", 1: "layer", 2: "other"}
    assert list(recorded.first) == ["layer"] and recorded.first["layer"][0] == 1, "the first block given what is kept"
    assert not recorded.every_key_kept, "no step is timed from them"


def test_a_block_reached_by_another_path_is_no_module_of_the_trunk() -> None:
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

    class Wrapper(torch.nn.Module):
        def __init__(self, block: torch.nn.Module) -> None:
            super().__init__()
            self.inner, self.norm = block, torch.nn.LayerNorm(4)

    class Model(torch.nn.Module):
        _no_split_modules = ["Block"]

        def __init__(self) -> None:
            super().__init__()
            self.embed, self.blocks = torch.nn.Linear(4, 4), torch.nn.ModuleList([Block(), Block()])
            self.alias, self.wrapper = self.blocks[0], Wrapper(self.blocks[1])
            self.proj = torch.nn.Linear(4, 4)
            self.proj_again = self.proj

    model = Model()
    assert [path for path, _ in repeated_blocks(model)] == ["blocks.0", "blocks.1"]
    # The alias is a block, the wrapper holds one (its norm is the trunk's), the projection is listed once.
    assert [path for path, _, _ in trunk_modules(model)] == ["embed", "wrapper.norm", "proj"]


def test_the_plan_made_at_enable_is_chosen_from_its_denoisers_blocks_timed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    case = PipelineCase("flux")
    timed: list[str] = []
    seconds: list[float] = []
    real_timed = block_timing._timed

    def timed_block(block, *rest):
        timed.append(block.name)
        result = real_timed(block, *rest)
        seconds.append(result[0])
        return result

    monkeypatch.setattr(block_timing, "_timed", timed_block)
    random_state = torch.get_rng_state()
    caplog.set_level(logging.INFO, logger="diffusers_residency.adaptive")
    case.pipe.enable_pinned_offload("cpu", vram_budget=_budget_keeping_half_the_transformer(case))
    state = pipeline_state(case.pipe)
    assert torch.equal(torch.get_rng_state(), random_state), "the user's random numbers are the user's"
    assert timed == ["transformer.transformer_blocks.0", "transformer.single_transformer_blocks.0"]
    step = state.plan.timings["transformer"]
    assert step.estimated and step.compute_per_byte > 0 and step.load_per_byte > 0
    # Each block's share of the step is its layout's timed block's.
    transformer = case.pipe.transformer
    doubles, singles = len(transformer.transformer_blocks), len(transformer.single_transformer_blocks)
    per_block = [seconds[0]] * doubles + [seconds[1]] * singles
    assert step.compute_shares == pytest.approx([block / sum(per_block) for block in per_block])
    assert state.plan.source == AT_ENABLE and "chosen from a step estimated from blocks timed" in str(state.plan)
    assert "transformer's step" in caplog.text and "from blocks of it timed" in caplog.text
    # The timed blocks went back to their masters unless the plan keeps them: nothing else is loaded.
    blocks = _transformer_blocks(case)
    assert [block.stager.loaded for block in blocks] == [block.policy is Policy.RESIDENT for block in blocks]
    assert state.group.units_of("transformer")[1].stream._recording == [], "run under no hook: no pass recorded"
    _measure_on_the_cpu(case, monkeypatch)
    assert torch.equal(case.run(), case.reference)


def test_a_timed_block_is_left_on_its_masters() -> None:
    case = PipelineCase("flux")
    case.pipe.enable_pinned_offload("cpu", vram_budget=_budget_keeping_half_the_transformer(case))
    state = pipeline_state(case.pipe)
    position, specs = next(iter(state.dry_runs.forward.default_blocks.first.values()))
    block = _transformer_blocks(case)[position]
    block.stager.offload()
    block_timing._timed(block, specs, state.group.device)
    assert not block.stager.loaded


def test_no_step_is_estimated_where_a_block_did_not_run_in_the_dry_run() -> None:
    case = PipelineCase("flux")
    case.pipe.enable_pinned_offload("cpu", vram_budget=_budget_keeping_half_the_transformer(case))
    state = pipeline_state(case.pipe)
    recorded = state.dry_runs.forward.default_blocks
    # The first block skipped.
    skipped = BlockInputs(dict(list(recorded.keys.items())[1:]), recorded.first, recorded.blocks)
    sizes = next(s for s in state.plan.sizes if s.name == "transformer")
    assert block_timing.estimated_step(state.group, sizes, skipped) is None
    assert block_timing.estimated_step(state.group, sizes, recorded) is not None


def test_blocks_a_call_does_not_run_need_no_warm_up_and_leave_the_others_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A block the dry run did not reach (a vision tower's in a text encoder used for text) is not
    run at enable; the others and the trunk are, where no step could be timed from them."""
    case = PipelineCase("flux")
    case.pipe.enable_pinned_offload("cpu", vram_budget=_budget_keeping_half_the_transformer(case))
    state = pipeline_state(case.pipe)
    recorded = state.dry_runs.forward.default_blocks
    reached = dict(list(recorded.keys.items())[:-1])  # the last block not reached
    skipped = BlockInputs(reached, recorded.first, recorded.blocks, recorded.trunk)
    made = record_block_runs(monkeypatch)
    block_timing.warm_kernels(state.group, "transformer", skipped)
    blocks = [unit.module for unit in state.group.stream_of("transformer").blocks]
    trunk = [case.pipe.transformer.get_submodule(path) for path, _ in recorded.trunk.values()]
    ran = [module for module, _ in made]
    assert [blocks[position] for position, _ in recorded.first.values()] + trunk == ran, made
    assert torch.equal(case.run(), case.reference)



def test_blocks_that_cannot_be_timed_run_untimed_at_enable_where_the_plan_streams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the plan made at enable streams the denoiser's blocks but they cannot be timed (a layout
    given what cannot be kept, an object: the tiny pipelines' blocks never are, so one layout's
    record is dropped here, as the dry run drops such inputs), no step is estimated, and the blocks
    of the layouts kept still run once, untimed, before the trunk's modules."""
    real = dry_runs.ForwardDryRun.need_at_defaults

    def dropping_a_layout(self, pipe, name):
        need = real(self, pipe, name)
        self.default_blocks.first.pop(next(iter(self.default_blocks.first)))
        return need

    monkeypatch.setattr(dry_runs.ForwardDryRun, "need_at_defaults", dropping_a_layout)
    case = PipelineCase("flux")
    made = record_block_runs(monkeypatch)
    case.pipe.enable_pinned_offload("cpu", vram_budget=_budget_keeping_half_the_transformer(case))
    state = pipeline_state(case.pipe)
    inputs = state.dry_runs.forward.default_blocks
    assert not inputs.every_key_kept and "transformer" not in state.plan.timings, str(state.plan)
    assert state.plan["transformer"].policy is Policy.STREAMED
    blocks = [unit.module for unit in state.group.stream_of("transformer").blocks]
    kept = [blocks[position] for position, _ in inputs.first.values()]
    ran = [module for module, runs in made if runs]
    assert len(kept) == 1 and ran[:1] == kept and [runs for _, runs in made[:1]] == [1], made
    assert torch.equal(case.run(), case.reference)

def _plan_as_the_first_block_starts(case: PipelineCase) -> list[ResidencyPlan]:
    state = pipeline_state(case.pipe)
    plans: list[ResidencyPlan] = []
    case.pipe.transformer.transformer_blocks[0].register_forward_pre_hook(lambda *_: plans.append(state.plan))
    return plans


@pytest.mark.parametrize("default_shape", [True, False])
def test_a_call_plans_from_the_step_estimated_at_enable_only_if_it_is_of_the_default_shape(
    default_shape: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = PipelineCase("flux")  # its tiny call is 32x32, its default 1024x1024
    case.pipe.enable_pinned_offload("cpu", vram_budget=_budget_keeping_half_the_transformer(case))
    _measure_on_the_cpu(case, monkeypatch)
    estimate = pipeline_state(case.pipe).plan.timings["transformer"]
    plans = _plan_as_the_first_block_starts(case)
    kwargs = {**_default_call("flux"), "num_inference_steps": 1} if default_shape else call_kwargs("flux")
    pipeline_output(case.pipe, kwargs)
    assert plans[0].source == DRY_RUN
    assert plans[0].timings.get("transformer") == (estimate if default_shape else None)


@pytest.mark.parametrize("default_shape", [True, False])
def test_a_call_that_times_a_step_plans_its_other_steps_from_it(
    default_shape: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = PipelineCase("flux")

    def kwargs() -> dict:
        # The default shape's call returns latents: a decode at 1024x1024 would take the CPU a while.
        return {**_default_call("flux"), "output_type": "latent"} if default_shape else call_kwargs("flux")

    reference = case.pipe(**{**kwargs(), "num_inference_steps": 4}, return_dict=False)[0]
    case.pipe.enable_pinned_offload("cpu", vram_budget=_budget_keeping_half_the_transformer(case))
    _measure_on_the_cpu(case, monkeypatch)
    plans = _plan_as_the_first_block_starts(case)
    assert torch.equal(case.pipe(**{**kwargs(), "num_inference_steps": 4}, return_dict=False)[0], reference)
    timings = [plan.timings.get("transformer") for plan in plans]
    assert (timings[0] is not None and timings[0].estimated) if default_shape else timings[0] is None
    assert not timings[-1].estimated, "its steps after the one timed are planned from that step"


def test_a_step_estimated_at_enable_is_kept_as_estimated_until_a_step_is_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    case = PipelineCase("flux")
    case.pipe.enable_pinned_offload("cpu", vram_budget=_budget_keeping_half_the_transformer(case))
    _measure_on_the_cpu(case, monkeypatch)
    state = pipeline_state(case.pipe)
    kwargs = {**_default_call("flux"), "num_inference_steps": 2}  # of the default shape; two steps time none
    pipeline_output(case.pipe, kwargs)
    assert state.plan.timings["transformer"].estimated, "the plan keeps what it was chosen from"
    figures = state.profile.shapes[state.shape]
    # Saved as estimated, so that a process planning from it times its step, as this one does next.
    assert figures.timings["transformer"].estimated and not figures.retimed
    assert CallFigures.from_json(figures.as_json()) == figures
    # Timed under the plan, however close to the estimate, the step timed replaces it.
    monkeypatch.setattr("diffusers_residency.retiming._moved", lambda *_: False)
    case.pipe(**{**kwargs, "num_inference_steps": 4, "output_type": "latent"})
    assert not state.plan.timings["transformer"].estimated


def test_a_block_that_cannot_be_timed_leaves_the_plan_chosen_by_bytes(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    case = PipelineCase("flux")

    def out_of_memory(*_: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory (injected: inputs for a block timed at enable)")

    monkeypatch.setattr(block_timing, "_materialized", out_of_memory)
    caplog.set_level(logging.INFO, logger="diffusers_residency.block_timing")
    case.pipe.enable_pinned_offload("cpu", vram_budget=_budget_keeping_half_the_transformer(case))
    state = pipeline_state(case.pipe)
    assert "No step estimate for 'transformer'" in caplog.text
    assert state.plan.source == AT_ENABLE and state.plan.timings == {}
    blocks = _transformer_blocks(case)
    assert [block.stager.loaded for block in blocks] == [block.policy is Policy.RESIDENT for block in blocks]
    _measure_on_the_cpu(case, monkeypatch)
    assert torch.equal(case.run(), case.reference)


def test_a_compiled_block_is_not_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    case = PipelineCase("flux")
    case.pipe.transformer.single_transformer_blocks[0].compile()  # compiled lazily: nothing compiles here
    timed: list[str] = []
    monkeypatch.setattr(block_timing, "_timed", lambda block, *_: timed.append(block.name))
    case.pipe.enable_pinned_offload("cpu", vram_budget=_budget_keeping_half_the_transformer(case))
    assert timed == [] and pipeline_state(case.pipe).plan.timings == {}


def test_a_compiled_trunk_is_not_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    case = PipelineCase("flux")
    case.pipe.transformer.compile()  # compiled lazily: nothing compiles here
    timed: list[str] = []
    monkeypatch.setattr(block_timing, "_timed", lambda block, *_: timed.append(block.name))
    case.pipe.enable_pinned_offload("cpu", vram_budget=_budget_keeping_half_the_transformer(case))
    assert timed == [] and pipeline_state(case.pipe).plan.timings == {}


@pytest.mark.parametrize("sign", ["retry", "peak"])
def test_what_the_encoders_run_at_enable_make_the_device_do_is_no_shortfall_of_call_1(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, sign: str
) -> None:
    """Enabled from a profile, the encoders run once the plan is in place, its resident weights
    loaded: an allocator retry while they run, or a peak over the budget (the CPU has neither: made
    at that run), is neither the first component's of call 1, planned again with more room, nor
    any other's."""
    first = sdxl_in_float16()
    budget = _budget(first)
    first.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    _measure_on_the_cpu(first, monkeypatch)
    assert torch.equal(first.run(), first.reference)
    case = sdxl_in_float16()
    retries, peak, strained = [0], [0], []
    monkeypatch.setattr(_device, "allocator_retries", lambda device: retries[0])
    monkeypatch.setattr(_device, "reset_peak_allocated", lambda device: peak.__setitem__(0, 0))
    run = block_timing._run

    def straining_the_device(module, specs, device, runs: int) -> float:
        if module is case.pipe.text_encoder:
            strained.append(module)
            if sign == "retry":
                retries[0] += 1
            else:
                peak[0] = budget + 1
        return run(module, specs, device, runs)

    monkeypatch.setattr(block_timing, "_run", straining_the_device)
    case.pipe.enable_pinned_offload("cpu", vram_budget=budget)  # from the profile just saved
    assert strained, "the text encoder ran at enable"
    planned = case.pipe.residency_plan()
    # The peak a CUDA allocator would report (see _measure_on_the_cpu), the one made at enable
    # included until a reset takes it.
    loaded = pipeline_state(case.pipe).group.loaded_bytes
    monkeypatch.setattr(_device, "peak_allocated", lambda device: max(peak[0], loaded() + 1000))
    with caplog.at_level(logging.INFO, logger="diffusers_residency"):
        assert torch.equal(case.run(), case.reference)
    assert "retried" not in caplog.text and "over vram_budget" not in caplog.text
    assert pipeline_state(case.pipe).retry_replans == {}
    assert case.pipe.residency_plan().components == planned.components
