"""``moe-ref`` (also ``python -m moe_ref``): plan | check | explain | demo | bench | info.

    moe-ref plan --preset kimi-k2 --ep 8 --max-num-tokens 1024 [--budget-gib 4]
    moe-ref check --config config.json --tp 8 --ep 8 --dp 8
    moe-ref explain CAP001
    moe-ref demo                      # EP over 2 processes (CPU, or GPUs when present)
    moe-ref bench                     # expert backends on this machine
    moe-ref info                      # versions, devices, backends and why not
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import torch

from moe_ref.config import PRESETS, MoEConfig, ParallelConfig
from moe_ref.errors import CATALOGUE, FP8AlignmentError, MoERefError, explain

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _add_model_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=PRESETS, help="a built-in model (default: kimi-k2)")
    src.add_argument("--config", help="an HF config.json (or its folder)")


def _load_cfg(args, validate: bool = True) -> MoEConfig:
    from moe_ref.config import preset

    if args.config:
        return MoEConfig.from_hf_config(args.config, validate=validate)
    return preset(args.preset or "kimi-k2")


# --- plan ------------------------------------------------------------------------------------------------
def cmd_plan(args) -> int:
    from moe_ref.capacity import CapacityPlan, max_tokens_for_budget

    cfg = _load_cfg(args)
    parallel = ParallelConfig(ep_size=args.ep, dp_size=args.dp, attention_dp=args.attention_dp)
    for problem in parallel.problems(cfg):
        raise problem
    dtype = DTYPES[args.dtype]
    print(f"{cfg.name}: E={cfg.num_experts}, K={cfg.num_topk}, D={cfg.hidden_size}, F={cfg.intermediate_size}"
          f"{f', latent L={cfg.latent_dim}' if cfg.latent_dim else ''}; ep={args.ep}, dp={args.dp}, "
          f"attention-dp={'on' if args.attention_dp else 'off'}")
    print(f"cap = {args.max_num_tokens} rows fed by ONE rank per call (never multiplied by dp or ep size)")
    plan = CapacityPlan.build(cfg, args.ep, args.max_num_tokens, dtype, dispatch_fp8=args.dispatch_fp8,
                              alignment=args.alignment)
    print(plan.report())
    if args.budget_gib is not None:
        best = max_tokens_for_budget(cfg, args.ep, int(args.budget_gib * 2**30), dtype,
                                     dispatch_fp8=args.dispatch_fp8, alignment=args.alignment)
        best_plan = CapacityPlan.build(cfg, args.ep, best, dtype, dispatch_fp8=args.dispatch_fp8,
                                       alignment=args.alignment)
        print(f"\nlargest cap within {args.budget_gib} GiB per rank: {best} tokens "
              f"({best_plan.total_bytes / 2**30:.3f} GiB)")
    return 0


# --- check -----------------------------------------------------------------------------------------------
def cmd_check(args) -> int:
    cfg = _load_cfg(args, validate=False)
    problems = list(cfg.problems())
    if not problems:
        problems += ParallelConfig(tp_size=args.tp, ep_size=args.ep, dp_size=args.dp).problems(cfg)
        if args.dispatch_fp8:
            bad = {n: v for n, v in (("hidden_size", cfg.hidden_size), ("intermediate_size", cfg.intermediate_size),
                                     ("expert_hidden_size", cfg.expert_hidden_size)) if v % 128}
            if bad:
                problems.append(FP8AlignmentError(f"FP8 needs multiples of 128; not: {bad}"))
    where = args.config or args.preset or "kimi-k2"
    if not problems:
        print(f"OK: {where} with tp={args.tp} ep={args.ep} dp={args.dp} "
              f"({cfg.num_experts // args.ep} experts per EP rank)")
        return 0
    print(f"{len(problems)} problem(s) with {where} at tp={args.tp} ep={args.ep} dp={args.dp}:")
    for problem in problems:
        print(f"  - {problem}")
    return 1


# --- explain ---------------------------------------------------------------------------------------------
def cmd_explain(args) -> int:
    if args.code is None or args.list:
        for code, entry in sorted(CATALOGUE.items()):
            print(f"{code}  {entry.title}")
        return 0
    try:
        print(explain(args.code))
    except KeyError as err:
        print(err.args[0], file=sys.stderr)
        return 2
    return 0


# --- demo ------------------------------------------------------------------------------------------------
def cmd_demo(args) -> int:
    on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.device_count() >= args.nproc)
    checkpoint = args.checkpoint or os.path.join(tempfile.gettempdir(), f"moe_ref_demo_{args.preset}")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               "-m", "moe_ref.dist_check", "--preset", args.preset, "--checkpoint", checkpoint,
               "--tokens-per-rank", str(args.tokens_per_rank), "--cap", str(args.cap), "--overflow", "chunk",
               "--runs", str(args.runs), "--device", "cuda" if on_gpu else "cpu",
               "--dtype", "bf16" if on_gpu else "fp32"]
    print(f"demo: {args.preset} over {args.nproc} processes on {'GPU (NCCL)' if on_gpu else 'CPU (gloo)'}, "
          f"checkpoint {checkpoint}, {args.tokens_per_rank} tokens on rank 0 > cap {args.cap} -> chunk policy")
    print("$ " + " ".join(command), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.call(command, env=env)


# --- bench -----------------------------------------------------------------------------------------------
def cmd_bench(args) -> int:
    from moe_ref.experts import ExpertLayout, make_experts
    from moe_ref.testing import bench, calc_diff

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    e, D, F = args.experts, args.hidden, args.intermediate
    gen = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(e, 2 * F, D, generator=gen) / D**0.5).to(device, dtype)
    down = (torch.randn(e, D, F, generator=gen) / F**0.5).to(device, dtype)
    counts = torch.full((e,), args.rows // e, dtype=torch.int64)
    layout = ExpertLayout.from_counts(counts.to(device), 128)
    x = torch.randn(layout.num_pool_rows, D, generator=gen).to(device, dtype)
    backends = ["torch", "grouped_mm"] + (["triton"] if device == "cuda" else [])
    ref = make_experts("torch", gate_up, down)(x, layout)
    flops = 2 * 3 * int(counts.sum()) * D * F
    print(f"experts e={e} D={D} F={F} rows={int(counts.sum())} on {device} ({dtype})")
    print(f"{'backend':>12} {'us':>10} {'TFLOP/s':>8} {'x torch':>8} {'calc_diff':>10}")
    base = None
    for name in backends:
        try:
            experts = make_experts(name, gate_up, down)
            out = experts(x, layout)
            t_us = bench(lambda: experts(x, layout), iters=args.iters)
        except MoERefError as err:
            print(f"{name:>12}  unavailable: {err}")
            continue
        base = base or t_us
        print(f"{name:>12} {t_us:>10.1f} {flops / t_us / 1e6:>8.2f} {base / t_us:>8.2f} {calc_diff(out, ref):>10.2e}")
    print("(full GPU benchmarks: scripts/bench_experts.py, scripts/bench_layer.py)")
    return 0


# --- info ------------------------------------------------------------------------------------------------
def cmd_info(args) -> int:
    import triton

    import moe_ref

    print(f"moe_ref {moe_ref.__version__}, torch {torch.__version__}, triton {triton.__version__}, "
          f"python {sys.version.split()[0]}")
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        print(f"CUDA: {len(names)} device(s): {', '.join(names)}")
    else:
        print("CUDA: not available (CPU: experts backend 'torch', Triton kernels run only under TRITON_INTERPRET=1)")
    print(f"torch.nn.functional.grouped_mm: {'yes' if hasattr(torch.nn.functional, 'grouped_mm') else 'no'}")
    try:
        from moe_ref.deep_gemm_backend import deep_gemm_status

        status = deep_gemm_status()
        print(f"deep_gemm: {'usable' if status.available else 'not usable'}"
              f"{f' (version {status.version})' if status.version else ''}: {status.reason}")
    except ImportError as err:
        print(f"deep_gemm: backend module not importable: {err}")
    print("transports: local; symm (CPU shared memory"
          f"{', CUDA symmetric memory' if torch.cuda.is_available() else ''}); a2a (all_to_all_single)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-ref", description="moe_ref: reference expert-parallel MoE layer")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="print the per-rank symmetric buffer layout for a model and topology")
    _add_model_args(p)
    p.add_argument("--ep", type=int, default=8, help="expert-parallel size")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size (does not change the per-rank cap)")
    p.add_argument("--attention-dp", action="store_true", help="attention data parallel")
    p.add_argument("--max-num-tokens", type=int, default=4096, help="cap: rows one rank feeds per call")
    p.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    p.add_argument("--dispatch-fp8", action="store_true")
    p.add_argument("--alignment", type=int, default=128)
    p.add_argument("--budget-gib", type=float, default=None, help="also print the largest cap within this budget")
    p.set_defaults(fn=cmd_plan)

    p = sub.add_parser("check", help="validate a deployment; prints every problem at once")
    _add_model_args(p)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--dispatch-fp8", action="store_true")
    p.set_defaults(fn=cmd_check)

    p = sub.add_parser("explain", help="explain an error code (no code: list them)")
    p.add_argument("code", nargs="?")
    p.add_argument("--list", action="store_true")
    p.set_defaults(fn=cmd_explain)

    p = sub.add_parser("demo", help="run the EP layer over several processes against the reference")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--preset", default="tiny-kimi-k2", choices=PRESETS)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--tokens-per-rank", type=int, default=150)
    p.add_argument("--cap", type=int, default=64)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--checkpoint", default=None, help="checkpoint folder (generated if absent)")
    p.set_defaults(fn=cmd_demo)

    p = sub.add_parser("bench", help="time the expert backends on this machine")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=128)
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--iters", type=int, default=10)
    p.set_defaults(fn=cmd_bench)

    p = sub.add_parser("info", help="versions, devices and which backends load (and why not)")
    p.set_defaults(fn=cmd_info)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except MoERefError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
