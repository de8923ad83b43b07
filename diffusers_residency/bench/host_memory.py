"""Host memory as a run meets it: the process's anonymous memory (what a host budget bounds) sampled
through setup and every call, and the page cache of the checkpoint files dropped for a cold run.

``RssAnon`` counts the process's own pages: masters in RAM, page-locked or not, the ring of slots,
and everything else the process allocated. Pages of a file mapping that the process never wrote to
(masters served from checkpoint files) are ``RssFile``: the page cache's, which the kernel can drop.
``VmLck`` adds pages locked with ``mlock`` (a page-locked anonymous page is already in ``RssAnon``).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

# How often the sampler reads /proc/self/status: often enough to see a load's transient.
_SAMPLE_SECONDS = 0.01


def process_memory() -> dict[str, int]:
    """``RssAnon``, ``RssFile``, ``VmLck``, ``VmPin`` and ``VmHWM`` of this process, in bytes (Linux;
    empty elsewhere)."""
    wanted = ("RssAnon", "RssFile", "VmLck", "VmPin", "VmHWM")
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return {}
    found = {}
    for line in lines:
        name, _, value = line.partition(":")
        if name in wanted:
            found[name] = int(value.split()[0]) * 1024  # kB
    return found


def anonymous_bytes() -> int | None:
    """``RssAnon`` plus ``VmLck``: the host memory a host budget is about (None off Linux)."""
    memory = process_memory()
    return memory["RssAnon"] + memory.get("VmLck", 0) if "RssAnon" in memory else None


class PeakAnonymous:
    """The most :func:`anonymous_bytes` seen between :meth:`start` and :meth:`stop`, sampled by a
    thread every 10 ms (a transient shorter than that can be missed)."""

    def __init__(self) -> None:
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peak_anonymous", daemon=True)

    def _sample(self) -> None:
        while True:
            now = anonymous_bytes()
            if now is not None:
                self.peak = max(self.peak or 0, now)
            if self._stop.wait(_SAMPLE_SECONDS):
                return

    def start(self) -> PeakAnonymous:
        self._thread.start()
        return self

    def stop(self) -> int | None:
        self._stop.set()
        self._thread.join()
        now = anonymous_bytes()
        if now is not None:
            self.peak = max(self.peak or 0, now)
        return self.peak


def drop_page_cache(folder: str | os.PathLike) -> int:
    """Ask the kernel to drop the page cache of every safetensors file under ``folder``
    (``POSIX_FADV_DONTNEED``: pages mapped by a process, or dirty, stay), and return the files'
    bytes. No privileges needed, unlike ``/proc/sys/vm/drop_caches``."""
    total = 0
    for path in Path(folder).rglob("*.safetensors"):
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(descriptor).st_size
        finally:
            os.close(descriptor)
    return total
