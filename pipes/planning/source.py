"""This rank's pack source: the epoch's planned packs, strided over ranks, with a global cursor.

Pack slot ``s`` of an epoch's order goes to rank ``s % world_size``. After every rank has taken
``n`` packs, the ranks together have consumed the slots ``[start, start + n * world_size)``;
that global cursor is the whole position. A state saved on ``W`` ranks therefore resumes on
``W'`` ranks: the rest of the epoch, ``order[cursor:]``, is strided over the new ranks.

Example: 10 packs, world_size 2, batch_size 2, ``tail="drop"`` keeps 8 slots::

    slot   0 1 2 3 4 5 6 7 | 8 9      (order[8:] dropped, counted)
    rank   0 1 0 1 0 1 0 1
    rank 0 gets slots 0 2 4 6; rank 1 gets 1 3 5 7: two batches each.

Checkpoint after one batch (cursor 4), resume on 3 ranks: the remaining slots 4..9 are 6,
one step of 3 ranks x 2 packs: rank 0 takes 4 7, rank 1 takes 5 8, rank 2 takes 6 9.

The plan for an epoch is grouped for a world size (``group_size``) so that one training step
carries balanced loads. The state records that group size; a resumed source rebuilds exactly
that plan for the rest of the epoch, whatever its own world size, and plans the next epoch
for the new world size (DESIGN.md, "Plan parameters travel with the state").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, Protocol, get_args

import numpy as np
from torchdata.nodes import BaseNode

from neatpack.pipes.contracts import PackRef

__all__ = [
    "TAIL_POLICIES",
    "PackRef",
    "PackSource",
    "PlanLike",
    "PositionKeys",
    "ResumePoint",
    "StateMismatchError",
    "TailPolicy",
    "epoch_slots",
]

#: The epoch's last step when too little is left for every rank.
TailPolicy = Literal["drop", "pad"]
TAIL_POLICIES: tuple[str, ...] = get_args(TailPolicy)


class PlanLike(Protocol):
    """What the source needs of a plan (``neatpack.pipes.planning.plan.PackPlan`` is one)."""

    @property
    def fingerprint(self) -> str: ...

    def __len__(self) -> int: ...

    def pack(self, index: int) -> list[int]: ...

    def epoch_order(self, epoch: int) -> np.ndarray: ...


class ResumePoint(NamedTuple):
    """Where a saved state resumes: the epoch, its plan's group size, and the position."""

    epoch: int
    group_size: int
    start: int
    local: int


class StateMismatchError(ValueError):
    """A saved state does not belong to this source (other data, config, rank or version)."""


def epoch_slots(num_packs: int, start: int, unit: int, tail: str) -> int:
    """Number of slots (from ``start``) the epoch yields so every rank gets whole steps.

    ``unit`` is world_size x per-rank batch size. ``drop`` cuts the remainder, ``pad`` repeats
    packs from the start of the order to fill the last step.

    >>> epoch_slots(10, 0, 4, "drop"), epoch_slots(10, 0, 4, "pad"), epoch_slots(10, 4, 6, "drop")
    (8, 12, 6)
    """
    remaining = max(num_packs - start, 0)
    if tail == "drop":
        return remaining // unit * unit
    return math.ceil(remaining / unit) * unit


