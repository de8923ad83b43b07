"""A pipeline's call with its default arguments, run on the meta device up to its denoiser's first
step: the denoiser's inputs for calls of the pipeline's default shape, known as the pipeline is
enabled rather than as its first call reaches the denoiser.

A denoiser's need is estimated by a dry run of its inputs (see ``dry_runs.ForwardDryRun``), and
those come from the pipeline's own code: its latents' packing, its prompt embeddings' length, its
guidance batch differ from one pipeline class to the next. Running that code on meta copies of the
components (tensors with shapes and no memory) makes them without knowing any of it, in a few
hundred dispatched operations. A first call of that shape then finds its denoiser's estimate made,
rather than holding the device idle while the host makes it (0.053 s for SDXL's UNet on the
development machine's CPU, docs/benchmarks.md).

The call is made on a stand-in pipeline object: the components' meta copies, the scheduler's copy
(setting its timesteps changes it), the tokenizers and settings shared. Code that reads values
(``.item()`` on a mask, as transformers' T5 attention does for Wan's UMT5) cannot run on the meta
device: such a pipeline gets no inputs here, and its first call estimates as it reaches its
denoiser, as before.

The same call tells the size the pipeline makes when given none: the height and width its code
hands ``check_inputs`` once it has filled them in. Pipelines work that out differently
(``default_sample_size`` in latent units times ``vae_scale_factor`` for most, in pixels for PRX's),
so it is read from the pipeline's own code rather than worked out here.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from diffusers import DiffusionPipeline, ModelMixin
from torch import nn

from .guards import GUARDED, STATE_ATTR
from .replayed_blocks import kept_specs

logger = logging.getLogger(__name__)

# Instance attributes an enabled pipeline holds that a stand-in must not: its setup, whose call
# wrapper would take the stand-in's call for the pipeline's own, and its guards.
_NOT_COPIED = (STATE_ATTR, *GUARDED)


class _DenoiserReached(Exception):
    """Raised by the denoiser's copy as its first step starts, with the inputs it was given."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__("the denoiser was reached")
        self.inputs = (args, kwargs)


def _raise_reached(module: nn.Module, args: tuple, kwargs: dict) -> None:
    raise _DenoiserReached(args, kwargs)


@dataclass(frozen=True)
class DefaultCall:
    """What ``pipe(prompt="")`` gave its denoiser's first step, and the ``(height, width)`` it made
    its output's size (None where its ``check_inputs`` was not given two ints); and, by name, what
    it first gave each encoder it ran before (see :func:`is_encoder`), as specs (see
    ``replayed_blocks.kept_specs``: none for inputs holding other objects). A diffusers model run
    before the denoiser (another denoiser, Wan 2.2's first) is left out: run whole at enable, it
    could cost what a step does."""

    args: tuple
    kwargs: dict
    size: tuple[int, int] | None
    encoder_inputs: dict[str, tuple[tuple, dict]]


def is_encoder(component: nn.Module) -> bool:
    """Whether a pipeline's component is an encoder: no diffusers model (transformers' text and
    image encoders), which takes tokens, or images at a size of its own, where diffusers' models
    (VAEs, denoisers, ControlNets, adapters) take latents or images at the call's size."""
    return not isinstance(component, ModelMixin)


def denoiser_inputs(pipe: DiffusionPipeline, twins: Mapping[str, nn.Module], denoiser: str) -> DefaultCall | None:
    """The inputs of ``denoiser``'s first step in ``pipe(prompt="")`` (every other argument its
    default), made by ``pipe``'s class's own call on ``twins``: a meta copy of each of its module
    components by name. None where that call fails before the denoiser (it reads values, or needs
    arguments beyond a prompt) or never reaches it."""
    stand_in = object.__new__(type(pipe))
    state = {name: value for name, value in vars(pipe).items() if name not in _NOT_COPIED}
    for name, value in state.items():
        if callable(getattr(value, "set_timesteps", None)):
            state[name] = _scheduler_on_host(value)
    state.update(twins)
    vars(stand_in).update(state)
    stand_in.set_progress_bar_config(disable=True)
    sizes: dict[str, Any] = {}
    if callable(getattr(stand_in, "check_inputs", None)):
        stand_in.check_inputs = _telling_sizes(stand_in.check_inputs, sizes)
    encoder_inputs: dict[str, tuple[tuple, dict] | None] = {}
    handles = [twins[denoiser].register_forward_pre_hook(_raise_reached, with_kwargs=True)]
    handles += [
        twin.register_forward_pre_hook(functools.partial(_told_first_inputs, encoder_inputs, name), with_kwargs=True)
        for name, twin in twins.items()
        if is_encoder(twin)
    ]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the pipeline's own, about arguments left to defaults
            stand_in(prompt="", output_type="latent")
    except _DenoiserReached as reached:
        height, width = sizes.get("height"), sizes.get("width")
        size = (height, width) if all(type(side) is int and side > 0 for side in (height, width)) else None
        kept = {name: specs for name, specs in encoder_inputs.items() if specs is not None}
        return DefaultCall(*reached.inputs, size, kept)
    except Exception as error:  # any failure means no inputs, never a failed enable
        logger.debug("%s's call cannot run on the meta device: %s", type(pipe).__name__, error)
        return None
    finally:
        for handle in handles:
            handle.remove()
    logger.debug("%s's call never reached %r", type(pipe).__name__, denoiser)
    return None


def _told_first_inputs(
    told: dict[str, tuple[tuple, dict] | None], name: str, module: nn.Module, args: tuple, kwargs: dict
) -> None:
    """Keep what ``name`` is first given (None where it cannot be kept, so that a later run is not
    taken for its first: a negative prompt's encoding)."""
    if name not in told:
        told[name] = kept_specs(args, kwargs)


def _telling_sizes(check_inputs: Any, sizes: dict[str, Any]) -> Any:
    """``check_inputs`` that also writes the ``height`` and ``width`` it is given into ``sizes``."""
    try:
        signature = inspect.signature(check_inputs)
    except (TypeError, ValueError):  # no signature to read (a builtin): left as it is, nothing told
        return check_inputs

    @functools.wraps(check_inputs)
    def telling(*args: Any, **kwargs: Any) -> Any:
        try:
            given = signature.bind(*args, **kwargs).arguments
        except TypeError:
            given = {}  # the pipeline's own check raises for these
        sizes.update((name, given[name]) for name in ("height", "width") if name in given)
        return check_inputs(*args, **kwargs)

    return telling


def _scheduler_on_host(scheduler: Any) -> Any:
    """A copy of ``scheduler`` that keeps its timesteps on the host whatever device it is given:
    diffusers' schedulers move their sigmas to the CPU (``sigmas.to("cpu")``), which no meta
    tensor can do. A timestep is a scalar the denoiser's copy takes as it would a device's."""
    scheduler = copy.deepcopy(scheduler)
    set_timesteps = scheduler.set_timesteps
    signature = inspect.signature(set_timesteps)

    @functools.wraps(set_timesteps)  # pipelines read its parameters (``sigmas``, ``timesteps``)
    def on_host(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        if "device" in signature.parameters:
            bound.arguments["device"] = "cpu"
        return set_timesteps(*bound.args, **bound.kwargs)

    scheduler.set_timesteps = on_host
    return scheduler
