"""Train a tiny real Qwen2-VL for a few steps on neatpack batches, checkpoint, resume.

    python examples/train_tiny.py --steps 6

Everything is local: generated data, the embedded tiny processor, a randomly initialised tiny
model built from a config. Prints one JSON line with the losses.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch

from neatpack.graphs import NeatVLMConfig, neat_vlm_graph
from neatpack.graphs.train import model_inputs
from neatpack.pipes.synth import write_corpus
from neatpack.pipes.tiny import load_tiny_processor
from neatpack.pipes.tiny_models import tiny_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--attn", default="sdpa")
    args = parser.parse_args()
    torch.manual_seed(0)
    root = tempfile.mkdtemp(prefix="neatpack-train-")
    data = write_corpus(root, num_samples=48)
    processor = load_tiny_processor("qwen2_vl")
    config = NeatVLMConfig(
        pack_size=1024, batch_size=2, media_root=f"{root}/media", attn_implementation=args.attn
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
    while len(losses) < args.steps:
        for batch in loader:
            loss = model(**model_inputs(batch)).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(round(float(loss.detach()), 4))
            if len(losses) == args.steps // 2:
                state = loader.state_dict()  # save with the model checkpoint
            if len(losses) == args.steps:
                break
    resumed = neat_vlm_graph(data, processor, config=config)
    resumed.load_state_dict(state)
    print(
        json.dumps(
            {
                "steps": len(losses),
                "losses": losses,
                "resumed_epoch": resumed.epoch,
                "utilization": round(loader.stats.utilization(), 4),
            }
        )
    )


if __name__ == "__main__":
    main()
