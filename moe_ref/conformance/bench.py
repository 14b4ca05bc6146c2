"""``moe-ref bench``: the conformance harness's speed mode over every implementation this machine runs, on one
model shape at a few token counts: each figure comes with the case's checks passed, beside the others of the run.

    moe-ref bench [--kind moe|experts|dispatch] [--impl NAME ...] [--shape kimi-k2 | <preset>@ep<N>] [--tokens 16,128,512]
                  [--dtype bf16] [--quant none|fp8_block|int4|mxfp4] [--ranks 1] [--device cpu|cuda]
                  [--timer events|graph|kernels] [--jsonl F] [--table F]
    moe-ref bench --auto-table [OUT] [--install] [--max-seconds 480]   # experts_backend="auto"'s table, this GPU

Each implementation runs the speed case ``<shape>/<recipe>/T<n>`` (``scenarios.speed_case``: n tokens on every
rank, routed as the matrix's ``base``) for each n: first every check of a matrix case (the float64 oracle, re-run
bits, permuted rows, a token alone, the poisoned and guarded output), then ``SPEED_ITERS`` timed calls. A case that
fails a check is reported FAIL with no time, and the command exits 1.

``--timer`` says what a time is (``runner.TIMERS``; the table's title names it): ``events`` (default) the wall time
of each call, host work included (CUDA events, L2 flushed; the wall clock on CPU); ``graph`` the call captured in a
CUDA graph and replayed, for the implementations that declare ``graph_safe`` (the others SKIP); ``kernels`` the GPU
time of the call's kernels from the profiler, as DeepGEMM's tests time theirs (kernel-only rows). On a GPU the run
first measures its anchors, HBM copy bandwidth and the bf16 GEMM peak (``moe_ref.bench.timing.measure_anchors``),
and each row shows its fraction of that roofline: max(bytes / HBM bandwidth, FLOPs / peak) over its time, with the
peak doubled for the ``fp8_block`` recipe (an estimate, not measured).

``--kind dispatch`` compares the transports' dispatch + combine instead (``dispatch_combine`` implementations, the
rows checked exactly; GB/s counts each live slot's row sent and sent back). ``--kind experts`` compares the expert
MLPs alone (``pool_experts``: kernel-only rows): moe_ref's backends and the peers' kernels on the same 128-aligned
pool of the case's routed rows, no routing and no top-k sum. ``--auto-table`` measures ``experts_backend="auto"``'s
table for this GPU class from such cases (``moe_ref.conformance.auto_table``).

Defaults: on a GPU, Kimi-K2's routed experts of one rank at EP 8 (48 experts, D 7168, F 2048, top-8) in bf16 at
T = 16, 128, 512 and 4096; on CPU the tiny shape in fp32 at T = 24 and 96. Implementations: every registered one of
kind ``experts`` or ``routed_step`` that runs the case here (``skip_reason``), not a mutant nor the docs' example:
moe_ref's backends through its routed step (dispatch, experts, combine: the path the layer calls) and the peers'
fused-MoE kernels when their files are in ``.whl/`` (``make peers``). The experts are SiLU-gated MLPs of the shape's
widths, whatever the preset's activation.
"""
from __future__ import annotations

import argparse
import json
import re
import sys

import torch

from moe_ref.conformance.mutants import CORRECT_BASES, MUTANT_NAMES
from moe_ref.conformance.registry import registered, resolve
from moe_ref.conformance.report import record
from moe_ref.conformance.runner import TIMERS, skip_reason
from moe_ref.conformance.scenarios import Case, speed_case, speed_tokens
from moe_ref.conformance.spawn import run_jobs
from moe_ref.core.errors import CommandLineError, ConformanceImplError, DeviceUnavailableError

DEFAULTS = {"cuda": ("kimi-k2", "bf16", (16, 128, 512, 4096)), "cpu": ("tiny", "fp32", (24, 96))}
# --kind: the implementation kinds one table compares
COMPARED_KINDS = {"moe": ("experts", "routed_step"), "experts": ("pool_experts",), "dispatch": ("dispatch_combine",)}
# the harness's own: the planted bugs and their correct base (``mutants``), the docs' worked example
NOT_BENCHED = (*CORRECT_BASES, *MUTANT_NAMES, "example:sglang-style")
# implementations that search their config per case before it is checked and timed (minutes per case): benched when
# named, or with --tune-peers
TUNED_SUFFIX = "+tuned"


