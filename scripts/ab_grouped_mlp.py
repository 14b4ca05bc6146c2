#!/usr/bin/env python
"""A/B of the grouped MLP on one GPU, through `grouped_mlp` as the Triton experts call it.

    python3 scripts/ab_grouped_mlp.py [--ab layout|schedule|alignment] [--models kimi-k2,step3]
                                      [--rows 64,512,4096,32768] [--out results/ab.json] [--max-seconds S]
                                      [--dry-run]

`--ab layout` (default), the gate/up weight layout:
  A: gate_up rows stacked (gate 0..F-1, then up 0..F-1): GEMM1 runs two dots per k-step.
  B: gate_up rows interleaved (alternating 128-row gate and up blocks, FP8 block scales alike;
     `interleave_gate_up`, done once): one dot over 256 rows.
  Both autotune over the same tile lists; down (GEMM2) is the same launch in both.
`--ab schedule`, the program schedule of both GEMMs (`grouped_mlp`'s `schedule`), in the layout the Triton experts
use (FP8 interleaved, bf16 stacked), on the cases' 128-aligned pool with the rows hint:
  A: grid: one program per tile of the pool's upper bound (surplus programs exit at once).
  B: hinted: one program per tile of the hinted rows; programs walk any tiles past it.
  C: persistent: about two programs per SM walk the live tiles.
  Each autotunes its own tiles (the schedule is part of the autotune key).
`--ab alignment` (default models kimi-k2,step3, rows 64,512), the receive pool's segment alignment, in the gate_up
layout the Triton experts use:
  A: segments start on multiples of 128 rows (the pool of the 128-aligned backends; the cases' own pool).
  B: the pool the layer builds for the Triton experts: segments on multiples of
     `experts_class("triton").segment_alignment` (1: back to back, no padding rows;
     `moe_ref.bench.cases.case_pool`).
  Both get the rows hint the layer passes, the routed rows (the device-side dispatch's T * K): the regime follows
  the hint, not the pool, so both tune over the same regime's tile list. Each pool autotunes on its own
  (`clear_tuned_configs` before its first call; the autotune key also holds the pool's rows bucket, which tells
  these two pools apart). Then every pool runs every pool's chosen (gate_up, down) tiles, forced
  (`grouped_mlp(configs=...)`, the same kernel and launch options as the autotuned launch): A with B's tiles
  and B with A's tell the layout's cost from the tile choice's. `--nohint` adds C: the 128-aligned pool without
  the hint (rows_hint = P, `grouped_mlp`'s default, whose regime follows the padded pool), and its tiles on
  every pool. bf16 adds torch grouped_mm on the packed rows as an anchor. `--dry-run` prints the pools, hints,
  regimes and the tiles autotune would try, without a GPU.
The cases are scripts/bench_experts.py's (`moe_ref.bench.cases.make_case`: its per-rank EP8 shapes, routed rows
spread randomly over the experts, 128-aligned segments), with `num_rows_hint` given and unused rows left unwritten
(what the layer passes). bf16 and FP8 (e4m3, per-128 activation scales, 128x128 weight blocks). (The first recorded
layout run, 2026-12-01, built its cases in this script, the same way; its files are in git history.)

Timing: `triton.testing.do_bench` (L2 flushed before each run), A and B alternated over `--rounds` rounds, the
median of the rounds kept. Check: B's output vs A's on the rows inside segments (calc_diff < 1e-4 bf16,
1e-3 FP8; alignment: every run vs A with its own tiles). JSON and a markdown table go to --out (and its .md),
rewritten after every case; `--max-seconds` starts no case after that many seconds.
"""

from __future__ import annotations

import time

_T0 = time.monotonic()  # before the heavy imports: --max-seconds counts the whole process

import argparse  # noqa: E402
import functools  # noqa: E402
import importlib  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moe_ref.bench.cases import (ALIGN, MODELS, case_pool, grouped_mm_path, make_case, make_weights,  # noqa: E402
                                 routed_counts, segment_rows)
