#!/usr/bin/env python
"""The public layer on one GPU: eager calls against the CUDA-graph routes, and where an eager call's host time goes.

    PYTHONPATH=. python3 scripts/bench_eager.py --out results/eager [--tokens 16 128 1024] [--profile]
        [--weights random int4_group mxfp4 fp8_block] [--checkpoint-dir DIR]

``MegaMoE`` (one process, ``group=None``: the ``local`` transport) at a per-rank share of Kimi-K2 (48 experts,
top-8, H 7168, F 2048, one shared expert, bf16, Triton experts), bf16 and FP8 dispatch. Per T (cap = the largest T):
- ``eager_wall_us``: back-to-back eager calls, until the GPU is done; ``eager_host_us``: until Python returns
  (equal when the host is the bottleneck); each the median of ``--repeats`` runs of ``--calls`` calls. The layer as
  built by default: from T's second call on, an eager call replays the CUDA graph the layer captured for T
  (``moe_ref.eager_graphs``, T <= ``eager_graph_max_tokens``);
- ``eager_launches_*``: the same eager calls of a layer built with ``eager_graph_max_tokens=0`` (every kernel
  launched from Python each call; same weights), timed run by run alternating with the first;
- ``graph_us``: the same call captured once in a ``torch.cuda.CUDAGraph`` (inputs copied in, replay);
- ``compile_us``: ``torch.compile(moe, mode="reduce-overhead", fullgraph=True)`` (its own CUDA graph);
- with ``--profile``: kernel launches, host synchronizations and device-to-host copies per eager call (torch
  profiler runtime events), the Python lines that synchronized (``torch.cuda.set_sync_debug_mode``), and the
  functions the host time goes to (cProfile, ``cprofile_<dispatch>_<T>.txt``).
Every route's output is compared with the eager call's (bitwise). Writes ``bench_eager.json``, ``bench_eager.md`` and
``bench_eager.png`` (with matplotlib).

``--weights`` picks the expert weights: ``random`` (bf16, drawn from the seed), or a published checkpoint format
(``fp8_block``, ``int4_group``, ``mxfp4``): a synthetic checkpoint of the same share in that format is written once
under ``--checkpoint-dir`` (``moe_ref.checkpoint.synthetic``; ~1-4 GB, some minutes of CPU) and loaded the way a user
loads theirs (``MegaMoE.load_hf_weights``: the experts kept as stored, run by the quantized kernels). With several,
the markdown gives each route's speed-up over the ``random`` layer of the same dispatch and T.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moe_ref import MegaMoE  # noqa: E402
from moe_ref.bench.timing import RUNTIME_KINDS, cprofile_text, host_and_wall_us  # noqa: E402
from moe_ref.checkpoint.synthetic import quantizable_config, write_synthetic_checkpoint  # noqa: E402
from moe_ref.core.config import preset  # noqa: E402
from moe_ref.kernels.runtime.launch import bound_launches  # noqa: E402
from moe_ref.testing import graphed, sync_debug_mode  # noqa: E402

WEIGHTS = ("random", "fp8_block", "int4_group", "mxfp4")  # --weights: random bf16, or a checkpoint format
CHECKPOINT_LAYER = 1  # the synthetic checkpoints' MoE layer (layer 0 dense, as Kimi-K2's first_k_dense_replace)
LAUNCHES = RUNTIME_KINDS["kernel launches"]
SYNCS = RUNTIME_KINDS["synchronizations"]
COPIES = RUNTIME_KINDS["copies (memcpy)"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="results/eager")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 128, 1024])
    parser.add_argument("--num-experts", type=int, default=48)
    parser.add_argument("--dispatch", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    parser.add_argument("--routes", nargs="+", default=["eager", "eager_launches", "graph", "compile"],
                        choices=["eager", "eager_launches", "graph", "compile"])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of --calls calls; the median is reported")
    parser.add_argument("--ab-bound-launch", action="store_true",
                        help="also time the eager_launches calls on Triton's own launch path "
                             "(bound launches off, as MOE_REF_BOUND_LAUNCH=0), the two alternating run by run in this "
                             "process")
    parser.add_argument("--profile", action="store_true", help="launches, syncs, sync sites and a cProfile")
    parser.add_argument("--weights", nargs="+", default=["random"], choices=WEIGHTS,
                        help="the experts' weights: random bf16, or a synthetic checkpoint in a published format")
    parser.add_argument("--checkpoint-dir", default=os.path.join(tempfile.gettempdir(), "moe_ref_bench_eager"),
                        help="where the synthetic checkpoints are written (once per format; not under --out: GBs)")
    return parser.parse_args(argv)


def share_config(args):
    """Kimi-K2 with ``--num-experts`` experts: one rank's share."""
    return dataclasses.replace(preset("kimi-k2"), num_experts=args.num_experts, name=f"kimi-k2/{args.num_experts}")


