"""Sleep and wake on real pipelines, on the CPU: the state machine, errors, and exact outputs."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from diffusers_residency import AwakeRotation, StagingHook, detach_staging_hook, sleep, sleep_mode, wake_up
from diffusers_residency.bench.builders import build_pipeline, call_kwargs, pipeline_output
from diffusers_residency.policy import Policy

from .helpers import PipelineCase, assert_no_meta_or_foreign_device, assert_weights_equal, enable_with_transformer


def states(pipe) -> dict[str, str]:
    return {c.name: c.state for c in pipe.residency_report().components}


def test_level_1_sleep_and_wake(flux: PipelineCase) -> None:
    flux.pipe.enable_pinned_offload(device="cpu", components={"vae": "resident"})
    flux.run()
    loaded_before = {c.name for c in flux.pipe.residency_report().components if c.loaded}
    assert loaded_before == {"transformer", "vae"}  # the last staged component, and the resident one
    flux.pipe.sleep()
    assert flux.pipe.is_sleeping
    report = flux.pipe.residency_report()
    assert report.device_bytes == 0
    assert set(states(flux.pipe).values()) == {"asleep (1)"}
    assert all(c.mapped_bytes == 0 for c in report.components)

    flux.pipe.wake_up()
    assert not flux.pipe.is_sleeping
    loaded = {c.name for c in flux.pipe.residency_report().components if c.loaded}
    assert loaded == loaded_before, "what was on the device comes back"
    assert torch.equal(flux.run(), flux.reference)


@pytest.mark.parametrize("policy", ["staged", "streamed"])
def test_a_pipeline_sharing_the_components_sees_them_asleep_and_wakes_them(flux: PipelineCase, policy: str) -> None:
    """A pipeline made with ``from_pipe`` holds the same components, whose hooks are the other
    pipeline's: asleep, they are asleep for it too, and its wake_up wakes them."""
    from diffusers import FluxImg2ImgPipeline

    if policy == "streamed":
        enable_with_transformer(flux, policy)
    else:
        flux.pipe.enable_pinned_offload(device="cpu")
    sibling = FluxImg2ImgPipeline.from_pipe(flux.pipe)
    flux.run()
    flux.pipe.sleep()
    assert flux.pipe.is_sleeping and sibling.is_sleeping
    sibling.wake_up()
    assert not flux.pipe.is_sleeping and not sibling.is_sleeping
    assert torch.equal(flux.run(), flux.reference)
    flux.pipe.sleep(offload=["vae"])
    assert sibling.is_sleeping
    sibling.wake_up("vae")
    assert not flux.pipe.is_sleeping
    for kwargs in ({}, {"offload": ["vae"]}):
        with pytest.raises(ValueError, match="sleep that pipeline, or put it in a rotation"):
            sibling.sleep(**kwargs)
    with pytest.raises(ValueError, match="sleep that pipeline, or put it in a rotation"):
        AwakeRotation({"flux": flux.pipe, "img2img": sibling})
    assert not flux.pipe.is_sleeping


def test_sleep_sets_up_masters_once_on_a_pipeline_without_offload(flux: PipelineCase) -> None:
    flux.pipe.sleep()
    units = {u.name: u for u in flux.pipe.__dict__["_pinned_residency"].group.units}
    assert {u.policy.value for u in units.values()} == {"resident"}
    stagers = {name: u.stager for name, u in units.items()}
    flux.pipe.wake_up()
    assert all(c.loaded for c in flux.pipe.residency_report().components), "a resident pipeline wakes resident"
    assert torch.equal(flux.run(), flux.reference)
    flux.pipe.sleep()
    flux.pipe.wake_up()
    assert {u.name: u.stager for u in flux.pipe.__dict__["_pinned_residency"].group.units} == stagers
    assert torch.equal(flux.run(), flux.reference)


def test_a_call_wakes_what_it_needs(flux: PipelineCase) -> None:
    flux.pipe.enable_pinned_offload(device="cpu")
    flux.pipe.sleep()
    assert torch.equal(flux.run(), flux.reference)
    assert not flux.pipe.is_sleeping


