"""The batch-invariant combine's exchange: the expert owner pushes every (source, token, slot) expert row it
computed, unweighted and unreduced, into the source's `combine_slots [C, K, Dx]` (one launch), and the source sums
its tokens' K rows itself in slot order (`moe_ref.ep.batch_invariant.sum_slots`; on CUDA `sum_slots_kernel`).

    ... ep_dispatch -> experts (y_PD) -> [ep_combine_slots_push] -> symm_barrier -> [sum_slots_kernel] -> out_TDx

push, on expert owner r, for every source s, token t < T_s and slot j with recv_pos[s, t, j] >= 0:
    combine_slots_s[t, j] = y[recv_pos[s, t, j]]                       (a copy to rank s, activation dtype, exact)
Every slot of a token has ONE owner (the rank of its expert), so no two ranks write one row; a masked slot (id -1)
is written by nobody and holds stale bytes that the sum never reads.

sum, on source s, for every token t < T (`sum_slots_kernel`, one launch; its twin `batch_invariant.sum_slots_ref`):
    out[t] = (sum_{j = 0..K-1 in order, topk_ids[t, j] >= 0} topk_weights[t, j] * float(rows[t, j])).to(out dtype)
with acc starting at +0.0, separate fp32 multiply and add roundings (no FMA) and one rounding at the end; a
masked slot's row is never read, so stale bytes (NaN, Inf) there cannot reach the sum.

The push copies rows bit for bit (no arithmetic), so it and its twin agree bitwise; so do the sum and its twin (the
same roundings in the same order). Against the default combine (`ep_combine`), a token sends K rows back instead of
one partial per owning rank: K x Dx values in the activation dtype per token.

Shape legend: R ranks, K top-k, C cap, T tokens of this rank, Dx row width, P pool rows, U tokens exchanged with one
rank, N routed entries (the live slots among them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_ref.core.errors import DTypeError, ShapeError
from moe_ref.kernels.ep.ep_dispatch import source_token
from moe_ref.kernels.ep.ep_launch import EP_LAUNCH
from moe_ref.kernels.ep.ep_regions import EPRegions, PeerBuffers, check_peers
from moe_ref.kernels.runtime._triton_utils import (check_device, cdiv, is_interpreter, launch_options,
                                                    next_power_of_2)
from moe_ref.kernels.runtime.launch import launch

__all__ = ["ep_combine_slots_push", "ep_combine_slots_push_ref", "sum_slots_kernel"]

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
# columns per program of the slot sum: a 2-D grid (token, column block) so that a decode step (T = 1) still spreads
# its K rows over several SMs (Dx 7168: 14 programs); the interpreter's smaller block exercises the tail mask
_SUM_BLOCK_COLS = 512
_SUM_BLOCK_COLS_INTERPRETED = 128


@triton.jit
def _combine_slots_push_kernel(
    # pointers
    y_ptr, ptrs_R,
    # sizes / scalars
    rank, C, K, D, off_recv_num_tokens, off_recv_pos, off_combine_slots,
    # strides
    stride_y_p,
    # meta
    ROW_DTYPE: tl.constexpr,       # activation dtype of y and combine_slots
    BLOCK_D: tl.constexpr,
):
    """One program = one (source s, token t): each of t's slots on my experts copied to s's `combine_slots[t, j]`.

    Example: K=2, recv_pos[s, t] = [7, -1], y[7] = [2.0, -4.0] -> combine_slots_s[t, 0] = [2.0, -4.0]; slot 1
    is not mine and is left alone.
    """
    s, t, my_base, live = source_token(ptrs_R, rank, C, off_recv_num_tokens)
    if live:
        pos_ptr = (my_base + off_recv_pos).to(tl.pointer_type(tl.int32)) + (s * C + t).to(tl.int64) * K
        dst_base = tl.load(ptrs_R + s)
        out_ptr = (dst_base + off_combine_slots).to(tl.pointer_type(ROW_DTYPE)) + t.to(tl.int64) * K * D
        for j in range(0, K):
            pos_j = tl.load(pos_ptr + j).to(tl.int64)
            if pos_j >= 0:
                for d0 in range(0, D, BLOCK_D):
                    offs_d = d0 + tl.arange(0, BLOCK_D)
                    mask_d = offs_d < D
                    row = tl.load(y_ptr + pos_j * stride_y_p + offs_d, mask=mask_d)
                    tl.store(out_ptr + j * D + offs_d, row, mask=mask_d)


@triton.jit
def _round_rn(x, DTYPE: tl.constexpr):
    """fp32 -> DTYPE rounding to nearest even, subnormals included, on the GPU and under the interpreter alike. For
    bf16 the rounded high half of the bits is bitcast: the interpreter's fp32 -> bf16 cast (which
    ``ep_combine._cast_rn`` ends with) turns a bf16 subnormal into 0 or a wrong value (Triton 3.9); a NaN is cast."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        high = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)  # arithmetic shift: the sign bit survives
        return tl.where(x != x, x.to(DTYPE), high.to(DTYPE, bitcast=True))
    return x.to(DTYPE)


