"""Weights shared by the ranks of one host: one copy of each component in a file of ``/dev/shm`` that
every local rank maps, instead of a copy per rank.

Data-parallel serving runs one pipeline per GPU, every rank loading the same checkpoint: with host
memory per rank, eight ranks serving FLUX.1-dev hold eight copies of its 33.7 GB. Here, as pinned
offload is enabled, the host's first rank writes each component's weights into a file of their own,
every rank of the host checks that file against its own weights and maps it, and the component's
tensors are rebound to the mapping: their private memory goes back to the system, and the
mapping's pages count once for the host. The masters the stagers then take are those tensors.

Each rank maps the file *privately* (``MAP_PRIVATE``): it reads the host's pages until it writes
one, which then gets a copy of its own. A rank that fuses a LoRA or loads a state dict changes its
own weights, never another rank's, whichever way the write comes.

The file is unlinked as soon as every rank of the host has mapped it: from then on no rank's exit,
or death, can leave it behind, and its memory goes back with the last mapping. Only a host's first
rank dying between writing the file and the other ranks mapping it (a second or so of enable) would
leave one, named ``diffusers_residency-<pid>-...``.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from . import _device
from .masters import TensorBinding
from .pinning import block_bytes, slot
from .weights import flat_bytes, module_stored_tensors

logger = logging.getLogger(__name__)

SHARED_FOLDER = "/dev/shm"
FILE_PREFIX = "diffusers_residency-"


@dataclass(frozen=True)
class _Layout:
    """Where each storage of a component goes in its shared file, and what checks that two ranks
    lay out the same component: its storages' sizes and alignments, and its tensors' places."""

    offsets: tuple[int, ...]
    span: int
    signature: tuple


def refuse_unsharable(modules: Mapping[str, nn.Module]) -> None:
    """Raise, before anything changes, unless the weights can be shared between the host's ranks:
    ``torch.distributed`` initialised, shared memory to map, every weight on the host."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "share_host_masters needs torch.distributed initialised in every rank (torchrun, then "
            "torch.distributed.init_process_group()) before enable_pinned_offload"
        )
    if not os.path.isdir(SHARED_FOLDER):
        raise ValueError(f"share_host_masters needs shared memory at {SHARED_FOLDER}, which this machine does not have")
    for name, module in modules.items():
        if any(tensor.device.type != "cpu" for tensor in module_stored_tensors((module,))):
            raise ValueError(
                f"share_host_masters shares host memory, and component {name!r} has weights on "
                f"{_first_device(module)}: load the pipeline on the host (no .to(device) before enabling)"
            )


def _first_device(module: nn.Module) -> torch.device:
    return next(t.device for t in module_stored_tensors((module,)) if t.device.type != "cpu")


def _host_ranks() -> list[int]:
    """The global ranks on this host, in order (the first one writes the files)."""
    me = (socket.gethostname(), _boot_id())
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, me)
    return [rank for rank, host in enumerate(every) if host == me]


def _boot_id() -> str:
    """Tells two hosts that share a name apart (containers often do)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return boot.read().strip()
    except OSError:
        return ""


def _storages(module: nn.Module) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """The module's distinct storages as flat byte tensors, and the stored tensors that live in each."""
    wholes: dict[int, torch.Tensor] = {}
    members: dict[int, list[torch.Tensor]] = {}
    for tensor in module_stored_tensors((module,)):
        storage = tensor.untyped_storage()
        key = storage.data_ptr() if storage.nbytes() else -id(tensor)
        if key not in wholes:
            wholes[key] = flat_bytes(storage)
            members[key] = []
        members[key].append(tensor)
    return list(wholes.values()), list(members.values())


def _layout(wholes: Sequence[torch.Tensor], members: Sequence[Sequence[torch.Tensor]]) -> _Layout:
    """Each storage keeps its address modulo 64 in the file, as the stagers' host copies do: CPU
    kernels branch on it, and a result computed over other alignments may differ in its last bits."""
    sizes = [whole.numel() for whole in wholes]
    alignments = [_device.host_alignment(whole) for whole in wholes]
    offsets, span = block_bytes(sizes, alignments)
    places = tuple(
        tuple((str(t.dtype), tuple(t.shape), tuple(t.stride()), t.storage_offset()) for t in tensors) for tensors in members
    )
    return _Layout(tuple(offsets), span, (tuple(sizes), tuple(alignments), places))