def test_a_call_wakes_the_blocks_it_does_not_run_with_their_component(flux: PipelineCase) -> None:
    # A text-to-image call never runs the streamed VAE's encoder blocks.
    enable_with_transformer(flux, "streamed")
    assert flux.pipe.residency_plan()["vae"].policy is Policy.STREAMED
    assert torch.equal(flux.run(), flux.reference)
    flux.pipe.sleep(level=2)
    assert torch.equal(flux.run(), flux.reference)
    assert not flux.pipe.is_sleeping and set(states(flux.pipe).values()) == {"awake"}
    flux.pipe.sleep(level=1)  # masters in memory: the files are not needed any more
    assert all(c.mapped_bytes == 0 for c in flux.pipe.residency_report().components)
    flux.pipe.wake_up()
    assert torch.equal(flux.run(), flux.reference)


def test_a_pipeline_sharing_components_of_two_pipelines_sees_both_asleep_and_wakes_both() -> None:
    from diffusers import FluxPipeline

    first, second = PipelineCase("flux"), PipelineCase("flux")
    for case in (first, second):
        case.pipe.enable_pinned_offload(device="cpu")
    both = FluxPipeline.from_pipe(first.pipe, transformer=second.pipe.transformer)
    reference = pipeline_output(both, call_kwargs("flux"))
    first.pipe.sleep()
    assert both.is_sleeping and not second.pipe.is_sleeping
    first.pipe.wake_up()
    second.pipe.sleep()
    assert both.is_sleeping, "its transformer, the second pipeline's, sleeps"
    both.wake_up("transformer")
    assert not both.is_sleeping and second.pipe.is_sleeping, "its other components sleep on"
    first.pipe.sleep()
    second.pipe.sleep()
    both.wake_up()
    assert not both.is_sleeping, "each of its components woken, in the group that stages it"
    assert states(first.pipe)["transformer"] != "awake" and states(first.pipe)["vae"] == "awake"
    assert states(second.pipe)["transformer"] == "awake" and states(second.pipe)["vae"] != "awake"
    assert torch.equal(pipeline_output(both, call_kwargs("flux")), reference)


def test_level_2_maps_masters_to_the_checkpoint_and_reloads_exactly(flux: PipelineCase) -> None:
    flux.pipe.enable_pinned_offload(device="cpu")
    flux.run()
    flux.pipe.sleep(level=2)
    report = flux.pipe.residency_report()
    assert set(states(flux.pipe).values()) == {"asleep (2)"}
    for c in report.components:
        # Only buffers that are not saved in checkpoints (position ids, say) keep their own memory.
        assert c.mapped_bytes >= 0.95 * c.weight_bytes, str(report)
    assert_no_meta_or_foreign_device(flux.pipe)
    assert torch.equal(flux.run(), flux.reference), "a call after level 2 wakes from the files"
    flux.pipe.sleep(level=2)
    flux.pipe.wake_up()
    assert torch.equal(flux.run(), flux.reference)
    flux.pipe.sleep()
    assert set(states(flux.pipe).values()) == {"asleep (1)"}
    report = flux.pipe.residency_report()
    assert all(c.mapped_bytes == 0 for c in report.components), "read back by the next offload"
    flux.pipe.wake_up()
    assert torch.equal(flux.run(), flux.reference)


@pytest.mark.parametrize("inference", [False, True], ids=["", "woken under inference mode"])
def test_weights_written_before_or_during_a_level_2_sleep_wake_as_written(flux: PipelineCase, inference: bool) -> None:
    """Waking reads unchanged weights from the files, not through their mappings: a weight changed
    before the sleep, or written in place through its mapping while asleep, must not come back as
    the file has it. Woken under inference mode (a call made in it), the masters are read back
    all the same, by threads outside it."""
    flux.pipe.enable_pinned_offload(device="cpu")
    flux.run()
    largest = sorted(flux.pipe.transformer.parameters(), key=torch.Tensor.numel)[-2:]
    changed_before, written_asleep = largest
    with torch.no_grad():
        changed_before.add_(1.0)
    expected_before = changed_before.detach().clone()
    mapped_before = flux.pipe.residency_report()["transformer"].weight_bytes
    flux.pipe.sleep(level=2)
    transformer = flux.pipe.residency_report()["transformer"]
    assert transformer.mapped_bytes <= mapped_before - changed_before.nbytes, "a changed weight keeps its master"
    with torch.no_grad():
        written_asleep[1:2].mul_(-1.0)  # through the mapping: the process's own pages from here on
    expected_asleep = written_asleep.detach().clone()
    with torch.inference_mode(inference):
        flux.pipe.wake_up()
        flux.pipe.sleep()  # the masters read back, taken by the offload
    assert flux.pipe.residency_report()["transformer"].mapped_bytes == 0
    flux.pipe.wake_up()
    flux.pipe.transformer.to("cpu")
    assert torch.equal(changed_before, expected_before) and torch.equal(written_asleep, expected_asleep)


