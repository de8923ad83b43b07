"""Block streaming and VRAM budgets on a real tiny Flux pipeline, on the CPU: outputs equal resident."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from diffusers.hooks import FirstBlockCacheConfig

from diffusers_residency import (
    BudgetTooSmallError,
    ModuleStager,
    ResidencyGroup,
    _device,
    attach_block_streaming,
    detach_staging_hook,
    residency,
    retiming,
)
from diffusers_residency._device import MemoryTelemetry
from diffusers_residency.bench.builders import call_kwargs, pipeline_output
from diffusers_residency.budget_watch import BudgetWatch
from diffusers_residency.components import component_sizes, module_components
from diffusers_residency.pipeline import pipeline_state
from diffusers_residency.pipeline_residency import AT_ENABLE, RESERVE_MARGIN, apply_plan, replan_in_place
from diffusers_residency.planner import MIN_RESERVE_BYTES, plan_residency
from diffusers_residency.plans import PREFETCH_BLOCKS
from diffusers_residency.policy import Policy
from diffusers_residency.residency import ResidencyUnit
from diffusers_residency.step_timing import StepTiming
from diffusers_residency.streaming import STEPS_TIMED, repeated_blocks
from diffusers_residency.text import format_bytes

from .helpers import (
    RESERVE,
    PipelineCase,
    assert_no_meta_or_foreign_device,
    assert_weights_equal,
    count_device_allocations,
    streaming_budget,
)


def _record_loaded_bytes(flux: PipelineCase) -> list[int]:
    """After every block of every component runs, what the group holds on the device."""
    group = pipeline_state(flux.pipe).group
    seen: list[int] = []
    for unit in group.units:
        if unit.stream is not None:
            unit.module.register_forward_hook(lambda *_: seen.append(group.loaded_bytes()))
    return seen


# A call of the pipelines these watches stand for starts with its text encoder and ends with its VAE.
CALL_ENDS = {"call_start": "text_encoder", "call_end": "vae"}
# How long a test stalls each block to stretch a step it times: several times what a whole step
# of the tiny pipeline takes on a two-core machine with other work on it, so that a stretched step
# and a plain one stay apart by more than twice there too.
STALL_SECONDS = 0.25


def watch_budget(group: ResidencyGroup, on_over_budget: Callable[[str, int, bool], None], **kwargs: Any) -> BudgetWatch:
    """A watch of a 100-byte budget on ``group``, made as adaptive makes one."""
    group.budget_watch = BudgetWatch(group.device, group.retention, group.loaded_bytes, 100, on_over_budget, **kwargs)
    return group.budget_watch

def test_budget_streams_the_transformer_within_the_budget(flux: PipelineCase) -> None:
    before = flux.state()
    budget = streaming_budget(flux)
    flux.pipe.enable_pinned_offload("cpu", vram_budget=budget, activation_reserve=RESERVE)
    plan = flux.pipe.residency_plan()
    assert plan["transformer"].policy is Policy.STREAMED and len(plan["transformer"].resident_blocks) > 0, str(plan)
    seen = _record_loaded_bytes(flux)

    assert torch.equal(flux.run(), flux.reference)
    assert torch.equal(flux.run(), flux.reference)
    assert seen and max(seen) <= budget - RESERVE, (max(seen), budget - RESERVE, str(plan))
    report = flux.pipe.residency_report()
    assert report["transformer"].policy == "streamed"
    steps = call_kwargs("flux")["num_inference_steps"]
    streamed = [u for u in pipeline_state(flux.pipe).group.units_of("transformer") if u.policy is Policy.STREAMED and u.stream]
    resident = [u for u in pipeline_state(flux.pipe).group.units_of("transformer") if u.policy is Policy.RESIDENT]
    assert all(u.stager.loads >= steps for u in streamed), "streamed blocks load at every step"
    assert all(u.stager.loads == 1 for u in resident), "the trunk and the resident prefix load once"

    flux.pipe.disable_pinned_offload()
    assert_weights_equal(before, flux.state())
    assert_no_meta_or_foreign_device(flux.pipe)
    assert torch.equal(flux.run(), flux.reference)


def test_new_budget_moves_the_resident_prefix_and_keeps_the_masters(flux: PipelineCase) -> None:
    flux.pipe.enable_pinned_offload("cpu", vram_budget=streaming_budget(flux), activation_reserve=RESERVE)
    plan = flux.pipe.residency_plan()
    first = len(plan["transformer"].resident_blocks)
    group = pipeline_state(flux.pipe).group
    stagers = [u.stager for u in group.units]
    assert torch.equal(flux.run(), flux.reference)

    # An ample budget, the same components streamed (they would be resident otherwise).
    streamed = {p.name: "streamed" for p in plan.components if p.policy is Policy.STREAMED}
    flux.pipe.enable_pinned_offload("cpu", components=streamed, vram_budget=10**9, activation_reserve=RESERVE)
    assert len(flux.pipe.residency_plan()["transformer"].resident_blocks) == 6 > first
    assert [u.stager for u in pipeline_state(flux.pipe).group.units] == stagers, "masters kept"
    assert torch.equal(flux.run(), flux.reference)
    assert all(u.stager.loaded for u in group.units_of("transformer")), "all blocks resident now"


def test_too_small_budget_is_refused_before_anything_changes(flux: PipelineCase) -> None:
    with pytest.raises(BudgetTooSmallError, match="too small"):
        flux.pipe.enable_pinned_offload("cpu", vram_budget=2000, activation_reserve=RESERVE)
    with pytest.raises(ValueError, match="leaves nothing"):
        flux.pipe.enable_pinned_offload("cpu", vram_budget="1MB", activation_reserve="2MB")
    with pytest.raises(ValueError, match="unknown residency policy"):
        flux.pipe.enable_pinned_offload("cpu", components={"text_encoder": "sometimes"}, vram_budget="auto")
    with pytest.raises(ValueError, match="is not a size"):
        flux.pipe.enable_pinned_offload("cpu", vram_budget="plenty")
    # A reserve is checked whether or not there is a budget to plan for (the CPU has no free memory
    # to read for "auto"): never taken and ignored.
    for budget in (None, "auto"):
        with pytest.raises(ValueError, match="activation_reserve='some' is not a size"):
            flux.pipe.enable_pinned_offload("cpu", vram_budget=budget, activation_reserve="some")
        with pytest.raises(ValueError, match="activation_reserve must be positive"):
            flux.pipe.enable_pinned_offload("cpu", vram_budget=budget, activation_reserve=-1)
    assert not any(hasattr(m, "_hf_hook") for m in flux.pipe.components.values())
    assert torch.equal(flux.run(), flux.reference)


def test_a_budget_larger_than_the_device_is_refused_before_anything_changes(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The CPU reports no memory: a device's figures stand in, as an accelerator's allocator gives them.
    device = MemoryTelemetry(reserved=0, allocated=0, free=10**9, total=2 * 10**9)
    monkeypatch.setattr(_device, "read_memory_telemetry", lambda device_: device)
    with pytest.raises(ValueError, match=r"vram_budget 3.00 GB is more than cpu has \(2.00 GB\)"):
        flux.pipe.enable_pinned_offload("cpu", vram_budget="3GB")
    assert not any(hasattr(m, "_hf_hook") for m in flux.pipe.components.values())
    flux.pipe.enable_pinned_offload("cpu", vram_budget="2GB")
    assert torch.equal(flux.run(), flux.reference)


def test_a_budget_the_weights_alone_do_not_fit_names_what_they_need(flux: PipelineCase) -> None:
    """With the default reserve, a budget too small for the weights says what they need alone, the
    smallest budget that is planned, not that and a reserve of gigabytes."""
    sizes = component_sizes(flux.pipe, module_components(flux.pipe))
    weights = plan_residency(sizes, 10**12, 0, least=True).peak_weight_bytes
    alone = f"needs {format_bytes(weights)} at its largest moment for its weights alone"
    with pytest.raises(BudgetTooSmallError, match=alone):
        flux.pipe.enable_pinned_offload("cpu", vram_budget=weights - 1)
    flux.pipe.enable_pinned_offload("cpu", vram_budget=weights + 1000)
    assert torch.equal(flux.run(), flux.reference)


@pytest.mark.parametrize("cache_first", [True, False], ids=["cache-then-streaming", "streaming-then-cache"])
def test_first_block_cache_skipping_blocks_neither_stalls_nor_corrupts(cache_first: bool) -> None:
    flux = PipelineCase("flux")
    transformer = flux.pipe.transformer
    # A threshold no residual change reaches: every step after the first skips all blocks but the first.
    config = FirstBlockCacheConfig(threshold=1e9)
    transformer.enable_cache(config)
    reference = flux.run()
    transformer.disable_cache()
    if cache_first:
        transformer.enable_cache(config)
    flux.pipe.enable_pinned_offload("cpu", components={"transformer": "streamed"}, vram_budget=None)
    if not cache_first:
        transformer.enable_cache(config)
    assert torch.equal(flux.run(), reference)
    assert torch.equal(flux.run(), reference)
    last = pipeline_state(flux.pipe).group.units_of("transformer")[-1]
    steps = call_kwargs("flux")["num_inference_steps"]
    if not cache_first:
        # The cache's hook runs first and skips the block before staging sees it.
        assert last.stager.loads < 2 * steps, "blocks were skipped, so they were not loaded at every step"


@pytest.mark.parametrize("level", [1, 2])
def test_streamed_component_sleeps_and_wakes(flux: PipelineCase, level: int) -> None:
    flux.pipe.enable_pinned_offload("cpu", components={"transformer": "streamed", "text_encoder_2": "streamed"}, vram_budget=None)
    assert torch.equal(flux.run(), flux.reference)
    flux.pipe.sleep(level=level)
    report = flux.pipe.residency_report()
    assert report.device_bytes == 0 and report["transformer"].sleep_level == level, str(report)
    if level == 2:
        assert report["transformer"].mapped_bytes >= 0.95 * report["transformer"].weight_bytes, str(report)
    assert torch.equal(flux.run(), flux.reference), "a call wakes what it needs"
    flux.pipe.sleep(level=level)
    flux.pipe.wake_up()
    assert not flux.pipe.is_sleeping
    assert torch.equal(flux.run(), flux.reference)


def test_script_streams_a_component_through_a_group(flux: PipelineCase) -> None:
    before = flux.state()
    group = ResidencyGroup("cpu")
    transformer = flux.pipe.transformer
    for positions in ([0, 99], [True]):  # True is 1 to Python, and no position
        with pytest.raises(ValueError, match="not positions"):
            attach_block_streaming(transformer, group, name="transformer", resident_blocks=positions)
    assert group.units == [] and not hasattr(transformer, "_hf_hook")
    attach_block_streaming(transformer, group, name="transformer", resident_blocks=[0])
    stream = group.units_of("transformer")[1].stream
    assert stream.order[0] == "transformer.transformer_blocks.0"
    assert torch.equal(flux.run(), flux.reference)
    assert torch.equal(flux.run(), flux.reference)
    with pytest.raises(ValueError, match="too few to stream"):
        attach_block_streaming(flux.pipe.vae.decoder.mid_block, group, name="mid_block")  # two resnets
    detach_staging_hook(transformer)
    assert group.units == [] and not any(hasattr(m, "_hf_hook") for m in transformer.modules())
    assert_weights_equal(before, flux.state())
    assert torch.equal(flux.run(), flux.reference)


def _record_loaded_while_running(blocks: list, policy: Policy) -> dict[str, list[str]]:
    """Record, as each block's forward ends the first time, which blocks of ``policy`` are loaded."""
    loaded_while_running: dict[str, list[str]] = {}

    def record(unit):
        def hook(*_):
            loaded = [b.name for b in blocks if b.policy is policy and b.stager.loaded]
            loaded_while_running.setdefault(unit.name, loaded)

        return hook

    for unit in blocks:
        unit.module.register_forward_hook(record(unit))
    return loaded_while_running


