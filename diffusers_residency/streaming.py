"""Stream a component's repeated blocks through the device, a few at a time.

A component too large for the device (or for its share of a VRAM budget) is split into its *trunk*
(embeddings, norms, projections: everything outside the blocks) and its repeated blocks, the ones
diffusers lists in ``_repeated_blocks`` and transformers in ``_no_split_modules``. Each block gets a
stager of its own. The trunk and some of the blocks (chosen by the planner) stay on the device;
every other block is loaded just before it runs and dropped after, while the next few load on the
copy stream behind the compute.

Device memory for streamed blocks is not allocated anew at each step: a dropped block hands its
storage to the block that loads in its place through the stream's :class:`~.placement.DeviceSlots`
(the copy into it first waits for the compute that last read it; see ``_device.TimedCopy``), so the
window's storage is allocated when the component starts running and goes back to the allocator with
the last blocks loaded, when another component evicts them.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from . import _device
from .placement import DeviceSlots
from .policy import Policy
from .staging import ModuleStager
from .step_timing import compute_shares
from .weights import shared_tensor

logger = logging.getLogger(__name__)

# Steps timed per activation of a streamed component (a pipeline call), from its second on; their
# median is the step the planner is given. One step's time moves with a garbage collection, an
# allocator retry or another process on the device, and a plan chosen from it moved with it.
STEPS_TIMED = 5


class Block(Protocol):
    """What a stream needs of one of its blocks (a residency unit): its stager, its policy, and its load."""

    name: str
    policy: Policy
    stager: ModuleStager

    def load(self, *, ahead: bool = False, slots: DeviceSlots | None = None) -> None: ...


class StreamOwner(Protocol):
    """What a stream needs of the group it runs in (a residency group)."""

    # How many times the device has switched from one component to another, and how many pipeline
    # calls began: a stream that sees either move knows its next pass begins a new activation.
    switches: int
    calls: int
    # Whether a pass timed now would be used (see ResidencyGroup.times_steps), and whether the call
    # under way or the next is measured (see ResidencyGroup.measures_next_call).
    times_steps: bool
    measures_next_call: bool

    def first_pass_ran(self, component: str) -> None:
        """Told once a component's blocks have run through once in a call."""

    def timed_step_ran(self, component: str) -> None:
        """Told as each pass of a component begins once one of its steps was timed in its activation."""


