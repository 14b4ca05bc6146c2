"""Per-kernel GPU times inside one experts call (torch.profiler, 10 calls, L2 flushed before each), per path and rows,
at bench_w4a16.py's shape and weights: which kernels a call launches and their mean us per call.

    OUT=<dir> python3 docs/results/profile_experts_kernels_h200_2026-12-02.py     (from the repository root, a GPU)

A probe kept with its result (profile_experts_kernels_h200_2026-12-02.json: {"<rows> <path>": {kernel: [launches
per call, us per call]}}), not a maintained script."""
import json, os, sys, time
import torch
sys.path.insert(0, "scripts"); sys.path.insert(0, ".")
import bench_w4a16 as B
from moe_ref.checkpoint.formats import QuantFormat
from moe_ref.experts import make_experts
from moe_ref.experts.quantized import make_quantized_experts
from moe_ref.kernels.grouped_mlp_w4 import grouped_mlp_w4, launch_w4_gemm, tuned_tiles
from torch.profiler import profile, ProfilerActivity

OUT = os.environ.get("OUT", "results")
flush = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")

def kernels(fn, iters=10):
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    agg = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name[:70]
            if "fill" in name.lower() and "Fill" in name and e.device_time > 50: continue
            agg.setdefault(name, []).append(e.device_time)
    out = {k: (len(v) / iters, sum(v) / iters) for k, v in agg.items()}
    return {k: v for k, v in out.items() if not k.startswith("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<unsigned char>")}

gen = torch.Generator(device="cuda").manual_seed(0)
E, D, F = B.NUM_EXPERTS, B.HIDDEN, B.INTER
gate_up = (torch.randn(E, 2 * F, D, device="cuda", generator=gen) / D**0.5).bfloat16()
down = (torch.randn(E, D, F, device="cuda", generator=gen) / F**0.5).bfloat16()
paths = {"bf16": make_experts("triton", gate_up, down, "silu")}
planes = {}
for fmt, name in ((QuantFormat.FP8_BLOCK, "fp8_ckpt"), (QuantFormat.INT4_GROUP, "int4"), (QuantFormat.MXFP4, "mxfp4")):
    q = B._quantized(gate_up, down, fmt)
    if fmt == QuantFormat.FP8_BLOCK:
        q = q.with_interleaved_gate_up()
    else:
        planes[name] = q.group_planes()
    paths[name] = make_quantized_experts(q, "silu")
cases = {r: B._case(r, gen) for r in (64, 512)}
res = {}
for rows, case in cases.items():
    for name, ex in paths.items():
        call = lambda: ex(case["x"], case["layout"])
        if name == "fp8_ckpt":
            pcall = lambda: ex(case["x_fp8"], case["layout"], case["x_scale"])
            res[f"{rows} fp8_pool"] = kernels(pcall)
        res[f"{rows} {name}"] = kernels(call)
        print(rows, name, json.dumps({k: [round(a, 2), round(b, 1)] for k, b_ in [(0, 0)] for k, (a, b) in res[f"{rows} {name}"].items()}, indent=0), flush=True)
print("tuned", tuned_tiles(), flush=True)
json.dump({k: (v if isinstance(v, dict) else v) for k, v in res.items()}, open(f"{OUT}/prof.json", "w"), indent=1, default=str)
