"""The length index: every sample's estimated length, built once (cooperatively across ranks),
cached on disk under its fingerprint and reloaded in milliseconds (plus one ``stat`` per media
file it sized from the file: a cached index is reused only while those files are unchanged,
``pipes/indexing/media_stamp.py``). While it is built, its pieces are saved as they finish
(``pipes/indexing/index_parts.py``): a killed build resumes, a grown sharded dataset
re-estimates only its new shards.

``total[i]`` is sample ``i``'s estimated length after the shift (``L - 1``); ``visual[i]`` the
image + video tokens inside it (``docs/data_contracts.md`` section 2); ``images[i]`` its media
items (images plus video clips: what ``plan_packs(max_images=)`` budgets and the vision cost
splits its patches over); ``supervised[i]``, only when the estimator counts them
(``LengthEstimator(supervised=True)``, what ``balance="supervised"`` switches on), its label
tokens (``pipes/indexing/supervised.py``).

>>> from neatpack.pipes.reading.read import SequenceSource
>>> from neatpack.pipes.indexing.estimate import LengthEstimator
>>> src = SequenceSource([{"messages": [{"role": "user", "content": "x" * 30}]}])
>>> index = build_length_index(src, LengthEstimator(), progress=False)
>>> index.total.tolist(), index.visual.tolist(), index.images.tolist()  # 30 // 3 + 5 + 11 - 1
([25], [0], [0])
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from neatpack.pipes.indexing._media_meta import media_items
from neatpack.pipes.indexing.estimate import LengthEstimator
from neatpack.pipes.indexing.index_parts import (
    Part,
    Piece,
    assign_pieces,
    load_piece,
    piece_path,
    plan_pieces,
    prune_pieces,
    remove_pieces,
    save_piece,
    sharded,
)
from neatpack.pipes.indexing.index_split import initialized_dist, side_group
from neatpack.pipes.indexing.index_workers import index_start_method, index_workers
from neatpack.pipes.indexing.media_stamp import MediaStamp, relative_to, unsized_media_paths
from neatpack.pipes.indexing.supervised import (
    supervised_raw_batch,
    supervised_tokens,
    supervised_tokens_batch,
)
from neatpack.pipes.reading._record import RecordError, paused_gc
from neatpack.pipes.reading.npz_files import map_npz, write_npz
from neatpack.pipes.reading.verified import verify_once

__all__ = [
    "FORMAT_VERSION",
    "LAYOUT",
    "ON_ERROR",
    "LengthIndex",
    "build_length_index",
    "length_index_fingerprint",
]

FORMAT_VERSION = 1
ON_ERROR = ("raise", "skip")
IntArray = npt.NDArray[np.int64]


#: How the arrays lie in the cache file. 1 (the first files): int64, checksum over int64;
#: 2: int32 lengths, checksum over the stored bytes, mapped on load; 3: plus ``images``
#: (uint16 media items per sample). Not in the fingerprint: a layout-1 file keeps its
#: fingerprint (saved loader states still match) and is rewritten once as layout 2 when
#: loaded. A layout-1 or 2 file loads with ``images=None`` (unknown: they cannot be derived
#: from the lengths); only the images budget needs them, and it says how to rebuild the file.
LAYOUT = 3
_NO_IMAGES_LAYOUT = 2  # what an index without media-item counts is saved as
_INT32_MAX = int(np.iinfo(np.int32).max)
_UINT16_MAX = int(np.iinfo(np.uint16).max)
_CHUNK = 1 << 20  # elements hashed at a time: the int64 view of a chunk, not of the index


def _narrow(name: str, values: Any) -> npt.NDArray[Any]:
    """``values`` as int32 (4 bytes a sample, half of int64), unchanged when they are; a length
    over int32 (2,147,483,647 tokens) raises naming the sample."""
    arr = values if isinstance(values, np.ndarray) else np.asarray(values)
    if arr.dtype == np.int32:
        return arr
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"LengthIndex.{name} must hold ints, got dtype {arr.dtype}")
    if arr.size:
        hi, lo = int(arr.max()), int(arr.min())
        if hi > _INT32_MAX or lo < -_INT32_MAX - 1:
            i = int(np.argmax(arr) if hi > _INT32_MAX else np.argmin(arr))
            raise ValueError(
                f"LengthIndex.{name}: sample {i} has {int(arr[i])} tokens, outside int32 "
                f"(|value| <= {_INT32_MAX}), the index's dtype: no pack holds it; fix that "
                "record's length (or its estimate) or drop it from the data"
            )
    return arr.astype(np.int32)


def saturate_supervised(values: Any) -> npt.NDArray[np.uint16]:
    """Supervised tokens per sample as uint16, saturating at 65,535 (not raising).

    Two bytes a sample (the #29 budget is 24 per node, and tar shards are at 23.1 without
    them). The column only orders packs for ``balance="supervised"``: a sample with 65,535
    label tokens or more is at least that long, so it fills a pack of 64k nearly alone and
    its step is set by the pack size; counting it as 65,535 changes no order below that.
    """
    arr = values if isinstance(values, np.ndarray) else np.asarray(values)
    if arr.dtype == np.uint16:
        return arr
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"LengthIndex.supervised must hold ints, got dtype {arr.dtype}")
    if arr.size and int(arr.min()) < 0:
        i = int(np.argmin(arr))
        raise ValueError(f"LengthIndex.supervised: sample {i} has {int(arr[i])} tokens (< 0)")
    return np.minimum(arr, _UINT16_MAX).astype(np.uint16)


def _narrow_images(values: Any) -> npt.NDArray[np.uint16]:
    """``values`` as uint16 (2 bytes a sample); a count over 65,535 items raises naming the
    sample."""
    arr = values if isinstance(values, np.ndarray) else np.asarray(values)
    if arr.dtype == np.uint16:
        return arr
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"LengthIndex.images must hold ints, got dtype {arr.dtype}")
    if arr.size and (int(arr.max()) > _UINT16_MAX or int(arr.min()) < 0):
        i = int(np.argmax(arr) if int(arr.max()) > _UINT16_MAX else np.argmin(arr))
        raise ValueError(
            f"LengthIndex.images: sample {i} has {int(arr[i])} media items, outside uint16 "
            f"(0..{_UINT16_MAX}), the index's dtype: split that record into several"
        )
    return arr.astype(np.uint16)


def _hash_arrays(h: Any, arrays: Any, as_int64: bool) -> None:
    for a in arrays:
        if not as_int64:  # layout 2: the bytes as stored (little-endian), no conversion
            h.update(np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).data)
            continue
        for i in range(0, len(a), _CHUNK):
            h.update(np.ascontiguousarray(a[i : i + _CHUNK], dtype="<i8").tobytes())


@dataclass(frozen=True)
class LengthIndex:
    """Per-sample lengths of one source under one estimator config.

    ``total`` and ``visual`` are int32 (any other integer input is narrowed, and a value over
    int32 raises naming its sample); ``images`` (media items) uint16, or None where unknown
    (an index built by hand without them, or a cache file written before they were counted:
    ``require_images`` says how to rebuild it). A loaded index maps them read-only from its
    cache file (``map_npz``): every process of a node that loads one file shares its pages,
    and a worker that receives the index by pickle maps it again. Bytes per sample: 10 (two
    int32 and one uint16), once per node (docs/scale.md).
    """

    total: npt.NDArray[Any]  # int32 (any integer input is narrowed in __post_init__)
    visual: npt.NDArray[Any]
    fingerprint: str
    fallback_ids: IntArray = field(default_factory=lambda: np.zeros(0, np.int64))
    fallback_counts: dict[str, int] = field(default_factory=dict)
    # the media files the lengths were read from (none for an index built by hand)
    media: MediaStamp = field(default_factory=MediaStamp.empty)
    images: npt.NDArray[np.uint16] | None = None  # media items per sample; None: unknown
    # supervised (label) tokens per sample, saturating uint16; None: not counted (the default)
    supervised: npt.NDArray[np.uint16] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "total", _narrow("total", self.total))
        object.__setattr__(self, "visual", _narrow("visual", self.visual))
        if self.total.shape != self.visual.shape or self.total.ndim != 1:
            raise ValueError(
                f"total {self.total.shape} and visual {self.visual.shape} must be equal 1-D"
            )
        if self.images is not None:
            object.__setattr__(self, "images", _narrow_images(self.images))
            if self.images.shape != self.total.shape:
                raise ValueError(f"images {self.images.shape} must equal total {self.total.shape}")
        if self.supervised is not None:
            object.__setattr__(self, "supervised", saturate_supervised(self.supervised))
            if self.supervised.shape != self.total.shape:
                raise ValueError(
                    f"supervised {self.supervised.shape} must equal total {self.total.shape}"
                )

    def require_images(self, who: str) -> npt.NDArray[np.uint16]:
        """``images``, or a ``ValueError`` naming ``who`` (the option that needs them) and the
        fix when they are unknown."""
        if self.images is not None:
            return self.images
        raise ValueError(
            f"{who} needs the media items per sample, and this length index has none: it was "
            f"loaded from a cache file written before they were counted ({self.fingerprint}.npz "
            "in the cache folder), or built by hand. Fix: delete that file so the index is "
            "built again with them (or give LengthIndex(images=...)), or unset the images budget"
        )

    def require_supervised(self, who: str) -> npt.NDArray[np.uint16]:
        """``supervised``, or a ``ValueError`` naming ``who`` and the fix when unknown."""
        if self.supervised is not None:
            return self.supervised
        raise ValueError(
            f"{who} needs the supervised (label) tokens per sample, and this length index has "
            f"none ({self.fingerprint}.npz in the cache folder, or built by hand): they are "
            "counted only when asked. Fix: let the graph build the index (do not pass "
            "lengths=, or delete that file if you load it yourself) with balance='supervised', "
            "which counts them under another fingerprint; or build it with "
            "build_length_index(source, supervised_estimator(estimator, processor)) "
            "(neatpack.pipes.indexing.supervised), or give LengthIndex(supervised=...); or use "
            "another balance"
        )

    def __len__(self) -> int:
        return int(self.total.shape[0])

    def _checksum(self, layout: int = LAYOUT) -> str:
        h = hashlib.sha256(self.fingerprint.encode())
        media = self.media.arrays()
        _hash_arrays(h, (self.total, self.visual), as_int64=layout < 2)
        if layout >= 3 and self.images is not None:
            _hash_arrays(h, (self.images,), as_int64=False)
        if self.supervised is not None:  # only in files of an index that counts them
            h.update(b"|supervised|")
            _hash_arrays(h, (self.supervised,), as_int64=False)
        _hash_arrays(h, (self.fallback_ids, *media.values()), as_int64=True)
        h.update(json.dumps(self.fallback_counts, sort_keys=True).encode())
        return h.hexdigest()

    def save(self, path: str | os.PathLike[str]) -> None:
        """Atomic write (``write_npz``), uncompressed so ``load`` maps it. An index without
        ``images`` is written as layout 2 (no such column), as it was loaded."""
        layout = LAYOUT if self.images is not None else _NO_IMAGES_LAYOUT
        meta = {
            "format_version": FORMAT_VERSION,
            "layout": layout,
            "fingerprint": self.fingerprint,
            "fallback_counts": self.fallback_counts,
            "checksum": self._checksum(layout),
            "media_root": self.media.root,
        }
        extra: dict[str, Any] = {} if self.images is None else {"images": self.images}
        if self.supervised is not None:  # the key only where the column is: older files as were
            meta["supervised"] = True
            extra["supervised"] = self.supervised
        write_npz(
            path, total=self.total, visual=self.visual, fallback_ids=self.fallback_ids,
            meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **self.media.arrays(),
            **extra,
        )  # fmt: skip

    @classmethod
    def load(cls, path: str | os.PathLike[str], fingerprint: str | None = None) -> LengthIndex:
        """Map and verify (format version, fingerprint, checksum over the arrays); a torn or
        corrupt file raises ``ValueError`` instead of returning wrong lengths. A file written
        before the media stamp existed lacks its fields: unreadable too, so it is rebuilt once
        (same fingerprint). A file of layout 1 (int64, written before the index was mapped) is
        read, verified, and rewritten once as layout 2 (where the folder is writable), so the
        next load maps it. A file of layout 1 or 2 has no media-item counts: it loads with
        ``images=None`` (``require_images`` refuses the images budget, naming the fix)."""
        fields = ("meta", "total", "visual", "fallback_ids", "media_paths", "media_sizes",
                  "media_mtimes")  # fmt: skip
        z = map_npz(path, fields, what="length index file")
        try:
            meta = json.loads(bytes(z["meta"]))
            layout = int(meta.get("layout", 1))
            if layout >= 3:
                z.update(map_npz(path, ("images",), what="length index file"))
            if meta.get("supervised"):
                z.update(map_npz(path, ("supervised",), what="length index file"))
            index = cls(
                total=z["total"],
                visual=z["visual"],
                fingerprint=str(meta["fingerprint"]),
                fallback_ids=np.array(z["fallback_ids"], np.int64),
                fallback_counts={str(k): int(v) for k, v in meta["fallback_counts"].items()},
                media=MediaStamp.from_arrays(meta.get("media_root"), z),
                images=z.get("images"),
                supervised=z.get("supervised"),
            )
        except (ValueError, KeyError) as e:
            raise ValueError(f"length index file {path} is unreadable: {e!r}") from e
        if meta.get("format_version") != FORMAT_VERSION or layout not in (1, 2, LAYOUT):
            raise ValueError(
                f"{path}: format {meta.get('format_version')} layout {layout}, not "
                f"{FORMAT_VERSION} / {LAYOUT}"
            )
        if fingerprint is not None and index.fingerprint != fingerprint:
            raise ValueError(f"{path}: fingerprint {index.fingerprint} is not {fingerprint}")

        def check() -> None:
            if index._checksum(layout) != meta["checksum"]:
                raise ValueError(f"{path}: checksum mismatch (corrupt file)")

        if layout < _NO_IMAGES_LAYOUT:  # read whole, verified and rewritten below
            check()
        else:  # mapped: once per node, the other ranks of a node find it verified (verified.py)
            verify_once(path, z, check)
        if layout < _NO_IMAGES_LAYOUT:
            try:
                index.save(path)
            except OSError:
                return index  # a read-only cache: used from memory, rewritten by no one
            return cls.load(path, fingerprint)
        return index


def length_index_fingerprint(source: Any, estimator: LengthEstimator) -> str:
    """sha256 over the format version, the source content and the estimator config."""
    h = hashlib.sha256(f"neatpack-lengths-v{FORMAT_VERSION}\n".encode())
    h.update(f"{len(source)}\n{source.content_fingerprint()}\n".encode())
    h.update(estimator.config_key().encode())
    return h.hexdigest()


def _raw_blocks(source: Any, start: int, stop: int, size: int) -> Iterator[list[Any]]:
    """Raw records in blocks of at most ``size``; sources without ``iter_raw`` give Records
    (the fast path then reads them as ``conversation``-form raw records, which they are)."""
    if hasattr(source, "iter_raw_blocks"):  # whole parsed blocks: no per-record generator
        for parsed in source.iter_raw_blocks(start, stop):
            for i in range(0, len(parsed), size):
                yield parsed[i : i + size]
        return
    it = source.iter_raw(start, stop) if hasattr(source, "iter_raw") else (
        source[i] for i in range(start, stop))  # fmt: skip
    while block := list(islice(it, size)):
        yield block


def estimate_slice(
    source: Any,
    estimator: LengthEstimator,
    start: int,
    stop: int,
    progress: bool,
    on_error: str = "raise",
    media: list[str] | None = None,
    supervised: IntArray | None = None,
) -> tuple[IntArray, IntArray, IntArray, list[tuple[int, tuple[str, ...]]]]:
    """``(total, visual, images, fallbacks)``: ``images`` the media items of each record.
    ``supervised``: an array of ``stop - start`` filled with each record's supervised tokens
    (``supervised.py``, clipped to its total) when the estimator counts them.
    Fast path (``estimate_raw_batch``) per block of 8192; the records it leaves undecided go
    through ``source[id]`` and ``estimate_sample`` (errors, fallbacks, header reads); the paths
    of the media files those may read (no metadata sizes them) are appended to ``media``.
    ``on_error="skip"``: a record that cannot be read or estimated (``RecordError``) gets length
    0 and the fallback reason ``record_error``; the materializer's failure policy then skips or
    replaces it, counted in the loader's ledger with its id."""
    from tqdm.auto import tqdm

    n = stop - start
    total = np.empty(n, np.int64)
    visual = np.empty(n, np.int64)
    images = np.empty(n, np.int64)
    fallbacks: list[tuple[int, tuple[str, ...]]] = []
    counts = supervised is not None and bool(getattr(estimator, "supervised", False))
    k = 0
    # One pause for the whole slice: re-enabling the collector after each block started a
    # full collection over the block's parsed records each time (~9 % of the build).
    with (
        paused_gc(),
        tqdm(
            total=n, desc="length index", unit="rec", disable=not progress, mininterval=0.5
        ) as bar,
    ):
        for block in _raw_blocks(source, start, stop, 8192):
            t, v, m, slow = estimator.estimate_raw_batch(block)
            if counts:
                sup, sup_slow = supervised_raw_batch(estimator, block)
                slow = sorted(set(slow) | set(sup_slow))  # their Records give both
            ids = [start + k + j for j in slow]
            for j, (tj, vj, reasons, mj, sj) in zip(
                slow, _estimate_ids(source, estimator, ids, on_error, media, counts), strict=True
            ):
                t[j], v[j], m[j] = tj, vj, mj
                if counts:
                    sup[j] = sj
                if reasons:
                    fallbacks.append((start + k + j, reasons))
            total[k : k + len(block)], visual[k : k + len(block)] = t, v
            images[k : k + len(block)] = m
            if counts and supervised is not None:
                supervised[k : k + len(block)] = np.minimum(sup, t)
            k += len(block)
            bar.update(len(block))
    if k != n:
        raise RuntimeError(f"source yielded {k} records for ids {start}..{stop - 1}, not {n}")
    return total, visual, images, fallbacks


