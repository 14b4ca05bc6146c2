"""EPLB load telemetry: rows each physical slot received over a window of calls, gathered into a per-layer report.

    each call: the routed step adds the rows each local slot received to its counter ``[e]`` int64, on the device
      (the dispatch kernels / the a2a transport: no host sync, also inside CUDA graphs)
    layer.expert_load()   collective: every rank's window (counter - baseline) gathered -> ExpertLoad
      (per-slot rows, per-rank rows, balancedness = mean / max rows per rank, max-rank rows, per-logical-expert rows)
    layer.reset_expert_load()   a new window starts (no host sync)
    save_expert_loads(path, [ExpertLoad per layer])  the dump format; ``moe_ref.eplb.trace.load_loads`` reads it as
      a one-window trace of logical rows, for ``moe-ref eplb simulate --loads``

Shape legend: E experts, e local slots, R EP ranks, Ph physical slots.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_ref.ep.distributed import comm_device, gather_ints
from moe_ref.eplb.slots import ExpertSlots

FILE_FORMAT = "moe_ref.eplb.telemetry"
FILE_VERSION = 1


@dataclass(frozen=True, eq=False)
class ExpertLoad:
    """One layer's routed rows over a window of calls (CPU tensors; the same on every rank).

    Attributes:
        rows_Ph: ``[Ph]`` int64: rows each physical slot received.
        physical_to_logical_Ph: ``[Ph]`` int64: the logical expert each slot held during the window.
        num_experts: E. num_ranks: R (rank r owns slots ``[r * Ph / R, (r + 1) * Ph / R)``).
    """

    rows_Ph: torch.Tensor
    physical_to_logical_Ph: torch.Tensor
    num_experts: int
    num_ranks: int

    @property
    def rows_per_rank_R(self) -> torch.Tensor:
        """``[R]`` int64: rows each rank's experts computed."""
        return self.rows_Ph.view(self.num_ranks, -1).sum(dim=1)

    @property
    def max_rank_rows(self) -> int:
        """The most rows one rank computed (the slowest rank sets the step time)."""
        return int(self.rows_per_rank_R.max())

    @property
    def balancedness(self) -> float:
        """Mean / max rows per rank (1.0 = even, and for a window without rows)."""
        rows_R = self.rows_per_rank_R.double()
        return float(rows_R.mean() / rows_R.max()) if self.max_rank_rows > 0 else 1.0

    @property
    def logical_rows_E(self) -> torch.Tensor:
        """``[E]`` int64: rows per logical expert (its replicas summed): the planner's load."""
        return torch.zeros(self.num_experts, dtype=torch.int64).index_add_(0, self.physical_to_logical_Ph, self.rows_Ph)

    def as_record(self) -> dict:
        """This layer's entry of the dump format (plain lists and ints)."""
        return {"num_experts": self.num_experts, "num_ranks": self.num_ranks,
                "physical_to_logical": self.physical_to_logical_Ph.tolist(), "rows": self.rows_Ph.tolist()}


def gather_expert_load(slots: ExpertSlots, counter_e: torch.Tensor, group) -> ExpertLoad:
    """Every rank's window of ``counter_e`` gathered (collective; one ``all_gather``, one host sync).

    Args:
        slots: the layer's slots (the window's baseline, the placement).
        counter_e: ``[e]`` int64 on the layer's device: the routed step's cumulative rows per local slot.
        group: the EP group (None: one process).
    """
    window_e = slots.window_rows(counter_e)
    everyone = gather_ints([], group, comm_device(group, counter_e.device), device_values=window_e,
                           what="expert_load (all_gather of the slots' rows)")
    rows_Ph = torch.tensor([rows for rank_rows in everyone for rows in rank_rows], dtype=torch.int64)
    return ExpertLoad(rows_Ph, slots.physical_to_logical_Ph.clone(), slots.num_experts, slots.num_ranks)


def save_expert_loads(path: str | Path, loads: list[ExpertLoad]) -> None:
    """Write one window of several layers' telemetry: ``{"format": "moe_ref.eplb.telemetry", "version": 1,
    "layers": [ExpertLoad.as_record() per MoE layer, in layer order]}``."""
    record = {"format": FILE_FORMAT, "version": FILE_VERSION, "layers": [load.as_record() for load in loads]}
    Path(path).write_text(json.dumps(record))


def logical_rows_from_record(record: dict) -> list[list[int]]:
    """``[Ly][E]`` logical rows of a dump ``save_expert_loads`` wrote (already parsed JSON). Raises ``ValueError``
    or ``KeyError`` / ``TypeError`` on a malformed record (the trace reader turns them into CFG035)."""
    if record.get("version") != FILE_VERSION or not isinstance(record.get("layers"), list):
        raise ValueError(f"a {FILE_FORMAT} record needs version {FILE_VERSION} and a list of layers")
    out = []
    for layer in record["layers"]:
        load = ExpertLoad(torch.tensor(layer["rows"], dtype=torch.int64),
                          torch.tensor(layer["physical_to_logical"], dtype=torch.int64),
                          int(layer["num_experts"]), int(layer["num_ranks"]))
        if load.rows_Ph.shape != load.physical_to_logical_Ph.shape or load.rows_Ph.dim() != 1:
            raise ValueError("rows and physical_to_logical must be lists of the same length")
        out.append(load.logical_rows_E.tolist())
    return out
