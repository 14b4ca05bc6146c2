"""What the batch-invariant mode costs on one GPU (docs/batch_invariance.md): ``MegaMoE`` (one process, the ``local``
transport) default vs ``batch_invariant=True``, eager calls and CUDA-graph replays, bf16 and FP8 dispatch, at
Kimi-K2's per-rank share (48 experts, EP 8) and Step3 (48 experts), T = 1, 16, 128, 1024, 4096.

    python scripts/bench_invariant.py [--models kimi-k2/48 step3/48] [--tokens 1 16 128 1024 4096] [--out DIR]
                                      [--kernel-table 4096 ...]

Prints one markdown table, a row as each is measured (``--out``: also ``DIR/bench_invariant.md``): median us per
call (``moe_ref.bench.timing.bench_us``, L2 flushed) and invariant / default. ``--kernel-table T``: also, at those
token counts, where the time goes, the GPU time per call of each kernel in the default and the invariant layer side
by side (``moe_ref.bench.timing.kernel_table``, 10 eager calls back to back), the kernels that differ most first. Weights are random, made on the GPU
(bf16; FP8 dispatch quantizes the experts once at load). The default layer's first call of each token count may
autotune (seconds, untimed). About 2-3 minutes on one H100.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

from moe_ref import MegaMoE
from moe_ref.bench.timing import bench_us, kernel_table
from moe_ref.core.config import MoEConfig, preset
from moe_ref.core.weights import MoEWeights

DEFAULT_TOKENS = (1, 16, 128, 1024, 4096)


def model_config(name: str) -> MoEConfig:
    """``preset/E``: the preset with E experts (one rank's share)."""
    base, experts = name.split("/")
    return dataclasses.replace(preset(base), num_experts=int(experts), name=name)


def gpu_weights(cfg: MoEConfig, seed: int = 0) -> MoEWeights:
    """Random bf16 weights made on the GPU (seconds, where ``MoEWeights.random`` draws gigabytes on the CPU)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape, fan_in):
        return (torch.randn(*shape, generator=gen, device="cuda") / fan_in ** 0.5).to(torch.bfloat16)

    E, D, F, S = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.shared_intermediate_size
    shared = cfg.has_shared_experts
    return MoEWeights(
        gate_weight_ED=rand(E, D, fan_in=D), gate_up_weight_E2FD=rand(E, 2 * F, D, fan_in=D),
        down_weight_EDF=rand(E, D, F, fan_in=F),
        bias_E=0.1 * torch.rand(E, generator=gen, device="cuda") if cfg.use_selection_bias else None,
        shared_gate_up_weight_2SD=rand(2 * S, D, fan_in=D) if shared else None,
        shared_down_weight_DS=rand(D, S, fan_in=S) if shared else None)


def time_layer(moe: MegaMoE, x_TD: torch.Tensor) -> tuple[float, float]:
    """(eager us, CUDA-graph replay us) of ``moe(x_TD)``."""
    with torch.inference_mode():
        for _ in range(2):  # autotune / warm-up, untimed
            moe(x_TD)
        eager = bench_us(lambda: moe(x_TD), quick=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            moe(x_TD)
        replay = bench_us(graph.replay, quick=True)
    return eager, replay


def kernel_rows(name: str, precision: str, num_tokens: int, default: dict[str, float],
                invariant: dict[str, float], top: int = 12) -> list[str]:
    """Markdown rows of one point's kernels: us per call in the default and invariant layer (0 where a layer does
    not launch it), the ``top`` largest differences first, then the sums."""
    names = sorted(set(default) | set(invariant), key=lambda k: -abs(invariant.get(k, 0.0) - default.get(k, 0.0)))
    rows = [f"| {name} | {precision} | {num_tokens} | {kernel[:90]} | {default.get(kernel, 0.0):.1f} | "
            f"{invariant.get(kernel, 0.0):.1f} |" for kernel in names[:top]]
    rows.append(f"| {name} | {precision} | {num_tokens} | all kernels | {sum(default.values()):.1f} | "
                f"{sum(invariant.values()):.1f} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["kimi-k2/48", "step3/48"])
    parser.add_argument("--tokens", nargs="+", type=int, default=list(DEFAULT_TOKENS))
    parser.add_argument("--out", default=None, help="a folder for bench_invariant.md (also printed)")
    parser.add_argument("--kernel-table", nargs="*", type=int, default=[],
                        help="token counts (of --tokens) at which to also list each kernel's GPU time per call")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_invariant.py needs a CUDA GPU", file=sys.stderr)
        return 2
    cap = max(args.tokens)
    lines = [f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; us per call (median)\n",
             "| model | precision | T | default eager | invariant eager | ratio | default graph | invariant graph "
             "| ratio |", "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    kernel_lines = ["", "Kernels, GPU us per call (torch profiler, eager calls back to back):", "",
                    "| model | precision | T | kernel | default | invariant |", "|---|---|---|---|---:|---:|"]
    for name in args.models:
        cfg = model_config(name)
        weights = gpu_weights(cfg)
        for fp8 in (False, True):
            timings, kernels = {}, {}
            for invariant in (False, True):
                moe = MegaMoE(cfg, None, num_max_tokens_per_rank=cap, dtype=torch.bfloat16, device="cuda",
                              dispatch_fp8=fp8, eager_graph_max_tokens=0, batch_invariant=invariant)
                moe.load_weights(weights)
                for num_tokens in args.tokens:
                    x = torch.randn(num_tokens, cfg.hidden_size, device="cuda",
                                    generator=torch.Generator(device="cuda").manual_seed(num_tokens)).to(torch.bfloat16)
                    timings[invariant, num_tokens] = time_layer(moe, x)
                    if num_tokens in args.kernel_table:
                        with torch.inference_mode():
                            kernels[invariant, num_tokens] = kernel_table(lambda: moe(x))[0]
                moe.destroy()
                del moe
                torch.cuda.empty_cache()
            for num_tokens in args.tokens:
                (d_eager, d_graph), (i_eager, i_graph) = timings[False, num_tokens], timings[True, num_tokens]
                lines.append(f"| {name} | {'fp8 dispatch' if fp8 else 'bf16'} | {num_tokens} | {d_eager:.1f} | "
                             f"{i_eager:.1f} | {i_eager / d_eager:.2f}x | {d_graph:.1f} | {i_graph:.1f} | "
                             f"{i_graph / d_graph:.2f}x |")
                print(lines[-1], flush=True)
                if (False, num_tokens) in kernels:
                    rows = kernel_rows(name, "fp8 dispatch" if fp8 else "bf16", num_tokens, kernels[False, num_tokens],
                                       kernels[True, num_tokens])
                    kernel_lines += rows
                    print("\n".join(rows), flush=True)
        del weights
        torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_invariant.md"), "w") as f:
            f.write("\n".join(lines + (kernel_lines if args.kernel_table else [])) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
