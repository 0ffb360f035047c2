"""Rank and world size: explicit arguments win; only graph builders read torch.distributed."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["resolve_rank"]


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world_size)`` from the arguments, else the initialized process group, else (0, 1).

    >>> resolve_rank(1, 4)
    (1, 4)
    """
    if rank is None or world_size is None:
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
        else:
            rank = 0 if rank is None else rank
            world_size = 1 if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got {rank=} {world_size=}")
    return rank, world_size
