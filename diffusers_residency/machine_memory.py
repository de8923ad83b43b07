"""How much memory this process may have: physical RAM, or less where the cgroups over it set a
limit (a container). Fractions of RAM in ``pin_budget`` and ``host_budget``, and
``host_budget="auto"``, are taken of it.

A container's limit is rarely on the process's own cgroup alone: Kubernetes sets it on the pod's
cgroup, systemd on a slice above the service, and Docker on cgroup v1 hosts mounts the container's
cgroup as the hierarchy's root. So every hierarchy that limits memory (the unified v2 one, and v1's
``memory`` controller on hosts that mount both) is read from the process's cgroup up to the top of
its mount, and the tightest limit wins. Where the hierarchies are mounted comes from
``mountinfo``, not from a fixed ``/sys/fs/cgroup``: hybrid hosts mount v2 at
``/sys/fs/cgroup/unified``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

# cgroup v1 writes "no limit" as the largest page-aligned 64-bit value; any figure this large is
# no limit on a real machine.
_NO_LIMIT_FROM = 1 << 60


@dataclass(frozen=True)
class _Hierarchy:
    """A mounted cgroup hierarchy that can limit memory: the cgroup its mount shows as its top
    (``root``, a container's own cgroup under Docker on v1), where it is mounted, and the file that
    holds a cgroup's limit."""

    root: PurePosixPath
    mount_point: Path
    limit_file: str


def _unescaped(field: str) -> str:
    # mountinfo writes a space, tab, newline or backslash in a path as an octal escape (\040).
    return re.sub(r"\\([0-7]{3})", lambda escape: chr(int(escape.group(1), 8)), field)


def _memory_hierarchies(mountinfo: str) -> dict[str, _Hierarchy]:
    """The hierarchies that limit memory, by how ``/proc/self/cgroup`` names them: ``""`` for v2
    (its line is ``0::path``), ``"memory"`` for v1's memory controller."""
    found: dict[str, _Hierarchy] = {}
    for line in mountinfo.splitlines():
        before, separator, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if not separator or len(fields) < 5 or len(tail) < 3:
            continue
        root, mount_point = _unescaped(fields[3]), _unescaped(fields[4])
        filesystem, options = tail[0], tail[2].split(",")
        if filesystem == "cgroup2":
            key, limit_file = "", "memory.max"
        elif filesystem == "cgroup" and "memory" in options:
            key, limit_file = "memory", "memory.limit_in_bytes"
        else:
            continue
        found.setdefault(key, _Hierarchy(PurePosixPath(root), Path(mount_point), limit_file))
    return found


def _limit_in(folder: Path, limit_file: str) -> int | None:
    try:
        value = (folder / limit_file).read_text().strip()
    except OSError:  # the top of a hierarchy has no limit file, and a cgroup may be gone
        return None
    if not value.isdigit() or int(value) >= _NO_LIMIT_FROM:  # v2 writes "max" for none
        return None
    return int(value)


def _tightest_limit(hierarchy: _Hierarchy, cgroup: PurePosixPath) -> int | None:
    """The lowest limit from ``cgroup`` up to the top of the hierarchy's mount."""
    try:
        below_root = cgroup.relative_to(hierarchy.root)
    except ValueError:  # a cgroup namespace: paths are the namespace's, its root mounted
        below_root = cgroup.relative_to("/")
    folder = hierarchy.mount_point / below_root
    limits = []
    while True:
        limit = _limit_in(folder, hierarchy.limit_file)
        if limit is not None:
            limits.append(limit)
        if folder == hierarchy.mount_point or hierarchy.mount_point not in folder.parents:
            break
        folder = folder.parent
    return min(limits, default=None)


def cgroup_memory_limit(proc: Path = Path("/proc/self")) -> int | None:
    """The tightest memory limit any cgroup over this process sets, in bytes, or None where none
    does (or the system has no cgroups to read)."""
    try:
        cgroups = (proc / "cgroup").read_text().splitlines()
        hierarchies = _memory_hierarchies((proc / "mountinfo").read_text())
    except OSError:
        return None
    limits = []
    for line in cgroups:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        key = "" if not controllers else "memory" if "memory" in controllers.split(",") else None
        if key is None or key not in hierarchies or not path.startswith("/"):
            continue
        limit = _tightest_limit(hierarchies[key], PurePosixPath(path))
        if limit is not None:
            limits.append(limit)
    return min(limits, default=None)


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def machine_memory_limit() -> int:
    """The most memory this process can have: the tightest limit of the cgroups over it where one is
    set and lower than physical RAM (a container), else physical RAM."""
    physical = physical_memory_bytes()
    limit = cgroup_memory_limit()
    return min(physical, limit) if limit else physical
