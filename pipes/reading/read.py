"""Raw record sources: random access by sample id over JSONL, JSON lists, in-memory lists and
Hugging Face datasets, each returning the Record shape of ``docs/data_contracts.md`` section 1.

Accepted raw shapes (converted lazily, when a sample id is read):

* ``{"conversation" | "messages": [{"role": ..., "content": str | [blocks]}], ...}``
* LLaVA: ``{"conversations": [{"from": "human", "value": "<image>\\nWhat?"}, ...],
  "image": "a.jpg"}`` (or ``"images": [...]``; ``<video>`` with ``"video"``/``"videos"``).

>>> src = SequenceSource([{"conversations": [{"from": "human", "value": "<image>\\nHi"},
...                                          {"from": "gpt", "value": "Cat."}], "image": "c.jpg"}])
>>> src[0]["conversation"][0]["content"]
[{'type': 'image', 'image': 'c.jpg'}, {'type': 'text', 'text': 'Hi'}]

JSONL blank lines (empty or whitespace only) are **skipped and counted** (``blank_lines``):
sample ids number the non-blank lines, and errors quote the 1-based line number in the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from neatpack.pipes.contracts import Record
from neatpack.pipes.reading._record import RecordError, paused_gc, to_record
from neatpack.pipes.reading.built_once import built_once
from neatpack.pipes.reading.line_index import LineIndex
from neatpack.pipes.reading.npz_files import checksum, map_npz, read_npz, write_npz
from neatpack.pipes.reading.verified import verify_once

__all__ = [
    "MAX_RECORD_BYTES",
    "HFDatasetSource",
    "JsonListSource",
    "JsonlSource",
    "RecordError",
    "RecordSource",
    "SequenceSource",
    "to_record",
]

_CHUNK = 1 << 20  # 1 MiB: read and hash granularity
_BLOCK = 8 << 20  # 8 MiB: sequential read block of iter_raw
#: ``JsonlSource``'s default ``max_record_bytes``: one block of the length index. A record's
#: parse and token count cost memory in proportion to it (tokenized whole ~200 bytes a
#: character: a 20 MB line took 2.9 GB, a 200 MB one was killed at 18 GB; text_pieces.py cuts
#: that for Qwen-style tokenizers, not for all), so one record may cost what one index block
#: of many records costs, and no more.
MAX_RECORD_BYTES = _BLOCK

_fast_loads: Callable[[bytes | memoryview], Any] | None
try:  # optional: ~3x faster than json.loads on typical records (3.4 vs 11 us for 440 bytes)
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - the json fallback is tested by patching this to None
    _fast_loads = None


def _long_digit_runs(block: bytes) -> npt.NDArray[np.intp]:
    """Byte offsets inside every run of 19+ digits in ``block`` (one or more per run; none
    elsewhere).

    orjson turns integers past 64 bits into floats (``-9999999999999999999`` -> ``-1e19``),
    where ``json`` keeps them exact; lines with such runs are parsed with ``json``. A run of
    19 digits covers three consecutive multiples of 6, so looking at every sixth byte finds
    each one as a candidate; a candidate ``p`` is kept only if the 37 bytes around it hold 19
    digits in a row (any run through ``p`` lies there). Without that check, three digits 6
    bytes apart (``[1234, 1156]``: common in image sizes) sent one line in six of a metadata
    corpus to ``json``, ~4x slower than orjson.
    """
    b = np.frombuffer(block, dtype=np.uint8)[::6]
    digit = (b >= 48) & (b <= 57)
    cand = np.flatnonzero(digit[:-2] & digit[1:-1] & digit[2:]) * 6
    if not cand.size:
        return cand
    search = _DIGITS_19.search
    keep = [p for p in cand.tolist() if search(block, max(p - 18, 0), p + 19)]
    return np.asarray(keep, dtype=np.intp)


_DIGITS_19 = re.compile(rb"[0-9]{19}")


def loads_exact(data: bytes | memoryview) -> Any:
    """``json.loads(data)``, through orjson when it gives the same object.

    orjson refuses NaN/Infinity, lone surrogates, a BOM and other inputs ``json`` accepts:
    those fall back to ``json``, which also raises the usual errors. Integers past 64 bits,
    which orjson would make floats, go to ``json`` first (``_long_digit_runs``).
    """
    if _fast_loads is not None and not _long_digit_runs(bytes(data)).size:
        try:
            return _fast_loads(data)
        except ValueError:
            pass
    return json.loads(bytes(data))


@runtime_checkable
class RecordSource(Protocol):
    """Random access to Records by stable sample id ``0..len-1``."""

    def __len__(self) -> int: ...

    def __getitem__(self, sample_id: int) -> Record: ...

    def content_fingerprint(self) -> str: ...


def _check_id(sample_id: int, n: int) -> int:
    if isinstance(sample_id, bool) or not isinstance(sample_id, int | np.integer):
        raise TypeError(f"sample ids are ints; got {sample_id=!r}")
    if not 0 <= sample_id < n:
        raise IndexError(f"{sample_id=} is outside 0..{n - 1} (the source has {n} records)")
    return int(sample_id)


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def real_media_root(media_root: str | os.PathLike[str] | None) -> str | None:
    return None if media_root is None else os.path.realpath(media_root)


_TOO_DEEP = "more levels than Python's recursion limit; no real record is"


def _convert(raw: Any, sid: int, media_root: str | None, where: str = "") -> Record:
    """``to_record``, with a record too deeply nested to convert or quote (``repr`` recurses)
    refused as a ``RecordError`` naming it instead of a ``RecursionError`` from deep inside."""
    try:
        return to_record(raw, sid, media_root)
    except RecursionError:
        raise RecordError(
            f"{where}(sample_id={sid}) is nested too deeply to read ({_TOO_DEEP}); fix or "
            "delete that record"
        ) from None


class JsonlSource:
    """A JSONL file with random access through a byte-offset index built in one pass.

    The pass reads the file in 1 MiB binary chunks, finds newlines with numpy and hashes the
    same bytes (sha256), so ``content_fingerprint()`` costs nothing more. Lines are parsed only
    when their id is read. Pickles without an open file (workers reopen it lazily).

    ``cache_dir``: keep the pass's result there (``jsonl-index-<key>.npz``), keyed by the
    file's identity: path, device, inode, size, mtime and ctime. Any write to the file changes
    its ctime, which no tool can set back, so a changed file is never taken for the cached one;
    an unchanged one is not read again (a 1M-record, 557 MB file: 0.5 s -> a few ms at every
    start). The graphs pass their ``cache_dir``.

    ``max_record_bytes``: a line longer than this (default ``MAX_RECORD_BYTES``, 8 MiB; None:
    no limit) is never read: reading its id raises a ``RecordError`` naming the line, its size
    and the fix, which ``on_bad_sample`` then raises, skips or replaces (counted). The limit
    enters ``content_fingerprint()`` only when some line is over it, so the length index
    cached for a file with no such line keeps its key.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        media_root: str | os.PathLike[str] | None = None,
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        max_record_bytes: int | None = MAX_RECORD_BYTES,
    ) -> None:
        if max_record_bytes is not None and max_record_bytes < 1:
            raise ValueError(f"{max_record_bytes=} must be >= 1 byte, or None for no limit")
        self.path = Path(path)
        self.media_root = real_media_root(media_root)
        self._fd: int | None = None
        self._pid = -1
        lines, blanks, digest = _index_jsonl_cached(self.path, cache_dir)
        self.lines: LineIndex = lines  # ~4 bytes a line, mapped from cache_dir when given
        self.blank_lines = blanks
        self.max_record_bytes = max_record_bytes
        # ids of the lines over the limit, sorted: never read, refused by id
        self.too_large: npt.NDArray[np.int64] = (
            np.zeros(0, np.int64) if max_record_bytes is None else lines.over(max_record_bytes)
        )
        # The limit changes lengths only where it refuses a line: only then is it in the key.
        self._fingerprint = (
            f"{digest}\0max_record_bytes={max_record_bytes}" if self.too_large.size else digest
        )

    def __len__(self) -> int:
        return len(self.lines)

    def line_number(self, sample_id: int) -> int:
        """The 1-based line of the file that holds ``sample_id``."""
        return self.lines.line_number(_check_id(sample_id, len(self)))

    def read_bytes(self, sample_id: int) -> bytes:
        sid = _check_id(sample_id, len(self))
        start = self.lines.start(sid)
        size = self.lines.end(sid) - start
        if self.max_record_bytes is not None and size > self.max_record_bytes:
            raise RecordError(
                f"{self.path} line {self.line_number(sid)} (sample_id={sid}) is {size} bytes, "
                f"over max_record_bytes={self.max_record_bytes} (one record may not cost more "
                "memory than that to parse and tokenize); split or shorten that record, or "
                "raise max_record_bytes (NeatVLMConfig, GroupedConfig) if you have the memory"
            )
        if self._fd is None or self._pid != os.getpid():
            self._fd = os.open(self.path, os.O_RDONLY)
            self._pid = os.getpid()
        return os.pread(self._fd, size, start)

    def raw(self, sample_id: int) -> dict[str, Any]:
        """The parsed JSON object of ``sample_id`` (no conversion)."""
        data = self.read_bytes(sample_id)
        try:
            obj = loads_exact(data)
        except ValueError as e:
            raise RecordError(
                f"malformed JSON in {self.path} line {self.line_number(sample_id)} "
                f"(sample_id={sample_id}): {e}; fix or delete that line"
            ) from e
        except RecursionError:  # json recurses per level: a hostile line would escape unnamed
            raise RecordError(
                f"{self.path} line {self.line_number(sample_id)} (sample_id={sample_id}) is "
                f"nested too deeply to read ({_TOO_DEEP}); fix or delete that line"
            ) from None
        if not isinstance(obj, dict):
            raise RecordError(
                f"{self.path} line {self.line_number(sample_id)} (sample_id={sample_id}) holds a "
                f"{type(obj).__name__}, expected a JSON object"
            )
        return obj

    def __getitem__(self, sample_id: int) -> Record:
        raw = self.raw(sample_id)
        return _convert(raw, int(sample_id), self.media_root, f"{self.path} line "
                        f"{self.line_number(sample_id)} ")  # fmt: skip

    def iter_raw(self, start: int, stop: int) -> Iterator[Any]:
        """Parsed JSON of ids ``start..stop-1`` in order, read in ~8 MiB blocks (the length
        index's fast path); a line that does not parse yields ``None`` (reading that id through
        ``source[id]`` raises the error with its line number)."""
        for block in self.iter_raw_blocks(start, stop):
            yield from block

    def iter_raw_blocks(self, start: int, stop: int) -> Iterator[list[Any]]:
        """``iter_raw`` as one list per ~8 MiB block read (no per-record generator step)."""
        i = start
        big = self.too_large
        with self.path.open("rb") as f:
            while i < stop:
                k = int(np.searchsorted(big, i))
                if k < big.size and big[k] == i:
                    yield [None]  # over max_record_bytes: not read; source[id] says why
                    i += 1
                    continue
                base = self.lines.start(i)
                j = max(min(stop, self.lines.first_at(base + _BLOCK)), i + 1)
                if k < big.size:
                    j = min(j, int(big[k]))  # the block ends before the next line over the limit
                starts, ends = self.lines.starts(i, j) - base, self.lines.ends(i, j) - base
                f.seek(base)
                yield _parse_block(f.read(int(ends[-1])), starts, ends)
                i = j

    def content_fingerprint(self) -> str:
        return self._fingerprint

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fd"], state["_pid"] = None, -1
        return state

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None and self._pid == os.getpid():
            with contextlib.suppress(Exception):  # interpreter shutdown may have torn down os
                os.close(fd)