@pytest.mark.parametrize("level", [1, 2])
def test_a_weight_replaced_while_asleep_wakes_as_replaced(flux: PipelineCase, level: int) -> None:
    """``param.data = ...`` while asleep: the wake must not bind the parameter back to its master
    (at level 2, reading the masters back from the files rebinds every weight)."""
    flux.pipe.enable_pinned_offload(device="cpu")
    flux.run()
    flux.pipe.sleep(level=level)
    weight = flux.pipe.transformer.proj_out.weight
    replacement = torch.randn_like(weight)
    weight.data = replacement.clone()
    flux.pipe.wake_up()
    assert torch.equal(weight.cpu(), replacement)
    flux.run()  # which ends with the transformer offloaded, evicted by the VAE
    assert not flux.pipe.residency_report()["transformer"].loaded
    second = torch.randn_like(weight)
    weight.data = second.clone()
    flux.pipe.sleep(level=level)
    assert torch.equal(weight, second), "and it stays so asleep again"
    if level == 2:
        transformer = flux.pipe.residency_report()["transformer"]
        assert transformer.mapped_bytes <= transformer.weight_bytes - weight.nbytes, "its old master is not mapped"
    flux.pipe.wake_up()
    assert torch.equal(weight.cpu(), second)


def test_a_checkpoint_written_while_asleep_at_level_2_is_refused_at_wake(flux: PipelineCase) -> None:
    import os
    from pathlib import Path

    flux.pipe.enable_pinned_offload(device="cpu")
    flux.run()
    flux.pipe.sleep(level=2)
    (written,) = (Path(flux.pipe.name_or_path) / "transformer").glob("*.safetensors")
    stamp = os.stat(written)
    os.utime(written, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 10**9))  # as a save into the folder would
    with pytest.raises(RuntimeError, match="changed since the pipeline.s weights were mapped from it"):
        flux.pipe.wake_up()
    assert states(flux.pipe)["transformer"] == "asleep (2)"
    assert_no_meta_or_foreign_device(flux.pipe)
    # Nor can a disable read the weights back from it: it says why, not "free device memory".
    with pytest.raises(RuntimeError, match=r"\['transformer'\] back their weights.*changed since"):
        flux.pipe.disable_pinned_offload()
    os.utime(written, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    flux.pipe.wake_up()
    assert torch.equal(flux.run(), flux.reference)
    flux.pipe.disable_pinned_offload()
    assert_no_meta_or_foreign_device(flux.pipe)
    assert torch.equal(flux.run(), flux.reference)


def test_a_lora_loaded_while_asleep_at_level_2_keeps_a_master_per_storage(flux: PipelineCase) -> None:
    """Weights mapped from a file are slices of one mapping of the whole file: taking masters for an
    adapter added while asleep must not take that mapping as the master of the weights on it."""
    from .test_changing_weights import lora_state_dict

    lora = lora_state_dict(flux)
    resident = PipelineCase("flux")
    resident.pipe.load_lora_weights(lora, adapter_name="style")
    expected = resident.run()
    flux.pipe.enable_pinned_offload(device="cpu")
    flux.run()
    flux.pipe.sleep(level=2)
    flux.pipe.load_lora_weights(lora, adapter_name="style")
    assert torch.equal(flux.run(), expected)
    # Waits for the masters read back since the call loaded them from the files: until then, a
    # tensor over a mapped master has the whole file's mapping as its storage.
    flux.pipe.sleep()
    assert flux.pipe.residency_report()["transformer"].mapped_bytes == 0
    transformer = flux.pipe.transformer
    largest = max(t.untyped_storage().nbytes() for t in transformer.parameters())
    stager = flux.pipe.__dict__["_pinned_residency"].group.units_of("transformer")[0].stager
    assert max(group.nbytes for group in stager._groups) == largest, "one master per storage"


def test_a_cast_back_while_asleep_at_level_2_gives_masters_of_their_own(flux: PipelineCase) -> None:
    """SDXL casts its VAE inside the call, before the VAE runs (and wakes): the cast back must not
    bind the weights to the checkpoint file's mapping, which would then be their master for good."""
    flux.pipe.enable_pinned_offload(device="cpu")
    flux.run()
    flux.pipe.sleep(level=2)
    flux.pipe.vae.to(dtype=torch.float64)
    flux.pipe.vae.to(dtype=torch.float32)
    assert states(flux.pipe)["vae"] == "asleep (1)", "nothing of it maps a file now: its level says so"
    assert flux.pipe.residency_report()["vae"].mapped_bytes == 0
    assert torch.equal(flux.run(), flux.reference)
    assert flux.pipe.residency_report()["vae"].mapped_bytes == 0
    flux.pipe.sleep(level=2)
    vae = flux.pipe.residency_report()["vae"]
    assert vae.mapped_bytes >= 0.95 * vae.weight_bytes, "level 2 frees the VAE's masters again"
    assert torch.equal(flux.run(), flux.reference)


def test_level_2_without_checkpoint_files_is_refused_before_anything_sleeps(flux: PipelineCase, tmp_path) -> None:
    flux.pipe.enable_pinned_offload(device="cpu")
    flux.pipe.register_to_config(_name_or_path=str(tmp_path))
    with pytest.raises(ValueError, match="save_pretrained"):
        flux.pipe.sleep(level=2)
    assert not flux.pipe.is_sleeping
    with pytest.raises(ValueError, match="transformer"):
        flux.pipe.sleep(discard=["transformer"])
    assert not flux.pipe.is_sleeping


def test_a_rotation_at_level_2_with_a_pipeline_without_files_is_refused_before_any_sleeps(
    flux: PipelineCase, tmp_path
) -> None:
    built_in_code = build_pipeline("flux", "tiny")
    built_in_code.register_to_config(_name_or_path=str(tmp_path))
    with pytest.raises(ValueError, match="save_pretrained"):
        AwakeRotation({"saved": flux.pipe, "built": built_in_code}, level=2)
    for pipe in (flux.pipe, built_in_code):
        assert "_pinned_residency" not in pipe.__dict__ and not pipe.is_sleeping
        assert not hasattr(pipe.transformer, "_hf_hook")
    assert torch.equal(flux.run(), flux.reference)


def test_level_2_with_an_unreadable_checkpoint_file_is_refused_before_anything_sleeps(flux: PipelineCase) -> None:
    flux.pipe.enable_pinned_offload(device="cpu")
    assert torch.equal(flux.run(), flux.reference)
    stray = Path(flux.pipe.name_or_path, "transformer", "zz-partial.safetensors")  # a download cut short
    stray.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(ValueError, match="zz-partial.safetensors is no safetensors file that can be read"):
        flux.pipe.sleep(level=2)
    assert set(states(flux.pipe).values()) == {"awake"}
    stray.unlink()
    flux.pipe.sleep(level=2)
    flux.pipe.wake_up()
    assert torch.equal(flux.run(), flux.reference)


def test_per_component_levels(flux: PipelineCase) -> None:
    flux.pipe.enable_pinned_offload(device="cpu")
    flux.run()
    sleep(flux.pipe, offload=["text_encoder", "vae"], discard=["transformer"])
    assert states(flux.pipe) == {
        "text_encoder": "asleep (1)",
        "text_encoder_2": "awake",
        "transformer": "asleep (2)",
        "vae": "asleep (1)",
    }
    wake_up(flux.pipe, ["transformer"])
    assert states(flux.pipe)["transformer"] == "awake"
    assert torch.equal(flux.run(), flux.reference)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(level=3), "level must be 1"),
        (dict(level=True), "level must be 1"),
        (dict(level=7, offload=["vae"]), "level must be 1"),
        (dict(offload=["vae"], discard=["vae"]), "both offload= and discard="),
        (dict(offload=["tokenizer"]), "tokenizer"),
    ],
)
@pytest.mark.parametrize("replaced", [False, True], ids=["", "a component replaced since enabling"])
def test_bad_sleep_arguments(flux: PipelineCase, kwargs: dict, error: str, replaced: bool) -> None:
    flux.pipe.enable_pinned_offload(device="cpu")
    state, vae = flux.pipe.__dict__["_pinned_residency"], flux.pipe.vae
    if replaced:  # enabled again by the next call or sleep: not by one refused
        flux.pipe.vae = build_pipeline("flux", "tiny").vae.eval()
    with pytest.raises(ValueError, match=error):
        flux.pipe.sleep(**kwargs)
    assert not flux.pipe.is_sleeping
    assert flux.pipe.__dict__["_pinned_residency"] is state and isinstance(vae._hf_hook, StagingHook)


