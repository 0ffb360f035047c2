"""Sharded datasets: WebDataset-style tar shards and Parquet files, local or at fsspec URLs
(``pipes/reading/remote.py``), read by sample id.

Sample ids run over the shards in the order given (a glob is sorted): shard 0's samples, then
shard 1's, ... Random access goes through a per-shard offset index: a Parquet file's row groups
(from its footer, no data read), a tar shard's member offsets (headers only, grouped by key),
cached in ``cache_dir`` (``pipes/reading/tar_index.py``: compact arrays, ``.npz``, the whole
index mapped by every process of a node) under the shard's
fingerprint (local: size + sha256 of its first and last 64 KiB + name; remote: ETag, size,
mtime) so a restart does not rescan. Both are ``RecordSource`` s: pass one to
``neat_vlm_graph`` and resume, exactly-once and elastic resume work as with JSONL (the ids are
stable). A record's media references are confined to the shard's location
(``pipes/reading/media_policy.py``).

A tar sample is the members sharing a key (``dir/000017.json``, ``dir/000017.jpg``; the key is
the name up to the first dot of its base name). Its ``.json`` member is the record, in any
format ``to_record`` reads (``pipes/reading/formats.py``); a media value that names a member of the
sample (``"000017.jpg"`` or ``"jpg"``) becomes that member's bytes; a record with neither an
``images`` / ``videos`` key nor such a reference gets its image and video members, in member
order, as ``images`` / ``videos`` (for ``{"type": "image"}`` placeholders). Parquet rows are
records; an Image column's ``{"bytes", "path"}`` structs are read as ``pipes/reading/formats.py``
says.

>>> ShardIndexError.__mro__[1].__name__
'RecordError'
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import io
import json
import os
import tarfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np

from neatpack.pipes.contracts import Record
from neatpack.pipes.indexing.index_split import initialized_dist, side_group, split_points
from neatpack.pipes.reading._record import RecordError, to_record
from neatpack.pipes.reading.built_once import built_once
from neatpack.pipes.reading.media_policy import confine_record_media
from neatpack.pipes.reading.remote import (
    FsspecStore,
    LocalStore,
    RangeFile,
    WindowFile,
    is_url,
    split_url,
    store_for,
)
from neatpack.pipes.reading.tar_index import LAYOUT, TarIndex

__all__ = [
    "ParquetSource",
    "ShardIndexError",
    "TarShardSource",
    "prune_tar_pieces",
    "shard_fingerprint",
    "shard_source",
]

IMAGE_EXTS: Final = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff")
VIDEO_EXTS: Final = ("mp4", "webm", "mkv", "avi", "mov")
_MEDIA_KEYS: Final = ("image", "video", "path", "url")
_JSON_BATCH: Final = 256  # remote .json members read together by iter_raw


class ShardIndexError(RecordError):
    """A shard that cannot be indexed (missing, not a tar / Parquet file, no samples)."""


def _paths(
    shards: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    kind: str,
    store: LocalStore | FsspecStore,
) -> list[str]:
    try:
        return _expand(shards, kind, store)
    except ShardIndexError:
        raise
    except RecordError as e:  # a remote store that cannot answer
        raise ShardIndexError(f"{kind} shards {shards!r} cannot be listed: {e}") from e


def _expand(
    shards: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    kind: str,
    store: LocalStore | FsspecStore,
) -> list[str]:
    if isinstance(shards, str | os.PathLike):
        found = store.expand(os.fspath(shards))
        if not found and not any(c in os.fspath(shards) for c in "*?["):
            raise ShardIndexError(
                f"{kind} shard {os.fspath(shards)!r} does not exist; fix the path"
            )
    else:
        found = [os.fspath(p) for p in shards]
        for p in found:
            if not store.expand(p):
                raise ShardIndexError(f"{kind} shard {p!r} does not exist; fix the path")
    if not found:
        raise ShardIndexError(f"no {kind} shards match {shards!r}; check the path or glob")
    return found


def shard_fingerprint(path: str) -> str:
    """sha256 over the base name, size and the first and last 64 KiB (cheap on huge shards)."""
    return LocalStore().fingerprint(path)


def _base(store: LocalStore | FsspecStore, path: str, media_root: str | None) -> str:
    """Where the media of ``path`` 's records may come from (``pipes/reading/media_policy.py``)."""
    if store.remote:
        return path.rsplit("/", 1)[0]
    return media_root if media_root is not None else os.path.dirname(os.path.realpath(path))


