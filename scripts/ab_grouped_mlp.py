#!/usr/bin/env python
"""A/B of the grouped MLP on one GPU, through `grouped_mlp` as the Triton experts call it.

    python3 scripts/ab_grouped_mlp.py [--ab layout|schedule] [--models kimi-k2,step3] [--rows 64,512,4096,32768]
                                      [--out results/ab.json]

`--ab layout` (default), the gate/up weight layout:
  A: gate_up rows stacked (gate 0..F-1, then up 0..F-1): GEMM1 runs two dots per k-step.
  B: gate_up rows interleaved (gate j, up j; `interleave_gate_up`, done once): one dot over 2 * BLOCK_N rows.
  Both autotune over the same tile lists; down (GEMM2) is the same launch in both.
`--ab schedule`, the program schedule of both GEMMs, in the layout the Triton experts use (FP8 interleaved, bf16
stacked):
  A: one program per tile of the upper-bound grid (surplus programs exit at once).
  B: persistent: about two programs per SM walk the live tiles.
  Each autotunes its own tiles (the schedule is part of the autotune key).
The cases are scripts/bench_experts.py's (`_make_case`: its per-rank EP8 shapes, routed rows spread randomly over
the experts, 128-aligned segments), with `num_rows_hint` given and unused rows left unwritten (what the layer
passes). bf16 and FP8 (e4m3, per-128 activation scales, 128x128 weight blocks). (The first recorded layout run,
docs/results/ab_gate_up_layout_kimi_2026-12-01.*, built its cases in this script, the same way.)

Timing: `triton.testing.do_bench` (L2 flushed before each run), A and B alternated over `--rounds` rounds, the
median of the rounds kept. Check: B's output vs A's on the rows inside segments (calc_diff < 1e-4 bf16,
1e-3 FP8). JSON and a markdown table go to --out (and its .md).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_experts import MODELS, _make_case, _make_weights, _segment_rows  # noqa: E402  (same folder)
from moe_ref.kernels.grouped_mlp import grouped_mlp, interleave_gate_up  # noqa: E402
from moe_ref.testing import calc_diff  # noqa: E402

gm = importlib.import_module("moe_ref.kernels.grouped_mlp")  # the module (the package re-exports the function)


def run(case, precision: str, gate_up: torch.Tensor, interleaved: bool, persistent: bool = False):
    """`grouped_mlp` on a bench_experts case as the Triton experts call it, with `gate_up` in the given layout."""
    if precision == "fp8":
        ops = case.fp8
        inputs, down = (ops["x"],), ops["down"]
        scales = {"x_scale_PDb": ops["x_scale"], "gate_up_scale": ops["gate_up_scale"], "down_scale": ops["down_scale"]}
    else:
        inputs, down, scales = (case.x_PDx,), case.down, {}
    return grouped_mlp(*inputs, gate_up, down, case.row_start_e, case.num_rows_e, **scales,
                       num_rows_hint=case.num_rows, zero_unused_rows=False, gate_up_interleaved=interleaved,
                       persistent=persistent)


def variants(ab: str, precision: str, stacked: torch.Tensor) -> dict[str, dict]:
    """A and B of the comparison: name -> `run` keywords (first A, then B)."""
    if ab == "layout":
        return {"stacked": dict(gate_up=stacked, interleaved=False),
                "interleaved": dict(gate_up=interleave_gate_up(stacked), interleaved=True)}
    layout = dict(gate_up=interleave_gate_up(stacked), interleaved=True) if precision == "fp8" else \
        dict(gate_up=stacked, interleaved=False)  # as TritonExperts stores them
    return {"grid": dict(layout, persistent=False), "persistent": dict(layout, persistent=True)}


def main(argv=None) -> int:
    import triton

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ab", choices=("layout", "schedule"), default="layout")
    parser.add_argument("--models", default="kimi-k2")
    parser.add_argument("--rows", default="64,512,4096,32768")
    parser.add_argument("--precisions", default="bf16,fp8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="results/ab_grouped_mlp.json")
    args = parser.parse_args(argv)
    results = {"ab": args.ab, "env": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__}, "cases": []}
    for model in args.models.split(","):
        num_experts, hidden, inter, _ = MODELS[model]
        weights = _make_weights(num_experts, hidden, inter, with_fp8=True)
        for num_rows in map(int, args.rows.split(",")):
            case = _make_case(model, num_rows, weights, seed=0, with_fp8=True)
            valid = _segment_rows(case.row_start_e, case.num_rows_e, case.x_PDx.shape[0])
            for precision in args.precisions.split(","):
                stacked = case.fp8["gate_up"] if precision == "fp8" else case.gate_up
                specs = variants(args.ab, precision, stacked)
                (name_a, spec_a), (name_b, spec_b) = specs.items()
                outs = {name: run(case, precision, **spec)[valid].float() for name, spec in specs.items()}
                diff = calc_diff(outs[name_b], outs[name_a])
                times = {name: [] for name in specs}
                for _ in range(args.rounds):
                    for name, spec in specs.items():
                        times[name].append(triton.testing.do_bench(lambda spec=spec: run(case, precision, **spec)))
                row = {"model": model, "rows": num_rows, "precision": precision, "a": name_a, "b": name_b,
                       "calc_diff": diff, "ok": diff < (1e-3 if precision == "fp8" else 1e-4),
                       "a_us": statistics.median(times[name_a]) * 1e3, "b_us": statistics.median(times[name_b]) * 1e3,
                       "rounds_us": {name: [t * 1e3 for t in ts] for name, ts in times.items()}}
                row["speedup"] = row["a_us"] / row["b_us"]
                results["cases"].append(row)
                print(f"{model:8s} {num_rows:6d} {precision:5s} {name_a} {row['a_us']:8.1f} us  {name_b} "
                      f"{row['b_us']:8.1f} us  x{row['speedup']:.3f}  calc_diff {diff:.1e}", flush=True)
                os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1)
    # the tiles autotune chose, per launch key (rows_hint, N, K, experts, flags...): compare with tune_grouped_mlp's
    results["autotune_choices"] = {str(key): str(config) for key, config in gm.autotuned_kernel().cache.items()}
    for key, config in results["autotune_choices"].items():
        print(f"autotune {key}: {config}")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    lines = ["| model | rows | precision | A | A us | B | B us | A / B | calc_diff |",
             "|---|---:|---|---|---:|---|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['rows']} | {r['precision']} | {r['a']} | {r['a_us']:.1f} | {r['b']} | "
              f"{r['b_us']:.1f} | {r['speedup']:.3f} | {r['calc_diff']:.1e} |" for r in results["cases"]]
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(f"{results['env']}\n\n" + "\n".join(lines) + "\n")
    return 0 if all(r["ok"] for r in results["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
