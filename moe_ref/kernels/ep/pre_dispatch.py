"""Fused pre-dispatch: copy (or FP8-quantize) this rank's tokens and routing into its own send buffer.

    router -> [pre_dispatch] -> dispatch (peers pull rows) -> grouped_mlp -> combine (partials) -> reduce

One launch writes, for tokens 0..T-1 of this rank:
- `buf_x_CD[:T]`: the token rows, same dtype as `x_TD`, or fp8 e4m3 with one fp32 scale per row per 128
  columns in `buf_x_scale_CDb` (DeepGEMM's SM90 activation convention: scale = max(amax, 1e-4) / 448,
  value = x / scale rounded to nearest even);
- `buf_topk_ids_CK[:T]`, `buf_topk_weights_CK[:T]`: the routing (int64 ids, -1 = masked slot; fp32 weights);
- `num_rows_per_expert_E += ` the number of non-masked slots per global expert (int32 atomics; the caller
  zeroes the counter, so several chunks can accumulate into one).

Shape legend: T tokens of this rank, Dx expert input width (the ``D`` of the argument names), K top-k,
E experts (global), C cap (rows one rank feeds per call), N routed entries, Db = ceil(Dx / 128) scale groups per row.

The torch quantizers `quantize_fp8_per_128` / `dequantize_fp8_per_128` live in `moe_ref.kernels.experts.fp8` (also
importable from here, where the twin uses them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_ref.core.errors import DTypeError, ShapeError

from moe_ref.kernels.runtime._triton_utils import (
    FP8_DTYPE,
    cdiv,
    check_device,
    is_interpreter,
    launch_options,
    next_power_of_2,
    num_fp8_groups,
    quantize_e4m3,
)
from moe_ref.kernels.experts.fp8 import dequantize_fp8_per_128, quantize_fp8_per_128
from moe_ref.kernels.runtime.launch import launch

__all__ = ["pre_dispatch", "pre_dispatch_ref", "quantize_fp8_per_128", "dequantize_fp8_per_128"]


# --------------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------------
@triton.jit
def _pre_dispatch_kernel(
    # pointers
    x_ptr, topk_ids_ptr, topk_weights_ptr,
    buf_x_ptr, buf_x_scale_ptr, buf_topk_ids_ptr, buf_topk_weights_ptr, num_rows_per_expert_ptr,
    # sizes
    D, K, E,
    # strides (elements; the last dimension of every tensor is contiguous)
    stride_x_t, stride_ids_t, stride_w_t,
    stride_buf_x_c, stride_buf_scale_c, stride_buf_ids_c, stride_buf_w_c,
    # meta
    QUANT_FP8: tl.constexpr,       # buf_x is fp8 e4m3: quantize per 128 columns and write scales
    BLOCK_G: tl.constexpr,         # 128-column groups per program (BLOCK_G * 128 columns)
    BLOCK_K: tl.constexpr,         # next_power_of_2(K)
):
    """One program = one token row x (BLOCK_G * 128) columns; the pid_d == 0 program also copies routing.

    Example: T=2, D=256, K=2, E=4, fp8 buffer, BLOCK_G=1 -> grid (2, 2).
        x[0, 0:128] has amax 0.896 -> buf_x_scale[0, 0] = 0.896 / 448 = 0.002, buf_x[0, 0:128] = x / 0.002;
        topk_ids = [[3, -1], [3, 0]] -> buf_topk_ids[:2] = same, num_rows_per_expert += [1, 0, 0, 2].
    """
    pid_t = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)

    # --- token row: [BLOCK_G, 128] tile of columns -------------------------------------------------
    offs_g = pid_d * BLOCK_G + tl.arange(0, BLOCK_G)
    offs_d = offs_g[:, None] * 128 + tl.arange(0, 128)[None, :]
    mask_d = offs_d < D
    x = tl.load(x_ptr + pid_t * stride_x_t + offs_d, mask=mask_d, other=0.0)
    if QUANT_FP8:
        x_q, scale_g = quantize_e4m3(x.to(tl.float32))
        tl.store(buf_x_ptr + pid_t * stride_buf_x_c + offs_d, x_q, mask=mask_d)
        tl.store(buf_x_scale_ptr + pid_t * stride_buf_scale_c + offs_g, scale_g, mask=offs_g * 128 < D)
    else:
        # raw copy, no arithmetic (bf16 arithmetic is wrong under the interpreter; a copy is exact)
        tl.store(buf_x_ptr + pid_t * stride_buf_x_c + offs_d, x, mask=mask_d)

    # --- routing: ids, weights, per-expert counts --------------------------------------------------
    if pid_d == 0:
        offs_k = tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        ids = tl.load(topk_ids_ptr + pid_t * stride_ids_t + offs_k, mask=mask_k, other=-1)
        weights = tl.load(topk_weights_ptr + pid_t * stride_w_t + offs_k, mask=mask_k, other=0.0)
        tl.store(buf_topk_ids_ptr + pid_t * stride_buf_ids_c + offs_k, ids, mask=mask_k)
        tl.store(buf_topk_weights_ptr + pid_t * stride_buf_w_c + offs_k, weights, mask=mask_k)
        counted = mask_k & (ids >= 0) & (ids < E)
        ones = tl.full([BLOCK_K], 1, tl.int32)
        tl.atomic_add(num_rows_per_expert_ptr + tl.where(counted, ids, 0), ones, mask=counted)


# --------------------------------------------------------------------------------------------------
# launcher and twin
# --------------------------------------------------------------------------------------------------
def _check_args(x_TD, topk_ids_TK, topk_weights_TK, buf_x_CD, buf_x_scale_CDb, buf_topk_ids_CK,
                buf_topk_weights_CK, num_rows_per_expert_E) -> bool:
    """Validate shapes/dtypes; returns whether the buffer is fp8 (quantizing)."""
    if x_TD.dim() != 2 or buf_x_CD.dim() != 2:
        raise ShapeError(f"x_TD and buf_x_CD must be 2-D, got {tuple(x_TD.shape)=}, {tuple(buf_x_CD.shape)=}")
    num_tokens, hidden = x_TD.shape
    capacity = buf_x_CD.shape[0]
    if buf_x_CD.shape[1] != hidden:
        raise ShapeError(f"hidden size mismatch: {tuple(x_TD.shape)=} vs {tuple(buf_x_CD.shape)=}")
    if num_tokens > capacity:
        raise ShapeError(
            f"pre_dispatch: {num_tokens=} rows do not fit the send buffer ({capacity=} rows per rank); "
            "raise num_max_tokens_per_rank or use overflow='chunk'"
        )
    if topk_ids_TK.dim() != 2 or topk_ids_TK.shape[0] != num_tokens:
        raise ShapeError(f"topk_ids_TK must be [T, K] with {num_tokens=}, got {tuple(topk_ids_TK.shape)}")
    num_topk = topk_ids_TK.shape[1]
    for name, tensor, rows, dtype in (
        ("topk_ids_TK", topk_ids_TK, num_tokens, torch.int64),
        ("topk_weights_TK", topk_weights_TK, num_tokens, torch.float32),
        ("buf_topk_ids_CK", buf_topk_ids_CK, capacity, torch.int64),
        ("buf_topk_weights_CK", buf_topk_weights_CK, capacity, torch.float32),
    ):
        if tuple(tensor.shape) != (rows, num_topk) or tensor.dtype != dtype:
            raise DTypeError(f"{name} must be [{rows}, {num_topk}] {dtype}, got {tuple(tensor.shape)} {tensor.dtype}")
    if num_rows_per_expert_E.dim() != 1 or num_rows_per_expert_E.dtype != torch.int32:
        raise DTypeError(f"num_rows_per_expert_E must be int32 [E], got {tuple(num_rows_per_expert_E.shape)} "
                         f"{num_rows_per_expert_E.dtype}")
    quant_fp8 = buf_x_CD.dtype == FP8_DTYPE
    if not quant_fp8 and buf_x_CD.dtype != x_TD.dtype:
        raise DTypeError(f"buf_x_CD dtype must equal x_TD dtype or be {FP8_DTYPE}, got {buf_x_CD.dtype=}, {x_TD.dtype=}")
    if quant_fp8:
        if x_TD.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise DTypeError(f"fp8 pre-dispatch needs a bf16/fp16/fp32 x_TD, got {x_TD.dtype}")
        expected = (capacity, num_fp8_groups(hidden))
        if buf_x_scale_CDb is None or tuple(buf_x_scale_CDb.shape) != expected or buf_x_scale_CDb.dtype != torch.float32:
            got = None if buf_x_scale_CDb is None else (tuple(buf_x_scale_CDb.shape), buf_x_scale_CDb.dtype)
            raise DTypeError(f"fp8 buf_x_CD needs buf_x_scale_CDb fp32 {expected}, got {got}")
    for name, tensor in (("x_TD", x_TD), ("buf_x_CD", buf_x_CD), ("buf_x_scale_CDb", buf_x_scale_CDb),
                         ("topk_ids_TK", topk_ids_TK), ("topk_weights_TK", topk_weights_TK),
                         ("buf_topk_ids_CK", buf_topk_ids_CK), ("buf_topk_weights_CK", buf_topk_weights_CK),
                         ("num_rows_per_expert_E", num_rows_per_expert_E)):
        if tensor is not None and tensor.numel() > 0 and tensor.stride(-1) != 1:
            raise ShapeError(f"{name} must have a contiguous last dimension, got strides {tensor.stride()}")
    return quant_fp8


def pre_dispatch(
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    buf_x_CD: torch.Tensor,
    buf_x_scale_CDb: torch.Tensor | None,
    buf_topk_ids_CK: torch.Tensor,
    buf_topk_weights_CK: torch.Tensor,
    num_rows_per_expert_E: torch.Tensor,
) -> None:
    """Write this rank's tokens and routing into its send buffer (one Triton launch, in place).

    Args:
        x_TD: `[T, D]` bf16/fp16/fp32, this rank's token rows (T may be 0: nothing is written).
        topk_ids_TK: `[T, K]` int64, global expert ids, `-1` = masked slot.
        topk_weights_TK: `[T, K]` fp32, routing weights.
        buf_x_CD: `[C, D]`, same dtype as x, or `torch.float8_e4m3fn` to quantize; rows `[:T]` are written.
        buf_x_scale_CDb: `[C, ceil(D/128)]` fp32 per-row per-128 scales (fp8 buffer only; else may be None).
        buf_topk_ids_CK: `[C, K]` int64, rows `[:T]` written.
        buf_topk_weights_CK: `[C, K]` fp32, rows `[:T]` written.
        num_rows_per_expert_E: `[E]` int32, incremented (atomics) by the non-masked slots per expert; ids
            outside `[0, E)` are not counted. The caller zeroes it.

    Raises:
        ValueError: `T > C` or any shape/dtype mismatch. No host sync.
    """
    quant_fp8 = _check_args(x_TD, topk_ids_TK, topk_weights_TK, buf_x_CD, buf_x_scale_CDb, buf_topk_ids_CK,
                            buf_topk_weights_CK, num_rows_per_expert_E)
    num_tokens, hidden = x_TD.shape
    if num_tokens == 0:
        return
    check_device("x_TD", x_TD)
    num_topk = topk_ids_TK.shape[1]
    num_groups = num_fp8_groups(hidden)
    block_g = 1 if is_interpreter() else min(8, next_power_of_2(num_groups))
    scale = buf_x_scale_CDb if quant_fp8 else buf_x_CD  # dummy pointer when not quantizing
    grid = (num_tokens, cdiv(num_groups, block_g))
    launch(_pre_dispatch_kernel, grid,
        x_TD, topk_ids_TK, topk_weights_TK,
        buf_x_CD, scale, buf_topk_ids_CK, buf_topk_weights_CK, num_rows_per_expert_E,
        hidden, num_topk, num_rows_per_expert_E.shape[0],
        x_TD.stride(0), topk_ids_TK.stride(0), topk_weights_TK.stride(0),
        buf_x_CD.stride(0), scale.stride(0), buf_topk_ids_CK.stride(0), buf_topk_weights_CK.stride(0),
        QUANT_FP8=quant_fp8,
        BLOCK_G=block_g, BLOCK_K=next_power_of_2(num_topk),
        num_warps=4, **launch_options(fp_fusion=False),
    )


def pre_dispatch_ref(
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    buf_x_CD: torch.Tensor,
    buf_x_scale_CDb: torch.Tensor | None,
    buf_topk_ids_CK: torch.Tensor,
    buf_topk_weights_CK: torch.Tensor,
    num_rows_per_expert_E: torch.Tensor,
) -> None:
    """Plain-torch twin of `pre_dispatch` (same arguments, same in-place writes, no host sync)."""
    quant_fp8 = _check_args(x_TD, topk_ids_TK, topk_weights_TK, buf_x_CD, buf_x_scale_CDb, buf_topk_ids_CK,
                            buf_topk_weights_CK, num_rows_per_expert_E)
    num_tokens = x_TD.shape[0]
    if num_tokens == 0:
        return
    if quant_fp8:
        x_fp8_TD, scale_TDb = quantize_fp8_per_128(x_TD)
        buf_x_CD[:num_tokens].copy_(x_fp8_TD)
        buf_x_scale_CDb[:num_tokens].copy_(scale_TDb)
    else:
        buf_x_CD[:num_tokens].copy_(x_TD)
    buf_topk_ids_CK[:num_tokens].copy_(topk_ids_TK)
    buf_topk_weights_CK[:num_tokens].copy_(topk_weights_TK)
    num_experts = num_rows_per_expert_E.shape[0]
    ids_N = topk_ids_TK.reshape(-1)
    counted_N = (ids_N >= 0) & (ids_N < num_experts)
    num_rows_per_expert_E.index_add_(0, ids_N.clamp(0, max(num_experts - 1, 0)), counted_N.to(torch.int32))
