"""Call shapes: what of a pipeline call's arguments changes what it needs on the device, as a short
string (``height=1024 width=1024 batch=1 ...``) that plans and residency profiles are kept by, and
how two shapes compare (a smaller call is planned from a larger one's figures).
"""

from __future__ import annotations

import inspect
import json
import numbers
from collections.abc import Collection, Mapping
from typing import Any

import torch

# Call arguments that change how much memory a call needs (the latents' size, the batch, guidance
# that doubles it), by the names diffusers' pipelines use. Steps, seeds and prompts' words do not.
# ``max_area`` (FLUX Kontext) and ``resolution`` (Qwen-Image Layered, VisualCloze) set the output's
# size where ``height`` and ``width`` give only its aspect, or nothing; ``layers`` how many images a
# Qwen-Image Layered call makes; ``decode_chunk_size`` and ``vae_batch_size`` (video pipelines) how
# many frames the VAE decodes at once. ``use_resolution_binning`` (PixArt, Sana: on by default)
# makes the latents those of the nearest of the model's sizes, the image resized after decoding;
# ``use_input_image_size_as_output`` (OmniGen) makes the output the size of the image given;
# ``output_resolution`` (Qwen-Image 2.1) is the side of a call given no height or width.
OUTPUT_SIZE_ARGUMENTS = (
    "max_area", "resolution", "use_resolution_binning", "use_input_image_size_as_output", "output_resolution",
)  # fmt: skip
_SHAPE_ARGUMENTS = (
    "height", "width", *OUTPUT_SIZE_ARGUMENTS, "num_frames", "layers", "num_images_per_prompt",
    "num_videos_per_prompt", "max_sequence_length", "decode_chunk_size", "vae_batch_size",
)  # fmt: skip
_BATCH_ARGUMENTS = ("prompt", "prompt_embeds")
# Images, videos and latents given to a call, by their size (a call given one encodes or conditions
# on it; OmniGen's ``input_images`` by their number and the first one's size); and the tensors
# counted in a call's shape: those, and prompt embeddings (whose sequence length, not
# ``max_sequence_length``, is what the denoiser then attends over).
IMAGE_ARGUMENTS = (
    "image", "mask_image", "control_image", "last_image", "video", "latents", "ip_adapter_image", "input_images",
)  # fmt: skip
_TENSOR_ARGUMENTS = (*IMAGE_ARGUMENTS, "prompt_embeds")
_GUIDANCE_ARGUMENTS = ("guidance_scale", "true_cfg_scale")
# The arguments of a shape signature that measure a call's size: a call smaller in these (and the
# same in the others) needs no more room than the larger one (see covering_shape).
SIZE_ARGUMENTS = (
    "height", "width", "max_area", "resolution", "num_frames", "layers", "max_sequence_length",
    "num_images_per_prompt", "num_videos_per_prompt", "decode_chunk_size", "vae_batch_size", "batch",
)  # fmt: skip


def _describe(value: Any) -> Any:
    """A call argument as far as memory goes: a tensor or image by its size, a list by its length
    and its items', a number as a number (a numpy or 0-d tensor one too)."""
    if isinstance(value, numbers.Number) or (getattr(value, "ndim", None) == 0 and hasattr(value, "item")):
        return value.item() if hasattr(value, "item") else value  # numpy's bool too, which is no Number
    if isinstance(value, torch.Tensor) or (hasattr(value, "shape") and hasattr(value, "dtype")):  # numpy too
        return list(value.shape)
    if hasattr(value, "size") and hasattr(value, "mode"):  # a PIL image
        return list(value.size)
    if isinstance(value, (list, tuple)):
        # Its length and its items' one description where they share it, else every item's (the
        # sizes of OmniGen's input images, how many of each counting).
        described = [_describe(item) for item in value]
        if all(description == described[0] for description in described):
            return [len(value), described[0] if described else None]
        return [len(value), *described]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__name__


_PASSING_ON = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
_BY_POSITION = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def call_signature(cls: type, caller: type | None = None) -> inspect.Signature:
    """The arguments calls of pipeline class ``cls`` take. Its ``__call__``'s, and where that passes
    arguments on (``*args, **kwargs``), the nearest parent's that names them, parents in the order
    ``super()`` reaches them from a pipeline of class ``caller`` (a subclass of ``cls``; with
    several parents, ``cls``'s next may be another than in ``cls``'s own order): for a ``__call__``
    taking only ``*args, **kwargs`` the parent's signature, and for one that names some arguments
    and passes the rest on (``prompt, strength=0.5, **kwargs``) its own followed by the parent's
    others as keyword-only arguments (where it names none by position, ``*args, strength=0.5,
    **kwargs``, its positional arguments are the parent's, see :func:`_passed_on_to`); either way
    what it takes from the parent defaults to None (see :func:`_defaults_unknown`). A parent's
    ``__call__`` that is no plain function, or has no signature to read, names nothing: what was
    read so far is kept. Raises as ``inspect.signature`` does where the class's own has none to
    read."""
    order = caller.__mro__ if caller is not None and cls in caller.__mro__ else cls.__mro__
    read: inspect.Signature | None = None
    for owner in order[order.index(cls) :]:
        function = owner.__dict__.get("__call__")
        if function is None:
            continue
        if read is not None and not inspect.isfunction(function):
            return read  # a staticmethod's or a callable object's first parameter need not be self
        try:
            signature = inspect.signature(function)
        except (TypeError, ValueError):
            if read is None:
                raise
            return read
        read = signature if read is None else _passed_on_to(read, signature)
        if not any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in signature.parameters.values()):
            return read  # names every argument it takes
    if read is None:
        raise ValueError(f"{cls.__name__} defines no __call__")
    return read


