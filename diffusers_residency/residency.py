"""Which staged units are on the device, and who gets evicted when another component runs.

A :class:`ResidencyGroup` is the controller behind a set of hooks that share one device, one copy
stream and one retention budget: a pipeline's components under ``enable_pinned_offload()``, or any
modules a script attaches hooks to. Units belong to *components* (a component is one unit, or a
streamed component's trunk and blocks). When a non-resident component starts running, the group
evicts the other components' evictable units (staged ones, streamed blocks), as diffusers'
``model_cpu_offload_seq`` would; resident units are loaded on first use and stay; a streamed
component's blocks come and go through its :class:`~diffusers_residency.streaming.BlockStream`.
With a weight capacity from the plan, the next component in call order loads ahead when it fits.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from . import _device, files, pinning
from .budget_watch import BudgetWatch
from .conversions import check_sources_ahead
from .diffusers_hooks import casts_layerwise
from .host_copy import HostCopy
from .mapped_masters import FileBacking
from .masters import staged_by
from .placement import DeviceSlots
from .policy import Policy
from .retention import RetentionBudget
from .staging import ModuleStager
from .start_order import Start, StartOrder
from .streaming import BlockStream
from .weights import module_stored_tensors, module_tensors

logger = logging.getLogger(__name__)


# The largest block (bytes of its weights, at each load) whose load takes one device buffer, like a
# whole component's: one allocation, and one copy per run of masters side by side on the host,
# where a load per storage makes one of each per weight (SDXL's UNet and text encoder blocks load
# over a hundred times a call at 8 GB). Larger blocks keep one allocation per storage: one buffer
# per block of FLUX.1-dev (270 and 648 MiB) ran its transformer out of room under a 16 GB cap,
# where storages of their own fit between the activations.
ONE_BUFFER_BLOCK_BYTES = 128 << 20


@dataclass(eq=False)
class ResidencyUnit:
    """One module (a pipeline component, one of its blocks, or any submodule) under a group's control.

    ``component`` names what the unit belongs to (itself, unless it is a streamed block or trunk):
    a group evicts by component, so a component's own units never evict each other.
    """

    name: str
    module: nn.Module
    policy: Policy
    stager: ModuleStager
    component: str = ""
    # The block stream this unit is a block of, if any.
    stream: BlockStream | None = None
    releases: int = 0
    retains: int = 0
    original_device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # 0 awake; 1 asleep with host masters; 2 asleep with masters mapped from checkpoint files.
    sleep_level: int = 0
    load_on_wake: bool = False
    # Host time the package spent for this unit: making it ready at each forward (evictions, loads
    # issued, replans), at a wake or a move to the device, and casting its weights; waits for the
    # device in there (a cache release, the previous copy collected) included. A pipeline whose
    # host issues kernels more slowly than the device runs them pays it nearly in full.
    host_seconds: float = 0.0

    def __post_init__(self) -> None:
        self.component = self.component or self.name

    @property
    def evictable(self) -> bool:
        """Whether another component's need for room takes this unit off the device: staged units
        and streamed blocks are; resident units and a streamed component's trunk are kept."""
        return self.policy is Policy.STAGED or (self.policy is Policy.STREAMED and self.stream is not None)

    def load(self, *, ahead: bool = False, slots: DeviceSlots | None = None) -> None:
        """Load, waking a sleeping unit (the stager takes masters for weights replaced or added
        while offloaded; see ModuleStager.load). ``ahead``: loaded before it runs;
        ``stager.ready()`` is called where it does. ``slots``: device storage to load into, where
        it has some of the right layout."""
        if self.sleep_level:
            # Masters mapped from files (level 2) are copied from the files, and read back into
            # memory of their own after (see ModuleStager.read_ahead).
            logger.info("Waking %r (asleep at level %d)", self.name, self.sleep_level)
        if self.name == self.component:
            # A whole component (or a trunk) loads at most once a call: asked at each of its loads
            # whether layerwise casting is on, where a block's stager learns it at an offload (see
            # ResidencyGroup.add), a resident component enabled late would never offload to learn it.
            self.stager.note_moves_weights()
        self.stager.load(ahead=ahead, slots=slots)
        self.sleep_level = 0