def _estimate_ids(
    source: Any,
    estimator: Any,
    ids: list[int],
    on_error: str,
    media: list[str] | None = None,
    supervised: bool = False,
) -> list[tuple[int, int, tuple[str, ...], int, int]]:
    """``(total, visual, fallback reasons, media items, supervised tokens)`` of ``source[id]``
    for each id (the items counted from the record's blocks, ``media_items``; the supervised
    tokens only when ``supervised``, else 0). An estimator with
    ``estimate_samples`` (``exact`` mode: one template and one tokenizer call for the lot) gets
    them all at once; any record error there redoes the ids one by one, so which record raises
    (or is skipped as ``record_error``) is decided exactly as the one-by-one loop decides it."""
    batch = getattr(estimator, "estimate_samples", None)
    if batch is not None and len(ids) > 1 and getattr(estimator, "mode", "") == "exact":
        try:
            records = [source[sid] for sid in ids]
            sup = supervised_tokens_batch(estimator, records) if supervised else [0] * len(ids)
            done = [
                (s[0], s[1], s[2], media_items(r), u)
                for s, r, u in zip(batch(records), records, sup, strict=True)
            ]
            if media is not None:
                media.extend(p for r in records for p in unsized_media_paths(r))
            return done
        except RecordError:
            pass  # one by one below: the same error, or the same skips, as without batching
    out: list[tuple[int, int, tuple[str, ...], int, int]] = []
    for sid in ids:
        try:
            record = source[sid]
            if media is not None:  # a record refused for its media is stamped too
                media.extend(unsized_media_paths(record))
            t, v, reasons = estimator.estimate_sample(record)
            u = supervised_tokens(estimator, record) if supervised else 0
            out.append((t, v, reasons, media_items(record), u))
        except RecordError:
            if on_error == "raise":
                raise
            out.append((0, 0, ("record_error",), 0, 0))
    return out


