"""The single-process torch reference of a whole MoE block: the oracle every fast path is compared to.

    x [T, D] --route--> topk_ids [T, K], topk_weights [T, K]
      --(Kimi-K3) latent_down--> z [T, L]
      --routed experts, weighted sum over the K slots in fp32, slot order 0..K-1--> routed [T, Dx]
      --(Kimi-K3) RMSNorm over the full sum, latent_up--> [T, D]
      --+ shared experts (fp32 add)--> y [T, D] in x's dtype

``moe_block`` is the composition; it takes the routed step as a function so the EP layer reuses the
same composition with its dispatch/experts/combine path, and ``routed_experts_reference`` is the
one-process routed step.
"""
from __future__ import annotations

from typing import Callable

import torch

from moe_ref.activations import dense_mlp
from moe_ref.config import MoEConfig
from moe_ref.router import route
from moe_ref.weights import MoEWeights

# (expert input [T, Dx], topk_ids [T, K] int64, topk_weights [T, K] fp32) -> routed sum [T, Dx] in input dtype
RoutedFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def routed_experts_reference(
    x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
    gate_up_weight_E2FD: torch.Tensor, down_weight_EDF: torch.Tensor, activation: str = "silu",
    situ_beta: float = 4.0, situ_linear_beta: float = 25.0,
) -> torch.Tensor:
    """``y[t] = sum_j w[t, j] * Expert_{ids[t, j]}(x[t])`` over all E experts in one process.

    Args:
        x_TD: ``[T, D]`` expert input.
        topk_ids_TK: ``[T, K]`` int64, -1 = masked slot (skipped).
        topk_weights_TK: ``[T, K]`` fp32.
        gate_up_weight_E2FD, down_weight_EDF: all experts' weights.

    Returns:
        ``[T, D]`` in ``x_TD``'s dtype. Each expert output is rounded to ``x_TD``'s dtype (as it is when it
        crosses ranks), weighted and summed in fp32 in slot order.
    """
    num_tokens, num_topk = topk_ids_TK.shape
    expert_out_KTD = torch.zeros(num_topk, num_tokens, x_TD.shape[1], dtype=x_TD.dtype, device=x_TD.device)
    for expert in torch.unique(topk_ids_TK[topk_ids_TK >= 0]).tolist():
        token_idx, slot_idx = (topk_ids_TK == expert).nonzero(as_tuple=True)
        expert_out_KTD[slot_idx, token_idx] = dense_mlp(
            x_TD[token_idx], gate_up_weight_E2FD[expert], down_weight_EDF[expert], activation, situ_beta,
            situ_linear_beta)
    y_TD = torch.zeros(num_tokens, x_TD.shape[1], dtype=torch.float32, device=x_TD.device)
    for slot in range(num_topk):
        live_T = topk_ids_TK[:, slot] >= 0
        y_TD += torch.where(live_T[:, None], topk_weights_TK[:, slot, None] * expert_out_KTD[slot].float(), 0.0)
    return y_TD.to(x_TD.dtype)


def rms_norm(x_TL: torch.Tensor, weight_L: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, output in ``x_TL``'s dtype."""
    x32 = x_TL.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight_L.float()).to(x_TL.dtype)


def moe_block(x_TD: torch.Tensor, weights: MoEWeights, cfg: MoEConfig, routed_fn: RoutedFn,
              *, check_finite: bool = True) -> torch.Tensor:
    """Run one MoE block: route, (latent down), ``routed_fn``, (norm, latent up), + shared experts.

    Returns ``[T, D]`` in ``x_TD``'s dtype.
    """
    topk_ids_TK, topk_weights_TK = route(x_TD, weights.gate_weight_ED, cfg, weights.bias_E, check_finite=check_finite)
    expert_in = x_TD if cfg.latent_dim is None else x_TD @ weights.latent_down_weight_LD.t().to(x_TD.dtype)
    routed = routed_fn(expert_in, topk_ids_TK, topk_weights_TK)
    if cfg.latent_dim is not None:
        if cfg.latent_norm:
            routed = rms_norm(routed, weights.latent_norm_weight_L, cfg.rms_norm_eps)
        routed = routed @ weights.latent_up_weight_DL.t().to(routed.dtype)
    if not cfg.has_shared_experts:
        return routed
    shared_TD = dense_mlp(x_TD, weights.shared_gate_up_weight_2SD, weights.shared_down_weight_DS, cfg.activation,
                          cfg.situ_beta, cfg.situ_linear_beta)
    return (routed.float() + shared_TD.float()).to(x_TD.dtype)


def reference_moe(x_TD: torch.Tensor, weights: MoEWeights, cfg: MoEConfig) -> torch.Tensor:
    """The whole block in one process with all experts (``weights`` must hold every expert)."""
    def routed(x, ids, w):
        return routed_experts_reference(x, ids, w, weights.gate_up_weight_E2FD, weights.down_weight_EDF,
                                        cfg.activation, cfg.situ_beta, cfg.situ_linear_beta)
    return moe_block(x_TD, weights, cfg, routed)