def _passed_on_to(child: inspect.Signature, parent: inspect.Signature) -> inspect.Signature:
    """``child``, a signature passing arguments on, with those its ``parent`` names: the parent's
    whole signature where the child names none of its own, else the child's followed by the
    parent's others, keyword-only (an argument given by position goes to the child's names first,
    or, where it names none by position, to the parent's), in both cases with the parent's
    defaults unknown."""
    parent = _defaults_unknown(parent)
    own = list(child.parameters.values())
    # ``self``, unless the child takes it in ``*args`` (a decorator's ``wrapper(*args, **kwargs)``).
    first = own[:1] if own and own[0].kind in _BY_POSITION else []
    named = [parameter for parameter in own[len(first) :] if parameter.kind not in _PASSING_ON]
    if not named:
        return parent
    names = {parameter.name for parameter in named}
    keyword_only = inspect.Parameter.KEYWORD_ONLY
    positional = [parameter for parameter in named if parameter.kind is not keyword_only]
    theirs = list(parent.parameters.values())
    if theirs and theirs[0].kind in _BY_POSITION:
        theirs_self, theirs = theirs[:1], theirs[1:]
    else:
        theirs_self = []
    variadic = [parameter for parameter in own if parameter.kind is inspect.Parameter.VAR_POSITIONAL]
    leading: list[inspect.Parameter] = []
    if variadic and not positional:
        # ``(self, *args, strength=0.5, **kwargs)`` passes its positional arguments on as they
        # came, so they are the parent's (its ``self`` too, for a child taking it in ``*args``),
        # up to the first the child names itself or the parent's own ``*args``: arguments past
        # those stay unnamed, as the parent takes them.
        stop = None
        for parameter in [*([] if first else theirs_self), *theirs]:
            if parameter.name in names or parameter.kind not in _BY_POSITION:
                stop = parameter
                break
            leading.append(parameter)
        if stop is None or stop.kind in (keyword_only, inspect.Parameter.VAR_KEYWORD):
            variadic = []
        if any(parameter.kind is inspect.Parameter.POSITIONAL_ONLY for parameter in leading):
            first = [parameter.replace(kind=inspect.Parameter.POSITIONAL_ONLY) for parameter in first]
    parameters = [
        *first,
        *positional,
        *leading,
        *variadic,
        *(parameter for parameter in named if parameter.kind is keyword_only),
        *(
            parameter.replace(kind=keyword_only)
            for parameter in theirs
            if parameter.kind not in _PASSING_ON and parameter.name not in names and parameter not in leading
        ),
        *(parameter for parameter in theirs if parameter.kind is inspect.Parameter.VAR_KEYWORD),
    ]
    return child.replace(parameters=parameters)


def _defaults_unknown(signature: inspect.Signature) -> inspect.Signature:
    """A parent's ``signature`` with every argument defaulting to None: a subclass passing its
    arguments on may set defaults of its own first (``kwargs.setdefault("guidance_scale", 0.0)``),
    so an argument its call leaves out counts as None, as under a signature of its own, not as
    the parent's default. (Its height and width left out are still keyed by the size its own
    default call makes, see ``default_call``.)"""
    first, *rest = signature.parameters.values()
    rest = [parameter if parameter.kind in _PASSING_ON else parameter.replace(default=None) for parameter in rest]
    return signature.replace(parameters=[first, *rest])


