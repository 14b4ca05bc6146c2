"""OLMoE (model_type ``olmoe``; OLMoE-1B-7B).

Router (transformers ``OlmoeTopKRouter``): softmax over all experts, top-k, renormalised if ``norm_topk_prob``; no
bias, no groups, no scaling. Experts: SwiGLU of ``intermediate_size`` (OLMoE has one width); no shared expert.
Every decoder layer is an MoE layer. Names as Qwen's (``mlp.gate.weight``, ``mlp.experts.{e}.*_proj.weight``).

Shape legend: E experts, D hidden width, F expert intermediate.
"""
from __future__ import annotations

from moe_ref.core.families.base import ExpertRule, Family, Key, RouterRule
from moe_ref.core.families.layouts import mlp_layouts

OLMOE = Family(
    name="olmoe",
    model_types=("olmoe",),
    models="OLMoE",
    num_experts=Key(("num_experts", "num_local_experts")),
    num_topk=Key(("num_experts_per_tok",)),
    router=RouterRule(scoring="softmax", renormalize=Key(("norm_topk_prob",), False)),
    experts=ExpertRule(intermediate_size=Key(("intermediate_size",))),
    layouts=mlp_layouts(router="mlp.gate.weight"),
)