def test_a_resident_block_loads_one_streamed_block_more_ahead(flux: PipelineCase) -> None:
    # A running resident block holds no slot of the window, so the window's 1 + 2 slots all load ahead.
    group = ResidencyGroup("cpu")
    attach_block_streaming(flux.pipe.transformer, group, name="transformer", resident_blocks=[0], prefetch_blocks=2)
    blocks = group.units_of("transformer")[1:]
    loaded_while_running = _record_loaded_while_running(blocks, Policy.STREAMED)
    assert torch.equal(flux.run(), flux.reference)
    names = [b.name for b in blocks]
    assert loaded_while_running[names[0]] == names[1:4], "three streamed blocks ahead of a resident one"
    assert loaded_while_running[names[2]] == names[2:5], "a streamed block and the two after it"
    detach_staging_hook(flux.pipe.transformer)


def test_a_component_that_runs_one_pass_at_a_time_stops_loading_its_top_blocks_for_a_next_pass(flux: PipelineCase) -> None:
    group = ResidencyGroup("cpu")
    for name in ("text_encoder_2", "transformer"):
        attach_block_streaming(getattr(flux.pipe, name), group, name=name, prefetch_blocks=2)
    encoder, transformer = (group.units_of(name)[1:] for name in ("text_encoder_2", "transformer"))

    def loads_of_a_call(run: Callable[[], torch.Tensor] = flux.run) -> tuple[int, int]:
        before = [sum(b.stager.loads for b in blocks) for blocks in (encoder, transformer)]
        assert torch.equal(run(), flux.reference)
        return tuple(sum(b.stager.loads for b in blocks) - n for blocks, n in zip((encoder, transformer), before))

    first, second, third = loads_of_a_call(), loads_of_a_call(), loads_of_a_call()
    # The encoder's first call wraps its window around, loading its top two blocks again behind
    # its last ones; one pass seen, it loads each block once a call. The transformer's steps go on
    # taking its top blocks from the end of the step before.
    assert first[0] == len(encoder) + 2 and second[0] == third[0] == len(encoder), (first, second, third)
    assert first[1] == second[1] == third[1], "the denoiser's windows still wrap around"
    ids = flux.pipe.tokenizer_2("a prompt", return_tensors="pt").input_ids
    with torch.no_grad():  # two passes in one activation (the call after it runs in it too)
        flux.pipe.text_encoder_2(ids)
        flux.pipe.text_encoder_2(ids)
    loads_of_a_call()
    assert loads_of_a_call()[0] == len(encoder) + 2, "learned as its next activation starts: it wraps around again"
    for name in ("text_encoder_2", "transformer"):
        detach_staging_hook(getattr(flux.pipe, name))


