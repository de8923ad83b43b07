"""Quantized weights staged through the plain tensors that hold their bytes, on a real tiny Flux
pipeline on the CPU: torchao and optimum-quanto wrapper tensors, and GGUF files loaded through
diffusers' own single-file loader. Each is compared with the same quantized pipeline run resident."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from diffusers_residency import Policy
from diffusers_residency.bench.builders import call_kwargs
from diffusers_residency.components import component_sizes, module_components
from diffusers_residency.dry_runs import ForwardDryRun
from diffusers_residency.pipeline import pipeline_state
from diffusers_residency.pipeline_residency import DRY_RUN
from diffusers_residency.weights import module_tensors, storage_bytes, stored_tensors

from .helpers import (
    RESERVE,
    PipelineCase,
    assert_no_meta_or_foreign_device,
    assert_weights_equal,
    enable_with_transformer,
    streaming_budget,
)
from .test_dry_runs import _first_step_inputs
from .test_profile import _budget, _measure_on_the_cpu


def _torchao(config: str) -> Callable[[PipelineCase, Path], None]:
    def quantize(case: PipelineCase, _: Path) -> None:
        quantization = pytest.importorskip("torchao.quantization")
        quantization.quantize_(case.pipe.transformer, getattr(quantization, config)())

    return quantize


def _quanto_int8(transformer: nn.Module) -> None:
    quanto = pytest.importorskip("optimum.quanto")
    quanto.quantize(transformer, weights=quanto.qint8)
    quanto.freeze(transformer)


def _gguf_q8(case: PipelineCase, folder: Path) -> None:
    """Write the transformer to a GGUF file (Q8_0 where a row holds whole blocks) and load it back
    with diffusers' ``from_single_file``, as a user loads a published GGUF checkpoint."""
    gguf = pytest.importorskip("gguf")
    from diffusers import GGUFQuantizationConfig

    transformer = case.pipe.transformer
    transformer.save_pretrained(folder / "config")
    writer = gguf.GGUFWriter(str(folder / "transformer.gguf"), "flux")
    for name, tensor in transformer.state_dict().items():
        values = tensor.float().numpy()
        if tensor.ndim == 2 and tensor.shape[1] % 32 == 0:
            packed = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    case.pipe.transformer = type(transformer).from_single_file(
        str(folder / "transformer.gguf"),
        config=str(folder / "config"),
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32),
    )


QUANTIZERS: dict[str, Callable[[PipelineCase, Path], None]] = {
    "torchao-int8": _torchao("Int8WeightOnlyConfig"),
    "torchao-float8": _torchao("Float8WeightOnlyConfig"),
    "quanto-qint8": lambda case, _: _quanto_int8(case.pipe.transformer),
    "gguf-q8_0": _gguf_q8,
}


def quantized_case(kind: str, folder: Path) -> PipelineCase:
    case = PipelineCase("flux")
    QUANTIZERS[kind](case, folder)
    case.reference = case.run()
    return case


@pytest.fixture(params=list(QUANTIZERS))
def quantized(request: pytest.FixtureRequest, tmp_path: Path) -> PipelineCase:
    return quantized_case(request.param, tmp_path)


def _is_quantized(tensor: torch.Tensor) -> bool:
    return type(tensor) not in (torch.Tensor, nn.Parameter)


def test_quantized_transformer_whole_is_exact_and_reports_quantized_bytes(quantized: PipelineCase) -> None:
    transformer = quantized.pipe.transformer
    assert any(_is_quantized(t) for t in module_tensors((transformer,))), "the transformer must hold quantized weights"
    quantized_bytes = storage_bytes(module_tensors((transformer,)))
    full = sum(t.numel() * 4 for t in module_tensors((transformer,)))
    assert quantized_bytes < 0.6 * full, "int8 weights are staged as about a quarter of float32's bytes"
    before = quantized.state()

    quantized.pipe.enable_pinned_offload("cpu", vram_budget=None)
    assert torch.equal(quantized.run(), quantized.reference)
    assert torch.equal(quantized.run(), quantized.reference)
    report = quantized.pipe.residency_report()["transformer"]
    assert report.weight_bytes == quantized_bytes
    unit = next(u for u in pipeline_state(quantized.pipe).group.units if u.name == "transformer")
    assert unit.stager.loads >= 1

    quantized.pipe.disable_pinned_offload()
    assert_weights_equal(before, quantized.state())
    assert_no_meta_or_foreign_device(quantized.pipe)
    assert torch.equal(quantized.run(), quantized.reference)


