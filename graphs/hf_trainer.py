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
* Checkpoints: each ``checkpoint-N`` folder gets ``loader.state_dict()`` (a few ints, one file
  per rank, written atomically) before the Trainer's own files; ``trainer_state.json``, which
  the Trainer writes last, marks the folder complete. ``train(resume_from_checkpoint=...)``
  loads the loader state and sets ``ignore_data_skip``, so the Trainer does not replay the
  consumed batches to skip them: the loader resumes from its cursor, exactly.
  ``resume_from_checkpoint=True`` takes the newest *complete* checkpoint (a run killed while
  saving leaves a torn last one; it is skipped with a warning).
* A checkpoint saved at an epoch's end resumes with the next epoch: the loader's saved
  position is the end of the finished epoch, an empty remainder the Trainer would stop on.
* Each training log (every ``logging_steps``) carries the loader's ``data_metrics()``
  (``data/wait_s``, ``data/wait_fraction``, ``data/fill``, ... since the previous log), so
  TensorBoard, W&B or any ``report_to`` shows when the data is the bottleneck. The figures are
  this process's; the Trainer reports the main process's.
* Model weights are restored through ``from_pretrained``'s key conversion: ``save_pretrained``
  writes some models' legacy key names (Qwen2-VL's ``model.embed_tokens...`` for
  ``model.language_model.embed_tokens...``) that the Trainer's own ``load_state_dict`` would
  skip, leaving 57 of Qwen2-VL's 58 tensors at their current values. A checkpoint that does not
  restore every tensor is refused.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import torch
from transformers import PreTrainedModel, Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from neatpack.graphs.checkpoint_dirs import atomic_file, json_problem, newest_complete
from neatpack.graphs.runtime.dist import resolve_rank
from neatpack.graphs.train import model_inputs, use_varlen_attention_for

__all__ = [
    "NeatTrainer",
    "TrainerBatches",
    "check_loader_ranks",
    "checkpoint_problem",
    "last_complete_checkpoint",
    "load_loader_state",
    "load_weights",
    "loader_state_path",
    "save_loader_state",
]

TRAINER_STATE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME, written last
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


class TrainerBatches:
    """A neatpack loader as ``transformers.Trainer``'s train dataloader.

    Yields ``model_inputs(batch)`` (labels and ``shift_labels``: the Trainer counts
    ``num_items_in_batch`` from ``shift_labels`` and hands it to the model's loss), keeps the
    loader's length, and delegates ``state_dict`` / ``load_state_dict``.

    The first ``iter()`` after ``load_state_dict`` that yields nothing was resumed at the end of
    an epoch (the Trainer saves after the epoch's last batch, before the loader sees its end):
    that empty remainder closes the finished epoch and the same ``iter()`` goes on with the next
    one, as the Trainer's epoch count expects; the Trainer would stop on an empty epoch.
    """

    def __init__(self, loader: Any, model: Any = None) -> None:
        self.loader = loader
        self.model = model  # checked against each batch's attention inputs (model_inputs)
        self._resumed = False

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.loader_batches():
            yield self.inputs(batch)

    def loader_batches(self) -> Iterator[Any]:
        """The loader's batches as they are, one epoch (the empty resumed remainder skipped)."""
        resumed, self._resumed = self._resumed, False
        empty = True
        for batch in self.loader:
            empty = False
            yield batch
        if resumed and empty:
            yield from self.loader

    def inputs(self, batch: Any) -> dict[str, Any]:
        """One batch as the trainer's ``compute_loss`` takes it (a subclass adds keys)."""
        out: dict[str, Any] = model_inputs(batch, model=self.model)
        return out

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.loader.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)
        self._resumed = True


def loader_state_path(checkpoint_dir: str | os.PathLike[str], rank: int = 0) -> str:
    """Where a rank's loader state lives inside a Trainer checkpoint folder."""
    return os.path.join(os.fspath(checkpoint_dir), f"neatpack_loader_rank{rank}.pt")


def save_loader_state(loader: Any, checkpoint_dir: str | os.PathLike[str]) -> None:
    """This rank's loader state into a checkpoint folder, atomically (a temporary file, synced,
    renamed over the target): a kill mid-write leaves the old file or none, never half."""
    path = loader_state_path(checkpoint_dir, resolve_rank(None, None)[0])
    with atomic_file(path) as f:
        torch.save(loader.state_dict(), f)


def load_loader_state(loader: Any, checkpoint_dir: str | os.PathLike[str]) -> None:
    """Load this rank's loader state from a Trainer checkpoint folder (errors name the file)."""
    path = loader_state_path(checkpoint_dir, resolve_rank(None, None)[0])
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path} not found: the checkpoint was not written by NeatTrainer; "
            "resume the loader from its own state file instead"
        )
    loader.load_state_dict(torch.load(path, weights_only=True))


def checkpoint_problem(checkpoint_dir: str | os.PathLike[str]) -> str | None:
    """Why a NeatTrainer checkpoint folder cannot be resumed from (torn by a kill while it was
    saved, or not NeatTrainer's), or None when it is complete: every rank's loader state and a
    readable ``trainer_state.json``, the file the Trainer writes after the weights and the
    optimizer."""
    folder = os.fspath(checkpoint_dir)
    unfinished = json_problem(folder, TRAINER_STATE)
    if unfinished is not None:
        return unfinished
    world_size = resolve_rank(None, None)[1]
    missing = [r for r in range(world_size) if not os.path.exists(loader_state_path(folder, r))]
    if missing:
        return f"no loader state for rank(s) {missing}"
    return None