def _combined(fingerprints: list[str], kind: str) -> str:
    return hashlib.sha256(f"{kind}:{','.join(fingerprints)}".encode()).hexdigest()


def _locate(starts: Any, sample_id: int, n: int) -> tuple[int, int]:
    """(shard, index in shard) of ``sample_id``; ``starts``: a sorted list of shard starts."""
    if isinstance(sample_id, bool) or not isinstance(sample_id, int | np.integer):
        raise TypeError(f"sample_id must be an int, got {sample_id!r}")
    if not 0 <= sample_id < n:
        raise IndexError(f"{sample_id=} out of range for a source of {n} samples")
    shard = bisect.bisect_right(starts, int(sample_id)) - 1
    return shard, int(sample_id) - int(starts[shard])


# -- tar shards ----------------------------------------------------------------------------------

Members = dict[str, tuple[int, int]]  # ext -> (data offset, size)


def index_tar(path: str, fileobj: Any = None) -> list[tuple[str, Members]]:
    """``[(key, {ext: (offset, size)}), ...]`` in member order, reading headers only
    (``fileobj``: an open remote object, read through its readahead buffer)."""
    samples: list[tuple[str, Members]] = []
    try:
        with tarfile.open(path if fileobj is None else None, "r:", fileobj=fileobj) as tf:
            for m in tf:
                if not m.isfile():
                    continue
                head, _, base = m.name.rpartition("/")
                stem, dot, ext = base.partition(".")
                if not dot:
                    continue
                key = f"{head}/{stem}" if head else stem
                if not samples or samples[-1][0] != key:
                    samples.append((key, {}))
                samples[-1][1][ext.lower()] = (m.offset_data, m.size)
    except (tarfile.TarError, OSError, RecordError) as e:
        raise ShardIndexError(f"tar shard {path!r} is unreadable ({e}); re-create it") from e
    finally:
        if fileobj is not None:
            fileobj.close()
    return samples


def _piece_path(cache_dir: str | os.PathLike[str], fp: str) -> Path:
    return Path(cache_dir) / f"tar-index-{fp}.npz"


def _where(path: str) -> str:
    """A shard's place as its cache files record it: an absolute local path, or the URL."""
    return path if is_url(path) else os.path.abspath(path)


def _load_set(whole: Path | None, fingerprint: str, convert: bool = False) -> TarIndex | None:
    """The whole (mapped) offset index of the shards with this fingerprint, or None. A file
    of layout 2 counts as absent unless ``convert`` (the caller holds the set's lock): then
    it is converted, rewritten in this layout once and mapped."""
    if whole is None:
        return None
    try:
        index, meta = TarIndex.load(whole)
    except (ValueError, KeyError, TypeError):
        return None  # absent, torn, corrupt or of the first layout: assembled again
    if meta.get("fingerprint") != fingerprint:
        return None
    if meta.get("layout") != LAYOUT:
        if not convert:
            return None
        with contextlib.suppress(OSError):
            index.save(whole, {k: v for k, v in meta.items() if k not in ("layout", "unit")})
        return _load_set(whole, fingerprint) or index
    return index


def prune_tar_pieces(
    cache_dir: str | os.PathLike[str], paths: Sequence[str], fingerprints: Sequence[str]
) -> list[Path]:
    """Remove the offset-index files in ``cache_dir`` that no dataset of these shards can use
    again, and return them: a shard's index (``tar-index-*.npz``) made for a shard at one of
    ``paths`` whose content (``fingerprints``) has changed since, or for a local shard that is
    gone from one of their folders; a whole index (``tar-set-*.npz``) holding such a shard.
    Files this function cannot read as its own (the earlier layout, torn or foreign files) are
    never touched. Call it after the current whole index is written: a process of an older
    run that still maps a removed file keeps its pages (the name goes, the file stays until
    it is unmapped)."""
    current = {_where(p): fp for p, fp in zip(paths, fingerprints, strict=True)}
    folders = {os.path.dirname(w) for w in current if not is_url(w)}

    def stale(where: Any, fp: Any) -> bool:
        if not isinstance(where, str) or not isinstance(fp, str):
            return False
        if where in current:
            return current[where] != fp  # re-written since
        return (
            not is_url(where) and os.path.dirname(where) in folders and not (os.path.exists(where))
        )  # deleted from this dataset's folder

    removed = []
    for f in sorted(Path(cache_dir).glob("tar-index-*.npz")) + sorted(
        Path(cache_dir).glob("tar-set-*.npz")
    ):
        try:
            meta = TarIndex.read_meta(f)
            where = meta.get("paths", [meta.get("path")])
            pairs = list(zip(where, meta.get("shards", [meta.get("fingerprint")]), strict=True))
        except (ValueError, TypeError):
            continue  # not a file of ours (or not one this function can judge)
        if any(stale(w, fp) for w, fp in pairs):
            with contextlib.suppress(OSError):
                f.unlink()
                removed.append(f)
    return removed


