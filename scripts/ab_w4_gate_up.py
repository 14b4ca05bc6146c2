"""A/B of the 4-bit experts' first GEMM at decode: the activation fused into it, or after it.

    python scripts/ab_w4_gate_up.py [--rows 64 512] [--out results/ab_w4_gate_up.json]

fused:   `launch_w4_gemm(..., n=F, activation="silu")`: each program computes a gate tile and its up tile (two
         accumulators, two weight streams) and writes h [P, F].
unfused: `launch_w4_gemm(..., n=2F, activation="none")` writes gate|up [P, 2F] (one accumulator, one weight stream
         per program), then `kernels.gated_act.gated_activation_rows` writes h from it.
Both on the Kimi-K2 per-rank shape of `bench_w4a16.py` (48 experts, D 7168, F 2048, its random rows), INT4 and MXFP4,
timed as that script times (`bench`: L2 flushed, median) eagerly and replayed from a CUDA graph; h compared on the
valid rows (calc_diff).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_w4a16 as w4bench  # noqa: E402  (its shape, weights, rows and timer)

from moe_ref.checkpoint.formats import QuantFormat  # noqa: E402
from moe_ref.kernels.gated_act import gated_activation_rows  # noqa: E402
from moe_ref.kernels.grouped_mlp_w4 import launch_w4_gemm  # noqa: E402
from moe_ref.kernels.pool_rows import pool_row_experts  # noqa: E402
from moe_ref.testing import calc_diff, graphed  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--out", default="results/ab_w4_gate_up.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("ab_w4_gate_up needs a CUDA GPU", file=sys.stderr)
        return 2
    experts, hidden, inter = w4bench.NUM_EXPERTS, w4bench.HIDDEN, w4bench.INTER
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5).bfloat16()
    down = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) / inter**0.5).bfloat16()
    rows_out = []
    for fmt in (QuantFormat.INT4_GROUP, QuantFormat.MXFP4):
        weight = w4bench._quantized(gate_up, down, fmt).group_planes()[0]
        for num_rows in args.rows:
            case = w4bench._case(num_rows, gen)
            layout, x = case["layout"], case["x"]
            num_pool_rows = x.shape[0]
            h = torch.empty(num_pool_rows, inter, dtype=x.dtype, device=x.device)
            gate_up_P2F = torch.empty(num_pool_rows, 2 * inter, dtype=x.dtype, device=x.device)
            group_P = pool_row_experts(layout.row_start_e, layout.num_rows_e, num_pool_rows)

            def fused():
                return w4bench._launch(case, weight, "gate_up", x, h)

            def gemm_only():
                return launch_w4_gemm(x, weight, gate_up_P2F, layout.row_start_e, layout.num_rows_e, n=2 * inter,
                                      activation="none", situ_beta=4.0, situ_linear_beta=25.0, rows_hint=num_rows)

            def unfused():
                gemm_only()
                return gated_activation_rows(gate_up_P2F, group_P=group_P, activation="silu")[0]

            fused()
            h_fused = h.clone()
            h_unfused = unfused()
            valid = group_P >= 0
            row = dict(format=fmt.value, rows=num_rows,
                       calc_diff=calc_diff(h_fused[valid].float(), h_unfused[valid].float()))
            for name, fn in (("fused", fused), ("unfused", unfused), ("unfused_gemm_only", gemm_only)):
                row[f"{name}_us"] = round(w4bench.bench(fn), 1)
                row[f"{name}_graph_us"] = round(w4bench.bench(graphed(fn)), 1)
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows_out), f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
