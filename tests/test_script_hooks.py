"""Hooks attached per module from a script, without the pipeline method."""

from __future__ import annotations

import pytest
import torch

from diffusers_residency import (
    ResidencyGroup,
    attach_block_streaming,
    attach_staging_hook,
    detach_staging_hook,
)
from diffusers_residency.bench.builders import call_kwargs, pipeline_output
from diffusers_residency.pipeline import pipeline_state

from .helpers import PipelineCase, assert_weights_equal


def test_block_level_hooks_share_one_group(flux: PipelineCase) -> None:
    pipe = flux.pipe
    before = flux.state()
    group = ResidencyGroup("cpu")
    transformer = pipe.transformer
    blocks = [*transformer.transformer_blocks, *transformer.single_transformer_blocks]
    # Everything in the call runs through the group: the text encoders and VAE as components, and
    # the transformer block by block, with its small non-block layers kept resident.
    modules = {"text_encoder": pipe.text_encoder, "text_encoder_2": pipe.text_encoder_2, "vae": pipe.vae}
    modules |= {f"block{i}": block for i, block in enumerate(blocks)}
    for name, module in modules.items():
        attach_staging_hook(module, group, name=name)
    for name, module in transformer.named_children():
        if name not in ("transformer_blocks", "single_transformer_blocks"):
            attach_staging_hook(module, group, name=f"transformer.{name}", policy="resident")

    assert torch.equal(flux.run(), flux.reference)
    assert torch.equal(flux.run(), flux.reference)
    steps = call_kwargs("flux")["num_inference_steps"]
    loads = {u.name: u.stager.loads for u in group.units}
    assert all(loads[name] == 2 for name in ("text_encoder", "text_encoder_2", "vae")), loads
    assert all(loads[f"block{i}"] == 2 * steps for i in range(len(blocks))), loads
    assert all(u.stager.loads == 1 for u in group.units if u.policy.value == "resident"), loads
    assert [u.name for u in group.units if u.policy.value == "staged" and u.stager.loaded] == ["vae"]

    for unit in list(group.units):
        detach_staging_hook(unit.module)
    assert group.units == []
    assert_weights_equal(before, flux.state())
    assert torch.equal(flux.run(), flux.reference)


def test_overlapping_modules_are_refused(flux: PipelineCase) -> None:
    group = ResidencyGroup("cpu")
    attach_staging_hook(flux.pipe.transformer.transformer_blocks[0], group, name="block0")
    with pytest.raises(ValueError, match="shares weights"):
        attach_staging_hook(flux.pipe.transformer, group, name="transformer")
    assert len(group.units) == 1


def test_detach_without_hook_is_a_clear_error(flux: PipelineCase) -> None:
    with pytest.raises(ValueError, match="no staging hook"):
        detach_staging_hook(flux.pipe.vae)


def test_a_block_of_a_staged_component_cannot_join_another_group(flux) -> None:
    flux.pipe.enable_pinned_offload(device="cpu")
    flux.run()
    block = flux.pipe.transformer.transformer_blocks[0]
    before = {name: t.data_ptr() for name, t in block.named_parameters()}
    with pytest.raises(ValueError, match="another staging group"):
        attach_staging_hook(block, ResidencyGroup("cpu"), name="block0")
    assert not hasattr(block, "_hf_hook")
    assert {name: t.data_ptr() for name, t in block.named_parameters()} == before
    assert torch.equal(flux.run(), flux.reference)

    flux.pipe.disable_pinned_offload()  # once the pipeline lets go, the block can be staged
    group = ResidencyGroup("cpu")
    attach_staging_hook(block, group, name="block0")
    with pytest.raises(ValueError, match="already staged by another"):
        flux.pipe.enable_pinned_offload(device="cpu")  # and now the pipeline cannot take it
    assert not hasattr(flux.pipe.transformer, "_hf_hook")


def test_a_module_whose_decode_is_a_submodule_is_staged_as_it_is() -> None:
    class WithDecodeLayers(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.decode = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.decode(x)

    module, x = WithDecodeLayers().eval(), torch.randn(2, 4)
    expected = module(x)
    attach_staging_hook(module, ResidencyGroup("cpu"))
    assert isinstance(module.decode, torch.nn.Linear), "no entry point to retry: left as it is"
    assert torch.equal(module(x), expected)
    detach_staging_hook(module)
    assert isinstance(module.decode, torch.nn.Linear) and torch.equal(module(x), expected)


def test_an_fx_graph_staged_then_detached_runs_as_before() -> None:
    # accelerate hooks an fx graph through its class's forward, and restores only that: the
    # instance's forward the hook wrapped goes with the hook.
    graph = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4)).eval())
    x = torch.randn(2, 4)
    expected = graph(x)
    attach_staging_hook(graph, ResidencyGroup("cpu"), name="graph")
    assert torch.equal(graph(x), expected)
    detach_staging_hook(graph)
    assert "forward" not in vars(graph) and torch.equal(graph(x), expected)


