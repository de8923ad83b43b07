"""Pinned-master offloading for diffusers pipelines.

Importing the package adds ``enable_pinned_offload``, ``disable_pinned_offload``,
``residency_report``, ``residency_plan``, ``sleep``, ``wake_up`` and ``is_sleeping`` to ``diffusers.DiffusionPipeline``;
the same operations are functions here that take the pipeline first. For scripts, :func:`attach_staging_hook` stages any one module (a component
or a submodule) through a :class:`ResidencyGroup`.
"""

from diffusers import DiffusionPipeline

from .hooks import StagingHook, attach_block_streaming, attach_staging_hook, detach_staging_hook
from .pipeline import disable_pinned_offload, enable_pinned_offload, residency_plan, residency_report
from .planner import BudgetTooSmallError, ComponentPlan, ComponentSizes, ResidencyPlan, plan_residency
from .report import ComponentReport, ResidencyReport
from .residency import Policy, ResidencyGroup, StagedUnit
from .retention import RetentionBudget, RetentionDecision
from .sleep_mode import AwakeRotation, is_sleeping, sleep, wake_up
from .staging import ModuleStager

__version__ = "0.1.0"

DiffusionPipeline.enable_pinned_offload = enable_pinned_offload
DiffusionPipeline.disable_pinned_offload = disable_pinned_offload
DiffusionPipeline.residency_report = residency_report
DiffusionPipeline.residency_plan = residency_plan
DiffusionPipeline.sleep = sleep
DiffusionPipeline.wake_up = wake_up
DiffusionPipeline.is_sleeping = property(is_sleeping)

__all__ = [
    "AwakeRotation",
    "BudgetTooSmallError",
    "ComponentPlan",
    "ComponentReport",
    "ComponentSizes",
    "ModuleStager",
    "Policy",
    "ResidencyGroup",
    "ResidencyPlan",
    "ResidencyReport",
    "RetentionBudget",
    "RetentionDecision",
    "StagedUnit",
    "StagingHook",
    "attach_block_streaming",
    "attach_staging_hook",
    "detach_staging_hook",
    "disable_pinned_offload",
    "enable_pinned_offload",
    "is_sleeping",
    "plan_residency",
    "residency_plan",
    "residency_report",
    "sleep",
    "wake_up",
]