def checkpoint_folder(cfg, fmt: str, root: str) -> str:
    """A synthetic checkpoint of layer ``CHECKPOINT_LAYER`` of ``cfg`` in format ``fmt`` under ``root``, written on
    the first call and reused after (written beside, then renamed: a folder of that name is always whole)."""
    folder = os.path.join(root, f"{cfg.name.replace('/', '_')}_{fmt}")
    if not os.path.isdir(folder):
        started = time.perf_counter()
        print(f"writing a {fmt} checkpoint of {cfg.name} into {folder} ...", flush=True)
        os.makedirs(root, exist_ok=True)
        partial = tempfile.mkdtemp(prefix=os.path.basename(folder) + ".", dir=root)
        write_synthetic_checkpoint(partial, cfg, layer_idx=CHECKPOINT_LAYER, quant=fmt, seed=0, dtype=torch.bfloat16)
        os.replace(partial, folder)
        print(f"  written in {time.perf_counter() - started:.0f} s", flush=True)
    return folder


def layer_options(dispatch: str, cap: int, **options) -> dict:
    """Every layer's keyword arguments here: bf16 on one GPU, Triton experts, ``dispatch``, cap, and ``options``."""
    return dict(num_max_tokens_per_rank=cap, dtype=torch.bfloat16, device="cuda", experts_backend="triton",
                dispatch_fp8=dispatch == "fp8", **options)


def build_layer(args, dispatch: str, cap: int, weights: str = "random", **options) -> MegaMoE:
    """The layer at ``share_config`` with ``weights`` (see the module docstring), Triton experts."""
    cfg = share_config(args)
    if weights == "random":
        return MegaMoE(cfg, None, seed=0, **layer_options(dispatch, cap, **options))
    cfg = quantizable_config(cfg, weights)
    folder = checkpoint_folder(cfg, weights, args.checkpoint_dir)
    return MegaMoE(cfg, None, **layer_options(dispatch, cap, **options)).load_hf_weights(folder,
                                                                                       layer_idx=CHECKPOINT_LAYER)


def sync_sites(fn, x) -> list[str]:
    """The Python lines (innermost moe_ref frame, and its caller) that synchronized during one call."""
    sites: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "moe_ref" in f.filename or "scripts" in f.filename]
        where = " <- ".join(f"{os.path.relpath(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames[-3:]))
        sites.append(f"{str(message).splitlines()[0][:60]} at {where}")

    torch.cuda.synchronize()
    saved = warnings.showwarning
    warnings.showwarning = record
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            with sync_debug_mode("warn"):
                fn(x)
    finally:
        warnings.showwarning = saved
    torch.cuda.synchronize()
    return sites


def runtime_counts(fn, x, calls: int = 5) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(x)
        torch.cuda.synchronize()
    counts = {"launches": 0, "graph_launches": 0, "copies": 0, "syncs": 0, "d2h_pageable": 0, "gpu_busy_us": 0.0}
    kernels: dict[str, int] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in event.name:
            kernels[event.name[:70]] = kernels.get(event.name[:70], 0) + 1
        if event.name in LAUNCHES:
            counts["launches"] += 1
        elif event.name == "cudaGraphLaunch":
            counts["graph_launches"] += 1
        elif event.name in COPIES:
            counts["copies"] += 1
        elif event.name in SYNCS:
            counts["syncs"] += 1
        elif "Device -> Pageable" in event.name:
            counts["d2h_pageable"] += 1
        if event.device_type == torch.autograd.DeviceType.CUDA:
            counts["gpu_busy_us"] += event.time_range.elapsed_us()
    counts = {k: round(v / calls, 1) for k, v in counts.items()}
    counts["host_ops_table"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=50)
    counts["kernels"] = {name: n / calls for name, n in sorted(kernels.items(), key=lambda kv: -kv[1])}
    return counts


# the eager_launches calls timed on Triton's own launch path (--ab-bound-launch)
TRITON_LAUNCH = "eager_launches_triton_launch"


@contextlib.contextmanager
def launch_path(name: str):
    """Bound launches off inside (``moe_ref.kernels.runtime.launch.bound_launches(False)``, as ``MOE_REF_BOUND_LAUNCH=0``
    would set them for a whole process) for the ``TRITON_LAUNCH`` calls; nothing for the others."""
    if name != TRITON_LAUNCH:
        yield
        return
    with bound_launches(False):
        yield


def median_host_and_wall_us(fns: dict, x, args) -> dict:
    """``{name: (host us, wall us)}`` per call of ``--calls`` back-to-back calls of each ``fns[name]``, the median
    over ``--repeats`` runs, the functions alternating run by run (the host of a lent machine is shared, and one run
    can be 30% off), each on its ``launch_path``."""
    runs: dict[str, list] = {name: [] for name in fns}
    for _ in range(args.repeats):
        for name, fn in fns.items():
            with launch_path(name):
                runs[name].append(host_and_wall_us(fn, (x,), args.calls))
    return {name: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs))
            for name, rs in runs.items()}