def build_length_index(
    source: Any,
    estimator: LengthEstimator,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
    rank: int = 0,
    world_size: int = 1,
    group: Any = None,
    num_workers: int | None = None,
    on_error: str = "raise",
    start_method: str | None = None,
) -> LengthIndex:
    """Estimate every sample of ``source`` (or load the cached index with the same fingerprint).

    With ``world_size > 1`` and ``torch.distributed`` initialized (otherwise this process
    estimates everything), the ranks share the work and all-gather the results on a CPU gloo
    side group (never the default group: an NCCL one would route them through GPU memory), so
    every rank returns the identical index. ``group``: a gloo group to use instead (None: the
    world's). The work is cut into pieces (``pipes/indexing/index_parts.py``: whole shards,
    or ``PIECE_RECORDS`` records at most) that each rank splits by records: rank ``r`` of an
    unsharded source estimates the contiguous slice ``[N*r//W, N*(r+1)//W)``, a sharded one
    whole shards. The cache is used only when every rank has it (decided collectively, so
    ranks never disagree about entering the collective). Estimation errors on any rank are
    raised on every rank.

    With a ``cache_dir``, each piece is saved there as soon as it is estimated: a build killed
    mid-way (any rank, any worker) estimates only the missing pieces when started again, and a
    sharded dataset that grew (or had a shard re-written) estimates only its new (changed)
    shards; a torn or stale piece is estimated again, never used. ``progress``: one line per
    rank (``length index [rank r/W]``), counting this rank's reused and estimated records.

    ``num_workers > 0`` splits this rank's pieces over that many worker processes (forked
    where the platform can, see ``index_workers``; the source and estimator go to each worker
    once), ``0`` keeps them in this process, and ``None`` (the default) picks the number with
    ``index_workers(records this rank estimates)``: one per core this rank may use, once they
    are enough to pay for a pool (32,768 records); the index is the same for any number.
    ``start_method`` starts those processes (``fork``, ``spawn``, ``forkserver``; None: fork
    where the platform has it), see ``index_start_method``. ``on_error``: ``"raise"`` (a bad
    record stops the build, naming it) or ``"skip"`` (it gets length 0 and is listed under the
    fallback reason ``record_error``: the loader's ``on_bad_sample`` policy then skips or
    replaces it, counted). The cached file does not depend on ``on_error``: a ``"raise"`` run
    that reuses a ``"skip"`` index raises for the bad record when it is materialized instead.
    """
    if on_error not in ON_ERROR:
        raise ValueError(f"{on_error=} is not one of {ON_ERROR}")
    if num_workers is not None and num_workers < 0:
        raise ValueError(
            f"{num_workers=} must be >= 0 (0: estimate in this process), or None for one per core"
        )
    start_method = index_start_method(start_method)
    fp = length_index_fingerprint(source, estimator)
    path = None if cache_dir is None else Path(cache_dir) / f"{fp}.npz"
    root = getattr(source, "media_root", None)
    cached = _try_load(path, fp, root)
    dist = initialized_dist(world_size)
    if dist is None and cached is not None:
        return cached
    ranks = world_size if dist is not None else 1
    pieces = plan_pieces(source, estimator.config_key(), ranks)
    have = np.zeros(len(pieces), bool)
    if cache_dir is not None and cached is None:
        have = np.asarray([piece_path(cache_dir, p).is_file() for p in pieces], bool)
    haves = [have]
    if dist is not None:
        group = side_group(group)  # CPU gloo: never the (maybe NCCL) default group
        actual = (dist.get_rank(group), dist.get_world_size(group))
        bad = None
        if actual != (rank, world_size):
            bad = (
                f"{rank=}, {world_size=} but the process group says rank {actual[0]} of {actual[1]}"
            )
        flags: list[Any] = [None] * actual[1]
        # every rank joins, with the pieces it has on its disk
        dist.all_gather_object(flags, (cached is not None, bad, np.packbits(have)), group=group)
        if errors := [b for _, b, _ in flags if b is not None]:
            raise ValueError("; ".join(errors) + "; pass the group's rank and world size")
        if all(f for f, _, _ in flags) and cached is not None:
            return cached
        haves = [np.unpackbits(h, count=len(pieces)).astype(bool) for _, _, h in flags]
    me = rank if dist is not None else 0
    counts_supervised = bool(getattr(estimator, "supervised", False))
    loads, estimates = assign_pieces(pieces, haves)
    error: str | None = None
    got: dict[int, Part] = {}
    from tqdm.auto import tqdm

    desc = "length index" if dist is None else f"length index [rank {rank}/{world_size}]"
    mine = sum(pieces[i].size for i in [*loads[me], *estimates[me]])
    with tqdm(total=mine, desc=desc, unit="rec", disable=not progress, mininterval=0.5) as bar:
        try:
            todo = list(estimates[me])
            for i in loads[me]:
                part = None if cache_dir is None else load_piece(cache_dir, pieces[i], root)
                if part is not None and counts_supervised and part[5] is None:
                    part = None  # saved without the counts this build needs
                if part is None:
                    todo.append(i)  # torn, corrupt or stale: estimated again
                    continue
                got[i] = part
                bar.update(pieces[i].size)
            bar.set_postfix(reused=len(got), estimate=len(todo))
            todo.sort()
            workers = num_workers
            if workers is None:
                records = sum(pieces[i].size for i in todo)
                workers = index_workers(records, start_method=start_method)
            parts = _estimate_parallel(
                source, estimator, [pieces[i] for i in todo], workers, on_error=on_error,
                start_method=start_method, cache_dir=cache_dir, advance=bar.update,
            )  # fmt: skip
            got.update(zip(todo, parts, strict=True))
        except Exception as e:
            if dist is None:
                raise
            error = f"rank {rank}: {type(e).__name__}: {e}"  # raised below on every rank
    if dist is not None:
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, (error, got), group=group)
        errors = [g[0] for g in gathered if g[0] is not None]
        if errors:
            raise RuntimeError("length index build failed: " + "; ".join(errors))
        got = {i: part for _, share in gathered for i, part in share.items()}
    if sorted(got) != list(range(len(pieces))):  # a rank's share went missing: never a gap
        raise RuntimeError(f"length index pieces {sorted(set(range(len(pieces))) - set(got))} "
                           "were neither loaded nor estimated")  # fmt: skip
    empty = np.zeros(0, np.int64)
    ordered = [got[i] for i in range(len(pieces))]
    total = np.concatenate([empty, *(p[0] for p in ordered)])
    visual = np.concatenate([empty, *(p[1] for p in ordered)])
    images = np.concatenate([empty, *(p[2] for p in ordered)])
    sup_parts = [p[5] for p in ordered]
    supervised = None
    if counts_supervised:
        if any(x is None for x in sup_parts):  # a piece saved without them cannot be used
            raise RuntimeError("length index pieces without supervised counts were assembled")
        supervised = np.concatenate([empty, *(x for x in sup_parts if x is not None)])
    fallbacks = [f for p in ordered for f in p[3]]
    media = [m for p in ordered for m in p[4]]
    counts: Counter[str] = Counter(r for _, reasons in fallbacks for r in reasons)
    index = LengthIndex(
        total=total, visual=visual, fingerprint=fp,
        fallback_ids=np.asarray([sid for sid, _ in fallbacks], np.int64),
        fallback_counts=dict(sorted(counts.items())),
        media=MediaStamp.of(media, root), images=images, supervised=supervised,
    )  # fmt: skip
    for sid, reasons in fallbacks:
        estimator.fallbacks.add(sid, reasons)
    if path is not None:
        index.save(path)
        if not sharded(source):  # its pieces serve no other build: see index_parts.py
            remove_pieces(path.parent, [pieces[i] for i in [*loads[me], *estimates[me]]])
        elif me == 0:  # rewritten or deleted shards' pieces, once the index is written
            prune_pieces(path.parent, pieces)
    return index