@triton.jit
def _sum_slots_kernel(
    # pointers
    rows_ptr, ids_ptr, weights_ptr, pool_row_ptr, out_ptr,
    # sizes
    Dx,
    # strides
    stride_rows_t, stride_rows_k, stride_ids_t, stride_ids_k, stride_w_t, stride_w_k, stride_pool_row_t,
    stride_pool_row_k, stride_out_t,
    # meta
    K: tl.constexpr,
    POOL_ROWS: tl.constexpr,       # rows is the pool [P, Dx], slot (t, j) reading row pool_row[t, j] (< 0: zeros)
    OUT_DTYPE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program = one token t, BLOCK_D columns: its live slots' weighted rows summed in slot order in fp32.

    Example: K=3, ids[t] = [4, -1, 9], w[t] = [0.5, 2.0, 0.25], rows[t] = [[2.0], [NaN], [-4.0]]
        -> out[t] = [(+0.0 + 0.5 * 2.0) + 0.25 * -4.0] = [0.0]; slot 1's row is not read.
    """
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < Dx
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(K):
        id_j = tl.load(ids_ptr + t * stride_ids_t + j * stride_ids_k)
        w_j = tl.load(weights_ptr + t * stride_w_t + j * stride_w_k)
        live = (tl.full([BLOCK_D], 0, tl.int64) + id_j) >= 0  # a tensor (the interpreter needs it)
        if POOL_ROWS:
            row_j = tl.load(pool_row_ptr + t * stride_pool_row_t + j * stride_pool_row_k).to(tl.int64)
            has_row = (tl.full([BLOCK_D], 0, tl.int64) + row_j) >= 0
            row = tl.load(rows_ptr + row_j * stride_rows_t + offs_d, mask=mask_d & live & has_row,
                          other=0.0).to(tl.float32)
        else:
            row = tl.load(rows_ptr + t * stride_rows_t + j * stride_rows_k + offs_d, mask=mask_d & live,
                          other=0.0).to(tl.float32)
        # where() on the sum, not a product with 0: a masked slot leaves acc bit-identical whatever w_j is
        acc = tl.where(live, acc + w_j * row, acc)
    tl.store(out_ptr + t * stride_out_t + offs_d, _round_rn(acc, OUT_DTYPE), mask=mask_d)


def sum_slots_kernel(rows: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                     out_dtype: torch.dtype, pool_row_TK: torch.Tensor | None = None) -> torch.Tensor:
    """``moe_ref.ep.batch_invariant.sum_slots`` in one launch (no host sync, CUDA-graph safe), bitwise equal to its
    torch loop: ``sum_j w[t, j] * row(t, j)`` over the live slots (id >= 0), j in order, fp32 from +0.0 with
    separate multiply and add roundings, rounded once to ``out_dtype``.

    Args:
        rows: ``[T, K, Dx]`` fp32/fp16/bf16, each slot's expert row unweighted (any strides along T and K); or, with
            ``pool_row_TK``, the expert pool ``[P, Dx]``, slot (t, j) reading row ``pool_row_TK[t, j]`` (a zero row
            where it is < 0), so no ``[T, K, Dx]`` copy is made. Unit stride along Dx. A masked slot's row is never
            read (it may hold any bytes).
        topk_ids_TK: ``[T, K]`` int64 or int32, -1 = masked. topk_weights_TK: ``[T, K]`` fp32.
        out_dtype: fp32, fp16 or bf16.
        pool_row_TK: ``[T, K]`` int64 or int32, or None.

    Returns:
        ``[T, Dx]`` out_dtype, contiguous (a masked token: +0.0).
    """
    T, K = topk_ids_TK.shape if topk_ids_TK.dim() == 2 else (-1, -1)
    if pool_row_TK is None:
        if rows.dim() != 3:
            raise ShapeError(f"rows must be [T, K, Dx], got {tuple(rows.shape)}")
        T, K, Dx = rows.shape
    else:
        if rows.dim() != 2:
            raise ShapeError(f"rows must be the pool [P, Dx] with pool_row_TK, got {tuple(rows.shape)}")
        Dx = rows.shape[1]
    named = [("topk_ids_TK", topk_ids_TK), ("topk_weights_TK", topk_weights_TK)]
    named += [("pool_row_TK", pool_row_TK)] if pool_row_TK is not None else []
    for name, t in named:
        if t.dim() != 2 or tuple(t.shape) != (T, K):
            raise ShapeError(f"{name} must be [T={T}, K={K}] (rows' or topk_ids_TK's), got {tuple(t.shape)}")
    if rows.dtype not in _TL_DTYPES or out_dtype not in _TL_DTYPES:
        raise DTypeError(f"rows and out_dtype must be fp32/fp16/bf16, got {rows.dtype} and {out_dtype}")
    index_dtypes = (torch.int64, torch.int32)
    if topk_ids_TK.dtype not in index_dtypes or topk_weights_TK.dtype != torch.float32 or (
            pool_row_TK is not None and pool_row_TK.dtype not in index_dtypes):
        raise DTypeError(f"topk_ids_TK and pool_row_TK must be int64/int32 and topk_weights_TK fp32, got "
                         f"{topk_ids_TK.dtype}, {None if pool_row_TK is None else pool_row_TK.dtype} and "
                         f"{topk_weights_TK.dtype}")
    if rows.numel() and rows.stride(-1) != 1:
        raise ShapeError(f"rows must have a contiguous last dimension, got strides {rows.stride()}")
    for name, t in [("rows", rows)] + named:
        check_device(name, t)
    out_TDx = torch.empty(T, Dx, dtype=out_dtype, device=rows.device)
    if out_TDx.numel() == 0:
        return out_TDx
    pool_row_TK = topk_ids_TK if pool_row_TK is None else pool_row_TK  # not read without POOL_ROWS
    block_d = min(next_power_of_2(Dx), _SUM_BLOCK_COLS_INTERPRETED if is_interpreter() else _SUM_BLOCK_COLS)
    launch(_sum_slots_kernel, (T, cdiv(Dx, block_d)),
        rows, topk_ids_TK, topk_weights_TK, pool_row_TK, out_TDx, Dx,
        rows.stride(0), rows.stride(1) if rows.dim() == 3 else 0, *topk_ids_TK.stride(), *topk_weights_TK.stride(),
        *pool_row_TK.stride(), out_TDx.stride(0),
        K=K, POOL_ROWS=rows.dim() == 2, OUT_DTYPE=_TL_DTYPES[out_dtype], BLOCK_D=block_d,
        num_warps=4, **launch_options(fp_fusion=False),
    )
    return out_TDx


def _check_args(y_PD: torch.Tensor, peers: PeerBuffers, regions: EPRegions) -> None:
    check_peers(peers, regions)
    if not regions.slot_rows:
        raise ShapeError("these regions have no combine_slots: build them with slot_rows=True (the batch-invariant "
                         "plan, CapacityPlan.build(..., batch_invariant=True))")
    if y_PD.dim() != 2 or y_PD.shape[1] != regions.hidden or y_PD.shape[0] > regions.num_pool_rows:
        raise ShapeError(f"y_PD must be [<= P={regions.num_pool_rows}, Dx={regions.hidden}], got {tuple(y_PD.shape)}")
    if y_PD.dtype != regions.activation_dtype:
        raise DTypeError(f"y_PD must be in the activation dtype {regions.activation_dtype} (the rows travel exactly), "
                         f"got {y_PD.dtype}")
    if y_PD.numel() and y_PD.stride(1) != 1:
        raise ShapeError(f"y_PD must have a contiguous last dimension, got strides {y_PD.stride()}")


def ep_combine_slots_push(y_PD: torch.Tensor, peers: PeerBuffers, regions: EPRegions) -> None:
    """Copy every slot row of my experts into its source's `combine_slots[t, j]` (one launch, no host sync).

    Call after `ep_dispatch` (same chunk) and the experts; follow with `symm_barrier` on every rank, after which
    each rank's `combine_slots[:T]` holds the rows of all its tokens' live slots.

    Args:
        y_PD: `[R_used, Dx]` activation dtype, the expert output of pool row p at row p; must cover every received
            row (the whole pool `[P, Dx]` is fine). Padding rows are never read.
        peers, regions: the buffers and layout (`regions.slot_rows`); reads MY `recv_num_tokens` and `recv_pos`.

    Writes: `combine_slots[t, j]` of every source s for its slots on my experts.
    """
    _check_args(y_PD, peers, regions)
    check_device("y_PD", y_PD)
    D, offsets = regions.hidden, [regions.offsets[name] for name in ("recv_num_tokens", "recv_pos", "combine_slots")]
    launch(_combine_slots_push_kernel, (regions.num_ranks * regions.cap,),  # one program per (source, token)
        y_PD, peers.ptrs_R, peers.rank, regions.cap, regions.num_topk, D, *offsets,
        y_PD.stride(0) if y_PD.numel() else D,
        ROW_DTYPE=_TL_DTYPES[regions.activation_dtype],
        BLOCK_D=min(next_power_of_2(D), 64 if is_interpreter() else EP_LAUNCH.combine_block_cols),
        num_warps=EP_LAUNCH.combine_warps, **launch_options(fp_fusion=False),
    )


def ep_combine_slots_push_ref(y_PD: torch.Tensor, peers: PeerBuffers, regions: EPRegions) -> None:
    """Torch twin of `ep_combine_slots_push` (same arguments, same writes, bitwise; no host sync)."""
    _check_args(y_PD, peers, regions)
    my, C = peers.local, regions.cap
    y_pad = torch.cat([y_PD, y_PD.new_zeros(1, regions.hidden)])  # row -1 -> a row never stored
    num_tokens_R = regions.view(my, "recv_num_tokens")
    for s, dst in enumerate(peers.buffers):
        pos_CK = regions.view(my, "recv_pos")[s]
        send_CK = (torch.arange(C, device=my.device) < num_tokens_R[s])[:, None] & (pos_CK >= 0)  # t >= T_s: stale
        rows_CKD = y_pad[torch.where(send_CK, pos_CK.to(torch.int64), -1)]
        # only the slots this rank owns: rewriting the whole region (torch.where + copy_) would also write back
        # what it read of the slots the other owners are pushing at the same time (a race: stale rows)
        send_CK = send_CK.to(dst.device)
        regions.view(dst, "combine_slots")[send_CK] = rows_CKD.to(dst.device)[send_CK]


def slot_rows_of_tokens(y_PD: torch.Tensor, pos_UK: torch.Tensor) -> torch.Tensor:
    """``[N, Dx]``: the rows ``y_PD[pos]`` of the slots with ``pos >= 0``, tokens in order, slots in order within a
    token (what the ``a2a`` transport sends one source; the source scatters them back in the same order).

    Args:
        y_PD: ``[<= P, Dx]`` expert outputs. pos_UK: ``[U, K]`` pool rows, -1 = not mine.
    """
    return y_PD[pos_UK[pos_UK >= 0].to(torch.int64)]