def add_arguments(p: argparse.ArgumentParser, count=int) -> None:
    """``moe-ref bench``'s flags; ``count``: the argparse type of a positive integer (the command line's, whose
    errors are coded)."""
    p.add_argument("--impl", action="append", default=[],
                   help="a registered name or module:attribute (repeatable; default: every one that runs here)")
    p.add_argument("--kind", default="moe", choices=tuple(COMPARED_KINDS),
                   help="moe: fused-MoE kernels and routed steps (default); experts: the expert MLPs alone on one "
                        "pool (kernel-only rows); dispatch: dispatch + combine alone")
    p.add_argument("--shape", default=None, help="a named shape (moe-ref conform --list) or <preset>@ep<N>; "
                                                 "default kimi-k2 on a GPU, tiny on CPU")
    p.add_argument("--tokens", default=None, type=lambda text: tuple(count(t) for t in re.split(r"[ ,]+", text) if t),
                   help="comma-separated tokens per rank (default 16,128,512,4096 on a GPU, 24,96 on CPU)")
    p.add_argument("--dtype", default=None, choices=("fp32", "bf16", "fp16"))
    p.add_argument("--quant", default="none", choices=("none", "fp8_block", "int4", "mxfp4"))
    p.add_argument("--ranks", type=count, default=1, help="rank processes (gloo on CPU, NCCL on GPUs)")
    p.add_argument("--device", default=None, choices=("cpu", "cuda"), help="default: cuda when present")
    p.add_argument("--timer", default="events", choices=tuple(TIMERS),
                   help="events: wall time per call, host included (default); graph: replayed from a CUDA graph "
                        "(graph_safe implementations); kernels: the GPU time of the call's kernels (profiler)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline", type=float, default=600.0, help="seconds per case before it is a hang (FAIL)")
    p.add_argument("--jsonl", default=None, help="one JSON record per (implementation, T), as conform writes")
    p.add_argument("--table", default=None, help="the markdown table, also printed")
    p.add_argument("--tune-peers", action="store_true",
                   help="also the peers at their best (peer:*+tuned), beside the defaults or the --impl ones: each "
                        "searches its own tuner's space for each case first (at most 50 configs: minutes per case "
                        "on a GPU)")
    p.add_argument("--auto-table", nargs="?", const="results/auto_table.json", default=None, metavar="OUT",
                   help="measure experts_backend='auto''s table for this GPU class instead (moe_ref.conformance."
                        "auto_table; default OUT results/auto_table.json)")
    p.add_argument("--install", action="store_true",
                   help="with --auto-table: write the package's table (moe_ref/experts/auto_table.json)")
    p.add_argument("--max-seconds", type=float, default=480.0,
                   help="with --auto-table: start no measurement after this many seconds; write what finished")


def default_impls(cases, world: int, device: str, kinds: tuple[str, ...], tuned: bool = False) -> list[str]:
    """Every registered implementation of ``kinds`` that runs at least one of ``cases`` here (``tuned``: the
    ``+tuned`` ones too)."""
    chosen = []
    for name, impl in sorted(registered().items()):
        if impl.kind in kinds and name not in NOT_BENCHED and (tuned or not name.endswith(TUNED_SUFFIX)) and \
                any(skip_reason(impl, case, world, device) is None for case in cases):
            chosen.append(impl.spec or name)
    return chosen


def roofline(rec: dict, anchors: dict, fp8: bool) -> float:
    """The fraction of this GPU's roofline a timed record reaches: ``moe_ref.bench.timing.roofline_s`` of what it moves
    and computes in one second of its time (its GB/s and TFLOP/s), on the run's ``anchors``; ``fp8``: the peak doubled
    (an estimate). Example: 1500 GB/s and 300 TFLOP/s on 3000 GB/s and 800 TFLOP/s -> max(0.5, 0.375) = 0.5."""
    from moe_ref.bench.timing import roofline_s

    return roofline_s(rec["GB/s"] * 1e9, (rec["TFLOP/s"] or 0.0) * 1e12, anchors, fp8)[0]


