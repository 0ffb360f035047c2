"""``RecordReader``: a record source as a stream of ``{"sample_id", "record"}``, resumable.

For streaming graphs that read raw records as items (a filter on the raw data, a length report,
a custom planner); the prebuilt graphs read records by id inside the materialize step instead.
Its state is one int, the next id, so a resumed graph reads no record twice.

>>> from neatpack.pipes.reading.read import SequenceSource
>>> records = [{"messages": [{"role": "user", "content": "hi"}]}] * 3
>>> reader = RecordReader(SequenceSource(records))
>>> [item["sample_id"] for item in reader]
[0, 1, 2]
"""

from __future__ import annotations

from typing import Any

from torchdata.nodes import BaseNode

__all__ = ["RecordReader"]


class RecordReader(BaseNode[dict[str, Any]]):
    """Yields ``{"sample_id": i, "record": source[i]}`` for i in ``[start, len(source))``."""

    CURSOR_KEY = "cursor"

    def __init__(self, source: Any, *, start: int = 0) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # BaseNode.__init__ is unannotated
        if not 0 <= start <= len(source):
            raise ValueError(f"{start=} must be in [0, {len(source)}] (the source's length)")
        self.source, self.start = source, start
        self._cursor = start

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._cursor = self.start if initial_state is None else int(initial_state[self.CURSOR_KEY])

    def next(self) -> dict[str, Any]:
        if self._cursor >= len(self.source):
            raise StopIteration
        sample_id = self._cursor
        record = self.source[sample_id]
        self._cursor += 1
        return {"sample_id": sample_id, "record": record}

    def get_state(self) -> dict[str, Any]:
        return {self.CURSOR_KEY: self._cursor}
