"""Step3 (model_type ``step3_text``; the VL wrapper ``step3_vl`` carries it as ``text_config``).

Router: softmax over all experts, top-k, renormalised only if ``norm_expert_weight``; no bias, no groups, no
scaling. Experts: SwiGLU, stored stacked per layer (``moe.gate_proj.weight [E, F, D]``, ``moe.up_proj.weight``,
``moe.down_proj.weight [E, D, F]``); one shared expert of ``share_expert_dim`` under ``share_expert.``. MoE layers:
``moe_layers_enum``. Step3 has no transformers module: the facts come from its model card and SGLang's model code.

Shape legend: E experts, D hidden width, F expert intermediate.
"""
from __future__ import annotations

from moe_ref.core.families.base import ExpertRule, Family, Key, MoELayers, RouterRule, SharedRule, TensorLayout
from moe_ref.core.families.layouts import shared_mlp

STEP3 = Family(
    name="step3",
    model_types=("step3_text", "step3"),
    models="Step3",
    num_experts=Key(("moe_num_experts",)),
    num_topk=Key(("moe_top_k",)),
    router=RouterRule(scoring="softmax", renormalize=Key(("norm_expert_weight",), False)),
    experts=ExpertRule(intermediate_size=Key(("moe_intermediate_size",))),
    shared=SharedRule(count=None, size=Key(("share_expert_dim",), 0)),
    moe_layers=MoELayers("enum", (("enum", Key(("moe_layers_enum",), "")),)),
    layouts=(TensorLayout(
        name="hub", module="moe", router="moe.gate.weight", experts="stacked", gate="moe.gate_proj.weight",
        up="moe.up_proj.weight", down="moe.down_proj.weight", **shared_mlp("share_expert.")),),
)
