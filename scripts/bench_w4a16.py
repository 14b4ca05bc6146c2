#!/usr/bin/env python
"""W4A16 (INT4, MXFP4) and FP8-from-checkpoint experts vs bf16 experts through the public Experts API (CUDA).

    python scripts/bench_w4a16.py [--rows 64 512] [--out results/bench_w4a16.json] [--sweep]
                                  [--peer first|all|none] [--max-seconds 240] [--dry-run] [--every-tile]

Shape: Kimi-K2 per rank at EP8 (48 local experts, D 7168, F 2048, SiLU); routed rows spread uniformly at random
(multinomial) over the experts; pool layout with alignment 1 (the Triton backends' own). Paths:
    bf16        make_experts("triton", bf16 weights)
    fp8_ckpt    make_quantized_experts(fp8_block weights as the layer holds a checkpoint's: gate/up interleaved in
                place at load, `with_interleaved_gate_up`), bf16 rows (quantized per 128 in the call)
    fp8_ckpt_pool  the same experts given the FP8 pool as the layer's dispatch hands it (rows quantized per 128 once,
                outside the timed call: the layer's path)
    int4_w4a16  make_quantized_experts(int4_group weights), bf16 activations
    mxfp4_w4a16 make_quantized_experts(mxfp4 weights), bf16 activations
    int4_w4a8, mxfp4_w4a8  the same experts with W4A8 at every row count (`W4A16Experts(a8_rows_per_expert=0)`: x and
                h quantized to e4m3 per row, fp8 MMAs on the weights cast to fp8 in the decode)
The 4-bit paths are `W4A16Experts` on `moe_ref.kernels.experts.grouped_mlp_w4`: the stored weights laid out once
(`to_group_planes`: a group's 32 features in 16 words, as the decode's register pairs; scales block-major), then two
autotuned launches (gate_up with the SiLU in its epilogue, then down) that decode the 4-bit codes in the registers the
tensor cores read, the group scale applied by the decode's last bf16 FMA (MXFP4 exactly, INT4 rounded once to bf16).
The experts get the layout the layer's dispatch hands them (static rows hint, unused rows not zeroed: no host sync).
Per case: us (moe_ref.testing.bench with host_ahead: GPU time, calls queued back to back, L2 flushed) of the eager
call and of the same call captured once in a CUDA graph and replayed (moe_ref.testing.graphed), speedup vs bf16 of
each, weight GB/s of the experts that got rows, calc_diff vs the dequantized fp32 reference (the torch backend of the
same stored weights). A 4-bit row names the tiles autotune chose for its two GEMMs (`autotuned_tiles`, read from
`grouped_mlp_w4.tuned_tiles()` by rows bucket, N, K, experts, bf16 x and the format's scale dtype; None, `?` in the
markdown, when no launch of that key was tuned, e.g. the experts ran another kernel).

--sweep: per 4-bit format, rows and GEMM, every tile autotune tries in that regime (`grouped_mlp_w4.tiles_for`: the
BLOCK_M 8 and 16 `TILES` up to 4 rows per expert, BLOCK_M 16 up to 16, the larger ones above), forced through
`launch_w4_gemm(..., tile=tile)` on the format's planes (`to_group_planes` of the same stored weights, built once per
format) and timed alone; each checked against the autotuned launch's output (calc_diff < 1e-4; gate_up writes h, the
SiLU of its gate and up sums; down reads the autotuned gate_up's h). A tile that fails to compile or launch is recorded
with its error.
The best per (format, rows, GEMM) goes into the JSON and the markdown. --every-tile sweeps all of `TILES` at every
row count (is a tile the regimes leave out faster there? e.g. BLOCK_M 16 at prefill).

Peer anchor (--peer, default the first peer file): the INT4 W4A16 Triton kernel SGLang and vLLM ship (`fused_moe_kernel_gptq_awq`, read
out of the files `make peers` puts in .whl/ by `moe_ref.bench.peers`, never installed) on the same INT4 weights
(words read as its bytes) and rows: per GEMM the fastest of `PEER_W4A16_CONFIGS` (a small search), then its MLP
(GEMM1, the engine's act, GEMM2) with those configs, checked against our INT4 experts (calc_diff). Recorded as
skipped, with the reason, when the files are absent or lack the kernel. There is no MXFP4 peer kernel.

--max-seconds (counted from process start) stops the sweep and the peer search cleanly; what was measured is kept.
Progress lines are flushed; JSON goes to --out and a markdown table beside it (.md). --dry-run prints the plan
(cases, sweep tiles per rows regime, peer files and configs) without a GPU.
"""
from __future__ import annotations

