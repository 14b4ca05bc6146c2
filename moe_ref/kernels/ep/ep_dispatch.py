"""Receiver-side EP dispatch: pull every source's rows routed to my experts into my expert-major pool.

    ep_pre_dispatch (every rank) -> symm_barrier -> [ep_dispatch] -> experts -> ep_combine_push -> ...

Two launches, no host sync:
1. `_recv_layout_kernel` (one program): read every source's `num_tokens` and `send_count[:, r]` (my column),
   then on the device, with seg[i] = align(num_rows[i], alignment) (contiguous pool) or M (masked pool)
       num_rows[i]     = sum_s send_count_s[r, i]
       row_start[i]    = sum_{i' < i} seg[i']                               (contiguous: aligned; masked: i * M)
       recv_base[s, i] = row_start[i] + sum_{s' < s} send_count_{s'}[r, i]
       pool_end        = sum_i seg[i]
   `pool_end > P`, or a masked segment given more than M rows, sets `status = [2, rows needed]`
   (rows past their segment are then dropped, never written elsewhere). After a peer timeout
   (`status[0] == 1`) it receives nothing (every T_s = 0): the peers' regions may hold anything.
2. `_dispatch_rows_kernel` (one program per (source s, token t < C)): for t < T_s read the token's K ids,
   slot ranks and weights from s, and for the slots j routed to my local expert i:
       pos = recv_base[s, i] + slot_rank_s[t, j]
   write `recv_src[pos] = (s, t, j)`, `recv_pos[s, t, j] = pos` (-1 for slots not mine), `recv_weight[s, t, j]`,
   then read the row `x_s[t]` ONCE (and its fp8 scales) and store it into each of its k' <= K pool rows. The
   programs also write -1 into `recv_src` of every padding row (from a segment's last row to its next multiple of
   `alignment`), local expert i by program i mod #programs (one program alone was slow at e=192).
   Rows are moved as raw words (8, 4, 2 or 1 bytes), so any wire dtype is copied bit for bit.

Shape legend: R ranks, e local experts, K top-k, C cap, Dx row width, Db = ceil(Dx/128), P pool rows,
U tokens exchanged with one rank (the rows given to `receive_rows_ref`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_ref.core.errors import ShapeError
from moe_ref.kernels.runtime._triton_utils import check_device, is_interpreter, next_power_of_2
from moe_ref.kernels.runtime.launch import launch
from moe_ref.kernels.ep.ep_launch import EP_LAUNCH
from moe_ref.kernels.ep.ep_regions import STATUS_PEER_TIMEOUT, STATUS_POOL_OVERFLOW, EPRegions, PeerBuffers, check_peers
from moe_ref.kernels.ep.symm_signal import (
    DEFAULT_MAX_POLLS,
    DEFAULT_TIMEOUT_US,
    bound_mode,
    symm_barrier_ref,
    wait_epoch,
)

__all__ = ["ep_dispatch", "ep_dispatch_ref"]

_WORD_DTYPES = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}


@triton.jit
def _recv_layout_kernel(
    # pointers
    ptrs_R,
    # sizes / scalars
    rank, R, e, alignment, P, masked_rows,
    off_num_tokens, off_send_count, off_recv_num_tokens, off_num_rows, off_row_start, off_recv_base, off_pool_end,
    off_status, off_signal, off_epoch, max_polls, timeout_ns,
    received_e,                    # [e] int64 running count of received rows (COUNT_RECEIVED)
    # meta
    WAIT: tl.constexpr,            # first wait (bounded) until every rank posted my current epoch
    BOUND: tl.constexpr,
    COUNT_RECEIVED: tl.constexpr,  # add num_rows into received_e (a statistic kept outside the buffer)
    BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """One program: the receive layout of rank `rank` from every source's counts.

    Example: R=2, e=2, alignment 4, send_count column of rank 0: source 0 -> [1, 2], source 1 -> [3, 0]
        -> num_rows [4, 2], row_start [0, 4], recv_base [[0, 4], [1, 6]], pool_end 8 (padding rows 6, 7);
        masked with M = 8: row_start [0, 8], recv_base [[0, 8], [1, 10]], pool_end 16 (padding rows 10, 11).
    """
    my_base = tl.load(ptrs_R + rank)
    if WAIT:
        wait_epoch(my_base, R, off_signal, off_epoch, off_status, max_polls, timeout_ns, BOUND, BLOCK_R)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < e
    # after a peer timeout the peers' send regions may hold anything: receive nothing (the call is invalid)
    status_ptr = (my_base + off_status).to(tl.pointer_type(tl.int32))
    live = tl.load(status_ptr) != 1
    src_base = tl.load(ptrs_R + offs_r, mask=mask_r, other=0)
    num_tokens_r = tl.load((src_base + off_num_tokens).to(tl.pointer_type(tl.int32)), mask=mask_r, other=0)
    num_tokens_r = tl.where(live, num_tokens_r, 0)
    counts_ptrs = (src_base[:, None] + off_send_count).to(tl.pointer_type(tl.int32)) + rank * e + offs_e[None, :]
    mask_re = mask_r[:, None] & mask_e[None, :]
    counts = tl.load(counts_ptrs, mask=mask_re, other=0).to(tl.int64)           # [BLOCK_R, BLOCK_E]
    counts = tl.where(live, counts, 0)
    num_rows = tl.sum(counts, axis=0)
    aligned = (num_rows + alignment - 1) // alignment * alignment
    segment = tl.where(masked_rows > 0, tl.where(mask_e, masked_rows, 0).to(tl.int64), aligned)
    row_start = tl.cumsum(segment, axis=0) - segment
    recv_base = row_start[None, :] + tl.cumsum(counts, axis=0) - counts
    pool_end = tl.sum(segment, axis=0)
    most_rows = tl.max(num_rows, axis=0)

    tl.store((my_base + off_recv_num_tokens).to(tl.pointer_type(tl.int32)) + offs_r, num_tokens_r, mask=mask_r)
    tl.store((my_base + off_num_rows).to(tl.pointer_type(tl.int64)) + offs_e, num_rows, mask=mask_e)
    if COUNT_RECEIVED:  # one program: no other writer of received_e
        seen = tl.load(received_e + offs_e, mask=mask_e, other=0)
        tl.store(received_e + offs_e, seen + num_rows, mask=mask_e)
    tl.store((my_base + off_row_start).to(tl.pointer_type(tl.int64)) + offs_e, row_start, mask=mask_e)
    tl.store((my_base + off_recv_base).to(tl.pointer_type(tl.int64)) + offs_r[:, None] * e + offs_e[None, :],
             recv_base, mask=mask_re)
    tl.store((my_base + off_pool_end).to(tl.pointer_type(tl.int64)), pool_end)
    if pool_end > P:
        tl.store(status_ptr + 1, pool_end.to(tl.int32))
        tl.store(status_ptr, 2)
    if (masked_rows > 0) & (most_rows > masked_rows):
        tl.store(status_ptr + 1, most_rows.to(tl.int32))
        tl.store(status_ptr, 2)


@triton.jit
def _write_padding_rows(my_base, e, P, alignment, masked_rows, off_num_rows, off_row_start, off_recv_src,
                        BLOCK_A: tl.constexpr):
    """recv_src = -1 on the padding rows of my segments [row_start + num_rows, row_start + align(num_rows)) (below P
    and the segment's end), spread over the programs: expert i by program i, i + #programs, ... ."""
    recv_src_ptr = (my_base + off_recv_src).to(tl.pointer_type(tl.int32))
    minus_one = tl.full([BLOCK_A], -1, tl.int32)
    for i in range(tl.program_id(0), e, tl.num_programs(0)):
        count = tl.load((my_base + off_num_rows).to(tl.pointer_type(tl.int64)) + i)
        start = tl.load((my_base + off_row_start).to(tl.pointer_type(tl.int64)) + i)
        end = start + (count + alignment - 1) // alignment * alignment
        if masked_rows > 0:
            end = tl.minimum(end, start + masked_rows)
        end = tl.minimum(end, P)
        for a0 in range(0, alignment - 1, BLOCK_A):
            rows = start + count + a0 + tl.arange(0, BLOCK_A)
            for c in tl.static_range(3):
                tl.store(recv_src_ptr + rows * 3 + c, minus_one, mask=(rows >= 0) & (rows < end))


@triton.jit
def _pick(values, offs_k, j):
    """values[j] of a [BLOCK_K] vector, as a scalar."""
    return tl.sum(tl.where(offs_k == j, values, 0), axis=0)


@triton.jit
def source_token(ptrs_R, rank, C, off_recv_num_tokens):
    """(s, t, my base address, t < T_s) of a program of an R * C grid over (source rank, token)."""
    pid = tl.program_id(0)
    s = pid // C
    t = pid - s * C
    my_base = tl.load(ptrs_R + rank)
    num_tokens_s = tl.load((my_base + off_recv_num_tokens).to(tl.pointer_type(tl.int32)) + s)
    return s, t, my_base, t < num_tokens_s


@triton.jit
def _dispatch_rows_kernel(
    # pointers
    ptrs_R,
    # sizes / scalars
    rank, C, K, e, P, alignment, masked_rows, row_words, scale_words,
    off_topk_ids, off_topk_weights, off_slot_rank, off_x, off_x_scale, off_num_rows, off_row_start,
    off_recv_num_tokens, off_recv_base, off_recv_pos, off_recv_weight, off_recv_src, off_recv_x, off_recv_x_scale,
    # meta
    WORD: tl.constexpr,            # integer type the rows are copied as
    HAS_SCALE: tl.constexpr,       # fp8: copy the scale rows too (int32 words)
    BLOCK_K: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_A: tl.constexpr,
):
    """One program = one (source s, token t): move the row once, expand it to its pool rows here. Program p also
    writes the padding rows of local experts p, p + #programs, ... .

    Example: rank 1, e=2, K=2, source 0 token 3 with ids [3, 0], slot_rank [5, 9], recv_base[0] = [8, 20]
        -> slot 0 goes to local expert 1: pos 20 + 5 = 25; slot 1 is not mine. recv_pos[0, 3] = [25, -1],
        recv_src[25] = (0, 3, 0), recv_x[25] = x_0[3].
    """
    s, t, my_base, live = source_token(ptrs_R, rank, C, off_recv_num_tokens)
    if alignment > 1:
        _write_padding_rows(my_base, e, P, alignment, masked_rows, off_num_rows, off_row_start, off_recv_src, BLOCK_A)
    if live:
        src_base = tl.load(ptrs_R + s)
        offs_k = tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        slot = t.to(tl.int64) * K + offs_k
        ids = tl.load((src_base + off_topk_ids).to(tl.pointer_type(tl.int64)) + slot, mask=mask_k, other=-1)
        srank = tl.load((src_base + off_slot_rank).to(tl.pointer_type(tl.int32)) + slot, mask=mask_k, other=0)
        weight = tl.load((src_base + off_topk_weights).to(tl.pointer_type(tl.float32)) + slot, mask=mask_k, other=0.0)
        local = ids - rank * e
        mine = mask_k & (ids >= 0) & (local >= 0) & (local < e)
        base = tl.load((my_base + off_recv_base).to(tl.pointer_type(tl.int64)) + s * e + local, mask=mine, other=0)
        pos = base + srank
        # an overflowing pool (status 2) drops rows, never writes past it (or past a masked segment)
        segment_end = tl.where(masked_rows > 0, (local + 1) * masked_rows, P)
        mine = mine & (pos >= 0) & (pos < P) & (pos < segment_end)
        pos = tl.where(mine, pos, -1)
        my_slot = (s * C + t).to(tl.int64) * K + offs_k
        tl.store((my_base + off_recv_pos).to(tl.pointer_type(tl.int32)) + my_slot, pos.to(tl.int32), mask=mask_k)
        tl.store((my_base + off_recv_weight).to(tl.pointer_type(tl.float32)) + my_slot, weight, mask=mask_k)
        recv_src_ptr = (my_base + off_recv_src).to(tl.pointer_type(tl.int32))
        tl.store(recv_src_ptr + pos * 3, tl.full([BLOCK_K], 0, tl.int32) + s, mask=mine)
        tl.store(recv_src_ptr + pos * 3 + 1, tl.full([BLOCK_K], 0, tl.int32) + t, mask=mine)
        tl.store(recv_src_ptr + pos * 3 + 2, offs_k, mask=mine)

        if tl.sum(mine.to(tl.int32), axis=0) > 0:
            x_src = (src_base + off_x).to(tl.pointer_type(WORD)) + t.to(tl.int64) * row_words
            x_dst = (my_base + off_recv_x).to(tl.pointer_type(WORD))
            for w0 in range(0, row_words, BLOCK_W):
                offs_w = w0 + tl.arange(0, BLOCK_W)
                mask_w = offs_w < row_words
                words = tl.load(x_src + offs_w, mask=mask_w)
                for j in tl.static_range(BLOCK_K):
                    pos_j = _pick(pos, offs_k, j)
                    tl.store(x_dst + pos_j * row_words + offs_w, words, mask=mask_w & ((offs_w * 0 + pos_j) >= 0))
            if HAS_SCALE:
                offs_c = tl.arange(0, BLOCK_S)
                mask_c = offs_c < scale_words
                scales = tl.load((src_base + off_x_scale).to(tl.pointer_type(tl.int32)) + t.to(tl.int64) * scale_words
                                 + offs_c, mask=mask_c)
                scale_dst = (my_base + off_recv_x_scale).to(tl.pointer_type(tl.int32))
                for j in tl.static_range(BLOCK_K):
                    pos_j = _pick(pos, offs_k, j)
                    tl.store(scale_dst + pos_j * scale_words + offs_c, scales, mask=mask_c & ((offs_c * 0 + pos_j) >= 0))


def _word_bytes(row_bytes: int) -> int:
    return next(w for w in (8, 4, 2, 1) if row_bytes % w == 0)


def ep_dispatch(peers: PeerBuffers, regions: EPRegions, *, wait: bool = False,
                timeout_us: float = DEFAULT_TIMEOUT_US, max_polls: int = DEFAULT_MAX_POLLS,
                received_e: torch.Tensor | None = None) -> None:
    """Pull my experts' rows from every source into my pool (two launches, no host sync).

    Call after every rank's `ep_pre_dispatch` and a `symm_barrier`, or pass `wait=True` after every rank's
    `ep_pre_dispatch(..., post=True)`.

    Args:
        peers: the buffers (peers' send regions are read, mine written).
        regions: the layout (R, e, K, C, Dx, P, alignment, fp8).
        wait: the first launch first waits for every rank's post of my current epoch (the second half of
            `symm_barrier`, fused; bounded by `timeout_us` / `max_polls` like it).
        timeout_us, max_polls: the bound of that wait.
        received_e: optional ``[e]`` int64 on my buffer's device: the rows each local expert received are added to
            it (the dispatcher's running count, updated by the layout launch instead of a launch of its own).

    Writes (my buffer): `recv_num_tokens [R]`, `num_rows [e]`, `row_start [e]`, `recv_base [R, e]`, `pool_end [1]`,
    `recv_pos [R, C, K]` and `recv_weight [R, C, K]` (rows t < T_s of each source), `recv_src [P, 3]` (received
    and padding rows below `pool_end`), `recv_x [P, Dx]` (+ `recv_x_scale [P, Db]`) at the received rows; on
    pool overflow `status = [2, rows needed, ...]` (`check_ep_status` raises ExpertIdError).
    """
    check_peers(peers, regions)
    check_device("peers.ptrs_R", peers.ptrs_R)
    off = regions.offsets
    R, e, K, C = regions.num_ranks, regions.num_local_experts, regions.num_topk, regions.cap
    launch(_recv_layout_kernel, (1,),
        peers.ptrs_R,
        peers.rank, R, e, regions.alignment, regions.num_pool_rows, regions.masked_rows,
        off["num_tokens"], off["send_count"], off["recv_num_tokens"], off["num_rows"], off["row_start"],
        off["recv_base"], off["pool_end"], off["status"], off["signal"], off["epoch"],
        int(max_polls), int(timeout_us * 1000),
        check_received(received_e, e, peers.ptrs_R.device) if received_e is not None else peers.ptrs_R,
        WAIT=wait, BOUND=bound_mode(), COUNT_RECEIVED=received_e is not None, BLOCK_R=next_power_of_2(R),
        BLOCK_E=next_power_of_2(e), num_warps=4,
    )
    row_bytes = regions.hidden * regions.wire_dtype.itemsize
    word = _word_bytes(row_bytes)
    row_words = row_bytes // word
    block_w = min(next_power_of_2(row_words),
                  64 if is_interpreter() else EP_LAUNCH.dispatch_block_bytes // word)
    launch(_dispatch_rows_kernel, (R * C,),
        peers.ptrs_R,
        peers.rank, C, K, e, regions.num_pool_rows, regions.alignment, regions.masked_rows, row_words,
        regions.num_scale_cols,
        off["topk_ids"], off["topk_weights"], off["slot_rank"], off["x"], off.get("x_scale", 0), off["num_rows"],
        off["row_start"],
        off["recv_num_tokens"], off["recv_base"], off["recv_pos"], off["recv_weight"], off["recv_src"],
        off["recv_x"], off.get("recv_x_scale", 0),
        WORD=_WORD_DTYPES[word], HAS_SCALE=regions.fp8, BLOCK_K=next_power_of_2(K), BLOCK_W=block_w,
        BLOCK_S=next_power_of_2(regions.num_scale_cols),
        BLOCK_A=min(next_power_of_2(max(regions.alignment - 1, 1)), 8 if is_interpreter() else 128),
        num_warps=EP_LAUNCH.dispatch_warps,
    )


def ep_dispatch_ref(peers: PeerBuffers, regions: EPRegions, *, wait: bool = False,
                    timeout_us: float = DEFAULT_TIMEOUT_US, max_polls: int = DEFAULT_MAX_POLLS,
                    received_e: torch.Tensor | None = None) -> None:
    """Torch twin of `ep_dispatch` (same arguments, same writes, bitwise; no host sync except the wait's)."""
    check_peers(peers, regions)
    if received_e is not None:
        check_received(received_e, regions.num_local_experts, peers.local.device)
    if wait:
        symm_barrier_ref(peers, regions, post=False, wait=True, timeout_us=timeout_us, max_polls=max_polls)
    my = peers.local
    live = regions.view(my, "status")[0] != STATUS_PEER_TIMEOUT
    num_tokens_R = torch.stack([regions.view(b, "num_tokens")[0] for b in peers.buffers]) * live
    counts_Re = torch.stack([regions.view(b, "send_count")[peers.rank] for b in peers.buffers]).to(torch.int64) * live
    recv_base_Re = receive_layout_ref(my, regions, num_tokens_R, counts_Re)
    if received_e is not None:
        received_e.add_(regions.view(my, "num_rows"))
    C = regions.cap
    token_C = torch.arange(C, device=my.device)
    for s, src in enumerate(peers.buffers):
        live_C = token_C < regions.view(src, "num_tokens")[0].to(my.device)  # t < T_s, no host sync
        rows = [regions.view(src, name).to(my.device) for name in ("topk_ids", "slot_rank", "topk_weights", "x")]
        scale_CDb = regions.view(src, "x_scale").to(my.device) if regions.fp8 else None
        receive_rows_ref(my, regions, peers.rank, s, recv_base_Re, token_C, live_C, *rows, scale_CDb)


def check_received(received_e: torch.Tensor, num_local_experts: int, device: torch.device) -> torch.Tensor:
    """``received_e`` if it is the ``[e]`` int64 count on the buffer's device, else ShapeError (a wrong one would be
    written out of bounds by the kernel)."""
    if received_e.shape != (num_local_experts,) or received_e.dtype != torch.int64 or received_e.device != device:
        raise ShapeError(f"received_e must be [{num_local_experts}] int64 on {device}, got {tuple(received_e.shape)} "
                         f"{received_e.dtype} on {received_e.device}")
    return received_e


def receive_layout_ref(my: torch.Tensor, regions: EPRegions, num_tokens_R: torch.Tensor,
                       counts_Re: torch.Tensor) -> torch.Tensor:
    """The receive layout from every source's T and counts (what `_recv_layout_kernel` computes); shared by the
    twin and the `a2a` transport, which learns the counts by a collective instead of reading peers.

    Args:
        my: my buffer. num_tokens_R: `[R]` T of every source. counts_Re: `[R, e]` int64 slots of source s routed
            to my expert i.

    Writes MY `recv_num_tokens`, `num_rows`, `row_start`, `recv_base`, `pool_end` (+ the overflow status) and -1
    into `recv_src` of every padding row. Returns `recv_base_Re` `[R, e]` int64.
    """
    view = regions.view
    P, device = regions.num_pool_rows, my.device
    num_rows_e = counts_Re.sum(0)
    aligned_e = (num_rows_e + regions.alignment - 1) // regions.alignment * regions.alignment
    segment_e = torch.full_like(aligned_e, regions.masked_rows) if regions.masked_rows else aligned_e
    row_start_e = torch.cumsum(segment_e, 0) - segment_e
    recv_base_Re = row_start_e[None, :] + torch.cumsum(counts_Re, 0) - counts_Re
    pool_end = segment_e.sum()
    view(my, "recv_num_tokens").copy_(num_tokens_R)
    view(my, "num_rows").copy_(num_rows_e)
    view(my, "row_start").copy_(row_start_e)
    view(my, "recv_base").copy_(recv_base_Re)
    view(my, "pool_end").fill_(pool_end)
    status = view(my, "status")
    for overflow, needed in ((pool_end > P, pool_end),
                             ((num_rows_e > regions.masked_rows).any() & (regions.masked_rows > 0), num_rows_e.max())):
        status[1] = torch.where(overflow, needed.to(torch.int32), status[1])
        status[0] = torch.where(overflow, STATUS_POOL_OVERFLOW, status[0])
    # padding rows: [row_start + num_rows, row_start + aligned) of each segment, below P and the segment's end
    pad_e = aligned_e - num_rows_e
    pad_rows = (row_start_e + num_rows_e)[:, None] + torch.arange(max(regions.alignment - 1, 0), device=device)
    pad_mask = ((torch.arange(pad_rows.shape[1], device=device)[None, :] < pad_e[:, None]) & (pad_rows >= 0)
                & (pad_rows < P) & (pad_rows < (row_start_e + segment_e)[:, None]))
    pad_target_N = torch.where(pad_mask, pad_rows, P).reshape(-1)
    _scatter_rows(view(my, "recv_src"), pad_target_N, torch.full((pad_target_N.numel(), 3), -1, dtype=torch.int32,
                                                                   device=device))
    return recv_base_Re


def receive_rows_ref(my: torch.Tensor, regions: EPRegions, rank: int, src: int, recv_base_Re: torch.Tensor,
                     token_U: torch.Tensor, live_U: torch.Tensor, ids_UK: torch.Tensor, slot_rank_UK: torch.Tensor,
                     weights_UK: torch.Tensor, x_UD: torch.Tensor, x_scale_UDb: torch.Tensor | None) -> None:
    """Place rows of source `src` into MY pool (what `_dispatch_rows_kernel` does for one source).

    Args:
        token_U: `[U]` int64 token index at the source of each row given; live_U: `[U]` bool, rows to place
            (the twin passes all C rows with t < T_s live; `a2a` passes the tokens it received).
        ids_UK, slot_rank_UK, weights_UK: the source's routing rows of those tokens; x_UD (+ x_scale_UDb): the rows.

    Writes, for live rows: `recv_pos[src, t]` (pool row of each slot, -1 if not mine), `recv_weight[src, t]`, and
    for each of my slots `recv_src[pos] = (src, t, j)`, `recv_x[pos]` (+ scales).
    """
    view = regions.view
    e, K, P = regions.num_local_experts, regions.num_topk, regions.num_pool_rows
    local_UK = ids_UK - rank * e
    mine_UK = live_U[:, None] & (ids_UK >= 0) & (local_UK >= 0) & (local_UK < e)
    pos_UK = recv_base_Re[src, local_UK.clamp(0, e - 1)] + slot_rank_UK
    segment_end_UK = (local_UK + 1) * regions.masked_rows if regions.masked_rows else P
    mine_UK &= (pos_UK >= 0) & (pos_UK < P) & (pos_UK < segment_end_UK)
    pos_UK = torch.where(mine_UK, pos_UK, -1)
    recv_pos_CK, recv_weight_CK = view(my, "recv_pos")[src], view(my, "recv_weight")[src]
    recv_pos_CK[token_U] = torch.where(live_U[:, None], pos_UK.to(torch.int32), recv_pos_CK[token_U])
    recv_weight_CK[token_U] = torch.where(live_U[:, None], weights_UK, recv_weight_CK[token_U])
    # scatter the slots that are mine; the others go to a dummy row P (dropped)
    target_of_slot = torch.where(mine_UK, pos_UK, P).reshape(-1)
    row_of_slot = torch.arange(token_U.numel(), device=my.device).repeat_interleave(K)
    src_rows = torch.stack([torch.full_like(row_of_slot, src), token_U[row_of_slot],
                            torch.arange(K, device=my.device).repeat(token_U.numel())], dim=1).to(torch.int32)
    _scatter_rows(view(my, "recv_src"), target_of_slot, src_rows)
    _scatter_rows(view(my, "recv_x"), target_of_slot, x_UD.index_select(0, row_of_slot))
    if x_scale_UDb is not None:
        _scatter_rows(view(my, "recv_x_scale"), target_of_slot, x_scale_UDb.index_select(0, row_of_slot))


def _scatter_rows(dst_P_: torch.Tensor, target_N: torch.Tensor, rows_N_: torch.Tensor) -> None:
    """dst[target[n]] = rows[n] for target < P (rows aimed at P are dropped); no host sync. ``dst_P_`` is ``[P, ...]``
    and ``rows_N_`` ``[N, ...]`` with the same trailing dims (the pool's row width, scale blocks or source triples)."""
    num_rows = dst_P_.shape[0]
    padded = torch.cat([dst_P_, dst_P_.new_empty(1, *dst_P_.shape[1:])])
    if dst_P_.dtype == torch.float8_e4m3fn:  # index_copy has no fp8 kernel: move the bytes
        padded_u8 = padded.view(torch.uint8)
        padded_u8.index_copy_(0, target_N, rows_N_.view(torch.uint8))
    else:
        padded.index_copy_(0, target_N, rows_N_)
    dst_P_.copy_(padded[:num_rows])
