"""Train a tiny real Qwen2-VL on neatpack batches, checkpoint the loader, resume it.

    python examples/train_tiny.py --steps 16

Everything is local: generated data, the embedded tiny processor, a randomly initialised tiny
model built from a config. The corpus is small and repeated (several epochs), so the loss must
fall: a real learning signal. Each optimizer step accumulates ``--accum`` micro-batches and
normalizes by the step's label tokens (``step_normalizer``), the model's own loss doing the
rest (``model_inputs`` passes the already shifted labels as ``shift_labels``). Prints one JSON
line with the losses.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.graphs.train import model_inputs, step_normalizer
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor
from neatpack.pipes.testing.tiny_models import tiny_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--attn", default="sdpa")
    args = parser.parse_args()
    torch.manual_seed(0)
    root = tempfile.mkdtemp(prefix="neatpack-train-")
    data = write_corpus(root, num_samples=12)
    processor = load_tiny_processor("qwen2_vl")
    config = NeatVLMConfig(
        pack_size=1024, batch_size=1, media_root=f"{root}/media", attn_implementation=args.attn
    )
    loader = neat_vlm_graph(data, processor, config=config)
    model = tiny_model(
        "qwen2_vl",
        processor=processor,
        attn_implementation="eager" if args.attn == "eager" else "sdpa",
    )
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses: list[float] = []
    state = None
    after_state: list[torch.Tensor] = []
    micro: list[dict] = []
    while len(losses) < args.steps:
        for batch in loader:  # one epoch; the outer loop repeats the corpus
            if state is not None and len(after_state) < 2:
                after_state.append(batch["input_ids"])
            micro.append(batch)
            if len(micro) < args.accum:
                continue
            n = step_normalizer(micro)  # label tokens of the whole step (all ranks, if any)
            step_loss = 0.0
            for b in micro:
                loss = model(**model_inputs(b, num_items_in_batch=n, model=model)).loss
                loss.backward()
                step_loss += float(loss.detach())
            optimizer.step()
            optimizer.zero_grad()
            micro = []
            losses.append(round(step_loss, 4))
            if len(losses) == args.steps // 2:
                state = loader.state_dict()  # save with the model checkpoint
            if len(losses) == args.steps:
                break
    resumed = neat_vlm_graph(data, processor, config=config)
    resumed.load_state_dict(state)
    again: list[torch.Tensor] = []
    while len(again) < len(after_state):  # a state saved at an epoch's end resumes there
        for batch in resumed:
            again.append(batch["input_ids"])
            if len(again) == len(after_state):
                break
    print(
        json.dumps(
            {
                "steps": len(losses),
                "losses": losses,
                "resumed_epoch": resumed.epoch,
                "resumed_identical": all(
                    torch.equal(a, b) for a, b in zip(after_state, again, strict=True)
                ),
                "utilization": round(loader.stats.utilization(), 4),
            }
        )
    )


if __name__ == "__main__":
    main()