import time

_T0 = time.monotonic()  # before the heavy imports: --max-seconds counts the whole process

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moe_ref.bench import peers  # noqa: E402
from moe_ref.bench.w4_cases import HIDDEN, INTER, NUM_EXPERTS, quantized_weights, random_weights, w4_case  # noqa: E402
from moe_ref.checkpoint.formats import QuantFormat, QuantizedExpertWeights  # noqa: E402
from moe_ref.experts import make_experts  # noqa: E402
from moe_ref.experts.quantized import W4A16Experts, make_quantized_experts  # noqa: E402
from moe_ref.kernels.experts.grouped_mlp_w4 import TILES, launch_w4_gemm, tiles_for, tuned_tiles  # noqa: E402
from moe_ref.kernels.experts.w4 import W4Weight  # noqa: E402
from moe_ref.testing import bench as _bench_calls, calc_diff, graphed  # noqa: E402


def bench(fn) -> float:
    """us of ``fn()``'s GPU work: calls queued back to back as a model queues its layers (L2 flushed, median)."""
    return _bench_calls(fn, host_ahead=True)


W4_PATHS = ("int4_w4a16", "mxfp4_w4a16")  # the 4-bit paths (INT4, MXFP4)
A8_PATHS = ("int4_w4a8", "mxfp4_w4a8")  # the same weights, W4A8
GEMMS = ("gate_up", "down")
SWEEP_CALC_DIFF_LIMIT = 1e-4
SWEEP_BEST_KEYS = ("path", "rows", "gemm")  # the sweep keeps its fastest correct tile per these
# The peer's small search: decode tiles of one BLOCK_SIZE_M (16 covers <= 16 rows per expert in one block);
# N 32 / K 64 and N 64 / K 32 are vLLM's default W4A16 Triton tiles (get_moe_wna16_block_config)
PEER_W4A16_CONFIGS = [
    dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=n, BLOCK_SIZE_K=k, GROUP_SIZE_M=1, num_warps=4, num_stages=s)
    for n, k, s in ((32, 64, 3), (64, 32, 3), (64, 64, 3), (64, 64, 4), (128, 64, 3), (64, 128, 3), (128, 128, 2),
                    (32, 128, 4))
]


def _elapsed() -> float:
    return time.monotonic() - _T0


def _log(message: str) -> None:
    print(f"[{_elapsed():6.1f}s] {message}", flush=True)


def gemm_shape(gemm: str) -> tuple[int, int]:
    """(n, k) of a GEMM at this script's shape: gate_up n = 2F (gate rows, then up rows), k = D; down n = D, k = F."""
    return (2 * INTER, HIDDEN) if gemm == "gate_up" else (HIDDEN, INTER)


def sweep_tiles(rows: int, every_tile: bool = False) -> list[tuple]:
    """The tiles (BLOCK_M, BLOCK_N, num_warps, num_stages) autotune tries for `rows` routed rows over this script's
    experts (`grouped_mlp_w4.tiles_for`), or with ``every_tile`` all of ``TILES`` (to see whether the regimes'
    bounds leave a faster tile out): the sweep's candidates, the same for both formats and GEMMs.

    Example: 64 rows (1.3 per expert) -> the BLOCK_M 8 and 16 tiles; 512 rows (10.7) -> BLOCK_M 16; 4096 rows (85.3
    per expert) -> BLOCK_M 32 to 128.
    """
    return [tuple(tile) for tile in (TILES if every_tile else tiles_for(rows / NUM_EXPERTS))]

