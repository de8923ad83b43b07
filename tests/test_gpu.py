"""The same guarantees where they are real: CUDA streams, pinned masters, the caching allocator.

Marked ``gpu``: skipped on machines without CUDA (CI), run on the GPU machine.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from diffusers_residency import _device
from diffusers_residency.pipeline import pipeline_state
from diffusers_residency.pipeline_residency import AT_ENABLE
from diffusers_residency.policy import Policy

from .helpers import PipelineCase, assert_warmed_once_per_layout, assert_weights_equal, record_block_runs, staging_hooks

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def release_pipelines():
    """Collect each test's pipelines, so their page-locked masters are unregistered before the next.
    A failed test's pipeline lives on in its traceback: its offload is disabled instead."""
    yield
    for case in list(PipelineCase.live):
        if pipeline_state(case.pipe) is not None:
            case.pipe.disable_pinned_offload()
    gc.collect()


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def staged_from_host(kind: str = "flux", dtype: torch.dtype = torch.bfloat16) -> PipelineCase:
    """A pipeline whose reference output was computed resident on CUDA, then moved to the host and
    put under pinned offload."""
    case = PipelineCase(kind, device="cuda", dtype=dtype)
    case.pipe.to("cpu")
    case.pipe.enable_pinned_offload(vram_budget=None)  # staged per model_cpu_offload_seq, not planned
    return case


def param_devices(pipe) -> dict[str, set[torch.device]]:
    return {
        name: {t.device for t in module.parameters()}
        for name, module in pipe.components.items()
        if isinstance(module, torch.nn.Module)
    }


@pytest.mark.parametrize(
    "kind, dtype, start",
    [("flux", torch.bfloat16, "cpu"), ("sdxl", torch.float16, "cuda")],
    ids=["flux-bf16-from-host", "sdxl-fp16-from-device"],
)
def test_cuda_output_equals_resident(kind: str, dtype: torch.dtype, start: str, monkeypatch: pytest.MonkeyPatch) -> None:
    case = PipelineCase(kind, device="cuda", dtype=dtype)  # the reference runs resident on CUDA
    if kind == "sdxl":
        # The VAE upcast to fp32 and back inside the call is the path under test.
        assert case.pipe.vae.config.force_upcast and case.pipe.vae.dtype == torch.float16
    case.pipe.to(start)
    devices_before = param_devices(case.pipe)
    before = case.state()

    case.pipe.enable_pinned_offload(vram_budget=None)
    assert case.pipe._execution_device == CUDA
    report = case.pipe.residency_report()
    assert all(c.pinned for c in report.components), str(report)
    assert all(t.device.type == "cpu" for m in staging_hooks(case.pipe) for t in case.pipe.components[m].parameters())

    assert torch.equal(case.run(), case.reference), "first call differs from resident"
    assert torch.equal(case.run(), case.reference), "second call differs from resident"
    report = case.pipe.residency_report()
    assert all(c.loads >= 2 and c.load_gbps for c in report.components if c.policy == "staged"), str(report)
    if kind == "sdxl":
        registered = []
        register = _device.register_host_memory
        monkeypatch.setattr(_device, "register_host_memory", lambda *args: registered.append(args) or register(*args))
        assert torch.equal(case.run(), case.reference), "third call differs from resident"
        assert not registered, "the VAE's upcast and cast back bind the masters the call before took"

    case.pipe.disable_pinned_offload()
    assert param_devices(case.pipe) == devices_before
    assert_weights_equal(before, case.state())


def test_offload_copies_nothing_to_the_host_and_allocates_no_host_memory() -> None:
    case = staged_from_host()
    case.run()
    group = case.pipe.__dict__["_pinned_residency"].group
    units = [u for u in group.units if u.policy.value == "staged"]

    def cycle(times: int) -> None:
        for _ in range(times):
            for unit in units:
                group.activate(unit)  # loads this one, offloads the others
        torch.cuda.synchronize()

    cycle(1)
    rss_before = rss_bytes()
    cycle(20)
    rss_growth = rss_bytes() - rss_before
    assert rss_growth < 8 * 2**20, f"host memory grew by {rss_growth} bytes over {20 * len(units)} offloads"

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        cycle(5)
    memcpys = [e.name for e in prof.events() if "memcpy" in e.name.lower()]
    assert any("HtoD" in name for name in memcpys), "the profiler saw no loads: the check would be blind"
    assert not [name for name in memcpys if "DtoH" in name], memcpys
    assert torch.equal(case.run(), case.reference)


def test_loads_do_not_block_the_host() -> None:
    """A load is queued behind the compute stream: the host returns before the copy finishes."""
    case = staged_from_host()
    group = case.pipe.__dict__["_pinned_residency"].group
    unit = next(u for u in group.units if u.name == "transformer")
    busy = torch.randn(8192, 8192, device=CUDA)
    torch.cuda.synchronize()
    for _ in range(20):
        busy = busy @ busy  # queue work on the compute stream
    group.activate(unit)
    assert not torch.cuda.current_stream().query(), "activate() waited for the device"
    torch.cuda.synchronize()
    assert torch.equal(case.run(), case.reference)


