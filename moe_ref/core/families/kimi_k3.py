"""Kimi-K3: a latent MoE with SiTU experts (model_type ``kimi_k3``, fields under ``text_config``).

Router: DeepSeek-V3's rule (sigmoid, ``e_score_correction_bias`` for the selection, grouped top-k by the top-2
sum, renormalised by ``moe_renormalize``, times ``routed_scaling_factor``) under K3's field names. Experts: SiTU,
``beta*tanh(g/beta)*sigmoid(g) * (lb*tanh(u/lb))`` with ``activation_situ_beta`` and
``activation_situ_linear_beta``, on the latent ``x @ latent_down^T`` ``[T, L]``; the routed sum gets RMSNorm
(``latent_moe_use_norm``) after the full cross-rank sum, then ``latent_up``. ``num_shared_experts`` shared experts
of ``moe_intermediate_size`` see the full hidden state. Tensor names follow SGLang's ``KimiK3MoE``
(``block_sparse_moe.``; the latent projections sit there too). K3 has no transformers module: the facts come from
public copies of its config.json and SGLang's model code.

Shape legend: E experts, D hidden width, L latent width, F expert intermediate.
"""
from __future__ import annotations

from moe_ref.core.families.base import (ExpertRule, Family, Key, LatentRule, MoELayers, RouterRule, SharedRule,
                                        TensorLayout)
from moe_ref.core.families.layouts import shared_mlp

_M = "block_sparse_moe."

KIMI_K3 = Family(
    name="kimi_k3",
    model_types=("kimi_k3",),
    models="Kimi-K3",
    num_experts=Key(("num_experts",)),
    num_topk=Key(("num_experts_per_token",)),
    router=RouterRule(
        scoring=Key(("moe_router_activation_func",), "sigmoid"), topk_method=Key(("topk_method",), "noaux_tc"),
        num_groups=Key(("num_expert_group",), 1), num_topk_groups=Key(("topk_group",), 1),
        renormalize=Key(("moe_renormalize",), True), routed_scaling_factor=Key(("routed_scaling_factor",), 1.0)),
    experts=ExpertRule(intermediate_size=Key(("moe_intermediate_size",)), activation=Key(("hidden_act",), "situ"),
                       situ_beta=Key(("activation_situ_beta",), 4.0),
                       situ_linear_beta=Key(("activation_situ_linear_beta",), 25.0)),
    shared=SharedRule(count=Key(("num_shared_experts",), 0)),
    moe_layers=MoELayers("first_k_dense", (("first_dense", Key(("first_k_dense_replace",), 0)),
                                           ("freq", Key(("moe_layer_freq",), 1)))),
    latent=LatentRule(enabled=Key(("use_latent_moe",), True),
                      dim=Key(("latent_moe_dim", "routed_expert_hidden_size", "latent_dim")),
                      norm=Key(("latent_moe_use_norm",), True)),
    layouts=(TensorLayout(
        name="hub", module="block_sparse_moe", router=f"{_M}gate.weight",
        selection_bias=f"{_M}gate.e_score_correction_bias", experts="per_expert",
        gate=f"{_M}experts.{{expert}}.w1.weight", up=f"{_M}experts.{{expert}}.w3.weight",
        down=f"{_M}experts.{{expert}}.w2.weight", **shared_mlp(f"{_M}shared_experts."),
        latent_down=f"{_M}routed_expert_down_proj.weight", latent_up=f"{_M}routed_expert_up_proj.weight",
        latent_norm=f"{_M}routed_expert_norm.weight"),),
)
