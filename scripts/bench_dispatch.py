"""Dispatch + combine alone (identity experts) over the device-side EP kernels, beside same-run anchors.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=. \
        python3 -m torch.distributed.run --standalone --nproc-per-node 2 scripts/bench_dispatch.py --out results/

Rows (per tokens/rank T, H 7168, top-8 over 384 experts = 192 per rank at EP 2, random distinct experts):
- `kernels eager`: `ep_chunk` (ep_pre_dispatch, barrier, ep_dispatch, identity, ep_combine_push, barrier,
  ep_combine_reduce), launched from Python each call; also split into its dispatch and combine halves.
- `kernels graph`: the same chunk captured in one torch.cuda.CUDAGraph, replayed.
- `nccl plain` (anchor): argsort by destination + counts `all_to_all_single` + `.tolist()` + rows
  `all_to_all_single` out (one row per slot) + identity + rows back + weighted `index_add_`.
- `peer copy_` (anchor): each rank pulls, all at once, as many bytes as a bf16 call moves each way from the next
  rank's symmetric buffer with one `copy_` (a cudaMemcpyAsync of peer-mapped memory over NVLink): the link's bandwidth
  without any kernel of ours.
- `all_to_all_vdev` (anchor, a separate launch with `--vdev-only`): torch's NVSHMEM `all_to_all_vdev`, one way,
  T*K/R rows to each rank (one row per slot, one direction).
Identity experts: bf16 -> y is the pool itself (no copy); FP8 -> y is a preallocated bf16 pool-sized tensor
(its values are not the dequantized rows; the data path's time does not depend on them).

Times: CUDA events around `iters` back-to-back calls (the in-chunk barriers keep the ranks in step), median of
`repeats`, max over ranks. NVLink bytes per direction (each rank sends this much to the other, both directions
busy at once): rows that cross once per (token, other rank) in dispatch (+ fp8 scales) plus partials that come back
once per (token, other rank) in combine; GB/s = those bytes / total time (whole call, not only the copy phases).
`dispatch us` / `combine us`: the two halves timed alone (`ep_pre_dispatch(post) + ep_dispatch(wait)` and
`ep_combine_push(post) + ep_combine_reduce(wait)`). `standalone barriers`: `fused_signals=False` (8 launches
instead of 6). With `--profile`-like output in the JSON: GPU time per kernel of the eager chunk (rank 0, bf16,
T = 128 and 4096).
Writes bench_dispatch.json and .md (and .png when matplotlib imports) under --out (bench_dispatch_vdev.* with
--vdev-only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from moe_ref.kernels.ep.ep_chunk import ep_chunk  # noqa: E402
from moe_ref.kernels.ep.ep_combine import ep_combine_push, ep_combine_reduce  # noqa: E402
from moe_ref.kernels.ep.ep_dispatch import ep_dispatch  # noqa: E402
from moe_ref.kernels.ep.ep_launch import EP_LAUNCH  # noqa: E402
from moe_ref.kernels.ep.ep_layout import ep_pre_dispatch  # noqa: E402
from moe_ref.kernels.ep.ep_regions import EPRegions, PeerBuffers, zero_signal_regions  # noqa: E402
from moe_ref.kernels.ep.symm_signal import check_ep_status  # noqa: E402

HIDDEN, TOPK, NUM_EXPERTS = 7168, 8, 384


def routing(num_tokens: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, device=device, generator=gen).to(torch.bfloat16)
    scores = torch.rand(num_tokens, NUM_EXPERTS, device=device, generator=gen)
    ids = scores.topk(TOPK, dim=1).indices
    w = torch.rand(num_tokens, TOPK, device=device, generator=gen)
    return x, ids, w


def timed(fn, iters: int, repeats: int) -> float:
    """Median over repeats of the mean us per call of `iters` back-to-back calls; max over ranks."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    value = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def capture(fn) -> torch.cuda.CUDAGraph:
    """`fn` captured in a CUDA graph (after one warm-up call on a side stream); collective (barriers inside)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    return graph


def link_bytes(ids: torch.Tensor, rank: int, e: int, world: int, row_bytes: int) -> int:
    """Bytes this rank sends to other ranks in one direction: one row per (token, other rank with >= 1 slot)."""
    dests = ids // e
    total = 0
    for s in range(world):
        if s != rank:
            total += int((dests == s).any(dim=1).sum()) * row_bytes
    return total


def profile_kernels(fn, rank: int, calls: int = 10) -> list[dict]:
    """GPU time per kernel name (us per call, summed over launches of the same kernel) over `calls` eager calls,
    profiled on rank 0 (collective: every rank runs the calls)."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    torch.cuda.synchronize()
    if rank != 0:  # the peer runs the same calls (its barriers pair with rank 0's), unprofiled
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        return []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = []
    for evt in prof.key_averages():
        device_us = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0)
        if device_us > 0:
            rows.append(dict(kernel=evt.key[:80], us_per_call=device_us / calls, launches_per_call=evt.count / calls))
    rows.sort(key=lambda r: -r["us_per_call"])
    return rows[:14]


