#!/usr/bin/env python
"""W4A16 (INT4, MXFP4) and FP8-from-checkpoint experts vs bf16 experts through the public Experts API (CUDA).

    python scripts/bench_w4a16.py [--rows 64 512] [--out results/bench_w4a16.json] [--sweep]
                                  [--peer first|all|none] [--w4-decode both|convert|bits] [--max-seconds 240]
                                  [--dry-run]

Shape: Kimi-K2 per rank at EP8 (48 local experts, D 7168, F 2048, SiLU); routed rows spread uniformly at random
(multinomial) over the experts; pool layout with alignment 1 (the Triton backends' own). Paths:
    bf16        make_experts("triton", bf16 weights)
    fp8_ckpt    make_quantized_experts(fp8_block weights as a checkpoint stores them)   (x quantized per 128)
    int4_w4a16  make_quantized_experts(int4_group weights), bf16 activations
    mxfp4_w4a16 make_quantized_experts(mxfp4 weights), bf16 activations
The experts get the layout the layer's dispatch hands them (static rows hint, unused rows not zeroed: no host sync).
Per case: us (moe_ref.testing.bench with host_ahead: GPU time, calls queued back to back, L2 flushed), speedup vs bf16, weight GB/s of the experts that got rows,
calc_diff vs the dequantized fp32 reference (the torch backend of the same stored weights).

--w4-decode (TEMPORARY, goes with `MOE_REF_W4_DECODE` after its A/B): the 4-bit paths run under each named decode
arithmetic of the kernel (`both`, the default: convert and bits), timed in turn for `AB_ROUNDS` rounds (median), so
drift hits both; their rows are `<path>/<decode>` with a `w4_decode` key, and `bitwise_eq_decodes` says whether the
decodes' outputs were the same bits. The sweep runs each tile under each of them too.

--sweep: per 4-bit format, rows and GEMM, every tile of `DECODE_TILES_W4` that the library's rules keep for
the launch, forced through `launch_gemm(..., config=triton.Config(...))` and timed alone; each checked against the
autotuned launch's output (calc_diff < 1e-4; down reads the autotuned gate_up's h). The best per (format, rows,
GEMM) goes into the JSON and the markdown.

Peer anchor (--peer, default the first peer file): the INT4 W4A16 Triton kernel SGLang and vLLM ship (`fused_moe_kernel_gptq_awq`, read
out of the files `make peers` puts in .whl/ by `scripts/peer_moe.py`, never installed) on the same INT4 weights
(words read as its bytes) and rows: per GEMM the fastest of `PEER_W4A16_CONFIGS` (a small search), then its MLP
(GEMM1, the engine's act, GEMM2) with those configs, checked against our INT4 experts (calc_diff). Recorded as
skipped, with the reason, when the files are absent or lack the kernel. There is no MXFP4 peer kernel.

--max-seconds (counted from process start) stops the sweep and the peer search cleanly; what was measured is kept.
Progress lines are flushed; JSON goes to --out and a markdown table beside it (.md). --dry-run prints the plan
(cases, sweep tiles and the ones left out with the reason, peer files and configs) without a GPU.
"""
from __future__ import annotations

import time

_T0 = time.monotonic()  # before the heavy imports: --max-seconds counts the whole process

import argparse  # noqa: E402
import contextlib  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

_SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_SCRIPTS, ".."))
sys.path.insert(0, _SCRIPTS)  # peer_moe

from moe_ref.core import envs  # noqa: E402
from moe_ref.experts import ExpertLayout, make_experts  # noqa: E402
from moe_ref.experts.quantized import make_quantized_experts  # noqa: E402
from moe_ref.checkpoint.formats import QuantFormat, QuantizedExpertWeights, QuantSpec, quantize_weight  # noqa: E402
from moe_ref.testing import bench as _bench_calls, calc_diff  # noqa: E402


def bench(fn) -> float:
    """us of ``fn()``'s GPU work: calls queued back to back as a model queues its layers (L2 flushed, median)."""
    return _bench_calls(fn, host_ahead=True)

