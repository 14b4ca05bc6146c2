#!/usr/bin/env python
"""The public layer's first calls on one GPU: what a serving loop whose token count changes call to call pays.

    PYTHONPATH=. python3 scripts/bench_warmup.py --out results/warmup [--sequences walk256 uniform512 fixed64]

``MegaMoE`` (one process, Kimi-K2's per-rank share: 48 experts, top-8, H 7168, F 2048, one shared expert, bf16,
Triton experts, cap 512) is called ``--calls`` times with T drawn per call from a sequence (seed 0), then the same
sequence again. Each (sequence, mode) runs in a fresh process after one process has compiled every kernel (Triton's
disk cache is warm, as on a serving host after its first start). Modes: ``default`` (the layer as built by default:
eager graphs per T, the grouped MLP's tiles from the recorded table of this GPU class), ``launch``
(``eager_graph_max_tokens=0``) and ``autotune`` (the default layer with ``MOE_REF_AUTOTUNE=1``: the tiles autotuned at
the first call of each rows bucket, as before the table). Per pass: mean wall us per call (one sync at the
end), the calls that captured a graph and their host ms, the layer's reserved memory. ``--profile`` adds a cProfile
of the first capture (``cprofile_capture.txt``). Writes ``bench_warmup.json`` and ``bench_warmup.md`` under ``--out``.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import os
import pstats
import random
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moe_ref import MegaMoE  # noqa: E402
from moe_ref.core.config import preset  # noqa: E402

SEQUENCES = ("walk256", "uniform512", "fixed64")
MODES = ("default", "launch", "autotune")


def token_counts(name: str, calls: int, seed: int = 0) -> list[int]:
    """The T of each call: a random walk in [1, 256], uniform in [1, 512], or 64 every call."""
    rng = random.Random(seed)
    if name == "fixed64":
        return [64] * calls
    if name == "uniform512":
        return [rng.randint(1, 512) for _ in range(calls)]
    counts, t = [], 64
    for _ in range(calls):
        t = min(256, max(1, t + rng.randint(-8, 8)))
        counts.append(t)
    return counts


def build_layer(mode: str, cap: int) -> MegaMoE:
    cfg = dataclasses.replace(preset("kimi-k2"), num_experts=48, name="kimi-k2/48")
    return MegaMoE(cfg, None, num_max_tokens_per_rank=cap, dtype=torch.bfloat16, device="cuda", seed=0,
                   experts_backend="triton", eager_graph_max_tokens=0 if mode == "launch" else None)


def _captures(moe: MegaMoE) -> int:
    """Graphs the layer captured so far (its eager graphs are built at its first call, or never)."""
    graphs = moe.eager_graphs
    return graphs.captures if graphs is not None else 0


def run_pass(moe: MegaMoE, xs: dict[int, torch.Tensor], counts: list[int], profile_to: str | None) -> dict:
    """One pass over ``counts``: mean wall us per call (one sync at the end), the calls that captured a graph."""
    capture_ms, first_call_ms, seen = [], [], set()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for num_tokens in counts:
        before = _captures(moe)
        graphs = moe.eager_graphs
        about_to_capture = (graphs is not None and num_tokens in graphs._seen and num_tokens not in graphs._graphs)
        t0 = time.perf_counter()
        if profile_to is not None and about_to_capture:
            profiler = cProfile.Profile()
            profiler.enable()
            moe(xs[num_tokens])
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
            with open(profile_to, "w") as f:
                f.write(text.getvalue())
            profile_to = None
        else:
            moe(xs[num_tokens])
        spent_ms = (time.perf_counter() - t0) * 1e3
        if _captures(moe) > before:
            capture_ms.append(spent_ms)
        if num_tokens not in seen:
            first_call_ms.append(spent_ms)
            seen.add(num_tokens)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return {"mean_us": wall / len(counts) * 1e6, "captures": len(capture_ms),
            "capture_ms_mean": sum(capture_ms) / len(capture_ms) if capture_ms else 0.0,
            "capture_ms_total": sum(capture_ms), "first_call_of_t_ms_max": max(first_call_ms),
            "first_call_of_t_ms_total": sum(first_call_ms), "reserved_mib": torch.cuda.memory_reserved() / 2**20}


def time_graph_methods() -> dict[str, list[float]]:
    """Wrap ``torch.cuda.CUDAGraph.capture_begin`` / ``capture_end`` with host timers: ms of each call, by name."""
    spent: dict[str, list[float]] = {"capture_begin": [], "capture_end": []}
    for name in spent:
        original = getattr(torch.cuda.CUDAGraph, name)

        def timed(self, *a, _original=original, _name=name, **k):
            t0 = time.perf_counter()
            try:
                return _original(self, *a, **k)
            finally:
                spent[_name].append((time.perf_counter() - t0) * 1e3)
        setattr(torch.cuda.CUDAGraph, name, timed)
    return spent


def worker(args) -> dict:
    spent = time_graph_methods() if args.profile else {}
    counts = token_counts(args.sequence, args.calls)
    moe = build_layer(args.mode, cap=512)
    torch.manual_seed(0)
    xs = {t: torch.randn(t, 7168, device="cuda", dtype=torch.bfloat16) for t in sorted(set(counts))}
    base_mib = torch.cuda.memory_reserved() / 2**20
    # the layer's very first call builds its routed step, buffers and experts (hundreds of ms, once per layer):
    # timed on its own, so the passes measure what a new T costs
    start = time.perf_counter()
    moe(xs[counts[0]])
    torch.cuda.synchronize()
    build_ms = (time.perf_counter() - start) * 1e3
    profile_to = os.path.join(args.out, "cprofile_capture.txt") if args.profile and args.mode == "default" else None
    first = run_pass(moe, xs, counts, profile_to)
    second = run_pass(moe, xs, counts, None)
    return {"sequence": args.sequence, "mode": args.mode, "calls": args.calls, "distinct_t": len(set(counts)),
            "first": first, "second": second, "reserved_before_calls_mib": base_mib, "layer_first_call_ms": build_ms,
            **{f"{name}_ms_mean": sum(v) / len(v) for name, v in spent.items() if v}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="results/warmup")
    parser.add_argument("--sequences", nargs="+", default=list(SEQUENCES), choices=SEQUENCES)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--sequence", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.sequence:  # one case in this process
        print("ROW " + json.dumps(worker(args)), flush=True)
        return 0
    me = [sys.executable, os.path.abspath(__file__), "--out", args.out, "--calls", str(args.calls)]
    # compile every kernel once, so each measured process starts with Triton's disk cache warm
    # (with the recorded tiles, and with every tile the autotuner tries where the autotune mode is measured)
    for autotune in ("0", "1") if "autotune" in args.modes else ("0",):
        subprocess.run(me + ["--sequence", "uniform512", "--mode", "launch", "--calls", "600"], check=True,
                       stdout=subprocess.DEVNULL, env=dict(os.environ, MOE_REF_AUTOTUNE=autotune))
    rows = []
    for sequence in args.sequences:
        for mode in args.modes:
            extra = ["--profile"] if args.profile else []
            env = dict(os.environ, MOE_REF_AUTOTUNE="1" if mode == "autotune" else "0")
            out = subprocess.run(me + ["--sequence", sequence, "--mode", mode] + extra, check=True,
                                 capture_output=True, text=True, env=env).stdout
            row = json.loads(next(line[4:] for line in out.splitlines() if line.startswith("ROW ")))
            print(json.dumps(row), flush=True)
            rows.append(row)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "calls": args.calls}
    with open(os.path.join(args.out, "bench_warmup.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [f"# First calls of the public layer ({meta['gpu']}, torch {meta['torch']}, triton {meta['triton']})", "",
             "| sequence | distinct T | mode | layer's first call ms | 1st pass us/call | 2nd pass us/call | 1st / 2nd | "
             "captures | ms per capture | 1st pass: first calls of each T, ms (max) | reserved MiB |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        first, second = r["first"], r["second"]
        lines.append(f"| {r['sequence']} | {r['distinct_t']} | {r['mode']} | {r['layer_first_call_ms']:.0f} | "
                     f"{first['mean_us']:.0f} | "
                     f"{second['mean_us']:.0f} | {first['mean_us'] / second['mean_us']:.2f} | "
                     f"{first['captures']} + {second['captures']} | {first['capture_ms_mean']:.1f} | "
                     f"{first['first_call_of_t_ms_total']:.0f} ({first['first_call_of_t_ms_max']:.0f}) | "
                     f"{second['reserved_mib']:.0f} |")
    with open(os.path.join(args.out, "bench_warmup.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