# Calls timed after a sync for the host's own work per call: fewer than the unread calls a layer's deferred device
# checks allow (``moe_ref.ep.device_checks.DeferredChecks``, 4), so no call waits for an earlier call's flags.
HOST_WORK_CALLS = 3


def host_work_us(fns: dict, x, repeats: int = 30) -> dict:
    """``{name: us}``: the host's own work per call of each ``fns[name]`` (median over ``repeats`` of
    ``HOST_WORK_CALLS`` calls started on an idle GPU, the functions alternating, each on its ``launch_path``).
    Back-to-back calls cannot show it: there the host runs ahead until it waits for the oldest unread call's checks,
    so its time per call is the GPU's."""
    runs: dict[str, list] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            with launch_path(name):
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(HOST_WORK_CALLS):
                    fn(x)
                runs[name].append((time.perf_counter() - start) / HOST_WORK_CALLS * 1e6)
                torch.cuda.synchronize()
    return {name: round(statistics.median(times), 1) for name, times in runs.items()}


def profile_calls(row: dict, name: str, fn, x, args, dispatch: str, num_tokens: int) -> None:
    """Launches, syncs and D2H copies per call (``<name>_`` keys, none for ``eager``), the host-op table, the sync
    sites and a cProfile of ``fn``'s calls."""
    prefix = "" if name == "eager" else f"{name}_"
    counts = runtime_counts(fn, x)
    with open(os.path.join(args.out, f"host_ops_{prefix}{dispatch}_{num_tokens}.txt"), "w") as f:
        f.write(counts.pop("host_ops_table"))
    row.update({prefix + key: value for key, value in counts.items()})
    row[prefix + "sync_sites"] = sync_sites(fn, x)
    with open(os.path.join(args.out, f"cprofile_{prefix}{dispatch}_{num_tokens}.txt"), "w") as f:
        f.write(cprofile_text(fn, (x,), args.calls, rank=0))


def build_layers(args, dispatch: str, cap: int, weights: str = "random") -> tuple[MegaMoE, MegaMoE | None]:
    """The layer as built by default, and (route ``eager_launches``) one with ``eager_graph_max_tokens=0`` holding
    the same weights (random ones copied on the GPU, as they are drawn once on the CPU; a checkpoint loaded again)."""
    moe = build_layer(args, dispatch, cap, weights)
    if "eager_launches" not in args.routes:
        return moe, None
    if weights != "random":
        return moe, build_layer(args, dispatch, cap, weights, eager_graph_max_tokens=0)
    launching = MegaMoE(moe.cfg, None, **layer_options(dispatch, cap, eager_graph_max_tokens=0))
    launching.load_state_dict(moe.state_dict())
    return moe, launching


