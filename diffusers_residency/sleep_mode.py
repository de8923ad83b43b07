"""Sleep and wake: give a pipeline's device memory back without unloading it, and take it again.

vLLM's sleep mode copies every weight device-to-host into newly allocated pinned memory at each
level-1 sleep. A pipeline under pinned offload already holds a host master of every weight, so its
level-1 sleep is an offload: rebind to the masters, drop the device storage, release the cache; no
copy at all. Level 2 also gives the masters' host memory back, by swapping each master for a view
of the same bytes in the memory-mapped checkpoint the pipeline was loaded from (checked byte for
byte, so a weight changed since loading keeps its own master); waking copies them from the files
to the device through a ring of pinned slots (see ring.copy_from_files), then reads them
back into pinned memory of their own in the background (see file_reads.ReadBack).

A call to a pipeline that sleeps wakes the components it needs, one by one, as it reaches them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

from diffusers import DiffusionPipeline
from torch import nn

from . import _device
from .calls import groups_staging
from .checkpoints import checkpoint_views, component_folder
from .pipeline import enable_pinned_offload, pipeline_state
from .policy import Policy
from .residency import ResidencyGroup, ResidencyUnit

logger = logging.getLogger(__name__)

def _names(value: str | Iterable[str] | None) -> list[str]:
    return [value] if isinstance(value, str) else list(value or ())


def _units(group: ResidencyGroup, names: Iterable[str]) -> dict[str, list[ResidencyUnit]]:
    """The group's units of each named component: one, or a streamed component's trunk and blocks
    (a hook removed on its own is no longer one)."""
    units = {name: group.units_of(name) for name in names}
    return {name: found for name, found in units.items() if found}


def _staging_groups(pipe: DiffusionPipeline) -> list[ResidencyGroup]:
    """The groups that stage the pipeline's components: its own, or, for a pipeline made with
    ``from_pipe`` from pipelines pinned offload was enabled on, those whose hooks the components it
    shares carry (asleep, they sleep for both)."""
    state = pipeline_state(pipe)
    return [state.group] if state is not None else groups_staging(pipe)


def _staged_components(group: ResidencyGroup, pipe: DiffusionPipeline) -> list[str]:
    """The components of ``group`` that are components of ``pipe`` too (all of them for the pipeline
    it was enabled on), by the names the group knows them by, in the group's order."""
    modules = {id(component) for component in pipe.components.values()}
    return [unit.component for unit in group.units if unit.name == unit.component and id(unit.module) in modules]


def _sleep_plan(
    pipe: DiffusionPipeline, level: int, offload: str | Iterable[str] | None, discard: str | Iterable[str] | None
) -> dict[str, int]:
    components = [name for name, c in pipe.components.items() if isinstance(c, nn.Module)]
    # Checked even where offload= and discard= give the levels: a level that means nothing is a mistake.
    if isinstance(level, bool) or not isinstance(level, int) or level not in (1, 2):
        raise ValueError(f"sleep level must be 1 (keep host masters) or 2 (drop them too), not {level!r}")
    if offload is None and discard is None:
        return dict.fromkeys(components, level)
    offload, discard = _names(offload), _names(discard)
    both = sorted(set(offload) & set(discard))
    if both:
        raise ValueError(f"{both} named in both offload= and discard=; each component gets one level")
    unknown = sorted(set(offload + discard) - set(components))
    if unknown:
        raise ValueError(f"{unknown} are not nn.Module components of {type(pipe).__name__}; choose from {components}")
    return {**dict.fromkeys(offload, 1), **dict.fromkeys(discard, 2)}


def _checkpoint_folders(pipe: DiffusionPipeline, names: Iterable[str]) -> dict[str, Path]:
    """Each named component's safetensors folder in the directory the pipeline was loaded from, or
    a clear error before anything is put to sleep."""
    names = list(names)
    if not names:
        return {}
    folders = {name: component_folder(pipe, name) for name in names}
    missing = [name for name, folder in folders.items() if folder is None]
    if missing:
        raise ValueError(
            f"Level-2 sleep reloads weights from the pipeline's safetensors files, and none were found for "
            f"{missing} under {pipe.name_or_path!r} (pipe.name_or_path). Load the pipeline with from_pretrained() "
            "from a local directory, or save_pretrained() it and load it from there, or use level 1."
        )
    return folders


def _refuse_sharing(pipe: DiffusionPipeline) -> None:
    """Raise for a pipeline without pinned offload of its own whose components another pipeline's
    stages (``from_pipe``), or a script's group: enabling it would be refused as staging them twice."""
    if pipeline_state(pipe) is None and groups_staging(pipe):
        raise ValueError(
            f"This {type(pipe).__name__} has components staged by another pipeline's pinned offload (made "
            "with from_pipe, or from its components): sleep that pipeline, or put it in a rotation, instead; "
            "wake_up() and is_sleeping work on either. Or by hooks a script attached: sleep their "
            "ResidencyGroup, or detach them (detach_staging_hook) first."
        )


