"""Ernie-4.5 MoE text models (model_type ``ernie4_5_moe``; ERNIE-4.5-21B-A3B, 300B-A47B).

Router (transformers ``Ernie4_5_MoeTopKRouter``): ``softmax(logits)`` over all experts; the selection adds
``moe_statics.e_score_correction_bias`` (stored ``[1, E]``); the weights are the unbiased softmax scores of the K
chosen, renormalised by their sum clamped below at ``moe_norm_min`` (1e-12; moe_ref adds 1e-20 instead: the same
fp32 value whenever the sum exceeds 1e-12, always for a softmax over E <= 10**11 experts). Experts: SwiGLU of
``moe_intermediate_size``; ``moe_num_shared_experts`` shared experts of that size fused into one MLP. MoE layers:
``(i + 1) % moe_layer_interval == 0`` within ``[moe_layer_start_index, moe_layer_end_index]`` (-1: the last).
Names: the Hub's ``mlp.moe_statics.e_score_correction_bias``; transformers 5.x holds it as
``mlp.gate.moe_statics.e_score_correction_bias``.

Shape legend: E experts, D hidden width, F expert intermediate.
"""
from __future__ import annotations

from moe_ref.core.families.base import ExpertRule, Family, Key, MoELayers, RouterRule, SharedRule
from moe_ref.core.families.layouts import mlp_layouts, shared_mlp

ERNIE4_5_MOE = Family(
    name="ernie4_5_moe",
    model_types=("ernie4_5_moe",),
    models="ERNIE-4.5-MoE",
    num_experts=Key(("moe_num_experts", "num_experts")),
    num_topk=Key(("moe_k", "num_experts_per_tok")),
    router=RouterRule(scoring="softmax", selection_bias=True, renormalize=True),
    experts=ExpertRule(intermediate_size=Key(("moe_intermediate_size",))),
    shared=SharedRule(count=Key(("moe_num_shared_experts",), 2)),
    moe_layers=MoELayers("interval", (("start", Key(("moe_layer_start_index",), 1)),
                                      ("end", Key(("moe_layer_end_index",), -1)),
                                      ("interval", Key(("moe_layer_interval",), 1)))),
    layouts=mlp_layouts(
        router="mlp.gate.weight", selection_bias="mlp.moe_statics.e_score_correction_bias",
        fused_overrides=dict(selection_bias="mlp.gate.moe_statics.e_score_correction_bias"),
        **shared_mlp("mlp.shared_experts.")),
    unsupported=(("use_bias", False, "biases on the MLPs' Linear layers (the shared experts' too)"),),
)
