"""EPLB simulator: the rows each rank would compute under a placement, and a synthetic skewed load to feed it.

    load [Ly, E] (trace file or zipf_loads) -> planner -> Placement -> balancedness (before: E / R experts per rank,
      after: the placement) -> moe-ref eplb simulate's report (moe_ref.eplb.cli)

A rank's rows are the sum over its slots of (expert load / expert replica count): ``Placement.replica_for``
spreads an expert's rows about evenly over its replicas. Balancedness of a layer = mean rows per rank / max rows
per rank (1 = perfectly even; the slowest rank sets the step time).

Shape legend: E experts (the model's logical experts), R EP ranks, T tokens of this rank, K top-k, Ly MoE layers of a
model, Ph physical expert slots of a layer (E + redundant replicas).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_ref.core.errors import LoadTraceError, PlacementTopologyError, TopKError
from moe_ref.eplb.placement import Placement
from moe_ref.eplb.planner import check_load


def identity_placement(num_layers: int, num_experts: int, num_ranks: int) -> Placement:
    """The placement without EPLB: expert e on rank ``e // (E / R)``, one slot each (P = E).

    Args:
        num_layers: L MoE layers.
        num_experts: E logical experts (``E % R == 0``, else CFG034).
        num_ranks: R EP ranks.

    Returns:
        placement: ``physical_to_logical_LyPh[l] = arange(E)`` for every layer.
    """
    if num_experts % num_ranks:
        raise PlacementTopologyError(f"{num_experts=} % {num_ranks=} = {num_experts % num_ranks}: the placement "
                                     f"without EPLB puts E / R experts on each rank; use an EP size dividing "
                                     f"{num_experts}")
    return Placement(torch.arange(num_experts).expand(num_layers, -1).clone(), num_experts, num_ranks)


def slot_rows(load_LyE: torch.Tensor, placement: Placement) -> torch.Tensor:
    """Rows each physical slot computes per layer: its expert's rows split evenly over the expert's replicas.

    Args:
        load_LyE: ``[Ly, E]``, real, finite, ``>= 0``: rows routed to each logical expert per layer.
        placement: a ``Placement`` with the same L and E.

    Returns:
        rows_LyPh: ``[Ly, Ph]`` ``torch.float64`` (rank r's slots are ``[r * Ph / R, (r + 1) * Ph / R)``).
    """
    load_LyE = check_load(load_LyE)
    if tuple(load_LyE.shape) != (placement.num_layers, placement.num_experts):
        raise LoadTraceError(f"load is {list(load_LyE.shape)} but the placement is for {placement.num_layers} "
                             f"layers x {placement.num_experts} experts; simulate with matching sizes")
    per_replica_LyE = load_LyE / placement.replica_count_LyE
    return torch.gather(per_replica_LyE, 1, placement.physical_to_logical_LyPh)


def rank_rows(load_LyE: torch.Tensor, placement: Placement) -> torch.Tensor:
    """Rows each rank computes per layer (the sum of its slots' ``slot_rows``).

    Args:
        load_LyE: ``[Ly, E]``, real, finite, ``>= 0``: rows routed to each logical expert per layer.
        placement: a ``Placement`` with the same L and E.

    Returns:
        rows_LyR: ``[Ly, R]`` ``torch.float64``.
    """
    slot_rows_LyPh = slot_rows(load_LyE, placement)
    return slot_rows_LyPh.view(placement.num_layers, placement.num_ranks, placement.slots_per_rank).sum(dim=2)


@dataclass(frozen=True, eq=False)
class Balancedness:
    """Per-layer rank rows before (identity placement) and after (the given placement), all ``[Ly]`` float64.

    ``balancedness_*_Ly`` = ``mean_rank_rows_Ly / max_rank_rows_*_Ly`` (1.0 for a layer without load).
    """

    mean_rank_rows_Ly: torch.Tensor
    max_rank_rows_before_Ly: torch.Tensor
    max_rank_rows_after_Ly: torch.Tensor

    @property
    def balancedness_before_Ly(self) -> torch.Tensor:
        return _ratio(self.mean_rank_rows_Ly, self.max_rank_rows_before_Ly)

    @property
    def balancedness_after_Ly(self) -> torch.Tensor:
        return _ratio(self.mean_rank_rows_Ly, self.max_rank_rows_after_Ly)


def _ratio(mean_Ly: torch.Tensor, max_Ly: torch.Tensor) -> torch.Tensor:
    return torch.where(max_Ly > 0, mean_Ly / max_Ly.clamp_min(1e-300), torch.ones_like(mean_Ly))


def balancedness(load_LyE: torch.Tensor, placement: Placement) -> Balancedness:
    """Mean and max rows per rank per layer without EPLB (expert e on rank ``e // (E / R)``) and with ``placement``.

    Args:
        load_LyE: ``[Ly, E]``, real, finite, ``>= 0``: rows routed to each logical expert per layer.
        placement: the placement to judge (same L, E; its R is used for both sides).

    Returns:
        result: a ``Balancedness`` (``[Ly]`` float64 fields; balancedness = mean / max rows per rank).
    """
    before = identity_placement(placement.num_layers, placement.num_experts, placement.num_ranks)
    rows_before_LyR = rank_rows(load_LyE, before)
    rows_after_LyR = rank_rows(load_LyE, placement)
    return Balancedness(mean_rank_rows_Ly=rows_before_LyR.mean(dim=1),
                        max_rank_rows_before_Ly=rows_before_LyR.max(dim=1).values,
                        max_rank_rows_after_Ly=rows_after_LyR.max(dim=1).values)


def _sample_without_replacement(cdf_E: torch.Tensor, num_tokens: int, top_k: int,
                                generator: torch.Generator) -> torch.Tensor:
    """``[T, K]`` int64 draws of K distinct experts per token, each slot drawn from the weights restricted to the
    experts not yet chosen (draw from all, redraw on a repeat: the same law as torch.multinomial without
    replacement, at O(K log E) per token instead of O(E))."""
    num_experts = cdf_E.numel()
    ids_TK = torch.empty(num_tokens, top_k, dtype=torch.int64)
    for k in range(top_k):
        redraw_T = torch.ones(num_tokens, dtype=torch.bool)
        while bool(redraw_T.any()):
            rows = redraw_T.nonzero().squeeze(1)
            draws = torch.searchsorted(cdf_E, torch.rand(rows.numel(), dtype=torch.float64, generator=generator)
                                       * cdf_E[-1], right=True).clamp_max(num_experts - 1)
            ids_TK[rows, k] = draws
            redraw_T = torch.zeros_like(redraw_T)
            redraw_T[rows] = (ids_TK[rows, :k] == draws.unsqueeze(1)).any(dim=1)
    return ids_TK


def zipf_loads(num_layers: int, num_experts: int, top_k: int, tokens: int, s: float, seed: int = 0) -> torch.Tensor:
    """A synthetic skewed routing trace: per layer, experts ranked by a random permutation get weight
    ``1 / rank^s`` (rank from 1), and each token picks ``top_k`` distinct experts by those weights.

    Args:
        num_layers: L MoE layers (each its own permutation).
        num_experts: E logical experts.
        top_k: K experts per token (1 <= K <= E, else CFG003).
        tokens: tokens routed per layer (all ranks together), ``>= 0``.
        s: Zipf exponent, ``>= 0`` (0 = uniform weights).
        seed: seed of the private generator (same arguments -> same trace).

    Returns:
        load_LyE: ``[Ly, E]`` ``torch.int64`` rows per expert; each layer sums to ``tokens * top_k``.
    """
    if not 1 <= top_k <= num_experts:
        raise TopKError(f"{top_k=} must lie in [1, {num_experts=}]")
    if tokens < 0 or num_layers < 1 or not s >= 0:
        raise LoadTraceError(f"zipf_loads needs {tokens=} >= 0, {num_layers=} >= 1 and a Zipf exponent {s=} >= 0")
    generator = torch.Generator().manual_seed(seed)
    weights_E = torch.arange(1, num_experts + 1, dtype=torch.float64) ** -float(s)
    load_LyE = torch.empty(num_layers, num_experts, dtype=torch.int64)
    for layer in range(num_layers):
        expert_of_rank_E = torch.randperm(num_experts, generator=generator)
        layer_weights_E = torch.empty_like(weights_E)
        layer_weights_E[expert_of_rank_E] = weights_E
        ids_TK = _sample_without_replacement(torch.cumsum(layer_weights_E, 0), tokens, top_k, generator)
        load_LyE[layer] = torch.bincount(ids_TK.flatten(), minlength=num_experts)
    return load_LyE
