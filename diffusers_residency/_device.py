"""The accelerator, seen through ``torch.accelerator`` and the generic ``torch.Stream``/``torch.Event``.

Every device- or platform-specific branch of the package lives here, so the stager, the retention
budget and the hooks read as if every device were an accelerator. On ``device="cpu"`` the same code
runs with no streams, no events and no pinning: copies are synchronous and timed on the host clock.
That keeps the whole mechanism testable on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# The widest alignment CPU kernels branch on (a cache line; AVX-512 loads).
CPU_ALIGNMENT = 64


def is_accelerator(device: torch.device) -> bool:
    return device.type != "cpu"


def current_accelerator() -> torch.device | None:
    """The accelerator this process can compute on, or None.

    Plain ``torch.accelerator.current_accelerator()`` names the accelerator torch was built for: a
    CUDA build on a machine without a GPU (or with ``CUDA_VISIBLE_DEVICES=""``) reports ``cuda``,
    and the first device call then fails inside torch ("Found no NVIDIA driver").
    """
    return torch.accelerator.current_accelerator(check_available=True)


def resolve_device(device: str | torch.device | int | None) -> torch.device:
    """The device that staged modules compute on, with an explicit index for an accelerator.

    ``None`` means the current accelerator; a CPU-only process has none, and silently falling back to
    the CPU would hide a broken install, so that raises.
    """
    if device is None:
        accelerator = current_accelerator()
        if accelerator is None:
            raise RuntimeError(
                "No accelerator is available to stage weights on. Pass device='cpu' to run the offload "
                "mechanism on the CPU (unpinned, synchronous), or install a torch build for your GPU."
            )
        device = accelerator
    device = torch.device(device)
    if device.type == "cpu":
        return device
    accelerator = current_accelerator()
    if accelerator is None or accelerator.type != device.type:
        choices = "'cpu'" if accelerator is None else f"{accelerator.type!r} or 'cpu'"
        raise ValueError(
            f"device={str(device)!r} is not a device weights can be staged on and computed with in this process; "
            f"pass device={choices}"
        )
    if device.index is not None and device.index >= torch.accelerator.device_count():
        raise ValueError(
            f"device={str(device)!r} does not exist: there are {torch.accelerator.device_count()} {device.type} "
            f"device(s), numbered from 0"
        )
    return _indexed(device)


def _indexed(device: torch.device) -> torch.device:
    """``device`` with the current index where an accelerator's is left out."""
    if is_accelerator(device) and device.index is None:
        return torch.device(device.type, torch.accelerator.current_device_index())
    return device


def same_device(a: torch.device, b: torch.device) -> bool:
    """Device equality where ``cuda`` and ``cuda:<current>`` are the same place."""
    return a.type == b.type and (a.index == b.index or _indexed(a) == _indexed(b))


def slices_storages(device: torch.device) -> bool:
    """Whether a slice of a storage on ``device`` is memory a tensor can live in: a storage's data
    pointer is an address on the CPU and CUDA (ROCm included), but MPS hands out a buffer handle,
    to which an offset means nothing. Elsewhere one allocation is made per storage (see
    staging.ModuleStager._placed)."""
    return device.type in ("cpu", "cuda")


def host_alignment(host: torch.Tensor) -> int:
    """The tensor's address modulo the widest alignment CPU kernels branch on."""
    return host.data_ptr() % CPU_ALIGNMENT


def allocate_device_storage(nbytes: int, device: torch.device, *, alignment: int) -> torch.Tensor:
    """Allocate ``nbytes`` of device memory as a flat byte tensor.

    On an accelerator the storage is allocated on the *current* (compute) stream. The caching
    allocator is stream-ordered: a block belongs to the stream it was allocated on and is only handed
    out again to work on that stream. Allocating here rather than inside the copy stream's context
    means that once the staged weights are dropped, their blocks cannot be reused by the next load's
    copy while the compute stream may still be reading them (the all-NaN failure of diffusers #14657).

    On the CPU the copy starts at ``alignment`` modulo 64: the address the weights had when they
    were attached (see :func:`host_alignment`). CPU GEMM kernels split their work by pointer
    alignment, so a weight copied to a differently aligned address computes results that differ in
    the last bit (weights loaded from safetensors are often not 64-byte aligned). The shift keeps
    every tensor's natural alignment, because the original address was a multiple of every item
    size stored there.

    This is also the one named point where tests inject an out-of-memory error on a machine that has
    no device memory to exhaust.
    """
    if is_accelerator(device):
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    padded = torch.empty(nbytes + CPU_ALIGNMENT, dtype=torch.uint8)
    shift = (alignment - padded.data_ptr()) % CPU_ALIGNMENT
    return padded[shift : shift + nbytes]


