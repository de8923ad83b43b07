"""Weights that change after enable_pinned_offload: LoRA adapters, fused projections, replaced
parameters. Each change is made on the host masters and staged like the weights it joins."""

from __future__ import annotations

import pytest
import torch

from .helpers import PipelineCase

peft = pytest.importorskip("peft")


def lora_state_dict(case: PipelineCase) -> dict[str, torch.Tensor]:
    """A LoRA for the transformer's attention projections, made here with non-zero weights."""
    donor = PipelineCase(case.kind).pipe.transformer
    torch.manual_seed(1)
    donor.add_adapter(
        peft.LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v"], init_lora_weights=False)
    )
    return {f"transformer.{k}": v for k, v in peft.utils.get_peft_model_state_dict(donor).items()}


def assert_every_weight_staged(pipe, name: str) -> None:
    """Every tensor of the component has a master, and a load moves every one of them."""
    group = pipe.__dict__["_pinned_residency"].group
    unit = next(u for u in group.units if u.name == name)
    group.activate(unit)
    loaded = {id(t): t.data_ptr() for t in unit.module.parameters()}
    unit.stager.offload()
    assert unit.stager.masters_current()
    assert all(t.data_ptr() != loaded[id(t)] for t in unit.module.parameters()), "a weight was not staged"


def test_lora_loaded_fused_and_unloaded_after_enable(flux: PipelineCase) -> None:
    lora = lora_state_dict(flux)
    resident = PipelineCase("flux")
    resident.pipe.load_lora_weights(lora, adapter_name="style")
    expected = resident.run()
    assert not torch.equal(expected, flux.reference), "the LoRA must change the output for this test to mean anything"

    flux.pipe.enable_pinned_offload(device="cpu")
    flux.run()
    flux.pipe.load_lora_weights(lora, adapter_name="style")
    assert torch.equal(flux.run(), expected)
    assert_every_weight_staged(flux.pipe, "transformer")

    resident.pipe.fuse_lora()
    flux.pipe.fuse_lora()
    assert torch.equal(flux.run(), resident.run())
    resident.pipe.unfuse_lora()
    flux.pipe.unfuse_lora()
    resident.pipe.unload_lora_weights()
    flux.pipe.unload_lora_weights()
    assert torch.equal(flux.run(), resident.run())


def test_fused_qkv_projections_after_enable(flux: PipelineCase) -> None:
    resident = PipelineCase("flux")
    resident.pipe.transformer.fuse_qkv_projections()
    flux.pipe.enable_pinned_offload(device="cpu")
    flux.run()
    flux.pipe.transformer.fuse_qkv_projections()
    assert torch.equal(flux.run(), resident.run())
    assert_every_weight_staged(flux.pipe, "transformer")


def test_a_submodule_cast_is_staged_not_undone(flux: PipelineCase) -> None:
    flux.pipe.enable_pinned_offload(device="cpu")
    flux.run()
    flux.pipe.transformer.proj_out.to(torch.float64)
    group = flux.pipe.__dict__["_pinned_residency"].group
    unit = next(u for u in group.units if u.name == "transformer")
    group.activate(unit)
    assert flux.pipe.transformer.proj_out.weight.dtype == torch.float64
    unit.stager.offload()
    assert flux.pipe.transformer.proj_out.weight.dtype == torch.float64
    flux.pipe.transformer.proj_out.to(torch.float32)
    assert torch.equal(flux.run(), flux.reference)
