"""Tar and Parquet files as a stream (``pipes/reading/stream.py``): one shard per file, a
position is a sample of the tar (its members sharing a key) or a row of the Parquet file.

The files are read by the existing readers (``pipes/reading/shards.py``: the same records, the
same media rules, local paths or any fsspec URL through ``pipes/reading/remote.py``), one
reader per file, made when the file is first opened: a stream of 10,000 shards does not index
them all before the first batch. A tar file's offset index (headers only) is what lets
``open(shard, start)`` jump to ``start``; a Parquet file's row groups do the same.

>>> import tempfile, pyarrow as pa, pyarrow.parquet as pq
>>> d = tempfile.mkdtemp()
>>> rows = [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(3)]
>>> pq.write_table(pa.Table.from_pylist(rows), f"{d}/a.parquet")
>>> pq.write_table(pa.Table.from_pylist(rows[:1]), f"{d}/b.parquet")
>>> src = ShardStream(f"{d}/*.parquet")
>>> [s.rsplit("/", 1)[1] for s in src.shards()]
['a.parquet', 'b.parquet']
>>> [r["messages"][0]["content"] for r in src.open(0, start=1)]
['q1', 'q2']
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final

from neatpack.pipes.reading._record import RecordError
from neatpack.pipes.reading.remote import FsspecStore, LocalStore, store_for
from neatpack.pipes.reading.shards import ParquetSource, ShardIndexError, TarShardSource

__all__ = ["ShardStream", "check_start"]

KINDS: Final = (".tar", ".parquet")


def check_start(shard: int, start: int, n_shards: int, name: str) -> None:
    """Refuse a shard index or a start position that no shard can have (``name``: the source,
    quoted in the error)."""
    if isinstance(shard, bool) or not isinstance(shard, int) or not 0 <= shard < n_shards:
        raise IndexError(f"{name}: {shard=} is not a shard; valid: 0..{n_shards - 1}")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(
            f"{name} shard {shard}: {start=} is not a position; positions are ints >= 0"
        )


class ShardStream:
    """WebDataset-style tar files or Parquet files (all one kind, ``KINDS``), one shard each.

    ``shards``: a path, a glob (sorted) or a list, local or fsspec URLs (``s3://b/set/*.tar``)
    with their ``storage_options``; ``media_root``, ``retries``, ``allow_hosts`` as for
    ``TarShardSource``; ``cache_dir``: where tar offset indexes are cached by file fingerprint.
    ``open`` yields the readers' raw records (``TarShardSource.raw`` / ``ParquetSource.raw``);
    a record that cannot be read raises the reader's ``RecordError`` naming the file and the
    position, and the caller may open the shard again at the next position."""

    def __init__(
        self,
        shards: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        media_root: str | os.PathLike[str] | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        retries: int = 3,
        allow_hosts: Sequence[str] = (),
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self._store: LocalStore | FsspecStore = store_for(shards, storage_options, retries)
        self.paths = _expand(shards, self._store)
        suffixes = sorted({Path(p).suffix for p in self.paths})
        if len(suffixes) != 1 or suffixes[0] not in KINDS:
            raise ShardIndexError(
                f"stream shards {shards!r} have suffixes {suffixes}; give files of one kind, "
                f"one of {list(KINDS)}"
            )
        self.kind = suffixes[0]
        self._options = {"storage_options": storage_options, "retries": retries}
        self.media_root = media_root
        self.allow_hosts = tuple(allow_hosts)
        self.cache_dir = cache_dir
        self._readers: dict[int, TarShardSource | ParquetSource] = {}
        self._fingerprint: str | None = None

    def shards(self) -> list[str]:
        return list(self.paths)

    def _reader(self, shard: int) -> TarShardSource | ParquetSource:
        if shard not in self._readers:
            path = self.paths[shard]
            if self.kind == ".tar":
                self._readers[shard] = TarShardSource(
                    [path], self.media_root, self.cache_dir, allow_hosts=self.allow_hosts,
                    **self._options,  # type: ignore[arg-type]
                )  # fmt: skip
            else:
                self._readers[shard] = ParquetSource(
                    [path], self.media_root, allow_hosts=self.allow_hosts,
                    **self._options,  # type: ignore[arg-type]
                )  # fmt: skip
        return self._readers[shard]

    def shard_size(self, shard: int) -> int:
        """How many records shard ``shard`` holds (its file is indexed if it was not yet)."""
        return len(self._reader(shard))

    def open(self, shard: int, start: int = 0) -> Iterator[Any]:
        check_start(shard, start, len(self.paths), f"ShardStream({self.kind})")
        reader = self._reader(shard)  # a missing / unreadable file raises ShardIndexError here
        n = len(reader)
        if start > n:
            raise ValueError(
                f"shard {shard} ({self.paths[shard]}): {start=} is past its end ({n} records); "
                "the file changed since the position was saved: resume with the files it was "
                "saved on, or start a new epoch"
            )
        return _records(reader, start, n, self.paths[shard])

    def fingerprint(self) -> str:
        """sha256 over every file's store fingerprint (local: name, size, first and last 64
        KiB; remote: URL, size, ETag, mtime): a changed, added or removed file changes it."""
        if self._fingerprint is None:
            try:
                parts = [self._store.fingerprint(p) for p in self.paths]
            except (OSError, RecordError) as e:
                raise ShardIndexError(f"stream shards cannot be fingerprinted: {e}") from e
            self._fingerprint = hashlib.sha256(
                f"stream{self.kind}:{','.join(parts)}".encode()
            ).hexdigest()
        return self._fingerprint


def _records(
    reader: TarShardSource | ParquetSource, start: int, n: int, path: str
) -> Iterator[Any]:
    """Raw records ``start..n-1`` of a one-file reader; an unreadable one raises its error."""
    for i, raw in enumerate(reader.iter_raw(start, n), start):
        if raw is None:  # iter_raw's marker: read it alone, which raises the named error
            try:
                raw = reader.raw(i)
            except RecordError as e:
                raise RecordError(f"shard {path!r} position {i}: {e}") from e
        yield raw


def _expand(
    shards: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    store: LocalStore | FsspecStore,
) -> list[str]:
    items = [shards] if isinstance(shards, str | os.PathLike) else list(shards)
    found: list[str] = []
    for item in items:
        p = os.fspath(item)
        try:
            got = store.expand(p)
        except RecordError as e:  # a remote store that cannot answer
            raise ShardIndexError(f"stream shards {p!r} cannot be listed: {e}") from e
        if not got:
            what = "match" if any(c in p for c in "*?[") else "exist"
            raise ShardIndexError(f"stream shard {p!r}: no files {what}; fix the path or glob")
        found += got
    return found
