"""ncu driver for the 4-bit MLP: one call per forced tile, profiled alone (cudaProfilerStart/Stop around it).

    ncu --clock-control none --profile-from-start off -k regex:_w4_gemm --section SpeedOfLight \\
        --section SchedulerStats --section Occupancy \\
        --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio \\
        python3 scripts/prof_w4.py ROWS FORMAT:TILE [FORMAT:TILE ...]     e.g. 512 int4:16,64,4,2 mxfp4:16,64,4,3

Shape, weights and rows as `bench_w4a16.py` (Kimi-K2 per rank); each call launches gate_up then down.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_w4a16 as w4bench  # noqa: E402  (its shape, weights and rows)

from moe_ref.checkpoint.formats import QuantFormat  # noqa: E402
from moe_ref.kernels.grouped_mlp_w4 import grouped_mlp_w4  # noqa: E402

FORMATS = {"int4": QuantFormat.INT4_GROUP, "mxfp4": QuantFormat.MXFP4}


def main() -> int:
    rows, specs = int(sys.argv[1]), sys.argv[2:]
    gen = torch.Generator(device="cuda").manual_seed(0)
    experts, hidden, inter = w4bench.NUM_EXPERTS, w4bench.HIDDEN, w4bench.INTER
    gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5).bfloat16()
    down = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) / inter**0.5).bfloat16()
    case = w4bench._case(rows, gen)
    planes = {}
    for spec in specs:
        fmt, tile_text = spec.split(":")
        tile = tuple(int(v) for v in tile_text.split(","))
        if fmt not in planes:
            planes[fmt] = w4bench._quantized(gate_up, down, FORMATS[fmt]).group_planes()

        def call():
            return grouped_mlp_w4(case["x"], *planes[fmt], case["layout"].row_start_e, case["layout"].num_rows_e,
                                  num_rows_hint=rows, zero_unused_rows=False, tiles=(tile, tile))
        call()  # compile, then warm
        call()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        call()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print("profiled", spec, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
