"""``PPMediaSplitter``: a batch's media chunked per pipeline-parallel micro-batch."""

from __future__ import annotations

from typing import Any

__all__ = ["PPMediaSplitter"]


class PPMediaSplitter:
    """A batch -> the same batch with its media chunked per pipeline-parallel micro-batch.

    Wraps ``prepare_vlm_media_for_pp``: the media keys move to per-micro-batch chunks on the
    ``tensor_split`` boundaries of the text rows (``len(batch["packs"])`` rows). A batch without
    media is returned unchanged.
    """

    def __init__(self, microbatches: int) -> None:
        if microbatches < 1:
            raise ValueError(f"{microbatches=} must be >= 1")
        self.microbatches = microbatches

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        from neatpack.pipes.parallel.pp_media import prepare_vlm_media_for_pp

        rows = len(batch["packs"]) if "packs" in batch else int(batch["input_ids"].shape[0])
        return dict(prepare_vlm_media_for_pp(batch, rows, self.microbatches))
