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
from neatpack.pipes.reading.npz_files import map_npz, read_npz, write_npz

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
        starts, sizes, lines, blanks, digest = _index_jsonl_cached(self.path, cache_dir)
        self.starts: npt.NDArray[np.int64] = starts
        self.sizes: npt.NDArray[Any] = sizes  # uint32 (int64 only for a line over 4 GiB)
        self._lines = lines  # 1-based file line numbers, or None when there were no blank lines
        self.blank_lines = blanks
        self.max_record_bytes = max_record_bytes
        # ids of the lines over the limit, sorted: never read, refused by id
        self.too_large: npt.NDArray[np.int64] = (
            np.zeros(0, np.int64)
            if max_record_bytes is None
            else np.flatnonzero(sizes > max_record_bytes).astype(np.int64)
        )
        # The limit changes lengths only where it refuses a line: only then is it in the key.
        self._fingerprint = (
            f"{digest}\0max_record_bytes={max_record_bytes}" if self.too_large.size else digest
        )

    def __len__(self) -> int:
        return int(self.starts.shape[0])

    @property
    def ends(self) -> npt.NDArray[np.int64]:
        """Each line's end (its newline's offset): ``starts + sizes``, made on each call."""
        return np.asarray(self.starts + self.sizes, dtype=np.int64)

    def line_number(self, sample_id: int) -> int:
        """The 1-based line of the file that holds ``sample_id``."""
        sid = _check_id(sample_id, len(self))
        return sid + 1 if self._lines is None else int(self._lines[sid])

    def read_bytes(self, sample_id: int) -> bytes:
        sid = _check_id(sample_id, len(self))
        size = int(self.sizes[sid])
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
        return os.pread(self._fd, size, int(self.starts[sid]))

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
                base = int(self.starts[i])
                j = min(stop, int(np.searchsorted(self.starts, base + _BLOCK, side="left")))
                j = max(j, i + 1)
                if k < big.size:
                    j = min(j, int(big[k]))  # the block ends before the next line over the limit
                f.seek(base)
                block = f.read(int(self.starts[j - 1]) + int(self.sizes[j - 1]) - base)
                yield self._parse_block(block, i, j, base)
                i = j

    def _parse_block(self, block: bytes, i: int, j: int, base: int) -> list[Any]:
        """Parse lines ``i..j-1`` of ``block`` (read from file offset ``base``), as
        ``loads_exact`` would line by line, with the garbage collector paused."""
        starts = self.starts[i:j] - base
        lo = starts.tolist()
        hi = (starts + self.sizes[i:j]).tolist()
        slow = [_fast_loads is None] * (j - i)
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


_JsonlIndex = tuple[npt.NDArray[np.int64], npt.NDArray[Any], npt.NDArray[np.int64] | None, int, str]


def _file_identity(path: Path) -> str:
    st = os.stat(path)
    return (
        f"neatpack-jsonl-index-v1\0{os.path.realpath(path)}\0{st.st_dev}\0{st.st_ino}\0"
        f"{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}"
    )


def _line_sizes(starts: npt.NDArray[np.int64], ends: npt.NDArray[np.int64]) -> npt.NDArray[Any]:
    """Line sizes as uint32 (4 bytes a line instead of the 8 of an end offset) unless a line is
    over 4 GiB."""
    sizes = ends - starts
    return sizes.astype(np.uint32) if not sizes.size or sizes.max() < 2**32 else sizes


def _index_jsonl_cached(path: Path, cache_dir: str | os.PathLike[str] | None) -> _JsonlIndex:
    """``_index_jsonl``, kept in ``cache_dir`` under the file's identity (see ``JsonlSource``)
    and mapped from there (``map_npz``: the ranks and workers of a node share its pages: 12
    bytes a line, starts int64 + sizes uint32). A torn or foreign cache file, or one of the
    earlier layout (``ends``, no ``sizes``), is rebuilt once; a cache that cannot be written is
    skipped."""
    if cache_dir is None:
        starts, ends, lines, blanks, digest = _index_jsonl(path)
        return starts, _line_sizes(starts, ends), lines, blanks, digest
    ident = _file_identity(path)
    cache = Path(cache_dir) / f"jsonl-index-{hashlib.sha256(ident.encode()).hexdigest()}.npz"
    got = _load_jsonl_index(cache, ident)
    if got is not None:
        return got
    starts, ends, lines, blanks, digest = _index_jsonl(path)
    sizes = _line_sizes(starts, ends)
    del ends
    if _file_identity(path) != ident:  # written to while it was read: no cache of it
        return starts, sizes, lines, blanks, digest
    kept = np.zeros(0, np.int64) if lines is None else lines
    try:
        write_npz(
            cache, starts=starts, sizes=sizes, lines=kept, blanks=np.asarray(blanks),
            digest=np.asarray(digest), identity=np.asarray(ident),
        )  # fmt: skip
    except OSError:  # a read-only cache: the next start reads the file again
        return starts, sizes, lines, blanks, digest
    return _load_jsonl_index(cache, ident) or (starts, sizes, lines, blanks, digest)


def _load_jsonl_index(cache: Path, ident: str) -> _JsonlIndex | None:
    try:
        small = read_npz(cache, ("blanks", "digest", "identity"), what="JSONL line index cache")
        z = map_npz(cache, ("starts", "sizes", "lines"), what="JSONL line index cache")
    except ValueError:
        return None  # absent, torn, foreign or the earlier layout: build it again
    if str(small["identity"]) != ident:
        return None
    starts, sizes, lines, blanks = z["starts"], z["sizes"], z["lines"], int(small["blanks"])
    if len(starts) != len(sizes) or len(lines) not in (0, len(starts)):
        return None
    return starts, sizes, (lines if blanks else None), blanks, str(small["digest"])


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
