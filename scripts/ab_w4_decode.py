"""A/B of the 4-bit experts' kernel at decode: the moe_ref of the tree this script is in, at forced tiles.

    python scripts/ab_w4_decode.py --tag NAME [--rows 64 512] [--tiles 16,64,4,3 16,128,4,3/16,64,4,2] [--out DIR]

Run once per tree in one device session: for the last commit, unpack it with its scripts elsewhere and run that copy's
script (it puts its own tree first on sys.path). Each run times, on the Kimi-K2 per-rank shape of `bench_w4a16.py`
(`moe_ref.bench.w4_cases`: 48 experts, D 7168, F 2048, its random rows and weights), the bf16 experts
(make_experts("triton"), its anchor) and the INT4 and MXFP4 MLPs through `grouped_mlp_w4` at each forced tile (``A``
both GEMMs, ``A/B`` gate_up A and down B), eagerly and replayed from a CUDA graph (`bench`: L2 flushed, median), with
calc_diff against the dequantized fp32 reference (the torch backend of the same stored weights).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moe_ref.bench.w4_cases import quantized_weights, random_weights, w4_case  # noqa: E402
from moe_ref.checkpoint.formats import QuantFormat  # noqa: E402
from moe_ref.experts import make_experts  # noqa: E402
from moe_ref.experts.quantized import make_quantized_experts  # noqa: E402
from moe_ref.kernels.experts.grouped_mlp_w4 import grouped_mlp_w4  # noqa: E402
from moe_ref.testing import bench as bench_calls, calc_diff, graphed  # noqa: E402

# bench_w4a16's timer: calls queued back to back as a model queues its layers (L2 flushed, median)
bench = functools.partial(bench_calls, host_ahead=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tag", required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--tiles", nargs="+", default=["16,64,4,3", "16,64,4,4", "16,128,4,3", "16,128,8,3"])
    parser.add_argument("--out", default="results/ab_w4_decode")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("ab_w4_decode needs a CUDA GPU", file=sys.stderr)
        return 2
    import moe_ref
    print(f"moe_ref from {os.path.dirname(moe_ref.__file__)}", flush=True)
    tiles = [tuple(tuple(int(v) for v in part.split(",")) for part in (t.split("/") * 2)[:2]) for t in args.tiles]
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up, down = random_weights(gen)
    bf16 = make_experts("triton", gate_up, down, "silu")
    cases = {rows: w4_case(rows, gen) for rows in args.rows}
    rows_out = []
    for rows, case in cases.items():
        us = bench(lambda: bf16(case["x"], case["layout"]))
        row = dict(tag=args.tag, format="bf16", rows=rows, us=round(us, 1),
                   graph_us=round(bench(graphed(lambda: bf16(case["x"], case["layout"]))), 1))
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    for fmt in (QuantFormat.INT4_GROUP, QuantFormat.MXFP4):
        q = quantized_weights(gate_up, down, fmt)
        reference = make_quantized_experts(q, "silu", backend="torch")
        planes = q.group_planes()
        for rows, case in cases.items():
            layout, x = case["layout"], case["x"]
            ref = reference(x.float(), layout)
            valid = layout.row_expert_P() >= 0  # rows outside every segment are left unwritten
            for tile in tiles:
                def call(tile=tile):
                    return grouped_mlp_w4(x, *planes, layout.row_start_e, layout.num_rows_e, num_rows_hint=rows,
                                          zero_unused_rows=False, tiles=tile)
                row = dict(tag=args.tag, format=fmt.value, rows=rows, tiles=[list(t) for t in tile])
                try:
                    y = call()
                    row["calc_diff"] = calc_diff(y[valid].float(), ref[valid].float())
                    row["us"] = round(bench(call), 1)
                    row["graph_us"] = round(bench(graphed(call)), 1)
                except Exception as error:  # a tile that does not compile or launch is recorded, not fatal
                    row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                rows_out.append(row)
                print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.tag}.json")
    with open(path, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows_out), f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
