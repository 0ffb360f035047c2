"""Tar shards' offset index in compact flat arrays, cached as ``.npz`` and memory-mapped.

``index_tar`` (``pipes/reading/shards.py``) lists a shard's samples as ``[(key, {ext: (offset,
size)})]``; a Python list of dicts costs ~1 KB a sample. ``TarIndex`` keeps the same facts for
one shard or many in flat arrays and builds one sample's ``(key, members)`` when it is read:

* per shard: its first sample id (``shard_starts``), its keys' common prefix (``prefixes``)
  and, when the rest of each key is a run of consecutive numbers (``000017``, ``000018``, ...:
  WebDataset's usual keys), the first of them and its width (``key_first``, ``key_width``):
  such keys cost nothing a sample. Other shards' key tails are kept as UTF-8 bytes
  (``keys``, ``key_starts``: uint32, from ``key_at``);
* per sample: where its members start (``member_starts``) and its first member's data offset
  in units of 512 bytes (``first_offsets``: tar data is block-aligned; ``unit`` 1 if not),
  uint32 (int64 when a value does not fit);
* per member: its extension as a code into ``exts`` (uint8) and its size (uint32). A later
  member's offset is not stored: it follows the previous member's data, padded to 512 bytes,
  and one 512-byte header; a member where that does not hold (a long name's extra header, a
  skipped entry between) is listed in ``moved_ids`` / ``moved_offsets`` (int64).

A sample of a .json and a .jpg member with numbered keys: 18 bytes (was ~88 with numpy
strings: keys and extensions at 4 bytes a character, int64 offsets). ``save`` writes a
checksum; ``load`` maps the arrays (``map_npz``: one copy per node in the page cache) after
checking it, and reads a file of the earlier layout (``keys``, ``starts``, ``exts``,
``offsets``, ``sizes``) into the compact one::

    >>> idx = TarIndex.from_samples([("a/x1", {"json": (512, 40), "png": (1536, 900)}),
    ...                              ("a/x2", {"json": (3072, 41)})])
    >>> len(idx), idx[0], idx[1]
    (2, ('a/x1', {'json': (512, 40), 'png': (1536, 900)}), ('a/x2', {'json': (3072, 41)}))
    >>> idx.prefixes.tolist(), idx.key_first.tolist(), idx.first_offsets.tolist()
    (['a/x'], [1], [1, 6])
    >>> both = TarIndex.concat([idx, TarIndex.from_samples([("b/cat", {"txt": (700, 3)}),
    ...                                                     ("b/dog", {"txt": (1300, 3)})])])
    >>> both[3], both.shard_of(3), both.unit, both.prefixes.tolist(), bytes(both.keys)
    (('b/dog', {'txt': (1300, 3)}), 1, 1, ['a/x', 'b/'], b'catdog')
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


def _padded(size: int) -> int:
    return -(-size // _BLOCK) * _BLOCK


def _follow(offsets: npt.NDArray[np.int64], sizes: npt.NDArray[np.int64],
            member_starts: npt.NDArray[Any]) -> npt.NDArray[np.int64]:  # fmt: skip
    """Each member's offset as ``__getitem__`` derives it: a sample's first member's is its
    own; a later one's follows the previous member's data, padded to 512 bytes, and a header of
    512 (a member with a longer header, or not next to it, is listed in ``moved_*``)."""
    out = offsets.copy()
    later = np.ones(len(offsets), bool)
    later[np.asarray(member_starts[:-1], np.int64)[np.diff(member_starts) > 0]] = False
    prev = np.flatnonzero(later) - 1
    out[later] = offsets[prev] + -(-sizes[prev] // _BLOCK) * _BLOCK + _BLOCK
    return out


def _small(values: Any) -> npt.NDArray[Any]:
    """uint32 when every value fits (offsets, sizes and positions almost always do), else
    int64."""
    a = np.asarray(values, np.int64)
    return a.astype(np.uint32) if not a.size or (a.min() >= 0 and a.max() < 2**32) else a


class TarIndex:
    """The samples of one or more tar shards (module docstring); ``index[i]`` is sample ``i``
    counted over all of them, ``(key, {ext: (data offset, size)})``."""

    FIELDS = ("shard_starts", "prefixes", "key_first", "key_width", "key_at", "key_starts", "keys",
              "member_starts", "first_offsets", "exts", "ext_codes", "sizes", "moved_ids",
              "moved_offsets")  # fmt: skip

    def __init__(self, arrays: Mapping[str, Any], unit: int) -> None:
        a = dict(arrays)
        n, shards = len(a["member_starts"]) - 1, len(a["prefixes"])
        members, listed = len(a["ext_codes"]), len(a["key_starts"]) - 1
        if (
            unit not in (1, _BLOCK) or n < 0 or listed < 0
            or len(a["first_offsets"]) != n or len(a["sizes"]) != members
            or len(a["shard_starts"]) != shards + 1 or int(a["shard_starts"][-1]) != n
            or not len(a["key_first"]) == len(a["key_width"]) == len(a["key_at"]) == shards
            or len(a["moved_ids"]) != len(a["moved_offsets"])
            or (n and int(a["member_starts"][-1]) != members)
            or (listed and int(a["key_starts"][-1]) != len(a["keys"]))
        ):  # fmt: skip
            raise ValueError(
                f"inconsistent tar index: {n} samples, {members} members, {shards} shards, "
                f"{unit=}; rebuild it"
            )
        self.arrays = a
        self.unit = unit
        self.shard_starts, self.prefixes = a["shard_starts"], a["prefixes"]
        self.key_first, self.key_width, self.key_at = a["key_first"], a["key_width"], a["key_at"]
        self.key_starts, self.keys = a["key_starts"], a["keys"]
        self.member_starts, self.first_offsets = a["member_starts"], a["first_offsets"]
        self.exts, self.ext_codes, self.sizes = a["exts"], a["ext_codes"], a["sizes"]
        self.moved_ids, self.moved_offsets = a["moved_ids"], a["moved_offsets"]

    @classmethod
    def from_samples(cls, samples: Sequence[tuple[str, Members]]) -> TarIndex:
        """One shard's index from ``index_tar`` 's list."""
        keys = [k for k, _ in samples]
        prefix = os.path.commonprefix(keys) if keys else ""  # noqa: RUF071 (characters wanted)
        tails = [k[len(prefix) :] for k in keys]
        first = int(tails[0]) if tails and tails[0].isascii() and tails[0].isdigit() else -1
        width = len(tails[0]) if tails else 0
        if first >= 0 and any(t != f"{first + j:0{width}d}" for j, t in enumerate(tails)):
            first = -1  # not a run of consecutive numbers: the tails are kept
        listed = [] if first >= 0 else [t.encode() for t in tails]
        members = [(e, o, s) for _, m in samples for e, (o, s) in m.items()]
        vocab = sorted({e for e, _, _ in members})
        code = {e: i for i, e in enumerate(vocab)}
        counts = [len(m) for _, m in samples]
        member_starts = np.cumsum([0, *counts])
        offsets = np.asarray([o for _, o, _ in members], np.int64)
        sizes = np.asarray([s for _, _, s in members], np.int64)
        firsts = np.zeros(len(samples), np.int64)
        has = np.asarray(counts) > 0
        firsts[has] = offsets[member_starts[:-1][has]]
        moved = np.flatnonzero(offsets != _follow(offsets, sizes, member_starts))
        unit = _BLOCK if not (firsts % _BLOCK).any() else 1
        return cls(
            {
                "shard_starts": np.asarray([0, len(samples)], np.int64),
                "prefixes": np.asarray([prefix], dtype=str),
                "key_first": np.asarray([first], np.int64),
                "key_width": np.asarray([width], np.int64),
                "key_at": np.zeros(1, np.int64),
                "key_starts": _small(np.cumsum([0, *(len(t) for t in listed)])),
                "keys": np.frombuffer(b"".join(listed), np.uint8),
                "member_starts": _small(member_starts),
                "first_offsets": _small(firsts // unit),
                "exts": np.asarray(vocab, dtype=str),
                "ext_codes": np.asarray([code[e] for e, _, _ in members],
                                        np.uint8 if len(vocab) <= 256 else np.int64),
                "sizes": _small(sizes),
                "moved_ids": moved.astype(np.int64),
                "moved_offsets": offsets[moved],
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

        def joined(name: str, dtype: Any = np.int64, shift: Any = None) -> npt.NDArray[Any]:
            pieces = [np.asarray(p.arrays[name], dtype) + (0 if shift is None else shift[k])
                      for k, p in enumerate(parts)]  # fmt: skip
            return np.concatenate([np.zeros(0, dtype), *pieces])

        bases = np.cumsum([0, *(len(p) for p in parts)])[:-1]
        member_bases = np.cumsum([0, *(len(p.ext_codes) for p in parts)])[:-1]
        key_bases = np.cumsum([0, *(len(p.key_starts) - 1 for p in parts)])[:-1]
        codes = [np.asarray([code[str(e)] for e in p.exts], np.int64)[np.asarray(p.ext_codes,
                 np.int64)] for p in parts]  # fmt: skip
        return cls(
            {
                "shard_starts": np.concatenate([np.zeros(1, np.int64), *(
                    np.asarray(p.shard_starts[1:], np.int64) + b
                    for p, b in zip(parts, bases.tolist(), strict=True))]),
                "prefixes": np.concatenate([np.zeros(0, str), *(p.prefixes for p in parts)]),
                "key_first": joined("key_first"),
                "key_width": joined("key_width"),
                "key_at": joined("key_at", shift=key_bases),
                "key_starts": _small(run_on("key_starts", "keys")),
                "keys": joined("keys", np.uint8),
                "member_starts": _small(run_on("member_starts", "ext_codes")),
                "first_offsets": _small(np.concatenate([np.zeros(0, np.int64), *(
                    np.asarray(p.first_offsets, np.int64) * (p.unit // unit) for p in parts)])),
                "exts": np.asarray(vocab, dtype=str),
                "ext_codes": np.concatenate([np.zeros(0, np.int64), *codes]).astype(
                    np.uint8 if len(vocab) <= 256 else np.int64),
                "sizes": _small(joined("sizes")),
                "moved_ids": joined("moved_ids", shift=member_bases),
                "moved_offsets": joined("moved_offsets"),
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

    def key(self, i: int) -> str:
        shard = self.shard_of(i)
        first = int(self.key_first[shard])
        local = i - int(self.shard_starts[shard])
        if first >= 0:  # a run of consecutive numbers, as wide as the first (or wider)
            return str(self.prefixes[shard]) + f"{first + local:0{int(self.key_width[shard])}d}"
        k = int(self.key_at[shard]) + local
        tail = bytes(self.keys[int(self.key_starts[k]) : int(self.key_starts[k + 1])])
        return str(self.prefixes[shard]) + tail.decode()

    def __getitem__(self, i: int) -> tuple[str, Members]:
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} is outside 0..{len(self) - 1} of the tar index")
        a, b = int(self.member_starts[i]), int(self.member_starts[i + 1])
        sizes = self.sizes[a:b].tolist()
        offset = int(self.first_offsets[i]) * self.unit
        lo, hi = np.searchsorted(self.moved_ids, [a, b])
        moved = dict(zip(self.moved_ids[lo:hi].tolist(), self.moved_offsets[lo:hi].tolist(),
                         strict=True))  # fmt: skip
        members: Members = {}
        for m, (c, size) in enumerate(zip(self.ext_codes[a:b].tolist(), sizes, strict=True)):
            if m:  # after the previous member's data (padded to 512) and one 512-byte header
                offset = moved.get(a + m, offset + _padded(sizes[m - 1]) + _BLOCK)
            members[str(self.exts[c])] = (offset, size)
        return self.key(i), members

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
