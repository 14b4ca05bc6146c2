#!/usr/bin/env python
"""Sweep grouped_mlp tiles per GEMM for the mid and prefill regimes on one H200 (needs CUDA; --dry-run runs anywhere).

    python3 scripts/tune_grouped_mlp.py [--fp8] [--decode [--explore]] [--alignment 128]
                                        [--out results/tune_grouped_mlp.json] [--max-seconds 170] [--dry-run]

Cases: Kimi-K2 (48 experts, D 7168, F 2048) and Step3 (48 experts, D 7168, F 5120) per-rank shapes, 4096
and 32768 routed rows spread evenly over the experts, each expert segment at a 128-aligned pool row
(`--alignment N`: segments start on multiples of N rows; 1 packs them back to back, the pool the layer builds for
the Triton experts). The rows hint is the routed rows whatever the alignment (as the layer passes it). Per case
both GEMMs are timed separately through the library launcher with a forced config
(`moe_ref.kernels.experts.grouped_mlp.launch_gemm(..., config=triton.Config(...))`, the same kernel and compile options
that autotune uses):

    gate_up (GEMM1)  h[R, F] = silu(x @ gate.T) * (x @ up.T)   w [e, 2F, D]; one program: BLOCK_M x 2*BLOCK_N
    down    (GEMM2)  y[R, D] = h @ down.T                      w [e, D, F]

Anchor: torch grouped_mm on the same rows packed, the same GEMM (without SiLU for gate_up).
Check: every (config, case) result once against grouped_mlp_ref (on 5 of the 48 experts, fp32), calc_diff
< 1e-4: gate_up through a fixed down config, down from a fixed gate_up's h.

Candidates (Hopper wgmma, bf16): BLOCK_M {64, 128} x effective N tile {128, 256} (gate_up: BLOCK_N is per
half, so {64, 128}) x BLOCK_K 64 x num_warps {4, 8} x num_stages {3, 4, 5}, pruned at 227 KB of shared
memory, > 128 fp32 accumulator registers per thread, and the library's legality rules; plus the tiles
of the current autotune lists (`MID_TILES`, `PREFILL_TILES`) that the library's rules keep (marked * in
a case's table when autotune would consider them for that launch). Phase 2: the best `--swizzle-top`
tiles per GEMM (ranked on the 32768-row cases) again with GROUP_M in `--group-m` (L2 swizzle).

Compile time: each config compiles once per GEMM (every case has the same Triton specialisation, so
the compiled kernel is reused across shapes and rows). Before timing, a pool of processes compiles all
configs of a phase in parallel into Triton's on-disk cache with tiny launches of identical
specialisation (--jobs 0: compile in this process, serially). Nothing is timed while they compile.

--decode: the decode regime instead (64 and 512 rows; the DECODE lists and `DECODE_GRID_*`: 16/32-row tiles, 4
warps, 4-8 stages), for bf16 or --fp8. --decode --explore: the wider few-row space `DECODE_EXPLORE_*` instead of
that grid (BLOCK_M 16/32/64 x effective N 128/256 x BLOCK_K 128/64 x 4/8 warps x 3-6 stages), kept where the
library's rules keep it (correctness, shared memory; no register rules, as --explore everywhere: the compiler's
spill counts show which fit). --interleaved: gate_up's rows interleaved (128-row gate and up blocks), as the FP8
Triton experts store them (`grouped_mlp(..., gate_up_interleaved=True)`).

--fp8 (default --out results/tune_grouped_mlp_fp8.json): the FP8 path as `grouped_mlp` runs it for e4m3 x:
x quantized per row per 128 columns (fp32 scales), weights e4m3 with fp32 128x128 block scales
(`moe_ref.kernels.experts.fp8`), GEMM1 re-quantizing h per row per 128 columns, GEMM2 writing bf16 y.
  Check: calc_diff < 1e-3 against grouped_mlp_ref on the same FP8 operands (the FP8 twin).
  Anchor: the bf16 kernel (same launcher) with the bf16 sweep's best tile of the same case (`BF16_BEST`, from
  docs/results/tune_grouped_mlp.txt), timed in the same run: "x bf16" = bf16 us / FP8 us.
  Candidates: the library's FP8 rules (gate_up BLOCK_N 128, BLOCK_K dividing 128, <= 128x128 fp32
  accumulator elements per program) over BLOCK_K {128, 64} x num_warps {4, 8} x num_stages {3, 4, 5}, gate_up
  BLOCK_M {64, 32}, down (BLOCK_M, BLOCK_N) {(128, 128), (64, 256), (64, 128)}, and at most 64 accumulator
  registers per thread (the scaled partial product of each k-step needs as many again); plus the current FP8
  autotune tiles (`MID_TILES_FP8`, `PREFILL_TILES_FP8`) the library's rules keep, spilling or not. Kimi-K2
  and Step3 differ in Triton's specialisation of the FP8 scale strides (F/128 = 16 vs 40), so each config
  compiles once per shape; the workers compile both.
  Output as below, with the replacement `MID_TILES_FP8` / `PREFILL_TILES_FP8` blocks (the current entries +
  the winners) to paste into moe_ref/kernels/experts/grouped_mlp_tiles.py; bf16's lists are not touched.

Output: a progress line per config (flushed), then per (shape, rows, GEMM) a table config | us |
TFLOP/s | x vs the anchor | calc_diff | registers per thread | spilled bytes, the best config per case, and per (regime, GEMM) the tiles to
put into `MID_TILES` / `PREFILL_TILES` (--fp8: `*_FP8`) of moe_ref/kernels/experts/grouped_mlp_tiles.py, then those lists
with the winners appended, ready to paste (also written to <out>.txt).
JSON goes to --out after every config, so a time-out keeps what was measured; --max-seconds stops the
sweep cleanly (default 170 s, counted from process start, including setup and compilation).
"""

from __future__ import annotations

import time

_T0 = time.monotonic()  # before the heavy imports: --max-seconds counts the whole process

import argparse  # noqa: E402
import concurrent.futures  # noqa: E402
import importlib  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402

from moe_ref.bench.cases import ALIGN, MODELS, grouped_mm_fn  # noqa: E402

