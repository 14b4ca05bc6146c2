"""Torchrun harness: does the EP layer give the single-process answer on every rank?

    torchrun --nproc-per-node 2 -m moe_ref.tools.dist_check --preset tiny-kimi-k2
    torchrun --nproc-per-node 2 -m moe_ref.tools.dist_check --device cuda --dtype bf16 --preset kimi-k2 --cap 512

Every rank builds the same weights from one seed (or loads them from a checkpoint, each rank reading only
its experts), feeds its own tokens (uneven counts: odd ranks get half), runs ``MegaMoE`` over the group
and the single-process reference ``reference_moe`` on the same tokens with all experts, and rank 0
prints the capacity plan, per-rank loads, errors, timings and PASS/FAIL (exit code 1 on FAIL).

Rank 0 reports its steps on stderr, and progress bars there on a terminal (``MOE_REF_PROGRESS=1``: always).
Flags are checked before any work (CFG015), the device before the process group (ENV006); the memory estimate
(ENV016, unless ``--skip-memory-check``), the checkpoint write (ENV015) and a ``--checkpoint`` folder holding
another format or model (LOAD016, LOAD017) are decided once and raised on every rank alike. A moe_ref error ends every
rank with one line, ``moe_ref.tools.dist_check: [CODE] ...`` (printed by rank 0), and exit status 2;
``--debug`` or ``MOE_REF_DEBUG=1`` adds the traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

from moe_ref.core import envs
from moe_ref.tools.cli import (
    CommandLineParser,
    check_checkpoint_folder,
    check_demo_memory,
    debug_requested,
    int_at_least,
    require_devices,
    resolve_cap,
    synthetic_config,
)
from moe_ref.core.config import PRESETS
from moe_ref.core.errors import MoERefError, PathNotWritableError
from moe_ref.ep.options import TRANSPORTS
from moe_ref.testing import CALC_DIFF_TOLERANCES, TOLERANCES, calc_diff

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_CAP = 64
NUM_STEPS = 5


def parse_args(argv=None) -> argparse.Namespace:
    p = CommandLineParser(prog="moe_ref.tools.dist_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny-kimi-k2", choices=PRESETS)
    p.add_argument("--tokens-per-rank", type=int_at_least(0), default=96,
                   help="tokens on even ranks (odd ranks: half)")
    p.add_argument("--cap", type=int_at_least(1), default=None,
                   help=f"num_max_tokens_per_rank (default: MOE_REF_NUM_MAX_TOKENS_PER_RANK, else {DEFAULT_CAP})")
    p.add_argument("--overflow", default="chunk", choices=("error", "chunk"))
    p.add_argument("--transport", default="auto", choices=tuple(TRANSPORTS))
    p.add_argument("--experts-backend", default="auto")
    p.add_argument("--dispatch-fp8", action="store_true")
    p.add_argument("--mega", default="off", choices=("off", "deep_gemm", "auto"),
                   help="routed step on DeepGEMM's SM90 fused mega-MoE (2+ GPUs)")
    p.add_argument("--dtype", default="fp32", choices=tuple(DTYPES))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--checkpoint", default=None, help="folder of a safetensors checkpoint (written if absent)")
    p.add_argument("--quant", default=None, choices=("fp8_block", "int4_group", "mxfp4"),
                   help="with --checkpoint: its routed experts in this published format (the preset's sizes rounded "
                        "up to it), loaded as stored; the reference runs the dequantized weights")
    p.add_argument("--runs", type=int_at_least(1), default=3,
                   help="timed forward calls after the checked one (the last is compared bitwise with it)")
    p.add_argument("--seed", type=int_at_least(0), default=0)
    p.add_argument("--json", default=None, help="write rank 0's summary here")
    p.add_argument("--skip-memory-check", action="store_true", help="run even when the memory estimate does not fit")
    p.add_argument("--debug", action="store_true", help="show the traceback of moe_ref errors (or MOE_REF_DEBUG=1)")
    args = p.parse_args(argv)
    if args.quant and args.checkpoint is None:
        p.error("--quant needs --checkpoint (the folder the quantized checkpoint is written to)")
    return args


def _init(device: str) -> torch.device:
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _agreed(fn, rank: int, *, on_every_rank: bool = False) -> None:
    """Run ``fn`` on rank 0 (or on every rank); if it raises a moe_ref error anywhere, EVERY rank raises the
    first failing rank's error (same class, message naming that rank). Collective: also a barrier."""
    failure = None
    if on_every_rank or rank == 0:
        try:
            fn()
        except MoERefError as err:
            failure = (type(err), err.message)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, failure)
    for failed_rank, found in enumerate(gathered):
        if found is not None:
            error_cls, message = found
            raise error_cls(f"rank {failed_rank}: {message}")


