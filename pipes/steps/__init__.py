"""The worker-side steps of a packed graph, as public, picklable step objects.

A prebuilt graph runs ``StepChain(PerPack(PackMaterializer(...)), Collater(...))`` over each
batch of pack references in worker processes: the same objects a user chains by hand, with
their own steps in between (a pack augmentation, a batch transform) or one of them replaced.
Each step is a plain callable ``item -> item`` with no state, so the chain can run in any worker
and be recomputed after a resume. Stateful work belongs in a node in the main process.

    pack refs [r0, r1]                                   (from Batcher(PackSource))
      PerPack(PackMaterializer)   -> [pack0, pack1]      each pack carries "meta"
                                                         (its Materializer shifts each
                                                         sample with Shifter, replaceable)
      PerPack(my_pack_step)       -> [pack0', pack1']    optional user step
      Collater                    -> batch               batch["packs"] = [meta0, meta1]
        = PackPadder              -> batch               padded; doc ids in attention_mask
        + MaskConverter           -> batch               doc ids -> sdpa / eager / flex mask
      PPMediaSplitter             -> batch               media chunked per PP micro-batch

``batch["packs"]`` is the bookkeeping ``NeatLoader`` advances its cursor and ledger with: a
collate of your own must keep it (``pack_meta`` builds one entry).
"""

from __future__ import annotations

from .chain import StepChain
from .collater import Collater
from .conversation_tokenizer import ConversationTokenizer
from .mask_converter import MASK_CONVERSIONS as MASK_CONVERSIONS
from .mask_converter import MaskConverter
from .materializer import PackMaterializer
from .meta import META_KEY as META_KEY
from .meta import pack_meta
from .pack_padder import PackPadder
from .pad_collater import PadCollater
from .per_pack import PerPack
from .pp_split import PPMediaSplitter
from .sample_reader import SampleReader
from .shifter import Shifter

__all__ = [
    "Collater",
    "ConversationTokenizer",
    "MaskConverter",
    "PPMediaSplitter",
    "PackMaterializer",
    "PackPadder",
    "PadCollater",
    "PerPack",
    "SampleReader",
    "Shifter",
    "StepChain",
    "pack_meta",
]
