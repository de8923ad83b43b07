"""Weights shared by the ranks of one host: one copy of each component in a file of ``/dev/shm`` that
every local rank maps, instead of a copy per rank.

Data-parallel serving runs one pipeline per GPU, every rank loading the same checkpoint: with host
memory per rank, eight ranks serving FLUX.1-dev hold eight copies of its 33.7 GB. Here, as pinned
offload is enabled, the host's first rank writes each component's weights into a file of their own,
every rank of the host checks that file against its own weights and maps it, and the component's
tensors are rebound to the mapping: their private memory goes back to the system, and the
mapping's pages count once for the host. The masters the stagers then take are those tensors.

Each rank maps the file twice. Its tensors are bound to a *private* mapping (``MAP_PRIVATE``): it
reads the host's pages until it writes one, which then gets a copy of its own, so a rank that fuses
a LoRA or loads a state dict changes its own weights, never another rank's. Its loads read a
*shared* mapping of the same pages, which each rank page-locks for its own GPU: locking the private
one would make the kernel copy every page for that rank first (a write-locked page of a private
mapping must be the rank's own), and each rank would hold the weights again. The shared mapping is
never written; a master this rank writes no longer matches it, so it gets a copy of its own, loaded
from there on (see :mod:`.host_copy`, which finds those writes).

The file is unlinked as soon as every rank of the host has mapped it: from then on no rank's exit,
or death, can leave it behind, and its memory goes back with the last mapping. Only a host's first
rank dying between writing the file and the other ranks mapping it (a second or so of enable) would
leave one, named ``diffusers_residency-<pid>-...``.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import socket
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from . import _device
from .host_copy import HostCopy, MappedCopy, address_of
from .masters import TensorBinding
from .pinning import HostPin, block_bytes, claim_range, register_claimed, slot
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


def refuse_unsharable(modules: Mapping[str, nn.Module], *, enabled: bool, host_budget: int | None) -> None:
    """Raise, before anything changes, unless the weights can be shared between the host's ranks:
    a first enable, every master in RAM, ``torch.distributed`` initialised, shared memory to map,
    every weight on the host."""
    if enabled:
        raise ValueError(
            "share_host_masters is given to the first enable_pinned_offload of a pipeline: call "
            "disable_pinned_offload() on every rank first"
        )
    if host_budget is not None:
        raise ValueError(
            "share_host_masters keeps every master in shared memory, host_budget serves some from files: give one"
        )
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


@contextlib.contextmanager
def failures_told(sharing: bool) -> Iterator[None]:
    """Around what a rank checks and plans before :func:`share_host_weights`: a failure there is
    told to every other rank, in the exchange that starts sharing, so that they raise too instead
    of waiting for this one until the process group times out."""
    try:
        yield
    except Exception as exc:
        if sharing and dist.is_available() and dist.is_initialized():
            group = _exchange_group()
            try:
                _exchange(group, (None, f"rank {dist.get_rank()} could not enable ({exc})"))
            finally:
                dist.destroy_process_group(group)
        raise


def _exchange_group() -> dist.ProcessGroup:
    """A gloo group of every rank for the exchanges (collective): host objects, whatever the
    default backend, and a rank that dies is seen as gone at once, where NCCL would wait for its
    timeout and then end the process, with a file of the host's copy still in shared memory."""
    return dist.new_group(backend="gloo")


def _exchange(group: dist.ProcessGroup, value: object) -> list:
    """``value`` from every rank of the world, in rank order (every rank must call it)."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, value, group=group)
    return every


def _raise_any(failures: Iterable[str | None]) -> None:
    """Raise, on every rank alike, if any rank of the world reported a failure."""
    failures = [text for text in failures if text is not None]
    if failures:
        raise ValueError(
            f"share_host_masters: {'; '.join(failures)}. Every rank of a host must load the same checkpoint, "
            "and the host needs room in shared memory for one copy of the weights"
        )


def _host_of_each_rank(group: dist.ProcessGroup, names: tuple[str, ...]) -> list[tuple[str, str]]:
    """Each rank's host (name and boot id), once every rank has said it shares the same components
    (``names``): each component is one exchange more, which every rank must make. A rank that
    failed before sharing says so here instead (see :func:`failures_told`)."""
    every = _exchange(group, ((socket.gethostname(), _boot_id(), names), None))
    _raise_any(failure for _, failure in every)
    _raise_any(
        f"rank {rank} shares components {list(other[2])} where rank 0 shares {list(names)}"
        for rank, (other, _) in enumerate(every)
        if other[2] != every[0][0][2]
    )
    return [other[:2] for other, _ in every]


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
        tuple((str(t.dtype), tuple(t.shape), tuple(t.stride()), t.storage_offset()) for t in tensors)
        for tensors in members
    )
    return _Layout(tuple(offsets), span, (tuple(sizes), tuple(alignments), places))


def share_host_weights(modules: Mapping[str, nn.Module], pin_budget: int | None, device: torch.device) -> HostCopy:
    """Rebind every component's weights to one copy per host, mapped by each of its ranks (see the
    module's docstring), and return that copy as this rank maps it, its shared mappings page-locked
    for ``device`` within ``pin_budget`` (None: pageable). Collective: every rank of the world
    calls it with the same components, in the same order.

    Raises on every rank, before any weight is rebound, when any rank could not write or map a
    component's file, or the ranks of a host lay a component out differently or hold different
    bytes for it (another checkpoint). Each rank's failures are exchanged at the next step rather
    than raised where they happen, so that no rank is left waiting for another."""
    distinct = {}
    for name, module in modules.items():
        distinct.setdefault(id(module), (name, module))  # one module under two names: shared once
    group = _exchange_group()
    try:
        hosts = _host_of_each_rank(group, tuple(name for name, _ in distinct.values()))
        host = [rank for rank, other in enumerate(hosts) if other == hosts[dist.get_rank()]]
        shared = []
        for name, module in distinct.values():
            wholes, members = _storages(module)
            layout = _layout(wholes, members)
            shared.append((name, wholes, members, layout, _mapped_copy(group, name, wholes, layout, hosts)))
    finally:
        dist.destroy_process_group(group)
    copies = []
    for name, wholes, members, layout, (private, shared_mapping) in shared:
        for whole, tensors, offset in zip(wholes, members, layout.offsets):
            place = slot(private, offset, whole.numel())
            for tensor in tensors:
                _rebind(tensor, place)
        copies.append(MappedCopy(private, shared_mapping, _lock(shared_mapping, pin_budget, device)))
        logger.info("%r: %d bytes shared by ranks %s of this host", name, sum(w.numel() for w in wholes), host)
    return HostCopy(tuple(host), copies)


def _lock(mapping: memoryview, pin_budget: int | None, device: torch.device) -> HostPin | None:
    """Page-lock a shared mapping for ``device`` if ``pin_budget`` leaves room; None if not (loads
    from it then run at the pageable rate). The pages are the host's: locking them copies nothing."""
    start = address_of(mapping)
    end = start + len(mapping)
    if pin_budget is None or not claim_range(start, end, pin_budget):
        return None
    return register_claimed(start, end, (torch.frombuffer(mapping, dtype=torch.uint8),), device)