def call_shape(
    signature: inspect.Signature,
    args: tuple,
    kwargs: Mapping[str, Any],
    default_size: tuple[int, int] | None = None,
) -> str:
    """The shape signature of one pipeline call: its arguments that change what the call needs on
    the device, as a short string (``height=1024 width=1024 batch=1 ...``). Arguments a pipeline
    does not take are left out; one left to its default counts as ``None``, except a height and a
    width both left out (or 0, see :func:`_unset`) of a call given no image and every output size
    argument at its default: those count as ``default_size``, the (height, width) the pipeline's
    default call makes (see ``default_call``), so that ``pipe(prompt)`` and ``pipe(prompt,
    height=1024, width=1024)`` are planned for once, not twice. ``signature`` is the one
    :func:`call_signature` reads."""
    try:
        binding = signature.bind(None, *args, **kwargs)
        binding.apply_defaults()  # a default and the same value given are one shape
        bound = dict(binding.arguments)
    except TypeError:
        bound = dict(kwargs)  # the pipeline raises its own error for these
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:  # a subclass's __call__(self, *args, **kwargs)
            bound.update(bound.pop(parameter.name, {}))
    taken = set(signature.parameters) | set(bound)
    if default_size is not None and _left_to_default_size(signature, bound, taken):
        bound["height"], bound["width"] = default_size
    parts = {name: _describe(bound.get(name)) for name in _SHAPE_ARGUMENTS if name in taken}
    batch = next((bound[name] for name in _BATCH_ARGUMENTS if bound.get(name) is not None), None)
    parts["batch"] = len(batch) if isinstance(batch, (list, tuple)) else batch.shape[0] if isinstance(batch, torch.Tensor) else 1
    for name in _GUIDANCE_ARGUMENTS:
        if bound.get(name) is not None:
            parts[f"{name}>1"] = bool(_describe(bound[name]) > 1)
    if bound.get("negative_prompt") is not None or bound.get("negative_prompt_embeds") is not None:
        parts["negative"] = True
    for name in _TENSOR_ARGUMENTS:
        if bound.get(name) is not None:
            parts[name] = _describe(bound[name])
    return " ".join(f"{name}={json.dumps(value, separators=(',', ':'))}" for name, value in parts.items())


def output_size_defaults(signature: inspect.Signature) -> dict[str, Any]:
    """The defaults of the output size arguments (see :data:`OUTPUT_SIZE_ARGUMENTS`) a pipeline's
    call of ``signature`` takes."""
    parameters = signature.parameters
    return {name: parameters[name].default for name in OUTPUT_SIZE_ARGUMENTS if name in parameters}


def _left_to_default_size(signature: inspect.Signature, bound: Mapping[str, Any], taken: Collection[str]) -> bool:
    """Whether a call's arguments leave its size to what the pipeline's default call makes. Only
    both sides at once: pipelines fill in one side left out differently (SD 1.5's takes its
    default for both, FLUX's the default for the missing one). An image given sets the size in
    some pipelines (FLUX Kontext's, Qwen-Image Edit's), and an output size argument in others,
    whichever value it is given other than its default (PixArt's binning turned off)."""
    defaults = output_size_defaults(signature)
    return (
        {"height", "width"} <= set(taken)
        and _unset(signature, bound, "height")
        and _unset(signature, bound, "width")
        and not any(bound.get(name) is not None for name in IMAGE_ARGUMENTS)
        and all(bound.get(name) == defaults.get(name) for name in OUTPUT_SIZE_ARGUMENTS)
    )


def _unset(signature: inspect.Signature, bound: Mapping[str, Any], side: str) -> bool:
    """Whether a call leaves ``side`` (height or width) to the pipeline: not given, or 0 where it
    defaults to None (most of diffusers' pipelines read those as ``height or default``; the few
    that test ``height is None`` fail on 0, and a failed call keeps no figures; one defaulting to
    a size, Wan's, would make a call of none)."""
    value, parameter = bound.get(side), signature.parameters.get(side)
    return value is None or (_describe(value) == 0 and parameter is not None and parameter.default is None)


def shape_parts(shape: str) -> dict[str, Any] | None:
    """The arguments of a shape signature (see :func:`call_shape`) as data, or None for a string
    that is not one (a profile written by hand, say)."""
    parts: dict[str, Any] = {}
    decoder = json.JSONDecoder()
    position = 0
    try:
        while position < len(shape):
            equals = shape.index("=", position)
            parts[shape[position:equals]], end = decoder.raw_decode(shape, equals + 1)
            if end < len(shape) and shape[end] != " ":
                return None
            position = end + 1
    except ValueError:
        return None
    return parts


def covering_shape(shapes: Collection[str], shape: str) -> str | None:
    """Among ``shapes``, the smallest one whose calls are at least as large as calls of ``shape`` in
    every size (:data:`SIZE_ARGUMENTS`) and the same in every other argument; None if none is.

    What a call needs above the weights does not grow as its latents, its prompt or its batch
    shrink, so the figures measured for such a shape are an upper bound for ``shape``'s: a plan
    made from them fits its calls."""
    wanted = shape_parts(shape)
    if wanted is None:
        return None
    covering = []
    for known in shapes:
        parts = shape_parts(known)
        if known == shape or parts is None or parts.keys() != wanted.keys():
            continue
        if all(_covers(name, parts[name], wanted[name]) for name in wanted):
            volume = 1.0
            for name in SIZE_ARGUMENTS:
                volume *= parts[name] if _is_size(parts.get(name)) else 1
            covering.append((volume, known))
    return min(covering)[1] if covering else None


def _covers(name: str, known: Any, wanted: Any) -> bool:
    """Whether ``known``, a value of argument ``name``, makes calls at least as large as ``wanted``."""
    # Of another type (True == 1 to Python), or None (left to the default): not comparable as sizes.
    if name in SIZE_ARGUMENTS and type(known) is type(wanted) and _is_size(known):
        return known >= wanted
    return type(known) is type(wanted) and known == wanted


def _is_size(value: Any) -> bool:
    # Booleans are numbers to Python, not sizes.
    return isinstance(value, (int, float)) and not isinstance(value, bool)
