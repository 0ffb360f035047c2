"""A plan in a file, mapped by every process of a node: one copy of the plan per node.

``plan_packs`` gives every rank the same plan, and its sample ids are one int32 per planned
sample (400 MB at 100M samples): eight ranks each holding their own copy would hold 3.2 GB of
the same bytes. ``shared_plan(cache_dir, ...)`` plans once per node instead: the first process
to ask takes an exclusive lock on ``plan-<fingerprint>.lock``, plans, and writes
``plan-<fingerprint>.npz`` atomically; it and every later process map that file read-only
(``npz_files.map_npz``), so the page cache holds one copy for the node. A torn or corrupt
file (checksum) is planned and written again; a folder that cannot be written falls back to
planning in memory (``built_once``).

    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> plan = shared_plan(folder, [5, 4, 3, 3, 2], 8)
    >>> type(plan.ids).__name__, plan.packs()
    ('MappedArray', [[4], [1, 3], [0, 2]])
    >>> shared_plan(folder, [5, 4, 3, 3, 2], 8).fingerprint == plan.fingerprint
    True
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from neatpack.pipes.planning.plan import (
    PackPlan,
    plan_fingerprint,
    plan_images,
    plan_packs,
    plan_supervised,
)
from neatpack.pipes.reading.built_once import built_once
from neatpack.pipes.reading.npz_files import checksum, map_npz, write_npz
from neatpack.pipes.reading.verified import verify_once

__all__ = ["load_plan", "save_plan", "shared_plan"]

_ARRAYS = ("offsets", "ids", "totals", "visual", "dropped_ids", "truncated_ids")
_SCALARS = ("capacity", "packing_ratio", "group_size", "seed", "shuffle", "fingerprint", "balance")
_LAYOUT = 1


# the stamps of mapped lengths, by their place in their cache file (file identity included):
# a process plans for its first loader and again to resume, 0.2 CPU-s each at 100M samples
_STAMPS: dict[tuple[Any, ...], list[int]] = {}


def _lengths_stamp(lengths: npt.ArrayLike, options: dict[str, Any]) -> list[int]:
    """Count and sums of the lengths a plan was made from: a plan file found by a ``key`` must
    match them too (a hand-made index reusing a fingerprint gets its own plan, not this one)."""
    visual = options.get("visual")
    key = (getattr(lengths, "_where", None), getattr(visual, "_where", None))
    cached = key[0] is not None and (visual is None or key[1] is not None)
    if cached and key in _STAMPS:
        stamp = list(_STAMPS[key])
    else:
        total = np.asarray(lengths)
        vis_sum = -1 if visual is None else int(np.asarray(visual).sum())
        stamp = [int(total.shape[0]), int(total.sum()), vis_sum]
        if cached:
            _STAMPS[key] = list(stamp)
    images = _relevant_images(options)
    tail = [] if images is None else [int(images.sum(dtype=np.int64))]  # older stamps unchanged
    supervised = _relevant_supervised(options)
    if supervised is not None:
        tail.append(int(supervised.sum(dtype=np.int64)))
    return [*stamp, *tail]


def _relevant_supervised(options: dict[str, Any]) -> npt.NDArray[Any] | None:
    """The supervised-token counts when the plan depends on them (``plan.plan_supervised``)."""
    supervised = options.get("supervised")
    return plan_supervised(
        None if supervised is None else np.asarray(supervised),
        str(options.get("balance", "tokens")),
    )


def _relevant_images(options: dict[str, Any]) -> npt.NDArray[Any] | None:
    """The media-item counts when the plan depends on them (``plan.plan_images``), else None."""
    images = options.get("images")
    return plan_images(
        None if images is None else np.asarray(images),
        str(options.get("balance", "tokens")),
        options.get("max_images"),
    )


def save_plan(plan: PackPlan, path: str | os.PathLike[str], stamp: list[int] | None = None) -> None:
    """Write ``plan`` to ``path`` atomically (``write_npz``), with a checksum over it."""
    arrays: dict[str, Any] = {name: np.asarray(getattr(plan, name)) for name in _ARRAYS}
    meta = {"layout": _LAYOUT, **{name: getattr(plan, name) for name in _SCALARS}}
    if plan.free_from:  # only when set: other plans' files stay as they were
        meta["free_from"] = plan.free_from
    meta["lengths"] = stamp
    meta["checksum"] = checksum(arrays, meta)
    write_npz(path, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)


def load_plan(
    path: str | os.PathLike[str], fingerprint: str | None = None, stamp: list[int] | None = None
) -> PackPlan:
    """The plan in ``path``, its arrays mapped read-only; ``ValueError`` for a file that is
    absent, torn, corrupt (checksum) or of another plan (``fingerprint``, or ``stamp``: the
    lengths' count and sums)."""
    z = map_npz(path, ("meta", *_ARRAYS), what="plan file")
    try:
        meta = json.loads(bytes(z["meta"]))
        want = meta.pop("checksum")
        if meta.get("layout") != _LAYOUT:
            raise ValueError(f"layout {meta.get('layout')}, not {_LAYOUT}")
        scalars = {name: meta[name] for name in _SCALARS}
        scalars["free_from"] = int(meta.get("free_from", 0))  # absent from older files
    except (ValueError, KeyError) as e:
        raise ValueError(f"plan file {os.fspath(path)} is unreadable: {e!r}") from e
    if fingerprint is not None and scalars["fingerprint"] != fingerprint:
        raise ValueError(f"{path}: plan {scalars['fingerprint']}, not {fingerprint}")
    if stamp is not None and meta.get("lengths") != stamp:
        raise ValueError(f"{path}: planned from lengths {meta.get('lengths')}, not {stamp}")
    arrays = {name: z[name] for name in _ARRAYS}

    def check() -> None:
        if checksum(arrays, meta) != want:
            raise ValueError(f"{path}: checksum mismatch (corrupt plan file)")

    verify_once(path, arrays, check)  # once per node (verified.py)
    return PackPlan(**arrays, **scalars)


def shared_plan(
    cache_dir: str | os.PathLike[str],
    lengths: npt.ArrayLike,
    capacity: int,
    *,
    key: str | None = None,
    **options: Any,
) -> PackPlan:
    """``plan_packs(lengths, capacity, **options)``, planned once per node through
    ``cache_dir`` and mapped from there (module docstring). The same plan, array for array,
    as ``plan_packs`` gives.

    ``key``: a string that already identifies ``lengths`` and ``visual`` (a length index's
    fingerprint): the file is then found by it and the options, without hashing the lengths
    (1.6 GB of int64 at 100M samples, about a second on every rank at every start). None:
    found by the plan's own fingerprint."""
    stamp = _lengths_stamp(lengths, options)
    if key is None:
        fp = plan_fingerprint(lengths, capacity, **options)
    else:
        fp = None
        named = {k: v for k, v in options.items() if k not in ("visual", "images", "supervised")}
        named["visual"] = options.get("visual") is not None  # the key covers the arrays
        if _relevant_images(options) is not None:  # only then: older plan files keep their name
            named["images"] = True
        if _relevant_supervised(options) is not None:  # the key covers them (index fingerprint)
            named["supervised"] = True
        name = json.dumps({"key": key, "capacity": capacity, **named}, sort_keys=True)
        key = hashlib.sha256(name.encode()).hexdigest()
    path = Path(cache_dir) / f"plan-{fp or key}.npz"

    def load() -> PackPlan | None:
        try:
            return load_plan(path, fp, stamp)
        except ValueError:  # absent, torn, corrupt or of another plan: planned again
            return None

    def build() -> PackPlan:
        plan = plan_packs(lengths, capacity, **options)
        try:
            save_plan(plan, path, stamp)
        except OSError:
            return plan
        return load_plan(path, fp, stamp)

    return built_once(path, load, build, in_memory=lambda: plan_packs(lengths, capacity, **options))
