"""The pieces of a length index build, saved as each one finishes, so that a build killed
mid-way resumes and a dataset that grew re-estimates only its new shards.

A piece is a run of sample ids whose lengths are kept in ``cache_dir`` as
``length-piece-<key>.npz`` (written atomically with a checksum, ``write_npz``), under a key
that names what they are the lengths of:

* **a sharded source** (``shard_starts`` and ``shard_fingerprints``: ``ParquetSource``,
  ``TarShardSource``): one piece per shard, or per ``PIECE_RECORDS`` records of a larger one,
  keyed by the shard's fingerprint (``remote.py``: base name, size and first/last 64 KiB of a
  local file; URL, size, ETag and mtime of a remote one), its record count, the piece's place
  in it and the estimator config. Shards appended to the dataset, or one shard re-written,
  change the whole source's fingerprint but not the other shards' pieces: only the new or
  changed shards are estimated. The pieces are kept after the index is assembled (that is
  what the next, grown, build reuses): about 12 bytes per sample on disk (int32 total,
  visual and media items); those of shards re-written or deleted since are removed then
  (``prune_pieces``; pieces of another estimator config, another model's, are left alone).
* **any other source** (one JSONL file, a list): the ranks' slices cut every
  ``PIECE_RECORDS`` records, keyed by the whole source's fingerprint and the ids. They serve
  only a restart of the same build (any change to the file changes every key; another world
  size cuts other slices), so they are removed once the whole index is saved.

A piece file that is torn, foreign, fails its checksum, or whose media files (those sized
from their headers, ``media_stamp.py``) differ now is estimated again, never used. Which rank
loads a piece one of them has, and which estimates a missing one, is decided from every rank's
list of present pieces (``assign_pieces``): the missing pieces are split by records.

>>> pieces = [Piece(0, 4, "a"), Piece(4, 8, "b"), Piece(8, 10, "c"), Piece(10, 12, "d")]
>>> have = [np.array([True, False, False, False]), np.array([True, True, False, False])]
>>> assign_pieces(pieces, have)  # (loads, estimates) per rank
([[0], [1]], [[2], [3]])
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from neatpack.pipes.indexing.index_split import split_points
from neatpack.pipes.indexing.media_stamp import MediaStamp
from neatpack.pipes.reading.npz_files import checksum, read_npz, write_npz
from neatpack.pipes.reading.remote import is_url

__all__ = [
    "PIECE_RECORDS",
    "Part",
    "Piece",
    "assign_pieces",
    "load_piece",
    "piece_path",
    "plan_pieces",
    "prune_pieces",
    "remove_pieces",
    "save_piece",
    "sharded",
]

#: Records per piece at most: what a killed worker loses (about 0.3 s in estimate mode, 5-10 s
#: in exact mode), and the grain the ranks and workers split the work at.
PIECE_RECORDS = 16_384
PIECE_VERSION = 1
IntArray = npt.NDArray[np.int64]
#: ``(total, visual, images, [(sample id, fallback reasons)], media paths relative to the media
#: root, supervised)``: ``images`` the media items of each sample, ``supervised`` its label
#: tokens (None: the estimator does not count them)
Part = tuple[
    IntArray, IntArray, IntArray, list[tuple[int, tuple[str, ...]]], list[str], IntArray | None
]


@dataclass(frozen=True)
class Piece:
    """Sample ids ``lo..hi-1``, cached under ``key``; a sharded source's piece also names its
    family (``kind``: the source's class, ``config``: the estimator's config key) and its shard
    (``shard``: an absolute path or URL, ``fingerprint``), which ``prune_pieces`` reads."""

    lo: int
    hi: int
    key: str
    kind: str = ""
    config: str = ""
    shard: str = ""
    fingerprint: str = ""

    @property
    def size(self) -> int:
        return self.hi - self.lo


def sharded(source: Any) -> bool:
    """Whether ``source`` names its shards' fingerprints (pieces then survive its growth)."""
    starts = getattr(source, "shard_starts", None)
    fps = getattr(source, "shard_fingerprints", None)
    return starts is not None and fps is not None and len(starts) == len(fps)


def _key(*parts: object) -> str:
    text = "\n".join(str(p) for p in (f"neatpack-length-piece-v{PIECE_VERSION}", *parts))
    return hashlib.sha256(text.encode()).hexdigest()


