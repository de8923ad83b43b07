"""Estimating what a component needs above its weights before it runs: a dry run of the call on the
meta device, where every tensor has a shape and a dtype but no memory, counting the bytes of the
tensors alive at once.

What a call needs depends on its shape (an SDXL VAE decoding at 1024x1024 needs four times what it
needs at 512x512), so an estimate has to be made for the call being made: from the component's own
inputs where its hook sees them (a denoiser's forward), or from the call's arguments where it does
not (``vae.decode`` runs its hook without them, see ``hooks.StagingHook``). A dry run counts what the
tensors of the call take; the device's allocator takes more (its caching, convolutions' workspaces),
and :data:`ALLOCATOR_FACTOR` stands for that. The first call of each shape still measures every
component, and the plan is made again from what it measured (see ``adaptive``).
"""

from __future__ import annotations

import logging
import numbers
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import DiffusionPipeline
from diffusers.configuration_utils import ConfigMixin
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from .call_shapes import IMAGE_ARGUMENTS, OUTPUT_SIZE_ARGUMENTS, call_signature, output_size_defaults
from .default_call import denoiser_inputs, is_encoder
from .diffusers_hooks import compute_dtypes
from .live_bytes import LiveBytes
from .replayed_blocks import BlockInputs, block_layouts, replaying_repeats, signature
from .weights import module_tensors

logger = logging.getLogger(__name__)

# What the device's allocator held above the weights (its reserved peak) over the bytes of live
# tensors a dry run counted, for the same component and call shape, at 1024x1024 on the H200
# (docs/measurements.md): 1.89 and 1.85 for FLUX.1-dev's and SDXL's VAEs run alone, 1.99 for the
# former in a measuring call, 1.56 for FLUX.1-dev's transformer there (1.24 to 1.32 alone). The
# allocator's rounding and cache, and what kernels take for themselves (a convolution's workspace)
# without a tensor to show for it. The decoders set it: short of room, they would decode again
# with the rest of the pipeline off the device (see dry_run_plans.make_room_to_retry), a first call
# slower by a decode and the reloads after it.
ALLOCATOR_FACTOR = 2.0