def test_level_1_sleep_frees_the_device_and_wakes_exact() -> None:
    baseline = torch.cuda.memory_allocated()
    case = PipelineCase("flux", device="cuda", dtype=torch.bfloat16)
    resident = torch.cuda.memory_allocated() - baseline
    case.pipe.sleep()  # no pinned offload yet: sleep takes the masters itself, once
    assert case.pipe.is_sleeping
    assert torch.cuda.memory_allocated() - baseline < 0.01 * resident
    assert case.pipe.residency_report().device_bytes == 0
    case.pipe.wake_up()
    assert all(c.loaded for c in case.pipe.residency_report().components)
    assert torch.equal(case.run(), case.reference)


def test_layers_added_while_loaded_leave_the_device_with_their_component() -> None:
    case = staged_from_host()
    case.pipe.enable_pinned_offload(components={"transformer": "resident"}, vram_budget=None)
    case.run()
    case.pipe.transformer.fuse_qkv_projections()  # its fused layers made on the device
    case.pipe.sleep(offload=["transformer"])
    assert param_devices(case.pipe)["transformer"] == {torch.device("cpu")}
    assert case.pipe.residency_report()["transformer"].device_bytes == 0
    case.pipe.wake_up()
    case.run()
    case.pipe.disable_pinned_offload()
    assert param_devices(case.pipe)["transformer"] == {torch.device("cpu")}


def test_level_2_sleep_frees_pinned_masters_and_wakes_exact(tmp_path, monkeypatch) -> None:
    from diffusers_residency import pinning, ring

    # A ring of two small slots: each is copied out of and read into again many times, so a slot
    # read into before its copy to the device ran would show in the outputs.
    monkeypatch.setattr(ring, "_RING_SLOT_BYTES", 256 << 10)
    monkeypatch.setattr(ring, "_RING_SLOTS", 2)
    case = PipelineCase("flux", device="cuda", dtype=torch.bfloat16)
    case.pipe.save_pretrained(tmp_path)
    case.pipe.register_to_config(_name_or_path=str(tmp_path))
    locked = []
    for _ in range(2):
        case.pipe.sleep(level=2)
        report = case.pipe.residency_report()
        assert all(c.mapped_bytes >= 0.95 * c.weight_bytes for c in report.components), str(report)
        case.pipe.wake_up()
        assert torch.equal(case.run(), case.reference)
        case.pipe.sleep()  # waits for the masters read back
        report = case.pipe.residency_report()
        assert all(c.mapped_bytes == 0 and c.pinned for c in report.components), str(report)
        case.pipe.wake_up()
        assert torch.equal(case.run(), case.reference)
        locked.append(pinning.locked_bytes())
    assert locked[0] == locked[1], "no slot of the ring is left locked"


def test_a_level_2_sleeper_called_under_inference_mode_wakes_exact_and_warns_nothing(tmp_path, caplog) -> None:
    """The masters read back from the files after a wake under ``torch.inference_mode()`` are read
    on threads that are not in inference mode: nothing of that may fail or warn."""
    case = PipelineCase("flux", device="cuda", dtype=torch.bfloat16)
    case.pipe.save_pretrained(tmp_path)
    case.pipe.register_to_config(_name_or_path=str(tmp_path))
    case.pipe.to("cpu")
    case.pipe.enable_pinned_offload(vram_budget=None)
    case.run()
    caplog.set_level("WARNING", logger="diffusers_residency")
    for _ in range(3):
        case.pipe.sleep(level=2)
        with torch.inference_mode():
            assert torch.equal(case.run(), case.reference)
            assert torch.equal(case.run(), case.reference)
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("diffusers_residency")]


def test_hundred_sleep_wake_cycles_keep_memory_flat() -> None:
    case = PipelineCase("flux", device="cuda", dtype=torch.bfloat16)

    def cycles(times: int) -> None:
        for _ in range(times):
            case.pipe.sleep()
            case.pipe.wake_up()
        torch.cuda.synchronize()

    cycles(10)
    device_before, reserved_before, rss_before = torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), rss_bytes()
    cycles(90)
    assert torch.cuda.memory_allocated() == device_before
    assert torch.cuda.memory_reserved() <= reserved_before
    assert rss_bytes() - rss_before < 16 * 2**20
    assert torch.equal(case.run(), case.reference)


def test_a_rotation_wakes_into_the_sleeping_pipelines_cache_and_gives_the_rest_back() -> None:
    from diffusers_residency import AwakeRotation

    baseline = torch.cuda.memory_allocated()
    flux = PipelineCase("flux", device="cuda", dtype=torch.bfloat16)
    flux_bytes = torch.cuda.memory_allocated() - baseline
    sdxl = PipelineCase("sdxl", device="cuda", dtype=torch.float16)
    sdxl_bytes = torch.cuda.memory_allocated() - baseline - flux_bytes
    rotation = AwakeRotation({"flux": flux.pipe, "sdxl": sdxl.pipe})
    reserved_after: dict[str, int] = {}
    for name, case, weights in [("flux", flux, flux_bytes), ("sdxl", sdxl, sdxl_bytes)] * 3:
        rotation.use(name)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - baseline
        assert weights <= held < weights + 2**20, "the sleeping pipeline holds nothing (a load pads each copy to 512 bytes)"
        # The cache left after a switch is given back at the next: it does not pile up.
        reserved = reserved_after.setdefault(name, torch.cuda.memory_reserved())
        assert torch.cuda.memory_reserved() <= reserved
        assert torch.equal(case.run(), case.reference)