def test_quantized_transformer_streamed_under_a_budget_is_exact(quantized: PipelineCase) -> None:
    before = quantized.state()
    budget = streaming_budget(quantized)
    quantized.pipe.enable_pinned_offload("cpu", vram_budget=budget, activation_reserve=RESERVE)
    plan = quantized.pipe.residency_plan()
    assert plan["transformer"].policy is Policy.STREAMED, str(plan)
    sizes = {s.name: s for s in component_sizes(quantized.pipe, module_components(quantized.pipe))}
    assert sizes["transformer"].nbytes == storage_bytes(module_tensors((quantized.pipe.transformer,))), "planned on quantized bytes"

    assert torch.equal(quantized.run(), quantized.reference)
    assert torch.equal(quantized.run(), quantized.reference)

    # Every block streamed, at every step.
    quantized.pipe.enable_pinned_offload("cpu", components={"transformer": "streamed"}, vram_budget=None)
    assert torch.equal(quantized.run(), quantized.reference)
    assert torch.equal(quantized.run(), quantized.reference)
    blocks = [u for u in pipeline_state(quantized.pipe).group.units_of("transformer") if u.stream is not None]
    assert blocks and all(u.policy is Policy.STREAMED for u in blocks), str(quantized.pipe.residency_plan())
    steps = call_kwargs("flux")["num_inference_steps"]
    assert all(u.stager.loads >= 2 * steps for u in blocks), "streamed blocks load at every step"

    quantized.pipe.disable_pinned_offload()
    assert_weights_equal(before, quantized.state())
    assert torch.equal(quantized.run(), quantized.reference)


def test_a_quantized_transformers_first_call_under_a_budget_is_planned_from_dry_runs(
    quantized: PipelineCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    quantized.pipe.enable_pinned_offload("cpu", vram_budget=_budget(quantized))
    _measure_on_the_cpu(quantized, monkeypatch)
    state = pipeline_state(quantized.pipe)
    sources: list[str] = []
    first_block = state.group.units_of("transformer")[1].module
    first_block.register_forward_pre_hook(lambda *_: sources.append(state.plan.source))
    assert torch.equal(quantized.run(), quantized.reference)
    assert sources[0] == DRY_RUN, "estimated from the plain model its config builds, in its inputs' dtype"
    assert quantized.pipe.residency_plan().source == "measured"
    assert torch.equal(quantized.run(), quantized.reference)
    # Each quantized layer holds its dequantized weights as it runs, beside the plain model's needs.
    args, kwargs = _first_step_inputs(quantized)
    plain = ForwardDryRun(PipelineCase("flux").pipe.transformer).need(args, kwargs)
    assert ForwardDryRun(quantized.pipe.transformer).need(args, kwargs) > plain


def test_every_stored_tensor_of_a_quantized_weight_moves_with_a_load(tmp_path: Path) -> None:
    """A wrapper's inner tensors (torchao's ``qdata``, ``scale``, ``zero_point``) each get a master:
    a load binds every one of them to new storage, an offload back to its master."""
    case = quantized_case("torchao-int8", tmp_path)
    weight = case.pipe.transformer.transformer_blocks[0].attn.to_q.weight
    inner = stored_tensors(weight)
    assert len(inner) > 1 and all(type(t) is torch.Tensor for t in inner)
    case.pipe.enable_pinned_offload("cpu", components={"transformer": "staged"}, vram_budget=None)
    group = pipeline_state(case.pipe).group
    unit = next(u for u in group.units if u.name == "transformer")
    masters = [t.data_ptr() for t in inner]
    group.activate(unit)
    assert all(t.data_ptr() != m for t, m in zip(inner, masters)), "every inner tensor is loaded"
    assert stored_tensors(weight) == inner, "the wrapper keeps its inner tensor objects"
    unit.stager.offload()
    assert [t.data_ptr() for t in inner] == masters


def test_an_unstageable_tensor_subclass_is_refused_before_anything_changes(flux: PipelineCase) -> None:
    class Opaque(torch.Tensor):
        """A wrapper with no storage and no ``__tensor_flatten__``: nothing says where its bytes are."""

        @staticmethod
        def __new__(cls, data: torch.Tensor) -> Opaque:
            return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype, device=data.device)

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
            if func is torch.ops.aten.detach.default:  # what nn.Parameter() asks of it
                return cls(args[0])
            raise NotImplementedError(func)

    layer = flux.pipe.transformer.transformer_blocks[0].attn.to_q
    layer.weight = nn.Parameter(Opaque(layer.weight.detach()), requires_grad=False)
    with pytest.raises(ValueError, match=r"transformer.*transformer_blocks\.0\.attn\.to_q\.weight.*Opaque"):
        flux.pipe.enable_pinned_offload("cpu")
    assert not any(hasattr(m, "_hf_hook") for m in flux.pipe.components.values())



