"""The mixture as the graph sees it: one record source over all sources (global ids), the pack
source whose plan changes per epoch, and the step that tags each document with its source.

Global sample ids run over the sources in order: with sources ``ocr`` (3 records) and ``chat``
(2), ids 0-2 are ``ocr``'s records 0-2 and ids 3-4 ``chat``'s 0-1. The ledger, the plan and
``batch["packs"]`` speak global ids; ``MixtureRecords.locate(i)`` turns one back.

``MixturePackSource`` is a ``PackSource`` whose plan is the epoch's (``MixtureLayout.epoch_plan``)
and whose state also records the blend(s) the epoch was planned with: a list of
``[cursor, blend]`` segments (one, unless the blend changed mid-epoch with
``on_change="cursor"``). On resume with another blend ``Mixture.on_change`` decides: finish
the saved epoch with the saved blend (the default), re-plan the rest from the cursor, or refuse.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from neatpack.pipes.mixtures.mixture import (
    Blend,
    IntArray,
    blend_fingerprint,
    epoch_counts,
    source_targets,
)
from neatpack.pipes.mixtures.mixture_plan import MixturePlan, plan_mixture, replan_from_cursor
from neatpack.pipes.planning.balance import BalancePolicy
from neatpack.pipes.planning.source import PackRef, PackSource, ResumePoint, StateMismatchError

__all__ = ["MixtureLayout", "MixturePackSource", "MixtureRecords", "SourceTagger"]

Segments = list[tuple[int, Blend]]


class MixtureRecords:
    """Records of several sources under global ids (``sample_id`` rewritten to the global id).

    >>> from neatpack.pipes.reading.read import SequenceSource
    >>> conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    >>> recs = MixtureRecords(["a", "b"], [SequenceSource([{"messages": conv}] * 3),
    ...                                    SequenceSource([{"messages": conv}] * 2)])
    >>> len(recs), recs[3]["sample_id"], recs.locate(3)
    (5, 3, ('b', 0))
    """

    def __init__(self, names: Sequence[str], sources: Sequence[Any]) -> None:
        if len(names) != len(sources):
            raise ValueError(f"{len(names)} names for {len(sources)} sources")
        self.names, self.sources = tuple(names), list(sources)
        self.bounds = np.concatenate([[0], np.cumsum([len(s) for s in sources])]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.bounds[-1])

    def locate(self, sample_id: int) -> tuple[str, int]:
        """``(source name, id within that source)`` of a global id."""
        if not 0 <= int(sample_id) < len(self):
            raise IndexError(f"{sample_id=} is outside 0..{len(self) - 1} (the mixture's ids)")
        s = int(np.searchsorted(self.bounds, int(sample_id), side="right")) - 1
        return self.names[s], int(sample_id) - int(self.bounds[s])

    def __getitem__(self, sample_id: int) -> dict[str, Any]:
        name, local = self.locate(sample_id)
        try:
            record = dict(self.sources[self.names.index(name)][local])
        except Exception as exc:
            exc.add_note(f"mixture sample {sample_id} is sample {local} of source {name!r}")
            raise
        record["sample_id"] = int(sample_id)
        return record

    def content_fingerprint(self) -> str:
        h = hashlib.sha256()
        for name, src in zip(self.names, self.sources, strict=True):
            h.update(f"{name}:{len(src)}:{src.content_fingerprint()}|".encode())
        return h.hexdigest()


@dataclass(frozen=True, eq=False)
class MixtureLayout:
    """What an epoch's plan is made of: the sources' sizes and planned lengths (concatenated,
    as the pack will hold them) and the plan parameters. ``fingerprint`` covers all of it but
    not the blend, which travels in the state apart."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    total: IntArray
    visual: IntArray
    capacity: int
    packing_ratio: float
    overlong: str
    seed: int
    single_source: bool
    lengths_fingerprint: str
    balance: BalancePolicy = "tokens"  # plan_packs' step balance, inside each plan part
    max_visual: int | None = None  # plan_packs' visual-token budget per pack
    images: IntArray | None = None  # media items per sample (None: unknown)
    max_images: int | None = None  # plan_packs' media-item budget per pack
    supervised: IntArray | None = None  # label tokens per sample (balance="supervised")
    per_rank: int | None = None  # packs per rank per step balance="cost" plans for (batch_size)

    @property
    def tokens(self) -> list[int]:
        bounds = np.concatenate([[0], np.cumsum(self.sizes)])
        return [int(self.total[bounds[s] : bounds[s + 1]].sum()) for s in range(len(self.sizes))]

    @property
    def fingerprint(self) -> str:
        key = [self.names, self.sizes, self.capacity, self.packing_ratio, self.overlong,
               self.seed, self.single_source, self.lengths_fingerprint]  # fmt: skip
        if self.balance != "tokens" or self.max_visual is not None:  # older keys unchanged
            key += [self.balance, self.max_visual]
        if self.max_images is not None:  # the same
            key += [self.max_images]
        if self.balance == "supervised" and self.supervised is not None:  # what it orders by
            key += [hashlib.sha256(np.asarray(self.supervised, "<i8").tobytes()).hexdigest()]
        if self.balance == "cost" and self.per_rank is not None:  # the step shape it plans for
            key += [f"per_rank={int(self.per_rank)}"]
        if self.balance == "cost":  # every use in one plan (mixture_uses): older states refused
            key += ["uses-together"]
        return hashlib.sha256(("mixture/1" + json.dumps(key)).encode()).hexdigest()

    def targets(self, blend: Blend) -> IntArray:
        return source_targets(blend, self.sizes, self.tokens)

    def epoch_plan(self, segments: Segments, epoch: int, group_size: int) -> MixturePlan:
        """The plan of ``epoch``: planned with the first segment's blend, re-planned from each
        later segment's cursor (a cursor at or past the epoch's end changes nothing)."""
        first = segments[0][1]
        counts = epoch_counts(self.targets(first), self.sizes, self.names, self.seed, epoch)
        plan = plan_mixture(
            counts, self.total, self.visual, epoch=epoch, group_size=group_size,
            capacity=self.capacity, packing_ratio=self.packing_ratio, overlong=self.overlong,
            seed=self.seed, single_source=self.single_source, balance=self.balance,
            max_visual=self.max_visual, images=self.images, max_images=self.max_images,
            supervised=self.supervised, per_rank=self.per_rank,
        )  # fmt: skip
        for cursor, blend in segments[1:]:
            if cursor < len(plan):
                plan = replan_from_cursor(
                    plan, cursor, self.targets(blend), self.names, self.total, self.visual,
                    capacity=self.capacity, packing_ratio=self.packing_ratio,
                    overlong=self.overlong, seed=self.seed, single_source=self.single_source,
                    balance=self.balance, max_visual=self.max_visual, images=self.images,
                    max_images=self.max_images, supervised=self.supervised,
                    per_rank=self.per_rank,
                )  # fmt: skip
        return plan


