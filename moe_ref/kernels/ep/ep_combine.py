"""EP combine: the expert owner pushes ONE weighted partial row per (source, token) back to the source, and the
source sums the partials of the ranks that own its token's slots, in rank order.

    ... ep_dispatch -> experts (y_PD) -> [ep_combine_push] -> symm_barrier -> [ep_combine_reduce] -> out_TD

push, on expert owner r, for every source s and token t < T_s with >= 1 slot on my experts:
    partial = sum_{j = 0..K-1 in order, recv_pos[s, t, j] >= 0} recv_weight[s, t, j] * y[recv_pos[s, t, j]]   (fp32)
    combine_partial_s[r, t] = partial.to(activation dtype)                                    (a store to rank s)
reduce, on source s, for every token t < T:
    out[t] = sum_{r' = 0..R-1 in order, r' owns >= 1 of t's slots} combine_partial[r', t]    (fp32) -> out dtype
A rank that owns none of t's slots wrote nothing at [r', t] and is never read (no zero rows are sent).

Both sums add in a fixed order with separate multiply and add roundings (GPU launches disable FMA
contraction), so the kernels and their twins agree bitwise and every run repeats bitwise.

Shape legend: R ranks, e local experts, K top-k, C cap, T tokens of this rank, Dx row width, P pool rows,
U tokens exchanged with one rank (the rows given to `weighted_partials_ref`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from moe_ref.core.errors import DTypeError, ShapeError

from moe_ref.kernels.runtime._triton_utils import check_device, is_interpreter, launch_options, next_power_of_2
from moe_ref.kernels.runtime.launch import launch
from moe_ref.kernels.ep.ep_dispatch import source_token
from moe_ref.kernels.ep.ep_launch import EP_LAUNCH
from moe_ref.kernels.ep.ep_regions import EPRegions, PeerBuffers, check_peers
from moe_ref.kernels.ep.symm_signal import (
    DEFAULT_MAX_POLLS,
    DEFAULT_TIMEOUT_US,
    arrive_then_post,
    bound_mode,
    symm_barrier,
    symm_barrier_ref,
    wait_epoch,
)

__all__ = ["ep_combine_push", "ep_combine_push_ref", "ep_combine_reduce", "ep_combine_reduce_ref"]

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _cast_rn(x, DTYPE: tl.constexpr):
    """fp32 -> DTYPE rounding to nearest even. For bf16 the rounding is done on the bit pattern first (the
    interpreter's own fp32 -> bf16 cast does not round to nearest; the GPU's does, so both agree)."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        x = tl.where(x != x, x, rounded)  # NaN stays NaN
    return x.to(DTYPE)


