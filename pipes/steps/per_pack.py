"""``PerPack``: a one-pack step applied to every pack of a batch's list."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["PerPack"]


class PerPack:
    """Apply a one-pack step to every pack of a list (a batch's rows).

    >>> PerPack(lambda p: {**p, "seen": True})([{"x": 1}, {"x": 2}])
    [{'x': 1, 'seen': True}, {'x': 2, 'seen': True}]
    """

    def __init__(self, step: Callable[[Any], Any]) -> None:
        self.step = step

    def __call__(self, items: Sequence[Any]) -> list[Any]:
        return [self.step(item) for item in items]

    def __repr__(self) -> str:
        return f"PerPack({self.step!r})"
