"""A ``datasets.IterableDataset`` (``load_dataset(..., streaming=True)``) as a stream
(``pipes/reading/stream.py``): its own shards (``ds.num_shards``: one per data file for the
JSON / Parquet / CSV builders), a position counted by this adapter inside the shard.

Positions never come from the dataset's ``state_dict()``: in ``datasets`` 5.0 it stops advancing
after one ``load_state_dict`` (huggingface/datasets issue 8308: a second resume restarts the
stream from the beginning; the 5.1.0 tested here carries the fix, which
``tests/pipes/test_stream_sources.py`` checks). The adapter counts the records it yields itself,
and uses ``load_state_dict`` only to *seek*: ``open(shard, start)`` makes a fresh one-shard
dataset and loads the state that says "``start`` records of this shard consumed", so the dataset
skips Arrow rows instead of converting them. That state is built only for the layouts whose
meaning is known (``RebatchedArrowExamplesIterable`` over an ``ArrowExamplesIterable`` or a
plain ``ExamplesIterable``); any other layout (a ``.map``, ``.filter``) seeks by reading and
dropping ``start`` records, always right but slower, and counts it in ``seeks_by_reading``.
Image / Video features are read undecoded (bytes, decoded in the workers) as for
``HFDatasetSource``.

>>> import datasets, json, tempfile
>>> d = tempfile.mkdtemp()
>>> for k in range(2):
...     with open(f"{d}/{k}.jsonl", "w") as f:
...         for i in range(3):
...             print(json.dumps({"messages": [{"role": "user", "content": f"{k}.{i}"}]}), file=f)
>>> ds = datasets.load_dataset("json", data_files=[f"{d}/0.jsonl", f"{d}/1.jsonl"],
...                            split="train", streaming=True)
>>> src = HFStream(ds)
>>> len(src.shards()), [r["messages"][0]["content"] for r in src.open(1, start=1)]
(2, ['1.1', '1.2'])
"""

from __future__ import annotations

import copy
import hashlib
import itertools
from collections.abc import Iterator
from typing import Any, Final

from neatpack.pipes.reading._record import RecordError
from neatpack.pipes.reading.remote import is_url, store_for
from neatpack.pipes.reading.shards import ShardIndexError
from neatpack.pipes.reading.stream_files import check_start

__all__ = ["HFStream"]

_LEAVES: Final = ("ArrowExamplesIterable", "ExamplesIterable")
_REBATCH: Final = "RebatchedArrowExamplesIterable"


class HFStream:
    """The shards of a streaming ``datasets.IterableDataset``, each re-readable from a position.

    ``fingerprint``: give one for a dataset without data files (``Dataset.to_iterable_dataset``,
    a generator builder); for file-backed datasets it is the files' own fingerprints (name,
    size, first and last 64 KiB; remote: ETag, size, mtime, with ``storage_options``).
    Refused: a ``.shuffle()`` -d dataset (its buffer order is not re-readable by position; the
    streaming graph mixes shards and samples itself)."""

    def __init__(
        self,
        ds: Any,
        *,
        fingerprint: str | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        try:
            import datasets
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                "HFStream needs the `datasets` package: pip install 'neatpack[datasets]'"
            ) from e
        if not isinstance(ds, datasets.IterableDataset):
            raise TypeError(
                f"HFStream takes a datasets.IterableDataset, got {type(ds).__name__}; for a "
                "datasets.Dataset use HFDatasetSource with a planned graph (or "
                "ds.to_iterable_dataset(num_shards=...) to stream it)"
            )
        from neatpack.pipes.reading.formats import undecoded_dataset

        if shuffled := [n for n in _chain_types(ds._ex_iterable) if "Shuffl" in n]:
            raise ValueError(
                f"HFStream: the dataset is shuffled ({shuffled[0]}): a shuffle buffer's order "
                "cannot be re-read from a position; pass the dataset before .shuffle() (the "
                "streaming graph's buffer and shard order do the mixing)"
            )
        self.ds = undecoded_dataset(ds)
        self.n_shards = int(ds.num_shards)
        self._given_fingerprint = fingerprint
        self._storage_options = storage_options
        self._fingerprint: str | None = None
        self._names: list[str] | None = None
        self.seeks_by_state = 0
        self.seeks_by_reading = 0

    def shards(self) -> list[str]:
        if self._names is None:
            files = [self.files(k) for k in range(self.n_shards)]
            self._names = [",".join(f) if f else f"shard-{k}" for k, f in enumerate(files)]
        return list(self._names)

    def shard_dataset(self, shard: int) -> Any:
        """A fresh one-shard ``IterableDataset`` of shard ``shard`` (contiguous split)."""
        return self.ds.shard(num_shards=self.n_shards, index=shard, contiguous=True)

    def files(self, shard: int) -> list[str]:
        """The data files of shard ``shard`` (empty for a dataset built without files)."""
        leaf = _leaf(self.shard_dataset(shard)._ex_iterable)
        kwargs = getattr(leaf, "kwargs", None) or {}
        found = kwargs.get("original_files") or kwargs.get("base_files") or kwargs.get("files")
        out: list[str] = []
        for f in found or []:  # a path, or an iterable of paths (datasets' FilesIterable)
            out += [f] if isinstance(f, str) else [str(p) for p in f]
        groups = [g for g in kwargs.get("row_groups_list") or [] if g is not None]
        return [*out, *(f"row groups {g}" for g in groups)]

    def open(self, shard: int, start: int = 0) -> Iterator[Any]:
        check_start(shard, start, self.n_shards, "HFStream")
        sub = self.shard_dataset(shard)
        where = f"HFStream shard {shard} ({self.shards()[shard]})"
        if start == 0:
            return _guarded(iter(sub), where, 0)
        state = seek_state(sub.state_dict(), start)
        if state is not None:
            sub.load_state_dict(state)
            self.seeks_by_state += 1
            return _checked_end(_guarded(iter(sub), where, start), self, shard, start, where)
        self.seeks_by_reading += 1
        return _checked_end(
            _guarded(itertools.islice(iter(sub), start, None), where, start),
            self, shard, start, where,
        )  # fmt: skip

    def fingerprint(self) -> str:
        if self._fingerprint is not None:
            return self._fingerprint
        if self._given_fingerprint is not None:
            parts = [f"given:{self._given_fingerprint}"]
        else:
            files = [
                f for k in range(self.n_shards) for f in self.files(k) if not f.startswith("row ")
            ]
            if not files:
                raise ValueError(
                    "HFStream: this IterableDataset has no data files to fingerprint; pass "
                    "HFStream(ds, fingerprint='<a version of its content>')"
                )
            try:
                if any(is_url(f) for f in files):
                    store = store_for(files, self._storage_options)
                    parts = [store.fingerprint(f) for f in files]
                else:
                    parts = [store_for(files).fingerprint(f) for f in files]
            except (OSError, RecordError) as e:
                raise ShardIndexError(f"HFStream: data files cannot be fingerprinted: {e}") from e
        order = ",".join(self.shards())
        self._fingerprint = hashlib.sha256(
            f"hf-stream:{self.n_shards}:{order}:{','.join(parts)}".encode()
        ).hexdigest()
        return self._fingerprint


