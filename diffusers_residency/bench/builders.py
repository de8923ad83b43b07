"""Real diffusers pipelines with random weights, built offline.

Offloading has to be exercised against the pipelines people run, so these builders use the real
pipeline and model classes (FluxPipeline, StableDiffusionXLPipeline, StableDiffusion3Pipeline,
StableDiffusionPipeline, WanPipeline) with random weights and tokenizers made in code: nothing
comes from the hub.

Two scales:

* ``"tiny"``: the same architectures shrunk to a few layers and widths of 8-64, for tests. The
  whole pipeline goes through ``save_pretrained`` / ``from_pretrained``, so it is loaded by the
  same code as a user's pipeline (dtype handling, modules kept in float32, tokenizer files).
* ``"full"``: the published architectures (FLUX.1-dev, SDXL base 1.0, SD3 medium, Stable
  Diffusion 1.5, Wan 2.1 T2V 14B), for the benchmark. Built directly on the target device: a
  round trip through disk would write tens of GB, and random init on a GPU takes seconds.
"""

from __future__ import annotations

import logging
import string
import struct
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLWan,
    DiffusionPipeline,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    ModelMixin,
    PNDMScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
    UniPCMultistepScheduler,
    WanPipeline,
    WanTransformer3DModel,
)
from tokenizers import pre_tokenizers
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    PreTrainedModel,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
    UMT5Config,
    UMT5EncoderModel,
)

__all__ = ["PIPELINE_KINDS", "PROMPT", "SCALES", "build_pipeline", "call_kwargs", "pipeline_output"]

from ..checkpoints import DATA_ALIGNMENT
from .architectures import ARCHITECTURES

logger = logging.getLogger(__name__)

PIPELINE_KINDS = ("flux", "sdxl", "sd3", "sd15", "wan")
SCALES = ("tiny", "full")

PROMPT = "a photograph of an astronaut riding a horse on the moon, highly detailed"

# --------------------------------------------------------------------------------------------
# Tokenizers. The real tokenizer classes, with vocabularies small enough to write in code: the
# pipelines' own padding, truncation and overflow-decoding code runs unchanged, and the
# tokenizers save and load like downloaded ones.
# --------------------------------------------------------------------------------------------


def _clip_tokenizer() -> CLIPTokenizer:
    """CLIP's byte-level BPE with the 256 byte symbols as vocabulary and no merges.

    Without merges every word splits into characters, so no vocabulary has to be learned. The
    special tokens come last, as in CLIP's own vocabulary.
    """
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    symbols = alphabet + [symbol + "</w>" for symbol in alphabet]  # "</w>" ends a word
    symbols += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {symbol: token_id for token_id, symbol in enumerate(symbols)}
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def _t5_tokenizer() -> T5Tokenizer:
    """T5's Unigram tokenizer over single printable ASCII characters; serves UMT5 as well.

    Pad, end-of-sequence and unknown take ids 0, 1 and 2, the ids T5 and UMT5 configs assume.
    No sentinel (``<extra_id_*>``) tokens: nothing here does span corruption.
    """
    specials = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    characters = "▁" + string.digits + string.ascii_letters + string.punctuation  # "▁" = space
    return T5Tokenizer(
        vocab=specials + [(character, -1.0) for character in characters],
        extra_ids=0,
        model_max_length=512,
    )


def _clip_text_encoder(
    model_cls: type[CLIPTextModel | CLIPTextModelWithProjection],
    architecture: Mapping[str, Any],
    tokenizer: CLIPTokenizer,
) -> Callable[[], torch.nn.Module]:
    """A factory for a CLIP text tower whose special-token ids are the tokenizer's.

    CLIP's pooled output is read at the end-of-text token, found by its id, so the ids must agree.
    """
    config = CLIPTextConfig(
        **architecture,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_position_embeddings=tokenizer.model_max_length,
    )
    return lambda: model_cls(config)