def test_sleep_gives_back_the_device_copies_of_a_component_set_to_none(flux: PipelineCase) -> None:
    # Embeddings computed, the text encoders dropped: their units are still the setup's, and kept
    # resident they hold device memory that the sleep is to free.
    flux.pipe.enable_pinned_offload(device="cpu", components={"text_encoder": "resident", "text_encoder_2": "resident"})
    flux.run()
    group = flux.pipe.__dict__["_pinned_residency"].group
    encoders = [unit for name in ("text_encoder", "text_encoder_2") for unit in group.units_of(name)]
    assert encoders and all(unit.stager.loaded for unit in encoders)
    flux.pipe.text_encoder = flux.pipe.text_encoder_2 = None
    flux.pipe.sleep()
    assert not any(unit.stager.loaded for unit in group.units)
    assert_no_meta_or_foreign_device(flux.pipe)


def test_a_module_registered_under_two_names_sleeps_by_either(flux: PipelineCase) -> None:
    flux.pipe.register_modules(image_encoder=flux.pipe.text_encoder)  # staged once, as text_encoder
    flux.pipe.enable_pinned_offload(device="cpu")
    for name in ("image_encoder", "text_encoder"):
        flux.pipe.sleep(offload=[name])
        assert states(flux.pipe)["text_encoder"] == "asleep (1)"
        flux.pipe.wake_up()
    assert torch.equal(flux.run(), flux.reference)


