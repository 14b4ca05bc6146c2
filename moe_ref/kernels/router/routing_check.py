"""One launch that checks the routing values before any row moves, without a host sync.

    routing_check(topk_ids_TK, topk_weights_TK, num_experts) -> flag [1] int32: 1 when some token has a NaN/inf
        weight, an id outside [-1, E), or picks one expert twice (-1, the masked slot, may repeat); else 0

The routed step folds the flag into its per-call agreement (``moe_ref.ep.device_checks``): read with the group's
other numbers, it costs no host sync of its own. ``routing_check_ref`` is the torch twin (and the CPU path).

Shape legend: T tokens, K top-k, E experts.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_ref.kernels.runtime._triton_utils import cdiv, check_device, next_power_of_2
from moe_ref.kernels.runtime.launch import launch

__all__ = ["routing_check", "routing_check_ref", "routing_faults_T"]

FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)
BLOCK_T = 64


@triton.jit
def _routing_check_kernel(ids_ptr, weights_ptr, flag_ptr, num_tokens, num_experts, ids_stride_t, weights_stride_t,
                          NUM_TOPK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    k = tl.arange(0, BLOCK_K)
    live_t = t < num_tokens
    mask = live_t[:, None] & (k[None, :] < NUM_TOPK)
    ids = tl.load(ids_ptr + t[:, None].to(tl.int64) * ids_stride_t + k[None, :], mask=mask, other=-1).to(tl.int64)
    weights = tl.load(weights_ptr + t[:, None].to(tl.int64) * weights_stride_t + k[None, :], mask=mask,
                      other=0.0).to(tl.float32)
    bad = (weights != weights) | (tl.abs(weights) > FLOAT32_MAX) | (ids < -1) | (ids >= num_experts)
    for j in tl.static_range(NUM_TOPK):  # slot j against every later slot of its token
        id_j = tl.load(ids_ptr + t.to(tl.int64) * ids_stride_t + j, mask=live_t, other=-1).to(tl.int64)
        bad |= (ids == id_j[:, None]) & (id_j[:, None] >= 0) & (k[None, :] > j) & mask
    found = tl.max(tl.max(bad.to(tl.int32), axis=1), axis=0)
    if found > 0:
        tl.atomic_max(flag_ptr, 1)


def routing_check(topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, num_experts: int,
                  flag: torch.Tensor | None = None) -> torch.Tensor:
    """``[1]`` int32 on the ids' device: 1 when a routing value is bad (module doc), else 0. No host sync.

    Args:
        topk_ids_TK: ``[T, K]`` int64 or int32, unit stride along K. topk_weights_TK: ``[T, K]`` float, unit
            stride along K.
        num_experts: E.
        flag: optional ``[1]`` int32, zero on entry, to raise instead of a new one (a slot of the call's
            ``DeviceChecks``); returned.
    """
    check_device("topk_ids_TK", topk_ids_TK)
    num_tokens, num_topk = topk_ids_TK.shape
    if flag is None:
        flag = torch.zeros(1, dtype=torch.int32, device=topk_ids_TK.device)
    if num_tokens == 0:
        return flag
    ids = topk_ids_TK if topk_ids_TK.stride(1) == 1 else topk_ids_TK.contiguous()
    weights = topk_weights_TK if topk_weights_TK.stride(1) == 1 else topk_weights_TK.contiguous()
    launch(_routing_check_kernel, (cdiv(num_tokens, BLOCK_T),),
        ids, weights, flag, num_tokens, num_experts, ids.stride(0), weights.stride(0),
        NUM_TOPK=num_topk, BLOCK_T=BLOCK_T, BLOCK_K=next_power_of_2(num_topk))
    return flag


def routing_check_ref(topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, num_experts: int,
                      flag: torch.Tensor | None = None) -> torch.Tensor:
    """The torch twin of ``routing_check`` (same arguments and result, no host sync)."""
    if flag is None:
        flag = torch.zeros(1, dtype=torch.int32, device=topk_ids_TK.device)
    if topk_ids_TK.numel() == 0:
        return flag
    bad_weight_T, dup_T = routing_faults_T(topk_ids_TK, topk_weights_TK)
    bad = bad_weight_T.any() | (topk_ids_TK < -1).any() | (topk_ids_TK >= num_experts).any() | dup_T.any()
    return flag.copy_(torch.maximum(flag, bad.to(torch.int32).reshape(1)))


def routing_faults_T(topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, on the ids' device (no host sync): ``bad_weight_T`` [T] bool, a weight is NaN/inf, and ``dup_T``
    [T] bool, an expert id >= 0 appears twice. The twin's flag and ``dispatch.routing_value_problem``'s message
    both come from these."""
    sorted_TK = topk_ids_TK.to(torch.int64).sort(dim=1).values
    dup_T = ((sorted_TK[:, 1:] == sorted_TK[:, :-1]) & (sorted_TK[:, 1:] >= 0)).any(dim=1)
    return (~torch.isfinite(topk_weights_TK)).any(dim=1), dup_T