from moe_ref.experts import ExpertLayout, experts_class  # noqa: E402
from moe_ref.kernels.experts import grouped_mlp_tiles as tiles  # noqa: E402
from moe_ref.kernels.experts.grouped_mlp import grouped_mlp, interleave_gate_up  # noqa: E402
from moe_ref.testing import calc_diff  # noqa: E402

gm = importlib.import_module("moe_ref.kernels.experts.grouped_mlp")  # the module (the package re-exports the function)

DEFAULTS = {"layout": ("kimi-k2", "64,512,4096,32768"), "schedule": ("kimi-k2", "64,512,4096,32768"),
            "alignment": ("kimi-k2,step3", "64,512")}  # --ab -> (--models, --rows) when not given


def run(case, precision: str, gate_up: torch.Tensor, interleaved: bool, gate_up_scale: torch.Tensor | None = None,
        schedule: str | None = None, *, alignment: int = ALIGN, hint: bool = True, configs: tuple | None = None):
    """`grouped_mlp` on a bench_experts case as the Triton experts call it, with `gate_up` (FP8: and its block
    scales `gate_up_scale`) in the given layout:
    the case's rows in its pool of segments aligned to `alignment` (`case_pool`), rows hint = the routed rows
    (`hint=False`: none, i.e. the pool's rows), unused rows unwritten; `configs`: (gate_up, down) tiles forced.
    Returns y `[P, D]` (bf16) of that pool."""
    pool = case_pool(case, alignment)
    if precision == "fp8":
        ops = case.fp8
        inputs, down = (pool.x_fp8,), ops["down"]
        scales = {"x_scale_PDb": pool.x_scale, "gate_up_scale": gate_up_scale, "down_scale": ops["down_scale"]}
    else:
        inputs, down, scales = (pool.x_PDx,), case.down, {}
    return grouped_mlp(*inputs, gate_up, down, pool.row_start_e, pool.num_rows_e, **scales,
                       num_rows_hint=case.num_rows if hint else None, zero_unused_rows=False,
                       gate_up_interleaved=interleaved, schedule=schedule, configs=configs)


def variants_case(case, precision: str, specs: dict[str, dict], valid: torch.Tensor, rounds: int) -> dict:
    """Every variant of `specs` (name -> `run` keywords, A first) on one case, alternated over `rounds`: the median
    us of each, A's us over each one's ("speedup", > 1: faster than A), and each one's calc_diff against A's output
    on the rows inside segments."""
    import triton

    outs = {name: run(case, precision, **spec)[valid].float() for name, spec in specs.items()}
    first = next(iter(specs))
    diffs = {name: calc_diff(out, outs[first]) for name, out in outs.items()}
    times = {name: [] for name in specs}
    for _ in range(rounds):
        for name, spec in specs.items():
            times[name].append(triton.testing.do_bench(lambda spec=spec: run(case, precision, **spec)))
    us = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    return {"variants": list(specs), "us": us, "speedup": {name: us[first] / t for name, t in us.items()},
            "calc_diff": diffs, "ok": all(d < (1e-3 if precision == "fp8" else 1e-4) for d in diffs.values()),
            "rounds_us": {name: [t * 1e3 for t in ts] for name, ts in times.items()}}


def variants_markdown(results: dict) -> list[str]:
    """The markdown table of `--ab layout|schedule`: us per variant, A's us over each other's, calc_diff vs A."""
    if not results["cases"]:
        return ["no case ran"]
    names = results["cases"][0]["variants"]
    lines = ["| model | rows | precision | " + " | ".join(f"{n} us" for n in names) + " | "
             + " | ".join(f"A / {n}" for n in names[1:]) + " | max calc_diff vs A |",
             "|---|---:|---|" + "---:|" * (2 * len(names))]
    lines += [f"| {r['model']} | {r['rows']} | {r['precision']} | " + " | ".join(f"{r['us'][n]:.1f}" for n in names)
              + " | " + " | ".join(f"{r['speedup'][n]:.3f}" for n in names[1:])
              + f" | {max(r['calc_diff'].values()):.1e} |" for r in results["cases"]]
    return lines