NUM_EXPERTS, HIDDEN, INTER = 48, 7168, 2048
W4_PATHS = {"int4_w4a16": (QuantFormat.INT4_GROUP, 1), "mxfp4_w4a16": (QuantFormat.MXFP4, 2)}  # path -> (format, W4)
GEMMS = ("gate_up", "down")
# TEMPORARY (the A/B of MOE_REF_W4_DECODE): the kernel's 4-bit decodes, and timing rounds per decode when alternating
W4_DECODES = envs.W4_DECODES
AB_ROUNDS = 3
SWEEP_CALC_DIFF_LIMIT = 1e-4
SWEEP_BEST_KEYS = ("path", "rows", "gemm")  # the sweep keeps its fastest correct tile per these (path/decode)
# The names of the autotune key of `autotuned_kernel()` (its `.cache` keys start with their values, in this order)
AUTOTUNE_KEY = ("rows_hint", "N", "K", "num_experts", "ACTIVATION", "INTERLEAVED", "FP8", "QUANT_OUT", "W4",
                "W4_DECODE", "USE_TMA", "PERSISTENT")
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


def _gm():
    # the package re-exports a function named grouped_mlp: take the module itself
    return importlib.import_module("moe_ref.kernels.grouped_mlp")


def _tiles():
    return importlib.import_module("moe_ref.kernels.grouped_mlp_tiles")


def gemm_shape(gemm: str) -> tuple[int, int]:
    """(n, k) of a GEMM at this script's shape: gate_up n = F per half, k = D; down n = D, k = F."""
    return (INTER, HIDDEN) if gemm == "gate_up" else (HIDDEN, INTER)


def sweep_tiles(w4: int, gemm: str) -> tuple[list[tuple], list[tuple[tuple, str]]]:
    """(tiles to time, [(tile, why left out)]) of `DECODE_TILES_W4` for one 4-bit launch, by the library's rules
    (`config_problem`, as autotune prunes them).

    Example: a tile with BLOCK_K 48 would be left out ("a 4-bit k-step covers whole 32-wide scale groups ...").
    """
    tiles = _tiles()
    n, k = gemm_shape(gemm)
    keep, left_out = [], []
    for tile in tiles.DECODE_TILES_W4:
        problem = tiles.config_problem(tiles.config_of_tile(tile), n=n, k=k, gated=gemm == "gate_up", fp8=False,
                                       quant_out=False, ieee_fp32=False, w4=w4)
        if problem:
            left_out.append((tuple(tile), problem))
        else:
            keep.append(tuple(tile))
    return keep, left_out


def peer_configs(gemm: str) -> list[dict]:
    """The `PEER_W4A16_CONFIGS` the peer kernel can run for this GEMM (its b loads need K % BLOCK_SIZE_K == 0)."""
    k = gemm_shape(gemm)[1]
    return [dict(c) for c in PEER_W4A16_CONFIGS if k % c["BLOCK_SIZE_K"] == 0]


def decodes_of(choice: str) -> tuple[str, ...]:
    """`--w4-decode`'s decodes, in timing order: `both` -> every one of `W4_DECODES`."""
    return W4_DECODES if choice == "both" else (choice,)


@contextlib.contextmanager
def w4_decode_env(decode: str):
    """`MOE_REF_W4_DECODE=decode` inside (the kernel reads it per launch), the previous value back afterwards."""
    previous = os.environ.get("MOE_REF_W4_DECODE")
    os.environ["MOE_REF_W4_DECODE"] = decode
    try:
        yield
    finally:
        if previous is None:
            del os.environ["MOE_REF_W4_DECODE"]
        else:
            os.environ["MOE_REF_W4_DECODE"] = previous


def time_decodes(fn, decodes: tuple[str, ...], rounds: int = AB_ROUNDS) -> dict[str, tuple[float, object]]:
    """`{decode: (median us, fn()'s output)}`: `fn` timed under each decode in turn, `rounds` rounds (one when there
    is one decode), so that drift of the GPU's clocks or neighbours hits every decode alike."""
    times: dict[str, list[float]] = {decode: [] for decode in decodes}
    for _ in range(rounds if len(decodes) > 1 else 1):
        for decode in decodes:
            with w4_decode_env(decode):
                times[decode].append(bench(fn))
    outputs = {}
    for decode in decodes:
        with w4_decode_env(decode):
            outputs[decode] = fn()
    return {decode: (statistics.median(times[decode]), outputs[decode]) for decode in decodes}