def test_a_rotation_keeping_the_cache_never_gives_it_back_and_never_piles_it_up() -> None:
    from diffusers_residency import AwakeRotation

    flux = PipelineCase("flux", device="cuda", dtype=torch.bfloat16)
    sdxl = PipelineCase("sdxl", device="cuda", dtype=torch.float16)
    rotation = AwakeRotation({"flux": flux.pipe, "sdxl": sdxl.pipe}, keep_cache=True)
    freed = torch.cuda.memory_stats()["segment.all.freed"]
    reserved = [torch.cuda.memory_reserved()]
    for name, case in [("flux", flux), ("sdxl", sdxl)] * 3:
        rotation.use(name)
        assert torch.equal(case.run(), case.reference)
        reserved.append(torch.cuda.memory_reserved())
    assert torch.cuda.memory_stats()["segment.all.freed"] == freed, "a switch gave device memory back"
    assert reserved == sorted(reserved), f"a switch gave cache back: {reserved}"
    assert reserved[-1] <= reserved[2], f"the switches after the first two reserved more: {reserved}"


def test_lora_loaded_after_enable_runs_on_cuda_and_matches_resident() -> None:
    pytest.importorskip("peft")
    from .test_changing_weights import lora_state_dict

    resident = PipelineCase("flux", device="cuda", dtype=torch.bfloat16)
    lora = lora_state_dict(resident)
    resident.pipe.load_lora_weights(lora, adapter_name="style")
    case = staged_from_host()
    case.run()
    case.pipe.load_lora_weights(lora, adapter_name="style")
    assert torch.equal(case.run(), resident.run())
    case.pipe.transformer.fuse_qkv_projections()
    resident.pipe.transformer.fuse_qkv_projections()
    assert torch.equal(case.run(), resident.run())


def test_adapters_switched_hotswapped_and_deleted_on_cuda_match_resident() -> None:
    pytest.importorskip("peft")
    from .test_changing_weights import lora_state_dict, second_lora

    resident = PipelineCase("flux", device="cuda", dtype=torch.bfloat16)
    first, second = lora_state_dict(resident), second_lora(resident)
    case = staged_from_host()
    case.run()
    steps = [
        lambda pipe: pipe.load_lora_weights(first, adapter_name="style"),
        lambda pipe: pipe.load_lora_weights(second, adapter_name="detail"),
        lambda pipe: pipe.set_adapters(["style", "detail"], adapter_weights=[0.7, 0.4]),
        lambda pipe: pipe.load_lora_weights(second, adapter_name="style", hotswap=True),
        lambda pipe: pipe.delete_adapters("detail"),
    ]
    for step in steps:
        step(resident.pipe)
        step(case.pipe)
        assert torch.equal(case.run(), resident.run())


@pytest.mark.parametrize("order", ["casting-then-offload", "casting-then-offload-under-a-budget", "offload-then-casting"])
def test_layerwise_fp8_casting_on_cuda_matches_resident_casting(order: str) -> None:
    fp8 = torch.float8_e4m3fn
    resident = PipelineCase("flux", device="cuda", dtype=torch.bfloat16)
    resident.pipe.transformer.enable_layerwise_casting(storage_dtype=fp8, compute_dtype=torch.bfloat16)
    expected = resident.run()
    case = PipelineCase("flux", device="cuda", dtype=torch.bfloat16)
    case.pipe.to("cpu")
    budget = None
    if order.startswith("casting-then-offload"):
        case.pipe.transformer.enable_layerwise_casting(storage_dtype=fp8, compute_dtype=torch.bfloat16)
        budget = half_way_budget(case.pipe) if order.endswith("budget") else None
        case.pipe.enable_pinned_offload(vram_budget=budget)
        if budget is not None:
            # The first call planned from dry runs of the transformer's layers in bfloat16.
            state = pipeline_state(case.pipe)
            sources: list[str] = []
            first_block = state.group.units_of("transformer")[1].module
            hook = first_block.register_forward_pre_hook(lambda *_: sources.append(state.plan.source))
            assert torch.equal(case.run(), expected)
            hook.remove()
            assert sources[0].startswith("estimated by dry runs"), sources
    else:
        case.pipe.enable_pinned_offload(vram_budget=None)
        case.run()
        case.pipe.transformer.enable_layerwise_casting(storage_dtype=fp8, compute_dtype=torch.bfloat16)
    for _ in range(2):
        assert torch.equal(case.run(), expected)
    # Stored in float8: offloaded to the host after a call, or (under a budget) kept on the device.
    assert any(t.dtype == fp8 and (budget or t.device.type == "cpu") for t in case.pipe.transformer.parameters())


