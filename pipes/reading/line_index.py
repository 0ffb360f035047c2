"""A JSONL file's line index in about 4 bytes a line: where each record's line starts and ends.

Line ``i`` starts at ``base[i >> bits] + rel[i]``: ``rel`` is uint32, relative to the start of
its block of ``2**bits`` lines (``base``, int64, one per block). ``bits`` is the largest (at
most ``MAX_BITS``) for which every block spans less than 4 GiB, so a file of any size fits; a
block of a file with 65,536 lines of 64 KiB or more each gets a smaller block (down to one line
a block: 12 bytes a line, the old layout's cost). A line ends where the next one starts, less
its ``\\n`` (a CRLF line keeps its ``\\r``, which JSON reads as whitespace, as before); the
lines that end otherwise (the last line, with or without a newline, and each line followed by
blank lines, which are skipped) are listed apart (``gap_ids``, ``gap_ends``), with the count of
blank lines before each following line (``gap_blanks``, cumulative) so errors still quote the
file's line number. Before: int64 starts + uint32 sizes (12 bytes a line), and int64 line
numbers (8 more) when the file had a blank line. The longest line's size (``longest``) is kept
beside the arrays (in the cache file's meta): ``over(limit)`` then needs no pass over the lines
when none is over the limit (a pass costs ~1.3 s a process at 100M lines).

>>> import numpy as np
>>> # b'{"a":1}\\n\\n{"b":2}\\r\\n{"c":3}' : lines 1, 3 and 4 (line 2 is blank)
>>> idx = LineIndex.build(np.array([0, 9, 17]), np.array([7, 16, 24]),
...                       np.array([1, 3, 4]), bits=1)
>>> idx.starts(0, 3).tolist(), idx.ends(0, 3).tolist(), [idx.line_number(i) for i in range(3)]
([0, 9, 17], [7, 16, 24], [1, 3, 4])
>>> idx.rel.tolist(), idx.base.tolist(), idx.gap_ids.tolist()
([0, 9, 0], [0, 17], [0, 2])
>>> idx.longest, idx.sizes(0, 3).tolist(), idx.over(6).tolist()
(7, [7, 7, 7], [0, 1, 2])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["MAX_BITS", "SPAN", "LineIndex", "block_bits"]

#: Lines a block at most (``2**MAX_BITS``): one int64 base per 65,536 lines (0.0001 byte a line).
MAX_BITS = 16
#: A block's starts are uint32 offsets from its base: every block must span less than this.
SPAN = 2**32
_CHUNK = 1 << 20  # lines at a time when a whole-file pass needs int64 starts

IntArray = npt.NDArray[np.int64]


def block_bits(starts: IntArray, *, span: int | None = None, max_bits: int = MAX_BITS) -> int:
    """The largest ``bits <= max_bits`` whose blocks of ``2**bits`` lines each span less than
    ``span`` bytes (None: ``SPAN``; first start to last start). 0 (a block a line) always
    fits.

    >>> block_bits(np.array([0, 10, 20, 30]), span=25, max_bits=2)
    1
    """
    n, span = len(starts), SPAN if span is None else span
    for bits in range(max_bits, 0, -1):
        size = 1 << bits
        first = starts[::size]
        last = starts[np.minimum(np.arange(size - 1, n + size - 1, size), n - 1)]
        if not n or int((last - first).max()) < span:
            return bits
    return 0


class LineIndex:
    """Starts and ends of a file's non-blank lines, and their 1-based line numbers (see the
    module docstring). Read-only; the arrays may be memory-mapped (``MappedArray``)."""

    FIELDS = ("rel", "base", "gap_ids", "gap_ends", "gap_blanks")

    def __init__(
        self,
        rel: npt.NDArray[np.uint32],
        base: IntArray,
        gap_ids: IntArray,
        gap_ends: IntArray,
        gap_blanks: IntArray,
        *,
        bits: int,
        lead: int,
        longest: int | None = None,
    ) -> None:
        n = len(rel)
        if not 0 <= bits <= MAX_BITS or len(base) != -(-n // (1 << bits)):
            raise ValueError(f"inconsistent line index: {n} lines, {len(base)} blocks, {bits=}")
        if not len(gap_ids) == len(gap_ends) == len(gap_blanks) or (n and not len(gap_ids)):
            raise ValueError(f"inconsistent line index: {len(gap_ids)} gap ids; rebuild it")
        self.rel, self.base, self.bits, self.lead = rel, base, bits, lead
        self.gap_ids, self.gap_ends, self.gap_blanks = gap_ids, gap_ends, gap_blanks
        #: the longest line's bytes; None when not known (a cache file written before it was
        #: kept): ``over`` scans then, ``scan_longest`` finds it
        self.longest = longest

    @classmethod
    def build(
        cls,
        starts: IntArray,
        ends: IntArray,
        lines: IntArray | None = None,
        *,
        bits: int | None = None,
    ) -> LineIndex:
        """From every kept line's start and end (its newline's offset, or the file's size for
        a last line without one) and 1-based line number (None: no blank lines, line ``i + 1``).
        ``bits`` (None: ``block_bits``) sets the block size."""
        starts = np.asarray(starts, np.int64)
        ends = np.asarray(ends, np.int64)
        n = len(starts)
        if bits is None:
            bits = block_bits(starts)
        base = starts[:: 1 << bits].copy()
        rel = np.empty(n, np.uint32)
        longest = 0
        for i in range(0, n, _CHUNK):  # a chunk at a time: no int64 copy of every start
            j = min(i + _CHUNK, n)
            part = starts[i:j] - base[np.arange(i, j) >> bits]
            if int(part.max()) >= min(SPAN, 2**32):
                raise ValueError(f"{bits=} makes a block span {SPAN} bytes or more; see block_bits")
            rel[i:j] = part
            longest = max(longest, int((ends[i:j] - starts[i:j]).max()))
        gaps = np.flatnonzero(ends[:-1] != starts[1:] - 1)
        gap_ids = np.append(gaps, n - 1) if n else gaps
        blanks, lead = np.zeros(len(gap_ids), np.int64), 0
        if lines is not None and n:
            numbers = np.asarray(lines, np.int64)
            skipped = np.diff(numbers) - 1  # blank lines between line i and line i + 1
            adjacent = np.ones(n - 1, bool)
            adjacent[gaps] = False
            if np.any(skipped[adjacent] != 0):
                raise ValueError("line numbers skip a line between adjacent lines; rebuild it")
            blanks = np.cumsum(np.append(skipped[gaps], 0))
            lead = int(numbers[0]) - 1
        return cls(
            rel, base, gap_ids.astype(np.int64), ends[gap_ids].copy(), blanks.astype(np.int64),
            bits=bits, lead=lead, longest=longest,
        )  # fmt: skip

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, Any], meta: Mapping[str, Any]) -> LineIndex:
        longest = meta.get("longest")
        return cls(*(arrays[f] for f in cls.FIELDS), bits=int(meta["bits"]),
                   lead=int(meta["lead"]),
                   longest=None if longest is None else int(longest))  # fmt: skip

    def arrays(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.FIELDS}

    def meta(self) -> dict[str, int]:
        out = {"bits": self.bits, "lead": self.lead}
        if self.longest is not None:
            out["longest"] = self.longest
        return out

    def __len__(self) -> int:
        return int(self.rel.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays().values())

    def start(self, i: int) -> int:
        return int(self.base[i >> self.bits]) + int(self.rel[i])

    def starts(self, i: int, j: int) -> IntArray:
        """Starts of lines ``i..j-1`` (int64)."""
        if j <= i:
            return np.zeros(0, np.int64)
        lo, hi = i >> self.bits, ((j - 1) >> self.bits) + 1
        first = lo << self.bits
        base = np.repeat(np.asarray(self.base[lo:hi], np.int64), 1 << self.bits)
        return base[i - first : j - first] + self.rel[i:j]

    def end(self, i: int) -> int:
        k = int(np.searchsorted(self.gap_ids, i))
        if k < len(self.gap_ids) and int(self.gap_ids[k]) == i:
            return int(self.gap_ends[k])
        return self.start(i + 1) - 1

    def ends(self, i: int, j: int) -> IntArray:
        """Ends of lines ``i..j-1`` (each newline's offset; the file's end for the last)."""
        out = np.empty(j - i, np.int64)
        inner = min(j, len(self) - 1)  # line n-1 has no next start: it is a gap
        if inner > i:
            out[: inner - i] = self.starts(i + 1, inner + 1) - 1
        a, b = np.searchsorted(self.gap_ids, [i, j])
        out[self.gap_ids[a:b] - i] = self.gap_ends[a:b]
        return out

    def size(self, i: int) -> int:
        return self.end(i) - self.start(i)

    def line_number(self, i: int) -> int:
        """The 1-based line of the file that holds line ``i`` of the index."""
        k = int(np.searchsorted(self.gap_ids, i))  # gaps before i: ids < i
        return i + 1 + self.lead + (int(self.gap_blanks[k - 1]) if k else 0)

    def first_at(self, offset: int) -> int:
        """The first line starting at or after byte ``offset`` (``len`` when none does)."""
        n = len(self)
        b = int(np.searchsorted(self.base, offset, side="left"))  # first block at/after it
        if b == 0:
            return 0
        lo, hi = (b - 1) << self.bits, min(b << self.bits, n)
        want = offset - int(self.base[b - 1])
        if want > int(self.rel[hi - 1]):
            return hi
        return lo + int(np.searchsorted(self.rel[lo:hi], np.uint32(want), side="left"))

    def sizes(self, i: int, j: int) -> IntArray:
        """Sizes in bytes of lines ``i..j-1`` (int64; without their newlines)."""
        n = len(self)
        if j <= i:
            return np.zeros(0, np.int64)
        starts = self.starts(i, min(j + 1, n))
        size = np.empty(j - i, np.int64)
        size[: len(starts) - 1] = np.diff(starts) - 1  # up to the next line's start
        a, b = np.searchsorted(self.gap_ids, [i, j])
        at = self.gap_ids[a:b] - i
        size[at] = self.gap_ends[a:b] - starts[at]  # lines that end otherwise
        return size

    def scan_longest(self) -> int:
        """The longest line's bytes, found by a pass over every line a chunk at a time (for an
        index whose ``longest`` is not known)."""
        n = len(self)
        return max((int(self.sizes(i, min(i + _CHUNK, n)).max()) for i in range(0, n, _CHUNK)),
                   default=0)  # fmt: skip

    def over(self, limit: int) -> IntArray:
        """Ids of the lines longer than ``limit`` bytes, sorted; none without a pass when the
        longest line is known and fits, else computed a chunk of lines at a time (no int64
        array of every line)."""
        n, found = len(self), [np.zeros(0, np.int64)]
        if self.longest is not None and self.longest <= limit:
            return found[0]
        for i in range(0, n, _CHUNK):
            size = self.sizes(i, min(i + _CHUNK, n))
            found.append(np.flatnonzero(size > limit) + i)
        return np.concatenate(found).astype(np.int64)
