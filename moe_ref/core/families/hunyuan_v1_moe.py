"""Hunyuan MoE (model_type ``hunyuan_v1_moe``; Hunyuan-A13B as transformers reads it).

Router (transformers ``HunYuanMoEV1Gate``): ``gate.wg`` (an fp32 Linear) gives the logits; softmax over all experts,
top-``moe_topk``, always renormalised; no bias, no groups, no scaling. Experts: SwiGLU of ``intermediate_size``; one
shared MLP of ``intermediate_size`` (``mlp.shared_mlp.``) added to the routed sum. Every layer is an MoE layer.
``moe_topk`` and ``num_experts`` may be per-layer lists: moe_ref takes them when every layer has the same value.

Shape legend: E experts, D hidden width, F expert intermediate, S shared-MLP intermediate.
"""
from __future__ import annotations

from moe_ref.core.families.base import ExpertRule, Family, Key, RouterRule, SharedRule
from moe_ref.core.families.layouts import mlp_layouts, shared_mlp

HUNYUAN_V1_MOE = Family(
    name="hunyuan_v1_moe",
    model_types=("hunyuan_v1_moe",),
    models="Hunyuan-A13B",
    num_experts=Key(("num_experts", "num_local_experts")),
    num_topk=Key(("moe_topk", "num_experts_per_tok")),
    router=RouterRule(scoring="softmax", renormalize=True),
    experts=ExpertRule(intermediate_size=Key(("intermediate_size",))),
    shared=SharedRule(count=1, size=Key(("intermediate_size",))),
    layouts=mlp_layouts(router="mlp.gate.wg.weight", **shared_mlp("mlp.shared_mlp.")),
)
