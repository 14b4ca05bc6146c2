"""Qwen2-MoE / Qwen1.5-MoE (model_type ``qwen2_moe``).

Router: as Qwen3-MoE (softmax over all experts, top-k, renormalised if ``norm_topk_prob``). Experts: SwiGLU of
``moe_intermediate_size``. One shared expert of ``shared_expert_intermediate_size`` (``mlp.shared_expert.``) whose
output is scaled per token by ``sigmoid(x @ shared_expert_gate^T)`` (``shared_expert_gate.weight [1, D]``) before
it joins the routed sum (transformers ``Qwen2MoeSparseMoeBlock``). MoE layers: Qwen's ``decoder_sparse_step`` and
``mlp_only_layers``.

Shape legend: E experts, D hidden width, F expert intermediate, S shared-MLP intermediate.
"""
from __future__ import annotations

from moe_ref.core.families.base import ExpertRule, Family, Key, RouterRule, SharedRule
from moe_ref.core.families.layouts import mlp_layouts, shared_mlp
from moe_ref.core.families.qwen3_moe import SPARSE_STEP

QWEN2_MOE = Family(
    name="qwen2_moe",
    model_types=("qwen2_moe",),
    models="Qwen2-MoE/Qwen1.5-MoE",
    num_experts=Key(("num_experts",)),
    num_topk=Key(("num_experts_per_tok",)),
    router=RouterRule(scoring="softmax", renormalize=Key(("norm_topk_prob",), False)),
    experts=ExpertRule(intermediate_size=Key(("moe_intermediate_size",))),
    shared=SharedRule(count=None, size=Key(("shared_expert_intermediate_size",)), gate=True),
    moe_layers=SPARSE_STEP,
    layouts=mlp_layouts(router="mlp.gate.weight", shared_expert_gate="mlp.shared_expert_gate.weight",
                        **shared_mlp("mlp.shared_expert.")),
)
