"""Modelled expert time for ``moe-ref eplb simulate``: a layer's step before and after a placement, in microseconds.

    t(r)            one expert's MLP time at r routed rows: piecewise linear in r through measured points
    rank time       sum over the rank's slots of t(rows of that slot)
    a layer's step  its slowest rank (every rank waits for the slowest one in the combine)
    before: E / R experts per rank, each with its load; after: the placement's slots, each expert's rows split
    evenly over its replicas (``moe_ref.eplb.simulate.slot_rows``)

The shipped table (``TABLE``) holds only measurements already recorded in docs/results/: moe_ref's expert MLP
(``make_experts('auto')`` with the rows hint, the layer's default backend; and Kimi-K2's 4-bit W4A16 paths) on ONE
NVIDIA H200 at EP 8 per-rank shapes: Kimi-K2 (48 local experts, D 7168, F 2048) and Step3 (48 experts, D 7168,
F 5120). Each point names its file and table row; ``experts_measured`` is the expert count of that run (48:
scripts/bench_experts.py and the decode file's header say so).

The approximation: a measurement is one call over ``rows`` routed rows spread uniformly at random over the
``experts_measured`` experts; one expert's time at ``rows / experts_measured`` rows is taken to be
``us / experts_measured``. Between points t is linear in r; above the largest point it goes on along the last
segment; below the smallest (``0 < r < r0``) it is the smallest point's time (the weights are read once whatever the
rows: the small-row regime is memory bound); t(0) = 0 (a slot without rows reads no weights).

Limits: one expert's time at r rows is read off a call where every expert had about r rows (a skewed call's
kernel schedule, tile padding and L2 reuse differ); a rank's slots are summed as if run back to back (a grouped
kernel overlaps them); no dispatch, combine, router or shared-expert cost; one GPU class and one backend per table.
Compare placements with it; do not read it as a step time.

Shape legend: E experts, R EP ranks, Ly MoE layers, Ph physical expert slots.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_ref.core.errors import CommandLineError
from moe_ref.eplb.placement import Placement
from moe_ref.eplb.simulate import identity_placement, slot_rows

FILE_FORMAT = "moe_ref.eplb.expert_times"
FILE_VERSION = 1
_KIMI = "48 experts (Kimi-K2 per rank at EP 8), D 7168, F 2048, SiLU; one NVIDIA H200, torch 2.11, triton 3.6"
_STEP3 = "48 experts (Step3 per rank at EP 8), D 7168, F 5120, SiLU; one NVIDIA H200, torch 2.11, triton 3.6"
_AUTO = "moe_ref make_experts('auto') on its pool, rows hint (path {}): the layer's default backend"
_W4 = "moe_ref make_quantized_experts (path {}), bf16 activations; decode rows only: above 512 rows extrapolated"


def _point(rows: int, us: float, source: str, row: str) -> dict:
    return {"rows": rows, "us": us, "source": f"docs/results/{source}", "row": row}


def _auto_points(model: str, dtype: str, files: dict[int, str], us: dict[int, float]) -> list[dict]:
    return [_point(rows, us[rows], files[rows], f"| {model} | {rows} | api_auto_{dtype} |") for rows in sorted(us)]


_KIMI_FILES = {64: "experts_vs_peers_64_rows_h200_2026-12-02.md", 512: "experts_vs_peers_512_rows_h200_2026-12-02.md",
               4096: "experts_vs_peers_kimi_4096_rows_h200_2026-12-02.md",
               32768: "experts_vs_peers_kimi_64_32768_rows_h200_2026-12-01.md"}
_STEP3_FILES = {64: "experts_vs_peers_64_rows_h200_2026-12-02.md", 512: "experts_vs_peers_512_rows_h200_2026-12-02.md",
                4096: "experts_vs_peers_step3_4096_rows_h200_2026-12-02.md",
                32768: "experts_vs_peers_step3_32768_rows_h200_2026-12-02.md"}
_DECODE = "quantized_experts_decode_h200_2026-12-02.md"

# The per-call numbers exactly as recorded (column "us" of the named row); the per-expert model is derived in code.
TABLE = {
    "format": FILE_FORMAT, "version": FILE_VERSION,
    "models": {
        "kimi-k2": {"shape": _KIMI, "experts_measured": 48, "dtypes": {
            "bf16": {"path": _AUTO.format("api_auto_bf16"), "points": _auto_points(
                "kimi-k2", "bf16", _KIMI_FILES, {64: 699.1, 512: 963.3, 4096: 1149.8, 32768: 4915.5})},
            "fp8": {"path": _AUTO.format("api_auto_fp8"), "points": _auto_points(
                "kimi-k2", "fp8", _KIMI_FILES, {64: 387.7, 512: 514.9, 4096: 704.7, 32768: 2861.5})},
            "int4": {"path": _W4.format("int4_w4a16"), "points": [
                _point(64, 281.0, _DECODE, "| 64 | int4_w4a16 |"),
                _point(512, 374.2, _DECODE, "| 512 | int4_w4a16 |")]},
            "mxfp4": {"path": _W4.format("mxfp4_w4a16"), "points": [
                _point(64, 278.6, _DECODE, "| 64 | mxfp4_w4a16 |"),
                _point(512, 370.4, _DECODE, "| 512 | mxfp4_w4a16 |")]},
        }},
        "step3": {"shape": _STEP3, "experts_measured": 48, "dtypes": {
            "bf16": {"path": _AUTO.format("api_auto_bf16"), "points": _auto_points(
                "step3", "bf16", _STEP3_FILES, {64: 1690.8, 512: 2344.8, 4096: 2816.8, 32768: 12475.1})},
            "fp8": {"path": _AUTO.format("api_auto_fp8"), "points": _auto_points(
                "step3", "fp8", _STEP3_FILES, {64: 906.3, 512: 1233.3, 4096: 1786.9, 32768: 7109.2})},
        }},
    },
}


@dataclass(frozen=True)
class ExpertTimes:
    """t(r): one expert's MLP time (us) at r routed rows, piecewise linear through ``(rows, us)`` per-expert points
    (module doc for the rules outside them).

    Attributes:
        rows: rows per expert of each point, strictly increasing, > 0. us: one expert's us at each, > 0 and
            non-decreasing (so t never falls with rows, also past the last point). name: where the table came from.
    """

    rows: tuple[float, ...]
    us: tuple[float, ...]
    name: str = "table"

    def __post_init__(self):
        problem = _points_problem(self.rows, self.us)
        if problem:
            raise CommandLineError(f"expert times {self.name}: {problem}")

    @property
    def max_rows(self) -> float:
        """The largest measured rows per expert (above it t is extrapolated)."""
        return self.rows[-1]

    def __call__(self, rows) -> torch.Tensor:
        """t at ``rows`` (any shape, real, >= 0) -> the same shape, ``torch.float64`` us."""
        r = torch.as_tensor(rows, dtype=torch.float64)
        x = torch.tensor(self.rows, dtype=torch.float64)
        y = torch.tensor(self.us, dtype=torch.float64)
        right = torch.searchsorted(x, r).clamp(1, x.numel() - 1)  # the segment [right - 1, right]; past the end: last
        x0, x1, y0, y1 = x[right - 1], x[right], y[right - 1], y[right]
        t = y0 + (r - x0) * (y1 - y0) / (x1 - x0)
        t = torch.where(r < x[0], y[0], t)
        return torch.where(r <= 0, torch.zeros_like(t), t)


def _points_problem(rows, us) -> str | None:
    if len(rows) != len(us) or len(rows) < 2:
        return f"needs at least 2 points of (rows, us), got {len(rows)} rows and {len(us)} times"
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (*rows, *us)):
        return f"rows {list(rows)} and us {list(us)} must be finite numbers"
    if rows[0] <= 0 or any(b <= a for a, b in zip(rows, rows[1:])):
        return f"rows {list(rows)} must be > 0 and strictly increasing"
    if us[0] <= 0 or any(b < a for a, b in zip(us, us[1:])):
        return f"us {list(us)} must be > 0 and non-decreasing in rows"
    return None


def read_table(path: str | Path | None = None) -> dict:
    """The shipped ``TABLE`` (``path`` None) or a user's JSON file of the same format; ``CommandLineError`` (CFG015,
    ``--times``) naming the path for anything else."""
    if path is None:
        return TABLE
    try:
        table = json.loads(Path(path).read_text())
        if table.get("format") != FILE_FORMAT or table.get("version") != FILE_VERSION:
            raise ValueError(f"format {table.get('format')!r} version {table.get('version')!r}")
        if not isinstance(table.get("models"), dict) or not table["models"]:
            raise ValueError("no 'models'")
    except (OSError, ValueError, AttributeError) as err:
        raise CommandLineError(f"eplb simulate: --times {str(path)!r} is not a {FILE_FORMAT} version {FILE_VERSION} "
                               f"file ({err}); copy the shipped table's format (moe_ref.eplb.expert_times.TABLE, "
                               f"docs/eplb.md)") from err
    return table


def expert_times(table: dict, model: str, dtype: str, name: str = "the shipped table") -> ExpertTimes:
    """One model's and dtype's ``ExpertTimes`` from a table: each point's ``rows / experts_measured`` rows and
    ``us / experts_measured`` us (the module doc's approximation). ``CommandLineError`` (CFG015) names what the
    table holds when ``model`` or ``dtype`` is not in it, or a point is malformed."""
    models = table["models"]
    if model not in models:
        raise CommandLineError(f"eplb simulate: --model {model!r} is not in {name}; it holds {', '.join(models)}")
    entry = models[model]
    dtypes = entry.get("dtypes", {}) if isinstance(entry, dict) else {}
    if dtype not in dtypes:
        raise CommandLineError(f"eplb simulate: --expert-dtype {dtype!r} is not in {name} for {model}; it holds "
                               f"{', '.join(dtypes) or 'none'}")
    try:
        experts = float(entry.get("experts_measured", 1))
        points = dtypes[dtype]["points"]
        rows = tuple(float(p["rows"]) / experts for p in points)
        us = tuple(float(p["us"]) / experts for p in points)
    except (KeyError, TypeError, ValueError) as err:
        raise CommandLineError(f"eplb simulate: {name}, {model} {dtype}: each point needs numbers 'rows' and 'us' "
                               f"({err!r})") from err
    if not experts > 0:
        raise CommandLineError(f"eplb simulate: {name}, {model}: experts_measured {experts} must be > 0")
    return ExpertTimes(rows, us, f"{name}, {model} {dtype}")


def rank_us(load_LyE: torch.Tensor, placement: Placement, times: ExpertTimes) -> torch.Tensor:
    """Modelled expert time of each rank per layer: the sum over its slots of t(rows of the slot).

    Args:
        load_LyE: ``[Ly, E]`` real, finite, >= 0: rows routed to each logical expert in one step of each layer.
        placement: the placement (``Ly`` layers, E experts, Ph slots over R ranks).
        times: t(r).

    Returns:
        us_LyR: ``[Ly, R]`` ``torch.float64``.
    """
    us_LyPh = times(slot_rows(load_LyE, placement))
    return us_LyPh.view(placement.num_layers, placement.num_ranks, placement.slots_per_rank).sum(dim=2)


@dataclass(frozen=True, eq=False)
class StepTimes:
    """Modelled step of each layer, before (E / R experts per rank) and after the placement: ``[Ly]`` float64 us
    (the slowest rank's), and the largest rows of one slot after (to say when t was extrapolated)."""

    before_us_Ly: torch.Tensor
    after_us_Ly: torch.Tensor
    max_slot_rows_after: float
    max_slot_rows_before: float

    @property
    def speedup(self) -> float:
        """Sum over layers before / after (1.0 when both are 0)."""
        after = float(self.after_us_Ly.sum())
        return float(self.before_us_Ly.sum()) / after if after > 0 else 1.0


def step_times(load_LyE: torch.Tensor, placement: Placement, times: ExpertTimes) -> StepTimes:
    """Each layer's modelled step (its slowest rank) without EPLB and with ``placement``.

    Args:
        load_LyE: ``[Ly, E]`` rows per logical expert in one step of each layer.
        placement: the placement to judge (its R is used for both sides; E % R == 0 for the side without EPLB).
        times: t(r).
    """
    before = identity_placement(placement.num_layers, placement.num_experts, placement.num_ranks)
    return StepTimes(before_us_Ly=rank_us(load_LyE, before, times).max(dim=1).values,
                     after_us_Ly=rank_us(load_LyE, placement, times).max(dim=1).values,
                     max_slot_rows_after=float(slot_rows(load_LyE, placement).max()),
                     max_slot_rows_before=float(slot_rows(load_LyE, before).max()))
