"""Fused router top-k: every family's rule (``moe_ref.core.families``): sigmoid "noaux_tc" (DeepSeek-V3, Kimi,
GLM-4.5), softmax (Step3, Qwen, Mixtral, OLMoE, Ernie, HunYuan), DeepSeek-V2's max-scored groups, gpt-oss's
softmax over the top-k logits.

    [router_topk] -> pre_dispatch -> dispatch -> grouped_mlp -> combine (partials) -> reduce

Semantics (HF transformers DeepseekV3TopkRouter, with deterministic slot order):
    scores_TE = sigmoid(logits) | softmax(logits over all E) | logits (topk_softmax)     (fp32)
    select_TE = scores_TE + bias_E                                       (bias used for selection only)
    if num_groups > 1: group score = sum of the top-2 select scores in each group of E/num_groups experts
        ("top2_sum"), or its best one ("max"); keep the best `num_topk_groups` groups; experts of other groups
        get select = -inf (HF fills 0.0 instead; the two agree whenever select scores are >= 0, e.g. no or
        positive bias)
    topk_ids_TK = the K experts with the largest select score, slots ordered by descending select score,
        ties broken by the lower expert id (groups likewise)
    topk_weights_TK = scores_TE gathered (UNBIASED); topk_softmax: exp(w - max_k w) / sum_k (slot by slot);
        if renormalize: w / (sum_k w + 1e-20) with the sum taken slot by slot in order; then
        * routed_scaling_factor

Shape legend: T tokens, E experts (global), K top-k, G expert groups.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_ref.core.errors import DTypeError, GroupConfigError, ShapeError, TopKError, UnknownNameError

from moe_ref.kernels.runtime._triton_utils import cdiv, check_device, div_rn, is_interpreter, launch_options, next_power_of_2
from moe_ref.core.router import select_experts
from moe_ref.kernels.runtime.launch import launch

__all__ = ["router_topk", "router_topk_ref"]

_SCORING = {"sigmoid": 0, "softmax": 1, "topk_softmax": 2}
_GROUP_SCORES = ("top2_sum", "max")


@triton.jit
def _router_topk_kernel(
    # pointers
    logits_ptr, bias_ptr, topk_ids_ptr, topk_weights_ptr, nonfinite_ptr,
    # sizes
    T, E, routed_scaling_factor,
    # strides (elements)
    stride_logits_t, stride_ids_t, stride_w_t,
    # meta
    SCORING: tl.constexpr,          # 0: sigmoid; 1: softmax over all E; 2: the logits (softmax over the K chosen)
    HAS_BIAS: tl.constexpr,
    NUM_GROUPS: tl.constexpr,       # G (1 = no group stage)
    GROUP_MAX: tl.constexpr,        # a group's score: its best select score (else the sum of its top 2)
    NUM_TOPK_GROUPS: tl.constexpr,
    NUM_TOPK: tl.constexpr,         # K
    RENORMALIZE: tl.constexpr,
    FLAG_NONFINITE: tl.constexpr,   # raise nonfinite_ptr[0] to 1 when a logit of the tile is NaN/inf
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,          # next_power_of_2(E): all experts in one tile
    BLOCK_K: tl.constexpr,          # next_power_of_2(K)
):
    """One program = BLOCK_T tokens x all E experts; K rounds of argmax pick the experts.

    Example: E=4, K=2, sigmoid, no bias, no groups, renormalize, logits[0] = [0, 2, -1, 2]
        scores = [0.5, 0.881, 0.269, 0.881]; picks expert 1 (tie with 3, lower id first), then 3;
        weights = [0.881, 0.881] / 1.762 = [0.5, 0.5] -> topk_ids[0] = [1, 3], topk_weights[0] = [0.5, 0.5].
    Example (gpt-oss): SCORING=2 (topk_softmax), K=2, logits[0] = [0, 2, -1, 1]: picks 1, then 3;
        weights = softmax([2, 1]) = [0.731, 0.269].
    """
    pid = tl.program_id(0)
    offs_t = (pid * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    mask_t = offs_t < T
    mask_e = offs_e < E
    mask_te = mask_t[:, None] & mask_e[None, :]

    # --- scores (fp32) --------------------------------------------------------------------------
    logits = tl.load(logits_ptr + offs_t[:, None] * stride_logits_t + offs_e[None, :], mask=mask_te,
                     other=float("-inf")).to(tl.float32)
    if FLAG_NONFINITE:
        # x - x is 0 for a finite x and NaN for NaN/inf; == is an ordered compare (False against NaN)
        finite = (logits - logits) == 0.0
        nonfinite = mask_te & (finite == 0)
        if tl.max(tl.max(nonfinite.to(tl.int32), axis=1), axis=0) > 0:
            tl.atomic_max(nonfinite_ptr, 1)
    if SCORING == 1:
        logits_max = tl.max(logits, axis=1)
        logits_max = tl.where(mask_t, logits_max, 0.0)  # rows past T are all -inf
        numer = tl.exp(logits - logits_max[:, None])
        denom = tl.where(mask_t, tl.sum(numer, axis=1), 1.0)
        scores = div_rn(numer, denom[:, None])
    elif SCORING == 0:
        scores = tl.sigmoid(logits)
    else:
        scores = logits
    select = scores
    if HAS_BIAS:
        select = select + tl.load(bias_ptr + offs_e, mask=mask_e, other=0.0).to(tl.float32)[None, :]
    select = tl.where(mask_e[None, :], select, float("-inf"))

    # --- group stage: keep the NUM_TOPK_GROUPS best groups (score = sum of the top-2 in a group, or its max) ---
    if NUM_GROUPS > 1:
        group_size = E // NUM_GROUPS
        group_e = offs_e // group_size
        group_score_te = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
        for g in tl.static_range(NUM_GROUPS):
            in_group = (group_e == g)[None, :]
            values = tl.where(in_group, select, float("-inf"))
            top1 = tl.max(values, axis=1)
            top1_idx = tl.min(tl.where(values == top1[:, None], offs_e[None, :], BLOCK_E), axis=1)
            if GROUP_MAX:
                group_score_te = tl.where(in_group, top1[:, None], group_score_te)
            else:
                top2 = tl.max(tl.where(offs_e[None, :] == top1_idx[:, None], float("-inf"), values), axis=1)
                group_score_te = tl.where(in_group, (top1 + top2)[:, None], group_score_te)
        # rank of each expert's group = number of groups that beat it (higher score, or equal and lower id)
        group_rank_te = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int32)
        for h in tl.static_range(NUM_GROUPS):
            score_h = tl.max(tl.where((group_e == h)[None, :], group_score_te, float("-inf")), axis=1)
            beats = (score_h[:, None] > group_score_te) | ((score_h[:, None] == group_score_te) & (h < group_e[None, :]))
            group_rank_te += beats.to(tl.int32)
        select = tl.where(group_rank_te < NUM_TOPK_GROUPS, select, float("-inf"))

    # --- top-k by repeated argmax (ties -> lower expert id) -------------------------------------------
    offs_k = tl.arange(0, BLOCK_K)
    ids_tk = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int64)
    weights_tk = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    weight_sum = tl.zeros([BLOCK_T], dtype=tl.float32)
    for k in tl.static_range(NUM_TOPK):
        best = tl.max(select, axis=1)
        best_idx = tl.min(tl.where(select == best[:, None], offs_e[None, :], BLOCK_E), axis=1)
        is_best = offs_e[None, :] == best_idx[:, None]
        weight = tl.sum(tl.where(is_best, scores, 0.0), axis=1)
        weight_sum = weight_sum + weight
        ids_tk = tl.where(offs_k[None, :] == k, best_idx.to(tl.int64)[:, None], ids_tk)
        weights_tk = tl.where(offs_k[None, :] == k, weight[:, None], weights_tk)
        select = tl.where(is_best, float("-inf"), select)
    if SCORING == 2:  # softmax over the K chosen logits, the sums slot by slot (the torch twin's order)
        valid_k = (offs_k < NUM_TOPK)[None, :]
        top_max = tl.max(tl.where(valid_k, weights_tk, float("-inf")), axis=1)
        weights_tk = tl.where(valid_k, tl.exp(weights_tk - top_max[:, None]), 0.0)
        denom_k = tl.zeros([BLOCK_T], dtype=tl.float32)
        for k in tl.static_range(NUM_TOPK):
            denom_k = denom_k + tl.sum(tl.where(offs_k[None, :] == k, weights_tk, 0.0), axis=1)
        weights_tk = div_rn(weights_tk, denom_k[:, None])
        weight_sum = tl.zeros([BLOCK_T], dtype=tl.float32)
        for k in tl.static_range(NUM_TOPK):
            weight_sum = weight_sum + tl.sum(tl.where(offs_k[None, :] == k, weights_tk, 0.0), axis=1)
    if RENORMALIZE:
        weights_tk = div_rn(weights_tk, (weight_sum + 1e-20)[:, None])
    weights_tk = weights_tk * routed_scaling_factor

    mask_tk = mask_t[:, None] & (offs_k < NUM_TOPK)[None, :]
    tl.store(topk_ids_ptr + offs_t[:, None] * stride_ids_t + offs_k[None, :], ids_tk, mask=mask_tk)
    tl.store(topk_weights_ptr + offs_t[:, None] * stride_w_t + offs_k[None, :], weights_tk, mask=mask_tk)


def _check_args(logits_TE, num_topk, scoring, bias_E, num_groups, num_topk_groups, group_score="top2_sum") -> None:
    if logits_TE.dim() != 2:
        raise ShapeError(f"logits_TE must be [T, E], got {tuple(logits_TE.shape)}")
    if not logits_TE.is_floating_point():
        raise DTypeError(f"logits_TE must be a float tensor, got {logits_TE.dtype}")
    num_experts = logits_TE.shape[1]
    if scoring not in _SCORING:
        raise UnknownNameError(f"{scoring=} must be one of {sorted(_SCORING)}")
    if group_score not in _GROUP_SCORES:
        raise UnknownNameError(f"{group_score=} must be one of {list(_GROUP_SCORES)}")
    if not 1 <= num_topk <= num_experts:
        raise TopKError(f"{num_topk=} must be in [1, {num_experts=}]")
    if bias_E is not None and tuple(bias_E.shape) != (num_experts,):
        raise ShapeError(f"bias_E must be [{num_experts}], got {tuple(bias_E.shape)}")
    if num_groups < 1 or num_experts % num_groups != 0:
        raise GroupConfigError(f"{num_groups=} must divide {num_experts=}")
    if not 1 <= num_topk_groups <= num_groups:
        raise GroupConfigError(f"{num_topk_groups=} must be in [1, {num_groups=}]")
    if num_groups > 1:
        group_size = num_experts // num_groups
        if group_size < 2 and group_score == "top2_sum":
            raise GroupConfigError(f"top-2-sum group scores need >= 2 experts per group, got {num_experts=} / "
                                   f"{num_groups=}")
        if num_topk > num_topk_groups * group_size:
            raise GroupConfigError(f"{num_topk=} exceeds the experts in the kept groups ({num_topk_groups=} x {group_size=})")


def router_topk(
    logits_TE: torch.Tensor,
    num_topk: int,
    scoring: str = "sigmoid",
    bias_E: torch.Tensor | None = None,
    num_groups: int = 1,
    num_topk_groups: int = 1,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    nonfinite_flag: torch.Tensor | None = None,
    group_score: str = "top2_sum",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Select each token's experts and routing weights (one Triton launch, no host sync).

    Args:
        logits_TE: `[T, E]` float router logits (computed in fp32 inside); E <= 1024 recommended (one tile).
        num_topk: K, experts per token.
        scoring: "sigmoid" (DeepSeek-V3/Kimi), "softmax" over all E (Step3, Qwen, ...) or "topk_softmax" (the
            logits select, the weights are a softmax over the K chosen: gpt-oss).
        bias_E: optional `[E]` float selection bias (`e_score_correction_bias`), not applied to the weights.
        num_groups, num_topk_groups: group-limited routing (n_group, topk_group); 1, 1 = no group stage.
        renormalize: divide the K weights by their sum (+1e-20).
        routed_scaling_factor: multiplies the final weights.
        nonfinite_flag: optional `[1]` int32, zero on entry: set to 1 when any logit is NaN/inf (a device-side
            check read later, `moe_ref.ep.device_checks`); untouched otherwise.
        group_score: a group's score: "top2_sum" (DeepSeek-V3) or "max" (DeepSeek-V2 group_limited_greedy).

    Returns:
        topk_ids_TK: `[T, K]` int64 expert ids, slots in descending selection score (ties: lower id first).
        topk_weights_TK: `[T, K]` fp32 weights (unbiased scores, renormalized and scaled).
    """
    _check_args(logits_TE, num_topk, scoring, bias_E, num_groups, num_topk_groups, group_score)
    num_tokens, num_experts = logits_TE.shape
    device = logits_TE.device
    topk_ids_TK = torch.empty(num_tokens, num_topk, dtype=torch.int64, device=device)
    topk_weights_TK = torch.empty(num_tokens, num_topk, dtype=torch.float32, device=device)
    if num_tokens == 0:
        return topk_ids_TK, topk_weights_TK
    check_device("logits_TE", logits_TE)
    logits_TE = logits_TE if logits_TE.stride(-1) == 1 else logits_TE.contiguous()
    bias = None if bias_E is None else bias_E.contiguous()
    block_e = next_power_of_2(num_experts)
    if is_interpreter():
        block_t = 8
    else:
        block_t = max(1, min(64, 4096 // block_e))
    grid = (cdiv(num_tokens, block_t),)
    launch(_router_topk_kernel, grid,
        logits_TE, bias if bias is not None else logits_TE, topk_ids_TK, topk_weights_TK,
        nonfinite_flag if nonfinite_flag is not None else topk_ids_TK,
        num_tokens, num_experts, float(routed_scaling_factor),
        logits_TE.stride(0), topk_ids_TK.stride(0), topk_weights_TK.stride(0),
        SCORING=_SCORING[scoring], HAS_BIAS=bias is not None,
        NUM_GROUPS=num_groups, GROUP_MAX=group_score == "max", NUM_TOPK_GROUPS=num_topk_groups, NUM_TOPK=num_topk,
        RENORMALIZE=bool(renormalize), FLAG_NONFINITE=nonfinite_flag is not None,
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=next_power_of_2(num_topk),
        num_warps=4 if block_e <= 256 else 8, **launch_options(fp_fusion=False),
    )
    return topk_ids_TK, topk_weights_TK


def router_topk_ref(
    logits_TE: torch.Tensor,
    num_topk: int,
    scoring: str = "sigmoid",
    bias_E: torch.Tensor | None = None,
    num_groups: int = 1,
    num_topk_groups: int = 1,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    nonfinite_flag: torch.Tensor | None = None,
    group_score: str = "top2_sum",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch twin of `router_topk` (same arguments, checks and returns): the package's reference
    router, ``moe_ref.core.router.select_experts``."""
    _check_args(logits_TE, num_topk, scoring, bias_E, num_groups, num_topk_groups, group_score)
    if nonfinite_flag is not None and logits_TE.numel():
        nonfinite_flag.copy_(torch.maximum(nonfinite_flag, (~torch.isfinite(logits_TE)).any().to(torch.int32)))
    topk_ids_TK, topk_weights_TK = select_experts(logits_TE, num_topk, scoring, bias_E, num_groups, num_topk_groups,
                                                  renormalize, routed_scaling_factor, group_score)
    return topk_ids_TK.contiguous(), topk_weights_TK.contiguous()