# --------------------------------------------------------------------------------------------
# Pipelines: what each is made of, and how it is called.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Parts:
    """A pipeline's constructor arguments, grouped by how they are made."""

    # Modules with random weights; each factory is called under a fresh seed. The denoiser comes
    # first: it is the largest, and its transient float32 copy then adds to nothing else.
    modules: dict[str, Callable[[], torch.nn.Module]]
    # Tokenizers and the scheduler: no weights, nothing random.
    components: dict[str, Any]
    # Constructor flags that save_pretrained does not record, so loading must pass them again.
    options: dict[str, Any] = field(default_factory=dict)


def _flux_parts(architecture: Mapping[str, dict[str, Any]]) -> _Parts:
    tokenizer = _clip_tokenizer()
    return _Parts(
        modules={
            "transformer": lambda: FluxTransformer2DModel(**architecture["flux_transformer"]),
            "text_encoder": _clip_text_encoder(CLIPTextModel, architecture["clip_l"], tokenizer),
            "text_encoder_2": lambda: T5EncoderModel(T5Config(**architecture["t5"])),
            "vae": lambda: AutoencoderKL(**architecture["flux_vae"]),
        },
        components={
            "tokenizer": tokenizer,
            "tokenizer_2": _t5_tokenizer(),
            "scheduler": FlowMatchEulerDiscreteScheduler(
                shift=3.0,
                use_dynamic_shifting=True,
                base_shift=0.5,
                max_shift=1.15,
                base_image_seq_len=256,
                max_image_seq_len=4096,
            ),
        },
    )


def _sdxl_parts(architecture: Mapping[str, dict[str, Any]]) -> _Parts:
    tokenizer = _clip_tokenizer()
    return _Parts(
        modules={
            "unet": lambda: UNet2DConditionModel(**architecture["sdxl_unet"]),
            "text_encoder": _clip_text_encoder(CLIPTextModel, architecture["clip_l"], tokenizer),
            "text_encoder_2": _clip_text_encoder(CLIPTextModelWithProjection, architecture["clip_g"], tokenizer),
            "vae": lambda: AutoencoderKL(**architecture["sdxl_vae"]),
        },
        components={
            "tokenizer": tokenizer,
            "tokenizer_2": _clip_tokenizer(),
            "scheduler": EulerDiscreteScheduler(
                beta_start=0.00085,
                beta_end=0.012,
                beta_schedule="scaled_linear",
                steps_offset=1,
                timestep_spacing="leading",
            ),
        },
        # Left unset, the watermark depends on whether invisible-watermark is installed.
        options={"add_watermarker": False},
    )


def _sd3_parts(architecture: Mapping[str, dict[str, Any]]) -> _Parts:
    tokenizer = _clip_tokenizer()
    return _Parts(
        modules={
            "transformer": lambda: SD3Transformer2DModel(**architecture["sd3_transformer"]),
            "text_encoder": _clip_text_encoder(CLIPTextModelWithProjection, architecture["clip_l"], tokenizer),
            "text_encoder_2": _clip_text_encoder(CLIPTextModelWithProjection, architecture["clip_g"], tokenizer),
            "text_encoder_3": lambda: T5EncoderModel(T5Config(**architecture["t5"])),
            "vae": lambda: AutoencoderKL(**architecture["sd3_vae"]),
        },
        components={
            "tokenizer": tokenizer,
            "tokenizer_2": _clip_tokenizer(),
            "tokenizer_3": _t5_tokenizer(),
            "scheduler": FlowMatchEulerDiscreteScheduler(shift=3.0),
        },
    )