def _mapped_copy(
    group: dist.ProcessGroup, name: str, wholes: Sequence[torch.Tensor], layout: _Layout, hosts: list
) -> tuple[memoryview, memoryview]:
    """The host's copy of one component, mapped here privately and shared once every rank of every
    host has checked it holds the same bytes as its host's first rank, which writes it."""
    rank = dist.get_rank()
    writers = {host: hosts.index(host) for host in hosts}
    writer = writers[hosts[rank]]
    path, failure = None, None
    if rank == writer:
        try:
            path = _write(name, wholes, layout)
        except Exception as exc:
            failure = f"rank {rank} could not write {name!r} to {SHARED_FOLDER} ({exc})"
    mappings = None
    try:
        every = _exchange(group, (path, failure, layout.signature))
        _raise_any(
            [failure for _, failure, _ in every]
            + [
                f"rank {other} lays {name!r} out otherwise than rank {writers[hosts[other]]} (other tensors, shapes or dtypes)"
                for other in range(len(hosts))
                if every[other][2] != every[writers[hosts[other]]][2]
            ]
        )
        path = every[writer][0]
        try:
            mappings = _map(path, layout.span)
            same = all(
                torch.equal(whole, slot(mappings[0], offset, whole.numel()))
                for whole, offset in zip(wholes, layout.offsets)
            )
            failure = None if same else f"rank {rank} holds other weights for {name!r} than rank {writer}"
        except Exception as exc:
            failure = f"rank {rank} could not map {path} ({exc})"
        failures = _exchange(group, failure)
    finally:
        if rank == writer and path is not None:
            os.unlink(path)  # every rank of the host has mapped it by now, failed to, or is gone
    _raise_any(failures)
    return mappings


def _write(name: str, wholes: Sequence[torch.Tensor], layout: _Layout) -> str:
    """The host's first rank writes the component's storages into a new file of shared memory."""
    path = os.path.join(SHARED_FOLDER, f"{FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}-{name}")
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        # Reserved here: a tmpfs that runs out of room while its pages are written through a
        # mapping kills the process (SIGBUS) instead of failing a call.
        os.posix_fallocate(descriptor, 0, layout.span)
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


def _map(path: str, span: int) -> tuple[memoryview, memoryview]:
    """The file mapped privately (the host's pages, copied for this rank alone if it writes one) and
    shared (the host's pages, which loads read). A mapping lasts as long as a tensor over it does
    (each holds a view of the memoryview)."""
    descriptor = os.open(path, os.O_RDWR)
    try:
        return tuple(
            memoryview(mmap.mmap(descriptor, span, flags=flags)) for flags in (mmap.MAP_PRIVATE, mmap.MAP_SHARED)
        )
    finally:
        os.close(descriptor)


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


def shared_and_owned_bytes(masters: Iterable[torch.Tensor]) -> tuple[int, int]:
    """Bytes of ``masters`` that this rank reads from its host's copy, and bytes it holds alone:
    masters elsewhere, and the pages it wrote of the mappings that hold these masters, which got
    copies of their own (from ``/proc/self/smaps``, as a report asks; not a hot path)."""
    mappings: dict[tuple[int, int], int] = {}  # address range -> bytes written (copied for this rank)
    try:
        with open("/proc/self/smaps") as smaps:
            current = None
            for line in smaps:
                fields = line.split()
                if not fields[0].endswith(":"):  # a mapping's first line: its address range, ..., its path
                    current = tuple(int(end, 16) for end in fields[0].split("-")) if FILE_PREFIX in line else None
                    if current is not None:
                        mappings[current] = 0
                elif current is not None and fields[0] == "Anonymous:":
                    mappings[current] += int(fields[1]) * 1024
    except OSError:
        mappings = {}
    total = in_copy = 0
    holding = set()
    for master in masters:
        total += master.numel()
        where = next((span for span in mappings if span[0] <= master.data_ptr() < span[1]), None)
        if where is not None:
            in_copy += master.numel()
            holding.add(where)
    shared = max(0, in_copy - sum(mappings[span] for span in holding))
    return shared, total - shared