def tile_label(tile) -> str:
    block_m, block_n, block_k, warps, stages, *rest = tile
    return f"M{block_m} N{block_n} K{block_k} w{warps} s{stages}" + (f" g{rest[0]}" if rest else "")


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
    """The JSON's tables as markdown: the API rows, the sweep's best per case, the peer anchor."""
    lines = [f"# bench_w4a16 ({results.get('device', '?')})", "",
             f"{NUM_EXPERTS} experts, D {HIDDEN}, F {INTER}, SiLU, bf16 activations; L2 flushed, median.", "",
             "| rows | path | us | x bf16 | weight GB/s | calc_diff vs fp32 dequantized |",
             "|---:|---|---:|---:|---:|---:|"]
    for row in results.get("results", []):
        diff = row.get("calc_diff_vs_dequantized_fp32")
        lines.append(f"| {row['rows']} | {row['path']} | {row['us']} | {row['speedup_vs_bf16']} | "
                     f"{row['weight_gb_per_s']} | {'-' if diff is None else f'{diff:.1e}'} |")
    compared = [row for row in results.get("results", []) if "bitwise_eq_decodes" in row]
    if compared:
        differ = sorted({f"{row['rows']} {row['path']}" for row in compared if not row["bitwise_eq_decodes"]})
        lines += ["", "4-bit decodes (MOE_REF_W4_DECODE, a temporary A/B), outputs bitwise equal: "
                  + ("all" if not differ else "NO for " + ", ".join(differ))]
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
def _quantized(gate_up, down, fmt: QuantFormat) -> QuantizedExpertWeights:
    stored = []
    for weight in (gate_up, down):
        parts = [quantize_weight(w, fmt) for w in weight]  # one expert at a time: small temporaries
        stored += [torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])]
    return QuantizedExpertWeights(QuantSpec(fmt, 128 if fmt == QuantFormat.FP8_BLOCK else 32), *stored,
                                  hidden_size=HIDDEN, intermediate_size=INTER)


def _case(num_rows: int, gen) -> dict:
    counts = torch.bincount(torch.multinomial(torch.ones(NUM_EXPERTS), num_rows, replacement=True,
                                              generator=torch.Generator().manual_seed(num_rows)),
                            minlength=NUM_EXPERTS)
    packed = ExpertLayout.from_counts(counts.cuda(), alignment=1)
    # as the layer's device-side dispatch hands it to the experts: a static rows hint, unused rows not zeroed
    layout = ExpertLayout(packed.row_start_e, packed.num_rows_e, packed.num_pool_rows, 1, num_rows_hint=num_rows,
                          zero_unused_rows=False)
    x_PDx = torch.randn(layout.num_pool_rows, HIDDEN, device="cuda", generator=gen).bfloat16()
    return dict(rows=num_rows, layout=layout, x=x_PDx, touched=int((counts > 0).sum()) / NUM_EXPERTS)


def _gemm_weights(q: QuantizedExpertWeights, gemm: str) -> tuple[torch.Tensor, torch.Tensor]:
    if gemm == "gate_up":
        return q.gate_up_qweight_e2FDq, q.gate_up_scale_e2FDs
    return q.down_qweight_eDFq, q.down_scale_eDFs


def _launch(case: dict, q: QuantizedExpertWeights, w4: int, gemm: str, a, out, config=None):
    """One GEMM of this script's shape through `launch_gemm` (autotuned, or the forced `config`), under the
    caller's `MOE_REF_W4_DECODE`."""
    n, k = gemm_shape(gemm)
    weight, scale = _gemm_weights(q, gemm)
    layout = case["layout"]
    return _gm().launch_gemm(a, None, weight, scale, out, None, layout.row_start_e, layout.num_rows_e, n=n, k=k,
                             activation="silu" if gemm == "gate_up" else "none", situ_beta=4.0, situ_linear_beta=25.0,
                             fp8=False, quant_out=False, rows_hint=case["rows"], w4=w4, config=config)


