"""Helpers for the EP kernel tests: inputs, a one-process simulation of R ranks, and an independent oracle.

R fake ranks live in one process, each with its own separately allocated uint8 buffer; `PeerBuffers` of rank
r holds all R buffers, so the kernels reach "peers" through real base addresses. Phases run rank by rank in
order (every rank's pre-dispatch, then every rank's barrier post, then every wait, ...), which is what a
device-side barrier guarantees on real ranks. Also imported by tests/gpu/ep_kernels_worker.py.

Shape legend: R ranks, T tokens of a rank, K top-k, E experts, e local experts, Dx row width, P pool rows.

On a machine with a GPU the buffers and inputs are CUDA tensors by default (Triton is not interpreted there, so
the kernels need CUDA tensors); without one, CPU tensors for the interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_ref.kernels.ep.ep_regions import SIGNAL_REGIONS, EPRegions, PeerBuffers
from moe_ref.kernels.experts.fp8 import dequantize_fp8_per_128

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class RankInputs:
    x_TD: torch.Tensor
    topk_ids_TK: torch.Tensor
    topk_weights_TK: torch.Tensor


def make_inputs(num_tokens: int, num_topk: int, num_experts: int, hidden: int, dtype: torch.dtype, *, seed: int,
                masked: float = 0.2, one_expert: int | None = None, device: str = DEVICE) -> RankInputs:
    """Random tokens with distinct experts per token, some slots masked (-1); `one_expert` routes every token's
    slot 0 to that expert (the rest stay random)."""
    gen = torch.Generator().manual_seed(seed)
    x_TD = (torch.randn(num_tokens, hidden, generator=gen) * 2).to(dtype)
    rows = []
    for _ in range(num_tokens):
        perm = torch.randperm(num_experts, generator=gen)
        if one_expert is not None:  # move one_expert to slot 0, keeping the ids distinct
            perm = torch.cat([torch.tensor([one_expert]), perm[perm != one_expert]])
        rows.append(perm[:num_topk])
    ids_TK = torch.stack(rows) if rows else torch.empty(0, num_topk, dtype=torch.int64)
    ids_TK[torch.rand(num_tokens, num_topk, generator=gen) < masked] = -1
    w_TK = torch.rand(num_tokens, num_topk, generator=gen)
    return RankInputs(x_TD.to(device), ids_TK.to(device), w_TK.to(device))


def expert_scale(local_expert: torch.Tensor) -> torch.Tensor:
    """The test experts multiply a row by (1 + local expert) / 4 (so a row in the wrong segment shows)."""
    return (1.0 + local_expert.to(torch.float32)) / 4.0


def scaled_identity_experts(peers: PeerBuffers, regions: EPRegions):
    """Experts over MY pool: y[p] = dequant(recv_x[p]) * expert_scale(expert of row p), in the activation dtype.
    The expert of a row comes from MY `row_start` (on the device, no host sync)."""
    row_start_e = regions.view(peers.local, "row_start")

    def experts(recv_x_PD: torch.Tensor, recv_x_scale_PDb: torch.Tensor | None) -> torch.Tensor:
        rows_P = torch.arange(recv_x_PD.shape[0], device=recv_x_PD.device)
        expert_P = torch.searchsorted(row_start_e, rows_P, right=True) - 1
        x_PD = (dequantize_fp8_per_128(recv_x_PD, recv_x_scale_PDb) if recv_x_scale_PDb is not None
                else recv_x_PD.float())
        return (x_PD * expert_scale(expert_P)[:, None]).to(regions.activation_dtype)

    return experts


def expected_output(inputs: RankInputs, num_local_experts: int, fp8: bool) -> torch.Tensor:
    """Independent oracle in float64: out[t] = sum_j w[t, j] * x[t] * expert_scale(local expert of slot j)."""
    x = inputs.x_TD
    if fp8:
        from moe_ref.kernels.experts.fp8 import quantize_fp8_per_128

        x = dequantize_fp8_per_128(*quantize_fp8_per_128(x))
    ids_TK = inputs.topk_ids_TK
    scale_TK = torch.where(ids_TK >= 0, expert_scale(ids_TK % num_local_experts).double(), 0.0)
    return ((inputs.topk_weights_TK.double() * scale_TK).sum(1, keepdim=True) * x.double())


def make_world(regions: EPRegions, *, garbage_seed: int | None = 0, device: str = DEVICE) -> list[PeerBuffers]:
    """R buffers (random bytes, so unwritten regions show; signal/epoch/status zeroed) and each rank's view."""
    gen = torch.Generator().manual_seed(garbage_seed or 0)
    buffers = []
    for _ in range(regions.num_ranks):
        buf = (torch.randint(0, 256, (regions.end,), dtype=torch.uint8, generator=gen) if garbage_seed is not None
               else torch.zeros(regions.end, dtype=torch.uint8)).to(device)
        for name in SIGNAL_REGIONS:
            regions.view(buf, name).zero_()
        buffers.append(buf)
    return [PeerBuffers.from_tensors(r, buffers) for r in range(regions.num_ranks)]


