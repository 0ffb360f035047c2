"""``PackMaterializer``: the step that turns a pack reference into the materialized pack."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from neatpack.pipes.materializing.materialize import Materializer

from .meta import META_KEY, pack_meta

__all__ = ["PackMaterializer"]


class PackMaterializer:
    """A pack reference -> the materialized pack, with the loader's bookkeeping in ``"meta"``.

    Input: ``{"epoch": 0, "slot": 3, "pack_index": 7, "padded": False, "sample_ids": [4, 9]}``
    (one item of ``PackSource``). Output: the pack of ``materialize_pack`` (``input_ids``,
    ``labels``, ``position_ids``, ``attention_mask`` as document ids, ``seq_lens``, media...)
    plus ``pack["meta"] = pack_meta(ref, real_tokens=..., estimated_tokens=..., report=...)``.
    ``estimated`` is the plan's per-sample length (``LengthIndex.total``), for the estimate
    error figures; ``materializer`` any callable ``ref -> pack`` (``Materializer``, or the text
    graph's token packer).
    """

    def __init__(
        self, materializer: Materializer | Callable[[Any], Any], estimated: Any = None
    ) -> None:
        self.materializer = materializer
        self.estimated = None if estimated is None else np.asarray(estimated)

    def __call__(self, ref: Mapping[str, Any]) -> dict[str, Any]:
        pack = dict(self.materializer(ref))
        ids = ref["sample_ids"]
        seq_lens = pack.get("seq_lens", [])
        real = int(sum(seq_lens))
        if self.estimated is None:  # a stream's reference carries its estimate
            estimated = int(ref.get("estimated_tokens", real))
        else:
            estimated = int(self.estimated[list(ids)].sum()) if len(ids) else 0
        pack[META_KEY] = pack_meta(
            ref,
            real_tokens=real,
            estimated_tokens=estimated,
            report=pack.pop("report", None),
            seq_lens=seq_lens,
        )
        return pack