def symmetric_bytes(num_bytes: int, device):
    """``num_bytes`` of torch symmetric memory on every rank (collective): (my uint8 buffer, its rendezvous)."""
    import torch.distributed._symmetric_memory as symm_mem

    local = symm_mem.empty(num_bytes, dtype=torch.uint8, device=device)
    return local, symm_mem.rendezvous(local, dist.group.WORLD.group_name)


class ChunkCase:
    """One (T, dtype) case over a fresh symmetric buffer: the whole chunk and its two halves as callables."""

    def __init__(self, num_tokens: int, fp8: bool, rank: int, world: int, device):
        self.e = NUM_EXPERTS // world
        self.regions = regions = EPRegions.build(world, self.e, TOPK, num_tokens, HIDDEN,
                                                 activation_dtype=torch.bfloat16, fp8=fp8, alignment=1)
        self.local, handle = symmetric_bytes(regions.end, device)
        self.local.zero_()
        self.peers = peers = PeerBuffers.from_symm_handle(self.local, handle)
        zero_signal_regions(peers, regions)
        torch.cuda.synchronize()
        dist.barrier()
        self.x, self.ids, self.w = routing(num_tokens, 1000 + rank, device)
        self.pool = regions.view(self.local, "recv_x")
        self.y_fp8 = torch.zeros(self.pool.shape, dtype=torch.bfloat16, device=device) if fp8 else None
        self.num_tokens, self.fp8 = num_tokens, fp8

    def experts(self, recv_x, recv_x_scale):
        return self.y_fp8 if self.fp8 else recv_x

    def chunk(self, fused_signals: bool = True):
        return ep_chunk(self.x, self.ids, self.w, self.experts, self.peers, self.regions, fused_signals=fused_signals)

    def dispatch_half(self):
        ep_pre_dispatch(self.x, self.ids, self.w, self.peers, self.regions, post=True)
        ep_dispatch(self.peers, self.regions, wait=True)

    def combine_half(self):
        ep_combine_push(self.experts(self.pool, None), self.peers, self.regions, post=True)
        return ep_combine_reduce(self.num_tokens, self.peers, self.regions, wait=True)


