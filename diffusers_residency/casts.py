"""Casts a pipeline's calls make of a component and undo, made before its first call.

Pipelines cast a component inside every call and back (SDXL upcasts its VAE to float32 to decode,
and casts it back to float16). A call's first cast converts the masters on the host and
page-locks the results (see :mod:`.conversions`); later calls find both sets of masters kept and
convert nothing. A residency profile keeps, per call shape, the round trips a call made, and a
pipeline enabled from it makes them as it is enabled, so that its first call finds what later
calls find; without one, those a pipeline's code is expected to make are made instead.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .residency import ResidencyGroup
from .weights import module_tensors

logger = logging.getLogger(__name__)


def lossless_round_trip(dtypes: Sequence[torch.dtype | None]) -> tuple[torch.dtype, ...]:
    """The casts of a component that had ``dtypes[0]`` and was cast to each of the others in turn,
    as each wider dtype they went through, once, in order, then the one it began and ended in (SDXL's
    VAE: float32, float16); empty where it ended elsewhere (cast for good) or went through a dtype
    that does not hold every value of the one it began in (float16 through bfloat16 rounds). Cast
    to those and back, a component has the bits it began with, however often a call did it."""
    if len(dtypes) < 2 or dtypes[0] is None or dtypes[-1] != dtypes[0] or not dtypes[0].is_floating_point:
        return ()
    start, wider = dtypes[0], []
    for dtype in dtypes[1:-1]:
        if dtype == start:
            continue
        if not _holds_every_value_of(dtype, start):
            return ()
        if dtype not in wider:
            wider.append(dtype)
    return (*wider, start) if wider else ()


def _holds_every_value_of(wide: torch.dtype | None, narrow: torch.dtype) -> bool:
    if wide is None or not wide.is_floating_point:
        return False
    try:
        return torch.promote_types(narrow, wide) == wide
    except RuntimeError:  # float8 types promote to nothing
        return False


def guessed_casts(pipe: object) -> dict[str, tuple[torch.dtype, ...]]:
    """The round trips ``pipe``'s calls are expected to make, guessed before any call was made:
    diffusers' pipelines that define ``upcast_vae`` (SDXL, Kolors and their kin, with their img2img,
    inpainting and ControlNet variants) cast a float16 VAE whose config asks for ``force_upcast``
    to float32 to decode or encode, and back, in every call that does. Others (SD 1.5's VAE has
    ``force_upcast`` too, but its pipeline never reads it) make none. A guess, not a record: the
    first call that does not make a round trip made on it (one returning latents) lets go of what
    was kept for it (see ResidencyGroup.casts_made_ahead). Some of these pipelines upcast for good
    in some paths (AuraFlow, SDXL ControlNet inpainting): their first call then takes the float32
    masters made here as they are."""
    vae = getattr(pipe, "vae", None)
    if not callable(getattr(type(pipe), "upcast_vae", None)) or not isinstance(vae, nn.Module):
        return {}
    if not getattr(getattr(vae, "config", None), "force_upcast", False):
        return {}
    return {"vae": (torch.float32, torch.float16)}  # warm_casts skips a VAE that is not float16


def leaves_as_it_is(module: nn.Module, casts: tuple[torch.dtype, ...]) -> bool:
    """Whether the round trip ``casts`` (see :func:`lossless_round_trip`) leaves ``module`` as it
    is: every floating-point tensor of it in the dtype the trip begins and ends in (``module.to``
    casts complex tensors too, to real: one of those is not left as it is), and each dtype on the
    way holding every value of that one."""
    own = {t.dtype for t in module_tensors((module,)) if t.is_floating_point() or t.is_complex()}
    return bool(casts) and own == {casts[-1]} and lossless_round_trip((casts[-1], *casts)) == tuple(casts)


def warm_casts(
    group: ResidencyGroup, casts_by_component: Mapping[str, tuple[torch.dtype, ...]], *, guessed: bool = False
) -> None:
    """Make now, as in a call, the round trips (see :func:`lossless_round_trip`) that a call made of
    each component and a residency profile kept (SDXL's VAE to float32 to decode, then float16
    again): made here, the first call finds the masters of both dtypes kept and converts nothing,
    as later calls do (see ConversionReuse.convert).

    Only what leaves the weights as they are: each round trip through dtypes that hold every value
    of the component's own (see ``lossless_round_trip``; a profile is a file, and may have been
    edited), of a component whose floating-point tensors all have that dtype (one kept in float32
    inside a float16 VAE would be rounded), awake (asleep, its masters may map files, and a cast
    would put them in memory), and not kept from a cast already (enabled again after calls: made
    again, the round trip would only unload the component). Not inside a call (a callback loading
    a profile): it makes its own. A cast that fails here is undone and left to the first call.
    ``guessed``: casts no call was seen to make (see :func:`guessed_casts`), let go of after a
    first call that does not make them."""
    with group.call_lock:  # checked and cast with no call of another thread under way
        if group.calls_running:
            return
        for name, casts in casts_by_component.items():
            units = group.units_of(name)
            if not casts or not units or any(unit.sleep_level or unit.stager.keeps_conversions for unit in units):
                continue
            module = units[0].module  # the component (a streamed one's trunk unit holds it whole)
            if not leaves_as_it_is(module, casts):
                continue
            logger.info("Casting %r to %s and back before the first call, as calls do", name, ", ".join(map(str, casts[:-1])))
            with group.running_call():
                made = _cast_through(name, module, casts)
            if made and guessed:
                group.casts_made_ahead.add(name)


def _cast_through(name: str, module: nn.Module, casts: tuple[torch.dtype, ...]) -> bool:
    """Cast ``module`` to each of ``casts`` in turn; on a failure, back to the last, with a warning
    (the first call then makes the casts itself), and False. A failure to cast back too raises:
    the weights may be left in a wider dtype than the pipeline expects."""
    try:
        for dtype in casts:
            module.to(dtype=dtype)
        return True
    except BaseException as error:
        try:
            module.to(dtype=casts[-1])
        except BaseException as undo_error:
            raise RuntimeError(
                f"Casting {name!r} before the first call failed ({error}), and so did casting it back to "
                f"{casts[-1]}: cast it with pipe.{name}.to(dtype={casts[-1]}) before calling the pipeline"
            ) from undo_error
        if not isinstance(error, Exception):
            raise
        logger.warning("Could not cast %r before the first call (%s); its first call casts it", name, error)
        return False
