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
Each family's helpers (``gemma3_estimator``, ``kimi_k25_pack_media``, ...) are exported here
too: ``from neatpack.pipes.families import gemma3_estimator``.

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

# The registry, and each family's own helpers (neatpack.pipes exports them too).
from .chat_template import default_estimate, tokenize_default
from .gemma3 import gemma3_estimator, gemma3_pan_and_scan
from .gemma4 import GEMMA4_THINKING_PREFIX, gemma4_estimate, inject_thinking_prefix
from .kimi import kimi_k25_fixed_length_batch, kimi_k25_pack_media
from .nemotron_omni import nemotron_omni_estimate, nemotron_omni_pack_media, tokenize_nemotron_omni
from .phi4 import phi4_estimate, phi4_pack_media, tokenize_phi4
from .prompt_answer import prompt_answer_length, tokenize_prompt_answer
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
from .smolvlm import smolvlm_estimate, tokenize_smolvlm
from .step3 import step3_estimate, step3_pack_media, step3_pp_media

__all__ = [
    "GEMMA4_THINKING_PREFIX",
    "HANDLERS",
    "PROCESSOR_HANDLERS",
    "EstimateFn",
    "EstimatorFactory",
    "Handler",
    "PositionsFn",
    "chat_template",
    "default_estimate",
    "gemma3",
    "gemma3_estimator",
    "gemma3_pan_and_scan",
    "gemma4",
    "gemma4_estimate",
    "get_handler",
    "idefics3",
    "inject_thinking_prefix",
    "kimi",
    "kimi_k25_fixed_length_batch",
    "kimi_k25_pack_media",
    "llava_onevision",
    "nemotron_omni",
    "nemotron_omni_estimate",
    "nemotron_omni_pack_media",
    "packed_model_inputs",
    "phi4",
    "phi4_estimate",
    "phi4_pack_media",
    "prompt_answer",
    "prompt_answer_length",
    "qwen3_omni",
    "qwen_omni",
    "qwen_vl",
    "register_handler",
    "resolve_handler",
    "smolvlm",
    "smolvlm_estimate",
    "step3",
    "step3_estimate",
    "step3_pack_media",
    "step3_pp_media",
    "tokenize_default",
    "tokenize_nemotron_omni",
    "tokenize_phi4",
    "tokenize_prompt_answer",
    "tokenize_smolvlm",
    "tokenize_with_handler",
]