def bench_kernels(num_tokens: int, fp8: bool, rank: int, world: int, device, iters: int, repeats: int,
                  profile: bool = False) -> dict:
    case = ChunkCase(num_tokens, fp8, rank, world, device)
    regions, peers, local, ids, e = case.regions, case.peers, case.local, case.ids, case.e
    chunk, dispatch_half, combine_half = case.chunk, case.dispatch_half, case.combine_half

    def chunk_unfused():
        return case.chunk(fused_signals=False)

    for _ in range(3):
        chunk()
    torch.cuda.synchronize()
    out = {"eager_us": timed(chunk, iters, repeats)}
    out["eager_dispatch_us"] = timed(dispatch_half, iters, repeats)
    out["eager_combine_us"] = timed(combine_half, iters, repeats)
    graph, graph_d, graph_c = capture(chunk), capture(dispatch_half), capture(combine_half)
    graph_u = capture(chunk_unfused)
    out["graph_us"] = timed(graph.replay, iters, repeats)
    out["graph_unfused_us"] = timed(graph_u.replay, iters, repeats)
    out["eager_unfused_us"] = timed(chunk_unfused, iters, repeats)
    if profile:
        out["profile"] = profile_kernels(chunk, rank)
    out["graph_dispatch_us"] = timed(graph_d.replay, iters, repeats)
    out["graph_combine_us"] = timed(graph_c.replay, iters, repeats)
    torch.cuda.synchronize()
    check_ep_status(peers, regions)
    row_bytes = HIDDEN * (1 if fp8 else 2) + (regions.num_scale_cols * 4 if fp8 else 0)
    out["dispatch_link_bytes"] = link_bytes(ids, rank, e, world, row_bytes)
    out["combine_link_bytes"] = link_bytes(ids, rank, e, world, HIDDEN * 2)
    out["pool_rows"] = int(regions.view(local, "pool_end")[0])
    del graph, graph_d, graph_c, graph_u
    dist.barrier()
    return out