def test_masters_are_page_locked_without_rounding_and_unlocked_on_disable() -> None:
    from diffusers_residency import pinning

    case = PipelineCase("flux", device="cuda", dtype=torch.bfloat16)
    case.pipe.to("cpu")
    gc.collect()  # pipelines of earlier tests release their registrations
    before = pinning.locked_bytes()
    case.pipe.enable_pinned_offload()
    report = case.pipe.residency_report()
    staged = sum(c.weight_bytes for c in report.components)
    groups = sum(len(hook.unit.stager._groups) for hook in staging_hooks(case.pipe).values())
    assert all(c.pinned for c in report.components), str(report)
    assert all(t.is_pinned() for t in case.pipe.transformer.parameters())
    # Tiny weights are copied into one exactly sized block per component: slot padding, no rounding.
    assert staged <= pinning.locked_bytes() - before <= staged + groups * 576 + 8 * 4096
    for _ in range(2):
        assert torch.equal(case.run(), case.reference)
    case.pipe.disable_pinned_offload()
    assert pinning.locked_bytes() == before
    assert not any(t.is_pinned() for t in case.pipe.transformer.parameters())


def test_pin_budget_leaves_masters_pageable_and_loads_still_exact() -> None:
    case = PipelineCase("flux", device="cuda", dtype=torch.bfloat16)
    case.pipe.to("cpu")
    case.pipe.enable_pinned_offload(pin_budget=0, vram_budget=None)
    report = case.pipe.residency_report()
    assert all(c.pinned_bytes == 0 and c.pageable_bytes == c.weight_bytes for c in report.components), str(report)
    for _ in range(2):
        assert torch.equal(case.run(), case.reference)
    case.pipe.disable_pinned_offload()


@pytest.mark.parametrize("how", ["regional", "whole"])
def test_inductor_compiled_staged_transformer_never_recompiles(how: str) -> None:
    import torch._dynamo
    from torch._dynamo.utils import counters

    from .test_compile import compile_transformer

    torch._dynamo.reset()
    resident = PipelineCase("flux", device="cuda", dtype=torch.bfloat16)
    compile_transformer(resident, how, "inductor")
    expected = resident.run()
    case = staged_from_host()
    compile_transformer(case, how, "inductor")
    counters.clear()
    first = case.run()
    graphs = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        later = [case.run() for _ in range(2)]
    assert counters["stats"]["unique_graphs"] == graphs
    for output in (first, *later):
        torch.testing.assert_close(output, expected, rtol=1.6e-2, atol=1e-2)
    torch._dynamo.reset()


@pytest.mark.parametrize("policy", ["resident", "staged"])
def test_cuda_graphs_of_a_staged_transformer_record_once_per_set_of_weight_addresses(policy: str) -> None:
    """mode="reduce-overhead": the graphs replay at the addresses they captured. Kept on the device,
    the weights never move and one graph serves every call; loaded at each call, they come back
    where the allocator has room, and a graph is recorded for each new set of addresses only."""
    import warnings

    import torch._dynamo
    from torch._dynamo.utils import counters

    from diffusers_residency.bench.compiling import cuda_graphs_recorded

    torch._dynamo.reset()
    try:
        resident = PipelineCase("flux", device="cuda", dtype=torch.bfloat16)
        resident.pipe.transformer.compile(mode="reduce-overhead", fullgraph=True)
        expected = [resident.run() for _ in range(2)][-1]  # the first call only warms the graph up
        del resident
        torch._dynamo.reset()
        counters.clear()
        case = PipelineCase("flux", device="cuda", dtype=torch.bfloat16)
        case.pipe.to("cpu")
        kept = {"transformer": "resident"} if policy == "resident" else None
        case.pipe.enable_pinned_offload(vram_budget=None, components=kept)
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            case.pipe.transformer.compile(mode="reduce-overhead", fullgraph=True)
        about_graphs = [str(w.message) for w in warned if "CUDA graphs" in str(w.message)]
        assert bool(about_graphs) == (policy == "staged"), about_graphs
        addresses = set()
        weights = list(case.pipe.transformer.parameters())
        case.pipe.transformer.register_forward_hook(lambda *_: addresses.add(tuple(w.data_ptr() for w in weights)))
        outputs = [case.run()]
        with torch._dynamo.config.patch(error_on_recompile=True):
            outputs += [case.run() for _ in range(5)]
        assert counters["inductor"]["cudagraph_skips"] == 0, "the graphs were replayed, not skipped"
        assert cuda_graphs_recorded(CUDA) == len(addresses), len(addresses)
        if policy == "resident":
            assert len(addresses) == 1
        for output in outputs:
            torch.testing.assert_close(output, expected, rtol=1.6e-2, atol=1e-2)
    finally:
        torch._dynamo.reset()


def test_auto_budget_keeps_everything_resident_and_moves_nothing_after_the_first_call() -> None:
    case = PipelineCase("flux", device="cuda", dtype=torch.bfloat16)
    case.pipe.to("cpu")
    case.pipe.enable_pinned_offload()  # vram_budget="auto": the whole pipeline fits
    assert {p.policy.value for p in case.pipe.residency_plan().components} == {"resident"}
    assert torch.equal(case.run(), case.reference)
    loads = sum(c.loads for c in case.pipe.residency_report().components)
    for _ in range(2):
        assert torch.equal(case.run(), case.reference)
    assert sum(c.loads for c in case.pipe.residency_report().components) == loads