def test_a_component_no_longer_staged_is_refused_by_name(flux: PipelineCase) -> None:
    flux.pipe.enable_pinned_offload(device="cpu")
    detach_staging_hook(flux.pipe.vae)
    with pytest.raises(ValueError, match=r"\['vae'\] are not staged by pinned offload now"):
        flux.pipe.sleep(offload=["text_encoder", "vae"])
    assert not flux.pipe.is_sleeping
    with pytest.raises(ValueError, match="not staged components"):
        wake_up(PipelineCase("flux").pipe, "no_such_component")  # nothing staged at all


def test_sleeping_what_sleeps_keeps_its_level(flux: PipelineCase, caplog: pytest.LogCaptureFixture) -> None:
    flux.pipe.enable_pinned_offload(device="cpu")
    flux.pipe.sleep(level=1)
    with caplog.at_level(logging.WARNING, logger="diffusers_residency"):
        flux.pipe.sleep(level=2)
    assert set(states(flux.pipe).values()) == {"asleep (1)"}
    assert "keeping that level" in caplog.text
    flux.pipe.sleep(level=1)  # same level: silently a no-op
    flux.pipe.wake_up()
    flux.pipe.wake_up()  # awake already: a no-op
    assert torch.equal(flux.run(), flux.reference)
    with pytest.raises(ValueError, match="not staged components"):
        flux.pipe.wake_up(["scheduler"])


def test_awake_rotation_between_two_pipelines() -> None:
    flux, sdxl = PipelineCase("flux"), PipelineCase("sdxl")
    rotation = AwakeRotation({"flux": flux.pipe, "sdxl": sdxl.pipe})
    assert flux.pipe.is_sleeping and sdxl.pipe.is_sleeping
    for name, case in [("flux", flux), ("sdxl", sdxl), ("flux", flux)]:
        assert rotation.use(name) is case.pipe
        other = sdxl if case is flux else flux
        assert other.pipe.is_sleeping and not case.pipe.is_sleeping
        assert torch.equal(case.run(), case.reference)
    with pytest.raises(KeyError, match="wan"):
        rotation.use("wan")