@triton.jit
def _combine_push_kernel(
    # pointers
    y_ptr, ptrs_R,
    # sizes / scalars
    rank, C, K, D, off_recv_num_tokens, off_recv_pos, off_recv_weight, off_combine_partial,
    R, off_signal, off_epoch, off_counter,
    # strides
    stride_y_p,
    # meta
    PART_DTYPE: tl.constexpr,      # activation dtype of combine_partial
    POST: tl.constexpr,            # the last program to finish posts the next barrier epoch to every rank
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """One program = one (source s, token t): weighted sum of t's rows on my experts, stored once at s.

    Example: K=2, recv_pos[s, t] = [7, -1], recv_weight[s, t] = [0.5, 0.25], y[7] = [2.0, -4.0]
        -> combine_partial_s[rank, t] = [1.0, -2.0]; a token with recv_pos [-1, -1] stores nothing.
    """
    s, t, my_base, live = source_token(ptrs_R, rank, C, off_recv_num_tokens)
    if live:
        offs_k = tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        my_slot = (s * C + t).to(tl.int64) * K + offs_k
        pos = tl.load((my_base + off_recv_pos).to(tl.pointer_type(tl.int32)) + my_slot, mask=mask_k, other=-1)
        weight = tl.load((my_base + off_recv_weight).to(tl.pointer_type(tl.float32)) + my_slot, mask=mask_k,
                         other=0.0)
        if tl.sum((pos >= 0).to(tl.int32), axis=0) > 0:
            dst_base = tl.load(ptrs_R + s)
            out_ptr = (dst_base + off_combine_partial).to(tl.pointer_type(PART_DTYPE)) + (rank * C + t).to(tl.int64) * D
            for d0 in range(0, D, BLOCK_D):
                offs_d = d0 + tl.arange(0, BLOCK_D)
                mask_d = offs_d < D
                acc = tl.zeros([BLOCK_D], dtype=tl.float32)
                for j in tl.static_range(BLOCK_K):
                    pos_j = tl.sum(tl.where(offs_k == j, pos, 0), axis=0).to(tl.int64)
                    w_j = tl.sum(tl.where(offs_k == j, weight, -0.0), axis=0)  # -0.0: the sum is exact, sign included
                    valid = (tl.full([BLOCK_D], 0, tl.int64) + pos_j) >= 0  # a tensor (the interpreter needs it)
                    row = tl.load(y_ptr + pos_j * stride_y_p + offs_d, mask=mask_d & valid, other=0.0).to(tl.float32)
                    # where(), not "+ 0": a skipped slot leaves acc bit-identical (-0.0 stays -0.0)
                    acc = tl.where(valid, acc + w_j * row, acc)
                tl.store(out_ptr + offs_d, _cast_rn(acc, PART_DTYPE), mask=mask_d)
    if POST:
        arrive_then_post(ptrs_R, my_base, rank, R, off_signal, off_epoch, off_counter, BLOCK_R)


@triton.jit
def _combine_reduce_kernel(
    # pointers
    out_ptr, ptrs_R,
    # sizes / scalars
    rank, R, T, C, K, D, e, off_topk_ids, off_combine_partial,
    off_signal, off_epoch, off_status, max_polls, timeout_ns,
    # strides
    stride_out_t,
    # meta
    PART_DTYPE: tl.constexpr,
    WAIT: tl.constexpr,            # every program first waits (bounded) for every rank's post of my epoch
    BOUND: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Program p = tokens p, p + P, ... (P programs, at most a few per SM: each waits once), all columns:
    sum the partials of the owning ranks in rank order.

    Example: R=2, e=4, ids[t] = [5, 6] (both on rank 1) -> out[t] = partial[1, t]; ids [0, -1] -> partial[0, t].
    """
    my_base = tl.load(ptrs_R + rank)
    if WAIT:
        wait_epoch(my_base, R, off_signal, off_epoch, off_status, max_polls, timeout_ns, BOUND, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    part_ptr = (my_base + off_combine_partial).to(tl.pointer_type(PART_DTYPE))
    for t_idx in range(tl.program_id(0), T, tl.num_programs(0)):
        t = t_idx + tl.zeros([], dtype=tl.int64)  # int64 offsets (works for the interpreter's plain ints too)
        ids = tl.load((my_base + off_topk_ids).to(tl.pointer_type(tl.int64)) + t * K + offs_k, mask=offs_k < K,
                      other=-1)
        owner = tl.where(ids >= 0, ids // e, -1)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask_d = offs_d < D
            acc = tl.zeros([BLOCK_D], dtype=tl.float32)
            for src in range(0, R):
                owns = (tl.full([BLOCK_D], 0, tl.int32) + tl.sum((owner == src).to(tl.int32), axis=0)) > 0
                row = tl.load(part_ptr + (src * C + t) * D + offs_d, mask=mask_d & owns, other=0.0).to(tl.float32)
                acc = tl.where(owns, acc + row, acc)
            tl.store(out_ptr + t * stride_out_t + offs_d, _cast_rn(acc, out_ptr.dtype.element_ty), mask=mask_d)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _check_push_args(y_PD: torch.Tensor, peers: PeerBuffers, regions: EPRegions) -> None:
    check_peers(peers, regions)
    if y_PD.dim() != 2 or y_PD.shape[1] != regions.hidden or y_PD.shape[0] > regions.num_pool_rows:
        raise ShapeError(f"y_PD must be [<= P={regions.num_pool_rows}, Dx={regions.hidden}], got {tuple(y_PD.shape)}")
    if not y_PD.dtype.is_floating_point or y_PD.dtype == torch.float8_e4m3fn:
        raise DTypeError(f"y_PD must be fp32/fp16/bf16, got {y_PD.dtype}")
    if y_PD.numel() and y_PD.stride(1) != 1:
        raise ShapeError(f"y_PD must have a contiguous last dimension, got strides {y_PD.stride()}")


def ep_combine_push(y_PD: torch.Tensor, peers: PeerBuffers, regions: EPRegions, *, post: bool = False) -> None:
    """Push one weighted partial per (source, token) into each source's `combine_partial` (one launch).

    Call after `ep_dispatch` (same chunk) and the experts; follow with `symm_barrier`, then
    `ep_combine_reduce` on every rank (or `post=True` here and `ep_combine_reduce(..., wait=True)`).

    Args:
        y_PD: `[R_used, Dx]` fp32/fp16/bf16 expert outputs, row p = the expert result of pool row p; must cover
            every received row (R_used >= `pool_end`; the whole pool `[P, Dx]` is fine). Padding rows are never read.
        peers, regions: the buffers and layout; reads MY `recv_num_tokens`, `recv_pos`, `recv_weight`.
        post: the last program to finish posts the next barrier epoch (the first half of `symm_barrier`, fused).

    Writes: `combine_partial[rank, t]` of every source s (activation dtype) for its tokens with >= 1 slot here.
    """
    _check_push_args(y_PD, peers, regions)
    check_device("y_PD", y_PD)
    R, K, C, D = regions.num_ranks, regions.num_topk, regions.cap, regions.hidden
    block_d = min(next_power_of_2(D), 64 if is_interpreter() else EP_LAUNCH.combine_block_cols)
    off = regions.offsets
    launch(_combine_push_kernel, (R * C,),
        y_PD, peers.ptrs_R,
        peers.rank, C, K, D, off["recv_num_tokens"], off["recv_pos"], off["recv_weight"], off["combine_partial"],
        R, off["signal"], off["epoch"], off["counter"],
        y_PD.stride(0) if y_PD.numel() else D,
        PART_DTYPE=_TL_DTYPES[regions.activation_dtype], POST=post, BLOCK_K=next_power_of_2(K),
        BLOCK_D=block_d, BLOCK_R=next_power_of_2(R),
        num_warps=EP_LAUNCH.combine_warps, **launch_options(fp_fusion=False),
    )


def ep_combine_push_ref(y_PD: torch.Tensor, peers: PeerBuffers, regions: EPRegions, *, post: bool = False) -> None:
    """Torch twin of `ep_combine_push` (same arguments, same writes, bitwise; no host sync)."""
    _check_push_args(y_PD, peers, regions)
    my, rank = peers.local, peers.rank
    C = regions.cap
    num_tokens_R = regions.view(my, "recv_num_tokens")
    for s, dst in enumerate(peers.buffers):
        live_C = torch.arange(C, device=my.device) < num_tokens_R[s]
        part_CD, send_C = weighted_partials_ref(y_PD, regions.view(my, "recv_pos")[s], regions.view(my, "recv_weight")[s],
                                                live_C, regions.activation_dtype)
        part_dst = regions.view(dst, "combine_partial")[rank]
        part_dst.copy_(torch.where(send_C[:, None], part_CD.to(part_dst.device), part_dst))
    if post:
        symm_barrier_ref(peers, regions, post=True, wait=False)


def weighted_partials_ref(y_PD: torch.Tensor, pos_UK: torch.Tensor, weight_UK: torch.Tensor, live_U: torch.Tensor,
                          out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One partial row per token: `sum_j w[u, j] * y[pos[u, j]]` over the slots with `pos >= 0`, j in order, fp32
    with separate multiply and add roundings (as the push kernel), then cast to `out_dtype`.

    Args:
        y_PD: `[<= P, Dx]` expert outputs. pos_UK: `[U, K]` pool rows (-1: not mine). weight_UK: `[U, K]` fp32.
        live_U: `[U]` bool, rows to compute (the others count as having no slot here).

    Returns:
        part_UD `[U, Dx]` out_dtype, and has_slot_U `[U]` bool (live rows with >= 1 slot here: the ones sent).
    """
    D = y_PD.shape[1]
    y_pad = torch.cat([y_PD.float(), y_PD.new_zeros(1, D, dtype=torch.float32)])  # row -1 -> a zero row
    valid_UK = live_U[:, None] & (pos_UK >= 0)  # rows t >= T_s of recv_pos are stale
    pos_UK = torch.where(valid_UK, pos_UK.to(torch.int64), -1)
    acc_UD = torch.zeros(pos_UK.shape[0], D, dtype=torch.float32, device=y_PD.device)
    for j in range(pos_UK.shape[1]):
        acc_UD = torch.where(valid_UK[:, j:j + 1], acc_UD + weight_UK[:, j:j + 1] * y_pad[pos_UK[:, j]], acc_UD)
    return acc_UD.to(out_dtype), valid_UK.any(dim=1)


def _check_reduce_args(num_tokens: int, peers: PeerBuffers, regions: EPRegions, out_dtype) -> torch.dtype:
    check_peers(peers, regions)
    if not 0 <= num_tokens <= regions.cap:
        raise ShapeError(f"{num_tokens=} must be in [0, C={regions.cap}]")
    out_dtype = regions.activation_dtype if out_dtype is None else out_dtype
    if out_dtype not in _TL_DTYPES:
        raise DTypeError(f"out_dtype must be fp32/fp16/bf16, got {out_dtype}")
    return out_dtype


def ep_combine_reduce(num_tokens: int, peers: PeerBuffers, regions: EPRegions,
                      out_dtype: torch.dtype | None = None, *, wait: bool = False,
                      timeout_us: float = DEFAULT_TIMEOUT_US, max_polls: int = DEFAULT_MAX_POLLS) -> torch.Tensor:
    """Sum my tokens' partials over the owning ranks in rank order (one launch, local reads only).

    Call after every rank's `ep_combine_push` and a `symm_barrier`, or pass `wait=True` after every rank's
    `ep_combine_push(..., post=True)`.

    Args:
        num_tokens: T of this chunk (a host int: the output shape; the same T that `ep_pre_dispatch` got).
        peers, regions: reads MY `topk_ids [:T]` and `combine_partial`.
        out_dtype: default the activation dtype.
        wait: every program first waits for every rank's post of my current epoch (the second half of
            `symm_barrier`, fused; bounded by `timeout_us` / `max_polls`).
        timeout_us, max_polls: the bound of that wait.

    Returns:
        out_TD: `[T, Dx]` out_dtype; a token with no live slot gets zeros.
    """
    out_dtype = _check_reduce_args(num_tokens, peers, regions, out_dtype)
    check_device("peers.ptrs_R", peers.ptrs_R)
    D = regions.hidden
    out_TD = torch.empty(num_tokens, D, dtype=out_dtype, device=peers.local.device)
    if num_tokens == 0:
        if wait:  # nothing to reduce, but the wait is part of the barrier every rank counts on
            symm_barrier(peers, regions, post=False, wait=True, timeout_us=timeout_us, max_polls=max_polls)
        return out_TD
    block_d = min(next_power_of_2(D), 64 if is_interpreter() else EP_LAUNCH.combine_block_cols)
    off = regions.offsets
    num_programs = min(num_tokens, 8 if is_interpreter() else 4 * _num_sms(out_TD.device.index))
    launch(_combine_reduce_kernel, (num_programs,),
        out_TD, peers.ptrs_R,
        peers.rank, regions.num_ranks, num_tokens, regions.cap, regions.num_topk, D, regions.num_local_experts,
        off["topk_ids"], off["combine_partial"],
        off["signal"], off["epoch"], off["status"], int(max_polls), int(timeout_us * 1000),
        out_TD.stride(0),
        PART_DTYPE=_TL_DTYPES[regions.activation_dtype], WAIT=wait, BOUND=bound_mode(),
        BLOCK_K=next_power_of_2(regions.num_topk), BLOCK_D=block_d,
        BLOCK_R=next_power_of_2(regions.num_ranks),
        num_warps=EP_LAUNCH.combine_warps, **launch_options(fp_fusion=False),
    )
    return out_TD


def ep_combine_reduce_ref(num_tokens: int, peers: PeerBuffers, regions: EPRegions,
                          out_dtype: torch.dtype | None = None, *, wait: bool = False,
                          timeout_us: float = DEFAULT_TIMEOUT_US, max_polls: int = DEFAULT_MAX_POLLS) -> torch.Tensor:
    """Torch twin of `ep_combine_reduce` (same arguments and result, bitwise; no host sync but the wait's)."""
    out_dtype = _check_reduce_args(num_tokens, peers, regions, out_dtype)
    if wait:
        symm_barrier_ref(peers, regions, post=False, wait=True, timeout_us=timeout_us, max_polls=max_polls)
    my = peers.local
    return sum_partials_ref(regions.view(my, "topk_ids")[:num_tokens], regions.view(my, "combine_partial"),
                            regions.num_local_experts, out_dtype)


def slot_owners_TR(topk_ids_TK: torch.Tensor, num_local_experts: int, num_ranks: int) -> torch.Tensor:
    """``[T, R]`` bool: rank r owns >= 1 of token t's slots (global expert e lives on rank e // e_local; -1 =
    masked, owned by nobody). Who sends a token in dispatch, and whose partial comes back for it in combine."""
    owner_TK = torch.where(topk_ids_TK >= 0, topk_ids_TK // num_local_experts, -1)
    return (owner_TK[:, :, None] == torch.arange(num_ranks, device=topk_ids_TK.device)).any(dim=1)


def sum_partials_ref(topk_ids_TK: torch.Tensor, part_RCD: torch.Tensor, num_local_experts: int,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """`out[t] = sum over ranks r in order, r owning >= 1 of t's slots, of part[r, t]` in fp32 -> out_dtype.

    Shared by the reduce twin and the `a2a` transport. topk_ids_TK `[T, K]` int64; part_RCD `[R, >= T, Dx]`.
    """
    num_tokens = topk_ids_TK.shape[0]
    owns_TR = slot_owners_TR(topk_ids_TK, num_local_experts, part_RCD.shape[0])
    acc_TD = torch.zeros(num_tokens, part_RCD.shape[2], dtype=torch.float32, device=part_RCD.device)
    for src in range(part_RCD.shape[0]):
        acc_TD = torch.where(owns_TR[:, src:src + 1], acc_TD + part_RCD[src, :num_tokens].float(), acc_TD)
    return acc_TD.to(out_dtype)
