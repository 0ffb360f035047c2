"""The checkpointable loader: iterate batches, save a tiny state, resume anywhere, any world size.

A ``NeatLoader`` owns a graph whose first node is a
:class:`~neatpack.pipes.planning.source.PackSource`.
Its state is the position of the *trainer*, not of the pipeline: the epoch and how many batches
this rank has handed out. Everything in flight (packs being built in workers, prefetched
batches) is a pure function of that position, so it is dropped and rebuilt on resume, never
saved. Resume costs the same at 0 % and at 95 % of an epoch: nothing is replayed.

    loader = neat_vlm_graph(data, processor, config=NeatVLMConfig(pack_size=4096))
    for batch in loader:                       # one epoch
        step(batch)
        if want_checkpoint:
            torch.save(loader.state_dict(), "loader.pt")   # a few ints
    ...
    loader = neat_vlm_graph(...)               # after a crash, on any number of ranks
    loader.load_state_dict(torch.load("loader.pt", weights_only=True))
    for batch in loader: ...                   # the rest of that epoch, exactly

Epochs: each ``iter(loader)`` runs one epoch. After ``load_state_dict`` the next ``iter`` continues
the saved epoch (a state saved inside the loop after the epoch's last batch continues with an
empty remainder; a state saved after the loop continues with the next epoch), so a trainer that
reads ``loader.epoch`` never gains or loses an epoch. A new ``iter(loader)`` ends the previous
iterator (it yields nothing more): one graph serves one epoch iterator at a time.

A stream (``neat_stream_graph``: a ``StreamPacker`` instead of a ``PackSource``) has no plan:
its position is the packer's state at the last batch handed out (the shards' positions and the
buffer's addresses, found in the graph's state), a resume on another world size takes every
rank's state (``load_state_dict([...])``), and its ranks end an epoch together when all of
them have run dry (one all-reduce of a flag per step).

Leaving a loader: ``break``, an exception, dropping the loader or the iterator, ``Ctrl-C`` and
interpreter exit all stop the graph's background threads (prefetch, pin memory, mapper
threads) and worker processes, so a script ends cleanly however it leaves. ``loader.close()``
(or ``with neat_vlm_graph(...) as loader:``) does it now and waits for the batch in flight.
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from neatpack.graphs.runtime.data_metrics import DataWindow
from neatpack.graphs.runtime.graph_state import graph_signature, source_state, stateful_nodes
from neatpack.graphs.runtime.step_cost import StepCost
from neatpack.graphs.runtime.watchdog import (
    STOP_TIMEOUT_S,
    WorkerWatchdog,
    shutdown_at_exit,
    stop_graph,
)
from neatpack.pipes.contracts import Batch
from neatpack.pipes.planning.source import (
    PackRef,
    PackSource,
    ResumePoint,
    StateMismatchError,
    epoch_slots,
)
from neatpack.pipes.planning.stream_packer import StreamPacker

__all__ = [
    "BookkeepingError",
    "EpochLedger",
    "LoaderStats",
    "NeatLoader",
    "StateMismatchError",
    "describe_data",
]

ESTIMATE_WINDOW = 65536
META_KEYS = ("epoch", "slot", "sample_ids", "padded")


class BookkeepingError(ValueError):
    """A batch lacks what the loader counts packs with (``batch["packs"]``)."""


@dataclass
class EpochLedger:
    """Sample ids of one epoch on this rank, by outcome. Ids are stable indices into the source."""

    consumed: list[int] = field(default_factory=list)
    padded: list[int] = field(default_factory=list)  # repeated to fill the last step (tail="pad")
    tail_dropped: list[int] = field(default_factory=list)  # cut to keep ranks even (tail="drop")
    dropped: list[int] = field(default_factory=list)  # removed by the overflow policy
    truncated: list[int] = field(default_factory=list)  # consumed, but cut to fit the pack
    failed: list[int] = field(default_factory=list)  # failed to load; skipped or replaced
    replacements: list[int] = field(default_factory=list)  # ids that stood in for failed ones
    # left out by the plan: longer than the pack (overlong="drop"); listed on rank 0 only, so
    # the union over ranks names each once
    overlong: list[int] = field(default_factory=list)
    # in packs that a node of the graph (a user filter) took out between source and trainer
    filtered: list[int] = field(default_factory=list)


@dataclass
class LoaderStats:
    """Running figures, readable at any time (``NeatLoader.data_metrics()`` logs their change
    between two reads)."""

    batches: int = 0
    packs: int = 0
    real_tokens: int = 0
    pack_tokens: int = 0  # packs x pack size
    # real / estimated per pack, the most recent ESTIMATE_WINDOW packs (bounded over long runs)
    estimate_ratio: deque[float] = field(default_factory=lambda: deque(maxlen=ESTIMATE_WINDOW))
    estimated_packs: int = 0  # packs that had an estimate (all of them, not only the window)
    wait_s: float = 0.0  # seconds the trainer's next() blocked on the graph
    source_tokens: dict[str, int] = field(default_factory=dict)  # mixtures: real tokens by source
    # per step cost column (step_cost.STEP_COLUMNS): sums over the steps costed so far of the
    # slowest rank's load and of the mean rank's load (packed graphs; their ratio is the
    # share of time a step waits for its slowest rank)
    step_peak: dict[str, float] = field(default_factory=dict)
    step_mean: dict[str, float] = field(default_factory=dict)

    def add_pack(
        self,
        *,
        real: int,
        capacity: int,
        estimated: float | None,
        sources: dict[str, int] | None = None,
    ) -> None:
        """Count one pack handed out: its real tokens, its pack size, its length estimate and
        (mixtures) its real tokens per source."""
        self.packs += 1
        self.pack_tokens += capacity
        self.real_tokens += real
        if estimated:
            self.estimate_ratio.append(real / float(estimated))
            self.estimated_packs += 1
        for name, tokens in (sources or {}).items():
            self.source_tokens[name] = self.source_tokens.get(name, 0) + int(tokens)

    def add_step(self, loads: dict[str, tuple[float, float]]) -> None:
        """Count one step's (slowest rank, mean rank) load per cost column."""
        for name, (peak, mean) in loads.items():
            self.step_peak[name] = self.step_peak.get(name, 0.0) + peak
            self.step_mean[name] = self.step_mean.get(name, 0.0) + mean

    def step_imbalance(self) -> dict[str, float]:
        """Per cost column, the slowest ranks' summed load over the mean ranks' (1.0: even)."""
        return {
            name: self.step_peak[name] / mean if mean > 0 else 1.0
            for name, mean in self.step_mean.items()
        }

    def utilization(self) -> float:
        """Real tokens / (packs x pack size): the fraction of each GPU step that trains."""
        return self.real_tokens / self.pack_tokens if self.pack_tokens else 0.0

    def estimate_error(self) -> dict[str, float]:
        """p50 and p99 of |real / estimated - 1| over the last ``ESTIMATE_WINDOW`` packs."""
        if not self.estimate_ratio:
            return {"p50": 0.0, "p99": 0.0}
        err = np.abs(np.asarray(self.estimate_ratio) - 1.0)
        return {"p50": float(np.percentile(err, 50)), "p99": float(np.percentile(err, 99))}


