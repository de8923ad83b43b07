"""The offloading schemes the benchmark compares, each as a way to put a host-resident pipeline under
it and to take it off again: keeping everything on the device, this package's pinned offload, and
diffusers', accelerate's and mmgp's own offloading.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from diffusers import DiffusionPipeline

from .. import _device
from ..pipeline import disable_pinned_offload, enable_pinned_offload
from ..planner import default_reserve
from .host_memory import drop_page_cache


@dataclass(frozen=True)
class Mode:
    """How to put a host-resident pipeline under one offloading scheme, and how to undo it.

    ``setup`` gets the VRAM budget the run is capped at (None: the whole device); only a mode that
    plans for a budget uses it, the others simply run under the cap or run out of memory."""

    name: str
    setup: Callable[[DiffusionPipeline, torch.device, int | None], None]
    teardown: Callable[[DiffusionPipeline], None]
    # accelerate's sequential offload moves weights through the meta device and cannot run on the
    # CPU (nor be undone there).
    needs_accelerator: bool = False
    # False for a mode whose teardown only frees the device (mmgp rewrites every module's forward
    # and moves the weights into pinned buffers of its own, with no way back): every mode after it
    # would measure a pipeline it changed, so it runs once, after all the others.
    undoable: bool = True


class ModeUnavailable(RuntimeError):
    """A mode that cannot run in this process (a package missing, a device it does not support):
    reported as that mode's result, without a traceback."""


def _resident(pipe: DiffusionPipeline, device: torch.device, budget: int | None) -> None:
    pipe.to(device)


def _to_host(pipe: DiffusionPipeline) -> None:
    pipe.to("cpu")


# The pinned modes: all masters in RAM; masters beyond --host-budget served from the checkpoint
# files with their page cache warm (as enabling left it); the same, the page cache dropped after
# enabling, before the first call.
PINNED_MODES = ("pinned", "pinned_files", "pinned_files_cold")


def pinned_mode(
    activation_reserve: int | str | None = None,
    components: Mapping[str, str] | None = None,
    host_budget: int | str | None = None,
    name: str = "pinned",
) -> Mode:
    """``enable_pinned_offload`` planned for the run's budget (``"auto"`` when there is none), with
    the policies ``components`` names kept as given; for the ``pinned_files`` modes (see
    PINNED_MODES), with ``host_budget``."""
    if name not in PINNED_MODES:
        raise ValueError(f"{name!r} is not one of {PINNED_MODES}")
    if (name == "pinned") != (host_budget is None):
        raise ValueError(f"{name} runs {'without' if name == 'pinned' else 'with'} a host budget (--host-budget)")

    def setup(pipe: DiffusionPipeline, device: torch.device, budget: int | None) -> None:
        vram_budget = "auto" if budget is None else budget
        enable_pinned_offload(
            pipe,
            device,
            components=components,
            vram_budget=vram_budget,
            activation_reserve=activation_reserve,
            host_budget=host_budget,
        )
        if name == "pinned_files_cold":
            drop_page_cache(pipe.name_or_path)

    return Mode(name, setup, disable_pinned_offload)


def _needs_host_budget(pipe: DiffusionPipeline, device: torch.device, budget: int | None) -> None:
    raise ModeUnavailable("needs --host-budget")


def _model_cpu_offload(pipe: DiffusionPipeline, device: torch.device, budget: int | None) -> None:
    pipe.enable_model_cpu_offload(device=device)


def _sequential_cpu_offload(pipe: DiffusionPipeline, device: torch.device, budget: int | None) -> None:
    pipe.enable_sequential_cpu_offload(device=device)


def _remove_model_cpu_offload(pipe: DiffusionPipeline) -> None:
    pipe.remove_all_hooks()
    pipe.to("cpu")


def _group_offload(offload_type: str) -> Callable[[DiffusionPipeline, torch.device, int | None], None]:
    def setup(pipe: DiffusionPipeline, device: torch.device, budget: int | None) -> None:
        # Streams are what make it fast; the CPU has none, and diffusers refuses them there.
        stream = _device.is_accelerator(device)
        extra = {} if offload_type == "leaf_level" else {"num_blocks_per_group": 1}
        pipe.enable_group_offload(onload_device=device, offload_type=offload_type, use_stream=stream, **extra)

    return setup


