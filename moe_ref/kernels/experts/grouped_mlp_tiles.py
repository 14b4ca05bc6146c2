"""Tile configurations of the grouped MLP kernel (`moe_ref.kernels.experts.grouped_mlp`): which tiles autotune tries.

    rows_hint, experts -> regime (decode / mid / prefill) -> tile list (bf16, FP8 or 4-bit) -> prune (legal, fits) -> autotune

A tile is `(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, GROUP_M])`; `config_of_tile` turns it into a
`triton.Config` whose pre-hook gives a TMA launch's descriptors the tile's block shapes. `prune_configs` is the
autotuner's early prune: it keeps the launch's regime list minus the tiles that would compute a wrong result
(`config_error`: FP8 scale-group rules, 4-bit group rules) or not fit (`config_problem`: tile larger than the
problem, register pressure, shared memory). `scripts/tune_grouped_mlp.py` sweeps tiles on a GPU and prints
the list entries to paste here; forced configs (`forced_options`) bypass autotune.

Shape legend: Dx expert input width, F expert intermediate, e local experts, O and I one weight matrix's output
and input features (the kernel's GEMM sizes N and K: GEMM1 O = F per half, I = Dx; GEMM2 O = Dx, I = F).
"""

from __future__ import annotations

import triton

from moe_ref.core.errors import InvalidConfigError
from moe_ref.kernels.runtime._triton_utils import is_interpreter, next_power_of_2
from moe_ref.kernels.runtime.fixed_tiles import GROUPED_MLP_TILES, same_bits_tile, tile_precision

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, GROUP_M]), grouped by the rows-per-expert regime
# they serve (see `regime`); GROUP_M (program-order swizzle) is 1 when left out. For GEMM1 BLOCK_N
# counts one half: a program computes a BLOCK_M x 2*BLOCK_N gate||up tile. Both GEMMs share these
# lists; `config_problem` drops what does not fit one of them.
# `scripts/tune_grouped_mlp.py` sweeps tiles per GEMM on a GPU (with `launch_gemm(..., config=...)`).
DECODE_TILES = [  # <= 32 rows per expert: weight-bandwidth bound, many N tiles in flight
    (16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (32, 64, 128, 4, 4), (32, 128, 64, 4, 4),
    # SGLang's tuner's winners at 512 rows in bf16 (BLOCK_SIZE_M 32, N 128, K 128, 4 warps, 3 stages for Kimi-K2, 5
    # for Step3; docs/results/experts_vs_peers_512_rows_h200_2026-12-02.md), where that peer ran 6% faster than us
    # on an H100; GEMM1's BLOCK_N counts one half, so the peer's N 128 is our 64 there
    (32, 64, 128, 4, 3), (32, 128, 128, 4, 3), (32, 64, 128, 4, 5), (32, 128, 128, 4, 5),
]
# The last entries of MID_TILES and PREFILL_TILES are the winners of scripts/tune_grouped_mlp.py on an H200
# (2026-11-30, docs/results/tune_grouped_mlp.txt): 1.29-1.44x over this list's previous best at 4096 rows,
# 1.04-1.17x at 32768 rows; GROUP_M=8 (L2 swizzle) won at 32768 rows.
MID_TILES = [  # 32..256 rows per expert
    (32, 128, 128, 4, 4), (64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 128, 128, 8, 3),
    (128, 128, 64, 8, 4, 8), (128, 256, 64, 8, 4),
    (128, 128, 64, 8, 4),  # tune_grouped_mlp.py with TMA loads, H200, 2026-12-01: gate_up kimi-k2/4096, step3/4096
]
PREFILL_TILES = [  # > 256 rows per expert: compute bound, big tiles
    (64, 128, 64, 4, 4), (64, 128, 128, 8, 3), (64, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 128, 8, 3),
    (128, 256, 64, 8, 3), (128, 128, 64, 8, 3, 8), (128, 64, 64, 4, 3, 8), (128, 256, 64, 8, 3, 8),
    (128, 128, 64, 8, 4, 8),  # tune_grouped_mlp.py with TMA loads, H200, 2026-12-01: gate_up kimi-k2/32768
    (128, 256, 64, 8, 4, 8),  # tune_grouped_mlp.py with TMA loads, H200, 2026-12-01: down kimi-k2/32768
]
# FP8 (e4m3 x and weights) launches autotune over these lists instead, so that
# `scripts/tune_grouped_mlp.py --fp8` results change FP8's choices only. They
# hold the bf16 lists' tiles plus the FP8 sweep's winners (docs/results/tune_grouped_mlp_fp8.txt, one H200);
# `config_problem` drops the ones FP8 cannot run
# (GEMM1 needs BLOCK_N 128, BLOCK_K divides 128, <= 128x128 fp32 accumulator elements per program).
DECODE_TILES_FP8 = [  # <= 32 rows per expert: DECODE_TILES plus deeper pipelines (e4m3 tiles are half the bytes)
    (16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (32, 64, 128, 4, 4), (32, 128, 64, 4, 4),
    (16, 128, 128, 4, 5), (32, 128, 128, 4, 5), (16, 64, 128, 4, 8), (32, 64, 128, 4, 6),
    # tune_grouped_mlp.py --fp8 --interleaved --decode (H200, 2026-12-01, docs/results/tune_grouped_mlp_fp8_decode.txt):
    # down kimi-k2/64 and /512, 2.5% over the list's best; gate_up's winner (16, 128, 128, 4, 4) is already here
    (32, 128, 128, 4, 4),
]
MID_TILES_FP8 = [  # 32..256 rows per expert
    (32, 128, 128, 4, 4), (64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 128, 128, 8, 3), (128, 128, 64, 8, 4, 8),
    (128, 256, 64, 8, 4),
    (64, 128, 128, 8, 4, 8),  # tune_grouped_mlp.py --fp8, NVIDIA H200, 2026-12-01: gate_up kimi-k2/4096
    (64, 128, 128, 8, 3, 8),  # tune_grouped_mlp.py --fp8, NVIDIA H200, 2026-12-01: gate_up step3/4096
    (128, 128, 128, 8, 4),  # tune_grouped_mlp.py --fp8, NVIDIA H200, 2026-12-01: down kimi-k2/4096
    (128, 128, 128, 8, 5),  # tune_grouped_mlp.py --fp8, NVIDIA H200, 2026-12-01: down step3/4096
    # tune_grouped_mlp.py --fp8 --explore after the TMA loads and one-scale-per-tile promotion (NVIDIA H200,
    # 2026-12-01, docs/results/tune_grouped_mlp_fp8_tma.txt): kimi-k2/4096 gate_up 580 us, down 252 us
    (64, 128, 128, 8, 5, 8), (64, 128, 128, 4, 3),
]
PREFILL_TILES_FP8 = [  # > 256 rows per expert
    (64, 128, 64, 4, 4), (64, 128, 128, 8, 3), (64, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 128, 8, 3),
    (128, 256, 64, 8, 3), (128, 128, 64, 8, 3, 8), (128, 64, 64, 4, 3, 8), (128, 256, 64, 8, 3, 8),
    (64, 128, 128, 8, 5, 8),  # tune_grouped_mlp.py --fp8, NVIDIA H200, 2026-12-01: gate_up kimi-k2/32768
    (64, 128, 128, 8, 4, 8),  # tune_grouped_mlp.py --fp8, NVIDIA H200, 2026-12-01: gate_up step3/32768
    (64, 128, 128, 4, 3),  # tune_grouped_mlp.py --fp8, NVIDIA H200, 2026-12-01: down kimi-k2/32768
    (64, 256, 128, 8, 4, 8),  # tune_grouped_mlp.py --fp8, NVIDIA H200, 2026-12-01: down step3/32768
    # wider L2 swizzle groups, as SGLang's default FP8 tile (GROUP_SIZE_M 32) beat us by 3% at 32768 rows
    (64, 128, 128, 8, 4, 32), (64, 128, 128, 4, 3, 32),
    # tune_grouped_mlp.py --fp8 --interleaved --explore (interleaved gate/up rows, as TritonExperts runs FP8; H200,
    # 2026-12-01, docs/results/tune_grouped_mlp_fp8_interleaved.txt): gate_up kimi-k2/32768 2623 us, 734 TFLOP/s
    (64, 128, 128, 8, 3, 8),
]
# Rows per gate or up block of interleaved gate_up weights (`grouped_mlp.interleave_gate_up`): one FP8 scale block,
# and GEMM1's BLOCK_N over them, so that one 256-row b tile holds a gate block and its up block.
GATE_UP_BLOCK = 128
# Autotune keeps configs whose estimated pipeline buffers stay under this (the H200 allows 227 KB per
# block; the estimate ignores epilogue scratch, hence the headroom).
AUTOTUNE_SMEM_LIMIT = 200 * 1024
META_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K")  # required in a forced config; GROUP_M is optional (default 1)


def normalize_tile(tile: tuple) -> tuple:
    """A tile-list entry without a trailing GROUP_M of 1 (so 5- and 6-element forms compare equal)."""
    return tuple(tile[:5]) if len(tile) == 5 or tile[5] == 1 else tuple(tile)


def tma_block_shapes(meta: dict, flags: dict) -> tuple[list[int], list[int]]:
    """The block shapes of a TMA launch's a and b descriptors for the tile ``meta`` (BLOCK_M/N/K) and the kernel's
    ``flags``: a gated launch over interleaved gate/up rows loads 2 * BLOCK_N b rows at once."""
    b_rows = meta["BLOCK_N"] * (2 if flags.get("ACTIVATION") and flags.get("INTERLEAVED") else 1)
    return [meta["BLOCK_M"], meta["BLOCK_K"]], [b_rows, meta["BLOCK_K"]]


def set_tma_block_shapes(nargs: dict) -> None:
    """Autotune pre-hook: a TMA launch's descriptors take the block shapes of the config being run."""
    if nargs.get("a_desc") is not None:
        nargs["a_desc"].block_shape, nargs["b_desc"].block_shape = tma_block_shapes(nargs, nargs)


def config_of_tile(tile: tuple) -> triton.Config:
    block_m, block_n, block_k, warps, stages = tile[:5]
    meta = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k}
    if len(tile) > 5 and tile[5] != 1:
        meta["GROUP_M"] = tile[5]
    return triton.Config(meta, num_warps=warps, num_stages=stages, pre_hook=set_tma_block_shapes)


def gpu_configs() -> list[triton.Config]:
    """H200 candidates (union of the regimes; `prune_configs` keeps the ones for this launch)."""
    every = (DECODE_TILES + MID_TILES + PREFILL_TILES + DECODE_TILES_FP8 + MID_TILES_FP8 + PREFILL_TILES_FP8
)
    tiles = dict.fromkeys(normalize_tile(t) for t in every)
    return [config_of_tile(tile) for tile in tiles]


def tile_of(config: triton.Config) -> tuple:
    """The tile-list form of a config: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, GROUP_M if != 1])."""
    return normalize_tile((*(config.kwargs[key] for key in META_KEYS), config.num_warps, config.num_stages,
                           config.kwargs.get("GROUP_M", 1)))


def regime(rows_hint: int, num_experts: int, fp8: bool = False) -> tuple[str, list]:
    """(name, tile list) of the rows-per-expert regime for a launch's `rows_hint` bucket (a power of 2);
    `fp8` launches take the `*_FP8` lists.

    Example: 4096 routed rows over 48 experts -> 85 per expert -> ("mid", MID_TILES), with fp8
    ("mid", MID_TILES_FP8); 32768 -> 683 -> prefill; 512 -> 10.7 -> decode.
    """
    rows_per_expert = rows_hint / max(num_experts, 1)
    if rows_per_expert <= 32:
        return "decode", DECODE_TILES_FP8 if fp8 else DECODE_TILES
    if rows_per_expert <= 256:
        return "mid", MID_TILES_FP8 if fp8 else MID_TILES
    return "prefill", PREFILL_TILES_FP8 if fp8 else PREFILL_TILES


def smem_bytes(config: triton.Config, *, gated: bool, bytes_per_element: int) -> int:
    """Estimated pipeline buffers: num_stages x (a tile + b tile(s)); GEMM1 loads gate and up tiles."""
    block_m, block_n, block_k = (config.kwargs[key] for key in META_KEYS)
    b_rows = block_n * (2 if gated else 1)
    return int(config.num_stages * (block_m + b_rows) * bytes_per_element * block_k)


def config_error(config: triton.Config, *, fp8: bool, quant_out: bool, interleaved: bool = False) -> str | None:
    """Why this config would compute a wrong result for the launch (None if it is correct)."""
    block_n, block_k = config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"]
    if interleaved and block_n != GATE_UP_BLOCK:
        return f"interleaved gate/up rows come in {GATE_UP_BLOCK}-row blocks (BLOCK_N must be {GATE_UP_BLOCK})"
    if quant_out and block_n != 128:
        return "the fp8 epilogue quantizes exactly one 128-column group per tile (BLOCK_N must be 128)"
    if fp8 and 128 % block_k != 0:
        return "a k-step must stay inside one 128-wide scale group (BLOCK_K must divide 128)"
    return None


def config_problem(config: triton.Config, *, n: int, k: int, gated: bool, fp8: bool, quant_out: bool,
                    ieee_fp32: bool, smem_limit: int = AUTOTUNE_SMEM_LIMIT,
                    register_rules: bool = True, interleaved: bool = False) -> str | None:
    """Why autotune should not try this config for the launch (None if it should): wrong results,
    tiles larger than the problem, register spills (`register_rules`; a tuner exploring past them turns
    them off and reads the compiler's spill count instead), shared memory above `smem_limit` bytes."""
    error = config_error(config, fp8=fp8, quant_out=quant_out, interleaved=interleaved)
    if error:
        return error
    block_m, block_n, block_k = (config.kwargs[key] for key in META_KEYS)
    if block_n > max(64, next_power_of_2(n)) or block_k > max(64, next_power_of_2(k)):
        return "tile larger than the problem"
    if register_rules and gated and (block_m * block_n > 128 * 128 or block_n > 128):
        return "two fp32 accumulators (gate, up): register pressure"
    if register_rules and fp8 and block_m * block_n * (2 if gated else 1) > 128 * 128:
        return "fp8 keeps a scaled partial product beside each accumulator: spills (ptxas, sm_90a)"
    smem = smem_bytes(config, gated=gated, bytes_per_element=1 if fp8 else 4 if ieee_fp32 else 2)
    if smem > smem_limit:
        return f"shared memory ~{smem // 1024} KB > {smem_limit // 1024} KB"
    return None


def prune_configs(configs, named_args, same_bits: bool = False, **kwargs):
    """Keep the configs of this launch's regime (its FP8 list for FP8) that are legal (fp8 groups) and fit shared
    memory; with ``same_bits`` (the batch-invariant mode) only those of the launch's bits class
    (``fixed_tiles.same_bits_tile``)."""
    _, tile_list = regime(named_args["rows_hint"], named_args["num_experts"], fp8=kwargs.get("FP8", False))
    allowed = {normalize_tile(tile) for tile in tile_list}
    ieee_fp32 = kwargs.get("IEEE_FP32", False)
    facts = dict(n=named_args["N"], k=named_args["K"], gated=kwargs.get("ACTIVATION", 0) != 0,
                 fp8=kwargs.get("FP8", False), quant_out=kwargs.get("QUANT_OUT", False), ieee_fp32=ieee_fp32,
                 interleaved=kwargs.get("INTERLEAVED", False) and kwargs.get("ACTIVATION", 0) != 0)
    kept = [config for config in configs if tile_of(config) in allowed and config_problem(config, **facts) is None]
    if same_bits:
        precision = tile_precision(facts["fp8"], ieee_fp32)
        kept = [config for config in kept if same_bits_tile(tile_of(config), precision)]
        if not kept:
            return [config_of_tile(GROUPED_MLP_TILES[precision][0 if facts["gated"] else 1])]
    fallback_fp32 = (32, GATE_UP_BLOCK if facts["interleaved"] else 64, 32, 4, 2)
    fallback = config_of_tile(fallback_fp32 if ieee_fp32 else (64, GATE_UP_BLOCK, 64, 4, 3))
    return kept or [fallback]


def interpreter_meta(quant_out: bool, interleaved: bool = False) -> dict:
    """The interpreter's fixed tile (small and fast, BLOCK_N 128 where the fp8 epilogue or the gate/up blocks need
    it)."""
    return {"BLOCK_M": 16, "BLOCK_N": GATE_UP_BLOCK if quant_out or interleaved else 32, "BLOCK_K": 32}


def forced_options(config: triton.Config) -> dict:
    """Launch keywords for a forced config: its meta-parameters and compile options."""
    unknown = set(config.kwargs) - set(META_KEYS) - {"GROUP_M"}
    missing = set(META_KEYS) - set(config.kwargs)
    if unknown or missing:
        raise InvalidConfigError(f"config needs {META_KEYS} (+ optional GROUP_M); {missing=} {unknown=}")
    options = dict(config.kwargs)
    if is_interpreter():
        return options  # the interpreter has no compile options
    options.update(num_warps=config.num_warps, num_stages=config.num_stages)
    if getattr(config, "num_ctas", 1) != 1:  # only what a config sets: the launch keywords autotune passes
        options["num_ctas"] = config.num_ctas
    if getattr(config, "maxnreg", None) is not None:
        options["maxnreg"] = config.maxnreg
    return options