def share_host_weights(modules: Mapping[str, nn.Module]) -> tuple[int, ...]:
    """Rebind every component's weights to one copy per host, mapped by each of its ranks (see the
    module's docstring). Collective: every rank calls it with the same components, in the same order.

    Raises on every rank, before any weight is rebound, when a rank of the host could not write or
    map a component's file, or the ranks lay a component out differently or hold different bytes
    for it (built from another checkpoint, or seeded apart). A failure on one rank is told to the
    others at the next exchange, so that none waits for it."""
    host = _host_ranks()
    shared = []
    for name, module in modules.items():
        wholes, members = _storages(module)
        layout = _layout(wholes, members)
        backing = _mapped_copy(name, wholes, layout, host)
        shared.append((name, wholes, members, layout, backing))
    for name, wholes, members, layout, backing in shared:
        for whole, tensors, offset in zip(wholes, members, layout.offsets):
            place = slot(backing, offset, whole.numel())
            for tensor in tensors:
                _rebind(tensor, place)
        logger.info("%r: %d bytes shared by ranks %s of this host", name, sum(w.numel() for w in wholes), host)
    return tuple(host)


def _mapped_copy(name: str, wholes: Sequence[torch.Tensor], layout: _Layout, host: list[int]) -> memoryview:
    """The host's copy of one component, mapped here once every rank of the host has checked it
    holds the same bytes (the host's first rank writes it)."""
    writer = dist.get_rank() == host[0]
    path, failure = None, None
    if writer:
        try:
            path = _write(name, wholes, layout)
        except OSError as exc:
            failure = f"rank {host[0]} could not write {name!r} to {SHARED_FOLDER} ({exc})"
    try:
        path = _agree(path, failure, layout, host, name)
        try:
            backing = _map(path, layout.span)
        except OSError as exc:
            backing, failure = None, f"rank {dist.get_rank()} could not map {path} ({exc})"
        else:
            same = all(torch.equal(whole, slot(backing, offset, whole.numel())) for whole, offset in zip(wholes, layout.offsets))
            failure = None if same else f"rank {dist.get_rank()} holds other weights for {name!r} than rank {host[0]}"
        failures = [text for text in _gather(failure, host) if text is not None]
    finally:
        if writer and path is not None:
            os.unlink(path)  # every rank of the host has mapped it by now, or failed to (see _gather)
    if failures:
        raise ValueError(
            f"share_host_masters: {'; '.join(failures)}. Every rank of a host must load the same checkpoint, "
            "and the host needs room in shared memory for one copy of the weights"
        )
    return backing


def _write(name: str, wholes: Sequence[torch.Tensor], layout: _Layout) -> str:
    """The host's first rank writes the component's storages into a new file of shared memory."""
    path = os.path.join(SHARED_FOLDER, f"{FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}-{name}")
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(descriptor, layout.span)
        with mmap.mmap(descriptor, layout.span, flags=mmap.MAP_SHARED) as mapping:
            block = memoryview(mapping)
            for whole, offset in zip(wholes, layout.offsets):
                slot(block, offset, whole.numel()).copy_(whole)
            del block
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(descriptor)
    return path


def _agree(path: str | None, failure: str | None, layout: _Layout, host: list[int], name: str) -> str:
    """The writer's path, once every rank of the host has checked that it lays the component out alike."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (path, failure, layout.signature))
    path, failure, signature = every[host[0]]
    if failure is not None:
        raise ValueError(f"share_host_masters: {failure}")
    differing = [rank for rank in host if every[rank][2] != signature]
    if differing:
        raise ValueError(
            f"share_host_masters: component {name!r} is laid out differently on ranks {differing} than on rank "
            f"{host[0]} (other tensors, shapes or dtypes); every rank of a host must build the same pipeline"
        )
    return path


def _map(path: str, span: int) -> memoryview:
    """The file mapped privately: the host's pages, copied for this rank alone if it writes one. The
    mapping lasts as long as a tensor over it does (each holds a view of the memoryview)."""
    descriptor = os.open(path, os.O_RDWR)
    try:
        return memoryview(mmap.mmap(descriptor, span, flags=mmap.MAP_PRIVATE))
    finally:
        os.close(descriptor)


def _gather(value: str | None, host: list[int]) -> list[str | None]:
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return [every[rank] for rank in host]


def _rebind(tensor: torch.Tensor, backing: torch.Tensor) -> None:
    """Rebind ``tensor`` to the same place in ``backing``, a copy of its storage's bytes."""
    binding = TensorBinding(
        target=tensor,
        inference=tensor.is_inference(),
        dtype=tensor.dtype,
        shape=tuple(tensor.shape),
        stride=tuple(tensor.stride()),
        storage_offset=tensor.storage_offset(),
    )
    with torch.inference_mode(binding.inference):
        tensor.data = binding.view_over(backing)


def shared_bytes(masters: Iterable[torch.Tensor]) -> int:
    """Bytes of ``masters`` that lie in a host's shared copy (this process's mappings of its files,
    from ``/proc/self/maps``: what a report asks, not a hot path)."""
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if FILE_PREFIX in line:
                    low, high = line.split(maxsplit=1)[0].split("-")
                    ranges.append((int(low, 16), int(high, 16)))
    except OSError:
        return 0
    return sum(
        master.numel() for master in masters if any(low <= master.data_ptr() < high for low, high in ranges)
    )
