"""Qwen3-MoE (model_type ``qwen3_moe``; Qwen3-30B-A3B, Qwen3-235B-A22B).

Router (transformers ``Qwen3MoeTopKRouter``): ``softmax(logits)`` over all experts, top-k, renormalised if
``norm_topk_prob``; no bias, no groups, no scaling. Experts: SwiGLU of ``moe_intermediate_size``; no shared
expert. MoE layers: ``(i + 1) % decoder_sparse_step == 0`` and i not in ``mlp_only_layers``.

Shape legend: E experts, D hidden width, F expert intermediate.
"""
from __future__ import annotations

from moe_ref.core.families.base import ExpertRule, Family, Key, MoELayers, RouterRule
from moe_ref.core.families.layouts import mlp_layouts

SPARSE_STEP = MoELayers("sparse_step", (("step", Key(("decoder_sparse_step",), 1)),
                                        ("dense_list", Key(("mlp_only_layers",), ()))))

QWEN3_MOE = Family(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    models="Qwen3-MoE",
    num_experts=Key(("num_experts", "num_local_experts")),
    num_topk=Key(("num_experts_per_tok",)),
    router=RouterRule(scoring="softmax", renormalize=Key(("norm_topk_prob",), False)),
    experts=ExpertRule(intermediate_size=Key(("moe_intermediate_size",))),
    moe_layers=SPARSE_STEP,
    layouts=mlp_layouts(router="mlp.gate.weight"),
)
