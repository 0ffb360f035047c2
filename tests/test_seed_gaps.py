"""Issue 18: the seed-named API called as a user of the seeds' framework would call it, with the
seeds' argument names, on records shaped as the seeds describe (``shared/seeds/``)."""

from __future__ import annotations

from typing import Any


def test_seed_constants_import_from_pipes_with_the_seed_values() -> None:
    from neatpack.pipes import CROSS_ENTROPY_IGNORE_IDX, MEDIA_KEYS, VLM_PP_MEDIA_KEY

    assert CROSS_ENTROPY_IGNORE_IDX == -100  # seed 001
    assert MEDIA_KEYS == (  # seed 000 / peer notes 3
        "pixel_values",
        "image_grid_thw",
        "image_position_ids",
        "pixel_values_videos",
        "video_grid_thw",
        "second_per_grid_ts",
    )
    assert VLM_PP_MEDIA_KEY == "_vlm_pp_media_chunks"  # seed 004
