"""A layer's physical expert slots (EPLB inside ``MegaMoE``): which logical expert each slot holds, and the device
tables that send each routed (token, k) to one replica of its logical expert.

    MegaMoE(cfg, group, num_redundant_experts=N, placement=...)
      resolve_slots(...)           -> ExpertSlots, or None (no EPLB), or a coded problem (CFG021, CFG023, CFG033)
                                      that the construction's one collective raises on every rank
      step_config(cfg)             the routed step sees the Ph slots as its experts: capacity plan, shared buffer,
                                      transport and telemetry count slots, Ph / R per rank
      local_weights(weights)       each local slot's logical expert, taken from a block of experts (LOAD020)
      to_physical(x_TD, ids_TK)    router's logical ids -> physical slots, on the device (no host sync, graph-safe)
      set_placement(placement)     the tables rewritten in place (a rebalance; the layer then rebuilds its experts and
                                      drops its graphs: a graph a caller captured must be captured again, as after a load)
      deployment_slots(cfg, R, N, placement)   the same two calls (resolve_slots, step_config) without a group:
                                      what moe-ref plan / check count (Ph / R slots per rank, the layer's coded errors)

Replica choice (``to_physical``): ``replica_index(token_key(x), k, replica count)``, one Triton launch on
CUDA, its torch twin elsewhere (both, and ``token_key``, in ``moe_ref.kernels.router.replica_route``). The key is a
hash of the bits of ``NUM_KEY_COLUMNS`` fixed, evenly spaced columns of the token's hidden state: a function of the
token's content only, so a token gets the same replica whichever rank, batch position, chunk or micro-batch it is
in, and no collective (a global token index would need every rank's offset) and no reduction over D (a hash of all
D columns would cost a pass over x) is needed. Tokens with identical hidden states share a replica (a padding row,
the same prompt prefix twice): their rows pile on one replica, which the telemetry shows. Where the hidden state
differs between two batchings in the last bit (experts or earlier layers that are not batch-invariant) the replica
can differ too, and so can the router's own top-k; either way the output is the same whichever replica serves
(every replica holds the same weights), bitwise where the experts are row-invariant.

Shape legend: T tokens of this rank, K top-k, D hidden width, E experts, e local slots (Ph / R), R EP ranks, Ph
physical slots (E + redundant).
"""
from __future__ import annotations

import dataclasses
import hashlib
import numbers
import os

import torch

from moe_ref.checkpoint.formats import QUANTIZED_TENSOR_FIELDS, QuantizedExpertWeights
from moe_ref.core.config import MoEConfig
from moe_ref.core.errors import (ExpertSlotsError, MoERefError, PlacementError, PlacementMismatchError,
                                 SlotWeightsError)
from moe_ref.core.weights import EXPERT_FIELDS, MoEWeights
from moe_ref.eplb.placement import Placement
from moe_ref.eplb.planner import plan_global
from moe_ref.kernels.router.replica_route import replica_route, replica_route_ref
from moe_ref.kernels.runtime.ops import uses_triton

NUM_KEY_COLUMNS = 16
# odd multipliers below 2**26: 16 products of a 32-bit column and a multiplier sum below 2**63 (no int64 overflow)
_KEY_MULTIPLIER, _KEY_OFFSET, _KEY_MASK = 0x2545F49, 0x1B873593, (1 << 26) - 1


def placement_digest(placement: Placement) -> str:
    """A short digest of a placement's sizes and map (compared across ranks)."""
    table = placement.physical_to_logical_LyPh.tolist()
    text = f"{placement.num_experts}/{placement.num_ranks}/{table}"
    return hashlib.sha1(text.encode()).hexdigest()[:16]