def gate_up_layout(stacked: torch.Tensor, stacked_scale: torch.Tensor | None, interleaved: bool) -> dict:
    """`run` keywords of gate_up (and its FP8 block scales, None for bf16) stacked or interleaved (copies)."""
    if not interleaved:
        return dict(gate_up=stacked, gate_up_scale=stacked_scale, interleaved=False)
    scale = None if stacked_scale is None else interleave_gate_up(stacked_scale, rows_per_block=1)
    return dict(gate_up=interleave_gate_up(stacked), gate_up_scale=scale, interleaved=True)


def triton_layout(precision: str, stacked: torch.Tensor, stacked_scale: torch.Tensor | None) -> dict:
    """`run` keywords of gate_up as TritonExperts stores it: FP8 interleaved (a copy), bf16 the stacked rows."""
    return gate_up_layout(stacked, stacked_scale, interleaved=precision == "fp8")


def variants(ab: str, precision: str, stacked: torch.Tensor, stacked_scale: torch.Tensor | None) -> dict[str, dict]:
    """A and B of the comparison: name -> `run` keywords (first A, then B)."""
    if ab == "layout":
        return {"stacked": gate_up_layout(stacked, stacked_scale, False),
                "interleaved": gate_up_layout(stacked, stacked_scale, True)}
    layout = triton_layout(precision, stacked, stacked_scale)
    return {schedule: dict(layout, schedule=schedule) for schedule in ("grid", "hinted", "persistent")}


# ------------------------------------------------------------------------------------------------
# --ab alignment
# ------------------------------------------------------------------------------------------------
def alignment_pools(nohint: bool = False) -> dict[str, dict]:
    """The pools of `--ab alignment`, A and B (and C with `nohint`): name -> `run` keywords."""
    packed = experts_class("triton").segment_alignment
    pools = {f"A_align{ALIGN}": dict(alignment=ALIGN), f"B_align{packed}": dict(alignment=packed)}
    if nohint:
        pools[f"C_align{ALIGN}_nohint"] = dict(alignment=ALIGN, hint=False)
    return pools


def hint_and_regime(spec: dict, num_rows: int, pool_rows: int, num_experts: int, fp8: bool) -> tuple[int, str]:
    """(rows hint, regime) of a pool's launches: the routed rows, or the pool's rows without the hint."""
    import triton

    rows_hint = num_rows if spec.get("hint", True) else pool_rows
    return rows_hint, tiles.regime(triton.next_power_of_2(rows_hint), num_experts, fp8)[0]


def autotune_candidates(rows_hint: int, num_experts: int, hidden: int, inter: int, fp8: bool) -> dict[str, list]:
    """GEMM -> the tiles autotune tries for a launch with this hint (its regime's list, pruned by the library)."""
    import triton

    out = {}
    for gemm, (n, k, activation) in {"gate_up": (inter, hidden, 1), "down": (hidden, inter, 0)}.items():
        named = {"rows_hint": triton.next_power_of_2(rows_hint), "num_experts": num_experts, "N": n, "K": k}
        kept = tiles.prune_configs(tiles.gpu_configs(), named, ACTIVATION=activation, FP8=fp8,
                                   QUANT_OUT=fp8 and activation == 1, IEEE_FP32=False)
        out[gemm] = [tiles.tile_of(config) for config in kept]
    return out


def chosen_configs(inter: int, hidden: int) -> tuple:
    """(gate_up, down) `triton.Config`s that autotune chose, read from `autotuned_kernel().cache` after one
    `grouped_mlp` call on cleared choices: each key holds the values of the autotuner's key arguments (`.keys`) in
    order; gate_up has N, K = F, D, down D, F."""
    tuner = gm.autotuned_kernel()
    n_at, k_at = tuner.keys.index("N"), tuner.keys.index("K")
    by_shape = {(key[n_at], key[k_at]): config for key, config in tuner.cache.items()}
    return by_shape[(inter, hidden)], by_shape[(hidden, inter)]


