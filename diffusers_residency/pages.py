"""The process's pages of checkpoint files: which it wrote (its own copies now), and giving back the
ones it only read.

A private mapping of a file (``from_pretrained``'s weights, a level-2 sleep's masters, masters served
from files) shows the page cache's pages until the process writes one, which gets a copy of its own.
"""

from __future__ import annotations

import ctypes
import mmap
import os

PAGE = mmap.PAGESIZE


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment

# For each value of a pagemap entry's top byte, 1 where the page is the process's own copy.
_WRITTEN_BY_TOP_BYTE = bytes(1 if (top & 0x40) or (top & 0xA0) == 0x80 else 0 for top in range(256))


def _written_flags(start: int, end: int) -> bytes | None:
    """One byte per page between the page-aligned addresses ``start`` and ``end``, 1 where the page
    is the process's own copy (``/proc/self/pagemap``: present without the file-page bit, or
    swapped out; a page never written is either not present or a page of the file); None where
    it cannot be told."""
    expected = 8 * ((end - start) // PAGE)
    # Asked for every chunk a load from the files reads (see copy_from_files), by sixteen threads
    # at once: plain descriptor calls and a byte translation stay off the GIL that the thread
    # queueing the copies needs, where a Python file object and tensor arithmetic took it for a
    # few hundred microseconds a chunk.
    try:
        pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            entries = os.pread(pagemap, expected, 8 * (start // PAGE))
        finally:
            os.close(pagemap)
    except OSError:
        return None
    if len(entries) != expected:
        return None
    # The flags are in each little-endian entry's last byte: present (bit 63), swapped (62), a
    # page of the file (61).
    return entries[7::8].translate(_WRITTEN_BY_TOP_BYTE)


def written_pages(start: int, end: int) -> bool:
    """Whether this process wrote to any page of a private file mapping between addresses ``start``
    and ``end`` (or cannot tell)."""
    start, end = start - start % PAGE, align_up(end, PAGE)
    if end <= start:
        return False  # no bytes, no pages
    flags = _written_flags(start, end)
    return flags is None or 1 in flags


def written_spans(start: int, end: int) -> list[tuple[int, int]] | None:
    """The runs of pages between addresses ``start`` and ``end`` that this process wrote to (see
    :func:`written_pages`), as address ranges clipped to ``start`` and ``end``; None where it
    cannot be told."""
    low, high = start - start % PAGE, align_up(end, PAGE)
    if high <= low:
        return []
    flags = _written_flags(low, high)
    if flags is None:
        return None
    spans = []
    first = flags.find(1)
    while first != -1:
        after = flags.find(0, first)
        after = len(flags) if after == -1 else after
        spans.append((max(start, low + first * PAGE), min(end, low + after * PAGE)))
        first = flags.find(1, after)
    return spans


def private_file_mappings() -> list[tuple[int, int]]:
    """The address ranges of this process's private mappings of files (``/proc/self/maps``)."""
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[1][3] == "p" and fields[4] != "0" and fields[5].startswith("/"):
                    low, high = fields[0].split("-")
                    ranges.append((int(low, 16), int(high, 16)))
    except OSError:
        return []
    return ranges


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def give_back_read_pages(start: int, end: int, mappings: list[tuple[int, int]]) -> int:
    """Drop from this process the whole pages between ``start`` and ``end`` that lie in one of
    ``mappings`` (private mappings of files, see :func:`private_file_mappings`) and that it never
    wrote, and return their bytes.

    Such a page is the file's: dropping it (``MADV_DONTNEED``) changes no byte anyone reads, a later
    read maps it from the page cache again. Called on a weight just copied into a master of its
    own: its old pages stayed mapped, and counted in the process's memory, for as long as any other
    weight of the same file was alive (a large one page-locked in place keeps the whole mapping).
    A written page (one page-locked in place is written: locking copies it) is left alone."""
    first, last = align_up(start, PAGE), end - end % PAGE
    if last <= first or not any(low <= first and last <= high for low, high in mappings):
        return 0
    flags = _written_flags(first, last)
    if flags is None:
        return 0
    dropped = 0
    page = 0
    while page < len(flags):
        if flags[page]:
            page += 1
            continue
        run = page
        while run < len(flags) and not flags[run]:
            run += 1
        if _LIBC.madvise(first + page * PAGE, (run - page) * PAGE, mmap.MADV_DONTNEED) == 0:
            dropped += (run - page) * PAGE
        page = run
    return dropped


def drop_pages(start: int, end: int) -> None:
    """Drop from this process the whole pages between ``start`` and ``end`` of a private mapping of
    a file, written or not (``MADV_DONTNEED``): a written page goes back to the system, and reads
    there see the file's bytes again. For bytes that no tensor reads any more."""
    first, last = align_up(start, PAGE), end - end % PAGE
    if last > first:
        _LIBC.madvise(first, last - first, mmap.MADV_DONTNEED)
