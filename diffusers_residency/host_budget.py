"""The host budget: how much of the masters stays in RAM, and which are served from checkpoint files.

Offloading moves weights from the device to host RAM, and a pipeline larger than RAM cannot be
offloaded at all. With a host budget, masters beyond it keep no copy in anonymous memory: they are
views of the pipeline's safetensors files, mapped (their pages are the page cache's, which the
kernel may drop and read again), and their loads go through a ring of page-locked slots (see
:class:`~.ring.Ring`). This module decides which, from sizes and the device plan alone, so
its choices are tested with plain numbers.

Each byte served from a file costs a read at every load, so the masters chosen are those loaded
least often per call: components kept on the device (loaded once, then only after a sleep or an
eviction), then what loads once per call (text encoders, the VAE, a denoiser's blocks kept only
while it runs), then the denoiser's streamed blocks, which load at every step. A denoiser's
resident blocks, its trunk and a denoiser kept whole on the device are never served from files:
they are what a retry, a re-plan or a wake brings back first.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from diffusers import DiffusionPipeline
from torch import nn

from .checkpoints import checkpoint_views, component_folder, equal_views, saved_weights, servable, write_checkpoint
from .files import MappedBytes
from .machine_memory import machine_memory_limit
from .mapped_masters import FileBacking
from .plans import ComponentPlan, ComponentSizes, ResidencyPlan
from .policy import Policy
from .ring import new_ring, ring_bytes, ring_shape
from .streaming import repeated_blocks
from .text import format_bytes, parse_bytes

logger = logging.getLogger(__name__)

# "auto" leaves this much of what the machine allows to the process itself and to the rest of the
# system: a tenth, at least 2 GiB.
_AUTO_MARGIN_FRACTION = 0.10
_AUTO_MARGIN_BYTES = 2 << 30


def resolve_host_budget(host_budget: int | float | str | None) -> int | None:
    """Bytes of masters that may stay in RAM: None (no budget, every master in RAM), bytes as an int
    or a string such as ``"16GB"``, a float in (0, 1] for a fraction of what :func:`machine_memory_limit`
    allows, or ``"auto"``:
    what :func:`machine_memory_limit` allows, less a tenth (at least 2 GiB) for the process and the
    rest of the system."""
    if host_budget is None:
        return None
    if isinstance(host_budget, str) and host_budget.strip().lower() == "auto":
        limit = machine_memory_limit()
        return max(0, limit - max(_AUTO_MARGIN_BYTES, int(_AUTO_MARGIN_FRACTION * limit)))
    if isinstance(host_budget, float):
        if not 0.0 < host_budget <= 1.0:
            raise ValueError(f"host_budget as a fraction of RAM must be in (0, 1], not {host_budget}")
        return int(host_budget * machine_memory_limit())
    return parse_bytes(host_budget, "host_budget")


@dataclass(frozen=True)
class HostPlacement:
    """Which masters are served from checkpoint files under a host budget: whole components (by
    name) and blocks of streamed ones (positions, by component), each with why; and what stays in
    RAM, the ring that file loads go through included."""

    budget: int | None
    components: frozenset[str] = frozenset()
    blocks: Mapping[str, frozenset[int]] = field(default_factory=dict)
    ram_bytes: int = 0
    file_bytes: int = 0
    ring_bytes: int = 0
    # The ring's slot bytes and slot count (see ring_shape).
    ring_shape: tuple[int, int] = (1, 0)
    reasons: Mapping[str, str] = field(default_factory=dict)

    @property
    def serves_files(self) -> bool:
        return bool(self.components or self.blocks)

    @property
    def served(self) -> tuple[frozenset[str], frozenset[tuple[str, int]]]:
        """What is served from files, whatever the figures around it."""
        return self.components, frozenset((name, i) for name, blocks in self.blocks.items() for i in blocks)

    def file_backed(self, component: str, block: int | None = None) -> bool:
        """Whether the component (its trunk, for a streamed one) or one of its blocks is served from files."""
        if component in self.components:
            return True
        return block is not None and block in self.blocks.get(component, ())

    def lines(self) -> list[str]:
        """What the plan prints about host memory."""
        if self.budget is None:
            return []
        head = (
            f"host budget {format_bytes(self.budget)}: {format_bytes(self.ram_bytes)} of masters in RAM"
            + (f" (a {format_bytes(self.ring_bytes)} ring included)" if self.ring_bytes else "")
            + f", {format_bytes(self.file_bytes)} served from checkpoint files"
        )
        return [head, *(f"  {name}: {why}" for name, why in self.reasons.items())]


class HostBudgetTooSmallError(ValueError):
    """The masters that must stay in RAM alone exceed the host budget."""


@dataclass(frozen=True)
class _Candidate:
    component: str
    block: int | None
    nbytes: int
    # Loads per call: 0 (kept on the device), 1 (once per call), 2 (at every step).
    loads: int
    # The most one load of it moves (a streamed component loads block by block): the ring's size.
    largest_load: int


_WHY = {
    0: "kept on the device: read from its files once, and after a sleep or an eviction",
    1: "loaded once per call: read from its files at each call",
    2: "streamed at every step: read from its files at each step",
}


def _candidates(plan: ComponentPlan, sizes: ComponentSizes) -> list[_Candidate]:
    """What of one component or block may be served from files, with how often it loads: what a
    checkpoint holds of it (its non-persistent buffers stay in RAM)."""
    whole = sizes.nbytes - sizes.unsaved_bytes
    if plan.policy is Policy.STREAMED:
        blocks = range(len(sizes.block_bytes))
        if not sizes.per_step:
            return [_Candidate(plan.name, None, whole, 1, max(sizes.trunk_bytes, *sizes.block_bytes))]
        return [
            _Candidate(
                plan.name, i, sizes.servable_block_bytes(i), 1 if i in plan.staged_blocks else 2, sizes.block_bytes[i]
            )
            for i in blocks
            if i not in plan.resident_blocks
        ]
    if plan.policy is Policy.RESIDENT:
        return [] if sizes.per_step else [_Candidate(plan.name, None, whole, 0, sizes.nbytes)]
    return [_Candidate(plan.name, None, whole, 1, sizes.nbytes)]


def _cast_bytes(nbytes: int, round_trip: tuple[torch.dtype, ...]) -> int:
    """What a component of ``nbytes`` keeps on the host besides its masters for a round trip its
    calls make (see casts.lossless_round_trip: the dtypes it goes through, then the one it began
    in): the masters of each dtype it goes through, and a copy of its own that a call's first cast
    compares them with (see ConversionReuse)."""
    *through, own = round_trip
    return nbytes + sum(nbytes * dtype.itemsize // own.itemsize for dtype in dict.fromkeys(through) if dtype != own)


def place_on_host(
    plan: ResidencyPlan, budget: int | None, casts: Mapping[str, tuple[torch.dtype, ...]] | None = None
) -> HostPlacement:
    """Serve from files the fewest, least often loaded masters that bring those in RAM, with the ring
    their loads need, within ``budget``; the least often loaded first, the largest first among
    equals (fewer units to map), later blocks first among equal blocks. A component its calls cast
    and undo (``casts``: SDXL's VAE, to float32 and back) stays in RAM, with the masters of the
    dtype it is cast to: a cast converts masters on the host, and its results, kept for the next
    call, are memory of their own whatever the first ones are. Raises
    :class:`HostBudgetTooSmallError` where what must stay in RAM does not fit."""
    casts = {name: trip for name, trip in (casts or {}).items() if trip}
    by_name = {s.name: s for s in plan.sizes}
    cast_bytes = sum(_cast_bytes(by_name[name].nbytes, trip) for name, trip in casts.items() if name in by_name)
    total = sum(s.nbytes for s in plan.sizes) + cast_bytes
    if budget is None or total <= budget:
        return HostPlacement(budget, ram_bytes=total)
    candidates = sorted(
        (c for p in plan.components if p.name not in casts for c in _candidates(p, by_name[p.name])),
        key=lambda c: (c.loads, -c.nbytes, -(c.block or 0)),
    )
    chosen: list[_Candidate] = []
    file_bytes = ring = 0
    shape = ring_shape([])
    for candidate in candidates:
        if total - file_bytes + ring <= budget:
            break
        chosen.append(candidate)
        file_bytes += candidate.nbytes
        shape = ring_shape([(c.largest_load, c.loads == 2) for c in chosen])
        ring = ring_bytes(shape)
    if total - file_bytes + ring > budget:
        raise HostBudgetTooSmallError(
            f"host_budget ({format_bytes(budget)}) is less than the masters that must stay in RAM: "
            f"{format_bytes(total - file_bytes + ring)} (the denoiser's trunk and resident blocks, "
            + ("components its calls cast with their cast masters, " if casts else "")
            + f"and a {format_bytes(ring)} ring for loads from files). "
            "Raise host_budget, or lower vram_budget so that more of the denoiser streams."
        )
    blocks: dict[str, set[int]] = {}
    reasons: dict[str, str] = {}
    for candidate in chosen:
        if candidate.block is None:
            reasons[candidate.component] = _WHY[candidate.loads]
        else:
            blocks.setdefault(candidate.component, set()).add(candidate.block)
    for name, positions in blocks.items():
        streamed = sum(1 for c in chosen if c.component == name and c.loads == 2)
        reasons[name] = (
            f"{len(positions)} of {len(by_name[name].block_bytes)} blocks served from files ({streamed} streamed at "
            f"every step, read from their files at each step); its trunk and resident blocks stay in RAM"
        )
    for plan_of in plan.components:
        if plan_of.name in casts:
            dtypes = ", ".join(str(dtype).removeprefix("torch.") for dtype in casts[plan_of.name])
            reasons[plan_of.name] = f"in RAM, with masters of each dtype its calls cast it to and back ({dtypes})"
        elif plan_of.name not in reasons:
            kept = by_name[plan_of.name].per_step and plan_of.policy is Policy.RESIDENT
            reasons[plan_of.name] = (
                "in RAM: a denoiser kept on the device is never served from files"
                if kept
                else "in RAM: the rest fits the budget without it"
            )
    placement = HostPlacement(
        budget,
        components=frozenset(c.component for c in chosen if c.block is None),
        blocks={name: frozenset(positions) for name, positions in blocks.items()},
        ram_bytes=total - file_bytes + ring,
        file_bytes=file_bytes,
        ring_bytes=ring,
        ring_shape=shape,
        reasons=reasons,
    )
    return placement


def _served_modules(modules: Mapping[str, nn.Module], placement: HostPlacement) -> dict[str, list[nn.Module]]:
    """Per component, the modules whose masters the placement serves from files: the component and
    its blocks (units of their own if it streams), or the blocks chosen."""
    served = {name: [modules[name], *(block for _, block in repeated_blocks(modules[name]))] for name in placement.components}
    for name, positions in placement.blocks.items():
        blocks = repeated_blocks(modules[name])
        served[name] = [blocks[i][1] for i in sorted(positions)]
    return served


def _views_in(folder: Path | None, module: nn.Module, weights: list[torch.Tensor]) -> dict[int, MappedBytes]:
    return equal_views(weights, checkpoint_views(folder, module)) if folder is not None else {}


def file_sources(
    pipe: DiffusionPipeline,
    modules: Mapping[str, nn.Module],
    placement: HostPlacement,
    offload_folder: str | os.PathLike | None,
) -> dict[int, Mapping[int, MappedBytes]]:
    """What each module the placement serves from files is served from (by ``id`` of the module):
    the views of its weights in the pipeline's checkpoint files, byte for byte equal to them. A
    component whose weights are not all in those files (built in code, or changed since loading)
    has them written once into ``offload_folder/<component>`` and served from there; with no
    ``offload_folder`` it is refused. Raises before the pipeline changes."""
    if not placement.serves_files:
        return {}
    served = _served_modules(modules, placement)
    weights: dict[str, list[torch.Tensor]] = {}
    shared: dict[str, int] = {}
    on_device: dict[str, torch.device] = {}
    for name, units in served.items():
        saved = saved_weights(units)
        weights[name] = [w for w in saved if servable(w)]
        if len(weights[name]) < len(saved):
            shared[name] = sum(w.nbytes for w in saved if not servable(w))
        device = next((w.device for w in saved if w.device.type != "cpu"), None)
        if device is not None:
            on_device[name] = device
    if on_device:
        # Copied down to be compared with the files and to take masters, they would fill the RAM
        # the budget is there to spare, and what no file holds would stay there.
        raise ValueError(
            f"host_budget would serve {sorted(on_device)} from checkpoint files, but their weights are on "
            f"{sorted(map(str, set(on_device.values())))}. Enable pinned offload on the pipeline on the CPU: "
            "load it there, or pipe.to('cpu') first."
        )
    if shared:
        raise ValueError(
            f"host_budget would serve {sorted(shared)} from checkpoint files, but {format_bytes(sum(shared.values()))} "
            "of their weights are views into storages they share (as some loaders leave a checkpoint loaded with a "
            "dtype change), or of a dtype no safetensors file holds (complex, float8_e4m3fnuz), which no file can "
            "serve. Load the checkpoint in the dtype it was saved in, or save the pipeline in the dtype you use and "
            "load it from there, or give a host_budget that keeps these components in RAM."
        )
    sources: dict[str, dict[int, MappedBytes]] = {}
    unserved: dict[str, int] = {}
    for name, wanted in weights.items():
        views = _views_in(component_folder(pipe, name), modules[name], wanted)
        if len(views) < len(wanted) and offload_folder is not None:
            cached = Path(offload_folder) / name
            views = _views_in(cached if any(cached.glob("*.safetensors")) else None, modules[name], wanted)
            if len(views) < len(wanted):
                logger.info("Writing %r's weights to %s, to serve them from there", name, cached)
                views = _views_in(write_checkpoint(cached, modules[name]), modules[name], wanted)
        if len(views) < len(wanted):
            unserved[name] = sum(w.nbytes for w in wanted if id(w) not in views)
        sources[name] = views
    if unserved:
        where = (
            f"are not in the files it was loaded from ({pipe.name_or_path!r}): built in code, or changed since loading"
            if pipe.name_or_path
            else "have no files: the pipeline was not loaded from a folder"
        )
        raise ValueError(
            f"host_budget serves {sorted(unserved)} from checkpoint files, but {format_bytes(sum(unserved.values()))} "
            f"of their weights {where}. Pass offload_folder= "
            "to have them written there once and served from there, or load the pipeline with from_pretrained() "
            "from a local folder."
        )
    return {id(unit): sources[name] for name, units in served.items() for unit in units}


def file_backing(
    sources: Mapping[int, Mapping[int, MappedBytes]],
    placement: HostPlacement,
    *,
    budget: int,
    pin: bool,
    device: torch.device,
) -> dict[int, FileBacking]:
    """Each served module's :class:`FileBacking`: its sources (see :func:`file_sources`) and one ring
    for all their loads, page-locked within ``budget`` when ``pin``. The caller closes the ring
    if it does not stage them after all."""
    if not sources:
        return {}
    ring = new_ring(placement.ring_shape, budget, pin=pin, device=device)
    return {module: FileBacking(views, ring) for module, views in sources.items()}
