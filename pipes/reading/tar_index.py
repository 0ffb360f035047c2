"""Tar shards' offset index in compact flat arrays, cached as ``.npz`` and memory-mapped.

``index_tar`` (``pipes/reading/shards.py``) lists a shard's samples as ``[(key, {ext: (offset,
size)})]``; a Python list of dicts costs ~1 KB a sample. ``TarIndex`` keeps the same facts for
one shard or many in flat arrays and builds one sample's ``(key, members)`` when it is read:

* per shard: its first sample id (``shard_starts``) and member id (``member_bases``), its
  keys' common prefix (``prefixes``) and, when the rest of each key is a run of consecutive
  numbers (``000017``, ``000018``, ...: WebDataset's usual keys), the first of them and its
  width (``key_first``, ``key_width``): such keys cost nothing a sample. Other shards' key
  tails are kept as UTF-8 bytes (``keys``, ``key_starts``: uint32, from ``key_at``);
* members: a *regular* shard (every sample has the same extensions in the same order,
  WebDataset's norm) keeps its ``members_each`` and the extensions' codes into ``exts`` once
  (``ext_codes`` from ``codes_at``); sample ``i`` 's members are ``i * members_each`` on. An
  irregular shard (``members_each`` -1) keeps each sample's first member (``member_starts``
  from ``starts_at``, uint32) and each member's code;
* per member: its size (uint32). Its offset is not stored: it follows the previous member's
  data (of its sample or the one before), padded to 512 bytes, and one 512-byte header. Where
  a walk starts, every 64th sample of a shard, the offset is kept (``checkpoints`` from
  ``check_at``, in units of 512 bytes: tar data is block-aligned; ``unit`` 1 if not); a member
  where the rule does not hold (a long name's extra header, a skipped entry between) is listed
  in ``moved_ids`` / ``moved_offsets`` (int64). Reading a sample sums the padded sizes of at
  most 63 samples' members since its checkpoint (or the last moved member) in numpy.

A sample of a .json and a .jpg member with numbered keys: 8.06 bytes (layout 2: 18, with
per-sample member positions, first offsets and per-member codes; ~88 with numpy strings).
``save`` writes a checksum; ``load`` maps the arrays (``map_npz``: one copy per node in the
page cache) after checking it, and reads a file of an earlier layout (layout 2, or the first:
``keys``, ``starts``, ``exts``, ``offsets``, ``sizes``) into this one (the caller rewrites it)::

    >>> idx = TarIndex.from_samples([("a/x1", {"json": (512, 40), "png": (1536, 900)}),
    ...                              ("a/x2", {"json": (3072, 41)})])
    >>> len(idx), idx[0], idx[1]
    (2, ('a/x1', {'json': (512, 40), 'png': (1536, 900)}), ('a/x2', {'json': (3072, 41)}))
    >>> idx.prefixes.tolist(), idx.key_first.tolist(), idx.members_each.tolist()
    (['a/x'], [1], [-1])
    >>> idx.checkpoints.tolist(), idx.moved_ids.tolist()
    ([1], [])
    >>> both = TarIndex.concat([idx, TarIndex.from_samples([("b/cat", {"txt": (700, 3)}),
    ...                                                     ("b/dog", {"txt": (1300, 3)})])])
    >>> both[3], both.shard_of(3), both.unit, both.prefixes.tolist(), bytes(both.keys)
    (('b/dog', {'txt': (1300, 3)}), 1, 1, ['a/x', 'b/'], b'catdog')
    >>> both.members_each.tolist(), both.moved_ids.tolist()
    ([-1, 1], [4])
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from neatpack.pipes.reading.npz_files import checksum, map_npz, read_npz, write_npz

__all__ = ["TarIndex"]

Members = dict[str, tuple[int, int]]
LAYOUT = 3
_LAYOUTS = (2, LAYOUT)  # files ``load`` reads as its own (layout 2 converted)
_BLOCK = 512  # tar's block: headers and member data start on it
_EVERY = 64  # a shard's offset walk restarts at every 64th sample
_WHAT = "tar index cache"
_KEY_FIELDS = ("prefixes", "key_first", "key_width", "key_at", "key_starts", "keys")
_FIELDS_2 = ("shard_starts", *_KEY_FIELDS, "member_starts", "first_offsets", "exts",
             "ext_codes", "sizes", "moved_ids", "moved_offsets")  # fmt: skip


def _padded(size: int) -> int:
    return -(-size // _BLOCK) * _BLOCK


def _steps(sizes: npt.NDArray[Any]) -> npt.NDArray[np.int64]:
    """From each member's offset to the next one's: its data padded to 512 and a header."""
    return -(-np.asarray(sizes, np.int64) // _BLOCK) * _BLOCK + _BLOCK


def _small(values: Any) -> npt.NDArray[Any]:
    """uint32 when every value fits (offsets, sizes and positions almost always do), else
    int64."""
    a = np.asarray(values, np.int64)
    return a.astype(np.uint32) if not a.size or (a.min() >= 0 and a.max() < 2**32) else a


def _codes(values: Any, vocab: int) -> npt.NDArray[Any]:
    return np.asarray(values, np.int64).astype(np.uint8 if vocab <= 256 else np.int64)


def _cat(pieces: Sequence[Any], dtype: Any = np.int64) -> npt.NDArray[Any]:
    return np.concatenate([np.zeros(0, dtype), *(np.asarray(p, dtype) for p in pieces)])


def _compact(
    keyed: Mapping[str, Any], shard_starts: npt.NDArray[np.int64],
    member_starts: npt.NDArray[np.int64], codes: npt.NDArray[np.int64], exts: Any,
    offsets: npt.NDArray[np.int64], sizes: npt.NDArray[np.int64],
) -> TarIndex:  # fmt: skip
    """The index of shards given as flat per-sample ``member_starts`` and per-member
    ``codes`` (into ``exts``), ``offsets`` and ``sizes``; keys as ``keyed`` holds them."""
    shards = len(shard_starts) - 1
    each, codes_at, starts_at, check_at = (np.zeros(shards, np.int64) for _ in range(4))
    patterns: list[Any] = []
    listed: list[Any] = []
    checks: list[Any] = []
    anchored = np.zeros(len(sizes), bool)  # members whose offset a checkpoint holds
    n_codes = n_listed = n_checks = 0
    for s in range(shards):
        ms = member_starts[int(shard_starts[s]) : int(shard_starts[s + 1]) + 1]
        base, local = int(ms[0]), ms - ms[0]
        counts, mine = np.diff(local), codes[base : int(ms[-1])]
        k = int(counts[0]) if len(counts) else 0
        if (counts == k).all() and (k == 0 or (mine.reshape(-1, k) == mine[:k]).all()):
            each[s], mine = k, mine[:k]
        else:
            each[s], starts_at[s] = -1, n_listed
            listed.append(local)
            n_listed += len(local)
        codes_at[s], check_at[s] = n_codes, n_checks
        patterns.append(mine)
        n_codes += len(mine)
        heads = local[:-1][::_EVERY]  # the first member of every 64th sample (or the next)
        heads = heads[heads < local[-1]] + base
        got = np.zeros(-(-len(counts) // _EVERY), np.int64)
        got[: len(heads)] = offsets[heads]
        checks.append(got)
        n_checks += len(got)
        anchored[heads] = True
    follows = np.zeros(len(sizes), np.int64)
    follows[1:] = offsets[:-1] + _steps(sizes[:-1])
    moved = np.flatnonzero(~anchored & (offsets != follows))
    checkpoints = _cat(checks)
    unit = _BLOCK if not (checkpoints % _BLOCK).any() else 1
    return TarIndex(
        {
            **{k: keyed[k] for k in _KEY_FIELDS},
            "shard_starts": np.asarray(shard_starts, np.int64),
            "member_bases": np.asarray(member_starts[np.asarray(shard_starts)], np.int64),
            "members_each": each, "codes_at": codes_at, "starts_at": starts_at,
            "check_at": check_at,
            "member_starts": _small(_cat(listed)),
            "checkpoints": _small(checkpoints // unit),
            "exts": np.asarray(exts, dtype=str),
            "ext_codes": _codes(_cat(patterns), len(exts)),
            "sizes": _small(sizes),
            "moved_ids": moved.astype(np.int64),
            "moved_offsets": offsets[moved],
        },
        unit,
    )  # fmt: skip


class TarIndex:
    """The samples of one or more tar shards (module docstring); ``index[i]`` is sample ``i``
    counted over all of them, ``(key, {ext: (data offset, size)})``."""

    FIELDS = ("shard_starts", "member_bases", *_KEY_FIELDS, "members_each", "codes_at",
              "starts_at", "check_at", "member_starts", "checkpoints", "exts", "ext_codes",
              "sizes", "moved_ids", "moved_offsets")  # fmt: skip
    _PER_SHARD = ("key_first", "key_width", "key_at", "members_each", "codes_at", "starts_at",
                  "check_at")  # fmt: skip

    def __init__(self, arrays: Mapping[str, Any], unit: int) -> None:
        a = dict(arrays)
        shards, members = len(a["prefixes"]), len(a["sizes"])
        listed = len(a["key_starts"]) - 1
        each = np.asarray(a["members_each"], np.int64)
        lens = np.diff(np.asarray(a["shard_starts"], np.int64))
        counts = np.diff(np.asarray(a["member_bases"], np.int64))
        regular = each >= 0
        wide = np.where(regular, each, counts)  # codes a shard keeps
        if (
            unit not in (1, _BLOCK) or listed < 0
            or len(a["shard_starts"]) != shards + 1 or len(a["member_bases"]) != shards + 1
            or any(len(a[f]) != shards for f in self._PER_SHARD)
            or (shards and (int(a["shard_starts"][0]) or int(a["member_bases"][0])))
            or (shards and int(a["member_bases"][-1]) != members)
            or (lens < 0).any() or (counts < 0).any()
            or (counts[regular] != each[regular] * lens[regular]).any()
            or (np.asarray(a["codes_at"], np.int64) + wide > len(a["ext_codes"])).any()
            or (np.asarray(a["starts_at"], np.int64)[~regular] + lens[~regular] + 1
                > len(a["member_starts"])).any()
            or (np.asarray(a["check_at"], np.int64) + -(-lens // _EVERY)
                > len(a["checkpoints"])).any()
            or len(a["moved_ids"]) != len(a["moved_offsets"])
            or (listed and int(a["key_starts"][-1]) != len(a["keys"]))
        ):  # fmt: skip
            raise ValueError(
                f"inconsistent tar index: {int(lens.sum())} samples, {members} members, "
                f"{shards} shards, {unit=}; rebuild it"
            )
        self.arrays = a
        self.unit = unit
        self.shard_starts, self.member_bases = a["shard_starts"], a["member_bases"]
        self.prefixes = a["prefixes"]
        self.key_first, self.key_width, self.key_at = a["key_first"], a["key_width"], a["key_at"]
        self.key_starts, self.keys = a["key_starts"], a["keys"]
        self.members_each, self.codes_at = a["members_each"], a["codes_at"]
        self.starts_at, self.check_at = a["starts_at"], a["check_at"]
        self.member_starts, self.checkpoints = a["member_starts"], a["checkpoints"]
        self.exts, self.ext_codes, self.sizes = a["exts"], a["ext_codes"], a["sizes"]
        self.moved_ids, self.moved_offsets = a["moved_ids"], a["moved_offsets"]
        self._len = int(self.shard_starts[-1]) if shards else 0
        # plain views of the same (mapped) bytes for reading: a MappedArray's own indexing
        # costs a Python call each; the index pickles as its arrays (``__reduce__``)
        self._v = {k: np.asarray(v).view(np.ndarray) for k, v in a.items()}

    def __reduce__(self) -> tuple[Any, ...]:
        return (TarIndex, (self.arrays, self.unit))

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
        keyed = {
            "prefixes": np.asarray([prefix], dtype=str),
            "key_first": np.asarray([first], np.int64),
            "key_width": np.asarray([width], np.int64),
            "key_at": np.zeros(1, np.int64),
            "key_starts": _small(np.cumsum([0, *(len(t) for t in listed)])),
            "keys": np.frombuffer(b"".join(listed), np.uint8),
        }
        members = [(e, o, s) for _, m in samples for e, (o, s) in m.items()]
        vocab = sorted({e for e, _, _ in members})
        code = {e: i for i, e in enumerate(vocab)}
        return _compact(
            keyed, np.asarray([0, len(samples)], np.int64),
            np.cumsum([0, *(len(m) for _, m in samples)]).astype(np.int64),
            np.asarray([code[e] for e, _, _ in members], np.int64), vocab,
            np.asarray([o for _, o, _ in members], np.int64),
            np.asarray([s for _, _, s in members], np.int64),
        )  # fmt: skip

    @classmethod
    def concat(cls, parts: Sequence[TarIndex]) -> TarIndex:
        """The shards of ``parts``, in order, as one index (sample and member ids run on)."""
        unit = min((p.unit for p in parts), default=_BLOCK)
        vocab = sorted({str(e) for p in parts for e in p.exts})
        code = {e: i for i, e in enumerate(vocab)}

        def run_on(name: str) -> npt.NDArray[np.int64]:
            base, out = 0, [np.zeros(1, np.int64)]
            for p in parts:
                out.append(np.asarray(p.arrays[name][1:], np.int64) + base)
                base += int(p.arrays[name][-1]) if len(p.arrays[name]) > 1 else 0
            return np.concatenate(out)

        def joined(name: str, by: str | None = None, dtype: Any = np.int64) -> npt.NDArray[Any]:
            """``name`` of every part, shifted by the lengths of ``by`` in the parts before."""
            shift = np.cumsum([0, *(len(p.arrays[by]) for p in parts)]) if by else [0] * (
                len(parts) + 1)  # fmt: skip
            return _cat([np.asarray(p.arrays[name], dtype) + shift[k]
                         for k, p in enumerate(parts)], dtype)  # fmt: skip

        key_bases = np.cumsum([0, *(len(p.key_starts) - 1 for p in parts)])
        each = joined("members_each")
        return cls(
            {
                "shard_starts": run_on("shard_starts"),
                "member_bases": run_on("member_bases"),
                "prefixes": np.concatenate([np.zeros(0, str), *(p.prefixes for p in parts)]),
                "key_first": joined("key_first"),
                "key_width": joined("key_width"),
                "key_at": _cat([np.asarray(p.key_at, np.int64) + key_bases[k]
                                for k, p in enumerate(parts)]),
                "key_starts": _small(run_on("key_starts")),
                "keys": joined("keys", dtype=np.uint8),
                "members_each": each,
                "codes_at": joined("codes_at", "ext_codes"),
                "starts_at": np.where(each < 0, joined("starts_at", "member_starts"), 0),
                "check_at": joined("check_at", "checkpoints"),
                "member_starts": _small(joined("member_starts")),
                "checkpoints": _small(_cat([np.asarray(p.checkpoints, np.int64)
                                            * (p.unit // unit) for p in parts])),
                "exts": np.asarray(vocab, dtype=str),
                "ext_codes": _codes(_cat([np.asarray([code[str(e)] for e in p.exts],
                    np.int64)[np.asarray(p.ext_codes, np.int64)] for p in parts]), len(vocab)),
                "sizes": _small(joined("sizes")),
                "moved_ids": joined("moved_ids", "sizes"),
                "moved_offsets": joined("moved_offsets"),
            },
            unit,
        )  # fmt: skip

    @classmethod
    def from_old(cls, old: Mapping[str, Any]) -> TarIndex:
        """One shard's index from the arrays of the first layout (numpy strings, int64)."""
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

    @classmethod
    def from_layout2(cls, a: Mapping[str, Any], unit: int) -> TarIndex:
        """The index from the arrays of layout 2 (a member position and first offset a
        sample, an extension code a member), converted in numpy."""
        ms = np.asarray(a["member_starts"], np.int64)
        sizes = np.asarray(a["sizes"], np.int64)
        n, members = len(ms) - 1, len(sizes)
        shard_starts = np.asarray(a["shard_starts"], np.int64)
        if (
            n < 0 or len(a["first_offsets"]) != n or len(a["ext_codes"]) != members
            or (n and int(ms[-1]) != members) or unit not in (1, _BLOCK)
            or len(shard_starts) != len(a["prefixes"]) + 1 or int(shard_starts[-1]) != n
            or len(a["moved_ids"]) != len(a["moved_offsets"])
        ):  # fmt: skip
            raise ValueError(f"inconsistent tar index of layout 2: {n} samples; rebuild it")
        counts = np.diff(ms)
        offsets = np.zeros(members, np.int64)
        firsts = ms[:-1][counts > 0]
        offsets[firsts] = np.asarray(a["first_offsets"], np.int64)[counts > 0] * unit
        place = np.arange(members) - np.repeat(ms[:-1], counts)  # within its sample
        moved = np.asarray(a["moved_ids"], np.int64)
        for k in range(1, int(counts.max()) if n else 0):
            at = np.flatnonzero(place == k)
            offsets[at] = offsets[at - 1] + _steps(sizes[at - 1])
            here = place[moved] == k
            offsets[moved[here]] = np.asarray(a["moved_offsets"], np.int64)[here]
        codes = np.asarray(a["ext_codes"], np.int64)
        return _compact(a, shard_starts, ms, codes, a["exts"], offsets, sizes)

    def __len__(self) -> int:
        return self._len

    @property
    def nbytes(self) -> int:
        return sum(int(np.asarray(a).nbytes) for a in self.arrays.values())

    def shard_of(self, i: int) -> int:
        return int(self._v["shard_starts"].searchsorted(i, side="right")) - 1

    def key(self, i: int) -> str:
        shard = self.shard_of(i)
        return self._key(shard, i - int(self.shard_starts[shard]))

    def _key(self, shard: int, local: int) -> str:
        v = self._v
        first = int(v["key_first"][shard])
        if first >= 0:  # a run of consecutive numbers, as wide as the first (or wider)
            return str(v["prefixes"][shard]) + f"{first + local:0{int(v['key_width'][shard])}d}"
        k = int(v["key_at"][shard]) + local
        tail = v["keys"][int(v["key_starts"][k]) : int(v["key_starts"][k + 1])].tobytes()
        return str(v["prefixes"][shard]) + tail.decode()

    def __getitem__(self, i: int) -> tuple[str, Members]:
        i, v = int(i), self._v
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} is outside 0..{len(self) - 1} of the tar index")
        shard = int(v["shard_starts"].searchsorted(i, side="right")) - 1
        local = i - int(v["shard_starts"][shard])
        each, at = int(v["members_each"][shard]), int(v["codes_at"][shard])
        head = local - local % _EVERY  # the sample whose first member's offset is kept
        if each >= 0:
            h, a, b = head * each, local * each, local * each + each
            codes = v["ext_codes"][at : at + each].tolist()
        else:
            s = int(v["starts_at"][shard])
            h, a, b = v["member_starts"][[s + head, s + local, s + local + 1]].tolist()
            codes = v["ext_codes"][at + a : at + b].tolist()
        members: Members = {}
        if a == b:
            return self._key(shard, local), members
        base = int(v["member_bases"][shard])
        h, a, b = h + base, a + base, b + base
        lo, hi = v["moved_ids"].searchsorted((h + 1, b)).tolist()  # members moved after h
        ids, offs = v["moved_ids"][lo:hi].tolist(), v["moved_offsets"][lo:hi].tolist()
        j = bisect.bisect_right(ids, a) - 1  # the walk starts at the last one at or before a
        if j >= 0:
            start, offset = ids[j], offs[j]
        else:
            c = int(v["check_at"][shard]) + local // _EVERY
            start, offset = h, int(v["checkpoints"][c]) * self.unit
        if start < a:
            run = v["sizes"][start:a].astype(np.int64)
            offset += int(((run + (_BLOCK - 1)) // _BLOCK).sum()) * _BLOCK + _BLOCK * (a - start)
        moved = dict(zip(ids[j + 1 :], offs[j + 1 :], strict=True))
        sizes = v["sizes"][a:b].tolist()
        exts = v["exts"]
        for m, (c, size) in enumerate(zip(codes, sizes, strict=True)):
            if m:  # after the previous member's data (padded to 512) and one 512-byte header
                offset = moved.get(a + m, offset + _padded(sizes[m - 1]) + _BLOCK)
            members[str(exts[c])] = (offset, size)
        return self._key(shard, local), members

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
        """The JSON meta ``save`` wrote (``checksum`` and ``layout`` included: this one or
        layout 2); ``ValueError`` for a file of the first layout, a torn or a foreign one."""
        try:
            meta = json.loads(read_npz(path, ("meta",), what=_WHAT)["meta"].tobytes())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{_WHAT} {os.fspath(path)} has no readable meta: {e}") from e
        if not isinstance(meta, dict) or meta.get("layout") not in _LAYOUTS:
            raise ValueError(f"{_WHAT} {os.fspath(path)} is not of layout {_LAYOUTS}")
        return meta

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], *, mapped: bool = True
    ) -> tuple[TarIndex, dict[str, Any]]:
        """``(index, meta)``: the arrays mapped (or read, ``mapped=False``) and checked against
        their checksum; a file of an earlier layout is read whole and converted in memory (meta
        ``{}`` for the first layout, layout 2's meta with its ``layout``: the caller rewrites
        it once). ``ValueError`` for a torn, corrupt or foreign file (the caller rebuilds)."""
        try:
            meta = cls.read_meta(path)
        except ValueError:
            old = read_npz(path, ("keys", "starts", "exts", "offsets", "sizes"), what=_WHAT)
            return cls.from_old(old), {}
        want = meta.pop("checksum", None)
        current = meta["layout"] == LAYOUT
        read = map_npz if mapped and current else read_npz
        arrays = read(path, cls.FIELDS if current else _FIELDS_2, what=_WHAT)
        if checksum(arrays, meta) != want:
            raise ValueError(f"{_WHAT} {os.fspath(path)}: checksum mismatch (corrupt); rebuilt")
        if not current:
            return cls.from_layout2(arrays, int(meta["unit"])), meta
        return cls(arrays, int(meta["unit"])), meta
