"""``LengthSource``: the length index as a stream, one sample's estimate at a time.

``build_length_index`` is the fast, cached way to get every length at once. This node is for
graphs that want lengths as items (a streaming planner, a length report, a custom filter):
it yields ``{"sample_id", "total", "visual"}`` in sample-id order, and its state is one int,
so a resumed graph continues at the next id without re-estimating anything before it.

>>> from neatpack.pipes.indexing.estimate import LengthEstimator
>>> from neatpack.pipes.reading.read import SequenceSource
>>> records = [{"messages": [{"role": "user", "content": "hi " * n},
...                          {"role": "assistant", "content": "ok"}]} for n in (3, 30)]
>>> node = LengthSource(SequenceSource(records), LengthEstimator())
>>> [item["sample_id"] for item in node]
[0, 1]
"""

from __future__ import annotations

from typing import Any

from torchdata.nodes import BaseNode

from neatpack.pipes.indexing.estimate import LengthEstimator

__all__ = ["LengthSource"]


class LengthSource(BaseNode[dict[str, int]]):
    """Yields each sample's estimated ``total`` and ``visual`` tokens; state = the next id."""

    CURSOR_KEY = "cursor"

    def __init__(self, source: Any, estimator: LengthEstimator) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # BaseNode.__init__ is unannotated
        self.source, self.estimator = source, estimator
        self._cursor = 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._cursor = 0 if initial_state is None else int(initial_state[self.CURSOR_KEY])

    def next(self) -> dict[str, int]:
        if self._cursor >= len(self.source):
            raise StopIteration
        sample_id = self._cursor
        total, visual = self.estimator.estimate(self.source[sample_id])
        self._cursor += 1
        return {"sample_id": sample_id, "total": int(total), "visual": int(visual)}

    def get_state(self) -> dict[str, Any]:
        return {self.CURSOR_KEY: self._cursor}
