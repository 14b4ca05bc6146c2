#!/usr/bin/env python
"""Benchmark the routed step of one EP MoE layer at Kimi-K2 shapes: 2 GPUs (torchrun, NCCL), or one GPU.

    torchrun --standalone --nproc-per-node 2 scripts/bench_layer.py --out results/gpu [--tokens 128 512 4096]
    PYTHONPATH=. python3 scripts/bench_layer.py --out results/gpu1 --num-experts 192 [--tokens 128 512 4096]

Without torchrun (no ``WORLD_SIZE`` in the environment) the script is one plain process on GPU 0: world 1, no
process group (``group=None``), so the moe_ref paths run the ``local`` transport and a2a_grouped_mm's
all_to_all_single calls become local copies; no barrier or all_gather is issued. ``--num-experts 192`` gives that
GPU the experts one rank of the 2-GPU run holds (with uniform routing, the same rows per local expert). Paths that
need 2+ ranks (deep_gemm_mega: DeepGEMM's mega-MoE shares symmetric memory between ranks) report 'not available'
with that reason.

Shapes: 384 experts (192 per rank), top-8, hidden 7168, expert intermediate 2048 (bf16 weights; the
FP8 paths quantize their copy to fp8 with 128x128 block scales once, at build). Tokens per rank: 128, 512, 4096 by default; routing is
uniform random top-8 (distinct experts), weights random, the same inputs for every path.

Paths (each built per token count with cap = that count, so no path pays for an oversized buffer):
    a2a_grouped_mm   NCCL all_to_all_single of counts, rows and local expert ids -> sort by expert ->
                     torch grouped_mm (gate||up) -> SiLU-and-mul (fp32) -> grouped_mm (down) ->
                     all_to_all_single back -> fp32 weighted index_add at the source (bf16, one row per slot)
    moe_ref_triton   moe_ref.ep.routed_step.make_modular_step (auto transport) + make_experts("triton"), bf16 end to end,
                     pool planned with the backend's segment alignment (TritonExperts: 1, no padding rows)
    moe_ref_triton_fp8  the same with dispatch_fp8=True + make_experts("triton", fp8=True): tokens move as fp8
                     e4m3 + per-128 scales and the Triton FP8 grouped MLP takes that pool as is (MegaMoE's
                     dispatch_fp8=True on CUDA)
    deep_gemm_mega   moe_ref.ep.mega_deep_gemm.make_mega_step (DeepGEMM SM90 fused fp8 mega-kernel)
    *_graph          the moe_ref path captured ONCE in a torch.cuda.CUDAGraph (the routed step under capture:
                     the symm transport's device-side kernels, no host sync), each call = copy the inputs into the
                     captured tensors + replay
    a2a_identity     a2a_grouped_mm with the expert GEMMs replaced by identity: plain NCCL dispatch + combine
                     (the anchor for dispatch + combine alone)
    moe_ref_identity the moe_ref routed step with identity experts (dispatch + combine alone, through the public
                     make_modular_step API); *_graph as above
    *_masked         the same over the masked receive pool (pool_format="masked": M = R * cap rows per local expert)
    moe_ref_deep_gemm_fp8[_masked]  the modular step with DeepGEMM experts (fp8 weights, FP8 dispatch, the pool
                     taken as is): its contiguous grouped GEMMs, or its masked GEMMs on the masked pool
DEFAULT_PATHS run by default; --paths names any of PATHS.
A path that cannot be built or fails reports 'not available' with its error; the others still run.

``--replot saved.json --out DIR`` rewrites the markdown and the plot (``bench_layer.png``, with matplotlib) of a
saved run on any machine.

Timing: after warmup, per iteration a cross-rank barrier (none at world 1) + synchronize, then CUDA events around
one call; per rank the median, reported as the max over ranks (the layer is as slow as its slowest rank). Every
path's first output is compared with a2a_grouped_mm's (calc_diff). Rank 0 writes
``<out>/bench_layer.json`` and ``<out>/bench_layer.md`` (rewritten after every path, so a time-out still
leaves the finished rows). The first call of a DeepGEMM or Triton shape compiles kernels (reported as
``first_call_s``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import textwrap
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moe_ref.core.config import MoEConfig  # noqa: E402
from moe_ref.ep.distributed import group_size_and_rank  # noqa: E402
from moe_ref.experts import Experts  # noqa: E402
from moe_ref.testing import calc_diff, graphed  # noqa: E402

DEFAULT_PATHS = ("a2a_grouped_mm", "moe_ref_triton", "moe_ref_triton_graph", "moe_ref_triton_fp8",
                 "moe_ref_triton_fp8_graph", "deep_gemm_mega", "a2a_identity", "moe_ref_identity",
                 "moe_ref_identity_graph")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="EP MoE layer benchmark (2 GPUs under torchrun, or one GPU as a "
                                                 "plain process)")
    parser.add_argument("--out", default="results/gpu", help="folder for bench_layer.json / bench_layer.md")
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 4096], help="tokens per rank")
    parser.add_argument("--num-experts", type=int, default=384,
                        help="experts over all ranks (default 384); on one GPU, 192 is one rank's share of EP 2")
    parser.add_argument("--num-topk", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--paths", nargs="+", default=list(DEFAULT_PATHS), choices=PATHS)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replot", metavar="JSON", help="rewrite the markdown and PNG of a saved bench_layer.json "
                        "into --out, on any machine (no GPU, no torchrun)")
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------------------
# ranks: one code path for torchrun (a process group) and one plain process (world 1, group None)
# ------------------------------------------------------------------------------------------------
# paths that cannot run in one process: (ranks they need, why)
MIN_RANKS = {"deep_gemm_mega": (2, "DeepGEMM's SM90 mega-MoE needs 2+ ranks sharing symmetric memory (in one process "
                                   "moe_ref_deep_gemm_fp8 runs DeepGEMM's grouped GEMMs)")}


def distributed() -> bool:
    """True when this process is in a process group (torchrun); False for one plain process."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def barrier() -> None:
    """A barrier over the ranks; nothing at world 1."""
    if distributed():
        dist.barrier()


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None) -> None:
    """``dist.all_to_all_single``; with no group (one process) every row stays here: a copy."""
    if group is None:
        output.copy_(input)
    else:
        dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group)