def sleep(
    pipe: DiffusionPipeline,
    level: int = 1,
    *,
    offload: str | Iterable[str] | None = None,
    discard: str | Iterable[str] | None = None,
    release_cache: bool = True,
) -> None:
    """Free the device memory the pipeline's weights hold, keeping the pipeline usable.

    Args:
        level: 1 keeps every weight in host memory (its pinned master); 2 also gives that host
            memory back, keeping only a memory-mapped view of the checkpoint files the pipeline was
            loaded from (refused, before anything changes, when there are none).
        offload / discard: per component, in the spirit of vLLM's tags: the components named in
            ``offload`` sleep at level 1, those in ``discard`` at level 2, the others stay awake.
        release_cache: give the device memory back to the device at the end (the default). False
            leaves it in PyTorch's allocator cache, for what loads next to take (see
            :class:`AwakeRotation`); ``torch.accelerator.empty_cache()`` gives it back later.

    A pipeline without pinned offload gets it first (every component resident, on the device the
    pipeline is on), so its host masters are taken once, here. Sleeping what sleeps is a no-op; a
    different level for a component that already sleeps is ignored with a warning.
    """
    _refuse_sharing(pipe)
    plan = _sleep_plan(pipe, level, offload, discard)
    folders = _checkpoint_folders(pipe, [name for name, lvl in plan.items() if lvl == 2])
    # Every file read before anything sleeps: one that cannot be read refuses the whole sleep. (By
    # the tensors' ids, which a component replaced since keeps as it is enabled again just below.)
    views = {name: checkpoint_views(folder, pipe.components[name]) for name, folder in folders.items()}
    state = pipeline_state(pipe)
    if state is not None:
        state.staging_replaced(pipe)
    state = pipeline_state(pipe)
    if state is None:
        modules = [name for name, c in pipe.components.items() if isinstance(c, nn.Module)]
        enable_pinned_offload(pipe, pipe.device, components=dict.fromkeys(modules, "resident"), vram_budget=None)
        state = pipeline_state(pipe)
    group = state.group
    # By module: one registered under two names is staged once, under the first.
    component_of = {id(unit.module): unit.component for unit in group.units if unit.name == unit.component}
    staged_as = {name: component_of.get(id(pipe.components[name])) for name in plan}
    unstaged = sorted(name for name, component in staged_as.items() if component is None)
    if unstaged and (offload is not None or discard is not None):  # its hook taken off on its own since
        raise ValueError(f"{unstaged} are not staged by pinned offload now; name staged components only")
    for name, component in staged_as.items():
        for unit in group.units_of(component) if component is not None else ():
            group.sleep(unit, plan[name], views.get(name))
    # A component set to None since (its embeddings computed) is no component to wake, but its
    # device copies are weights of this pipeline's setup all the same: they go too.
    current = {id(module) for module in pipe.components.values()}
    for unit in group.units:
        if unit.name == unit.component and id(unit.module) not in current:
            group.offload_component(unit.component)
    if release_cache:
        group.retention.release(reason="sleep")


def wake_up(pipe: DiffusionPipeline, components: str | Iterable[str] | None = None) -> None:
    """Wake every sleeping component, or the named ones: on the device again those that were there
    (and every resident one). Waking what is awake is a no-op.

    Masters of a level-2 sleep are read back into memory of their own in the background after the
    wake returns (see ModuleStager.read_ahead): a load takes them as they arrive, a forward or an
    eviction once they are all read, and a level-1 sleep waits for them. Until then they are the files' pages,
    and the files must stay as they are (one that changes under a loaded component is noticed at
    its offload, and its masters are copied from the device)."""
    groups = _staging_groups(pipe)
    staged = [_staged_components(group, pipe) for group in groups]
    every = [name for names in staged for name in names]
    names = every if components is None else _names(components)
    unknown = sorted(set(names) - set(every))
    if unknown:
        raise ValueError(f"{unknown} are not staged components of this pipeline; choose from {sorted(every)}")
    for group, names_there in zip(groups, staged):
        _wake(group, [name for name in names if name in names_there])