SHAPES = {name: shape[:3] for name, shape in MODELS.items()}  # name -> (local experts e, hidden D, intermediate F)
ROWS = (4096, 32768)
DECODE_ROWS = (64, 512)  # 1.3 and 10.7 rows per expert of 48
GEMMS = ("gate_up", "down")
SMEM_LIMIT = 227 * 1024          # H100/H200 opt-in shared memory per block
MAX_ACC_REGS = 128               # fp32 accumulator registers per thread (BLOCK_M x effective N / threads)
CALC_DIFF_LIMIT = 1e-4
CALC_DIFF_LIMIT_FP8 = 1e-3       # FP8 kernel vs the FP8 twin (the same e4m3 operands and scales)
CHECK_EXPERTS = (0, 1, 24, -2, -1)  # experts whose rows are checked (mod e)
GRID_BLOCK_M = (64, 128)
GRID_EFFECTIVE_N = (128, 256)
GRID_BLOCK_K = (64,)
GRID_WARPS = (4, 8)
GRID_STAGES = (3, 4, 5)
FIXED_TILE = (64, 128, 64, 4, 3)  # the library's fallback: computes h for the down sweep, y for gate_up checks
# --fp8: BLOCK_K 128 first (one e4m3 k-step = one 128-wide scale group); gate_up's BLOCK_N is 128 (its epilogue
# quantizes one 128-column group of h per tile); (BLOCK_M, effective N) pairs per GEMM
FP8_GRID_TILES_MN = {"gate_up": ((64, 256), (32, 256)), "down": ((128, 128), (64, 256), (64, 128))}
# --explore (FP8): instead of the grid, these larger tiles (8 warps), past the library's register rules; the
# compiler's register and spill counts show which fit (the per-tile scalar weight scale and TMA loads free
# registers the rules were measured without)
EXPLORE_TILES = {
    "gate_up": ((128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 128, 64, 8, 4), (128, 128, 64, 8, 5)),
    "down": ((128, 256, 128, 8, 3), (128, 256, 128, 8, 4), (256, 128, 128, 8, 3), (256, 128, 64, 8, 4),
             (128, 256, 64, 8, 4)),
}
FP8_GRID_BLOCK_K = (128, 64)
# --decode (<= 32 rows per expert: weight-bandwidth bound): instead of the grid above, few-row tiles with deep
# pipelines (more weight bytes in flight per SM); (BLOCK_M, effective N) pairs per GEMM, 4 warps
DECODE_GRID_TILES_MN = {"gate_up": ((16, 256), (32, 256), (16, 128)), "down": ((16, 128), (16, 256), (32, 128))}
DECODE_GRID_BLOCK_K = (128, 64)
DECODE_GRID_STAGES = (4, 5, 6, 8)
# --decode --explore: the decode space widened (tiles up to the mid regime's 64 rows, 8 warps, shallower pipelines);
# 4 warps and 4-5 stages first, so a sweep cut short by --max-seconds holds the likelier winners
DECODE_EXPLORE_BLOCK_M = (16, 32, 64)
DECODE_EXPLORE_EFFECTIVE_N = (128, 256)
DECODE_EXPLORE_BLOCK_K = (128, 64)
DECODE_EXPLORE_WARPS = (4, 8)
DECODE_EXPLORE_STAGES = (4, 5, 3, 6)
FP8_MAX_ACC_REGS = 64            # fp32 accumulator registers per thread; the scaled partial product doubles them
FIXED_TILE_FP8 = (64, 128, 128, 8, 3)  # legal for both FP8 GEMMs; in the current FP8 lists and the FP8 grid
# --fp8 anchor: the bf16 kernel's best tile per (shape, regime, GEMM), the winners of the bf16 sweep on an H200
# (2026-11-30, docs/results/tune_grouped_mlp.txt; all in the current bf16 autotune lists)
BF16_BEST = {
    ("kimi-k2", "mid", "gate_up"): (128, 128, 64, 8, 4, 8), ("kimi-k2", "mid", "down"): (128, 256, 64, 8, 4),
    ("kimi-k2", "prefill", "gate_up"): (128, 128, 64, 8, 3, 8), ("kimi-k2", "prefill", "down"): (128, 256, 64, 8, 3, 8),
    ("step3", "mid", "gate_up"): (128, 128, 64, 8, 4, 8), ("step3", "mid", "down"): (128, 256, 64, 8, 4),
    ("step3", "prefill", "gate_up"): (128, 64, 64, 4, 3, 8), ("step3", "prefill", "down"): (128, 256, 64, 8, 3, 8),
}
SITU_BETA, SITU_LINEAR_BETA = 4.0, 25.0  # grouped_mlp's defaults (same constexpr flags as the library)
DEVICE = "cuda"  # a CPU smoke test of the whole flow sets "cpu" (with TRITON_INTERPRET=1 and tiny SHAPES)


def _gm():
    # the package re-exports a function named grouped_mlp: take the module itself
    return importlib.import_module("moe_ref.kernels.experts.grouped_mlp")


def _tiles():
    return importlib.import_module("moe_ref.kernels.experts.grouped_mlp_tiles")


def _elapsed() -> float:
    return time.monotonic() - _T0


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _log(message: str) -> None:
    print(f"[{_elapsed():6.1f}s] {message}", flush=True)


# ------------------------------------------------------------------------------------------------
# candidates
# ------------------------------------------------------------------------------------------------
def _make_config(tile: tuple, group_m: int) -> triton.Config:
    return _tiles().config_of_tile((*tile, group_m))


def _list_entry(tile: tuple, group_m: int) -> tuple:
    """The form of an entry of `MID_TILES` / `PREFILL_TILES`: GROUP_M as a 6th element when != 1."""
    return tuple(tile) if group_m == 1 else (*tile, group_m)


def _label(gemm: str, tile: tuple, group_m: int) -> str:
    """`tile` is (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages[, GROUP_M]); a 6th element overrides `group_m`."""
    block_m, block_n, block_k, warps, stages, *rest = tile
    group_m = rest[0] if rest else group_m
    n = f"{block_n}x2" if gemm == "gate_up" else f"{block_n}"
    return f"M{block_m} N{n} K{block_k} w{warps} s{stages} g{group_m}"


def _skip_reason(gemm: str, tile: tuple, fp8: bool = False, heuristics: bool = True,
                 explore: bool = False) -> str | None:
    """Why the sweep leaves this tile out for this GEMM (None: keep). Uses the library's rules (FP8's with
    `fp8`) with the H200's 227 KB, plus (`heuristics`) an accumulator-register bound; `explore` (--explore)
    drops the register rules and that bound."""
    gated = gemm == "gate_up"
    config = _make_config(tile, 1)
    _, hidden, inter = SHAPES["kimi-k2"] if "kimi-k2" in SHAPES else next(iter(SHAPES.values()))
    n, k = (inter, hidden) if gated else (hidden, inter)
    problem = _tiles().config_problem(config, n=n, k=k, gated=gated, fp8=fp8, quant_out=fp8 and gated, ieee_fp32=False,
                                 smem_limit=SMEM_LIMIT, register_rules=not explore)
    if problem or not heuristics or explore:
        return problem
    block_m, block_n, _, warps, _ = tile
    acc_regs = block_m * block_n * (2 if gated else 1) // (32 * warps)
    limit = FP8_MAX_ACC_REGS if fp8 else MAX_ACC_REGS
    if acc_regs > limit:
        return f"{acc_regs} fp32 accumulator registers per thread > {limit}"
    return None


def _current_tiles(fp8: bool = False, decode: bool = False) -> list[tuple]:
    """(tile, GROUP_M) of the current mid and prefill autotune lists, or (`decode`) the decode list (the FP8
    lists with `fp8`)."""
    t = _tiles()
    if decode:
        lists = t.DECODE_TILES_FP8 if fp8 else t.DECODE_TILES
    else:
        lists = t.MID_TILES_FP8 + t.PREFILL_TILES_FP8 if fp8 else t.MID_TILES + t.PREFILL_TILES
    entries = dict.fromkeys(_tiles().normalize_tile(t) for t in lists)
    return [(tuple(t[:5]), t[5] if len(t) > 5 else 1) for t in entries]


