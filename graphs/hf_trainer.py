"""Training with ``transformers.Trainer`` on a neatpack loader.

    loader = neat_vlm_graph(data, processor, config=NeatVLMConfig(pack_size=4096))
    trainer = NeatTrainer(model=model, args=TrainingArguments(...), train_loader=loader)
    trainer.train()                                   # or train(resume_from_checkpoint=True)

What it changes in ``Trainer``, and why:

* ``get_train_dataloader`` returns the loader itself (wrapped in
  :class:`TrainerBatches`): no sampler, no re-collation; each batch is
  ``model_inputs(batch)``, so the labels reach the model's loss with ``shift_labels`` and the
  loss is next-token cross-entropy.
* ``num_items_in_batch``: the Trainer counts it from ``shift_labels`` (transformers >= 5.x
  releases that know that key) or from ``labels`` (older 5.x): both are the step's label
  tokens, because neatpack's labels are already shifted. Its loss is therefore the mean over
  every label token of the optimizer step, across accumulation micro-steps and (with
  ``average_tokens_across_devices``) ranks: the ``"token"`` convention.
* Checkpoints: :class:`NeatLoaderCallback` saves ``loader.state_dict()`` (a few ints) into each
  ``checkpoint-N`` folder, one file per rank; ``train(resume_from_checkpoint=...)`` loads it and
  sets ``ignore_data_skip``, so the Trainer does not replay the consumed batches to skip them:
  the loader resumes from its cursor, exactly.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from neatpack.graphs.train import model_inputs

__all__ = [
    "NeatLoaderCallback",
    "NeatTrainer",
    "TrainerBatches",
    "load_loader_state",
    "loader_state_path",
]


class TrainerBatches:
    """A neatpack loader as ``transformers.Trainer``'s train dataloader.

    Yields ``model_inputs(batch)`` (labels and ``shift_labels``: the Trainer counts
    ``num_items_in_batch`` from ``shift_labels`` and hands it to the model's loss), keeps the
    loader's length, and delegates ``state_dict`` / ``load_state_dict``. See
    :class:`NeatLoaderCallback` for checkpointing it with the trainer.
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.loader:
            yield model_inputs(batch)

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.loader.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


def loader_state_path(checkpoint_dir: str | os.PathLike[str], rank: int = 0) -> str:
    """Where a rank's loader state lives inside a Trainer checkpoint folder."""
    return os.path.join(os.fspath(checkpoint_dir), f"neatpack_loader_rank{rank}.pt")


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class NeatLoaderCallback(TrainerCallback):
    """Save the loader's state into every checkpoint the Trainer writes."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        torch.save(self.loader.state_dict(), loader_state_path(folder, _rank()))
        return control


def load_loader_state(loader: Any, checkpoint_dir: str | os.PathLike[str]) -> None:
    """Load this rank's loader state from a Trainer checkpoint folder (errors name the file)."""
    path = loader_state_path(checkpoint_dir, _rank())
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path} not found: the checkpoint was not written with NeatLoaderCallback "
            "(NeatTrainer adds it); resume the loader from its own state file instead"
        )
    loader.load_state_dict(torch.load(path, weights_only=True))


class NeatTrainer(Trainer):
    """``transformers.Trainer`` fed by a neatpack loader (``train_loader=``), checkpointed with
    the trainer. Everything else is the Trainer's own behaviour."""

    def __init__(self, *args: Any, train_loader: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.train_loader = train_loader
        self.add_callback(NeatLoaderCallback(train_loader))

    def get_train_dataloader(self) -> Any:
        return TrainerBatches(self.train_loader)

    def train(  # type: ignore[override]
        self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any
    ) -> Any:
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)  # type: ignore[no-untyped-call]
            if resume_from_checkpoint is None:
                raise ValueError(f"no checkpoint found in {self.args.output_dir=}")
        if isinstance(resume_from_checkpoint, str):
            load_loader_state(self.train_loader, resume_from_checkpoint)
            self.args.ignore_data_skip = True  # the loader resumes from its cursor
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