def clone_world(world: list[PeerBuffers]) -> list[PeerBuffers]:
    buffers = [b.clone() for b in world[0].buffers]
    return [PeerBuffers.from_tensors(r, buffers) for r in range(len(buffers))]


def simulate_chunk(world: list[PeerBuffers], regions: EPRegions, inputs: list[RankInputs], *, kernels: bool,
                   fused_signals: bool = True, max_polls: int = 50) -> list[torch.Tensor]:
    """`ep_chunk` for R fake ranks in one process, phase by phase; returns every rank's out_TD.

    fused_signals: posts inside ep_pre_dispatch / ep_combine_push and waits inside ep_dispatch /
    ep_combine_reduce (what ep_chunk does by default), else standalone barriers (post all, then wait all)."""
    from moe_ref.kernels.ep.ep_combine import (
        ep_combine_push, ep_combine_push_ref, ep_combine_reduce, ep_combine_reduce_ref)
    from moe_ref.kernels.ep.ep_dispatch import ep_dispatch, ep_dispatch_ref
    from moe_ref.kernels.ep.ep_layout import ep_pre_dispatch, ep_pre_dispatch_ref
    from moe_ref.kernels.ep.symm_signal import symm_barrier, symm_barrier_ref

    pre, barrier, dispatch, push, reduce = (
        (ep_pre_dispatch, symm_barrier, ep_dispatch, ep_combine_push, ep_combine_reduce) if kernels else
        (ep_pre_dispatch_ref, symm_barrier_ref, ep_dispatch_ref, ep_combine_push_ref, ep_combine_reduce_ref))

    def barrier_all():
        for peers in world:
            barrier(peers, regions, post=True, wait=False, max_polls=max_polls)
        for peers in world:
            barrier(peers, regions, post=False, wait=True, max_polls=max_polls)

    post = dict(post=True) if fused_signals else {}
    wait = dict(wait=True, max_polls=max_polls) if fused_signals else {}
    for peers, inp in zip(world, inputs):
        pre(inp.x_TD, inp.topk_ids_TK, inp.topk_weights_TK, peers, regions, **post)
    if not fused_signals:
        barrier_all()
    for peers in world:
        dispatch(peers, regions, **wait)
    ys = []
    for peers in world:
        my = peers.local
        experts = scaled_identity_experts(peers, regions)
        ys.append(experts(regions.view(my, "recv_x"), regions.view(my, "recv_x_scale") if regions.fp8 else None))
    for peers, y_PD in zip(world, ys):
        push(y_PD, peers, regions, **post)
    if not fused_signals:
        barrier_all()
    return [reduce(inp.x_TD.shape[0], peers, regions, **wait) for peers, inp in zip(world, inputs)]


def check_pool_semantics(world: list[PeerBuffers], regions: EPRegions, inputs: list[RankInputs]) -> None:
    """Independent check of every rank's pool against the contract (python loops; tiny shapes only)."""
    e, A = regions.num_local_experts, regions.alignment
    view = regions.view
    for r, peers in enumerate(world):
        my = peers.local
        expected_rows = []  # (expert, source, token, slot) in pool order
        for i in range(e):
            for s, inp in enumerate(inputs):
                for t in range(inp.topk_ids_TK.shape[0]):
                    for j in range(inp.topk_ids_TK.shape[1]):
                        if int(inp.topk_ids_TK[t, j]) == r * e + i:
                            expected_rows.append((i, s, t, j))
        counts = [sum(1 for row in expected_rows if row[0] == i) for i in range(e)]
        starts, pos = [], 0
        for c in counts:  # contiguous: aligned segments back to back; masked: M rows each
            starts.append(pos)
            pos += regions.masked_rows or -(-c // A) * A
        assert view(my, "num_rows").tolist() == counts, f"rank {r}: {view(my, 'num_rows').tolist()=} {counts=}"
        assert view(my, "row_start").tolist() == starts, f"rank {r}: {view(my, 'row_start').tolist()=} {starts=}"
        assert int(view(my, "pool_end")[0]) == pos, f"rank {r}: pool_end {int(view(my, 'pool_end')[0])} != {pos}"
        recv_src = view(my, "recv_src")
        recv_x = view(my, "recv_x")
        seen = 0
        for i in range(e):
            rows = [row for row in expected_rows if row[0] == i]
            for k, (_, s, t, j) in enumerate(rows):
                p = starts[i] + k
                assert recv_src[p].tolist() == [s, t, j], f"rank {r} row {p}: {recv_src[p].tolist()} != {[s, t, j]}"
                src_x = view(world[s].local, "x")[t]
                assert torch.equal(recv_x[p].view(torch.uint8), src_x.view(torch.uint8)), f"rank {r} row {p} bytes"
                seen += 1
            for p in range(starts[i] + len(rows), starts[i] + -(-len(rows) // A) * A):
                assert recv_src[p].tolist() == [-1, -1, -1], f"rank {r}: padding row {p} = {recv_src[p].tolist()}"
        assert seen == len(expected_rows)
