"""Quantized weights on CUDA: bitsandbytes (CUDA only) and torchao's float8, each loaded the way
diffusers loads them, staged and compared with the same quantized pipeline run resident.

Marked ``gpu``: skipped on machines without CUDA (CI), run on the GPU machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from diffusers_residency.pipeline import pipeline_state
from diffusers_residency.weights import module_tensors, storage_bytes, stored_tensors

from .helpers import PipelineCase, assert_weights_equal
from .test_gpu import CUDA, release_pipelines  # noqa: F401  (the fixture, for this module too)

pytestmark = pytest.mark.gpu


def _bitsandbytes_transformer(case: PipelineCase, folder: Path, **config: object) -> None:
    """The transformer saved and loaded back through diffusers' bitsandbytes quantizer, onto CUDA."""
    pytest.importorskip("bitsandbytes")
    from diffusers import BitsAndBytesConfig

    transformer = case.pipe.transformer
    transformer.save_pretrained(folder)
    case.pipe.transformer = type(transformer).from_pretrained(
        folder, quantization_config=BitsAndBytesConfig(**config), torch_dtype=torch.bfloat16
    ).eval()


def _torchao_float8_transformer(case: PipelineCase, _: Path) -> None:
    quantization = pytest.importorskip("torchao.quantization")
    quantization.quantize_(case.pipe.transformer, quantization.Float8WeightOnlyConfig())


QUANTIZED = {
    "bnb-nf4": lambda case, folder: _bitsandbytes_transformer(
        case, folder, load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
    ),
    "torchao-float8": _torchao_float8_transformer,
}


def _devices(module: torch.nn.Module) -> set[torch.device]:
    """The devices of the module's tensors, quantized ones and every tensor inside them."""
    found = set()
    for tensor in module_tensors((module,)):
        found.add(tensor.device)
        found.update(t.device for t in stored_tensors(tensor))
    return found


@pytest.mark.parametrize("kind", list(QUANTIZED))
def test_quantized_transformer_on_cuda_matches_resident_and_copies_nothing_back(kind: str, tmp_path: Path) -> None:
    case = PipelineCase("flux", device="cuda", dtype=torch.bfloat16)
    QUANTIZED[kind](case, tmp_path)
    transformer = case.pipe.transformer
    assert any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in module_tensors((transformer,)))
    case.reference = case.run()
    before = case.state()
    quantized_bytes = storage_bytes(module_tensors((transformer,)))

    case.pipe.enable_pinned_offload(vram_budget=None, components={"transformer": "staged"})
    assert _devices(transformer) == {torch.device("cpu")}, "every part of every weight on its host master"
    assert case.pipe.residency_report()["transformer"].weight_bytes == quantized_bytes
    with torch.inference_mode():  # the first loads, and the wrappers rebuilt on the device, under it
        assert torch.equal(case.run(), case.reference)
    assert not any(t.is_inference() for t in module_tensors((transformer,))), "weights stay ordinary tensors"
    assert torch.equal(case.run(), case.reference)

    group = pipeline_state(case.pipe).group
    unit = next(u for u in group.units if u.name == "transformer")
    group.activate(unit)
    assert _devices(transformer) == {CUDA}, "the wrappers' own device follows their inner tensors"
    others = [u for u in group.units if u is not unit]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            group.activate(others[0])
            group.activate(unit)
        torch.cuda.synchronize()
    memcpys = [e.name for e in prof.events() if "memcpy" in e.name.lower()]
    assert any("HtoD" in name for name in memcpys), "the profiler saw no loads: the check would be blind"
    assert not [name for name in memcpys if "DtoH" in name], memcpys
    assert torch.equal(case.run(), case.reference)

    case.pipe.disable_pinned_offload()
    assert _devices(transformer) == {CUDA}, "back on the device it was enabled from"
    assert_weights_equal(before, case.state())
    assert torch.equal(case.run(), case.reference)


def test_bitsandbytes_8bit_is_refused_before_anything_changes(tmp_path: Path) -> None:
    case = PipelineCase("flux", device="cuda", dtype=torch.bfloat16)
    _bitsandbytes_transformer(case, tmp_path, load_in_8bit=True)
    case.reference = case.run()
    with pytest.raises(ValueError, match=r"transformer.*Int8Params"):
        case.pipe.enable_pinned_offload(vram_budget=None)
    assert pipeline_state(case.pipe) is None
    assert torch.equal(case.run(), case.reference)


def test_bitsandbytes_state_shared_between_weights_is_refused_before_anything_changes(tmp_path: Path) -> None:
    """Older bitsandbytes releases gave every 4-bit weight's nested quantization state one ``code``
    tensor; staged apart, the blocks would move it under each other. Made so here by hand, as those
    releases made it."""
    case = PipelineCase("flux", device="cuda", dtype=torch.bfloat16)
    _bitsandbytes_transformer(
        case, tmp_path, load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True
    )
    states = [p.quant_state.state2 for p in case.pipe.transformer.parameters() if getattr(p, "quant_state", None)]
    assert len(states) > 1 and all(state is not None for state in states), "nested states expected"
    for state in states[1:]:
        state.code = states[0].code
    case.reference = case.run()
    with pytest.raises(ValueError, match=r"quantization state.*Upgrade bitsandbytes"):
        case.pipe.enable_pinned_offload(vram_budget=None, components={"transformer": "streamed"})
    assert pipeline_state(case.pipe) is None
    assert torch.equal(case.run(), case.reference)
