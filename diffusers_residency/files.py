"""Checkpoint files as masters: the open file, a master's bytes mapped from it, and the checks that
they still hold the weights (the file unchanged, the mapped pages never written, the same bytes).

A level-2 sleep swaps masters for views of the pipeline's safetensors files (``MappedBytes``),
freeing their memory; :mod:`.file_reads` brings them back.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import weakref
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .pages import written_pages

logger = logging.getLogger(__name__)

# Reading the page cache is a copy the kernel makes on the calling thread: sixteen threads read about
# seven times as fast as one (docs/measurements.md).
READ_THREADS = max(1, min(16, os.cpu_count() or 1))
# Weights are compared with their files through a scratch buffer of this size per thread.
_COMPARED_AT_ONCE = 64 << 20


class OpenFile:
    """A file open for reading, closed once nothing reads it any more.

    Masters read their file through the descriptor, not its path: the path could be given a new
    file (a checkpoint saved again) while their mapping still shows the old one. ``mapping_path``
    names the same open file, for mapping it.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        weakref.finalize(self, os.close, self.fd)
        by_descriptor = f"/proc/self/fd/{self.fd}"
        self.mapping_path = by_descriptor if os.path.exists(by_descriptor) else self.path
        self._stamp = self._stat()

    def _stat(self) -> tuple[int, int]:
        status = os.fstat(self.fd)
        return status.st_size, status.st_mtime_ns

    def changed(self) -> bool:
        """Whether the file was written since it was opened. Written in place (``save_pretrained``
        into the same folder rewrites each file), its mapping shows the new bytes at the old places;
        cut short, touching the mapping past the new end kills the process (SIGBUS)."""
        return self._stat() != self._stamp

    def refuse_if_changed(self) -> None:
        """Raise if the file :meth:`changed`."""
        if self.changed():
            raise RuntimeError(
                f"{self.path} changed since the pipeline's weights were mapped from it (a level-2 sleep, "
                "or a host_budget, keeps them only in that file); they cannot be loaded from it. Restore "
                "the file, or load the pipeline again (and leave the files a pipeline serves weights "
                "from as they are)."
            )


@dataclass(frozen=True)
class MappedBytes:
    """A master's bytes in a checkpoint file: a flat view of them in a private memory mapping of the
    file, and, when known, the open file and where in it they lie."""

    view: torch.Tensor
    file: OpenFile | None = None
    offset: int = 0


def files_of(sources: Iterable[MappedBytes]) -> list[OpenFile]:
    """The open files the sources lie in, each once."""
    return list({id(source.file): source.file for source in sources if source.file is not None}.values())


def _view_written(view: torch.Tensor) -> bool:
    return written_pages(view.data_ptr(), view.data_ptr() + view.numel())


def fill_from_file(slot: torch.Tensor, source: MappedBytes) -> None:
    """Copy a master's bytes into ``slot``: with ``pread`` from its file where this process never
    wrote to its mapped view, else from the view.

    Copying from the view makes the kernel fault in every 4 KiB page of the mapping and, at the
    end, unmap them; reading the file copies out of the page cache with neither, and ran 1.6x as
    fast (docs/measurements.md)."""
    if source.file is None or _view_written(source.view):
        slot.copy_(source.view)
    elif not read_into(source.file, source.offset, [bytes_of(slot)]):
        refuse_short_read(source.file, source.offset, slot.numel())


def refuse_short_read(file: OpenFile, offset: int, nbytes: int) -> None:
    file.refuse_if_changed()
    raise RuntimeError(f"{file.path} ends before the {nbytes} bytes at {offset}")


def bytes_of(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview over a flat byte tensor's memory (``preadv`` reads into buffers)."""
    return memoryview((ctypes.c_uint8 * tensor.numel()).from_address(tensor.data_ptr())).cast("B")


# The most buffers one preadv takes (the kernel's UIO_MAXIOV).
_MOST_BUFFERS_PER_READ = 1024


def read_into(file: OpenFile, offset: int, targets: Sequence[memoryview]) -> bool:
    """Fill ``targets`` in turn from consecutive bytes of ``file`` at ``offset`` (a scatter read,
    ``preadv``); False if the file ends first. One call for many weights lying back to back in the
    file: per-weight calls cost their Python overhead a thousand times a component, under the GIL
    that every reader thread shares."""
    pending = [target for target in targets if len(target)]
    first = 0
    while first < len(pending):
        done = os.preadv(file.fd, pending[first : first + _MOST_BUFFERS_PER_READ], offset)
        if done <= 0:
            return False
        offset += done
        while first < len(pending) and done >= len(pending[first]):
            done -= len(pending[first])
            first += 1
        if done:
            pending[first] = pending[first][done:]
    return True


def _same_as_file(master: torch.Tensor, source: MappedBytes, scratch: torch.Tensor) -> bool:
    """Whether ``source`` holds the same bytes as ``master``, read from its file a chunk at a time
    into ``scratch`` where it has one (see :func:`fill_from_file` for why not through the view)."""
    if master.numel() != source.view.numel():
        return False
    if source.file is None or _view_written(source.view):
        return equal_bytes(master, source.view)
    for start in range(0, master.numel(), scratch.numel()):
        chunk = master[start : start + scratch.numel()]
        if not read_into(source.file, source.offset + start, [bytes_of(scratch[: chunk.numel()])]) or not equal_bytes(
            chunk, scratch[: chunk.numel()]
        ):
            return False
    return True


_LIBC = ctypes.CDLL(None)
_LIBC.memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_LIBC.memcmp.restype = ctypes.c_int


def equal_bytes(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Whether two contiguous host tensors of one size in bytes hold the same bytes, by ``memcmp``.
    ``torch.equal`` runs a team of intra-op threads, each busy for the whole comparison: called from
    every reader thread at once, those teams would compete for the same cores, and called between
    the kernel launches of a pipeline whose pace the host sets, they compete with the thread that
    launches them. ``memcmp`` stays on the thread that calls it (and ctypes lets go of the GIL)."""
    nbytes = first.numel() * first.element_size()
    return not nbytes or _LIBC.memcmp(first.data_ptr(), second.data_ptr(), nbytes) == 0


def hold_the_same_bytes(masters: Sequence[torch.Tensor], sources: Sequence[MappedBytes]) -> list[bool]:
    """For each master, whether its source in a checkpoint file holds the same bytes, compared by
    threads (a level-2 sleep compares every weight, and one thread through the views is slow:
    docs/measurements.md)."""
    scratches = threading.local()

    def holds(pair: tuple[torch.Tensor, MappedBytes]) -> bool:
        if not hasattr(scratches, "tensor"):
            scratches.tensor = torch.empty(_COMPARED_AT_ONCE, dtype=torch.uint8)
        return _same_as_file(*pair, scratches.tensor)

    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="hold_the_same_bytes") as readers:
        return list(readers.map(holds, zip(masters, sources)))
