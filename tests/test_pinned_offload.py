"""enable_pinned_offload on real diffusers pipelines, on the CPU: outputs equal to resident, bit for bit."""

from __future__ import annotations

import copy
import functools
import threading
from types import SimpleNamespace

import accelerate
import pytest
import torch

import diffusers_residency
from diffusers_residency import ModuleStager, StagingHook, conversions
from diffusers_residency.bench.builders import PIPELINE_KINDS, build_pipeline, call_kwargs, pipeline_output
from diffusers_residency.pipeline import pipeline_state

from .helpers import (
    WITHOUT_AN_ACCELERATOR,
    PipelineCase,
    assert_no_meta_or_foreign_device,
    assert_weights_equal,
    build_without_an_accelerator,
    dtypes_compared,
    sdxl_in_float16,
    staging_hooks,
    threads_comparing,
    vae_through_bfloat16,
)


@pytest.mark.parametrize("kind", PIPELINE_KINDS)
def test_output_equals_resident_and_disable_restores(kind: str) -> None:
    case = PipelineCase(kind)
    before = case.state()

    case.pipe.enable_pinned_offload(device="cpu")
    hooks = staging_hooks(case.pipe)
    modules = {n for n, m in case.pipe.components.items() if isinstance(m, torch.nn.Module)}
    assert set(hooks) == modules, "every nn.Module component needs a hook for _execution_device"
    assert case.pipe._execution_device == torch.device("cpu")

    assert torch.equal(case.run(), case.reference), "first call differs from resident"
    assert torch.equal(case.run(), case.reference), "second call differs from resident"
    report = case.pipe.residency_report()
    assert all(c.loads >= 1 for c in report.components), str(report)
    staged = [c for c in report.components if c.policy == "staged"]
    assert sum(c.loaded for c in staged) == 1, "loading a staged component evicts the other staged ones"

    case.pipe.disable_pinned_offload()
    assert staging_hooks(case.pipe) == {}
    assert "to" not in case.pipe.__dict__
    assert_weights_equal(before, case.state())
    assert_no_meta_or_foreign_device(case.pipe)
    assert torch.equal(case.run(), case.reference)


def test_enable_twice_reconfigures(flux: PipelineCase) -> None:
    flux.pipe.enable_pinned_offload(device="cpu")
    stagers = {n: h.unit.stager for n, h in staging_hooks(flux.pipe).items()}
    flux.pipe.enable_pinned_offload(device="cpu", components={"vae": "resident", "text_encoder": "resident"})
    assert {n: h.unit.stager for n, h in staging_hooks(flux.pipe).items()} == stagers, "same device: masters kept"
    hooks = staging_hooks(flux.pipe)
    assert {n: h.unit.policy.value for n, h in hooks.items()} == {
        "text_encoder": "resident",
        "text_encoder_2": "staged",
        "transformer": "staged",
        "vae": "resident",
    }
    # One unit per module: a second enable never stacks a second hook.
    assert len(flux.pipe.__dict__["_pinned_residency"].group.units) == 4
    assert torch.equal(flux.run(), flux.reference)
    assert torch.equal(flux.run(), flux.reference)
    report = flux.pipe.residency_report()
    assert report["vae"].loaded and report["text_encoder"].loaded
    assert report["vae"].loads == 1 and report["text_encoder"].loads == 1, "resident components load once"
    assert report["transformer"].loads == 2


def test_a_decode_set_on_the_vae_runs_while_enabled_and_is_there_again_after(flux: PipelineCase) -> None:
    vae = flux.pipe.vae
    decoded: list[int] = []

    def counted(*args, decode=vae.decode, **kwargs):  # as a user's wrapper (or a compiled decode) would
        decoded.append(1)
        return decode(*args, **kwargs)

    vae.decode = counted
    flux.pipe.enable_pinned_offload(device="cpu")
    assert torch.equal(flux.run(), flux.reference) and decoded == [1]
    flux.pipe.enable_pinned_offload(device="cpu", components={"vae": "streamed"})  # another setup: hooked anew
    assert torch.equal(flux.run(), flux.reference) and decoded == [1, 1]
    flux.pipe.disable_pinned_offload()
    assert vae.decode is counted

    # One set while enabled is the user's last word: it stays after disabling.
    flux.pipe.enable_pinned_offload(device="cpu")
    set_while_enabled = functools.partial(vae.decode)
    vae.decode = set_while_enabled
    assert torch.equal(flux.run(), flux.reference)
    flux.pipe.disable_pinned_offload()
    assert vae.decode is set_while_enabled