@dataclass(frozen=True)
class MemoryTelemetry:
    """Allocator and device figures, in bytes, read at one component boundary."""

    reserved: int
    allocated: int
    free: int
    total: int

    @property
    def cached(self) -> int:
        """Reserved by the caching allocator but backing no live tensor: reusable without cudaMalloc."""
        return max(0, self.reserved - self.allocated)


def read_memory_telemetry(device: torch.device) -> MemoryTelemetry | None:
    """The caching allocator's figures, or None where the platform has none (the CPU)."""
    if not is_accelerator(device):
        return None
    stats = torch.accelerator.memory_stats(device)
    free, total = torch.accelerator.get_memory_info(device)
    return MemoryTelemetry(
        reserved=int(stats.get("reserved_bytes.all.current", 0)),
        allocated=int(stats.get("allocated_bytes.all.current", 0)),
        free=int(free),
        total=int(total),
    )


def device_model(device: torch.device) -> str:
    """What the device is, for telling measurements made on one kind of device from another's:
    the CUDA device's product name, else the device type."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def peak_allocated(device: torch.device) -> int | None:
    """The most memory tensors held on ``device`` at once since the process started or the peak was
    last reset; None where the platform does not count (the CPU)."""
    return int(torch.accelerator.max_memory_allocated(device)) if is_accelerator(device) else None


def peak_reserved(device: torch.device) -> int | None:
    """The most memory the caching allocator held from the device at once (tensors, and cached blocks
    too fragmented to serve the next request): what a device of that size must have. None on the CPU."""
    return int(torch.accelerator.max_memory_reserved(device)) if is_accelerator(device) else None


def reset_peak_allocated(device: torch.device) -> None:
    if is_accelerator(device):
        torch.accelerator.reset_peak_memory_stats(device)


def allocator_retries(device: torch.device) -> int | None:
    """How often the caching allocator, out of memory, freed its cache (synchronising the device)
    and tried again, since the process started; None where there is no such allocator."""
    if not is_accelerator(device):
        return None
    return int(torch.accelerator.memory_stats(device).get("num_alloc_retries", 0))


def cap_device_memory(device: torch.device, nbytes: int | None) -> bool:
    """Make the caching allocator refuse to hold more than ``nbytes`` on ``device`` (None lifts the
    cap), as a smaller GPU would. Only CUDA has such a cap; returns whether one is in force."""
    if device.type != "cuda":
        return False
    device = _indexed(device)  # torch's memory fraction wants an index
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(1.0 if nbytes is None else min(1.0, nbytes / total), device)
    return nbytes is not None


def empty_cache(device: torch.device) -> None:
    """Give the caching allocator's unused blocks back to the driver; nothing to give back on the CPU."""
    if is_accelerator(device):
        torch.accelerator.empty_cache()


# Where the CUDA caching allocator reads its settings when torch cannot say which it read (before
# 2.13); which of the two wins when both are set has changed between versions.
_ALLOCATOR_SETTINGS_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
# Free memory the cache may hold and a kept load still take segments of its own: the free ends of
# the segments that hold weights (a large allocation is rounded up to 2 MiB, an expandable
# segment's pieces are 20 MiB).
_CACHED_SLACK = 64 << 20


def without_expandable_segments(settings: str) -> str | None:
    """``settings`` (an allocator settings string) with ``expandable_segments`` switched off, every
    other option as it was; None where they are not switched on."""
    entries = [entry.strip() for entry in settings.split(",") if entry.strip()]
    keys = [entry.partition(":")[0].strip() for entry in entries]
    if "expandable_segments" not in keys:
        return None
    at = keys.index("expandable_segments")
    if entries[at].partition(":")[2].strip().lower() != "true":
        return None
    entries[at] = "expandable_segments:False"
    return ",".join(entries)