def table(records: list[dict], flops: bool = True) -> str:
    """One row per (implementation, T): status, us, TFLOP/s (``flops``), GB/s, the fraction of the roofline (when
    the records carry one: a GPU run) and the time over the fastest at that T."""
    best = {}
    for r in records:
        if r["status"] == "PASS" and r["us"]:
            best[r["case"]] = min(best.get(r["case"], r["us"]), r["us"])
    with_roofline = any(r.get("roofline") is not None for r in records)
    columns = ["implementation", "T", "status", "us"] + (["TFLOP/s"] if flops else []) + ["GB/s"] + \
        (["roofline"] if with_roofline else []) + ["x fastest"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" if c in ("implementation", "status") else "---:"
                                                            for c in columns) + "|"]
    for r in sorted(records, key=lambda r: (int(r["case"].rsplit("/T", 1)[1]), r["us"] or float("inf"))):
        timed = r["status"] == "PASS" and r["us"]
        status = r["status"] + ("" if r["status"] == "PASS" else f": {r['reason'][:80]}")
        numbers = [f"{r['us']:,.1f}"] + ([f"{r['TFLOP/s']:.3g}"] if flops else []) + [f"{r['GB/s']:.3g}"] + \
            ([f"{r['roofline']:.2f}" if r.get("roofline") is not None else "-"] if with_roofline else []) + \
            [f"{r['us'] / best[r['case']]:.2f}"] if timed else ["-"] * (len(columns) - 3)
        lines.append(f"| {r['impl']}@{r['ranks']} | {r['case'].rsplit('/T', 1)[1]} | {status} | {' | '.join(numbers)} |")
    return "\n".join(lines)


def _timer_skip(impl, timer: str) -> str | None:
    """Why ``impl`` is not timed by ``timer`` (only ``graph_safe`` ones are captured), or None."""
    if timer == "graph" and not impl.caps.graph_safe:
        return "not graph_safe (Capabilities.graph_safe): --timer graph times only calls that can be captured"
    return None