def api_rows(name: str, experts, weight_bytes: int, reference, case: dict, decodes: tuple[str, ...],
             base_us: float | None) -> list[tuple[dict, torch.Tensor]]:
    """(row, output) of one path at one case through the public API: one, or for a 4-bit path one per decode
    (`time_decodes`, with `bitwise_eq_decodes` when there are several). `base_us`: the bf16 row's us (None for
    the bf16 path itself); `reference`: the torch backend of the same stored weights, or None."""
    def call():
        return experts(case["x"], case["layout"])
    timed = time_decodes(call, decodes) if name in W4_PATHS else {None: (bench(call), call())}
    outputs = [y for _, y in timed.values()]
    y_ref = None if reference is None else reference(case["x"].float(), case["layout"])
    rows = []
    for decode, (us, y) in timed.items():
        row = dict(rows=case["rows"], path=name if decode is None else f"{name}/{decode}", us=round(us, 1),
                   speedup_vs_bf16=round((base_us or us) / us, 2),
                   weight_gb_per_s=round(weight_bytes * case["touched"] / us / 1e3, 1))
        if decode is not None:
            row["w4_decode"] = decode
            if len(timed) > 1:
                row["bitwise_eq_decodes"] = all(torch.equal(other, outputs[0]) for other in outputs)
        if y_ref is not None:
            row["calc_diff_vs_dequantized_fp32"] = calc_diff(y.float(), y_ref)
        rows.append((row, y))
    return rows


# ------------------------------------------------------------------------------------------------
# the sweep
# ------------------------------------------------------------------------------------------------
def run_sweep(cases: list[dict], quantized: dict, args, results: dict) -> None:
    """Every `sweep_tiles` tile per 4-bit format, decode (`--w4-decode`), rows and GEMM (see the module docstring)."""
    for path, (_, w4) in W4_PATHS.items():
        for decode in decodes_of(args.w4_decode):
            with w4_decode_env(decode):
                if not _sweep_path(f"{path}/{decode}", w4, decode, quantized[path], cases, args, results):
                    return
    results["sweep_best"] = best_runs(results["sweep"], SWEEP_BEST_KEYS)