class TarShardSource:
    """WebDataset-style tar shards (uncompressed ``.tar``), random access by sample id.

    ``shards``: local paths or fsspec URLs (``s3://bucket/set/*.tar``) with their
    ``storage_options`` (endpoint, credentials); ``retries``: further tries of a failed remote
    read; ``allow_hosts``: the http(s) hosts a record's media may be fetched from (none by
    default); ``cache_dir``: where the offset index is cached, per shard by its fingerprint
    and whole (``tar-set-*.npz``, mapped: one copy per node, see ``_index_all``);
    ``rank``, ``world_size``, ``group``: split the offset index build over the ranks of an
    initialized ``torch.distributed`` (each scans its share; gathered on a gloo side group)."""

    def __init__(
        self,
        shards: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        media_root: str | os.PathLike[str] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        retries: int = 3,
        allow_hosts: Sequence[str] = (),
        rank: int = 0,
        world_size: int = 1,
        group: Any = None,
    ) -> None:
        from neatpack.pipes.reading.read import real_media_root

        self._store = store_for(shards, storage_options, retries)
        self.paths = _paths(shards, "tar", self._store)
        self.media_root = real_media_root(media_root)
        self.allow_hosts = tuple(allow_hosts)
        try:
            fps = [self._store.fingerprint(p) for p in self.paths]
        except RecordError as e:
            raise ShardIndexError(f"tar shards are unreadable: {e}") from e
        self.shard_fingerprints = fps  # per shard: the length index keeps its pieces by these
        self._fingerprint = _combined(fps, "tar")
        self.index: TarIndex = self._index_all(fps, cache_dir, rank, world_size, group)
        self._starts: list[int] = np.asarray(self.index.shard_starts, np.int64).tolist()
        self._prefetched: dict[int, tuple[int, bytes | BaseException]] = {}
        self._json: dict[int, bytes] = {}  # iter_raw's batch of remote .json members

    def _index_all(
        self,
        fps: list[str],
        cache_dir: str | os.PathLike[str] | None,
        rank: int,
        world_size: int,
        group: Any,
    ) -> TarIndex:
        """Every shard's offset index as one ``TarIndex``. With ``world_size > 1`` under
        ``torch.distributed`` each rank scans its share of the shards (``split_points``; remote
        shards 8 at a time) on the CPU gloo side group. With a ``cache_dir`` every shard's
        index is kept there (``tar-index-<shard fingerprint>.npz``: a grown dataset scans only
        its new shards) and the whole index once (``tar-set-<fingerprint>.npz``), assembled by
        one process of a node (an ``flock``) and mapped by every rank and worker; shards the
        ranks of another node scanned reach it through the side group. Without one, the
        shares are all-gathered and every rank holds the whole index in memory."""
        whole = None if cache_dir is None else Path(cache_dir) / f"tar-set-{self._fingerprint}.npz"
        found = _load_set(whole, self._fingerprint)
        dist = initialized_dist(world_size)
        if dist is not None:
            group = side_group(group)
        if dist is not None and whole is not None:  # without a cache no rank has it
            flags: list[Any] = [None] * world_size
            dist.all_gather_object(flags, found is not None, group=group)
            if all(flags) and found is not None:
                return found
        elif found is not None:
            return found
        cuts = split_points(len(self.paths), world_size) if dist is not None else [0, 0]
        mine = range(cuts[rank], cuts[rank + 1]) if dist is not None else range(len(self.paths))

        def one(k: int) -> TarIndex:
            return self._index(self.paths[k], fps[k], cache_dir)

        error: str | None = None
        got: dict[int, TarIndex] = {}
        try:
            if self._store.remote and len(mine) > 1:
                from concurrent.futures import ThreadPoolExecutor

                with ThreadPoolExecutor(min(8, len(mine))) as pool:
                    got = dict(zip(mine, pool.map(one, mine), strict=True))
            else:
                got = {k: one(k) for k in mine}
        except ShardIndexError as e:
            if dist is None:
                raise
            error = f"rank {rank}: {e}"
        if dist is not None:
            got = self._exchange(dist, group, world_size, error, got, fps, cache_dir)
        if whole is None:
            return TarIndex.concat([got[k] for k in range(len(self.paths))])
        return self._assemble(whole, got, fps)

    def _exchange(
        self, dist: Any, group: Any, world_size: int, error: str | None,
        got: dict[int, TarIndex], fps: list[str], cache_dir: str | os.PathLike[str] | None,
    ) -> dict[int, TarIndex]:  # fmt: skip
        """The shards' indexes this rank needs from the others: all of them without a cache,
        else only those its cache does not hold (another node's disk), after every rank has
        written its share (the first collective is the barrier)."""
        if cache_dir is None:
            parts: list[Any] = [None] * world_size
            dist.all_gather_object(parts, (error, got), group=group)
            if errors := [e for e, _ in parts if e is not None]:
                raise ShardIndexError("; ".join(errors))
            return {k: v for _, part in parts for k, v in part.items()}
        errs: list[Any] = [None] * world_size
        dist.all_gather_object(errs, error, group=group)
        if errors := [e for e in errs if e is not None]:
            raise ShardIndexError("; ".join(errors))
        piece = [_piece_path(cache_dir, fp) for fp in fps]
        have = np.asarray([k in got or piece[k].is_file() for k in range(len(fps))], bool)
        haves: list[Any] = [None] * world_size
        dist.all_gather_object(haves, np.packbits(have), group=group)
        held = np.stack([np.unpackbits(h, count=len(fps)).astype(bool) for h in haves])
        if held.all():
            return got
        # a shard no disk holds (an unwritable cache) goes from the rank that scanned it; one
        # another node's disk lacks, from the first rank that holds it
        me = dist.get_rank(group)
        send = {k: v for k, v in got.items() if not held[:, k].all()}
        for k in np.flatnonzero(~held.all(axis=0)).tolist():
            if k not in send and held[me, k] and int(np.argmax(held[:, k])) == me:
                with contextlib.suppress(ShardIndexError):  # the receiver then scans it itself
                    send[k] = self._index(self.paths[k], fps[k], cache_dir)  # its file or a scan
        parts = [None] * world_size
        dist.all_gather_object(parts, send, group=group)
        for part in parts:
            for k, v in part.items():
                if not have[k]:
                    got[k] = v
                    with contextlib.suppress(OSError):
                        v.save(piece[k], {"fingerprint": fps[k], "path": _where(self.paths[k])})
        return got

    def _assemble(self, whole: Path, got: dict[int, TarIndex], fps: list[str]) -> TarIndex:
        """The whole index, written once per node to ``whole`` (``built_once``: the others
        wait on its lock and map it) from the shards' cached indexes (or ``got``), then mapped;
        stale pieces of this dataset's shards are pruned after it is written
        (``prune_tar_pieces``)."""
        parts = dict(got)

        def build() -> TarIndex:
            found = _load_set(whole, self._fingerprint, convert=True)  # layout 2: rewritten
            if found is not None:
                return found
            for k, fp in enumerate(fps):
                if k not in parts:  # another rank's share, from its file (or scanned)
                    parts[k] = self._index(self.paths[k], fp, whole.parent)
            index = TarIndex.concat([parts[k] for k in range(len(fps))])
            try:
                index.save(whole, {"fingerprint": self._fingerprint, "shards": fps,
                                   "paths": [_where(p) for p in self.paths]})  # fmt: skip
                prune_tar_pieces(whole.parent, self.paths, fps)
            except OSError:  # a cache we cannot write: held in memory
                return index
            return _load_set(whole, self._fingerprint) or index

        return built_once(
            whole,
            lambda: _load_set(whole, self._fingerprint),
            build,
            in_memory=lambda: TarIndex.concat([parts[k] for k in range(len(fps))]),
        )

    def _index(self, path: str, fp: str, cache_dir: str | os.PathLike[str] | None) -> TarIndex:
        cache = _piece_path(cache_dir, fp) if cache_dir is not None else None
        if cache is not None and cache.is_file():
            try:
                index, meta = TarIndex.load(cache, mapped=False)
                if meta.get("fingerprint", fp) == fp:
                    if meta.get("layout") != LAYOUT:  # an earlier layout: rewritten once
                        with contextlib.suppress(OSError):
                            index.save(cache, {"fingerprint": fp, "path": _where(path)})
                    return index
            except ValueError:
                pass  # a torn or corrupt cache file: rebuild it
        if self._store.remote:
            try:
                fileobj = self._store.open(path)
            except Exception as e:  # the client's own error types
                raise ShardIndexError(f"tar shard {path!r} is unreadable ({e}); fix it") from e
            index = TarIndex.from_samples(index_tar(path, fileobj))
        else:
            index = TarIndex.from_samples(index_tar(path))
        if cache is not None:
            with contextlib.suppress(OSError):
                index.save(cache, {"fingerprint": fp, "path": _where(path)})
        return index

    def __len__(self) -> int:
        return int(self._starts[-1])

    @property
    def shard_starts(self) -> list[int]:
        """The first sample id of each shard (the index build cuts its parts there)."""
        return list(self._starts[:-1])

    def raw(self, sample_id: int) -> dict[str, Any]:
        shard, local = _locate(self._starts, sample_id, len(self))
        if self._store.remote:
            return self._raw_at(None, shard, local, int(sample_id))
        with open(self.paths[shard], "rb") as f:
            return self._raw_at(f, shard, local, sample_id)

    def iter_raw(self, start: int, stop: int) -> Iterator[Any]:
        """Raw records ``start..stop-1``, one open file per shard (the length index reads
        these). A sample that cannot be read yields None: the index then takes it through
        ``source[id]``, which raises the named error (or its policy counts it)."""
        sid = start
        while sid < stop:
            shard, _ = _locate(self._starts, sid, len(self))
            first, end = int(self._starts[shard]), min(stop, int(self._starts[shard + 1]))
            f = None if self._store.remote else open(self.paths[shard], "rb")  # noqa: SIM115
            try:
                for i in range(sid, end):
                    if f is None and (i - sid) % _JSON_BATCH == 0:
                        self._prefetch_json(shard, i - first, min(end, i + _JSON_BATCH) - first)
                    try:
                        yield self._raw_at(f, shard, i - first, i)
                    except RecordError:
                        yield None
            finally:
                if f is not None:
                    f.close()
            sid = end

    def _prefetch_json(self, shard: int, lo: int, hi: int) -> None:
        """The ``.json`` members of samples ``lo..hi-1`` of a remote shard in one concurrent
        read (the length index reads records in order: one request per sample otherwise)."""
        first = int(self._starts[shard])
        ranges, ids = [], []
        for local in range(lo, hi):
            members = self.index[first + local][1]
            if "json" in members:
                ranges.append((self.paths[shard], *members["json"]))
                ids.append(first + local)
        got = self._store.read_many(ranges, f"{self.paths[shard]}: .json members {lo}..{hi - 1}")
        self._json = {i: g for i, g in zip(ids, got, strict=True) if isinstance(g, bytes)}

    def prefetch(self, sample_ids: Sequence[int]) -> None:
        """Read the byte spans of ``sample_ids`` (json + media members are adjacent in a tar)
        in one concurrent call; the next ``source[id]`` of each reads from memory. Remote
        shards only (the worker calls it with its pack's ids); replaces the last prefetch."""
        self._prefetched = {}
        if not self._store.remote:
            return
        ranges, ids = [], []
        for sid in dict.fromkeys(int(i) for i in sample_ids):
            if not 0 <= sid < len(self):
                continue
            shard, _ = _locate(self._starts, sid, len(self))
            spans = list(self.index[sid][1].values())
            lo = min(o for o, _ in spans)
            ranges.append((self.paths[shard], lo, max(o + n for o, n in spans) - lo))
            ids.append(sid)
        got = self._store.read_many(ranges, f"prefetch of sample_ids {ids[:8]}")
        self._prefetched = {
            sid: (lo, data) for sid, (_, lo, _), data in zip(ids, ranges, got, strict=True)
        }

    def _raw_at(self, f: Any, shard: int, local: int, sample_id: int) -> dict[str, Any]:
        key, members = self.index[int(self._starts[shard]) + local]
        path = self.paths[shard]
        where = f"sample_id={sample_id} ({path}: {key})"
        if "json" not in members:
            raise RecordError(f"{where}: no .json member (members {sorted(members)}); add one")
        span = self._prefetched.pop(sample_id, None)
        if span is not None and isinstance(span[1], BaseException):
            span = None  # the batch read failed for this one: read (and retry) it alone

        def read(ext: str) -> Any:
            offset, size = members[ext]
            if ext == "json" and sample_id in self._json:
                return self._json.pop(sample_id)
            image = ext.rsplit(".", 1)[-1] in IMAGE_EXTS  # header now, pixels in the worker
            if span is not None:
                lo, data = span
                body = bytes(data[offset - lo : offset - lo + size])  # type: ignore[index]
                return _open_image(io.BytesIO(body), f"{where} member .{ext}") if image else body
            if f is None:  # remote: ranged reads
                if image:
                    raw = RangeFile(self._store, path, offset, size, where)
                    return _open_image(io.BufferedReader(raw, 16384), f"{where} member .{ext}")
                return self._store.read(path, offset, size, where)
            if image:
                return _member_image(path, offset, size, f"{where} member .{ext}")
            f.seek(offset)
            return f.read(size)

        body = read("json")  # a failed remote read raises its own error
        try:
            raw = json.loads(body)
        except ValueError as e:
            raise RecordError(f"{where}: malformed .json member: {e}") from e
        if not isinstance(raw, dict):
            raise RecordError(f"{where}: .json member is a {type(raw).__name__}, not a dict")
        names = {f"{Path(key).name}.{e}": e for e in members} | {e: e for e in members}
        used = _substitute(raw, names, read) if len(members) > 1 else False
        raw = self._confine(raw, path, where)
        if len(members) == 1:
            return raw  # metadata only: nothing to attach
        if not used and not any(k in raw for k in ("images", "image", "videos", "video")):
            exts = [e for e in members if e != "json"]
            images = [read(e) for e in exts if e.rsplit(".", 1)[-1] in IMAGE_EXTS]
            videos = [read(e) for e in exts if e.rsplit(".", 1)[-1] in VIDEO_EXTS]
            if images:
                raw["images"] = images
            if videos:
                raw["videos"] = videos
        return raw

    def _confine(self, raw: dict[str, Any], path: str, where: str) -> dict[str, Any]:
        out: dict[str, Any] = _confine_media(
            raw, self._store, path, self.media_root, self.allow_hosts, where
        )
        return out

    def __getitem__(self, sample_id: int) -> Record:
        return to_record(self.raw(sample_id), int(sample_id), self.media_root)

    def content_fingerprint(self) -> str:
        return self._fingerprint

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_prefetched": {}, "_json": {}}


