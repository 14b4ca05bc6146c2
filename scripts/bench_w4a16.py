#!/usr/bin/env python
"""W4A16 (INT4, MXFP4) and FP8-from-checkpoint experts vs bf16 experts through the public Experts API (CUDA).

    python scripts/bench_w4a16.py [--rows 64 512] [--out results/bench_w4a16.json]

Shape: Kimi-K2 per rank at EP8 (48 local experts, D 7168, F 2048, SiLU); routed rows spread uniformly at random
(multinomial) over the experts; pool layout with alignment 1 (the Triton backends' own). Paths:
    bf16        make_experts("triton", bf16 weights)
    fp8_ckpt    make_quantized_experts(fp8_block weights as a checkpoint stores them)   (x quantized per 128)
    int4_w4a16  make_quantized_experts(int4_group weights), bf16 activations
    mxfp4_w4a16 make_quantized_experts(mxfp4 weights), bf16 activations
Per case: us (moe_ref.testing.bench, L2 flushed), speedup vs bf16, weight GB/s of the experts that got rows,
calc_diff vs the dequantized fp32 reference (the torch backend of the same stored weights).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moe_ref.experts import ExpertLayout, make_experts  # noqa: E402
from moe_ref.experts.quantized import make_quantized_experts  # noqa: E402
from moe_ref.checkpoint.formats import QuantFormat, QuantizedExpertWeights, QuantSpec, quantize_weight  # noqa: E402
from moe_ref.testing import bench, calc_diff  # noqa: E402

NUM_EXPERTS, HIDDEN, INTER = 48, 7168, 2048


def _quantized(gate_up, down, fmt: QuantFormat) -> QuantizedExpertWeights:
    stored = []
    for weight in (gate_up, down):
        parts = [quantize_weight(w, fmt) for w in weight]  # one expert at a time: small temporaries
        stored += [torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])]
    return QuantizedExpertWeights(QuantSpec(fmt, 128 if fmt == QuantFormat.FP8_BLOCK else 32), *stored,
                                  hidden_size=HIDDEN, intermediate_size=INTER)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--out", default="results/bench_w4a16.json")
    args = parser.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=gen) / HIDDEN**0.5).bfloat16()
    down = (torch.randn(NUM_EXPERTS, HIDDEN, INTER, device="cuda", generator=gen) / INTER**0.5).bfloat16()
    paths = {"bf16": (make_experts("triton", gate_up, down, "silu"), gate_up.nbytes + down.nbytes)}
    for fmt, name in ((QuantFormat.FP8_BLOCK, "fp8_ckpt"), (QuantFormat.INT4_GROUP, "int4_w4a16"),
                      (QuantFormat.MXFP4, "mxfp4_w4a16")):
        q = _quantized(gate_up, down, fmt)
        paths[name] = (make_quantized_experts(q, "silu"), q.nbytes(), make_quantized_experts(q, "silu", backend="torch"))
    results = []
    for num_rows in args.rows:
        counts = torch.bincount(torch.multinomial(torch.ones(NUM_EXPERTS), num_rows, replacement=True,
                                                  generator=torch.Generator().manual_seed(num_rows)),
                                minlength=NUM_EXPERTS)
        layout = ExpertLayout.from_counts(counts.cuda(), alignment=1)
        x_PDx = torch.randn(layout.num_pool_rows, HIDDEN, device="cuda", generator=gen).bfloat16()
        touched = int((counts > 0).sum()) / NUM_EXPERTS
        base_us = None
        for name, (experts, weight_bytes, *reference) in paths.items():
            us = bench(lambda: experts(x_PDx, layout))
            base_us = base_us or us
            row = dict(rows=num_rows, path=name, us=round(us, 1), speedup_vs_bf16=round(base_us / us, 2),
                       weight_gb_per_s=round(weight_bytes * touched / us / 1e3, 1))
            if reference:
                row["calc_diff_vs_dequantized_fp32"] = calc_diff(experts(x_PDx, layout).float(),
                                                                 reference[0](x_PDx.float(), layout))
            results.append(row)
            print(json.dumps(row), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "shape": dict(experts=NUM_EXPERTS, hidden=HIDDEN,
                   intermediate=INTER), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