def _parse_block(
    block: bytes, starts: npt.NDArray[np.int64], ends: npt.NDArray[np.int64]
) -> list[Any]:
    """Parse the lines ``block[starts[k]:ends[k]]`` as ``loads_exact`` would line by line, with
    the garbage collector paused."""
    lo, hi = starts.tolist(), ends.tolist()
    slow = [_fast_loads is None] * len(lo)
    if _fast_loads is not None:  # lines holding long digit runs go to json
        hits = _long_digit_runs(block)
        if hits.size:
            for k in np.unique(np.searchsorted(starts, hits, side="right") - 1).tolist():
                slow[k] = True  # digits lie inside lines, never between them
    fast = _fast_loads
    if fast is not None and not any(slow):
        # Common case: every line goes to orjson. Given bytes, not a memoryview slice:
        # orjson parses a bytes object ~15 % cheaper (about 13.6k vs 14.6k instructions a
        # 530-byte record, counted with cachegrind).
        with paused_gc():
            try:
                return [fast(block[a:b]) for a, b in zip(lo, hi, strict=True)]
            except ValueError:
                pass  # some line is not orjson's: line by line below
    view = memoryview(block)
    out: list[Any] = []
    with paused_gc():
        for a, b, use_json in zip(lo, hi, slow, strict=True):
            if fast is not None and not use_json:
                try:
                    out.append(fast(view[a:b]))
                    continue
                except ValueError:
                    pass
            try:
                out.append(json.loads(block[a:b]))
            except (ValueError, RecursionError):
                out.append(None)  # source[id] raises the error naming the line
    return out


