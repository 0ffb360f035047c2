"""``StepChain``: steps run one after the other on each item, in a worker stage."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .per_pack import PerPack

__all__ = ["StepChain"]


class StepChain:
    """Steps run one after the other on each item: ``StepChain(f, g)(x) == g(f(x))``.

    The unit of work a worker stage (``neatpack.graphs.map_stage``) runs in its workers. Steps
    must be pure (stateless): a worker's state is never saved, so a step that defines
    ``get_state`` is refused; make it a node in the main process instead.

    >>> StepChain(lambda x: x + 1, lambda x: x * 10)(2)
    30
    """

    def __init__(self, *steps: Callable[[Any], Any]) -> None:
        for step in steps:
            inner = step.step if isinstance(step, PerPack) else step
            if not callable(step):
                raise TypeError(f"StepChain: step {step!r} is not callable")
            if hasattr(inner, "get_state"):
                raise TypeError(
                    f"StepChain: step {inner!r} has get_state(): a step with state cannot run "
                    "in worker processes (its state is never saved, so a resume would restart "
                    "it empty). Make it a node in the main process, before or after the "
                    "worker stage (see README 'Compose your own graph')"
                )
        self.steps = tuple(steps)

    def __call__(self, item: Any) -> Any:
        for step in self.steps:
            item = step(item)
        return item

    def __repr__(self) -> str:
        return "StepChain(" + ", ".join(repr(s) for s in self.steps) + ")"
