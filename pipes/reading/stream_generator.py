"""A user's generator as a stream (``pipes/reading/stream.py``).

A generator cannot be read again from a position, so the user gives what can:
``make(shard, start)``, a function that returns an iterator over shard ``shard``'s records
from position ``start`` on (a seeded generator that skips ``start`` records, a query with an
offset, a file read from a line), and the number of shards. ``key(record)``, optional, names a
record (an id field, a hash of its text): the source remembers the keys it has given out at
each address (the last ``remember`` per shard) and checks them when the same address is read
again, so a generator that is not deterministic (an unseeded RNG, a live feed) is caught at
the first re-read instead of silently training on other data. ``version`` is the user's name
for the generator's content and order (its seed, the data's date); with ``key`` the first
record of every shard is also part of the fingerprint.

>>> import random
>>> def make(shard, start):
...     rng = random.Random(shard)  # seeded per shard: the same records every time
...     for i in range(5):
...         rec = {"id": f"{shard}-{i}", "messages": [
...             {"role": "user", "content": str(rng.random())}]}
...         if i >= start:
...             yield rec
>>> src = GeneratorStream(make, n_shards=2, key=lambda r: r["id"], version="seed-0")
>>> [r["id"] for r in src.open(1, start=3)]
['1-3', '1-4']
>>> [r["id"] for r in src.open(1, start=4)]  # checked against the keys seen above
['1-4']
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from neatpack.pipes.reading.stream_files import check_start

__all__ = ["GeneratorStream", "StreamOrderError"]


class StreamOrderError(RuntimeError):
    """A shard gave another record at an address than before: its generator is not
    deterministic, or its data changed under a running stream."""


class GeneratorStream:
    """Shards made by ``make(shard, start) -> iterator``; ``n_shards`` of them, named
    ``names`` (default ``"0"``, ``"1"``, ...). ``key``: a record's name, checked on re-read;
    ``remember``: how many addresses per shard keep their key (the buffer's re-reads fall in
    the last few thousand); ``version``: the generator's content and order, for the
    fingerprint (required: a function's code is no proof of its output)."""

    def __init__(
        self,
        make: Callable[[int, int], Any],
        n_shards: int,
        *,
        key: Callable[[Any], Any] | None = None,
        version: str,
        names: list[str] | None = None,
        remember: int = 100_000,
    ) -> None:
        if not callable(make):
            raise TypeError(f"make must be a function (shard, start) -> iterator, got {make!r}")
        if isinstance(n_shards, bool) or not isinstance(n_shards, int) or n_shards < 1:
            raise ValueError(f"{n_shards=}: a stream has at least one shard")
        if names is not None and len(names) != n_shards:
            raise ValueError(f"{len(names)} names for {n_shards=}; give one name per shard")
        if not isinstance(version, str) or not version:
            raise ValueError(
                f"{version=}: name the generator's content and order (its seed, its data's "
                "date): a saved state is resumed only on the same version"
            )
        self.make = make
        self.n_shards = n_shards
        self.key = key
        self.version = version
        self.names = list(names) if names is not None else [str(k) for k in range(n_shards)]
        self.remember = remember
        self._seen: dict[int, OrderedDict[int, str]] = {}

    def shards(self) -> list[str]:
        return list(self.names)

    def open(self, shard: int, start: int = 0) -> Iterator[Any]:
        check_start(shard, start, self.n_shards, "GeneratorStream")
        try:
            it = iter(self.make(shard, start))
        except TypeError as e:
            raise TypeError(
                f"GeneratorStream shard {shard}: make({shard}, {start}) did not return an "
                f"iterator ({e}); make must be a function (shard, start) -> iterator"
            ) from e
        return it if self.key is None else self._checked(shard, start, it, self.key)

    def _checked(
        self, shard: int, start: int, records: Iterator[Any], key: Callable[[Any], Any]
    ) -> Iterator[Any]:
        seen = self._seen.setdefault(shard, OrderedDict())
        for pos, record in enumerate(records, start):
            k = _key_text(key(record))
            before = seen.get(pos)
            if before is None:
                seen[pos] = k
                if len(seen) > self.remember:
                    seen.popitem(last=False)
            elif before != k:
                raise StreamOrderError(
                    f"GeneratorStream shard {shard} ({self.names[shard]}) position {pos}: "
                    f"key {k!r}, but {before!r} was read there before; make(shard, start) "
                    "must give the same records in the same order every time (seed its RNG "
                    "from the shard, not the clock)"
                )
            yield record

    def fingerprint(self) -> str:
        parts = [self.version, str(self.n_shards), *self.names]
        if self.key is not None:  # the first record of every shard: a cheap content check
            for k in range(self.n_shards):
                first = next(iter(self.make(k, 0)), None)
                parts.append("" if first is None else _key_text(self.key(first)))
        return hashlib.sha256("\n".join(["generator", *parts]).encode()).hexdigest()


def _key_text(k: Any) -> str:
    return k if isinstance(k, str) else repr(k)