def _allocator_settings() -> str | None:
    """The allocator's settings string: as it is now where torch can read it back, else from the
    environment (None where both variables are set and differ)."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is not None:
        return getter()
    found = {os.environ.get(name) for name in _ALLOCATOR_SETTINGS_VARIABLES} - {None, ""}
    return found.pop() if len(found) == 1 else (None if found else "")


def _set_allocator_settings(settings: str) -> None:
    # The accelerator-generic setter where this torch has it (2.10 on, where torch.cuda's warns
    # that it is deprecated); torch.cuda's before.
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setter(settings)


@contextlib.contextmanager
def segments_of_their_own(device: torch.device) -> Iterator[None]:
    """Device memory allocated inside comes from segments of its own (``cudaMalloc``), not from
    expandable segments, where the process runs with ``expandable_segments:True`` and the cache holds
    no free memory a load could reuse.

    For weights kept on the device until a sleep, a replan or a disable, loaded together (a wake, or
    the resident units a plan loads ahead): the allocator maps and unmaps an expandable segment in
    20 MiB pieces, one driver call each way per piece, so a level-1 sleep of FLUX.1-dev's 33.7 GB
    spent most of its time giving them back, and its wake mapping them. Other loads keep the
    expandable segments, which spare fragmentation under a tight cap. With expandable segments off
    the allocator does not reuse cached expandable memory, so a cache holding some is left as it is
    (a wake into the memory another pipeline left, see AwakeRotation): new segments beside it could
    overrun a cap. vLLM's sleep allocator switches them off around its pool the same way, rewriting
    the whole settings string (the allocator resets every option the string leaves out). The switch
    is process-wide: another thread allocating meanwhile gets segments of its own too.
    """
    if device.type != "cuda" or not _switch.open(device):
        yield
        return
    try:
        yield
    finally:
        _switch.close()


class _SettingsSwitch:
    """The expandable segments switched off for :func:`segments_of_their_own`, process-wide: a
    thread that opens one while another's is open joins it, and the last to close switches them
    back, so that neither loads its weights half in expandable segments."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = 0
        self._settings = ""

    def open(self, device: torch.device) -> bool:
        """Switch them off, or join the switch already made; False where there is nothing to switch."""
        with self._lock:
            if not self._open:
                settings = _allocator_settings()
                switched_off = without_expandable_segments(settings) if settings else None
                memory = read_memory_telemetry(device) if switched_off else None
                if memory is None or memory.reserved - memory.allocated > _CACHED_SLACK:
                    return False
                _set_allocator_settings(switched_off)
                self._settings = settings
            self._open += 1
            return True

    def close(self) -> None:
        with self._lock:
            self._open -= 1
            if not self._open:
                _set_allocator_settings(self._settings)


_switch = _SettingsSwitch()


def synchronize(device: torch.device) -> None:
    if is_accelerator(device):
        torch.accelerator.synchronize(device)


def new_copy_stream(device: torch.device) -> torch.Stream | None:
    return torch.Stream(device=device) if is_accelerator(device) else None


def can_register_host_memory() -> bool:
    """Whether existing host memory can be page-locked in place: the CUDA runtime (and HIP, behind
    the same torch binding) can; other accelerators have no such call."""
    return torch.cuda.is_available()


# cudaHostRegisterPortable, from cuda_runtime_api.h.
_HOST_REGISTER_PORTABLE = 1


def _in_context_of(device: torch.device | None) -> contextlib.AbstractContextManager:
    """Make ``device`` current around a runtime call that needs a context: the runtime uses the
    calling thread's current device, and creates that device's context if it has none. A thread of
    the package's own (a read-back's reader, or one a finalizer runs on) starts on device 0,
    whichever device the pipeline runs on."""
    return torch.cuda.device(device) if device is not None and device.type == "cuda" else contextlib.nullcontext()


def register_host_memory(address: int, nbytes: int, device: torch.device | None = None) -> bool:
    """Page-lock existing host memory where it is (``cudaHostRegister``), in ``device``'s context
    (default: the calling thread's current device); False where that cannot be done, and the memory
    stays pageable."""
    if not can_register_host_memory():
        return False
    # Portable: locked for every device's context, not only the one it was registered in.
    with _in_context_of(device):
        error = torch.cuda.cudart().cudaHostRegister(address, nbytes, _HOST_REGISTER_PORTABLE)
    if int(error) == 0:
        return True
    logger.info("Could not page-lock %d bytes of host memory in place (CUDA error %d)", nbytes, int(error))
    _clear_last_cuda_error()
    return False


def unregister_host_memory(address: int, device: torch.device | None = None) -> None:
    with _in_context_of(device):
        error = torch.cuda.cudart().cudaHostUnregister(address)
    if int(error) != 0:
        logger.warning("Could not unregister page-locked host memory at %#x", address)
        _clear_last_cuda_error()