def _confine_media(
    raw: Any,
    store: LocalStore | FsspecStore,
    path: str,
    media_root: str | None,
    allow_hosts: Sequence[str],
    where: str,
) -> Any:
    """The record with its string media references confined (``pipes/reading/media_policy.py``); a
    remote
    one is opened lazily (an image's header only), a local one stays a checked path."""

    def load(ref: str) -> Any:
        if not is_url(ref):
            return ref
        own = isinstance(store, FsspecStore) and ref.startswith(f"{store.protocol}://")
        source = store if own and isinstance(store, FsspecStore) else _web_store(ref)
        size = _size(source, ref, where)
        if size is None:  # a server that does not say: the whole object, once
            body = source._retry(lambda: source.fs.cat_file(source._path(ref)), f"{where}: {ref!r}")
            if ref.rsplit(".", 1)[-1].lower() in VIDEO_EXTS:
                return body
            return _open_image(io.BytesIO(body), f"{where} media {ref!r}")
        if ref.rsplit(".", 1)[-1].lower() in VIDEO_EXTS:
            return source.read(ref, 0, size, where)
        raw = RangeFile(source, ref, 0, size, where)
        return _open_image(io.BufferedReader(raw, 16384), f"{where} media {ref!r}")

    return confine_record_media(
        raw, base=_base(store, path, media_root), where=where, allow_hosts=allow_hosts, load=load
    )