def _sd15_parts(architecture: Mapping[str, dict[str, Any]]) -> _Parts:
    tokenizer = _clip_tokenizer()
    return _Parts(
        modules={
            "unet": lambda: UNet2DConditionModel(**architecture["sd15_unet"]),
            "text_encoder": _clip_text_encoder(CLIPTextModel, architecture["clip_l"], tokenizer),
            "vae": lambda: AutoencoderKL(**architecture["sd15_vae"]),
        },
        components={
            "tokenizer": tokenizer,
            # The scheduler stable-diffusion-v1-5 ships with.
            "scheduler": PNDMScheduler(
                beta_start=0.00085,
                beta_end=0.012,
                beta_schedule="scaled_linear",
                skip_prk_steps=True,
                set_alpha_to_one=False,
                steps_offset=1,
            ),
            # Left out, as pipelines are mostly loaded (safety_checker=None): the published one
            # adds a CLIP vision tower (0.6 GB in float16) that diffusers keeps on the device.
            "safety_checker": None,
            "feature_extractor": None,
        },
        options={"requires_safety_checker": False},
    )


def _wan_parts(architecture: Mapping[str, dict[str, Any]]) -> _Parts:
    return _Parts(
        modules={
            "transformer": lambda: WanTransformer3DModel(**architecture["wan_transformer"]),
            "text_encoder": lambda: UMT5EncoderModel(UMT5Config(**architecture["umt5"])),
            "vae": lambda: AutoencoderKLWan(**architecture["wan_vae"]),
        },
        components={
            "tokenizer": _t5_tokenizer(),
            # The scheduler Wan 2.1 T2V ships with; flow_shift 3.0 is its 480p setting.
            "scheduler": UniPCMultistepScheduler(
                prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
            ),
        },
    )


@dataclass(frozen=True)
class _Kind:
    """One pipeline kind: how to build it and how it is usually called."""

    pipeline_cls: type[DiffusionPipeline]
    parts: Callable[[Mapping[str, dict[str, Any]]], _Parts]
    guidance_scale: float
    # Per scale: (height, width) and the call arguments that only this pipeline takes.
    size: Mapping[str, tuple[int, int]]
    extra_call_kwargs: Mapping[str, Mapping[str, Any]]


# Tiny pipelines encode a short prompt: T5 compute grows with the sequence length.
_TINY_SEQUENCE = {"max_sequence_length": 16}

_KINDS: dict[str, _Kind] = {
    "flux": _Kind(
        FluxPipeline,
        _flux_parts,
        guidance_scale=3.5,
        size={"tiny": (32, 32), "full": (1024, 1024)},
        extra_call_kwargs={"tiny": _TINY_SEQUENCE, "full": {}},
    ),
    "sdxl": _Kind(
        StableDiffusionXLPipeline,
        _sdxl_parts,
        guidance_scale=5.0,
        size={"tiny": (32, 32), "full": (1024, 1024)},
        extra_call_kwargs={"tiny": {}, "full": {}},
    ),
    "sd3": _Kind(
        StableDiffusion3Pipeline,
        _sd3_parts,
        guidance_scale=7.0,
        size={"tiny": (32, 32), "full": (1024, 1024)},
        extra_call_kwargs={"tiny": _TINY_SEQUENCE, "full": {}},
    ),
    "sd15": _Kind(
        StableDiffusionPipeline,
        _sd15_parts,
        guidance_scale=7.5,
        size={"tiny": (32, 32), "full": (512, 512)},
        extra_call_kwargs={"tiny": {}, "full": {}},
    ),
    "wan": _Kind(
        WanPipeline,
        _wan_parts,
        guidance_scale=5.0,
        size={"tiny": (32, 32), "full": (480, 832)},
        # Wan needs 4k + 1 frames: its VAE compresses time by 4 after the first frame.
        extra_call_kwargs={"tiny": {**_TINY_SEQUENCE, "num_frames": 5}, "full": {"num_frames": 33}},
    ),
}

_DEFAULT_STEPS = {"tiny": 2, "full": 10}


def _kind(kind: str, scale: str) -> _Kind:
    if kind not in _KINDS:
        raise ValueError(f"unknown pipeline kind {kind!r}; expected one of {PIPELINE_KINDS}")
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; expected one of {SCALES}")
    return _KINDS[kind]


