"""Bounded device-side barrier over the symmetric buffer's `signal` region (no host sync, CUDA-graph replayable).

    ep_layout -> [symm_barrier] -> ep_dispatch -> experts -> ep_combine_push -> [symm_barrier] -> ep_combine_reduce

One barrier on rank r:
1. post: `epoch[0] += 1` (kept in my buffer, so a captured graph replays with no host input), then for every
   peer s: `signal_s[r] = epoch` with release semantics at system scope (`atomic_xchg`, sem="release").
   Everything this GPU wrote before the barrier (earlier kernels on the stream) is visible to a peer that
   acquires the flag.
2. wait: poll MY `signal[s]` for every s with acquire semantics (`atomic_add(ptr, 0, sem="acquire")`) until
   each holds at least `epoch` (a peer may already be one barrier ahead), or until the bound runs out: then
   `status[0] = 1` (peer timeout), `status[1] = epoch`, `status[2 + s] = 1` for each silent peer, and return.
   A wait that finds `status[0] != 0` does not wait (the call is already broken; every later wait would only
   time out too), so a dead peer costs one bound per call, never a hang.

`check_ep_status` (host, syncs) turns a set status into `PeerTimeoutError` (ENV010) naming the silent peers,
or `ExpertIdError` (INP005) for a receive-pool overflow recorded by `ep_dispatch`.

The bound: `max_polls` flag reads always; on a GPU also `timeout_us` of `%globaltimer` time. A one-process
simulation of R ranks (the interpreter tests) runs `post` for every rank before any `wait`
(`symm_barrier(..., post=True, wait=False)` then `(..., post=False, wait=True)`).

The halves are also `@triton.jit` helpers other kernels fuse (`ep_chunk(fused_signals=True)`): `post_epoch`,
`arrive_then_post` (every program of a kernel arrives on MY `counter`; the last one posts, so the post covers all
of the kernel's writes) and `wait_epoch` (bounded, at the start of a consumer kernel).

Shape legend: R ranks.
"""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl

from moe_ref.core.errors import ExpertIdError, MoERefError, PeerTimeoutError

from moe_ref.kernels.runtime._triton_utils import check_device, is_interpreter, next_power_of_2
from moe_ref.kernels.runtime.launch import launch
from moe_ref.kernels.ep.ep_regions import (
    STATUS_OK,
    STATUS_PEER_TIMEOUT,
    STATUS_POOL_OVERFLOW,
    EPRegions,
    PeerBuffers,
    check_peers,
)

__all__ = ["symm_barrier", "symm_barrier_ref", "check_ep_status", "ep_status_problem", "DEFAULT_TIMEOUT_US",
           "DEFAULT_MAX_POLLS"]

DEFAULT_TIMEOUT_US = 30_000_000.0  # 30 s: above a first call's JIT compilation on a slow peer; reports a dead peer
DEFAULT_MAX_POLLS = 2**31 - 1     # GPU: the time bound decides; the interpreter passes a small count

# BOUND modes (constexpr): what the wait loop checks besides the flags
BOUND_POLLS = 1   # a poll counter only
BOUND_TIMER = 2   # the poll counter and %globaltimer (GPU only)
BOUND_NONE = 0    # nothing: for measuring what the bound costs, never for real use


@triton.jit
def _globaltimer_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def post_epoch(ptrs_R, my_base, rank, R, off_signal, off_epoch, BLOCK_R: tl.constexpr):
    """`epoch += 1` in my buffer, then `signal_s[rank] = epoch` on every rank s (release, system scope)."""
    epoch_ptr = (my_base + off_epoch).to(tl.pointer_type(tl.int32))
    epoch = tl.load(epoch_ptr) + 1
    tl.store(epoch_ptr, epoch)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    peer_base = tl.load(ptrs_R + offs_r, mask=mask_r, other=0)
    flag_ptrs = (peer_base + off_signal).to(tl.pointer_type(tl.int32)) + rank
    tl.atomic_xchg(flag_ptrs, tl.full([BLOCK_R], 0, tl.int32) + epoch, mask=mask_r, sem="release", scope="sys")


@triton.jit
def arrive_then_post(ptrs_R, my_base, rank, R, off_signal, off_epoch, off_counter, BLOCK_R: tl.constexpr):
    """Called once by every program of a kernel at its end: the LAST program to arrive posts the next epoch,
    so peers that acquire it see every program's writes (the CTA barrier orders this program's threads'
    writes before its arrival; arrivals are acq_rel at system scope). The last program resets the counter."""
    tl.debug_barrier()
    counter_ptr = (my_base + off_counter).to(tl.pointer_type(tl.int32))
    num_programs = tl.num_programs(0) * tl.num_programs(1)
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="sys")
    if arrived == num_programs - 1:
        tl.store(counter_ptr, 0)
        post_epoch(ptrs_R, my_base, rank, R, off_signal, off_epoch, BLOCK_R)


