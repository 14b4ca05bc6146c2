"""Capacity: the exact layout of one rank's symmetric buffer (the overflow policy is ``moe_ref.ep.overflow``).

    x [T, Dx] --(group max of T vs cap: error | chunk)--> pre-dispatch into MY buffer (send regions)
      --dispatch--> peers' receive pools --experts--> combine slots of the SOURCE rank --> reduce

``CapacityPlan`` is the single source of truth for the buffer (``SymmetricBuffer`` allocates exactly
``plan.total_bytes``). Its regions are the device-side data path's contract, ``kernels.ep_regions.EPRegions``
(signals, send regions, receive pool and its layout, the combine partials: see the table there). Both
transports use this one layout: ``symm`` reads peers' regions in place, ``a2a`` fills the same regions of a
private buffer with collectives. Nothing in it outlives a call, so every MoE layer of a model with the same
plan shares ONE buffer per EP group (``buffer.acquire_buffer``), as DeepEP keeps one buffer per process.

The receive pool is laid out in one of two formats (``POOL_FORMATS``, chosen with ``pool_format``):
- ``contiguous`` (default, prefill): ``P = align(R * C * min(K, e) + e * (alignment - 1), alignment)`` rows:
  every token of every rank may pick up to ``min(K, e)`` of my experts, and each expert segment starts on a
  multiple of ``alignment`` rows (the starts are prefix sums computed on the device).
- ``masked`` (decode): ``P = e * M`` with ``M = align(R * C, alignment)`` rows per local expert at fixed starts
  ``i * M`` (DeepGEMM's masked layout ``[e, M, Dx]``); no expert can receive more than M rows.

With ``batch_invariant`` at R >= 2 the plan adds ``combine_slots`` ``[C, K, Dx]`` in the activation dtype (the
invariant combine's receive region: every slot's expert row comes back unreduced, ``Dispatcher.combine_slots``);
the default plan has no such region, so its bytes do not change.

Shape legend: C = cap = ``num_max_tokens_per_rank`` (rows ONE rank feeds per call), Dx expert input width
(hidden, or latent for Kimi-K3), K top-k, E experts, e local experts, R EP ranks, P receive-pool rows.

NOTE: the cap is never multiplied by dp_size or ep_size outside ``CapacityPlan.build``; with attention DP
each rank feeds its own batch, so the per-rank buffer does not depend on dp_size (a peer's double count
made it 95 GiB per rank instead of about 3 GiB at DEP=32).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_ref.core.config import MoEConfig, ParallelConfig
from moe_ref.core.errors import ExpertsNotDivisibleError, InvalidConfigError, MemoryBudgetError
from moe_ref.kernels.ep.ep_regions import (POOL_FORMATS, REGION_ALIGN_BYTES, EPRegions, default_pool_rows,
                                        masked_segment_rows)
from moe_ref.ep.options import ACTIVATION_DTYPES


def _align(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def format_bytes(num_bytes: int) -> str:
    """``1536 -> '1.50 KiB'`` (binary units)."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Region:
    """One named slice of the buffer: ``nbytes`` bytes at ``offset``, viewed as ``shape`` of ``dtype``."""

    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class CapacityPlan:
    """The per-rank symmetric buffer of an EP MoE layer: every region's offset, shape, dtype and bytes.

    Build it with ``CapacityPlan.build``; ``total_bytes`` is what ``SymmetricBuffer`` allocates.
    """

    cfg: MoEConfig
    ep_size: int
    num_max_tokens_per_rank: int
    activation_dtype: torch.dtype
    dispatch_fp8: bool
    alignment: int
    regions: tuple[Region, ...]
    total_bytes: int
    ep_regions: EPRegions
    batch_invariant: bool = False

    @staticmethod
    def build(cfg: MoEConfig, ep_size: int, num_max_tokens_per_rank: int,
              activation_dtype: torch.dtype = torch.bfloat16, dispatch_fp8: bool = False,
              alignment: int = 128, pool_format: str = "contiguous",
              batch_invariant: bool = False) -> "CapacityPlan":
        """Lay out one rank's buffer.

        Args:
            cfg: the MoE block.
            ep_size: R, ranks of the EP group (must divide ``cfg.num_experts``).
            num_max_tokens_per_rank: C, the most rows ONE rank feeds into one call (never dp x ep of them).
            activation_dtype: dtype of the expert input/output rows (bf16, fp16 or fp32).
            dispatch_fp8: ship rows as fp8 e4m3 + fp32 per-128-column scales (``x``/``recv_x`` become fp8).
            alignment: rows each expert segment of the pool starts on (128 for the grouped GEMMs).
            pool_format: ``"contiguous"`` or ``"masked"`` (module doc).
            batch_invariant: the batch-invariant mode's plan: at R >= 2 it adds ``combine_slots`` ``[C, K, Dx]``
                (module doc); one rank reads its pool directly and needs none.

        Returns:
            The plan. Raises ``InvalidConfigError`` (CFG007) for a non-positive cap/alignment, an
            unsupported dtype or pool format, ``ExpertsNotDivisibleError`` (CFG002) when R does not divide E.
        """
        _check_plan_args(cfg, ep_size, num_max_tokens_per_rank, activation_dtype, alignment, pool_format)
        cap, num_local = num_max_tokens_per_rank, cfg.num_experts // ep_size
        # P: EPRegions' own default for the contiguous pool (num_recv_pool_rows), e * M for the masked one
        ep_regions = EPRegions.build(ep_size, num_local, cfg.num_topk, cap, cfg.expert_hidden_size,
                                     activation_dtype=activation_dtype, fp8=dispatch_fp8, alignment=alignment,
                                     masked_rows=masked_segment_rows(ep_size, cap, alignment)
                                     if pool_format == "masked" else 0,
                                     slot_rows=bool(batch_invariant) and ep_size > 1)
        regions = [Region(name, ep_regions.offsets[name], *ep_regions.spec(name), ep_regions.nbytes(name))
                   for name in ep_regions.offsets]
        offset = _align(regions[-1].end, REGION_ALIGN_BYTES)
        return CapacityPlan(cfg, ep_size, cap, activation_dtype, dispatch_fp8, alignment, tuple(regions), offset,
                            ep_regions, bool(batch_invariant))

    # --- queries ---------------------------------------------------------------------------------------
    @property
    def num_local_experts(self) -> int:
        return self.cfg.num_experts // self.ep_size

    @property
    def pool_format(self) -> str:
        """``"contiguous"`` or ``"masked"`` (the regions' layout)."""
        return self.ep_regions.pool_format

    @property
    def num_pool_rows(self) -> int:
        return self.region("recv_x").shape[0]

    def region(self, name: str) -> Region:
        """The region called ``name``; raises ``KeyError`` listing the names."""
        for region in self.regions:
            if region.name == name:
                return region
        raise KeyError(f"no region {name!r} in this plan; regions: {', '.join(r.name for r in self.regions)}")

    def has_region(self, name: str) -> bool:
        return any(region.name == name for region in self.regions)

    def with_cap(self, num_max_tokens_per_rank: int) -> "CapacityPlan":
        """The same plan for another cap (used to price the cap an overflow error asks for)."""
        return CapacityPlan.build(self.cfg, self.ep_size, num_max_tokens_per_rank, self.activation_dtype,
                                  self.dispatch_fp8, self.alignment, self.pool_format, self.batch_invariant)

    def group_bytes(self) -> dict[str, int]:
        """Bytes per part: signals, send, receive, combine (region bytes plus the alignment gaps after them)."""
        parts = {"signals": ("signal", "epoch", "status", "counter"),
                 "send": ("num_tokens", "send_count", "topk_ids", "topk_weights", "slot_rank", "x", "x_scale"),
                 "receive": ("recv_num_tokens", "num_rows", "row_start", "recv_base", "pool_end", "recv_pos",
                             "recv_weight", "recv_src", "recv_x", "recv_x_scale"),
                 "combine": ("combine_partial", "combine_slots")}
        ends = [r.offset for r in self.regions[1:]] + [self.total_bytes]
        out = {part: 0 for part in parts}
        for region, end in zip(self.regions, ends):
            part = next(p for p, names in parts.items() if region.name in names)
            out[part] += end - region.offset
        return out

    def report(self) -> str:
        """A human table of every region, with totals per part and per rank."""
        cfg = self.cfg
        wire = "fp8 e4m3 + fp32 scales per 128 columns" if self.dispatch_fp8 else _dtype_name(self.activation_dtype)
        lines = [
            f"Symmetric buffer of ONE rank: {cfg.name}, EP {self.ep_size} (local experts {self.num_local_experts} of "
            f"{cfg.num_experts}, top-{cfg.num_topk}), cap {self.num_max_tokens_per_rank} rows/rank, "
            f"width {cfg.expert_hidden_size}, dispatch {wire}, alignment {self.alignment}, pool {self.pool_format}"
            f"{', batch-invariant combine' if self.batch_invariant else ''}",
            self._pool_rows_line(),
            "",
            f"{'region':<28} {'offset':>14} {'shape':<22} {'dtype':<14} {'bytes':>16} {'':>11}",
        ]
        for r in self.regions:
            lines.append(f"{r.name:<28} {r.offset:>14} {str(list(r.shape)):<22} {_dtype_name(r.dtype):<14} "
                         f"{r.nbytes:>16} {format_bytes(r.nbytes):>11}")
        lines.append("")
        for part, nbytes in self.group_bytes().items():
            lines.append(f"{'total ' + part:<28} {'':>14} {'':<22} {'':<14} {nbytes:>16} {format_bytes(nbytes):>11}")
        lines.append(f"{'TOTAL per rank':<28} {'':>14} {'':<22} {'':<14} {self.total_bytes:>16} "
                     f"{format_bytes(self.total_bytes):>11}")
        lines.append(f"{'TOTAL over the EP group':<28} {'':>14} {'':<22} {'':<14} "
                     f"{self.total_bytes * self.ep_size:>16} {format_bytes(self.total_bytes * self.ep_size):>11}")
        lines.append(_model_total_line(self.cfg, self))
        return "\n".join(lines)


    def _pool_rows_line(self) -> str:
        R, C, e, A = self.ep_size, self.num_max_tokens_per_rank, self.num_local_experts, self.alignment
        if self.pool_format == "masked":
            M = self.ep_regions.masked_rows
            return (f"receive pool rows P = e*M, M = align(R*C, alignment) = align({R}*{C}, {A}) = {M} rows per "
                    f"local expert -> {e}*{M} = {self.num_pool_rows}")
        return (f"receive pool rows P = R*C*min(K,e) + e*(alignment-1), aligned = {R}*{C}*"
                f"{min(self.cfg.num_topk, e)} + {e}*{A - 1} -> {self.num_pool_rows}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_plan_args(cfg, ep_size, cap, activation_dtype, alignment, pool_format) -> None:
    if not isinstance(ep_size, int) or ep_size <= 0:
        raise InvalidConfigError(f"ep_size={ep_size!r} must be a positive integer")
    if cfg.num_experts % ep_size != 0:
        raise ExpertsNotDivisibleError(
            f"num_experts={cfg.num_experts} % ep_size={ep_size} = {cfg.num_experts % ep_size}: experts are "
            f"placed in equal blocks; choose ep_size among the divisors of {cfg.num_experts}",
            num_experts=cfg.num_experts, ep_size=ep_size)
    if not isinstance(cap, int) or isinstance(cap, bool) or cap <= 0:
        raise InvalidConfigError(f"num_max_tokens_per_rank={cap!r} must be a positive integer (rows one rank "
                                 f"feeds per call)", field="num_max_tokens_per_rank")
    if not isinstance(alignment, int) or alignment <= 0:
        raise InvalidConfigError(f"alignment={alignment!r} must be a positive integer (rows)", field="alignment")
    if pool_format not in POOL_FORMATS:
        raise InvalidConfigError(f"pool_format={pool_format!r}; use one of {', '.join(POOL_FORMATS)}",
                                 field="pool_format")
    if activation_dtype not in ACTIVATION_DTYPES:
        raise InvalidConfigError(f"activation_dtype={activation_dtype} is not supported; use one of "
                                 f"{', '.join(_dtype_name(d) for d in ACTIVATION_DTYPES)} (FP8 dispatch: "
                                 f"dispatch_fp8=True)", field="activation_dtype")


def num_recv_pool_rows(cfg: MoEConfig, ep_size: int, num_max_tokens_per_rank: int, alignment: int = 128,
                       pool_format: str = "contiguous") -> int:
    """P: rows of one rank's receive pool: ``align(R*C*min(K, e) + e*(alignment-1), alignment)`` (contiguous),
    ``e * align(R*C, alignment)`` (masked).

    Example: R=2, C=16, K=4, e=8, alignment=128 -> 2*16*4 + 8*127 = 1144 -> 1152 (contiguous), 8*128 = 1024
    (masked).
    """
    num_local = cfg.num_experts // ep_size
    if pool_format == "masked":
        return num_local * masked_segment_rows(ep_size, num_max_tokens_per_rank, alignment)
    return default_pool_rows(ep_size, num_max_tokens_per_rank, cfg.num_topk, num_local, alignment)


# --- topology and budget ----------------------------------------------------------------------------------

def plan_for_topology(cfg: MoEConfig, parallel: ParallelConfig, max_num_tokens: int, *,
                      activation_dtype: torch.dtype = torch.bfloat16, dispatch_fp8: bool = False,
                      alignment: int = 128, pool_format: str = "contiguous",
                      batch_invariant: bool = False) -> CapacityPlan:
    """The plan of one rank for a deployment.

    Args:
        parallel: tp/ep/dp sizes; only ``ep_size`` shapes the buffer.
        max_num_tokens: rows ONE rank feeds per call (the scheduler's max batched tokens of one DP rank
            with attention DP). It is the cap as is: the buffer multiplies by R internally, so it is
            never multiplied by ``dp_size`` or ``ep_size`` here.
    """
    parallel.num_local_experts(cfg)  # raises CFG001/CFG002 for an impossible topology
    return CapacityPlan.build(cfg, parallel.ep_size, max_num_tokens, activation_dtype, dispatch_fp8, alignment,
                              pool_format, batch_invariant)


def _model_total_line(cfg: MoEConfig, plan: CapacityPlan) -> str:
    """One buffer per EP group, shared by every MoE layer of the model (what that saves)."""
    num_layers = len(cfg.moe_layers)
    if num_layers <= 1:
        return (f"Every MoE layer with this plan shares this one buffer per rank ({format_bytes(plan.total_bytes)}); "
                f"the config does not say how many MoE layers the model has")
    return (f"Model total: {num_layers} MoE layers share ONE buffer per rank: {format_bytes(plan.total_bytes)} "
            f"(one buffer per layer would take {format_bytes(plan.total_bytes * num_layers)})")


def max_tokens_for_budget(cfg: MoEConfig, ep_size: int, budget_bytes: int,
                          activation_dtype: torch.dtype = torch.bfloat16, dispatch_fp8: bool = False,
                          alignment: int = 128, pool_format: str = "contiguous",
                          batch_invariant: bool = False) -> int:
    """The largest cap whose per-rank plan fits ``budget_bytes`` (binary search; bytes grow with the cap).

    Raises ``MemoryBudgetError`` (CAP004) when even a cap of 1 does not fit, naming both byte counts.
    """
    def cost(cap: int) -> int:
        return CapacityPlan.build(cfg, ep_size, cap, activation_dtype, dispatch_fp8, alignment, pool_format,
                                  batch_invariant).total_bytes

    smallest = cost(1)
    if smallest > budget_bytes:
        raise MemoryBudgetError(
            f"a cap of 1 row per rank already needs {smallest} bytes ({format_bytes(smallest)}) per rank for "
            f"{cfg.name} at EP {ep_size}, above the budget of {budget_bytes} bytes ({format_bytes(budget_bytes)}); "
            f"raise the budget or use more EP ranks", needed_bytes=smallest, budget_bytes=budget_bytes)
    low, high = 1, 2
    while cost(high) <= budget_bytes:
        low, high = high, high * 2
    while high - low > 1:  # invariant: cost(low) <= budget < cost(high)
        mid = (low + high) // 2
        low, high = (mid, high) if cost(mid) <= budget_bytes else (low, mid)
    return low


def plan_report(cfg: MoEConfig, parallel: ParallelConfig, max_num_tokens: int, *,
                activation_dtype: torch.dtype = torch.bfloat16, dispatch_fp8: bool = False,
                alignment: int = 128, pool_format: str = "contiguous", budget_bytes: int | None = None,
                batch_invariant: bool = False) -> str:
    """The text ``moe-ref plan`` prints: topology, the per-rank region table with totals, and (with a
    budget) the largest cap that fits it."""
    plan = plan_for_topology(cfg, parallel, max_num_tokens, activation_dtype=activation_dtype,
                             dispatch_fp8=dispatch_fp8, alignment=alignment, pool_format=pool_format,
                             batch_invariant=batch_invariant)
    feeders = "each attention-DP rank feeds its own batch" if parallel.attention_dp else "rows each rank feeds"
    lines = [
        f"Topology: tp {parallel.tp_size}, ep {parallel.ep_size}, dp {parallel.dp_size}, attention-dp "
        f"{'on' if parallel.attention_dp else 'off'}",
        f"cap = num_max_tokens_per_rank = {max_num_tokens} ({feeders}; the receive side is sized inside the "
        f"plan from R x cap, and the per-rank bytes do not depend on dp_size)",
        "",
        plan.report(),
    ]
    if budget_bytes is not None:
        lines.append("")
        try:
            best = max_tokens_for_budget(cfg, parallel.ep_size, budget_bytes, activation_dtype, dispatch_fp8, alignment,
                                         pool_format, batch_invariant)
            best_bytes = plan.with_cap(best).total_bytes
            lines.append(f"Largest cap within {format_bytes(budget_bytes)} per rank: {best} rows/rank "
                         f"({format_bytes(best_bytes)}); set num_max_tokens_per_rank={best} or "
                         f"MOE_REF_NUM_MAX_TOKENS_PER_RANK={best}")
        except MemoryBudgetError as err:
            lines.append(str(err))
    return "\n".join(lines)