class _FusedAttention(TorchFunctionMode):
    """``scaled_dot_product_attention`` as the device's fused kernels run it: its output and no
    more. On the meta device it would take the math path, whose attention matrix (24 heads of
    4608 x 4608 for FLUX.1-dev at 1024x1024, 1 GB) the device never holds."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            query = args[0] if args else kwargs["query"]
            value = args[2] if len(args) > 2 else kwargs["value"]
            return query.new_empty((*query.shape[:-1], value.shape[-1]))
        return func(*args, **kwargs)


# How peft lays out a layer it adapts: the layer as ``base_layer`` beside the adapter's own
# weights (``lora_A.<adapter name>.weight``, ...). DoRA's magnitude vector marks an adapter whose
# forward makes matrices the size of the layer's weights, at every layer: no copy without it
# stands for what that needs.
_ADAPTED_LAYER = "base_layer"
_ADAPTER_PREFIX = "lora_"
_WEIGHT_SIZED_ADAPTER = "lora_magnitude_vector"


def meta_twin(module: nn.Module) -> nn.Module | None:
    """A copy of ``module`` on the meta device, built from its config, with its tensors' shapes and
    dtypes and none of its memory or hooks; None for a module that cannot be built so (no config,
    tensors laid out otherwise than its config builds them, a DoRA adapter).

    Layers that diffusers' layerwise casting stores in a small dtype are copied in the dtype they
    compute in: the meta device has no kernels for float8 matrices, and what a layer's forward
    makes is what it makes in that dtype. A quantized module is copied as the plain model its
    config builds, in float32 (to be cast as its inputs are, see :class:`ForwardDryRun`), for the
    same reason. Either way each such layer of the copy holds a copy of its weights while it runs
    (see :func:`_holding_a_weight_copy`). Layers peft adapts (a LoRA) are copied as the layer they
    adapt, without the adapter: what it adds to their forward, a product of its rank and a sum the
    size of their output, is left to :data:`ALLOCATOR_FACTOR`."""
    config = getattr(module, "config", None)
    if config is None:
        return None
    try:
        with torch.device("meta"):
            # diffusers' models are built from their config by from_config, transformers' by __init__.
            twin = type(module).from_config(config) if isinstance(module, ConfigMixin) else type(module)(config)
        if holds_quantized(module):
            _holding_a_weight_copy(twin, _quantized_layers(module))
            return twin.float().eval()
        cast = compute_dtypes(module)
        shapes = {}
        for name, tensor in module.state_dict().items():
            parts = name.split(".")
            if _WEIGHT_SIZED_ADAPTER in parts:
                return None
            if not any(part.startswith(_ADAPTER_PREFIX) for part in parts):
                dtype = cast.get(name.rpartition(".")[0], tensor.dtype)
                shapes[_unadapted(name)] = torch.empty_like(tensor, device="meta", dtype=dtype)
        twin.load_state_dict(shapes, strict=True, assign=True)
        _holding_a_weight_copy(twin, cast)
    except Exception as error:  # any failure means no estimate, never a failed call
        logger.debug("No dry run of %s: %s", type(module).__name__, error)
        return None
    return twin.eval()


def _unadapted(name: str) -> str:
    """The name of a tensor or layer of an adapted model in the model without adapters."""
    return ".".join(part for part in name.split(".") if part != _ADAPTED_LAYER)


def _quantized_layers(module: nn.Module) -> list[str]:
    """The layers of ``module`` whose own weights are quantized, by name."""
    return [name for name, sub in module.named_modules() if holds_quantized(sub, recurse=False)]


def _holding_a_weight_copy(twin: nn.Module, names: Iterable[str]) -> None:
    """Make each layer of ``twin`` named in ``names`` (names of the module it copies) hold a copy
    of its own weights while it runs: the one in the compute dtype that layerwise casting makes,
    or the dequantized one a quantized layer makes, which the device holds beside the stored
    weights for as long as the layer runs: at small sizes, much of a step's need."""
    layers = dict(twin.named_modules())
    for name in names:
        layer = layers.get(_unadapted(name))
        if layer is not None:
            layer.register_forward_pre_hook(_take_weight_copy)
            layer.register_forward_hook(_drop_weight_copy)


def _take_weight_copy(layer: nn.Module, args: tuple) -> None:
    layer.dry_run_weight_copies = [tensor.clone() for tensor in layer.parameters(recurse=False)]


def _drop_weight_copy(layer: nn.Module, args: tuple, output: Any) -> None:
    del layer.dry_run_weight_copies


def holds_quantized(module: nn.Module, recurse: bool = True) -> bool:
    """Whether ``module`` (its own tensors only, without ``recurse``) holds tensors of a
    quantization library (torchao's, optimum-quanto's, GGUF's, bitsandbytes' parameters:
    subclasses of ``torch.Tensor``)."""
    plain = (torch.Tensor, nn.Parameter)
    tensors = (*module.parameters(recurse=recurse), *module.buffers(recurse=recurse))
    return any(type(tensor) not in plain for tensor in tensors)


# Each twin's weights, listed once (a walk of every submodule, 5 ms for SDXL's UNet) rather than in
# each dry run, and again once cast (see _cast), which makes its buffers anew.
_WEIGHTS: weakref.WeakKeyDictionary[nn.Module, tuple[torch.Tensor, ...]] = weakref.WeakKeyDictionary()


def _weights(twin: nn.Module) -> tuple[torch.Tensor, ...]:
    weights = _WEIGHTS.get(twin)
    if weights is None:
        weights = _WEIGHTS[twin] = (*twin.parameters(), *twin.buffers())
    return weights


