"""``neat_stream_graph()``: a stream of raw conversations to packed, collated, resumable batches.

For data that cannot be indexed before training (a ``datasets.IterableDataset`` opened with
``streaming=True``, shards read as a stream, freshly generated samples): no length index and no
plan. The stream's shards are spread over the ranks, each rank packs what it reads online
(``StreamPacker``: best fit over a buffer of ``buffer_size`` samples, lengths from the same
estimators as ``neat_vlm_graph``) and the packs go through the planned graphs' worker chain
(materialize, collate, mask formats, hooks, ``batch["packs"]``), assembled by the same
``packed_parts``:

    StreamSource ─► StreamPacker (this rank's shards, online best fit, buffer-exact state)
      ─► Batcher ─► map_stage(StepChain(PerPack(materialize), Collater, ...)) ─► NeatLoader

When to plan and when to stream: plan (``neat_vlm_graph``) whenever the data can be indexed
first: the plan sees the whole epoch (fuller packs, steps balanced across ranks, a known epoch
length, O(1) resume). Stream when it cannot: the state then holds the buffer's addresses, and a
resume reads those records again (at most ``buffer_size`` of them plus the records between).

Resume: ``loader.state_dict()`` is small (positions and ``[sample id, length]`` pairs, never
records); the same world size continues bit for bit. Another world size or worker count:
``loader.load_state_dict([state of rank 0, state of rank 1, ...])`` with every saved rank's
state redistributes the remaining shards and the buffered samples, each sample once.

>>> from neatpack.pipes.reading.stream import ListStream
>>> from neatpack.pipes.testing.tiny import load_tiny_processor
>>> conv = lambda i: {"messages": [{"role": "user", "content": f"question {i}"},
...                                {"role": "assistant", "content": f"answer {i}"}]}
>>> stream = ListStream([[conv(i) for i in range(6)], [conv(i) for i in range(6, 9)]])
>>> loader = neat_stream_graph(stream, load_tiny_processor(),
...                            config=NeatStreamConfig(pack_size=128, buffer_size=4))
>>> batches = list(loader)
>>> sorted(i for b in batches for m in b["packs"] for i in m["sample_ids"]) == sorted(
...     loader.ledgers[0].consumed)
True
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

from neatpack.graphs.assemble import Hooks, cp_alignment, loader_of, packed_parts, probe_boundaries
from neatpack.graphs.config import NeatStreamConfig
from neatpack.graphs.families import family_attention, plan_family
from neatpack.graphs.neat_vlm import pad_id_of
from neatpack.graphs.open_data import MISSING_MEDIA_FIX
from neatpack.graphs.runtime.dist import resolve_rank
from neatpack.graphs.runtime.stages import GraphParts
from neatpack.pipes.errors import RecordError
from neatpack.pipes.materializing.materialize import MaterializeConfig, Materializer
from neatpack.pipes.planning.stream_packer import FAILED_KEY, StreamPacker
from neatpack.pipes.reading.lazy_image import send_lazy_images_encoded
from neatpack.pipes.reading.read import real_media_root, to_record
from neatpack.pipes.reading.stream import StreamSource
from neatpack.pipes.steps import PackMaterializer

__all__ = [
    "NeatStreamConfig",
    "StreamLength",
    "StreamMaterializer",
    "StreamRecords",
    "neat_stream_graph",
    "neat_stream_parts",
]


class StreamRecords:
    """A stream pack reference's records by sample id: the record source the materializer
    reads one pack from (the records travel in the reference, nothing is read again). A record
    the main process could not read or estimate raises its error here, so ``on_bad_sample``
    decides it and the ledger counts it as failed."""

    def __init__(self, ref: Mapping[str, Any]) -> None:
        self._by_id = dict(zip(ref["sample_ids"], ref["records"], strict=True))

    def __len__(self) -> int:
        return len(self._by_id)

    def __getitem__(self, sample_id: int) -> Any:
        record = self._by_id[int(sample_id)]
        if isinstance(record, dict) and FAILED_KEY in record:
            raise RecordError(str(record[FAILED_KEY]))
        return record


class StreamMaterializer:
    """A stream pack reference -> its pack (``Materializer`` over ``StreamRecords``);
    picklable when the processor and the hook are."""

    def __init__(
        self,
        processor: Any,
        config: MaterializeConfig,
        sample_transform: Callable[[Any], Any] | None = None,
    ) -> None:
        self.processor, self.config, self.sample_transform = processor, config, sample_transform

    def __call__(self, ref: Mapping[str, Any]) -> Any:
        return Materializer(
            StreamRecords(ref), self.processor, self.config, sample_transform=self.sample_transform
        )(ref)


class StreamLength:
    """A record's planned length: the estimator's total, rounded up to ``alignment`` (context
    parallelism), as the planned graphs' length index and ``cp_padded_lengths`` give it."""

    def __init__(self, estimator: Any, alignment: int = 1) -> None:
        self.estimator, self.alignment = estimator, alignment

    def __call__(self, record: Any) -> int:
        total, _visual = self.estimator.estimate(record)
        return -(-int(total) // self.alignment) * self.alignment


class _RecordOf:
    """A raw stream record -> Record (media paths against the media root)."""

    def __init__(self, media_root: str | None) -> None:
        self.media_root = real_media_root(media_root)

    def __call__(self, raw: Any, sid: int) -> Any:
        return to_record(raw, sid, self.media_root)


def neat_stream_parts(
    source: StreamSource,
    processor: Any,
    *,
    config: NeatStreamConfig | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    sample_transform: Callable[[Any], Any] | None = None,
    pack_transform: Callable[[Any], Any] | None = None,
    batch_transform: Callable[[Any], Any] | None = None,
    model: Any = None,
    cp_rank: int | None = None,
) -> GraphParts:
    """The pieces of ``neat_stream_graph`` (same arguments) to compose a graph of your own.

    ``source``: a ``StreamSource`` (``pipes/reading/stream.py``: shards re-readable from a
    position). The hooks, ``model`` and ``cp_rank`` are ``neat_vlm_parts``'; ``parts.source``
    is this rank's ``StreamPacker``."""
    cfg = family_attention(processor, config or NeatStreamConfig(), model)  # "auto" -> a format
    if not isinstance(source, StreamSource):
        raise TypeError(
            f"neat_stream_graph reads a StreamSource (shards(), open(shard, start), "
            f"fingerprint()), not a {type(source).__name__}: wrap the data in one "
            "(neatpack.pipes.reading.stream), or plan it with neat_vlm_graph"
        )
    hooks = Hooks(pack_transform, batch_transform, model, cp_rank)
    boundaries = probe_boundaries(cfg, hooks)  # before any record is read
    family = plan_family(processor, cfg)  # every family; raises on misfit
    rank, world_size = resolve_rank(rank, world_size)
    estimator = family.estimator(
        processor, cfg.estimate_mode, None, missing_media_fix=MISSING_MEDIA_FIX
    )
    data_fp = source.fingerprint()
    fingerprint = hashlib.sha256(
        f"neatpack-stream-v1\n{data_fp}\n{estimator.config_key()}\n".encode()
    ).hexdigest()
    packer = StreamPacker(
        source,
        load=_RecordOf(cfg.media_root),
        length=StreamLength(estimator, cp_alignment(cfg)),
        capacity=int(cfg.pack_size * cfg.packing_ratio),
        buffer_size=cfg.buffer_size,
        rank=rank,
        world_size=world_size,
        batch_size=cfg.batch_size,
        seed=cfg.seed,
        shuffle=cfg.shuffle,
        overlong=cfg.overlong,
        on_error="raise" if cfg.on_bad_sample == "raise" else "skip",
        fingerprint=fingerprint,
    )
    if cfg.num_workers > 0 and cfg.worker_method == "process":
        send_lazy_images_encoded()  # the workers decode the records' images, not this process
    padding_idx = pad_id_of(processor)
    materialize = StreamMaterializer(
        processor,
        family.materialize_config(cfg, padding_idx),
        sample_transform,
    )
    return packed_parts(
        cfg,
        graph="neat_stream",
        total=None,
        lengths_fingerprint=fingerprint[:16],
        materialize=PackMaterializer(materialize),
        collate_options={"padding_idx": padding_idx, **family.collate_options},
        extra_steps=family.pp_steps(cfg),
        rank=rank,
        world_size=world_size,
        data={
            "source": f"{type(source).__name__} of {len(source.shards())} shards",
            "fingerprint": data_fp,
        },
        hooks=hooks,
        boundaries=boundaries,
        stream=packer,
    )


@loader_of(neat_stream_parts)
def neat_stream_graph() -> None:
    """Build this rank's checkpointable loader of packed VLM batches from a stream
    (``neat_stream_parts``' arguments; the module docstring says when to stream).

    The graph: ``StreamPacker -> Batcher(batch_size) -> map_stage(StepChain(PerPack(
    PackMaterializer(StreamMaterializer)), Collater[, PPMediaSplitter][,
    ContextParallelSplitter]), num_workers) -> Prefetcher``. ``len(loader)`` is a
    ``TypeError``: a stream's epoch ends when its shards run out.
    """
