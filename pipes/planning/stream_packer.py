"""``StreamPacker``: this rank's packs of a stream, packed online, with a buffer-exact state.

The node reads its shards of a ``StreamSource`` in order (``pipes/reading/stream.py``), gives
each record its length (the graph's estimator) and packs it with ``OnlinePacker``. It yields
the same ``PackRef`` as ``PackSource`` (``epoch``, ``slot``, ``sample_ids``, ``padded``) plus
the records themselves (``records``: the workers materialize them without reading again) and
their estimated length. Sample ids are ``sample_id(shard, position)``.

Shards: epoch ``e`` orders the shards (shuffled with ``(seed, e)`` when ``shuffle``) and rank
``r`` of ``W`` reads ``order[r::W]``, one shard after the other.

State (plain lists and ints, never records): each remaining shard of this rank with its next
position, the open packs and the packs ready to leave as ``[sample id, length]`` pairs, the
last real pack (the one the end of the epoch repeats), the overlong ids dropped so far.
``reset(state)`` reads the buffered records again by address (``source.open(shard, pos)`` from
the lowest needed position of each shard, skipping the others) and continues with exactly the
packs the uninterrupted run makes: no randomness is left to restore.

End of the epoch: the rank's shards exhausted, the buffer is flushed. Ranks read different
shards, so they run dry at different steps; a dry rank repeats its last real pack (``padded``
True, counted apart in the ledger) and ``NeatLoader`` ends the epoch at the first step where
every rank is dry (one all-reduce of a flag per step), so no rank waits on a collective the
others never reach. One rank alone pads only its last batch to ``batch_size``.

Elastic: ``merge_states(states, rank, world_size)`` combines the states of every rank of a run
into one rank's state on a new world size: every remaining shard range and every buffered
sample goes to exactly one new rank (``tests/graphs/test_stream_elastic.py``).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Sequence
from typing import Any

from torchdata.nodes import BaseNode

from neatpack.pipes.contracts import PackRef
from neatpack.pipes.errors import RecordError
from neatpack.pipes.planning.binpack import OVERLONG_POLICIES
from neatpack.pipes.planning.online import OnlinePacker
from neatpack.pipes.planning.source import PositionKeys, ResumePoint, StateMismatchError
from neatpack.pipes.reading.stream import StreamSource, address, sample_id

__all__ = ["FAILED_KEY", "StreamPacker", "merge_states", "shard_order"]

#: a record that could not be read or estimated (``on_error="skip"``) travels to the worker as
#: ``{FAILED_KEY: message}``; reading it there raises, so ``on_bad_sample`` counts it as failed
FAILED_KEY = "__neatpack_failed__"

Pairs = list[list[int]]


def _copied(pairs: Pairs) -> Pairs:
    return [[a, b] for a, b in pairs]


def shard_order(num_shards: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """The epoch's shard order (rank ``r`` of ``W`` reads ``order[r::W]``).

    >>> shard_order(4, 0, 0, False), shard_order(4, 0, 0, True) == shard_order(4, 0, 0, True)
    ([0, 1, 2, 3], True)
    """
    order = list(range(num_shards))
    if shuffle:
        random.Random(f"neatpack-stream:{seed}:{epoch}").shuffle(order)
    return order


class StreamPacker(PositionKeys, BaseNode[PackRef]):
    """This rank's pack references of a stream (module docstring).

    ``load(raw, sample_id) -> record`` converts a raw record (the graph's ``to_record``);
    ``length(record) -> int`` is its planned length (the graph's estimator, aligned for context
    parallelism). Either may raise ``RecordError``: ``on_error="raise"`` lets it through,
    ``"skip"`` packs the sample with length 0 and lets the worker fail it (counted).
    ``overlong``: a sample longer than ``capacity`` raises naming it, or is dropped (listed in
    the state's ``overlong`` and the ledger).
    """

    ELASTIC = True  # its whole state is the position the loader saves (state_dict()["source"])
    STREAM_KEY = "stream"
    SHARDS_KEY = "shards"
    OPEN_KEY = "open"
    READY_KEY = "ready"
    CARRY_KEY = "carry"
    LAST_KEY = "last"
    DRY_KEY = "dry"
    OVERLONG_KEY = "overlong"

    def __init__(
        self,
        source: StreamSource,
        *,
        load: Callable[[Any, int], Any],
        length: Callable[[Any], int],
        capacity: int,
        buffer_size: int,
        rank: int,
        world_size: int,
        batch_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        overlong: str = "raise",
        on_error: str = "raise",
        fingerprint: str | None = None,
        initial_epoch: int = 0,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # BaseNode.__init__ is unannotated
        self.check_position(rank, world_size, batch_size)
        if overlong not in OVERLONG_POLICIES:
            raise ValueError(f"{overlong=} is not one of {OVERLONG_POLICIES}")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"{on_error=} is not one of ('raise', 'skip')")
        self.source, self.load, self.length = source, load, length
        self.num_shards = len(source.shards())
        if self.num_shards < world_size:
            raise ValueError(
                f"the stream {type(source).__name__} has {self.num_shards} shard(s) for "
                f"{world_size} ranks: every rank reads whole shards, so each sample can be "
                "delivered exactly once only with at least one shard per rank. Split the data "
                "into at least world_size shards (more shards also spread better)"
            )
        OnlinePacker(capacity, buffer_size)  # checks both
        self.capacity, self.buffer_size = capacity, buffer_size
        self.rank, self.world_size, self.batch_size = rank, world_size, batch_size
        self.tail = "pad"
        self.seed, self.shuffle, self.overlong, self.on_error = seed, shuffle, overlong, on_error
        self.fingerprint = fingerprint if fingerprint is not None else source.fingerprint()
        self._epoch = initial_epoch
        self._started = False
        self._pending: dict[str, Any] | None = None
        self._records: dict[int, Any] = {}
        self._lengths: dict[int, int] = {}
        self._iter: Any = None
        self._restore(self.fresh_state(initial_epoch))

    # -- state ------------------------------------------------------------------------------
    def fresh_state(self, epoch: int) -> dict[str, Any]:
        """The state at the start of ``epoch`` on this rank."""
        mine = shard_order(self.num_shards, epoch, self.seed, self.shuffle)[
            self.rank :: self.world_size
        ]
        return self._state(epoch, 0, [[s, 0] for s in mine], [], [], [], None, False, [], False)

    def _state(
        self,
        epoch: int,
        local: int,
        shards: Pairs,
        open_packs: list[Pairs],
        ready: list[Pairs],
        carry: Pairs,
        last: Pairs | None,
        dry: bool,
        overlong: list[int],
        started: bool,
    ) -> dict[str, Any]:
        return {
            self.VERSION_KEY: self.VERSION,
            self.FINGERPRINT_KEY: self.fingerprint,
            self.EPOCH_KEY: epoch,
            self.START_KEY: 0,
            self.LOCAL_KEY: local,
            self.CURSOR_KEY: local * self.world_size,
            self.RANK_KEY: self.rank,
            self.WORLD_SIZE_KEY: self.world_size,
            self.GROUP_SIZE_KEY: self.world_size,
            self.BATCH_SIZE_KEY: self.batch_size,
            self.TAIL_KEY: self.tail,
            self.STARTED_KEY: started,
            self.STREAM_KEY: {  # fresh lists (never aliased), without deepcopy's cost
                self.SHARDS_KEY: _copied(shards),
                self.OPEN_KEY: open_packs,  # OnlinePacker.state(): fresh lists already
                self.READY_KEY: [_copied(p) for p in ready],
                self.CARRY_KEY: _copied(carry),
                self.LAST_KEY: None if last is None else _copied(last),
                self.DRY_KEY: dry,
                self.OVERLONG_KEY: list(overlong),
            },
        }

    def get_state(self) -> dict[str, Any]:
        return self._state(
            self._epoch, self._local, self._shards, self._packer.state(), self._ready,
            self._carry, self._last, self._dry, self._overlong, self._started,
        )  # fmt: skip

    def check_state(self, state: dict[str, Any]) -> None:
        """Refuse a state of another version or another stream (data, estimator, capacity)."""
        version = state.get(self.VERSION_KEY)
        if version != self.VERSION or self.STREAM_KEY not in state:
            raise StateMismatchError(
                f"stream state has {version=} and keys {sorted(state)}: this neatpack reads "
                f"version {self.VERSION} of a streaming graph's state (a planned graph's state "
                "cannot resume a stream)"
            )
        if state[self.FINGERPRINT_KEY] != self.fingerprint:
            raise StateMismatchError(
                "the saved stream state was taken on other data or another length estimate: "
                f"saved fingerprint {state[self.FINGERPRINT_KEY]!r}, this stream "
                f"{self.fingerprint!r}. Resume with the same source, processor and config"
            )

    def resume_state(self, states: dict[str, Any] | Sequence[dict[str, Any]]) -> dict[str, Any]:
        """This rank's state from a saved state (the same world size: its own) or from every
        rank's saved states (any world size: ``merge_states``)."""
        many = list(states) if not isinstance(states, dict) else [states]
        for s in many:
            self.check_state(s)
        saved_world = int(many[0][self.WORLD_SIZE_KEY])
        if saved_world == self.world_size:
            own = [s for s in many if int(s[self.RANK_KEY]) == self.rank]
            if not own:
                raise StateMismatchError(
                    f"state of rank {int(many[0][self.RANK_KEY])} loaded into rank {self.rank} "
                    f"(same world size {self.world_size}): load each rank's own state, or the "
                    "list of every rank's state"
                )
            if int(own[0][self.BATCH_SIZE_KEY]) == self.batch_size:
                return copy.deepcopy(own[0])
        if len(many) == 1 and saved_world > 1:
            raise StateMismatchError(
                f"a stream saved on {saved_world} ranks resumes on {self.world_size} ranks only "
                "from every rank's state: each rank buffered and read its own samples. Pass the "
                "list of all saved ranks' states (loader.load_state_dict([state_0, state_1, "
                "...]))"
            )
        return merge_states(many, rank=self.rank, world_size=self.world_size,
                            batch_size=self.batch_size)  # fmt: skip

    def state_at(
        self, point: ResumePoint, *, started: bool, at: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The state at the trainer's position: ``at`` (the state found in the graph at the
        last batch handed out) when it is of ``point``'s epoch, else a new epoch's start."""
        if at is not None and int(at[self.EPOCH_KEY]) == point.epoch:
            out = copy.deepcopy(at)
        else:
            out = self.fresh_state(point.epoch)
        out[self.STARTED_KEY] = started
        return out

    def seek(self, state: dict[str, Any]) -> None:
        """Start the next ``reset(None)`` from ``state`` (used by the loader to resume)."""
        self._pending = copy.deepcopy(state)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is None and self._pending is not None:
            initial_state, self._pending = self._pending, None
        if initial_state is not None:
            self.check_state(initial_state)
            self._restore(initial_state)
        else:
            self._restore(self.fresh_state(self._epoch + 1 if self._started else self._epoch))

    def _restore(self, state: dict[str, Any]) -> None:
        s = state[self.STREAM_KEY]
        self._epoch, self._local = int(state[self.EPOCH_KEY]), int(state[self.LOCAL_KEY])
        self._started = bool(state.get(self.STARTED_KEY, False))
        self._shards: Pairs = [[int(a), int(b)] for a, b in s[self.SHARDS_KEY]]
        self._packer = OnlinePacker(self.capacity, self.buffer_size, state=s[self.OPEN_KEY])
        self._ready: list[Pairs] = [[[int(a), int(b)] for a, b in p] for p in s[self.READY_KEY]]
        self._carry: Pairs = [[int(a), int(b)] for a, b in s[self.CARRY_KEY]]
        last = s[self.LAST_KEY]
        self._last: Pairs | None = None if last is None else [[int(a), int(b)] for a, b in last]
        self._dry = bool(s[self.DRY_KEY])
        self._overlong = [int(i) for i in s[self.OVERLONG_KEY]]
        self._iter = None
        held = [*s[self.OPEN_KEY], *self._ready, self._carry, self._last or []]
        saved = {int(sid): int(n) for pack in held for sid, n in pack}
        self._records = self._read_again(set(saved))
        for sid, n in saved.items():
            if n == 0:  # a record whose estimate failed (on_error="skip") fails again, marked
                self._length(self._records[sid], sid)
        self._lengths = {sid: n for pack in s[self.OPEN_KEY] for sid, n in pack}

    def _read_again(self, needed: set[int]) -> dict[int, Any]:
        """The records of ``needed`` ids, read again by address: one pass per shard from the
        lowest needed position to the highest, the records between skipped."""
        by_shard: dict[int, list[int]] = {}
        for sid in needed:
            shard, pos = address(sid)
            by_shard.setdefault(shard, []).append(pos)
        out: dict[int, Any] = {}
        for shard, positions in sorted(by_shard.items()):
            lo, hi = min(positions), max(positions)
            want = set(positions)
            pos = lo
            for raw in self.source.open(shard, lo):
                if pos in want:
                    sid = sample_id(shard, pos)
                    out[sid] = self._load(raw, sid)
                if pos >= hi:
                    break
                pos += 1
            missing = sorted(want - {address(i)[1] for i in out if address(i)[0] == shard})
            if missing:
                raise StateMismatchError(
                    f"shard {shard} of the stream ended before positions {missing[:5]} that the "
                    "saved state buffered: the data changed since the state was saved"
                )
        return out

    # -- reading and packing ----------------------------------------------------------------
    def _load(self, raw: Any, sid: int) -> Any:
        try:
            return self.load(raw, sid)
        except RecordError as exc:
            if self.on_error == "raise":
                raise
            return {FAILED_KEY: str(exc)[:500], "sample_id": sid}

    def _length(self, record: Any, sid: int) -> int:
        if isinstance(record, dict) and FAILED_KEY in record:
            return 0
        try:
            return int(self.length(record))
        except RecordError as exc:
            if self.on_error == "raise":
                raise
            record.clear()
            record.update({FAILED_KEY: str(exc)[:500], "sample_id": sid})
            return 0

    def _read_one(self) -> bool:
        """Read the next record of this rank's shards into the packer; False when none is left."""
        while self._shards:
            shard, pos = self._shards[0]
            if self._iter is None:
                self._iter = iter(self.source.open(shard, pos))
            try:
                raw = next(self._iter)
            except StopIteration:
                self._shards.pop(0)
                self._iter = None
                continue
            self._shards[0][1] = pos + 1
            sid = sample_id(shard, pos)
            record = self._load(raw, sid)
            n = self._length(record, sid)
            if n > self.capacity:
                if self.overlong == "raise":
                    raise ValueError(
                        f"sample {sid} (shard {shard}, position {pos}) is {n} tokens, longer "
                        f"than the pack ({self.capacity}): raise pack_size, or pass "
                        "overlong='drop' to leave such samples out (listed in the ledger)"
                    )
                self._overlong.append(sid)
                return True
            self._records[sid] = record
            self._lengths[sid] = n
            self._ready.extend(self._pairs(p) for p in self._packer.add(sid, n))
            return True
        return False

    def _pairs(self, ids: list[int]) -> Pairs:
        return [[sid, self._lengths[sid]] for sid in ids]

    def next(self) -> PackRef:
        self._started = True
        while not self._ready:
            if self._carry:
                sid, n = self._carry.pop(0)
                self._lengths[sid] = n
                self._ready.extend(self._pairs(p) for p in self._packer.add(sid, n))
            elif self._read_one():
                continue
            elif not self._dry:
                self._ready.extend(self._pairs(p) for p in self._packer.flush())
                self._dry = True
            else:
                return self._pad()
        pack = self._ready.pop(0)
        ref = self._ref(pack, padded=False)
        self._forget(self._last, keep=pack)
        self._last = pack  # kept (records too) for a dry rank's repeats at the epoch's end
        return ref

    def _pad(self) -> PackRef:
        if self.world_size == 1 and self._local % self.batch_size == 0:
            raise StopIteration
        if self._last is None:
            self._last = self._stand_in()
        return self._ref(self._last, padded=True)

    def _stand_in(self) -> Pairs:
        """A pack for a rank that had none this epoch to repeat (its shards empty, or given
        nothing after a resize): the stream's first sample that fits, in shard order. A repeat
        of real tokens, not an empty row: an all-padding row has no label to average over."""
        for shard in range(self.num_shards):
            for pos, raw in enumerate(self.source.open(shard, 0)):
                sid = sample_id(shard, pos)
                record = self._load(raw, sid)
                n = self._length(record, sid)
                if (isinstance(record, dict) and FAILED_KEY in record) or n > self.capacity:
                    continue
                self._records[sid] = record
                return [[sid, n]]
        raise RuntimeError(
            f"rank {self.rank} has no pack to repeat at the end of epoch {self._epoch} and the "
            "stream has no sample that fits a pack (every one is empty, failed or overlong)"
        )

    def _ref(self, pack: Pairs, *, padded: bool) -> PackRef:
        slot = self._local * self.world_size + self.rank
        self._local += 1
        ids = [sid for sid, _ in pack]
        ref: dict[str, Any] = {
            "epoch": self._epoch,
            "slot": slot,
            "pack_index": slot,
            "sample_ids": ids,
            "padded": padded,
            "records": [self._records[sid] for sid in ids],
            "estimated_tokens": sum(n for _, n in pack),
        }
        return ref  # type: ignore[return-value]  # a PackRef plus the stream's two keys

    def _forget(self, pack: Pairs | None, *, keep: Pairs) -> None:
        """Drop the records of ``pack`` (the previous repeat, now sent on): a record lives from
        its read until its pack leaves, so the rank holds the buffer's records and one pack's,
        not a multiple of the buffer (decoded pixels included: 5.4 GB at buffer 1,000 on the
        bench_stream images while records stayed until the buffer's double)."""
        kept = {sid for sid, _ in keep}
        for sid, _ in pack or ():
            if sid not in kept:
                self._records.pop(sid, None)
                self._lengths.pop(sid, None)


def merge_states(
    states: Sequence[dict[str, Any]], *, rank: int, world_size: int, batch_size: int
) -> dict[str, Any]:
    """Rank ``rank`` of ``world_size``'s state from the states of every rank of a run (the same
    epoch): the remaining shard ranges, sorted by shard, go to the new ranks in turn; a
    buffered sample goes with its shard (to ``shard % world_size`` when its shard is read to
    the end); nothing is lost or read twice. Refuses an incomplete set of states by name."""
    K = StreamPacker
    old_world = int(states[0][K.WORLD_SIZE_KEY])
    ranks = sorted(int(s[K.RANK_KEY]) for s in states)
    if ranks != list(range(old_world)) or any(
        int(s[K.WORLD_SIZE_KEY]) != old_world for s in states
    ):
        raise StateMismatchError(
            f"elastic resume of a stream needs the state of every rank of the saved run, each "
            f"once: got ranks {ranks} of world sizes "
            f"{sorted({int(s[K.WORLD_SIZE_KEY]) for s in states})}, expected ranks "
            f"0..{old_world - 1}. Pass every rank's loader.state_dict() from the same step"
        )
    epochs = {int(s[K.EPOCH_KEY]) for s in states}
    if len(epochs) != 1:
        raise StateMismatchError(
            f"the ranks' states are of different epochs {sorted(epochs)}: save every rank at the "
            "same step"
        )
    entries = sorted(
        ([int(a), int(b)] for s in states for a, b in s[K.STREAM_KEY][K.SHARDS_KEY]),
        key=lambda e: e[0],
    )
    owner = {shard: j % world_size for j, (shard, _) in enumerate(entries)}
    samples: list[list[int]] = []
    for s in states:
        st = s[K.STREAM_KEY]
        for pack in (*st[K.OPEN_KEY], *st[K.READY_KEY], st[K.CARRY_KEY]):
            samples.extend([int(a), int(b)] for a, b in pack)
    samples.sort()

    def new_rank(sid: int) -> int:
        shard = address(sid)[0]
        return owner.get(shard, shard % world_size)

    last = next(
        (s[K.STREAM_KEY][K.LAST_KEY] for s in sorted(states, key=lambda s: s[K.RANK_KEY])
         if int(s[K.RANK_KEY]) == rank % old_world and s[K.STREAM_KEY][K.LAST_KEY]),
        next((s[K.STREAM_KEY][K.LAST_KEY] for s in states if s[K.STREAM_KEY][K.LAST_KEY]), None),
    )  # fmt: skip
    local = max(int(s[K.LOCAL_KEY]) for s in states)
    first = states[0]
    return {
        K.VERSION_KEY: K.VERSION,
        K.FINGERPRINT_KEY: first[K.FINGERPRINT_KEY],
        K.EPOCH_KEY: epochs.pop(),
        K.START_KEY: 0,
        K.LOCAL_KEY: local,
        K.CURSOR_KEY: local * world_size,
        K.RANK_KEY: rank,
        K.WORLD_SIZE_KEY: world_size,
        K.GROUP_SIZE_KEY: world_size,
        K.BATCH_SIZE_KEY: batch_size,
        K.TAIL_KEY: "pad",
        K.STARTED_KEY: True,
        K.STREAM_KEY: {
            K.SHARDS_KEY: [e for e in entries if owner[e[0]] == rank],
            K.OPEN_KEY: [],
            K.READY_KEY: [],
            K.CARRY_KEY: [p for p in samples if new_rank(p[0]) == rank],
            K.LAST_KEY: copy.deepcopy(last),
            K.DRY_KEY: False,
            # listed once, on the new rank 0 (the union over ranks names each once)
            K.OVERLONG_KEY: sorted(int(i) for s in states for i in s[K.STREAM_KEY][K.OVERLONG_KEY])
            if rank == 0
            else [],
        },
    }