def _record_wakes_and_releases(monkeypatch: pytest.MonkeyPatch, sdxl: PipelineCase, fail: bool = False) -> list[str]:
    from diffusers_residency.retention import RetentionBudget

    events = []
    real_release, real_wake = RetentionBudget.release, sleep_mode.wake_up

    def release(budget, reason="forced"):
        events.append(f"release ({reason})")
        return real_release(budget, reason)

    def wake(pipe, components=None):
        events.append(f"wake {'sdxl' if pipe is sdxl.pipe else 'flux'}")
        if fail:
            raise RuntimeError("injected: out of device memory in the wake")
        real_wake(pipe, components)

    monkeypatch.setattr(RetentionBudget, "release", release)
    monkeypatch.setattr(sleep_mode, "wake_up", wake)
    return events


def test_a_rotation_wakes_the_next_pipeline_before_giving_the_cache_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device memory of the pipeline put to sleep is left to the allocator's cache for the one
    waking, and given back after (see AwakeRotation)."""
    flux, sdxl = PipelineCase("flux"), PipelineCase("sdxl")
    rotation = AwakeRotation({"flux": flux.pipe, "sdxl": sdxl.pipe})
    rotation.use("flux")
    events = _record_wakes_and_releases(monkeypatch, sdxl)
    rotation.use("sdxl")
    assert flux.pipe.is_sleeping and not sdxl.pipe.is_sleeping
    assert events == ["wake sdxl", "release (switch)"]
    assert torch.equal(sdxl.run(), sdxl.reference)


def test_a_rotation_keeping_the_cache_gives_it_back_only_when_a_wake_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    flux, sdxl = PipelineCase("flux"), PipelineCase("sdxl")
    rotation = AwakeRotation({"flux": flux.pipe, "sdxl": sdxl.pipe}, keep_cache=True)
    rotation.use("flux")
    with monkeypatch.context() as patch:
        events = _record_wakes_and_releases(patch, sdxl, fail=True)
        with pytest.raises(RuntimeError, match="injected"):
            rotation.use("sdxl")
    assert events == ["wake sdxl", "release (switch)"], "a failed wake gives the cache back"
    events = _record_wakes_and_releases(monkeypatch, sdxl)
    assert rotation.use("sdxl") is sdxl.pipe, "asked again, it wakes"
    assert flux.pipe.is_sleeping and torch.equal(sdxl.run(), sdxl.reference)
    events.clear()
    rotation.use("flux")
    assert events == ["wake flux"] and sdxl.pipe.is_sleeping, "the cache is kept for the next switch"
    assert torch.equal(flux.run(), flux.reference)


def test_a_rotation_puts_a_pipeline_that_failed_to_wake_back_to_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    flux, sdxl = PipelineCase("flux"), PipelineCase("sdxl")
    rotation = AwakeRotation({"flux": flux.pipe, "sdxl": sdxl.pipe})
    rotation.use("flux")
    real_wake = sleep_mode.wake_up

    def wake_one_then_fail(pipe, components=None):
        real_wake(pipe, "unet")
        raise RuntimeError("injected: out of device memory part-way through the wake")

    def fail_part_way() -> None:
        with monkeypatch.context() as patch:
            patch.setattr(sleep_mode, "wake_up", wake_one_then_fail)
            with pytest.raises(RuntimeError, match="injected"):
                rotation.use("sdxl")
        assert states(sdxl.pipe)["unet"] == "awake" and sdxl.pipe.is_sleeping

    fail_part_way()
    assert rotation.use("sdxl") is sdxl.pipe and not sdxl.pipe.is_sleeping, "asked again, it wakes"
    assert torch.equal(sdxl.run(), sdxl.reference)
    rotation.use("flux")
    fail_part_way()
    rotation.use("flux")
    assert set(states(sdxl.pipe).values()) == {"asleep (1)"}, "the next switch puts all of it to sleep"
    assert torch.equal(flux.run(), flux.reference)


def test_failure_inside_sleep_leaves_the_pipeline_usable(flux: PipelineCase, monkeypatch: pytest.MonkeyPatch) -> None:
    flux.pipe.enable_pinned_offload(device="cpu")
    flux.run()
    real = sleep_mode.checkpoint_views
    calls = []

    def failing(directory, module):
        calls.append(directory.name)
        if len(calls) == 2:
            raise OSError("injected: checkpoint unreadable")
        return real(directory, module)

    monkeypatch.setattr(sleep_mode, "checkpoint_views", failing)
    with pytest.raises(OSError, match="injected"):
        flux.pipe.sleep(level=2)
    monkeypatch.undo()
    assert_no_meta_or_foreign_device(flux.pipe)
    assert torch.equal(flux.run(), flux.reference)
    flux.pipe.sleep(level=2)
    flux.pipe.wake_up()
    assert torch.equal(flux.run(), flux.reference)


def test_failure_inside_wake_leaves_the_pipeline_usable(flux: PipelineCase, monkeypatch: pytest.MonkeyPatch) -> None:
    from diffusers_residency import _device

    flux.pipe.sleep(level=2)
    with monkeypatch.context() as patch:

        def out_of_memory(*args, **kwargs):
            raise torch.OutOfMemoryError("injected: out of device memory")

        patch.setattr(_device, "allocate_device_storage", out_of_memory)
        with pytest.raises(torch.OutOfMemoryError):
            flux.pipe.wake_up()
    assert set(states(flux.pipe).values()) == {"asleep (2)"}, "what failed to wake still sleeps, mapped"
    assert all(c.mapped_bytes for c in flux.pipe.residency_report().components)
    assert_no_meta_or_foreign_device(flux.pipe)
    flux.pipe.wake_up()
    assert torch.equal(flux.run(), flux.reference)


def test_a_level_2_wake_reads_masters_back_once_every_component_is_on_the_device(flux: PipelineCase, monkeypatch) -> None:
    """The wake copies each component from the files, and only then are the masters read back into
    memory of their own: read back during the wake, they would slow its copies."""
    from diffusers_residency import file_reads, ring
    from diffusers_residency.residency import ResidencyGroup

    flux.pipe.sleep(level=2)
    units = flux.pipe.__dict__["_pinned_residency"].group.units
    events: list[str] = []
    real_init, real_wake, real_copy = file_reads.ReadBack.__init__, ResidencyGroup.wake, ring.copy_from_files

    def read_back(read, *args, **kwargs):
        events.append("read back")
        real_init(read, *args, **kwargs)

    def wake(group, unit):
        events.append("wake")
        real_wake(group, unit)

    def copy_from_files(*args, **kwargs):
        events.append("copy from files")
        real_copy(*args, **kwargs)

    monkeypatch.setattr(file_reads.ReadBack, "__init__", read_back)
    monkeypatch.setattr(ring, "copy_from_files", copy_from_files)
    monkeypatch.setattr(ResidencyGroup, "wake", wake)
    flux.pipe.wake_up()
    assert events == ["wake", "copy from files"] * len(units) + ["read back"] * len(units)
    assert all(unit.stager._reading_ahead is not None for unit in units)
    assert torch.equal(flux.run(), flux.reference)
    flux.pipe.sleep()
    assert all(c.mapped_bytes == 0 for c in flux.pipe.residency_report().components)
    assert all(unit.stager._reading_ahead is None for unit in units)
    flux.pipe.wake_up()
    assert torch.equal(flux.run(), flux.reference)


def test_a_level_2_wake_whose_copy_from_a_file_fails_leaves_that_component_asleep(flux: PipelineCase, monkeypatch) -> None:
    from diffusers_residency import files

    flux.pipe.sleep(level=2)
    units = flux.pipe.__dict__["_pinned_residency"].group.units
    real_preadv = files.os.preadv

    def preadv(fd, buffers, offset):
        if f"{os.sep}text_encoder_2{os.sep}" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError("injected: unreadable")
        return real_preadv(fd, buffers, offset)

    with monkeypatch.context() as patch:
        patch.setattr(files.os, "preadv", preadv)
        with pytest.raises(OSError, match="injected"):
            flux.pipe.wake_up()
        state = states(flux.pipe)
        assert state["text_encoder_2"] == "asleep (2)"
        for unit in units:
            asleep = state[unit.component] != "awake"
            assert (unit.stager._reading_ahead is None) == asleep, "what woke is read back, what sleeps is not"
        assert_no_meta_or_foreign_device(flux.pipe)
    flux.pipe.wake_up()
    assert torch.equal(flux.run(), flux.reference)
    flux.pipe.sleep()
    assert all(c.mapped_bytes == 0 for c in flux.pipe.residency_report().components)


def test_masters_that_cannot_be_read_back_are_copied_from_the_device(
    flux: PipelineCase, monkeypatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint written after the wake (a save into the same folder) no longer holds the weights:
    the wake stands, and the next offload takes the masters from the device copy."""
    from pathlib import Path

    from diffusers_residency.residency import ResidencyGroup

    flux.pipe.sleep(level=2)
    (written,) = (Path(flux.pipe.name_or_path) / "transformer").glob("*.safetensors")
    units = flux.pipe.__dict__["_pinned_residency"].group.units_of("transformer")
    real_wake = ResidencyGroup.wake

    def wake_then_save(group, unit):
        real_wake(group, unit)
        if unit in units:  # after its copy from the file, before its read back starts
            stamp = os.stat(written)
            os.utime(written, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 10**9))

    monkeypatch.setattr(ResidencyGroup, "wake", wake_then_save)
    with caplog.at_level(logging.WARNING, logger="diffusers_residency"):
        flux.pipe.wake_up()
        assert "Could not start reading 'transformer'" in caplog.text
        assert flux.pipe.residency_report()["transformer"].mapped_bytes > 0
        assert torch.equal(flux.run(), flux.reference)
        flux.pipe.sleep()
    assert "Copying" in caplog.text
    assert flux.pipe.residency_report()["transformer"].mapped_bytes == 0
    flux.pipe.wake_up()
    assert torch.equal(flux.run(), flux.reference)


