"""What an enabled pipeline refuses, and what it does instead: bad arguments, other offloaders,
copies and pickles."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from diffusers import FluxImg2ImgPipeline, FluxPipeline

from diffusers_residency.diffusers_hooks import GROUP_OFFLOADING_HOOK, registered_hook
from diffusers_residency.pipeline import pipeline_state

from .helpers import (
    WITHOUT_AN_ACCELERATOR,
    PipelineCase,
    assert_weights_equal,
    build_without_an_accelerator,
    staging_hooks,
)


def test_components_given_as_a_list_are_refused_with_the_form_expected(flux: PipelineCase) -> None:
    with pytest.raises(TypeError, match=r"components maps component names to policies, e\.g\. \{'vae': 'resident'"):
        flux.pipe.enable_pinned_offload("cpu", components=["vae"])
    assert pipeline_state(flux.pipe) is None


@pytest.mark.parametrize("device", ["meta", "cuda:7"])
def test_a_device_this_process_cannot_compute_on_is_refused_before_anything_changes(flux: PipelineCase, device: str) -> None:
    if torch.accelerator.is_available() and device == "cuda:7" and torch.accelerator.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    flux.pipe.enable_pinned_offload("cpu")
    before = flux.pipe.residency_plan()
    with pytest.raises(ValueError, match=rf"device='{device}' is not a device weights can be staged on|does not exist"):
        flux.pipe.enable_pinned_offload(device)
    assert flux.pipe.residency_plan() is before, "the setup in place is untouched"
    assert torch.equal(flux.run(), flux.reference)


def test_group_offloading_over_pinned_offload_is_refused(flux: PipelineCase) -> None:
    before = FluxPipeline.from_pipe(flux.pipe)
    flux.pipe.enable_pinned_offload("cpu")
    after = FluxPipeline.from_pipe(flux.pipe)
    for pipe in (flux.pipe, before, after):
        with pytest.raises(RuntimeError, match=r"disable_pinned_offload\(\) before pipe.enable_group_offload"):
            pipe.enable_group_offload(onload_device="cpu", offload_type="leaf_level")
    with pytest.raises(RuntimeError, match="'transformer' is staged by pinned offload; group offloading would stack"):
        flux.pipe.transformer.enable_group_offload(onload_device=torch.device("cpu"), offload_type="leaf_level")
    assert not any(registered_hook(m, GROUP_OFFLOADING_HOOK) for m in flux.pipe.transformer.modules())
    assert pipeline_state(flux.pipe) is not None
    assert torch.equal(flux.run(), flux.reference)
    flux.pipe.disable_pinned_offload()
    twin = pickle.loads(pickle.dumps(after))  # nothing of the guards left on the sibling
    assert torch.equal(pipeline_output_of(twin, flux), flux.reference)
    flux.pipe.transformer.enable_group_offload(onload_device=torch.device("cpu"), offload_type="leaf_level")


class _OffloadingOfItsOwn(FluxPipeline):
    def enable_model_cpu_offload(self, gpu_id: int | None = None, device: str | None = None) -> None:
        self.remove_all_hooks()
        raise RuntimeError("found no accelerator")

    enable_sequential_cpu_offload = enable_model_cpu_offload


@pytest.mark.skipif(torch.accelerator.is_available(), reason="diffusers refuses only without an accelerator")
@pytest.mark.parametrize("device", [None, "cuda"])
@pytest.mark.parametrize("method", ["enable_model_cpu_offload", "enable_sequential_cpu_offload"])
@pytest.mark.parametrize("build", WITHOUT_AN_ACCELERATOR)
def test_model_offload_that_diffusers_would_refuse_leaves_pinned_offload_in_place(
    flux: PipelineCase, method: str, device: str | None, build: str, monkeypatch
) -> None:
    build_without_an_accelerator(monkeypatch, build)
    before = FluxImg2ImgPipeline.from_pipe(flux.pipe)
    flux.pipe.enable_pinned_offload("cpu")
    hooks = staging_hooks(flux.pipe)
    after = FluxImg2ImgPipeline.from_pipe(flux.pipe)  # their offloading would take the shared hooks off
    own = _OffloadingOfItsOwn.from_pipe(flux.pipe)  # as AudioLDM2 has: no super() call to meet the guard
    for pipe in (flux.pipe, before, after, own):
        with pytest.raises(RuntimeError, match="and this process has none; pinned offload stays enabled"):
            getattr(pipe, method)(device=device)
    assert pipeline_state(flux.pipe) is not None and staging_hooks(flux.pipe) == hooks
    assert torch.equal(flux.run(), flux.reference)


def test_a_deep_copy_is_an_independent_pipeline_without_offloading(flux: PipelineCase) -> None:
    flux.pipe.enable_pinned_offload("cpu", components={"transformer": "streamed", "vae": "resident"}, vram_budget=10**9)
    assert torch.equal(flux.run(), flux.reference)  # the VAE, resident, is loaded now
    weights = flux.state()
    twin = copy.deepcopy(flux.pipe)
    assert pipeline_state(twin) is None and "to" not in twin.__dict__
    for module in (m for m in twin.components.values() if isinstance(m, torch.nn.Module)):
        assert not any(hasattr(sub, "_hf_hook") for sub in module.modules()), "no hook on the copy"
    assert pipeline_state(flux.pipe) is not None and "to" in flux.pipe.__dict__, "the original keeps its own"
    copied = pipeline_output_of(twin, flux)
    assert torch.equal(copied, copied_output(flux, copy.deepcopy))
    twin.vae.decoder.conv_out.weight.data.zero_()
    assert not torch.equal(pipeline_output_of(twin, flux), copied), "the copy decodes with its own VAE"
    twin.to(torch.float64)  # the copy's own to(): the original is not cast
    twin.transformer.transformer_blocks[0].ff.net[0].proj.weight.data.zero_()
    assert_weights_equal(weights, flux.state())
    assert torch.equal(flux.run(), flux.reference)
    flux.pipe.disable_pinned_offload()
    assert_weights_equal(weights, flux.state())


def pipeline_output_of(pipe, case: PipelineCase) -> torch.Tensor:
    from diffusers_residency.bench.builders import call_kwargs, pipeline_output

    return pipeline_output(pipe, call_kwargs(case.kind, "tiny"))


def copied_output(case: PipelineCase, copy_pipeline) -> torch.Tensor:
    """The output of a copy of the same pipeline never offloaded: what a copy of the offloaded one
    must give. Not the original's output: a copy's weights are new 64-byte-aligned host memory, the
    original's are mapped from its files at their offsets there, and the CPU's kernels can round
    differently with alignment."""
    return pipeline_output_of(copy_pipeline(PipelineCase(case.kind).pipe), case)


def test_pickling_an_enabled_pipeline_says_what_to_do_and_works_after_disabling(flux: PipelineCase) -> None:
    flux.pipe.enable_pinned_offload("cpu")
    with pytest.raises(TypeError, match=r"disable_pinned_offload\(\) before pickling or torch.save"):
        pickle.dumps(flux.pipe)
    flux.pipe.remove_all_hooks()  # hooks removed by other means: the guards go with them
    restored = pickle.loads(pickle.dumps(flux.pipe))
    assert torch.equal(pipeline_output_of(restored, flux), copied_output(flux, lambda pipe: pickle.loads(pickle.dumps(pipe))))


def test_copying_a_staged_module_or_a_pipeline_sharing_it_says_what_to_copy(flux: PipelineCase) -> None:
    flux.pipe.enable_pinned_offload("cpu", components={"transformer": "streamed"})
    sibling = FluxPipeline.from_pipe(flux.pipe)
    for staged in (flux.pipe.vae, flux.pipe.transformer.transformer_blocks[0], sibling):
        for copying in (copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError, match="copy.deepcopy\\(\\) the pipeline pinned offload was enabled on"):
                copying(staged)
    assert torch.equal(flux.run(), flux.reference)