def test_streamed_blocks_on_cuda_are_exact_within_budget_and_reuse_device_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    from .helpers import RESERVE, streaming_budget
    from .test_streaming import _record_loaded_bytes

    case = PipelineCase("flux", device="cuda", dtype=torch.bfloat16)
    case.pipe.to("cpu")
    reserve = 256 * 2**20  # the tiny pipeline's activations, cuBLAS workspaces and rounding
    budget = streaming_budget(case) - RESERVE + reserve  # the same room for weights
    gc.collect()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    peaks = record_peaks(monkeypatch)
    case.pipe.enable_pinned_offload(vram_budget=budget, activation_reserve=reserve)
    plan = case.pipe.residency_plan()
    assert plan["transformer"].policy.value == "streamed" and len(plan["transformer"].resident_blocks) > 0, str(plan)
    seen = _record_loaded_bytes(case)
    for _ in range(2):
        assert torch.equal(case.run(), case.reference)
    mallocs = torch.cuda.memory_stats()["segment.all.allocated"]
    assert torch.equal(case.run(), case.reference)
    assert torch.cuda.memory_stats()["segment.all.allocated"] == mallocs, "a warm call allocated new device memory"
    assert max(seen) <= budget - reserve, str(plan)
    assert max(peaks + [torch.cuda.max_memory_allocated()]) - baseline <= budget
    group = pipeline_state(case.pipe).group
    streamed = [u for u in group.units_of("transformer") if u.policy.value == "streamed" and u.stream is not None]
    assert all(u.stager.loads >= 3 for u in streamed)
    assert all(u.stager.pinned for u in group.units)
    case.pipe.disable_pinned_offload()
    assert all(t.device.type == "cpu" for t in case.pipe.transformer.parameters())


@pytest.mark.parametrize("masters", ["page-locked", "pageable"])
def test_with_no_block_streamed_on_cuda_the_first_block_queues_every_staged_load_and_stays_exact(masters: str) -> None:
    from diffusers_residency import ResidencyGroup, attach_block_streaming, detach_staging_hook

    from .test_streaming import _record_loaded_while_running

    case = PipelineCase("flux", device="cuda", dtype=torch.bfloat16)
    group = ResidencyGroup("cuda", pin_budget=None if masters == "page-locked" else 0)
    transformer = case.pipe.transformer.to("cpu")
    attach_block_streaming(transformer, group, name="transformer", resident_blocks=[0], prefetch_blocks=1)
    try:
        blocks = group.units_of("transformer")[1:]
        for block in blocks[1:]:
            block.policy = Policy.STAGED
        blocks[0].stream.replan()
        assert len(blocks) > 3 and all(block.stager.pinned == (masters == "page-locked") for block in blocks)
        expected = [block.name for block in blocks[1:]] if masters == "page-locked" else [blocks[1].name]
        assert torch.equal(case.run(), case.reference)  # learns the order the blocks run in
        for _ in range(2):
            # Nothing else in the group evicts the staged blocks between calls, as the next component would.
            for block in blocks[1:]:
                block.stager.offload()
            loaded_while_running = _record_loaded_while_running(blocks, Policy.STAGED)
            assert torch.equal(case.run(), case.reference)
            assert loaded_while_running[blocks[0].name] == expected
    finally:
        detach_staging_hook(transformer)


def test_a_streamed_step_is_timed_with_cuda_events() -> None:
    from .test_streaming import _run

    case = PipelineCase("flux", device="cuda", dtype=torch.bfloat16)
    reference = _run(case, 3)
    case.pipe.to("cpu")
    case.pipe.enable_pinned_offload(components={"transformer": "streamed"}, vram_budget=None)
    for _ in range(2):
        assert torch.equal(_run(case, 3), reference)
    first, latest = case.pipe.residency_report()["transformer"].step_compute_seconds
    assert 0 < first and 0 < latest
    # Each block timed on the device: its share of the step, which the planner simulates.
    stream = pipeline_state(case.pipe).group.stream_of("transformer")
    shares = stream.step_compute_shares()
    assert len(shares) == len(stream.blocks) and min(shares) > 0 and sum(shares) == pytest.approx(1)


