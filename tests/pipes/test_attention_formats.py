"""The attention formats' names in one place (pipes/collating/attention_formats.py): every
group is a part of ``MASK_FORMATS``, and the modules that test a name against a group use
these very tuples (no copy of their own to drift)."""

from __future__ import annotations

import doctest

from neatpack.pipes.collating import (
    attention_choice,
    attention_formats,
    collate_family,
    leak_probe,
    mask_format,
)
from neatpack.pipes.collating.attention_formats import (
    DENSE_FORMATS,
    FLASH_FORMATS,
    MASK_CONVERSIONS,
    MASK_FORMATS,
    MASK_FREE_FORMATS,
    PADDED_FORMATS,
    VARLEN_FORMAT,
)
from neatpack.pipes.planning import cost


def test_the_groups_partition_the_formats_as_the_collate_path_needs() -> None:
    assert len(set(MASK_FORMATS)) == len(MASK_FORMATS) == 8
    for group in (DENSE_FORMATS, FLASH_FORMATS, MASK_CONVERSIONS, MASK_FREE_FORMATS):
        assert set(group) <= set(MASK_FORMATS)
    # every format is either padded into doc ids and converted, or padded into itself
    assert set(MASK_CONVERSIONS) | set(PADDED_FORMATS) == set(MASK_FORMATS)
    assert not set(MASK_CONVERSIONS) & set(PADDED_FORMATS)
    assert VARLEN_FORMAT in FLASH_FORMATS
    assert mask_format.padded_format("eager") == "doc_ids"


def test_every_module_uses_the_one_tuple() -> None:
    for name in ("FLASH_FORMATS", "MASK_FORMATS", "MASK_CONVERSIONS", "MASK_FREE_FORMATS",
                 "PADDED_FORMATS"):  # fmt: skip
        assert getattr(mask_format, name) is getattr(attention_formats, name)
    assert attention_choice._SWAPPED is DENSE_FORMATS
    assert collate_family.FAMILY_4D_FORMATS is DENSE_FORMATS
    assert cost.DENSE_FORMATS is DENSE_FORMATS
    assert leak_probe.DENSE_FORMATS is DENSE_FORMATS


def test_auto_and_the_models_formats_are_unchanged() -> None:
    choose = attention_choice.choose_attention_format
    assert (choose("auto", cuda=True), choose("auto", cuda=False)) == ("flash_attention_2", "sdpa")
    model_to_batch = {
        "flash_attention_3": "flash_attention_3",
        "flash_attention_2": "flash_attention_2",
        "neatpack_varlen": "flash_attention_2",
        "sdpa": "sdpa",
        "eager": "eager",
        "flex_attention": "flex_attention",
    }
    for impl, want in model_to_batch.items():
        assert attention_choice._format_of_model(impl) == want


def test_doctests_pass() -> None:
    assert doctest.testmod(attention_formats).failed == 0
