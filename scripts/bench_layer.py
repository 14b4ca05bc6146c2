#!/usr/bin/env python
"""Benchmark the routed step of one EP MoE layer at Kimi-K2 shapes: 2 GPUs (torchrun, NCCL), or one GPU.

    torchrun --standalone --nproc-per-node 2 scripts/bench_layer.py --out results/gpu [--tokens 128 512 4096]
    PYTHONPATH=. python3 scripts/bench_layer.py --out results/gpu1 --num-experts 192 [--tokens 128 512 4096]

Without torchrun (no ``WORLD_SIZE`` in the environment) the script is one plain process on GPU 0: world 1, no
process group (``group=None``), so the moe_ref paths run the ``local`` transport and a2a_grouped_mm's
all_to_all_single calls become local copies; no barrier or all_gather is issued. ``--num-experts 192`` gives that
GPU the experts one rank of the 2-GPU run holds (with uniform routing, the same rows per local expert). Paths that
need 2+ ranks (deep_gemm_mega: DeepGEMM's mega-MoE shares symmetric memory between ranks) report 'not available'
with that reason.

Shapes: 384 experts (192 per rank), top-8, hidden 7168, expert intermediate 2048 (bf16 weights; the
FP8 paths quantize their copy to fp8 with 128x128 block scales once, at build). Tokens per rank: 128, 512, 4096 by default; routing is
uniform random top-8 (distinct experts), weights random, the same inputs for every path.

Paths (each built per token count with cap = that count, so no path pays for an oversized buffer):
    a2a_grouped_mm   NCCL all_to_all_single of counts, rows and local expert ids -> sort by expert ->
                     torch grouped_mm (gate||up) -> SiLU-and-mul (fp32) -> grouped_mm (down) ->
                     all_to_all_single back -> fp32 weighted index_add at the source (bf16, one row per slot)
    moe_ref_triton   moe_ref.ep.routed_step.make_modular_step (auto transport) + make_experts("triton"), bf16 end to end,
                     pool planned with the backend's segment alignment (TritonExperts: 1, no padding rows)
    moe_ref_triton_fp8  the same with dispatch_fp8=True + make_experts("triton", fp8=True): tokens move as fp8
                     e4m3 + per-128 scales and the Triton FP8 grouped MLP takes that pool as is (MegaMoE's
                     dispatch_fp8=True on CUDA)
    deep_gemm_mega   moe_ref.ep.mega_deep_gemm.make_mega_step (DeepGEMM SM90 fused fp8 mega-kernel)
    *_graph          the moe_ref path captured ONCE in a torch.cuda.CUDAGraph (the routed step under capture:
                     the symm transport's device-side kernels, no host sync), each call = copy the inputs into the
                     captured tensors + replay
    a2a_identity     a2a_grouped_mm with the expert GEMMs replaced by identity: plain NCCL dispatch + combine
                     (the anchor for dispatch + combine alone)
    moe_ref_identity the moe_ref routed step with identity experts (dispatch + combine alone, through the public
                     make_modular_step API); *_graph as above
    *_masked         the same over the masked receive pool (pool_format="masked": M = R * cap rows per local expert)
    moe_ref_deep_gemm_fp8[_masked]  the modular step with DeepGEMM experts (fp8 weights, FP8 dispatch, the pool
                     taken as is): its contiguous grouped GEMMs, or its masked GEMMs on the masked pool
DEFAULT_PATHS run by default; --paths names any of PATHS (the builders, shapes, inputs and rank helpers are
`moe_ref.bench.layer_paths` and `moe_ref.bench.ranks`).
A path that cannot be built or fails reports 'not available' with its error; the others still run.

``--replot saved.json --out DIR`` rewrites the markdown and the plot (``bench_layer.png``, with matplotlib) of a
saved run on any machine.

Timing: after warmup, per iteration a cross-rank barrier (none at world 1) + synchronize, then CUDA events around
one call; per rank the median, reported as the max over ranks (the layer is as slow as its slowest rank). Every
path's first output is compared with a2a_grouped_mm's (calc_diff). Rank 0 writes
``<out>/bench_layer.json`` and ``<out>/bench_layer.md`` (rewritten after every path, so a time-out still
leaves the finished rows). The first call of a DeepGEMM or Triton shape compiles kernels (reported as
``first_call_s``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import textwrap
import time
import traceback
from datetime import timedelta

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moe_ref.bench.layer_paths import (BUILDERS, DEFAULT_PATHS, DEFAULT_SHAPE, MIN_RANKS, PATHS,  # noqa: E402
                                       make_inputs, make_weights)
from moe_ref.bench.ranks import all_ok, barrier, finish_ranks, gather_floats, init_ranks, rank  # noqa: E402
from moe_ref.ep.distributed import group_size_and_rank  # noqa: E402
from moe_ref.testing import calc_diff  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="EP MoE layer benchmark (2 GPUs under torchrun, or one GPU as a "
                                                 "plain process)")
    parser.add_argument("--out", default="results/gpu", help="folder for bench_layer.json / bench_layer.md")
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 4096], help="tokens per rank")
    parser.add_argument("--num-experts", type=int, default=DEFAULT_SHAPE["num_experts"],
                        help="experts over all ranks (default 384); on one GPU, 192 is one rank's share of EP 2")
    parser.add_argument("--num-topk", type=int, default=DEFAULT_SHAPE["num_topk"])
    parser.add_argument("--hidden", type=int, default=DEFAULT_SHAPE["hidden"])
    parser.add_argument("--intermediate", type=int, default=DEFAULT_SHAPE["intermediate"])
    parser.add_argument("--paths", nargs="+", default=list(DEFAULT_PATHS), choices=PATHS)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--seed", type=int, default=DEFAULT_SHAPE["seed"])
    parser.add_argument("--replot", metavar="JSON", help="rewrite the markdown and PNG of a saved bench_layer.json "
                        "into --out, on any machine (no GPU, no torchrun)")
    return parser.parse_args(argv)


def time_path(fn, inputs, warmup: int, iters: int, device) -> float:
    """Median microseconds of ``fn(*inputs)`` on this rank, each iteration started after a barrier."""
    for _ in range(warmup):
        fn(*inputs)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*inputs)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def run_path(name, args, cfg, group, num_tokens, local_weights, inputs, reference, device) -> tuple[dict, object]:
    """Build, check and time one path; every rank returns the same status."""
    row = {"path": name, "tokens_per_rank": num_tokens}
    world = group_size_and_rank(group)[0]
    min_ranks, why = MIN_RANKS.get(name, (1, ""))
    if world < min_ranks:  # the same on every rank: nothing to agree on
        row.update(status="not available", error=f"needs {min_ranks}+ ranks, this run has {world}: {why}")
        return row, None
    output, cleanup, error = None, None, None
    start = time.perf_counter()
    try:
        fn, cleanup = BUILDERS[name](args, cfg, group, num_tokens, local_weights, device)
        row["build_s"] = round(time.perf_counter() - start, 2)
        start = time.perf_counter()
        output = fn(*inputs)
        torch.cuda.synchronize()
        row["first_call_s"] = round(time.perf_counter() - start, 2)
    except Exception as err:  # noqa: BLE001 - a broken path is reported, the bench goes on
        error = f"{type(err).__name__}: {err}"
        print(f"[rank {rank()}] {name} at {num_tokens} tokens failed:\n{traceback.format_exc()}", flush=True)
    if not all_ok(error is None, device):
        row.update(status="not available", error=error or "failed on another rank")
        if cleanup is not None:
            try:
                cleanup()
            except Exception:  # noqa: BLE001
                pass
        return row, None
    diffs = gather_floats(calc_diff(output, reference) if reference is not None else float("nan"), device)
    us = time_path(fn, inputs, args.warmup, args.iters, device)
    per_rank = gather_floats(us, device)
    flops = 2 * 3 * args.hidden * args.intermediate * num_tokens * args.num_topk  # per rank, every slot live
    row.update(status="ok", us=max(per_rank), us_per_rank=per_rank, calc_diff_vs_a2a=max(diffs),
               tflops_per_rank=flops / (max(per_rank) * 1e-6) / 1e12)
    cleanup()
    return row, output


def write_results(out_dir: str, meta: dict, rows: list[dict]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench_layer.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    # identity paths are compared with the NCCL identity anchor, the others with a2a_grouped_mm
    base = {(r["tokens_per_rank"], "identity" in r["path"]): r["us"] for r in rows
            if r["path"] in ("a2a_grouped_mm", "a2a_identity") and r.get("status") == "ok"}
    lines = [f"# EP layer routed step, {meta['ranks']} rank(s): {meta['shape']}", "",
             "| tokens/rank | path | us (max over ranks) | us per rank | TFLOP/s per rank | x vs its a2a anchor | calc_diff vs anchor "
             "| first call s | status |",
             "|---:|---|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r['tokens_per_rank']} | {r['path']} | - | - | - | - | - | - | not available: "
                         f"{str(r.get('error', ''))[:160].replace('|', '/')} |")
            continue
        speedup = base.get((r["tokens_per_rank"], "identity" in r["path"]), float("nan")) / r["us"]
        lines.append(f"| {r['tokens_per_rank']} | {r['path']} | {r['us']:.1f} | "
                     f"{' / '.join(f'{u:.1f}' for u in r['us_per_rank'])} | {r['tflops_per_rank']:.1f} | "
                     f"{speedup:.2f} | {r['calc_diff_vs_a2a']:.2e} | {r.get('first_call_s', '-')} | ok |")
    with open(os.path.join(out_dir, "bench_layer.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot_results(out_dir, meta, rows)


def plot_results(out_dir: str, meta: dict, rows: list[dict]) -> None:
    """``bench_layer.png``: us per call of every path that ran, one group of bars per token count (log scale);
    skipped without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    done = [r for r in rows if r.get("status") == "ok"]
    tokens = sorted({r["tokens_per_rank"] for r in done})
    paths = list(dict.fromkeys(r["path"] for r in done))
    if not done:
        return
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(tokens) * len(paths) / 3), 5))
    width = 0.8 / len(paths)
    for i, path in enumerate(paths):
        us = {r["tokens_per_rank"]: r["us"] for r in done if r["path"] == path}
        ax.bar([t + i * width for t in range(len(tokens))], [us.get(t, 0) for t in tokens], width, label=path)
    ax.set_xticks([t + 0.4 - width / 2 for t in range(len(tokens))], [str(t) for t in tokens])
    ax.set_yscale("log")
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("us per routed step (max over ranks)")
    ax.set_title(textwrap.fill(f"EP routed step, {meta['ranks']} rank(s): {meta['shape']}", 90), fontsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(os.path.join(out_dir, "bench_layer.png"), dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replot:
        saved = json.load(open(args.replot))
        write_results(args.out, saved["meta"], saved["rows"])
        return 0
    device, group, rank, world, cfg = init_ranks(args, "bench-layer", timedelta(minutes=10))
    num_local = args.num_experts // world
    meta = {"ranks": world, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "python": platform.python_version(),
            "shape": f"{args.num_experts} experts ({num_local}/rank), top-{args.num_topk}, hidden {args.hidden}, "
                     f"intermediate {args.intermediate}, bf16 (moe_ref_triton_fp8, deep_gemm_mega: fp8)",
            "timing": f"median of {args.iters} after {args.warmup} warmup, "
                      + ("barrier before each, max over ranks" if world > 1 else "one process, no barrier")}
    try:
        from moe_ref.experts.deep_gemm.probe import deep_gemm_status

        meta["deep_gemm"] = deep_gemm_status().__dict__
    except Exception as err:  # noqa: BLE001
        meta["deep_gemm"] = f"{type(err).__name__}: {err}"
    if rank == 0:
        print(f"bench_layer: {meta}", flush=True)
    t0 = time.perf_counter()
    local_weights = make_weights(args, rank, num_local, device)
    if rank == 0:
        print(f"weights ready in {time.perf_counter() - t0:.1f} s", flush=True)
    rows: list[dict] = []
    for num_tokens in args.tokens:
        inputs = make_inputs(args, rank, num_tokens, device)
        reference = identity_reference = None
        for name in args.paths:
            t0 = time.perf_counter()
            expected = identity_reference if "identity" in name else reference
            row, output = run_path(name, args, cfg, group, num_tokens, local_weights, inputs, expected, device)
            if name == "a2a_grouped_mm" and output is not None:
                reference = output
            if name == "a2a_identity" and output is not None:
                identity_reference = output
            rows.append(row)
            if rank == 0:
                print(f"RESULT {json.dumps(row)} ({time.perf_counter() - t0:.1f} s)", flush=True)
                write_results(args.out, meta, rows)
            torch.cuda.empty_cache()
    if rank == 0:
        print(open(os.path.join(args.out, "bench_layer.md")).read(), flush=True)
    finish_ranks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
