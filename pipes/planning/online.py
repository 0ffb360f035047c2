"""Online best-fit packing of a stream: samples arrive one by one, packs leave when full.

A planned graph packs the whole epoch at once (``best_fit_decreasing`` over the length index).
A stream cannot be seen whole, so ``OnlinePacker`` keeps a buffer of at most ``buffer_size``
samples spread over open packs:

* a new sample goes into the open pack it fits best (the least room left that still holds it;
  the oldest such pack on a tie), or opens a new pack;
* a pack leaves as soon as it is full (no room left);
* when the buffer holds more than ``buffer_size`` samples, the fullest open pack leaves (the
  oldest on a tie) to make room;
* at the end of the stream ``flush`` packs what the buffer holds again by best fit decreasing
  (the planned graphs' packer: sorted, it fills better than arrival order) and empties it,
  fullest pack first.

No randomness and no I/O: the packs are a pure function of the lengths in arrival order and
of ``(capacity, buffer_size)``. The state is the open packs as ``[sample id, length]`` pairs
(``state()`` / ``OnlinePacker(..., state=...)``), so a stream resumes with the same packs.

>>> p = OnlinePacker(capacity=8, buffer_size=2)
>>> [p.add(i, n) for i, n in enumerate([5, 4, 3, 2, 6])]
[[], [], [[0, 2]], [], [[1, 3]]]
>>> p.state()
[[[4, 6]]]
>>> p.flush()
[[4]]

Worked by hand: 5 opens pack A (room 3), 4 does not fit A and opens B (room 4), 3 fits both
and goes where it leaves the least room: A, now full, leaves as ``[0, 2]``. 2 goes into B (room
2). 6 fits nowhere and opens C; the buffer then holds 3 samples, more than 2, so the fullest
pack leaves: B and C both have room 2, B is older: ``[1, 3]``. ``flush`` empties C.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise

from .binpack import best_fit_decreasing

__all__ = ["OnlinePacker"]


@dataclass
class _Open:
    """One open pack: its samples in arrival order, its used length, its creation number."""

    seq: int
    ids: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    used: int = 0


class OnlinePacker:
    """The buffer of open packs (module docstring). ``add(sample_id, length)`` returns the packs
    (lists of sample ids) that leave because of that sample; ``flush()`` the rest."""

    def __init__(
        self,
        capacity: int,
        buffer_size: int,
        *,
        state: Sequence[Sequence[Sequence[int]]] = (),
    ) -> None:
        if capacity < 1:
            raise ValueError(f"{capacity=} must be >= 1 token")
        if buffer_size < 1:
            raise ValueError(f"{buffer_size=} must be >= 1 sample")
        self.capacity, self.buffer_size = capacity, buffer_size
        self._seq = 0
        self._open: dict[int, _Open] = {}
        self._by_room: list[tuple[int, int]] = []  # (room left, seq), sorted
        self._count = 0
        for pack in state:
            entry = self._new()
            for sid, length in pack:
                self._put(entry, int(sid), int(length))

    def __len__(self) -> int:
        """Samples in the buffer."""
        return self._count

    def _new(self) -> _Open:
        entry = _Open(self._seq)
        self._seq += 1
        self._open[entry.seq] = entry
        bisect.insort(self._by_room, (self.capacity, entry.seq))
        return entry

    def _put(self, entry: _Open, sid: int, length: int) -> None:
        if length > self.capacity - entry.used:
            raise ValueError(
                f"sample {sid} of length {length} does not fit its pack (used {entry.used} of "
                f"{self.capacity}): a state saved with another capacity?"
            )
        self._by_room.remove((self.capacity - entry.used, entry.seq))
        entry.ids.append(sid)
        entry.lengths.append(length)
        entry.used += length
        self._count += 1
        bisect.insort(self._by_room, (self.capacity - entry.used, entry.seq))

    def _take(self, seq: int) -> list[int]:
        entry = self._open.pop(seq)
        self._by_room.remove((self.capacity - entry.used, seq))
        self._count -= len(entry.ids)
        return entry.ids

    def add(self, sample_id: int, length: int) -> list[list[int]]:
        """Put one sample in its best-fit pack; the packs that leave now (full, or the fullest
        one when the buffer holds more than ``buffer_size`` samples)."""
        if not 0 <= length <= self.capacity:
            raise ValueError(
                f"sample {sample_id} has length {length}, outside [0, {self.capacity}]: "
                "overlong samples are the caller's to drop or refuse (overlong policy)"
            )
        at = bisect.bisect_left(self._by_room, (length, -1))
        entry = self._open[self._by_room[at][1]] if at < len(self._by_room) else self._new()
        self._put(entry, int(sample_id), int(length))
        out: list[list[int]] = []
        if entry.used == self.capacity:
            out.append(self._take(entry.seq))
        while self._count > self.buffer_size:
            out.append(self._take(self._by_room[0][1]))
        return out

    def flush(self) -> list[list[int]]:
        """The buffer's samples packed again by ``best_fit_decreasing``, fullest pack first
        (the first made on a tie); the buffer is empty after."""
        ids: list[int] = []
        lengths: list[int] = []
        for entry in sorted(self._open.values(), key=lambda e: e.seq):
            ids += entry.ids
            lengths += entry.lengths
        self._open.clear()
        self._by_room.clear()
        self._count = 0
        if not ids:
            return []
        offsets, order = best_fit_decreasing(lengths, self.capacity)
        packs = [[int(j) for j in order[a:b]] for a, b in pairwise(offsets.tolist())]
        packs.sort(key=lambda p: -sum(lengths[j] for j in p))  # stable: ties keep their order
        return [[ids[j] for j in p] for p in packs]

    def state(self) -> list[list[list[int]]]:
        """The open packs, oldest first, each as ``[[sample id, length], ...]`` (plain lists)."""
        return [
            [[sid, n] for sid, n in zip(e.ids, e.lengths, strict=True)]
            for e in sorted(self._open.values(), key=lambda e: e.seq)
        ]
