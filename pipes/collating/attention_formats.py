"""The names of the attention formats a batch can be collated into, and their groups: one place.

``mask_format.py`` (what each format puts in a batch), ``attention_choice.py`` (which format
``"auto"`` picks, which attention a model runs), the families' collate, the leak probe and the
cost model all test a name against these tuples. They live here, importing nothing, because
``mask_format`` resolves ``"auto"`` through ``attention_choice``: the choice cannot import
them from ``mask_format`` without closing an import cycle (``tests/test_layout.py``).

    >>> DENSE_FORMATS, MASK_FREE_FORMATS[:2] == FLASH_FORMATS
    (('sdpa', 'eager'), True)
"""

from __future__ import annotations

__all__ = [
    "DENSE_FORMATS",
    "FLASH_FORMATS",
    "MASK_CONVERSIONS",
    "MASK_FORMATS",
    "MASK_FREE_FORMATS",
    "PADDED_FORMATS",
    "VARLEN_FORMAT",
]

#: Formats whose batch carries a dense ``[S, S]`` mask per row (bool for sdpa, additive for
#: eager): attention costs the row's square, and any mask a family needs can be drawn in it.
DENSE_FORMATS = ("sdpa", "eager")
#: The batch a varlen kernel attends by (``cu_seq_lens_q/k``, no mask): what ``"auto"`` picks on
#: CUDA, under transformers' name for it.
VARLEN_FORMAT = "flash_attention_2"
FLASH_FORMATS = (VARLEN_FORMAT, "flash_attention_3")
#: Every accepted ``attn_implementation`` / ``mask_format`` value; the check uses this tuple.
MASK_FORMATS = (*DENSE_FORMATS, *FLASH_FORMATS, "flex_attention", "position_ids", "thd", "doc_ids")
#: Formats with no attention mask: document boundaries travel in positions or cu_seqlens.
MASK_FREE_FORMATS = (*FLASH_FORMATS, "position_ids", "thd")
#: Formats whose mask is built from a padded batch's ``[B, S]`` document ids (``convert_mask``).
MASK_CONVERSIONS = (*DENSE_FORMATS, "flex_attention")
#: The formats a batch is padded into (``collate.pad_batch``): document ids, or a mask-free one.
PADDED_FORMATS = ("doc_ids", *MASK_FREE_FORMATS)
