"""Model families: one module per family in this folder, and the ``Handler`` registry.

Every fact about a family lives on its ``Handler``, defined and registered in the family's own
module (``gemma3.py`` is all of Gemma 3): how to tokenize a record, its length estimate, its
model-free positions, how a batch's media merge, its packed attention mask, the axis its media
items lie on for pipeline parallelism, and why the graph refuses it (if it does). The generic
code (``materialize``, ``handler_lengths``, ``collate_family``, ``pp_family_media``,
``graphs/families``) asks the handler; adding a family is one ``register_handler`` call
(``docs/families.md``, "Adding a family"). ``Handler`` and the lookup (``get_handler``,
``resolve_handler``, ``HANDLERS``) are defined in ``registry.py`` and exported here; the family
modules import them from there, so no module imports this package back.

>>> sorted(HANDLERS)  # doctest: +NORMALIZE_WHITESPACE
['chat_template', 'gemma3', 'gemma4', 'idefics3', 'kimi_k25', 'llava_onevision',
 'nemotron_omni', 'phi4', 'prompt_answer', 'qwen3_omni', 'qwen_omni', 'qwen_vl', 'smolvlm', 'step3']
"""

from __future__ import annotations

# The built-in families register themselves when their module is imported.
from . import (
    chat_template,
    gemma3,
    gemma4,
    idefics3,
    kimi,
    llava_onevision,
    nemotron_omni,
    phi4,
    prompt_answer,
    qwen3_omni,
    qwen_omni,
    qwen_vl,
    smolvlm,
    step3,
)
from .registry import (
    HANDLERS,
    PROCESSOR_HANDLERS,
    EstimateFn,
    EstimatorFactory,
    Handler,
    PositionsFn,
    get_handler,
    packed_model_inputs,
    register_handler,
    resolve_handler,
    tokenize_with_handler,
)

__all__ = [
    "HANDLERS",
    "PROCESSOR_HANDLERS",
    "EstimateFn",
    "EstimatorFactory",
    "Handler",
    "PositionsFn",
    "chat_template",
    "gemma3",
    "gemma4",
    "get_handler",
    "idefics3",
    "kimi",
    "llava_onevision",
    "nemotron_omni",
    "packed_model_inputs",
    "phi4",
    "prompt_answer",
    "qwen3_omni",
    "qwen_omni",
    "qwen_vl",
    "register_handler",
    "resolve_handler",
    "smolvlm",
    "step3",
    "tokenize_with_handler",
]
