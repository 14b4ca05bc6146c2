"""The single-process torch reference of a whole MoE block: the oracle every fast path is compared to.

    x [T, D] --route--> topk_ids [T, K], topk_weights [T, K]
      --(Kimi-K3) latent_down--> z [T, L]
      --routed experts, weighted sum over the K slots in fp32, slot order 0..K-1--> routed [T, Dx]
      --(Kimi-K3) RMSNorm over the full sum, latent_up--> [T, D]
      --+ shared experts (fp32 add)--> y [T, D] in x's dtype

``routed_experts_reference`` is the one-process routed step; ``reference_moe`` plugs it into
``moe_ref.block.moe_block``, the same composition the EP layer uses around its routed step.
"""
from __future__ import annotations

import torch

from moe_ref.core.activations import dense_mlp
from moe_ref.block import moe_block
from moe_ref.core.config import MoEConfig
from moe_ref.core.weights import MoEWeights


def routed_experts_reference(
    x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
    gate_up_weight_E2FD: torch.Tensor, down_weight_EDF: torch.Tensor, activation: str = "silu",
    situ_beta: float = 4.0, situ_linear_beta: float = 25.0, *, swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0, gate_up_bias_E2F: torch.Tensor | None = None, down_bias_ED: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y[t] = sum_j w[t, j] * Expert_{ids[t, j]}(x[t])`` over all E experts in one process.

    Args:
        x_TD: ``[T, D]`` expert input.
        topk_ids_TK: ``[T, K]`` int64, -1 = masked slot (skipped).
        topk_weights_TK: ``[T, K]`` fp32.
        gate_up_weight_E2FD, down_weight_EDF: all experts' weights.
        activation, situ_beta, situ_linear_beta, swiglu_alpha, swiglu_limit: see ``moe_ref.core.activations``.
        gate_up_bias_E2F, down_bias_ED: all experts' biases ``[E, 2F]``, ``[E, D]`` (gpt-oss), or None.

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
            situ_linear_beta, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
            gate_up_bias_2S=None if gate_up_bias_E2F is None else gate_up_bias_E2F[expert],
            down_bias_D=None if down_bias_ED is None else down_bias_ED[expert])
    y_TD = torch.zeros(num_tokens, x_TD.shape[1], dtype=torch.float32, device=x_TD.device)
    for slot in range(num_topk):
        live_T = topk_ids_TK[:, slot] >= 0
        y_TD += torch.where(live_T[:, None], topk_weights_TK[:, slot, None] * expert_out_KTD[slot].float(), 0.0)
    return y_TD.to(x_TD.dtype)


def reference_moe(x_TD: torch.Tensor, weights: MoEWeights, cfg: MoEConfig) -> torch.Tensor:
    """The whole block in one process with all experts (``weights`` must hold every expert)."""
    def routed(x, ids, w):
        return routed_experts_reference(x, ids, w, weights.gate_up_weight_E2FD, weights.down_weight_EDF,
                                        cfg.activation, cfg.situ_beta, cfg.situ_linear_beta,
                                        swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit,
                                        gate_up_bias_E2F=weights.gate_up_bias_E2F, down_bias_ED=weights.down_bias_ED)
    return moe_block(x_TD, weights, cfg, routed)
