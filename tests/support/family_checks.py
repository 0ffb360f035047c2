"""Checks shared by the family tests: decoded label spans, packed-vs-separate parity through
``families.packed_model_inputs`` and the byte-for-byte rebuild of a build script's assets.

Each check is the same for every family once the family's media keys (what a sample gives the
model besides ``input_ids``) are named, so the tests call it with those instead of repeating it.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from neatpack.pipes.collating.mask import to_4d_additive_mask
from neatpack.pipes.families import packed_model_inputs, tokenize_with_handler

ROOT = Path(__file__).resolve().parents[2]
PROCESSORS = ROOT / "tests" / "support" / "assets" / "processors"


def label_spans(tok: Any, s: dict[str, Any]) -> list[str]:
    """The decoded text of each maximal run of labelled (``!= -100``) tokens, in order."""
    keep, ids = (s["labels"] != -100).tolist(), s["input_ids"].tolist()
    out, cur = [], []
    for k, t in zip([*keep, False], [*ids, -1], strict=True):
        if k:
            cur.append(t)
        elif cur:
            out.append(tok.decode(cur))
            cur = []
    return out


def estimate_error(recs: Sequence[dict[str, Any]], proc: Any, estimate: Any) -> float:
    """``estimate(rec, proc)`` (exact mode) == the real length after the shift, with and without
    ``audios_meta`` / ``images_meta``; returns the worst relative error of
    ``estimate(rec, proc, mode="estimate")`` against the real length."""
    worst = 0.0
    for rec in recs:
        real = len(tokenize_with_handler(rec, proc)["input_ids"]) - 1
        assert estimate(rec, proc) == real, rec["sample_id"]
        bare = {k: v for k, v in rec.items() if k not in ("audios_meta", "images_meta")}
        assert estimate(bare, proc) == real, rec["sample_id"]
        worst = max(worst, abs(estimate(rec, proc, mode="estimate") - real) / real)
    return worst


def runs(values: Sequence[int], code: int) -> list[int]:
    """Lengths of the maximal runs of ``code`` in ``values``, in order."""
    out, n = [], 0
    for t in [*values, None]:
        if t == code:
            n += 1
        elif n:
            out.append(n)
            n = 0
    return out


def logits_alone(
    model: Any, s: dict[str, Any], media_keys: Sequence[str], *, token_types: bool = False
) -> torch.Tensor:
    """The logits of one sample run alone (its ``media_keys`` that it has, and with
    ``token_types`` its ``mm_token_type_ids``), after the shift."""
    kw = {k: s[k] for k in media_keys if k in s}
    if token_types:
        kw["mm_token_type_ids"] = s["mm_token_type_ids"][:-1][None]
    with torch.no_grad():
        return model(input_ids=s["input_ids"][:-1][None], **kw).logits[0]  # type: ignore[no-any-return]


def worst_vs_alone(
    model: Any,
    samples: Sequence[dict[str, Any]],
    packed: torch.Tensor,
    seq_lens: Sequence[int],
    media_keys: Sequence[str],
    *,
    token_types: bool = False,
) -> float:
    """Max abs diff between the packed row's logits (``[sum(seq_lens), vocab]``) and each
    sample's ``logits_alone``, document by document."""
    worst, start = 0.0, 0
    for s, n in zip(samples, seq_lens, strict=True):
        alone = logits_alone(model, s, media_keys, token_types=token_types)
        worst = max(worst, float((packed[start : start + n] - alone).abs().max()))
        start += n
    return worst


def check_packed_equals_separate(
    model: Any, processor: Any, samples: list[dict[str, Any]], media_keys: Sequence[str]
) -> float:
    """One packed row from ``families.packed_model_inputs`` == each sample alone, max abs diff
    <= 1e-5 fp32 (returned); a one-document mask over the same row must differ by > 1e-3 (the
    block-causal mask is really used)."""
    inputs = packed_model_inputs(samples, processor)
    lens = inputs.pop("seq_lens")
    with torch.no_grad():
        packed = model(**inputs).logits[0]
    worst = worst_vs_alone(model, samples, packed, lens, media_keys)
    assert worst <= 1e-5, worst
    one_doc = dict(inputs, attention_mask=to_4d_additive_mask(torch.ones(1, sum(lens)).long()))
    with torch.no_grad():
        assert float((model(**one_doc).logits[0] - packed).abs().max()) > 1e-3
    return worst


def assert_script_rebuilds(script: str, tmp_path: Path, families: Sequence[str]) -> None:
    """``scripts/<script> tmp_path`` writes, for each of ``families``, the same files as the
    committed ``tests/support/assets/processors/<family>/``, byte for byte."""
    run = [sys.executable, str(ROOT / "scripts" / script), str(tmp_path)]
    subprocess.run(run, check=True, capture_output=True)
    for family in families:
        shipped = PROCESSORS / family
        names = sorted(p.name for p in shipped.iterdir())
        assert names == sorted(p.name for p in (tmp_path / family).iterdir()), family
        for name in names:
            built = (tmp_path / family / name).read_bytes()
            assert built == (shipped / name).read_bytes(), (family, name)
