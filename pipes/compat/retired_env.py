"""Environment variables that once switched worker-side machinery and are no longer read (#26).

Two of them became config fields (a choice a user makes); setting one now raises, naming the
field, because the job asked for a behaviour it would otherwise silently not get (a fork where
``spawn`` was needed can hang). The two malloc opt-outs are gone (the tuning never lost in the
measurements, docs/reliability.md); setting one warns, since the job runs as well without
it and there is nothing to move it to::

    NEATPACK_INDEX_START=spawn   ->  NeatVLMConfig(index_start_method="spawn")
    NEATPACK_WORKER_ARENA=0      ->  NeatVLMConfig(worker_transfer="torch")

>>> import os
>>> check_retired_env("NEATPACK_INDEX_START")  # not set: nothing to say
>>> os.environ["NEATPACK_INDEX_START"] = "spawn"
>>> check_retired_env("NEATPACK_INDEX_START")  # doctest: +ELLIPSIS
Traceback (most recent call last):
RuntimeError: NEATPACK_INDEX_START='spawn' is no longer read: ... index_start_method ...
>>> del os.environ["NEATPACK_INDEX_START"]
"""

from __future__ import annotations

import os
import warnings
from typing import Final

__all__ = ["RETIRED_ENV", "check_retired_env"]

#: variable -> (what replaced it, whether setting it is an error rather than a warning)
RETIRED_ENV: Final[dict[str, tuple[str, bool]]] = {
    "NEATPACK_INDEX_START": (
        "the length index's start method is the config field index_start_method "
        "(NeatVLMConfig, GroupedConfig; build_length_index(start_method=...))",
        True,
    ),
    "NEATPACK_WORKER_ARENA": (
        "how worker batches reach the trainer is the config field worker_transfer "
        '(NeatVLMConfig, NeatLLMConfig, GroupedConfig; map_stage(transfer=...)): "torch" for '
        'torch\'s own path (what NEATPACK_WORKER_ARENA=0 did), "segment" (the default) for reused '
        "shared-memory segments",
        True,
    ),
    "NEATPACK_WORKER_MALLOC": (
        "loader workers always keep freed memory (1.25-1.6x tokens/s with the same peak RSS, "
        "docs/reliability.md); there is no switch",
        False,
    ),
    "NEATPACK_MAIN_MALLOC": (
        "with num_workers=0 a step always reuses freed heap memory while it runs (0.64-0.72x -> "
        "0.95-1.19x the bare processor's rate, docs/reliability.md); there is no switch",
        False,
    ),
}


def check_retired_env(*names: str) -> None:
    """Raise (``RuntimeError``) or warn (``UserWarning``) for each of ``names`` that is set in
    the environment, saying what replaced it; nothing when none is set."""
    for name in names:
        value = os.environ.get(name)
        if value is None:
            continue
        instead, fatal = RETIRED_ENV[name]
        message = f"{name}={value!r} is no longer read: {instead}. Unset {name}."
        if fatal:
            raise RuntimeError(message)
        warnings.warn(message, UserWarning, stacklevel=3)
