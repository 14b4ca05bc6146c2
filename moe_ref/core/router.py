"""Router semantics: logits -> top-k expert ids and weights, in torch (the reference; ``kernels.router_topk``
is its fused Triton twin, ``ops.select_experts`` picks one, ``block.route`` runs the gate GEMM + top-k).

    logits [T, E] fp32 --score--> scores [T, E] --(+bias, groups)--> selection [T, E]
        --top-k--> topk_ids [T, K] int64 --gather unbiased scores, renorm, scale--> topk_weights [T, K] fp32

Shape legend: T tokens, E experts, G expert groups, Eg experts per group (E / G), K top-k.

Family semantics (see ``MoEConfig`` and ``moe_ref.core.families``):
- softmax over all experts, top-k (Step3, Qwen2/Qwen3-MoE, OLMoE, Mixtral, HunYuan; renormalised or not);
  Ernie-4.5 adds its ``e_score_correction_bias`` for the selection only.
- DeepSeek-V3 / Kimi-K2 / K3 / GLM-4.5 ("noaux_tc") = sigmoid; ``e_score_correction_bias`` is added for
  *selection only*; grouped top-k scores each group by the sum of its top-2 selection scores (``top2_sum``) and
  keeps ``num_topk_groups`` groups; weights are the unbiased sigmoid scores, renormalised with a 1e-20 guard,
  times ``routed_scaling_factor``.
- DeepSeek-V2 "group_limited_greedy" = softmax; a group scores its best expert (``max``).
- gpt-oss (``topk_softmax``) = top-k over the logits themselves (its router bias already added to them by the
  caller, ``block.route_unchecked``), the weights a softmax over the K chosen logits.

NOTE: experts of dropped groups are excluded with -inf, as DeepSeek's own inference code, vLLM and
transformers 5.x do (older transformers filled 0.0, which differs once a negative bias pushes a kept
expert's selection score below 0; tests/unit/test_hf_parity.py pins the agreement with transformers).

Slot order is deterministic: descending selection score, ties broken by the lower expert id.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from moe_ref.core.errors import NonFiniteError
from moe_ref.core.fixed_chunks import in_fixed_chunks


class RouterOutput(NamedTuple):
    topk_ids_TK: torch.Tensor  # [T, K] int64, expert ids in [0, E)
    topk_weights_TK: torch.Tensor  # [T, K] float32


def select_experts(
    logits_TE: torch.Tensor,
    num_topk: int,
    scoring: str = "sigmoid",
    bias_E: torch.Tensor | None = None,
    num_groups: int = 1,
    num_topk_groups: int = 1,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    group_score: str = "top2_sum",
) -> RouterOutput:
    """Top-k routing of each token over E experts.

    Args:
        logits_TE: ``[T, E]`` router logits, any float dtype (computed in fp32).
        num_topk: K, experts per token.
        scoring: ``"sigmoid"``, ``"softmax"`` (softmax over all E experts) or ``"topk_softmax"`` (the logits
            select; the weights are a softmax over the K chosen logits).
        bias_E: ``[E]`` selection-only bias (``e_score_correction_bias``), or None.
        num_groups, num_topk_groups: grouped top-k (G groups of E/G experts, keep the best ones).
        renormalize: divide the K weights by their sum (+1e-20).
        routed_scaling_factor: multiplies the final weights.
        group_score: what ranks a group: ``"top2_sum"`` (the sum of its two best selection scores) or ``"max"``
            (its best one).

    Returns:
        ``RouterOutput(topk_ids_TK [T, K] int64, topk_weights_TK [T, K] float32)``.
    """
    num_tokens, num_experts = logits_TE.shape
    logits_TE = logits_TE.float()
    if scoring == "sigmoid":  # in fixed chunks: a token's bits do not depend on T (moe_ref.core.fixed_chunks)
        scores_TE = in_fixed_chunks(torch.sigmoid, logits_TE)
    elif scoring == "softmax":
        scores_TE = logits_TE.softmax(dim=-1)
    else:  # topk_softmax: the logits themselves select
        scores_TE = logits_TE
    selection_TE = scores_TE if bias_E is None else scores_TE + bias_E.float()[None, :]
    if num_groups > 1:
        grouped_TGEg = selection_TE.view(num_tokens, num_groups, num_experts // num_groups)
        top2_TG2 = grouped_TGEg.topk(min(2, grouped_TGEg.shape[-1]), dim=-1).values
        group_scores_TG = top2_TG2[..., 0] + top2_TG2[..., 1] if top2_TG2.shape[-1] == 2 and \
            group_score == "top2_sum" else top2_TG2[..., 0]
        # Stable descending sort: ties keep the lower group id, like the expert ties below.
        kept_groups = torch.sort(group_scores_TG, dim=-1, descending=True, stable=True).indices[:, :num_topk_groups]
        keep_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, kept_groups, True)
        keep_TE = keep_TG.repeat_interleave(num_experts // num_groups, dim=1)
        selection_TE = selection_TE.masked_fill(~keep_TE, float("-inf"))
    topk_ids_TK = torch.sort(selection_TE, dim=-1, descending=True, stable=True).indices[:, :num_topk]
    topk_weights_TK = scores_TE.gather(1, topk_ids_TK)
    if scoring == "topk_softmax":  # exp(l - max) / sum over the K chosen logits, summed slot by slot
        topk_weights_TK = in_fixed_chunks(torch.exp, topk_weights_TK - topk_weights_TK.max(dim=-1, keepdim=True).values)
        denominator_T = torch.zeros(num_tokens, dtype=torch.float32, device=logits_TE.device)
        for slot in range(num_topk):
            denominator_T = denominator_T + topk_weights_TK[:, slot]
        topk_weights_TK = topk_weights_TK / denominator_T[:, None]
    if renormalize:
        weight_sum_T = torch.zeros(num_tokens, dtype=torch.float32, device=logits_TE.device)
        for slot in range(num_topk):  # slot by slot: the Triton kernel's order, so the two agree bitwise
            weight_sum_T = weight_sum_T + topk_weights_TK[:, slot]
        topk_weights_TK = topk_weights_TK / (weight_sum_T + 1e-20)[:, None]
    topk_weights_TK = topk_weights_TK * routed_scaling_factor
    return RouterOutput(topk_ids_TK.to(torch.int64), topk_weights_TK.float())


def router_logits(x_TD: torch.Tensor, gate_weight_ED: torch.Tensor) -> torch.Tensor:
    """``[T, D] x [E, D] -> [T, E]`` logits in fp32 (the gate GEMM runs in fp32, as the families do)."""
    return torch.nn.functional.linear(x_TD.float(), gate_weight_ED.float())


def non_finite_logits_error(logits_TE: torch.Tensor) -> NonFiniteError | None:
    """``NonFiniteError`` (INP004, not raised) naming the tokens whose logits hold NaN/inf, or None.

    NOTE: syncs the host with the device once.
    """
    if logits_TE.numel() == 0 or bool(torch.isfinite(logits_TE).all()):
        return None
    bad = (~torch.isfinite(logits_TE)).any(dim=1).nonzero().flatten()
    return NonFiniteError(f"router logits are NaN/inf for {bad.numel()} of {logits_TE.shape[0]} tokens (first token "
                          f"indices: {bad[:8].tolist()}); the hidden states or gate weight hold non-finite values")