class PositionKeys:
    """The state keys of a rank's position, the same for every source the loader reads (a
    planned ``PackSource``, a stream's ``StreamPacker``), and the check of that position."""

    VERSION = 1
    VERSION_KEY = "version"
    FINGERPRINT_KEY = "fingerprint"
    EPOCH_KEY = "epoch"
    START_KEY = "epoch_start"
    LOCAL_KEY = "local"
    CURSOR_KEY = "cursor"
    RANK_KEY = "rank"
    WORLD_SIZE_KEY = "world_size"
    GROUP_SIZE_KEY = "group_size"
    BATCH_SIZE_KEY = "batch_size"
    TAIL_KEY = "tail"
    STARTED_KEY = "started"

    @staticmethod
    def check_position(rank: int, world_size: int, batch_size: int) -> None:
        """ValueError for a rank outside the world or a batch of no packs."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got {rank=} {world_size=}")
        if batch_size < 1:
            raise ValueError(f"{batch_size=} must be >= 1")


class PackSource(PositionKeys, BaseNode[PackRef]):
    """Yields this rank's pack references, ``{"epoch", "slot", "pack_index", "sample_ids", ...}``.

    ``plan`` is a plan or a function ``group_size -> plan`` (needed to resume a checkpoint taken
    on another world size). The state is a handful of ints: resume is O(1), no replay.
    """

    def __init__(
        self,
        plan: PlanLike | Callable[[int], PlanLike],
        *,
        rank: int,
        world_size: int,
        batch_size: int = 1,
        tail: str = "pad",
        initial_epoch: int = 0,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # BaseNode.__init__ is unannotated
        self.check_position(rank, world_size, batch_size)
        if tail not in TAIL_POLICIES:
            raise ValueError(f"{tail=} is not one of {TAIL_POLICIES}")
        self.rank, self.world_size, self.batch_size, self.tail = rank, world_size, batch_size, tail
        self._plans: dict[int, PlanLike] = {}
        if callable(plan) and not hasattr(plan, "epoch_order"):
            self._plan_for: Callable[[int], PlanLike] = plan
        else:
            fixed: PlanLike = plan  # type: ignore[assignment]

            def _fixed(_group_size: int) -> PlanLike:
                return fixed

            self._plan_for = _fixed
        self._epoch = initial_epoch
        self._group_size = world_size
        self._start = 0
        self._local = 0
        self._started = False
        self._pending: dict[str, Any] | None = None
        self._order: np.ndarray = np.zeros(0, dtype=np.int64)
        self._limit = 0

    def plan_for(self, group_size: int) -> PlanLike:
        """The plan grouped for ``group_size`` ranks (cached)."""
        if group_size not in self._plans:
            self._plans[group_size] = self._plan_for(group_size)
        return self._plans[group_size]

    @property
    def order(self) -> np.ndarray:
        """This epoch's pack indices by slot (as of the last ``reset``)."""
        return self._order

    def order_of(self, epoch: int, group_size: int) -> np.ndarray:
        """The serving order of ``epoch`` in the plan grouped for ``group_size``: the current
        epoch's as ``reset`` made it (0.15 s to draw again at 4.4M packs), else drawn."""
        if (epoch, group_size) == (self._epoch, self._group_size) and self._order.size:
            return self._order
        return np.asarray(self.plan_for(group_size).epoch_order(epoch), dtype=np.int64)

    def seek(self, state: dict[str, Any]) -> None:
        """Start the next ``reset(None)`` from ``state`` (used by the loader to resume)."""
        self._pending = dict(state)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is None and self._pending is not None:
            initial_state, self._pending = self._pending, None
        if initial_state is not None:
            self._restore(initial_state)
        else:
            if self._started:
                self._epoch += 1
            self._group_size, self._start, self._local = self.world_size, 0, 0
        self._started = False
        plan = self.plan_for(self._group_size)
        self._order = np.asarray(plan.epoch_order(self._epoch), dtype=np.int64)
        unit = self.world_size * self.batch_size
        total = epoch_slots(len(self._order), self._start, unit, self.tail)
        if len(self._order) == 0:
            raise ValueError("the plan has no packs: nothing to load (check the data and capacity)")
        self._limit = total // self.world_size

    def _restore(self, state: dict[str, Any]) -> None:
        point = self.resume_point(state)
        self._epoch, self._group_size = point.epoch, point.group_size
        self._start, self._local = point.start, point.local
        self._started = bool(state.get(self.STARTED_KEY, False))

    def resume_point(self, state: dict[str, Any]) -> ResumePoint:
        """Check ``state`` against this source and say where it resumes.

        Refuses another version, another plan (data, lengths or plan config) and another rank
        at the same world size. On the same layout the saved start and count are kept; on
        another world size or batch size the rest of the epoch restarts at the global cursor.
        """
        version = state.get(self.VERSION_KEY)
        if version != self.VERSION:
            raise StateMismatchError(
                f"pack source state has {version=}, this neatpack reads version {self.VERSION}"
            )
        group_size = int(state[self.GROUP_SIZE_KEY])
        self.check_plan(state, group_size)
        saved_world, saved_rank = int(state[self.WORLD_SIZE_KEY]), int(state[self.RANK_KEY])
        if saved_world == self.world_size and saved_rank != self.rank:
            raise StateMismatchError(
                f"state of rank {saved_rank} loaded into rank {self.rank} (same world size "
                f"{self.world_size}): load each rank's own state"
            )
        same_layout = saved_world == self.world_size and (
            int(state.get(self.BATCH_SIZE_KEY, self.batch_size)) == self.batch_size
        )
        if same_layout:
            start, local = int(state[self.START_KEY]), int(state[self.LOCAL_KEY])
        else:  # elastic: re-stride the rest of the epoch from the global cursor
            start, local = int(state[self.CURSOR_KEY]), 0
        return ResumePoint(int(state[self.EPOCH_KEY]), group_size, start, local)

    def check_plan(self, state: dict[str, Any], group_size: int) -> None:
        """Refuse a state saved on another plan (a subclass may accept some changes)."""
        want = self.plan_fingerprint(ResumePoint(int(state[self.EPOCH_KEY]), group_size, 0, 0))
        if state[self.FINGERPRINT_KEY] != want:
            raise StateMismatchError(
                "the saved state was taken on a different plan (the data, the lengths or the "
                f"plan config changed): saved fingerprint {state[self.FINGERPRINT_KEY]!r}, "
                f"this plan {want!r}. Resume with the same data and config, or start afresh."
            )

    def plan_fingerprint(self, point: ResumePoint) -> str:
        """The fingerprint a state at ``point`` records (the plan of its group size)."""
        return self.plan_for(point.group_size).fingerprint

    def next(self) -> PackRef:
        self._started = True
        if self._local >= self._limit:
            raise StopIteration
        slot = self._start + self._local * self.world_size + self.rank
        self._local += 1
        num_packs = len(self._order)
        pack_index = int(self._order[slot % num_packs])
        plan = self.plan_for(self._group_size)
        return {
            "epoch": self._epoch,
            "slot": slot,
            "pack_index": pack_index,
            "sample_ids": [int(i) for i in plan.pack(pack_index)],
            "padded": slot >= num_packs,
        }

    def get_state(self) -> dict[str, Any]:
        point = ResumePoint(self._epoch, self._group_size, self._start, self._local)
        return self.state_at(point, started=self._started)

    def state_at(self, point: ResumePoint, *, started: bool) -> dict[str, Any]:
        """The state this source has at ``point`` (the loader saves the trainer's position)."""
        return {
            self.VERSION_KEY: self.VERSION,
            self.FINGERPRINT_KEY: self.plan_fingerprint(point),
            self.EPOCH_KEY: point.epoch,
            self.START_KEY: point.start,
            self.LOCAL_KEY: point.local,
            self.CURSOR_KEY: point.start + point.local * self.world_size,
            self.RANK_KEY: self.rank,
            self.WORLD_SIZE_KEY: self.world_size,
            self.GROUP_SIZE_KEY: point.group_size,
            self.BATCH_SIZE_KEY: self.batch_size,
            self.TAIL_KEY: self.tail,
            self.STARTED_KEY: started,
        }

    def tail_dropped(self) -> list[int]:
        """Pack indices of this epoch's ``drop`` tail whose slots fall to this rank.

        The union over ranks is the whole dropped tail, each pack once (the loader's ledger
        counts them).
        """
        kept = self._start + self._limit * self.world_size
        slots = range(kept + self.rank, len(self._order), self.world_size)
        return [int(self._order[s]) for s in slots]
