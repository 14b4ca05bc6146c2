#!/usr/bin/env python
"""Benchmark the expert MLP backends on one GPU at per-rank EP8 shapes (needs CUDA).

    python scripts/bench_experts.py [--quick] [--out results/bench_experts.json] [--include-deep-gemm]
                                    [--peer-search {none,small,full}] [--peer-wheel .whl/sglang-0.5.23-....whl ...]

Shapes (per rank at EP8): Kimi-K2 48 local experts, D 7168, F 2048 (top-8); Step3 48 experts, D 7168,
F 5120 (top-3). Routed rows 64 / 512 / 4096 / 32768 spread randomly (multinomial, uniform) over the
experts; the 128-aligned pool (DeepGEMM's, the peers', grouped_mlp's) puts each expert segment at a 128-aligned row,
the API rows get the pool of their backend's segment alignment, the torch baselines the same rows packed.

The cases, rows, timers and report are `moe_ref.bench` (cases, expert_rows, timing, expert_report).

Paths per case (every JSON row carries `label`: what it times, `timing`: how, `tuned`, and for a peer `config`):
    api_triton_bf16 / api_triton_fp8  moe_ref through the public API: make_experts("triton"[, fp8=True]) called on
                    the pool the layer builds for that backend (segments aligned to
                    experts_class("triton").segment_alignment, i.e. 1: no padding rows) with the static rows hint
                    of the device-side dispatch (ExpertLayout.num_rows_hint); fp8: the FP8 pool as dispatched
    api_triton_bf16_nohint / api_triton_fp8_nohint  the same without the hint (the backend reads the row count:
                    a host sync per call)
    api_deep_gemm_{bf16,fp8}[_nohint]  with --include-deep-gemm where deep_gemm runs: make_experts("deep_gemm"[,
                    fp8=True]) the same way, on its own pool (128-aligned segments): the whole MLP as the layer runs it
    api_auto_{bf16,fp8}[_nohint]  the same with make_experts("auto"): the backend moe_ref/experts/auto_table.json
                    picks for the call's regime, on the pool auto plans (the layer's default backend)
    graph_api_*     with --graph: an api_ row (rows hint) captured once in a CUDA graph and replayed (GPU work only,
                    as a layer's replayed eager call and a captured decode step run it)
    triton_bf16 / triton_fp8  moe_ref.kernels.experts.grouped_mlp direct on the 128-aligned pool
    grouped_mm_bf16 torch grouped GEMM (offs = cumulative ends, w.transpose(-2, -1)) + torch SiLU-and-mul
    loop_bf16       torch per-expert loop (host-side counts, no sync inside the timed region)
    deep_gemm_*     optional (--include-deep-gemm; none unless `deep_gemm` runs here), on the 128-aligned pool,
                    `moe_ref.experts.deep_gemm.bench`:
      deep_gemm_{bf16,fp8}, deep_gemm_masked_{bf16,fp8}  "whole MLP": GEMM1, activation (+ per-128 FP8
                    quantization of h), GEMM2; fp8 from the FP8 pool as dispatched; masked: the pool's segments
                    copied once, outside the timed region, into [e, M, D] (left out, with a note, when the masked
                    API is missing)
      deep_gemm_kernels_{bf16,fp8}, deep_gemm_masked_kernels_{bf16,fp8}  "kernels only", as DeepGEMM's tests call
                    them: the two grouped GEMMs on inputs quantized once outside the timed region (x and h, their
                    scales laid out once with deep_gemm.get_mn_major_tma_aligned_tensor); timed by the profiler
                    (GPU kernel time, L2 flushed by a fill whose kernel is not counted)
    peer_<engine>_{bf16,fp8}  the Triton fused-MoE kernels SGLang and vLLM ship (`moe_ref.bench.peers`: read out of
                    the files given by --peer-wheel, repeatable, default every peer file in .whl/: the SGLang wheel
                    and the vLLM fused-moe zip, `make peers`; rows left out with a note when there is none) on our
                    pool "as shipped": the engine's tuned H200 config for (E, F) or, where the wheel has none, its
                    default rule (the rows of before; `--peer-search none` gives only these)
    peer_<engine>_tuned_{bf16,fp8}  the same kernels "tuned": the fastest config of the engine's OWN tuner space
                    for the exact shape (SGLang tuning_fused_moe_triton.py, vLLM benchmark_moe.py; reproduced and
                    cited in moe_ref.bench.peers.search, `tuner_space`), one config for both GEMMs as both tuners
                    time it, pruned to what can run (`pruned_space`: shared memory, vLLM FP8 BLOCK_SIZE_K duplicates).
                    --peer-search small (default): <= 50 configs per engine, dtype and shape, in two stages
                    (`peers.search_config`); full: every runnable config (1248 for bf16; hours). Each config is
                    checked against our twin and timed briefly; search time is excluded from every row (it is in
                    results["peer"]["searches"]); the winner is then timed like every other row.
    Peer routing inputs (sorted_token_ids, expert_ids) are built once outside the timed region: a peer's timing
    excludes its align step, as ours excludes the dispatch.
    Every peer_* and deep_gemm_* row is checked once per case against our twin (calc_diff, the limits of the small
    check) on its first call, before timing; a row that fails is left out with the reason.

The JSON's env records torch, triton, the peer files (wheel / fused-moe zip names: their versions), the deep_gemm
version and the peer search mode.

On one H200 (from the repository root, `make peers` run beforehand here: .whl/ travels with the tree):
    python scripts/peer_moe.py --check
    python scripts/bench_experts.py --quick --peer-search small --out results/bench_experts_quick.json
    python scripts/bench_experts.py --include-deep-gemm --peer-search small --models kimi-k2 \
        --out results/bench_experts_kimi.json
    python scripts/bench_experts.py --include-deep-gemm --peer-search small --models step3 \
        --out results/bench_experts_step3.json
(`--peer-search full --models kimi-k2 --rows 32768` for one exhaustive point; `--peer-search none` for the rows of
before.)

Also measured in the same run: HBM bandwidth (a 2 GiB device-to-device copy, read + write bytes) and the
bf16 GEMM peak (torch.matmul 8192^3). Per case: us | TFLOP/s | weight GB/s | x vs grouped_mm |
fraction of roofline, where roofline time = max(bytes moved / HBM bandwidth, FLOPs / peak) with bytes =
weights of the experts that got rows + activations (x, h written and read, y), and peak = the measured
bf16 peak (x2 for fp8, an estimate). Writes JSON, a markdown table and (if matplotlib imports) a PNG.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moe_ref.bench.cases import MODELS, QUICK_ROWS, ROWS, make_case, make_weights  # noqa: E402
from moe_ref.bench.expert_report import make_row, markdown, plot, versions  # noqa: E402
from moe_ref.bench.expert_rows import (case_paths, check_correctness, checked_first_call, load_peers,  # noqa: E402
                                       peer_paths_logged, selected, time_path)
from moe_ref.bench.timing import kernel_table, measure_anchors, time_rounds  # noqa: E402
from moe_ref.testing import graphed  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="kimi-k2 only, rows 64 and 4096, short timing")
    parser.add_argument("--out", default="results/bench_experts.json")
    parser.add_argument("--models", default=None, help=f"comma list of {sorted(MODELS)}")
    parser.add_argument("--rows", default=None, help="comma list of routed row counts")
    parser.add_argument("--no-fp8", action="store_true")
    parser.add_argument("--include-deep-gemm", action="store_true")
    parser.add_argument("--peer-wheel", action="append", default=None,
                        help="an engine's wheel or fused-moe zip to read a peer kernel from, repeatable (default: "
                             "every peer file in .whl/, one per engine)")
    parser.add_argument("--peer-search", choices=("none", "small", "full"), default="small",
                        help="also time each peer with the fastest config of its own tuner's space for the exact "
                             "shape: small (<= 50 configs per engine, dtype and shape: minutes), full (every "
                             "runnable config: hours), none (as shipped only, the rows of before)")
    parser.add_argument("--paths", default=None,
                        help="comma list of the rows to time, by name or name prefix (e.g. api_,deep_gemm_kernels_); "
                             "default: every row")
    parser.add_argument("--graph", action="store_true",
                        help="also time each api_ row with the rows hint captured in a CUDA graph (`graph_<row>`: "
                             "its GPU work without the host's, as a layer's replayed eager call runs it)")
    parser.add_argument("--kernel-table", action="store_true",
                        help="also record each timed row's GPU kernels, their us per call, the GPU span and the "
                             "CUDA runtime calls per call (torch profiler)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1,
                        help="time every path this many times, every other round in reverse order, and keep each "
                             "path's fastest (the JSON keeps every round): no path gains from its place in the run")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: time each path at least once")
    if not torch.cuda.is_available():
        print("bench_experts needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    models = args.models.split(",") if args.models else (["kimi-k2"] if args.quick else list(MODELS))
    row_counts = [int(r) for r in args.rows.split(",")] if args.rows else (QUICK_ROWS if args.quick else ROWS)
    with_fp8 = not args.no_fp8
    results = {"env": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                       "python": platform.python_version(), "quick": args.quick}, "cases": []}

    print("correctness check (small case) ...", flush=True)
    failures = check_correctness(args.include_deep_gemm)
    results["correctness_failures"] = failures
    peers, loaded = load_peers(args.peer_wheel)
    print("\n".join(loaded), flush=True)
    results["peer"] = {"loaded": loaded, "configs": [], "notes": [], "searches": []}
    results["env"].update(versions(peers), peer_search=args.peer_search)
    peer_labels = {peer.engine.name: peer.label for peer in peers}
    print("measuring anchors ...", flush=True)
    anchors = measure_anchors(args.quick)
    results["anchors"] = anchors
    print(f"  HBM {anchors['hbm_bytes_per_s'] / 1e12:.2f} TB/s, bf16 peak {anchors['bf16_flops_per_s'] / 1e12:.0f} "
          "TFLOP/s", flush=True)

    for model in models:
        torch.manual_seed(args.seed)
        num_experts, hidden, inter, _ = MODELS[model]
        weights = make_weights(num_experts, hidden, inter, with_fp8)
        for num_rows in row_counts:
            case = make_case(model, num_rows, weights, args.seed, with_fp8)
            timings, twins = {}, {}
            peer_paths = [path for peer in peers for path in peer_paths_logged(case, peer, results["peer"],
                                                                                args.peer_search, args.quick)]
            configs = {name: config for name, _, config in peer_paths}
            paths = case_paths(case, args.include_deep_gemm) + [(name, fn) for name, fn, _ in peer_paths]
            if args.graph:
                paths += [(f"graph_{name}", graphed(fn)) for name, fn in paths
                          if name.startswith("api_") and not name.endswith("_nohint") and selected(name, args.paths)]
            ready = []  # (name, fn) of the selected paths whose first call ran (compiled, tuned, checked)
            for name, fn in paths:
                if not selected(name.removeprefix("graph_"), args.paths):
                    continue
                if name.startswith(("peer_", "deep_gemm_")):  # a failing anchor leaves its row out, not the run
                    _, problem = checked_first_call(case, name, fn, twins)
                else:
                    fn()  # compile + autotune outside the timed region
                    problem = None
                torch.cuda.synchronize()
                if problem:
                    print(f"  {model:8s} rows={num_rows:6d} {name:22s} left out: {problem}", flush=True)
                    results["peer"]["notes"].append(f"{model} rows {num_rows} {name} left out: {problem}")
                    continue
                ready.append((name, fn))
            per_round, timing_of = time_rounds(ready, args.rounds, functools.partial(time_path, quick=args.quick))
            for name, fn in ready:
                us = timings[name] = min(per_round[name])
                row = make_row(case, name, us, anchors, config=configs.get(name), search=args.peer_search,
                               peer_labels=peer_labels, timing=timing_of[name])
                row["us_per_round"] = per_round[name]
                if args.kernel_table:
                    row["kernel_us"], row["gpu_span_us"], row["runtime_calls"] = kernel_table(fn)
                    for kernel, kernel_us in list(row["kernel_us"].items())[:8]:
                        print(f"      {kernel_us:9.1f} us  {kernel[:110]}", flush=True)
                    print(f"      kernels {sum(row['kernel_us'].values()):.1f} us in a GPU span of "
                          f"{row['gpu_span_us']:.1f} us per call; runtime calls per call (count, host us): "
                          + ", ".join(f"{name} {n:g} {us:.0f}" for name, (n, us) in row["runtime_calls"].items()),
                          flush=True)
                results["cases"].append(row)
                rounds = " / ".join(f"{r:.1f}" for r in per_round[name])
                print(f"  {model:8s} rows={num_rows:6d} {name:22s} {us:10.1f} us {row['tflops']:7.1f} TFLOP/s "
                      f"{row['weight_gbps']:7.0f} GB/s roofline {row['roofline_fraction']:.2f} (rounds {rounds})",
                      flush=True)
            for row in results["cases"]:
                if row["model"] == model and row["num_rows"] == num_rows and "grouped_mm_bf16" in timings:
                    row["x_vs_grouped_mm"] = timings["grouped_mm_bf16"] / row["us"]
            _write(results, args.out)
            del case, twins, peer_paths, ready
            torch.cuda.empty_cache()
        del weights
        torch.cuda.empty_cache()

    try:
        from moe_ref.kernels.experts.grouped_mlp import autotuned_kernel

        results["autotune_choices"] = {str(k): str(v) for k, v in autotuned_kernel().cache.items()}
    except Exception as exc:  # informational only
        results["autotune_choices"] = f"unavailable: {exc!r}"

    markdown_path = _write(results, args.out)
    print(markdown(results))
    print(f"wrote {args.out} and {markdown_path}", flush=True)
    plot(results, os.path.splitext(args.out)[0] + ".png")
    return 1 if failures else 0


def _write(results: dict, out: str) -> str:
    """Write the JSON and markdown (after every case, so a time-out keeps what was measured)."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=2)
    markdown_path = os.path.splitext(out)[0] + ".md"
    with open(markdown_path, "w") as f:
        f.write(markdown(results))
    return markdown_path


if __name__ == "__main__":
    sys.exit(main())