def run_case(args, moe: MegaMoE, launching: MegaMoE | None, dispatch: str, cap: int, num_tokens: int,
             weights: str = "random") -> dict:
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, moe.cfg.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
    row: dict = {"weights": weights, "dispatch": dispatch, "tokens": num_tokens, "cap": cap,
                 "eager_graph_max_tokens": moe.options.eager_graph_max_tokens}
    with torch.inference_mode():
        first = time.perf_counter()
        reference = moe(x).clone()  # T's first call: the eager path, every kernel launched
        torch.cuda.synchronize()
        row["first_call_s"] = round(time.perf_counter() - first, 2)
        fns = {"eager": lambda x_TD: moe(x_TD)}  # noqa: E731 - a replay of T's graph from the second call on
        if launching is not None:
            fns["eager_launches"] = lambda x_TD: launching(x_TD)  # noqa: E731
            if args.ab_bound_launch:
                fns[TRITON_LAUNCH] = fns["eager_launches"]
        for name, fn in fns.items():
            with launch_path(name):
                for _ in range(3):
                    out = fn(x)
            row[f"{name}_bitwise_eq_first_call"] = bool(torch.equal(out, reference))
        graphs = moe.eager_graphs
        row["eager_graphs_captured"] = graphs.captures if graphs is not None else 0
        for name, (host, wall) in median_host_and_wall_us(fns, x, args).items():
            row[f"{name}_host_us"], row[f"{name}_wall_us"] = host, wall
        for name, us in host_work_us(fns, x).items():
            row[f"{name}_host_work_us"] = us
        if args.profile:
            for name in ("eager", "eager_launches"):
                if name in fns:
                    profile_calls(row, name, fns[name], x, args, dispatch, num_tokens)
        for route in args.routes:
            if route in ("eager", "eager_launches"):
                continue
            try:
                fn = graphed(moe, x.clone()) if route == "graph" else torch.compile(moe, mode="reduce-overhead",
                                                                            fullgraph=True)
                for _ in range(3):
                    out = fn(x)
                row[f"{route}_bitwise_eq_first_call"] = bool(torch.equal(out, reference))
                row[f"{route}_host_us"], row[f"{route}_us"] = median_host_and_wall_us({route: fn}, x, args)[route]
            except Exception as err:  # noqa: BLE001 - a route that fails is reported, the others still run
                row[f"{route}_error"] = f"{type(err).__name__}: {str(err)[:300]}"
            torch._dynamo.reset()
    for route in ("graph", "compile"):
        if f"{route}_us" in row:
            row[f"eager_over_{route}"] = round(row["eager_wall_us"] / row[f"{route}_us"], 2)
            if "eager_launches_wall_us" in row:
                row[f"eager_launches_over_{route}"] = round(row["eager_launches_wall_us"] / row[f"{route}_us"], 2)
    return row


def _launch_counts(row: dict, prefix: str) -> str:
    if prefix + "launches" not in row:
        return "-"
    return " + ".join(f"{row.get(prefix + key, 0):g}" for key in ("launches", "graph_launches", "copies"))


def _weights(row: dict) -> str:
    return row.get("weights", "random")


def speedup_lines(rows: list[dict]) -> list[str]:
    """Each checkpoint row's speed-up over the ``random`` row of the same dispatch and T (that row's us over this
    row's), eager and from a graph; no lines without both."""
    base = {(r["dispatch"], r["tokens"]): r for r in rows if _weights(r) == "random"}
    pairs = [(base[(r["dispatch"], r["tokens"])], r) for r in rows
             if _weights(r) != "random" and (r["dispatch"], r["tokens"]) in base]
    if not pairs:
        return []

    def ratio(anchor: dict, row: dict, key: str) -> str:
        return f"{anchor[key] / row[key]:.2f}x" if anchor.get(key) and row.get(key) else "-"

    lines = ["", "Speed-up over the random bf16 weights' layer of the same dispatch and T (its us / this row's us):",
             "", "| weights | dispatch | T | eager | graph |", "|---|---|---:|---:|---:|"]
    return lines + [f"| {_weights(r)} | {r['dispatch']} | {r['tokens']} | {ratio(b, r, 'eager_wall_us')} | "
                    f"{ratio(b, r, 'graph_us')} |" for b, r in pairs]


