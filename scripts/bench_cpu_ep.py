"""CPU EP chunk over the /dev/shm symmetric heap: the torch twins vs the compiled ops (moe_ref.kernels.runtime.native), at 2 and
4 processes, 128..16384 tokens per rank, a tiny and a mid-size shape. Writes JSON + markdown.

    python scripts/bench_cpu_ep.py [--world-sizes 2,4] [--tokens 128,512,2048,4096,16384] [--configs tiny,mid]
                                   [--out results/bench_cpu_ep | --record]

Writes <out>.json and <out>.md (default results/bench_cpu_ep.*, outside the tracked tree); --record writes the
recorded run docs/results/bench_cpu_ep.* instead.

One chunk = ep_chunk's phases with fused signals (pre-dispatch + post, dispatch + wait, experts, combine push +
post, combine reduce + wait); the experts are the identity on the pool (no time), so a chunk is the EP data
path alone (dispatch + combine). Both paths run the same phase code; only the five ops differ. Per iteration
every rank enters after a gloo barrier; a chunk's time is the slowest rank's; the figure is the median over
iterations. Every (shape, ranks, tokens) also checks that both paths give bitwise-equal outputs. Each process
gets cores // ranks intra-op threads (1 on a 2-core machine), for both paths.

Shapes: tiny = tiny-deepseek-v3 (E=16, K=4, Dx=48); mid = E=64, K=8, Dx=1024 (a mid-size model's routing at a
reduced hidden size, so 16384 tokens/rank at 4 ranks fits in memory); bf16 activations, alignment 1, cap = T.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "dist"))

CONFIGS = {  # name: (experts E, top-k K, row width Dx, fp8)
    "tiny": (16, 4, 48, False),
    "mid": (64, 8, 1024, False),
}


# ---------------------------------------------------------------------------------------------------------
# worker (one process of a torchrun job)
# ---------------------------------------------------------------------------------------------------------
def _worker(args) -> int:
    import torch
    import torch.distributed as dist

    from ep_kernels_cpu_worker import map_shm_buffers  # tests/dist: the /dev/shm mapping of the CPU heap

    from moe_ref.kernels.runtime import native
    from moe_ref.kernels.ep.ep_combine import ep_combine_push_ref, ep_combine_reduce_ref
    from moe_ref.kernels.ep.ep_dispatch import ep_dispatch_ref
    from moe_ref.kernels.ep.ep_layout import ep_pre_dispatch_ref
    from moe_ref.kernels.ep.ep_regions import EPRegions, PeerBuffers, zero_signal_regions
    from moe_ref.kernels.ep.symm_signal import check_ep_status, symm_barrier_ref

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    paths = {"twins": (ep_pre_dispatch_ref, symm_barrier_ref, ep_dispatch_ref, ep_combine_push_ref,
                       ep_combine_reduce_ref),
             "compiled": native.ops_table()}
    if not native.is_active():
        raise SystemExit(f"compiled ops not active: {native.native_status()}")
    tokens = [int(t) for t in args.tokens.split(",")]
    configs = args.configs.split(",")

    def layout(name, T):
        E, K, D, fp8 = CONFIGS[name]
        return EPRegions.build(world, E // world, K, T, D, activation_dtype=torch.bfloat16, fp8=fp8, alignment=1)

    nbytes = max(layout(c, T).end for c in configs for T in tokens)
    buffers = map_shm_buffers(nbytes, rank, world)

    def chunk(ops, x, ids, w, peers, regions):
        """Returns (out, seconds per phase)."""
        pre, _, dispatch, push, reduce = ops
        my = peers.local
        t0 = time.perf_counter()
        pre(x, ids, w, peers, regions, post=True)
        t1 = time.perf_counter()
        dispatch(peers, regions, wait=True)
        t2 = time.perf_counter()
        y = regions.view(my, "recv_x")  # identity experts
        push(y, peers, regions, post=True)
        t3 = time.perf_counter()
        out = reduce(x.shape[0], peers, regions, wait=True)
        t4 = time.perf_counter()
        return out, (t4 - t0, t1 - t0, t2 - t1, t3 - t2, t4 - t3)

    rows = []
    for name in configs:
        E, K, D, fp8 = CONFIGS[name]
        for T in tokens:
            regions = layout(name, T)
            peers = PeerBuffers.from_tensors(rank, [b[:regions.end] for b in buffers])
            gen = torch.Generator().manual_seed(1000 * rank + T)
            x = torch.randn(T, D, generator=gen).to(torch.bfloat16)
            ids = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :K].contiguous()  # distinct experts, uniform
            w = torch.rand(T, K, generator=gen)
            iters = max(3, min(20, int(2e8 / (T * K * D * 2))))
            outs, result = {}, {}
            for path, ops in paths.items():
                zero_signal_regions(peers, regions)
                dist.barrier()
                times = []
                for it in range(iters + 1):  # the first is a warm-up
                    dist.barrier()
                    out, phases = chunk(ops, x, ids, w, peers, regions)
                    if it:
                        times.append(phases)
                check_ep_status(peers, regions)
                outs[path] = out
                gathered = [None] * world
                dist.all_gather_object(gathered, times)
                slowest = [[max(g[i][p] for g in gathered) for p in range(5)] for i in range(iters)]
                result[path] = {"chunk_ms": 1e3 * statistics.median(s[0] for s in slowest),
                                "phases_ms": {phase: 1e3 * statistics.median(s[p + 1] for s in slowest)
                                              for p, phase in enumerate(("pre_dispatch", "dispatch", "combine_push",
                                                                         "combine_reduce"))}}
            same = torch.equal(outs["twins"].view(torch.uint8), outs["compiled"].view(torch.uint8))
            flags = [None] * world
            dist.all_gather_object(flags, bool(same))
            row = dict(config=name, experts=E, topk=K, hidden=D, fp8=fp8, ranks=world, tokens_per_rank=T,
                       iters=iters, threads_per_rank=torch.get_num_threads(), bitwise_equal=all(flags),
                       twins=result["twins"], compiled=result["compiled"],
                       speedup=result["twins"]["chunk_ms"] / result["compiled"]["chunk_ms"])
            rows.append(row)
            if rank == 0:
                print(f"[bench] {name} EP{world} T={T}: twins {row['twins']['chunk_ms']:.2f} ms, compiled "
                      f"{row['compiled']['chunk_ms']:.2f} ms, {row['speedup']:.1f}x, bitwise {row['bitwise_equal']}",
                      flush=True)
            dist.barrier()
    os.makedirs(args.out, exist_ok=True)
    if rank == 0:
        Path(args.out, "rank0.json").write_text(json.dumps({"rows": rows, "status": native.native_status()}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------------------------------------
def _markdown(report: dict) -> str:
    lines = [f"# CPU EP chunk: torch twins vs compiled ops ({report['date']})", "",
             f"Machine: {report['machine']}. {report['native_status']}.",
             "One chunk = pre-dispatch, dispatch, combine push, combine reduce with fused barrier halves over the "
             "/dev/shm heap; identity experts (no time), bf16, alignment 1, cap = tokens/rank. Median over "
             "iterations of the slowest rank; `scripts/bench_cpu_ep.py` regenerates this file.", ""]
    loads = {r["ranks"]: r.get("load_avg_1min_job_start_end") for r in report["rows"]}
    if any(loads.values()):
        lines += ["Load average (1 min) at the start / end of each job (above 2 = other work shared the cores): " +
                  ", ".join(f"{k} ranks {v[0]} / {v[1]}" for k, v in loads.items() if v) + ".", ""]
    for name in dict.fromkeys(r["config"] for r in report["rows"]):
        rows = [r for r in report["rows"] if r["config"] == name]
        E, K, D = rows[0]["experts"], rows[0]["topk"], rows[0]["hidden"]
        lines += [f"## {name}: E={E}, K={K}, Dx={D}", "",
                  "| ranks | tokens/rank | twins ms | compiled ms | speedup | compiled: pre / dispatch / push / reduce ms "
                  "| twins: pre / dispatch / push / reduce ms | bitwise equal |",
                  "|---:|---:|---:|---:|---:|---|---|---|"]
        for r in sorted(rows, key=lambda r: (r["ranks"], r["tokens_per_rank"])):
            def phases(p):
                return " / ".join(f"{v:.2f}" for v in r[p]["phases_ms"].values())
            lines.append(f"| {r['ranks']} | {r['tokens_per_rank']} | {r['twins']['chunk_ms']:.2f} | "
                         f"{r['compiled']['chunk_ms']:.2f} | {r['speedup']:.1f}x | {phases('compiled')} | "
                         f"{phases('twins')} | {'yes' if r['bitwise_equal'] else 'NO'} |")
        lines.append("")
    goal = [r for r in report["rows"] if r["ranks"] == 2 and r["tokens_per_rank"] == 4096]
    if goal:
        lines.append("Goal (EP2, 4096 tokens/rank, >= 5x): " + "; ".join(
            f"{r['config']} {r['speedup']:.1f}x ({'met' if r['speedup'] >= 5 else 'NOT met'})" for r in goal) + ".")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--tokens", default="128,512,2048,4096,16384")
    parser.add_argument("--configs", default="tiny,mid")
    parser.add_argument("--out", default=None, help="path stem of the JSON and markdown (default results/bench_cpu_ep)")
    parser.add_argument("--record", action="store_true", help="write docs/results/bench_cpu_ep.* (the recorded run)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per torchrun job")
    args, _ = parser.parse_known_args()
    if "LOCAL_RANK" in os.environ:  # started by torchrun: one rank
        return _worker(args)
    if args.record and args.out is not None:
        parser.error("--record writes docs/results/bench_cpu_ep: give --out or --record, not both")
    args.out = str(REPO / "docs" / "results" / "bench_cpu_ep") if args.record else args.out or "results/bench_cpu_ep"

    from launch import torchrun  # tests/dist: private shm folder, wall-clock limit

    import platform

    rows = []
    for world in (int(w) for w in args.world_sizes.split(",")):
        print(f"bench_cpu_ep: {world} ranks ...", file=sys.stderr, flush=True)
        load_before = os.getloadavg()[0]
        with tempfile.TemporaryDirectory() as tmp:
            launch = torchrun(world, ["--tokens", args.tokens, "--configs", args.configs], Path(tmp), args.timeout,
                              worker=Path(__file__).resolve())
        if launch.returncode != 0 or 0 not in launch.results:
            print(launch.log[-6000:], file=sys.stderr)
            raise SystemExit(f"bench_cpu_ep: the {world}-rank job failed ({launch.returncode=})")
        for row in launch.results[0]["rows"]:
            row["load_avg_1min_job_start_end"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
            rows.append(row)
        status = launch.results[0]["status"]
    report = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  machine=f"{os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}",
                  native_status=status, rows=rows)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(report, indent=1))
    text = _markdown(report)
    Path(args.out + ".md").write_text(text)
    print(text)
    return 0 if all(r["bitwise_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
