"""Plain-text formatting shared by the plan, the report and the benchmark: byte sizes and tables."""

from __future__ import annotations

from collections.abc import Sequence


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