def plan_pieces(source: Any, config_key: str, world_size: int = 1) -> list[Piece]:
    """Every piece of ``source``'s index, in id order, covering ``0..len(source)-1``. For an
    unsharded source the pieces lie inside the ranks' slices (``split_points``), so a build on
    ``world_size`` ranks gives each rank its own contiguous slice."""
    n = len(source)
    if sharded(source):
        kind = type(source).__name__
        bounds = [*(int(s) for s in source.shard_starts), n]
        paths = getattr(source, "paths", None)
        out = []
        for k, fp in enumerate(source.shard_fingerprints):
            first, m = bounds[k], bounds[k + 1] - bounds[k]
            cuts = split_points(m, max(1, -(-m // PIECE_RECORDS)))
            shard = (
                _where(str(paths[k])) if paths is not None and len(paths) == len(bounds) - 1 else ""
            )
            out += [Piece(first + a, first + b, _key(kind, fp, m, a, b, config_key), kind,
                          config_key, shard, fp)
                    for a, b in itertools.pairwise(cuts) if b > a]  # fmt: skip
        return out
    whole = source.content_fingerprint()
    slices = split_points(n, max(1, world_size), getattr(source, "shard_starts", None))
    out = []
    for lo, hi in itertools.pairwise(slices):
        cuts = split_points(hi - lo, max(1, -(-(hi - lo) // PIECE_RECORDS)))
        out += [Piece(lo + a, lo + b, _key("source", whole, n, lo + a, lo + b, config_key))
                for a, b in itertools.pairwise(cuts) if b > a]  # fmt: skip
    return out


def assign_pieces(
    pieces: Sequence[Piece], have: Sequence[npt.NDArray[np.bool_]]
) -> tuple[list[list[int]], list[list[int]]]:
    """``(loads, estimates)``: per rank, the indexes of the pieces it reads from its cache and
    of those it estimates. ``have[r]``: which pieces rank ``r`` found on its disk. A present
    piece is read by one of the ranks that have it (spread over them by its index); the
    missing ones are split over all ranks by records, at piece boundaries (``split_points``)."""
    ranks = len(have)
    loads: list[list[int]] = [[] for _ in range(ranks)]
    missing: list[int] = []
    for i in range(len(pieces)):
        holders = [r for r in range(ranks) if have[r][i]]
        if holders:
            loads[holders[i % len(holders)]].append(i)
        else:
            missing.append(i)
    starts = np.concatenate([[0], np.cumsum([pieces[i].size for i in missing])]).astype(int)
    cuts = split_points(int(starts[-1]), ranks, starts.tolist())
    at = starts[:-1].tolist()
    estimates = [
        [i for i, s in zip(missing, at, strict=True) if cuts[r] <= s < cuts[r + 1]]
        for r in range(ranks)
    ]
    return loads, estimates


def piece_path(cache_dir: str | os.PathLike[str], piece: Piece) -> Path:
    return Path(cache_dir) / f"length-piece-{piece.key}.npz"


def _narrow(a: IntArray) -> npt.NDArray[Any]:
    """int32 where every value fits (lengths do): half the bytes on disk."""
    fits = a.size == 0 or (int(a.min()) >= -(2**31) and int(a.max()) < 2**31)
    return a.astype(np.int32) if fits else a


def save_piece(
    cache_dir: str | os.PathLike[str], piece: Piece, part: Part, root: str | None
) -> None:
    """Write ``piece`` 's lengths atomically; a cache that cannot be written is skipped (the
    build goes on; only its resume is lost)."""
    total, visual, images, fallbacks, media, supervised = part
    stamp = MediaStamp.of(media, root)
    arrays = {
        "total": _narrow(total), "visual": _narrow(visual), "images": _narrow(images),
        "fallback_at": np.asarray([sid - piece.lo for sid, _ in fallbacks], np.int64),
        **stamp.arrays(),
    }  # fmt: skip
    meta = {"version": PIECE_VERSION, "key": piece.key, "size": piece.size,
            "reasons": [list(r) for _, r in fallbacks], "media_root": root}  # fmt: skip
    if supervised is not None:  # only then: other pieces' files stay as they were
        arrays["supervised"] = _narrow(supervised)
        meta["supervised"] = True
    if piece.shard:  # what prune_pieces needs to tell a stale piece of this family
        meta |= {"kind": piece.kind, "config": piece.config, "shard": piece.shard,
                 "fingerprint": piece.fingerprint}  # fmt: skip
    body = json.dumps({**meta, "checksum": checksum(arrays, meta, head=piece.key)})
    with contextlib.suppress(OSError):
        # no fsync: a piece torn by a machine crash fails its checksum and is estimated again
        write_npz(piece_path(cache_dir, piece), fsync=False,
                  meta=np.frombuffer(body.encode(), np.uint8), **arrays)  # fmt: skip


def load_piece(cache_dir: str | os.PathLike[str], piece: Piece, root: str | None) -> Part | None:
    """``piece`` 's saved lengths, or None when the file is absent, torn, corrupt, another
    piece's, or measured media files that differ now (the piece is estimated again)."""
    fields = ("meta", "total", "visual", "images", "fallback_at", "media_paths", "media_sizes",
              "media_mtimes")  # fmt: skip
    try:  # a piece saved before the media-item counts lacks "images": estimated again
        z = read_npz(piece_path(cache_dir, piece), fields, what="length index piece")
        meta = json.loads(z.pop("meta").tobytes())
        want = meta.pop("checksum")
        if meta.get("key") != piece.key or meta.get("size") != piece.size:
            return None
        supervised = None
        if meta.get("supervised"):
            path = piece_path(cache_dir, piece)
            z["supervised"] = read_npz(path, ("supervised",), what="length index piece")[
                "supervised"
            ]
            supervised = z["supervised"].astype(np.int64)
        if checksum(z, meta, head=piece.key) != want:
            return None
        stamp = MediaStamp.from_arrays(meta["media_root"], z)
        at = z["fallback_at"].tolist()
        if any(len(z[k]) != piece.size for k in ("total", "visual", "images")):
            return None
        if len(at) != len(meta["reasons"]) or stamp.changes(root, limit=1):
            return None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    fallbacks = [(piece.lo + int(a), tuple(str(x) for x in r))
                 for a, r in zip(at, meta["reasons"], strict=True)]  # fmt: skip
    total, visual, images = (z[k].astype(np.int64) for k in ("total", "visual", "images"))
    if supervised is not None and len(supervised) != piece.size:
        return None
    return total, visual, images, fallbacks, stamp.paths, supervised


def remove_pieces(cache_dir: str | os.PathLike[str], pieces: Sequence[Piece]) -> None:
    for piece in pieces:
        with contextlib.suppress(OSError):
            piece_path(cache_dir, piece).unlink(missing_ok=True)


def _where(path: str) -> str:
    return path if is_url(path) else os.path.abspath(path)


def prune_pieces(cache_dir: str | os.PathLike[str], pieces: Sequence[Piece]) -> list[Path]:
    """Remove, and return, the saved pieces in ``cache_dir`` that no build of this dataset can
    use again: pieces of the same family as ``pieces`` (a sharded source's kind and estimator
    config) made for one of its shards whose content (fingerprint) has changed since, or for a
    local shard that is gone from one of its shards' folders. Pieces of another family
    (another estimator config, another kind of source: another model's index), pieces written
    before they named their shard, and any other file are never touched. Call it once the
    whole index is saved: the ranks of the build have read their pieces by then."""
    named = [p for p in pieces if p.shard]
    if not named:
        return []
    family = {(p.kind, p.config) for p in named}
    current = {p.shard: p.fingerprint for p in named}
    folders = {os.path.dirname(w) for w in current if not is_url(w)}
    keep = {piece_path(cache_dir, p).name for p in pieces}
    removed = []
    for f in sorted(Path(cache_dir).glob("length-piece-*.npz")):
        if f.name in keep:
            continue
        try:
            meta = json.loads(read_npz(f, ("meta",), what="length index piece")["meta"].tobytes())
            where, fp = str(meta["shard"]), str(meta["fingerprint"])
            if (meta["kind"], meta["config"]) not in family:
                continue
        except (ValueError, KeyError, TypeError):
            continue  # torn, earlier or foreign: not ours to judge
        gone = not is_url(where) and os.path.dirname(where) in folders and not os.path.exists(where)
        if current.get(where, fp) != fp or (where not in current and gone):
            with contextlib.suppress(OSError):
                f.unlink()
                removed.append(f)
    return removed