def write_markdown(out: str, meta: dict, rows: list[dict]) -> None:
    nan = float("nan")
    lines = [f"# MegaMoE eager vs graph, one GPU ({meta['device']}, torch {meta['torch']}, triton {meta['triton']}, "
             f"{meta['date']})", "", f"`{meta['command']}`", "",
             "eager: the layer as built by default (T's calls replay the graph it captured for T); eager, launches: "
             "built with `eager_graph_max_tokens=0` (every kernel launched from Python). us per call.", "",
             "host work: the host's own time per call, 3 calls started on an idle GPU (back to back, the host "
             "waits for the GPU once 4 calls' checks are unread).", "",
             "| weights | dispatch | T | eager wall | eager host | eager host work | eager, launches: wall | host | "
             "host work | "
             "wall, Triton's launch path | "
             "graph | compile r-o | eager/graph | launches/graph | compile/graph | per call, eager: kernel launches "
             "+ graph launches + copies | eager, launches: the same | syncs | D2H pageable | GPU busy us |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = (f"{r['compile_us'] / r['graph_us']:.2f}" if "compile_us" in r and "graph_us" in r else "-")
        lines.append(f"| {_weights(r)} | {r['dispatch']} | {r['tokens']} | {r['eager_wall_us']:.0f} | "
                     f"{r['eager_host_us']:.0f} | "
                     f"{r.get('eager_host_work_us', nan):.0f} | "
                     f"{r.get('eager_launches_wall_us', nan):.0f} | {r.get('eager_launches_host_us', nan):.0f} | "
                     f"{r.get('eager_launches_host_work_us', nan):.0f} | "
                     f"{r.get('eager_launches_triton_launch_wall_us', nan):.0f} | "
                     f"{r.get('graph_us', nan):.0f} | {r.get('compile_us', nan):.0f} | "
                     f"{r.get('eager_over_graph', '-')} | {r.get('eager_launches_over_graph', '-')} | {ratio} | "
                     f"{_launch_counts(r, '')} | {_launch_counts(r, 'eager_launches_')} | "
                     f"{r.get('syncs', '-')} / {r.get('eager_launches_syncs', '-')} | "
                     f"{r.get('d2h_pageable', '-')} / {r.get('eager_launches_d2h_pageable', '-')} | "
                     f"{r.get('gpu_busy_us', '-')} |")
    for r in rows[:1] + rows[len(rows) // 2:len(rows) // 2 + 1]:
        for prefix, what in (("", "eager (graph replay)"), ("eager_launches_", "eager, launches")):
            if r.get(prefix + "kernels"):
                lines += ["", f"GPU kernels of one call, {what}, {_weights(r)} {r['dispatch']} T={r['tokens']}:", "",
                          "| kernel | per call |", "|---|---:|"]
                lines += [f"| `{name}` | {n:g} |" for name, n in r[prefix + "kernels"].items()]
    for r in rows:
        for prefix, what in (("", "eager (graph replay)"), ("eager_launches_", "eager, launches")):
            if r.get(prefix + "sync_sites"):
                lines += ["", f"Syncs of one call, {what}, {_weights(r)} {r['dispatch']} T={r['tokens']}:", ""]
                lines += [f"- {s}" for s in r[prefix + "sync_sites"]]
        for key in ("graph_error", "compile_error"):
            if key in r:
                lines += ["", f"{key}, {_weights(r)} {r['dispatch']} T={r['tokens']}: {r[key]}"]
    lines += speedup_lines(rows)
    with open(os.path.join(out, "bench_eager.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def plot_results(out: str, meta: dict, rows: list[dict]) -> None:
    """``bench_eager.png``: us per call of each route, one group of bars per (weights, dispatch, T); skipped without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    routes = [("eager_wall_us", "eager (graph replay)"), ("eager_launches_wall_us", "eager, launches"),
              ("eager_launches_triton_launch_wall_us", "eager, launches, Triton's launch path"),
              ("graph_us", "CUDA graph"), ("compile_us", "torch.compile reduce-overhead")]
    routes = [(key, label) for key, label in routes if any(key in r for r in rows)]
    fig, ax = plt.subplots(figsize=(max(7, 1.3 * len(rows)), 4.5))
    width = 0.8 / len(routes)
    for i, (key, label) in enumerate(routes):
        ax.bar([j + i * width for j in range(len(rows))], [r.get(key, 0) for r in rows], width, label=label)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))],
                  [f"{_weights(r)}\n{r['dispatch']}\nT={r['tokens']}" for r in rows])
    ax.set_ylabel("us per MegaMoE call (wall)")
    ax.set_title(f"MegaMoE, one GPU ({meta['device']}, triton {meta['triton']}, {meta['date']})", fontsize=9)
    ax.legend(fontsize=8)
    fig.savefig(os.path.join(out, "bench_eager.png"), dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_eager: needs a CUDA GPU", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    import triton

    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
            "command": "python3 scripts/bench_eager.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    rows = []
    cap = max(args.tokens)
    for weights, dispatch in itertools.product(args.weights, args.dispatch):
        moe, launching = build_layers(args, dispatch, cap, weights)
        for num_tokens in args.tokens:
            row = run_case(args, moe, launching, dispatch, cap, num_tokens, weights)
            rows.append(row)
            print("EAGER " + json.dumps({k: v for k, v in row.items() if not k.endswith(("sync_sites", "kernels"))}),
                  flush=True)
            with open(os.path.join(args.out, "bench_eager.json"), "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
            write_markdown(args.out, meta, rows)
        for layer in (moe, launching):
            if layer is not None:
                layer.destroy()
    plot_results(args.out, meta, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
