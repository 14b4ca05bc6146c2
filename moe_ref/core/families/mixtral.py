"""Mixtral (model_type ``mixtral``; Mixtral-8x7B/8x22B).

Router (transformers ``MixtralTopKRouter``): softmax over all experts, top-k, always renormalised; no bias, no
groups, no scaling. Experts: SwiGLU of ``intermediate_size`` (one width); no shared expert. Every layer is an MoE
layer. Names: the Hub's ``block_sparse_moe.gate.weight`` and ``block_sparse_moe.experts.{e}.w1`` (gate) / ``w3``
(up) / ``w2`` (down); transformers 5.x renames the block ``mlp.`` and fuses the experts
(``mlp.experts.gate_up_proj``), its ``mixtral`` conversion recipe.

Shape legend: E experts, D hidden width, F expert intermediate.
"""
from __future__ import annotations

from moe_ref.core.families.base import ExpertRule, Family, Key, RouterRule, TensorLayout
from moe_ref.core.families.layouts import FUSED

MIXTRAL = Family(
    name="mixtral",
    model_types=("mixtral",),
    models="Mixtral",
    num_experts=Key(("num_local_experts", "num_experts")),
    num_topk=Key(("num_experts_per_tok",)),
    router=RouterRule(scoring="softmax", renormalize=True),
    experts=ExpertRule(intermediate_size=Key(("intermediate_size",))),
    layouts=(
        TensorLayout(name="hub", module="block_sparse_moe", router="block_sparse_moe.gate.weight",
                     experts="per_expert", gate="block_sparse_moe.experts.{expert}.w1.weight",
                     up="block_sparse_moe.experts.{expert}.w3.weight",
                     down="block_sparse_moe.experts.{expert}.w2.weight"),
        TensorLayout(name="fused", module="mlp", router="mlp.gate.weight", **FUSED),
    ),
)
