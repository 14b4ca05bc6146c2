"""Placement: which logical expert each physical expert slot holds, per MoE layer (the EPLB map).

    load per (layer, expert) -> planner (moe_ref.eplb.planner) -> Placement -> simulate / save -> (later) the layer

``Placement`` owns the map and everything derived from it: the padded logical -> physical table, the replica
counts, the rank of each slot, the per-token replica choice (``replica_for``) and the JSON file format.

Shape legend: E experts (the model's logical experts), R EP ranks, T tokens of this rank, K top-k, Ly MoE layers of a
model, Ph physical expert slots of a layer (E + redundant replicas).

Rank r owns slots [r * Ph / R, (r + 1) * Ph / R).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from moe_ref.core.errors import PlacementError
from moe_ref.kernels.router.replica_route import replica_index

FILE_FORMAT = "moe_ref.eplb.placement"
FILE_VERSION = 1
@dataclass(frozen=True, eq=False)  # tensors have no truth value: compare physical_to_logical_LyPh
class Placement:
    """The physical slots of every MoE layer and the logical expert each holds (checked on construction).

    Args:
        physical_to_logical_LyPh: ``[Ly, Ph]`` ``torch.int64`` (CPU): the logical expert in ``[0, E)`` held by physical
            slot p of layer l; rank r owns slots ``[r * P / R, (r + 1) * P / R)``.
        num_experts: E, the logical experts; each needs at least one slot in every layer.
        num_ranks: R, the EP ranks the slots are split over (P % R == 0).
    """

    physical_to_logical_LyPh: torch.Tensor
    num_experts: int
    num_ranks: int

    def __post_init__(self):
        self.validate()

    # --- checks ------------------------------------------------------------------------------------------

    def validate(self) -> None:
        """Raise ``PlacementError`` (CFG033) naming the numbers when the map is not a placement: not a 2-D integer
        tensor, P not a multiple of R, an id outside ``[0, E)``, or a logical expert without a slot in some layer."""
        table = self.physical_to_logical_LyPh
        if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.dtype != torch.int64:
            got = f"{table.dtype} {list(table.shape)}" if isinstance(table, torch.Tensor) else type(table).__name__
            raise PlacementError(f"physical_to_logical_LyPh must be an int64 [layers, slots] tensor, got {got}; "
                                 "build it with torch.tensor(..., dtype=torch.int64)")
        num_layers, num_physical = table.shape
        num_experts, num_ranks = self.num_experts, self.num_ranks
        if num_experts < 1 or num_ranks < 1 or num_layers < 1:
            raise PlacementError(f"{num_experts=}, {num_ranks=} and {num_layers=} must be >= 1")
        if num_physical % num_ranks:
            raise PlacementError(f"{num_physical=} slots do not split over {num_ranks=} ranks "
                                 f"({num_physical} % {num_ranks} = {num_physical % num_ranks}); use a multiple of "
                                 f"{num_ranks} slots (e.g. {num_physical + num_ranks - num_physical % num_ranks})")
        bad = (table < 0) | (table >= num_experts)
        if bool(bad.any()):
            layer, slot = (int(i) for i in bad.nonzero()[0])
            raise PlacementError(f"layer {layer} slot {slot} holds expert {int(table[layer, slot])}, outside "
                                 f"[0, {num_experts=}); every slot must name a logical expert")
        missing = self.replica_count_LyE == 0
        if bool(missing.any()):
            layer, expert = (int(i) for i in missing.nonzero()[0])
            raise PlacementError(f"layer {layer}: logical expert {expert} has no physical slot "
                                 f"({int(missing.sum())} (layer, expert) pairs without one, {num_physical=}, "
                                 f"{num_experts=}); give every expert at least one slot (num_physical >= num_experts)")

    # --- sizes and derived tables ---------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return self.physical_to_logical_LyPh.shape[0]

    @property
    def num_physical(self) -> int:
        return self.physical_to_logical_LyPh.shape[1]

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.num_ranks

    @cached_property
    def replica_count_LyE(self) -> torch.Tensor:
        """``[Ly, E]`` ``torch.int64``: the physical slots holding each logical expert, per layer."""
        counts_LyE = torch.zeros(self.num_layers, self.num_experts, dtype=torch.int64)
        in_range_LyPh = self.physical_to_logical_LyPh.clamp(0, self.num_experts - 1)  # validate() reports bad ids
        return counts_LyE.scatter_add_(1, in_range_LyPh, torch.ones_like(in_range_LyPh))

    @cached_property
    def logical_to_physical_LE_(self) -> torch.Tensor:
        """``[Ly, E, max replicas]`` ``torch.int64``: the physical slots of each logical expert in increasing order,
        padded with ``-1`` after its ``replica_count_LyE`` entries."""
        num_layers, num_physical = self.physical_to_logical_LyPh.shape
        width = int(self.replica_count_LyE.max())
        table = torch.full((num_layers, self.num_experts, width), -1, dtype=torch.int64)
        # a stable sort by expert keeps each expert's slots in increasing order
        order_LyPh = torch.sort(self.physical_to_logical_LyPh, dim=1, stable=True).indices
        experts_LyPh = torch.gather(self.physical_to_logical_LyPh, 1, order_LyPh)
        first_LyE = torch.cumsum(self.replica_count_LyE, dim=1) - self.replica_count_LyE
        replica_LyPh = torch.arange(num_physical).expand(num_layers, -1) - torch.gather(first_LyE, 1, experts_LyPh)
        layer_LyPh = torch.arange(num_layers).unsqueeze(1).expand(-1, num_physical)
        table[layer_LyPh, experts_LyPh, replica_LyPh] = order_LyPh
        return table

    def rank_of_slot(self, slot_idx: torch.Tensor) -> torch.Tensor:
        """The rank owning each physical slot.

        Args:
            slot_idx: physical slot ids in ``[0, P)``, any shape, ``torch.int64``.

        Returns:
            rank_idx: same shape, ``torch.int64``: ``slot_idx // (P / R)``.
        """
        return slot_idx // self.slots_per_rank

    # --- per-token replica choice ------------------------------------------------------------------------

    def replica_for(self, token_key: torch.Tensor, slot_idx: torch.Tensor, logical_expert: torch.Tensor,
                    layer_idx: int = 0) -> torch.Tensor:
        """The physical slot that serves one routed entry, chosen from the entry alone (``replica_index``'s rule,
        replicas in slot order as in ``logical_to_physical_LE_``).

        Args:
            token_key: an integer key of each token, ``>= 0``, ``torch.int64`` (the layer's: ``routing.token_key``, a
                hash of the token's hidden-state bits); any shape broadcastable with the other two (e.g. ``[T, 1]``).
            slot_idx: top-k slots ``k`` in ``[0, K)``, ``torch.int64`` (e.g. ``[1, K]``).
            logical_expert: logical expert ids in ``[0, E)``, ``torch.int64`` (e.g. ``topk_ids_TK`` ``[T, K]``).
            layer_idx: the MoE layer whose placement is used.

        Returns:
            physical_slot: the broadcast shape (e.g. ``[T, K]``), ``torch.int64`` in ``[0, P)``.
        """
        token_key, slot_idx, logical_expert = (torch.as_tensor(v, dtype=torch.int64)
                                               for v in (token_key, slot_idx, logical_expert))
        replica = replica_index(token_key, slot_idx, self.replica_count_LyE[layer_idx][logical_expert])
        return self.logical_to_physical_LE_[layer_idx][logical_expert, replica]

    def layer(self, layer_idx: int) -> Placement:
        """The one-layer placement of MoE layer ``layer_idx`` (what a ``MegaMoE`` takes)."""
        if not 0 <= layer_idx < self.num_layers:
            raise PlacementError(f"{layer_idx=} is not a layer of this placement (it has {self.num_layers})")
        return Placement(self.physical_to_logical_LyPh[layer_idx:layer_idx + 1].clone(), self.num_experts,
                         self.num_ranks)

    # --- file format -------------------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """Write the placement as JSON: ``{"format", "version", "num_experts", "num_ranks",
        "physical_to_logical": [[...] per layer]}``."""
        record = {"format": FILE_FORMAT, "version": FILE_VERSION, "num_experts": self.num_experts,
                  "num_ranks": self.num_ranks, "physical_to_logical": self.physical_to_logical_LyPh.tolist()}
        Path(path).write_text(json.dumps(record))

    @classmethod
    def load(cls, path: str | Path) -> Placement:
        """Read a file ``save`` wrote; anything else is ``PlacementError`` (CFG033) naming the path."""
        try:
            record = json.loads(Path(path).read_text())
            if record.get("format") != FILE_FORMAT or record.get("version") != FILE_VERSION:
                raise ValueError(f"format {record.get('format')!r} version {record.get('version')!r}")
            table = torch.tensor(record["physical_to_logical"], dtype=torch.int64)
            num_experts, num_ranks = int(record["num_experts"]), int(record["num_ranks"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise PlacementError(f"{str(path)!r} is not a {FILE_FORMAT} version {FILE_VERSION} file ({err}); "
                                 "write it with Placement.save") from err
        return cls(table, num_experts, num_ranks)
