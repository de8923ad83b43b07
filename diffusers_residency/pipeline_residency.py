"""What ``enable_pinned_offload`` set up on one pipeline (:class:`PipelineResidency`), and how a
plan is put in place on it: the policies of its units, the room left for weights, a plan made again
for new figures on the hooks that were attached. The modules that plan a pipeline's calls share
these: ``adaptive`` (what calls teach), ``dry_run_plans`` (a first call planned from estimates).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from diffusers import DiffusionPipeline
from torch import nn

from .dry_runs import CallDryRuns
from .guards import STATE_ATTR
from .hooks import StagingHook
from .plans import ComponentPlan, ResidencyPlan
from .policy import Policy
from .profile import ResidencyProfile
from .residency import ResidencyGroup
from .step_timing import StepTiming

logger = logging.getLogger(__name__)

# Kept on top of what a component was measured to need above its weights, as a fraction of the
# budget: the next call's activations may differ a little (another prompt length, say).
RESERVE_MARGIN = 0.02
# How a plan made from estimates says where they come from: a larger call shape's figures (see
# adaptive.begin_call), or dry runs of the call under way (see dry_run_plans.estimate_at_start).
ESTIMATED = "estimated"
COVERING = f"{ESTIMATED} from calls of"
DRY_RUN = f"{ESTIMATED} by dry runs of this call's denoiser and decoder"
# The plan made at enable with no profile (see adaptive.plan_ahead): dry runs of the default call.
AT_ENABLE = f"{ESTIMATED} at enable by dry runs of a call of the pipeline's default shape"


@dataclass
class PipelineResidency:
    """What ``enable_pinned_offload`` set up on one pipeline."""

    group: ResidencyGroup
    hooks: dict[str, StagingHook]
    plan: ResidencyPlan
    # The plan for given per-component activations, with everything else as enabled (and the
    # policies given pinned besides).
    replan: Callable[..., ResidencyPlan]
    # Whether calls are measured: the first of each call shape measures each component's
    # activations (no reserve given, and a plan that does not keep everything on the device).
    measuring: bool = False
    # The first and last components of model_cpu_offload_seq: the ones that begin and end a call.
    call_start: str | None = None
    call_end: str | None = None
    # Per component, the calls it was planned more room in for allocator retries, and the
    # components no plan could give more room to for them (see adaptive.learn_overshoot).
    retry_replans: dict[str, int] = field(default_factory=dict)
    retries_left_alone: set[str] = field(default_factory=set)
    # What calls measured, per call shape, and the file it is kept in (None: not kept); None when
    # nothing is measured (no budget, a reserve given, or a plan that keeps everything).
    profile: ResidencyProfile | None = None
    profile_file: Path | None = None
    # Encoders hooked whole as enabled, from a profile's figures or the dry runs' estimate (see
    # pipeline._hooked_whole): enabled again, they stay so, whatever the figures then.
    hooked_whole: tuple[str, ...] = ()
    # The shape of the call under way, or of the last one (see adaptive.begin_call), and the shapes whose
    # figures this process measured (the others came from the profile).
    shape: str | None = None
    measured_shapes: set[str] = field(default_factory=set)
    # Shapes an estimate failed (its call ran out of memory, or measured needs that fit no plan): the
    # least on the device for them from then on.
    estimates_failed: set[str] = field(default_factory=set)
    # Set while a pipeline call is under way (see calls._wrap_call): calls within it are not
    # planned for on their own. Pipelines are not thread-safe, and neither is this.
    in_call: bool = False
    # What estimates a measured call's needs before they are measured (None: the pipeline's calls
    # are not denoiser then decoder).
    dry_runs: CallDryRuns | None = None
    # enable_pinned_offload as it was called for this setup, taking the pipeline, and the modules it
    # staged by every name they had then, by id (see staging_replaced).
    enable_again: Callable[[DiffusionPipeline], None] = lambda pipe: None
    staged_names: Mapping[str, int] = field(default_factory=dict)

    @property
    def default_size(self) -> tuple[int, int] | None:
        """The (height, width) of a call that gives neither, where the dry runs know it (see
        ``dry_runs.CallDryRuns.default_size``)."""
        return self.dry_runs.default_size if self.dry_runs is not None else None

    def active_in(self, pipe: DiffusionPipeline) -> bool:
        """Whether pinned offload is still on for ``pipe``: a component of it is staged here, or none
        of the modules staged as enabled is a component now (each replaced or set to None: enabled
        again at the next call, see :meth:`staging_replaced`) and hooks are left. Off once
        ``pipe.remove_all_hooks()`` took the hooks off its components (as ``enable_model_cpu_offload``
        does first): diffusers walks the components there are, and leaves the hooks of a module
        replaced or set to None since."""
        units = self.group.units
        if not units:
            return False
        current = [id(module) for module in pipe.components.values() if isinstance(module, nn.Module)]
        staged_now = {id(unit.module) for unit in units if unit.name == unit.component}
        if any(module in staged_now for module in current):
            return True
        staged_then = set(self.staged_names.values())
        return not any(module in staged_then for module in current)

    def staging_replaced(self, pipe: DiffusionPipeline) -> PipelineResidency | None:
        """The pipeline's state after enabling it again, as it was enabled, where a staged component
        was replaced since by a module no pinned offload stages (``pipe.transformer = other``); else
        this one. Left as they are, the new component would run unstaged, wherever it is, and the
        one it replaced would keep its device memory. One set to None (its embeddings computed),
        or to a module another pipeline stages, is left as it was. An attribute look-up per
        component while nothing changed: it runs as every call starts."""
        replaced = self._replaced_by_unstaged(pipe)
        if not replaced or not self.active_in(pipe):
            return self
        if self.group.host_copy is not None:
            # Enabled with share_host_masters: enabling is collective, and this rank alone would
            # wait for the others in it.
            raise RuntimeError(
                f"{replaced} replaced since pinned offload was enabled with share_host_masters=True, whose "
                "ranks share one host copy of the weights: one rank cannot enable it again alone. Call "
                "pipe.disable_pinned_offload() and then pipe.enable_pinned_offload(..., share_host_masters=True) "
                "on every rank, each with the new component."
            )
        with self.group.call_lock:
            current = pipe.__dict__.get(STATE_ATTR)
            if current is not self:  # enabled again by another thread's call meanwhile
                return current
            logger.info("%s replaced since pinned offload was enabled: enabling it again, as it was enabled", replaced)
            self.enable_again(pipe)
        return pipe.__dict__[STATE_ATTR]

    def _replaced_by_unstaged(self, pipe: DiffusionPipeline) -> list[str]:
        replaced = []
        for name, staged in self.staged_names.items():
            current = getattr(pipe, name, None)
            if id(current) != staged and isinstance(current, nn.Module):
                if not isinstance(getattr(current, "_hf_hook", None), StagingHook):
                    replaced.append(name)
        return replaced


def apply_plan(state: PipelineResidency, plan: ResidencyPlan) -> None:
    """Give the units of an unchanged setup the policies of ``plan``; evictions follow at the next switch."""
    for component in plan.components:
        hook = state.hooks.get(component.name)
        # A component whose hook a script took off or attached again keeps what the script gave it.
        if hook is None or getattr(hook.unit.module, "_hf_hook", None) is not hook:
            continue
        units = state.group.units_of(component.name)
        units[0].policy = component.policy
        for index, block in enumerate(units[1:]):
            policy = (
                Policy.RESIDENT
                if index in component.resident_blocks
                else Policy.STAGED
                if index in component.staged_blocks
                else Policy.STREAMED
            )
            if block.policy is not Policy.STREAMED and policy is Policy.STREAMED and block.stager.loaded:
                # Now streamed: its room goes to the blocks that now stay, before they load (and the
                # stream drops only blocks it loaded itself).
                block.stager.offload()
            block.policy = policy
        if units[0].policy is Policy.STREAMED:
            units[1].stream.replan(component.prefetch_blocks)
    state.plan = plan
    group = state.group
    group.weight_room = None if plan.budget is None else plan.weight_room
    if plan.budget is None:
        group.retention.reserved_limit = None  # under a budget, set at each switch (evict_others)
        group.budget_watch = None  # a plan without a budget has none to watch


def replan_in_place(
    state: PipelineResidency,
    activations: Mapping[str, int],
    timings: Mapping[str, StepTiming] | None = None,
    chosen: Sequence[ComponentPlan] | None = None,
) -> ResidencyPlan:
    """The plan for ``activations`` (and ``timings``, by default the plan's) on the hooks in place:
    components that stream keep streaming (their blocks have hooks of their own; with every block
    resident, one is as good as resident), the others may move between staged and resident, not to
    streaming (they have no block hooks). ``chosen``: the plan made before for these figures; the
    plan in place is the incumbent (see plan_residency).

    Raises :class:`BudgetTooSmallError` when nothing fits."""
    streaming, whole = hooked_policies(state)
    timings = state.plan.timings if timings is None else timings
    plan = state.replan(activations, streaming, whole, timings, chosen=chosen, incumbent=state.plan.components)
    return replace(plan, source="measured", shape=state.shape)


def hooked_policies(state: PipelineResidency) -> tuple[dict[str, Policy], list[str]]:
    """What the hooks in place allow: the components that stream (their blocks have hooks of their
    own), pinned so, and those that can only move whole."""
    streaming = {p.name: Policy.STREAMED for p in state.plan.components if p.policy is Policy.STREAMED}
    whole = [p.name for p in state.plan.components if p.policy is not Policy.STREAMED]
    return streaming, whole


def apply_least_plan(state: PipelineResidency) -> None:
    """The measuring plan, with the least on the device, on the hooks in place."""
    streaming, whole = hooked_policies(state)
    apply_plan(state, state.replan({}, streaming, whole, least=True))
