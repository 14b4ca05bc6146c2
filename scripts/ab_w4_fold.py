"""Experiment: the 4-bit MLP at decode at forced tiles, INT4 exact against INT4 folded (weights rounded once to bf16),
registers capped, and MXFP4 at BLOCK_M 32 (one dot a half block).

    python scripts/ab_w4_fold.py [--rows 512 64] [--out results/ab_w4_fold]

Shape and rows of `bench_w4a16.py` (48 experts, D 7168, F 2048, its random rows and weights). Per variant: the whole
MLP through `grouped_mlp_w4` at forced tiles (``A`` both GEMMs, ``A/B`` gate_up A and down B; a fifth value caps the
registers, ``maxnreg``), eagerly and replayed from a CUDA graph (`bench`: L2 flushed, median), calc_diff against the
dequantized fp32 reference. INT4 "folded" sets MOE_REF_W4_INT4_FOLD=1 for its calls. Anchor: the bf16 experts
(make_experts("triton")) in the same process. Committed to be cited; removed in the next commit.
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
from moe_ref.experts import make_experts  # noqa: E402
from moe_ref.experts.quantized import make_quantized_experts  # noqa: E402
from moe_ref.kernels.grouped_mlp_w4 import grouped_mlp_w4  # noqa: E402
from moe_ref.testing import calc_diff, graphed  # noqa: E402

# (label, format, INT4 fold, tiles)
VARIANTS = [
    ("int4 exact", QuantFormat.INT4_GROUP, False, ["16,64,4,2", "16,64,4,2,72", "16,64,4,2,64", "8,32,2,2"]),
    ("int4 folded", QuantFormat.INT4_GROUP, True, ["16,64,4,2", "16,64,4,3", "16,64,4,4", "16,128,8,3",
                                                   "32,64,4,2", "8,32,2,2"]),
    ("mxfp4", QuantFormat.MXFP4, False, ["16,64,4,3", "16,64,4,2", "32,64,4,2", "32,64,4,3", "32,128,8,3",
                                         "32,64,4,2/16,64,4,3", "16,64,4,3,56"]),
]


def _tiles(text: str) -> tuple:
    return tuple(tuple(int(v) for v in part.split(",")) for part in (text.split("/") * 2)[:2])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 64])
    parser.add_argument("--out", default="results/ab_w4_fold")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("ab_w4_fold needs a CUDA GPU", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    experts_n, hidden, inter = w4bench.NUM_EXPERTS, w4bench.HIDDEN, w4bench.INTER
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(experts_n, 2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5).bfloat16()
    down = (torch.randn(experts_n, hidden, inter, device="cuda", generator=gen) / inter**0.5).bfloat16()
    bf16 = make_experts("triton", gate_up, down, "silu")
    cases = {rows: w4bench._case(rows, gen) for rows in args.rows}
    rows_out = []

    def save():
        with open(os.path.join(args.out, "ab_w4_fold.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows_out), f, indent=1)

    for rows, case in cases.items():
        row = dict(label="bf16", format="bf16", rows=rows,
                   us=round(w4bench.bench(lambda: bf16(case["x"], case["layout"])), 1),
                   graph_us=round(w4bench.bench(graphed(lambda: bf16(case["x"], case["layout"]))), 1))
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    for label, fmt, fold, tile_texts in VARIANTS:
        q = w4bench._quantized(gate_up, down, fmt)
        reference = make_quantized_experts(q, "silu", backend="torch")
        planes = q.group_planes()
        os.environ["MOE_REF_W4_INT4_FOLD"] = "1" if fold else "0"
        for rows, case in cases.items():
            layout, x = case["layout"], case["x"]
            ref = reference(x.float(), layout)
            valid = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
            for start, count in zip(layout.row_start_e.tolist(), layout.num_rows_e.tolist()):
                valid[start:start + count] = True
            for text in tile_texts:
                tiles = _tiles(text)

                def call(tiles=tiles):
                    return grouped_mlp_w4(x, *planes, layout.row_start_e, layout.num_rows_e, num_rows_hint=rows,
                                          zero_unused_rows=False, tiles=tiles)
                row = dict(label=label, format=fmt.value, rows=rows, tiles=text)
                try:
                    y = call()
                    row["calc_diff"] = calc_diff(y[valid].float(), ref[valid].float())
                    row["us"] = round(w4bench.bench(call), 1)
                    row["graph_us"] = round(w4bench.bench(graphed(call)), 1)
                except Exception as error:  # a tile that does not compile or launch is recorded, not fatal
                    row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                rows_out.append(row)
                print(json.dumps(row), flush=True)
                save()
        del q, reference, planes
        torch.cuda.empty_cache()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
