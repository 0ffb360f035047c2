"""Loader states saved by neatpack before the config groups (commit 6a0a567), for
tests/graphs/test_config_groups.py. Run with the old code: python old_states.py OUT.json"""

import json
import sys
import tempfile

from neatpack.graphs import (
    GroupedConfig,
    NeatLLMConfig,
    NeatVLMConfig,
    grouped_vlm_graph,
    neat_llm_graph,
    neat_vlm_graph,
)
from neatpack.pipes import load_tiny_processor, write_corpus


def records():
    return [{"input_ids": list(range(1, n + 1))} for n in (5, 9, 3, 7, 4, 6, 8, 2, 11, 5)]


def take(loader, n):
    it = iter(loader)
    for _ in range(n):
        next(it)
    return loader.state_dict()


out = {}
out["neat_llm"] = take(neat_llm_graph(records(), config=NeatLLMConfig(pack_size=16)), 2)
out["neat_llm_cp"] = take(
    neat_llm_graph(records(), config=NeatLLMConfig(pack_size=16, cp_size=2)), 1
)
root = tempfile.mkdtemp()
data = write_corpus(root, num_samples=12, seed=3)
proc = load_tiny_processor()
vcfg = NeatVLMConfig(pack_size=1024, media_root=f"{root}/media")
out["neat_vlm"] = take(neat_vlm_graph(data, proc, config=vcfg), 2)
gcfg = GroupedConfig(batch_size=2, media_root=f"{root}/media")
out["grouped"] = take(grouped_vlm_graph(data, proc, config=gcfg), 2)
with open(sys.argv[1], "w") as f:
    json.dump(out, f, indent=1, sort_keys=True)
print({k: v["config"] for k, v in out.items()})
