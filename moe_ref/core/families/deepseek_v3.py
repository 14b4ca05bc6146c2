"""DeepSeek-V3/R1, Kimi-K2/K2.5 and GLM-4.5/4.6 (``glm4_moe``): one router rule, one set of tensor names.

Router (transformers ``DeepseekV3TopkRouter`` / ``Glm4MoeTopkRouter``): ``sigmoid(logits)``; the selection adds
``e_score_correction_bias``; grouped top-k keeps ``topk_group`` of ``n_group`` groups, each scored by the sum of its
top-2 selection scores (other groups' experts masked with -inf); the weights are the unbiased scores of the K
chosen, renormalised (``norm_topk_prob``, +1e-20) and times ``routed_scaling_factor``. ``topk_method`` (DeepSeek's
own config field; transformers ignores it and always runs noaux_tc) may say ``greedy`` (no bias, no groups).
Experts: SwiGLU; ``n_shared_experts`` shared experts of ``moe_intermediate_size`` each, fused into one MLP.
MoE layers: from ``first_k_dense_replace`` on (every ``moe_layer_freq``-th).

The families differ only in their configuration classes' defaults (GLM-4.5: one group, scaling 1.0, first dense
layer 1), which matter for a config.json that leaves a field out.

Shape legend: E experts, D hidden width, F expert intermediate.
"""
from __future__ import annotations

import dataclasses

from moe_ref.core.families.base import ExpertRule, Family, Key, MoELayers, RouterRule, SharedRule
from moe_ref.core.families.layouts import mlp_layouts, shared_mlp

DEEPSEEK_V3 = Family(
    name="deepseek_v3",
    model_types=("deepseek_v3",),
    models="DeepSeek-V3/R1",
    num_experts=Key(("n_routed_experts", "num_local_experts")),
    num_topk=Key(("num_experts_per_tok",)),
    router=RouterRule(
        scoring=Key(("scoring_func",), "sigmoid"), topk_method=Key(("topk_method",), "noaux_tc"),
        num_groups=Key(("n_group",), 8), num_topk_groups=Key(("topk_group",), 4),
        renormalize=Key(("norm_topk_prob",), True), routed_scaling_factor=Key(("routed_scaling_factor",), 2.5)),
    experts=ExpertRule(intermediate_size=Key(("moe_intermediate_size",))),
    shared=SharedRule(count=Key(("n_shared_experts",), 1)),
    moe_layers=MoELayers("first_k_dense", (("first_dense", Key(("first_k_dense_replace",), 3)),
                                           ("freq", Key(("moe_layer_freq",), 1)))),
    layouts=mlp_layouts(router="mlp.gate.weight", selection_bias="mlp.gate.e_score_correction_bias",
                        **shared_mlp("mlp.shared_experts.")),
)

# Kimi-K2 ships DeepseekV3ForCausalLM under its own model_type (K2.5 wraps it as text_config): same facts
KIMI_K2 = dataclasses.replace(DEEPSEEK_V3, name="kimi_k2", model_types=("kimi_k2",), models="Kimi-K2/K2.5")

GLM4_MOE = dataclasses.replace(
    DEEPSEEK_V3, name="glm4_moe", model_types=("glm4_moe",), models="GLM-4.5/4.6",
    num_experts=Key(("n_routed_experts", "num_local_experts")),
    router=RouterRule(
        scoring="sigmoid", topk_method="noaux_tc", num_groups=Key(("n_group",), 1),
        num_topk_groups=Key(("topk_group",), 1), renormalize=Key(("norm_topk_prob",), True),
        routed_scaling_factor=Key(("routed_scaling_factor",), 1.0)),
    experts=ExpertRule(intermediate_size=Key(("moe_intermediate_size",))),
    moe_layers=MoELayers("first_k_dense", (("first_dense", Key(("first_k_dense_replace",), 1)),
                                           ("freq", Key(("moe_layer_freq",), 1)))),
)
