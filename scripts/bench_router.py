#!/usr/bin/env python
"""The router's gate GEMM on one GPU: moe_ref's Triton kernel against the fp32 torch GEMM it replaced, same run.

    PYTHONPATH=. python3 scripts/bench_router.py --out results/router [--tokens 1 16 128 1024 4096 32768]

Rows per (router, T), us per call (moe_ref.testing.bench with host_ahead: GPU time, calls queued back to back, L2
flushed), eagerly and replayed from a CUDA graph of the same call:
- ``triton``: ``moe_ref.kernels.router_logits`` (bf16 operands as stored, fp32 sums, one launch);
- ``torch fp32``: ``router_logits_ref``, ``F.linear(x.float(), w.float())`` (the path before: both casts, an fp32
  GEMM, cuBLAS's split-K reduce);
- ``torch bf16`` (anchor): ``x @ w.t()`` in bf16 (cuBLAS, bf16 out: the tensor cores' speed on these bytes);
- ``cublas fp32 out``: ``torch.mm(x, w.t(), out_dtype=torch.float32)`` (cuBLAS on the bf16 operands, fp32 sums and
  output: the same numerics as the Triton kernel, from the library; absent where torch lacks ``mm.dtype``).
Also per row: the weight bytes read per us (decode is bound by the E x D weight) and the largest |triton - fp32|
and |cublas fp32 out - fp32|.
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


def cublas_fp32_out(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(x, w.t(), out_dtype=torch.float32)


def paths(x: torch.Tensor, w: torch.Tensor) -> dict:
    out = {"triton": lambda: router_logits(x, w), "torch fp32": lambda: router_logits_ref(x, w),
           "torch bf16 (anchor)": lambda: x @ w.t()}
    try:
        cublas_fp32_out(x, w)
        out["cublas fp32 out"] = lambda: cublas_fp32_out(x, w)
    except (RuntimeError, TypeError) as error:  # a torch without mm.dtype
        print(f"cublas fp32 out: skipped ({type(error).__name__}: {str(error)[:120]})", flush=True)
    return out


def markdown(results: dict) -> str:
    meta = results["meta"]
    lines = [f"# Router gate GEMM ({meta['device']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']})",
             "", f"`{meta['command']}`", "", "us per call, eager / replayed from a CUDA graph; GB/s of the bf16 weight "
             "read per us (eager).", "",
             "| router | T | triton | torch fp32 | torch bf16 (anchor) | cublas fp32 out | triton weight GB/s "
             "| fp32 / triton (graph) | max abs diff vs fp32: triton, cublas fp32 out |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in results["rows"]:
        us = row["us"]
        cells = [f"{us[name][0]:.1f} / {us[name][1]:.1f}" if name in us else "-"
                 for name in ("triton", "torch fp32", "torch bf16 (anchor)", "cublas fp32 out")]
        cublas_diff = row.get("cublas_max_abs_diff_vs_fp32")
        lines.append(f"| {row['router']} | {row['tokens']} | {' | '.join(cells)} | {row['triton_weight_gbps']:.0f} | "
                     f"{us['torch fp32'][1] / us['triton'][1]:.2f} | {row['max_abs_diff_vs_fp32']:.2e}, "
                     f"{'-' if cublas_diff is None else f'{cublas_diff:.2e}'} |")
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
            ref = router_logits_ref(x, w)
            diff = (router_logits(x, w) - ref).abs().max().item()
            row = dict(router=router, tokens=num_tokens, experts=num_experts, us=us, max_abs_diff_vs_fp32=diff,
                       triton_weight_gbps=w.nbytes / us["triton"][0] / 1e3)
            if "cublas fp32 out" in us:
                row["cublas_max_abs_diff_vs_fp32"] = (cublas_fp32_out(x, w) - ref).abs().max().item()
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
