"""Spies: a function replaced by one that notes each call, then calls the real one.

The distributed index tests count what crosses between ranks (``dist.all_gather_object``) and
which shards a rank scans (``shards.index_tar``); the varlen-attention tests record the
boundaries every kernel call gets. Each wrote its own wrapper; ``spy`` is the one they share::

    >>> from types import SimpleNamespace
    >>> ops = SimpleNamespace(add=lambda a, b: a + b)
    >>> seen = spy(ops, "add", lambda a, b: (a, b))
    >>> ops.add(3, 4), seen
    (7, [(3, 4)])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


def spy(
    owner: Any,
    name: str,
    note: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch | None = None,
) -> list[Any]:
    """Replace ``owner.name`` by a wrapper that appends ``note(*args, **kwargs)`` to the list
    returned here, then calls the real function. With ``monkeypatch`` the real one comes back
    after the test; without (a spawned rank's process), it stays replaced."""
    seen: list[Any] = []
    real = getattr(owner, name)

    def noted(*args: Any, **kwargs: Any) -> Any:
        seen.append(note(*args, **kwargs))
        return real(*args, **kwargs)

    if monkeypatch is None:
        setattr(owner, name, noted)
    else:
        monkeypatch.setattr(owner, name, noted)
    return seen


def attention_call(
    q: Any, k: Any, v: Any, cu: Any, causal: bool, scale: Any
) -> tuple[bool, int, list[int]]:
    """(causal, tokens, boundaries) of a call into the varlen kernel (or its CPU reference)."""
    return causal, int(q.shape[0]), [int(c) for c in cu]