def alignment_case(case, precision: str, layout: dict, pools: dict[str, dict], rounds: int) -> dict:
    """One (case, precision) of `--ab alignment`: each pool autotunes alone, then every pool runs every pool's
    chosen tiles (each distinct (pool, tiles) pair once per round); returns the JSON row."""
    import triton

    num_experts, hidden, inter, _ = MODELS[case.model]
    fp8 = precision == "fp8"
    chosen = {}
    for name, spec in pools.items():
        gm.clear_tuned_configs()
        run(case, precision, **layout, **spec)  # autotunes both GEMMs on this pool alone
        torch.cuda.synchronize()
        chosen[name] = chosen_configs(inter, hidden)
    # forced runs: the hint only keys autotune, so a pool's rows and a pair of tiles define a run
    key_of = {(pool, tiles_of): (pools[pool]["alignment"], tuple(tiles.tile_of(c) for c in chosen[tiles_of]))
              for pool in pools for tiles_of in pools}
    runs = {key: functools.partial(run, case, precision, **layout, alignment=key[0], configs=chosen[tiles_of])
            for (_, tiles_of), key in key_of.items()}
    outs = {}
    for key, fn in runs.items():
        pool = case_pool(case, key[0])
        outs[key] = fn()[segment_rows(pool.row_start_e, pool.num_rows_e, pool.x_PDx.shape[0])].float()
    first = next(iter(outs.values()))  # A's pool with A's tiles
    diff = max(calc_diff(out, first) for out in outs.values())
    anchor = grouped_mm_path(case) if precision == "bf16" else None
    times = {key: [] for key in runs}
    anchor_times = []
    for _ in range(rounds):
        for key, fn in runs.items():
            times[key].append(triton.testing.do_bench(fn) * 1e3)
        if anchor is not None:
            anchor_times.append(triton.testing.do_bench(anchor) * 1e3)
    us = {key: statistics.median(ts) for key, ts in times.items()}
    row = {"model": case.model, "rows": case.num_rows, "precision": precision, "calc_diff": diff,
           "ok": diff < (1e-3 if fp8 else 1e-4), "pools": {},
           "us": {pool: {tiles_of: us[key_of[pool, tiles_of]] for tiles_of in pools} for pool in pools},
           "rounds_us": {f"{pool} with {tiles_of}'s tiles": times[key_of[pool, tiles_of]]
                         for pool in pools for tiles_of in pools},
           "grouped_mm_us": statistics.median(anchor_times) if anchor_times else None}
    for name, spec in pools.items():
        pool_rows = case_pool(case, spec["alignment"]).x_PDx.shape[0]
        rows_hint, regime = hint_and_regime(spec, case.num_rows, pool_rows, num_experts, fp8)
        row["pools"][name] = {"alignment": spec["alignment"], "pool_rows": pool_rows, "rows_hint": rows_hint,
                              "regime": regime, "tiles": dict(zip(("gate_up", "down"),
                                                                  map(tiles.tile_of, chosen[name])))}
    a, b = list(pools)[:2]
    row.update(a=a, b=b, a_us=row["us"][a][a], b_us=row["us"][b][b])
    row["speedup"] = row["a_us"] / row["b_us"]
    # the layout's cost with one tile pair for both pools: B / A with A's tiles, with B's tiles (and C's)
    row["b_over_a_same_tiles"] = {tiles_of: row["us"][b][tiles_of] / row["us"][a][tiles_of] for tiles_of in pools}
    return row