class ExpertSlots:
    """One layer's Ph physical expert slots over R ranks, e = Ph / R on each, and the device tables of its replica
    routing.

    Args:
        placement: a one-layer ``Placement`` (``physical_to_logical_LyPh`` ``[1, Ph]``).
        rank: this rank (its slots are ``[rank * e, (rank + 1) * e)``).
        hidden_size: D of the layer's input (the key's columns).
        device: where the tables live (the layer's device).

    Attributes:
        placement: the current placement. num_physical: Ph. num_local: e. first_slot: ``rank * e``.
        map_Ph: ``[Ph]`` int64 (device): the placement's map, which the layer saves in its state dict.
        replica_count_E: ``[E]`` int64 (device). logical_to_physical_E_: ``[E, Ph - E + 1]`` int64 (device), row
            ``l``'s first ``replica_count_E[l]`` entries are expert l's slots in increasing order, the rest 0.
    """

    def __init__(self, placement: Placement, rank: int, hidden_size: int, device: torch.device):
        self.rank, self.num_physical = rank, placement.num_physical
        self.num_experts, self.num_ranks = placement.num_experts, placement.num_ranks
        self.num_local = placement.slots_per_rank
        self.first_slot = rank * self.num_local
        width = self.num_physical - self.num_experts + 1
        num_columns = min(NUM_KEY_COLUMNS, hidden_size)
        with torch.inference_mode(False):
            self.replica_count_E = torch.ones(self.num_experts, dtype=torch.int64, device=device)
            self.logical_to_physical_E_ = torch.zeros(self.num_experts, width, dtype=torch.int64, device=device)
            self.map_Ph = torch.zeros(self.num_physical, dtype=torch.int64, device=device)
            self.key_columns = torch.linspace(0, hidden_size - 1, num_columns).round().to(torch.int64).to(device)
            multipliers = torch.arange(num_columns) * _KEY_MULTIPLIER + _KEY_OFFSET & _KEY_MASK | 1
            self.key_multipliers = multipliers.to(device)
        self._counter, self._baseline = None, None
        self.set_placement(placement)

    # --- the placement ----------------------------------------------------------------------------------------
    def set_placement(self, placement: Placement) -> None:
        """Take ``placement`` (already checked to fit): the device tables are rewritten in place."""
        self.placement = placement
        table_E_ = torch.zeros_like(self.logical_to_physical_E_, device="cpu")
        slots_LE_ = placement.logical_to_physical_LE_[0]
        table_E_[:, :slots_LE_.shape[1]] = slots_LE_.clamp_min(0)
        with torch.inference_mode(False), torch.no_grad():
            self.replica_count_E.copy_(placement.replica_count_LyE[0])
            self.logical_to_physical_E_.copy_(table_E_)
            self.map_Ph.copy_(placement.physical_to_logical_LyPh[0])

    def take_map(self) -> None:
        """Take ``map_Ph`` as the placement where a state-dict load rewrote it (``PlacementError``, CFG033, if it is
        no placement). NOTE: syncs the host."""
        map_Ph = self.map_Ph.cpu()
        if not torch.equal(map_Ph, self.physical_to_logical_Ph):
            self.set_placement(Placement(map_Ph.unsqueeze(0).clone(), self.num_experts, self.num_ranks))

    @property
    def physical_to_logical_Ph(self) -> torch.Tensor:
        """``[Ph]`` int64 (CPU): the logical expert of each slot."""
        return self.placement.physical_to_logical_LyPh[0]

    def local_experts(self) -> list[int]:
        """The logical expert of each of this rank's e slots, in slot order."""
        return self.physical_to_logical_Ph[self.first_slot:self.first_slot + self.num_local].tolist()

    def local_span(self) -> tuple[int, int]:
        """``(first, count)``: the smallest block of consecutive logical experts holding every local slot's expert
        (what a checkpoint loader reads for this rank)."""
        experts = self.local_experts()
        return min(experts), max(experts) - min(experts) + 1

    def fit_problem(self, placement) -> MoERefError | None:
        """Why ``placement`` cannot replace this one (CFG023), or None."""
        return _fit_problem(placement, self.num_experts, self.num_ranks, self.num_physical)

    def step_config(self, cfg: MoEConfig) -> MoEConfig:
        """``cfg`` as the routed step sees it: Ph experts (the slots), unchecked (a group count of the router need
        not divide Ph)."""
        fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
        return MoEConfig.unchecked(**{**fields, "num_experts": self.num_physical})

    def describe(self) -> str:
        return (f"EPLB {self.num_physical} slots ({self.num_physical - self.num_experts} redundant, "
                f"{self.num_local} on this rank)")

    # --- routing ----------------------------------------------------------------------------------------------
    def to_physical(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor) -> torch.Tensor:
        """The router's logical ids -> the physical slot serving each (token, k) (module doc): one Triton launch
        (``replica_route``) when ``x_TD`` is on CUDA, the torch twin (``replica_route_ref``) elsewhere, bitwise the
        same; no host sync. Masked slots (-1) stay -1; an id outside ``[-1, E)`` becomes one outside ``[-1, Ph)``
        (Ph, or itself below -1), which the routed step's routing-value check reports.

        Args:
            x_TD: ``[T, D]`` bf16, fp16 or fp32, the layer's input (the replica key's bits).
            topk_ids_TK: ``[T, K]`` int64 (int32 accepted) logical ids.

        Returns:
            physical_ids_TK: ``[T, K]`` int64.
        """
        route = replica_route if uses_triton(x_TD.device) else replica_route_ref
        return route(x_TD, topk_ids_TK, self.key_columns, self.key_multipliers, self.replica_count_E,
                     self.logical_to_physical_E_, self.num_experts, self.num_physical)

    # --- weights ----------------------------------------------------------------------------------------------
    def local_weights(self, weights: MoEWeights) -> MoEWeights:
        """``weights`` with its experts replaced by this rank's slots' (``[e, ...]``, slot order; copies).
        Raises ``SlotWeightsError`` (LOAD020) when the block lacks an expert a local slot holds."""
        held = range(weights.first_expert, weights.first_expert + weights.num_held_experts)
        experts = self.local_experts()
        missing = sorted({x for x in experts if x not in held})
        if missing:
            raise SlotWeightsError(f"rank {self.rank}: its slots hold logical experts {sorted(set(experts))}; the "
                                   f"weights given hold experts [{held.start}, {held.stop}) and lack {missing}")
        index = torch.tensor(experts, dtype=torch.int64) - weights.first_expert
        picked = {name: None if getattr(weights, name) is None
                  else getattr(weights, name).index_select(0, index.to(getattr(weights, name).device))
                  for name in EXPERT_FIELDS}
        return dataclasses.replace(weights, first_expert=self.first_slot, **picked)

    def local_quantized(self, quantized: QuantizedExpertWeights) -> QuantizedExpertWeights:
        """A quantized block read for ``local_span()`` -> this rank's slots' experts (``[e, ...]`` each field)."""
        index = torch.tensor(self.local_experts(), dtype=torch.int64) - quantized.first_expert
        picked = {f: getattr(quantized, f).index_select(0, index.to(getattr(quantized, f).device))
                  for f in QUANTIZED_TENSOR_FIELDS}
        return dataclasses.replace(quantized, first_expert=self.first_slot, **picked)

    # --- telemetry window -------------------------------------------------------------------------------------
    def window_rows(self, counter_e: torch.Tensor) -> torch.Tensor:
        """``[e]`` int64 (device): rows the local slots received since the last ``reset_window``, from the routed
        step's cumulative counter (a rebuilt step starts a new counter, and a new window)."""
        if counter_e is not self._counter:
            self._counter, self._baseline = counter_e, torch.zeros_like(counter_e)
        return counter_e - self._baseline

    def reset_window(self, counter_e: torch.Tensor) -> None:
        """Start a new window at the counter's current values (no host sync)."""
        self._counter, self._baseline = counter_e, counter_e.clone()


