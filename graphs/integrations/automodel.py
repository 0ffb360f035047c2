"""NeMo AutoModel: a neatpack loader built from a recipe YAML, under the peer's own option names.

AutoModel recipes build components from YAML sections whose ``_target_`` names a callable;
its config loader (``nemo_automodel.components.config.loader``) resolves the target and calls
it with the section's keys. :func:`build_dataloader` is such a target. It takes the option
names an AutoModel VLM neat-packing recipe uses (the ``packed_sequence:``, ``dataset:`` and
``dataloader:`` sections: ``pack_size``, ``packing_ratio``, ``max_length``,
``drop_long_samples``, ``attn_implementation``, ``packing_format``, ``shuffle``, ...), maps
each to its ``NeatVLMConfig`` field, and refuses the ones with no equivalent by name, saying
what to use instead. Any ``NeatVLMConfig`` field is accepted under its own name too.

.. code-block:: yaml

    dataloader:
      _target_: neatpack.graphs.integrations.automodel.build_dataloader
      data: train.jsonl          # the peer's `dataset:` records: {"conversation": [...]}
      processor:
        _target_: transformers.AutoProcessor.from_pretrained
        pretrained_model_name_or_path: Qwen/Qwen2.5-VL-3B-Instruct
      pack_size: 8192
      packing_ratio: 0.9
      drop_long_samples: true    # -> overlong="drop" (counted in the loader's stats)

``PEER_OPTIONS`` is the one table of peer names; docs/migrating_from_automodel.md lists every
entry (a test keeps the two equal). Nothing here imports AutoModel: the builder is plain Python
and the loader it returns is a ``NeatLoader``.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

from neatpack.graphs.neat_vlm import NeatVLMConfig, neat_vlm_graph
from neatpack.graphs.runtime.loader import NeatLoader

__all__ = ["PEER_OPTIONS", "build_dataloader", "neatpack_options"]

#: Every AutoModel option the builder knows: its neatpack equivalent, or why there is none.
PEER_OPTIONS: dict[str, str] = {
    "pack_size": "pack_size",
    "packing_ratio": "packing_ratio",
    "max_length": "pack_size when pack_size is absent; a value below pack_size is refused",
    "drop_long_samples": "overlong: true -> 'drop' (counted), false -> 'raise' (names the sample)",
    "max_packs": "max_packs",
    "attn_implementation": "attn_implementation (one of pipes.mask_format.MASK_FORMATS)",
    "packed_mask_type": "attn_implementation: block_causal -> sdpa, document_ids -> doc_ids, "
    "flash_varlen -> flash_attention_2",
    "packing_format": "attn_implementation: neat -> unchanged, thd -> thd",
    "collate_max_length": "pad_to_multiple_of (rows padded to exactly this length); below "
    "pack_size is refused",
    "balance_media_tokens": "none: ignored with a warning (the peer's order is a sort that its "
    "own shuffle undoes); neatpack balances work per rank in the plan",
    "pretokenize": "none needed: neatpack tokenizes in its workers; ignored",
    "enabled": "none needed: neatpack always packs; false is refused (grouped_vlm_graph pads)",
    "truncate": "none: a sample is never cut; true is refused (use drop_long_samples)",
    "inject_fake_images": "fake_image (AutoModel's default is true, neatpack's false)",
    "chat_template": "none: set it on the processor (processor.chat_template); refused",
    "post_tokenize_hook_fn": "none: refused; neat_vlm_graph(sample_transform=...) in Python",
    "shuffle": "shuffle",
    "num_workers": "num_workers",
    "pin_memory": "pin_memory",
    "persistent_workers": "none needed: neatpack's workers live as long as the loader; ignored",
    "prefetch_factor": "prefetch",
    "drop_last": "tail: true -> 'drop', false -> 'pad' (repeats packs so ranks stay even)",
    "seed": "seed",
    "local_batch_size": "batch_size (packs per rank per step)",
    "dataset": "data (raw records: a path, a list of {'conversation': [...]}, an HF dataset)",
    "dp_rank": "rank (else torch.distributed)",
    "dp_world_size": "world_size (else torch.distributed)",
    "packed_sequence": "its keys, as if given in the section itself (the recipe's section "
    "copied as is)",
}

_MASK_TYPES = {
    "block_causal": "sdpa",
    "document_ids": "doc_ids",
    "flash_varlen": "flash_attention_2",
}
_PACKING_FORMATS = {"neat": None, "thd": "thd"}
_IGNORED = ("pretokenize", "persistent_workers")
_FIELDS = tuple(f.name for f in dataclasses.fields(NeatVLMConfig))


def neatpack_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``NeatVLMConfig`` keyword arguments for AutoModel-named (or neatpack-named) ``options``.

    >>> neatpack_options({"pack_size": 4096, "packing_ratio": 0.9, "drop_long_samples": True,
    ...                   "drop_last": False, "prefetch_factor": 4})
    {'pack_size': 4096, 'packing_ratio': 0.9, 'overlong': 'drop', 'tail': 'pad', 'prefetch': 4}
    >>> neatpack_options({"max_length": 2048, "packing_format": "thd"})
    {'attn_implementation': 'thd', 'pack_size': 2048}
    """
    options = _flatten_packed_sequence(options)
    out: dict[str, Any] = {}

    def put(field: str, value: Any, peer: str) -> None:
        if field in out and out[field] != value:
            raise ValueError(
                f"AutoModel option {peer}={value!r} sets neatpack's {field}, already set to "
                f"{out[field]!r} by another option; keep one of them"
            )
        out[field] = value

    for name, value in options.items():  # neatpack's own names first: a peer name must agree
        if name in _FIELDS:
            put(name, value, name)
    for name, value in options.items():
        if name in _FIELDS and name not in PEER_OPTIONS:
            continue
        if name not in PEER_OPTIONS:
            raise TypeError(
                f"unknown option {name!r}: not an AutoModel option neatpack maps "
                f"({', '.join(PEER_OPTIONS)}) nor a NeatVLMConfig field ({', '.join(_FIELDS)}); "
                "docs/migrating_from_automodel.md has the table"
            )
        if value is None or name in _IGNORED:
            continue
        _map_one(name, value, put)
    _map_max_length(options, out)
    return out