def test_a_wrapper_that_cannot_be_rebuilt_is_refused_before_anything_changes(flux: PipelineCase) -> None:
    """A load moves a wrapper by rebuilding it over its inner tensors (``__tensor_unflatten__``): one
    that cannot be rebuilt is refused at enable, naming the weight, not at its first load."""

    class Unrebuildable(torch.Tensor):
        @staticmethod
        def __new__(cls, inner: torch.Tensor) -> Unrebuildable:
            return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

        def __init__(self, inner: torch.Tensor) -> None:
            self.inner = inner

        def __tensor_flatten__(self) -> tuple[list[str], None]:
            return ["inner"], None

        @staticmethod
        def __tensor_unflatten__(inner, context, size, stride):  # noqa: ANN001, ANN205
            raise TypeError("made by its quantizer only")

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
            if func is torch.ops.aten.detach.default:
                return cls(args[0].inner)
            raise NotImplementedError(func)

    layer = flux.pipe.transformer.transformer_blocks[0].attn.to_q
    layer.weight = nn.Parameter(Unrebuildable(layer.weight.detach()), requires_grad=False)
    with pytest.raises(ValueError, match=r"transformer.*to_q\.weight.*Unrebuildable.*made by its quantizer only"):
        flux.pipe.enable_pinned_offload("cpu")
    assert pipeline_state(flux.pipe) is None
    assert not any(hasattr(m, "_hf_hook") for m in flux.pipe.components.values())

@pytest.mark.parametrize("policy", ["resident", "streamed"])
@pytest.mark.parametrize("kind", ["torchao-int8", "torchao-float8", "quanto-qint8"])
def test_quantized_weights_loaded_into_a_loaded_transformer_are_kept(kind: str, policy: str, tmp_path: Path) -> None:
    """``load_state_dict`` of other quantized weights into a loaded transformer. torchao writes into
    the inner tensors in place, moving only the wrapper's version counter; optimum-quanto assigns new
    parameters. Either way the next calls, and the weights after disable, carry the new values."""
    offloaded, resident = quantized_case(kind, tmp_path / "a"), quantized_case(kind, tmp_path / "b")
    source = PipelineCase("flux")
    with torch.no_grad():
        for parameter in source.pipe.transformer.parameters():
            parameter.mul_(1.05)
    QUANTIZERS[kind](source, tmp_path / "c")
    new = source.pipe.transformer.state_dict()
    resident.pipe.transformer.load_state_dict(new)
    expected = resident.run()
    assert not torch.equal(expected, offloaded.reference), "the new weights must change the output"

    enable_with_transformer(offloaded, policy)
    offloaded.run()
    units = pipeline_state(offloaded.pipe).group.units_of("transformer")
    assert any(u.stager.loaded for u in units), "some of the transformer must be loaded"
    offloaded.pipe.transformer.load_state_dict(new)
    assert torch.equal(offloaded.run(), expected)
    assert torch.equal(offloaded.run(), expected)
    offloaded.pipe.disable_pinned_offload()
    assert_weights_equal(resident.state(), offloaded.state())
    assert_no_meta_or_foreign_device(offloaded.pipe)
    assert torch.equal(offloaded.run(), expected)