def test_a_forward_takes_the_masters_read_back_once_read(flux: PipelineCase) -> None:
    """Resident components stay loaded after a wake: their masters read back are taken before a
    forward once the read is done, not left mapped until the next sleep."""
    flux.pipe.sleep(level=2)
    flux.pipe.wake_up()
    units = flux.pipe.__dict__["_pinned_residency"].group.units
    reads = [unit.stager._reading_ahead[1] for unit in units]
    for read in reads:
        read.finish()  # waits for it, as time passing would
    assert all(c.mapped_bytes for c in flux.pipe.residency_report().components)
    assert torch.equal(flux.run(), flux.reference)
    assert all(c.mapped_bytes == 0 and c.loaded for c in flux.pipe.residency_report().components)


def test_a_call_whose_read_back_cannot_start_keeps_what_it_loaded(flux: PipelineCase, caplog) -> None:
    """A call that wakes a component loads it from the files and starts reading its masters back:
    a file changed in between fails that read, not the call, and the masters come from the device."""
    from pathlib import Path

    from diffusers_residency import ring

    flux.pipe.enable_pinned_offload(device="cpu")
    flux.run()
    flux.pipe.sleep(level=2)
    (written,) = (Path(flux.pipe.name_or_path) / "transformer").glob("*.safetensors")
    real_copy = ring.copy_from_files

    def copy_then_save(sources, *args, **kwargs):
        real_copy(sources, *args, **kwargs)
        if any(source.file is not None and source.file.path == str(written) for source in sources):
            stamp = os.stat(written)
            os.utime(written, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 10**9))

    with pytest.MonkeyPatch.context() as patch, caplog.at_level(logging.WARNING, logger="diffusers_residency"):
        patch.setattr(ring, "copy_from_files", copy_then_save)
        assert torch.equal(flux.run(), flux.reference)  # which ends with the transformer evicted
    assert "Could not start reading masters back" in caplog.text and "Copying" in caplog.text
    assert flux.pipe.residency_report()["transformer"].mapped_bytes == 0
    assert torch.equal(flux.run(), flux.reference)


@pytest.mark.slow
@pytest.mark.parametrize("level", [1, 2])
def test_interpreter_exit_while_asleep(level: int) -> None:
    script = textwrap.dedent(
        f"""
        import torch
        import diffusers_residency
        from diffusers_residency.bench.builders import build_pipeline, call_kwargs
        pipe = build_pipeline("flux")
        device = torch.accelerator.current_accelerator(check_available=True) or "cpu"
        pipe.enable_pinned_offload(device)
        pipe(**call_kwargs("flux"))
        pipe.sleep(level={level})
        print("asleep", pipe.is_sleeping)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "asleep True" in done.stdout
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr


def test_disable_after_level_2_gives_weights_memory_of_their_own(flux: PipelineCase) -> None:
    before = flux.state()
    flux.pipe.enable_pinned_offload(device="cpu")
    flux.pipe.sleep(level=2)
    flux.pipe.disable_pinned_offload()
    assert_weights_equal(before, flux.state())
    assert torch.equal(flux.run(), flux.reference)