_WEB_STORES: dict[tuple[int, str], FsspecStore] = {}


def _web_store(url: str) -> FsspecStore:
    """One store per process and protocol for the allowed web media (made after the fork).
    Redirects are not followed: an allowed host could send the read anywhere (169.254...)."""
    key = (os.getpid(), split_url(url)[0])
    if key not in _WEB_STORES:
        options = {"allow_redirects": False} if key[1] in ("http", "https") else {}
        _WEB_STORES[key] = FsspecStore(key[1], options)
    return _WEB_STORES[key]


def _size(store: FsspecStore, url: str, where: str) -> int | None:
    info = store._retry(lambda: store.fs.info(store._path(url)), f"{where}: size of {url!r}")
    return None if info.get("size") is None else int(info["size"])


def _open_image(fileobj: Any, where: str) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(fileobj)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise RecordError(
            f"{where}: no readable image header ({type(e).__name__}: {e}); re-encode it"
        ) from e


class MemberFile(WindowFile):
    """A window of a local file (a tar member), opened on the first read in the reading process
    (``os.pread``: no shared file position)."""

    def __init__(self, path: str, offset: int, size: int) -> None:
        super().__init__(offset, size)
        self.path = path
        self._fd: int | None = None

    def _read(self, at: int, n: int) -> bytes:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        return os.pread(self._fd, n, at)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        super().close()