@triton.jit
def wait_epoch(my_base, R, off_signal, off_epoch, off_status, max_polls, timeout_ns,
               BOUND: tl.constexpr, BLOCK_R: tl.constexpr):
    """Wait (bounded) until my `signal[s]` reached my `epoch` for every s, with acquire at system scope.
    On timeout: status = [1, epoch, missing...]. Skips the wait when status is already set."""
    status_ptr = (my_base + off_status).to(tl.pointer_type(tl.int32))
    if tl.load(status_ptr) == 0:
        epoch = tl.load((my_base + off_epoch).to(tl.pointer_type(tl.int32)))
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        my_flags = (my_base + off_signal).to(tl.pointer_type(tl.int32)) + offs_r
        seen = tl.atomic_add(my_flags, 0, mask=mask_r, sem="acquire", scope="sys")
        # difference, not >=: stays right when the int32 epoch wraps; a peer may be one epoch ahead
        missing = mask_r & ((seen - epoch) < 0)
        num_missing = tl.sum(missing.to(tl.int32), axis=0)
        polls = 0
        if BOUND == 2:
            start = _globaltimer_ns()
        go = num_missing > 0
        while go:
            seen = tl.atomic_add(my_flags, 0, mask=mask_r, sem="acquire", scope="sys")
            missing = mask_r & ((seen - epoch) < 0)
            num_missing = tl.sum(missing.to(tl.int32), axis=0)
            polls += 1
            go = num_missing > 0
            if BOUND >= 1:
                go = go & (polls < max_polls)
            if BOUND == 2:
                go = go & ((_globaltimer_ns() - start) < timeout_ns)
        if num_missing > 0:
            tl.store(status_ptr + 1, epoch)
            tl.store(status_ptr + 2 + offs_r, missing.to(tl.int32), mask=mask_r)
            tl.store(status_ptr, 1)


