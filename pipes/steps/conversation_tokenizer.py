"""``ConversationTokenizer``: records -> unshifted samples, one processor call per item."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["ConversationTokenizer"]


class ConversationTokenizer:
    """``{"records": [...], ...}`` -> the same item with ``"samples"`` in place of ``"records"``.

    Wraps ``tokenize_conversations``: ONE processor call for the item's records (the image
    processor resizes same-size images together), each sample equal to
    ``tokenize_conversation``'s for its record (docs/data_contracts.md section 4, unshifted).
    ``options`` go to it (``label_policy``...). Other keys of the item (``"ref"``) pass through.
    """

    def __init__(self, processor: Any, **options: Any) -> None:
        self.processor, self.options = processor, options

    def __call__(self, item: Mapping[str, Any]) -> dict[str, Any]:
        from neatpack.pipes.materializing.tokenize import tokenize_conversations

        out = {k: v for k, v in item.items() if k != "records"}
        out["samples"] = tokenize_conversations(item["records"], self.processor, **self.options)
        return out
