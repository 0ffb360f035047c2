"""The attention formats' names in one place (pipes/collating/attention_formats.py): every
group is a part of ``MASK_FORMATS``, and the modules that test a name against a group use
these very tuples (no copy of their own to drift)."""

from __future__ import annotations

import doctest

from neatpack.pipes.collating import attention_choice, collate_family, leak_probe, mask_format
from neatpack.pipes.collating import attention_formats as F
from neatpack.pipes.planning import cost


def test_the_groups_partition_the_formats_as_the_collate_path_needs() -> None:
    assert len(set(F.MASK_FORMATS)) == len(F.MASK_FORMATS) == 8
    for group in (F.DENSE_FORMATS, F.FLASH_FORMATS, F.MASK_CONVERSIONS, F.MASK_FREE_FORMATS):
        assert set(group) <= set(F.MASK_FORMATS)
    # every format is either padded into doc ids and converted, or padded into itself
    assert set(F.MASK_CONVERSIONS) | set(F.PADDED_FORMATS) == set(F.MASK_FORMATS)
    assert not set(F.MASK_CONVERSIONS) & set(F.PADDED_FORMATS)
    assert F.VARLEN_FORMAT in F.FLASH_FORMATS
    assert mask_format.padded_format("eager") == "doc_ids"


def test_every_module_uses_the_one_tuple() -> None:
    for name in ("FLASH_FORMATS", "MASK_FORMATS", "MASK_CONVERSIONS", "MASK_FREE_FORMATS",
                 "PADDED_FORMATS"):  # fmt: skip
        assert getattr(mask_format, name) is getattr(F, name)
    assert attention_choice._SWAPPED is F.DENSE_FORMATS
    assert collate_family.FAMILY_4D_FORMATS is F.DENSE_FORMATS
    assert cost.DENSE_FORMATS is F.DENSE_FORMATS
    assert leak_probe.DENSE_FORMATS is F.DENSE_FORMATS


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
    assert doctest.testmod(F).failed == 0
