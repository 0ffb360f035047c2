"""LengthSource agrees with the length index and passes assert_resumable."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from neatpack.pipes.indexing.estimate import LengthEstimator
from neatpack.pipes.indexing.length_source import LengthSource
from neatpack.pipes.indexing.lengths import build_length_index
from neatpack.pipes.reading.read import JsonlSource
from neatpack.pipes.testing.resume import assert_resumable
from neatpack.pipes.testing.synth import write_corpus
from neatpack.pipes.testing.tiny import load_tiny_processor


def test_stream_equals_index_and_resumes(tmp_path: Path) -> None:
    data = write_corpus(tmp_path, num_samples=12, seed=2)
    source = JsonlSource(data, media_root=tmp_path / "media")
    estimator = LengthEstimator.from_processor(load_tiny_processor())
    index = build_length_index(source, estimator, progress=False)
    items = list(LengthSource(source, estimator))
    assert [i["sample_id"] for i in items] == list(range(12))
    assert np.array_equal([i["total"] for i in items], index.total)
    assert np.array_equal([i["visual"] for i in items], index.visual)
    assert assert_resumable(lambda: LengthSource(source, estimator), epochs=1) == 12
