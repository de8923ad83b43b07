"""Pinned-master offloading for diffusers pipelines.

Importing the package adds ``enable_pinned_offload``, ``disable_pinned_offload``,
``residency_report``, ``residency_plan``, ``residency_profile``, ``save_residency_profile``,
``load_residency_profile``, ``sleep``, ``wake_up`` and ``is_sleeping`` to ``diffusers.DiffusionPipeline``;
the same operations are functions here that take the pipeline first. For scripts, :func:`attach_staging_hook` stages any one module (a component
or a submodule) through a :class:`ResidencyGroup`.
"""

from diffusers import DiffusionPipeline

from .attaching import attach_block_streaming, attach_staging_hook, detach_staging_hook
from .calls import guard_offloads_of, wrap_calls_sharing_components
from .hooks import StagingHook
from .host_budget import HostBudgetTooSmallError, HostPlacement
from .pipeline import (
    disable_pinned_offload,
    enable_pinned_offload,
    load_residency_profile,
    residency_plan,
    residency_profile,
    residency_report,
    save_residency_profile,
)
from .planner import plan_residency
from .plans import BudgetTooSmallError, ComponentPlan, ComponentSizes, ResidencyPlan
from .policy import Policy
from .profile import ResidencyProfile
from .report import ComponentReport, ResidencyReport
from .residency import ResidencyGroup, ResidencyUnit
from .retention import RetentionBudget, RetentionDecision
from .sleep_mode import AwakeRotation, is_sleeping, sleep, wake_up
from .staging import ModuleStager

__version__ = "0.1.0"

DiffusionPipeline.enable_pinned_offload = enable_pinned_offload
DiffusionPipeline.disable_pinned_offload = disable_pinned_offload
DiffusionPipeline.residency_report = residency_report
DiffusionPipeline.residency_plan = residency_plan
DiffusionPipeline.residency_profile = residency_profile
DiffusionPipeline.save_residency_profile = save_residency_profile
DiffusionPipeline.load_residency_profile = load_residency_profile
DiffusionPipeline.sleep = sleep
DiffusionPipeline.wake_up = wake_up
DiffusionPipeline.is_sleeping = property(is_sleeping)
DiffusionPipeline.register_modules = wrap_calls_sharing_components(DiffusionPipeline.register_modules)
guard_offloads_of(DiffusionPipeline)

__all__ = [
    "AwakeRotation",
    "BudgetTooSmallError",
    "ComponentPlan",
    "ComponentReport",
    "ComponentSizes",
    "HostBudgetTooSmallError",
    "HostPlacement",
    "ModuleStager",
    "Policy",
    "ResidencyGroup",
    "ResidencyPlan",
    "ResidencyProfile",
    "ResidencyReport",
    "RetentionBudget",
    "RetentionDecision",
    "ResidencyUnit",
    "StagingHook",
    "attach_block_streaming",
    "attach_staging_hook",
    "detach_staging_hook",
    "disable_pinned_offload",
    "enable_pinned_offload",
    "is_sleeping",
    "load_residency_profile",
    "plan_residency",
    "residency_plan",
    "residency_profile",
    "residency_report",
    "save_residency_profile",
    "sleep",
    "wake_up",
]