def _fit_problem(placement, num_experts: int, num_ranks: int, num_physical: int | None) -> MoERefError | None:
    if not isinstance(placement, Placement):
        return PlacementMismatchError(f"placement={placement!r} ({type(placement).__name__}); pass a "
                                      f"moe_ref.eplb.Placement, a placement file's path, or None")
    wanted = {"layers": (placement.num_layers, 1), "experts": (placement.num_experts, num_experts),
              "ranks": (placement.num_ranks, num_ranks)}
    if num_physical is not None:
        wanted["slots"] = (placement.num_physical, num_physical)
    wrong = [f"{name} {got} (the layer: {want})" for name, (got, want) in wanted.items() if got != want]
    if not wrong:
        return None
    hint = "; give one layer: placement.layer(i)" if placement.num_layers != 1 else ""
    return PlacementMismatchError(f"the placement has {', '.join(wrong)}: plan it for E={num_experts}, "
                                  f"R={num_ranks}{'' if num_physical is None else f', Ph={num_physical}'}{hint}")


def _default_placement(num_experts: int, num_physical: int, num_ranks: int) -> Placement:
    """The planner's placement for an even load: each spare slot to the lowest-id experts, packed over ranks."""
    return plan_global(torch.ones(1, num_experts), num_physical, num_ranks)