def last_complete_checkpoint(output_dir: str | os.PathLike[str]) -> str:
    """The newest complete ``checkpoint-N`` folder in ``output_dir``; newer torn ones are
    skipped with a warning naming each and what it lacks. ValueError when none is complete."""
    return newest_complete(
        output_dir, _CHECKPOINT, checkpoint_problem,
        fix="train from scratch (resume_from_checkpoint=None)",
    )  # fmt: skip


class NeatTrainer(Trainer):
    """``transformers.Trainer`` fed by a neatpack loader (``train_loader=``), checkpointed with
    the trainer. Everything else is the Trainer's own behaviour.

    ``varlen_attention=True`` (default): when the loader's batches carry document boundaries
    (``flash_attention_2``, what ``attn_implementation="auto"`` gives on CUDA), the model is
    switched to neatpack's varlen attention on CUDA (:func:`use_varlen_attention_for`); False
    keeps the model's attention as it is. Either way each batch is checked against the model's
    attention before it trains (``model_inputs(batch, model=...)``)."""

    def __init__(
        self, *args: Any, train_loader: Any, varlen_attention: bool = True, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        parallel = getattr(self.accelerator, "parallelism_config", None)
        ranks = self.args.world_size if parallel is None else parallel.data_parallel_size
        check_loader_ranks(train_loader, ranks)
        if varlen_attention:
            use_varlen_attention_for(self.model, train_loader)
        self.train_loader = train_loader
        self.train_batches = TrainerBatches(train_loader, self.model)

    def get_train_dataloader(self) -> Any:
        return self.train_batches

    def train(  # type: ignore[override]
        self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any
    ) -> Any:
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_complete_checkpoint(str(self.args.output_dir))
        if isinstance(resume_from_checkpoint, str):
            problem = checkpoint_problem(resume_from_checkpoint)
            if problem is not None:
                raise ValueError(
                    f"cannot resume from {resume_from_checkpoint!r}: {problem} (a run killed "
                    "while saving it, or not a NeatTrainer checkpoint); pass another checkpoint "
                    "or resume_from_checkpoint=True for the newest complete one"
                )
            load_loader_state(self.train_batches, resume_from_checkpoint)
            self.args.ignore_data_skip = True  # the loader resumes from its cursor
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # A training log has the step's "loss" (evaluation and the end-of-run summary do not):
        # the data figures of the steps since the previous one join it, so every callback
        # (report_to's TensorBoard, W&B, ...) and log_history receive them.
        if "loss" in logs:
            logs = {**logs, **self.train_loader.data_metrics()}
        super().log(logs, start_time)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        folder = os.path.join(
            self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        )
        # A folder saved before (a resume from an older checkpoint redoes this step) counts as
        # torn until the Trainer rewrites its trainer_state.json, after everything else.
        # Only the process that writes it removes it (another rank could remove the new one).
        stale = os.path.join(folder, TRAINER_STATE)
        if self.args.should_save and os.path.exists(stale):
            os.remove(stale)
        save_loader_state(self.train_loader, folder)
        super()._save_checkpoint(model, trial)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        model = self.model if model is None else model
        plain = isinstance(model, PreTrainedModel) and getattr(model, "hf_quantizer", None) is None
        if not plain or self.is_fsdp_enabled or self.is_deepspeed_enabled:
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # PEFT, FSDP, ...
            return
        load_weights(model, resume_from_checkpoint)


def check_loader_ranks(loader: Any, data_parallel_size: int) -> None:
    """Refuse a loader built for another number of data-parallel ranks than the trainer runs.

    The usual cause: the graph was built before ``TrainingArguments`` (or ``SFTConfig``), whose
    creation starts the process group under ``torchrun`` / ``accelerate launch``; the graph then
    read world size 1 on every rank, and each rank would train the whole epoch (every sample
    ``data_parallel_size`` times per epoch)."""
    source = getattr(loader, "source", None)
    built = getattr(source, "world_size", None)
    if built is None or built == data_parallel_size:
        return
    raise ValueError(
        f"the loader was built for world_size={built} (rank {getattr(source, 'rank', '?')}) "
        f"but the trainer runs {data_parallel_size} data-parallel processes: each rank would "
        "train the wrong share of the data. Build the loader after TrainingArguments / "
        "SFTConfig (creating them starts the process group), or pass rank= and world_size= to "
        "the graph"
    )


def load_weights(model: PreTrainedModel, checkpoint_dir: str) -> None:
    """Every tensor of ``model`` from a ``save_pretrained`` folder, keys converted as
    ``from_pretrained`` converts them (the Trainer's plain ``load_state_dict`` skips the legacy
    names some models are saved under). Refused, naming the keys, unless every tensor loads."""
    saved: Any
    info: dict[str, Any]
    try:
        saved, info = type(model).from_pretrained(  # type: ignore[misc]
            checkpoint_dir, config=model.config, output_loading_info=True
        )
    except (RuntimeError, ValueError, OSError) as e:
        raise ValueError(
            f"cannot restore the weights of {type(model).__name__} from {checkpoint_dir!r}: "
            f"transformers cannot load what it saved ({e}). Resuming would train from the "
            "wrong weights; load the model yourself and train without resume_from_checkpoint"
        ) from e
    bad = {k: sorted(map(str, v))[:5] for k, v in info.items() if v}  # first 5 of each
    if bad:
        raise ValueError(
            f"cannot restore the weights of {type(model).__name__} from {checkpoint_dir!r}: "
            f"{bad}. Resuming would train from the wrong weights"
        )
    model.load_state_dict(saved.state_dict(), strict=True)
