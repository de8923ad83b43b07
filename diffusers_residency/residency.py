"""Which staged units are on the device, and who gets evicted when another one is needed.

A :class:`ResidencyGroup` is the controller behind a set of hooks that share one device, one copy
stream and one retention budget: a pipeline's components under ``enable_pinned_offload()``, or any
modules a script attaches hooks to. Its rule follows diffusers' ``model_cpu_offload_seq``: a
*staged* unit is on the device only while it is the one in use, so loading one evicts the other
staged ones; a *resident* unit is loaded on first use and stays.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

import torch
from torch import nn

from . import _device, host_memory
from .retention import RetentionBudget
from .staging import ModuleStager, module_tensors

logger = logging.getLogger(__name__)


class Policy(str, Enum):
    STAGED = "staged"
    RESIDENT = "resident"

    @classmethod
    def parse(cls, value: str | Policy, what: str) -> Policy:
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(repr(p.value) for p in cls)
            raise ValueError(f"{what}: unknown residency policy {value!r}; use one of {choices}") from None


@dataclass(eq=False)
class StagedUnit:
    """One module (a pipeline component, or any submodule) under a group's control."""

    name: str
    module: nn.Module
    policy: Policy
    stager: ModuleStager
    releases: int = 0
    retains: int = 0
    original_device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # 0 awake; 1 asleep with host masters; 2 asleep with masters mapped from checkpoint files.
    sleep_level: int = 0
    load_on_wake: bool = False


class ResidencyGroup:
    """Loads units on demand and evicts staged ones, sharing one copy stream and retention budget.

    Args:
        device: where the units compute; ``None`` takes the current accelerator.
        pin_memory: pin the host masters (default: when ``device`` is an accelerator). Pinned masters
            are what make loads asynchronous and fast; on the CPU there is nothing to pin for.
        pin_budget: the most host memory the package may keep page-locked in this process, in bytes
            or as a fraction of physical RAM (default 0.75); masters beyond it stay pageable.
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
        self.pin_budget = host_memory.resolve_pin_budget(pin_budget)
        self.retention = RetentionBudget(self.device)
        self.copy_stream = _device.new_copy_stream(self.device)
        self.units: list[StagedUnit] = []

    def check_can_add(self, module: nn.Module, name: str) -> None:
        """Refuse a module that shares weights with a unit already in the group: two stagers would
        each take a master of the same storage and rebind it behind the other's back."""
        owned = {id(t) for unit in self.units for t in module_tensors((unit.module,))}
        if any(id(t) in owned for t in module_tensors((module,))):
            raise ValueError(
                f"{name!r} shares weights with a module this group already stages; stage the enclosing "
                "module or its parts, not both"
            )

    def add(self, name: str, module: nn.Module, policy: str | Policy = Policy.STAGED) -> StagedUnit:
        policy = Policy.parse(policy, name)
        self.check_can_add(module, name)
        original_device = next((t.device for t in module_tensors((module,))), torch.device("cpu"))
        stager = ModuleStager(
            module,
            self.device,
            pin_memory=self.pin_memory,
            pin_budget=self.pin_budget,
            copy_stream=self.copy_stream,
            retention=self.retention,
        )
        unit = StagedUnit(name=name, module=module, policy=policy, stager=stager, original_device=original_device)
        self.units.append(unit)
        return unit

    def remove(self, unit: StagedUnit) -> None:
        """Offload the unit and stop managing it; its tensors stay bound to their host masters."""
        unit.stager.close()
        self.units.remove(unit)

    def activate(self, unit: StagedUnit) -> None:
        """Make sure ``unit`` is on the device, evicting other staged units first. Runs in every
        ``pre_forward``, so the common case (already loaded) returns at once."""
        if unit.stager.loaded:
            return
        if unit.sleep_level:
            logger.info("Waking %r for a call", unit.name)
            self._wake_masters(unit)
        # Weights replaced or added while offloaded (a LoRA adapter injected, projections fused, a
        # submodule cast) are bound to no master yet: take theirs before loading. Masters of the
        # unchanged storages are reused as they are, so this copies only what is new.
        unit.stager.retake_masters()
        if unit.policy is Policy.STAGED:
            self.evict_staged(keep=unit)
        unit.stager.load()

    def evict_staged(self, keep: StagedUnit | None = None) -> None:
        """Offload every loaded staged unit but ``keep``; then let the retention budget decide whether
        this boundary gives the allocator's cache back."""
        evicted = [u for u in self.units if u.policy is Policy.STAGED and u.stager.loaded and u is not keep]
        if not evicted:
            return
        for unit in evicted:
            unit.stager.offload()
        decision = self.retention.at_boundary()
        last = evicted[-1]
        if decision.released:
            last.releases += 1
        else:
            last.retains += 1

    def sleep(self, unit: StagedUnit, level: int, sources: Mapping[int, torch.Tensor] | None = None) -> None:
        """Put ``unit`` to sleep: level 1 keeps its host masters, level 2 also swaps every master that
        ``sources`` (views of a memory-mapped checkpoint) holds byte for byte for that view.

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
        load_on_wake = unit.stager.loaded or unit.policy is Policy.RESIDENT
        unit.stager.offload()
        if level == 2:
            unit.stager.map_masters(sources or {})
        unit.load_on_wake = load_on_wake
        unit.sleep_level = level

    def wake(self, unit: StagedUnit) -> None:
        """Wake ``unit``: masters back in memory of their own, and on the device again if it was there
        (or is resident). A no-op for a unit that is awake."""
        if not unit.sleep_level:
            return
        self._wake_masters(unit)
        if unit.load_on_wake:
            self.activate(unit)

    def _wake_masters(self, unit: StagedUnit) -> None:
        unit.stager.unmap_masters()
        unit.sleep_level = 0