#: What a JSONL line-index cache file holds (``_save_jsonl_index``): 3 is the compact
#: ``LineIndex`` (about 4 bytes a line) with a checksum and the longest line's size (a 3 written
#: before that size was kept is scanned for it once and rewritten: the over-long check of every
#: later open then reads no line); 2 (int64 ``starts``, uint32 ``sizes``, int64 ``lines``:
#: 12-20 bytes a line) is read, verified and rewritten once as 3; 1 (``ends``) is rebuilt from
#: the file.
JSONL_LAYOUT = 3
_JsonlIndex = tuple[LineIndex, int, str]  # (lines, blank lines, sha256 of the file)
_WHAT = "JSONL line index cache"


def _file_identity(path: Path) -> str:
    st = os.stat(path)
    return (
        f"neatpack-jsonl-index-v1\0{os.path.realpath(path)}\0{st.st_dev}\0{st.st_ino}\0"
        f"{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}"
    )


def _index_jsonl_cached(path: Path, cache_dir: str | os.PathLike[str] | None) -> _JsonlIndex:
    """``_index_jsonl``, kept in ``cache_dir`` under the file's identity (see ``JsonlSource``)
    and mapped from there (``map_npz``: the ranks and workers of a node share its pages). A
    torn, corrupt or foreign cache file, or one of layout 1, is rebuilt from the file; one of
    layout 2, or of layout 3 without the longest line's size, is converted (no read of the
    file) and rewritten once; a cache that cannot be
    written is skipped. The build runs once per node (``built_once``): one process of a node
    reads the file, the others wait and map what it wrote (at 100M lines the build holds ~3 GB
    of int64 offsets for a moment: once a node, not once a rank)."""
    if cache_dir is None:
        starts, ends, lines, blanks, digest = _index_jsonl(path)
        return LineIndex.build(starts, ends, lines), blanks, digest
    ident = _file_identity(path)
    cache = Path(cache_dir) / f"jsonl-index-{hashlib.sha256(ident.encode()).hexdigest()}.npz"
    return built_once(
        cache,
        lambda: _load_jsonl_index(cache, ident),
        lambda: _build_jsonl_index(path, cache, ident),
        in_memory=lambda: _index_jsonl_cached(path, None),
    )


