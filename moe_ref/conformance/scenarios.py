"""The seeded, named scenarios: a shape, a dtype and weight recipe, how many tokens each rank feeds and where they go.
Every rank rebuilds every rank's inputs from the case's seed alone, so a case id and a seed reproduce it anywhere.

Case ids read ``<shape>/<dtype>[-<quant>]/<scenario>``, e.g. ``tiny/bf16/mask0.3``, ``kimi-k2/bf16-fp8_block/base``.

| scenario        | tokens per rank (base T)            | routing                                               |
|-----------------|-------------------------------------|-------------------------------------------------------|
| base            | T                                   | K distinct random experts, random weights             |
| zero_one        | 0 on rank 0, T elsewhere            | random                                                |
| zero_all        | 0 everywhere                        | -                                                     |
| uneven          | max(1, T // (rank + 1))             | random                                                |
| one_expert      | T                                   | slot 0 of every token on expert 0                     |
| one_rank        | T                                   | every slot on rank 0's experts                        |
| mask0/0.3/1     | T                                   | that share of slots masked (-1)                       |
| tile-1/tile/tile+1 | tile + d on rank 0, 0 elsewhere  | slot 0 on expert 0: it receives exactly tile + d rows |
| cap             | C on every rank                     | random                                                |
| cap+1           | C + 1 on rank 0, C elsewhere        | random: must raise the agreed error or chunk           |
| duplicates      | T                                   | slot 1 repeats slot 0's expert (where allowed)        |
| T<n> (speed)    | n on every rank                     | random (as base)                                      |

The speed cases (``speed_case``; ``moe-ref bench``) are outside the matrix: ``<shape>/<recipe>/T<n>``, where the
shape is one of ``SHAPES`` or any model preset's per-rank share, ``<preset>@ep<N>`` (e.g. ``deepseek-v3@ep16``).

Shape legend: T tokens of this rank, K top-k, E experts, e local experts, D hidden width, F expert intermediate,
Db = ceil(D / 128), Fb = ceil(F / 128).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import torch

from moe_ref.conformance.api import DTYPES, QUANTS, ExpertPool, ExpertWeights
from moe_ref.core.errors import ConformanceLedgerError

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP8_MAX = 448.0
QUANT_GROUP = 32  # int4 and mxfp4: input columns per scale


@dataclass(frozen=True)
class Shape:
    """E_local experts per rank (the model's per-rank share at its deployed EP size), top-k, widths."""

    name: str
    experts_per_rank: int
    topk: int
    hidden: int
    intermediate: int
    tokens: int  # the base T per rank
    cuda_only: bool = False


SHAPES = {
    "tiny": Shape("tiny", 4, 3, 64, 32, 24),
    "tiny128": Shape("tiny128", 4, 3, 256, 128, 20),  # the quantized recipes need multiples of 128
    # the per-rank share of each model at EP 8 (Kimi-K3's experts run on its latent width)
    "kimi-k2": Shape("kimi-k2", 48, 8, 7168, 2048, 64, cuda_only=True),
    "kimi-k3": Shape("kimi-k3", 112, 16, 3584, 3072, 64, cuda_only=True),
    "deepseek-v3": Shape("deepseek-v3", 32, 8, 7168, 2048, 64, cuda_only=True),
    "step3": Shape("step3", 6, 3, 7168, 5120, 64, cuda_only=True),
}
SCENARIOS = ("base", "zero_one", "zero_all", "uneven", "one_expert", "one_rank", "mask0", "mask0.3", "mask1",
             "tile-1", "tile", "tile+1", "cap", "cap+1", "duplicates")
# (shape, dtype, quant) -> the scenarios run there; the tiny shape runs them all
RECIPES = [(("tiny", "fp32", "none"), SCENARIOS), (("tiny", "bf16", "none"), SCENARIOS)] + \
          [(("tiny128", "bf16", q), ("base", "uneven", "mask0.3")) for q in ("fp8_block", "int4", "mxfp4")] + \
          [((s, "bf16", q), ("base",)) for s in ("kimi-k2", "kimi-k3", "deepseek-v3", "step3")
           for q in ("none", "fp8_block")]


@dataclass(frozen=True)
class Case:
    """One scenario on one shape and recipe; ``seed`` makes every tensor of it."""

    shape: Shape
    dtype: str
    quant: str
    scenario: str
    seed: int

    @property
    def id(self) -> str:
        recipe = self.dtype if self.quant == "none" else f"{self.dtype}-{self.quant}"
        return f"{self.shape.name}/{recipe}/{self.scenario}"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


SPEED_SEED_OFFSET = 999  # a speed case's seed: seed * 1000 + this (past every matrix position)


def all_cases(seed: int = 0) -> list[Case]:
    """Every case of the matrix, each seeded from ``seed`` and its position (stable as long as ``RECIPES`` is)."""
    cases = [Case(SHAPES[shape], dtype, quant, scenario, 0) for (shape, dtype, quant), names in RECIPES
             for scenario in names]
    return [Case(c.shape, c.dtype, c.quant, c.scenario, seed * 1000 + i) for i, c in enumerate(cases)]


def speed_tokens(scenario: str) -> int | None:
    """n of a speed scenario ``T<n>``; None for the matrix's scenarios."""
    found = re.fullmatch(r"T(\d+)", scenario)
    return int(found.group(1)) if found else None


def shape_named(name: str) -> Shape:
    """A shape of ``SHAPES``, or ``<preset>@ep<N>``: that model preset's routed experts of one rank at EP N (its
    expert width and intermediate size, top-k, 64 base tokens). Raises ``ConformanceLedgerError`` (CFG029) naming
    what is known."""
    if name in SHAPES:
        return SHAPES[name]
    from moe_ref.core.config import PRESETS, preset

    found = re.fullmatch(r"(.+)@ep(\d+)", name)
    if found is None or found.group(1) not in PRESETS:
        raise ConformanceLedgerError(f"shape {name!r}: not one of {', '.join(SHAPES)}, nor <preset>@ep<N> with a "
                                     f"preset of {', '.join(PRESETS)}")
    cfg, ep = preset(found.group(1)), int(found.group(2))
    if ep < 1 or cfg.num_experts % ep:
        raise ConformanceLedgerError(f"shape {name!r}: EP {ep} does not divide {cfg.name}'s {cfg.num_experts} experts; "
                                     f"give an N >= 1 that divides {cfg.num_experts}")
    return Shape(name, cfg.num_experts // ep, cfg.num_topk, cfg.expert_hidden_size, cfg.intermediate_size, 64,
                 cuda_only=not cfg.name.startswith("tiny"))


def speed_case(shape: str, dtype: str, quant: str, tokens: int, seed: int = 0) -> Case:
    """The speed case of ``tokens`` per rank on ``shape`` (``shape_named``), routed as ``base``."""
    if dtype not in DTYPES or quant not in QUANTS:
        raise ConformanceLedgerError(f"speed case: dtype {dtype!r} / quant {quant!r}; dtypes from {tuple(DTYPES)}, "
                                     f"quants from {QUANTS}")
    return Case(shape_named(shape), dtype, quant, f"T{tokens}", seed * 1000 + SPEED_SEED_OFFSET)


@lru_cache(maxsize=4)
def _matrix_by_id(seed: int) -> dict[str, Case]:
    return {c.id: c for c in all_cases(seed)}  # a worker looks up every job's case here


def case_by_id(case_id: str, seed: int = 0) -> Case:
    """The case ``case_id`` names: one of the matrix's (``all_cases``) or a speed case ``<shape>/<recipe>/T<n>``."""
    matrix = _matrix_by_id(seed)
    if case_id in matrix:
        return matrix[case_id]
    shape, recipe, scenario = (case_id.split("/") + ["", ""])[:3]
    tokens = speed_tokens(scenario)
    if tokens is None or case_id.count("/") != 2:
        raise ConformanceLedgerError(f"case {case_id!r}: not a case of the matrix (`moe-ref conform --list`) nor a "
                                     f"speed case <shape>/<dtype>[-<quant>]/T<n>")
    dtype, _, quant = recipe.partition("-")
    return speed_case(shape, dtype, quant or "none", tokens, seed)


def tokens_per_rank(case: Case, world: int, cap: int | None, tile: int) -> list[int]:
    """T of each rank (see the module table); ``cap`` is the implementation's C (None: no bound)."""
    base = case.shape.tokens
    name = case.scenario
    if (tokens := speed_tokens(name)) is not None:
        return [tokens] * world
    if name == "zero_all":
        return [0] * world
    if name == "zero_one":
        return [0] + [base] * (world - 1)
    if name == "uneven":
        return [max(1, base // (rank + 1)) for rank in range(world)]
    if name.startswith("tile"):
        return [tile + {"tile-1": -1, "tile": 0, "tile+1": 1}[name]] + [0] * (world - 1)
    if name in ("cap", "cap+1"):
        limit = cap if cap is not None else base
        return [limit + (name == "cap+1")] + [limit] * (world - 1)
    return [base] * world


def routing(case: Case, num_tokens: int, rank: int, world: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_ids_TK int64, topk_weights_TK fp32)`` of one rank's tokens (see the module table)."""
    shape, name = case.shape, case.scenario
    num_experts, topk = shape.experts_per_rank * world, shape.topk
    pool = shape.experts_per_rank if name == "one_rank" else num_experts
    ids_TK = torch.stack([torch.randperm(pool, generator=gen)[:topk] for _ in range(num_tokens)]) \
        if num_tokens else torch.zeros(0, topk, dtype=torch.int64)
    if name == "one_expert" or name.startswith("tile"):
        # slot 0 on expert 0; the other slots keep distinct experts other than 0
        others = torch.stack([1 + torch.randperm(num_experts - 1, generator=gen)[:topk - 1] for _ in range(num_tokens)]) \
            if num_tokens else torch.zeros(0, topk - 1, dtype=torch.int64)
        ids_TK = torch.cat([torch.zeros(num_tokens, 1, dtype=torch.int64), others], dim=1)
    if name == "duplicates" and topk > 1:
        ids_TK[:, 1] = ids_TK[:, 0]
    ratio = {"mask0.3": 0.3, "mask1": 1.0}.get(name, 0.0)
    if ratio:
        ids_TK = torch.where(torch.rand(ids_TK.shape, generator=gen) < ratio, -1, ids_TK)
    weights_TK = 0.1 + 0.9 * torch.rand(num_tokens, topk, generator=gen)
    return ids_TK, weights_TK


@lru_cache(maxsize=8)
def rank_inputs(case: Case, world: int, cap: int | None, tile: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Every rank's ``(x_TD, topk_ids_TK, topk_weights_TK)`` on the CPU, ``x`` in the case's dtype (rank r's at [r]).
    Made on the CPU on every device (a few rows), so a case routes alike everywhere. Cached: callers copy before
    handing them to an implementation."""
    gen = torch.Generator().manual_seed(case.seed)
    out = []
    for rank, num_tokens in enumerate(tokens_per_rank(case, world, cap, tile)):
        x_TD = torch.randn(num_tokens, case.shape.hidden, generator=gen).to(case.torch_dtype)
        out.append((x_TD, *routing(case, num_tokens, rank, world, gen)))
    return out


# --- the receive pool a ``pool_experts`` implementation is handed (the harness's own dispatch at one rank) -------

class PooledRows(NamedTuple):
    """A pool the harness built (``expert_pool``) and where its rows came from."""

    pool: ExpertPool
    expert_P: torch.Tensor  # [P] int64: each pool row's expert, -1 outside every segment
    row_TK: torch.Tensor    # [T, K] int64: each slot's pool row, -1 for a masked slot


def expert_pool(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, num_experts: int, alignment: int = 1,
                layout: str = "contiguous", fp8: bool = False) -> PooledRows:
    """``PooledRows(pool, expert_P, row_TK)``: every live (token, slot) row of ``x_TD`` in its expert's segment, the rows of
    one expert in (token, slot) order; segments start on multiples of ``alignment`` (``masked``: expert i's at
    i * M, M the largest segment rounded up to ``alignment``); the other rows NaN. ``expert_P`` ``[P]`` int64:
    each pool row's expert, -1 outside every segment; ``row_TK``: each slot's pool row, -1 for a masked slot.
    ``fp8``: the pool's rows quantized too (``quantize_fp8_rows``). On ``x_TD``'s device."""
    device = x_TD.device
    ids_TK = topk_ids_TK.to(device).long()
    token_N, slot_N = (ids_TK >= 0).nonzero(as_tuple=True)
    expert_N = ids_TK[token_N, slot_N]
    order = torch.argsort(expert_N, stable=True)
    token_N, slot_N, expert_N = token_N[order], slot_N[order], expert_N[order]
    num_rows_e = torch.bincount(expert_N, minlength=num_experts)
    aligned_e = (num_rows_e + alignment - 1) // alignment * alignment
    masked_rows = 0
    if layout == "masked":
        masked_rows = max(alignment, int(aligned_e.max()) if num_experts else 0)
        row_start_e = torch.arange(num_experts, device=device) * masked_rows
        num_pool_rows = num_experts * masked_rows
    else:
        row_start_e = torch.cumsum(aligned_e, 0) - aligned_e
        num_pool_rows = int(aligned_e.sum())
    first_of_expert_N = (torch.cumsum(num_rows_e, 0) - num_rows_e)[expert_N]
    row_N = row_start_e[expert_N] + torch.arange(expert_N.numel(), device=device) - first_of_expert_N
    x_PD = torch.full((num_pool_rows, x_TD.shape[1]), float("nan"), dtype=x_TD.dtype, device=device)
    x_PD[row_N] = x_TD[token_N]
    expert_P = torch.full((num_pool_rows,), -1, dtype=torch.int64, device=device)
    expert_P[row_N] = expert_N
    row_TK = torch.full(ids_TK.shape, -1, dtype=torch.int64, device=device)
    row_TK[token_N, slot_N] = row_N
    x_fp8_PD, x_scale_PDb = quantize_fp8_rows(x_PD) if fp8 else (None, None)
    return PooledRows(ExpertPool(x_PD, row_start_e, num_rows_e, int(expert_N.numel()), masked_rows, x_fp8_PD,
                                 x_scale_PDb), expert_P, row_TK)


def rows_deranged_in_segments(pool: ExpertPool) -> torch.Tensor:
    """``src_P`` ``[P]``: a permutation of the pool's rows that moves every row of a segment of two or more rows to
    another place in its segment (each segment rotated by half its length); rows outside segments stay."""
    num_pool_rows = pool.x_PD.shape[0]
    device = pool.x_PD.device
    src_P = torch.arange(num_pool_rows, device=device)
    for start, count in zip(pool.row_start_e.tolist(), pool.num_rows_e.tolist()):
        if count > 1:
            src_P[start:start + count] = start + (torch.arange(count, device=device) + count // 2) % count
    return src_P


# --- weights in each recipe (the harness's own quantizers: nothing shared with the code under test) ------------

def quantize_fp8_rows(x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, D]`` -> (e4m3 codes ``[N, D]``, fp32 scales ``[N, Db]``): one scale (amax / 448) per row per 128
    columns, as FP8 dispatch sends rows."""
    num_rows, dim = x_ND.shape
    blocks = -(-dim // 128)
    padded = torch.zeros(num_rows, blocks * 128, dtype=torch.float64, device=x_ND.device)
    padded[:, :dim] = x_ND.double()
    view = padded.view(num_rows, blocks, 128)
    scale = (view.abs().amax(-1) / FP8_MAX).clamp(min=1e-12).float()
    codes = (view / scale.double()[..., None]).float().to(torch.float8_e4m3fn).view(num_rows, -1)
    return codes[:, :dim].contiguous(), scale


def quantize_fp8_blocks(w_eOI: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[e, O, I]`` -> (e4m3 codes ``[e, O, I]``, fp32 scales ``[e, ceil(O/128), ceil(I/128)]``), amax / 448 per
    128x128 block (on ``w_eOI``'s device)."""
    e, rows, cols = w_eOI.shape
    ob, ib = -(-rows // 128), -(-cols // 128)
    padded = torch.zeros(e, ob * 128, ib * 128, dtype=torch.float32, device=w_eOI.device)
    padded[:, :rows, :cols] = w_eOI.float()
    blocks = padded.view(e, ob, 128, ib, 128)
    scale = (blocks.abs().amax(dim=(2, 4)) / FP8_MAX).clamp(min=1e-12)
    codes = (blocks / scale[:, :, None, :, None]).to(torch.float8_e4m3fn).view(e, ob * 128, ib * 128)
    return codes[:, :rows, :cols].contiguous(), scale


def _grid_weights(w_eOI: torch.Tensor, quant: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight-only recipes: (codes int8 ``[e, O, I]``, fp32 scales ``[e, O, I / 32]``) drawn on the format's grid
    at ``w_eOI``'s magnitude (on its device, from ``gen``, a generator of that device)."""
    e, rows, cols = w_eOI.shape
    amax = w_eOI.abs().reshape(e, rows, cols // QUANT_GROUP, QUANT_GROUP).amax(-1)
    if quant == "int4":
        return torch.randint(-8, 8, (e, rows, cols), generator=gen, dtype=torch.int8, device=w_eOI.device), amax / 8
    scale = torch.exp2(torch.ceil(torch.log2(amax.clamp(min=1e-12) / 6)))  # a power of two, as MX scales are
    return torch.randint(0, 16, (e, rows, cols), generator=gen, dtype=torch.int8, device=w_eOI.device), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, quant: str) -> torch.Tensor:
    """The values a recipe's codes and scales stand for, in float64 (``[e, O, I]``, on the codes' device)."""
    if quant == "fp8_block":
        full = scale.double().repeat_interleave(128, 1).repeat_interleave(128, 2)
        return codes.double() * full[:, :codes.shape[1], :codes.shape[2]]
    per_col = scale.double().repeat_interleave(QUANT_GROUP, -1)
    if quant == "int4":
        return codes.double() * per_col
    magnitude = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=codes.device)[(codes & 7).long()]
    return torch.where(codes >= 8, -magnitude, magnitude) * per_col


def dequantized_as(codes: torch.Tensor, scale: torch.Tensor, quant: str, dtype: torch.dtype) -> torch.Tensor:
    """``dequantize(...).to(dtype)`` one expert at a time (the same values; float64 for one expert, not all E:
    Kimi-K3's experts at one rank would take 30 GB)."""
    out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
    for i in range(codes.shape[0]):
        out[i] = dequantize(codes[i:i + 1], scale[i:i + 1], quant)[0].to(dtype)
    return out


MXFP4_SCALE_BIAS = 125  # compressed-tensors' mxfp4-pack-quantized stores a scale 2**k as the byte k + 125


def published_form(codes_eOI: torch.Tensor, scale: torch.Tensor, quant: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One weight's codes and scales as the published checkpoints store them (the layouts of
    ``moe_ref.checkpoint.formats``; packed here, from the formats' documentation, not by moe_ref's packers):

    - fp8_block: e4m3 ``[e, O, I]`` (``weight``) and fp32 ``[e, ceil(O/128), ceil(I/128)]`` (``weight_scale_inv``),
      as held.
    - int4: int32 words ``[e, O, I/8]`` (``weight_packed``): element k of a row is the nibble ``k % 8`` (bits
      ``4 * (k % 8)``) of word ``k // 8``, stored offset-binary ``q + 8``; the fp32 scales ``[e, O, I/32]``
      (``weight_scale``; compressed-tensors writes the model dtype, the loaders take fp32 too: the values stay
      exact).
    - mxfp4: bytes ``[e, O, I/2]`` (``weight_packed``): element 2j is the low nibble of byte j, 2j+1 the high one;
      the scale ``2**k`` as the byte ``k + 125`` ``[e, O, I/32]`` (``weight_scale``).
    """
    if quant == "fp8_block":
        return codes_eOI, scale
    e, rows, cols = codes_eOI.shape
    if quant == "int4":
        nibbles = (codes_eOI.long() + 8).view(e, rows, cols // 8, 8)
        words = (nibbles << (4 * torch.arange(8, device=codes_eOI.device))).sum(-1)  # 0 .. 2**32 - 1
        return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32), scale.float()
    nibbles = codes_eOI.to(torch.uint8)
    exponent = torch.log2(scale.double()).round()
    assert bool((torch.exp2(exponent) == scale.double()).all()), "mxfp4 scales must be powers of two"
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4), (exponent + MXFP4_SCALE_BIAS).to(torch.uint8)


@lru_cache(maxsize=1)
def global_weights(case: Case, world: int, device: torch.device = torch.device("cpu")) -> ExpertWeights:
    """All E experts of the case in its recipe, made on ``device`` from a seeded generator of that device (every
    rank makes the same ones). On the CPU the values are those of every earlier release for the same seed; CUDA's
    generator (Philox) draws other numbers than the CPU's (Mersenne twister), so on a GPU the seed defines the case
    for that device type: ``--device`` belongs to a REPRO as much as ``--seed``. Cached for the case being run (one:
    the real shapes' experts take GBs), so the implementations of one case share it: ``local_weights`` copies."""
    shape, device = case.shape, torch.device(device)
    gen = torch.Generator(device).manual_seed(case.seed + 7919)
    num_experts = shape.experts_per_rank * world
    gate_up = torch.randn(num_experts, 2 * shape.intermediate, shape.hidden, generator=gen, device=device) \
        / shape.hidden ** 0.5
    down = torch.randn(num_experts, shape.hidden, shape.intermediate, generator=gen, device=device) \
        / shape.intermediate ** 0.5
    if case.quant == "none":
        return ExpertWeights(gate_up.to(case.torch_dtype), down.to(case.torch_dtype))
    if case.quant == "fp8_block":
        (gq, gs), (dq, ds) = quantize_fp8_blocks(gate_up), quantize_fp8_blocks(down)
    else:
        (gq, gs), (dq, ds) = _grid_weights(gate_up, case.quant, gen), _grid_weights(down, case.quant, gen)
    del gate_up, down
    return ExpertWeights(dequantized_as(gq, gs, case.quant, case.torch_dtype),
                         dequantized_as(dq, ds, case.quant, case.torch_dtype), case.quant, gq, gs, dq, ds)


def local_weights(weights: ExpertWeights, first: int, count: int, device: torch.device) -> ExpertWeights:
    """Experts ``first .. first + count - 1`` of ``weights`` on ``device``: a copy (an implementation may rewrite
    its weights in place; the cached ones serve the next implementation and the oracle)."""
    def part(t):
        return None if t is None else t[first:first + count].to(device, copy=True)

    return ExpertWeights(part(weights.gate_up_e2FD), part(weights.down_eDF), weights.quant,
                         part(weights.gate_up_q), part(weights.gate_up_scale), part(weights.down_q),
                         part(weights.down_scale))