def bench_nccl_plain(num_tokens: int, rank: int, world: int, device, iters: int, repeats: int) -> float:
    """The plain torch path (anchor): one row per slot each way, a host sync for the split sizes."""
    e = NUM_EXPERTS // world
    x, ids, w = routing(num_tokens, 1000 + rank, device)

    def run():
        dest_N = (ids // e).reshape(-1)
        order_N = torch.argsort(dest_N, stable=True)
        token_N = order_N // TOPK
        send_counts = torch.bincount(dest_N, minlength=world)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        send_list, recv_list = send_counts.tolist(), recv_counts.tolist()  # NOTE: host sync
        rows = x.index_select(0, token_N)
        recv = rows.new_empty(sum(recv_list), HIDDEN)
        dist.all_to_all_single(recv, rows, recv_list, send_list)
        back = torch.empty_like(rows)
        dist.all_to_all_single(back, recv, send_list, recv_list)  # identity experts
        out = torch.zeros(num_tokens, HIDDEN, dtype=torch.float32, device=device)
        out.index_add_(0, token_N, back.float() * w.reshape(-1)[order_N, None])
        return out.to(torch.bfloat16)

    for _ in range(3):
        run()
    return timed(run, iters, repeats)


def sweep_launch(num_tokens: int, fp8: bool, rank: int, world: int, device, iters: int, repeats: int) -> list[dict]:
    """Each half of the chunk, in a CUDA graph, under each EP launch shape (``kernels.ep_launch``)."""
    case = ChunkCase(num_tokens, fp8, rank, world, device)
    default = dataclasses.replace(EP_LAUNCH)
    shapes = [("dispatch", dict(dispatch_block_bytes=b, dispatch_warps=w))
              for b in (4096, 8192, 16384) for w in (4, 8, 16)]
    shapes += [("combine", dict(combine_block_cols=c, combine_warps=w))
               for c in (512, 1024, 2048) for w in (4, 8, 16)]
    rows = []
    for half, fields in shapes:
        for name, value in fields.items():
            setattr(EP_LAUNCH, name, value)
        fn = case.dispatch_half if half == "dispatch" else case.combine_half
        for _ in range(2):
            fn()
        graph = capture(fn)
        rows.append(dict(tokens=num_tokens, dtype="fp8" if fp8 else "bf16", half=half, **fields,
                         us=timed(graph.replay, iters, repeats)))
        del graph
        for name in fields:
            setattr(EP_LAUNCH, name, getattr(default, name))
    check_ep_status(case.peers, case.regions)
    dist.barrier()
    return rows


def bench_peer_copy(num_bytes: int, rank: int, world: int, device, iters: int, repeats: int) -> float:
    """Copy anchor: every rank at once pulls ``num_bytes`` from the next rank's symmetric buffer into local memory
    with one ``copy_`` (cudaMemcpyAsync of a peer-mapped address, over NVLink); us per copy, max over ranks."""
    _, handle = symmetric_bytes(num_bytes, device)
    peer = handle.get_buffer((rank + 1) % world, (num_bytes,), torch.uint8)
    dst = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    for _ in range(3):
        dst.copy_(peer)
    us = timed(lambda: dst.copy_(peer), iters, repeats)
    dist.barrier()
    return us


def bench_vdev(num_tokens: int, rank: int, world: int, device, iters: int, repeats: int) -> float | None:
    """torch all_to_all_vdev one way: the rows of one direction (T * K / world per peer on average)."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        rows = num_tokens * TOPK
        inp = symm_mem.empty(rows, HIDDEN, dtype=torch.bfloat16, device=device).normal_()
        out = symm_mem.empty(rows * 2, HIDDEN, dtype=torch.bfloat16, device=device)
        in_splits = symm_mem.empty(world, dtype=torch.int64, device=device).fill_(rows // world)
        out_splits = symm_mem.empty(2, world, dtype=torch.int64, device=device)
        group = dist.group.WORLD.group_name
        for t in (inp, out, in_splits, out_splits):
            symm_mem.rendezvous(t, group)

        def run():
            torch.ops.symm_mem.all_to_all_vdev(inp, out, in_splits, out_splits, group)

        for _ in range(3):
            run()
        return timed(run, iters, repeats)
    except Exception as err:  # an anchor that does not run here is reported, not fatal
        if rank == 0:
            print(f"all_to_all_vdev did not run: {err!r}", flush=True)
        return None


def write_outputs(rows: list[dict], out_dir: str, meta: dict, name: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [f"# bench_dispatch ({meta['device']} x{meta['world']}, H {HIDDEN}, top-{TOPK}, {NUM_EXPERTS} experts)",
             "", "Dispatch + combine alone, identity experts; us per call (max over ranks, median of repeats).", "",
             "| tokens/rank | path | dtype | mode | total us | dispatch us | combine us | NVLink GB/s per direction |",
             "|---:|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        def fmt(v):
            return "" if v is None else f"{v:.1f}"
        lines.append(f"| {r['tokens']} | {r['path']} | {r['dtype']} | {r['mode']} | {fmt(r.get('total_us'))} | "
                     f"{fmt(r.get('dispatch_us'))} | {fmt(r.get('combine_us'))} | {fmt(r.get('gbps'))} |")
    with open(os.path.join(out_dir, name + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 5))
        series = {}
        for r in rows:
            if r.get("total_us") is not None:
                series.setdefault(f"{r['path']} {r['dtype']} {r['mode']}", []).append((r["tokens"], r["total_us"]))
        for label, pts in series.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("us per call")
        ax.set_title("dispatch + combine (identity experts), 2x H200")
        ax.legend(fontsize=7)
        fig.savefig(os.path.join(out_dir, name + ".png"), dpi=120, bbox_inches="tight")
    except ImportError:
        pass


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results")
    parser.add_argument("--tokens", default="128,512,4096")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sweep", action="store_true",
                        help="only time each half in a CUDA graph under each EP launch shape (kernels.ep_launch) and "
                             "write bench_dispatch_sweep.json")
    parser.add_argument("--vdev-only", action="store_true",
                        help="time only torch all_to_all_vdev (NVSHMEM backend, set before any allocation; run it "
                             "as its own launch) and write bench_dispatch_vdev.json")
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    rows = []
    t_start = time.perf_counter()
    token_counts = [int(t) for t in args.tokens.split(",")]
    if args.vdev_only:
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.set_backend("NVSHMEM")
        for num_tokens in token_counts:
            vdev = bench_vdev(num_tokens, rank, world, device, args.iters, args.repeats)
            rows.append(dict(tokens=num_tokens, path="torch all_to_all_vdev one way (T*K/R rows to each rank)",
                             dtype="bf16", mode="eager", total_us=vdev))
            if rank == 0:
                print(f"T={num_tokens} all_to_all_vdev: {vdev}", flush=True)
    if args.sweep:
        sweep = [row for num_tokens in token_counts for fp8 in (False, True)
                 for row in sweep_launch(num_tokens, fp8, rank, world, device, args.iters, args.repeats)]
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "bench_dispatch_sweep.json"), "w") as f:
                json.dump({"default": dataclasses.asdict(EP_LAUNCH), "rows": sweep}, f, indent=1)
            for row in sweep:
                print(f"SWEEP {json.dumps(row)}", flush=True)
        dist.barrier()
        dist.destroy_process_group()
        return 0
    for num_tokens in [] if args.vdev_only else token_counts:
        for fp8 in (False, True):
            res = bench_kernels(num_tokens, fp8, rank, world, device, args.iters, args.repeats,
                                profile=not fp8 and num_tokens in (128, 4096))
            dtype = "fp8" if fp8 else "bf16"
            link = torch.tensor([res["dispatch_link_bytes"] + res["combine_link_bytes"]], device=device,
                                dtype=torch.float64)
            dist.all_reduce(link, op=dist.ReduceOp.MAX)
            for mode in ("eager", "graph"):
                total = res[f"{mode}_us"]
                rows.append(dict(tokens=num_tokens, path="moe_ref kernels", dtype=dtype, mode=mode, total_us=total,
                                 dispatch_us=res[f"{mode}_dispatch_us"], combine_us=res[f"{mode}_combine_us"],
                                 gbps=float(link) / (total * 1e-6) / 1e9, pool_rows=res["pool_rows"],
                                 link_bytes_per_direction=float(link), profile=res.get("profile")))
            for mode in ("eager", "graph"):
                total = res[f"{mode}_unfused_us"]
                rows.append(dict(tokens=num_tokens, path="moe_ref kernels, standalone barriers", dtype=dtype,
                                 mode=mode, total_us=total, gbps=float(link) / (total * 1e-6) / 1e9))
            if rank == 0:
                print(f"T={num_tokens} {dtype}: { {k: v for k, v in res.items() if k != 'profile'} }", flush=True)
                for prow in res.get("profile") or []:
                    print(f"   profile T={num_tokens} {dtype}: {prow}", flush=True)
        # the bytes one rank moves each way in a bf16 call (rows out + partials back), as one plain copy
        copy_bytes = next(int(r["link_bytes_per_direction"]) for r in rows
                          if r["tokens"] == num_tokens and r["dtype"] == "bf16" and "link_bytes_per_direction" in r)
        copy_us = bench_peer_copy(copy_bytes, rank, world, device, args.iters, args.repeats)
        rows.append(dict(tokens=num_tokens, path="peer copy_ (cudaMemcpyAsync pull, same bytes as bf16)", dtype="bf16",
                         mode="eager", total_us=copy_us, gbps=copy_bytes / (copy_us * 1e-6) / 1e9))
        if rank == 0:
            print(f"T={num_tokens} peer copy of {copy_bytes} bytes: {copy_us:.1f} us", flush=True)
        nccl = bench_nccl_plain(num_tokens, rank, world, device, max(5, args.iters // 2), args.repeats)
        rows.append(dict(tokens=num_tokens, path="nccl plain (argsort+a2a+tolist+index_add)", dtype="bf16",
                         mode="eager", total_us=nccl))
        if rank == 0:
            print(f"T={num_tokens} nccl plain: {nccl:.1f} us", flush=True)
    meta = dict(device=torch.cuda.get_device_name(device), world=world, torch=torch.__version__,
                triton=__import__("triton").__version__, seconds=time.perf_counter() - t_start,
                iters=args.iters, repeats=args.repeats)
    if rank == 0:
        name = "bench_dispatch_vdev" if args.vdev_only else "bench_dispatch"
        write_outputs(rows, args.out, meta, name)
        print(open(os.path.join(args.out, name + ".md")).read(), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