def test_exclude_from_cpu_offload_is_resident(flux: PipelineCase) -> None:
    flux.pipe._exclude_from_cpu_offload = ["text_encoder"]
    flux.pipe.enable_pinned_offload(device="cpu")
    assert staging_hooks(flux.pipe)["text_encoder"].unit.policy.value == "resident"
    assert flux.pipe.residency_report()["text_encoder"].loaded, "loaded at enable, as diffusers keeps it on the device"
    assert torch.equal(flux.run(), flux.reference)
    # Asleep, it stays asleep through what reloads it otherwise (a deepcopy, a LoRA method).
    flux.pipe.sleep()
    copy.deepcopy(flux.pipe)
    flux.pipe.unfuse_lora()
    report = flux.pipe.residency_report()["text_encoder"]
    assert report.state != "awake" and not report.loaded, str(flux.pipe.residency_report())
    flux.pipe.wake_up()
    assert flux.pipe.residency_report()["text_encoder"].loaded
    assert torch.equal(flux.run(), flux.reference)


def test_functions_equal_methods(flux: PipelineCase) -> None:
    diffusers_residency.enable_pinned_offload(flux.pipe, "cpu")
    assert torch.equal(flux.run(), flux.reference)
    assert diffusers_residency.residency_report(flux.pipe)["transformer"].loads == 1
    diffusers_residency.disable_pinned_offload(flux.pipe)
    assert staging_hooks(flux.pipe) == {}


def test_report_prints_a_table(flux: PipelineCase) -> None:
    flux.pipe.enable_pinned_offload(device="cpu")
    flux.run()
    text = str(flux.pipe.residency_report())
    for word in ("component", "policy", "transformer", "text_encoder_2", "vae", "GB/s", "releases", "retains"):
        assert word in text


def test_plan_and_report_of_a_small_pipeline_give_sizes_in_a_unit_that_fits(flux: PipelineCase) -> None:
    """The tiny pipeline's components weigh kilobytes: in gigabytes every size would read 0.000."""
    flux.pipe.enable_pinned_offload(device="cpu")
    flux.run()
    transformer = flux.pipe.residency_report()["transformer"].weight_bytes
    assert transformer < 10**6, "a pipeline of kilobytes"
    for text in (str(flux.pipe.residency_plan()), str(flux.pipe.residency_report())):
        header = next(line for line in text.splitlines() if line.startswith("component"))
        row = next(line for line in text.splitlines() if line.startswith("transformer ")).split()
        assert " kB " in f"{header} " and "GB " not in header.replace("GB/s", ""), header
        assert f"{transformer / 1e3:.3f}" in row, (header, row)


# --- guards -----------------------------------------------------------------------------------------


def test_pipe_to_device_is_refused_and_dtype_passes(flux: PipelineCase) -> None:
    flux.pipe.enable_pinned_offload(device="cpu")
    with pytest.raises(RuntimeError, match="disable_pinned_offload"):
        flux.pipe.to("cpu")
    with pytest.raises(RuntimeError, match="disable_pinned_offload"):
        flux.pipe.to(device="meta")
    staged = flux.pipe.residency_report()["transformer"].weight_bytes
    flux.pipe.to(torch.float64)
    assert flux.pipe.residency_report()["transformer"].weight_bytes == 2 * staged, "masters follow the cast"
    flux.pipe.to(torch.float32)
    assert torch.equal(flux.run(), flux.reference)


def test_module_to_other_device_is_refused(flux: PipelineCase) -> None:
    flux.pipe.enable_pinned_offload(device="cpu")
    with pytest.raises(RuntimeError, match="disable_pinned_offload"):
        flux.pipe.transformer.to("meta")
    assert_no_meta_or_foreign_device(flux.pipe)
    assert torch.equal(flux.run(), flux.reference)


def test_dtype_cast_inside_pipeline_moves_the_masters(flux: PipelineCase) -> None:
    """SDXL-style upcast and downcast of a staged component: the masters follow, and a lossless round
    trip leaves the weights and the output bit-identical."""
    before = flux.state()
    flux.pipe.enable_pinned_offload(device="cpu")
    flux.run()  # the VAE is now loaded: the cast must go through the masters, not the device copy
    vae = flux.pipe.vae
    staged_fp32 = flux.pipe.residency_report()["vae"].weight_bytes
    vae.to(dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in vae.parameters())
    assert flux.pipe.residency_report()["vae"].weight_bytes == 2 * staged_fp32
    vae.to(dtype=torch.float32)
    assert flux.pipe.residency_report()["vae"].weight_bytes == staged_fp32
    assert torch.equal(flux.run(), flux.reference)
    flux.pipe.disable_pinned_offload()
    assert_weights_equal(before, flux.state())