def _build_jsonl_index(path: Path, cache: Path, ident: str) -> _JsonlIndex:
    old = _load_jsonl_index(cache, ident, longest=False) or _load_jsonl_index_v2(cache, ident)
    if old is not None:  # an earlier layout of this file's index: converted, the file not read
        built = old
        if built[0].longest is None:  # one pass over the lines, once a node
            built[0].longest = built[0].scan_longest()
    else:
        starts, ends, numbers, blanks, digest = _index_jsonl(path)
        built = (LineIndex.build(starts, ends, numbers), blanks, digest)
        del starts, ends, numbers
        if _file_identity(path) != ident:  # written to while it was read: no cache of it
            return built
    try:
        _save_jsonl_index(cache, ident, *built)
    except OSError:  # a read-only cache: the next start reads (or converts) it again
        return built
    return _load_jsonl_index(cache, ident) or built


def _save_jsonl_index(cache: Path, ident: str, lines: LineIndex, blanks: int, digest: str) -> None:
    arrays = lines.arrays()
    meta = {"layout": JSONL_LAYOUT, "identity": ident, "blanks": blanks, "digest": digest,
            **lines.meta()}  # fmt: skip
    body = json.dumps({**meta, "checksum": checksum(arrays, meta, head=ident)})
    write_npz(cache, meta=np.frombuffer(body.encode(), np.uint8), **arrays)


