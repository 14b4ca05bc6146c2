"""torchrun worker (CPU, gloo): the device-side EP kernels and their twins across real processes over /dev/shm.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist/ep_kernels_cpu_worker.py --out DIR

Each rank maps every rank's shared-memory file (the CPU symmetric heap), so `PeerBuffers` holds real peer
mappings and the signals cross processes. Per case, every rank also simulates the whole group in its own
process (tests/interpreter/ep_sim.py, same inputs and starting bytes) and requires its output and its WHOLE
buffer to be bitwise equal to the simulation's. Writes OUT/rank{r}.json: {case: {"checks": {...}, "info": {...}}}.
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "interpreter"))

from ep_sim import expected_output, make_inputs, make_world, simulate_chunk  # noqa: E402

from moe_ref.kernels.ep.ep_chunk import ep_chunk  # noqa: E402
from moe_ref.kernels.ep.ep_regions import EPRegions, PeerBuffers  # noqa: E402
from moe_ref.kernels.ep.symm_signal import check_ep_status  # noqa: E402

# name: (token counts per rank (cycled), e, K, C, Dx, dtype, fp8, alignment, kernels, fused_signals)
CASES = {
    "kernels_fused_fp32_uneven_zero": ([5, 0, 3], 2, 3, 6, 40, torch.float32, False, 2, True, True),
    "twins_standalone_bf16_fp8": ([4, 6, 1], 2, 2, 6, 130, torch.bfloat16, True, 1, False, False),
    "twins_fused_fp16": ([3, 3, 2], 3, 2, 4, 72, torch.float16, False, 4, False, True),
}


def map_shm_buffers(nbytes: int, rank: int, world: int) -> list[torch.Tensor]:
    """Create my file in MOE_REF_SHM_DIR (or /dev/shm), map every rank's, unlink mine once all have mapped it."""
    folder = os.environ.get("MOE_REF_SHM_DIR", "/dev/shm")
    path = os.path.join(folder, f"ep_kernels_cpu_{os.getpid()}_{rank}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    try:
        local = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        paths: list = [None] * world
        dist.all_gather_object(paths, path)
        buffers = [local if s == rank else torch.from_file(paths[s], shared=True, size=nbytes, dtype=torch.uint8)
                   for s in range(world)]
        dist.barrier()
    finally:
        os.unlink(path)
    return buffers


def run_case(name: str, spec, rank: int, world: int, buffers: list[torch.Tensor]) -> dict:
    counts, e, K, C, D, dtype, fp8, alignment, kernels, fused = spec
    regions = EPRegions.build(world, e, K, C, D, activation_dtype=dtype, fp8=fp8, alignment=alignment)
    inputs = [make_inputs(counts[s % len(counts)], K, world * e, D, dtype, seed=17 * s + 3) for s in range(world)]
    sim = make_world(regions, garbage_seed=9)
    buffers[rank][:regions.end].copy_(sim[rank].local)  # same starting bytes as the simulation
    dist.barrier()
    peers = PeerBuffers.from_tensors(rank, [b[:regions.end] for b in buffers])
    from ep_sim import scaled_identity_experts

    t0 = time.perf_counter()
    out = ep_chunk(inputs[rank].x_TD, inputs[rank].topk_ids_TK, inputs[rank].topk_weights_TK,
                   scaled_identity_experts(peers, regions), peers, regions, kernels=kernels, fused_signals=fused,
                   timeout_us=120e6)
    seconds = time.perf_counter() - t0
    dist.barrier()  # every peer's writes into my buffer have landed before I compare it
    status_ok = True
    try:
        check_ep_status(peers, regions)
    except Exception:  # recorded as a failed check
        status_ok = False
    sim_outs = simulate_chunk(sim, regions, inputs, kernels=kernels, fused_signals=fused, max_polls=10**6)
    want = expected_output(inputs[rank], e, fp8)
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 4e-2}[dtype] * 4
    checks = {
        "status_ok": status_ok,
        "out_equals_simulation": bool(torch.equal(out.view(torch.uint8), sim_outs[rank].view(torch.uint8))),
        "buffer_equals_simulation": bool(torch.equal(buffers[rank][:regions.end], sim[rank].local)),
        "out_close_to_oracle": bool(((out.double() - want).abs() <= tol * (1 + want.abs())).all()),
    }
    dist.barrier()  # nobody rewrites a buffer for the next case while a peer still compares
    return {"checks": checks, "info": {"tokens": inputs[rank].x_TD.shape[0], "seconds": seconds}}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    nbytes = max(EPRegions.build(world, s[1], s[2], s[3], s[4], activation_dtype=s[5], fp8=s[6],
                                 alignment=s[7]).end for s in CASES.values())
    buffers = map_shm_buffers(nbytes, rank, world)
    results = {}
    for name, spec in CASES.items():
        results[name] = run_case(name, spec, rank, world, buffers)
        print(f"[rank {rank}] {name}: {results[name]}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if all(all(r["checks"].values()) for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
