"""Tests for the offline pipeline builders in ``diffusers_residency.bench.builders``."""

from __future__ import annotations

import functools
import gc
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate.hooks import ModelHook, add_hook_to_module
from diffusers import DiffusionPipeline
from transformers import CLIPTokenizer, T5Tokenizer

from diffusers_residency.bench import builders
from diffusers_residency.bench.architectures import ARCHITECTURES
from diffusers_residency.bench.builders import (
    PIPELINE_KINDS,
    build_pipeline,
    call_kwargs,
    pipeline_output,
)

pytestmark = pytest.mark.slow

TINY_OUTPUT_SHAPES = {
    "flux": (1, 3, 32, 32),
    "sdxl": (1, 3, 32, 32),
    "sd3": (1, 3, 32, 32),
    "sd15": (1, 3, 32, 32),
    "wan": (1, 5, 3, 32, 32),  # batch, frames, channels, height, width
}

# Parameter counts of the published checkpoints.
PUBLISHED_PARAMETER_COUNTS = [
    ("flux", "transformer", 11.9e9),  # FLUX.1-dev
    ("flux", "text_encoder_2", 4.76e9),  # T5-XXL encoder
    ("flux", "text_encoder", 123e6),  # CLIP-L text
    ("flux", "vae", 83.8e6),
    ("sdxl", "unet", 2.57e9),
    ("sdxl", "text_encoder_2", 695e6),  # CLIP-bigG text with projection
    ("sd3", "transformer", 2.03e9),  # SD3 medium
    ("sd15", "unet", 860e6),  # Stable Diffusion 1.5
    ("wan", "transformer", 14e9),  # Wan 2.1 T2V 14B
    ("wan", "vae", 127e6),
]


def modules_of(pipe: DiffusionPipeline) -> dict[str, torch.nn.Module]:
    return {name: c for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)}


@functools.cache
def tiny(kind: str) -> DiffusionPipeline:
    """A tiny pipeline shared by the tests that only call it or read it."""
    return build_pipeline(kind)


@functools.cache
def full_on_meta(kind: str) -> DiffusionPipeline:
    """Full-size pipelines on the meta device: the real structure, no memory, built once."""
    return build_pipeline(kind, "full", device="meta", dtype=torch.bfloat16)


@pytest.mark.parametrize("kind", PIPELINE_KINDS)
def test_tiny_pipeline_output_is_reproducible(kind: str) -> None:
    pipe = tiny(kind)
    output = pipeline_output(pipe, call_kwargs(kind))

    assert not any(m.training for module in modules_of(pipe).values() for m in module.modules())
    assert output.shape == TINY_OUTPUT_SHAPES[kind]
    assert output.isfinite().all()
    assert torch.equal(output, pipeline_output(pipe, call_kwargs(kind))), "second call differs"
    rebuilt = build_pipeline(kind)
    assert torch.equal(output, pipeline_output(rebuilt, call_kwargs(kind))), "rebuild differs"
    # The equalities above mean something only if the weights matter.
    reseeded = build_pipeline(kind, seed=1)
    assert not torch.equal(output, pipeline_output(reseeded, call_kwargs(kind)))


class _CountCalls(ModelHook):
    """Counts the calls an offloading hook would see (``forward``, and the VAE's ``decode``)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        self.calls += 1
        return args, kwargs


@pytest.mark.parametrize("kind", PIPELINE_KINDS)
def test_every_model_component_runs_in_a_call(kind: str) -> None:
    pipe = build_pipeline(kind)
    hooks = {name: _CountCalls() for name in modules_of(pipe)}
    for name, module in modules_of(pipe).items():
        add_hook_to_module(module, hooks[name])

    pipeline_output(pipe, call_kwargs(kind))

    assert {name for name, hook in hooks.items() if hook.calls == 0} == set()


@pytest.mark.parametrize("kind", PIPELINE_KINDS)
def test_prompts_longer_than_the_tokenizers_take_are_truncated(kind: str) -> None:
    pipe = tiny(kind)
    kwargs = call_kwargs(kind) | {"prompt": " ".join([builders.PROMPT] * 4)}  # > 77 CLIP tokens

    assert pipeline_output(pipe, kwargs).isfinite().all()


@pytest.mark.parametrize("kind", PIPELINE_KINDS)
def test_tokenizers_are_real_and_fit_their_text_encoders(kind: str) -> None:
    for pipe in (tiny(kind), full_on_meta(kind)):
        for name, tokenizer in pipe.components.items():
            if not name.startswith("tokenizer"):
                continue
            assert type(tokenizer) in (CLIPTokenizer, T5Tokenizer)
            encoder = pipe.components[name.replace("tokenizer", "text_encoder")]
            assert len(tokenizer) <= encoder.config.vocab_size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", PIPELINE_KINDS)
def test_building_on_device_gives_what_loading_gives(kind: str, dtype: torch.dtype) -> None:
    """Full pipelines skip save/load; at tiny size, that path must give the loaded tensors.

    Tensors, not outputs: on the CPU, results differ in the last bits between weights in
    memory-mapped files and the same weights in freshly allocated memory (alignment).
    """
    spec = builders._KINDS[kind]
    parts = spec.parts(ARCHITECTURES["tiny"])
    direct = modules_of(builders._build_on_device(spec.pipeline_cls, parts, seed=0, dtype=dtype, device="cpu"))
    loaded = modules_of(build_pipeline(kind, dtype=dtype))

    assert direct.keys() == loaded.keys()
    for component, module in loaded.items():
        expected = dict([*module.named_parameters(), *module.named_buffers()])
        actual = dict([*direct[component].named_parameters(), *direct[component].named_buffers()])
        assert actual.keys() == expected.keys()
        for name, tensor in expected.items():
            assert actual[name].dtype == tensor.dtype, f"{component}.{name}"
            assert torch.equal(actual[name], tensor), f"{component}.{name}"


def test_checkpoint_directory_lives_as_long_as_the_pipeline() -> None:
    # Loaded weights are memory-mapped from the saved files, so they must not vanish early.
    pipe = build_pipeline("flux")
    directory = Path(pipe._builder_checkpoint_dir.name)
    gc.collect()
    assert directory.is_dir()

    del pipe
    gc.collect()
    assert not directory.exists()


@pytest.mark.parametrize(("kind", "component", "expected"), PUBLISHED_PARAMETER_COUNTS)
def test_full_configs_have_the_published_sizes(kind: str, component: str, expected: float) -> None:
    module = modules_of(full_on_meta(kind))[component]

    assert sum(p.numel() for p in module.parameters()) == pytest.approx(expected, rel=0.03)
    assert {p.device.type for p in module.parameters()} == {"meta"}
    assert not module.training


def test_call_kwargs_defaults_and_overrides() -> None:
    full = call_kwargs("wan", "full")
    assert (full["height"], full["width"], full["num_frames"]) == (480, 832, 33)
    assert full["num_inference_steps"] == 10
    assert "max_sequence_length" not in full  # full scale keeps the pipeline's own default

    overridden = call_kwargs("sdxl", steps=3, height=64, width=48)
    assert (overridden["num_inference_steps"], overridden["height"], overridden["width"]) == (3, 64, 48)
    assert overridden["generator"] is not call_kwargs("sdxl")["generator"]


@pytest.mark.parametrize(("kind", "scale"), [("sd2", "tiny"), ("flux", "huge")])
def test_unknown_kind_or_scale_is_rejected(kind: str, scale: str) -> None:
    with pytest.raises(ValueError, match="unknown"):
        build_pipeline(kind, scale)
    with pytest.raises(ValueError, match="unknown"):
        call_kwargs(kind, scale)
