"""Expert-MLP benchmark cases at per-rank EP8 shapes (scripts/bench_experts.py, ab_grouped_mlp.py): a model's expert
weights (`make_weights`), routed rows spread uniformly at random over its experts (`routed_counts`) in a 128-aligned
pool (`make_case`), the same rows in the pool of any other segment alignment (`case_pool`), and the calls the routed
step makes on such a pool (`api_layout`, `api_call`).

Shape legend: P receive-pool rows, e local experts, D hidden width, Dx expert input width, Db FP8 scale blocks of an
expert input row, F expert intermediate (2F: gate rows then up rows), N routed entries (the routed rows, packed),
M rows reserved per expert in DeepGEMM's masked layout.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import torch
import torch.nn.functional as F

from moe_ref.experts import ExpertLayout
from moe_ref.kernels.experts.fp8 import quantize_fp8_per_block_128

ALIGN = 128
MODELS = {  # name -> (local experts e, hidden D, intermediate F, top-k)
    "kimi-k2": (48, 7168, 2048, 8),
    "step3": (48, 7168, 5120, 3),
}
ROWS = (64, 512, 4096, 32768)
QUICK_ROWS = (64, 4096)


@dataclasses.dataclass
class Case:
    """One benchmark case: a model's expert weights and a routed-row layout."""

    model: str
    num_rows: int                # routed rows (sum over experts)
    counts: list[int]            # rows per local expert
    x_PDx: torch.Tensor          # [P, Dx] bf16 ALIGN-aligned pool (padding rows zero)
    row_start_e: torch.Tensor    # [e] int64
    num_rows_e: torch.Tensor     # [e] int32
    x_packed: torch.Tensor       # [num_rows, D] bf16, the same rows without padding
    gate_up: torch.Tensor        # [e, 2F, D] bf16
    down: torch.Tensor           # [e, D, F] bf16
    fp8: dict | None = None      # quantized inputs for the fp8 path (x [P, D] e4m3, x_scale [P, Db] fp32, weights)
    pools: dict = dataclasses.field(default_factory=dict)  # alignment -> Pool (`case_pool`)
    path_pools: dict = dataclasses.field(default_factory=dict)  # path name -> the Pool it runs on (default: ALIGN)


@dataclasses.dataclass
class Pool:
    """The case's routed rows laid out as a backend's pool: segments starting on multiples of `alignment`
    (`ExpertLayout.from_counts`), padding rows zero; the FP8 pool (e4m3 rows + per-128 scales) beside it. A masked
    pool (`masked_rows` = M > 0) holds expert i's rows at i * M."""

    alignment: int
    x_PDx: torch.Tensor                   # [P, Dx] bf16
    row_start_e: torch.Tensor             # [e] int64
    num_rows_e: torch.Tensor              # [e] int32
    x_fp8: torch.Tensor | None = None     # [P, Dx] e4m3
    x_scale: torch.Tensor | None = None   # [P, Db] fp32
    masked_rows: int = 0


def aligned_layout(counts: list[int], device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(row_start_e int64, num_rows_e int32, pool rows): segments packed by ``ExpertLayout.from_counts``."""
    layout = ExpertLayout.from_counts(torch.tensor(counts, dtype=torch.int64), ALIGN)
    return (layout.row_start_e.to(device), layout.num_rows_e.to(device=device, dtype=torch.int32),
            max(layout.num_pool_rows, ALIGN))


def case_pool(case: Case, alignment: int) -> Pool:
    """The case's rows in a pool with segments aligned to `alignment` (built once per case and alignment; the
    ALIGN pool is the case's own)."""
    if alignment not in case.pools:
        if alignment == ALIGN:
            pool = Pool(ALIGN, case.x_PDx, case.row_start_e, case.num_rows_e)
        else:
            layout = ExpertLayout.from_counts(torch.tensor(case.counts, dtype=torch.int64), alignment)
            device = case.x_PDx.device
            num_pool_rows = max(layout.num_pool_rows, 1)
            x_PDx = case.x_PDx.new_zeros(num_pool_rows, case.x_PDx.shape[1])
            valid = ExpertLayout(layout.row_start_e, layout.num_rows_e, num_pool_rows, alignment).row_expert_P() >= 0
            x_PDx[valid.to(device)] = case.x_packed
            pool = Pool(alignment, x_PDx, layout.row_start_e.to(device),
                        layout.num_rows_e.to(device=device, dtype=torch.int32))
        if case.fp8 is not None:
            if alignment == ALIGN:
                pool.x_fp8, pool.x_scale = case.fp8["x"], case.fp8["x_scale"]
            else:
                from moe_ref.kernels.ep.pre_dispatch import quantize_fp8_per_128

                pool.x_fp8, pool.x_scale = quantize_fp8_per_128(pool.x_PDx)
        case.pools[alignment] = pool
    return case.pools[alignment]


def segment_rows(row_start_e: torch.Tensor, num_rows_e: torch.Tensor, pool_rows: int) -> torch.Tensor:
    """``[P]`` bool: True on the pool rows inside an expert's segment."""
    return ExpertLayout(row_start_e, num_rows_e, pool_rows, ALIGN).row_expert_P() >= 0


def routed_counts(model: str, num_rows: int, seed: int) -> list[int]:
    """Rows per local expert of a case: `num_rows` routed rows spread randomly (uniform) over the model's experts
    (CPU generator, so a dry run gets the counts the GPU run uses)."""
    num_experts = MODELS[model][0]
    gen = torch.Generator().manual_seed(seed + num_rows)
    picks = torch.randint(0, num_experts, (num_rows,), generator=gen)
    return torch.bincount(picks, minlength=num_experts).tolist()


def make_case(model: str, num_rows: int, weights: tuple, seed: int, with_fp8: bool, device="cuda") -> Case:
    """A `Case` of `model`: `num_rows` routed rows (`routed_counts`), random bf16 x `[num_rows, D]` copied into the
    ALIGN-aligned pool `[P, D]` (padding rows zero); `weights` is `make_weights`'s tuple (its bf16 pair is shared, not
    copied); `with_fp8`: the FP8 pool as dispatched (`quantize_fp8_per_128`: e4m3 `[P, D]`, fp32 scales `[P, Db]`)
    and the weights' FP8 copies in ``case.fp8``. The host syncs (the segment starts are read)."""
    hidden = MODELS[model][1]
    counts = routed_counts(model, num_rows, seed)
    row_start_e, num_rows_e, pool_rows = aligned_layout(counts, device)
    x_packed = torch.randn(num_rows, hidden, device=device).bfloat16()
    x_PDx = torch.zeros(pool_rows, hidden, dtype=torch.bfloat16, device=device)
    offset = 0
    for start, count in zip(row_start_e.tolist(), counts):
        x_PDx[start:start + count] = x_packed[offset:offset + count]
        offset += count
    case = Case(model, num_rows, counts, x_PDx, row_start_e, num_rows_e, x_packed, *weights[:2])
    if with_fp8:
        from moe_ref.kernels.ep.pre_dispatch import quantize_fp8_per_128

        x_fp8, x_scale = quantize_fp8_per_128(x_PDx)
        case.fp8 = dict(x=x_fp8, x_scale=x_scale, gate_up=weights[2], gate_up_scale=weights[3],
                        down=weights[4], down_scale=weights[5])
    return case


def make_weights(num_experts: int, hidden: int, inter: int, with_fp8: bool, device="cuda") -> tuple:
    """bf16 gate_up [e, 2F, D] and down [e, D, F] (+ fp8 copies with block scales)."""
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, device=device) / hidden**0.5).bfloat16()
    down = (torch.randn(num_experts, hidden, inter, device=device) / inter**0.5).bfloat16()
    if not with_fp8:
        return gate_up, down, None, None, None, None
    return (gate_up, down, *quantize_fp8_per_block_128(gate_up), *quantize_fp8_per_block_128(down))