# --------------------------------------------------------------------------------------------
# Building.
# --------------------------------------------------------------------------------------------


def build_pipeline(
    kind: str,
    scale: str = "tiny",
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> DiffusionPipeline:
    """Build a ``kind`` pipeline (see ``PIPELINE_KINDS``) with random weights, in eval mode.

    The same arguments give the same weights, so two builds produce bitwise-equal outputs.
    ``scale="tiny"`` is saved and reloaded with ``from_pretrained(dtype=dtype)`` and then
    moved to ``device``; on the CPU its weights may stay memory-mapped from the saved files,
    which therefore live as long as the pipeline. ``scale="full"`` is built on ``device``
    directly (``device="meta"`` builds the structure only, without allocating weights). The
    denoising progress bar is disabled: it would only add noise to test and benchmark output.
    """
    spec = _kind(kind, scale)
    build = _save_and_reload if scale == "tiny" else _build_on_device
    pipe = build(spec.pipeline_cls, spec.parts(ARCHITECTURES[scale]), seed=seed, dtype=dtype, device=device)
    pipe.set_progress_bar_config(disable=True)
    logger.info("built %s %s pipeline (%s, %s, seed %d)", scale, kind, dtype, device, seed)
    return pipe


def _seeded_modules(
    factories: Mapping[str, Callable[[], torch.nn.Module]],
    *,
    seed: int,
    device: str | torch.device,
    dtype: torch.dtype,
) -> dict[str, torch.nn.Module]:
    """Call each factory on ``device`` after re-seeding; cast the result to ``dtype``, eval it.

    Re-seeding makes a module's weights depend only on the seed and its own config, not on what
    was built before it. Constructing under ``torch.device(device)`` allocates and initialises
    the weights there: a full-size model never has a float32 copy in host memory (on the device
    it briefly exists in float32, until the cast).
    """
    modules = {}
    for name, factory in factories.items():
        torch.manual_seed(seed)
        with torch.device(device):
            module = factory().eval()  # as from_pretrained returns them: no dropout
        _cast_as_loaded(module, dtype)
        modules[name] = module
    return modules


def _cast_as_loaded(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast ``model`` in place to ``dtype`` the way ``from_pretrained(dtype=dtype)`` would.

    The loaders keep some precision-sensitive parts in float32 (Wan's norms and time embedding
    always, T5's ``wo`` in float16), so a loaded pipeline holds mixed dtypes. A plain
    ``.to(dtype)`` would hide that from the benchmark, and diffusers warns about it.
    """
    keep_float32 = _float32_names(model, dtype)
    for module_name, module in model.named_modules():
        path = set(module_name.split("."))
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            target = torch.float32 if keep_float32 & (path | {name}) else dtype
            if not tensor.is_floating_point() or tensor.dtype == target:
                continue
            if isinstance(tensor, torch.nn.Parameter):
                tensor.data = tensor.data.to(target)
            else:
                setattr(module, name, tensor.to(target))  # keeps the buffer's persistence


def _float32_names(model: torch.nn.Module, dtype: torch.dtype) -> set[str]:
    """Module or parameter names that ``model``'s loader keeps in float32 when asked for ``dtype``."""
    if isinstance(model, ModelMixin):  # diffusers: whatever the dtype
        return set(model._keep_in_fp32_modules or ())
    if isinstance(model, PreTrainedModel):  # transformers: "strict" ones for 16-bit, others for fp16
        names: set[str] = set()
        if dtype in (torch.float16, torch.bfloat16):
            names |= set(model._keep_in_fp32_modules_strict or ())
        if dtype == torch.float16:
            names |= set(model._keep_in_fp32_modules or ())
        return names
    return set()


def _build_on_device(
    pipeline_cls: type[DiffusionPipeline],
    parts: _Parts,
    *,
    seed: int,
    dtype: torch.dtype,
    device: str | torch.device,
) -> DiffusionPipeline:
    """Construct the pipeline from freshly built modules, with no disk round trip."""
    modules = _seeded_modules(parts.modules, seed=seed, device=device, dtype=dtype)
    return pipeline_cls(**modules, **parts.components, **parts.options)


def _save_and_reload(
    pipeline_cls: type[DiffusionPipeline],
    parts: _Parts,
    *,
    seed: int,
    dtype: torch.dtype,
    device: str | torch.device,
) -> DiffusionPipeline:
    """Build the pipeline in float32 on the CPU, save it, load it back in ``dtype``, move it.

    Loading is what users do, so the pipeline gets what the loaders give: dtypes as
    ``from_pretrained`` sets them, tokenizers and scheduler read back from files.
    """
    original = _build_on_device(pipeline_cls, parts, seed=seed, dtype=torch.float32, device="cpu")
    directory = tempfile.TemporaryDirectory(prefix="diffusers_residency_")
    original.save_pretrained(directory.name)
    for path in Path(directory.name).rglob("*.safetensors"):
        _align_tensor_data(path)
    pipe = pipeline_cls.from_pretrained(directory.name, dtype=dtype, **parts.options)
    # The loaders memory-map the safetensors files, and weights loaded without a dtype change
    # stay backed by them, as from the hub cache. So the files must outlive the pipeline's use:
    # the directory is tied to the pipeline, and removed when the pipeline is garbage-collected.
    pipe._builder_checkpoint_dir = directory
    return pipe.to(device)


def _align_tensor_data(path: Path) -> None:
    """Pad a safetensors file's header (with spaces, as its format allows) so that its tensor data
    starts where the package's own checkpoints' does (see checkpoints.write_checkpoint). A weight
    memory-mapped from it is then aligned as far as its offset in the data allows, whatever length
    the writer gave the header: the CPU's kernels can round differently with their operands'
    alignment, and a pipeline must compute as its copies do. (Tensors follow each other without
    gaps, so a weight after one of an odd size stays as unaligned as its offset.)"""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    padding = -(8 + length) % DATA_ALIGNMENT
    if padding:
        header = raw[8 : 8 + length] + b" " * padding
        path.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + length :])


# --------------------------------------------------------------------------------------------
# Calling.
# --------------------------------------------------------------------------------------------


def call_kwargs(
    kind: str,
    scale: str = "tiny",
    *,
    seed: int = 0,
    steps: int | None = None,
    height: int | None = None,
    width: int | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``pipe(**kwargs)`` of a ``build_pipeline(kind, scale)`` pipeline.

    Deterministic: a fixed prompt and a fresh CPU generator seeded with ``seed`` (a generator is
    consumed by a call, so ask for new kwargs for every call). ``output_type="pt"`` makes the
    VAE decode the latents, so every model component runs. ``steps``, ``height`` and ``width``
    override the defaults for the scale.
    """
    spec = _kind(kind, scale)
    default_height, default_width = spec.size[scale]
    return {
        "prompt": PROMPT,
        "num_inference_steps": _DEFAULT_STEPS[scale] if steps is None else steps,
        "height": default_height if height is None else height,
        "width": default_width if width is None else width,
        "guidance_scale": spec.guidance_scale,
        "output_type": "pt",
        "generator": torch.Generator("cpu").manual_seed(seed),
        **spec.extra_call_kwargs[scale],
    }


def pipeline_output(pipe: DiffusionPipeline, kwargs: Mapping[str, Any]) -> torch.Tensor:
    """Run ``pipe(**kwargs)`` without autograd and return its images (or video frames) on the CPU.

    The result is a copy made outside inference mode, so callers may keep and compare it freely.
    """
    with torch.inference_mode():
        # return_dict=False gives a tuple whose first item is the images, or Wan's frames.
        output = pipe(**kwargs, return_dict=False)[0]
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"expected a tensor from the pipeline, got {type(output).__name__}; pass output_type='pt'")
    return output.to("cpu", copy=True)