def autotuned_tiles(rows: int, scale_dtype: torch.dtype, tuned: dict | None = None,
                    x_dtype: torch.dtype = torch.bfloat16) -> dict[str, tuple | None]:
    """``{gemm: (BLOCK_M, BLOCK_N, num_warps, num_stages) or None}``: what autotune chose for this script's 4-bit
    launches at `rows` rows (its rows bucket), read from `tuned` (default `tuned_tiles()`, keyed ``(rows bucket, N, K,
    experts, kernel flags, x dtype, scale dtype)``): N and K tell the GEMMs apart, the scale dtype the format (INT4
    bf16/fp16/fp32, MXFP4 uint8; `to_group_planes` keeps the stored one), x is bf16 (W4A8: e4m3). None: no such
    launch was tuned.
    """
    tuned = tuned_tiles() if tuned is None else tuned
    chosen = {}
    for gemm in GEMMS:
        want = (triton.next_power_of_2(rows), *gemm_shape(gemm), NUM_EXPERTS)
        chosen[gemm] = next((tile for key, tile in tuned.items()
                             if key[:4] == want and key[-2:] == (x_dtype, scale_dtype)), None)
    return chosen


def peer_configs(gemm: str) -> list[dict]:
    """The `PEER_W4A16_CONFIGS` the peer kernel can run for this GEMM (its b loads need K % BLOCK_SIZE_K == 0)."""
    k = gemm_shape(gemm)[1]
    return [dict(c) for c in PEER_W4A16_CONFIGS if k % c["BLOCK_SIZE_K"] == 0]