@pytest.mark.parametrize("kind", ["flux", "sdxl"])
def test_the_first_call_measures_each_component_on_cuda_and_the_plan_stays_in_budget(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = PipelineCase(kind, device="cuda", dtype=torch.bfloat16)
    case.pipe.to("cpu")
    budget = half_way_budget(case.pipe)
    peaks = record_peaks(monkeypatch)
    case.pipe.enable_pinned_offload(vram_budget=budget)  # resets the peak
    before = case.pipe.residency_plan()
    # Planned at enable from the default call's dry runs, its resident blocks loaded: within budget.
    assert before.source == AT_ENABLE and len(before.activations) == 2, str(before)
    assert torch.cuda.memory_allocated() <= budget
    for _ in range(3):
        assert torch.equal(case.run(), case.reference)
    after = case.pipe.residency_plan()
    assert after.source == "measured" and set(after.activations) == {p.name for p in after.components}, str(after)
    assert after.resident_weight_bytes > _trunks(after), str(after)
    assert after.peak_bytes <= budget, str(after)
    assert max(peaks + [torch.cuda.max_memory_allocated()]) <= budget


def half_way_budget(pipe) -> int:
    """The default reserve (3 GiB) and room for the measuring plan's weights and half the rest."""
    from diffusers_residency.components import component_sizes, module_components
    from diffusers_residency.planner import MIN_RESERVE_BYTES, plan_residency

    sizes = component_sizes(pipe, module_components(pipe))
    least = plan_residency(sizes, 10**12, MIN_RESERVE_BYTES, least=True).peak_weight_bytes
    return MIN_RESERVE_BYTES + least + (sum(s.nbytes for s in sizes) - least) // 2


def record_peaks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The device's allocated peak before each reset the package makes (budget watches reset it at
    component switches), with the peak now appended by the caller: the peak over every call."""
    peaks: list[int] = []
    reset = _device.reset_peak_allocated

    def recording(device: torch.device) -> None:
        peaks.append(torch.cuda.max_memory_allocated(device))
        reset(device)

    monkeypatch.setattr(_device, "reset_peak_allocated", recording)
    return peaks


def _trunks(plan) -> int:
    by_name = {s.name: s for s in plan.sizes}
    return sum(by_name[p.name].trunk_bytes for p in plan.components if p.policy.value == "streamed")


def test_a_second_pipeline_plans_its_first_call_from_the_profile_the_first_saved_on_cuda(monkeypatch) -> None:
    first = PipelineCase("flux", device="cuda", dtype=torch.bfloat16)
    first.pipe.to("cpu")
    budget = half_way_budget(first.pipe)
    first.pipe.enable_pinned_offload(vram_budget=budget)
    assert torch.equal(first.run(), first.reference)
    learned = first.pipe.residency_plan()
    assert learned.source == "measured", str(learned)
    first.pipe.disable_pinned_offload()

    second = PipelineCase("flux", device="cuda", dtype=torch.bfloat16)
    second.pipe.to("cpu")
    peaks = record_peaks(monkeypatch)
    runs = record_block_runs(monkeypatch)
    second.pipe.enable_pinned_offload(vram_budget=budget)
    assert_warmed_once_per_layout(runs, second.pipe)
    group = pipeline_state(second.pipe).group
    measured: list[bool] = []
    second.pipe.text_encoder.register_forward_pre_hook(lambda *_: measured.append(group.measures_next_call))
    for _ in range(2):
        assert torch.equal(second.run(), second.reference)
    assert measured == [False, False], "planned from the profile: no measuring call"
    plan = second.pipe.residency_plan()
    assert plan.source == "from the residency profile" and plan.activations == learned.activations, str(plan)
    # Text encoders that the first pipeline hooked by blocks, and that its figures do not stream,
    # are hooked whole where the measuring plan has room for them so (the CPU test makes that
    # room); the others keep the plan learned.
    streamed = {p.name for p in learned.components if p.policy is Policy.STREAMED}
    whole = {p.name for p in plan.components if p.name in streamed and p.policy is not Policy.STREAMED}
    assert whole <= {"text_encoder", "text_encoder_2"}, (str(learned), str(plan))
    assert all(len(group.units_of(name)) == 1 for name in whole), (str(learned), str(plan))
    assert all(plan[p.name] == p for p in learned.components if p.name not in whole), (str(learned), str(plan))
    assert max(peaks + [torch.cuda.max_memory_allocated()]) <= budget


def test_a_pipeline_enabled_from_a_profile_makes_its_calls_casts_at_enable_and_its_first_call_pins_nothing(
    monkeypatch,
) -> None:
    """SDXL in float16 casts its VAE to float32 and back in every call: enabled from a profile, the
    casts are made as the pipeline is enabled, their float32 masters page-locked then, and the
    first call page-locks nothing."""
    first = PipelineCase("sdxl", device="cuda", dtype=torch.float16)
    first.pipe.to("cpu")
    budget = half_way_budget(first.pipe)
    first.pipe.enable_pinned_offload(vram_budget=budget)
    assert torch.equal(first.run(), first.reference)
    first.pipe.disable_pinned_offload()

    second = PipelineCase("sdxl", device="cuda", dtype=torch.float16)
    second.pipe.to("cpu")
    second.pipe.enable_pinned_offload(vram_budget=budget)
    assert second.pipe.residency_plan().source == "from the residency profile"
    vae = second.pipe.residency_report()["vae"]
    assert vae.pinned_bytes == 3 * vae.weight_bytes, "its float16 masters and the float32 ones, before any call"
    registered = []
    register = _device.register_host_memory
    monkeypatch.setattr(_device, "register_host_memory", lambda *args: registered.append(args) or register(*args))
    assert torch.equal(second.run(), second.reference)
    assert not registered, "the first call's casts bind the masters made at enable"


def test_a_smaller_shape_runs_its_first_call_under_the_larger_ones_plan_on_cuda_within_budget(monkeypatch) -> None:
    from diffusers_residency.bench.builders import call_kwargs, pipeline_output

    case = PipelineCase("flux", device="cuda", dtype=torch.bfloat16)
    small = pipeline_output(case.pipe, call_kwargs("flux", height=32, width=32))
    case.pipe.to("cpu")
    budget = half_way_budget(case.pipe)
    case.pipe.enable_pinned_offload(vram_budget=budget)
    state = pipeline_state(case.pipe)
    sources: list[str] = []
    case.pipe.text_encoder.register_forward_pre_hook(lambda *_: sources.append(state.plan.source))
    pipeline_output(case.pipe, call_kwargs("flux", height=64, width=64))
    large = case.pipe.residency_plan()
    torch.cuda.reset_peak_memory_stats()
    peaks = record_peaks(monkeypatch)
    for _ in range(2):
        assert torch.equal(pipeline_output(case.pipe, call_kwargs("flux", height=32, width=32)), small)
    assert sources == [AT_ENABLE, f"estimated from calls of {large.shape}", "measured"], sources
    assert max(peaks + [torch.cuda.max_memory_allocated()]) <= budget


@pytest.mark.parametrize("component", ["transformer", "vae"])
def test_a_step_or_decode_short_of_memory_under_dry_run_estimates_runs_again_on_cuda_and_is_exact(component) -> None:
    from diffusers_residency.pipeline_residency import DRY_RUN

    case = PipelineCase("flux", device="cuda", dtype=torch.bfloat16)
    case.pipe.to("cpu")
    case.pipe.enable_pinned_offload(vram_budget=half_way_budget(case.pipe))
    state = pipeline_state(case.pipe)
    attempts: list[tuple[str, int]] = []

    def short_at_first(*_) -> None:
        others = sum(u.stager.weight_bytes for u in state.group.units if u.component != component and u.stager.loaded)
        attempts.append((state.plan.source, others))
        if len(attempts) == 1:
            raise torch.OutOfMemoryError("short")  # where the allocator raises when a cap leaves no room

    # Inside the denoiser's first block (its stream has entered it), or the decoder's middle block.
    first_block = state.group.units_of("transformer")[1].module
    where = first_block.norm1 if component == "transformer" else case.pipe.vae.decoder.mid_block
    hook = where.register_forward_pre_hook(short_at_first)
    assert torch.equal(case.run(), case.reference)
    hook.remove()
    (source, kept), (retried_under, left) = attempts[:2]
    assert source == DRY_RUN and kept > 0, attempts  # the text encoders, the denoiser's blocks
    assert retried_under == "" and left == 0, "run again with nothing else on the device"
    assert case.pipe.residency_plan().source == "measured"
    assert torch.equal(case.run(), case.reference)


def test_a_first_call_planned_from_dry_runs_on_cuda_plans_its_other_steps_for_a_step_timed_with_events(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from diffusers_residency.bench.builders import call_kwargs, pipeline_output
    from diffusers_residency.pipeline_residency import DRY_RUN

    case = PipelineCase("flux", device="cuda", dtype=torch.bfloat16)
    reference = pipeline_output(case.pipe, call_kwargs("flux", steps=6))
    case.pipe.to("cpu")
    budget = half_way_budget(case.pipe)
    peaks = record_peaks(monkeypatch)
    case.pipe.enable_pinned_offload(vram_budget=budget)
    state = pipeline_state(case.pipe)
    plans = []
    state.group.units_of("transformer")[2].module.register_forward_pre_hook(lambda *_: plans.append(state.plan))
    assert torch.equal(pipeline_output(case.pipe, call_kwargs("flux", steps=6)), reference)
    assert len(plans) == 6 and {plan.source for plan in plans} == {DRY_RUN}, plans
    # From the third step on at the earliest: the second is the first timed, read once it ran.
    timed = [step for step, plan in enumerate(plans) if "transformer" in plan.timings]
    assert timed and timed[0] >= 2 and timed == list(range(timed[0], 6)), timed
    assert max(peaks + [torch.cuda.max_memory_allocated()]) <= budget
    assert torch.equal(pipeline_output(case.pipe, call_kwargs("flux", steps=6)), reference)


def test_masters_served_from_files_on_cuda_are_exact_and_the_ring_is_unlocked_on_disable(tmp_path) -> None:
    from diffusers_residency import pinning

    case = PipelineCase("flux", device="cuda", dtype=torch.bfloat16)
    case.pipe.to("cpu")  # new host tensors, in no file: written once to the offload folder
    gc.collect()
    before = pinning.locked_bytes()
    total = sum(sum(t.nbytes for t in m.state_dict().values()) for m in case.pipe.components.values() if isinstance(m, torch.nn.Module))
    case.pipe.enable_pinned_offload(
        vram_budget=None, components={"transformer": "streamed"}, host_budget=int(0.6 * total), offload_folder=tmp_path
    )
    plan = case.pipe.residency_plan()
    assert plan.host.blocks.get("transformer") and plan.host.components, str(plan)
    for _ in range(3):
        assert torch.equal(case.run(), case.reference)
    report = case.pipe.residency_report()
    assert all(report[name].mapped_bytes and report[name].read_gbps for name in plan.host.components), str(report)
    assert pinning.locked_bytes() - before >= plan.host.ring_bytes, "the ring is page-locked once, and kept"
    case.pipe.disable_pinned_offload()
    assert pinning.locked_bytes() == before
    case.pipe.to("cuda")
    assert torch.equal(case.run(), case.reference)


def test_a_host_budget_is_refused_for_weights_on_the_device_before_anything_changes() -> None:
    case = PipelineCase("flux", device="cuda", dtype=torch.bfloat16)
    total = sum(sum(t.nbytes for t in m.state_dict().values()) for m in case.pipe.components.values() if isinstance(m, torch.nn.Module))
    with pytest.raises(ValueError, match="pipe.to\\('cpu'\\)"):
        case.pipe.enable_pinned_offload(vram_budget=None, host_budget=int(0.6 * total))
    assert pipeline_state(case.pipe) is None
    assert all(devices == {CUDA} for devices in param_devices(case.pipe).values())
    assert torch.equal(case.run(), case.reference)


_KEPT_SEGMENTS_SCRIPT = """
import json, torch
from diffusers_residency import sleep, wake_up
from tests.helpers import PipelineCase

