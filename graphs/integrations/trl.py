"""TRL's ``SFTTrainer`` on a neatpack loader: packed VLM batches, TRL's own loss and checkpoints.

    from trl import SFTConfig
    from neatpack.graphs.integrations.trl import NeatSFTTrainer

    loader = neat_vlm_graph(data, processor, config=NeatVLMConfig(pack_size=4096))
    trainer = NeatSFTTrainer(model=model, args=SFTConfig(output_dir="out"),
                             train_loader=loader, processing_class=processor)
    trainer.train()                                   # or train(resume_from_checkpoint=True)

TRL 1.16 refuses ``packing=True`` and ``padding_free=True`` on vision datasets (no per-document
mRoPE positions, no block-causal mask); neatpack has already packed, tokenized, shifted and
collated. ``NeatSFTTrainer`` is ``NeatTrainer`` (``graphs/hf_trainer.py``: the loader is the
train dataloader, its state rides in every ``checkpoint-N``, resume is exact) in front of
``SFTTrainer``, so that TRL neither prepares, packs nor collates anything:

* ``train_dataset``: TRL requires one and peeks at its first row, which would consume a batch
  of the loader; it gets a one-row placeholder instead (``dataset_kwargs`` gets
  ``skip_prepare_dataset=True``), and the batches come from ``train_loader``.
* The loss is TRL's own: its fused LM head scores ``shift_labels`` as they are (neatpack's labels
  are already shifted, per document), divided by the ``num_items_in_batch`` the Trainer counts
  from them: next-token cross-entropy, the mean over the step's label tokens.
  ``label_smoothing_factor`` and ``compute_loss_func`` are refused: TRL hands them
  ``labels`` and shifts once more (position ``t`` scored against the token after next).
* TRL's ``num_tokens`` metric counts ``attention_mask.sum()``: on a packed ``[B,1,S,S]``
  block-causal mask that is attended pairs, not tokens, and with ``attention_mask=None``
  (``position_ids`` / flash formats) it raised ``AttributeError``. Here it counts the batch's
  real (non-padding) tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
from trl.trainer.sft_config import SFTConfig
from trl.trainer.sft_trainer import SFTTrainer

from neatpack.graphs.hf_trainer import NeatTrainer, TrainerBatches
from neatpack.graphs.train import model_inputs

__all__ = ["NeatSFTTrainer", "SFTBatches"]

#: the real (non-padding) tokens of a batch, carried to ``compute_loss`` and removed there
REAL_TOKENS = "neatpack_real_tokens"
#: what TRL's packing options would do again, and why they must stay off
_TRL_PACKING = ("packing", "padding_free")


class SFTBatches(TrainerBatches):
    """:class:`TrainerBatches` plus each batch's real-token count for TRL's ``num_tokens``
    metric: ``doc_ids`` is ``1..k`` on the k documents of a row, ``0`` on its padding."""

    def inputs(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = model_inputs(batch, model=self.model)
        if out.get("attention_mask", 0) is None:
            del out["attention_mask"]  # the same to the model; TRL would call None.sum()
        if "doc_ids" in batch:  # a padded (unpacked) batch's 2D mask counts right already
            out[REAL_TOKENS] = int(batch["doc_ids"].gt(0).sum())
        return out


def _placeholder() -> Any:
    """The one-row dataset ``SFTTrainer`` is given to check: never iterated for training."""
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": [[0]], "labels": [[-100]]})


def _checked_args(args: SFTConfig | None, output_dir: str) -> SFTConfig:
    args = SFTConfig(output_dir=output_dir) if args is None else args
    if not isinstance(args, SFTConfig):
        raise TypeError(f"args must be a trl.SFTConfig, got {type(args).__name__}")
    on = [name for name in _TRL_PACKING if getattr(args, name)]
    if on:
        raise ValueError(
            f"SFTConfig has {', '.join(f'{n}=True' for n in on)}: neatpack's loader has already "
            "packed the batches (per-document positions and masks), TRL must not pack again; "
            f"set {', '.join(f'{n}=False' for n in on)}"
        )
    if args.label_smoothing_factor > 0:
        raise ValueError(
            f"{args.label_smoothing_factor=}: TRL's label smoother shifts the labels once more, "
            "but neatpack's are already shifted (each token would be scored against the one after "
            "next); set label_smoothing_factor=0"
        )
    given = args.dataset_kwargs or {}
    given = json.loads(given) if isinstance(given, str) else given  # SFTConfig takes JSON too
    args.dataset_kwargs = {**given, "skip_prepare_dataset": True}
    return args


class NeatSFTTrainer(NeatTrainer, SFTTrainer):
    """``trl.SFTTrainer`` fed by a neatpack loader (``train_loader=``) and checkpointed with it.

    ``processing_class`` is the processor (or tokenizer) the loader tokenizes with; TRL saves it
    with each checkpoint. Everything else is ``SFTTrainer``'s own behaviour (its loss, metrics,
    optimizer, PEFT, logging); ``train_dataset`` and ``data_collator`` are the loader's job.
    """

    def __init__(
        self,
        model: Any,
        args: SFTConfig | None = None,
        *,
        train_loader: Any,
        processing_class: Any,
        **kwargs: Any,
    ) -> None:
        for name in ("train_dataset", "data_collator", "compute_loss_func", "formatting_func"):
            if kwargs.get(name) is not None:
                raise ValueError(
                    f"NeatSFTTrainer takes no {name}: the neatpack loader (train_loader=) reads, "
                    "packs, shifts and collates the data, and TRL's own loss scores it; "
                    f"remove {name}="
                )
            kwargs.pop(name, None)
        super().__init__(
            model=model,
            args=_checked_args(args, "neatpack-sft"),
            train_loader=train_loader,
            train_dataset=_placeholder(),
            processing_class=processing_class,
            **kwargs,
        )
        self.train_batches = SFTBatches(train_loader, self.model)

    def compute_loss(
        self,
        model: Any,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        real = inputs.pop(REAL_TOKENS, None)
        counted = self._total_train_tokens
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)  # type: ignore[no-untyped-call]
        if real is not None and getattr(self.model, "training", False):
            # TRL added attention_mask.sum() (pairs of a 4D mask) or position_ids.size(1) (the
            # batch size of [4,B,S] mRoPE positions); the real tokens replace it.
            device = self.accelerator.device
            total = self.accelerator.gather_for_metrics(torch.tensor(real, device=device))
            self._total_train_tokens = counted + int(total.sum()) // self._tp_size
            self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
        return out
