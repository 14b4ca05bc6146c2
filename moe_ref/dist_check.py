"""Torchrun harness: does the EP layer give the single-process answer on every rank?

    torchrun --nproc-per-node 2 -m moe_ref.dist_check --preset tiny-kimi-k2
    torchrun --nproc-per-node 2 -m moe_ref.dist_check --device cuda --dtype bf16 --preset kimi-k2 --cap 512

Every rank builds the same weights from one seed (or loads them from a checkpoint, each rank reading only
its experts), feeds its own tokens (uneven counts: odd ranks get half), runs ``MegaMoE`` over the group
and the single-process reference ``reference_moe`` on the same tokens with all experts, and rank 0
prints the capacity plan, per-rank loads, errors, timings and PASS/FAIL (exit code 1 on FAIL).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from moe_ref.config import PRESETS
from moe_ref.testing import CALC_DIFF_TOLERANCES, TOLERANCES, calc_diff

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="moe_ref.dist_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny-kimi-k2", choices=PRESETS)
    p.add_argument("--tokens-per-rank", type=int, default=96, help="tokens on even ranks (odd ranks: half)")
    p.add_argument("--cap", type=int, default=64, help="num_max_tokens_per_rank")
    p.add_argument("--overflow", default="chunk", choices=("error", "chunk"))
    p.add_argument("--transport", default="auto", choices=("auto", "symm", "a2a", "local"))
    p.add_argument("--experts-backend", default="auto")
    p.add_argument("--dispatch-fp8", action="store_true")
    p.add_argument("--mega", default="off", choices=("off", "deep_gemm", "auto"),
                   help="routed step on DeepGEMM's SM90 fused mega-MoE (2+ GPUs)")
    p.add_argument("--dtype", default="fp32", choices=tuple(DTYPES))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--checkpoint", default=None, help="folder of a safetensors checkpoint (written if absent)")
    p.add_argument("--runs", type=int, default=3, help="timed forward calls")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write rank 0's summary here")
    return p.parse_args(argv)


def _init(device: str) -> torch.device:
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _weights(args, cfg, dtype, device, rank):
    """(all experts' weights for the reference, checkpoint path or None)."""
    from moe_ref.weights import MoEWeights

    if args.checkpoint is None:
        return MoEWeights.random(cfg, seed=args.seed, dtype=dtype, device=device), None
    from moe_ref.loading import load_moe_weights
    from moe_ref.synthetic import write_synthetic_checkpoint

    if rank == 0 and not os.path.exists(os.path.join(args.checkpoint, "config.json")):
        write_synthetic_checkpoint(args.checkpoint, cfg, layer_idx=0, seed=args.seed, dtype=torch.bfloat16)
    dist.barrier()
    return load_moe_weights(args.checkpoint, cfg, 0, dtype=dtype, device=device), args.checkpoint


def run(args: argparse.Namespace) -> int:
    from moe_ref.config import preset
    from moe_ref.layer import MegaMoE
    from moe_ref.reference import reference_moe

    device = _init(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, dtype = preset(args.preset), DTYPES[args.dtype]
    full_weights, checkpoint = _weights(args, cfg, dtype, device, rank)
    moe = MegaMoE(cfg, dist.group.WORLD, num_max_tokens_per_rank=args.cap, overflow=args.overflow,
                  transport=args.transport, experts_backend=args.experts_backend, dispatch_fp8=args.dispatch_fp8,
                  dtype=dtype, device=device, mega=args.mega)
    if checkpoint:
        moe.load_hf_weights(checkpoint, layer_idx=0)
    else:
        moe.load_weights(full_weights)
    num_tokens = args.tokens_per_rank if rank % 2 == 0 else args.tokens_per_rank // 2
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    x_TD = torch.randn(num_tokens, cfg.hidden_size, generator=gen).to(dtype=dtype, device=device)

    progress = _progress(args.runs + 1, rank)
    with torch.inference_mode():
        y_TD = moe(x_TD)  # warm-up (allocates the buffer), also the checked output
        progress.update(1)
        times_ms = []
        for _ in range(args.runs):
            dist.barrier()
            _sync(device)
            start = time.perf_counter()
            y_again = moe(x_TD)
            _sync(device)
            times_ms.append((time.perf_counter() - start) * 1e3)
            progress.update(1)
        progress.close()
        ref_TD = reference_moe(x_TD, full_weights, cfg)
    # fp32: elementwise; lower precision: calc_diff (the reference rounds differently, not wrongly).
    fp8 = args.dispatch_fp8 or moe.uses_mega  # the mega kernel is FP8 inside
    tolerance_dtype = torch.float8_e4m3fn if fp8 else dtype
    err = (y_TD.float() - ref_TD.float()).abs()
    if tolerance_dtype == torch.float32:
        atol, rtol = TOLERANCES[torch.float32]
        close = bool((err <= atol + rtol * ref_TD.float().abs()).all())
    else:
        close = calc_diff(y_TD, ref_TD) <= CALC_DIFF_TOLERANCES[tolerance_dtype]
    ok = close and torch.equal(y_TD, y_again)
    mine = dict(rank=rank, num_tokens=num_tokens, ok=ok, bitwise_repeat=bool(torch.equal(y_TD, y_again)),
                max_abs_err=float(err.max()) if err.numel() else 0.0, calc_diff=calc_diff(y_TD, ref_TD),
                recv_rows_per_expert=moe.num_recv_tokens_per_expert.tolist(),
                median_ms=sorted(times_ms)[len(times_ms) // 2] if times_ms else float("nan"))
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    passed = all(r["ok"] for r in everyone)
    # NOTE: engine() reads state built during the calls above (building anything here would be
    # collective, and only rank 0 prints).
    if rank == 0:
        _print_summary(args, cfg, moe, everyone, passed, world)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(args=vars(args), ranks=everyone, passed=passed, engine=_engine(moe)), f, indent=2)
    moe.destroy()
    dist.barrier()
    dist.destroy_process_group()
    return 0 if passed else 1


def _progress(total: int, rank: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="forward calls", disable=rank != 0, file=sys.stdout, ncols=80)


def _engine(moe) -> str:
    """What ran the routed step (from state the calls built)."""
    if moe.uses_mega:
        return f"deep_gemm mega-MoE (FP8), buffer {moe.mega_engine.buffer_bytes} bytes per rank"
    return f"transport={moe.dispatcher.transport_name}, experts={moe.experts.name}"


def _print_summary(args, cfg, moe, ranks, passed, world) -> None:
    max_tokens = max(r["num_tokens"] for r in ranks)
    num_chunks = -(-max_tokens // args.cap) if max_tokens else 1
    print(f"\n== moe_ref.dist_check: {cfg.name} on {world} ranks ({args.device}, {args.dtype}), {_engine(moe)}, "
          f"cap={args.cap}, overflow={args.overflow}")
    if not moe.uses_mega:
        print(moe.dispatcher.plan.report())
    if num_chunks > 1:
        print(f"largest batch {max_tokens} > cap {args.cap}: every rank ran {num_chunks} chunks")
    print(f"\n{'rank':>4} {'tokens':>7} {'recv rows':>10} {'max|err|':>10} {'calc_diff':>10} {'ms/call':>8}  result")
    for r in ranks:
        print(f"{r['rank']:>4} {r['num_tokens']:>7} {sum(r['recv_rows_per_expert']):>10} {r['max_abs_err']:>10.2e} "
              f"{r['calc_diff']:>10.2e} {r['median_ms']:>8.2f}  {'PASS' if r['ok'] else 'FAIL'}")
    loads = [sum(r["recv_rows_per_expert"]) for r in ranks]
    print(f"\nper-rank expert load (rows received over {args.runs + 1} calls): {loads}")
    print(f"per-expert load, rank 0: {ranks[0]['recv_rows_per_expert']}")
    fp8 = args.dispatch_fp8 or moe.uses_mega
    rule = ("elementwise fp32 tolerance" if args.dtype == "fp32" and not fp8 else
            f"calc_diff <= {CALC_DIFF_TOLERANCES[torch.float8_e4m3fn if fp8 else DTYPES[args.dtype]]:g}")
    print(f"\nRESULT: {'PASS' if passed else 'FAIL'} (EP output vs single-process reference: {rule}; "
          f"and a second call bitwise equal)")


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