def test_a_cast_to_the_dtype_a_component_has_moves_nothing(flux: PipelineCase) -> None:
    # Between the transformer's blocks, with the block about to run and the trunk loaded: a cast
    # that changes nothing leaves them there (offloaded, a forward on another thread would run on
    # storage handed to the next block).
    flux.pipe.enable_pinned_offload(device="cpu", vram_budget="2GB", components={"transformer": "streamed"})
    flux.run()
    units = pipeline_state(flux.pipe).group.units_of("transformer")
    moved = []

    def cast(*_) -> None:
        loaded = [unit for unit in units if unit.stager.loaded]
        flux.pipe.transformer.to(torch.float32)
        moved.append([unit.name for unit in loaded if not unit.stager.loaded])

    flux.pipe.transformer.transformer_blocks[1].register_forward_pre_hook(cast)
    assert torch.equal(flux.run(), flux.reference)
    assert moved and not any(moved), moved


@pytest.mark.parametrize("vae", ["staged", "streamed"])
def test_a_cast_back_and_forth_reuses_the_masters_of_each_side(flux: PipelineCase, vae: str) -> None:
    """SDXL casts its VAE up and back at every call: the second round trip binds the masters the
    first one took (no new host memory to page-lock), and a master written in place in between is
    converted afresh, not taken from what was kept."""
    flux.pipe.enable_pinned_offload(device="cpu", components={"vae": vae}, vram_budget=None)
    assert torch.equal(flux.run(), flux.reference)
    module = flux.pipe.vae

    def addresses() -> dict[str, int]:
        return {name: tensor.data_ptr() for name, tensor in [*module.named_parameters(), *module.named_buffers()]}

    module.to(dtype=torch.float64)
    wide = addresses()
    module.to(dtype=torch.float32)
    narrow = addresses()
    module.to(dtype=torch.float32)  # converts nothing, and forgets nothing
    assert torch.equal(flux.run(), flux.reference)
    module.to(dtype=torch.float64)
    assert addresses() == wide, "the float64 masters of the first upcast are bound again"
    module.to(dtype=torch.float32)
    assert addresses() == narrow, "and the float32 ones on the way back"

    weight = module.decoder.conv_out.weight  # offloaded by the cast: written into its master
    with torch.no_grad():
        weight.neg_()
    written = weight.detach().clone()
    module.to(dtype=torch.float64)
    assert torch.equal(weight, written.double()), "a master changed since is converted afresh"
    assert addresses().items() - wide.items() == {("decoder.conv_out.weight", weight.data_ptr())}
    with torch.no_grad():
        weight.neg_()  # exact: the weights are as they were
    module.to(dtype=torch.float32)
    assert torch.equal(flux.run(), flux.reference)


def test_a_master_written_before_a_cast_that_fails_part_way_is_converted_afresh(flux: PipelineCase) -> None:
    """A cast that fails part way leaves no parameter on a kept master that was not compared with
    its conversion: the next load would take that master as the weights (a comparison deferred to
    the end of the cast, or made elsewhere, must be settled on the way out too)."""
    flux.pipe.enable_pinned_offload(device="cpu", components={"vae": "staged"}, vram_budget=None)
    module = flux.pipe.vae
    module.to(dtype=torch.float64)
    module.to(dtype=torch.float32)  # both sides kept from here on
    weight = module.encoder.conv_in.weight  # among the first the cast visits
    with torch.no_grad():
        weight.neg_()
    written = weight.detach().clone()
    visited = []

    def fails_part_way(tensor: torch.Tensor) -> torch.Tensor:
        visited.append(1)
        if len(visited) == 20:
            raise RuntimeError("failed part way")
        return tensor.to(dtype=torch.float64)

    with pytest.raises(RuntimeError, match="failed part way"):
        module._apply(fails_part_way)
    assert torch.equal(weight, written.double()), "the written master converted afresh, not the kept one"
    with torch.no_grad():
        weight.neg_()
    module.to(dtype=torch.float32)
    assert torch.equal(flux.run(), flux.reference)


def test_a_cast_that_gives_new_parameter_objects_converts_a_written_master_afresh(flux: PipelineCase) -> None:
    """Under torch's flag to overwrite parameters on conversion, _apply gives the module new
    parameter objects, made from what the conversion returned: a master written since the last
    cast must still come back converted afresh, not as the kept master."""
    flux.pipe.enable_pinned_offload(device="cpu", components={"vae": "staged"}, vram_budget=None)
    module = flux.pipe.vae
    module.to(dtype=torch.float64)
    module.to(dtype=torch.float32)  # both sides kept, with the flag off
    with torch.no_grad():
        module.decoder.conv_out.weight.neg_()
    written = module.decoder.conv_out.weight.detach().clone()
    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        module.to(dtype=torch.float64)
        assert torch.equal(module.decoder.conv_out.weight, written.double())
        with torch.no_grad():
            module.decoder.conv_out.weight.neg_()
        module.to(dtype=torch.float32)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
    assert torch.equal(flux.run(), flux.reference)