class MixturePackSource(PackSource):
    """A ``PackSource`` over a mixture: the epoch's plan, its blend segments in the state,
    and each pack reference's ``source_ids`` (source index per sample)."""

    MIXTURE_KEY = "mixture"
    SEGMENTS_KEY = "segments"
    BLEND_KEY = "blend_fingerprint"
    CACHED_PLANS = 2  # plans of 10M samples are large: keep the current ones only

    def __init__(
        self,
        layout: MixtureLayout,
        blend: Blend,
        *,
        on_change: str = "next_epoch",
        rank: int,
        world_size: int,
        batch_size: int = 1,
        tail: str = "pad",
    ) -> None:
        self.layout, self.blend, self.on_change = layout, blend, on_change
        self._segments: dict[int, Segments] = {}
        self._cache: dict[str, MixturePlan] = {}
        super().__init__(
            self.plan_for, rank=rank, world_size=world_size, batch_size=batch_size, tail=tail
        )

    def segments(self, epoch: int) -> Segments:
        """The ``[(cursor, blend), ...]`` epoch ``epoch`` is planned with."""
        return self._segments.get(epoch, [(0, self.blend)])

    def epoch_plan(self, epoch: int, group_size: int) -> MixturePlan:
        segments = self.segments(epoch)
        key = json.dumps([epoch, group_size, segments], sort_keys=True)
        if key not in self._cache:
            while len(self._cache) >= self.CACHED_PLANS:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = self.layout.epoch_plan(segments, epoch, group_size)
        return self._cache[key]

    def plan_for(self, group_size: int) -> MixturePlan:
        """The current epoch's plan grouped for ``group_size`` ranks."""
        return self.epoch_plan(self._epoch, group_size)

    def replan_dropped(self, epoch: int | None = None) -> list[int]:
        """Global ids (a sample once per use) that a blend change from the cursor dropped from
        ``epoch`` (default: the current one)."""
        epoch = self._epoch if epoch is None else epoch
        return [int(i) for i in self.epoch_plan(epoch, self._group_size).replan_dropped]

    def plan_fingerprint(self, point: ResumePoint) -> str:
        return self.layout.fingerprint

    def state_at(self, point: ResumePoint, *, started: bool) -> dict[str, Any]:
        out = super().state_at(point, started=started)
        segments = self.segments(point.epoch)
        out[self.MIXTURE_KEY] = {
            self.SEGMENTS_KEY: [[int(c), blend] for c, blend in segments],
            self.BLEND_KEY: blend_fingerprint(segments[-1][1]),
        }
        return out

    def check_plan(self, state: dict[str, Any], group_size: int) -> None:
        if state[self.FINGERPRINT_KEY] != self.layout.fingerprint:
            raise StateMismatchError(
                "the saved state was taken on another mixture layout (the sources, their data "
                "or lengths, or the plan config changed): saved fingerprint "
                f"{state[self.FINGERPRINT_KEY]!r:.20}, this one {self.layout.fingerprint!r:.20}. "
                "Resume with the same sources and config (weights may change: on_change), or "
                "start afresh"
            )
        saved = state.get(self.MIXTURE_KEY)
        if not isinstance(saved, dict) or not saved.get(self.SEGMENTS_KEY):
            raise StateMismatchError(
                "the saved state has no mixture blend (it was saved by a single-source graph): "
                "resume it with that graph, or start the mixture afresh"
            )
        segments: Segments = [(int(c), b) for c, b in saved[self.SEGMENTS_KEY]]
        last = segments[-1][1]
        if [e[0] for e in last["sources"]] != list(self.layout.names):
            raise StateMismatchError(
                f"the saved blend has sources {[e[0] for e in last['sources']]}, this mixture "
                f"{list(self.layout.names)}: resume with the same sources"
            )
        epoch = int(state[self.EPOCH_KEY])
        if blend_fingerprint(last) != blend_fingerprint(self.blend):
            if self.on_change == "refuse":
                raise StateMismatchError(
                    f"the mixture's blend changed since the state was saved: saved {last}, now "
                    f"{self.blend}. Set Mixture(on_change='next_epoch') to finish epoch {epoch} "
                    "with the saved blend and use the new one from the next epoch, or "
                    "on_change='cursor' to re-plan the rest of this epoch with the new blend "
                    "(uses it drops are listed), or resume with the saved blend"
                )
            cursor = int(state[self.CURSOR_KEY])
            if cursor == 0:  # nothing of the epoch served yet: it is all the new blend's
                segments = [(0, self.blend)]
            elif self.on_change == "cursor":
                segments.append((cursor, self.blend))
        self._segments = {} if segments == [(0, self.blend)] else {epoch: segments}

    def next(self) -> PackRef:
        ref = super().next()
        ref["source_ids"] = self.plan_for(self._group_size).pack_sources(ref["pack_index"])
        return ref