class ResidencyGroup:
    """Loads units on demand and evicts other components' units, sharing one copy stream and retention budget.

    Args:
        device: where the units compute; ``None`` takes the current accelerator.
        pin_memory: pin the host masters (default: when ``device`` is an accelerator). Pinned masters
            are what make loads asynchronous and fast; on the CPU there is nothing to pin for.
        pin_budget: the most host memory the package may keep page-locked in this process, in bytes
            or as a fraction of the memory the process may have (default 0.75); masters beyond it
            stay pageable.
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        *,
        pin_memory: bool | None = None,
        pin_budget: int | float | None = None,
    ) -> None:
        self.device = _device.resolve_device(device)
        accelerated = _device.is_accelerator(self.device)
        if pin_memory is None:
            pin_memory = accelerated
        if pin_memory and not accelerated:
            raise ValueError(f"pin_memory=True needs an accelerator device, not {self.device}; leave it unset on the CPU")
        self.pin_memory = pin_memory
        self.pin_budget = pinning.resolve_pin_budget(pin_budget)
        self.retention = RetentionBudget(self.device)
        # Held for each pipeline call that runs these units (see calls._wrap_call): one call at a
        # time, so that a unit in use by one call is never offloaded under another's.
        self.call_lock = threading.RLock()
        self.copy_stream = _device.new_copy_stream(self.device)
        self.units: list[ResidencyUnit] = []
        # The component whose units ran last (resident ones aside): switching away from it is
        # what evicts.
        self.active_component: str | None = None
        # Times evict_others handed the device to a component: a block stream times a step only
        # between two (see BlockStream).
        self.switches = 0
        # Pipeline calls begun (see calls._wrap_call): where every other component stays resident,
        # nothing switches between two calls, and a block stream tells its calls apart by these.
        self.calls = 0
        # Pipeline calls under way (a call inside another counts too): a cast made while one is
        # runs inside that call (see ConversionReuse.convert).
        self.calls_running = 0
        # Per component cast (``module.to(dtype)``) in the outermost call under way, the dtype it had
        # before the first of them, then each it was cast to: a profile keeps the round trips, to
        # make them before a later process's first call (see casts.warm_casts).
        self.casts_in_call: dict[str, list[torch.dtype | None]] = {}
        # Components whose round trip was made before the first call (see casts.warm_casts) on no
        # more than a guess: the first call that does not make it lets go of what it kept.
        self.casts_made_ahead: set[str] = set()
        # Set while a unit's hook casts its weights: the cast recurses into the unit's blocks, whose
        # hooks leave the timing to the outermost one (see ResidencyUnit.host_seconds).
        self.casting = False
        # The dtype of a ``module.to(dtype)`` under way, for the hooks of the blocks it recurses into.
        self.cast_dtype: torch.dtype | None = None
        # Components in call order, and the most weight bytes the group may hold while a given
        # component runs: together they let the next component load ahead while the current one
        # computes. No room, no loading ahead.
        self.call_order: tuple[str, ...] = ()
        self.weight_room: Callable[[str], int] | None = None
        # What started after what in the last calls, for loading ahead (see _load_ahead).
        self.start_order = StartOrder()
        # The budget watched at each switch, under a budget (see adaptive, which sets it).
        self.budget_watch: BudgetWatch | None = None
        # Set while a measured call waits for a component's inputs to estimate its need from, before
        # it starts (see dry_run_plans.estimate_at_start): told each whole component's and trunk's inputs.
        self.estimate_from_inputs: Callable[[str, tuple, dict], None] | None = None
        # Set while a call runs under a plan made from those estimates: makes the most room the
        # budget has for a component (the denoiser, the decoder) that ran out of device memory
        # under it, before it runs again (see retry_with_room.retried_with_room).
        self.make_room_to_retry: Callable[[str], None] | None = None
        # Set while a call runs under a plan made from those estimates whose denoiser has no step
        # timed yet: plans its other steps once one is (see dry_run_plans.plan_from_timed_step).
        self.plan_from_timed_step: Callable[[str], None] | None = None
        # Modules (by id) whose masters are served from checkpoint files for good, under a host
        # budget: set before they are added (see host_budget), so that their weights are never
        # copied or page-locked on the way.
        self.file_backing: dict[int, FileBacking] = {}
        # The copy of the weights that the ranks of this host share (see shared_masters), if any:
        # set before the units are added, which read their masters from it.
        self.host_copy: HostCopy | None = None

    @contextlib.contextmanager
    def running_call(self) -> Iterator[None]:
        """A pipeline call runs these units (or work that stands for one: see casts.warm_casts):
        counted; if it is the outermost, its casts noted afresh and the comparisons its first casts
        make started (see conversions.check_sources_ahead)."""
        self.calls += 1
        self.calls_running += 1
        try:
            if self.calls_running == 1:
                self.casts_in_call = {}
                check_sources_ahead([unit.stager for unit in self.units], self.calls)
            yield
        except BaseException:
            for stream in {id(unit.stream): unit.stream for unit in self.units if unit.stream is not None}.values():
                stream.forget_unfinished_pass()
            raise
        finally:
            self.calls_running -= 1
            if not self.calls_running and self.casts_made_ahead:
                self._let_go_of_casts_not_made()

    def _let_go_of_casts_not_made(self) -> None:
        """The first call since casts were made ahead of it ended: a component it did not cast (a
        pipeline returning latents never decodes) lets go of the masters kept for the round trip,
        which would otherwise take host memory for good (a VAE that never loads never lets go of
        them on its own, see ConversionReuse). Nothing reads them: a load of their dtype would
        have followed a cast."""
        unused, self.casts_made_ahead = self.casts_made_ahead - self.casts_in_call.keys(), set()
        for name in unused:
            for unit in self.units_of(name):
                unit.stager.forget_conversions()

    def note_cast(self, component: str, module: nn.Module, dtype: torch.dtype) -> None:
        """``module``, of ``component``, is about to be cast to ``dtype``: noted if a call runs."""
        if self.calls_running:
            if component not in self.casts_in_call:
                # Read once a call: a diffusers model's dtype walks its parameters.
                self.casts_in_call[component] = [getattr(module, "dtype", None)]
            self.casts_in_call[component].append(dtype)

    @property
    def measures_next_call(self) -> bool:
        """Whether the next whole call is measured (see :class:`~.budget_watch.BudgetWatch`)."""
        return self.budget_watch is not None and self.budget_watch.measures_next_call

    @property
    def times_steps(self) -> bool:
        """Whether block streams time their steps (see BlockStream): without a budget watch always
        (the report shows them), with one only where a plan will use them."""
        return self.budget_watch is None or self.budget_watch.wants_timed_steps

    def first_pass_ran(self, component: str) -> None:
        """A streamed component's first pass (a denoiser's first step) ran: told to the budget watch."""
        if self.budget_watch is not None:
            self.budget_watch.first_pass_ran(component)

    def timed_step_ran(self, component: str) -> None:
        """A pass of a streamed component begins, one of its steps having been timed in its
        activation: told to the plan waiting for that timing, if any."""
        if self.plan_from_timed_step is not None:
            self.plan_from_timed_step(component)

    def load_resident_ahead(self) -> None:
        """Start loading every resident unit that is not on the device, a plan having just made them
        resident: the copies run back to back at the bus's rate, behind whatever the device does
        next, rather than each in front of its unit's first forward, with the compute waiting.
        Evictable units go first, and the cache with them, so that the loads fit under a cap."""
        for unit in self.units:
            if unit.evictable and unit.stager.loaded:
                unit.stager.offload()
        self.active_component = None
        _device.empty_cache(self.device)
        with _device.segments_of_their_own(self.device):
            for unit in self.units:
                if unit.policy is Policy.RESIDENT and not unit.stager.loaded and not unit.sleep_level:
                    unit.load(ahead=True)
        if self.budget_watch is not None:
            self.budget_watch.forget_retries()  # allocations that retried here are no component's shortfall

    def check_can_add(self, module: nn.Module, name: str, exclude: tuple[nn.Module, ...] = ()) -> None:
        """Refuse a module that shares weights with a unit already in the group: two stagers would
        each take a master of the same storage and rebind it behind the other's back."""
        ours = {id(unit.stager) for unit in self.units}
        if any(id(staged_by(t)) in ours for t in module_stored_tensors((module,), exclude)):
            raise ValueError(
                f"{name!r} shares weights with a module this group already stages; stage the enclosing "
                "module or its parts, not both"
            )

    def add(
        self,
        name: str,
        module: nn.Module,
        policy: str | Policy = Policy.STAGED,
        *,
        component: str | None = None,
        exclude: tuple[nn.Module, ...] = (),
    ) -> ResidencyUnit:
        """Stage ``module`` (less the submodules in ``exclude``) as one unit of ``component``."""
        policy = Policy.parse(policy, name)
        self.check_can_add(module, name, exclude)
        original_device = next((t.device for t in module_tensors((module,), exclude)), torch.device("cpu"))
        # A whole component, or a streamed one's trunk, may load into one device buffer, and so may
        # a block of at most ONE_BUFFER_BLOCK_BYTES; larger blocks load one allocation per storage
        # (see ModuleStager._placed). So do units under layerwise casting: it moves each cast weight
        # to storage of its own at every forward and leaves the rest (norms, embeddings) where the
        # load put them, which in one buffer would hold every replaced copy's memory too, for as
        # long as the unit is loaded. (Asked when masters are taken, at an offload that finds weights
        # moved to storage of their own, and at each load of a whole component: it may be enabled
        # after the hooks; see ModuleStager and ResidencyUnit.load.)
        whole = component is None or component == name
        stager = ModuleStager(
            module,
            self.device,
            pin_memory=self.pin_memory,
            pin_budget=self.pin_budget,
            copy_stream=self.copy_stream,
            retention=self.retention,
            exclude=exclude,
            one_buffer=lambda nbytes: whole or nbytes <= ONE_BUFFER_BLOCK_BYTES,
            moves_weights=lambda: casts_layerwise(module),
            file_backing=self.file_backing.get(id(module)),
            host_copy=self.host_copy,
        )
        unit = ResidencyUnit(
            name=name,
            module=module,
            policy=policy,
            stager=stager,
            component=component or name,
            original_device=original_device,
        )
        self.units.append(unit)
        return unit

    def remove(self, unit: ResidencyUnit) -> None:
        """Offload the unit and stop managing it; its tensors stay bound to their host masters."""
        unit.stager.close()
        self.units.remove(unit)
        self.file_backing.pop(id(unit.module), None)  # an id the module may leave to another
        ring = unit.stager.file_ring
        if ring is not None and all(other.stager.file_ring is not ring for other in self.units):
            ring.close()  # the last unit that loaded through it is gone

    def forget_estimates(self) -> None:
        """Ask for no estimate and make no room for a retry: the measured call they were set for
        ended, or the setup is replaced."""
        self.estimate_from_inputs = None
        self.make_room_to_retry = None
        self.plan_from_timed_step = None

    def units_of(self, component: str) -> list[ResidencyUnit]:
        return [unit for unit in self.units if unit.component == component]

    def stream_of(self, component: str) -> BlockStream | None:
        """The stream of ``component``'s blocks, if it streams them."""
        return next((unit.stream for unit in self.units_of(component) if unit.stream is not None), None)

    def activate(self, unit: ResidencyUnit) -> None:
        """Make sure ``unit`` is on the device, evicting other components' units when its component
        takes over. Runs in every ``pre_forward``, so the common case returns at once (timed: two
        clock reads, about a quarter of a microsecond)."""
        started = time.perf_counter()
        try:
            self._activate(unit)
        finally:
            unit.host_seconds += time.perf_counter() - started

    def _activate(self, unit: ResidencyUnit) -> None:
        # When another component starts (not at every step of the same one, nor at every block: reading
        # the allocator's statistics builds a dict of them all).
        watch = self.budget_watch
        measuring = (
            watch is not None
            and unit.stream is None
            and unit.component != watch.running
            and watch.component_starts(unit.component)
        )
        switched = unit.policy is not Policy.RESIDENT and unit.component != self.active_component
        if switched:
            # A resident unit never switches: it may run interleaved with the others (a ControlNet
            # inside the denoising loop) and needs no room made for it.
            self.evict_others(unit.component)
        if measuring:
            watch.measure_from_here()
        if unit.stream is not None:
            unit.stream.enter(unit)
        elif not unit.stager.loaded:
            waking = unit.sleep_level and unit.name == unit.component
            unit.load()
            if waking:
                # With its trunk, every block wakes, those the call never runs too (a VAE's encoder):
                # asleep, they would keep the component asleep, at the level they slept at.
                for block in self.units_of(unit.component):
                    if block.sleep_level:
                        self.wake(block)
        else:
            unit.stager.ready()  # loaded ahead: the compute stream waits for the copy from here
        if switched:
            self._load_ahead(self.start_order.note(unit.component, self.calls, self.calls_running > 0))

    def evict_others(self, component: str | None) -> None:
        """Offload the evictable units of every component but ``component``, which becomes the active
        one; then let the retention budget decide whether this boundary gives the allocator's cache
        back."""
        self.active_component = component
        self.switches += 1
        evicted = [u for u in self.units if u.component != component and u.evictable and u.stager.loaded]
        if not evicted:
            return
        for unit in evicted:
            unit.stager.offload()
        if self.weight_room is not None and component is not None:
            # Cache above this is in the room the component's activations were planned to take.
            self.retention.reserved_limit = self.weight_room(component)
        decision = self.retention.at_boundary(component)
        last = evicted[-1]
        if decision.released:
            last.releases += 1
        else:
            last.retains += 1

    def loaded_bytes(self) -> int:
        return sum(unit.stager.weight_bytes for unit in self.units if unit.stager.loaded)

    def _load_ahead(self, start: Start) -> None:
        """Start loading the component expected after ``start`` (see :class:`~.start_order.StartOrder`),
        whole, if the room for weights while ``start``'s component runs holds it beside what is
        loaded: its copy then runs behind this component's compute. Of a streamed one only its trunk:
        its staged blocks load in its first pass (see BlockStream), as queued here their copies would
        go before every blocking copy the pipeline makes until then, holding the host
        (docs/vram-budget.md#loading-ahead)."""
        component = start[0]
        following = self.start_order.following(start, self.call_order, self.calls_running > 0)
        if self.weight_room is None or following is None:
            return
        if any(u.stream is not None for u in self.units_of(component)):
            return  # a streaming component's next blocks need the room the plan gave its window
        whole = [u for u in self.units_of(following) if u.stream is None and not u.stager.loaded and not u.sleep_level]
        if not whole or sum(u.stager.weight_bytes for u in whole) > self.weight_room(component) - self.loaded_bytes():
            return
        logger.debug("Loading %r ahead", following)
        for unit in whole:
            unit.load(ahead=True)

    def offload_component(self, component: str, *, for_writing: bool = False) -> None:
        """Offload every unit of ``component``; with ``for_writing``, also wait until no copy still
        reads their masters, which are about to be written."""
        for unit in self.units_of(component):
            if for_writing:
                unit.stager.offload_for_writing()
            else:
                unit.stager.offload()
        if self.active_component == component:
            self.active_component = None

    def own_copies_of_written(self, component: str | None = None) -> None:
        """After a method wrote into the offloaded weights of ``component`` (None: of every one):
        masters read from the host's copy that this rank wrote get copies of their own (see
        shared_masters), which the next loads read. Nothing to do without a host copy."""
        if self.host_copy is None:
            return
        for unit in self.units if component is None else self.units_of(component):
            unit.stager.copy_written_pages()

    def sleep(
        self, unit: ResidencyUnit, level: int, sources: Mapping[int, files.MappedBytes] | None = None
    ) -> None:
        """Put ``unit`` to sleep: level 1 keeps its host masters, level 2 also swaps every master that
        ``sources`` (a memory-mapped checkpoint) holds byte for byte for its view there.

        A unit already asleep keeps its level: changing it would mean waking it first, which the
        caller did not ask for, so the request is logged as a warning and ignored.
        """
        if unit.sleep_level:
            if unit.sleep_level != level:
                logger.warning(
                    "%r is already asleep at level %d; keeping that level (asked for %d). Wake it first to change it.",
                    unit.name,
                    unit.sleep_level,
                    level,
                )
            return
        # Streamed blocks come back when they run; everything else that was on the device comes
        # back at wake.
        streamed_block = unit.stream is not None and unit.policy is Policy.STREAMED
        load_on_wake = unit.policy is Policy.RESIDENT or (unit.stager.loaded and not streamed_block)
        unit.stager.offload()
        if level == 2:
            unit.stager.map_masters(sources or {})
        elif unit.stager.maps_files:
            # Level 1 keeps masters in memory: those still mapped since a level-2 wake are read
            # back first (the read that wake started, waited for).
            unit.stager.unmap_masters()
        unit.load_on_wake = load_on_wake
        unit.sleep_level = level
        if self.active_component == unit.component:
            self.active_component = None

    def wake(self, unit: ResidencyUnit) -> None:
        """Wake ``unit``: on the device again if it was there (or is resident). A no-op for a unit
        that is awake. Masters mapped from files stay so: the caller reads them back (see
        ModuleStager.read_ahead)."""
        if not unit.sleep_level:
            return
        if not unit.load_on_wake:
            for file in unit.stager.mapped_files():
                file.refuse_if_changed()
            unit.sleep_level = 0
        elif unit.stream is None:
            self.activate(unit)
        else:
            unit.load()