def _grid(gemm: str, fp8: bool, explore: bool = False, decode: bool = False) -> list[tuple]:
    """(tile, GROUP_M 1) of the phase-1 grid, largest tiles first (--fp8 --explore: EXPLORE_TILES instead;
    --decode: the decode grid; --decode --explore: the `DECODE_EXPLORE_*` space)."""
    gated = gemm == "gate_up"
    if decode and explore:
        return [((block_m, n_eff // 2 if gated else n_eff, block_k, warps, stages), 1)
                for warps, stages, block_m, n_eff, block_k in itertools.product(
                    DECODE_EXPLORE_WARPS, DECODE_EXPLORE_STAGES, DECODE_EXPLORE_BLOCK_M, DECODE_EXPLORE_EFFECTIVE_N,
                    DECODE_EXPLORE_BLOCK_K)]
    if decode:
        return [((block_m, n_eff // 2 if gated else n_eff, block_k, 4, stages), 1)
                for (block_m, n_eff), block_k, stages in itertools.product(
                    DECODE_GRID_TILES_MN[gemm], DECODE_GRID_BLOCK_K, DECODE_GRID_STAGES)]
    if fp8:
        if explore:
            return [(tile, 1) for tile in EXPLORE_TILES[gemm]]
        shapes = [(m, n_eff, k) for (m, n_eff), k in itertools.product(FP8_GRID_TILES_MN[gemm], FP8_GRID_BLOCK_K)]
    else:
        shapes = list(itertools.product(sorted(GRID_BLOCK_M, reverse=True), sorted(GRID_EFFECTIVE_N, reverse=True),
                                        GRID_BLOCK_K))
    return [((block_m, n_eff // 2 if gated else n_eff, block_k, warps, stages), 1)
            for (block_m, n_eff, block_k), warps, stages in itertools.product(
                shapes, sorted(GRID_WARPS, reverse=True), GRID_STAGES)]


def fixed_tile(fp8: bool) -> tuple:
    return FIXED_TILE_FP8 if fp8 else FIXED_TILE


def enumerate_candidates(gemm: str, include_current: bool = True, fp8: bool = False,
                         explore: bool = False, decode: bool = False) -> tuple[list[dict], list[dict]]:
    """(kept, skipped) phase-1 candidates for one GEMM (FP8 operands with `fp8`): current autotune tiles
    first (kept whenever the library's rules keep them), then the grid (largest tiles first, so a
    truncated sweep has the likely winners); `explore`: see --explore."""
    gated = gemm == "gate_up"
    grid = _grid(gemm, fp8, explore, decode) + ([(fixed_tile(fp8), 1)] if decode else [])  # the check tile
    current = _current_tiles(fp8, decode) if include_current else []
    kept, skipped = [], []
    for tile, group_m in dict.fromkeys(current + grid):
        source = "+".join(name for name, pool in (("current", current), ("grid", grid)) if (tile, group_m) in pool)
        entry = {"gemm": gemm, "fp8": fp8, "tile": tile, "group_m": group_m, "label": _label(gemm, tile, group_m),
                 "source": source, "smem_kb": _tiles().smem_bytes(_make_config(tile, 1), gated=gated,
                                                                bytes_per_element=1 if fp8 else 2) / 1024}
        reason = _skip_reason(gemm, tile, fp8, heuristics="current" not in source, explore=explore)
        if reason:
            skipped.append({**entry, "reason": reason})
        else:
            kept.append(entry)
    if fixed_tile(fp8) not in [c["tile"] for c in kept]:
        raise AssertionError(f"the fixed check tile {fixed_tile(fp8)} must be a candidate of {gemm}")
    return kept, skipped


def bf16_anchor_tile(shape: str, rows: int, gemm: str) -> tuple | None:
    """--fp8 anchor: the bf16 sweep's best list entry for this case's (shape, regime, GEMM), None if unknown."""
    num_experts = SHAPES[shape][0]
    regime = _tiles().regime(triton.next_power_of_2(rows), num_experts)[0]
    return BF16_BEST.get((shape, regime, gemm))


def anchor_candidates(shapes, rows_list) -> list[dict]:
    """The bf16 anchor configs of --fp8 as compile jobs (one per distinct GEMM and tile)."""
    out = {}
    for shape, rows, gemm in itertools.product(shapes, rows_list, GEMMS):  # both GEMMs: down's h comes from gate_up
        entry = bf16_anchor_tile(shape, rows, gemm)
        if entry is not None:
            tile, group_m = tuple(entry[:5]), entry[5] if len(entry) > 5 else 1
            out[(gemm, tile, group_m)] = {"gemm": gemm, "fp8": False, "tile": tile, "group_m": group_m,
                                          "label": "bf16 " + _label(gemm, tile, group_m), "source": "anchor"}
    return list(out.values())


# ------------------------------------------------------------------------------------------------
# launches (the library launcher, as grouped_mlp calls it for silu: bf16, or FP8 when w is e4m3)
# ------------------------------------------------------------------------------------------------
def launch(gemm: str, a, w, out, row_start_e, num_rows_e, rows_hint: int, config: triton.Config, *,
           a_scale=None, w_scale=None, out_scale=None, interleaved: bool = False):
    """One GEMM through the library launcher; returns the compiled kernel (GPU) or None. FP8 (e4m3 `w`):
    `a_scale` per row per 128 columns, `w_scale` 128x128 blocks; gate_up writes e4m3 h + `out_scale`.
    `interleaved`: gate_up's rows (and FP8 scale rows) alternate gate and up blocks
    (`grouped_mlp(..., gate_up_interleaved=True)`; BLOCK_N 128)."""
    gm = _gm()
    fp8 = w.dtype == gm.FP8_DTYPE
    if gemm == "gate_up":
        n, k, activation = w.shape[1] // 2, w.shape[2], "silu"
    else:
        n, k, activation = w.shape[1], w.shape[2], "none"
    return gm.launch_gemm(a, a_scale, w, w_scale, out, out_scale, row_start_e, num_rows_e, n=n, k=k,
                           activation=activation, situ_beta=SITU_BETA, situ_linear_beta=SITU_LINEAR_BETA, fp8=fp8,
                           quant_out=fp8 and gemm == "gate_up", rows_hint=rows_hint, interleaved=interleaved,
                           config=config)


def quantize_weights(weights: dict) -> dict:
    """`weights` (bf16 "gate_up", "down") + "fp8": e4m3 weights with fp32 128x128 block scales, as an FP8
    checkpoint stores them (`moe_ref.kernels.experts.fp8.quantize_fp8_per_block_128`, one expert matrix at a time)."""
    from moe_ref.kernels.experts.fp8 import quantize_fp8_per_block_128

    fp8 = {}
    for name in ("gate_up", "down"):
        fp8[name], fp8[name + "_scale"] = quantize_fp8_per_block_128(weights[name])
    return {**weights, "fp8": fp8}


def make_ops(x, weights: dict, pool_rows: int, fp8: bool, device: str, interleaved: bool = False) -> dict:
    """The operands and buffers of both GEMMs in one precision: bf16 as given, or (`fp8`) x quantized to e4m3
    per row per 128 columns and the e4m3 weights of `quantize_weights` (done here if `weights` lacks them).
    `h_PF` is the swept gate_up's output, `h_fixed` the fixed config's (down's input); `*_scale` are None
    for bf16. `interleaved`: gate_up's rows re-laid out in alternating 128-row gate and up blocks (its FP8 block
    scales alike), recorded as `ops["gate_up_interleaved"]`."""
    gm = _gm()
    hidden, inter = x.shape[1], weights["down"].shape[2]
    if not fp8:
        ops = {"x": x, "x_scale": None, "gate_up": weights["gate_up"], "gate_up_scale": None,
               "down": weights["down"], "down_scale": None,
               "h_PF": torch.zeros(pool_rows, inter, dtype=x.dtype, device=device), "h_PF_scale": None,
               "h_fixed": torch.zeros(pool_rows, inter, dtype=x.dtype, device=device), "h_fixed_scale": None,
               "y": torch.zeros(pool_rows, hidden, dtype=x.dtype, device=device)}
    else:
        from moe_ref.kernels.experts.fp8 import quantize_fp8_per_128

        if "fp8" not in weights:
            weights = quantize_weights(weights)
        ops = {"y": torch.zeros(pool_rows, hidden, dtype=torch.bfloat16, device=device), **weights["fp8"]}
        ops["x"], ops["x_scale"] = quantize_fp8_per_128(x)
        for h in ("h_PF", "h_fixed"):
            ops[h] = torch.zeros(pool_rows, inter, dtype=gm.FP8_DTYPE, device=device)
            ops[h + "_scale"] = torch.ones(pool_rows, gm.num_fp8_groups(inter), dtype=torch.float32, device=device)
    if interleaved:
        ops["gate_up"] = gm.interleave_gate_up(ops["gate_up"])
        if ops["gate_up_scale"] is not None:
            ops["gate_up_scale"] = gm.interleave_gate_up(ops["gate_up_scale"], rows_per_block=1)
    ops["gate_up_interleaved"] = interleaved
    return ops


def run_gemm(ops: dict, case: dict, gemm: str, config: triton.Config, h: str = "h_PF"):
    """One GEMM of `case` on `ops` (see `make_ops`): gate_up x -> ops[h], down ops[h] -> y."""
    if gemm == "gate_up":
        a, a_scale, out, out_scale = ops["x"], ops["x_scale"], ops[h], ops[h + "_scale"]
    else:
        a, a_scale, out, out_scale = ops[h], ops[h + "_scale"], ops["y"], None
    return launch(gemm, a, ops[gemm], out, case["row_start_e"], case["num_rows_e"], case["rows"], config,
                  a_scale=a_scale, w_scale=ops[gemm + "_scale"], out_scale=out_scale,
                  interleaved=gemm == "gate_up" and ops["gate_up_interleaved"])


def _like_dim(dim: int) -> int:
    """A small dimension that Triton specialises like `dim` in the FP8 launches: a multiple of 128 whose
    128-column group count has the same factors of 2 up to 16 (the scale strides and their products are
    then multiples of 16 exactly when the real ones are), e.g. 7168 (56 groups) -> 1024 (8), 2048 (16)
    -> 2048, 5120 (40) -> 1024. Dimensions that are not multiples of 128 are kept."""
    groups, rest = divmod(dim, 128)
    if rest or groups <= 1:
        return dim
    power = 1
    while groups % (power * 2) == 0 and power < 16:
        power *= 2
    return 128 * (power if power > 1 else 3)


def compile_dims(shape: str, fp8: bool) -> tuple[int, int]:
    """(D, F) of a worker's compile launch for this shape: bf16 launches do not depend on them (every int
    a multiple of 16, no scales), FP8 launches do through the scale strides (`_like_dim`)."""
    _, hidden, inter = SHAPES[shape]
    return (_like_dim(hidden), _like_dim(inter)) if fp8 else (256, 128)


_WORKER_TENSORS: dict = {}


def _compile_job(gemm: str, tile: tuple, group_m: int, num_experts: int, fp8: bool = False,
                 dims: tuple[int, int] = (256, 128), interleaved: bool = False) -> tuple[float, str | None]:
    """Pool worker: compile one config into Triton's on-disk cache with a tiny launch whose
    specialisation equals the real cases' (same expert count, dtypes and flags, ints and strides that
    are multiples of 16 where the real ones are: `compile_dims`), so the main process's first launch of
    it only loads the cubin."""
    start = time.perf_counter()
    try:
        key = (fp8, tuple(dims), interleaved)
        if key not in _WORKER_TENSORS:
            (d, f), e, r = dims, num_experts, 256
            weights = {"gate_up": torch.zeros(e, 2 * f, d, dtype=torch.bfloat16, device="cuda"),
                       "down": torch.zeros(e, d, f, dtype=torch.bfloat16, device="cuda")}
            ops = make_ops(torch.zeros(r, d, dtype=torch.bfloat16, device="cuda"), weights, r, fp8, "cuda",
                           interleaved)
            layout_e = {"rows": 4096, "row_start_e": torch.zeros(e, dtype=torch.int64, device="cuda"),
                        "num_rows_e": torch.tensor([64] + [0] * (e - 1), dtype=torch.int32, device="cuda")}
            _WORKER_TENSORS[key] = (ops, layout_e)
        ops, layout_e = _WORKER_TENSORS[key]
        run_gemm(ops, layout_e, gemm, _make_config(tuple(tile), group_m))
        torch.cuda.synchronize()
        return time.perf_counter() - start, None
    except Exception as exc:  # reported; the main process retries (and records) it
        return time.perf_counter() - start, f"{type(exc).__name__}: {str(exc)[:200]}"


class Precompiler:
    """Compiles configs in worker processes (spawned once, reused by both phases); each config once per
    entry of `dims[fp8]` (the distinct `compile_dims` of the swept shapes)."""

    def __init__(self, jobs: int, num_experts: int, dims: dict | None = None, interleaved: bool = False):
        self.jobs, self.num_experts, self.interleaved = jobs, num_experts, interleaved
        self.dims = dims or {False: [(256, 128)], True: []}
        self.pool = None
        if jobs > 0:
            try:
                self.pool = concurrent.futures.ProcessPoolExecutor(
                    max_workers=jobs, mp_context=multiprocessing.get_context("spawn"))
            except Exception as exc:
                _log(f"precompile pool unavailable ({exc!r}): compiling serially")

    def submit(self, candidates: list[dict]) -> list:
        if self.pool is None:
            return []
        try:
            return [(c, self.pool.submit(_compile_job, c["gemm"], c["tile"], c["group_m"], self.num_experts,
                                         c.get("fp8", False), dims, self.interleaved and c["gemm"] == "gate_up"))
                    for c in candidates for dims in self.dims[c.get("fp8", False)]]
        except Exception as exc:
            _log(f"precompile submit failed ({exc!r}): compiling serially")
            return []

    def wait(self, futures: list, deadline: float) -> None:
        if not futures:
            return
        start = _elapsed()
        done, errors, total = 0, [], 0.0
        for candidate, future in futures:
            try:
                seconds, error = future.result(timeout=max(1.0, deadline - _elapsed()))
                total += seconds
                done += 1
                if error:
                    errors.append(f"{candidate['gemm']} {candidate['label']}: {error}")
            except concurrent.futures.TimeoutError:
                _log("precompile: --max-seconds reached while compiling")
                break
            except Exception as exc:
                errors.append(f"{candidate['gemm']} {candidate['label']}: worker {exc!r}")
        _log(f"precompiled {done}/{len(futures)} (config, specialisation) pairs with {self.jobs} processes in {_elapsed() - start:.1f} s "
             f"(sum of per-config times {total:.0f} s)")
        for error in errors[:8]:
            _log(f"  precompile error (retried here): {error}")

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None


# ------------------------------------------------------------------------------------------------
# cases
# ------------------------------------------------------------------------------------------------
def even_counts(num_rows: int, num_experts: int) -> list[int]:
    base, extra = divmod(num_rows, num_experts)
    return [base + (1 if i < extra else 0) for i in range(num_experts)]


def layout(counts: list[int], alignment: int = ALIGN) -> tuple[list[int], int]:
    """(segment starts, pool rows): segments back to back, each starting on a multiple of `alignment` rows.

    Example: counts [3, 0, 5], alignment 4 -> starts [0, 4, 4], 12 rows; alignment 1 -> [0, 3, 3], 8 rows.
    """
    starts, row = [], 0
    for count in counts:
        starts.append(row)
        row += -(-count // alignment) * alignment
    return starts, max(row, alignment)


def make_weights(shape: str) -> dict:
    num_experts, hidden, inter = SHAPES[shape]
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    down = torch.randn(num_experts, hidden, inter, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    return {"gate_up": gate_up.mul_(hidden**-0.5), "down": down.mul_(inter**-0.5)}


def make_case(shape: str, num_rows: int, weights: dict, fp8: bool = False, interleaved: bool = False,
              alignment: int = ALIGN) -> dict:
    """Pool inputs (segments aligned to `alignment` rows), output buffers (`ops`: the swept precision, gate_up rows
    `interleaved` or stacked; `bf16_ops`), the fixed-config h, the reference y on CHECK_EXPERTS (the FP8 twin with
    `fp8`), and grouped_mm inputs (bf16)."""
    gm = _gm()
    num_experts, hidden, inter = SHAPES[shape]
    counts = even_counts(num_rows, num_experts)
    starts, pool_rows = layout(counts, alignment)
    row_start_e = torch.tensor(starts, dtype=torch.int64, device=DEVICE)
    num_rows_e = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
    valid = torch.cat([torch.arange(s, s + c) for s, c in zip(starts, counts)]).to(DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(num_rows)
    x_packed = torch.randn(num_rows, hidden, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    x_PDx = torch.zeros(pool_rows, hidden, dtype=torch.bfloat16, device=DEVICE)
    x_PDx[valid] = x_packed
    case = dict(shape=shape, rows=num_rows, counts=counts, pool_rows=pool_rows, alignment=alignment,
                row_start_e=row_start_e, num_rows_e=num_rows_e, x_packed=x_packed, fp8=fp8)
    case["bf16_ops"] = make_ops(x_PDx, weights, pool_rows, False, DEVICE, interleaved=interleaved and not fp8)
    case["ops"] = ops = make_ops(x_PDx, weights, pool_rows, True, DEVICE, interleaved) if fp8 else case["bf16_ops"]
    # reference y on a few experts (fp32 torch twin on the same operands; the other experts get 0 rows there)
    check_experts = sorted({i % num_experts for i in CHECK_EXPERTS})
    check_counts = [c if i in check_experts else 0 for i, c in enumerate(counts)]
    check_rows = torch.cat([torch.arange(starts[i], starts[i] + counts[i]) for i in check_experts]).to(DEVICE)
    y_ref = gm.grouped_mlp_ref(ops["x"], ops["gate_up"], ops["down"], row_start_e,
                               torch.tensor(check_counts, dtype=torch.int32, device=DEVICE),
                               x_scale_PDb=ops["x_scale"], gate_up_scale=ops["gate_up_scale"],
                               down_scale=ops["down_scale"], gate_up_interleaved=ops["gate_up_interleaved"])
    case.update(check_rows=check_rows, y_ref_check=y_ref[check_rows].float())
    del y_ref
    # fixed-config h (input of every down config) and its own check
    fixed = _make_config(fixed_tile(fp8), 1)
    run_gemm(ops, case, "gate_up", fixed, h="h_fixed")
    ops["y"].fill_(float("nan"))
    run_gemm(ops, case, "down", fixed, h="h_fixed")
    case["fixed_calc_diff"] = _check_diff(case)
    if not fp8:  # grouped_mm anchor inputs
        case["h_packed"] = ops["h_fixed"][valid].contiguous()
        case["offs"] = torch.tensor(counts, device=DEVICE).cumsum(0).to(torch.int32)
    return case


def case_key(case: dict) -> str:
    return f"{case['shape']}/{case['rows']}"


def flops(case: dict, gemm: str) -> float:
    _, hidden, inter = SHAPES[case["shape"]]
    return 2.0 * case["rows"] * hidden * inter * (2 if gemm == "gate_up" else 1)


def _check_diff(case: dict) -> float:
    from moe_ref.testing import calc_diff

    return calc_diff(case["ops"]["y"][case["check_rows"]].float(), case["y_ref_check"])


def current_autotune_tiles(case: dict, gemm: str) -> tuple[str, list[tuple]]:
    """(regime, tiles) that the library's autotune would consider for this launch."""
    num_experts, hidden, inter = SHAPES[case["shape"]]
    n, k = (inter, hidden) if gemm == "gate_up" else (hidden, inter)
    rows_hint = triton.next_power_of_2(case["rows"])
    named = {"rows_hint": rows_hint, "num_experts": num_experts, "N": n, "K": k}
    fp8 = case.get("fp8", False)
    flags = {"ACTIVATION": 1 if gemm == "gate_up" else 0, "FP8": fp8, "QUANT_OUT": fp8 and gemm == "gate_up",
             "IEEE_FP32": False}
    regime, _ = _tiles().regime(rows_hint, num_experts, fp8=fp8)
    return regime, [_tiles().tile_of(c) for c in _tiles().prune_configs(_tiles().gpu_configs(), named, **flags)]


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------
class Timer:
    """Median of CUDA-event times of `fn`, L2 flushed (256 MB write) before each run."""

    def __init__(self, rep_ms: float):
        self.rep_ms = rep_ms
        self.flush = torch.empty(256 << 20 if DEVICE == "cuda" else 1, dtype=torch.int8, device=DEVICE)

    def __call__(self, fn, min_runs: int = 3, max_runs: int = 100) -> float:
        if DEVICE != "cuda":  # CPU smoke test: wall clock of one run
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e6
        fn()  # warm-up
        self.flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        estimate_ms = max(start.elapsed_time(end), 1e-3)
        runs = int(min(max_runs, max(min_runs, self.rep_ms / estimate_ms)))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)]
        for begin, finish in events:
            self.flush.zero_()
            begin.record()
            fn()
            finish.record()
        torch.cuda.synchronize()
        return statistics.median(b.elapsed_time(f) for b, f in events) * 1e3


def run_candidate(candidate: dict, case: dict, timer: Timer) -> dict:
    """Check once, then time one config on one case."""
    gemm, ops = candidate["gemm"], case["ops"]
    config = _make_config(candidate["tile"], candidate["group_m"])
    if gemm == "gate_up":  # NaN-filled outputs: a tile that no program writes fails the check
        for name in ("h_PF", "h_PF_scale"):
            if ops[name] is not None:
                ops[name].fill_(float("nan"))
        run_gemm(ops, case, "gate_up", config)
        ops["y"].fill_(float("nan"))
        run_gemm(ops, case, "down", _make_config(fixed_tile(case["fp8"]), 1))

        def fn():
            run_gemm(ops, case, "gate_up", config)
    else:
        ops["y"].fill_(float("nan"))
        run_gemm(ops, case, "down", config, h="h_fixed")

        def fn():
            run_gemm(ops, case, "down", config, h="h_fixed")
    diff = _check_diff(case)
    us = timer(fn)
    limit = CALC_DIFF_LIMIT_FP8 if case["fp8"] else CALC_DIFF_LIMIT
    return {"us": us, "tflops": flops(case, gemm) / (us * 1e-6) / 1e12, "calc_diff": diff, "ok": bool(diff < limit)}


def _resources(kernel) -> dict:
    """Registers per thread, spilled bytes and shared memory of a compiled kernel (empty if unknown)."""
    out = {}
    for key, attr in (("regs", "n_regs"), ("spills", "n_spills")):
        value = getattr(kernel, attr, None)
        if isinstance(value, int):
            out[key] = value
    shared = getattr(getattr(kernel, "metadata", None), "shared", None)
    if isinstance(shared, int):
        out["smem_bytes"] = shared
    return out


def run_anchor(case: dict, gemm: str, timer: Timer) -> dict | None:
    """The case's anchor: torch grouped_mm (bf16 sweep) or the bf16 kernel's best tile (--fp8)."""
    if case["fp8"]:
        return run_bf16_anchor(case, gemm, timer)
    grouped_mm = grouped_mm_fn()
    if grouped_mm is None:
        return None
    ops = case["ops"]
    if gemm == "gate_up":
        a, w = case["x_packed"], ops["gate_up"].transpose(-2, -1)
    else:
        a, w = case["h_packed"], ops["down"].transpose(-2, -1)
    try:
        us = timer(lambda: grouped_mm(a, w, case["offs"]))
    except Exception as exc:
        _log(f"grouped_mm {gemm} on {case_key(case)} failed: {exc!r}")
        return None
    return {"name": "grouped_mm", "short": "gmm", "label": "torch grouped_mm", "us": us,
            "tflops": flops(case, gemm) / (us * 1e-6) / 1e12}


def run_bf16_anchor(case: dict, gemm: str, timer: Timer) -> dict | None:
    """--fp8 anchor: the bf16 kernel through the same launcher with `BF16_BEST`'s tile for the case, on the
    bf16 x and weights the FP8 operands were quantized from (down reads the bf16 anchor gate_up's h)."""
    entry = bf16_anchor_tile(case["shape"], case["rows"], gemm)
    if entry is None:
        _log(f"no bf16 anchor tile for {case_key(case)} {gemm} (BF16_BEST has the mid and prefill regimes)")
        return None
    ops = case["bf16_ops"]
    if gemm == "down" and not case.get("bf16_h_ready"):
        gate_up_entry = bf16_anchor_tile(case["shape"], case["rows"], "gate_up")
        run_gemm(ops, case, "gate_up", _make_config(tuple(gate_up_entry[:5]), *gate_up_entry[5:]))
    case["bf16_h_ready"] = True
    tile, group_m = tuple(entry[:5]), entry[5] if len(entry) > 5 else 1
    config = _make_config(tile, group_m)
    try:
        us = timer(lambda: run_gemm(ops, case, gemm, config))
    except Exception as exc:
        _log(f"bf16 anchor {gemm} on {case_key(case)} failed: {exc!r}")
        return None
    return {"name": "bf16", "short": "bf16", "label": "bf16 kernel " + _label(gemm, tile, group_m), "us": us,
            "tflops": flops(case, gemm) / (us * 1e-6) / 1e12}


# ------------------------------------------------------------------------------------------------
# reporting
# ------------------------------------------------------------------------------------------------
def _rows_of(results: dict, shape: str, rows: int, gemm: str) -> list[dict]:
    return [r for r in results["runs"] if r["shape"] == shape and r["rows"] == rows and r["gemm"] == gemm]


def _best(runs: list[dict], current_only: bool = False) -> dict | None:
    good = [r for r in runs if r.get("ok") and (r["in_current_autotune"] or not current_only)]
    return min(good, key=lambda r: r["us"]) if good else None


LIST_COMMENTS = {"DECODE_TILES": "<= 32 rows per expert: weight-bandwidth bound, many N tiles in flight",
                 "MID_TILES": "32..256 rows per expert", "PREFILL_TILES": "> 256 rows per expert: compute bound, big tiles",
                 "DECODE_TILES_FP8": "<= 32 rows per expert", "MID_TILES_FP8": "32..256 rows per expert",
                 "PREFILL_TILES_FP8": "> 256 rows per expert"}


def autotune_problem(shape: str, gemm: str, tile, group_m: int, fp8: bool) -> str | None:
    """Why the library's autotune would drop this tile for the GEMM (its rules, 200 KB shared memory), or None."""
    _, hidden, inter = SHAPES[shape]
    gated = gemm == "gate_up"
    n, k = (inter, hidden) if gated else (hidden, inter)
    return _tiles().config_problem(_make_config(tuple(tile), group_m), n=n, k=k, gated=gated, fp8=fp8,
                                 quant_out=fp8 and gated, ieee_fp32=False)


def tile_list_name(regime: str, fp8: bool) -> str:
    """The grouped_mlp_tiles.py list that autotune reads for this regime (FP8 has its own mid and prefill lists)."""
    return f"{regime.upper()}_TILES" + ("_FP8" if fp8 else "")


def summarize(results: dict) -> dict:
    """Best config per (shape, rows, GEMM) and the tiles to add per (regime, GEMM)."""
    best, suggestions = [], {}
    fp8 = results.get("fp8", False)
    for meta in results["cases"]:
        runs = _rows_of(results, meta["shape"], meta["rows"], meta["gemm"])
        top, top_current = _best(runs), _best(runs, current_only=True)
        if top is None:
            continue
        anchor = meta.get("anchor_us")
        entry = {"shape": meta["shape"], "rows": meta["rows"], "gemm": meta["gemm"], "regime": meta["regime"],
                 "label": top["label"], "tile": top["tile"], "group_m": top["group_m"], "us": top["us"],
                 "tflops": top["tflops"], "anchor": meta.get("anchor"), "anchor_us": anchor,
                 "x_vs_anchor": anchor / top["us"] if anchor else None,
                 "current_best_label": top_current["label"] if top_current else None,
                 "current_best_us": top_current["us"] if top_current else None,
                 "speedup_vs_current": top_current["us"] / top["us"] if top_current else None}
        entry["autotune_drops"] = autotune_problem(meta["shape"], meta["gemm"], top["tile"], top["group_m"], fp8)
        best.append(entry)
        key = f"{meta['regime']}/{meta['gemm']}"
        suggestions.setdefault(key, {"list": tile_list_name(meta["regime"], fp8), "tiles": [], "cases": {}})
        tiles = suggestions[key]["tiles"]
        entry = list(_list_entry(top["tile"], top["group_m"]))
        if entry not in tiles:
            tiles.append(entry)
        suggestions[key]["cases"].setdefault(str(tuple(entry)), []).append(f"{meta['shape']}/{meta['rows']}")
        if best[-1]["autotune_drops"]:
            suggestions[key].setdefault("autotune_drops", {})[str(tuple(entry))] = best[-1]["autotune_drops"]
    return {"best": best, "suggestions": suggestions}


def paste_blocks(results: dict, summary: dict) -> list[str]:
    """Per tile list with winners: the list as it stands in grouped_mlp_tiles.py with the winners it lacks appended
    (one line each, commented with the GEMM and cases they won), to paste over the list."""
    fp8 = results.get("fp8", False)
    env = results.get("env", {})
    alignment = results.get("args", {}).get("alignment", ALIGN)
    flags = (" --fp8" if fp8 else "") + (f" --alignment {alignment}" if alignment != ALIGN else "")
    source = f"tune_grouped_mlp.py{flags}, {env.get('gpu', DEVICE)}, {time.strftime('%Y-%m-%d')}"
    winners: dict[str, list] = {}
    for key, suggestion in summary["suggestions"].items():
        gemm = key.split("/")[1]
        for tile in suggestion["tiles"]:
            cases = ", ".join(suggestion["cases"].get(str(tuple(tile)), []))
            drops = suggestion.get("autotune_drops", {}).get(str(tuple(tile)))
            note = f" (NOTE: autotune drops it: {drops})" if drops else ""
            winners.setdefault(suggestion["list"], []).append((tuple(tile), f"{gemm} {cases}{note}"))
    lines = []
    for name, entries in winners.items():
        current = [tuple(t) for t in getattr(_tiles(), name)]
        known = {_tiles().normalize_tile(t) for t in current}
        added: dict[tuple, list[str]] = {}
        for tile, why in entries:
            if _tiles().normalize_tile(tile) not in known:
                added.setdefault(tile, []).append(why)
        lines.append(f"{name} = [  # {LIST_COMMENTS.get(name, '')}".rstrip())
        row = "   "
        for tile in current:
            text = f" {tile},"
            if len(row) + len(text) > 116:
                lines.append(row)
                row = "   "
            row += text
        if row.strip():
            lines.append(row)
        for tile, why in added.items():
            lines.append(f"    {tile},  # {source}: {'; '.join(why)}")
        lines.append("]" + ("" if added else "  # unchanged: the winners are already in the list"))
    return lines


def format_tables(results: dict) -> str:
    """The per-case tables, the best config per case, the tile-list entries and the lists to paste, as text."""
    lines = []
    emit = lines.append
    fp8 = results.get("fp8", False)
    for meta in results["cases"]:
        runs = sorted(_rows_of(results, meta["shape"], meta["rows"], meta["gemm"]),
                      key=lambda r: (not r.get("ok", False), r.get("us", float("inf"))))
        if not runs:
            continue
        anchor = meta.get("anchor_us")
        short = meta.get("anchor_short", "gmm")
        _, hidden, inter = SHAPES[meta["shape"]]
        what = (f"x[R,{hidden}] @ w[e,{2 * inter},{hidden}]^T + SiLU" if meta["gemm"] == "gate_up"
                else f"h[R,{inter}] @ w[e,{hidden},{inter}]^T")
        precision = "FP8 e4m3 (128x128 block weight scales, per-row per-128 x scales)" if fp8 else "bf16"
        anchor_text = (f"anchor {meta['anchor']} {anchor:.1f} us ({meta['anchor_tflops']:.0f} TFLOP/s)" if anchor
                       else f"anchor {meta.get('anchor') or short} n/a")
        emit(f"\n== {meta['shape']} rows={meta['rows']} {meta['gemm']} ({what}), {precision}, regime "
             f"{meta['regime']}, pool R={meta['pool_rows']} (segments aligned to {meta.get('alignment', ALIGN)}), "
             f"{anchor_text}; * = in the current autotune set")
        emit(f"   {'config':30s} {'us':>9s} {'TFLOP/s':>8s} {'x ' + short:>6s} {'calc_diff':>9s} {'regs':>5s} "
             f"{'spill':>5s}")
        for r in runs:
            mark = "*" if r["in_current_autotune"] else " "
            if "us" not in r:
                emit(f" {mark} {r['label']:30s} error: {r.get('error', '?')[:80]}")
                continue
            speed = f"{anchor / r['us']:6.2f}" if anchor else "   n/a"
            flag = "" if r["ok"] else "  FAIL"
            emit(f" {mark} {r['label']:30s} {r['us']:9.1f} {r['tflops']:8.1f} {speed} {r['calc_diff']:9.1e} "
                 f"{r.get('regs', '-'):>5} {r.get('spills', '-'):>5}{flag}")
    summary = summarize(results)
    emit("\n== best per (shape, rows, GEMM)")
    for b in summary["best"]:
        short = "bf16" if fp8 else "gmm"
        vs = f"{b['x_vs_anchor']:.2f}x {short}" if b["x_vs_anchor"] else f"{short} n/a"
        current = (f"; current autotune set best {b['current_best_label']} {b['current_best_us']:.1f} us "
                   f"-> {b['speedup_vs_current']:.2f}x" if b["current_best_us"] else "")
        if b.get("autotune_drops"):
            current += f"; NOTE autotune drops this tile: {b['autotune_drops']}"
        emit(f"  {b['shape']:8s} {b['rows']:6d} {b['gemm']:8s} [{b['regime']}] {b['label']:30s} {b['us']:9.1f} us "
              f"{b['tflops']:6.1f} TFLOP/s {vs}{current}")
    emit("\n== winners as entries of the tile lists in moe_ref/kernels/experts/grouped_mlp_tiles.py: (BLOCK_M, BLOCK_N "
          "[per half for gate_up], BLOCK_K, num_warps, num_stages[, GROUP_M])")
    for key, s in summary["suggestions"].items():
        emit(f"  {key:16s} -> {s['list']}: {', '.join(str(tuple(t)) for t in s['tiles'])}")
    if summary["suggestions"]:
        emit("\n== paste into moe_ref/kernels/experts/grouped_mlp_tiles.py over the list of the same name (current entries kept, "
             "winners appended)" + ("; bf16's lists stay as they are" if fp8 else ""))
        lines += paste_blocks(results, summary)
    return "\n".join(lines) + "\n"


def write_json(results: dict, path: str) -> None:
    results["elapsed_s"] = _elapsed()
    results["summary"] = summarize(results)
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1, default=str)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------
def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fp8", action="store_true",
                        help="sweep the FP8 path (e4m3 x and weights; `MID_TILES_FP8`, `PREFILL_TILES_FP8`), "
                             "anchored on the bf16 kernel's best tile")
    parser.add_argument("--out", default=None,
                        help="JSON path (default results/tune_grouped_mlp.json, --fp8: results/tune_grouped_mlp_fp8.json)")
    parser.add_argument("--max-seconds", type=float, default=170.0,
                        help="stop the sweep cleanly after this many seconds from process start (default 170)")
    parser.add_argument("--dry-run", action="store_true", help="list cases and candidates, then exit (no GPU)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {list(SHAPES)}")
    parser.add_argument("--rows", default=None,
                        help=f"comma list of routed rows (default {ROWS}; --decode: {DECODE_ROWS})")
    parser.add_argument("--gemms", default=",".join(GEMMS), help=f"comma list of {list(GEMMS)}")
    parser.add_argument("--rep-ms", type=float, default=50.0, help="timed milliseconds per (config, case)")
    parser.add_argument("--jobs", type=int, default=min(12, max(1, (os.cpu_count() or 2) - 2)),
                        help="parallel compile processes (0: compile serially in this process)")
    parser.add_argument("--group-m", default="8", help="GROUP_M values for phase 2 ('' to skip)")
    parser.add_argument("--swizzle-top", type=int, default=3, help="tiles per GEMM that phase 2 re-runs with GROUP_M")
    parser.add_argument("--no-current", action="store_true", help="leave out the current autotune tiles")
    parser.add_argument("--limit", type=int, default=0, help="at most this many phase-1 candidates per GEMM (0: all)")
    parser.add_argument("--explore", action="store_true",
                        help="--fp8: sweep the current tiles and EXPLORE_TILES (larger, 8 warps) instead of the grid; "
                             "--decode: the wider DECODE_EXPLORE_* space instead of the decode grid; both without the "
                             "register rules (the compiler's spill counts show which fit)")
    parser.add_argument("--alignment", type=int, default=ALIGN,
                        help=f"rows each expert segment of the pool starts on (default {ALIGN}; 1: back to back, the "
                             "pool the layer builds for the Triton experts)")
    parser.add_argument("--decode", action="store_true",
                        help="sweep the decode regime (<= 32 rows per expert; --rows default 64,512): the DECODE "
                             "lists and few-row tiles with deep pipelines (DECODE_GRID_*)")
    parser.add_argument("--interleaved", action="store_true",
                        help="gate_up weights re-laid out in alternating 128-row gate and up blocks "
                             "(one dot per k-step, "
                             "grouped_mlp(..., gate_up_interleaved=True)); down is unchanged")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = "results/tune_grouped_mlp_fp8.json" if args.fp8 else "results/tune_grouped_mlp.json"
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.rows = [int(r) for r in args.rows.split(",") if r] if args.rows else list(DECODE_ROWS if args.decode else ROWS)
    args.gemms = [g for g in args.gemms.split(",") if g]
    args.group_m = [int(g) for g in args.group_m.split(",") if g]
    if args.alignment <= 0:
        parser.error(f"--alignment {args.alignment} must be a positive number of rows")
    for name, values, allowed in (("shape", args.shapes, SHAPES), ("gemm", args.gemms, GEMMS)):
        bad = [v for v in values if v not in allowed]
        if bad:
            parser.error(f"unknown {name} {bad}; choose from {list(allowed)}")
    return args


def dry_run(args, candidates: dict, skipped: dict) -> int:
    print(f"cases (rows spread evenly, segments aligned to {args.alignment} rows, rows hint = the routed rows):")
    for shape in args.shapes:
        num_experts, hidden, inter = SHAPES[shape]
        for rows in args.rows:
            counts = even_counts(rows, num_experts)
            _, pool_rows = layout(counts, args.alignment)
            fake = {"shape": shape, "rows": rows, "fp8": args.fp8}
            regime = _tiles().regime(triton.next_power_of_2(rows), num_experts)[0]
            print(f"  {shape:8s} e={num_experts} D={hidden} F={inter} rows={rows:6d} per expert {min(counts)}-"
                  f"{max(counts)} pool R={pool_rows} regime={regime}"
                  + (f" (list {tile_list_name(regime, True)}; compile as D={compile_dims(shape, True)[0]} "
                     f"F={compile_dims(shape, True)[1]})" if args.fp8 else ""))
            for gemm in args.gemms:
                tiles = current_autotune_tiles(fake, gemm)[1]
                print(f"      current autotune set {gemm:8s}: {[_label(gemm, t, 1) for t in tiles]}")
                if args.fp8:
                    entry = bf16_anchor_tile(shape, rows, gemm)
                    anchor = _label(gemm, entry, 1) if entry else "n/a (not in BF16_BEST)"
                    print(f"      bf16 anchor          {gemm:8s}: {anchor}")
    for gemm in args.gemms:
        print(f"\n{gemm}: {len(candidates[gemm])} phase-1 candidates (+ phase 2: GROUP_M {args.group_m} on the "
              f"best {args.swizzle_top}):")
        for c in candidates[gemm]:
            print(f"  {c['label']:30s} smem ~{c['smem_kb']:5.0f} KB  [{c['source']}]")
        for c in skipped[gemm]:
            print(f"  skip {c['label']:25s} {c['reason']}")
    total = sum(len(candidates[g]) for g in args.gemms) + len(args.gemms) * args.swizzle_top * len(args.group_m)
    if args.fp8:
        variants = len({compile_dims(shape, True) for shape in args.shapes})
        anchors = len(anchor_candidates(args.shapes, args.rows))
        print(f"\ncompiles: at most {total} FP8 configs x {variants} specialisation(s) (the shapes' FP8 scale "
              f"strides) = {total * variants}, + {anchors} bf16 anchor configs")
    else:
        print(f"\ncompiles: at most {total} (each config once per GEMM, reused across shapes and rows)")
    return 0


def main(argv=None) -> int:
    args = _parse(argv)
    candidates, skipped = {}, {}
    for gemm in args.gemms:
        candidates[gemm], skipped[gemm] = enumerate_candidates(gemm, include_current=not args.no_current,
                                                               fp8=args.fp8, explore=args.explore,
                                                               decode=args.decode)
        if args.limit:
            fixed = [c for c in candidates[gemm] if c["tile"] == fixed_tile(args.fp8)]
            candidates[gemm] = candidates[gemm][:args.limit]
            candidates[gemm] += [c for c in fixed if c not in candidates[gemm]]
    if args.dry_run:
        return dry_run(args, candidates, skipped)
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("tune_grouped_mlp needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    deadline = args.max_seconds
    env = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()}
    if DEVICE == "cuda":
        env.update(gpu=torch.cuda.get_device_name(), sm_count=torch.cuda.get_device_properties(0).multi_processor_count)
    results = {"env": env, "fp8": args.fp8,
               "args": {k: v for k, v in vars(args).items()},
               "calc_diff_limit": CALC_DIFF_LIMIT_FP8 if args.fp8 else CALC_DIFF_LIMIT,
               "candidates": candidates, "skipped": skipped, "cases": [], "runs": [], "stopped_early": False}

    # phase-1 compiles run in workers while this process builds the cases (no timing meanwhile)
    experts = {SHAPES[shape][0] for shape in args.shapes}
    dims = {False: [compile_dims(args.shapes[0], False)],
            True: list(dict.fromkeys(compile_dims(shape, True) for shape in args.shapes))}
    precompiler = Precompiler(args.jobs if len(experts) == 1 and DEVICE == "cuda" else 0, experts.pop(), dims,
                              interleaved=args.interleaved)
    # --fp8: the bf16 anchors first (timed before the sweep); then the GEMMs interleaved so that a sweep cut
    # short by --max-seconds still covers both
    anchors = anchor_candidates(args.shapes, args.rows) if args.fp8 else []
    phase1 = [c for group in itertools.zip_longest(*(candidates[g] for g in args.gemms)) for c in group if c]
    futures = precompiler.submit(anchors + phase1)
    compiles = len(anchors) + len(phase1) * len(dims[args.fp8])
    _log(f"{len(phase1)} phase-1 configs, {compiles} compiles (x {len(dims[args.fp8])} specialisation(s)"
         f"{f', + {len(anchors)} bf16 anchors' if anchors else ''}); precompiling with "
         f"{precompiler.jobs if futures else 0} processes")

    cases = []
    timer = Timer(args.rep_ms)
    try:
        for shape in args.shapes:
            weights = make_weights(shape)
            if args.fp8:
                weights = quantize_weights(weights)
            for rows in args.rows:
                start = _elapsed()
                case = make_case(shape, rows, weights, fp8=args.fp8, interleaved=args.interleaved,
                                 alignment=args.alignment)
                cases.append(case)
                _log(f"case {case_key(case)}: pool R={case['pool_rows']}, fixed-config check calc_diff "
                     f"{case['fixed_calc_diff']:.1e} (setup {_elapsed() - start:.1f} s)")
        _sync()
        precompiler.wait(futures, deadline)
        for case in cases:
            for gemm in args.gemms:
                regime, tiles = current_autotune_tiles(case, gemm)
                anchor = run_anchor(case, gemm, timer)
                meta = {"shape": case["shape"], "rows": case["rows"], "gemm": gemm, "regime": regime,
                        "pool_rows": case["pool_rows"], "alignment": case["alignment"],
                        "rows_per_expert": [min(case["counts"]), max(case["counts"])],
                        "flops": flops(case, gemm), "current_autotune_tiles": tiles,
                        "anchor": anchor["label"] if anchor else None,
                        "anchor_short": "bf16" if case["fp8"] else "gmm",
                        "anchor_us": anchor["us"] if anchor else None,
                        "anchor_tflops": anchor["tflops"] if anchor else None}
                case.setdefault("current", {})[gemm] = tiles
                results["cases"].append(meta)
                _log(f"anchor {case_key(case)} {gemm}: {meta['anchor'] or 'n/a'} "
                     + (f"{anchor['us']:.1f} us {anchor['tflops']:.0f} TFLOP/s" if anchor else ""))
        write_json(results, args.out)
        cost = [0.0]  # the most one config has taken so far (compile + checks + timing on every case)

        def sweep(batch: list[dict]) -> bool:
            """Run a batch of candidates over all cases; False when --max-seconds stopped it."""
            for candidate in batch:
                if _elapsed() + cost[0] > deadline:  # would the next config end after the deadline?
                    _log(f"--max-seconds {deadline:.0f} reached: stopping the sweep")
                    results["stopped_early"] = True
                    return False
                begin = _elapsed()
                parts, compile_s, failed, resources = [], {}, None, {}
                for case in cases:
                    run = {"shape": case["shape"], "rows": case["rows"], "gemm": candidate["gemm"],
                           "label": candidate["label"], "tile": list(candidate["tile"]),
                           "group_m": candidate["group_m"], "source": candidate["source"],
                           "in_current_autotune": _list_entry(candidate["tile"], candidate["group_m"])
                           in case["current"][candidate["gemm"]]}
                    if failed:
                        run["error"] = failed
                    else:
                        try:
                            if case["shape"] not in compile_s:
                                # first launch per shape (FP8: its own specialisation) compiles or loads the
                                # precompiled cubin
                                t = time.perf_counter()
                                kernel = run_gemm(case["ops"], case, candidate["gemm"],
                                                  _make_config(candidate["tile"], candidate["group_m"]),
                                                  h="h_PF" if candidate["gemm"] == "gate_up" else "h_fixed")
                                _sync()
                                compile_s[case["shape"]] = time.perf_counter() - t
                                resources = _resources(kernel)
                            run.update(run_candidate(candidate, case, timer))
                            run.update(compile_s=compile_s[case["shape"]], **resources)
                        except Exception as exc:
                            failed = f"{type(exc).__name__}: {str(exc)[:300]}"
                            run["error"] = failed
                            if "illegal" in failed.lower() or "cuda error" in failed.lower():
                                raise  # the CUDA context is gone; nothing more can be measured
                    results["runs"].append(run)
                    if "us" in run:
                        anchor = next(m["anchor_us"] for m in results["cases"] if m["shape"] == run["shape"]
                                      and m["rows"] == run["rows"] and m["gemm"] == run["gemm"])
                        vs = f" {anchor / run['us']:.2f}x" if anchor else ""
                        bad = "" if run["ok"] else f" FAIL({run['calc_diff']:.1e})"
                        parts.append(f"{case_key(case)} {run['us']:.0f}us{vs}{bad}")
                    else:
                        parts.append(f"{case_key(case)} error")
                cost[0] = max(cost[0], _elapsed() - begin)
                compile_text = "+".join(f"{v:.1f}s" for v in compile_s.values()) or "-"
                regs = f" regs {resources.get('regs')} spills {resources.get('spills')}" if resources else ""
                _log(f"{candidate['gemm']:7s} {candidate['label']:28s} compile {compile_text}{regs} | " + " | ".join(parts)
                     + (f" | {failed}" if failed else ""))
                write_json(results, args.out)
            return True

        finished = sweep(phase1)
        if finished and args.group_m and args.swizzle_top > 0:
            phase2 = []
            for gemm in args.gemms:
                phase2 += swizzle_candidates(results, gemm, args, cases)
            if phase2:
                _log(f"phase 2: {[c['gemm'] + ' ' + c['label'] for c in phase2]}")
                precompiler.wait(precompiler.submit(phase2), deadline)
                sweep(phase2)
    except Exception:
        traceback.print_exc()
        results["error"] = traceback.format_exc()
    finally:
        precompiler.close()
    write_json(results, args.out)
    tables = format_tables(results)
    print(tables, flush=True)
    text_path = os.path.splitext(args.out)[0] + ".txt"
    with open(text_path, "w") as f:
        f.write(tables)
    _log(f"wrote {args.out} and {text_path}{' (stopped early by --max-seconds)' if results['stopped_early'] else ''}")
    return 1 if "error" in results else 0


def swizzle_candidates(results: dict, gemm: str, args, cases: list[dict]) -> list[dict]:
    """The best `--swizzle-top` tiles of a GEMM (mean time relative to each case's best, on the cases with
    the most rows) again with each GROUP_M."""
    big = max(case["rows"] for case in cases)
    runs = [r for r in results["runs"] if r["gemm"] == gemm and r["rows"] == big and r.get("ok") and r["group_m"] == 1]
    done = {(tuple(r["tile"]), r["group_m"]) for r in results["runs"] if r["gemm"] == gemm}
    best_us = {}
    for r in runs:
        best_us[r["shape"]] = min(best_us.get(r["shape"], float("inf")), r["us"])
    scores = {}
    for r in runs:
        scores.setdefault(tuple(r["tile"]), []).append(r["us"] / best_us[r["shape"]])
    complete = {t: s for t, s in scores.items() if len(s) == len(best_us)}
    ranked = sorted(complete, key=lambda t: sum(complete[t]) / len(complete[t]))[:args.swizzle_top]
    gated = gemm == "gate_up"
    out = []
    for tile in ranked:
        for group_m in args.group_m:
            if group_m == 1 or (tile, group_m) in done:
                continue
            out.append({"gemm": gemm, "fp8": args.fp8, "tile": tile, "group_m": group_m,
                        "label": _label(gemm, tile, group_m), "source": "swizzle",
                        "smem_kb": _tiles().smem_bytes(_make_config(tile, 1), gated=gated,
                                                     bytes_per_element=1 if args.fp8 else 2) / 1024})
    return out


if __name__ == "__main__":
    sys.exit(main())