def segments_of(pipe):
    segments = torch.cuda.memory_snapshot()
    found = set()
    for module in pipe.components.values():
        for tensor in module.parameters() if isinstance(module, torch.nn.Module) else ():
            address = tensor.data_ptr()
            found |= {s["is_expandable"] for s in segments if s["address"] <= address < s["address"] + s["total_size"]}
    return sorted(found)

case = PipelineCase("flux", device="cuda", dtype=torch.bfloat16)
case.pipe.to("cpu")
case.pipe.enable_pinned_offload(components={name: "resident" for name in ("text_encoder", "text_encoder_2", "transformer", "vae")})
equal = [torch.equal(case.run(), case.reference)]
sleep(case.pipe)
wake_up(case.pipe)
woken = segments_of(case.pipe)
equal.append(torch.equal(case.run(), case.reference))
probe = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
other = sorted({s["is_expandable"] for s in torch.cuda.memory_snapshot() if s["address"] <= probe.data_ptr() < s["address"] + s["total_size"]})
print(json.dumps({"equal": equal, "woken": woken, "other": other}))
"""


def test_kept_weights_take_segments_of_their_own_under_expandable_segments() -> None:
    """Resident weights woken after a sleep come from segments of their own, which the next level-1
    sleep gives back in one driver call each (see _device.segments_of_their_own); everything else
    keeps the expandable segments the process asked for. Its own process: the allocator reads its
    settings from the environment once."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("PYTORCH_ALLOC_CONF", None)
    done = subprocess.run([sys.executable, "-c", _KEPT_SEGMENTS_SCRIPT], check=False, env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["equal"] == [True, True]
    assert result["woken"] == [False], result
    assert result["other"] == [True], "an allocation of the process's own stays in an expandable segment"


@pytest.mark.parametrize(
    ("name", "dtype", "pixels"),
    [("flux_transformer", torch.bfloat16, 1024), ("flux_vae", torch.bfloat16, 1024), ("sdxl_vae", torch.float32, 1024)],
)
def test_a_dry_run_estimate_covers_what_the_device_needs_for_full_sized_components(name, dtype, pixels) -> None:
    """What the estimate stands for, on the device itself: the allocator's reserved peak less the
    weights (as a measuring call reads it), under expandable segments as the benchmark runs."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel

    from diffusers_residency.bench.architectures import ARCHITECTURES
    from diffusers_residency.dry_runs import ForwardDryRun, dry_run_need, meta_twin

    cls = FluxTransformer2DModel if name == "flux_transformer" else AutoencoderKL
    with torch.device(CUDA):
        module = cls.from_config(ARCHITECTURES["full"][name]).to(dtype).eval()
    if name == "flux_transformer":
        tokens = (pixels // 16) ** 2
        inputs = {
            "hidden_states": torch.randn(1, tokens, 64), "encoder_hidden_states": torch.randn(1, 512, 4096),
            "pooled_projections": torch.randn(1, 768), "timestep": torch.ones(1), "img_ids": torch.zeros(tokens, 3),
            "txt_ids": torch.zeros(512, 3), "guidance": torch.ones(1),
        }  # fmt: skip
        inputs = {key: value.to(CUDA, dtype) for key, value in inputs.items()}
        estimate = ForwardDryRun(module).need((), {**inputs, "return_dict": False})
        run = lambda: module(**inputs, return_dict=False)  # noqa: E731
    else:
        latents = torch.randn(1, module.config.latent_channels, pixels // 8, pixels // 8, device=CUDA, dtype=dtype)
        meta = torch.empty_like(latents, device="meta")
        estimate = dry_run_need(meta_twin(module), lambda twin: twin.decode(meta, return_dict=False), [meta])
        run = lambda: module.decode(latents, return_dict=False)  # noqa: E731
    inputs_bytes = sum(t.nbytes for t in inputs.values()) if name == "flux_transformer" else latents.nbytes
    needs = []
    for _ in range(2):  # the second, with the CUDA libraries warmed up, as calls after the first
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        # Everything allocated but the inputs is weights (or an earlier test's leftovers) here.
        weights = torch.cuda.memory_allocated() - inputs_bytes
        with torch.no_grad():
            run()
        torch.cuda.synchronize()
        needs.append(torch.cuda.max_memory_reserved() - weights)
    print(f"{name} at {pixels}x{pixels}: estimate {estimate / 1e9:.3f} GB, device {needs[0] / 1e9:.3f} then {needs[1] / 1e9:.3f} GB")
    # On the H200 the transformer's estimate came out 1.52x what it needed run alone, the VAEs' 1.06
    # and 1.08x (docs/measurements.md), and 1.66x in a later run (the transformer needing 0.590 GB
    # where it had needed 0.646): a first call keeps a little more room than it needs.
    assert max(needs) <= estimate <= 1.75 * max(needs)
