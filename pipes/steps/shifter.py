"""``Shifter``: the per-sample autoregressive shift as a replaceable step."""

from __future__ import annotations

from typing import Any

__all__ = ["Shifter"]


class Shifter:
    """The per-sample autoregressive shift as a step: ``input_ids[:-1]``, ``labels[1:]``.

    ``Materializer(..., shift=Shifter())`` is the default; pass a replacement (a step of the same
    contract: the sample one token shorter, ``labels[t]`` scoring token ``t + 1``) to change it,
    e.g. to shift a per-token key of your own along with the ids.

    >>> import torch
    >>> out = Shifter()({"sample_id": 0, "input_ids": torch.tensor([5, 6, 7]),
    ...                  "labels": torch.tensor([-100, 6, 7])})
    >>> out["input_ids"].tolist(), out["labels"].tolist()
    ([5, 6], [6, 7])
    """

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        from neatpack.pipes.materializing.pack import shift_sample

        shifted: dict[str, Any] = shift_sample(sample)
        return shifted