def _load_jsonl_index(cache: Path, ident: str, *, longest: bool = True) -> _JsonlIndex | None:
    """The layout-3 cache at ``cache``, mapped and verified; None when it is absent, torn,
    corrupt, of another file or of another layout, or (``longest``) written before the
    longest line's size was kept (``_build_jsonl_index`` converts it)."""
    try:
        meta = json.loads(read_npz(cache, ("meta",), what=_WHAT)["meta"].tobytes())
        want = meta.pop("checksum")
        if meta.get("layout") != JSONL_LAYOUT or meta.get("identity") != ident:
            return None
        if longest and "longest" not in meta:
            return None
        z = map_npz(cache, LineIndex.FIELDS, what=_WHAT)

        def check() -> None:
            if checksum(z, meta, head=ident) != want:
                raise ValueError(f"{cache}: checksum mismatch")

        verify_once(cache, z, check)  # hashed once per node, not on every open (verified.py)
        return LineIndex.from_arrays(z, meta), int(meta["blanks"]), str(meta["digest"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _load_jsonl_index_v2(cache: Path, ident: str) -> _JsonlIndex | None:
    """A layout-2 cache (``starts``, ``sizes``, ``lines``) of this file, converted; None for
    anything else. Its line numbers are checked against the starts and ends (a blank line
    lies between two lines exactly where one does not start after the other's newline)."""
    try:
        small = read_npz(cache, ("blanks", "digest", "identity"), what=_WHAT)
        z = map_npz(cache, ("starts", "sizes", "lines"), what=_WHAT)
        if str(small["identity"]) != ident:
            return None
        starts, sizes, numbers = z["starts"], z["sizes"], z["lines"]
        blanks = int(small["blanks"])
        if len(starts) != len(sizes) or len(numbers) != (len(starts) if blanks else 0):
            return None
        ends = np.asarray(starts, np.int64) + sizes
        lines = LineIndex.build(starts, ends, numbers if blanks else None)
        return lines, blanks, str(small["digest"])
    except (ValueError, KeyError, TypeError):
        return None


def _index_jsonl(
    path: Path,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64] | None, int, str]:
    """One pass: (line starts, line ends without the newline, line numbers or None, blank
    count, sha256)."""
    h = hashlib.sha256()
    newlines: list[npt.NDArray[np.int64]] = []
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            pos = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10)
            newlines.append(pos.astype(np.int64) + size)
            size += len(chunk)
    nl = np.concatenate(newlines) if newlines else np.zeros(0, np.int64)
    ends = nl if size == 0 or (nl.size and nl[-1] == size - 1) else np.append(nl, size)
    starts = np.concatenate([np.zeros(1, np.int64), nl + 1])[: ends.size]
    # Blank = empty or whitespace only. Only short lines can be blank-with-whitespace; check
    # those few in Python (a JSON object line is never shorter than 2 bytes: "{}").
    lengths = ends - starts
    blank = lengths == 0
    short = np.flatnonzero((lengths > 0) & (lengths <= 16))
    if short.size:
        with path.open("rb") as f:
            for i in short:
                f.seek(int(starts[i]))
                if not f.read(int(lengths[i])).strip():
                    blank[i] = True
    n_blank = int(blank.sum())
    lines: npt.NDArray[np.int64] | None = None
    if n_blank:
        keep = np.flatnonzero(~blank)
        starts, ends, lines = starts[keep], ends[keep], (keep + 1).astype(np.int64)
    return starts.astype(np.int64), ends.astype(np.int64), lines, n_blank, h.hexdigest()


