"""The data contracts between the stages, as types: Record -> Sample -> Pack, PackRef, Batch,
and PackMeta (one pack's bookkeeping, what ``NeatLoader`` counts).

Each is a ``TypedDict``: at runtime a plain ``dict`` (nothing is converted or checked, the key
names are the seed's), for the type checker a dict whose keys and value types are known.
``docs/data_contracts.md`` shows each one with an example; a test keeps the two in step (every
key the document lists is a key here, and every key here is listed there)::

    read             -> Record    one conversation, by sample id
    tokenize         -> Sample    one conversation through the real processor (unshifted)
    PackSource.next  -> PackRef   which samples make one pack slot of an epoch
    materialize      -> Pack      the samples, shifted and concatenated
    collate          -> Batch     packs padded to [B, S] plus the attention inputs
    PackMaterializer -> PackMeta  in pack["meta"]; Collater moves them to batch["packs"]

Keys a stage adds only in some cases (media, precomputed counts, a format's attention
inputs) are ``NotRequired``. A model family may add keys of its own to a Sample, Pack or
Batch (``docs/families.md``); they travel through untouched. ``Pack.meta`` and ``Batch.packs``
are ``NotRequired`` because the pure functions (``build_pack``, ``neat_packed_vlm_collater``)
do not make them; every graph's pack and batch carry them, and ``NeatLoader`` refuses a batch
without ``packs`` or a ``PackMeta`` without one of its required keys (``BookkeepingError``).

>>> ref: PackRef = {"epoch": 0, "slot": 3, "pack_index": 7, "sample_ids": [4, 9], "padded": False}
>>> type(ref) is dict
True
"""

from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

if TYPE_CHECKING:  # annotations only: reading records and planning never import torch
    from torch import Tensor

__all__ = ["Batch", "Pack", "PackMeta", "PackRef", "Record", "Sample"]


class Record(TypedDict):
    """One raw conversation after reading (docs/data_contracts.md section 1)."""

    sample_id: int
    conversation: list[dict[str, Any]]
    images_meta: NotRequired[list[Any]]
    videos_meta: NotRequired[list[Any]]
    audios_meta: NotRequired[list[Any]]
    _text_tokens: NotRequired[int]
    _media_tokens: NotRequired[int]


class Sample(TypedDict):
    """One tokenized conversation, NOT shifted (section 4)."""

    sample_id: int
    input_ids: "Tensor"
    labels: "Tensor"
    attention_mask: "Tensor"
    mm_token_type_ids: "Tensor"
    pixel_values: NotRequired["Tensor"]
    image_grid_thw: NotRequired["Tensor"]
    pixel_values_videos: NotRequired["Tensor"]
    video_grid_thw: NotRequired["Tensor"]
    second_per_grid_ts: NotRequired["Tensor"]


class PackRef(TypedDict):
    """One pack slot of an epoch for this rank, as ``PackSource`` yields it (section 3)."""

    epoch: int
    slot: int
    pack_index: int
    sample_ids: list[int]
    padded: bool
    source_ids: NotRequired[list[int]]  # mixtures only


class PackMeta(TypedDict):
    """One pack's bookkeeping, made by ``pack_meta`` (``PackMaterializer``) from its ``PackRef``:
    what ``NeatLoader`` advances its cursor, ledger and stats with (section 5). The required keys
    are the ones the loader checks in every batch; it reads the others with ``.get``."""

    epoch: int
    slot: int
    sample_ids: list[int]
    padded: bool
    pack_index: NotRequired[int]
    real_tokens: NotRequired[int]
    estimated_tokens: NotRequired[int | None]
    report: NotRequired[dict[str, Any] | None]
    seq_lens: NotRequired[list[int] | None]
    source_tokens: NotRequired[dict[str, int]]  # mixtures only


class Pack(TypedDict):
    """Shifted samples concatenated into one row (section 5)."""

    sample_ids: list[int]
    input_ids: "Tensor"
    labels: "Tensor"
    attention_mask: "Tensor"
    position_ids: "Tensor"
    text_position_ids: "Tensor"
    mm_token_type_ids: "Tensor"
    seq_lens: list[int]
    seq_lens_padded: list[int]
    n_images: int
    n_videos: int
    pixel_values: NotRequired["Tensor | list[Tensor] | None"]
    image_grid_thw: NotRequired["Tensor | None"]
    image_position_ids: NotRequired["Tensor | None"]
    pixel_values_videos: NotRequired["Tensor | list[Tensor] | None"]
    video_grid_thw: NotRequired["Tensor | None"]
    second_per_grid_ts: NotRequired["Tensor | None"]
    pack_index: NotRequired[int]
    epoch: NotRequired[int]
    planned_sample_ids: NotRequired[list[int]]
    report: NotRequired[dict[str, Any]]
    media_samples: NotRequired[list[dict[str, Any]]]
    meta: NotRequired[PackMeta]  # PackMaterializer: the loader's bookkeeping


class Batch(TypedDict):
    """Packs padded to ``[B, S]`` with the attention inputs of one format (section 6)."""

    input_ids: "Tensor"
    labels: "Tensor"
    mm_token_type_ids: "Tensor"
    position_ids: "Tensor"
    doc_ids: "Tensor"
    attention_mask: Any  # a [B,1,S,S] mask, a flex BlockMask, the [B,S] doc ids, or None
    sample_ids: list[list[int]]
    num_label_tokens: int
    num_documents: int
    label_weights: "Tensor"
    pixel_values: NotRequired["Tensor | list[Tensor]"]
    image_grid_thw: NotRequired["Tensor"]
    image_position_ids: NotRequired["Tensor"]
    pixel_values_videos: NotRequired["Tensor | list[Tensor]"]
    video_grid_thw: NotRequired["Tensor"]
    second_per_grid_ts: NotRequired["Tensor"]
    n_images_per_sample: NotRequired["Tensor"]
    n_videos_per_sample: NotRequired["Tensor"]
    cu_seq_lens_q: NotRequired["Tensor"]
    cu_seq_lens_k: NotRequired["Tensor"]
    max_length_q: NotRequired[int]
    max_length_k: NotRequired[int]
    packed_seq_params: NotRequired[dict[str, Any]]
    seq_idx: NotRequired["Tensor"]
    doc_sources: NotRequired["Tensor"]  # mixtures only
    source_names: NotRequired[list[str]]
    packs: NotRequired[list[PackMeta]]  # Collater: one per row; NeatLoader requires it
