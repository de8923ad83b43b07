"""Byte sizes read from and written as text (``"16GB"``, ``"23.80 GB"``), and plain-text tables."""

from __future__ import annotations

import re
from collections.abc import Sequence

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | str, what: str = "vram_budget") -> int:
    """Bytes from an int or a string such as ``"24GB"``, ``"24 GiB"`` or ``"512MB"``."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{what} must be bytes (an int), a string such as '24GB', or 'auto'; got {value!r}")
    if isinstance(value, int):
        number, unit = value, ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(f"{what}={value!r} is not a size; write e.g. '24GB', '16GiB', '8000MB' or bytes as an int")
        number, unit = float(match.group(1)), match.group(2).lower()
    nbytes = int(number * _UNITS[unit])
    if nbytes <= 0:
        raise ValueError(f"{what} must be positive, got {value!r}")
    return nbytes


def format_bytes(nbytes: int) -> str:
    """Bytes in the largest decimal unit that keeps a digit before the point: "23.80 GB", "512.0 kB"."""
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes} B"


def size_unit(largest: int) -> tuple[str, float]:
    """The unit a table of byte sizes up to ``largest`` reads best in, and its size: GB for a pipeline
    of gigabytes, MB or kB for a small one (whose sizes would all read 0.000 GB)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6)):
        if largest >= size:
            return unit, size
    return "kB", 1e3


def text_table(rows: Sequence[Sequence[str]]) -> list[str]:
    """``rows`` (the header first) as lines of left-aligned columns two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def first_line(exc: BaseException) -> str:
    """The exception's type and the start of its message's first line (a message may be empty)."""
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:100]}"
