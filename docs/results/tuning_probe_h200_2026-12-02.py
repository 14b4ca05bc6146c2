"""Probe: what Triton's autotuner measures for each 16-row tile of the 4-bit GEMMs at 512 rows (3 fresh tunings),
against the same GEMM timed alone by bench_w4a16's bench, per tile, interleaved (3 rounds).

    python3 docs/results/tuning_probe_h200_2026-12-02.py OUT.json      # at b7a4e25, on a GPU

Reads private names of moe_ref and of scripts/bench_w4a16.py (the autotuner object of that commit's
``grouped_mlp_w4._autotuned``), so it runs against that commit only; kept beside its output as what produced it.
"""
import json, os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import torch
import bench_w4a16 as wb
from moe_ref.checkpoint.formats import QuantFormat
from moe_ref.kernels import grouped_mlp_w4 as w4

out = sys.argv[1]
gen = torch.Generator(device="cuda").manual_seed(0)
E, D, F = wb.NUM_EXPERTS, wb.HIDDEN, wb.INTER
gate_up = (torch.randn(E, 2 * F, D, device="cuda", generator=gen) / D**0.5).bfloat16()
down = (torch.randn(E, D, F, device="cuda", generator=gen) / F**0.5).bfloat16()
case = wb._case(512, gen)
layout, x = case["layout"], case["x"]
rows = {}
tiles = tuple(w4.tiles_for(512 / E))
tuner = w4._autotuned(tiles)
for fmt in (QuantFormat.INT4_GROUP, QuantFormat.MXFP4):
    g, d = wb._quantized(gate_up, down, fmt).group_planes()
    h = torch.randn(x.shape[0], F, device="cuda", dtype=torch.bfloat16, generator=gen)
    for gemm, weight, inp, n in (("gate_up", g, x, 2 * F), ("down", d, h, D)):
        c = torch.empty(x.shape[0], n, device="cuda", dtype=torch.float32 if gemm == "gate_up" else torch.bfloat16)
        picks = []
        for rep in range(3):
            tuner.cache.clear()
            w4.clear_tuned_tiles()
            w4.launch_w4_gemm(inp, weight, c, layout.row_start_e, layout.num_rows_e, rows_hint=512)
            torch.cuda.synchronize()
            timings = {str((k.kwargs["BLOCK_M"], k.kwargs["BLOCK_N"], k.num_warps, k.num_stages)): [round(t * 1e3, 1) for t in v]
                       for k, v in tuner.configs_timings.items()}
            picks.append(dict(chosen=list(w4.tuned_tiles().values())[0], autotuner_us=timings))
        ours = {str(t): [] for t in tiles}
        for rep in range(3):
            for t in tiles:
                ours[str(t)].append(round(wb.bench(lambda t=t: w4.launch_w4_gemm(
                    inp, weight, c, layout.row_start_e, layout.num_rows_e, rows_hint=512, tile=t)), 1))
        rows[f"{fmt.value} {gemm}"] = dict(autotune=picks, bench_alone_us=ours)
        print(fmt.value, gemm, json.dumps(rows[f"{fmt.value} {gemm}"]), flush=True)
json.dump(dict(device=torch.cuda.get_device_name(), tiles=[list(t) for t in tiles], rows=rows), open(out, "w"), indent=1)
