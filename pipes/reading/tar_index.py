"""A tar shard's offset index in flat numpy arrays, cached as ``.npz``.

``index_tar`` (``pipes/reading/shards.py``) lists a shard's samples as ``[(key, {ext: (offset,
size)})]``;
a Python list of dicts costs ~1 KB a sample (10M samples: ~10 GB per rank). ``TarIndex`` keeps
the same facts in five arrays (~60 bytes a sample with short keys) and builds one sample's
``(key, members)`` when it is read. It saves to and loads from an ``.npz`` without pickle::

    >>> idx = TarIndex.from_samples([("a", {"json": (512, 40), "png": (1536, 900)}),
    ...                              ("b", {"json": (3072, 41)})])
    >>> len(idx), idx[0], idx[1]
    (2, ('a', {'json': (512, 40), 'png': (1536, 900)}), ('b', {'json': (3072, 41)}))
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from neatpack.pipes.reading.npz_files import read_npz, write_npz

__all__ = ["TarIndex"]

Members = dict[str, tuple[int, int]]


class TarIndex:
    """Samples ``keys[i]``, their members ``starts[i]:starts[i + 1]`` of ``exts`` /
    ``offsets`` / ``sizes`` (data offset and size in the tar)."""

    FIELDS = ("keys", "starts", "exts", "offsets", "sizes")

    def __init__(
        self,
        keys: npt.NDArray[Any],
        starts: npt.NDArray[np.int64],
        exts: npt.NDArray[Any],
        offsets: npt.NDArray[np.int64],
        sizes: npt.NDArray[np.int64],
    ) -> None:
        if len(starts) != len(keys) + 1 or not len(exts) == len(offsets) == len(sizes):
            raise ValueError(
                f"inconsistent tar index: {len(keys)} keys, {len(starts)} starts, "
                f"{len(exts)} / {len(offsets)} / {len(sizes)} members; rebuild it"
            )
        self.keys, self.starts, self.exts = keys, starts, exts
        self.offsets, self.sizes = offsets, sizes

    @classmethod
    def from_samples(cls, samples: Sequence[tuple[str, Members]]) -> TarIndex:
        counts = [len(m) for _, m in samples]
        members = [(e, o, s) for _, m in samples for e, (o, s) in m.items()]
        return cls(
            keys=np.array([k for k, _ in samples], dtype=str),
            starts=np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64),
            exts=np.array([e for e, _, _ in members], dtype=str),
            offsets=np.array([o for _, o, _ in members], dtype=np.int64),
            sizes=np.array([s for _, _, s in members], dtype=np.int64),
        )

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> tuple[str, Members]:
        a, b = int(self.starts[i]), int(self.starts[i + 1])
        members = {
            str(e): (int(o), int(s))
            for e, o, s in zip(self.exts[a:b], self.offsets[a:b], self.sizes[a:b], strict=True)
        }
        return str(self.keys[i]), members

    def __iter__(self) -> Iterator[tuple[str, Members]]:
        return (self[i] for i in range(len(self)))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Written to a temporary file and renamed: a reader never sees half a file."""
        write_npz(path, **{f: getattr(self, f) for f in self.FIELDS})

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TarIndex:
        """``ValueError`` for a torn or foreign file (the caller rebuilds)."""
        return cls(**read_npz(path, cls.FIELDS, what="tar index cache"))