def bench_cases(args) -> tuple[str, list[Case]]:
    """``(device, the speed cases)`` the flags ask for (defaults by device: ``DEFAULTS``)."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    shape, dtype, tokens = DEFAULTS[device]
    shape, dtype, tokens = args.shape or shape, args.dtype or dtype, args.tokens or tokens
    return device, [speed_case(shape, dtype, args.quant, t, args.seed) for t in tokens]


def memory_bytes(case: Case, world: int) -> int:
    """Bytes one rank process holds at least: every expert of the case made in fp32 on its device, then in the
    case's dtype (the cached ``global_weights``), and the implementation's copy of its own experts."""
    s = case.shape
    per_expert = 3 * s.hidden * s.intermediate
    itemsize = case.torch_dtype.itemsize
    return per_expert * (s.experts_per_rank * world * (4 + itemsize) + s.experts_per_rank * itemsize)


def run(args, device: str, cases: list[Case]) -> int:
    """Check then time each implementation on each case; print the table (exit 1 when a case FAILs); or, with
    ``--auto-table``, measure and write the auto table."""
    if args.auto_table is not None:
        from moe_ref.conformance import auto_table

        if args.timer != "events":
            raise CommandLineError(f"moe-ref bench --auto-table --timer {args.timer}: the table picks the backend a "
                                   f"call runs fastest with, host work included, so it is measured with the default "
                                   f"timer; leave --timer out")

        return auto_table.run(args)
    if args.install:
        raise CommandLineError("moe-ref bench: --install writes the auto table, so it needs --auto-table: give "
                               "`moe-ref bench --auto-table --install`, or leave --install out")
    if args.timer != "events" and device != "cuda":
        raise DeviceUnavailableError(f"moe-ref bench --timer {args.timer} times CUDA work ({TIMERS[args.timer]}); "
                                     f"on {device}, leave --timer out (the wall clock)")
    tokens = [speed_tokens(c.scenario) for c in cases]
    kinds = COMPARED_KINDS[args.kind]
    specs = list(args.impl) or default_impls(cases, args.ranks, device, kinds)
    if args.tune_peers:  # beside the defaults or the named ones
        specs += [name for name in default_impls(cases, args.ranks, device, kinds, tuned=True)
                  if name.endswith(TUNED_SUFFIX) and name not in specs]
    if not specs:
        why = {skip_reason(impl, cases[0], args.ranks, device) for impl in registered().values()
               if impl.kind in COMPARED_KINDS[args.kind] and impl.name not in NOT_BENCHED}
        raise ConformanceImplError(f"no registered implementation runs {cases[0].id.rsplit('/', 1)[0]} at "
                                   f"{args.ranks} rank(s) on {device} ({'; '.join(sorted(why - {None}))}); give "
                                   f"another --shape, --dtype, --quant or --ranks, or --impl your own")
    impls = [resolve(spec) for spec in specs]
    s = cases[0].shape
    title = (f"moe-ref bench: {cases[0].id.rsplit('/', 1)[0]} ({s.experts_per_rank} experts per rank, top-{s.topk}, "
             f"D {s.hidden}, F {s.intermediate}) at T {', '.join(map(str, tokens))} per rank, {args.ranks} rank(s) on "
             f"{device}; each time after the case's checks passed. Times (`--timer {args.timer}`): "
             f"{TIMERS[args.timer] if device == 'cuda' else 'the wall clock per call (median)'}.")
    print(title, flush=True)
    anchors = None
    if device == "cuda":
        from moe_ref.bench.timing import measure_anchors

        anchors = measure_anchors(quick=True)
        torch.cuda.empty_cache()
        title += (f" Anchors of this run: HBM copy {anchors['hbm_bytes_per_s'] / 1e12:.2f} TB/s (read + write), bf16 "
                  f"GEMM 8192^3 {anchors['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s.")
        print(title.rsplit(". ", 1)[-1], flush=True)
    skips = {(impl.name, c.id): skip_reason(impl, c, args.ranks, device) or _timer_skip(impl, args.timer)
             for impl in impls for c in cases}
    by_spec = {impl.spec or impl.name: impl for impl in impls}
    cases_by_id = {c.id: c for c in cases}
    jobs = [(impl.spec or impl.name, c.id) for c in cases for impl in impls if not skips[(impl.name, c.id)]]

    def report(job, merged) -> None:  # as each case finishes: the long runs show progress
        impl = by_spec[job[0]]
        rec = record(impl, cases_by_id[job[1]], args.ranks, device, merged, None)
        shown = f"{rec['us']:,.1f} us, {rec['GB/s']:.3g} GB/s" if rec["us"] else rec["reason"][:200]
        shown += f" (tuned first, {rec['tune_s']:.0f} s)" if rec["tune_s"] is not None else ""
        shown += "".join(f"\n      {us:9.1f} us  {name[:100]}" for name, us in list(rec.get("kernels", {}).items())[:6])
        print(f"  {impl.name} T={job[1].rsplit('/T', 1)[1]}: {rec['status']} {shown}", file=sys.stderr, flush=True)

    done = run_jobs(jobs, args.ranks, device, args.deadline, args.seed, timer=args.timer, on_done=report)
    records = []
    for impl in impls:
        for c in cases:
            rec = record(impl, c, args.ranks, device, done.get((impl.spec or impl.name, c.id)), skips[(impl.name, c.id)])
            rec["timer"], rec["anchors"] = args.timer, anchors
            if anchors is not None and rec["us"] and args.kind != "dispatch":
                fp8 = "fp8_block" in (c.quant, impl.caps.compute)
                rec["roofline"] = round(roofline(rec, anchors, fp8), 3)
            records.append(rec)
    text = table(records, flops=args.kind != "dispatch")
    print(text)
    if args.table:
        with open(args.table, "w") as f:
            f.write(title + "\n\n" + text + "\n")
    if args.jsonl:
        with open(args.jsonl, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    failed = [r["id"] for r in records if r["status"] == "FAIL"]
    for r in records:
        if r["status"] == "FAIL":
            print(f"FAIL {r['id']}: {r['reason'][:300]}\n  REPRO: {r['repro']}", file=sys.stderr)
    return 1 if failed else 0
