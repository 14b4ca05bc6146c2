#!/usr/bin/env python
"""The router's gate GEMM on one GPU: moe_ref's (cuBLAS, fp32 output) against the fp32 torch GEMM it replaced.

    PYTHONPATH=. python3 scripts/bench_router.py --out results/router [--tokens 1 16 128 1024 4096 32768]

Rows per (router, T), us per call (moe_ref.testing.bench with host_ahead: GPU time, calls queued back to back, L2
flushed), eagerly and replayed from a CUDA graph of the same call:
- ``moe_ref``: ``moe_ref.kernels.router.router_logits``, what the layer runs (``torch.mm(x, w.t(), out_dtype=torch.float32)``:
  cuBLAS on the bf16 operands as stored, fp32 sums and output, one launch);
- ``torch fp32``: ``router_logits_ref``, ``F.linear(x.float(), w.float())`` (the path before: both casts, an fp32
  GEMM, cuBLAS's split-K reduce);
- ``torch bf16`` (anchor): ``x @ w.t()`` in bf16 (cuBLAS, bf16 out: the tensor cores' speed on these bytes).
Also per row: the weight bytes read per us (decode is bound by the E x D weight) and the largest |moe_ref - fp32|.
(docs/results/bench_router_h200_2026-12-02.* is this script's earlier version, which also timed a Triton kernel of
moe_ref's own: cuBLAS beat it at every T, and replaced it.)
Routers: Kimi-K2 (E 384) and DeepSeek-V3 (E 256), D 7168. Writes router.json, router.md and router.png.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moe_ref.kernels import router_logits, router_logits_ref  # noqa: E402
from moe_ref.testing import bench, graphed  # noqa: E402

ROUTERS = {"kimi-k2": 384, "deepseek-v3": 256}
HIDDEN = 7168


def paths(x: torch.Tensor, w: torch.Tensor) -> dict:
    return {"moe_ref": lambda: router_logits(x, w), "torch fp32": lambda: router_logits_ref(x, w),
            "torch bf16 (anchor)": lambda: x @ w.t()}


def markdown(results: dict) -> str:
    meta = results["meta"]
    lines = [f"# Router gate GEMM ({meta['device']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']})",
             "", f"`{meta['command']}`", "", "us per call, eager / replayed from a CUDA graph; GB/s of the bf16 weight "
             "read per us (eager).", "",
             "| router | T | moe_ref | torch fp32 | torch bf16 (anchor) | moe_ref weight GB/s | fp32 / moe_ref (graph) "
             "| max abs diff vs fp32 |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in results["rows"]:
        us = row["us"]
        cells = [f"{us[name][0]:.1f} / {us[name][1]:.1f}" for name in ("moe_ref", "torch fp32", "torch bf16 (anchor)")]
        lines.append(f"| {row['router']} | {row['tokens']} | {' | '.join(cells)} | {row['weight_gbps']:.0f} | "
                     f"{us['torch fp32'][1] / us['moe_ref'][1]:.2f} | {row['max_abs_diff_vs_fp32']:.2e} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: str) -> None:
    """us per call in a graph against T, one panel per router (skipped when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    routers = list(dict.fromkeys(row["router"] for row in results["rows"]))
    fig, axes = plt.subplots(1, len(routers), figsize=(5 * len(routers), 4), squeeze=False)
    for ax, router in zip(axes[0], routers):
        rows = [row for row in results["rows"] if row["router"] == router]
        for name in rows[0]["us"]:
            ax.plot([r["tokens"] for r in rows], [r["us"][name][1] for r in rows], marker="o", label=name)
        ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="us per call (CUDA graph)", title=router)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="results/router")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 1024, 4096, 32768])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_router: needs a CUDA GPU", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for router, num_experts in ROUTERS.items():
        w = (torch.randn(num_experts, HIDDEN, device="cuda", generator=gen) / HIDDEN ** 0.5).bfloat16()
        for num_tokens in args.tokens:
            x = torch.randn(num_tokens, HIDDEN, device="cuda", generator=gen).bfloat16()
            us = {name: (bench(fn, host_ahead=True), bench(graphed(fn), host_ahead=True))
                  for name, fn in paths(x, w).items()}
            diff = (router_logits(x, w) - router_logits_ref(x, w)).abs().max().item()
            row = dict(router=router, tokens=num_tokens, experts=num_experts, us=us, max_abs_diff_vs_fp32=diff,
                       weight_gbps=w.nbytes / us["moe_ref"][0] / 1e3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
            "command": "python3 scripts/bench_router.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    results = {"meta": meta, "rows": rows}
    with open(os.path.join(args.out, "router.json"), "w") as f:
        json.dump(results, f, indent=1)
    text = markdown(results)
    with open(os.path.join(args.out, "router.md"), "w") as f:
        f.write(text)
    plot(results, os.path.join(args.out, "router.png"))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
