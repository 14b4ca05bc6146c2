"""torchrun worker: the device-side EP kernels on 2+ GPUs over torch symmetric memory.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=. \
        python3 -m torch.distributed.run --standalone --nproc-per-node 2 tests/gpu/ep_kernels_worker.py --json out.json

Checks (every rank; rank 0 writes the JSON):
1. twins: a whole chunk with the Triton kernels == the same chunk with the torch twins, bitwise, on every
   rank's WHOLE buffer and output (uneven T incl. 0, one hot expert, masked slots, T == C, bf16/fp16/fp32,
   FP8 on/off, odd widths), and the outputs against a float64 oracle.
2. graph: a chunk captured in a torch.cuda.CUDAGraph and replayed with new inputs == eager, bitwise.
3. timeout: a peer that skips a barrier gives PeerTimeoutError (ENV010) naming it, within the bound.
4. bound cost: 200 barriers captured in a graph, per-barrier time with no bound / a poll counter / counter +
   %globaltimer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "interpreter"))

from ep_sim import RankInputs, expected_output, make_inputs, scaled_identity_experts  # noqa: E402

from moe_ref.core.errors import PeerTimeoutError  # noqa: E402
from moe_ref.kernels.ep.ep_chunk import ep_chunk  # noqa: E402
from moe_ref.kernels.ep.ep_regions import EPRegions, PeerBuffers, zero_signal_regions  # noqa: E402
from moe_ref.kernels.ep.symm_signal import check_ep_status, symm_barrier  # noqa: E402

# name: (tokens per rank (cycled), e, K, C, Dx, dtype, fp8, alignment, one_expert)
TWIN_CASES = {
    "uneven_zero_fp32_a4": ([7, 0], 4, 3, 8, 72, torch.float32, False, 4, None),
    "full_cap_bf16": ([16, 16], 8, 8, 16, 7168, torch.bfloat16, False, 1, None),
    "fp8_bf16_odd_width": ([9, 13], 3, 4, 13, 200, torch.bfloat16, True, 1, None),
    "one_hot_expert_fp16": ([12, 5], 4, 4, 12, 256, torch.float16, False, 2, 5),
    "fp8_kimi_width_a128": ([33, 20], 16, 8, 40, 7168, torch.bfloat16, True, 128, None),
}


def log(rank: int, msg: str) -> None:
    print(f"[rank {rank}] {msg}", flush=True)


class SymmWorld:
    """One symmetric buffer of `nbytes` per rank; `peers` for kernels and twins."""

    def __init__(self, nbytes: int, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        self.local = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self.local.zero_()
        self.handle = symm_mem.rendezvous(self.local, dist.group.WORLD.group_name)
        self.peers = PeerBuffers.from_symm_handle(self.local, self.handle)
        torch.cuda.synchronize()
        dist.barrier()


def fill_garbage(world: SymmWorld, regions: EPRegions, seed: int) -> None:
    gen = torch.Generator(device=world.local.device).manual_seed(seed)
    world.local.copy_(torch.randint(0, 256, world.local.shape, dtype=torch.uint8, device=world.local.device,
                                    generator=gen))
    zero_signal_regions(world.peers, regions)
    torch.cuda.synchronize()
    dist.barrier()


def rank_inputs(counts, rank, K, E, D, dtype, seed, one_expert, device) -> RankInputs:
    return make_inputs(counts[rank % len(counts)], K, E, D, dtype, seed=seed + 101 * rank, one_expert=one_expert,
                       device=device)


def check_twins(world_k: SymmWorld, world_t: SymmWorld, rank: int, world_size: int, device) -> dict:
    results = {}
    cases = [(name, spec, True) for name, spec in TWIN_CASES.items()]
    cases.append(("full_cap_bf16_standalone_barriers", TWIN_CASES["full_cap_bf16"], False))
    for idx, (name, (counts, e, K, C, D, dtype, fp8, alignment, one_expert), fused) in enumerate(cases):
        regions = EPRegions.build(world_size, e, K, C, D, activation_dtype=dtype, fp8=fp8, alignment=alignment)
        inp = rank_inputs(counts, rank, K, world_size * e, D, dtype, idx, one_expert, device)
        fill_garbage(world_k, regions, seed=1000 + idx * 10 + rank)
        fill_garbage(world_t, regions, seed=1000 + idx * 10 + rank)
        outs = {}
        for label, world, kernels in (("kernel", world_k, True), ("twin", world_t, False)):
            experts = scaled_identity_experts(world.peers, regions)
            outs[label] = ep_chunk(inp.x_TD, inp.topk_ids_TK, inp.topk_weights_TK, experts, world.peers, regions,
                                   kernels=kernels, fused_signals=fused, timeout_us=10e6)
            torch.cuda.synchronize()
            check_ep_status(world.peers, regions)
        bad_regions = [r for r in regions.offsets
                       if not torch.equal(regions.view(world_k.local, r).view(torch.uint8).cpu(),
                                          regions.view(world_t.local, r).view(torch.uint8).cpu())]
        same_out = torch.equal(outs["kernel"].view(torch.uint8) if outs["kernel"].numel() else outs["kernel"],
                               outs["twin"].view(torch.uint8) if outs["twin"].numel() else outs["twin"])
        whole = torch.equal(world_k.local[:regions.end].cpu(), world_t.local[:regions.end].cpu())
        want = expected_output(RankInputs(inp.x_TD.cpu(), inp.topk_ids_TK.cpu(), inp.topk_weights_TK.cpu()), e, fp8)
        err = (outs["kernel"].double().cpu() - want).abs().max().item() if want.numel() else 0.0
        scale = want.abs().max().item() if want.numel() else 1.0
        tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 4e-2}[dtype] * max(scale, 1.0)
        ok = same_out and whole and not bad_regions and err <= tol
        results[name] = dict(ok=ok, same_out=same_out, whole_buffer_equal=whole, bad_regions=bad_regions,
                             oracle_max_err=err, oracle_tol=tol, tokens=inp.x_TD.shape[0])
        log(rank, f"twins {name}: {'PASS' if ok else 'FAIL'} {results[name]}")
        dist.barrier()
    return results


def check_graph(world: SymmWorld, rank: int, world_size: int, device) -> dict:
    e, K, C, D, dtype, fp8 = 8, 8, 64, 7168, torch.bfloat16, False
    results = {}
    for fp8 in (False, True):
        regions = EPRegions.build(world_size, e, K, C, D, activation_dtype=dtype, fp8=fp8, alignment=1)
        fill_garbage(world, regions, seed=77 + rank)
        num_tokens = [C, C // 2][rank % 2]  # uneven, fixed per rank (a graph has fixed shapes)
        experts = scaled_identity_experts(world.peers, regions)
        static = rank_inputs([num_tokens], 0, K, world_size * e, D, dtype, 500 + rank, None, device)
        x, ids, w = static.x_TD.clone(), static.topk_ids_TK.clone(), static.topk_weights_TK.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile + warm up outside the capture
                ep_chunk(x, ids, w, experts, world.peers, regions)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        dist.barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out_graph = ep_chunk(x, ids, w, experts, world.peers, regions)
        torch.cuda.synchronize()
        dist.barrier()
        same = []
        for step in range(3):
            new = rank_inputs([num_tokens], 0, K, world_size * e, D, dtype, 900 + 10 * step + rank, None, device)
            x.copy_(new.x_TD), ids.copy_(new.topk_ids_TK), w.copy_(new.topk_weights_TK)
            graph.replay()
            replayed = out_graph.clone()
            eager = ep_chunk(new.x_TD, new.topk_ids_TK, new.topk_weights_TK, experts, world.peers, regions)
            torch.cuda.synchronize()
            check_ep_status(world.peers, regions)
            same.append(bool(torch.equal(replayed.view(torch.uint8), eager.view(torch.uint8))))
        # replay timing (both ranks replay in lockstep through the graph's own barriers)
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        check_ep_status(world.peers, regions)
        key = "fp8" if fp8 else "bf16"
        results[key] = dict(ok=all(same), replay_equals_eager=same, tokens=num_tokens,
                            replay_us=start.elapsed_time(end) * 1e3 / 50)
        log(rank, f"graph {key}: {'PASS' if all(same) else 'FAIL'} {results[key]}")
        del graph
        dist.barrier()
    return results


def check_timeout(world: SymmWorld, rank: int, world_size: int) -> dict:
    regions = EPRegions.build(world_size, 1, 1, 1, 8, activation_dtype=torch.float32)
    fill_garbage(world, regions, seed=5)
    bound_us = 200_000.0
    result = dict(bound_us=bound_us)
    if rank == 0:  # rank 1.. skip this barrier: rank 0 must report them, not hang
        t0 = time.perf_counter()
        symm_barrier(world.peers, regions, timeout_us=bound_us)
        torch.cuda.synchronize()
        elapsed = (time.perf_counter() - t0) * 1e6
        try:
            check_ep_status(world.peers, regions)
            result.update(ok=False, error=None)
        except PeerTimeoutError as err:
            silent = err.details["peers"]
            result.update(ok=silent == list(range(1, world_size)) and elapsed < bound_us * 5, error=str(err),
                          peers=silent)
        result["elapsed_us"] = elapsed
        log(rank, f"timeout: {'PASS' if result['ok'] else 'FAIL'} {result}")
    dist.barrier()
    fill_garbage(world, regions, seed=6)  # resets signal/epoch/status on every rank
    if rank == 0:  # the fused wait of ep_dispatch: same error, and nothing is received from the silent peer
        from moe_ref.kernels.ep.ep_dispatch import ep_dispatch

        regions.view(world.local, "epoch").fill_(1)  # as if my ep_pre_dispatch(post=True) had run: it posts
        regions.view(world.local, "signal")[rank] = 1  # to every rank, me included
        t0 = time.perf_counter()
        ep_dispatch(world.peers, regions, wait=True, timeout_us=bound_us)
        torch.cuda.synchronize()
        elapsed = (time.perf_counter() - t0) * 1e6
        try:
            check_ep_status(world.peers, regions)
            ok = False
        except PeerTimeoutError as err:
            ok = err.details["peers"] == list(range(1, world_size))
        pool_end = int(regions.view(world.local, "pool_end")[0])
        result["fused_wait"] = dict(ok=ok and pool_end == 0, elapsed_us=elapsed, pool_end=pool_end)
        result["ok"] = result["ok"] and result["fused_wait"]["ok"]
        log(rank, f"fused-wait timeout: {'PASS' if result['fused_wait']['ok'] else 'FAIL'} {result['fused_wait']}")
    dist.barrier()
    fill_garbage(world, regions, seed=7)
    return result


def measure_bound_cost(world: SymmWorld, rank: int, world_size: int) -> dict:
    regions = EPRegions.build(world_size, 1, 1, 1, 8, activation_dtype=torch.float32)
    out = {}
    for label, bound in (("none", 0), ("polls", 1), ("polls+globaltimer", 2)):
        fill_garbage(world, regions, seed=8)
        for _ in range(3):
            symm_barrier(world.peers, regions, _bound=bound)
        torch.cuda.synchronize()
        dist.barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(200):
                symm_barrier(world.peers, regions, _bound=bound)
        torch.cuda.synchronize()
        dist.barrier()
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / 200)
        check_ep_status(world.peers, regions)
        out[label] = sorted(times)[len(times) // 2]
        del graph
    # eager: one launch per barrier from Python
    fill_garbage(world, regions, seed=9)
    for _ in range(10):
        symm_barrier(world.peers, regions)
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(200):
        symm_barrier(world.peers, regions)
    torch.cuda.synchronize()
    out["eager_launch_each"] = (time.perf_counter() - t0) * 1e6 / 200
    t0 = time.perf_counter()
    for _ in range(200):
        world.handle.barrier(channel=0)
    torch.cuda.synchronize()
    out["torch_handle_barrier_eager"] = (time.perf_counter() - t0) * 1e6 / 200
    log(rank, f"barrier us per call: {out}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--skip", default="", help="comma list of: twins,graph,timeout,bound")
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    nbytes = 64 << 20
    world_k, world_t = SymmWorld(nbytes, device), SymmWorld(nbytes, device)
    report, failed = {"world_size": world_size, "device": torch.cuda.get_device_name(device)}, False
    steps = [("twins", lambda: check_twins(world_k, world_t, rank, world_size, device)),
             ("graph", lambda: check_graph(world_k, rank, world_size, device)),
             ("timeout", lambda: check_timeout(world_k, rank, world_size)),
             ("bound", lambda: measure_bound_cost(world_k, rank, world_size))]
    for name, step in steps:
        if name in args.skip.split(","):
            continue
        t0 = time.perf_counter()
        try:
            report[name] = step()
        except Exception as err:  # report and go on: the other rank's waits are bounded
            report[name] = {"ok": False, "exception": repr(err), "traceback": traceback.format_exc()}
            log(rank, f"{name}: EXCEPTION {traceback.format_exc()}")
        report[name + "_seconds"] = time.perf_counter() - t0
        dist.barrier()
    for name in ("twins", "graph"):
        for case in report.get(name, {}).values():
            failed |= isinstance(case, dict) and not case.get("ok", False)
    failed |= isinstance(report.get("timeout"), dict) and rank == 0 and not report["timeout"].get("ok", False)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    log(rank, "ALL PASS" if not failed else "SOME FAILED")
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
