"""NeMo AutoModel's own config loader builds neatpack loaders from a recipe YAML, in a process
of its own (importing AutoModel patches transformers; the test process stays clean)::

    python tests/support/automodel_yaml_run.py recipe.yaml metrics.jsonl

The YAML's ``dataloader:`` section is instantiated the way a recipe does it
(``load_yaml_config`` then ``ConfigNode.instantiate``, runtime arguments as keywords). The last
stdout line is one JSON object: the loader's config, an epoch logged with its data metrics
through AutoModel's ``MetricLogger`` (the JSONL at the second argument), its epoch's batches
(input ids, labels and sample ids per row), the batches of a run resumed from a
``torch.save``-d mid-epoch state, the same for rank 1 of 2, what rank 1 does with rank 0's
state, and AutoModel's own VLM recipe config resolving the same section.
"""

from __future__ import annotations

import io
import json
import sys
from typing import Any

import torch
from nemo_automodel.components.config.loader import load_yaml_config

from neatpack.graphs import NeatLoader


def rows(batch: dict[str, Any]) -> list[dict[str, Any]]:
    """What the parent compares: each row's real tokens, its labels and its samples."""
    out = []
    for b, pack in enumerate(batch["packs"]):
        out.append(
            {
                "input_ids": batch["input_ids"][b].tolist(),
                "labels": batch["labels"][b].tolist(),
                "sample_ids": [int(s) for s in pack["sample_ids"]],
                "padded": bool(pack.get("padded", False)),
            }
        )
    return out


def saved(loader: NeatLoader) -> dict[str, Any]:
    """The state as a recipe's checkpoint holds it: through ``torch.save`` and back."""
    buf = io.BytesIO()
    torch.save(loader.state_dict(), buf)
    buf.seek(0)
    state: dict[str, Any] = torch.load(buf, weights_only=False)
    return state


def epoch_then_resume(build: Any, stop: int) -> tuple[list[Any], list[Any], list[Any]]:
    """A whole epoch; the same run stopped after ``stop`` batches; a fresh loader resumed."""
    full = [rows(b) for b in build()]
    first = build()
    it = iter(first)
    head = [rows(next(it)) for _ in range(stop)]
    state = saved(first)
    first.close()
    resumed = build()
    resumed.load_state_dict(state)
    tail = [rows(b) for b in resumed]
    return full, head, tail


def main(path: str, log_path: str) -> None:
    cfg = load_yaml_config(path)
    node = cfg.dataloader
    loader = node.instantiate()
    out: dict[str, Any] = {"type": type(loader).__name__, "config": loader.config}
    # one epoch logged the way the recipe's log_train_metrics does, with the data figures
    # merged as the guide says, through AutoModel's own JSONL metric logger
    from nemo_automodel.components.loggers.metric_logger import MetricLogger, MetricsSample

    out["logged"] = []
    with MetricLogger(log_path, append=False, buffer_size=1) as metric_logger:
        for step, batch in enumerate(loader):
            tokens = int(batch["num_label_tokens"])
            log_data = MetricsSample(step, loader.epoch, {"num_label_tokens": tokens})
            log_data.metrics.update(loader.data_metrics())  # the guide's one line
            metric_logger.log(log_data)
            out["logged"].append(rows(batch))
    loader.close()
    out["full"], out["head"], out["tail"] = epoch_then_resume(node.instantiate, 2)
    # two data-parallel ranks, under the recipe's runtime names: rank 1 resumes from its own
    # state; rank 0's state (what a recipe saves of a non-StatefulDataLoader) is refused
    rank = [lambda r=r: node.instantiate(dp_rank=r, dp_world_size=2) for r in (0, 1)]
    out["rank1_full"], out["rank1_head"], out["rank1_tail"] = epoch_then_resume(rank[1], 1)
    r0 = rank[0]()
    next(iter(r0))
    state = saved(r0)
    r0.close()
    r1 = rank[1]()
    try:
        r1.load_state_dict(state)
        out["rank0_state_in_rank1"] = [rows(b) for b in r1]
    except Exception as exc:
        out["rank0_state_in_rank1"] = f"{type(exc).__name__}: {exc}"
    # AutoModel's own VLM recipe config, given the same section as its dataloader
    from nemo_automodel.recipes._typed_config import RecipeConfig

    try:
        RecipeConfig.resolve_vlm_dataloader(
            {"_target_": "neatpack.graphs.open_source"}, load_yaml_config(path).dataloader
        )
        out["recipe_refusal"] = None
    except Exception as exc:  # the refusal the docs quote
        out["recipe_refusal"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