def _flatten_packed_sequence(options: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe's ``packed_sequence:`` section, nested as is, merged into the options."""
    flat = {k: v for k, v in options.items() if k != "packed_sequence"}
    for name, value in (options.get("packed_sequence") or {}).items():
        if name in flat and flat[name] != value:
            raise ValueError(
                f"packed_sequence.{name}={value!r} and {name}={flat[name]!r} disagree; keep one"
            )
        flat[name] = value
    return flat


def _map_one(name: str, value: Any, put: Any) -> None:
    """One AutoModel option (not None) into ``put(field, value, peer_name)``."""
    direct = {"pack_size", "packing_ratio", "max_packs", "attn_implementation", "shuffle",
              "num_workers", "pin_memory", "seed"}  # fmt: skip
    if name in direct:
        put(name, value, name)
    elif name == "drop_long_samples":
        put("overlong", "drop" if value else "raise", name)
    elif name == "packed_mask_type":
        if value not in _MASK_TYPES:
            raise ValueError(f"{name}={value!r} is not one of {tuple(_MASK_TYPES)}")
        put("attn_implementation", _MASK_TYPES[value], name)
    elif name == "packing_format":
        if value not in _PACKING_FORMATS:
            raise ValueError(f"{name}={value!r} is not one of {tuple(_PACKING_FORMATS)}")
        if _PACKING_FORMATS[value] is not None:
            put("attn_implementation", _PACKING_FORMATS[value], name)
    elif name == "collate_max_length":
        put("pad_to_multiple_of", value, name)  # checked against pack_size below
    elif name == "balance_media_tokens":
        if value:
            warnings.warn(
                "balance_media_tokens=True is ignored: the AutoModel option sorts packs by "
                "visual tokens, which its own shuffle then undoes; neatpack balances each "
                "step's work across ranks in its plan. Drop the option to silence this.",
                UserWarning,
                stacklevel=4,
            )
    elif name == "enabled" and not value:
        raise ValueError(
            "enabled=False: neatpack always packs; for padded, unpacked batches build "
            "neatpack.graphs.grouped_vlm_graph instead"
        )
    elif name == "truncate" and value:
        raise ValueError(
            "truncate=True: neatpack never cuts a sample; set drop_long_samples: true to drop "
            "(and count) samples longer than pack_size, or raise pack_size"
        )
    elif name == "chat_template":
        raise ValueError(
            "chat_template: neatpack uses the processor's template; set "
            "processor.chat_template (or the tokenizer's) before building the loader"
        )
    elif name == "post_tokenize_hook_fn":
        raise ValueError(
            "post_tokenize_hook_fn has no YAML equivalent: pass a per-sample step as "
            "neat_vlm_graph(..., sample_transform=fn) in Python"
        )
    elif name == "inject_fake_images":
        put("fake_image", bool(value), name)
    elif name == "prefetch_factor":
        put("prefetch", value, name)
    elif name == "drop_last":
        put("tail", "drop" if value else "pad", name)
    elif name == "local_batch_size":
        put("batch_size", value, name)


def _map_max_length(options: Mapping[str, Any], out: dict[str, Any]) -> None:
    """``max_length`` is the peer's per-sample cap; neatpack's cap is the pack itself."""
    max_length = options.get("max_length")
    if max_length is not None and "pack_size" not in out:
        out["pack_size"] = max_length
    pack_size = out.get("pack_size", NeatVLMConfig.pack_size)
    if max_length is not None and max_length < pack_size:
        raise ValueError(
            f"{max_length=} is below {pack_size=}: neatpack's only per-sample cap is the pack "
            "(a longer sample is dropped or raised, see drop_long_samples); set pack_size to "
            "max_length, or drop max_length"
        )
    pad = out.get("pad_to_multiple_of")
    if options.get("collate_max_length") is not None and pad < pack_size:
        raise ValueError(
            f"collate_max_length={pad} is below {pack_size=}: a full pack would not fit the "
            "row; leave it out (rows pad to the longest pack) or set it to pack_size"
        )


def build_dataloader(
    *,
    data: Any = None,
    dataset: Any = None,
    processor: Any = None,
    pretrained_model_name_or_path: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    dp_rank: int | None = None,
    dp_world_size: int | None = None,
    **options: Any,
) -> NeatLoader:
    """A ``NeatLoader`` of packed VLM batches: the target of a recipe's ``dataloader:`` section.

    ``data`` (or the peer's name ``dataset``) is what ``neat_vlm_graph`` reads; ``processor``
    is a built processor, or ``pretrained_model_name_or_path`` loads one with
    ``AutoProcessor``. ``options`` are AutoModel names (``PEER_OPTIONS``) or ``NeatVLMConfig``
    fields; :func:`neatpack_options` maps them and refuses what has no equivalent.
    """
    if (data is None) == (dataset is None):
        raise ValueError(
            "give the records as data= (or the AutoModel name dataset=), exactly one of them: "
            "a JSONL/JSON path, a list of {'conversation': [...]} rows, or an HF dataset"
        )
    for name, ours, peer in (("rank", rank, dp_rank), ("world_size", world_size, dp_world_size)):
        if ours is not None and peer is not None and ours != peer:
            raise ValueError(f"{name}={ours} and dp_{name}={peer} disagree; give one of them")
    if processor is None:
        if pretrained_model_name_or_path is None:
            raise ValueError(
                "no processor: give processor= (a built processor, or a section with "
                "_target_: transformers.AutoProcessor.from_pretrained) or "
                "pretrained_model_name_or_path="
            )
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(pretrained_model_name_or_path)  # type: ignore[no-untyped-call]
    config = NeatVLMConfig(**neatpack_options(options))
    return neat_vlm_graph(
        dataset if data is None else data,
        processor,
        config=config,
        rank=rank if dp_rank is None else dp_rank,
        world_size=world_size if dp_world_size is None else dp_world_size,
    )
