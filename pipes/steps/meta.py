"""``pack_meta``: the bookkeeping one pack carries to the loader (``pack["meta"]``, then
``batch["packs"]``), no tensors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["META_KEY", "pack_meta"]

META_KEY = "meta"


def pack_meta(
    ref: Mapping[str, Any],
    *,
    real_tokens: int,
    estimated_tokens: int | None = None,
    report: dict[str, Any] | None = None,
    seq_lens: Sequence[int] | None = None,
) -> dict[str, Any]:
    """What the loader's ledger and stats read of one pack (no tensors). ``seq_lens``: the real
    length of each packed document in pack order (a mixture counts its sources' tokens by it).

    >>> ref = {"epoch": 0, "slot": 3, "pack_index": 7, "padded": False, "sample_ids": [4, 9]}
    >>> pack_meta(ref, real_tokens=120)["sample_ids"], pack_meta(ref, real_tokens=120)["slot"]
    ([4, 9], 3)
    """
    return {
        "epoch": ref["epoch"],
        "slot": ref["slot"],
        "pack_index": ref["pack_index"],
        "padded": ref["padded"],
        "sample_ids": list(ref["sample_ids"]),
        "real_tokens": int(real_tokens),
        "estimated_tokens": estimated_tokens,
        "report": report,
        "seq_lens": None if seq_lens is None else [int(n) for n in seq_lens],
    }