def _remove_group_offload(pipe: DiffusionPipeline) -> None:
    # diffusers has no public way to remove group offloading; these are the hook names it registers
    # (see diffusers.hooks.group_offloading._maybe_remove_and_reapply_group_offloading).
    from diffusers.hooks import HookRegistry
    from diffusers.hooks.group_offloading import (
        _GROUP_OFFLOADING,
        _LAYER_EXECUTION_TRACKER,
        _LAZY_PREFETCH_GROUP_OFFLOADING,
    )

    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            registry = HookRegistry.check_if_exists_or_initialize(component)
            for name in (_GROUP_OFFLOADING, _LAYER_EXECUTION_TRACKER, _LAZY_PREFETCH_GROUP_OFFLOADING):
                registry.remove_hook(name, recurse=True)
    pipe.to("cpu")


# What the mmgp mode was written against: offload.all's arguments and budget rules change between
# releases, and mmgp 3.8.2 needs optimum-quanto 0.2.7.
MMGP_INSTALL = "pip install mmgp==3.8.2 optimum-quanto==0.2.7"

# mmgp's budgets are in MiB (offload.py: ONE_MB = 1048576).
_MIB = 1 << 20


def mmgp_budgets(budget: int | None) -> dict[str, int] | None:
    """mmgp's ``budgets`` for a run capped at ``budget`` bytes.

    No cap: None, mmgp's "no budget" profile (each model moves to the device whole when called).
    A cap: one budget for every model (``"*"``; mmgp moves one model at a time, text encoders and
    VAE aside), the cap less the activation reserve the pinned mode keeps by default, so both
    modes leave the same room for activations. At least 1 MiB: mmgp reads 0 as no budget at all.
    """
    if budget is None:
        return None
    return {"*": max(1, (budget - default_reserve(budget)) // _MIB)}


def _mmgp(pipe: DiffusionPipeline, device: torch.device, budget: int | None) -> None:
    # mmgp moves weights to "cuda", the current device, whatever the pipeline was asked to run on.
    if not _device.same_device(device, torch.device("cuda")):
        raise ModeUnavailable(f"mmgp runs on the current CUDA device only, not {device}")
    try:
        from mmgp import offload
    except ImportError as exc:
        raise ModeUnavailable(f"needs mmgp ({exc}): {MMGP_INSTALL}") from exc
    # mmgp prints its banner and plans on stdout, where the benchmark prints its results.
    with contextlib.redirect_stdout(sys.stderr):
        offload.all(
            pipe,
            pinnedMemory=True,
            quantizeTransformer=False,
            budgets=mmgp_budgets(budget),
            # mmgp casts float32 weights to bfloat16 by default, which would have a float32 run
            # move half the bytes the other modes move.
            convertWeightsFloatTo=pipe.dtype,
        )


def _release_mmgp(pipe: DiffusionPipeline) -> None:
    # Frees the device memory mmgp holds; the hooks and pinned weights stay (mmgp has no way to
    # remove them), which is why this mode runs last.
    offload = sys.modules.get("mmgp.offload")
    manager = None if offload is None else offload.last_offload_obj
    if manager is not None:
        manager.release()
    # offload.all leaves "cuda" as the process's default device.
    torch.set_default_device(None)


MODES: dict[str, Mode] = {
    "resident": Mode("resident", _resident, _to_host),
    "pinned": pinned_mode(),
    # Made from --host-budget (see PINNED_MODES).
    "pinned_files": Mode("pinned_files", _needs_host_budget, disable_pinned_offload),
    "pinned_files_cold": Mode("pinned_files_cold", _needs_host_budget, disable_pinned_offload),
    "model_cpu_offload": Mode("model_cpu_offload", _model_cpu_offload, _remove_model_cpu_offload),
    "sequential_cpu_offload": Mode(
        "sequential_cpu_offload", _sequential_cpu_offload, _remove_model_cpu_offload, needs_accelerator=True
    ),
    "group_offload_block": Mode("group_offload_block", _group_offload("block_level"), _remove_group_offload),
    "group_offload_leaf": Mode("group_offload_leaf", _group_offload("leaf_level"), _remove_group_offload),
    "mmgp": Mode("mmgp", _mmgp, _release_mmgp, needs_accelerator=True, undoable=False),
}

