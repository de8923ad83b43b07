"""What the stagers did: a small dataclass per unit that prints as a table."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from . import _device
from .residency import ResidencyGroup, ResidencyUnit
from .shared_masters import shared_and_owned_bytes
from .text import format_bytes, size_unit, text_table

_GB = 1e9


@dataclass(frozen=True)
class ComponentReport:
    """One component (a staged unit, or a streamed component's trunk and blocks together): its
    policy, its weight bytes, where they are, and what loading them cost."""

    name: str
    policy: str
    weight_bytes: int
    device_bytes: int
    pinned: bool
    sleep_level: int
    pinned_bytes: int
    pageable_bytes: int
    mapped_bytes: int
    loads: int
    loaded_bytes: int
    load_seconds: float
    releases: int
    retains: int
    # Bytes loaded from masters served from checkpoint files, and the host seconds those loads took.
    read_bytes: int = 0
    read_seconds: float = 0.0
    # Host time the package spent on the component (see ResidencyUnit.host_seconds) since it was
    # enabled: over all calls so far, and casts made at enable from a residency profile.
    host_seconds: float = 0.0
    # A streamed component's compute seconds per step: the first step timed, and the median of those
    # the latest call timed (see BlockStream). Beside its loads per step it says whether the bus or
    # the compute sets the pace.
    step_compute_seconds: tuple[float, float] | None = None

    @property
    def state(self) -> str:
        return f"asleep ({self.sleep_level})" if self.sleep_level else "awake"

    @property
    def loaded(self) -> bool:
        """Whether all of its weights are on the device."""
        return self.device_bytes == self.weight_bytes

    @property
    def load_gbps(self) -> float | None:
        """Effective host-to-device rate over all loads, in GB/s (None before the first load)."""
        if not self.loads or self.load_seconds <= 0:
            return None
        return self.loaded_bytes / self.load_seconds / _GB

    @property
    def read_gbps(self) -> float | None:
        """Rate of the loads from masters served from checkpoint files (read into the ring and
        copied to the device), in GB/s (None where none was)."""
        if not self.read_bytes or self.read_seconds <= 0:
            return None
        return self.read_bytes / self.read_seconds / _GB


@dataclass(frozen=True)
class HostSharing:
    """This rank's part in a host's shared masters (see :mod:`.shared_masters`): the host bytes it
    reads from the host's one copy, and those it holds alone (masters made since, for new LoRA
    layers or casts, and the pages of the host's copy it wrote, which got copies of their own)."""

    rank: int
    world_size: int
    host_ranks: tuple[int, ...]
    shared_bytes: int
    owned_bytes: int

    def __str__(self) -> str:
        return (
            f"rank {self.rank} of {self.world_size}, host masters shared with ranks {list(self.host_ranks)}: "
            f"{format_bytes(self.shared_bytes)} shared, {format_bytes(self.owned_bytes)} owned"
        )


@dataclass(frozen=True)
class ResidencyReport:
    device: str
    retention_budget_bytes: int | None
    components: tuple[ComponentReport, ...]
    host_sharing: HostSharing | None = None

    def __getitem__(self, name: str) -> ComponentReport:
        for component in self.components:
            if component.name == name:
                return component
        raise KeyError(name)

    @property
    def device_bytes(self) -> int:
        """Weight bytes the package holds on the device now."""
        return sum(c.device_bytes for c in self.components)

    def __str__(self) -> str:
        unit, size = size_unit(max((c.weight_bytes for c in self.components), default=0))
        header = (
            "component", "policy", "state", unit, f"device {unit}", f"pinned {unit}", f"pageable {unit}", f"mapped {unit}",
            "loads", "load s", "GB/s", "file GB/s", "host s", "releases", "retains", "compute s/step (first, latest call)",
        )  # fmt: skip
        rows = [
            (
                c.name,
                c.policy,
                c.state,
                *(f"{n / size:.3f}" for n in (c.weight_bytes, c.device_bytes, c.pinned_bytes, c.pageable_bytes, c.mapped_bytes)),
                str(c.loads),
                f"{c.load_seconds:.3f}",
                "-" if c.load_gbps is None else f"{c.load_gbps:.1f}",
                "-" if c.read_gbps is None else f"{c.read_gbps:.1f}",
                f"{c.host_seconds:.3f}",
                str(c.releases),
                str(c.retains),
                "-" if c.step_compute_seconds is None else "{:.3f}, {:.3f}".format(*c.step_compute_seconds),
            )
            for c in self.components
        ]
        lines = text_table((header, *rows))
        budget = "n/a" if self.retention_budget_bytes is None else format_bytes(self.retention_budget_bytes)
        head = [f"device {self.device}, retention budget {budget}"]
        return "\n".join([*head, *([str(self.host_sharing)] if self.host_sharing is not None else []), *lines])


def _component_report(name: str, units: list[ResidencyUnit]) -> ComponentReport:
    held = {"pinned": 0, "pageable": 0, "mapped": 0}
    for unit in units:
        own = unit.stager.host_bytes()
        # Pages of a file that the process wrote are its own: in RAM.
        written = unit.stager.written_mapped_bytes() if own["mapped"] else 0
        own.update(mapped=own["mapped"] - written, pageable=own["pageable"] + written)
        for kind, nbytes in own.items():
            held[kind] += nbytes
    main = units[0]  # the component itself, or a streamed component's trunk
    return ComponentReport(
        name=name,
        policy=main.policy.value,
        weight_bytes=sum(u.stager.weight_bytes for u in units),
        device_bytes=sum(u.stager.weight_bytes for u in units if u.stager.loaded),
        pinned=all(u.stager.pinned for u in units),
        sleep_level=max(u.sleep_level for u in units),
        **{f"{kind}_bytes": nbytes for kind, nbytes in held.items()},
        loads=sum(u.stager.loads for u in units),
        loaded_bytes=sum(u.stager.loaded_bytes for u in units),
        load_seconds=sum(u.stager.load_seconds for u in units),
        read_bytes=sum(u.stager.read_bytes for u in units),
        read_seconds=sum(u.stager.read_seconds for u in units),
        releases=sum(u.releases for u in units),
        retains=sum(u.retains for u in units),
        host_seconds=sum(u.host_seconds for u in units),
        step_compute_seconds=next((u.stream.step_compute_seconds() for u in units if u.stream is not None), None),
    )


def report_for(group: ResidencyGroup) -> ResidencyReport:
    memory = _device.read_memory_telemetry(group.device)
    budget = None if memory is None else group.retention.budget_for(memory.total)
    components: dict[str, list[ResidencyUnit]] = {}
    for unit in group.units:
        components.setdefault(unit.component, []).append(unit)
    return ResidencyReport(
        device=str(group.device),
        retention_budget_bytes=budget,
        components=tuple(_component_report(name, units) for name, units in components.items()),
        host_sharing=_host_sharing(group),
    )


def _host_sharing(group: ResidencyGroup) -> HostSharing | None:
    if group.host_copy is None:
        return None
    shared, owned = shared_and_owned_bytes(master for unit in group.units for master in unit.stager.masters())
    return HostSharing(
        rank=dist.get_rank() if dist.is_initialized() else 0,
        world_size=dist.get_world_size() if dist.is_initialized() else 1,
        host_ranks=group.host_copy.ranks,
        shared_bytes=shared,
        owned_bytes=owned,
    )
