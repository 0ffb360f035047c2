"""Reading a torchdata graph and its state: its nodes, its shape, the pack source's position.

``NeatLoader`` saves the whole graph's state (``root.state_dict()``, torchdata's nested dicts)
next to its cursor. Three questions about it are answered here:

* where in that state is the ``PackSource``'s position at the last batch handed out
  (``source_state``)? It is the loader's cursor, right even when a node dropped packs;
* does the live graph have the shape the state was saved from (``graph_signature``)? Worker
  stages inline vs in workers, or a prefetcher added, change the nesting of the state;
* which nodes hold state of their own that a resume on another layout would lose
  (``stateful_nodes``)? A node is known to need nothing but the position when it is a torchdata
  plumbing node or a neatpack node, or when its class sets ``ELASTIC = True``.

    state of PackSource -> Batcher -> ParallelMapper(workers) -> Prefetcher:
    {"snapshot": {"it_state": {"snapshot": {"source": {<PackSource state>}},
                               "steps_since_snapshot": 0}},
     "steps_since_snapshot": 0}
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torchdata.nodes import BaseNode, Batcher, ParallelMapper, PinMemory, Prefetcher, Unbatcher

from neatpack.pipes.planning.source import PackSource

__all__ = ["graph_nodes", "graph_signature", "source_state", "stateful_nodes"]

_PLUMBING: tuple[type[Any], ...] = (
    Batcher,
    ParallelMapper,
    PinMemory,
    Prefetcher,
    Unbatcher,
    PackSource,
)
_SOURCE_KEYS = (PackSource.VERSION_KEY, PackSource.FINGERPRINT_KEY, PackSource.CURSOR_KEY)


def graph_nodes(root: BaseNode[Any]) -> list[tuple[str, BaseNode[Any]]]:
    """Every node reachable from ``root`` through its attributes, as ``(path, node)``, once."""
    seen: set[int] = set()
    out: list[tuple[str, BaseNode[Any]]] = []

    def visit(path: str, node: BaseNode[Any]) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        if not _internal(node):
            out.append((path, node))
        for name, value in sorted(vars(node).items(), key=lambda kv: (kv[0][:1] == "_", kv[0])):
            for i, child in enumerate(_children(value)):
                visit(f"{path}.{name}" + (f"[{i}]" if isinstance(value, (list, tuple)) else ""),
                      child)  # fmt: skip

    visit("root", root)
    return out


def _children(value: Any) -> Iterator[BaseNode[Any]]:
    if isinstance(value, BaseNode):
        yield value
    elif isinstance(value, (list, tuple)):
        yield from (v for v in value if isinstance(v, BaseNode))
    elif isinstance(value, dict):
        yield from (v for v in value.values() if isinstance(v, BaseNode))


def _internal(node: BaseNode[Any]) -> bool:
    """torchdata's private iterator classes (``_ParallelMapperImpl`` ...): part of their node."""
    cls = type(node)
    return cls.__module__.startswith("torchdata.") and cls.__name__.startswith("_")


def graph_signature(root: BaseNode[Any]) -> list[str]:
    """The node classes in walk order (a worker stage marked inline or workers)."""
    sig = []
    for _, node in graph_nodes(root):
        name = type(node).__qualname__
        if isinstance(node, ParallelMapper):
            name += "/workers" if node.num_workers > 0 else "/inline"
        sig.append(name)
    return sig


def stateful_nodes(root: BaseNode[Any]) -> list[tuple[str, BaseNode[Any]]]:
    """Nodes whose state is more than the position (neither plumbing nor ``ELASTIC = True``)."""
    return [
        (path, node)
        for path, node in graph_nodes(root)
        if not isinstance(node, _PLUMBING) and not getattr(node, "ELASTIC", False)
    ]


def source_state(tree: Any) -> dict[str, Any] | None:
    """The ``PackSource`` state inside a graph state, or None when there is none or it lags
    behind the items handed out (a snapshot taken every k > 1 items leaves
    ``steps_since_snapshot`` > 0: the position is then not known from the state alone)."""
    if not isinstance(tree, dict):
        return None
    if all(k in tree for k in _SOURCE_KEYS):
        return tree
    if int(tree.get("steps_since_snapshot", 0) or 0) > 0:
        return None
    for value in tree.values():
        found = source_state(value)
        if found is not None:
            return found
    return None
