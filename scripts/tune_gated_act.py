#!/usr/bin/env python
"""Time the gated-activation kernel's tiles (rows per program, num_warps) on one GPU.

    PYTHONPATH=. python3 scripts/tune_gated_act.py [--rows 6144 38400] [--width 2048] [--out results/tune_gated_act]

``moe_ref.kernels.experts.gated_act.gated_activation_rows`` is the glue between the deep_gemm experts' two GEMMs: it reads
GEMM1's ``[P, 2F]`` bf16 output and writes h as fp8 with per-128 scales (``--quant``, the FP8 experts) or bf16, over
the valid rows of a contiguous pool (every row valid here: the pool of a prefill call). Per tile: us (L2 flushed,
median, ``moe_ref.testing.bench``) and the GB/s of the bytes it must move (GEMM1's output read, h and its scales
written), beside a device-to-device copy of the same read bytes (the bandwidth anchor). Each tile's output is
compared with the default tile's (bitwise). Prints the winner per row count and writes JSON and markdown.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moe_ref.kernels.experts.gated_act import DEFAULT_TILE, gated_activation_rows  # noqa: E402
from moe_ref.testing import bench  # noqa: E402

TILES = [(16, 4), (32, 4), (32, 8), (64, 4), (64, 8), (128, 8)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[6144, 38400],
                        help="pool rows P (the 128-aligned pools of 4096 and 32768 routed rows over 48 experts)")
    parser.add_argument("--width", type=int, default=2048, help="F, the expert intermediate size")
    parser.add_argument("--no-quant", action="store_true", help="bf16 h instead of fp8 + scales")
    parser.add_argument("--out", default="results/tune_gated_act")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_gated_act: needs a CUDA GPU", file=sys.stderr)
        return 2
    quant = not args.no_quant
    results = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "width": args.width,
               "quant": quant, "default_tile": list(DEFAULT_TILE), "command": "python3 scripts/tune_gated_act.py "
               + " ".join(argv if argv is not None else sys.argv[1:]), "rows": []}
    for num_rows in args.rows:
        gate_up = torch.randn(num_rows, 2 * args.width, device="cuda").bfloat16()
        group = torch.zeros(num_rows, dtype=torch.int32, device="cuda")
        moved = gate_up.nbytes + num_rows * args.width * (1 if quant else 2) + (num_rows * args.width // 128 * 4
                                                                                  if quant else 0)
        copy_dst = torch.empty_like(gate_up)
        copy_us = bench(lambda: copy_dst.copy_(gate_up))
        reference = gated_activation_rows(gate_up, group_P=group, quant=quant)
        for tile in TILES:
            out = gated_activation_rows(gate_up, group_P=group, quant=quant, tile=tile)
            same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(out, reference)
                       if a is not None)
            us = bench(lambda: gated_activation_rows(gate_up, group_P=group, quant=quant, tile=tile))
            row = dict(rows=num_rows, tile=list(tile), us=round(us, 1), gb_per_s=round(moved / us / 1e3, 1),
                       copy_gb_per_s=round(2 * gate_up.nbytes / copy_us / 1e3, 1), bitwise_eq_default=same)
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
        best = min((r for r in results["rows"] if r["rows"] == num_rows and r["bitwise_eq_default"]),
                   key=lambda r: r["us"])
        print(f"P={num_rows}: best tile {tuple(best['tile'])} {best['us']} us", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune_gated_act.json"), "w") as f:
        json.dump(results, f, indent=1)
    lines = [f"# Gated activation tiles ({results['device']}, {results['date']}, F {args.width}, "
             f"{'fp8 + scales' if quant else 'bf16'} out)", "", f"`{results['command']}`", "",
             "| P | rows per program, warps | us | GB/s moved | copy GB/s | == default tile |", "|---:|---|---:|---:|---:|---|"]
    lines += [f"| {r['rows']} | {tuple(r['tile'])} | {r['us']} | {r['gb_per_s']} | {r['copy_gb_per_s']} | "
              f"{r['bitwise_eq_default']} |" for r in results["rows"]]
    with open(os.path.join(args.out, "tune_gated_act.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
