"""Expert backends: the routed-expert MLP over an expert-major receive pool.

    recv pool x_RD (expert-major, segments aligned) --GEMM1 gate||up--> act --GEMM2 down--> y_RD

Shape legend: R pool rows, D width the experts see (hidden, or latent for Kimi-K3), F expert
intermediate, e local experts.

Every backend implements ``Experts.forward(x_RD, layout) -> y_RD`` over the same layout
(``ExpertLayout``): the rows of local expert i are ``x_RD[row_start_e[i] : row_start_e[i] + num_rows_e[i]]``;
rows outside every segment (alignment padding) come out as zeros. Backends:

| name         | what                                            | where            |
|--------------|-------------------------------------------------|------------------|
| ``torch``    | per-expert loop of plain matmuls (the oracle)   | anywhere         |
| ``grouped_mm`` | ``torch.nn.functional.grouped_mm``            | torch >= 2.9     |
| ``triton``   | ``kernels.grouped_mlp``, activation fused       | CUDA (or interpreter) |
| ``deep_gemm``| DeepGEMM grouped GEMMs                          | SM90 + deep_gemm |
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from moe_ref.activations import dense_mlp, gated_activation
from moe_ref.errors import BackendUnavailableError, UnknownNameError

EXPERT_BACKENDS = ("auto", "torch", "grouped_mm", "triton", "deep_gemm")


@dataclass(frozen=True)
class ExpertLayout:
    """Where each local expert's rows sit in the receive pool.

    Attributes:
        row_start_e: ``[e]`` int64, first pool row of each expert (a multiple of ``alignment``).
        num_rows_e: ``[e]`` int64, valid rows of each expert (may be 0).
        num_pool_rows: R, rows of the pool tensor (>= the last segment's aligned end).
        alignment: segment alignment in rows (128 for the grouped GEMMs).
    """

    row_start_e: torch.Tensor
    num_rows_e: torch.Tensor
    num_pool_rows: int
    alignment: int

    @staticmethod
    def from_counts(num_rows_e: torch.Tensor, alignment: int, num_pool_rows: int | None = None) -> "ExpertLayout":
        """Pack segments back to back, each starting on a multiple of ``alignment``.

        Example: counts [3, 0, 5], alignment 4 -> starts [0, 4, 4], ends 3, 4, 9; R = 12 unless given.
        """
        num_rows_e = num_rows_e.to(torch.int64)
        aligned_e = (num_rows_e + alignment - 1) // alignment * alignment
        row_start_e = torch.cumsum(aligned_e, 0) - aligned_e
        needed = int(aligned_e.sum()) if num_pool_rows is None else num_pool_rows
        return ExpertLayout(row_start_e, num_rows_e, needed, alignment)

    @property
    def num_local_experts(self) -> int:
        return self.num_rows_e.numel()

    def row_expert_R(self) -> torch.Tensor:
        """``[R]`` int64: the local expert of each pool row, -1 for padding rows."""
        expert_R = torch.full((self.num_pool_rows,), -1, dtype=torch.int64, device=self.num_rows_e.device)
        for i, (start, count) in enumerate(zip(self.row_start_e.tolist(), self.num_rows_e.tolist())):
            expert_R[start:start + count] = i
        return expert_R


class Experts(ABC):
    """The local experts' weights and one way to run them.

    Args:
        gate_up_weight_e2FD: ``[e, 2F, D]`` gate rows then up rows of each local expert.
        down_weight_eDF: ``[e, D, F]``.
        activation, situ_beta, situ_linear_beta: see ``moe_ref.activations``.
    """

    name = "abstract"
    # True: give me whole aligned segments with zeroed padding (see moe_ref.dispatch's NOTE); False: I skip
    # padding rows myself and leave them zero in my output.
    computes_whole_segments = False

    def __init__(self, gate_up_weight_e2FD: torch.Tensor, down_weight_eDF: torch.Tensor, activation: str = "silu",
                 situ_beta: float = 4.0, situ_linear_beta: float = 25.0):
        self.gate_up_weight_e2FD = gate_up_weight_e2FD
        self.down_weight_eDF = down_weight_eDF
        self.activation, self.situ_beta, self.situ_linear_beta = activation, situ_beta, situ_linear_beta

    @abstractmethod
    def forward(self, x_RD: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
        """``x_RD [R, D]`` pool rows -> ``y_RD [R, D]`` in ``x_RD``'s dtype (padding rows zero)."""

    def __call__(self, x_RD: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
        return self.forward(x_RD, layout)


class TorchLoopExperts(Experts):
    """One plain matmul pair per expert: slow and obviously right. Each row's result does not depend on
    which other rows share its expert, so chunked and unchunked runs agree bitwise on CPU."""

    name = "torch"
    computes_whole_segments = True

    def forward(self, x_RD, layout):
        y_RD = torch.zeros_like(x_RD)
        for i, (start, count) in enumerate(zip(layout.row_start_e.tolist(), layout.num_rows_e.tolist())):
            if count:
                y_RD[start:start + count] = dense_mlp(
                    x_RD[start:start + count], self.gate_up_weight_e2FD[i], self.down_weight_eDF[i],
                    self.activation, self.situ_beta, self.situ_linear_beta)
        return y_RD


class GroupedMMExperts(Experts):
    """``torch.nn.functional.grouped_mm`` (CUTLASS on SM90 for bf16; a composite elsewhere).

    Segments are passed with their aligned ends as ``offs``, so padding rows are computed and then
    zeroed; no host sync on CUDA.
    """

    name = "grouped_mm"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
        if self._grouped_mm is None:
            raise BackendUnavailableError(f"torch {torch.__version__} has no grouped_mm; use backend='torch'")

    def forward(self, x_RD, layout):
        num_rows = x_RD.shape[0]
        aligned_e = (layout.num_rows_e + layout.alignment - 1) // layout.alignment * layout.alignment
        offs_e = (layout.row_start_e + aligned_e).clamp(max=num_rows).to(torch.int32)
        x_in = x_RD.to(self.gate_up_weight_e2FD.dtype)
        gate_up_R2F = self._grouped_mm(x_in, self.gate_up_weight_e2FD.transpose(-2, -1), offs=offs_e)
        gate_RF, up_RF = gate_up_R2F.chunk(2, dim=-1)
        h_RF = gated_activation(gate_RF, up_RF, self.activation, self.situ_beta, self.situ_linear_beta)
        y_RD = self._grouped_mm(h_RF.to(self.down_weight_eDF.dtype).contiguous(),
                                self.down_weight_eDF.transpose(-2, -1), offs=offs_e)
        valid_R = _valid_rows(layout, num_rows, x_RD.device)
        return torch.where(valid_R[:, None], y_RD, 0).to(x_RD.dtype)


def _valid_rows(layout: ExpertLayout, num_rows: int, device) -> torch.Tensor:
    """``[R]`` bool, True on rows inside a segment (computed on device, no host sync)."""
    rows_R = torch.arange(num_rows, device=device)
    ends_e = layout.row_start_e + layout.num_rows_e
    seg_R = torch.searchsorted(layout.row_start_e, rows_R, right=True) - 1
    seg_R = seg_R.clamp(min=0)
    return (rows_R >= layout.row_start_e[seg_R]) & (rows_R < ends_e[seg_R])


class TritonExperts(Experts):
    """moe_ref's Triton grouped MLP (``kernels.grouped_mlp``): gate/up GEMM with the activation fused in
    its epilogue, then the down GEMM."""

    name = "triton"

    def forward(self, x_RD, layout):
        from moe_ref.kernels.grouped_mlp import grouped_mlp

        return grouped_mlp(x_RD, self.gate_up_weight_e2FD, self.down_weight_eDF, layout.row_start_e,
                           layout.num_rows_e, activation=self.activation, situ_beta=self.situ_beta,
                           situ_linear_beta=self.situ_linear_beta,
                           num_rows_hint=int(layout.num_rows_e.sum()))  # NOTE: host sync; picks GPU tiles


def make_experts(backend: str, gate_up_weight_e2FD: torch.Tensor, down_weight_eDF: torch.Tensor,
                 activation: str = "silu", situ_beta: float = 4.0, situ_linear_beta: float = 25.0) -> Experts:
    """Build the expert backend ``backend`` (``auto`` = triton on CUDA, else torch)."""
    if backend not in EXPERT_BACKENDS:
        raise UnknownNameError(f"experts backend={backend!r}; supported: {', '.join(EXPERT_BACKENDS)}")
    if backend == "auto":
        backend = "triton" if gate_up_weight_e2FD.is_cuda else "torch"
    classes = {"torch": TorchLoopExperts, "grouped_mm": GroupedMMExperts, "triton": TritonExperts}
    if backend == "deep_gemm":
        from moe_ref.deep_gemm_backend import DeepGemmExperts

        classes["deep_gemm"] = DeepGemmExperts
    return classes[backend](gate_up_weight_e2FD, down_weight_eDF, activation, situ_beta, situ_linear_beta)