def release_freed_host_heap() -> None:
    """Give the whole pages inside freed malloc chunks back to the system (glibc's ``malloc_trim``).

    Weights that malloc placed in its main heap are copied into masters of their own (see
    ``pinning.IN_PLACE_MIN_BYTES``), and freeing the originals leaves holes that glibc keeps
    resident: the process would hold those weights twice over in RSS. Elsewhere (no glibc) this
    does nothing; the holes are reused by later allocations there."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def _clear_last_cuda_error() -> None:
    """Reset the CUDA runtime's per-thread "last error" after a failed call.

    A failed runtime call stays recorded until ``cudaGetLastError`` reads it, and PyTorch reads it
    after every kernel launch: the next, unrelated kernel would raise this error. torch exposes no
    binding for ``cudaGetLastError``, so it is called from the runtime library the process already
    has loaded (found in ``/proc/self/maps``, never loaded anew; every one found, since another
    library may have brought its own copy).
    """
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart" in line or "libamdhip64" in line}
    cleared = False
    for path in paths:  # a process may hold more than one runtime; the error sits in torch's
        try:
            runtime = ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
            (getattr(runtime, "cudaGetLastError", None) or runtime.hipGetLastError)()
            cleared = True
        except (OSError, AttributeError):
            continue
    if not cleared:
        logger.warning("Could not clear a failed CUDA call's error; the next kernel launch may report it")


def compute_timestamp(device: torch.device) -> torch.Event | float:
    """The point the compute stream has reached: an event on an accelerator (recorded, not waited
    for), the host clock on the CPU, where compute is synchronous."""
    if not is_accelerator(device):
        return time.perf_counter()
    event = torch.Event(device=device, enable_timing=True)
    event.record(torch.accelerator.current_stream(device))
    return event


def has_passed(stamp: torch.Event | float) -> bool:
    """Whether the compute stream has passed a :func:`compute_timestamp` (asked, not waited for)."""
    return isinstance(stamp, float) or stamp.query()


def seconds_between(start: torch.Event | float, end: torch.Event | float) -> float:
    """Seconds from one :func:`compute_timestamp` to a later one (waiting for the later one to pass)."""
    if isinstance(start, float):
        return end - start
    end.synchronize()
    return start.elapsed_time(end) / 1000.0


class TimedCopy:
    """Host-to-device copies on a side stream, ordered against the compute stream without a host sync.

    ``with timed_copy.running():`` makes the copy stream wait for the compute stream (the destination
    blocks may have been freed by compute work still in flight), runs the body on the copy stream and
    records one reusable event. :meth:`join` then makes the compute stream wait on that event: the
    host never blocks on a load. The two are apart so that a copy made ahead (the next blocks of a
    streamed component) is waited for only where its weights are first used; joining at once would
    hold the compute stream behind every copy queued ahead of it, and copies and compute would run
    one after the other. The same event pair times the copy; its elapsed time is read at the next
    load or when asked, by which point the copy finished long ago, so reading it costs no stall.
    """

    def __init__(self, device: torch.device, copy_stream: torch.Stream | None) -> None:
        self.device = device
        self.copy_stream = copy_stream
        self._seconds = 0.0
        self._pending = False
        self._timed = True
        # The last copy's event has not been waited on by the compute stream yet.
        self._unjoined = False
        if copy_stream is not None:
            self._start = torch.Event(device=device, enable_timing=True)
            self._done = torch.Event(device=device, enable_timing=True)

    def wait(self) -> None:
        """Block until the last copy has finished reading its source (before that memory may go)."""
        self._collect()

    @property
    def seconds(self) -> float:
        """Total seconds the copies took on the copy stream (on the host clock on the CPU)."""
        self._collect()
        return self._seconds

    @property
    def in_flight(self) -> bool:
        """Whether the last copy may still be running (asked, not waited for)."""
        return self._pending and not self._done.query()

    def _collect(self) -> None:
        if self._pending:
            self._done.synchronize()
            if self._timed:
                self._seconds += self._start.elapsed_time(self._done) / 1000.0
            self._pending = False

    @contextlib.contextmanager
    def running(self, *, timed: bool = True) -> Iterator[None]:
        """Run the body's copies on the copy stream; ``timed``: count their time in :attr:`seconds`."""
        if self.copy_stream is None:
            started = time.perf_counter()
            yield
            if timed:
                self._seconds += time.perf_counter() - started
            return
        self._collect()
        compute_stream = torch.accelerator.current_stream(self.device)
        self.copy_stream.wait_stream(compute_stream)
        self._start.record(self.copy_stream)
        completed = False
        try:
            with self.copy_stream:
                yield
            completed = True
        finally:
            # Recorded after a failure in the body too: the copies it queued before failing still
            # read their sources, and whoever lets those go first waits for this event (see wait).
            # Their time is not counted: their bytes are not.
            self._done.record(self.copy_stream)
            self._pending, self._timed = True, timed and completed
            self._unjoined = True

    def join(self) -> None:
        """Make the compute stream wait for the last copy (on the device; the host goes on). Needed
        before the copied weights are read, and before their storage is dropped: the allocator
        hands freed blocks to later compute work, which must come after the copy into them."""
        if self._unjoined:
            torch.accelerator.current_stream(self.device).wait_event(self._done)
            self._unjoined = False