def seek_state(template: dict[str, Any], start: int) -> dict[str, Any] | None:
    """The state of a fresh one-shard dataset (``template``: its ``state_dict()`` before
    iterating) after ``start`` records, or None for a layout whose state is not known.

    >>> leaf = {"shard_idx": 0, "shard_example_idx": 0, "type": "ArrowExamplesIterable"}
    >>> t = {"examples_iterable": {"examples_iterable": leaf, "previous_state": None,
    ...      "batch_idx": 0, "num_chunks_since_previous_state": 0, "cropped_chunk_length": 0,
    ...      "type": "RebatchedArrowExamplesIterable"}, "epoch": 0}
    >>> s = seek_state(t, 5)["examples_iterable"]
    >>> s["previous_state"]["shard_example_idx"], s["num_chunks_since_previous_state"]
    (0, 5)
    """
    ex = template.get("examples_iterable")
    if set(template) != {"examples_iterable", "epoch"} or not isinstance(ex, dict):
        return None
    out = copy.deepcopy(template)
    if ex.get("type") in _LEAVES and ex.get("shard_idx") == 0:
        out["examples_iterable"]["shard_example_idx"] = start
        return out
    leaf = ex.get("examples_iterable")
    fresh = ex.get("previous_state") is None and ex.get("batch_idx") == 0
    if ex.get("type") != _REBATCH or not isinstance(leaf, dict) or not fresh:
        return None
    if leaf.get("type") not in _LEAVES or leaf.get("shard_idx") != 0:
        return None
    # The rebatcher restarts its leaf at previous_state and drops the first
    # num_chunks_since_previous_state chunks: one row each at the batch size 1 of __iter__.
    out["examples_iterable"].update(
        previous_state=copy.deepcopy(leaf), batch_idx=start,
        num_chunks_since_previous_state=start, cropped_chunk_length=0,
    )  # fmt: skip
    return out


def _guarded(records: Iterator[Any], where: str, start: int) -> Iterator[Any]:
    """The records, with a reading failure (a deleted file, a bad line) named by position."""
    pos = start
    while True:
        try:
            record = next(records)
        except StopIteration:
            return
        except (OSError, ValueError) as e:
            raise ShardIndexError(
                f"{where} position {pos}: {type(e).__name__}: {e}; restore the file (the "
                "stream resumes only on the data it was saved on)"
            ) from e
        yield record
        pos += 1


def _checked_end(
    records: Iterator[Any], src: HFStream, shard: int, start: int, where: str
) -> Iterator[Any]:
    """A seek that yields nothing is checked: ``start`` must then be the shard's length."""
    empty = True
    for r in records:
        empty = False
        yield r
    if empty:
        n = sum(1 for _ in src.shard_dataset(shard))
        if start > n:
            raise ValueError(
                f"{where}: start={start} is past its end ({n} records); the data changed "
                "since the position was saved: resume on the same files, or start a new epoch"
            )


def _leaf(ex: Any) -> Any:
    while hasattr(ex, "ex_iterable"):
        ex = ex.ex_iterable
    return ex


def _chain_types(ex: Any) -> list[str]:
    names = []
    while ex is not None:
        names.append(type(ex).__name__)
        ex = getattr(ex, "ex_iterable", None)
    return names
