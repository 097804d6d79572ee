"""Requests about to run: past admission's first checks, not yet placed on a model (waiting for
the router's verdict or the cache's answer). They run next, beside whatever a request placed now
runs beside, so the busy-box move counts them (admission/model_choice.py); the node board tells
the other ingress replicas on the node how many this one holds (admission/node_board.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from admission.node_board import NodeBoard


class Arrivals:
    """This ingress replica's count; `changed` is called at each change (to publish it)."""

    def __init__(self, changed: Callable[[], None]) -> None:
        self.count = 0
        self._changed = changed

    def on_box(self, board: NodeBoard | None) -> int:
        """This replica's and, on `board`, the other ingress replicas' on the node (those elsewhere
        are not known until they run)."""
        return self.count + (board.view().arriving if board is not None else 0)

    def arrive(self) -> Arrival:
        self.count += 1
        self._changed()
        return Arrival(self)

    def _placed(self) -> None:
        self.count = max(0, self.count - 1)
        self._changed()


class Arrival:
    """One request counted until it is placed on a model, served from the cache, or gone:
    uncounted exactly once, whoever gets there first."""

    def __init__(self, arrivals: Arrivals) -> None:
        self._arrivals: Arrivals | None = arrivals

    def end(self) -> None:
        if self._arrivals is not None:
            arrivals, self._arrivals = self._arrivals, None
            arrivals._placed()
