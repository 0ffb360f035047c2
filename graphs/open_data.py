"""Opening the data a graph reads: ``open_source`` turns what a user passes (a ``.jsonl`` /
``.json`` path, a list of dicts, a ``datasets.Dataset``, tar / Parquet shards, a source) into a
record source; ``EstimateChecked`` makes the records the length index could not estimate fail
in the worker, where ``on_bad_sample`` decides them."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from neatpack.pipes.contracts import Record
from neatpack.pipes.reading.read import (
    MAX_RECORD_BYTES,
    JsonListSource,
    JsonlSource,
    RecordSource,
    SequenceSource,
)

__all__ = ["MISSING_MEDIA_FIX", "EstimateChecked", "open_source"]

# The graphs' way past a missing media file at index time (``LengthEstimator.missing_media_fix``):
# their own option, not the estimator's ``on_missing_media``, which a graph user cannot pass.
MISSING_MEDIA_FIX = (
    "(a relative path resolves against the config's media_root), or set the config's "
    "on_bad_sample='skip' or 'replace' to leave the sample out, counted by id in "
    "loader.ledgers[epoch].failed"
)


def open_source(
    data: Any,
    media_root: str | None = None,
    *,
    cache_dir: str | None = None,
    rank: int = 0,
    world_size: int = 1,
    max_record_bytes: int | None = MAX_RECORD_BYTES,
) -> RecordSource:
    """A record source for a path (``.jsonl``, ``.json``), a list of dicts or a source; tar /
    Parquet shards (a path, a glob or a list of paths or fsspec URLs ending ``.tar`` /
    ``.parquet``; the tar offset index cached in ``cache_dir``, split over the ranks). A JSONL
    file's line index is cached in ``cache_dir`` too (``JsonlSource``, which also refuses a line
    over ``max_record_bytes`` by its id)."""
    from neatpack.pipes.reading.shards import shard_source

    shards = shard_source(data, media_root, cache_dir=cache_dir, rank=rank, world_size=world_size)
    if shards is not None:
        return shards
    if isinstance(data, (str, os.PathLike)):
        path = Path(data)
        if not path.exists():
            raise FileNotFoundError(
                f"data file {str(path)!r} does not exist: pass a .jsonl or .json"
            )
        if path.suffix == ".json":
            return JsonListSource(path, media_root=media_root)
        return JsonlSource(
            path, media_root=media_root, cache_dir=cache_dir, max_record_bytes=max_record_bytes
        )
    if isinstance(data, RecordSource):
        return data
    if isinstance(data, Sequence):
        return SequenceSource(list(data), media_root=media_root)
    from neatpack.pipes.reading.read import HFDatasetSource

    if hasattr(data, "features"):  # a datasets.Dataset
        return HFDatasetSource(data, media_root=media_root)
    raise TypeError(
        f"cannot read data of type {type(data).__name__}: pass a .jsonl/.json path, a list of "
        "dicts, a datasets.Dataset or a RecordSource"
    )


class EstimateChecked:
    """The record source as the materializer sees it: for the ids the length index could not
    estimate (``on_error="skip"``: a bad ``images_meta``, an unreadable image header) reading
    the record raises the estimator's own error, so ``on_bad_sample`` decides them (skipped or
    replaced, counted as failed) instead of a length-0 plan entry overflowing its pack."""

    def __init__(self, source: RecordSource, estimator: Any, ids: list[int]) -> None:
        self.source, self.estimator, self.ids = source, estimator, frozenset(ids)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, sample_id: int) -> Record:
        record: Record = self.source[sample_id]
        if int(sample_id) in self.ids:
            self.estimator.estimate_sample(record)  # raises EstimateError naming the sample
        return record

    def content_fingerprint(self) -> str:
        return str(self.source.content_fingerprint())

    def prefetch(self, sample_ids: Any) -> None:
        """The source's prefetch (remote shards), if it has one."""
        prefetch = getattr(self.source, "prefetch", None)
        if prefetch is not None:
            prefetch(sample_ids)