def _estimate_parallel(
    source: Any,
    estimator: LengthEstimator,
    pieces: list[Piece],
    workers: int,
    *,
    on_error: str = "raise",
    start_method: str = "fork",
    cache_dir: str | os.PathLike[str] | None = None,
    advance: Callable[[int], object] = lambda n: None,
) -> list[Part]:
    """The lengths of ``pieces`` and the media files read for them, relative to the source's
    media root (so ranks with their own copy of the media agree), each piece saved under
    ``cache_dir`` as it finishes (``advance(records)`` then). ``workers`` processes take the
    pieces one at a time (the source and estimator go to each once); a worker's error is
    raised here, the pieces finished before it stay saved."""
    records = sum(p.size for p in pieces)
    if workers == 0 or records < 2 * 8192 or len(pieces) < 2:
        out = []
        for piece in pieces:
            out.append(_piece(source, estimator, piece, on_error, cache_dir))
            advance(piece.size)
        return out
    import multiprocessing as mp
    from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait

    context = (source, estimator, on_error, cache_dir)
    with ProcessPoolExecutor(
        min(workers, len(pieces)), mp_context=mp.get_context(start_method),
        initializer=_worker_init, initargs=context,
    ) as pool:  # fmt: skip
        futures = [pool.submit(_worker_piece, piece) for piece in pieces]
        sizes = {f: p.size for f, p in zip(futures, pieces, strict=True)}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for f in done:
                if f.exception() is None:
                    advance(sizes[f])
            failed = [f for f in futures if f.done() and f.exception() is not None]
            if failed:
                for f in pending:
                    f.cancel()
                raise failed[0].exception()  # type: ignore[misc]  # the lowest failed piece's
        return [f.result() for f in futures]


