"""Model families as data: one ``Family`` record per family, one module per family, one registry list here.

    config.json (model_type) --family_for_model_type--> Family --moe_ref.core.config--> MoEConfig(family=name)
    MoEConfig.family --family_named--> Family --.layouts--> tensor names (moe_ref.checkpoint.loading)

Look-ups:
    ``family_for_model_type("qwen3_moe")`` -> the ``Family`` covering that config.json ``model_type`` (None if none);
    ``family_named(cfg.family)`` -> the ``Family`` of a ``MoEConfig`` (None for ``"custom"``, a block built in code);
    ``supported_model_types()`` -> every model_type read, in registry order.

What a ``Family`` states (``moe_ref.core.families.base`` documents each field): ``model_types``; the config.json
keys and defaults of D, E, K (``Key``: names tried in order, the family's default); ``router`` (``RouterRule``:
softmax | sigmoid | topk_softmax scoring, selection bias, grouped top-k with the top-2-sum or max group score,
renormalisation, routed scaling, router bias); ``experts`` (``ExpertRule``: F's key, activation incl. gpt-oss's
clamped SwiGLU, expert biases); ``shared`` (``SharedRule``: count, width, Qwen2-MoE's sigmoid gate);
``moe_layers`` (``MoELayers``); ``layouts`` (``TensorLayout``: every tensor's name per published layout, the
Hub's first, with gpt-oss's transposed, interleaved gate/up); ``latent`` (Kimi-K3); ``unsupported`` (config
values naming a feature moe_ref does not compute, refused with CFG025).

Adding a family: write ``moe_ref/core/families/<family>.py`` holding one ``Family`` (read the family's modeling and
configuration files for the math, names and defaults), add it to ``FAMILIES`` below, and add its case to
``tests/unit/test_families.py`` (a tiny transformers model of the family against ``MegaMoE``).
"""
from __future__ import annotations

from moe_ref.core.families.base import (TOPK_METHODS, ExpertRule, Family, Key, LatentRule, MoELayers, RouterRule,
                                        SharedRule, TensorLayout)
from moe_ref.core.families.deepseek_v2 import DEEPSEEK_V2
from moe_ref.core.families.deepseek_v3 import DEEPSEEK_V3, GLM4_MOE, KIMI_K2
from moe_ref.core.families.ernie4_5_moe import ERNIE4_5_MOE
from moe_ref.core.families.gpt_oss import GPT_OSS
from moe_ref.core.families.hunyuan_v1_moe import HUNYUAN_V1_MOE
from moe_ref.core.families.kimi_k3 import KIMI_K3
from moe_ref.core.families.mixtral import MIXTRAL
from moe_ref.core.families.olmoe import OLMOE
from moe_ref.core.families.qwen2_moe import QWEN2_MOE
from moe_ref.core.families.qwen3_moe import QWEN3_MOE
from moe_ref.core.families.step3 import STEP3

__all__ = ["FAMILIES", "Family", "Key", "RouterRule", "ExpertRule", "SharedRule", "MoELayers", "LatentRule",
           "TensorLayout", "TOPK_METHODS", "family_for_model_type", "family_named", "supported_model_types"]

# The registry: every family moe_ref reads, in the order messages list them.
FAMILIES: tuple[Family, ...] = (DEEPSEEK_V3, KIMI_K2, GLM4_MOE, KIMI_K3, STEP3, DEEPSEEK_V2, QWEN3_MOE, QWEN2_MOE,
                                MIXTRAL, GPT_OSS, OLMOE, ERNIE4_5_MOE, HUNYUAN_V1_MOE)


def family_for_model_type(model_type: str) -> Family | None:
    """The family covering config.json ``model_type`` (e.g. ``"kimi_k2"``), or None when no family does."""
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def family_named(name: str) -> Family | None:
    """The family whose ``name`` is ``name`` (``MoEConfig.family``), or None (``"custom"``, or unknown)."""
    return next((f for f in FAMILIES if f.name == name), None)


def supported_model_types() -> tuple[str, ...]:
    """Every config.json ``model_type`` a family covers, in registry order."""
    return tuple(t for f in FAMILIES for t in f.model_types)