def grouped_mm_fn():
    """torch's grouped GEMM as ``fn(a, b, offs)`` (`a` `[N, K]`, `b` `[e, K, N_out]`, `offs` `[e]` int32 cumulative
    row ends), or None when this torch has none (``torch.nn.functional.grouped_mm``, else ``torch._grouped_mm``)."""
    fn = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None:
        return None
    return lambda a, b, offs: fn(a, b, offs=offs)


def grouped_mm_path(case: Case) -> Callable[[], torch.Tensor] | None:
    """The `grouped_mm_bf16` path: torch grouped GEMM (offs = cumulative ends, w.transpose(-2, -1)) + torch
    SiLU-and-mul on the case's packed rows, returning y `[num_rows, D]` bf16; None when torch has no grouped_mm."""
    grouped_mm = grouped_mm_fn()
    if grouped_mm is None:
        return None
    inter = case.down.shape[2]
    offs = torch.tensor(case.counts, device=case.x_PDx.device).cumsum(0).to(torch.int32)
    gate_up_t, down_t = case.gate_up.transpose(-2, -1), case.down.transpose(-2, -1)

    def run_grouped_mm():
        gate_up_N2F = grouped_mm(case.x_packed, gate_up_t, offs)
        h_NF = F.silu(gate_up_N2F[:, :inter]) * gate_up_N2F[:, inter:]
        return grouped_mm(h_NF, down_t, offs)

    return run_grouped_mm


def api_layout(pool: Pool, num_rows_hint: int | None) -> ExpertLayout:
    """The layout ``ModularRoutedStep`` hands the experts for `pool`: with the static rows hint of the device-side
    dispatch (rows outside every segment then left unwritten), or None: without (the backend counts the rows, a host
    sync, and zeroes the other rows)."""
    return ExpertLayout(pool.row_start_e, pool.num_rows_e, pool.x_PDx.shape[0], pool.alignment,
                        num_rows_hint=num_rows_hint, zero_unused_rows=num_rows_hint is None,
                        masked_rows=pool.masked_rows)


def api_call(experts, pool: Pool, layout: ExpertLayout, fp8: bool) -> Callable[[], torch.Tensor]:
    """``experts`` called as the routed step calls it on `pool`: the FP8 pool as dispatched (fp8 rows + scales) for
    fp8 experts, else the activation-dtype rows."""
    if fp8:
        return functools.partial(experts, pool.x_fp8, layout, pool.x_scale)
    return functools.partial(experts, pool.x_PDx, layout)


def routed_rows(case: Case, out: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """``[num_rows, D]``: the rows of a path's output that hold routed rows, expert-major (the order of the rows
    inside segments in the pool): a pool-shaped ``[P, D]`` output keeps its rows inside segments, a masked
    ``[e, M, D]`` one the first ``counts[i]`` rows of expert i, a packed ``[num_rows, D]`` one is that already."""
    if out.dim() == 3:
        counts = torch.tensor(case.counts, device=out.device)
        return out[torch.arange(out.shape[1], device=out.device)[None, :] < counts[:, None]]
    pool = case.path_pools.get(name) if name else None
    if pool is not None and out.shape[0] == pool.x_PDx.shape[0]:
        return out[segment_rows(pool.row_start_e, pool.num_rows_e, pool.x_PDx.shape[0]).to(out.device)]
    if out.shape[0] == case.x_PDx.shape[0]:
        return out[segment_rows(case.row_start_e, case.num_rows_e, case.x_PDx.shape[0])]
    return out
