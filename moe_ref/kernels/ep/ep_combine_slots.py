"""The batch-invariant combine's exchange: the expert owner pushes every (source, token, slot) expert row it
computed, unweighted and unreduced, into the source's `combine_slots [C, K, Dx]` (one launch), and the source sums
its tokens' K rows itself in slot order (`moe_ref.ep.batch_invariant.sum_slots`).

    ... ep_dispatch -> experts (y_PD) -> [ep_combine_slots_push] -> symm_barrier -> sum_slots (source, torch)

push, on expert owner r, for every source s, token t < T_s and slot j with recv_pos[s, t, j] >= 0:
    combine_slots_s[t, j] = y[recv_pos[s, t, j]]                       (a copy to rank s, activation dtype, exact)
Every slot of a token has ONE owner (the rank of its expert), so no two ranks write one row; a masked slot (id -1)
is written by nobody and holds stale bytes that the sum never reads.

The kernel copies rows bit for bit (no arithmetic), so it and its twin agree bitwise. Against the default combine
(`ep_combine`), a token sends K rows back instead of one partial per owning rank: K x Dx values in the activation
dtype per token.

Shape legend: R ranks, K top-k, C cap, Dx row width, P pool rows, U tokens exchanged with one rank, N routed entries
(the live slots among them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_ref.core.errors import DTypeError, ShapeError
from moe_ref.kernels.ep.ep_dispatch import source_token
from moe_ref.kernels.ep.ep_launch import EP_LAUNCH
from moe_ref.kernels.ep.ep_regions import EPRegions, PeerBuffers, check_peers
from moe_ref.kernels.runtime._triton_utils import check_device, is_interpreter, launch_options, next_power_of_2
from moe_ref.kernels.runtime.launch import launch

__all__ = ["ep_combine_slots_push", "ep_combine_slots_push_ref"]

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


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