def _sweep_path(label: str, w4: int, decode: str, q: QuantizedExpertWeights, cases: list[dict], args,
                results: dict) -> bool:
    """The sweep of one format under one decode (already set); False when --max-seconds stopped it."""
    tiles = _tiles()
    refs = {}  # rows -> autotuned (h, y) and timings
    for case in cases:
        h = torch.empty(case["x"].shape[0], INTER, dtype=torch.bfloat16, device="cuda")
        y = torch.empty_like(case["x"])
        _launch(case, q, w4, "gate_up", case["x"], h)
        _launch(case, q, w4, "down", h, y)
        refs[case["rows"]] = dict(h=h, y=y)
        for gemm, a, out in (("gate_up", case["x"], h.clone()), ("down", h, y.clone())):
            refs[case["rows"]][gemm + "_us"] = bench(lambda: _launch(case, q, w4, gemm, a, out))
            chosen = _autotuned_tile(case["rows"], w4, gemm, decode)
            refs[case["rows"]][gemm + "_label"] = tile_label(chosen) if chosen else "?"
    for gemm in GEMMS:
        weight, scale = _gemm_weights(q, gemm)
        for tile in sweep_tiles(w4, gemm)[0]:
            if _elapsed() > args.max_seconds:
                results["stopped_early"] = f"sweep at {label} {gemm} {tile_label(tile)}"
                _log(f"--max-seconds {args.max_seconds:.0f} reached: stopping the sweep")
                return False
            parts = []
            for case in cases:
                ref = refs[case["rows"]]
                run = dict(path=label, w4_decode=decode, rows=case["rows"], gemm=gemm, tile=list(tile),
                           label=tile_label(tile), autotuned_us=ref[gemm + "_us"],
                           autotuned_label=ref[gemm + "_label"])
                a = case["x"] if gemm == "gate_up" else ref["h"]
                out = torch.full_like(ref["h"] if gemm == "gate_up" else ref["y"], float("nan"))
                config = tiles.config_of_tile(tile)
                try:
                    _launch(case, q, w4, gemm, a, out, config)
                    run["calc_diff"] = calc_diff(out.float(), (ref["h"] if gemm == "gate_up" else ref["y"]).float())
                    run["ok"] = bool(run["calc_diff"] < SWEEP_CALC_DIFF_LIMIT)
                    run["us"] = bench(lambda: _launch(case, q, w4, gemm, a, out, config))
                    run["weight_gb_per_s"] = (weight.nbytes + scale.nbytes) * case["touched"] / run["us"] / 1e3
                    parts.append(f"{case['rows']}: {run['us']:.0f} us (autotuned {ref[gemm + '_us']:.0f})"
                                 + ("" if run["ok"] else f" FAIL calc_diff {run['calc_diff']:.1e}"))
                except Exception as exc:  # noqa: BLE001 - e.g. OutOfResources: recorded, the sweep goes on
                    run["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    parts.append(f"{case['rows']}: error")
                    if "illegal" in run["error"].lower():
                        raise  # the CUDA context is gone
                results["sweep"].append(run)
            _log(f"sweep {label} {gemm:7s} {tile_label(tile):22s} " + " | ".join(parts))
    return True


def autotune_key(rows: int, w4: int, gemm: str, decode: str) -> tuple:
    """The values of `AUTOTUNE_KEY` for one of this script's 4-bit launches (`_launch` with config=None) under the
    4-bit `decode`: silu gate_up (stacked rows) or down, bf16 activations, pointer loads (4-bit weights never use
    TMA), not persistent."""
    import triton

    n, k = gemm_shape(gemm)
    values = dict(rows_hint=triton.next_power_of_2(rows), N=n, K=k, num_experts=NUM_EXPERTS,
                  ACTIVATION=1 if gemm == "gate_up" else 0, INTERLEAVED=False, FP8=False, QUANT_OUT=False, W4=w4,
                  W4_DECODE=W4_DECODES.index(decode), USE_TMA=False, PERSISTENT=False)
    return tuple(values[name] for name in AUTOTUNE_KEY)


def _autotuned_tile(rows: int, w4: int, gemm: str, decode: str):
    """The tile autotune chose for this launch (from `autotuned_kernel().cache`, keyed by the autotune key's values
    first, then the tensors' dtypes), or None when not found."""
    want = autotune_key(rows, w4, gemm, decode)
    for key, config in _gm().autotuned_kernel().cache.items():
        if tuple(key[:len(want)]) == want:
            return _tiles().tile_of(config)
    return None


# ------------------------------------------------------------------------------------------------
# the peer anchor
# ------------------------------------------------------------------------------------------------
def run_peer(cases: list[dict], q: QuantizedExpertWeights, ours: dict, args, results: dict) -> None:
    """The engines' INT4 W4A16 kernel per peer file (see the module docstring); `ours[rows]` = (our INT4 experts'
    us, y)."""
    import peer_moe

    files = peer_moe.default_peer_files()[:1 if args.peer == "first" else None]
    if not files:
        results["peer"].append(dict(skipped="no peer file in .whl/ (`make peers` downloads them)"))
        _log("peer: skipped (no peer file in .whl/; `make peers`)")
        return
    weights = {gemm: (peer_moe.int4_words_as_peer_bytes(_gemm_weights(q, gemm)[0]), _gemm_weights(q, gemm)[1])
               for gemm in GEMMS}
    for path in files:
        entry = dict(file=os.path.basename(path), rows=[], timed=[])
        results["peer"].append(entry)
        try:
            w4 = peer_moe.load_peer_w4a16(path)
        except Exception as exc:  # noqa: BLE001 - a missing file, kernel or signature: recorded, the run goes on
            entry["skipped"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            _log(f"peer {entry['file']}: skipped ({entry['skipped']})")
            continue
        entry["label"] = w4.label
        for case in cases:
            layout = case["layout"]
            routing = peer_moe.peer_routing(layout.row_start_e, layout.num_rows_e, case["x"].shape[0], 16,
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
                        peer_moe.launch_w4a16_gemm(w4, inputs[gemm], *weights[gemm], out, routing, config)
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
                    return peer_moe.run_peer_w4a16_mlp(w4, case["x"], *weights["gate_up"], *weights["down"], routing,
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
    parser.add_argument("--sweep", action="store_true", help="time DECODE_TILES_W4 per format, rows and GEMM")
    parser.add_argument("--peer", choices=["first", "all", "none"], default="first",
                        help="peer files to run: the first of .whl/ (SGLang's wheel when present: the engines' kernels "
                             "differ only in argument names), every one, or none")
    parser.add_argument("--w4-decode", choices=["both", *W4_DECODES], default="both",
                        help="TEMPORARY A/B: the 4-bit decode arithmetic the W4 paths (and the sweep) run under "
                             "(MOE_REF_W4_DECODE); both: each, alternating")
    parser.add_argument("--max-seconds", type=float, default=240.0,
                        help="stop the sweep and the peer search past this (from process start)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan; needs no GPU")
    args = parser.parse_args(argv)
    if any(r <= 0 for r in args.rows):
        parser.error(f"--rows must be positive, got {args.rows}")
    return args


def dry_run(args) -> int:
    print(f"shape: {NUM_EXPERTS} experts, D {HIDDEN}, F {INTER}; rows {args.rows}; out {args.out} (+ .md)")
    decodes = decodes_of(args.w4_decode)
    print("API rows: bf16, fp8_ckpt, " + ", ".join(f"{path}/{decode}" for path in W4_PATHS for decode in decodes))
    rounds = f"alternating, {AB_ROUNDS} rounds, median" if len(decodes) > 1 else "one"
    print(f"4-bit decodes (MOE_REF_W4_DECODE, temporary A/B): {', '.join(decodes)} ({rounds})")
    if args.sweep:
        for path, (_, w4) in W4_PATHS.items():
            for gemm in GEMMS:
                keep, left_out = sweep_tiles(w4, gemm)
                print(f"sweep {path} {gemm}: {[tile_label(t) for t in keep]}")
                for tile, why in left_out:
                    print(f"    left out {tile_label(tile)}: {why}")
    if args.peer != "none":
        import peer_moe

        files = peer_moe.default_peer_files()[:1 if args.peer == "first" else None]
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
    gate_up = (torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=gen) / HIDDEN**0.5).bfloat16()
    down = (torch.randn(NUM_EXPERTS, HIDDEN, INTER, device="cuda", generator=gen) / INTER**0.5).bfloat16()
    paths = {"bf16": (make_experts("triton", gate_up, down, "silu"), gate_up.nbytes + down.nbytes, None)}
    quantized = {}
    for fmt, name in ((QuantFormat.FP8_BLOCK, "fp8_ckpt"), (QuantFormat.INT4_GROUP, "int4_w4a16"),
                      (QuantFormat.MXFP4, "mxfp4_w4a16")):
        q = quantized[name] = _quantized(gate_up, down, fmt)
        reference = make_quantized_experts(q, "silu", backend="torch")
        paths[name] = (make_quantized_experts(q, "silu"), q.nbytes(), reference)
    del gate_up, down
    _log("weights ready")
    results = {"device": torch.cuda.get_device_name(), "shape": dict(experts=NUM_EXPERTS, hidden=HIDDEN,
               intermediate=INTER), "args": vars(args), "results": [], "sweep": [], "sweep_best": [], "peer": [],
               "stopped_early": None}
    cases, ours = [], {}
    decodes = decodes_of(args.w4_decode)
    for num_rows in args.rows:
        case = _case(num_rows, gen)
        cases.append(case)
        base_us = None
        for name, (experts, weight_bytes, reference) in paths.items():
            for row, y in api_rows(name, experts, weight_bytes, reference, case, decodes, base_us):
                base_us = base_us or row["us"]
                if name == "int4_w4a16" and (num_rows not in ours or row["w4_decode"] == envs.w4_decode()):
                    ours[num_rows] = (row["us"], y)  # the peer's yardstick: the decode the library runs by default
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