def resolve_slots(cfg: MoEConfig, world_size: int, rank: int, num_redundant_experts, placement,
                  device: torch.device) -> tuple[ExpertSlots | None, MoERefError | None]:
    """The layer's slots from its constructor arguments: ``(slots, None)``, ``(None, None)`` without EPLB
    (``num_redundant_experts`` None or 0 and no placement), or ``(None, problem)`` (not raised here: the
    construction's collective raises it on every rank).

    Args:
        num_redundant_experts: None (the placement's, else 0) or an int >= 0 with ``(E + it) % R == 0`` (CFG021).
        placement: None (the planner's for an even load), a ``Placement`` of one layer, or a path to one
            (``Placement.save``'s file); a misfit is CFG023, an unreadable or invalid file CFG033.
    """
    if placement is None and num_redundant_experts in (None, 0):
        return None, None
    E, R = cfg.num_experts, world_size
    redundant = num_redundant_experts
    if redundant is not None and (isinstance(redundant, bool) or not isinstance(redundant, numbers.Integral)
                                  or redundant < 0):
        return None, ExpertSlotsError(f"num_redundant_experts={redundant!r} must be None or an int >= 0")
    if isinstance(placement, (str, os.PathLike)):
        try:
            placement = Placement.load(placement)
        except PlacementError as err:
            return None, err
    num_physical = None if redundant is None else E + int(redundant)
    if placement is None:
        if num_physical % R:
            below, above = num_physical - num_physical % R - E, num_physical - num_physical % R + R - E
            options = f"{below} or {above}" if below >= 0 else f"{above}"
            return None, ExpertSlotsError(f"num_redundant_experts={redundant}: E + redundant = {E} + {redundant} = "
                                          f"{num_physical} slots do not split over {R} ranks ({num_physical} % {R} = "
                                          f"{num_physical % R}); use num_redundant_experts={options}")
        placement = _default_placement(E, num_physical, R)
    problem = _fit_problem(placement, E, R, num_physical)
    if problem is not None:
        return None, problem
    return ExpertSlots(placement, rank, cfg.hidden_size, device), None


def deployment_slots(cfg: MoEConfig, ep_size: int, num_redundant_experts=None,
                     placement=None) -> tuple[MoEConfig, ExpertSlots | None]:
    """The config the routed step of a ``MegaMoE(cfg, group, num_redundant_experts=, placement=)`` at EP
    ``ep_size`` is built for, and its slots: ``resolve_slots`` and ``ExpertSlots.step_config``, the layer's own two
    calls, for ``moe-ref plan`` / ``check`` (no process group; rank 0's view, which every rank shares).

    Args:
        num_redundant_experts, placement: as ``MegaMoE`` takes them; ``placement`` may also be a file of Ly layers,
            each checked as the layer checks its one (all of a file's layers have the same Ph).

    Returns:
        ``(cfg, None)`` without EPLB; else ``(cfg with num_experts = Ph, slots)`` (Ph / R slots per rank).

    Raises:
        the problem the layer's construction raises: ``ExpertSlotsError`` (CFG021), ``PlacementMismatchError``
        (CFG023), ``PlacementError`` (CFG033); a file's layer is named in the message.
    """
    source = placement
    if isinstance(placement, (str, os.PathLike)):
        placement = Placement.load(placement)  # CFG033, as resolve_slots returns it
    layers = [placement] if placement is None or placement.num_layers == 1 else [
        placement.layer(i) for i in range(placement.num_layers)]
    resolved = None
    for index, one_layer in enumerate(layers):
        slots, problem = resolve_slots(cfg, ep_size, 0, num_redundant_experts, one_layer, torch.device("cpu"))
        if problem is not None:
            if len(layers) > 1:
                raise type(problem)(f"{str(source)!r} layer {index} of {len(layers)}: {problem.message}")
            raise problem
        resolved = resolved or slots
    return (cfg, None) if resolved is None else (resolved.step_config(cfg), resolved)