def test_a_measuring_call_wraps_the_windows_of_a_component_that_runs_one_pass_at_a_time(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its need is its peak less what is loaded as the next component starts: the window wrapped
    # around holds then what it held at the peak.
    references = {size: pipeline_output(flux.pipe, call_kwargs("flux", height=size, width=size)) for size in (32, 48)}
    sizes = component_sizes(flux.pipe, module_components(flux.pipe))
    budget = plan_residency(sizes, 10**12, 3 << 30, least=True).peak_weight_bytes + (3 << 30)  # calls measured
    flux.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    # What the components need leaves the text encoder no block to keep once measured (the plan's
    # margin is 2 % of the budget).
    need = (3 << 30) - budget // 50 - (16 << 10)
    monkeypatch.setattr(_device, "peak_allocated", lambda device: pipeline_state(flux.pipe).group.loaded_bytes() + need)
    encoder = pipeline_state(flux.pipe).group.units_of("text_encoder_2")[1:]
    loads = []
    for size in (32, 32, 48):
        before = sum(b.stager.loads for b in encoder)
        assert torch.equal(pipeline_output(flux.pipe, call_kwargs("flux", height=size, width=size)), references[size])
        loads.append(sum(b.stager.loads for b in encoder) - before)
    assert flux.pipe.residency_plan()["text_encoder_2"].resident_blocks == frozenset()
    assert loads == [len(encoder) + 2, len(encoder), len(encoder) + 2], "measured, planned, a new shape measured"


@pytest.mark.parametrize("tie", ["trunk and block", "two blocks"])
def test_a_transformer_whose_blocks_share_weights_is_staged_whole_never_streamed(flux: PipelineCase, tie: str) -> None:
    # A tensor staged with one holder would be on the host when the other runs.
    budget = streaming_budget(flux)  # one under which the transformer, untied, streams
    transformer = flux.pipe.transformer
    blocks = transformer.single_transformer_blocks
    if tie == "trunk and block":
        transformer.time_text_embed.timestep_embedder.linear_2.weight = blocks[2].attn.to_q.weight
    else:
        blocks[1].norm = blocks[0].norm
    reference = flux.run()
    before = flux.state()
    with pytest.raises(ValueError, match="sharing no weight with each other or the rest of it"):
        flux.pipe.enable_pinned_offload("cpu", components={"transformer": "streamed"})
    with pytest.raises(ValueError, match="sharing no weight with each other or the rest of it"):
        attach_block_streaming(transformer, ResidencyGroup("cpu"), name="transformer")
    assert not any(hasattr(module, "_hf_hook") for module in transformer.modules()), "refused before any hook"
    flux.pipe.enable_pinned_offload("cpu", vram_budget=budget, activation_reserve=RESERVE)
    assert flux.pipe.residency_plan()["transformer"].policy is not Policy.STREAMED
    assert torch.equal(flux.run(), reference)
    flux.pipe.disable_pinned_offload()
    assert_weights_equal(before, flux.state())


def _transformer_gradient(case: PipelineCase, inputs: tuple[tuple, dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """The transformer's output for ``inputs`` (those of a step) and the gradient of its squares'
    sum with respect to its latents, as guidance that steers by gradients takes it."""
    args, kwargs = (tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in inputs[0]),
                    {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs[1].items()})  # fmt: skip
    latents = kwargs["hidden_states"].requires_grad_(True)
    with torch.enable_grad():
        out = case.pipe.transformer(*args, **{**kwargs, "return_dict": False})[0]
        out.pow(2).sum().backward()
    return out.detach(), latents.grad


@pytest.mark.parametrize("prefetch_blocks", [0, 2])
def test_gradients_through_a_streamed_transformer_are_the_resident_ones(flux: PipelineCase, prefetch_blocks: int) -> None:
    # A dropped block's storage is not handed to the next block while autograd may hold it for
    # the backward pass.
    seen: list[tuple[tuple, dict]] = []
    hook = flux.pipe.transformer.register_forward_pre_hook(lambda _, a, k: seen.append((a, k)), with_kwargs=True)
    flux.run()
    hook.remove()
    reference = _transformer_gradient(flux, seen[0])
    attach_block_streaming(flux.pipe.transformer, ResidencyGroup("cpu"), name="transformer", prefetch_blocks=prefetch_blocks)
    for _ in range(2):
        output, gradient = _transformer_gradient(flux, seen[0])
        assert torch.equal(output, reference[0]) and torch.equal(gradient, reference[1])
    assert torch.equal(flux.run(), flux.reference)
    detach_staging_hook(flux.pipe.transformer)


def test_a_pass_without_autograd_between_a_pass_under_it_and_its_backward_leaves_the_gradient_exact(
    flux: PipelineCase,
) -> None:
    # Guidance may run a pass with gradients, one without, then the backward of the first. The CLIP
    # encoder's blocks are alike, so a dropped block's storage fits the next one's.
    encoder = flux.pipe.text_encoder
    ids = [flux.pipe.tokenizer([text], padding="max_length", max_length=16, return_tensors="pt").input_ids
           for text in ("a prompt", "another one entirely")]  # fmt: skip
    embedded: list[torch.Tensor] = []
    encoder.embeddings.register_forward_hook(
        lambda module, args, out: embedded.append(out.detach().requires_grad_()) or embedded[-1]
    )

    def gradient() -> tuple[torch.Tensor, torch.Tensor]:
        embedded.clear()
        with torch.enable_grad():
            out = encoder(ids[0]).last_hidden_state
        with torch.no_grad():
            encoder(ids[1])
        out.pow(2).sum().backward()
        return out.detach(), embedded[0].grad

    reference = gradient()
    attach_block_streaming(encoder, ResidencyGroup("cpu"), name="text_encoder", prefetch_blocks=1)
    for _ in range(2):
        output, grad = gradient()
        assert torch.equal(output, reference[0]) and torch.equal(grad, reference[1])
    detach_staging_hook(encoder)


def test_no_prefetch_loads_each_streamed_block_alone(flux: PipelineCase) -> None:
    group = ResidencyGroup("cpu")
    attach_block_streaming(flux.pipe.transformer, group, name="transformer", prefetch_blocks=0)
    blocks = group.units_of("transformer")[1:]
    loaded_while_running = _record_loaded_while_running(blocks, Policy.STREAMED)
    assert torch.equal(flux.run(), flux.reference)
    assert all(loaded_while_running[b.name] == [b.name] for b in blocks), str(loaded_while_running)
    detach_staging_hook(flux.pipe.transformer)


def test_staged_blocks_load_ahead_in_the_first_pass_and_stay(flux: PipelineCase) -> None:
    group = ResidencyGroup("cpu")
    attach_block_streaming(flux.pipe.transformer, group, name="transformer", resident_blocks=[0], prefetch_blocks=2)
    blocks = group.units_of("transformer")[1:]
    for block in blocks[1:4]:
        block.policy = Policy.STAGED
    blocks[0].stream.replan()
    loaded_while_running = _record_loaded_while_running(blocks, Policy.STAGED)
    assert torch.equal(flux.run(), flux.reference)
    names = [b.name for b in blocks]
    assert loaded_while_running[names[0]] == names[1:3], "the two staged blocks after a resident one load ahead"
    assert loaded_while_running[names[1]] == names[1:4], "and the one after those as the first of them runs"
    assert all(b.stager.loads == 1 for b in blocks[1:4]), "staged blocks load once, and stay while their component runs"
    detach_staging_hook(flux.pipe.transformer)


def test_with_no_block_streamed_the_first_block_queues_every_kept_load_in_run_order_where_masters_are_page_locked(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With every block resident or staged, none streamed, the first block of a pass queues the
    loads of every kept block not loaded (staged ones, and resident ones a plan made in the call
    left unloaded), in the order they run, once the order is learned and up to the first block
    whose masters are not page-locked: a copy from pageable memory holds the host, and would keep
    the first blocks' compute from being queued. A CPU's masters never are (said to be here, which
    only a device with page-locked memory makes true); left pageable, the first block loads its
    kept window alone, as it does where a block streams. Each block loads once a call, and the
    output stays exact."""
    group = ResidencyGroup("cpu")
    transformer = flux.pipe.transformer
    attach_block_streaming(transformer, group, name="transformer", resident_blocks=[0, 2, 4], prefetch_blocks=1)
    blocks = group.units_of("transformer")[1:]
    assert len(blocks) == 6
    for block in blocks[1::2]:
        block.policy = Policy.STAGED
    blocks[0].stream.replan()
    names = [block.name for block in blocks]
    loads: list[str] = []
    load = ResidencyUnit.load
    monkeypatch.setattr(ResidencyUnit, "load", lambda self, **kwargs: loads.append(self.name) or load(self, **kwargs))
    loaded_as_first_ends: list[list[str]] = []
    blocks[0].module.register_forward_hook(
        lambda *_: loaded_as_first_ends.append([block.name for block in blocks[1:] if block.stager.loaded])
    )

    def loaded_as_the_first_block_ends(each_once: bool = True) -> list[str]:
        for block in blocks[1:]:
            block.stager.offload()  # staged ones as the next component would; resident ones as a plan made in a call
        loads.clear()
        loaded_as_first_ends.clear()
        assert torch.equal(flux.run(), flux.reference)
        assert not each_once or sorted(loads) == sorted(names[1:]), "each block loads once a call"
        return loaded_as_first_ends[0]

    assert torch.equal(flux.run(), flux.reference)  # loads the trunk and the first block, and learns the order
    assert loaded_as_the_first_block_ends() == names[1:3], "pageable: the kept window alone"
    monkeypatch.setattr(ModuleStager, "pinned", property(lambda self: True))
    assert loaded_as_the_first_block_ends() == names[1:], "page-locked: every kept block"
    assert loads == names[1:], "in the order they run"
    monkeypatch.setattr(ModuleStager, "pinned", property(lambda self: self is not blocks[3].stager))
    assert loaded_as_the_first_block_ends() == names[1:3], "up to the first block whose masters are pageable"
    monkeypatch.setattr(ModuleStager, "pinned", property(lambda self: True))
    blocks[5].policy = Policy.STREAMED
    blocks[0].stream.replan()
    loaded = loaded_as_the_first_block_ends(each_once=False)
    assert loaded == names[1:3] + names[5:], "one block streamed: the kept window alone, and the streamed window"
    detach_staging_hook(transformer)


def test_a_block_made_resident_while_its_component_streams_loads_ahead_of_its_turn(flux: PipelineCase) -> None:
    # As a plan made in a call (from dry runs, as its denoiser starts) leaves it: resident, not loaded.
    group = ResidencyGroup("cpu")
    attach_block_streaming(flux.pipe.transformer, group, name="transformer", prefetch_blocks=1)
    blocks = group.units_of("transformer")[1:]
    blocks[3].policy = Policy.RESIDENT
    blocks[0].stream.replan()
    loaded_while_running = _record_loaded_while_running(blocks, Policy.RESIDENT)
    assert torch.equal(flux.run(), flux.reference)
    names = [b.name for b in blocks]
    assert loaded_while_running[names[0]] == [names[3]], "loaded ahead, as the first kept block after the first"
    assert blocks[3].stager.loads == 1 and blocks[3].stager.loaded, "and kept"
    detach_staging_hook(flux.pipe.transformer)


def _allocations_per_load(unit: ResidencyUnit) -> int:
    return 1 if unit.stager.one_buffer else len(unit.stager._layout())


def _stream_single_blocks(flux: PipelineCase, prefetch_blocks: int) -> tuple[ResidencyGroup, list]:
    """Stream the tiny FLUX transformer's single-stream blocks (one layout) through a script's group,
    its double-stream blocks resident; returns the group and the streamed units."""
    transformer = flux.pipe.transformer
    doubles = [i for i, (path, _) in enumerate(repeated_blocks(transformer)) if path.startswith("transformer_blocks.")]
    group = ResidencyGroup("cpu")
    attach_block_streaming(transformer, group, name="transformer", resident_blocks=doubles, prefetch_blocks=prefetch_blocks)
    streamed = [u for u in group.units_of("transformer")[1:] if u.policy is Policy.STREAMED]
    assert len(streamed) == 4 and len(doubles) == 2
    return group, streamed


@pytest.mark.parametrize("in_one_buffer", [True, False], ids=["blocks-in-one-buffer", "blocks-per-storage"])
def test_streamed_blocks_load_into_the_storage_of_the_blocks_they_follow(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch, in_one_buffer: bool
) -> None:
    # Only the single-stream blocks stream: one layout, so the window's storage is allocated once.
    # The tiny blocks load into one buffer each; blocks over ONE_BUFFER_BLOCK_BYTES, an allocation per storage.
    if not in_one_buffer:
        monkeypatch.setattr(residency, "ONE_BUFFER_BLOCK_BYTES", 0)
    group, streamed = _stream_single_blocks(flux, prefetch_blocks=2)
    allocations = count_device_allocations(monkeypatch)

    assert torch.equal(flux.run(), flux.reference)
    window = 3 * _allocations_per_load(streamed[0])
    others = sum(_allocations_per_load(u) for u in group.units if u not in streamed)
    assert group.units[0].stager.one_buffer, "the trunk's load is one buffer"
    assert streamed[0].stager.one_buffer is in_one_buffer
    assert len(streamed[0].stager._layout()) > 1, "blocks of several storages"
    assert len(allocations) == window + others
    loads = sum(u.stager.loads for u in streamed)
    assert torch.equal(flux.run(), flux.reference)
    assert sum(u.stager.loads for u in streamed) - loads >= 2 * len(streamed), "blocks stream at every step"
    assert len(allocations) == window + others, (
        "the second call loads every block into storage the first allocated"
    )
    detach_staging_hook(flux.pipe.transformer)
    assert torch.equal(flux.run(), flux.reference)


def test_next_component_loads_ahead_when_the_budget_holds_it(flux: PipelineCase) -> None:
    staged = {name: "staged" for name in ("text_encoder", "text_encoder_2", "transformer", "vae")}
    flux.pipe.enable_pinned_offload("cpu", components=staged, vram_budget=10**9, activation_reserve=RESERVE)
    loaded_when_called = []
    encoder = flux.pipe.text_encoder_2
    hook = encoder._hf_hook
    encoder.register_forward_pre_hook(lambda *_: loaded_when_called.append(hook.unit.stager.loaded))
    assert torch.equal(flux.run(), flux.reference)
    assert loaded_when_called == [True], "text_encoder_2 loaded while text_encoder ran"
    report = flux.pipe.residency_report()
    assert sum(c.loaded for c in report.components) <= 2, "loading ahead does not keep everything"


def test_a_peak_over_the_budget_gives_that_component_more_room_out_of_resident_blocks(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    budget = 2 * 10**6 + RESERVE  # holds all the weights
    components = {"transformer": "streamed", "text_encoder_2": "streamed", "text_encoder": "resident", "vae": "resident"}
    flux.pipe.enable_pinned_offload("cpu", components=components, vram_budget=budget, activation_reserve=RESERVE)
    before = flux.pipe.residency_plan()
    assert len(before["transformer"].resident_blocks) == 6
    # The CPU counts no peak; the one a CUDA allocator would report once the VAE's activations took
    # 300 kB more than the reserve kept (seen when the next call starts).
    decoded = []
    flux.pipe.vae.decoder.register_forward_pre_hook(lambda *_: decoded.append(True))  # decode() is no forward
    monkeypatch.setattr(_device, "peak_allocated", lambda device: budget + 300_000 if decoded else 0)
    monkeypatch.setattr(_device, "reset_peak_allocated", lambda device: decoded.clear())
    assert torch.equal(flux.run(), flux.reference)
    assert flux.pipe.residency_plan() is before, "seen when the next component starts"
    assert torch.equal(flux.run(), flux.reference)
    after = flux.pipe.residency_plan()
    assert after.activation_bytes_of("vae") >= RESERVE + 300_000, str(after)
    assert after.activation_bytes_of("transformer") == RESERVE, "the others keep theirs"
    # The room comes out of resident blocks, the once-per-call encoder's first (the transformer's
    # would move at every step).
    assert after.resident_weight_bytes < before.resident_weight_bytes, str(after)
    assert len(after["text_encoder_2"].resident_blocks) < len(before["text_encoder_2"].resident_blocks), str(after)
    assert after.peak_bytes <= budget
    assert "over vram_budget while 'vae' ran" in caplog.text
    assert torch.equal(flux.run(), flux.reference)
    monkeypatch.undo()
    assert torch.equal(flux.run(), flux.reference)


@pytest.mark.parametrize("fixed", [True, False], ids=["policies-given", "policies-planned"])
def test_the_first_call_measures_each_component_and_the_plan_keeps_what_fits(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fixed: bool
) -> None:
    caplog.set_level("INFO", logger="diffusers_residency")
    components = (
        {"transformer": "streamed", "text_encoder_2": "streamed", "text_encoder": "resident", "vae": "resident"}
        if fixed
        else None
    )
    budget = streaming_budget(flux, MIN_RESERVE_BYTES, components)  # the default reserve
    flux.pipe.enable_pinned_offload("cpu", components=components, vram_budget=budget)
    before = flux.pipe.residency_plan()
    # Planned at enable for the dry runs' estimates of the default call, which the measuring call's
    # text encoders run under.
    assert before.source == AT_ENABLE and before.activations.keys() == {"transformer", "vae"}, str(before)
    assert (before["vae"].policy is Policy.RESIDENT) == fixed
    group = pipeline_state(flux.pipe).group
    # The CPU counts no peak; the one a CUDA allocator would report if each component's activations
    # took 1 kB, and the transformer's 5 kB, above what was loaded: read as the next one starts.
    ran = []
    modules = {name: getattr(flux.pipe, name) for name in ("text_encoder", "text_encoder_2", "transformer")}
    for name, module in {**modules, "vae": flux.pipe.vae.decoder}.items():  # decode() is no forward
        module.register_forward_hook(lambda *_, name=name: ran.append(name))
    needs = {"transformer": 5000}

    def peak(device: torch.device) -> int:
        return group.loaded_bytes() + needs.get(ran[-1] if ran else "", 1000)

    monkeypatch.setattr(_device, "peak_allocated", peak)
    assert torch.equal(flux.run(), flux.reference)
    after = flux.pipe.residency_plan()
    assert after is not before and after.source == "measured", "planned as the measuring call returns"
    assert after.shape and "height=32 width=32" in after.shape and f"for calls of {after.shape}" in str(after)
    assert torch.equal(flux.run(), flux.reference)
    assert flux.pipe.residency_plan() is after, "a call of the same shape changes nothing"
    margin = int(budget * 0.02)
    assert after.activations == {
        "text_encoder": 1000 + margin, "text_encoder_2": 1000 + margin, "transformer": 5000 + margin, "vae": 1000 + margin
    }, str(after)  # fmt: skip
    assert len(after["transformer"].resident_blocks) == 6, str(after)
    assert after["transformer"].policy is Policy.STREAMED, "streaming components keep their block hooks"
    assert after.peak_bytes <= budget
    assert "measured, above the weights" in caplog.text
    assert all(u.stager.loaded for u in group.units_of("transformer")), "the blocks kept now stay on the device"
    assert group.weight_room("transformer") == budget - 5000 - margin, "the room each component leaves to weights"
    assert torch.equal(flux.run(), flux.reference)

    # A reserve the caller gives is kept: nothing is measured.
    flux.pipe.enable_pinned_offload("cpu", components=components, vram_budget=budget, activation_reserve=MIN_RESERVE_BYTES)
    given = flux.pipe.residency_plan()
    assert given["transformer"].resident_blocks, str(given)
    for _ in range(3):
        assert torch.equal(flux.run(), flux.reference)
    assert flux.pipe.residency_plan() == given


def test_the_first_call_ends_when_its_first_component_runs_after_the_last(monkeypatch: pytest.MonkeyPatch) -> None:
    # SDXL with a negative prompt runs both text encoders twice before the UNet; a call that stops
    # at latents never runs the VAE. Only a whole call counts, and only once.
    monkeypatch.setattr(_device, "peak_allocated", lambda device: 10)
    group = ResidencyGroup("cpu")
    told: list[dict[str, int]] = []

    def never_over(component: str, overshoot: int, retried: bool) -> None:
        pytest.fail("no overshoot")

    # A component loaded outside a call (the VAE at enable, say) starts nothing.
    watch = watch_budget(group, never_over, on_first_call=lambda measured, retried: told.append(measured), **CALL_ENDS)
    watch.component_starts("vae")
    first_call = ["text_encoder", "text_encoder_2", "text_encoder", "text_encoder_2", *["unet"] * 3, "vae"]
    latents_call = ["text_encoder", "text_encoder_2", *["unet"] * 3]
    for component in first_call:
        watch.component_starts(component)
    assert told == []
    for component in latents_call + first_call:
        watch.component_starts(component)
    assert told == [{"text_encoder": 10, "text_encoder_2": 10, "unet": 10, "vae": 10}], "told once, as the call after the first began"
    watch = watch_budget(group, never_over, on_first_call=lambda measured, retried: told.append(measured), **CALL_ENDS)
    for component in latents_call + latents_call:
        watch.component_starts(component)
    assert len(told) == 1, "calls that never reach the VAE are not whole calls"


def test_an_overshoot_while_measuring_is_measured_and_later_ones_are_each_told(monkeypatch: pytest.MonkeyPatch) -> None:
    peaks = {"unet": 150, "vae": 150}
    running: list[str] = []
    monkeypatch.setattr(_device, "peak_allocated", lambda device: peaks.get(running[-1], 10) if running else 10)
    monkeypatch.setattr(_device, "reset_peak_allocated", lambda device: running.append("reset"))
    group = ResidencyGroup("cpu")
    told: list[dict[str, int]] = []
    overshoots: list[tuple[str, int, bool]] = []
    watch = watch_budget(group, lambda *over: overshoots.append(over), on_first_call=lambda measured, retried: told.append(measured), **CALL_ENDS)

    def call(peaks_now: dict[str, int]) -> None:
        peaks.clear()
        peaks.update(peaks_now)
        for component in ("text_encoder", "unet", "vae"):
            watch.component_starts(component)
            running.append(component)

    call({"unet": 150})  # the measuring call: the UNet goes over
    call({})
    assert told == [{"text_encoder": 10, "unet": 150, "vae": 10}] and overshoots == [], "measured, not told"
    call({"vae": 150})
    call({"unet": 130})  # less over than the VAE was: told all the same
    assert overshoots == [("vae", 50, False), ("unet", 30, False)]


_RETRY_COMPONENTS = {"transformer": "streamed", "text_encoder_2": "streamed", "text_encoder": "resident", "vae": "resident"}


def _retrying_in_the_vae(flux: PipelineCase, monkeypatch: pytest.MonkeyPatch, per_decode: int) -> int:
    """Enable under a budget that holds all the weights, with the allocator's retry count rising
    ``per_decode`` at each VAE decode, as a CUDA allocator's does when the VAE's activations find
    no room under a cap (the CPU has no such allocator: the count is injected). Returns the budget."""
    budget = 2 * 10**6 + RESERVE
    retries = [0]
    flux.pipe.vae.decoder.register_forward_pre_hook(lambda *_: retries.__setitem__(0, retries[0] + per_decode))
    monkeypatch.setattr(_device, "allocator_retries", lambda device: retries[0])
    monkeypatch.setattr(_device, "peak_allocated", lambda device: 0)
    flux.pipe.enable_pinned_offload("cpu", components=_RETRY_COMPONENTS, vram_budget=budget, activation_reserve=RESERVE)
    return budget


def test_allocator_retries_under_a_cap_give_that_component_more_room(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Under a cap on the process the peak never passes the budget: the allocator frees its cache
    # and retries instead.
    budget = _retrying_in_the_vae(flux, monkeypatch, per_decode=2)
    before = flux.pipe.residency_plan()
    assert torch.equal(flux.run(), flux.reference)
    assert flux.pipe.residency_plan() is before, "seen when the next component starts"
    assert torch.equal(flux.run(), flux.reference)
    once = flux.pipe.residency_plan()
    margin = int(budget * RESERVE_MARGIN)
    assert once.activation_bytes_of("vae") == RESERVE + margin, str(once)
    assert once.activation_bytes_of("transformer") == RESERVE, "the others keep theirs"
    assert once.resident_weight_bytes < before.resident_weight_bytes, str(once)
    assert "ran out of room under its cap and retried while 'vae' ran" in caplog.text
    assert torch.equal(flux.run(), flux.reference)
    assert flux.pipe.residency_plan().activation_bytes_of("vae") == RESERVE + 3 * margin, "doubled for each call that retries"
    # Retries that stop, stop the replanning.
    monkeypatch.setattr(_device, "allocator_retries", lambda device: 100)
    assert torch.equal(flux.run(), flux.reference)
    settled = flux.pipe.residency_plan()
    assert torch.equal(flux.run(), flux.reference)
    assert flux.pipe.residency_plan() is settled


def test_retries_no_plan_has_room_for_are_told_once(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    budget = _retrying_in_the_vae(flux, monkeypatch, per_decode=1)
    plans = []
    for _ in range(24):  # more than the room lasts, a margin at a time
        assert torch.equal(flux.run(), flux.reference)
        plans.append(flux.pipe.residency_plan())
    assert caplog.text.count("no plan leaves it more room") == 1
    assert plans[-1] is plans[-2], "left alone"
    # Enabled again (a budget raised, say, or the same one): what retries taught is learned anew.
    flux.pipe.enable_pinned_offload("cpu", components=_RETRY_COMPONENTS, vram_budget=budget, activation_reserve=RESERVE)
    state = pipeline_state(flux.pipe)
    assert state.retry_replans == {} and state.retries_left_alone == set()
    assert state.group.retention.release_over_limit_before == set()
    before = flux.pipe.residency_plan()
    for _ in range(2):
        assert torch.equal(flux.run(), flux.reference)
    assert flux.pipe.residency_plan().activation_bytes_of("vae") > before.activation_bytes_of("vae")
    assert plans[-1].peak_bytes <= budget
    margins = [(b.activation_bytes_of("vae") - a.activation_bytes_of("vae")) // int(budget * RESERVE_MARGIN) for a, b in zip(plans, plans[1:])]
    assert margins[:3] == [1, 2, 4] and 1 in margins[3:], f"doubled, then one at a time: {margins}"


def test_retries_are_told_once_a_call_when_another_component_runs_between_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    # A resident ControlNet runs between the UNet's steps: the UNet starts again at every step, and
    # its retries must not plan it more room (doubled, in retries' case) at every one of them.
    retries = [0]
    monkeypatch.setattr(_device, "peak_allocated", lambda device: 10)
    monkeypatch.setattr(_device, "allocator_retries", lambda device: retries[0])
    group = ResidencyGroup("cpu")
    shortfalls: list[tuple[str, int, bool]] = []
    watch = watch_budget(group, lambda *short: shortfalls.append(short), **CALL_ENDS)
    for _ in range(2):
        watch.component_starts("text_encoder")
        for _step in range(5):
            watch.component_starts("controlnet")
            watch.component_starts("unet")
            retries[0] += 1
        watch.component_starts("vae")
    assert shortfalls == [("unet", 0, True)], "the first call's, told as the second began"
    watch.component_starts("text_encoder")
    assert shortfalls == [("unet", 0, True)] * 2


def test_retries_while_measuring_are_measured_not_told(monkeypatch: pytest.MonkeyPatch) -> None:
    retries = [0]
    monkeypatch.setattr(_device, "peak_allocated", lambda device: 10)
    monkeypatch.setattr(_device, "allocator_retries", lambda device: retries[0])
    group = ResidencyGroup("cpu")
    told: list[dict[str, int]] = []
    shortfalls: list[tuple[str, int, bool]] = []
    watch = watch_budget(group, lambda *short: shortfalls.append(short), on_first_call=lambda measured, retried: told.append(measured), **CALL_ENDS)
    for component in ("text_encoder", "unet", "vae"):  # the measuring call: the UNet retries
        watch.component_starts(component)
        retries[0] += component == "unet"
    for component in ("text_encoder", "unet", "vae", "text_encoder"):  # the VAE retries
        watch.component_starts(component)
        retries[0] += component == "vae"
    assert len(told) == 1 and shortfalls == [("vae", 0, True)]


@pytest.mark.parametrize("kept_for", ["vae", "transformer"])
def test_retries_after_a_boundary_that_kept_the_cache_release_it_there_before_planning_more_room(
    monkeypatch: pytest.MonkeyPatch, kept_for: str
) -> None:
    # Kept as the VAE starts, or earlier, as the transformer does (the switch to the VAE evicting
    # nothing): the retries while the VAE runs release the cache at that boundary from then on.
    retries = [0]
    monkeypatch.setattr(_device, "peak_allocated", lambda device: 10)
    monkeypatch.setattr(_device, "allocator_retries", lambda device: retries[0])
    group = ResidencyGroup("cpu")
    shortfalls: list[tuple[str, int, bool]] = []
    watch = watch_budget(group, lambda *short: shortfalls.append(short))

    def call(keeps: bool) -> None:
        for component in ("text_encoder", "transformer", "vae"):
            watch.component_starts(component)
            # What the boundary into the component decided (a CPU has no cache to keep).
            if component == kept_for:
                group.retention.kept_over_limit = kept_for if keeps else None
            retries[0] += component == "vae"

    call(keeps=True)
    call(keeps=False)  # the retries of the first call show as this one starts
    assert group.retention.release_over_limit_before == {kept_for} and shortfalls == []
    call(keeps=False)
    assert shortfalls == [("vae", 0, True)], "released, and still short: more room"


def test_a_pipeline_of_one_component_in_its_sequence_is_not_measured(flux: PipelineCase) -> None:
    flux.pipe.model_cpu_offload_seq = "transformer"  # no call would ever be seen to end
    # Components outside the sequence are kept resident.
    budget = streaming_budget(flux, MIN_RESERVE_BYTES, {n: "resident" for n in ("text_encoder", "text_encoder_2", "vae")})
    flux.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    assert not pipeline_state(flux.pipe).measuring
    assert flux.pipe.residency_plan()["transformer"].resident_blocks, "planned with the reserve, not for measuring"
    assert torch.equal(flux.run(), flux.reference)


@pytest.mark.parametrize("kind", ["sdxl", "sd3", "wan"])
def test_every_streamable_component_of_other_pipelines_streams_exactly(kind: str) -> None:
    case = PipelineCase(kind)
    before = case.state()
    sizes = component_sizes(case.pipe, module_components(case.pipe))
    streamed = {s.name: "streamed" for s in sizes if s.streamable}
    assert any(s.per_step for s in sizes if s.name in streamed), "the denoiser streams"
    case.pipe.enable_pinned_offload("cpu", components=streamed, vram_budget=None)
    for _ in range(2):
        assert torch.equal(case.run(), case.reference)
    report = case.pipe.residency_report()
    assert {c.name for c in report.components if c.policy == "streamed"} == set(streamed), str(report)
    if kind == "sdxl":
        # The UNet defines its mid block after the up blocks but runs it before them: prefetching
        # follows the order the first pass took.
        order = pipeline_state(case.pipe).group.units_of("unet")[1].stream.order
        first_up = min(i for i, name in enumerate(order) if ".up_blocks." in name)
        assert max(i for i, name in enumerate(order) if ".mid_block." in name) < first_up, order
    case.pipe.disable_pinned_offload()
    assert_weights_equal(before, case.state())


def test_lora_loaded_and_fused_into_a_streamed_transformer_matches_resident(flux: PipelineCase) -> None:
    pytest.importorskip("peft")
    from .test_changing_weights import lora_state_dict

    resident = PipelineCase("flux")
    lora = lora_state_dict(resident)
    flux.pipe.enable_pinned_offload("cpu", components={"transformer": "streamed"}, vram_budget=None)
    assert torch.equal(flux.run(), flux.reference)
    for step in (
        lambda pipe: pipe.load_lora_weights(lora, adapter_name="style"),
        lambda pipe: pipe.fuse_lora(lora_scale=0.8),
        lambda pipe: pipe.unfuse_lora(),
        lambda pipe: pipe.unload_lora_weights(),
    ):
        step(resident.pipe)
        step(flux.pipe)
        assert torch.equal(flux.run(), resident.run())


@pytest.mark.parametrize("staged", ["text_encoder", "text_encoder_2", "vae"])
def test_loading_ahead_never_takes_the_room_of_a_streaming_component(flux: PipelineCase, staged: str) -> None:
    sizes = component_sizes(flux.pipe, module_components(flux.pipe))
    total = sum(s.nbytes for s in sizes)
    checked = 0
    for budget in range(total, total // 4, -total // 40):  # fine steps: overshoots show at a few budgets only
        try:
            flux.pipe.enable_pinned_offload("cpu", components={staged: "staged"}, vram_budget=budget, activation_reserve=RESERVE)
        except BudgetTooSmallError:
            break
        group = pipeline_state(flux.pipe).group
        seen = _record_loaded_bytes(flux)
        for module in flux.pipe.components.values():
            if isinstance(module, torch.nn.Module):
                module.register_forward_hook(lambda *_: seen.append(group.loaded_bytes()))
        assert torch.equal(flux.run(), flux.reference)
        assert torch.equal(flux.run(), flux.reference)
        assert max(seen) <= budget - RESERVE, (budget, max(seen), str(flux.pipe.residency_plan()))
        flux.pipe.disable_pinned_offload()
        for module in flux.pipe.components.values():
            if isinstance(module, torch.nn.Module):
                for sub in module.modules():
                    sub._forward_hooks.clear()
        checked += 1
    assert checked >= 3


def test_turning_the_budget_off_stops_watching_it(flux: PipelineCase, monkeypatch: pytest.MonkeyPatch) -> None:
    streamed = {"transformer": "streamed"}
    flux.pipe.enable_pinned_offload("cpu", components=streamed, vram_budget=10**7, activation_reserve=RESERVE)
    group = pipeline_state(flux.pipe).group
    assert torch.equal(flux.run(), flux.reference)
    assert group.weight_room("transformer") == 10**7 - RESERVE
    flux.pipe.enable_pinned_offload("cpu", components=streamed, vram_budget=None)
    assert pipeline_state(flux.pipe).group is group, "same setup: masters kept"
    assert group.weight_room is None and group.retention.reserved_limit is None
    monkeypatch.setattr(_device, "peak_allocated", lambda device: 10**9)  # far over the old budget
    assert torch.equal(flux.run(), flux.reference)
    assert flux.pipe.residency_plan().budget is None


def test_enabling_again_after_one_component_was_detached(flux: PipelineCase) -> None:
    flux.pipe.enable_pinned_offload("cpu", components={"transformer": "streamed"}, vram_budget=None)
    assert torch.equal(flux.run(), flux.reference)
    detach_staging_hook(flux.pipe.vae)
    flux.pipe.enable_pinned_offload("cpu", components={"transformer": "streamed"}, vram_budget=None)
    assert flux.pipe.residency_report()["vae"].policy == "staged"
    assert torch.equal(flux.run(), flux.reference)


def test_an_overshoot_never_streams_a_component_that_has_no_block_hooks(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    sizes = component_sizes(flux.pipe, module_components(flux.pipe))
    budget = sum(s.nbytes for s in sizes) + RESERVE  # everything resident, just
    flux.pipe.enable_pinned_offload("cpu", vram_budget=budget, activation_reserve=RESERVE)
    before = flux.pipe.residency_plan()
    assert {p.policy for p in before.components} == {Policy.RESIDENT}
    monkeypatch.setattr(_device, "peak_allocated", lambda device: budget + 400_000)
    assert torch.equal(flux.run(), flux.reference)
    after = flux.pipe.residency_plan()
    assert after is not before and Policy.STREAMED not in {p.policy for p in after.components}, str(after)
    assert after.peak_bytes <= budget, str(after)
    assert "over vram_budget" in caplog.text
    assert torch.equal(flux.run(), flux.reference)
    assert_no_meta_or_foreign_device(flux.pipe)


def test_blocks_a_call_never_runs_are_not_loaded_ahead(flux: PipelineCase) -> None:
    """Text-to-image decodes only: the streamed VAE's encoder blocks leave the prefetch order."""
    flux.pipe.enable_pinned_offload("cpu", components={"vae": "streamed"}, vram_budget=None)
    for _ in range(3):
        assert torch.equal(flux.run(), flux.reference)
    units = pipeline_state(flux.pipe).group.units_of("vae")[1:]
    order = units[0].stream.order
    assert order and all(".decoder." in name or name.startswith("vae.decoder") for name in order), order
    encoder = [u for u in units if ".encoder." in u.name]
    assert encoder and sum(u.stager.loads for u in encoder) <= 2, "loaded ahead once, before the order was known"


@pytest.mark.parametrize(
    ("component", "failing"), [("transformer", "single_transformer_blocks.0"), ("vae", "decoder.up_blocks.1")]
)
def test_a_first_pass_cut_short_by_an_error_leaves_no_block_out_of_the_order(
    flux: PipelineCase, component: str, failing: str
) -> None:
    flux.pipe.enable_pinned_offload("cpu", components={component: "streamed"}, vram_budget=None)

    def stop(*_: object) -> None:
        raise RuntimeError("stop")

    hook = getattr(flux.pipe, component).get_submodule(failing).register_forward_pre_hook(stop)
    with pytest.raises(RuntimeError, match="stop"):
        flux.run()
    hook.remove()
    for _ in range(2):  # the order a first pass recorded is taken as the second begins
        assert torch.equal(flux.run(), flux.reference)
    units = pipeline_state(flux.pipe).group.units_of(component)[1:]
    ran = {unit.name for unit in units if component == "transformer" or ".decoder." in unit.name}
    assert set(units[0].stream.order) == ran, "the blocks after the error are in the order too"


def test_blocks_loaded_before_a_failed_load_are_dropped_by_the_next_entry(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, streamed = _stream_single_blocks(flux, prefetch_blocks=1)
    stream = streamed[0].stream
    allocate, room = _device.allocate_device_storage, _allocations_per_load(streamed[0])

    def out_of_memory_after_one_block(nbytes: int, device: torch.device, *, alignment: int) -> torch.Tensor:
        nonlocal room
        if room == 0:
            raise torch.OutOfMemoryError("injected: out of device memory")
        room -= 1
        return allocate(nbytes, device, alignment=alignment)

    with monkeypatch.context() as patch:
        patch.setattr(_device, "allocate_device_storage", out_of_memory_after_one_block)
        with pytest.raises(torch.OutOfMemoryError):
            stream.enter(streamed[0])  # loads the block, then fails on the one ahead of it
    assert streamed[0].stager.loaded and not streamed[1].stager.loaded
    stream.enter(streamed[2])  # its window is the block after it: the first one goes
    assert not streamed[0].stager.loaded and streamed[2].stager.loaded and streamed[3].stager.loaded
    detach_staging_hook(flux.pipe.transformer)
    assert torch.equal(flux.run(), flux.reference)


def _run(flux: PipelineCase, steps: int) -> torch.Tensor:
    return pipeline_output(flux.pipe, call_kwargs("flux", steps=steps))


def test_a_streamed_component_reports_the_compute_of_a_step(flux: PipelineCase, monkeypatch: pytest.MonkeyPatch) -> None:
    reference = {steps: _run(flux, steps) for steps in (2, 3)}
    flux.pipe.enable_pinned_offload("cpu", components={"transformer": "streamed"}, vram_budget=None)
    # A clock that counts the transformer's forwards (its steps), and other components' turns a
    # hundredfold: a timed pass of one whole step, its last block ending as the next step's first
    # block enters, reads exactly 1.
    steps = []
    flux.pipe.transformer.register_forward_pre_hook(lambda *_: steps.append(None))
    group = pipeline_state(flux.pipe).group
    monkeypatch.setattr(_device, "compute_timestamp", lambda device: float(len(steps) + 100 * group.switches))

    assert torch.equal(_run(flux, 2), reference[2])
    assert torch.equal(_run(flux, 2), reference[2])
    assert flux.pipe.residency_report()["transformer"].step_compute_seconds is None, "a step across two calls"
    assert torch.equal(_run(flux, 3), reference[3])
    assert flux.pipe.residency_report()["transformer"].step_compute_seconds == (1.0, 1.0)
    assert "compute s/step (first, latest call)" in str(flux.pipe.residency_report())

    monkeypatch.undo()  # the host clock: the next call's step is timed afresh, the first kept
    assert torch.equal(_run(flux, 3), reference[3])
    first, latest = flux.pipe.residency_report()["transformer"].step_compute_seconds
    assert first == 1.0 and 0 < latest != 1.0


def test_each_call_times_its_steps_where_every_other_component_stays_resident(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Nothing switches between two calls then: the stream tells them apart by the calls begun, and
    # a third call's steps are timed as the first's were (not passes counted on from the first call).
    reference = _run(flux, 3)
    others = {name: "resident" for name in ("text_encoder", "text_encoder_2", "vae")}
    flux.pipe.enable_pinned_offload("cpu", components={"transformer": "streamed", **others}, vram_budget=None)
    steps = []
    flux.pipe.transformer.register_forward_pre_hook(lambda *_: steps.append(None))
    group = pipeline_state(flux.pipe).group
    step_seconds = [1.0]
    monkeypatch.setattr(_device, "compute_timestamp", lambda device: step_seconds[0] * len(steps))
    assert torch.equal(_run(flux, 3), reference)
    switches = group.switches
    for step_seconds[0] in (2.0, 3.0):
        assert torch.equal(_run(flux, 3), reference)
        assert flux.pipe.residency_report()["transformer"].step_compute_seconds == (1.0, step_seconds[0])
    assert group.switches == switches, "no component switched between the calls"


def test_a_streamed_step_is_the_median_of_the_steps_a_call_timed(flux: PipelineCase, monkeypatch: pytest.MonkeyPatch) -> None:
    reference = _run(flux, 8)
    flux.pipe.enable_pinned_offload("cpu", components={"transformer": "streamed"}, vram_budget=None)
    # A clock at which the n-th step of a call lasts durations[n]: the steps from the second on are
    # timed, STEPS_TIMED of them (the 2nd to the 6th), and one of them is slow.
    durations = [0.0, 0.0, 1.0, 9.0, 2.0, 3.0, 100.0, 50.0, 7.0, 7.0]
    steps = []
    flux.pipe.transformer.register_forward_pre_hook(lambda *_: steps.append(None))
    monkeypatch.setattr(_device, "compute_timestamp", lambda device: sum(durations[: len(steps)]))
    assert STEPS_TIMED == 5
    assert torch.equal(_run(flux, 8), reference)
    assert flux.pipe.residency_report()["transformer"].step_compute_seconds == (1.0, 3.0)


@pytest.mark.parametrize("kind, denoiser", [("flux", "transformer"), ("sdxl", "unet")])
def test_a_streamed_step_tells_each_blocks_share_of_its_compute(
    kind: str, denoiser: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = PipelineCase(kind)
    reference = pipeline_output(case.pipe, call_kwargs(kind, steps=4))
    case.pipe.enable_pinned_offload("cpu", components={denoiser: "streamed"}, vram_budget=None)
    state = pipeline_state(case.pipe)
    stream = state.group.stream_of(denoiser)
    # A clock that moves by each block's own seconds once the next block enters: the block defined
    # i-th computes for i + 1 seconds, the last one run included (its span ends as the next step's
    # first block enters). SDXL's UNet runs its mid block before its up blocks: shares are told in
    # definition order, the order of the planner's block sizes, whatever the order run.
    entered: list[int] = []
    for position, block in enumerate(stream.blocks):
        block.module.register_forward_pre_hook(lambda *_, position=position: entered.append(position))
    monkeypatch.setattr(_device, "compute_timestamp", lambda device: float(sum(i + 1 for i in entered[:-1])))
    assert stream.step_compute_shares() is None, "no step timed yet"
    assert torch.equal(pipeline_output(case.pipe, call_kwargs(kind, steps=4)), reference)
    seconds = [i + 1 for i in range(len(stream.blocks))]
    shares = [s / sum(seconds) for s in seconds]
    assert stream.step_compute_seconds() == (sum(seconds), sum(seconds))
    assert stream.step_compute_shares() == pytest.approx(shares)
    assert retiming.step_timings(state.group, state.plan)[denoiser].compute_shares == pytest.approx(shares)
    if kind == "sdxl":
        assert stream.order != tuple(block.name for block in stream.blocks), "run in an order of its own"


def _sdxl_with_staged_unet_blocks(
    monkeypatch: pytest.MonkeyPatch, components: dict[str, str] | None = None
) -> tuple[PipelineCase, ResidencyGroup, Any, int, int]:
    """SDXL's shape of the problem: the VAE needs far more above its weights than the UNet does, so
    the UNet keeps across calls only what fits beside the VAE's decode, and keeps the rest of its
    blocks while it runs. The tiny SDXL pipeline, enabled with ``components`` and measured (its
    peaks faked: the VAE's need set so that half the UNet's blocks stay), after two calls; returns
    it, its group, the plan expected, the budget and the VAE's need."""
    case = PipelineCase("sdxl")
    sizes = component_sizes(case.pipe, module_components(case.pipe))
    least = plan_residency(sizes, 10**12, MIN_RESERVE_BYTES, least=True)
    budget = MIN_RESERVE_BYTES + least.peak_weight_bytes  # the measuring plan just fits the default reserve
    case.pipe.enable_pinned_offload("cpu", vram_budget=budget, components=components)
    state = pipeline_state(case.pipe)
    group = state.group
    assert state.measuring and not state.plan["unet"].resident_blocks, str(state.plan)
    unet_sizes = next(s for s in state.plan.sizes if s.name == "unet")
    margin = int(budget * 0.02)
    small = 1000

    def measured(vae_need: int) -> dict[str, int]:
        return {"text_encoder": small, "text_encoder_2": small, "unet": small, "vae": vae_need}

    def planned(vae_need: int):
        try:
            return replan_in_place(state, {name: need + margin for name, need in measured(vae_need).items()})
        except BudgetTooSmallError:
            return None

    def unet_resident(vae_need: int) -> bool:
        plan = planned(vae_need)
        return plan is not None and bool(plan["unet"].resident_blocks)

    # The largest VAE need that lets some UNet blocks stay across calls, then half of them less.
    low, high = 0, budget
    while high - low > 1:
        low, high = ((low + high) // 2, high) if unet_resident((low + high) // 2) else (low, (low + high) // 2)
    vae_need = low - sum(unet_sizes.block_bytes) // 2
    expected = planned(vae_need)
    unet_plan = expected["unet"]
    assert unet_plan.resident_blocks and unet_plan.staged_blocks, str(expected)
    assert len(unet_plan.resident_blocks) + len(unet_plan.staged_blocks) == len(unet_sizes.block_bytes), str(expected)

    ran: list[str] = []
    modules = {name: getattr(case.pipe, name) for name in ("text_encoder", "text_encoder_2", "unet")}
    for name, module in {**modules, "vae": case.pipe.vae.decoder}.items():  # decode() is no forward
        module.register_forward_hook(lambda *_, name=name: ran.append(name))
    monkeypatch.setattr(
        _device, "peak_allocated", lambda device: group.loaded_bytes() + measured(vae_need).get(ran[-1] if ran else "", small)
    )
    assert torch.equal(case.run(), case.reference)  # measures, and plans as it returns
    assert torch.equal(case.run(), case.reference)
    plan = case.pipe.residency_plan()
    assert (plan.components, plan.activations) == (expected.components, expected.activations)
    return case, group, expected, budget, vae_need


def test_a_denoiser_keeps_its_staged_blocks_through_the_call_and_leaves_their_room_to_the_vae(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    case, group, expected, budget, vae_need = _sdxl_with_staged_unet_blocks(monkeypatch)
    unet_plan = expected["unet"]
    blocks = group.units_of("unet")[1:]
    staged = [block for block in blocks if block.policy is Policy.STAGED]
    assert len(staged) == len(unet_plan.staged_blocks)
    loaded_while_decoding: list[int] = []
    case.pipe.vae.decoder.register_forward_pre_hook(lambda *_: loaded_while_decoding.append(group.loaded_bytes()))
    loads_before = [block.stager.loads for block in staged]
    steps = call_kwargs("sdxl", "tiny")["num_inference_steps"]
    assert steps > 1
    assert torch.equal(case.run(), case.reference)
    assert [block.stager.loads - before for block, before in zip(staged, loads_before)] == [1] * len(staged), (
        "a staged block loads once per call, not once per step"
    )
    assert not any(block.stager.loaded for block in staged), "the VAE's turn evicted them"
    assert max(loaded_while_decoding) + vae_need <= budget
    assert_no_meta_or_foreign_device(case.pipe)


def test_a_denoisers_staged_blocks_load_in_its_first_pass_not_while_the_encoder_before_it_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With its text encoders whole (as a residency profile hooks SDXL's at 8 GB), the UNet's staged
    blocks are not queued as text_encoder_2 starts: every copy the pipeline makes to the device
    before the UNet runs (the encoder's token ids, the latents) would wait behind them, holding the
    host. None is loaded when the UNet is called; each loads once in the call, in its first pass."""
    whole = {"text_encoder": "staged", "text_encoder_2": "staged"}
    case, group, expected, _, _ = _sdxl_with_staged_unet_blocks(monkeypatch, whole)
    staged = [block for block in group.units_of("unet")[1:] if block.policy is Policy.STAGED]
    assert len(staged) == len(expected["unet"].staged_blocks)
    loaded_at: list[tuple[str, bool]] = []
    inside_encoder = case.pipe.text_encoder_2.text_model  # runs once the encoder's hook has made it ready
    for name, module in (("text_encoder_2", inside_encoder), ("unet", case.pipe.unet)):  # unet: before its hook
        module.register_forward_pre_hook(
            lambda *_, name=name: loaded_at.append((name, any(b.stager.loaded for b in staged)))
        )
    loads = [block.stager.loads for block in staged]
    assert torch.equal(case.run(), case.reference)
    assert loaded_at[:2] == [("text_encoder_2", False), ("unet", False)], loaded_at
    assert [block.stager.loads - before for block, before in zip(staged, loads)] == [1] * len(staged)
    assert_no_meta_or_foreign_device(case.pipe)


def test_loading_ahead_goes_where_the_last_call_went_next(monkeypatch: pytest.MonkeyPatch) -> None:
    """A negative prompt runs SDXL's text encoders twice: from the second such call on (the first
    measures the new shape, and learns the order), the first text_encoder_2 to start loads
    text_encoder ahead, which the call runs next, and the second one does not, the UNet coming next."""
    whole = {"text_encoder": "staged", "text_encoder_2": "staged"}
    case, group, _, _, _ = _sdxl_with_staged_unet_blocks(monkeypatch, whole)
    def negative() -> dict[str, Any]:  # a generator of its own for each call
        return {**call_kwargs("sdxl", "tiny"), "negative_prompt": "blurry"}

    reference = pipeline_output(PipelineCase("sdxl").pipe, negative())
    (first_encoder,) = group.units_of("text_encoder")
    at_encoder: list[bool] = []
    inside_encoder = case.pipe.text_encoder_2.text_model
    inside_encoder.register_forward_pre_hook(lambda *_: at_encoder.append(first_encoder.stager.loaded))
    assert torch.equal(pipeline_output(case.pipe, negative()), reference)  # runs the encoders twice: learned
    at_encoder.clear()
    loads = first_encoder.stager.loads
    assert torch.equal(pipeline_output(case.pipe, negative()), reference)
    assert at_encoder == [True, False], "loaded as the first text_encoder_2 started"
    assert first_encoder.stager.loads - loads == 2, "once for each run: none evicted unused"
    assert torch.equal(case.run(), case.reference), "and back to one prompt"


def test_the_measuring_call_times_the_denoisers_step_for_the_plan(flux: PipelineCase, monkeypatch: pytest.MonkeyPatch) -> None:
    reference = _run(flux, 3)
    budget = streaming_budget(flux, MIN_RESERVE_BYTES)
    flux.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    group = pipeline_state(flux.pipe).group
    monkeypatch.setattr(_device, "peak_allocated", lambda device: group.loaded_bytes() + 1000)
    assert torch.equal(_run(flux, 3), reference)  # measures, a step timed among them
    assert torch.equal(_run(flux, 3), reference)
    assert torch.equal(_run(flux, 3), reference)  # timed again as it starts, and planned for once more if moved
    plan = flux.pipe.residency_plan()
    timing = plan.timings["transformer"]
    assert timing.compute_per_byte > 0 and timing.load_per_byte > 0, str(plan)
    assert set(plan.timings) == {"transformer"}, "only the per-step component"
    assert "chosen from a timed step" in str(plan)
    # An overshoot later plans with the same timing.
    monkeypatch.setattr(_device, "peak_allocated", lambda device: budget + 10**6)
    assert torch.equal(_run(flux, 3), reference)
    assert flux.pipe.residency_plan() is not plan and flux.pipe.residency_plan().timings == plan.timings


def test_a_plan_that_loads_one_block_ahead_is_followed_by_the_stream(flux: PipelineCase) -> None:
    """A bus-bound step (loads slower than compute) may be planned with one block in flight (see
    planner.PREFETCH_CHOICES); the stream in place takes that depth when the plan is applied."""
    sizes = component_sizes(flux.pipe, module_components(flux.pipe))
    transformer = next(s for s in sizes if s.name == "transformer")
    bus_bound = {"transformer": StepTiming(compute_per_byte=1e-12, load_per_byte=1e-9)}

    def depth(budget: int) -> int | None:
        # As the pipeline enabled under this budget plans: hooked by the plan made as it is enabled,
        # the components that plan streams keep streaming, the others move whole.
        try:
            hooked = plan_residency(sizes, budget, RESERVE)
            streaming = {p.name: Policy.STREAMED for p in hooked.components if p.policy is Policy.STREAMED}
            as_hooked = [s if s.name in streaming else replace(s, block_bytes=()) for s in sizes]
            return plan_residency(as_hooked, budget, RESERVE, streaming, timings=bus_bound)["transformer"].prefetch_blocks
        except BudgetTooSmallError:
            return None

    # The largest budget (in steps of a quarter block) that the bus-bound plan fills with one block ahead.
    budgets = range(streaming_budget(flux), 0, -max(transformer.block_bytes) // 4)
    budget = next(b for b in budgets if depth(b) in (1, None))
    assert depth(budget) == 1
    flux.pipe.enable_pinned_offload("cpu", vram_budget=budget, activation_reserve=RESERVE)
    assert torch.equal(flux.run(), flux.reference)
    state = pipeline_state(flux.pipe)
    blocks = state.group.units_of("transformer")[1:]
    assert blocks[0].stream.prefetch_blocks == PREFETCH_BLOCKS, "not timed: the default"
    plan = replan_in_place(state, {}, bus_bound)
    assert plan["transformer"].prefetch_blocks == 1, str(plan)
    apply_plan(state, plan)
    assert blocks[0].stream.prefetch_blocks == 1
    loaded_while_running = _record_loaded_while_running(blocks, Policy.STREAMED)
    assert torch.equal(flux.run(), flux.reference)
    streamed = [b for b in blocks if b.policy is Policy.STREAMED]
    assert streamed and all(len(loaded_while_running[b.name]) <= 2 for b in streamed), str(loaded_while_running)
    assert any(len(loaded_while_running[b.name]) == 2 for b in streamed), "the next one loads ahead"


def test_a_plan_made_again_on_the_hooks_in_place_keeps_the_blocks_in_place_where_as_good(flux: PipelineCase) -> None:
    """replan_in_place plans with the plan in place as the incumbent (see planner.plan_residency):
    for a step timed 20 % longer, a fresh plan moves the transformer's resident blocks, the plan
    made again on the pipeline keeps them, and the pipeline still computes what it did."""
    sizes = component_sizes(flux.pipe, module_components(flux.pipe))
    transformer = next(s for s in sizes if s.name == "transformer")

    def timing(compute_per_byte: float) -> dict[str, StepTiming]:
        return {"transformer": StepTiming(compute_per_byte=compute_per_byte, load_per_byte=1e-9)}

    def case() -> tuple[int, float]:
        # A budget and step the fresh plans of which move resident blocks (the tiny pipeline's
        # blocks are of two sizes), searched as the pipeline enabled under it would plan.
        for budget in range(streaming_budget(flux), 0, -max(transformer.block_bytes) // 8):
            hooked = plan_residency(sizes, budget, RESERVE)
            streaming = {p.name: Policy.STREAMED for p in hooked.components if p.policy is Policy.STREAMED}
            as_hooked = [s if s.name in streaming else replace(s, block_bytes=()) for s in sizes]
            for compute in (n * 1e-11 for n in range(1, 300, 7)):
                before = plan_residency(as_hooked, budget, RESERVE, streaming, timings=timing(compute))
                after = plan_residency(as_hooked, budget, RESERVE, streaming, timings=timing(compute * 1.2))
                if before["transformer"].resident_blocks != after["transformer"].resident_blocks:
                    kept = plan_residency(as_hooked, budget, RESERVE, streaming, timings=timing(compute * 1.2),
                                          incumbent=before.components)  # fmt: skip
                    if kept["transformer"].resident_blocks == before["transformer"].resident_blocks:
                        return budget, compute
        pytest.fail("no budget and step whose fresh plans move resident blocks within the tie")

    budget, compute = case()
    flux.pipe.enable_pinned_offload("cpu", vram_budget=budget, activation_reserve=RESERVE)
    state = pipeline_state(flux.pipe)
    apply_plan(state, replan_in_place(state, {}, timing(compute)))
    resident = state.plan["transformer"].resident_blocks
    again = replan_in_place(state, {}, timing(compute * 1.2))
    assert again["transformer"].resident_blocks == resident, str(again)
    assert again.timings == timing(compute * 1.2)
    apply_plan(state, again)
    assert torch.equal(flux.run(), flux.reference)


@pytest.mark.parametrize("true_cfg", [False, True], ids=["plain", "true-cfg"])
def test_a_step_timed_again_under_the_plan_is_planned_for_once(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch, true_cfg: bool
) -> None:
    """The measuring call's step can be stretched (on a GPU under a tight cap, by the allocator's
    synchronising retries): the first step timed under the plan is planned for, once. Not before:
    a call whose transformer runs fewer than three passes times none (two steps; one under true
    CFG, which runs it twice a step), and under true CFG the text encoders that start a call run
    twice in it."""
    cfg = {"negative_prompt": "blurry", "true_cfg_scale": 2.0} if true_cfg else {}
    short = 1 if true_cfg else 2

    def run(steps: int) -> torch.Tensor:
        return pipeline_output(flux.pipe, {**call_kwargs("flux", steps=steps), **cfg})

    reference = {steps: run(steps) for steps in (short, 3)}
    budget = streaming_budget(flux, MIN_RESERVE_BYTES)
    flux.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    group = pipeline_state(flux.pipe).group
    monkeypatch.setattr(_device, "peak_allocated", lambda device: group.loaded_bytes() + 1000)
    stalled = [True]
    for block in group.units_of("transformer")[1:]:
        block.module.register_forward_pre_hook(lambda *_: time.sleep(STALL_SECONDS) if stalled[0] else None)
    assert torch.equal(run(3), reference[3])  # measures, its step stretched, and plans for it as it returns
    stalled[0] = False
    first = flux.pipe.residency_plan()
    assert torch.equal(run(short), reference[short])
    assert flux.pipe.residency_plan() is first, "no step timed under the plan yet"
    assert torch.equal(run(3), reference[3])
    second = flux.pipe.residency_plan()
    assert second is not first, "planned again as the first call that timed a step under the plan returned"
    assert second.timings["transformer"].compute_per_byte < first.timings["transformer"].compute_per_byte / 2
    assert torch.equal(run(3), reference[3])
    assert flux.pipe.residency_plan() is second, "once"


def test_steps_are_timed_only_while_a_plan_will_use_them(flux: PipelineCase, monkeypatch: pytest.MonkeyPatch) -> None:
    """Timing a step records two events a block on the host: in the measuring call (its plan is
    chosen from the step) and in the first call under that plan (timed again), not after."""
    reference = _run(flux, 3)
    budget = streaming_budget(flux, MIN_RESERVE_BYTES)
    flux.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    group = pipeline_state(flux.pipe).group
    monkeypatch.setattr(_device, "peak_allocated", lambda device: group.loaded_bytes() + 1000)
    timestamp, stamps = _device.compute_timestamp, []
    monkeypatch.setattr(_device, "compute_timestamp", lambda device: stamps.append(device) or timestamp(device))
    per_call = []
    for _ in range(4):
        stamps.clear()
        assert torch.equal(_run(flux, 3), reference)
        per_call.append(len(stamps))
    assert per_call[0] > 0 and per_call[1] > 0, per_call
    assert per_call[2:] == [0, 0], per_call
    assert group.budget_watch.on_call_start is None, "timed again, and done"
    assert flux.pipe.residency_report()["transformer"].step_compute_seconds is not None, "the last step timed stands"


def test_a_step_timed_under_a_plan_that_retried_is_not_planned_for(flux: PipelineCase, monkeypatch: pytest.MonkeyPatch) -> None:
    """Retries under the cap stretch the steps of the calls they come in, not only the measuring
    call's: the plan made for them (told as that call returns) waits for a step timed under it."""
    reference = _run(flux, 3)
    budget = streaming_budget(flux, MIN_RESERVE_BYTES)
    flux.pipe.enable_pinned_offload("cpu", vram_budget=budget)
    group = pipeline_state(flux.pipe).group
    monkeypatch.setattr(_device, "peak_allocated", lambda device: group.loaded_bytes() + 1000)
    retries = [0]
    monkeypatch.setattr(_device, "allocator_retries", lambda device: retries[0])
    stalled = [True]

    def retrying(*_: object) -> None:
        if stalled[0]:
            retries[0] += 1  # the allocator's synchronising retries, stretching the step
            time.sleep(STALL_SECONDS)

    for block in group.units_of("transformer")[1:]:
        block.module.register_forward_pre_hook(retrying)
    assert torch.equal(_run(flux, 3), reference)  # measures, stretched
    assert torch.equal(_run(flux, 3), reference)  # under the plan: retries again, stretched
    stretched = flux.pipe.residency_plan()
    stalled[0] = False
    for _ in range(3):  # the retries told and planned for; then a step timed under that plan
        assert torch.equal(_run(flux, 3), reference)
    plan = flux.pipe.residency_plan()
    assert plan.timings["transformer"].compute_per_byte < stretched.timings["transformer"].compute_per_byte / 2, str(plan)
    assert group.budget_watch.on_call_start is None, "done"


def test_host_time_in_the_hooks_is_reported_and_a_cast_through_blocks_counts_once() -> None:
    case = PipelineCase("sdxl")
    case.pipe.enable_pinned_offload("cpu", components={"vae": "streamed"}, vram_budget=None)
    assert torch.equal(case.run(), case.reference)
    report = case.pipe.residency_report()
    assert all(c.host_seconds > 0 for c in report.components), str(report)
    assert "host s" in str(report)
    vae = case.pipe.vae
    assert len(pipeline_state(case.pipe).group.units_of("vae")) > 1, "the VAE streams its blocks"

    before = report["vae"].host_seconds
    started = time.perf_counter()
    vae.to(torch.float64)
    vae.to(torch.float32)
    elapsed = time.perf_counter() - started
    # nn.Module._apply recurses from the trunk into every block, each with a hook of its own: timed
    # at every level, the blocks' time would count twice.
    added = case.pipe.residency_report()["vae"].host_seconds - before
    assert 0 < added <= elapsed, (added, elapsed)
    assert torch.equal(case.run(), case.reference)
