"""The tensor layouts most families share: the Hub's per-expert ``gate_proj``/``up_proj``/``down_proj`` names and
transformers 5.x's fused experts, both under ``mlp.`` (transformers' ``qwen2_moe`` conversion recipe, which
DeepSeek-V2/V3, GLM-4.5, Qwen3-MoE, Ernie-4.5, HunYuan and OLMoE reuse).

Shape legend: E experts, D hidden width, F expert intermediate.
"""
from __future__ import annotations

import dataclasses

from moe_ref.core.families.base import TensorLayout

# hub: one nn.Linear per expert, [F, D] / [F, D] / [D, F]
PER_EXPERT = dict(experts="per_expert", gate="mlp.experts.{expert}.gate_proj.weight",
                  up="mlp.experts.{expert}.up_proj.weight", down="mlp.experts.{expert}.down_proj.weight")
# transformers 5.x: gate_up_proj [E, 2F, D] (gate rows, then up rows), down_proj [E, D, F]
FUSED = dict(experts="stacked_gate_up", gate_up="mlp.experts.gate_up_proj", down="mlp.experts.down_proj")


def shared_mlp(module: str) -> dict[str, str]:
    """The names of a shared MLP module (``mlp.shared_experts.``, ``mlp.shared_expert.``, ``share_expert.``)."""
    return dict(shared_gate=f"{module}gate_proj.weight", shared_up=f"{module}up_proj.weight",
                shared_down=f"{module}down_proj.weight")


def mlp_layouts(fused_overrides: dict[str, str] | None = None, **names) -> tuple[TensorLayout, TensorLayout]:
    """``(hub, fused)`` layouts of a block under ``mlp.``: the per-expert and the fused expert names plus ``names``
    (router, biases, shared MLP; relative to the decoder layer), which both layouts share unless
    ``fused_overrides`` renames one in the fused layout."""
    hub = TensorLayout(name="hub", module="mlp", **PER_EXPERT, **names)
    fused = TensorLayout(name="fused", module="mlp", **FUSED, **names)
    return hub, dataclasses.replace(fused, **(fused_overrides or {}))
