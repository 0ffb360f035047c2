"""The package's error types: each names the sample (id, file or value) and the fix.

``RecordError`` (a raw record cannot be read) and its subclass ``EstimateError`` (its length
cannot be estimated) are raised while reading and planning; ``SampleError`` (one sample cannot
be tokenized, with a ``reason`` code from ``REASONS``) while materializing, where
``on_bad_sample`` may skip or replace it.

>>> str(SampleError(17, "missing_file", "cat.jpg does not exist; fix the path"))
'sample_id=17 [missing_file]: cat.jpg does not exist; fix the path'
"""

from __future__ import annotations

import re
from typing import Any, Final

__all__ = ["REASONS", "EmptyConversationError", "EstimateError", "RecordError", "SampleError"]


class RecordError(ValueError):
    """A raw record that cannot be read; the message names the sample id and the fix."""


class EmptyConversationError(RecordError):
    """A record whose conversation is an empty list: nothing to train on, but a length of 0
    to a length heuristic (``LengthGroupedSampler`` orders and counts it instead of stopping)."""


class EstimateError(RecordError):
    """A record whose length cannot be estimated; the message names the sample id."""


REASONS: Final = (
    "bad_record",
    "empty_conversation",
    "unknown_role",
    "bad_block",
    "bad_text",
    "empty_text",
    "no_assistant",
    "missing_file",
    "empty_file",
    "empty_image",
    "corrupt_image",
    "truncated_image",
    "decompression_bomb",
    "bad_media",
    "video_error",
    "media_count_mismatch",
    "placeholder_in_text",
    "special_token_in_text",
    "media_token_mismatch",
    "label_mismatch",
    "processor_error",
)
"""Every ``SampleError.reason`` code."""


class SampleError(ValueError):
    """One sample cannot be tokenized. ``reason`` is one of ``REASONS``; the message names the
    sample id, the offending file or value, and the fix."""

    def __init__(self, sample_id: Any, reason: str | None = None, message: str | None = None):
        if reason is None and message is None and isinstance(sample_id, str):
            # One argument: torchdata's ExceptionWrapper.reraise() (Prefetcher, ParallelMapper)
            # rebuilds the error from its traceback text alone; without this it falls back to
            # a RuntimeError and `except SampleError` misses it. Recover id and reason.
            found = re.search(r"sample_id=(\S+) \[(\w+)\]", sample_id)
            sid = found.group(1) if found else None
            self.sample_id = int(sid) if sid is not None and sid.isdigit() else sid
            self.reason = found.group(2) if found else "processor_error"
            super().__init__(sample_id)
            return
        if reason not in REASONS:
            raise ValueError(f"{reason=} is not one of {REASONS}")
        self.sample_id = sample_id
        self.reason = reason
        super().__init__(f"sample_id={sample_id} [{reason}]: {message}")

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across worker processes
        prefix = f"sample_id={self.sample_id} [{self.reason}]: "
        return (type(self), (self.sample_id, self.reason, str(self).removeprefix(prefix)))