def dry_run_need(
    twin: nn.Module,
    run: Callable[[nn.Module], Any],
    inputs: Sequence[torch.Tensor] = (),
    record: BlockInputs | None = None,
) -> int | None:
    """What ``run(twin)`` would need on the device above its weights, ``inputs`` (meta tensors
    it reads, already on the device in a real call) counted: the most bytes of tensors alive at
    once, times :data:`ALLOCATOR_FACTOR`. None where the dry run fails (code that reads values, which
    meta tensors do not have). ``record``: told what its repeated blocks were given."""
    undo = None
    try:
        counter = LiveBytes([*_weights(twin), *inputs])
        counter.live = counter.peak = sum(tensor.untyped_storage().nbytes() for tensor in inputs)
        undo = replaying_repeats(twin, counter, record)
        with torch.no_grad(), _FusedAttention(), counter:
            run(twin)
    except Exception as error:  # any failure means no estimate, never a failed call
        logger.debug("The dry run of %s failed: %s", type(twin).__name__, error)
        return None
    finally:
        if undo is not None:
            undo()
    return int(counter.peak * ALLOCATOR_FACTOR)


def _on_meta(args: tuple, kwargs: Mapping[str, Any]) -> tuple[tuple, dict, list[torch.Tensor]]:
    """``args`` and ``kwargs`` with each tensor replaced by an empty one of its shape and dtype on
    the meta device, and those tensors."""
    tensors: list[torch.Tensor] = []

    def to_meta(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(torch.empty_like(value, device="meta"))
            return tensors[-1]
        return value

    return tree_map(to_meta, args), tree_map(to_meta, dict(kwargs)), tensors


# diffusers' VAEs blend a decoded tile into its neighbours with a Python loop of small operations
# over each row or column of the overlap, hundreds a tile: dispatched in a dry run, seconds for a
# large tiled decode. They make only row-sized temporaries, which the estimate can do without: the
# twin keeps the tile as it is.
TILE_BLENDS = ("blend_v", "blend_h", "blend_t")


def _blended_as_is(a: torch.Tensor, b: torch.Tensor, blend_extent: int) -> torch.Tensor:
    return b


class DecoderDryRun:
    """The need of a pipeline's latent decoder (``vae.decode``) in a call, estimated from the call's
    size: its latents are ``batch x latent_channels x height/f x width/f`` for the pipelines that
    make images from text (FLUX, SDXL, SD3, Qwen-Image...), with ``f`` the pipeline's
    ``vae_scale_factor`` and the size its default where not given. ``dtype``: the one it decodes in
    (SDXL casts a float16 VAE to float32 to decode); ``cast_whole``: whether the pipeline casts the
    whole VAE to it, rather than each layer as it runs (layerwise casting)."""

    def __init__(
        self,
        name: str,
        module: nn.Module,
        scale_factor: int,
        default_size: int,
        dtype: torch.dtype,
        *,
        cast_whole: bool = False,
    ) -> None:
        self.name = name
        self._module = module
        self.latent_channels: int = module.config.latent_channels
        self.scale_factor = scale_factor
        self.default_size = default_size
        self.dtype = dtype
        # The pipeline's output size arguments as its call's defaults have them (PixArt's binning
        # on, FLUX Kontext's max_area of 1024²), where the default call told the size they make
        # (see CallDryRuns.of): a call leaving them so at that size is the default call, whose
        # decode is of that size. Empty, a call given any of them is not followed.
        self.default_outputs: dict[str, Any] = {}
        # Cast whole, the VAE holds its weights wider while it decodes than the plan counts them (as
        # stored): room the decode takes above the planned weights, which a measured call's need
        # has in it (read once the VAE is cast back, off the device). Counted for all of them, as
        # a VAE staged whole holds them; a streamed one holds its trunk and a window of blocks.
        # (SDXL's VAE, 167 MB more in float32: planned without them at 1024x1024 under an 8 GB
        # cap, its first decode made the allocator retry.)
        self._widened = _widened_bytes(module, dtype) if cast_whole else 0
        self._twin = meta_twin(module)
        # What the dry run of the default decode (``need({})``, made at enable) gave the repeated
        # blocks: the order a decode runs them in (see ``streaming.BlockStream.expect_order``).
        self.default_blocks = BlockInputs()
        if self._twin is not None:
            _cast(self._twin, dtype)
            for blend in TILE_BLENDS:
                if callable(getattr(self._twin, blend, None)):
                    setattr(self._twin, blend, _blended_as_is)
            block_layouts(self._twin)
            _weights(self._twin)
        self._needs: dict[tuple, int | None] = {}

    @classmethod
    def of(
        cls, pipe: object, casts: Mapping[str, tuple[torch.dtype, ...]], denoiser: nn.Module
    ) -> DecoderDryRun | None:
        """The decoder of ``pipe``, or None where its latents' shape cannot be told from a call's
        size (no ``vae_scale_factor`` or default size). One whose latents have more dimensions
        (a video's, Qwen-Image's) fails its dry run: no estimate."""
        vae = getattr(pipe, "vae", None)
        factor = getattr(pipe, "vae_scale_factor", None)
        default = getattr(pipe, "default_sample_size", None)
        if default is None:
            # Pipelines without one (SD 1.5's, CogView4's) default to their denoiser's sample size.
            default = getattr(getattr(denoiser, "config", None), "sample_size", None)
        channels = getattr(getattr(vae, "config", None), "latent_channels", None)
        if not isinstance(vae, nn.Module) or not callable(getattr(vae, "decode", None)):
            return None
        if not all(isinstance(value, int) for value in (factor, default, channels)):
            return None
        dtype = casts.get("vae", (_computes_in(vae),))[0]
        if dtype is None:
            return None
        return cls("vae", vae, factor, default * factor, dtype, cast_whole="vae" in casts)

    def need(self, parts: Mapping[str, Any]) -> int | None:
        """The estimate for a call whose shape signature has ``parts`` (see ``call_shapes.shape_parts``);
        None for calls this does not follow (images or latents given, frames, sizes it cannot read)."""
        # A call given an image, a video or latents runs what this does not follow (``vae.encode``,
        # a ControlNet), or decodes latents of another size.
        if "num_frames" in parts or any(parts.get(name) is not None for name in IMAGE_ARGUMENTS):
            return None
        height, width = (parts.get(name) for name in ("height", "width"))
        if any(parts.get(name) for name in OUTPUT_SIZE_ARGUMENTS) and not (
            height == width == self.default_size
            and all(parts.get(name) == self.default_outputs.get(name) for name in OUTPUT_SIZE_ARGUMENTS)
        ):
            return None  # the output's size is not height x width (FLUX Kontext's max_area, binning)
        if not height or not width:
            # Pipelines fill in a side not given differently: SD 1.5's takes its default for both,
            # FLUX's, SDXL's, SD3's and CogView4's for the missing one only. The larger of the
            # default and the side given covers either (a side given that is no int: checked below).
            height = width = max([self.default_size, *(side for side in (height, width) if side)])
        batch = parts.get("batch") or 1
        per_prompt = parts.get("num_images_per_prompt") or 1
        if not all(isinstance(value, int) and value > 0 for value in (height, width, batch, per_prompt)):
            return None
        shape = (batch * per_prompt, self.latent_channels, height // self.scale_factor, width // self.scale_factor)
        settings = _decode_settings(self._module)
        key = (shape, *((name, tuple(value) if isinstance(value, list) else value) for name, value in settings.items()))
        if key not in self._needs and self._twin is not None:
            vars(self._twin).update(settings)
            latents = torch.empty(shape, dtype=self.dtype, device="meta")
            decode = lambda twin: twin.decode(latents, return_dict=False)  # noqa: E731
            record = self.default_blocks if not parts and not self.default_blocks.keys else None
            self._needs[key] = dry_run_need(self._twin, decode, [latents], record)
        need = self._needs.get(key)
        return None if need is None else need + self._widened


def _widened_bytes(module: nn.Module, dtype: torch.dtype) -> int:
    """The bytes ``module``'s floating-point tensors narrower than ``dtype`` gain cast to it."""
    return sum(
        tensor.numel() * (dtype.itemsize - tensor.element_size())
        for tensor in module_tensors((module,))
        if tensor.is_floating_point() and tensor.element_size() < dtype.itemsize
    )


def _computes_in(module: nn.Module) -> torch.dtype | None:
    """The dtype ``module`` computes in: the one layerwise casting casts its layers to, else its
    first floating-point tensor's (a quantized module's packed bytes are not)."""
    cast = compute_dtypes(module)
    if cast:
        return next(iter(cast.values()))
    return next((tensor.dtype for tensor in module.parameters() if tensor.is_floating_point()), None)


def _cast(twin: nn.Module, dtype: torch.dtype) -> None:
    """Cast a meta twin's floating-point tensors to ``dtype``. Not through diffusers'
    ``ModelMixin.to``, which logs a warning about modules to keep in float32 at every dtype cast,
    even where a model has none: every enable under a budget would print it."""
    nn.Module.to(twin, dtype)
    _WEIGHTS.pop(twin, None)


def _decode_settings(vae: nn.Module) -> dict[str, Any]:
    """How ``vae`` decodes as set on it since it was built, which its twin (built from the config)
    does not have: diffusers' VAEs keep their tiling and slicing (``enable_tiling()``, a tile size
    set by hand) in attributes named ``use_*`` and ``tile_*``, flags and sizes (a number, or one per
    side). A tiled decode of a large image needs a fraction of a whole one, a sliced batch one image's."""
    return {
        name: value for name, value in vars(vae).items() if name.startswith(("use_", "tile_")) and _is_setting(value)
    }


def _is_setting(value: Any) -> bool:
    values = value if isinstance(value, (tuple, list)) else (value,)
    return all(isinstance(item, numbers.Number) for item in values)


class ForwardDryRun:
    """The need of a component's forward for the inputs its hook was given (a denoiser's step),
    remembered per inputs' :func:`~.replayed_blocks.signature`."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self._twin = meta_twin(module)
        # A quantized module's copy computes in the dtype of the inputs it is given (see meta_twin).
        self._cast_as_inputs = self._twin is not None and holds_quantized(module)
        if self._twin is not None:
            block_layouts(self._twin)
            _weights(self._twin)
        self._needs: dict[tuple, int | None] = {}
        # The default call's inputs' signature, and what its dry run gave each repeated block (see
        # need_at_defaults).
        self._default: tuple | None = None
        self.default_blocks = BlockInputs(trunk={})
        # The (height, width) of the default call's output, as its code told them, and what it first
        # gave each encoder it ran before this one (see default_call).
        self.default_size: tuple[int, int] | None = None
        self.default_encoder_inputs: dict[str, tuple[tuple, dict]] = {}
        self.default_encoder_blocks: dict[str, BlockInputs] = {}

    def need(self, args: tuple, kwargs: Mapping[str, Any], record: BlockInputs | None = None) -> int | None:
        """``record``: told what the repeated blocks were given, where the dry run is made now."""
        if self._twin is None:
            return None
        try:
            key = signature(args, kwargs)
            if key in self._needs:
                return self._needs[key]
            meta_args, meta_kwargs, inputs = _on_meta(args, kwargs)
        except Exception as error:  # an input tensor with no meta counterpart: no estimate
            logger.debug("No dry run of %s's inputs: %s", type(self._twin).__name__, error)
            return None
        dtype = next((tensor.dtype for tensor in inputs if tensor.is_floating_point()), None)
        if self._cast_as_inputs and dtype is not None:
            _cast(self._twin, dtype)
        self._needs[key] = dry_run_need(self._twin, lambda twin: twin(*meta_args, **meta_kwargs), inputs, record)
        return self._needs[key]

    def gets_default_inputs(self, args: tuple, kwargs: Mapping[str, Any]) -> bool:
        """Whether inputs of ``args`` and ``kwargs``'s signature are those of the default call."""
        return self._default is not None and signature(args, kwargs) == self._default

    def need_at_defaults(self, pipe: DiffusionPipeline, name: str) -> int | None:
        """The need of the forward in a call of ``pipe``'s default shape, made now from the inputs
        its call makes on meta copies of its components (see ``default_call``), so that a first
        call of that shape finds it made, and what its repeated blocks were given
        (:attr:`default_blocks`, see ``block_timing``). None where that call cannot run on the meta
        device."""
        if self._twin is None:
            return None
        twins, undos, encoder_blocks = {name: self._twin}, [], {}
        try:
            for component, module in pipe.components.items():
                if isinstance(module, nn.Module) and module is not self._module:
                    twin = twins[component] = meta_twin(module)
                    if twin is None:
                        return None
                    if holds_quantized(module) and (dtype := _computes_in(module)) is not None:
                        # Built in float32 (see meta_twin): what it makes, the denoiser's inputs,
                        # comes in the dtype it computes in.
                        _cast(twin, dtype)
                    # Only the shapes of what they make count here: each repeated block runs once
                    # (a text encoder's, 24 of T5-XXL's; the denoiser's is never reached). An
                    # encoder's blocks and trunk are told what they are given, for a streamed one's
                    # kernels run at enable (see block_timing.warm_encoders).
                    if is_encoder(module):
                        encoder_blocks[component] = BlockInputs(trunk={})
                    undos.append(replaying_repeats(twin, LiveBytes(()), encoder_blocks.get(component)))
            call = denoiser_inputs(pipe, twins, name)
        finally:
            for undo in undos:
                undo()  # the blocks' forwards refer to the blocks: freed with their twins, not by a collection
        if call is None:
            return None
        self._default, self.default_size = signature(call.args, call.kwargs), call.size
        self.default_encoder_inputs = call.encoder_inputs
        self.default_encoder_blocks = {name: blocks for name, blocks in encoder_blocks.items() if blocks.keys}
        return self.need(call.args, call.kwargs, record=self.default_blocks)


def _output_size_defaults(pipe: object) -> dict[str, Any]:
    try:
        return output_size_defaults(call_signature(type(pipe)))
    except (TypeError, ValueError):  # no signature to read: no argument at a default
        return {}


@dataclass(frozen=True)
class CallDryRuns:
    """The dry runs that estimate a text-to-image call's needs before they are measured: its
    ``denoiser`` (the component before the decoder in the offload sequence), from its inputs as its
    first step starts, and its decoder, from the call's size as the call starts. Components before
    the denoiser (text encoders) have run and been measured by then."""

    denoiser: str
    forward: ForwardDryRun
    decoder: DecoderDryRun
    # The denoiser's need in a call of the pipeline's default shape (see ForwardDryRun.need_at_defaults).
    default_step_need: int | None = None

    @classmethod
    def of(
        cls,
        pipe: object,
        modules: Mapping[str, nn.Module],
        sequence: Sequence[str],
        casts: Mapping[str, tuple[torch.dtype, ...]],
    ) -> CallDryRuns | None:
        """None for a pipeline whose call does not end denoiser, then decoder."""
        if len(sequence) < 2:
            return None
        denoiser = sequence[-2]
        decoder = DecoderDryRun.of(pipe, casts, modules[denoiser])
        if decoder is None or sequence[-1] != decoder.name or denoiser == decoder.name:
            return None
        forward = ForwardDryRun(modules[denoiser])
        default_step_need = forward.need_at_defaults(pipe, denoiser)  # made now, as the decode's below
        if forward.default_size is not None:
            # The size the pipeline's own code makes when given none, where the default call told
            # it, rather than the one worked out from its attributes (PRX's are in pixels, and
            # FLUX Kontext's max_area overrides them), with the output size arguments that made it.
            decoder.default_size = max(forward.default_size)
            decoder.default_outputs = _output_size_defaults(pipe)
        # The decode of the pipeline's default size, estimated now rather than as a first call of
        # that size starts, while the device waits (a call of another size, or with the VAE tiled
        # or sliced since, is estimated as it starts).
        decoder.need({})
        return cls(denoiser, forward, decoder, default_step_need)

    @property
    def default_size(self) -> tuple[int, int]:
        """The (height, width) of a call given neither: the key of such a call's shape (see
        ``call_shapes.call_shape``). The one the default call told, else (its call ran no
        ``check_inputs`` with them filled in, as FLUX.2's, or could not run on the meta device) the
        decoder's, worked out from the pipeline's attributes."""
        return self.forward.default_size or (self.decoder.default_size, self.decoder.default_size)
