"""torchrun worker (CPU, gloo): the compiled EP ops (moe_ref.kernels.runtime.native) across real processes over /dev/shm.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist/native_ops_cpu_worker.py --out DIR

Each rank maps every rank's shared-memory file, runs EP chunks with the compiled ops (signals cross processes
through std::atomic release/acquire), and requires its output and its WHOLE buffer to be bitwise equal to a
one-process simulation of the group with the torch twins (tests/interpreter/ep_sim.py). A last case keeps rank 1
silent: rank 0's bounded barrier must end and record the timeout. Writes OUT/rank{r}.json:
{case: {"checks": {...}, "info": {...}}}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (test worker, not package code)

import torch.distributed as dist  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "interpreter"))
sys.path.insert(0, HERE)

from ep_kernels_cpu_worker import map_shm_buffers  # noqa: E402
from ep_sim import expected_output, make_inputs, make_world, scaled_identity_experts, simulate_chunk  # noqa: E402

from moe_ref.kernels.runtime import native
from moe_ref.core.errors import PeerTimeoutError  # noqa: E402
from moe_ref.kernels.ep.ep_regions import EPRegions, PeerBuffers, zero_signal_regions  # noqa: E402
from moe_ref.kernels.ep.symm_signal import check_ep_status  # noqa: E402

# name: (token counts per rank (cycled, one list per chunk), e, K, C, Dx, dtype, fp8, alignment, fused_signals)
CASES = {
    "fused_bf16_fp8_odd_dx": ([[6, 3]], 2, 3, 6, 131, torch.bfloat16, True, 4, True),
    "standalone_fp32_zero_tokens": ([[0, 5]], 3, 2, 5, 40, torch.float32, False, 1, False),
    "three_chunks_fp16": ([[4, 4], [1, 0], [3, 4]], 2, 2, 4, 72, torch.float16, False, 2, True),
}
TIMEOUT_US = 300_000


def native_chunk(x_TD, ids_TK, w_TK, experts, peers, regions, fused):
    """ep_chunk's phase order with the compiled ops."""
    pre, barrier, dispatch, push, reduce = native.ops_table()
    my = peers.local
    pre(x_TD, ids_TK, w_TK, peers, regions, post=fused)
    if not fused:
        barrier(peers, regions, timeout_us=120e6)
    dispatch(peers, regions, wait=fused, timeout_us=120e6)
    y_PD = experts(regions.view(my, "recv_x"), regions.view(my, "recv_x_scale") if regions.fp8 else None)
    push(y_PD, peers, regions, post=fused)
    if not fused:
        barrier(peers, regions, timeout_us=120e6)
    return reduce(x_TD.shape[0], peers, regions, wait=fused, timeout_us=120e6)


def run_case(name, spec, rank, world, buffers) -> dict:
    chunks, e, K, C, D, dtype, fp8, alignment, fused = spec
    regions = EPRegions.build(world, e, K, C, D, activation_dtype=dtype, fp8=fp8, alignment=alignment)
    sim = make_world(regions, garbage_seed=9)
    buffers[rank][:regions.end].copy_(sim[rank].local)  # same starting bytes as the simulation
    dist.barrier()
    peers = PeerBuffers.from_tensors(rank, [b[:regions.end] for b in buffers])
    checks, seconds = {}, 0.0
    for c, counts in enumerate(chunks):
        inputs = [make_inputs(counts[s % len(counts)], K, world * e, D, dtype, seed=17 * s + 3 + 100 * c)
                  for s in range(world)]
        t0 = time.perf_counter()
        out = native_chunk(inputs[rank].x_TD, inputs[rank].topk_ids_TK, inputs[rank].topk_weights_TK,
                           scaled_identity_experts(peers, regions), peers, regions, fused)
        seconds += time.perf_counter() - t0
        dist.barrier()  # every peer's writes into my buffer have landed before I compare it
        try:
            check_ep_status(peers, regions)
            checks[f"chunk{c}_status_ok"] = True
        except Exception:  # recorded as a failed check
            checks[f"chunk{c}_status_ok"] = False
        sim_outs = simulate_chunk(sim, regions, inputs, kernels=False, fused_signals=fused, max_polls=10**6)
        want = expected_output(inputs[rank], e, fp8)
        tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 4e-2}[dtype] * 4
        checks[f"chunk{c}_out_equals_twin_simulation"] = bool(
            torch.equal(out.view(torch.uint8), sim_outs[rank].view(torch.uint8)))
        checks[f"chunk{c}_buffer_equals_twin_simulation"] = bool(torch.equal(buffers[rank][:regions.end],
                                                                             sim[rank].local))
        checks[f"chunk{c}_out_close_to_oracle"] = bool(((out.double() - want).abs() <= tol * (1 + want.abs())).all())
        dist.barrier()  # nobody starts the next chunk while a peer still compares
    return {"checks": checks, "info": {"seconds": seconds}}


def run_timeout_case(rank, world, buffers) -> dict:
    """Rank 1 never posts: rank 0's barrier ends within its bound and records [1, epoch, missing]."""
    regions = EPRegions.build(world, 1, 1, 2, 8, activation_dtype=torch.float32)
    peers = PeerBuffers.from_tensors(rank, [b[:regions.end] for b in buffers])
    zero_signal_regions(peers, regions)
    dist.barrier()
    checks, info = {}, {}
    if rank == 0:
        t0 = time.perf_counter()
        native.symm_barrier(peers, regions, timeout_us=TIMEOUT_US, max_polls=2**62)
        info["seconds"] = time.perf_counter() - t0
        checks["ended_within_bound"] = TIMEOUT_US * 1e-6 <= info["seconds"] < 10.0
        status = regions.view(peers.local, "status").tolist()
        info["status"] = status
        checks["status_records_silent_peer"] = status == [1, 1, 0] + [1] * (world - 1)
        try:
            check_ep_status(peers, regions)
            checks["coded_error"] = False
        except PeerTimeoutError as err:
            checks["coded_error"] = err.code == "ENV010"
    dist.barrier()  # the silent rank waits here, never posting
    if rank != 0:
        checks["my_status_untouched"] = regions.view(peers.local, "status").tolist() == [0] * (2 + world)
        checks["rank0_posted_to_me"] = int(regions.view(peers.local, "signal")[0]) == 1
    dist.barrier()
    zero_signal_regions(peers, regions)
    dist.barrier()
    return {"checks": checks, "info": info}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out_dir = parser.parse_args().out
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {"library": {"checks": {"compiled_ops_active": native.is_active()},
                           "info": {"status": native.native_status()}}}
    largest = max((EPRegions.build(world, *spec[1:5], activation_dtype=spec[5], fp8=spec[6], alignment=spec[7])
                   for spec in CASES.values()), key=lambda regions: regions.end)
    buffers = map_shm_buffers(largest.end, rank, world)
    steps = [(name, lambda spec=spec, name=name: run_case(name, spec, rank, world, buffers))
             for name, spec in CASES.items()]
    steps.append(("silent_peer_timeout", lambda: run_timeout_case(rank, world, buffers)))
    for name, step in steps:
        results[name] = step()
        print(f"[rank {rank}] {name}: {results[name]}", flush=True)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    failed = [name for name, result in results.items() if not all(result["checks"].values())]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