def alignment_lines(row: dict) -> list[str]:
    """A case's console lines: per pool its P, hint, regime, chosen tiles and its us with each pool's tiles."""
    names = list(row["pools"])
    lines = []
    for name, pool in row["pools"].items():
        timed = "  ".join(f"{other[0]}'s tiles {row['us'][name][other]:7.1f} us" for other in names)
        lines.append(f"{row['model']:8s} {row['rows']:6d} {row['precision']:5s} {name:20s} P {pool['pool_rows']:6d} "
                     f"hint {pool['rows_hint']:6d} {pool['regime']:8s} tiles {pool['tiles']['gate_up']} / "
                     f"{pool['tiles']['down']}  {timed}")
    gmm = f"  grouped_mm {row['grouped_mm_us']:.1f} us" if row["grouped_mm_us"] else ""
    same = ", ".join(f"{t[0]}'s tiles {r:.3f}" for t, r in row["b_over_a_same_tiles"].items())
    lines.append(f"{'':22s} A {row['a_us']:.1f} us, B {row['b_us']:.1f} us (own tiles, A / B {row['speedup']:.3f}); "
                 f"B / A with one tile pair: {same}{gmm}; calc_diff {row['calc_diff']:.1e}")
    return lines


def alignment_markdown(results: dict) -> list[str]:
    """The markdown tables of `--ab alignment`: one line per (case, pool), then the ratios per case."""
    if not results["cases"]:
        return ["no case ran"]
    names = list(results["cases"][0]["pools"])
    lines = ["| model | rows | precision | pool | P | rows hint -> regime | tiles chosen (gate_up; down) | "
             + " | ".join(f"us with {name[0]}'s tiles" for name in names) + " | grouped_mm us | calc_diff |",
             "|---|---:|---|---|---:|---|---|" + "---:|" * len(names) + "---:|---:|"]
    for r in results["cases"]:
        for name, pool in r["pools"].items():
            gmm = f"{r['grouped_mm_us']:.1f}" if r["grouped_mm_us"] else "-"
            lines.append(f"| {r['model']} | {r['rows']} | {r['precision']} | {name} | {pool['pool_rows']} | "
                         f"{pool['rows_hint']} -> {pool['regime']} | {pool['tiles']['gate_up']}; "
                         f"{pool['tiles']['down']} | " + " | ".join(f"{r['us'][name][o]:.1f}" for o in names)
                         + f" | {gmm} | {r['calc_diff']:.1e} |")
    lines += ["", "A / B: each pool with its own tiles; B / A: one tile pair for both pools (the layout's cost).", "",
              "| model | rows | precision | A us | B us | A / B | " + " | ".join(f"B / A with {n[0]}'s tiles"
                                                                          for n in names) + " |",
              "|---|---:|---|---:|---:|---:|" + "---:|" * len(names)]
    lines += [f"| {r['model']} | {r['rows']} | {r['precision']} | {r['a_us']:.1f} | {r['b_us']:.1f} | "
              f"{r['speedup']:.3f} | " + " | ".join(f"{r['b_over_a_same_tiles'][n]:.3f}" for n in names) + " |"
              for r in results["cases"]]
    return lines


def dry_run(args) -> int:
    """The cases without a GPU; `--ab alignment`: each pool's rows, hint, regime and the tiles autotune tries."""
    print(f"--ab {args.ab}: models {args.models}, rows {args.rows}, precisions {args.precisions}")
    pools = alignment_pools(args.nohint) if args.ab == "alignment" else {}
    for model in args.models:
        num_experts, hidden, inter, _ = MODELS[model]
        for num_rows in args.rows:
            counts = routed_counts(model, num_rows, seed=0)
            print(f"{model} rows={num_rows}: {sum(c > 0 for c in counts)} of {num_experts} experts get rows, "
                  f"{max(counts)} at most")
            for name, spec in pools.items():
                pool_rows = ExpertLayout.from_counts(torch.tensor(counts), spec["alignment"]).num_pool_rows
                for precision in args.precisions:
                    rows_hint, regime = hint_and_regime(spec, num_rows, pool_rows, num_experts, precision == "fp8")
                    print(f"  {name:20s} {precision:5s} P={pool_rows:6d} rows hint {rows_hint:6d} -> {regime}")
                    for gemm, tried in autotune_candidates(rows_hint, num_experts, hidden, inter,
                                                           precision == "fp8").items():
                        print(f"      autotune tries for {gemm:7s}: {tried}")
    return 0


