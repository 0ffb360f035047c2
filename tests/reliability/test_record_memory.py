"""What one long record costs in memory, measured in a fresh process through ``neat_vlm_graph``
(the default exact length index): tokenized whole, a 4.1 MB text grew the process by 576 MB;
in pieces (``pipes/indexing/text_pieces.py``) by 73 MB, mostly its ids."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import json, resource, sys, warnings
from neatpack.graphs.neat_vlm import NeatVLMConfig, neat_vlm_graph
from neatpack.pipes.testing.tiny import load_tiny_processor

processor = load_tiny_processor()
processor.apply_chat_template([{"role": "user", "content": "warm up"}], tokenize=False)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the overlong summary: dropped, counted below
    loader = neat_vlm_graph(sys.argv[1], processor, config=NeatVLMConfig(
        pack_size=1024, overlong="drop", index_workers=0))
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
list(loader)
print(json.dumps({"grew_mb": grew / 1024, "overlong": loader.ledgers[0].overlong}))
"""


def test_a_long_record_costs_its_pieces_not_its_whole_text(tmp_path: Path) -> None:
    text = "The quick brown fox jumps over the lazy dog again. " * 80_000  # 4.1 MB
    rows = [
        [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}],
        [{"role": "user", "content": "Summarize."}, {"role": "assistant", "content": text}],
    ]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(data)], capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["overlong"] == [1]  # measured exactly, then dropped by the policy, counted
    assert got["grew_mb"] < 300, got  # whole: 576 MB; in 64 KiB pieces: 73 MB