class JsonListSource:
    """A JSON file holding one list of records (parsed once; records converted lazily)."""

    def __init__(
        self, path: str | os.PathLike[str], media_root: str | os.PathLike[str] | None = None
    ) -> None:
        self.path = Path(path)
        self.media_root = real_media_root(media_root)
        with self.path.open("rb") as f:
            try:
                data = json.load(f)
            except ValueError as e:
                raise RecordError(f"malformed JSON in {self.path}: {e}") from e
            except RecursionError:
                raise RecordError(
                    f"{self.path} is nested too deeply to read ({_TOO_DEEP}); fix that record"
                ) from None
        if not isinstance(data, list):
            raise RecordError(
                f"{self.path} holds a {type(data).__name__}; JsonListSource expects a JSON list "
                "of records (use JsonlSource for one record per line)"
            )
        self._records: list[Any] = data
        self._fingerprint = _hash_file(self.path)

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, sample_id: int) -> Record:
        sid = _check_id(sample_id, len(self))
        return _convert(self._records[sid], sid, self.media_root, f"{self.path} record {sid} ")

    def iter_raw(self, start: int, stop: int) -> Iterator[Any]:
        return iter(self._records[start:stop])

    def content_fingerprint(self) -> str:
        return self._fingerprint


class SequenceSource:
    """An in-memory list of raw records. The fingerprint hashes their JSON form; values that are
    not JSON (PIL images, tensors) are hashed by ``repr``, which for most objects includes the
    address, so such sources never reuse a length cache across processes (safe, not stale)."""

    def __init__(
        self, records: Sequence[Mapping[str, Any]], media_root: str | os.PathLike[str] | None = None
    ) -> None:
        self.records = records
        self.media_root = real_media_root(media_root)
        self._fingerprint: str | None = None

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, sample_id: int) -> Record:
        sid = _check_id(sample_id, len(self))
        return _convert(self.records[sid], sid, self.media_root)

    def iter_raw(self, start: int, stop: int) -> Iterator[Any]:
        return (self.records[i] for i in range(start, stop))

    def content_fingerprint(self) -> str:
        if self._fingerprint is None:
            h = hashlib.sha256()
            for r in self.records:
                h.update(json.dumps(r, sort_keys=True, default=repr).encode())
                h.update(b"\n")
            self._fingerprint = h.hexdigest()
        return self._fingerprint


class HFDatasetSource:
    """A ``datasets.Dataset`` (needs the optional ``datasets`` package). The fingerprint is the
    dataset's own ``_fingerprint`` (content-derived for datasets loaded from files)."""

    def __init__(self, ds: Any, media_root: str | os.PathLike[str] | None = None) -> None:
        try:
            import datasets  # noqa: F401
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                "HFDatasetSource needs the `datasets` package: pip install 'neatpack[datasets]'"
            ) from e
        from neatpack.pipes.reading.formats import undecoded_dataset

        self.ds = undecoded_dataset(ds)  # Image/Video features: bytes, decoded in the workers
        self.media_root = real_media_root(media_root)

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, sample_id: int) -> Record:
        sid = _check_id(sample_id, len(self))
        return _convert(self.ds[sid], sid, self.media_root)

    def content_fingerprint(self) -> str:
        fp = getattr(self.ds, "_fingerprint", None)
        if fp is None:
            raise ValueError("this dataset has no _fingerprint; wrap it in SequenceSource instead")
        return hashlib.sha256(f"hf:{fp}:{len(self.ds)}".encode()).hexdigest()
