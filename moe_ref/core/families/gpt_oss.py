"""gpt-oss (model_type ``gpt_oss``; gpt-oss-20b/120b, plain bf16 weights).

Router (transformers ``GptOssTopKRouter``): ``logits = x @ router.weight^T + router.bias``; top-k over the logits;
the weights are a softmax over the K chosen logits (no renormalisation needed, no scaling, no groups).
Experts (``GptOssExperts``): ``gate_up = x @ gate_up_proj[e] + gate_up_proj_bias[e]`` with gate and up interleaved
along the output (gate j at column 2j, up j at 2j + 1); ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``,
``h = (u + 1) * g * sigmoid(alpha * g)`` (``swiglu_alpha`` 1.702, ``swiglu_limit`` 7.0: moe_ref's ``swigluoai``);
``y = h @ down_proj[e] + down_proj_bias[e]``. The weights are stored for ``x @ W``: ``gate_up_proj [E, D, 2F]``,
``down_proj [E, F, D]`` (the loader transposes and de-interleaves them into the canonical layout). No shared
expert; every layer is an MoE layer. The published gpt-oss checkpoints store the experts MXFP4
(``gate_up_proj_blocks`` / ``_scales``): moe_ref reads the plain (bf16/fp32) form only.

Shape legend: E experts, D hidden width, F expert intermediate.
"""
from __future__ import annotations

from moe_ref.core.families.base import ExpertRule, Family, Key, RouterRule, TensorLayout

GPT_OSS = Family(
    name="gpt_oss",
    model_types=("gpt_oss",),
    models="gpt-oss",
    num_experts=Key(("num_local_experts", "num_experts")),
    num_topk=Key(("num_experts_per_tok",)),
    router=RouterRule(scoring="topk_softmax", router_bias=True),
    experts=ExpertRule(intermediate_size=Key(("intermediate_size",)), activation="swigluoai", bias=True,
                       swiglu_alpha=Key(("swiglu_alpha",), 1.702), swiglu_limit=Key(("swiglu_limit",), 7.0)),
    layouts=(TensorLayout(
        name="hub", module="mlp", router="mlp.router.weight", router_bias="mlp.router.bias",
        experts="stacked_gate_up", gate_up="mlp.experts.gate_up_proj", down="mlp.experts.down_proj",
        transposed=True, interleaved=True, gate_up_bias="mlp.experts.gate_up_proj_bias",
        down_bias="mlp.experts.down_proj_bias"),),
)