# ------------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------------
def make_weights(args, rank: int, num_local: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's bf16 experts: gate_up [e, 2F, D], down [e, D, F] (scaled so outputs stay O(1))."""
    gen = torch.Generator(device=device).manual_seed(args.seed * 1000 + rank)
    D, Fi = args.hidden, args.intermediate
    gate_up = torch.empty(num_local, 2 * Fi, D, dtype=torch.bfloat16, device=device)
    down = torch.empty(num_local, D, Fi, dtype=torch.bfloat16, device=device)
    for i in range(num_local):  # one expert at a time: no fp32 copy of all weights
        gate_up[i] = torch.randn(2 * Fi, D, device=device, generator=gen) * D ** -0.5
        down[i] = torch.randn(D, Fi, device=device, generator=gen) * Fi ** -0.5
    return gate_up, down


def make_inputs(args, rank: int, num_tokens: int, device):
    """x [T, D] bf16, topk ids [T, K] int64 (distinct, uniform), topk weights [T, K] fp32."""
    gen = torch.Generator(device=device).manual_seed(args.seed * 7919 + 31 * rank + num_tokens)
    x = torch.randn(num_tokens, args.hidden, device=device, generator=gen).bfloat16()
    scores = torch.rand(num_tokens, args.num_experts, device=device, generator=gen)
    weights, ids = scores.topk(args.num_topk, dim=-1)
    return x, ids.to(torch.int64), (weights / weights.sum(-1, keepdim=True)).float()


# ------------------------------------------------------------------------------------------------
# paths: each builder returns (fn, cleanup)
# ------------------------------------------------------------------------------------------------
def build_a2a_grouped_mm(args, cfg, group, num_tokens, local_weights, device, *, identity: bool = False):
    grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if grouped_mm is None:
        raise RuntimeError(f"torch {torch.__version__} has no grouped_mm")
    gate_up, down = local_weights
    gate_up_t, down_t = gate_up.transpose(-2, -1), down.transpose(-2, -1)
    world, num_local, Fi, K = group_size_and_rank(group)[0], gate_up.shape[0], args.intermediate, args.num_topk

    def step(x_TD, ids_TK, weights_TK):
        num_tokens_, dim = x_TD.shape
        flat_ids = ids_TK.reshape(-1)
        slot_N = (flat_ids >= 0).nonzero().squeeze(1)
        expert_N = flat_ids[slot_N]
        order = torch.argsort(expert_N, stable=True)
        slot_N, expert_N = slot_N[order], expert_N[order]
        dst_N = expert_N // num_local
        send_counts = torch.bincount(dst_N, minlength=world)
        recv_counts = torch.empty_like(send_counts)
        all_to_all_single(recv_counts, send_counts, group=group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()  # NOTE: host sync
        num_recv = sum(recv_splits)
        recv_x = x_TD.new_empty(num_recv, dim)
        all_to_all_single(recv_x, x_TD[slot_N // K], recv_splits, send_splits, group=group)
        recv_expert = torch.empty(num_recv, dtype=torch.int64, device=x_TD.device)
        all_to_all_single(recv_expert, expert_N - dst_N * num_local, recv_splits, send_splits, group=group)
        perm = torch.argsort(recv_expert, stable=True)
        offs = torch.bincount(recv_expert, minlength=num_local).cumsum(0).to(torch.int32)
        y_recv = recv_x if identity else x_TD.new_empty(num_recv, dim)
        if num_recv and not identity:
            gate_up_rows = grouped_mm(recv_x[perm], gate_up_t, offs=offs)
            h = (F.silu(gate_up_rows[:, :Fi].float()) * gate_up_rows[:, Fi:].float()).bfloat16()
            y_recv[perm] = grouped_mm(h, down_t, offs=offs)
        back = x_TD.new_empty(slot_N.shape[0], dim)
        all_to_all_single(back, y_recv, send_splits, recv_splits, group=group)
        out = torch.zeros(num_tokens_, dim, dtype=torch.float32, device=x_TD.device)
        out.index_add_(0, slot_N // K, back.float() * weights_TK.reshape(-1)[slot_N, None])
        return out.to(x_TD.dtype)

    return step, lambda: None


def build_a2a_identity(args, cfg, group, num_tokens, local_weights, device):
    return build_a2a_grouped_mm(args, cfg, group, num_tokens, local_weights, device, identity=True)


def build_moe_ref(args, cfg, group, num_tokens, local_weights, device, *, backend: str = "triton", fp8: bool = False,
                  pool_format: str = "contiguous", identity: bool = False):
    """The public modular step: ``backend`` experts (with ``fp8``: fp8 weights, and FP8 dispatch, whose pool they take
    as is) over a ``pool_format`` pool."""
    from moe_ref.experts import make_experts
    from moe_ref.ep.options import EPOptions
    from moe_ref.ep.routed_step import make_modular_step

    experts = IdentityExperts(*local_weights) if identity else make_experts(backend, *local_weights, cfg.activation,
                                                                            fp8=fp8)
    options = EPOptions.resolve(num_max_tokens_per_rank=num_tokens, overflow="error", dtype=torch.bfloat16,
                                device=device, dispatch_fp8=fp8, experts_backend=backend,
                                pool_format=pool_format)
    step = make_modular_step(cfg, group, experts, options)
    print(f"[rank {rank()}] moe_ref routed step: transport={step.transport_name}, experts={experts.name}, "
          f"fp8={fp8}, alignment={step.plan.alignment}, pool {pool_format} {step.plan.num_pool_rows} rows, "
          f"buffer {step.plan.total_bytes} bytes", flush=True)
    return step, step.destroy


def modular(**kwargs):
    """A builder of ``build_moe_ref`` with these options."""
    return lambda *args: build_moe_ref(*args, **kwargs)


class IdentityExperts(Experts):
    """y = x: the routed step's dispatch + combine alone (bf16 pool rows returned as they are)."""

    name = "identity"
    segment_alignment = 1

    def forward(self, x_PD, layout, x_scale_PDb=None):
        return x_PD


def graphed_step(builder):
    """``builder``'s step captured once in a CUDA graph (``moe_ref.testing.graphed``); each call copies its inputs in
    and replays."""
    def build(args, cfg, group, num_tokens, local_weights, device):
        step, cleanup = builder(args, cfg, group, num_tokens, local_weights, device)
        static = [t.clone() for t in make_inputs(args, rank(), num_tokens, device)]
        return graphed(step, *static), cleanup

    return build


def build_deep_gemm_mega(args, cfg, group, num_tokens, local_weights, device):
    from moe_ref.ep.mega_deep_gemm import make_mega_step
    from moe_ref.ep.options import EPOptions

    options = EPOptions.resolve(num_max_tokens_per_rank=num_tokens, overflow="error", dtype=torch.bfloat16,
                                device=device, experts_backend="deep_gemm")
    mega = make_mega_step(cfg, group, options, *local_weights)
    print(f"[rank {rank()}] DeepGEMM mega-MoE: symmetric buffer {mega.engine.buffer_bytes} bytes", flush=True)
    return mega, mega.destroy


MODULAR = {  # path -> the options of its modular step
    "moe_ref_triton": {}, "moe_ref_triton_fp8": dict(fp8=True),
    "moe_ref_triton_masked": dict(pool_format="masked"), "moe_ref_triton_fp8_masked": dict(fp8=True, pool_format="masked"),
    "moe_ref_deep_gemm_fp8": dict(backend="deep_gemm", fp8=True),
    "moe_ref_deep_gemm_fp8_masked": dict(backend="deep_gemm", fp8=True, pool_format="masked"),
    "moe_ref_identity": dict(identity=True),
}
BUILDERS = {"a2a_grouped_mm": build_a2a_grouped_mm, "deep_gemm_mega": build_deep_gemm_mega,
            "a2a_identity": build_a2a_identity}
for _name, _options in MODULAR.items():
    BUILDERS[_name] = modular(**_options)
    BUILDERS[f"{_name}_graph"] = graphed_step(modular(**_options))
PATHS = tuple(BUILDERS)  # every path --paths can name


# ------------------------------------------------------------------------------------------------
# measurement
# ------------------------------------------------------------------------------------------------
def all_ok(flag: bool, device) -> bool:
    """True when every rank passes True (so all ranks skip a broken path together); ``flag`` at world 1."""
    if not distributed():
        return flag
    tensor = torch.tensor([0 if flag else 1], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item()) == 0


def time_path(fn, inputs, warmup: int, iters: int, device) -> float:
    """Median microseconds of ``fn(*inputs)`` on this rank, each iteration started after a barrier."""
    for _ in range(warmup):
        fn(*inputs)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*inputs)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def gather_floats(value: float, device) -> list[float]:
    """``value`` of every rank, in rank order; ``[value]`` at world 1."""
    if not distributed():
        return [value]
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor)
    return [float(t.item()) for t in out]


def run_path(name, args, cfg, group, num_tokens, local_weights, inputs, reference, device) -> tuple[dict, object]:
    """Build, check and time one path; every rank returns the same status."""
    row = {"path": name, "tokens_per_rank": num_tokens}
    world = group_size_and_rank(group)[0]
    min_ranks, why = MIN_RANKS.get(name, (1, ""))
    if world < min_ranks:  # the same on every rank: nothing to agree on
        row.update(status="not available", error=f"needs {min_ranks}+ ranks, this run has {world}: {why}")
        return row, None
    output, cleanup, error = None, None, None
    start = time.perf_counter()
    try:
        fn, cleanup = BUILDERS[name](args, cfg, group, num_tokens, local_weights, device)
        row["build_s"] = round(time.perf_counter() - start, 2)
        start = time.perf_counter()
        output = fn(*inputs)
        torch.cuda.synchronize()
        row["first_call_s"] = round(time.perf_counter() - start, 2)
    except Exception as err:  # noqa: BLE001 - a broken path is reported, the bench goes on
        error = f"{type(err).__name__}: {err}"
        print(f"[rank {rank()}] {name} at {num_tokens} tokens failed:\n{traceback.format_exc()}", flush=True)
    if not all_ok(error is None, device):
        row.update(status="not available", error=error or "failed on another rank")
        if cleanup is not None:
            try:
                cleanup()
            except Exception:  # noqa: BLE001
                pass
        return row, None
    diffs = gather_floats(calc_diff(output, reference) if reference is not None else float("nan"), device)
    us = time_path(fn, inputs, args.warmup, args.iters, device)
    per_rank = gather_floats(us, device)
    flops = 2 * 3 * args.hidden * args.intermediate * num_tokens * args.num_topk  # per rank, every slot live
    row.update(status="ok", us=max(per_rank), us_per_rank=per_rank, calc_diff_vs_a2a=max(diffs),
               tflops_per_rank=flops / (max(per_rank) * 1e-6) / 1e12)
    cleanup()
    return row, output


def write_results(out_dir: str, meta: dict, rows: list[dict]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench_layer.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    # identity paths are compared with the NCCL identity anchor, the others with a2a_grouped_mm
    base = {(r["tokens_per_rank"], "identity" in r["path"]): r["us"] for r in rows
            if r["path"] in ("a2a_grouped_mm", "a2a_identity") and r.get("status") == "ok"}
    lines = [f"# EP layer routed step, {meta['ranks']} rank(s): {meta['shape']}", "",
             "| tokens/rank | path | us (max over ranks) | us per rank | TFLOP/s per rank | x vs its a2a anchor | calc_diff vs anchor "
             "| first call s | status |",
             "|---:|---|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r['tokens_per_rank']} | {r['path']} | - | - | - | - | - | - | not available: "
                         f"{str(r.get('error', ''))[:160].replace('|', '/')} |")
            continue
        speedup = base.get((r["tokens_per_rank"], "identity" in r["path"]), float("nan")) / r["us"]
        lines.append(f"| {r['tokens_per_rank']} | {r['path']} | {r['us']:.1f} | "
                     f"{' / '.join(f'{u:.1f}' for u in r['us_per_rank'])} | {r['tflops_per_rank']:.1f} | "
                     f"{speedup:.2f} | {r['calc_diff_vs_a2a']:.2e} | {r.get('first_call_s', '-')} | ok |")
    with open(os.path.join(out_dir, "bench_layer.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot_results(out_dir, meta, rows)


def plot_results(out_dir: str, meta: dict, rows: list[dict]) -> None:
    """``bench_layer.png``: us per call of every path that ran, one group of bars per token count (log scale);
    skipped without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    done = [r for r in rows if r.get("status") == "ok"]
    tokens = sorted({r["tokens_per_rank"] for r in done})
    paths = list(dict.fromkeys(r["path"] for r in done))
    if not done:
        return
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(tokens) * len(paths) / 3), 5))
    width = 0.8 / len(paths)
    for i, path in enumerate(paths):
        us = {r["tokens_per_rank"]: r["us"] for r in done if r["path"] == path}
        ax.bar([t + i * width for t in range(len(tokens))], [us.get(t, 0) for t in tokens], width, label=path)
    ax.set_xticks([t + 0.4 - width / 2 for t in range(len(tokens))], [str(t) for t in tokens])
    ax.set_yscale("log")
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("us per routed step (max over ranks)")
    ax.set_title(textwrap.fill(f"EP routed step, {meta['ranks']} rank(s): {meta['shape']}", 90), fontsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(os.path.join(out_dir, "bench_layer.png"), dpi=120, bbox_inches="tight")
    plt.close(fig)


def init_ranks(args, name: str, timeout: timedelta):
    """This process's GPU, its group and the benchmark's MoE block: ``(device, group, rank, world, cfg)``.

    Under torchrun (``WORLD_SIZE`` set) the NCCL group over every rank; without it one plain process on GPU 0:
    ``group=None``, rank 0, world 1 (the ``local`` transport)."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{name}: needs a CUDA GPU and torch sees none (torch {torch.__version__}, CUDA build "
                         f"{torch.version.cuda or 'none'}); --help works anywhere")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    group = None
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
        group = dist.group.WORLD
    world, _ = group_size_and_rank(group)
    cfg = MoEConfig(num_experts=args.num_experts, num_topk=args.num_topk, hidden_size=args.hidden,
                    intermediate_size=args.intermediate, name=name)
    return device, group, rank(), world, cfg


def finish_ranks() -> None:
    """The end of what ``init_ranks`` started: a last barrier and the group torn down (nothing at world 1)."""
    if distributed():
        dist.barrier()
        dist.destroy_process_group()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replot:
        saved = json.load(open(args.replot))
        write_results(args.out, saved["meta"], saved["rows"])
        return 0
    device, group, rank, world, cfg = init_ranks(args, "bench-layer", timedelta(minutes=10))
    num_local = args.num_experts // world
    meta = {"ranks": world, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "python": platform.python_version(),
            "shape": f"{args.num_experts} experts ({num_local}/rank), top-{args.num_topk}, hidden {args.hidden}, "
                     f"intermediate {args.intermediate}, bf16 (moe_ref_triton_fp8, deep_gemm_mega: fp8)",
            "timing": f"median of {args.iters} after {args.warmup} warmup, "
                      + ("barrier before each, max over ranks" if world > 1 else "one process, no barrier")}
    try:
        from moe_ref.experts.deep_gemm.probe import deep_gemm_status

        meta["deep_gemm"] = deep_gemm_status().__dict__
    except Exception as err:  # noqa: BLE001
        meta["deep_gemm"] = f"{type(err).__name__}: {err}"
    if rank == 0:
        print(f"bench_layer: {meta}", flush=True)
    t0 = time.perf_counter()
    local_weights = make_weights(args, rank, num_local, device)
    if rank == 0:
        print(f"weights ready in {time.perf_counter() - t0:.1f} s", flush=True)
    rows: list[dict] = []
    for num_tokens in args.tokens:
        inputs = make_inputs(args, rank, num_tokens, device)
        reference = identity_reference = None
        for name in args.paths:
            t0 = time.perf_counter()
            expected = identity_reference if "identity" in name else reference
            row, output = run_path(name, args, cfg, group, num_tokens, local_weights, inputs, expected, device)
            if name == "a2a_grouped_mm" and output is not None:
                reference = output
            if name == "a2a_identity" and output is not None:
                identity_reference = output
            rows.append(row)
            if rank == 0:
                print(f"RESULT {json.dumps(row)} ({time.perf_counter() - t0:.1f} s)", flush=True)
                write_results(args.out, meta, rows)
            torch.cuda.empty_cache()
    if rank == 0:
        print(open(os.path.join(args.out, "bench_layer.md")).read(), flush=True)
    finish_ranks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