class NeatLoader:
    """Batches for one rank, with ``state_dict`` / ``load_state_dict`` and an optional ledger.

    ``build(source)`` returns the rest of the graph (materialize, batch, collate, prefetch)
    reading from ``source``. Each batch must carry ``batch["packs"]``: one dict per row with
    the pack reference fields (``epoch``, ``slot``, ``sample_ids``, ``padded``) and, when the
    materialize step reports them, ``report`` (dropped / truncated / replaced ids),
    ``real_tokens`` and ``estimated_tokens`` (``neatpack.pipes.Collater`` does this); a batch
    without them is a ``BookkeepingError``.

    The state is the trainer's position plus the whole graph's torchdata state at the last
    batch handed out, so nodes of your own with state (a filter's counters, an augmentation's
    RNG) resume with it. On another world size, batch size or graph shape (a worker stage
    inline instead of in workers) only the position carries over: nodes with state of their
    own are then refused by name, unless their class sets ``ELASTIC = True`` (its state may
    restart empty). Packs a node drops are counted in the ledger (``filtered``) by id.
    """

    VERSION = 1

    def __init__(
        self,
        source: PackSource | StreamPacker,
        build: Callable[[BaseNode[PackRef]], BaseNode[Batch]],
        *,
        pack_size: int,
        config: dict[str, Any] | None = None,
        keep_ledger: bool = True,
        ledger_epochs: int | None = None,
        initial_epoch: int = 0,
        data: dict[str, str] | None = None,
        step_cost: StepCost | None = None,
    ) -> None:
        if ledger_epochs is not None and ledger_epochs < 1:
            raise ValueError(f"{ledger_epochs=} must be >= 1 (None keeps every epoch's ledger)")
        self.source = source
        self.root = build(source)
        self._watchdog = WorkerWatchdog(self.root)
        shutdown_at_exit(self.root)
        self.pack_size = pack_size
        self.config = dict(config or {})
        # which data this is ({"source", "fingerprint"}: describe_data), saved with the state
        # so that a resume on changed data says so (outside the config fingerprint: states
        # saved before it existed still load)
        self.data = None if data is None else {str(k): str(v) for k, v in data.items()}
        self.config_fingerprint = hashlib.sha256(
            json.dumps(self.config, sort_keys=True, default=str).encode()
        ).hexdigest()[:16]
        self.keep_ledger = keep_ledger
        # Each epoch's ledger holds every id of the epoch on this rank (8 bytes+ per id in a
        # list): keeping the last few bounds the memory of a long multi-epoch run.
        self.ledger_epochs = ledger_epochs
        self.ledgers: dict[int, EpochLedger] = {}
        self.stats = LoaderStats()
        self.step_cost = step_cost  # each step's cost per rank, from the plan (step_cost.py)
        self._orders: tuple[Any, int, np.ndarray] | None = None  # (plan, epoch, epoch order)
        self._window = DataWindow()  # data_metrics(): the stats at its last call
        self._lock = threading.Lock()
        # Position of the trainer: epoch, where this epoch (re)started, packs taken since.
        self._position: dict[str, Any] = {"epoch": initial_epoch, "start": 0, "local": 0}
        self._group_size = source.world_size
        # a stream's position is its packer's state at the last batch handed out (found in
        # the graph's state), not a function of the pack count
        self._stream_at: dict[str, Any] | None = None
        self._side_group: Any = None
        self._continue = True  # next iter() continues _position instead of a new epoch
        # The whole graph's state at the last batch handed out ("finished": the epoch ended)
        # and the state a load_state_dict asked the next iter() to start from.
        self._graph: dict[str, Any] | None = None
        self._filtered_packs = 0  # packs of this epoch that a node dropped on this rank
        self._resume_graph: dict[str, Any] | None = None
        self._signature = graph_signature(self.root)
        self._active: weakref.ref[Iterator[Batch]] | None = None  # the running epoch iterator
        # Dropping the loader stops its threads (an iterator that was never advanced has none
        # of the generator's own cleanup); interpreter exit is shutdown_at_exit's job.
        self._finalizer = weakref.finalize(self, stop_graph, self.root, 0.0)
        self._finalizer.atexit = False

    def __enter__(self) -> NeatLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the running epoch's iterator, the graph's background threads and its worker
        processes, waiting for the batch in flight (at most ``STOP_TIMEOUT_S`` s). Like a
        ``break``: ``state_dict()`` still gives the position, and the next ``iter(loader)``
        starts the graph again. Idempotent; ``with loader:`` calls it on leaving the block.
        """
        active = self._active() if self._active is not None else None
        if active is not None and hasattr(active, "close"):
            active.close()
        self._active = None
        stop_graph(self.root, STOP_TIMEOUT_S)

    def __len__(self) -> int:
        """Batches in a whole epoch on this rank (the same on every rank; for progress bars)."""
        src = self.source
        if isinstance(src, StreamPacker):
            raise TypeError(
                "a streaming loader has no length: its epoch ends when its shards run out "
                "(count steps in the trainer, or use a planned graph to know the epoch's length)"
            )
        unit: int = src.world_size * src.batch_size
        slots: int = epoch_slots(len(src.plan_for(src.world_size)), 0, unit, src.tail)
        return slots // unit

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to (or the one in progress)."""
        return int(self._position["epoch"])

    def __iter__(self) -> Iterator[Batch]:
        # A new iter() ends the previous epoch iterator now, like close(): left open, it would
        # stop this new epoch's threads from its ``finally`` whenever it is dropped later
        # (``it = iter(loader)`` twice: the second iterator then ends at once).
        previous = self._active() if self._active is not None else None
        if previous is not None and hasattr(previous, "close"):
            previous.close()
        self._active = None
        started = time.perf_counter()
        if not self._continue:
            self._position = {"epoch": self.epoch + 1, "start": 0, "local": 0}
            self._group_size = self.source.world_size
            self._filtered_packs = 0
        self._continue = False
        # A previous iterator's threads may still be building a batch from the same nodes:
        # they must be gone before reset() starts new ones on the same source.
        stop_graph(self.root, STOP_TIMEOUT_S)
        resume, self._resume_graph = self._resume_graph, None
        if resume is not None:
            self.root.reset(copy.deepcopy(resume["state"]))
        if resume is None or resume["finished"]:
            self.source.seek(self._source_state(started=False))
            self.root.reset()
        with self._lock:
            self._graph = {"state": self.root.state_dict(), "finished": False}
        self._record_tail()
        with self._lock:  # starting the epoch (workers, reset) blocks the trainer like a batch
            if self._window.started is None:
                self._window.started = started
            self.stats.wait_s += time.perf_counter() - started
        batches = self._batches()
        self._active = weakref.ref(batches)
        return batches

    def _batches(self) -> Iterator[Batch]:
        self._watchdog.start()
        try:
            while True:
                asked = time.perf_counter()
                try:
                    batch = next(self.root)
                except StopIteration:
                    with self._lock:
                        self.stats.wait_s += time.perf_counter() - asked
                        graph = self.root.state_dict()
                        self._account_filtered(source_state(graph), set())
                        self._graph = {"state": graph, "finished": True}
                        self._end_epoch()
                    return
                waited = time.perf_counter() - asked
                if not self._any_rank_has_data(batch):  # a stream's epoch ends on every rank
                    with self._lock:
                        self.stats.wait_s += waited
                        graph = self.root.state_dict()
                        self._account_filtered(source_state(graph), set())
                        self._graph = {"state": graph, "finished": True}
                        self._end_epoch()
                    return
                with self._lock:
                    self.stats.wait_s += waited
                    graph = self.root.state_dict()
                    self._account(batch, source_state(graph))
                    self._graph = {"state": graph, "finished": False}
                yield batch
        finally:
            # break, an exception, Ctrl-C, the iterator dropped: tell the graph's threads to
            # stop now without waiting for the batch in flight (interpreter exit, close() and
            # the next iter() wait for them).
            self._watchdog.stop()
            stop_graph(self.root, 0.0)

    def _cost_step(self, step_cost: StepCost, packs: list[dict[str, Any]]) -> None:
        """Record the cost of the step this batch is part of, on every rank (from the plan)."""
        if not isinstance(self.source, PackSource):
            return  # a stream has no plan: the other ranks' packs are unknown here
        plan = self.source.plan_for(self._group_size)
        epoch = int(packs[0]["epoch"])
        if self._orders is None or self._orders[0] is not plan or self._orders[1] != epoch:
            self._orders = (plan, epoch, self.source.order_of(epoch, self._group_size))
        slots = [int(m["slot"]) for m in packs]
        self.stats.add_step(
            step_cost.step_loads(
                plan, self._orders[2], slots=slots, rank=self.source.rank,
                world_size=self.source.world_size,
            )
        )  # fmt: skip

    def _end_epoch(self) -> None:
        self._position = {"epoch": self.epoch + 1, "start": 0, "local": 0}
        self._group_size = self.source.world_size
        self._continue = True
        self._filtered_packs = 0

    def _any_rank_has_data(self, batch: Batch) -> bool:
        """A stream over several ranks: whether any rank's batch holds a real pack (one
        all-reduce of a flag per step on a gloo side group). Ranks read different shards and
        run dry at different steps; a dry rank repeats its last pack (``padded``) until every
        rank is dry, and then the epoch ends on all of them at the same step."""
        src = self.source
        if not isinstance(src, StreamPacker) or src.world_size == 1:
            return True
        real = any(not m.get("padded") for m in _bookkeeping(batch))
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"rank {src.rank} of {src.world_size} of a stream: the ranks run dry at "
                "different steps and only together know when the epoch ends (one all-reduce "
                "per step): initialize torch.distributed before iterating a streaming loader "
                "over several ranks (or use world_size=1)"
            )
        if self._side_group is None:
            from neatpack.pipes.indexing.index_split import side_group

            self._side_group = side_group()
        flag = torch.tensor([1 if real else 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._side_group)
        return bool(flag.item())

    def data_metrics(self) -> dict[str, float]:
        """The data figures since the previous call (or the first ``iter()``), for a trainer's
        logger: ``data/wait_s`` (seconds ``next()`` on this loader's iterator blocked on the
        graph), ``data/wait_fraction``, ``data/batches``, ``data/fill``,
        ``data/estimate_error_p50`` / ``_p99``, for the packed graphs
        ``data/step_imbalance/<column>`` (attention, vision, step: how much longer the window's
        steps took on their slowest rank than on even ranks, from the plan) and, for mixtures,
        ``data/tokens/<source>``.
        Plain floats, a flat dict; each call starts a new window
        (``graphs/runtime/data_metrics.py``).
        """
        with self._lock:
            figures: dict[str, float] = self._window.take(self.stats, time.perf_counter())
        return figures

    def _account(self, batch: Batch, at: dict[str, Any] | None) -> None:
        packs = _bookkeeping(batch)
        if at is None:  # the graph state does not say where the source is: count packs
            self._position["local"] += len(packs)
        else:
            self._account_filtered(at, {int(m["slot"]) for m in packs})
        self.stats.batches += 1
        if self.step_cost is not None and packs:
            self._cost_step(self.step_cost, packs)
        ledger = self._ledger() if self.keep_ledger else None
        for meta in packs:
            self.stats.add_pack(
                real=int(meta.get("real_tokens", 0)),
                capacity=self.pack_size,
                estimated=meta.get("estimated_tokens"),
                sources=meta.get("source_tokens"),
            )
            if ledger is None:
                continue
            report = meta.get("report") or {}
            replaced = [(int(a), int(b)) for a, b in report.get("replaced", [])]
            failed = {int(i) for key in ("failed", "skipped") for i in report.get(key, [])}
            failed |= {a for a, _ in replaced}
            dropped = {int(i) for i in report.get("dropped", [])} - failed
            kept = [int(i) for i in meta["sample_ids"] if int(i) not in failed | dropped]
            if meta.get("padded"):  # a repeat that fills the last step: counted once, here
                ledger.padded.extend(kept)
                continue
            ledger.consumed.extend(kept)
            ledger.dropped.extend(sorted(dropped))
            ledger.failed.extend(sorted(failed))
            ledger.replacements.extend(b for _, b in replaced)
            ledger.truncated.extend(int(i) for i in report.get("truncated", []))

    def _account_filtered(self, at: dict[str, Any] | None, delivered: set[int]) -> None:
        """Move the position to the source's (``at``); the slots it yielded since the last
        batch that no batch carries were dropped by a node: their ids go to ``filtered``."""
        if at is None or int(at[PackSource.EPOCH_KEY]) != self.epoch:
            return
        if isinstance(self.source, StreamPacker):
            self._stream_at = copy.deepcopy(at)
            self._position["local"] = int(at[PackSource.LOCAL_KEY])
            if self.keep_ledger:  # the overlong samples dropped so far in this epoch
                stream = at[StreamPacker.STREAM_KEY]
                self._ledger().overlong = [int(i) for i in stream[StreamPacker.OVERLONG_KEY]]
            return
        start, before = int(self._position["start"]), int(self._position["local"])
        after = int(at[PackSource.LOCAL_KEY])
        self._position["local"] = max(before, after)
        if not self.keep_ledger or after <= before:
            return
        plan = self.source.plan_for(self._group_size)
        order = self.source.order
        ledger = self._ledger()
        for local in range(before, after):
            slot = start + local * self.source.world_size + self.source.rank
            if slot in delivered or slot >= len(order):  # handed out, or a padding repeat
                continue
            self._filtered_packs += 1
            ledger.filtered.extend(int(i) for i in plan.pack(int(order[slot])))

    def _ledger(self) -> EpochLedger:
        """This epoch's ledger; opening a new one forgets all but the last ``ledger_epochs``."""
        ledger = self.ledgers.get(self.epoch)
        if ledger is None:
            ledger = self.ledgers[self.epoch] = EpochLedger()
            if self.ledger_epochs is not None:
                for old in sorted(self.ledgers)[: -self.ledger_epochs]:
                    del self.ledgers[old]
        return ledger

    def _record_tail(self) -> None:
        if not self.keep_ledger or isinstance(self.source, StreamPacker):
            return  # a stream lists its overlong samples as it reads them (_account_filtered)
        plan = self.source.plan_for(self._group_size)
        ledger = self._ledger()
        if self.source.rank == 0:
            ledger.overlong = [int(i) for i in getattr(plan, "dropped_ids", ())]
        # The layout that finishes the epoch decides its tail: replace, never accumulate.
        ledger.tail_dropped = [
            int(i) for pack_index in self.source.tail_dropped() for i in plan.pack(pack_index)
        ]

    def _source_state(self, *, started: bool) -> dict[str, Any]:
        point = ResumePoint(
            self.epoch,
            self._group_size,
            int(self._position["start"]),
            int(self._position["local"]),
        )
        if isinstance(self.source, StreamPacker):
            return self.source.state_at(point, started=started, at=self._stream_at)
        state: dict[str, Any] = self.source.state_at(point, started=started)
        return state

    def state_dict(self) -> dict[str, Any]:
        """A small versioned dict of plain values (safe for ``weights_only`` loads): the
        position (``source``) and the graph's state at the last batch (``graph``)."""
        with self._lock:
            graph = self._resume_graph or self._graph
            out = {
                "neatpack_loader_version": self.VERSION,
                "config_fingerprint": self.config_fingerprint,
                "config": copy.deepcopy({k: _plain(v) for k, v in self.config.items()}),
                "source": self._source_state(started=True),
            }
            if self.data is not None:
                out["data"] = dict(self.data)
            if graph is not None:
                out["graph"] = {
                    "state": copy.deepcopy(graph["state"]),
                    "finished": bool(graph["finished"]),
                    "signature": list(self._signature),
                    "filtered_packs": int(self._filtered_packs),
                }
            return out

    def load_state_dict(self, state: dict[str, Any] | Sequence[dict[str, Any]]) -> None:
        """Continue from ``state`` at the next ``iter()``; refuse other data, config or rank.

        ``state``: this rank's ``state_dict()``, or the list of every rank's (any order). A
        planned graph needs only one (every rank's holds the global cursor); a stream resumed
        on another world size needs every rank's, since each rank buffered its own samples."""
        states = [state] if isinstance(state, dict) else list(state)
        if not states:
            raise StateMismatchError("load_state_dict got an empty list of states")
        for one in states:
            self._check_loadable(one)
        states = copy.deepcopy(states)
        src = self.source
        own = next(
            (s for s in states
             if int(s["source"][PackSource.RANK_KEY]) == src.rank
             and int(s["source"][PackSource.WORLD_SIZE_KEY]) == src.world_size),
            states[0],
        )  # fmt: skip
        stream_at: dict[str, Any] | None = None
        if isinstance(src, StreamPacker):
            stream_at = src.resume_state([s["source"] for s in states])
            point = ResumePoint(
                int(stream_at[PackSource.EPOCH_KEY]), src.world_size, 0,
                int(stream_at[PackSource.LOCAL_KEY]),
            )  # fmt: skip
        else:
            # The source checks version, plan and rank now (not at the next iter()) and
            # resolves an elastic resume to the global cursor.
            point = src.resume_point(own["source"])
        graph = self._graph_to_resume(own)
        with self._lock:
            self._position = {"epoch": point.epoch, "start": point.start, "local": point.local}
            self._group_size = point.group_size
            self._continue = True
            self._resume_graph = graph
            self._stream_at = stream_at
            self._filtered_packs = (
                0 if graph is None else int(own["graph"].get("filtered_packs", 0))
            )

    def _check_loadable(self, state: Any) -> None:
        """Refuse a damaged state, another version, another config or other data by name."""
        _check_state(state)
        version = state.get("neatpack_loader_version")
        if version != self.VERSION:
            raise StateMismatchError(
                f"loader state has {version=}; this neatpack reads version {self.VERSION}. "
                "Is this a neatpack loader state (loader.state_dict())?"
            )
        if state["config_fingerprint"] != self.config_fingerprint:
            changed = sorted(
                k
                for k in set(state["config"]) | set(self.config)
                if state["config"].get(k) != _plain(self.config.get(k))
            )
            raise StateMismatchError(_mismatch_message(state, self.config, self.data, changed))

    def _graph_to_resume(self, state: dict[str, Any]) -> dict[str, Any] | None:
        """The saved graph state when this graph can take it; else None (the position alone),
        refused when a node with state of its own would silently restart empty."""
        saved = state["source"]
        graph = state.get("graph")
        same_layout = (
            int(saved[PackSource.WORLD_SIZE_KEY]) == self.source.world_size
            and int(saved.get(PackSource.BATCH_SIZE_KEY, self.source.batch_size))
            == self.source.batch_size
        )
        if graph is not None and same_layout and graph.get("signature") == self._signature:
            return {"state": graph["state"], "finished": bool(graph["finished"])}
        if graph is None:
            return None
        holders = stateful_nodes(self.root)
        if holders:
            why = (
                f"world size {saved[PackSource.WORLD_SIZE_KEY]} -> {self.source.world_size}"
                if not same_layout
                else f"graph shape {graph.get('signature')} -> {self._signature}"
            )
            names = ", ".join(f"{type(n).__qualname__} at {path}" for path, n in holders)
            raise StateMismatchError(
                f"cannot resume this graph on another layout ({why}): node(s) {names} hold "
                "state of their own, saved for the old layout, that would restart empty. "
                "Resume on the saved world size / batch size / worker setting, or set "
                "ELASTIC = True on the node's class if its state may restart on a new layout"
            )
        dropped = int(graph.get("filtered_packs", 0))
        if not same_layout and dropped and not graph["finished"]:
            raise StateMismatchError(
                f"cannot resume on {self.source.world_size} ranks from this state: a node of the "
                f"graph dropped {dropped} pack(s) on rank {saved[PackSource.RANK_KEY]} in epoch "
                f"{saved[PackSource.EPOCH_KEY]}, so the ranks stand at different positions and "
                "the rest of the epoch cannot be re-strided. Resume on the saved world size "
                f"({saved[PackSource.WORLD_SIZE_KEY]}), or from a state taken at an epoch end"
            )
        return None


def describe_data(source: Any) -> dict[str, str]:
    """``{"source", "fingerprint"}`` of a record source, for the loader's resume message: its
    file (``source.path``) or kind and length, and its content fingerprint (``""`` when the
    source has none)."""
    path = getattr(source, "path", None)
    name = str(path) if path is not None else f"{type(source).__name__} of {len(source)} records"
    try:
        fingerprint = str(source.content_fingerprint())
    except (AttributeError, ValueError, TypeError):
        fingerprint = ""
    return {"source": name, "fingerprint": fingerprint}


def _mismatch_message(
    state: dict[str, Any], config: dict[str, Any], data: dict[str, str] | None, changed: list[str]
) -> str:
    """Why a state does not fit this loader, and what to do: the data first, then the config."""
    saved_data = state.get("data")
    others = [k for k in changed if k != "lengths"]
    rest = (
        f" The config changed too: {others} (saved {[state['config'].get(k) for k in others]}, "
        f"now {[_plain(config.get(k)) for k in others]})."
        if others
        else ""
    )
    if "lengths" in changed and isinstance(saved_data, dict) and data is not None:
        old, new = str(saved_data.get("fingerprint", "")), data["fingerprint"]
        if old != new:
            return (
                f"the data changed since the state was saved: {data['source']} has content "
                f"fingerprint {new[:16] or '(none)'}, the state was saved on "
                f"{saved_data.get('source')} with {old[:16] or '(none)'}. The state's position "
                "counts packs of the old data's plan, so it cannot continue on other data: "
                "resume on the data it was saved with (restore the file), or, to train on the "
                "new data, start it without load_state_dict (a new plan from epoch 0)." + rest
            )
        return (
            f"the length estimate changed since the state was saved (same data, "
            f"{data['source']}, fingerprint {new[:16]}): the processor, estimate_mode or "
            "estimator settings differ, so the plan would too. Resume with the ones the state "
            "was saved with." + rest
        )
    what = (
        " ('lengths' is the length index fingerprint: the data or the length estimate changed)"
        if "lengths" in changed
        else ""
    )
    if "balance" in changed and "balance" not in state["config"]:
        what += (
            " (a state without 'balance' in its key was planned with balance='tokens', the "
            "default before 'cost': pass balance='tokens' to resume it)"
        )
    if "attn_implementation" in changed:  # "auto" resolves per machine (attention_choice.py)
        saved = state["config"].get("attn_implementation")
        what += (
            f" (attn_implementation='auto', the default, picks the format for this machine and "
            f"model: pass attn_implementation={saved!r} to resume this state)"
        )
    return (
        f"the loader config changed since the state was saved: {changed} "
        f"(saved {[state['config'].get(k) for k in changed]}, now "
        f"{[_plain(config.get(k)) for k in changed]}){what}. Resume with the same config."
    )


_INT_KEYS = (
    PackSource.EPOCH_KEY,
    PackSource.START_KEY,
    PackSource.LOCAL_KEY,
    PackSource.CURSOR_KEY,
    PackSource.RANK_KEY,
    PackSource.WORLD_SIZE_KEY,
    PackSource.GROUP_SIZE_KEY,
    PackSource.BATCH_SIZE_KEY,
)
_SIZE_KEYS = (PackSource.WORLD_SIZE_KEY, PackSource.GROUP_SIZE_KEY, PackSource.BATCH_SIZE_KEY)


def _bookkeeping(batch: Any) -> list[dict[str, Any]]:
    """``batch["packs"]``, checked: without it the loader cannot advance its cursor or ledger."""
    how = (
        "Collate with neatpack.pipes.Collater (it moves each pack's 'meta', made by "
        "PackMaterializer, into batch['packs']), or in your own collate set "
        "batch['packs'] = [pack.pop('meta') for pack in packs] (pack_meta(ref, ...) builds one)"
    )
    if not isinstance(batch, dict) or "packs" not in batch:
        keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
        raise BookkeepingError(
            f"a batch without 'packs' reached NeatLoader (keys {keys}): the loader reads each "
            f"row's pack bookkeeping there ({', '.join(META_KEYS)}) to advance its checkpoint "
            f"and ledger. {how}"
        )
    packs = batch["packs"]
    for i, meta in enumerate(packs):
        missing = [k for k in META_KEYS if not isinstance(meta, dict) or k not in meta]
        if missing:
            raise BookkeepingError(
                f"batch['packs'][{i}] lacks {missing} (has "
                f"{sorted(meta) if isinstance(meta, dict) else type(meta).__name__}). {how}"
            )
    return list(packs)


def _check_state(state: Any) -> None:
    """Refuse a damaged or foreign state with a message, not a KeyError deep inside."""
    fix = "load the dict that loader.state_dict() returned (torch.load(path, weights_only=True))"
    if not isinstance(state, dict):
        raise StateMismatchError(f"loader state is a {type(state).__name__}, not a dict; {fix}")
    if "neatpack_loader_version" not in state:
        return  # the version check names it
    source = state.get("source")
    missing = [k for k in ("config_fingerprint", "config", "source") if k not in state]
    if isinstance(source, dict):
        missing += [f"source.{k}" for k in (*_INT_KEYS, PackSource.FINGERPRINT_KEY)
                    if k not in source]  # fmt: skip
        bad = {
            k: source[k]
            for k in _INT_KEYS
            if k in source and (not isinstance(source[k], int) or isinstance(source[k], bool)
                                or source[k] < 0)
        }  # fmt: skip
        # Sizes are counts of ranks / packs: a 0 would divide by zero or stride nothing when
        # the epoch is re-strided, and a rank must be one of the saved world's ranks.
        bad |= {k: source[k] for k in _SIZE_KEYS if source.get(k) == 0}
        rank_key, world_key = PackSource.RANK_KEY, PackSource.WORLD_SIZE_KEY
        if not bad and not missing and source[rank_key] >= source[world_key]:
            bad[rank_key] = source[rank_key]
    else:
        bad = {"source": source}
    if missing or bad or not isinstance(state.get("config", {}), dict):
        raise StateMismatchError(
            f"loader state is damaged: missing keys {missing}, bad values {bad} (the positions "
            f"are non-negative ints, {list(_SIZE_KEYS)} at least 1, rank below world_size); "
            f"{fix}"
        )


def _plain(value: Any) -> Any:
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)