def _step(rank: int, number: int, what: str) -> None:
    """Rank 0 says which step it is in (stderr, like the progress bar)."""
    if rank == 0:
        print(f"dist_check [{number}/{NUM_STEPS}] {what}", file=sys.stderr, flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _weights(args, cfg, dtype, device, rank):
    """(all experts' weights for the reference, checkpoint path or None)."""
    from moe_ref.core.weights import MoEWeights

    if args.checkpoint is None:
        _step(rank, 2, "generating seeded random weights (all experts, for the reference)")
        return MoEWeights.random(cfg, seed=args.seed, dtype=dtype, device=device), None
    from moe_ref.checkpoint.loading import load_moe_weights
    from moe_ref.checkpoint.synthetic import write_synthetic_checkpoint

    def write():
        if os.path.exists(os.path.join(args.checkpoint, "config.json")):
            check_checkpoint_folder(args.checkpoint, cfg, args.preset, args.quant)  # read as it is: must match
            return
        _step(rank, 2, f"writing a synthetic {cfg.name} checkpoint to {args.checkpoint}"
                       f"{f' (routed experts in {args.quant})' if args.quant else ''}")
        try:
            write_synthetic_checkpoint(args.checkpoint, cfg, layer_idx=0, seed=args.seed, dtype=torch.bfloat16,
                                       quant=args.quant)
        except OSError as err:
            raise PathNotWritableError(f"--checkpoint {args.checkpoint!r}: cannot write the synthetic checkpoint "
                                       f"({err.strerror or err}: {err.filename or args.checkpoint}); pass a folder "
                                       f"you can write") from None

    _agreed(write, rank)
    if args.quant:
        from moe_ref.checkpoint.quantized import load_dequantized_weights

        _step(rank, 2, f"loading the weights from {args.checkpoint} (all experts dequantized, for the reference)")
        return load_dequantized_weights(args.checkpoint, cfg, 0, dtype=dtype, device=device), args.checkpoint
    _step(rank, 2, f"loading the weights from {args.checkpoint} (all experts, for the reference)")
    return load_moe_weights(args.checkpoint, cfg, 0, dtype=dtype, device=device), args.checkpoint


def run(args: argparse.Namespace) -> int:
    from moe_ref.layer import MegaMoE
    from moe_ref.reference import reference_moe

    args.cap = resolve_cap(args.cap, default=DEFAULT_CAP)
    require_devices(args.device, 1)
    device = _init(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, dtype = synthetic_config(args.preset, args.quant), DTYPES[args.dtype]
    _step(rank, 1, f"checking memory for {cfg.name} on {world} ranks ({args.device}, {args.dtype})")
    if not args.skip_memory_check:
        gpu_index = device.index if device.type == "cuda" else None
        # CPU: one host, rank 0 decides for all; CUDA: each rank checks its own GPU.
        _agreed(lambda: check_demo_memory(cfg, world, args.cap, dtype, gpu_index), rank,
                on_every_rank=gpu_index is not None)
    full_weights, checkpoint = _weights(args, cfg, dtype, device, rank)
    _step(rank, 3, f"building the EP layer (cap {args.cap}, overflow {args.overflow}) and loading this rank's experts")
    moe = MegaMoE(cfg, dist.group.WORLD, num_max_tokens_per_rank=args.cap, overflow=args.overflow,
                  transport=args.transport, experts_backend=args.experts_backend, dispatch_fp8=args.dispatch_fp8,
                  dtype=dtype, device=device, mega=args.mega)
    if checkpoint:
        moe.load_hf_weights(checkpoint, layer_idx=0, progress=rank == 0 and envs.show_progress())
    else:
        moe.load_weights(full_weights)
    num_tokens = args.tokens_per_rank if rank % 2 == 0 else args.tokens_per_rank // 2
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    x_TD = torch.randn(num_tokens, cfg.hidden_size, generator=gen).to(dtype=dtype, device=device)

    _step(rank, 4, f"{args.runs + 1} forward calls on every rank ({num_tokens} tokens on rank {rank})")
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
        _step(rank, 5, "comparing with the single-process reference (all experts on each rank)")
        ref_TD = reference_moe(x_TD, full_weights, cfg)
    # fp32: elementwise; lower precision: calc_diff (the reference rounds differently, not wrongly).
    fp8 = _fp8_path(args, moe)
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

    return tqdm(total=total, desc="forward calls", disable=rank != 0 or not envs.show_progress(), file=sys.stderr,
                ncols=80)


def _engine(moe) -> str:
    """What ran the routed step (from state the calls built)."""
    if moe.uses_mega:
        return f"deep_gemm mega-MoE (FP8), buffer {moe.routed_step.engine.buffer_bytes} bytes per rank"
    return f"transport={moe.routed_step.transport_name}, experts={moe.experts.name}"


def _fp8_path(args, moe) -> bool:
    """Whether FP8 roundings are part of the path (judged with the FP8 tolerance): FP8 dispatch, the mega
    kernel (FP8 inside), or FP8 expert weights (a triton backend's, or an FP8 checkpoint's on triton)."""
    return args.dispatch_fp8 or moe.uses_mega or moe.experts.fp8


def _print_summary(args, cfg, moe, ranks, passed, world) -> None:
    max_tokens = max(r["num_tokens"] for r in ranks)
    num_chunks = -(-max_tokens // args.cap) if max_tokens else 1
    print(f"\n== moe_ref.tools.dist_check: {cfg.name} on {world} ranks ({args.device}, {args.dtype}), {_engine(moe)}, "
          f"cap={args.cap}, overflow={args.overflow}")
    if not moe.uses_mega:
        print(moe.routed_step.plan.report())
    if moe.quantized_experts is not None:
        from moe_ref.checkpoint.formats import expert_weight_bytes

        q = moe.quantized_experts
        plain = expert_weight_bytes(None, q.hidden_size, q.intermediate_size, q.num_experts, DTYPES[args.dtype])
        print(f"routed experts of rank 0: {q.spec.format.value} as stored in the checkpoint, {moe.expert_nbytes()} "
              f"bytes on the device ({plain} in {args.dtype}), run by {moe.experts.name}")
    if num_chunks > 1:
        print(f"largest batch {max_tokens} > cap {args.cap}: every rank ran {num_chunks} chunks")
    print(f"\n{'rank':>4} {'tokens':>7} {'recv rows':>10} {'max|err|':>10} {'calc_diff':>10} {'ms/call':>8}  result")
    for r in ranks:
        print(f"{r['rank']:>4} {r['num_tokens']:>7} {sum(r['recv_rows_per_expert']):>10} {r['max_abs_err']:>10.2e} "
              f"{r['calc_diff']:>10.2e} {r['median_ms']:>8.2f}  {'PASS' if r['ok'] else 'FAIL'}")
    loads = [sum(r["recv_rows_per_expert"]) for r in ranks]
    print(f"\nper-rank expert load (rows received over {args.runs + 1} calls): {loads}")
    print(f"per-expert load, rank 0: {ranks[0]['recv_rows_per_expert']}")
    fp8 = _fp8_path(args, moe)
    rule = ("elementwise fp32 tolerance" if args.dtype == "fp32" and not fp8 else
            f"calc_diff <= {CALC_DIFF_TOLERANCES[torch.float8_e4m3fn if fp8 else DTYPES[args.dtype]]:g}")
    print(f"\nRESULT: {'PASS' if passed else 'FAIL'} (EP output vs single-process reference: {rule}; "
          f"and a second call bitwise equal)")


def main(argv=None) -> int:
    """Run the check; a moe_ref error: one line from rank 0 (traceback with --debug), status 2 on every rank."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = debug_requested(argv, "moe_ref.tools.dist_check")
    if debug is None:
        return 2
    try:
        return run(parse_args(argv))
    except MoERefError as err:
        rank = dist.get_rank() if dist.is_initialized() else envs.launcher_rank()
        if debug:
            traceback.print_exc(file=sys.stderr)
        if rank == 0 or debug:
            print(f"moe_ref.tools.dist_check: {err}", file=sys.stderr, flush=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
