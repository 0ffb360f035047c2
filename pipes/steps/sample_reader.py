"""``SampleReader``: a reference's sample ids -> their records, read from a source."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["SampleReader"]


class SampleReader:
    """A reference (a ``PackSource`` item) -> ``{"ref": ref, "records": [...]}``, the records of
    its ``sample_ids`` in order, read with ``source[sample_id]`` (any ``RecordSource``).

    The first step of the grouped graph: ``SampleReader -> ConversationTokenizer ->
    PadCollater``. The reference travels along for the bookkeeping of the last step.

    >>> ref = {"epoch": 0, "slot": 0, "pack_index": 0, "padded": False, "sample_ids": [2, 0]}
    >>> SampleReader(["a", "b", "c"])(ref)["records"]
    ['c', 'a']
    """

    def __init__(self, source: Any) -> None:
        self.source = source

    def __call__(self, ref: Mapping[str, Any]) -> dict[str, Any]:
        return {"ref": ref, "records": [self.source[i] for i in ref["sample_ids"]]}
