"""Source-side EP layout: per-(destination rank, local expert) counts and each slot's rank among my slots to
its expert, computed on the device (deterministic, no atomics, no host sync), plus the fused pre-dispatch.

    router -> [ep_layout + pre_dispatch] -> symm_barrier -> ep_dispatch -> experts -> ep_combine_push -> ...

    send_count[g // e, g % e] = #{(t, j): topk_ids[t, j] == g}                       (global expert g)
    slot_rank[t, j]           = #{(t', j') before (t, j) in row-major order: topk_ids[t', j'] == topk_ids[t, j]}
                                (-1 for masked slots and ids outside [0, E))

A receiver places slot (s, t, j) of its local expert i at
`row_start[i] + sum_{s' < s} send_count_{s'}[r, i] + slot_rank_s[t, j]` (see `ep_dispatch`), so the pool is
ordered by (source rank, token) inside each expert segment.

The kernel: program p owns global experts [p * BLOCK_E, (p+1) * BLOCK_E) and scans all T*K slots in order,
BLOCK_N at a time: a one-hot [BLOCK_N, BLOCK_E] match, its inclusive cumsum down the slots plus the running
count gives each matching slot its rank. Each slot is written by exactly one program; program 0 writes -1 for
slots no program owns and `num_tokens`.

Shape legend: T tokens of this rank, K top-k, E = R * e experts, R ranks, e local experts, C cap, Dx row width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_ref.core.errors import DTypeError, ShapeError

from moe_ref.kernels.runtime._triton_utils import cdiv, check_device, is_interpreter, next_power_of_2
from moe_ref.kernels.ep.ep_regions import EPRegions, PeerBuffers, check_peers
from moe_ref.kernels.ep.pre_dispatch import pre_dispatch, pre_dispatch_ref
from moe_ref.kernels.ep.symm_signal import arrive_then_post, symm_barrier_ref
from moe_ref.kernels.runtime.launch import launch

__all__ = ["ep_layout", "ep_layout_ref", "ep_pre_dispatch", "ep_pre_dispatch_ref"]


@triton.jit
def _ep_layout_kernel(
    # pointers
    topk_ids_ptr, ptrs_R,
    # sizes / scalars
    rank, T, K, E, off_num_tokens, off_send_count, off_slot_rank,
    R, off_signal, off_epoch, off_counter,
    # strides
    stride_ids_t,
    # meta
    POST: tl.constexpr,            # the last program to finish posts the next barrier epoch to every rank
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """One program = BLOCK_E global experts, scanning every slot of this rank in (token, slot) order.

    Example: T=3, K=2, E=4 (R=2, e=2), ids [[2, 0], [2, -1], [0, 2]], BLOCK_E=2 -> program 0 (experts 0, 1):
        slots (0,1), (2,0) rank 0, 1; program 1 (experts 2, 3): slots (0,0), (1,0), (2,1) rank 0, 1, 2;
        send_count = [[2, 0], [3, 0]]; slot_rank = [[0, 0], [1, -1], [1, 2]]; num_tokens = 3.
    """
    pid = tl.program_id(0)
    my_base = tl.load(ptrs_R + rank)
    slot_rank_ptr = (my_base + off_slot_rank).to(tl.pointer_type(tl.int32))
    experts = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    running = tl.zeros([BLOCK_E], dtype=tl.int32)
    num_slots = T * K
    for n0 in range(0, num_slots, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < num_slots
        t = offs_n // K
        ids = tl.load(topk_ids_ptr + t.to(tl.int64) * stride_ids_t + (offs_n - t * K), mask=mask_n, other=-1)
        hit = (ids[:, None] == experts[None, :]) & (experts[None, :] < E)      # [BLOCK_N, BLOCK_E]
        hit_i = hit.to(tl.int32)
        rank_n = tl.sum(tl.where(hit, tl.cumsum(hit_i, axis=0) - 1 + running[None, :], 0), axis=1)
        owned = tl.sum(hit_i, axis=1) > 0
        tl.store(slot_rank_ptr + offs_n, rank_n, mask=owned)                    # slot_rank is [C, K]: index t*K+j
        if pid == 0:
            tl.store(slot_rank_ptr + offs_n, tl.full([BLOCK_N], -1, tl.int32), mask=mask_n & ((ids < 0) | (ids >= E)))
        running += tl.sum(hit_i, axis=0)
    send_count_ptr = (my_base + off_send_count).to(tl.pointer_type(tl.int32))
    tl.store(send_count_ptr + experts, running, mask=experts < E)              # [R, e] row-major = global id
    if pid == 0:
        num_tokens_ptr = (my_base + off_num_tokens).to(tl.pointer_type(tl.int32))
        tl.store(num_tokens_ptr, T)
    if POST:
        arrive_then_post(ptrs_R, my_base, rank, R, off_signal, off_epoch, off_counter, BLOCK_R)


def _check_args(topk_ids_TK: torch.Tensor, peers: PeerBuffers, regions: EPRegions) -> None:
    if topk_ids_TK.dim() != 2 or topk_ids_TK.dtype != torch.int64 or topk_ids_TK.shape[1] != regions.num_topk:
        raise DTypeError(f"topk_ids_TK must be int64 [T, {regions.num_topk}], got {tuple(topk_ids_TK.shape)} "
                         f"{topk_ids_TK.dtype}")
    if topk_ids_TK.shape[0] > regions.cap:
        raise ShapeError(f"{topk_ids_TK.shape[0]=} tokens exceed the cap C={regions.cap} rows per rank")
    if topk_ids_TK.numel() and topk_ids_TK.stride(-1) != 1:
        raise ShapeError(f"topk_ids_TK must have a contiguous last dimension, got strides {topk_ids_TK.stride()}")
    check_peers(peers, regions)


def ep_layout(topk_ids_TK: torch.Tensor, peers: PeerBuffers, regions: EPRegions, *, post: bool = False) -> None:
    """Write MY `num_tokens`, `send_count [R, e]` and `slot_rank [:T]` regions (one launch, no host sync).

    Args:
        topk_ids_TK: `[T, K]` int64 global expert ids of my tokens, -1 = masked; T <= C (T may be 0).
        peers: the buffers (mine is written).
        regions: the layout (R, e, K, C).
        post: when every program is done, post the next barrier epoch to every rank (the first half of
            `symm_barrier`, fused; everything written before and by this launch is then visible to a peer that
            waits for it, e.g. `ep_dispatch(wait=True)`).

    Writes (in my buffer): `num_tokens[0] = T` int32; `send_count[s, i]` int32 = my slots to global expert
    s * e + i; `slot_rank[t, j]` int32 (module doc), rows t >= T untouched.
    """
    _check_args(topk_ids_TK, peers, regions)
    check_device("topk_ids_TK", topk_ids_TK)
    num_tokens, num_topk = topk_ids_TK.shape
    num_experts = regions.num_ranks * regions.num_local_experts
    num_slots = num_tokens * num_topk
    if is_interpreter():
        block_n, block_e = max(16, next_power_of_2(min(num_slots, 64))), 4
    else:
        block_n, block_e = min(2048, max(16, next_power_of_2(num_slots))), 2
    grid = (cdiv(num_experts, block_e),)
    launch(_ep_layout_kernel, grid,
        topk_ids_TK, peers.ptrs_R,
        peers.rank, num_tokens, num_topk, num_experts, regions.offsets["num_tokens"], regions.offsets["send_count"],
        regions.offsets["slot_rank"],
        regions.num_ranks, regions.offsets["signal"], regions.offsets["epoch"], regions.offsets["counter"],
        topk_ids_TK.stride(0) if num_tokens else num_topk,
        POST=post, BLOCK_N=block_n, BLOCK_E=block_e, BLOCK_R=next_power_of_2(regions.num_ranks), num_warps=4,
    )


def ep_layout_ref(topk_ids_TK: torch.Tensor, peers: PeerBuffers, regions: EPRegions, *, post: bool = False) -> None:
    """Torch twin of `ep_layout` (same arguments, same writes; a stable sort instead of one-hot scans)."""
    _check_args(topk_ids_TK, peers, regions)
    my = peers.local
    num_tokens, num_topk = topk_ids_TK.shape
    num_experts = regions.num_ranks * regions.num_local_experts
    ids_N = topk_ids_TK.reshape(-1)
    valid_N = (ids_N >= 0) & (ids_N < num_experts)
    key_N = torch.where(valid_N, ids_N, num_experts)  # invalid slots sort last, in their own bucket
    order_N = torch.sort(key_N, stable=True).indices
    counts = torch.bincount(key_N, minlength=num_experts + 1)
    first = torch.cumsum(counts, 0) - counts
    rank_sorted = torch.arange(ids_N.numel(), device=ids_N.device) - first[key_N[order_N]]
    rank_N = torch.empty_like(ids_N)
    rank_N[order_N] = rank_sorted
    rank_N = torch.where(valid_N, rank_N, -1)
    regions.view(my, "slot_rank")[:num_tokens] = rank_N.view(num_tokens, num_topk).to(torch.int32)
    regions.view(my, "send_count").copy_(counts[:num_experts].view(regions.num_ranks, -1).to(torch.int32))
    regions.view(my, "num_tokens").fill_(num_tokens)
    if post:
        symm_barrier_ref(peers, regions, post=True, wait=False)


def _send_views(peers: PeerBuffers, regions: EPRegions) -> dict:
    my = peers.local
    return dict(buf_x_CD=regions.view(my, "x"),
                buf_x_scale_CDb=regions.view(my, "x_scale") if regions.fp8 else None,
                buf_topk_ids_CK=regions.view(my, "topk_ids"), buf_topk_weights_CK=regions.view(my, "topk_weights"))


def ep_pre_dispatch(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                    peers: PeerBuffers, regions: EPRegions, *, post: bool = False) -> None:
    """Fill MY send regions for one chunk: `kernels.pre_dispatch` + `ep_layout` (two launches, no host sync).

    Args:
        x_TD: `[T, Dx]` activation dtype (`regions.activation_dtype`), T <= C.
        topk_ids_TK: `[T, K]` int64, -1 = masked.
        topk_weights_TK: `[T, K]` fp32.
        peers, regions: the buffers and their layout.
        post: `ep_layout`'s last program posts the next barrier epoch (after both launches' writes).

    Writes (my buffer): `num_tokens`, `send_count`, `slot_rank`, `x` (+ `x_scale`: fp8 e4m3 per 128 columns),
    `topk_ids`, `topk_weights` (rows t < T).
    """
    if x_TD.dtype != regions.activation_dtype:
        raise DTypeError(f"x_TD is {x_TD.dtype}, the regions were laid out for {regions.activation_dtype}")
    # an empty counter: pre_dispatch counts only ids in [0, 0), i.e. none (ep_layout wrote the counts); a
    # zero-size view of a real allocation, so the kernel gets a valid (never dereferenced) pointer
    no_counts = torch.empty(1, dtype=torch.int32, device=x_TD.device)[:0]
    pre_dispatch(x_TD, topk_ids_TK, topk_weights_TK, num_rows_per_expert_E=no_counts, **_send_views(peers, regions))
    ep_layout(topk_ids_TK, peers, regions, post=post)  # second: its post covers pre_dispatch's writes


def ep_pre_dispatch_ref(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                        peers: PeerBuffers, regions: EPRegions, *, post: bool = False) -> None:
    """Torch twin of `ep_pre_dispatch` (same arguments, same writes)."""
    if x_TD.dtype != regions.activation_dtype:
        raise DTypeError(f"x_TD is {x_TD.dtype}, the regions were laid out for {regions.activation_dtype}")
    # the twin's counter is scratch: pre_dispatch_ref cannot take an empty one
    scratch = torch.zeros(regions.num_ranks * regions.num_local_experts, dtype=torch.int32, device=x_TD.device)
    pre_dispatch_ref(x_TD, topk_ids_TK, topk_weights_TK, num_rows_per_expert_E=scratch, **_send_views(peers, regions))
    ep_layout_ref(topk_ids_TK, peers, regions, post=post)
