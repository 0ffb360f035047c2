"""``PPMediaSplitter``: a batch's media chunked per pipeline-parallel micro-batch."""

from __future__ import annotations

from typing import Any

__all__ = ["PPMediaSplitter"]


class PPMediaSplitter:
    """A batch -> the same batch with its media chunked per pipeline-parallel micro-batch.

    Asks the families ``handler`` (a registered name) for its split (``Handler.pp_split``;
    ``pp_family_media.split_batch_media``): the media keys move to per-micro-batch chunks on the
    ``tensor_split`` boundaries of the text rows (``len(batch["packs"])`` rows). A handler that
    declares no split is refused here, naming it. ``handler=None``: a batch of
    ``neat_packed_vlm_collater`` (``prepare_vlm_media_for_pp``). A batch without media is
    returned unchanged.
    """

    def __init__(self, microbatches: int, *, handler: str | None = None) -> None:
        if microbatches < 1:
            raise ValueError(f"{microbatches=} must be >= 1")
        self.microbatches, self.handler = microbatches, handler
        if handler is not None:
            from neatpack.pipes.parallel.pp_family_media import check_pp_split

            check_pp_split(handler, microbatches)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        from neatpack.pipes.parallel.pp_family_media import split_batch_media

        return dict(split_batch_media(batch, self.handler, self.microbatches))