def _write(results: dict, out: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ab", choices=tuple(DEFAULTS), default="layout")
    parser.add_argument("--models", default=None, help="comma list (default: kimi-k2; alignment: kimi-k2,step3)")
    parser.add_argument("--rows", default=None, help="comma list (default: 64,512,4096,32768; alignment: 64,512)")
    parser.add_argument("--precisions", default="bf16,fp8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nohint", action="store_true", help="--ab alignment: add pool C (128-aligned, no rows hint)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="start no case after this many seconds from process start (default: no limit)")
    parser.add_argument("--dry-run", action="store_true", help="print the cases (and the pools' regimes), no GPU")
    parser.add_argument("--out", default="results/ab_grouped_mlp.json")
    args = parser.parse_args(argv)
    models, rows = DEFAULTS[args.ab]
    args.models = (args.models or models).split(",")
    args.rows = [int(r) for r in (args.rows or rows).split(",")]
    args.precisions = args.precisions.split(",")
    bad = [m for m in args.models if m not in MODELS]
    if bad:
        parser.error(f"unknown models {bad}; choose from {list(MODELS)}")
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    if args.dry_run:
        return dry_run(args)
    import triton

    results = {"ab": args.ab, "env": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__}, "cases": [], "stopped_early": False}
    pools = alignment_pools(args.nohint)
    weights = case = None
    for model, num_rows, precision in itertools.product(args.models, args.rows, args.precisions):
        if args.max_seconds is not None and time.monotonic() - _T0 > args.max_seconds:
            results["stopped_early"] = True
            break
        if case is None or case.model != model:  # a model's weights (and their Triton layout) once
            case = weights = None
            stored = {}  # precision -> gate_up as the Triton experts store it (--ab alignment)
            torch.cuda.empty_cache()
            num_experts, hidden, inter, _ = MODELS[model]
            weights = make_weights(num_experts, hidden, inter, with_fp8=True)
        if case is None or case.num_rows != num_rows:
            case = make_case(model, num_rows, weights, seed=0, with_fp8=True)
            valid = segment_rows(case.row_start_e, case.num_rows_e, case.x_PDx.shape[0])
        if args.ab == "alignment":
            if precision not in stored:
                stored[precision] = (triton_layout(precision, weights[2], weights[3]) if precision == "fp8" else
                                     triton_layout(precision, weights[0], None))
            row = alignment_case(case, precision, stored[precision], pools, args.rounds)
            results["cases"].append(row)
            print("\n".join(alignment_lines(row)), flush=True)
            _write(results, args.out)
            continue
        stacked = (case.fp8["gate_up"], case.fp8["gate_up_scale"]) if precision == "fp8" else (case.gate_up, None)
        row = variants_case(case, precision, variants(args.ab, precision, *stacked), valid, args.rounds)
        row.update(model=model, rows=num_rows, precision=precision)
        results["cases"].append(row)
        print(f"{model:8s} {num_rows:6d} {precision:5s} " + "  ".join(
            f"{name} {us:8.1f} us (A / it x{row['speedup'][name]:.3f}, calc_diff {row['calc_diff'][name]:.1e})"
            for name, us in row["us"].items()), flush=True)
        _write(results, args.out)
    # the tiles autotune chose, per launch key (rows_hint, N, K, experts, flags...): compare with tune_grouped_mlp's
    # (alignment: the last pool's only; each row holds every pool's)
    results["autotune_choices"] = {str(key): str(config) for key, config in gm.autotuned_kernel().cache.items()}
    for key, config in results["autotune_choices"].items():
        print(f"autotune {key}: {config}")
    _write(results, args.out)
    if args.ab == "alignment":
        lines = alignment_markdown(results)
    else:
        lines = variants_markdown(results)
    stopped = "\n\nStopped early by --max-seconds." if results["stopped_early"] else ""
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(f"{results['env']}\n\n" + "\n".join(lines) + stopped + "\n")
    return 0 if all(r["ok"] for r in results["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