_WORKER: tuple[Any, ...] = ()


def _worker_init(*context: Any) -> None:
    global _WORKER
    _WORKER = context


def _worker_piece(piece: Piece) -> Part:
    source, estimator, on_error, cache_dir = _WORKER
    return _piece(source, estimator, piece, on_error, cache_dir)


def _piece(
    source: Any, estimator: LengthEstimator, piece: Piece, on_error: str, cache_dir: Any
) -> Part:
    part = _slice_with_media(source, estimator, piece.lo, piece.hi, False, on_error)
    if cache_dir is not None:
        save_piece(cache_dir, piece, part, getattr(source, "media_root", None))
    return part


def _slice_with_media(
    source: Any, estimator: LengthEstimator, lo: int, hi: int, progress: bool, on_error: str
) -> Part:
    media: list[str] = []
    sup = np.zeros(hi - lo, np.int64) if getattr(estimator, "supervised", False) else None
    total, visual, images, fallbacks = estimate_slice(
        source, estimator, lo, hi, progress, on_error, media, sup
    )
    root = getattr(source, "media_root", None)
    return total, visual, images, fallbacks, relative_to(media, root), sup


def _try_load(path: Path | None, fp: str, root: str | None) -> LengthIndex | None:
    """The cached index, or None to rebuild it: absent, torn or corrupt, or built from media
    files that differ now (another ``media_root``, files re-exported: said in a warning)."""
    if path is None or not path.exists():
        return None
    try:
        index = LengthIndex.load(path, fingerprint=fp)
    except ValueError:
        return None  # torn or corrupt: rebuild (the rebuild overwrites it atomically)
    changed = index.media.changes(root)
    if changed:
        n = len(index.media.paths)
        warnings.warn(
            f"length index cache {path} was built from media files that differ now "
            f"(media_root {index.media.root!r}, now {root!r}): {'; '.join(changed)}"
            f"{' ...' if len(changed) >= 5 else ''} (of {n} files it sized); its lengths would "
            "mis-plan every epoch, so it is rebuilt and overwritten",
            stacklevel=3,
        )
        return None
    return index
