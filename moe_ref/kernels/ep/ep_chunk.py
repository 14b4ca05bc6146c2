"""One EP chunk on the device, in the order the kernels' contract needs (for transports, tests and benches).

    ep_pre_dispatch -> symm_barrier -> ep_dispatch -> experts -> ep_combine_push -> symm_barrier -> ep_combine_reduce

With `fused_signals=True` (default) each barrier is split into its two halves and fused into the kernels
around it, saving two launches per chunk: `ep_pre_dispatch(post=True)` (the last program of its second launch
posts) -> `ep_dispatch(wait=True)` (its first, one-program launch waits) and `ep_combine_push(post=True)` ->
`ep_combine_reduce(wait=True)` (every program waits, then reads). Six launches per chunk instead of eight:
faster eager, no faster in a CUDA graph (figures in docs/RESULTS.md).

Why two barriers are enough per chunk: the first makes every rank's send regions (and counts) visible before
any rank pulls; the second makes every partial visible before any source reduces. A rank overwrites its send
regions in the next chunk only after the second barrier, which every peer passes only after its dispatch
(reads of my send regions) is done; a peer pushes the next chunk's partials only after the next chunk's
first barrier, which I pass only after my reduce is done. So no third barrier is needed.

With `kernels=True` nothing syncs the host, so a chunk can be captured in a CUDA graph and replayed with new
inputs of the same shape (copy them into the captured input tensors).

Shape legend: T tokens of this rank, K top-k, Dx row width, P pool rows, Db = ceil(Dx/128).
"""

from __future__ import annotations

from typing import Callable

import torch

from moe_ref.kernels.ep.ep_combine import (
    ep_combine_push,
    ep_combine_push_ref,
    ep_combine_reduce,
    ep_combine_reduce_ref,
)
from moe_ref.kernels.ep.ep_dispatch import ep_dispatch, ep_dispatch_ref
from moe_ref.kernels.ep.ep_layout import ep_pre_dispatch, ep_pre_dispatch_ref
from moe_ref.kernels.ep.ep_regions import EPRegions, PeerBuffers
from moe_ref.kernels.ep.symm_signal import DEFAULT_TIMEOUT_US, symm_barrier, symm_barrier_ref

__all__ = ["ep_chunk"]

# (recv_x_PD [P, Dx] wire dtype, recv_x_scale_PDb [P, Db] fp32 or None) -> y_PD [<= P, Dx] float
ExpertsFn = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def ep_chunk(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, experts: ExpertsFn,
             peers: PeerBuffers, regions: EPRegions, *, kernels: bool = True, fused_signals: bool = True,
             timeout_us: float = DEFAULT_TIMEOUT_US) -> torch.Tensor:
    """Dispatch, experts, combine and reduce of one chunk (collective: every rank calls it with its own T).

    Args:
        x_TD: `[T, Dx]` activation dtype, T <= C.
        topk_ids_TK: `[T, K]` int64, -1 = masked. topk_weights_TK: `[T, K]` fp32.
        experts: maps the whole pool (`recv_x [P, Dx]`, `recv_x_scale [P, Db]` or None) to results `y [<= P, Dx]`
            (rows at received positions are read; the used rows end at MY `pool_end`, on the device).
        peers, regions: the symmetric buffers and their layout.
        kernels: Triton kernels (no host sync) or the torch twins (the CPU path; the barrier twin syncs).
        fused_signals: fuse the barriers' post/wait halves into the neighbouring kernels (module doc).
        timeout_us: bound of each device-side wait.

    Returns:
        out_TD: `[T, Dx]` activation dtype, `sum_j w[t, j] * experts(x)[t, j]` (fp32 sums in fixed order).
        A peer timeout or pool overflow is only recorded in MY `status`: call `check_ep_status` to raise it.
    """
    pre, barrier, dispatch, push, reduce = (
        (ep_pre_dispatch, symm_barrier, ep_dispatch, ep_combine_push, ep_combine_reduce) if kernels else
        (ep_pre_dispatch_ref, symm_barrier_ref, ep_dispatch_ref, ep_combine_push_ref, ep_combine_reduce_ref))
    my = peers.local
    if fused_signals:
        pre(x_TD, topk_ids_TK, topk_weights_TK, peers, regions, post=True)
        dispatch(peers, regions, wait=True, timeout_us=timeout_us)
    else:
        pre(x_TD, topk_ids_TK, topk_weights_TK, peers, regions)
        barrier(peers, regions, timeout_us=timeout_us)
        dispatch(peers, regions)
    y_PD = experts(regions.view(my, "recv_x"), regions.view(my, "recv_x_scale") if regions.fp8 else None)
    if fused_signals:
        push(y_PD, peers, regions, post=True)
        return reduce(x_TD.shape[0], peers, regions, wait=True, timeout_us=timeout_us)
    push(y_PD, peers, regions)
    barrier(peers, regions, timeout_us=timeout_us)
    return reduce(x_TD.shape[0], peers, regions)
