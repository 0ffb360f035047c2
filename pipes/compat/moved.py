"""Module paths from before the layout by stage (issue #26), kept importable.

Until the layout by stage, every module of ``neatpack.pipes`` sat in one flat folder
(``neatpack.pipes.read``, ``neatpack.pipes.collate``, ...) and the graphs' runtime and command
modules sat in ``neatpack.graphs``. Code written against those paths keeps working: importing an
old path gives the module at its new place (the same module object, so ``mock.patch`` and
``isinstance`` see one thing). New code imports the new paths or the package's exports.

>>> import neatpack.pipes.read as old, neatpack.pipes.reading.read as new
>>> old is new
True
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Mapping, Sequence
from types import ModuleType

__all__ = ["MOVED_GRAPHS", "MOVED_PIPES", "MovedModules", "install_moved_modules"]

#: old module of ``neatpack.pipes`` -> its path under ``neatpack.pipes`` now
MOVED_PIPES: dict[str, str] = {
    "_conversation": "reading._conversation",
    "_estimate_raw": "indexing._estimate_raw",
    "_media_meta": "indexing._media_meta",
    "_record": "reading._record",
    "_template_probe": "indexing._template_probe",
    "_tensors": "materializing._tensors",
    "audio": "reading.audio",
    "binpack": "planning.binpack",
    "block_mask": "collating.block_mask",
    "boundaries": "collating.boundaries",
    "collate": "collating.collate",
    "collate_family": "collating.collate_family",
    "collate_media": "collating.collate_media",
    "context_parallel": "parallel.context_parallel",
    "cu_seqlens": "collating.cu_seqlens",
    "doc_ids": "collating.doc_ids",
    "estimate": "indexing.estimate",
    "estimate_types": "indexing.estimate_types",
    "exact_lengths": "indexing.exact_lengths",
    "expand_tokens": "collating.expand_tokens",
    "formats": "reading.formats",
    "handler_lengths": "indexing.handler_lengths",
    "index_split": "indexing.index_split",
    "index_workers": "indexing.index_workers",
    "labels": "materializing.labels",
    "leak_probe": "collating.leak_probe",
    "length_source": "indexing.length_source",
    "lengths": "indexing.lengths",
    "loss": "materializing.loss",
    "mask": "collating.mask",
    "mask_format": "collating.mask_format",
    "materialize": "materializing.materialize",
    "media": "reading.media",
    "media_policy": "reading.media_policy",
    "media_stamp": "indexing.media_stamp",
    "media_tokens": "indexing.media_tokens",
    "mixture": "mixtures.mixture",
    "mixture_plan": "mixtures.mixture_plan",
    "mixture_report": "mixtures.mixture_report",
    "mixture_source": "mixtures.mixture_source",
    "mrope": "materializing.mrope",
    "npz_files": "reading.npz_files",
    "overlong": "indexing.overlong",
    "pack": "materializing.pack",
    "packed_dataset": "compat.packed_dataset",
    "pad_packs": "collating.pad_packs",
    "plan": "planning.plan",
    "pp_family_media": "parallel.pp_family_media",
    "pp_media": "parallel.pp_media",
    "read": "reading.read",
    "record_reader": "reading.record_reader",
    "remote": "reading.remote",
    "robust_collate": "collating.robust_collate",
    "sample_collate": "collating.sample_collate",
    "sample_media": "materializing.sample_media",
    "sampler": "planning.sampler",
    "seed_compat": "compat.seed_compat",
    "shards": "reading.shards",
    "source": "planning.source",
    "synth": "testing.synth",
    "tar_index": "reading.tar_index",
    "text_pack": "compat.text_pack",
    "text_pieces": "indexing.text_pieces",
    "text_positions": "collating.text_positions",
    "tiny": "testing.tiny",
    "tiny_hybrid_models": "testing.tiny_hybrid_models",
    "tiny_models": "testing.tiny_models",
    "tokenize": "materializing.tokenize",
    "transfer": "materializing.transfer",
    "varlen_attention": "collating.varlen_attention",
    "video": "reading.video",
}
#: old module of ``neatpack.graphs`` -> its path under ``neatpack.graphs`` now
MOVED_GRAPHS: dict[str, str] = {
    "cli": "command.cli",
    "cli_inputs": "command.cli_inputs",
    "data_metrics": "runtime.data_metrics",
    "dist": "runtime.dist",
    "graph_state": "runtime.graph_state",
    "heap": "runtime.heap",
    "loader": "runtime.loader",
    "mixture_cli": "command.mixture_cli",
    "pictures": "command.pictures",
    "report": "command.report",
    "stages": "runtime.stages",
    "watchdog": "runtime.watchdog",
}


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A finder that answers ``<package>.<old>`` with the module now at ``<package>.<new>``."""

    def __init__(self, package: str, table: Mapping[str, str]) -> None:
        self.package, self.table = package, dict(table)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        old = fullname.removeprefix(self.package + ".")
        if old == fullname or old not in self.table:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # the default module; exec_module swaps in the real one

    def exec_module(self, module: ModuleType) -> None:
        old = module.__name__.removeprefix(self.package + ".")
        # importlib returns what sys.modules holds after exec_module: the real module
        sys.modules[module.__name__] = importlib.import_module(f"{self.package}.{self.table[old]}")


def install_moved_modules(package: str, table: Mapping[str, str]) -> None:
    """Answer ``package``'s old module paths from now on (once per package)."""
    for finder in sys.meta_path:
        if isinstance(finder, MovedModules) and finder.package == package:
            return
    sys.meta_path.append(MovedModules(package, table))