def repeated_blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost submodules of a repeated-block class, in definition order; none where they
    share a tensor with each other or with the rest of ``module``.

    The classes come from the model itself: diffusers' ``_repeated_blocks`` (what regional
    compilation compiles), else the ``_no_split_modules`` that diffusers and transformers keep for
    device maps, which name the same units: blocks that hold together and never share weights
    with the rest. A model tied otherwise (a weight tied across blocks by hand) is not streamed: a
    tensor staged with one block would be on the host when the other holder runs."""
    names = set(getattr(module, "_repeated_blocks", None) or getattr(module, "_no_split_modules", None) or ())
    if not names:
        return []
    blocks: list[tuple[str, nn.Module]] = []
    inside: list[str] = []
    for path, sub in module.named_modules():
        if not path or any(path.startswith(prefix + ".") for prefix in inside):
            continue
        if type(sub).__name__ in names:
            blocks.append((path, sub))
            inside.append(path)
    shared = shared_tensor(module, blocks)
    if shared is not None:
        logger.debug("%s's %r and %r share a tensor: no block of it streams", type(module).__name__, *shared)
        return []
    return blocks


class BlockStream:
    """The loading order of one component's blocks, and the window of blocks loaded ahead.

    The order is the one the forward really takes: definition order at first (or the order a dry
    run of the pipeline's default call took, see :meth:`expect_order`), then, from the second pass
    on, the blocks entered during the first pass, in that order (a pass ends when a block is
    entered again). A block entered out of that order (a cache hook skipping blocks, a
    branch not taken in the first pass) is loaded on the spot if it is not already there; nothing
    is ever read from a block that is not loaded, so skipping cannot corrupt the stream, only cost a
    wait.

    From the second pass of every activation of the component (the second denoising step of a
    call) on, up to :data:`STEPS_TIMED` passes are timed on the compute stream, block by block:
    from the end of a block's entry (its weights waited for) to the next block's entry, so the
    pass's last block also counts the work up to the next pass (the scheduler's step, the trunk).
    :meth:`step_compute_seconds` sums them: what a step computes, beside what it loads, says
    whether the bus or the compute sets its pace. A pass cut by a switch to another component, or
    by the end of its call, is not counted. Under a plan that no longer reads them (see
    ``ResidencyGroup.times_steps``) no pass is timed, and the last ones timed stand.
    """

    def __init__(
        self, component: str, blocks: Sequence[Block], prefetch_blocks: int, group: StreamOwner
    ) -> None:
        self.component = component
        self.group = group
        self.blocks = tuple(blocks)
        self.prefetch_blocks = prefetch_blocks
        self._order: tuple[Block, ...] = self.blocks
        self._recording: list[Block] | None = []
        # The pipeline call (the group's count) the recording last grew in.
        self._recorded_in_call = -1
        self._windows: dict[int, tuple[Block, ...]] = {}
        self._kept_windows: dict[int, tuple[Block, ...]] = {}
        self._kept_behind_first: tuple[Block, ...] = ()
        # Streamed blocks this stream loaded and has not dropped yet, and those of them that ran
        # under autograd (see enter).
        self._held: list[Block] = []
        self._ran_under_grad: set[Block] = set()
        # Storage of the blocks dropped at one entry, for the blocks loaded at the same entry.
        self.slots = DeviceSlots()
        # The pass being timed: (start, end) compute timestamps per block, and the block running
        # with its start. Passes are counted within an activation: from the group's switch and
        # call counts they began at.
        self._stamps: dict[Block, tuple] | None = None
        self._running: tuple[Block, torch.Event | float] | None = None
        self._activation: tuple[int, int] | None = None
        self._passes = 0
        # Whether the windows wrap around, loading the top blocks behind the last ones for a next
        # pass; whether the component's activations run one pass alone (None: none ran whole yet).
        # See _learn_wrapping.
        self._wraps = True
        self._one_pass_alone: bool | None = None
        # The first pass ever timed, and those of the latest activation that timed one: their
        # stamps until read, then their seconds per block.
        self._first_step: dict[Block, tuple] | tuple[float, ...] | None = None
        self._latest_steps: list[dict[Block, tuple] | tuple[float, ...]] = []
        self._timed_in_activation = 0
        # How many passes were timed: whether one was timed after a given moment.
        self.steps_timed = 0
        self._compute_windows()

    @property
    def order(self) -> tuple[str, ...]:
        return tuple(unit.name for unit in self._order)

    def expect_order(self, run_order: Sequence[tuple[int, type]], blocks: int) -> None:
        """Load ahead in ``run_order`` (positions of the blocks and their classes, as a whole dry
        run of the pipeline's default call ran them on a module of ``blocks`` repeated blocks, see
        ``replayed_blocks.BlockInputs``) until a pass of a real call records its own. Definition
        order is not the order every model runs: SDXL's UNet defines its mid block after its up
        blocks, and a VAE decoding runs its decoder's blocks alone; a first pass in definition
        order loads each block out of turn on the spot, its copy in front of its compute. Ignored
        where the blocks are not the dry run's (another count, or a class that differs), or once a
        pass recorded an order."""
        stream_blocks = self.blocks
        if self._recording is None or not run_order or blocks != len(stream_blocks):
            return
        if any(not 0 <= at < blocks or type(stream_blocks[at].module) is not cls for at, cls in run_order):
            return
        order = tuple(stream_blocks[position] for position, _ in run_order)
        if order != self._order:
            self._order = order
            self._compute_windows()

    def _compute_windows(self) -> None:
        """For each block, the streamed blocks that follow it in order, wrapping around: the next
        pass (the next denoising step) starts again at the top (not for a component whose
        activations run one pass alone, see :meth:`_learn_wrapping`). A resident block holds no slot of
        the window while it runs, so the slot a streamed block would take loads one more ahead.

        Also the kept blocks that follow it, as many of each policy: staged ones, loaded once per
        activation in its first pass, and resident ones that a plan made while the component runs
        has not loaded yet (see ``dry_run_plans.estimate_at_start`` and ``plan_from_timed_step``). They
        load ahead too, so that their copies run behind the compute of the blocks before them
        rather than each in front of its own block (a whole step's worth of copy time, for SDXL's
        UNet at 8 GB). Apart: resident blocks, loaded but for those, would take staged ones' places.

        Where no block streams, the kept blocks past the first block's kept window are queued
        before its forward too (see :meth:`_load_kept_behind_first`)."""
        windows, kept = {}, {}
        for position, unit in enumerate(self._order):
            depth = self.prefetch_blocks + (unit.policy is not Policy.STREAMED)
            windows[id(unit)] = self._following(position, Policy.STREAMED, depth)
            kept[id(unit)] = (
                self._following(position, Policy.STAGED, self.prefetch_blocks)
                + self._following(position, Policy.RESIDENT, self.prefetch_blocks)
            )
        self._windows, self._kept_windows = windows, kept
        streams = any(unit.policy is Policy.STREAMED for unit in self._order)
        head = {id(unit) for unit in kept.get(id(self._order[0]), ())} if self._order else set()
        self._kept_behind_first = (
            ()
            if streams or not self.prefetch_blocks
            else tuple(unit for unit in self._order[1:] if id(unit) not in head)
        )

    def _load_kept_behind_first(self) -> None:
        """Queue the loads of the kept blocks (staged, or resident and not loaded yet) past the
        first block's kept window, in the order they run, before the first block's forward (see
        :meth:`_compute_windows`). With no block streaming, every copy queued behind theirs is a
        later block's: the copy stream is kept busy through the first pass, where a window of
        ``prefetch_blocks`` leaves it idle under blocks whose compute outlasts the next copies (a
        UNet's resnets at full resolution) and compute waiting under blocks whose copies outlast
        it (its low-resolution transformer blocks). Not before the order is learned (a first pass
        in definition order would queue SDXL's mid block behind its up blocks), and up to the
        first block whose masters are not all page-locked (before its load, or after it: a load
        may take masters anew): its copies would hold the host (pageable memory, a ring from the
        files) while the first blocks' compute waits to be queued."""
        if self._recording is not None:
            return
        for block in self._kept_behind_first:
            if block.stager.loaded:
                continue
            if not block.stager.pinned:
                return
            block.load(ahead=True)
            if not block.stager.pinned:
                return

    def _following(self, position: int, policy: Policy, depth: int) -> tuple[Block, ...]:
        """Up to ``depth`` blocks of ``policy`` after ``position`` in order, wrapping around where
        the windows do (see :meth:`_learn_wrapping`)."""
        order = self._order
        count = len(order)
        ahead = []
        for step in range(1, count if self._wraps else count - position):
            if len(ahead) >= depth:
                break
            candidate = order[(position + step) % count]
            if candidate.policy is policy:
                ahead.append(candidate)
        return tuple(ahead)

    def replan(self, prefetch_blocks: int | None = None) -> None:
        """Recompute the windows after block policies changed (other resident blocks), loading
        ``prefetch_blocks`` ahead from here on where given."""
        if prefetch_blocks is not None:
            self.prefetch_blocks = prefetch_blocks
        self._compute_windows()

    def step_compute_seconds(self) -> tuple[float, float] | None:
        """Compute seconds of the first step ever timed, and the median of those timed in the
        latest activation that timed one (None before a whole step was timed, in a call of three
        steps or more). Reading waits for those steps to have run on the device."""
        if not self._latest_steps:
            return None
        self._first_step = self._block_seconds(self._first_step)
        self._latest_steps = [self._block_seconds(stamps) for stamps in self._latest_steps]
        return sum(self._first_step), statistics.median(sum(step) for step in self._latest_steps)

    def step_compute_shares(self) -> tuple[float, ...] | None:
        """Each block's part of a step's compute, in block order, in the step of median length among
        those :meth:`step_compute_seconds` takes the median of (the shorter of the two middle ones
        for an even count; None as there). One step's, not each block's median: steps that skip
        blocks (a cache hook) would leave the skipped ones none. Blocks of one size differ: a
        FLUX.1-dev double-stream block holds 2.4x a single-stream one's weights for about the same
        compute."""
        if self.step_compute_seconds() is None:
            return None
        by_length = sorted(self._latest_steps, key=sum)
        return compute_shares(by_length[(len(by_length) - 1) // 2])

    def step_so_far(self) -> tuple[float, ...] | None:
        """Compute seconds of each block in the first step timed in the activation under way (a
        call's second step), once the device has run it; None before. Asked, not waited for: read
        in the middle of a call (see ``dry_run_plans.plan_from_timed_step``), waiting would hold the
        host until the device caught up, and the device would then idle while the host planned."""
        if not self._timed_in_activation:
            return None
        first = self._latest_steps[0]
        if not isinstance(first, tuple):
            if not first or not all(_device.has_passed(end) for _, end in first.values()):
                return None
            self._latest_steps[0] = first = self._block_seconds(first)
        return first

    def _block_seconds(self, stamps: dict[Block, tuple] | tuple[float, ...]) -> tuple[float, ...]:
        """A timed pass's compute seconds per block, in block order (none for a block it did not
        run), from its (start, end) stamps once read."""
        if isinstance(stamps, tuple):
            return stamps
        return tuple(_device.seconds_between(*stamps[block]) if block in stamps else 0.0 for block in self.blocks)

    def _pass_begins(self, unit: Block) -> None:
        activation = (self.group.switches, self.group.calls)
        if activation != self._activation:
            self._learn_wrapping(self._passes if self._activation is not None else None)
            # Another component ran since this one last did, or another call began: a pass they
            # cut short is not a step.
            self._activation, self._passes, self._timed_in_activation = activation, 0, 0
            self._stamps = self._running = None
        elif self._stamps is not None:
            if self._running is not None:
                self._stamp_end(unit)
            if not self._timed_in_activation:
                self._latest_steps = []
            self._latest_steps.append(self._stamps)
            self._timed_in_activation += 1
            self.steps_timed += 1
            if self._first_step is None:
                self._first_step = self._stamps
            self._stamps = None
        self._passes += 1
        if 2 <= self._passes <= STEPS_TIMED + 1 and self.group.times_steps:
            self._stamps = {}
        if self._passes == 2:
            self.group.first_pass_ran(self.component)
        if self._timed_in_activation:
            self.group.timed_step_ran(self.component)

    def _learn_wrapping(self, passes: int | None) -> None:
        """An activation of the component begins, the one before having run ``passes`` passes (None:
        not known, cut short). Where each ran one alone (a text encoder's, a decode's), the top
        blocks that the last ones' windows loaded for a next pass were evicted unused as the next
        component started, a text encoder's among the largest (two of T5-XXL's blocks are 0.8 GB),
        and their copies went before the next component's: the windows stop wrapping around. One
        activation of several passes (a denoiser's steps, a tiled decode's tiles) makes them wrap
        for good.

        They wrap in a measuring call all the same: its component's need is its peak less the
        weights loaded as the next one starts (see ``BudgetWatch``), which a window wrapping around
        holds as it held them at the peak, and the last blocks alone do not."""
        if passes is not None and self._one_pass_alone is not False:
            self._one_pass_alone = passes == 1
        wraps = not self._one_pass_alone or self.group.measures_next_call
        if wraps != self._wraps:
            self._wraps = wraps
            self._compute_windows()

    def _stamp_end(self, unit: Block) -> None:
        ran, started = self._running
        self._stamps[ran] = (started, _device.compute_timestamp(unit.stager.device))
        self._running = None

    def _learn(self, unit: Block) -> None:
        recording = self._recording
        if unit in recording:
            self._recording = None
            if tuple(recording) != self._order:
                # Blocks the pass did not run (a VAE's encoder when only decoding) leave the order:
                # they are never loaded ahead, only on the spot if they ever run.
                logger.info("%r runs %d of its %d blocks in an order of its own; prefetching in that order",
                            self.component, len(recording), len(self.blocks))  # fmt: skip
                self._order = tuple(recording)
                self._compute_windows()
            return
        recording.append(unit)
        self._recorded_in_call = self.group.calls

    def forget_unfinished_pass(self) -> None:
        """The call under way cut this component's pass short (it raised, or runs a step or a decode
        again from its start: see ``dry_run_plans.make_room_to_retry``): a first pass it recorded is only
        that pass's start, and taken for the order it would leave the blocks after it out of
        prefetching for good. Recorded again from the next pass. A pass recorded whole in an earlier
        call stays.

        Nor is the pass cut short a step: passes are counted again from the next one, which is the
        first (so a step run again is told as a first step's, see ``first_pass_ran``, once it ran
        whole), and the cut one is not timed."""
        if self._recording is not None and self._recorded_in_call == self.group.calls:
            self._recording = []
        self._activation = None

    def enter(self, unit: Block) -> None:
        """``unit`` is about to run: have it loaded, drop streamed blocks outside its window, and
        start loading the window. Runs before every block's forward, so it allocates nothing but
        device storage for loads that no dropped block's storage fits."""
        if self._recording is not None:
            self._learn(unit)
        first = unit is self._order[0]
        if first:
            self._pass_begins(unit)
        if self._running is not None:
            self._stamp_end(unit)
        window = self._windows.get(id(unit), ())
        keep = (unit, *window)
        held = []
        try:
            for other in self._held:  # dropped first: their room is what the next loads take
                if other in keep:
                    held.append(other)
                elif other.policy is Policy.STREAMED:
                    # Run under autograd, the dropped block's storage may be saved for a backward
                    # pass (a linear layer saves its weight): handed on, that backward would read
                    # the next block's weights. Freed instead, it lives as long as what saved it.
                    other.stager.offload(slots=None if other in self._ran_under_grad else self.slots)
                    self._ran_under_grad.discard(other)
                # else planned to stay since it loaded (a measuring call's first step): it stays.
            if unit.stager.loaded:
                unit.stager.ready()  # loaded ahead: the compute stream waits for its copy from here
            else:
                unit.load(slots=self.slots)
            for ahead in window:
                if not ahead.stager.loaded:
                    ahead.load(ahead=True, slots=self.slots)
                if ahead not in held:
                    held.append(ahead)
            for ahead in self._kept_windows.get(id(unit), ()):
                if not ahead.stager.loaded:
                    ahead.load(ahead=True)  # kept while the component runs: never held, never dropped here
            if first:
                self._load_kept_behind_first()
            if unit not in held and unit.stager.loaded and unit.policy is Policy.STREAMED:
                held.append(unit)
            if unit.policy is Policy.STREAMED and torch.is_grad_enabled():
                self._ran_under_grad.add(unit)
            self._held = held
            if self._stamps is not None:
                self._running = (unit, _device.compute_timestamp(unit.stager.device))
        except BaseException:
            # Blocks loaded before the failure are held, so that a later entry drops them.
            self._held = [block for block in self.blocks if block.stager.loaded and block.policy is Policy.STREAMED]
            raise
        finally:
            # Storage dropped here and not taken back (fewer blocks loaded than dropped, or a load
            # that failed) is the allocator's again: between two entries the slots hold nothing, so
            # an eviction, a sleep or the end of the call finds every byte of the component in its
            # loaded blocks.
            self.slots.clear()
