"""torch.compile of staged components: regional (``compile_repeated_blocks``) and whole-component.

The CPU runs dynamo with the ``eager`` backend: graph breaks and recompilations are decided by
dynamo, not by the backend, and eager keeps the kernels, so outputs stay bit-identical to the
compiled resident pipeline. ``test_gpu.py`` runs the same with inductor on CUDA.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from diffusers_residency.hooks import replays_cuda_graphs

from .helpers import PipelineCase

pytestmark = pytest.mark.slow


def compile_transformer(case: PipelineCase, how: str, backend: str) -> None:
    if how == "regional":
        case.pipe.transformer.compile_repeated_blocks(backend=backend, fullgraph=True)
    else:
        case.pipe.transformer.compile(backend=backend, fullgraph=True)


def graph_breaks() -> dict[str, int]:
    return dict(counters["graph_break"])


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("how", ["regional", "whole"])
def test_compiled_staged_transformer_never_recompiles(flux: PipelineCase, how: str) -> None:
    resident = PipelineCase("flux")
    compile_transformer(resident, how, "eager")
    expected = resident.run()

    flux.pipe.enable_pinned_offload(device="cpu")
    compile_transformer(flux, how, "eager")
    torch._dynamo.reset()
    counters.clear()
    assert torch.equal(flux.run(), expected)
    graphs = counters["stats"]["unique_graphs"]
    breaks = graph_breaks()
    assert breaks == {} and graphs >= 1, "fullgraph=True: compiled as whole graphs, the hooks outside them"
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):  # weights at new device addresses each call: still no recompilation
            assert torch.equal(flux.run(), expected)
    assert counters["stats"]["unique_graphs"] == graphs and graph_breaks() == breaks


def test_a_component_compiled_before_enabling_breaks_its_graph_once_and_never_recompiles(flux: PipelineCase) -> None:
    resident = PipelineCase("flux")
    resident.pipe.transformer.compile(backend="eager")
    expected = resident.run()

    flux.pipe.transformer.compile(backend="eager")  # nn.Module.compile: the whole call, hooks to come
    flux.pipe.enable_pinned_offload(device="cpu")
    torch._dynamo.reset()
    counters.clear()
    assert torch.equal(flux.run(), expected)
    breaks = graph_breaks()
    # The staging call at the component's entry runs eagerly; the forward after it is one graph.
    assert len(breaks) == 1 and "StagingHook.pre_forward" in next(iter(breaks)), breaks
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(flux.run(), expected)
    assert graph_breaks() == breaks


def test_detaching_keeps_the_compiled_forward(flux: PipelineCase) -> None:
    flux.pipe.enable_pinned_offload(device="cpu")
    flux.pipe.transformer.compile(backend="eager", fullgraph=True)
    flux.pipe.disable_pinned_offload()
    assert "compile" not in flux.pipe.transformer.__dict__
    assert torch.equal(flux.run(), flux.reference)
    assert counters["stats"]["unique_graphs"] >= 1


def test_compiling_again_compiles_the_plain_forward_once(flux: PipelineCase) -> None:
    flux.pipe.transformer.compile(backend="eager")  # before enabling: the whole call
    flux.pipe.enable_pinned_offload(device="cpu")
    transformer = flux.pipe.transformer
    for _ in range(2):
        transformer.compile(backend="eager", fullgraph=True)
        assert not hasattr(transformer._old_forward._torchdynamo_orig_callable, "_torchdynamo_orig_callable")
    assert transformer._compiled_call_impl is None, "the earlier compile of the whole call is dropped"
    counters.clear()
    assert torch.equal(flux.run(), flux.reference)
    assert graph_breaks() == {}


def test_regionally_compiled_streamed_transformer_never_breaks_or_recompiles(flux: PipelineCase) -> None:
    """Each streamed block's staging hook stays outside the block's compiled graph."""
    resident = PipelineCase("flux")
    compile_transformer(resident, "regional", "eager")
    expected = resident.run()

    flux.pipe.enable_pinned_offload("cpu", components={"transformer": "streamed"}, vram_budget=None)
    compile_transformer(flux, "regional", "eager")
    torch._dynamo.reset()
    counters.clear()
    assert torch.equal(flux.run(), expected)
    graphs = counters["stats"]["unique_graphs"]
    assert graph_breaks() == {} and graphs >= 1
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):  # blocks at new device addresses at every step
            assert torch.equal(flux.run(), expected)
    assert counters["stats"]["unique_graphs"] == graphs and graph_breaks() == {}


def test_whole_compile_of_a_streamed_transformer_breaks_once_per_block(flux: PipelineCase) -> None:
    """Each streamed block's staging runs eagerly inside the compiled forward: fullgraph=True is
    refused by dynamo, and without it the graph breaks once per block."""
    flux.pipe.enable_pinned_offload("cpu", components={"transformer": "streamed"}, vram_budget=None)
    transformer = flux.pipe.transformer
    transformer.compile(backend="eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        flux.run()
    torch._dynamo.reset()
    transformer.compile(backend="eager")
    counters.clear()
    assert torch.equal(flux.run(), flux.reference)
    blocks = len(transformer.transformer_blocks) + len(transformer.single_transformer_blocks)
    assert sum(graph_breaks().values()) == blocks, graph_breaks()


CUDA_GRAPH_COMPILES = [{"mode": "reduce-overhead"}, {"backend": "cudagraphs"}, {"options": {"triton.cudagraphs": True}}]


@pytest.mark.parametrize("compile_kwargs", CUDA_GRAPH_COMPILES, ids=["reduce-overhead", "cudagraphs", "option"])
def test_compiling_a_moving_component_for_cuda_graphs_warns_and_names_the_fix(flux: PipelineCase, compile_kwargs) -> None:
    """CUDA graphs capture the weights' addresses; a component that loads at each call brings them
    back wherever the allocator has room. Compiling is lazy: nothing runs here."""
    flux.pipe.enable_pinned_offload(device="cpu")  # no plan on the CPU: the transformer is staged
    transformer = flux.pipe.transformer
    with pytest.warns(UserWarning, match=r"components=\{'transformer': 'resident'\}"):
        transformer.compile(**compile_kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        transformer.compile(backend="eager")  # no CUDA graphs: nothing to say
        flux.pipe.enable_pinned_offload(device="cpu", components={"transformer": "resident"})
        transformer.compile(**compile_kwargs)  # kept on the device: its addresses never change


def test_regional_compile_for_cuda_graphs_of_a_streamed_component_warns(flux: PipelineCase) -> None:
    flux.pipe.enable_pinned_offload("cpu", components={"transformer": "streamed"}, vram_budget=None)
    with pytest.warns(UserWarning, match="pinned offload moves it \\(streamed\\)"):
        flux.pipe.transformer.compile_repeated_blocks(mode="reduce-overhead")


@pytest.mark.parametrize(
    ("compile_kwargs", "replays"),
    [
        ({}, False),
        ({"mode": "default"}, False),
        ({"mode": "max-autotune-no-cudagraphs"}, False),
        ({"mode": "reduce-overhead"}, True),
        ({"mode": "max-autotune"}, True),
        ({"backend": "cudagraphs"}, True),
        ({"options": {"triton.cudagraphs": True}}, True),
        ({"backend": "eager", "mode": "reduce-overhead"}, False),  # only inductor takes modes
    ],
)
def test_which_compiles_replay_cuda_graphs(compile_kwargs: dict, replays: bool) -> None:
    assert replays_cuda_graphs(compile_kwargs) is replays


def test_inductor_set_to_cuda_graphs_in_its_config_replays_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch._inductor.config.triton, "cudagraphs", True)
    assert replays_cuda_graphs({}) and not replays_cuda_graphs({"options": {"triton.cudagraphs": False}})
