"""DeepSeek-V2 / V2-Lite / V2.5 (model_type ``deepseek_v2``).

Router (DeepSeek's ``MoEGate``; transformers ``DeepseekV2TopkRouter``): ``softmax(logits)`` over all experts, then
by ``topk_method``: ``greedy`` = plain top-k; ``group_limited_greedy`` = keep the ``topk_group`` best of ``n_group``
groups, a group scored by its best expert (max), then top-k among the kept. No selection bias. The weights are the
chosen scores, renormalised only if ``norm_topk_prob`` (DeepSeek's code; transformers 5.x never renormalises here,
the published configs say false), times ``routed_scaling_factor``. Experts: SwiGLU; ``n_shared_experts`` shared
experts of ``moe_intermediate_size`` fused into one MLP. MoE layers: from ``first_k_dense_replace`` on, every
``moe_layer_freq``-th.

Shape legend: E experts, D hidden width, F expert intermediate.
"""
from __future__ import annotations

from moe_ref.core.families.base import ExpertRule, Family, Key, MoELayers, RouterRule, SharedRule
from moe_ref.core.families.layouts import mlp_layouts, shared_mlp

DEEPSEEK_V2 = Family(
    name="deepseek_v2",
    model_types=("deepseek_v2",),
    models="DeepSeek-V2/V2-Lite/V2.5",
    num_experts=Key(("n_routed_experts", "num_experts")),
    num_topk=Key(("num_experts_per_tok",)),
    router=RouterRule(
        scoring="softmax", topk_method=Key(("topk_method",), "greedy"),
        num_groups=Key(("n_group",), 1), num_topk_groups=Key(("topk_group",), 1),
        renormalize=Key(("norm_topk_prob",), False), routed_scaling_factor=Key(("routed_scaling_factor",), 1.0)),
    experts=ExpertRule(intermediate_size=Key(("moe_intermediate_size",))),
    shared=SharedRule(count=Key(("n_shared_experts",), 2)),
    moe_layers=MoELayers("first_k_dense", (("first_dense", Key(("first_k_dense_replace",), 0)),
                                           ("freq", Key(("moe_layer_freq",), 1)))),
    layouts=mlp_layouts(router="mlp.gate.weight", **shared_mlp("mlp.shared_experts.")),
    unsupported=(("mlp_bias", False, "biases on every MLP's Linear layers (the shared experts' too)"),),
)