def test_sdxl_vae_casts_convert_nothing_once_a_call_has_made_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """From the second call on, the upcast compares the float16 masters with their copy, and the
    cast back binds the float16 masters, its sources unwritten since the upcast: no result is
    converted or compared."""
    case = sdxl_in_float16()
    case.pipe.enable_pinned_offload("cpu")
    assert torch.equal(case.run(), case.reference)
    compared = dtypes_compared(monkeypatch)
    for _ in range(2):
        assert torch.equal(case.run(), case.reference)
    assert compared and set(compared) == {torch.uint8}, "the float16 masters' bytes alone"
    vae = case.pipe.residency_report()["vae"]
    assert vae.pageable_bytes == 4 * vae.weight_bytes, "float16 and float32 masters, and the float16 ones' copy"


def test_the_upcast_takes_the_comparison_started_on_another_thread_as_its_call_began(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The float16 masters are compared with their copy as each call begins, on a thread of its
    own: the upcast, after the denoising loop, takes the answer. A cast between calls, which no
    call's comparison covers, compares on its own thread."""
    case = sdxl_in_float16()
    case.pipe.enable_pinned_offload("cpu")
    assert torch.equal(case.run(), case.reference)
    threads = threads_comparing(monkeypatch)
    assert torch.equal(case.run(), case.reference)
    assert threads and threading.main_thread() not in threads
    threads.clear()
    case.pipe.vae.to(torch.float32)
    case.pipe.vae.to(torch.float16)
    assert threads and set(threads) == {threading.main_thread()}
    assert torch.equal(case.run(), case.reference)


def test_a_call_whose_comparison_thread_cannot_start_compares_on_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """No thread to be had as a call begins (a process at its thread limit): the call runs, its
    upcast compares on the caller's thread, and nothing is left waiting for an answer that never
    comes (a cast between calls after it would wait forever)."""
    case = sdxl_in_float16()
    case.pipe.enable_pinned_offload("cpu")
    assert torch.equal(case.run(), case.reference)
    threads = threads_comparing(monkeypatch)

    def no_thread(thread: threading.Thread) -> None:
        raise RuntimeError("injected: can't start new thread")

    with monkeypatch.context() as patch:
        patch.setattr(threading.Thread, "start", no_thread)
        assert torch.equal(case.run(), case.reference)
    assert threads and set(threads) == {threading.main_thread()}
    vae = staging_hooks(case.pipe)["vae"]
    assert not vae.group.calls_running
    assert all(unit.stager._sources_check is None for unit in vae.group.units)
    case.pipe.vae.to(torch.float32)
    case.pipe.vae.to(torch.float16)
    assert torch.equal(case.run(), case.reference)


def test_a_weight_written_through_data_between_calls_is_seen_by_the_next_upcast() -> None:
    """No version counter sees a write through ``.data``: the upcast's comparison with the copy of
    the float16 masters does, and converts afresh."""
    case, resident = sdxl_in_float16(), sdxl_in_float16()
    case.pipe.enable_pinned_offload("cpu")
    for _ in range(2):
        assert torch.equal(case.run(), case.reference)
    for pipe in (case.pipe, resident.pipe):
        pipe.vae.decoder.conv_out.weight.data.mul_(2)
    expected = resident.run()
    assert not torch.equal(expected, case.reference)
    for _ in range(2):
        assert torch.equal(case.run(), expected)


class _RunsAtStart(threading.Thread):
    def start(self) -> None:
        self.run()


def test_a_weight_given_storage_of_its_own_while_loaded_is_seen_by_the_next_calls_upcast(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Copied into its master as the VAE is evicted, in the next call: after the comparison with the
    copy of the float16 masters that started as that call began (here run to its end at once)."""
    case, resident = sdxl_in_float16(), sdxl_in_float16()
    case.pipe.enable_pinned_offload("cpu")
    for _ in range(2):
        assert torch.equal(case.run(), case.reference)
    monkeypatch.setattr(conversions, "threading", SimpleNamespace(Thread=_RunsAtStart))
    latents = torch.zeros(1, case.pipe.vae.config.latent_channels, 8, 8, dtype=torch.float16)
    for pipe in (case.pipe, resident.pipe):
        with torch.no_grad():
            pipe.vae.decode(latents)  # loaded now
        for parameter in pipe.vae.decoder.parameters():
            parameter.data = parameter.detach() * 1.5
    expected = resident.run()
    assert not torch.equal(expected, case.reference)
    for _ in range(2):
        assert torch.equal(case.run(), expected)


def test_a_weight_added_after_enable_and_first_cast_in_an_inference_mode_call_keeps_its_writes() -> None:
    """SDXL's fused attention projections, made after enable: the call's upcast is the first to
    stage them. A write into them while the VAE is loaded is copied into their masters at offload."""
    case, resident = sdxl_in_float16(), sdxl_in_float16()
    case.pipe.enable_pinned_offload("cpu")
    assert torch.equal(case.run(), case.reference)
    latents = torch.zeros(1, case.pipe.vae.config.latent_channels, 8, 8, dtype=torch.float16)
    for pipe in (case.pipe, resident.pipe):
        pipe.fuse_qkv_projections()
        pipeline_output(pipe, call_kwargs("sdxl"))  # under inference mode
        with torch.no_grad():
            pipe.vae.decode(latents)  # loaded now
            for module in pipe.vae.modules():
                if getattr(module, "to_qkv", None) is not None:
                    module.to_qkv.weight.mul_(1.5)
    expected = resident.run()
    assert not torch.equal(expected, case.reference)
    for _ in range(2):
        assert torch.equal(case.run(), expected)
    case.pipe.disable_pinned_offload()
    assert_weights_equal(resident.state(), case.state())


def test_a_weight_written_in_place_between_a_cast_and_the_cast_back_is_kept() -> None:
    """Inside a call, the cast back trusts its sources only while their version counters stand: a
    write while decoding (a hook, here) is copied into the float32 master at offload, and cast back."""
    case, resident = sdxl_in_float16(), sdxl_in_float16()
    case.pipe.enable_pinned_offload("cpu")
    assert torch.equal(case.run(), case.reference)

    def double_once(vae: torch.nn.Module) -> None:
        def hook(module: torch.nn.Module, args: tuple) -> None:
            with torch.no_grad():
                module.weight.mul_(2)
            handle.remove()

        handle = vae.post_quant_conv.register_forward_pre_hook(hook)

    for pipe in (case.pipe, resident.pipe):
        double_once(pipe.vae)
    written = case.run()
    assert not torch.equal(written, case.reference)
    assert torch.equal(written, resident.run())
    assert case.pipe.vae.post_quant_conv.weight.dtype == torch.float16
    assert torch.equal(case.pipe.vae.post_quant_conv.weight, resident.pipe.vae.post_quant_conv.weight)
    assert torch.equal(case.run(), resident.run())


def test_casts_through_a_narrower_dtype_inside_a_call_give_what_resident_casts_give() -> None:
    """float16 to float32, bfloat16, float32 and float16 again, in a step's callback, before the
    pipeline's own casts: the way back up from bfloat16 finds the float32 masters kept, which it
    does not give (bfloat16 rounds), and must convert, not bind them."""
    case, resident = sdxl_in_float16(), sdxl_in_float16()
    case.pipe.enable_pinned_offload("cpu")
    assert torch.equal(case.run(), case.reference)

    def run(pipe) -> torch.Tensor:  # arguments made afresh: they hold the call's generator
        return pipeline_output(pipe, {**call_kwargs("sdxl", "tiny"), "callback_on_step_end": vae_through_bfloat16})

    expected = run(resident.pipe)
    assert not torch.equal(expected, case.reference)
    assert torch.equal(run(case.pipe), expected)
    assert torch.equal(case.run(), resident.run())


def test_a_round_trip_on_kept_masters_waits_for_no_copy(flux: PipelineCase, monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiting for the copies still reading a master is needed only before letting it go: SDXL's
    VAE casts, once their masters are kept, let none go, and must not stall the host behind the
    device's queue (the CPU has no copy to wait for: the waits are counted where they are made)."""
    flux.pipe.enable_pinned_offload(device="cpu", components={"vae": "staged"}, vram_budget=None)
    module = flux.pipe.vae
    waits: list[int] = []
    wait = ModuleStager._wait_before_letting_go
    monkeypatch.setattr(
        ModuleStager, "_wait_before_letting_go", lambda stager, groups: (waits.append(len(groups)), wait(stager, groups))
    )
    for _ in range(2):
        module.to(dtype=torch.float64)
        module.to(dtype=torch.float32)
    assert waits == []
    weight = module.decoder.conv_out.weight
    with torch.no_grad():
        weight.neg_()
    module.to(dtype=torch.float64)  # conv_out's float64 master from before is stale: let go
    assert waits == [1]
    with torch.no_grad():
        weight.neg_()
    module.to(dtype=torch.float32)  # and its float32 master, written since it was kept
    assert waits == [1, 1]
    assert torch.equal(flux.run(), flux.reference)


@pytest.mark.parametrize("vae", ["staged", "streamed"])
def test_a_round_trip_on_kept_masters_swaps_them_without_a_new_snapshot(
    flux: PipelineCase, vae: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once both sides of a cast have masters, a cast binds the other side's and keeps this side's:
    grouping the tensors by storage and making views over the masters again cost SDXL's VAE host
    time at both of its casts in every call. A master written in between still takes that path."""
    flux.pipe.enable_pinned_offload(device="cpu", components={"vae": vae}, vram_budget=None)
    module = flux.pipe.vae
    module.to(dtype=torch.float64)
    module.to(dtype=torch.float32)
    snapshots, views = [], []
    snapshot, views_over = diffusers_residency.staging.snapshot, ModuleStager._views_over
    spy_snapshot = lambda *args, **kwargs: (snapshots.append(1), snapshot(*args, **kwargs))[1]  # noqa: E731
    spy_views = lambda *args, **kwargs: (views.append(1), views_over(*args, **kwargs))[1]  # noqa: E731
    monkeypatch.setattr(diffusers_residency.staging, "snapshot", spy_snapshot)
    monkeypatch.setattr(ModuleStager, "_views_over", spy_views)
    for _ in range(2):
        module.to(dtype=torch.float64)
        for unit in staging_hooks(flux.pipe)["vae"].group.units_of("vae"):
            unit.stager.rebind_masters()  # offloading again reuses the views of these masters
        module.to(dtype=torch.float32)
    assert snapshots == [] and views == []

    weight = module.decoder.conv_out.weight  # offloaded by the cast: written into its master
    with torch.no_grad():
        weight.neg_()
    module.to(dtype=torch.float64)
    assert len(snapshots) == 1, "conv_out's float64 master is stale: the tensors are grouped afresh"
    with torch.no_grad():
        weight.neg_()
    module.to(dtype=torch.float32)
    assert torch.equal(flux.run(), flux.reference)


def _decode_in_float64(flux: PipelineCase, times: int) -> None:
    """Load the VAE ``times`` times (a decode each, then offloaded), without casting it."""
    latents = torch.randn(1, flux.pipe.vae.config.latent_channels, 4, 4, dtype=torch.float64)
    for _ in range(times):
        with torch.inference_mode():
            flux.pipe.vae.decode(latents)
        flux.pipe.sleep(offload=["vae"])


def test_a_cast_for_good_lets_the_masters_it_had_go(flux: PipelineCase) -> None:
    flux.pipe.enable_pinned_offload(device="cpu")
    flux.pipe.vae.to(dtype=torch.float64)
    flux.pipe.vae.to(dtype=torch.float32)  # binds the float32 masters kept from before
    assert torch.equal(flux.run(), flux.reference)  # offloaded after: views over both sets cached
    flux.pipe.vae.to(dtype=torch.float64)
    vae = flux.pipe.residency_report()["vae"]
    assert vae.pageable_bytes == vae.weight_bytes * 3 // 2, "kept for a cast back: float32 and float64 masters"
    _decode_in_float64(flux, 4)  # more than twice the loads ever seen between two casts (one)
    vae = flux.pipe.residency_report()["vae"]
    assert vae.pageable_bytes == vae.weight_bytes, "only the float64 masters are left"
    stager = staging_hooks(flux.pipe)["vae"].unit.stager
    assert all(groups is stager._groups for groups, _ in stager._master_views_by.values()), (
        "no view over a master let go is kept: it would keep the master's memory"
    )


def test_a_component_used_several_times_between_its_casts_keeps_its_masters(flux: PipelineCase) -> None:
    """A VAE decoding in tiles, or a preview decoded at every step, loads several times between two
    casts; from the second round on, its casts find the masters of the round before."""
    flux.pipe.enable_pinned_offload(device="cpu")
    module = flux.pipe.vae
    rounds = []
    for _ in range(3):
        module.to(dtype=torch.float64)
        wide = {name: p.data_ptr() for name, p in module.named_parameters()}
        _decode_in_float64(flux, 3)
        module.to(dtype=torch.float32)
        rounds.append((wide, {name: p.data_ptr() for name, p in module.named_parameters()}))
    assert rounds[0][0] == rounds[1][0] == rounds[2][0], "the float64 masters of the first round throughout"
    assert rounds[1][1] == rounds[2][1], "the float32 ones from the end of the first round on"
    assert torch.equal(flux.run(), flux.reference)


def test_model_cpu_offload_after_ours_replaces_ours(flux: PipelineCase) -> None:
    before = flux.state()
    flux.pipe.enable_pinned_offload(device="cpu")
    flux.run()
    flux.pipe.enable_model_cpu_offload(device="cpu")
    assert staging_hooks(flux.pipe) == {}
    assert "_pinned_residency" not in flux.pipe.__dict__
    assert all(
        isinstance(m._hf_hook, accelerate.hooks.CpuOffload)
        for m in flux.pipe.components.values()
        if isinstance(m, torch.nn.Module)
    )
    assert_weights_equal(before, flux.state())
    # diffusers' model offload copies weights to new, differently aligned CPU storage, which moves
    # the last bit of CPU results, so the reference is model offload on a pipeline never staged.
    untouched = PipelineCase("flux")
    untouched.pipe.enable_model_cpu_offload(device="cpu")
    assert torch.equal(flux.run(), untouched.run())


def test_refuses_accelerate_hooks_before_changing_anything(flux: PipelineCase) -> None:
    accelerate.hooks.add_hook_to_module(flux.pipe.vae, accelerate.hooks.AlignDevicesHook(execution_device="cpu"))
    with pytest.raises(ValueError, match="already has an accelerate hook"):
        flux.pipe.enable_pinned_offload(device="cpu")
    assert staging_hooks(flux.pipe) == {}


def test_refuses_group_offloading(flux: PipelineCase) -> None:
    flux.pipe.transformer.enable_group_offload(
        onload_device=torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1
    )
    with pytest.raises(ValueError, match="group offloading"):
        flux.pipe.enable_pinned_offload(device="cpu")
    assert staging_hooks(flux.pipe) == {}


def test_refuses_meta_weights_before_changing_anything(flux: PipelineCase) -> None:
    with torch.device("meta"):
        flux.pipe.vae.register_buffer("never_loaded", torch.empty(3))
    with pytest.raises(ValueError, match="meta"):
        flux.pipe.enable_pinned_offload(device="cpu")
    assert staging_hooks(flux.pipe) == {}
    assert not any(p.is_pinned() for p in flux.pipe.transformer.parameters())


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(components={"not_a_component": "staged"}), "not_a_component"),
        (dict(components={"vae": "sometimes"}), "unknown residency policy"),
        (dict(components={"tokenizer": "staged"}), "tokenizer"),
        (dict(pin_memory=True), "pin_memory=True needs an accelerator"),
    ],
)
def test_bad_arguments_raise_before_changing_anything(flux: PipelineCase, kwargs: dict, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        flux.pipe.enable_pinned_offload(device="cpu", **kwargs)
    assert staging_hooks(flux.pipe) == {}


@pytest.mark.skipif(torch.accelerator.is_available(), reason="this machine has an accelerator")
@pytest.mark.parametrize("build", WITHOUT_AN_ACCELERATOR)
def test_no_accelerator_and_no_device_is_a_clear_error(flux: PipelineCase, build: str, monkeypatch) -> None:
    build_without_an_accelerator(monkeypatch, build)
    with pytest.raises(RuntimeError, match="device='cpu'"):
        flux.pipe.enable_pinned_offload()
    assert staging_hooks(flux.pipe) == {}


def test_weights_that_are_already_inference_tensors(flux: PipelineCase) -> None:
    """diffusers' model offload, run under inference mode, leaves inference tensors behind."""
    flux.pipe.enable_model_cpu_offload(device="cpu")
    flux.run()
    flux.pipe.remove_all_hooks()
    assert any(b.is_inference() for b in flux.pipe.text_encoder.buffers())
    reference = flux.run()
    flux.pipe.enable_pinned_offload(device="cpu")
    assert torch.equal(flux.run(), reference)
    assert torch.equal(flux.run(), reference)


def test_enable_on_another_setup_starts_anew(flux: PipelineCase) -> None:
    flux.pipe.enable_pinned_offload(device="cpu")
    flux.run()
    first = staging_hooks(flux.pipe)["transformer"].unit.stager
    flux.pipe.transformer.fuse_qkv_projections()  # a different module set is a different setup too
    flux.pipe.vae = PipelineCase("flux").pipe.vae
    flux.pipe.enable_pinned_offload(device="cpu")
    assert staging_hooks(flux.pipe)["transformer"].unit.stager is not first
    assert len(flux.pipe.__dict__["_pinned_residency"].group.units) == 4


@pytest.mark.parametrize("first", ["call", "sleep"])
def test_a_component_replaced_after_enable_is_staged_as_the_one_it_replaces(flux: PipelineCase, first: str) -> None:
    flux.pipe.enable_pinned_offload(device="cpu", vram_budget="2GB", components={"transformer": "streamed"})
    flux.run()
    old = flux.pipe.transformer
    other = PipelineCase("flux")
    other.pipe.transformer = build_pipeline("flux", "tiny", seed=1).transformer.eval()
    other.reference = other.run()
    before = {name: tensor.clone() for name, tensor in old.state_dict().items()}
    flux.pipe.transformer = build_pipeline("flux", "tiny", seed=1).transformer.eval()
    if first == "sleep":
        flux.pipe.sleep()
        assert flux.pipe.residency_report()["transformer"].device_bytes == 0
    for _ in range(2):
        assert torch.equal(flux.run(), other.reference)
    assert isinstance(flux.pipe.transformer._hf_hook, StagingHook)
    assert flux.pipe.residency_plan()["transformer"].policy.value == "streamed"
    # The one replaced is unhooked, with its weights as they were, where they were.
    assert getattr(old, "_hf_hook", None) is None
    assert all(torch.equal(tensor, before[name]) for name, tensor in old.state_dict().items())
    assert {t.device.type for t in old.state_dict().values()} == {"cpu"}
    flux.pipe.disable_pinned_offload()
    assert_no_meta_or_foreign_device(flux.pipe)
    assert torch.equal(flux.run(), other.reference)


def test_a_component_set_to_none_or_to_one_staged_elsewhere_is_left_as_it_was(flux: PipelineCase) -> None:
    # Embeddings computed, the text encoders dropped: the components named at enable are gone.
    with torch.inference_mode():
        embeds, pooled, _ = flux.pipe.encode_prompt(prompt=call_kwargs("flux")["prompt"], prompt_2=None, device="cpu")
    def call() -> dict:  # a fresh generator each time
        without_prompt = {key: value for key, value in call_kwargs("flux").items() if key != "prompt"}
        return {**without_prompt, "prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    reference = pipeline_output(flux.pipe, call())
    flux.pipe.enable_pinned_offload(device="cpu", components={"text_encoder": "staged"})
    state = flux.pipe.__dict__["_pinned_residency"]
    flux.pipe.text_encoder = flux.pipe.text_encoder_2 = None
    other = PipelineCase("flux")
    other.pipe.enable_pinned_offload(device="cpu")
    flux.pipe.vae = other.pipe.vae  # staged by the other pipeline
    for _ in range(2):
        assert torch.equal(pipeline_output(flux.pipe, call()), reference)
    assert flux.pipe.__dict__["_pinned_residency"] is state, "not enabled again"


@pytest.mark.parametrize("change", ["replaced", "set to None"])
@pytest.mark.parametrize("then", ["remove_all_hooks", "enable_model_cpu_offload"])
def test_hooks_taken_off_the_components_turn_it_off_though_one_was_replaced_or_set_to_none(
    flux: PipelineCase, change: str, then: str
) -> None:
    """diffusers' remove_all_hooks (enable_model_cpu_offload's first step) walks the components there
    are: the hooks of a module replaced or set to None since stay on it. Pinned offload is off all
    the same: pipe.to and model offload are not refused, and no call enables it again."""
    flux.pipe.enable_pinned_offload(device="cpu")
    flux.run()
    if change == "replaced":
        flux.pipe.vae = build_pipeline("flux", "tiny").vae.eval()  # the same weights, not staged
    else:
        flux.pipe.text_encoder = flux.pipe.text_encoder_2 = None
    if then == "remove_all_hooks":
        flux.pipe.remove_all_hooks()
        flux.pipe.to("cpu")
    else:
        flux.pipe.enable_model_cpu_offload(device="cpu")
    assert pipeline_state(flux.pipe) is None and staging_hooks(flux.pipe) == {}
    if change == "replaced":
        untouched = PipelineCase("flux")  # model offload moves CPU results' last bits: see above
        if then == "enable_model_cpu_offload":
            untouched.pipe.enable_model_cpu_offload(device="cpu")
        assert torch.equal(flux.run(), untouched.run())
        assert staging_hooks(flux.pipe) == {}, "not enabled again by the call"


def test_two_components_swapped_are_another_setup(flux: PipelineCase) -> None:
    flux.pipe.enable_pinned_offload(device="cpu", components={"vae": "resident"})
    pipe = flux.pipe
    pipe.text_encoder, pipe.text_encoder_2 = pipe.text_encoder_2, pipe.text_encoder
    pipe.enable_pinned_offload(device="cpu", components={"vae": "resident"})
    hooks = pipe.__dict__["_pinned_residency"].hooks
    assert all(hook.unit.module is getattr(pipe, name) for name, hook in hooks.items())


def test_a_pipeline_deleted_while_enabled_leaves_no_record_of_its_weights() -> None:
    import gc

    from diffusers_residency import masters

    gc.collect()
    before = len(masters._STAGED_BY)
    for _ in range(2):
        case = PipelineCase("flux")
        case.pipe.enable_pinned_offload(device="cpu", vram_budget="2GB", components={"transformer": "streamed"})
        case.run()
        assert len(masters._STAGED_BY) > before
        del case
        gc.collect()
        assert len(masters._STAGED_BY) <= before


def test_component_to_its_execution_device_loads_it(flux: PipelineCase) -> None:
    flux.pipe.enable_pinned_offload(device="cpu")
    assert not flux.pipe.residency_report()["text_encoder"].loaded
    flux.pipe.text_encoder.to("cpu")  # the execution device here: a request to have the weights there
    assert flux.pipe.residency_report()["text_encoder"].loaded
