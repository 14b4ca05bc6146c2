"""Deterministic weighted k-slot reduce: the last step of the MoE layer on the token's source rank.

    router -> pre_dispatch -> dispatch -> grouped_mlp -> combine (rows come back) -> [combine_reduce]

    y[t] = sum_{j = 0..K-1, in this order, topk_ids[t, j] >= 0} w[t, j] * combine[j, t]   (fp32)
           (+ shared[t], added in fp32)  -> cast to out_dtype

Masked slots (`topk_ids_TK[t, j] < 0`) are never read (their combine rows hold garbage, NaN included).
The kernel and its twin add in the same order with separate multiply and add roundings (the GPU launch
disables FMA contraction), so in fp32 they agree bitwise.

Shape suffixes: T tokens of this rank, K top-k slots, C capacity (rows per rank, C >= T), D hidden.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_ref.errors import DTypeError, ShapeError

from moe_ref.kernels._triton_utils import check_device, is_interpreter, launch_options

__all__ = ["combine_reduce", "combine_reduce_ref"]


@triton.jit
def _combine_reduce_kernel(
    # pointers
    combine_ptr, topk_ids_ptr, topk_weights_ptr, shared_ptr, y_ptr,
    # sizes
    D,
    # strides (elements; last dimensions are contiguous)
    stride_combine_k, stride_combine_c, stride_ids_t, stride_w_t, stride_shared_t, stride_y_t,
    # meta
    NUM_TOPK: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program = one token x BLOCK_D columns; the K slots are added in order 0..K-1.

    Example: K=2, D=2, token 0 with topk_ids [5, -1], weights [0.5, 0.25],
        combine[0, 0] = [2.0, 4.0], combine[1, 0] = [nan, nan] (masked slot, never loaded),
        shared[0] = [1.0, 1.0]  ->  y[0] = 0.5 * [2, 4] + [1, 1] = [2.0, 3.0].
    """
    pid_t = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D

    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(NUM_TOPK):
        expert_id = tl.load(topk_ids_ptr + pid_t * stride_ids_t + j)
        weight = tl.load(topk_weights_ptr + pid_t * stride_w_t + j)
        valid = tl.full([BLOCK_D], 0, tl.int64) + expert_id >= 0  # as a tensor (the interpreter needs it)
        row = tl.load(combine_ptr + j * stride_combine_k + pid_t * stride_combine_c + offs_d,
                      mask=mask_d & valid, other=0.0).to(tl.float32)
        # where(), not "+ 0": a skipped slot must leave acc bit-identical (e.g. -0.0 stays -0.0)
        acc = tl.where(valid, acc + weight * row, acc)
    if HAS_SHARED:
        acc = acc + tl.load(shared_ptr + pid_t * stride_shared_t + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    tl.store(y_ptr + pid_t * stride_y_t + offs_d, acc.to(y_ptr.dtype.element_ty), mask=mask_d)


def _check_args(combine_KCD, topk_ids_TK, topk_weights_TK, shared_TD, out_dtype) -> torch.dtype:
    if combine_KCD.dim() != 3:
        raise ShapeError(f"combine_KCD must be [K, C, D], got {tuple(combine_KCD.shape)}")
    num_topk, capacity, hidden = combine_KCD.shape
    if topk_ids_TK.dim() != 2 or topk_ids_TK.shape[1] != num_topk or topk_ids_TK.dtype != torch.int64:
        raise DTypeError(f"topk_ids_TK must be int64 [T, {num_topk}], got {tuple(topk_ids_TK.shape)} {topk_ids_TK.dtype}")
    num_tokens = topk_ids_TK.shape[0]
    if num_tokens > capacity:
        raise ShapeError(f"{num_tokens=} exceeds the combine buffer's {capacity=} rows")
    if tuple(topk_weights_TK.shape) != (num_tokens, num_topk) or topk_weights_TK.dtype != torch.float32:
        raise DTypeError(f"topk_weights_TK must be fp32 [{num_tokens}, {num_topk}], got "
                         f"{tuple(topk_weights_TK.shape)} {topk_weights_TK.dtype}")
    if shared_TD is not None and tuple(shared_TD.shape) != (num_tokens, hidden):
        raise ShapeError(f"shared_TD must be [{num_tokens}, {hidden}], got {tuple(shared_TD.shape)}")
    for name, tensor in (("combine_KCD", combine_KCD), ("topk_ids_TK", topk_ids_TK),
                         ("topk_weights_TK", topk_weights_TK), ("shared_TD", shared_TD)):
        if tensor is not None and tensor.numel() > 0 and tensor.stride(-1) != 1:
            raise ShapeError(f"{name} must have a contiguous last dimension, got strides {tensor.stride()}")
    return combine_KCD.dtype if out_dtype is None else out_dtype


def combine_reduce(
    combine_KCD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    shared_TD: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Weighted, fixed-order sum of each token's K expert outputs (one Triton launch).

    Args:
        combine_KCD: `[K, C, D]` bf16/fp16/fp32, slot j of token t is `combine_KCD[j, t]`; only t < T is
            read, and never a masked slot's row.
        topk_ids_TK: `[T, K]` int64, `< 0` = masked slot (skipped).
        topk_weights_TK: `[T, K]` fp32 routing weights (applied here).
        shared_TD: optional `[T, D]` (any float dtype), added in fp32 after the routed sum.
        out_dtype: output dtype, default `combine_KCD.dtype`.

    Returns:
        y_TD: `[T, D]` `out_dtype`. T = 0 gives `[0, D]`.
    """
    out_dtype = _check_args(combine_KCD, topk_ids_TK, topk_weights_TK, shared_TD, out_dtype)
    num_topk, _, hidden = combine_KCD.shape
    num_tokens = topk_ids_TK.shape[0]
    y_TD = torch.empty(num_tokens, hidden, dtype=out_dtype, device=combine_KCD.device)
    if num_tokens == 0 or hidden == 0:
        return y_TD
    check_device("combine_KCD", combine_KCD)
    block_d = min(triton.next_power_of_2(hidden), 64 if is_interpreter() else 1024)
    has_shared = shared_TD is not None
    shared = shared_TD if has_shared else y_TD  # dummy pointer
    grid = (num_tokens, triton.cdiv(hidden, block_d))
    _combine_reduce_kernel[grid](
        combine_KCD, topk_ids_TK, topk_weights_TK, shared, y_TD,
        hidden,
        combine_KCD.stride(0), combine_KCD.stride(1), topk_ids_TK.stride(0), topk_weights_TK.stride(0),
        shared.stride(0), y_TD.stride(0),
        NUM_TOPK=num_topk, HAS_SHARED=has_shared, BLOCK_D=block_d,
        num_warps=4, **launch_options(fp_fusion=False),
    )
    return y_TD


def combine_reduce_ref(
    combine_KCD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    shared_TD: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Plain-torch twin of `combine_reduce` (same arguments; same slot order, so fp32-bitwise equal)."""
    out_dtype = _check_args(combine_KCD, topk_ids_TK, topk_weights_TK, shared_TD, out_dtype)
    num_topk, _, hidden = combine_KCD.shape
    num_tokens = topk_ids_TK.shape[0]
    acc_TD = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=combine_KCD.device)
    for j in range(num_topk):
        valid_T1 = (topk_ids_TK[:, j] >= 0).unsqueeze(1)
        row_TD = combine_KCD[j, :num_tokens].float()
        acc_TD = torch.where(valid_T1, acc_TD + topk_weights_TK[:, j : j + 1] * row_TD, acc_TD)
    if shared_TD is not None:
        acc_TD = acc_TD + shared_TD.float()
    return acc_TD.to(out_dtype)