def tile_label(tile) -> str:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) -> "M16 N64 w4 s3"; None (no tile found) -> "?"."""
    if tile is None:
        return "?"
    block_m, block_n, warps, stages = tile
    return f"M{block_m} N{block_n} w{warps} s{stages}"


def best_runs(runs: list[dict], keys: tuple[str, ...]) -> list[dict]:
    """The fastest correct run per value of `keys` (runs with an error or a failed check left out), in first-seen
    order of the keys."""
    best: dict[tuple, dict] = {}
    for run in runs:
        if run.get("error") or not run.get("ok", True) or "us" not in run:
            continue
        key = tuple(run[k] for k in keys)
        if key not in best or run["us"] < best[key]["us"]:
            best[key] = run
    return list(best.values())


def markdown(results: dict) -> str:
    """The JSON's tables as markdown: the API rows (with a 4-bit path's autotuned tiles), the sweep's best per case,
    the peer anchor."""
    lines = [f"# bench_w4a16 ({results.get('device', '?')})", "",
             f"{NUM_EXPERTS} experts, D {HIDDEN}, F {INTER}, SiLU, bf16 activations; L2 flushed, median.", "",
             "| rows | path | us | x bf16 | in a CUDA graph, us | x bf16 | weight GB/s | calc_diff vs fp32 dequantized "
             "| autotuned tiles gate_up / down |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for row in results.get("results", []):
        diff, tiles = row.get("calc_diff_vs_dequantized_fp32"), row.get("autotuned_tiles")
        tiles_cell = "-" if tiles is None else " / ".join(tile_label(tiles[gemm]) for gemm in GEMMS)
        lines.append(f"| {row['rows']} | {row['path']} | {row['us']} | {row['speedup_vs_bf16']} | "
                     f"{row.get('graph_us', '-')} | {row.get('graph_speedup_vs_bf16', '-')} | "
                     f"{row['weight_gb_per_s']} | {'-' if diff is None else f'{diff:.1e}'} | {tiles_cell} |")
    if results.get("sweep_best"):
        lines += ["", "Sweep: fastest forced tile per (format, rows, GEMM), checked against the autotuned launch "
                  "(calc_diff)", "", "| format | rows | GEMM | tile | us | weight GB/s | autotuned us | autotuned tile "
                  "| calc_diff |", "|---|---:|---|---|---:|---:|---:|---|---:|"]
        for run in results["sweep_best"]:
            lines.append(f"| {run['path']} | {run['rows']} | {run['gemm']} | {run['label']} | "
                         f"{run['us']:.1f} | {run['weight_gb_per_s']:.0f} | "
                         f"{run.get('autotuned_us', float('nan')):.1f} | {run.get('autotuned_label', '?')} | "
                         f"{run['calc_diff']:.1e} |")
    for peer in results.get("peer", []):
        if peer.get("skipped"):
            lines += ["", f"Peer {peer.get('file', 'W4A16 kernel')}: skipped ({peer['skipped']})"]
            continue
        lines += ["", f"Peer {peer['label']} (INT4 group 32), best of a small search per GEMM", "",
                  "| rows | gate_up us | down us | MLP us | x our int4 | calc_diff vs our int4 |",
                  "|---:|---:|---:|---:|---:|---:|"]
        for row in peer.get("rows", []):
            lines.append(f"| {row['rows']} | {row.get('gate_up_us', float('nan')):.1f} | "
                         f"{row.get('down_us', float('nan')):.1f} | {row.get('mlp_us', float('nan')):.1f} | "
                         f"{row.get('ours_vs_peer', float('nan')):.2f} | {row.get('calc_diff', float('nan')):.1e} |")
    if results.get("stopped_early"):
        lines += ["", f"Stopped early by --max-seconds ({results['stopped_early']})."]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# setup
# ------------------------------------------------------------------------------------------------
def _gemm_weights(q: QuantizedExpertWeights, gemm: str) -> tuple[torch.Tensor, torch.Tensor]:
    if gemm == "gate_up":
        return q.gate_up_qweight_e2FDq, q.gate_up_scale_e2FDs
    return q.down_qweight_eDFq, q.down_scale_eDFs


def _launch(case: dict, weight: W4Weight, gemm: str, a: torch.Tensor, out: torch.Tensor, tile: tuple | None = None):
    """One GEMM of this script's shape through ``launch_w4_gemm`` (autotuned, or the forced ``tile``), as
    ``grouped_mlp_w4`` runs it: gate_up reads x ``[P, D]`` into h ``[P, F]`` (SiLU of its gate and up sums, x's dtype),
    down reads h into y ``[P, D]``."""
    layout = case["layout"]
    return launch_w4_gemm(a, weight, out, layout.row_start_e, layout.num_rows_e, rows_hint=case["rows"], tile=tile,
                          activation="silu" if gemm == "gate_up" else "none")


def api_row(name: str, experts, weight_bytes: int, reference, case: dict,
            base: dict | None) -> tuple[dict, torch.Tensor]:
    """(row, y ``[P, D]``) of one path at one case through the public API, called eagerly (``us``) and replayed from
    a CUDA graph of the same call (``graph_us``: the GPU work alone, as a captured decode step runs it). `base`: the
    bf16 row (None for the bf16 path itself); `reference`: the torch backend of the same stored weights, or None."""
    def call():
        if name.endswith("_pool"):  # the FP8 pool as dispatched
            return experts(case["x_fp8"], case["layout"], case["x_scale"])
        return experts(case["x"], case["layout"])
    us = bench(call)
    graph_us = bench(graphed(call))
    y = call()
    base = base or dict(us=us, graph_us=graph_us)
    row = dict(rows=case["rows"], path=name, us=round(us, 1), speedup_vs_bf16=round(base["us"] / us, 2),
               graph_us=round(graph_us, 1), graph_speedup_vs_bf16=round(base["graph_us"] / graph_us, 2),
               weight_gb_per_s=round(weight_bytes * case["touched"] / us / 1e3, 1))
    if reference is not None:
        row["calc_diff_vs_dequantized_fp32"] = calc_diff(y.float(), reference(case["x"].float(), case["layout"]))
    return row, y


# ------------------------------------------------------------------------------------------------
# the sweep
# ------------------------------------------------------------------------------------------------
def run_sweep(cases: list[dict], quantized: dict, args, results: dict) -> None:
    """Every `sweep_tiles` tile per 4-bit format, rows and GEMM (see the module docstring), into
    ``results["sweep"]``; returns early at --max-seconds."""
    for path in W4_PATHS:
        planes = dict(zip(GEMMS, quantized[path].group_planes()))  # copies in the kernel's layout
        refs = {case["rows"]: _autotuned_refs(case, planes) for case in cases}
        for gemm in GEMMS:
            for case in cases:
                ref = refs[case["rows"]]
                for tile in sweep_tiles(case["rows"], args.every_tile):
                    if _elapsed() > args.max_seconds:
                        results["stopped_early"] = f"sweep at {path} {case['rows']} rows {gemm} {tile_label(tile)}"
                        _log(f"--max-seconds {args.max_seconds:.0f} reached: stopping the sweep")
                        return
                    run = sweep_run(path, case, planes[gemm], gemm, ref[gemm]["a"], ref[gemm], tile)
                    results["sweep"].append(run)
                    _log(f"sweep {path} {case['rows']} rows {gemm:7s} {run['label']:15s} {outcome(run)}")


def _autotuned_refs(case: dict, planes: dict[str, W4Weight]) -> dict[str, dict]:
    """``{gemm: dict(a, out, us, label)}`` of the autotuned launches at one case: each GEMM's input, its output (gate_up
    h ``[P, F]``; down's y ``[P, D]``, from that h), its time and the tile autotune chose."""
    x = case["x"]
    h = torch.empty(x.shape[0], INTER, dtype=x.dtype, device=x.device)
    y = torch.empty_like(x)
    _launch(case, planes["gate_up"], "gate_up", x, h)
    _launch(case, planes["down"], "down", h, y)
    chosen = autotuned_tiles(case["rows"], planes["gate_up"].block_scale.dtype)
    refs = {}
    for gemm, a, out in (("gate_up", x, h), ("down", h, y)):
        scratch = out.clone()  # timed launches write here: `out` stays the checked reference
        refs[gemm] = dict(a=a, out=out, us=bench(lambda: _launch(case, planes[gemm], gemm, a, scratch)),
                          label=tile_label(chosen[gemm]))
    return refs


def sweep_run(path: str, case: dict, weight: W4Weight, gemm: str, a: torch.Tensor, ref: dict,
              tile: tuple) -> dict:
    """One forced tile of one GEMM at one case: checked against the autotuned launch's output (`ref`, from
    `_autotuned_refs`), then timed; a tile that fails to compile or launch gets ``error`` instead."""
    run = dict(path=path, rows=case["rows"], gemm=gemm, tile=list(tile), label=tile_label(tile),
               autotuned_us=ref["us"], autotuned_label=ref["label"])
    out = torch.full_like(ref["out"], float("nan"))
    try:
        _launch(case, weight, gemm, a, out, tile)
        run["calc_diff"] = calc_diff(out.float(), ref["out"].float())
        run["ok"] = bool(run["calc_diff"] < SWEEP_CALC_DIFF_LIMIT)
        run["us"] = bench(lambda: _launch(case, weight, gemm, a, out, tile))
        run["weight_gb_per_s"] = weight.nbytes() * case["touched"] / run["us"] / 1e3
    except Exception as exc:  # noqa: BLE001 - e.g. OutOfResources: recorded, the sweep goes on
        run["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        if "illegal" in run["error"].lower():
            raise  # the CUDA context is gone
    return run


def outcome(run: dict) -> str:
    """A `sweep_run` in a few words: its error, or its us beside the autotuned launch's (FAIL: its check failed)."""
    if "error" in run:
        return run["error"]
    return (f"{run['us']:.0f} us (autotuned {run['autotuned_label']}: {run['autotuned_us']:.0f} us)"
            + ("" if run["ok"] else f" FAIL calc_diff {run['calc_diff']:.1e}"))


# ------------------------------------------------------------------------------------------------
# the peer anchor
# ------------------------------------------------------------------------------------------------
def run_peer(cases: list[dict], q: QuantizedExpertWeights, ours: dict, args, results: dict) -> None:
    """The engines' INT4 W4A16 kernel per peer file (see the module docstring); `ours[rows]` = (our INT4 experts'
    us, y)."""
    files = peers.default_peer_files()[:1 if args.peer == "first" else None]
    if not files:
        results["peer"].append(dict(skipped="no peer file in .whl/ (`make peers` downloads them)"))
        _log("peer: skipped (no peer file in .whl/; `make peers`)")
        return
    weights = {gemm: (peers.int4_words_as_peer_bytes(_gemm_weights(q, gemm)[0]), _gemm_weights(q, gemm)[1])
               for gemm in GEMMS}
    for path in files:
        entry = dict(file=os.path.basename(path), rows=[], timed=[])
        results["peer"].append(entry)
        try:
            w4 = peers.load_peer_w4a16(path)
        except Exception as exc:  # noqa: BLE001 - a missing file, kernel or signature: recorded, the run goes on
            entry["skipped"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            _log(f"peer {entry['file']}: skipped ({entry['skipped']})")
            continue
        entry["label"] = w4.label
        for case in cases:
            layout = case["layout"]
            routing = peers.peer_routing(layout.row_start_e, layout.num_rows_e, case["x"].shape[0], 16,
                                            w4.peer.engine)
            inputs = {"gate_up": case["x"], "down": torch.randn(case["x"].shape[0], INTER, device="cuda").bfloat16()}
            row, best = dict(rows=case["rows"]), {}
            for gemm in GEMMS:
                n = weights[gemm][0].shape[1]
                out = torch.empty(case["x"].shape[0], n, dtype=torch.bfloat16, device="cuda")
                for config in peer_configs(gemm):
                    if _elapsed() > args.max_seconds:
                        results["stopped_early"] = f"peer search at {case['rows']} rows {gemm}"
                        _log(f"--max-seconds {args.max_seconds:.0f} reached: stopping the peer search")
                        return

                    def fn(config=config, gemm=gemm, out=out):
                        peers.launch_w4a16_gemm(w4, inputs[gemm], *weights[gemm], out, routing, config)
                    try:
                        us = bench(fn)
                    except Exception as exc:  # noqa: BLE001 - a config that fails to compile or launch is skipped
                        entry["timed"].append(dict(rows=case["rows"], gemm=gemm, config=config,
                                                   error=f"{type(exc).__name__}: {str(exc)[:200]}"))
                        continue
                    entry["timed"].append(dict(rows=case["rows"], gemm=gemm, config=config, us=us))
                    if gemm not in best or us < best[gemm][1]:
                        best[gemm] = (config, us)
                if gemm in best:
                    row[gemm + "_us"], row[gemm + "_config"] = best[gemm][1], best[gemm][0]
            if len(best) == len(GEMMS):
                def mlp():
                    return peers.run_peer_w4a16_mlp(w4, case["x"], *weights["gate_up"], *weights["down"], routing,
                                                       best["gate_up"][0], best["down"][0])
                valid = layout.row_expert_P() >= 0
                our_us, our_y = ours[case["rows"]]
                row["calc_diff"] = calc_diff(mlp()[valid].float(), our_y[valid].float())
                row["mlp_us"] = bench(mlp)
                row["ours_vs_peer"] = row["mlp_us"] / our_us
            entry["rows"].append(row)
            _log(f"peer {w4.label} {case['rows']} rows: " + json.dumps({k: v for k, v in row.items()
                                                                       if not k.endswith("config")}))


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------
def _parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--out", default="results/bench_w4a16.json")
    parser.add_argument("--sweep", action="store_true",
                        help="time every tile autotune tries, forced, per 4-bit format, rows and GEMM")
    parser.add_argument("--every-tile", action="store_true",
                        help="with --sweep: every tile of grouped_mlp_w4.TILES at every row count, not only its "
                             "regime's")
    parser.add_argument("--peer", choices=["first", "all", "none"], default="first",
                        help="peer files to run: the first of .whl/ (SGLang's wheel when present: the engines' kernels "
                             "differ only in argument names), every one, or none")
    parser.add_argument("--max-seconds", type=float, default=240.0,
                        help="stop the sweep and the peer search past this (from process start)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan; needs no GPU")
    args = parser.parse_args(argv)
    if any(r <= 0 for r in args.rows):
        parser.error(f"--rows must be positive, got {args.rows}")
    return args


def dry_run(args) -> int:
    print(f"shape: {NUM_EXPERTS} experts, D {HIDDEN}, F {INTER}; rows {args.rows}; out {args.out} (+ .md)")
    print("API rows: bf16, fp8_ckpt, fp8_ckpt_pool, " + ", ".join(W4_PATHS + A8_PATHS))
    if args.sweep:
        for rows in args.rows:
            print(f"sweep {rows} rows ({rows / NUM_EXPERTS:.1f} per expert), per format and GEMM: "
                  f"{[tile_label(t) for t in sweep_tiles(rows, args.every_tile)]}")
    if args.peer != "none":
        files = peers.default_peer_files()[:1 if args.peer == "first" else None]
        print(f"peer files: {[os.path.basename(f) for f in files] or 'none (skipped: run `make peers`)'}")
        for gemm in GEMMS:
            print(f"peer configs {gemm}: {len(peer_configs(gemm))} "
                  f"{[(c['BLOCK_SIZE_N'], c['BLOCK_SIZE_K'], c['num_stages']) for c in peer_configs(gemm)]}")
    print(f"--max-seconds {args.max_seconds:.0f}")
    return 0


def main(argv=None) -> int:
    args = _parse(argv)
    if args.dry_run:
        return dry_run(args)
    if not torch.cuda.is_available():
        print("bench_w4a16 needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up, down = random_weights(gen)
    paths = {"bf16": (make_experts("triton", gate_up, down, "silu"), gate_up.nbytes + down.nbytes, None)}
    quantized = {}
    for fmt, name in ((QuantFormat.FP8_BLOCK, "fp8_ckpt"), (QuantFormat.INT4_GROUP, "int4_w4a16"),
                      (QuantFormat.MXFP4, "mxfp4_w4a16")):
        q = quantized_weights(gate_up, down, fmt)
        if fmt == QuantFormat.FP8_BLOCK:
            q = q.with_interleaved_gate_up()  # as the layer holds an FP8 checkpoint's experts
        quantized[name] = q
        reference = make_quantized_experts(q, "silu", backend="torch")
        paths[name] = (make_quantized_experts(q, "silu"), q.nbytes(), reference)
        if fmt == QuantFormat.FP8_BLOCK:
            paths[name + "_pool"] = paths[name]
    for w4_name, a8_name in zip(W4_PATHS, A8_PATHS):
        q = quantized[w4_name]
        paths[a8_name] = (W4A16Experts(q, "silu", a8_rows_per_expert=0), q.nbytes(), paths[w4_name][2])
        quantized[a8_name] = q
    del gate_up, down
    _log("weights ready")
    results = {"device": torch.cuda.get_device_name(), "shape": dict(experts=NUM_EXPERTS, hidden=HIDDEN,
               intermediate=INTER), "args": vars(args), "results": [], "sweep": [], "sweep_best": [], "peer": [],
               "stopped_early": None}
    cases, ours = [], {}
    for num_rows in args.rows:
        case = w4_case(num_rows, gen)
        cases.append(case)
        base = None
        for name, (experts, weight_bytes, reference) in paths.items():
            row, y = api_row(name, experts, weight_bytes, reference, case, base)
            base = base or row
            if name in W4_PATHS + A8_PATHS:
                x_dtype = torch.float8_e4m3fn if name in A8_PATHS else torch.bfloat16
                row["autotuned_tiles"] = autotuned_tiles(num_rows, quantized[name].gate_up_scale_e2FDs.dtype,
                                                         x_dtype=x_dtype)
            if name == "int4_w4a16":
                ours[num_rows] = (row["us"], y)  # the peer's yardstick
            results["results"].append(row)
            _log(json.dumps(row))
    _write(results, args.out)
    if args.peer != "none":
        run_peer(cases, quantized["int4_w4a16"], ours, args, results)
        _write(results, args.out)
    if args.sweep:
        try:
            run_sweep(cases, quantized, args, results)
        finally:
            results["sweep_best"] = best_runs(results["sweep"], SWEEP_BEST_KEYS)
    _write(results, args.out)
    print(markdown(results), flush=True)
    _log(f"wrote {args.out} and {os.path.splitext(args.out)[0]}.md")
    return 0


def _write(results: dict, out: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1, default=str)
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write(markdown(results))


if __name__ == "__main__":
    raise SystemExit(main())
