"""``python -m diffusers_residency.bench.plot results.json [results.png]``: s/call against peak memory.

One point per mode and budget, from the benchmark's JSON, so a run on a machine without matplotlib
can be drawn elsewhere. Needs matplotlib (``pip install matplotlib``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def draw(data: dict[str, Any], path: Path) -> Path:
    """Draw the results in ``data`` (the benchmark's JSON) to ``path``; ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(8, 5), dpi=120)
    results = [r for r in data["results"] if not r.get("error") and r.get("peak_allocated_bytes") is not None]
    for mode in dict.fromkeys(r["mode"] for r in results):
        points = [r for r in results if r["mode"] == mode]
        axes.scatter([r["peak_allocated_bytes"] / 1e9 for r in points], [r["seconds_per_call"] for r in points], label=mode)
        for r in points:
            budget = "unlimited" if r["budget_bytes"] is None else f"{r['budget_bytes'] / 1e9:.0f} GB"
            axes.annotate(budget, (r["peak_allocated_bytes"] / 1e9, r["seconds_per_call"]), fontsize=7,
                          xytext=(4, 4), textcoords="offset points")  # fmt: skip
    axes.set_xlabel("peak allocated (GB)")
    axes.set_ylabel("seconds per call")
    axes.set_title(data["setting"].split(",")[0], fontsize=10)
    axes.grid(alpha=0.3)
    if results:
        axes.legend(fontsize=8)
    else:
        axes.text(0.5, 0.5, "no peak memory figures (a CPU run)", ha="center", transform=axes.transAxes)
    figure.text(0.01, 0.01, data["environment"], fontsize=6, alpha=0.7)
    figure.tight_layout()
    figure.savefig(path)
    pyplot.close(figure)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    source = Path(argv[0])
    target = Path(argv[1]) if len(argv) > 1 else source.with_suffix(".png")
    print(draw(json.loads(source.read_text()), target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