class SourceTagger:
    """Batch step: ``batch["doc_sources"]`` (``[B, D]`` long, the source index of each document
    of each row in row order, ``-1`` past the row's documents) and ``batch["source_names"]``;
    each pack's meta gets ``source_tokens`` (real tokens per source name: the loader's
    ``data/tokens/<source>`` figures).

    >>> tag = SourceTagger([0, 3, 5], ["ocr", "chat"])
    >>> out = tag({"packs": [
    ...     {"sample_ids": [4, 0], "report": {"packed": [4, 0]}, "seq_lens": [7, 5]},
    ...     {"sample_ids": [1], "report": None, "seq_lens": [9]}]})
    >>> out["doc_sources"].tolist(), out["source_names"]
    ([[1, 0], [0, -1]], ['ocr', 'chat'])
    >>> [meta["source_tokens"] for meta in out["packs"]]  # real tokens per source, per pack
    [{'ocr': 5, 'chat': 7}, {'ocr': 9, 'chat': 0}]
    """

    def __init__(self, bounds: Sequence[int] | IntArray, names: Sequence[str]) -> None:
        self.bounds = np.asarray(bounds, dtype=np.int64)
        self.names = list(names)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        rows = []
        for meta in batch["packs"]:
            report = meta.get("report") or {}
            ids = report.get("packed", meta["sample_ids"])
            rows.append(np.searchsorted(self.bounds, np.asarray(ids, np.int64), side="right") - 1)
            meta["source_tokens"] = self.source_tokens(rows[-1], meta)
        width = max((len(r) for r in rows), default=0)
        out = torch.full((len(rows), width), -1, dtype=torch.long)
        for i, r in enumerate(rows):
            out[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
        batch["doc_sources"] = out
        batch["source_names"] = list(self.names)
        return batch

    def source_tokens(self, sources: IntArray, meta: dict[str, Any]) -> dict[str, int]:
        """Real tokens of each source in one pack, for the loader's ``data/tokens/<source>``:
        each document's length (``meta["seq_lens"]``, in packed order) to its source."""
        lens = meta.get("seq_lens")
        if lens is None or len(lens) != len(sources):
            raise ValueError(
                f"pack {meta.get('pack_index')} (samples {list(meta['sample_ids'])}) has "
                f"seq_lens={lens} for {len(sources)} packed documents: SourceTagger counts each "
                "source's tokens by document length. Build the pack's meta with "
                "neatpack.pipes.PackMaterializer, or pack_meta(..., seq_lens=<each document's "
                "real length in packed order>)"
            )
        out = dict.fromkeys(self.names, 0)
        for source, n in zip(sources.tolist(), lens, strict=True):
            out[self.names[source]] += int(n)
        return out