def test_a_name_another_module_of_the_group_has_is_refused_before_anything_changes() -> None:
    # Named by their class by default: two staged under one name would be one component, neither
    # evicting the other, and detaching one would take the other's hook.
    group = ResidencyGroup("cpu")
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    attach_staging_hook(first, group)
    with pytest.raises(ValueError, match="'Linear' already names another module in this group"):
        attach_staging_hook(second, group)
    assert not hasattr(second, "_hf_hook") and [unit.name for unit in group.units] == ["Linear"]
    attach_staging_hook(first, group, policy="resident")  # the same module again: its hook is replaced
    attach_staging_hook(second, group, name="second")
    detach_staging_hook(first)
    detach_staging_hook(second)
    assert not group.units


def test_one_block_of_a_streamed_module_is_not_detached_alone(flux: PipelineCase) -> None:
    group = ResidencyGroup("cpu")
    transformer = flux.pipe.transformer
    attach_block_streaming(transformer, group, name="transformer")
    block = transformer.single_transformer_blocks[0]
    hook = block._hf_hook
    with pytest.raises(ValueError, match="is a block of the streamed 'transformer': detach 'transformer' itself"):
        detach_staging_hook(block)
    with pytest.raises(ValueError, match="is a block of the streamed 'transformer': detach 'transformer' itself"):
        attach_staging_hook(block, group, name="my_block")  # in its stream's group: it would replace the hook
    assert block._hf_hook is hook and hook.unit in group.units, "left as it was"
    assert torch.equal(flux.run(), flux.reference)
    detach_staging_hook(transformer)
    assert not group.units and not hasattr(block, "_hf_hook")
    assert torch.equal(flux.run(), flux.reference)


@pytest.mark.parametrize("budget", [False, True], ids=["no-budget", "measured-budget"])
@pytest.mark.parametrize("name", ["vae", "my_vae"])
def test_a_hook_attached_again_in_a_pipelines_group_goes_with_disable(
    flux: PipelineCase, monkeypatch: pytest.MonkeyPatch, budget: bool, name: str
) -> None:
    from .test_profile import _budget, _measure_on_the_cpu

    before = flux.state()
    flux.pipe.enable_pinned_offload("cpu", vram_budget=_budget(flux) if budget else "auto")
    if budget:  # plans made again as calls measure, and for a shape of their own
        _measure_on_the_cpu(flux, monkeypatch)
    attach_staging_hook(flux.pipe.vae, pipeline_state(flux.pipe).group, name=name, policy="resident")
    for _ in range(2):
        assert torch.equal(flux.run(), flux.reference)
    pipeline_output(flux.pipe, {**call_kwargs("flux"), "height": 48, "width": 48})
    flux.pipe.disable_pinned_offload()
    assert not any(hasattr(module, "_hf_hook") for module in flux.pipe.components.values())
    assert_weights_equal(before, flux.state())
    flux.pipe.enable_pinned_offload("cpu")
    assert torch.equal(flux.run(), flux.reference)



@pytest.mark.parametrize("prefetch_blocks", [-1, 1.5, True])
def test_a_prefetch_depth_that_is_no_count_of_blocks_is_refused(flux: PipelineCase, prefetch_blocks) -> None:
    with pytest.raises(ValueError, match="a whole number from 0"):
        attach_block_streaming(flux.pipe.transformer, ResidencyGroup("cpu"), prefetch_blocks=prefetch_blocks)
    assert not any(hasattr(module, "_hf_hook") for module in flux.pipe.transformer.modules())


def test_a_module_is_not_streamed_through_attach_staging_hook(flux: PipelineCase) -> None:
    group = ResidencyGroup("cpu")
    with pytest.raises(ValueError, match="streams through attach_block_streaming"):
        attach_staging_hook(flux.pipe.transformer, group, policy="streamed")
    assert not group.units and not hasattr(flux.pipe.transformer, "_hf_hook")