def _member_image(path: str, offset: int, size: int, where: str) -> Any:
    """A PIL image opened lazily over a tar member: ``Image.open`` reads its header (the length
    index needs the size only); ``load_image`` in the worker reads and decodes the rest."""
    return _open_image(io.BufferedReader(MemberFile(path, offset, size), 16384), where)


def _substitute(node: Any, names: dict[str, str], read: Any) -> bool:
    """Replace media values naming a member by its bytes, in place; True if any did."""
    used = False
    if isinstance(node, dict):
        for k, v in node.items():
            if k in _MEDIA_KEYS and isinstance(v, str) and v in names:
                node[k] = read(names[v])
                used = True
            elif k in ("images", "videos") and isinstance(v, list):
                for i, item in enumerate(v):
                    if isinstance(item, str) and item in names:
                        v[i] = read(names[item])
                        used = True
            else:
                used = _substitute(v, names, read) or used
    elif isinstance(node, list):
        for item in node:
            used = _substitute(item, names, read) or used
    return used


# -- Parquet -------------------------------------------------------------------------------------


class ParquetSource:
    """Parquet files, one record per row, random access by sample id through row groups. The
    row groups of the last pack are kept per process (sequential ids in a pack read it once).
    ``shards``, ``storage_options``, ``retries``, ``allow_hosts`` as for ``TarShardSource``."""

    def __init__(
        self,
        shards: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        media_root: str | os.PathLike[str] | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        retries: int = 3,
        allow_hosts: Sequence[str] = (),
    ) -> None:
        from neatpack.pipes.reading.read import real_media_root

        self._store = store_for(shards, storage_options, retries)
        self.paths = _paths(shards, "Parquet", self._store)
        self.media_root = real_media_root(media_root)
        self.allow_hosts = tuple(allow_hosts)
        self._files: dict[int, Any] = {}
        self._pid = os.getpid()
        groups: list[list[int]] = []
        for k, p in enumerate(self.paths):
            try:
                meta = self._file(k).metadata
            except Exception as e:  # pyarrow raises ArrowInvalid / OSError on a bad footer
                raise ShardIndexError(
                    f"Parquet shard {p!r} is unreadable ({e}); re-write it"
                ) from e
            groups.append([meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
        self._groups = [np.concatenate([[0], np.cumsum(g)]).astype(int).tolist() for g in groups]
        self._starts = (
            np.concatenate([[0], np.cumsum([g[-1] for g in self._groups])]).astype(int).tolist()
        )
        # per shard: the length index keeps its pieces by these (a grown dataset: new shards only)
        self.shard_fingerprints = [self._store.fingerprint(p) for p in self.paths]
        self._fingerprint = _combined(self.shard_fingerprints, "parquet")
        self._cache: dict[tuple[int, int], list[dict[str, Any]]] = {}

    def _file(self, shard: int) -> Any:
        """This process's open ``ParquetFile`` of a shard (opened after the fork, kept)."""
        import pyarrow.parquet as pq

        if self._pid != os.getpid():
            self._files, self._pid = {}, os.getpid()
        if shard not in self._files:
            path = self.paths[shard]
            self._files[shard] = pq.ParquetFile(
                self._store.open(path) if self._store.remote else path
            )
        return self._files[shard]

    def __len__(self) -> int:
        return int(self._starts[-1])

    @property
    def shard_starts(self) -> list[int]:
        """The first sample id of each shard (the index build cuts its parts there)."""
        return list(self._starts[:-1])

    def _where(self, sample_id: int) -> tuple[int, int, int]:
        shard, local = _locate(self._starts, sample_id, len(self))
        starts = self._groups[shard]
        group = bisect.bisect_right(starts, local) - 1
        return shard, group, local - int(starts[group])

    def _rows(self, shard: int, group: int, sample_id: int) -> list[dict[str, Any]]:
        if (shard, group) not in self._cache:
            where = f"sample_id={sample_id} ({self.paths[shard]}: row group {group})"
            if self._store.remote:
                rows = self._store._retry(  # type: ignore[union-attr]
                    lambda: self._file(shard).read_row_group(group).to_pylist(), where
                )
            else:
                rows = self._file(shard).read_row_group(group).to_pylist()
            self._cache = (
                {**self._cache, (shard, group): rows}
                if len(self._cache) < 64
                else {(shard, group): rows}
            )
        return self._cache[(shard, group)]

    def prefetch(self, sample_ids: Sequence[int]) -> None:
        """Read the row groups of ``sample_ids`` (the worker's pack) before its samples."""
        wanted = {self._where(int(i))[:2]: int(i) for i in sample_ids if 0 <= int(i) < len(self)}
        self._cache = {k: v for k, v in self._cache.items() if k in wanted}
        for (shard, group), sid in wanted.items():
            with contextlib.suppress(RecordError):  # the sample's own read reports it
                self._rows(shard, group, sid)

    def raw(self, sample_id: int) -> dict[str, Any]:
        shard, group, row = self._where(sample_id)
        cached = self._rows(shard, group, int(sample_id))[row]
        where = f"sample_id={sample_id} ({self.paths[shard]}: row {row} of group {group})"
        raw = _confine_media(  # copy on write: the cached row stays as read
            cached, self._store, self.paths[shard], self.media_root, self.allow_hosts, where
        )
        return dict(raw)

    def __getitem__(self, sample_id: int) -> Record:
        return to_record(self.raw(sample_id), int(sample_id), self.media_root)

    def iter_raw(self, start: int, stop: int) -> Iterator[Any]:
        for i in range(start, stop):
            try:
                yield self.raw(i)
            except RecordError:
                yield None

    def content_fingerprint(self) -> str:
        return self._fingerprint

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": {}, "_files": {}, "_pid": -1}


_KINDS: Final[dict[str, type[TarShardSource] | type[ParquetSource]]] = {
    ".tar": TarShardSource,
    ".parquet": ParquetSource,
}


def shard_source(
    data: Any,
    media_root: str | os.PathLike[str] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> TarShardSource | ParquetSource | None:
    """A ``TarShardSource`` / ``ParquetSource`` when ``data`` is a path, glob or list of paths
    (or fsspec URLs, with the store's defaults: environment credentials and endpoint) that all
    end ``.tar`` or all end ``.parquet``; else None (another reader's data).

    >>> shard_source([{"messages": []}]) is None
    True
    """
    items = [data] if isinstance(data, str | os.PathLike) else data
    if not isinstance(items, list | tuple) or not items:
        return None
    if not all(isinstance(p, str | os.PathLike) for p in items):
        return None
    suffixes = {Path(os.fspath(p)).suffix for p in items}
    if len(suffixes) != 1 or (suffix := suffixes.pop()) not in _KINDS:
        return None
    if suffix == ".tar":  # the offset index: cached, split over the ranks
        return TarShardSource(
            data, media_root=media_root, cache_dir=cache_dir, rank=rank, world_size=world_size
        )
    return ParquetSource(data, media_root=media_root)
