#!/usr/bin/env python
"""Where one call of the EP routed step spends its time, through the public API (2 GPUs under torchrun, or one GPU).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=. \
        python3 -m torch.distributed.run --standalone --nproc-per-node 2 scripts/profile_step.py --out results/prof
    PYTHONPATH=. python3 scripts/profile_step.py --out results/prof1 --num-experts 192

Without torchrun (no ``WORLD_SIZE``) it is one plain process on GPU 0 (world 1, ``group=None``: the ``local``
transport, no barriers); ``--num-experts 192`` holds the experts of one rank of the 2-GPU run.
The paths are bench_layer's (its builders, shapes and inputs: `moe_ref.bench.layer_paths`). For each path and
tokens/rank, on rank 0 (under torchrun the other ranks run the same calls, unprofiled, since every call is
collective):
- ``host_us`` (eager host): wall time per eager call until Python returns, over ``--calls`` back-to-back calls, and
  ``wall_us`` (eager wall) until the GPU is done too: when the two are close the call is host bound; the same two
  for the graph replay (``graph_host_us``, ``graph_wall_us``).
- runtime calls per eager call (torch profiler): kernel launches, stream/device synchronizations, device-to-host
  copies, NCCL kernels; and the GPU kernels of one eager call, summed.
- a cProfile of the eager calls (``cprofile_<path>_<T>.txt``, cumulative time): which Python functions the host time
  goes to, with their callers (on the GPU image, Python 3.12, the routed step's outer frames were missing from the
  listing while the functions under them were complete; on the CPU machine, 3.11, they show); and the torch operators of 5 eager calls by CPU time (``torch_ops_<path>_<T>.txt``).
- the CUDA-graph replay: GPU time of each kernel and the span from the first kernel's start to the last one's end
  (the gaps between them are launch latency inside the graph and waits on the peer).
Writes ``profile_step.json`` and ``profile_step.md`` under ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moe_ref.bench import ranks  # noqa: E402
from moe_ref.bench.layer_paths import (BUILDERS, DEFAULT_SHAPE, PATHS, graphed_step, make_inputs,  # noqa: E402
                                       make_weights)
from moe_ref.bench.timing import RUNTIME_KINDS, cprofile_text, host_and_wall_us  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="results/prof")
    parser.add_argument("--tokens", type=int, nargs="+", default=[128])
    parser.add_argument("--paths", nargs="+", default=["moe_ref_identity", "moe_ref_triton", "moe_ref_triton_fp8"],
                        choices=[p for p in PATHS if p.startswith("moe_ref") and not p.endswith("_graph")])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--num-experts", type=int, default=None,
                        help="experts over all ranks: bench_layer's by default (384); e.g. 192 on one GPU for EP 2's "
                             "experts per rank")
    args = parser.parse_args(argv)
    # bench_layer's shape and seed
    for name, value in DEFAULT_SHAPE.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    return args


def torch_profile(fn, inputs, calls: int, rank: int):
    """Torch profiler (CPU + CUDA) over ``calls`` calls on rank 0; None on the others."""
    from torch.profiler import ProfilerActivity, profile

    ranks.barrier()
    torch.cuda.synchronize()
    if rank != 0:
        for _ in range(calls):
            fn(*inputs)
        torch.cuda.synchronize()
        return None
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(*inputs)
        torch.cuda.synchronize()
    return prof


def runtime_counts(prof, calls: int) -> dict:
    counts = {kind: 0 for kind in RUNTIME_KINDS}
    nccl = 0
    for event in prof.events():
        for kind, names in RUNTIME_KINDS.items():
            if event.name in names:
                counts[kind] += 1
        if event.device_type == torch.autograd.DeviceType.CUDA and event.name.startswith("nccl"):
            nccl += 1
    counts["nccl kernels"] = nccl
    return {kind: round(n / calls, 1) for kind, n in counts.items()}


def kernel_table(prof, calls: int) -> list[dict]:
    """GPU kernels, summed per name, per call (us), longest first."""
    per_name: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_name.setdefault(event.name, []).append(event.time_range.elapsed_us())
    rows = [dict(kernel=name[:90], count_per_call=len(t) / calls, us_per_call=sum(t) / calls)
            for name, t in per_name.items()]
    return sorted(rows, key=lambda r: -r["us_per_call"])


def gpu_span_us(prof, calls: int) -> float:
    """First kernel start to last kernel end, per call (the calls run back to back)."""
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA]
    return (max(end for _, end in spans) - min(start for start, _ in spans)) / calls if spans else 0.0


def profile_path(name: str, args, cfg, group, num_tokens: int, weights, device) -> dict:
    rank = ranks.rank()
    inputs = make_inputs(args, rank, num_tokens, device)
    fn, cleanup = BUILDERS[name](args, cfg, group, num_tokens, weights, device)
    for _ in range(3):  # compile and autotune outside the measurements
        fn(*inputs)
    torch.cuda.synchronize()
    row: dict = {"path": name, "tokens_per_rank": num_tokens}
    row["host_us"], row["wall_us"] = host_and_wall_us(fn, inputs, args.calls)
    text = cprofile_text(fn, inputs, args.calls, rank)
    if rank == 0:
        with open(os.path.join(args.out, f"cprofile_{name}_{num_tokens}.txt"), "w") as f:
            f.write(text)
    prof = torch_profile(fn, inputs, 5, rank)
    if prof is not None:
        with open(os.path.join(args.out, f"torch_ops_{name}_{num_tokens}.txt"), "w") as f:
            f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=60))
        row["per_eager_call"] = runtime_counts(prof, 5)
        row["eager_kernels"] = kernel_table(prof, 5)
        row["eager_gpu_busy_us"] = sum(r["us_per_call"] for r in row["eager_kernels"])
    cleanup()
    torch.cuda.synchronize()
    build = graphed_step(BUILDERS[name])
    replay, cleanup = build(args, cfg, group, num_tokens, weights, device)
    for _ in range(3):
        replay(*inputs)
    row["graph_host_us"], row["graph_wall_us"] = host_and_wall_us(replay, inputs, args.calls)
    prof = torch_profile(replay, inputs, 5, rank)
    if prof is not None:
        row["graph_kernels"] = kernel_table(prof, 5)
        row["graph_span_us"] = gpu_span_us(prof, 5)
        row["graph_gpu_busy_us"] = sum(r["us_per_call"] for r in row["graph_kernels"])
    cleanup()
    torch.cuda.synchronize()
    ranks.barrier()
    return row


def write_markdown(rows: list[dict], meta: dict, path: str) -> None:
    """``profile_step.md``: one summary line per tokens/rank and path (eager wall, eager host, graph, launches and
    syncs per call first), then the kernels of each."""
    def num(value, fmt: str = ".0f") -> str:
        return "-" if value is None else format(value, fmt)

    lines = [f"# Routed step profile, {meta['ranks']} rank(s), rank 0 ({meta['device']}, torch {meta['torch']}, "
             f"{meta['calls']} calls)", "",
             "Per call: eager wall = back-to-back eager calls until the GPU is done, eager host = until Python "
             "returns (close to wall: host bound); graph = the CUDA-graph replay (inputs copied in), wall; "
             "launches, syncs, memcpy and NCCL kernels per eager call (torch profiler); GPU busy = the kernels' "
             "summed time, graph span = first kernel start to last kernel end.", "",
             "| tokens/rank | path | eager wall us | eager host us | graph us | launches | syncs | memcpy | "
             "NCCL kernels | eager GPU busy us | graph GPU span us | graph GPU busy us |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: r["tokens_per_rank"]):  # stable: paths in run order per T
        c = r.get("per_eager_call", {})
        lines.append(f"| {r['tokens_per_rank']} | {r['path']} | {num(r.get('wall_us'))} | {num(r.get('host_us'))} | "
                     f"{num(r.get('graph_wall_us'))} | {c.get('kernel launches', '-')} | {c.get('synchronizations', '-')} | "
                     f"{c.get('copies (memcpy)', '-')} | {c.get('nccl kernels', '-')} | "
                     f"{num(r.get('eager_gpu_busy_us'))} | {num(r.get('graph_span_us'), '.1f')} | "
                     f"{num(r.get('graph_gpu_busy_us'), '.1f')} |")
    for r in rows:
        for kind in ("eager_kernels", "graph_kernels"):
            lines += ["", f"## {r['path']}, {r['tokens_per_rank']} tokens/rank: {kind.replace('_', ' ')} (per call)", "",
                      "| kernel | count | us |", "|---|---:|---:|"]
            lines += [f"| `{k['kernel']}` | {k['count_per_call']:.1f} | {k['us_per_call']:.1f} |"
                      for k in r.get(kind, [])[:14]]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    device, group, rank, world, cfg = ranks.init_ranks(args, "profile-step", timedelta(minutes=5))
    os.makedirs(args.out, exist_ok=True)
    weights = make_weights(args, rank, args.num_experts // world, device)
    meta = {"ranks": world, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "calls": args.calls}
    rows = []
    for num_tokens in args.tokens:
        for name in args.paths:
            row = profile_path(name, args, cfg, group, num_tokens, weights, device)
            rows.append(row)
            if rank == 0:
                brief = {k: v for k, v in row.items() if not k.endswith("kernels")}
                print(f"PROFILE {json.dumps(brief)}", flush=True)
                with open(os.path.join(args.out, "profile_step.json"), "w") as f:
                    json.dump({"meta": meta, "rows": rows}, f, indent=1)
                write_markdown(rows, meta, os.path.join(args.out, "profile_step.md"))
    ranks.finish_ranks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