@triton.jit
def _symm_barrier_kernel(
    # pointers
    ptrs_R,
    # sizes / scalars
    rank, R, off_signal, off_epoch, off_status, max_polls, timeout_ns,
    # meta
    POST: tl.constexpr,
    WAIT: tl.constexpr,
    BOUND: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """One program: post my epoch to every peer, then wait for every peer's (bounded).

    Example: R=2, rank 0, epoch 4 before the call -> epoch 5; signal of rank 1 gets [5, .] at slot 0;
        wait until my signal[0] >= 5 and signal[1] >= 5. If rank 1 never posts: status = [1, 5, 0, 1].
    """
    my_base = tl.load(ptrs_R + rank)
    if POST:
        post_epoch(ptrs_R, my_base, rank, R, off_signal, off_epoch, BLOCK_R)
    if WAIT:
        wait_epoch(my_base, R, off_signal, off_epoch, off_status, max_polls, timeout_ns, BOUND, BLOCK_R)


def bound_mode(override: int | None = None) -> int:
    """The wait bound the kernels use here: poll counter + %globaltimer on a GPU, poll counter in the interpreter."""
    if override is not None:
        return override
    return BOUND_POLLS if is_interpreter() else BOUND_TIMER


def _check_args(peers: PeerBuffers, regions: EPRegions, post: bool, wait: bool) -> None:
    check_peers(peers, regions)
    if not (post or wait):
        raise ValueError("symm_barrier: post and wait are both False: nothing to do")


def symm_barrier(peers: PeerBuffers, regions: EPRegions, *, timeout_us: float = DEFAULT_TIMEOUT_US,
                 max_polls: int = DEFAULT_MAX_POLLS, post: bool = True, wait: bool = True,
                 _bound: int | None = None) -> None:
    """Device-side barrier of the EP group (one single-program Triton launch; no host sync).

    Args:
        peers: the R buffers (`ptrs_R` is read on the device).
        regions: layout; uses `signal`, `epoch`, `status` (zeroed on every rank before the first barrier).
        timeout_us: give up after this much `%globaltimer` time in the wait (GPU; ignored by the interpreter).
        max_polls: give up after this many flag reads (both).
        post, wait: run only one half (one-process simulations of R ranks post for all ranks first).
        _bound: BOUND mode override (0 none, 1 polls, 2 polls + timer): benchmarks of the bound's cost only.

    Writes `epoch` (+1 with `post`), peers' `signal[rank]`, and on a timeout MY `status` (see module doc).
    Call `check_ep_status` (host sync) when the caller wants the error raised.
    """
    _check_args(peers, regions, post, wait)
    check_device("peers.ptrs_R", peers.ptrs_R)
    bound = bound_mode(_bound)
    launch(_symm_barrier_kernel, (1,),
        peers.ptrs_R,
        peers.rank, regions.num_ranks, regions.offsets["signal"], regions.offsets["epoch"],
        regions.offsets["status"], int(max_polls), int(timeout_us * 1000),
        POST=post, WAIT=wait, BOUND=bound, BLOCK_R=next_power_of_2(regions.num_ranks),
        num_warps=1,
    )


def symm_barrier_ref(peers: PeerBuffers, regions: EPRegions, *, timeout_us: float = DEFAULT_TIMEOUT_US,
                     max_polls: int = DEFAULT_MAX_POLLS, post: bool = True, wait: bool = True,
                     _bound: int | None = None) -> None:
    """Torch twin of `symm_barrier` (same arguments, same writes). The wait polls from the host (syncs);
    on CUDA the device is synchronized before posting, so earlier writes have landed."""
    _check_args(peers, regions, post, wait)
    my = peers.local
    epoch = regions.view(my, "epoch")
    status = regions.view(my, "status")
    if post:
        if my.is_cuda:
            torch.cuda.synchronize(my.device)
        epoch.add_(1)
        for peer in peers.buffers:
            regions.view(peer, "signal")[peers.rank] = epoch[0]
        if my.is_cuda:
            torch.cuda.synchronize(my.device)
    if not wait or int(status[0]) != STATUS_OK:
        return
    signal = regions.view(my, "signal")
    target = int(epoch[0])
    deadline = time.monotonic() + timeout_us * 1e-6
    polls = 0
    while True:
        missing = ((signal - target) < 0).to(torch.int32)  # int32 arithmetic wraps like the kernel's
        if not bool(missing.any()):
            return
        if polls >= max_polls or time.monotonic() > deadline:
            break
        polls += 1
        if polls > 64:  # NOTE: peers are processes sharing few cores (CPU): let them run
            time.sleep(20e-6)
    status[1] = target
    status[2:] = missing
    status[0] = STATUS_PEER_TIMEOUT


def check_ep_status(peers: PeerBuffers, regions: EPRegions) -> None:
    """Raise the coded error a device-side wait or dispatch recorded in MY `status` (host sync); see
    `ep_status_problem`."""
    problem = ep_status_problem(peers, regions)
    if problem is not None:
        raise problem


def ep_status_problem(peers: PeerBuffers, regions: EPRegions) -> MoERefError | None:
    """The coded error a device-side wait or dispatch recorded in MY `status` (not raised), or None. Host sync.

    Returns:
        PeerTimeoutError (ENV010): a barrier timed out; names the peers that never signalled and the epoch.
        ExpertIdError (INP005): `ep_dispatch` found more received rows than the pool holds (a token picked one
            expert twice, or ids outside the layout); names the rows needed and the pool rows (masked pool: the
            rows one expert received and the rows of its segment).
    """
    status = regions.view(peers.local, "status").tolist()  # NOTE: host sync
    code, detail, missing = status[0], status[1], status[2:]
    if code == STATUS_OK:
        return None
    if code == STATUS_PEER_TIMEOUT:
        silent = [s for s, flag in enumerate(missing) if flag]
        return PeerTimeoutError(
            f"rank {peers.rank}: peer(s) {silent} never signalled barrier epoch {detail} within the bound; the "
            f"data of this call is invalid (did a rank crash, or do ranks run different numbers of calls/chunks?)",
            rank=peers.rank, peers=silent, epoch=detail)
    if code == STATUS_POOL_OVERFLOW and regions.masked_rows:
        return ExpertIdError(
            f"rank {peers.rank}: a local expert received {detail} rows but each segment of the masked pool has "
            f"{regions.masked_rows}: a token picked the same expert twice, or ids are outside [-1, E) (rows past the "
            f"segment were dropped)", rank=peers.rank, rows_needed=detail, pool_rows=regions.masked_rows)
    if code == STATUS_POOL_OVERFLOW:
        return ExpertIdError(
            f"rank {peers.rank}: the received rows need {detail} pool rows but the pool has {regions.num_pool_rows}: "
            f"a token picked the same expert twice, or ids are outside [-1, E) (rows past the pool were dropped)",
            rank=peers.rank, rows_needed=detail, pool_rows=regions.num_pool_rows)
    return PeerTimeoutError(f"rank {peers.rank}: unknown EP status code {code} (status={status})")
