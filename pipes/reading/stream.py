"""What a streaming graph reads: shards, each an ordered sequence of records that can be read
again from any position.

A stream cannot be indexed before training, but it can still be resumed exactly if every
record has a stable address: ``(shard, position)``, position counted from 0 inside the shard.
The streaming packer keeps only addresses in its state (the records it holds in its buffer and
each shard's next position), never the records, and reads them again after a restart. Shards
are the unit that is spread over ranks and workers, and spread again when their number
changes.

>>> src = ListStream([["a", "b", "c"], ["d"]])
>>> src.shards()
['0', '1']
>>> list(src.open(0, start=1))
['b', 'c']
>>> sample_id(1, 0), address(sample_id(1, 0))
(1099511627776, (1, 0))
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["POSITION_BITS", "ListStream", "StreamSource", "address", "sample_id"]

#: bits of a sample id that hold the position inside its shard (2**40: a trillion records)
POSITION_BITS = 40


@runtime_checkable
class StreamSource(Protocol):
    """Shards of records, each re-readable from a position.

    * ``shards()``: stable names, one per shard, in a fixed order (a shard's index is its
      place in this list);
    * ``open(shard, start)``: the raw records of shard ``shard`` from position ``start`` on,
      in the same order every time (the same record at the same position);
    * ``fingerprint()``: identifies the content and the order (saved in the loader's state, so
      a state is never resumed on other data).
    """

    def shards(self) -> Sequence[str]: ...

    def open(self, shard: int, start: int = 0) -> Iterator[Any]: ...

    def fingerprint(self) -> str: ...


def sample_id(shard: int, position: int) -> int:
    """The stream's sample id of a record: its shard in the high bits, its position in the low
    ``POSITION_BITS`` (the ledger and the bookkeeping count plain ints, as for a planned graph)."""
    if not 0 <= position < 1 << POSITION_BITS or shard < 0:
        raise ValueError(f"{shard=}, {position=} out of range (position < 2**{POSITION_BITS})")
    return (shard << POSITION_BITS) | position


def address(sid: int) -> tuple[int, int]:
    """``(shard, position)`` of a stream sample id (the inverse of ``sample_id``)."""
    return sid >> POSITION_BITS, sid & ((1 << POSITION_BITS) - 1)


class ListStream:
    """Shards held in memory (lists of raw records): for tests and small generated data."""

    def __init__(self, shards: Sequence[Sequence[Any]]) -> None:
        self._shards = [list(s) for s in shards]

    def shards(self) -> list[str]:
        return [str(i) for i in range(len(self._shards))]

    def open(self, shard: int, start: int = 0) -> Iterator[Any]:
        return iter(self._shards[shard][start:])

    def fingerprint(self) -> str:
        return hashlib.sha256(
            json.dumps(self._shards, sort_keys=True, default=str).encode()
        ).hexdigest()
