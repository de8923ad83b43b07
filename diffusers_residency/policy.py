"""Where a component's weights live between its uses: the one word the planner, the runtime and the
report share, in a module of its own so that none of them imports another for it."""

from __future__ import annotations

from enum import Enum


class Policy(str, Enum):
    """Where a component's weights live between its uses."""

    STAGED = "staged"  # on the device only while in use, loaded whole
    RESIDENT = "resident"  # loaded on first use, kept
    STREAMED = "streamed"  # trunk and some blocks kept, the other blocks loaded around their use

    @classmethod
    def parse(cls, value: str | Policy, what: str) -> Policy:
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(repr(p.value) for p in cls)
            raise ValueError(f"{what}: unknown residency policy {value!r}; use one of {choices}") from None
