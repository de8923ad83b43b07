"""Which component is expected to start next, for loading ahead (see ResidencyGroup._load_ahead).

Inside pipeline calls, the component that started after each start is kept, by that start's
component and how many times it had started before in its call, as the last call ran them: loading
ahead goes there rather than to the next in call order, which a call may leave (a negative prompt
runs SDXL's text encoders twice; img2img encodes with the VAE before the UNet).
"""

from __future__ import annotations

# A component's start in a call: its name, and how many times it had started before in that call.
Start = tuple[str, int]


class StartOrder:
    """The starts of the last pipeline call that ran each, and what followed each."""

    def __init__(self) -> None:
        self._next_start: dict[Start, str] = {}
        # The call the counts below are for, how many times each component started in it, and its
        # last start.
        self._starts_of_call: tuple[int, dict[str, int], Start | None] = (-1, {}, None)

    def note(self, component: str, call: int, in_call: bool) -> Start:
        """``component`` starts (a switch to it) in pipeline call number ``call`` (``in_call``: inside
        one): noted as what followed the start before it, inside a call. Returns this start."""
        current, counts, last = self._starts_of_call
        if current != call:
            current, counts, last = call, {}, None
        if last is not None and in_call:
            self._next_start[last] = component
        start = (component, counts.get(component, 0))
        counts[component] = start[1] + 1
        self._starts_of_call = (current, counts, start)
        return start

    def following(self, start: Start, call_order: tuple[str, ...], in_call: bool) -> str | None:
        """The component expected to start after ``start``: the one that did in the last call that
        ran it, else the next in ``call_order`` (outside a call, or before one ran it)."""
        following = self._next_start.get(start) if in_call else None
        if following is None and start[0] in call_order:
            following = call_order[(call_order.index(start[0]) + 1) % len(call_order)]
        return following
