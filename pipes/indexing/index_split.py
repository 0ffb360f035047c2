"""How an index build is split: slices cut at shard boundaries, collectives on a CPU side group.

The length index (``pipes/indexing/lengths.py``) and the tar offset index
(``pipes/reading/shards.py``) are
built once, split over ranks (and, within a rank, over processes), then all-gathered so that
every rank holds the whole index. Two rules:

* **Whole shards per part.** The even split ``[N*k//P, N*(k+1)//P)`` is moved to the nearest
  shard start, so each part reads whole shards (one open object, sequential reads) instead of
  the tail of one shard and the head of the next. 10 samples in shards of 4, 4, 2 over 2
  parts: the even cut 5 moves to the shard start 4::

      >>> split_points(10, 2, [0, 4, 8, 10])
      [0, 4, 10]
      >>> split_points(10, 2)
      [0, 5, 10]

* **Never the default group.** Under an NCCL default group, ``all_gather_object`` moves its
  pickles through GPU memory on the device ``torch.cuda.set_device`` chose; the index build
  needs neither. Its collectives run on a gloo group over the same ranks, made once per
  process group (``dist.new_group(backend="gloo")``, a collective every rank reaches in the
  same order: the first index build).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

__all__ = ["initialized_dist", "side_group", "split_points"]

_SIDE_GROUPS: dict[int, Any] = {}


def split_points(n: int, parts: int, boundaries: Sequence[int] | None = None) -> list[int]:
    """``parts + 1`` cut points over ``0..n``, each inner cut at the shard start (in
    ``boundaries``) nearest the even cut; parts may be empty when shards are few."""
    if parts < 1:
        raise ValueError(f"{parts=} must be >= 1")
    even = [n * k // parts for k in range(parts + 1)]
    if not boundaries:
        return even
    starts = sorted({0, n, *(int(b) for b in boundaries if 0 <= int(b) <= n)})
    inner = [_nearest(starts, e) for e in even[1:-1]]
    return list(itertools.accumulate([0, *inner, n], max))


def _nearest(starts: list[int], target: int) -> int:
    return min(starts, key=lambda s: (abs(s - target), s))


def side_group(group: Any = None) -> Any:
    """A gloo group for the index build's collectives: ``group`` itself when it is gloo,
    else (``None``: the world) a gloo group over the world's ranks, made once and cached.

    A non-gloo subgroup is refused: making its gloo twin is a collective over the whole world
    that only its members would reach. Pass ``dist.new_group(ranks, backend="gloo")``."""
    import torch.distributed as dist

    if group is not None:
        backend = dist.get_backend(group)
        if backend != "gloo":
            raise ValueError(
                f"the index build's group has backend {backend!r}; pass a gloo group "
                "(dist.new_group(ranks, backend='gloo')) or None for the whole world"
            )
        return group
    world = dist.group.WORLD
    key = id(world)
    cached = _SIDE_GROUPS.get(key)
    if cached is not None:
        try:
            dist.get_world_size(cached)
            return cached
        except (RuntimeError, ValueError):  # the world was destroyed and made anew
            pass
    _SIDE_GROUPS[key] = dist.new_group(backend="gloo")
    return _SIDE_GROUPS[key]


def initialized_dist(world_size: int) -> Any:
    """``torch.distributed`` when an index build spans ranks (``world_size > 1``) and a process
    group is up; else None (one rank builds everything)."""
    if world_size <= 1:
        return None
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None
