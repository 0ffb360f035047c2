"""Tar shards' offset index in compact flat arrays, cached as ``.npz`` and memory-mapped.

``index_tar`` (``pipes/reading/shards.py``) lists a shard's samples as ``[(key, {ext: (offset,
size)})]``; a Python list of dicts costs ~1 KB a sample. ``TarIndex`` keeps the same facts for
one shard or many in flat arrays and builds one sample's ``(key, members)`` when it is read:

* per sample: where its members start (``member_starts``) and where its key starts in a byte
  string of every key (``key_starts``, ``keys``: UTF-8, each key less its shard's common
  prefix, ``prefixes``), both uint32 (int64 past 4G members or key bytes);
* per member: its extension as a code into ``exts`` (uint8), its data offset in units of 512
  bytes (``unit``: tar data is block-aligned; 1 if some member is not) and its size, each
  uint32 (int64 when a value does not fit);
* per shard: its first sample id (``shard_starts``, int64).

Two members a sample with 6-byte keys: 26 bytes a sample plus the keys' distinct tails (was
~88 with numpy strings: keys and extensions at 4 bytes a character, int64 offsets). ``save``
writes a checksum; ``load`` maps the arrays (``map_npz``: one copy per node in the page cache)
after checking it, and reads a file of the earlier layout (``keys``, ``starts``, ``exts``,
``offsets``, ``sizes``) into the compact one::

    >>> idx = TarIndex.from_samples([("a/x1", {"json": (512, 40), "png": (1536, 900)}),
    ...                              ("a/x2", {"json": (3072, 41)})])
    >>> len(idx), idx[0], idx[1]
    (2, ('a/x1', {'json': (512, 40), 'png': (1536, 900)}), ('a/x2', {'json': (3072, 41)}))
    >>> both = TarIndex.concat([idx, TarIndex.from_samples([("b", {"txt": (700, 3)})])])
    >>> both[2], both.shard_of(2), both.unit, both.prefixes.tolist(), bytes(both.keys)
    (('b', {'txt': (700, 3)}), 1, 1, ['a/x', 'b'], b'12')
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from neatpack.pipes.reading.npz_files import checksum, map_npz, read_npz, write_npz

__all__ = ["TarIndex"]

Members = dict[str, tuple[int, int]]
LAYOUT = 2
_BLOCK = 512  # tar's block: headers and member data start on it
_WHAT = "tar index cache"


def _small(values: Any) -> npt.NDArray[Any]:
    """uint32 when every value fits (offsets, sizes and positions almost always do), else
    int64."""
    a = np.asarray(values, np.int64)
    return a.astype(np.uint32) if not a.size or (a.min() >= 0 and a.max() < 2**32) else a


class TarIndex:
    """The samples of one or more tar shards (module docstring); ``index[i]`` is sample ``i``
    counted over all of them, ``(key, {ext: (data offset, size)})``."""

    FIELDS = ("shard_starts", "prefixes", "key_starts", "keys", "member_starts", "exts",
              "ext_codes", "offsets", "sizes")  # fmt: skip

    def __init__(self, arrays: Mapping[str, Any], unit: int) -> None:
        a = dict(arrays)
        n = len(a["member_starts"]) - 1
        members = len(a["ext_codes"])
        if (
            unit not in (1, _BLOCK) or n < 0 or len(a["key_starts"]) != n + 1
            or not len(a["offsets"]) == len(a["sizes"]) == members
            or len(a["shard_starts"]) != len(a["prefixes"]) + 1
            or int(a["shard_starts"][-1]) != n
            or (n and (int(a["member_starts"][-1]) != members
                       or int(a["key_starts"][-1]) != len(a["keys"])))
        ):  # fmt: skip
            raise ValueError(
                f"inconsistent tar index: {n} samples, {members} members, "
                f"{len(a['prefixes'])} shards, {unit=}; rebuild it"
            )
        self.arrays = a
        self.unit = unit
        self.shard_starts = a["shard_starts"]
        self.prefixes, self.key_starts, self.keys = a["prefixes"], a["key_starts"], a["keys"]
        self.member_starts, self.exts, self.ext_codes = (
            a["member_starts"], a["exts"], a["ext_codes"]
        )  # fmt: skip
        self.offsets, self.sizes = a["offsets"], a["sizes"]

    @classmethod
    def from_samples(cls, samples: Sequence[tuple[str, Members]]) -> TarIndex:
        """One shard's index from ``index_tar`` 's list."""
        keys = [k for k, _ in samples]
        prefix = os.path.commonprefix(keys) if keys else ""  # noqa: RUF071 (characters wanted)
        tails = [k[len(prefix) :].encode() for k in keys]
        members = [(e, o, s) for _, m in samples for e, (o, s) in m.items()]
        vocab = sorted({e for e, _, _ in members})
        code = {e: i for i, e in enumerate(vocab)}
        offsets = np.asarray([o for _, o, _ in members], np.int64)
        unit = _BLOCK if not (offsets % _BLOCK).any() else 1
        return cls(
            {
                "shard_starts": np.asarray([0, len(samples)], np.int64),
                "prefixes": np.asarray([prefix], dtype=str),
                "key_starts": _small(np.cumsum([0, *(len(t) for t in tails)])),
                "keys": np.frombuffer(b"".join(tails), np.uint8),
                "member_starts": _small(np.cumsum([0, *(len(m) for _, m in samples)])),
                "exts": np.asarray(vocab, dtype=str),
                "ext_codes": np.asarray([code[e] for e, _, _ in members],
                                        np.uint8 if len(vocab) <= 256 else np.int64),
                "offsets": _small(offsets // unit),
                "sizes": _small([s for _, _, s in members]),
            },
            unit,
        )  # fmt: skip

    @classmethod
    def concat(cls, parts: Sequence[TarIndex]) -> TarIndex:
        """The shards of ``parts``, in order, as one index (sample ids run on)."""
        unit = min((p.unit for p in parts), default=_BLOCK)
        vocab = sorted({str(e) for p in parts for e in p.exts})
        code = {e: i for i, e in enumerate(vocab)}

        def run_on(name: str, total: str) -> npt.NDArray[Any]:
            base, out = 0, [np.zeros(1, np.int64)]
            for p in parts:
                out.append(np.asarray(p.arrays[name][1:], np.int64) + base)
                base += len(p.arrays[total])
            return np.concatenate(out)

        bases = np.cumsum([0, *(len(p) for p in parts)])[:-1].tolist()
        shard_starts = np.concatenate([np.zeros(1, np.int64), *(
            np.asarray(p.shard_starts[1:], np.int64) + b for p, b in zip(parts, bases, strict=True)
        )])  # fmt: skip
        codes = [np.asarray([code[str(e)] for e in p.exts], np.int64)[np.asarray(p.ext_codes,
                 np.int64)] for p in parts]  # fmt: skip
        return cls(
            {
                "shard_starts": shard_starts,
                "prefixes": np.concatenate([np.zeros(0, str), *(p.prefixes for p in parts)]),
                "key_starts": _small(run_on("key_starts", "keys")),
                "keys": np.concatenate([np.zeros(0, np.uint8), *(p.keys for p in parts)]),
                "member_starts": _small(run_on("member_starts", "ext_codes")),
                "exts": np.asarray(vocab, dtype=str),
                "ext_codes": np.concatenate([np.zeros(0, np.int64), *codes]).astype(
                    np.uint8 if len(vocab) <= 256 else np.int64),
                "offsets": _small(np.concatenate([np.zeros(0, np.int64), *(
                    np.asarray(p.offsets, np.int64) * (p.unit // unit) for p in parts)])),
                "sizes": _small(np.concatenate([np.zeros(0, np.int64), *(
                    np.asarray(p.sizes, np.int64) for p in parts)])),
            },
            unit,
        )  # fmt: skip

    @classmethod
    def from_old(cls, old: Mapping[str, Any]) -> TarIndex:
        """One shard's index from the arrays of the earlier layout (numpy strings, int64)."""
        keys, starts, exts = old["keys"], old["starts"], old["exts"]
        if len(starts) != len(keys) + 1 or not len(exts) == len(old["offsets"]) == len(
            old["sizes"]
        ):
            raise ValueError(f"inconsistent tar index of the earlier layout: {len(keys)} keys")
        samples = [
            (str(keys[i]), {str(e): (int(o), int(s)) for e, o, s in zip(
                exts[starts[i]:starts[i + 1]], old["offsets"][starts[i]:starts[i + 1]],
                old["sizes"][starts[i]:starts[i + 1]], strict=True)})
            for i in range(len(keys))
        ]  # fmt: skip
        return cls.from_samples(samples)

    def __len__(self) -> int:
        return len(self.member_starts) - 1

    @property
    def nbytes(self) -> int:
        return sum(int(np.asarray(a).nbytes) for a in self.arrays.values())

    def shard_of(self, i: int) -> int:
        return int(np.searchsorted(self.shard_starts, i, side="right")) - 1

    def __getitem__(self, i: int) -> tuple[str, Members]:
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} is outside 0..{len(self) - 1} of the tar index")
        a, b = int(self.member_starts[i]), int(self.member_starts[i + 1])
        tail = bytes(self.keys[int(self.key_starts[i]) : int(self.key_starts[i + 1])])
        key = str(self.prefixes[self.shard_of(i)]) + tail.decode()
        unit, exts = self.unit, self.exts
        members = {
            str(exts[c]): (int(o) * unit, int(s))
            for c, o, s in zip(self.ext_codes[a:b].tolist(), self.offsets[a:b].tolist(),
                               self.sizes[a:b].tolist(), strict=True)
        }  # fmt: skip
        return key, members

    def __iter__(self) -> Iterator[tuple[str, Members]]:
        return (self[i] for i in range(len(self)))

    def save(self, path: str | os.PathLike[str], meta: Mapping[str, Any] | None = None) -> None:
        """Written to a temporary file and renamed (a reader never sees half a file), with a
        checksum over the arrays and ``meta`` (what the caller wants to find again)."""
        info = {"layout": LAYOUT, "unit": self.unit, **(meta or {})}
        body = json.dumps({**info, "checksum": checksum(self.arrays, info)})
        write_npz(path, meta=np.frombuffer(body.encode(), np.uint8), **self.arrays)

    @staticmethod
    def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
        """The JSON meta ``save`` wrote (``checksum`` included); ``ValueError`` for a file of
        the earlier layout, a torn or a foreign one."""
        try:
            meta = json.loads(read_npz(path, ("meta",), what=_WHAT)["meta"].tobytes())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{_WHAT} {os.fspath(path)} has no readable meta: {e}") from e
        if not isinstance(meta, dict) or meta.get("layout") != LAYOUT:
            raise ValueError(f"{_WHAT} {os.fspath(path)} is not of layout {LAYOUT}")
        return meta

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], *, mapped: bool = True
    ) -> tuple[TarIndex, dict[str, Any]]:
        """``(index, meta)``: the arrays mapped (or read, ``mapped=False``) and checked against
        their checksum; a file of the earlier layout is read whole and converted (meta
        ``{}``). ``ValueError`` for a torn, corrupt or foreign file (the caller rebuilds)."""
        try:
            meta = cls.read_meta(path)
        except ValueError:
            old = read_npz(path, ("keys", "starts", "exts", "offsets", "sizes"), what=_WHAT)
            return cls.from_old(old), {}
        want = meta.pop("checksum", None)
        arrays = (map_npz if mapped else read_npz)(path, cls.FIELDS, what=_WHAT)
        if checksum(arrays, meta) != want:
            raise ValueError(f"{_WHAT} {os.fspath(path)}: checksum mismatch (corrupt); rebuilt")
        return cls(arrays, int(meta["unit"])), meta