def _wake(group: ResidencyGroup, names: list[str]) -> None:
    """Wake ``group``'s components ``names`` (see :func:`wake_up`)."""
    # Resident components first, largest first. The others keep their order: waking one that was
    # on the device evicts the others' evictable units, so the last of them is the one left loaded.
    woken = list(_units(group, names).values())
    resident = [all(unit.policy is Policy.RESIDENT for unit in units) for units in woken]
    by_size = sorted(
        (units for units, kept in zip(woken, resident) if kept),
        key=lambda units: -sum(unit.stager.weight_bytes for unit in units),
    )
    order = [unit for units in by_size + [units for units, kept in zip(woken, resident) if not kept] for unit in units]
    # Masters mapped from files (level 2) are copied from the files to the device, unit after unit,
    # and read back into memory of their own once every unit is on the device: read back while the
    # next unit is copied, they would take the host memory bandwidth that copy runs on.
    for unit in order:
        unit.stager.reads_back_after_loading = False
    kept = sum(len(units) for units in by_size)
    try:
        # The resident ones are kept on the device until the next sleep: see _device.segments_of_their_own.
        with _device.segments_of_their_own(group.device):
            for unit in order[:kept]:
                group.wake(unit)
        for unit in order[kept:]:
            group.wake(unit)
    finally:
        for unit in order:
            unit.stager.reads_back_after_loading = True
        for unit in order:
            if unit.sleep_level:
                continue  # not woken: the wake failed before it
            try:
                unit.stager.read_ahead()
            except Exception:
                # The wake stands: the masters stay mapped, and an offload checks their files
                # (see ModuleStager._settle_mapped_masters).
                logger.warning("Could not start reading %r's masters back from its files", unit.name, exc_info=True)


def is_sleeping(pipe: DiffusionPipeline) -> bool:
    """Whether any component of the pipeline is asleep (``residency_report()`` says which)."""
    for group in _staging_groups(pipe):
        shared = set(_staged_components(group, pipe))
        if any(unit.sleep_level for unit in group.units if unit.component in shared):
            return True
    return False


class AwakeRotation:
    """Several pipelines sharing one device: one awake at a time, the others asleep.

    ``rotation.use("sdxl")`` puts the awake pipeline to sleep first, so the device never holds two
    pipelines' weights at once, then wakes the one asked for and returns it. The sleeping one's
    device memory stays in the allocator's cache until the other has woken into it, and what is
    left is given back after: freed first, the memory made the wake's copies run about 1.6x slower
    (docs/measurements.md). Cache the woken pipeline's weights share a
    segment with stays reserved, for its calls to use (``memory_reserved()`` shows it).

    ``keep_cache=True`` gives nothing back at a switch: the process keeps the device memory of the
    largest pipeline (and of its calls' activations) reserved for as long as it runs, and each
    switch, towards a smaller pipeline as towards a larger one, wakes into memory the allocator
    already holds. The cost of a switch is then a sleep and a wake into the cache; the price is
    that no other process can use that memory meanwhile. The allocator still gives the cache back
    where one of this process's own allocations would fail without it, a pipeline under a VRAM
    budget gives it back at a component boundary where its retention budget says so, and a switch
    whose wake fails gives it back too::

        rotation = AwakeRotation({"flux": flux, "sdxl": sdxl})
        image = rotation.use("flux")(prompt).images[0]
        image = rotation.use("sdxl")(prompt).images[0]
    """

    def __init__(self, pipelines: Mapping[str, DiffusionPipeline], *, level: int = 1, keep_cache: bool = False) -> None:
        if not pipelines:
            raise ValueError("AwakeRotation needs at least one pipeline")
        self.pipelines = dict(pipelines)
        self.level = level
        self.keep_cache = keep_cache
        self.awake: str | None = None
        for pipe in self.pipelines.values():
            # Every refusal before any pipeline sleeps: a rotation refused leaves them all as they were.
            _refuse_sharing(pipe)
            plan = _sleep_plan(pipe, level, None, None)
            _checkpoint_folders(pipe, [name for name, at in plan.items() if at == 2])
        for pipe in self.pipelines.values():
            sleep(pipe, level)

    def use(self, name: str) -> DiffusionPipeline:
        if name not in self.pipelines:
            raise KeyError(f"no pipeline named {name!r}; choose from {sorted(self.pipelines)}")
        asleep = self.pipelines[self.awake] if self.awake not in (None, name) else None
        if asleep is not None:
            sleep(asleep, self.level, release_cache=False)
        # Before the wake: one that fails part-way is put back to sleep by the next switch.
        self.awake = name
        woke = False
        try:
            # A no-op for the pipeline awake already, unless its wake failed part-way: then a retry.
            wake_up(self.pipelines[name])
            woke = True
        finally:
            # A wake that failed (out of memory, say) gives the cache back whatever keep_cache says.
            if asleep is not None and not (woke and self.keep_cache):
                pipeline_state(asleep).group.retention.release(reason="switch")
        return self.pipelines[name]
