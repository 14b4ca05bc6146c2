"""DeepGEMM paths for the expert benchmarks (``scripts/bench_experts.py``, ``tests/gpu/test_deep_gemm.py``).

One job: turn a benchmark case into ``(name, fn)`` pairs that run ``moe_ref.experts.deep_gemm.backend.DeepGemmExperts``;
none when ``moe_ref.experts.deep_gemm.probe`` says DeepGEMM cannot run here.

    pool x_PDx (expert-major, 128-aligned segments)
      contiguous: DeepGemmExperts.forward(x_PDx, layout)                          -> y_PDx
      masked:     masked_pool(...) once, outside fn: the segments copied into [e, M, Dx] + masked_m_e (device)
                  DeepGemmExperts.forward_masked(x_eMDx, masked_m_e, expected_m)  -> y_eMDx

Shape legend: P receive-pool rows, Dx expert input width, F expert intermediate, e local experts, M rows reserved
per expert in DeepGEMM's masked layout.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import torch

from moe_ref.experts.deep_gemm.backend import DeepGemmExperts
from moe_ref.experts.deep_gemm.probe import deep_gemm_status, import_deep_gemm
from moe_ref.experts import ExpertLayout

__all__ = ["deep_gemm_grouped_cases", "MaskedPool", "masked_pool"]

# what DeepGemmExperts.forward_masked calls, per variant (sgl-deep-gemm 0.1.4 names)
_MASKED_API = {False: "m_grouped_bf16_gemm_nt_masked", True: "m_grouped_fp8_fp4_gemm_nt_masked"}


@dataclasses.dataclass(frozen=True)
class MaskedPool:
    """A pool's segments in DeepGEMM's masked layout.

    Attributes:
        x_eMDx: ``[e, M, Dx]``, row m of expert i = pool row ``row_start_e[i] + m`` for ``m < num_rows_e[i]``, zero
            beyond.
        masked_m_e: ``[e]`` int32 on the pool's device, valid rows per expert (``num_rows_e``).
        expected_m: host int > 0, DeepGEMM's tiling hint (vLLM's estimate for its masked DeepGEMM experts).
    """

    x_eMDx: torch.Tensor
    masked_m_e: torch.Tensor
    expected_m: int


def masked_pool(x_PDx: torch.Tensor, row_start_e: torch.Tensor, num_rows_e: torch.Tensor,
                alignment: int = 128) -> MaskedPool:
    """Copy the pool's segments into DeepGEMM's masked layout (a copy, not a view: segments differ in length).

    Host syncs (M and expected_m are host ints): build it outside any timed region.

    Example: starts [0, 128, 128], counts [3, 0, 130] (P = 384), alignment 128 -> M = 256;
        x_eMDx[0, :3] = x_PDx[0:3], x_eMDx[2, :130] = x_PDx[128:258], the rest zero; masked_m_e [3, 0, 130];
        expected_m = min(256, max(16, round_up(133 // 3, 16))) = 48.

    Args:
        x_PDx: ``[P, Dx]`` pool rows, expert-major.
        row_start_e: ``[e]`` int, first pool row of each expert.
        num_rows_e: ``[e]`` int, valid rows of each expert.
        alignment: M is the largest count rounded up to this (at least one block).

    Returns:
        MaskedPool (see its attributes).
    """
    device = x_PDx.device
    counts_e = num_rows_e.to(device=device, dtype=torch.int64)
    num_experts, num_routed = counts_e.shape[0], int(counts_e.sum())
    max_rows = max(1, -(-(int(counts_e.max()) if num_experts else 0) // alignment)) * alignment
    slot_M = torch.arange(max_rows, device=device)
    valid_eM = slot_M[None, :] < counts_e[:, None]
    rows_eM = row_start_e.to(device=device, dtype=torch.int64)[:, None] + slot_M[None, :]
    x_eMDx = x_PDx.new_zeros(num_experts, max_rows, x_PDx.shape[1])
    x_eMDx[valid_eM] = x_PDx[rows_eM[valid_eM]]
    # vLLM's BatchedDeepGemmExperts.estimate_expected_m: rows per expert rounded up to 16, in [16, M]
    expected_m = min(max_rows, max(16, -(-(num_routed // max(num_experts, 1)) // 16) * 16))
    return MaskedPool(x_eMDx, counts_e.to(torch.int32), expected_m)


def deep_gemm_grouped_cases(x_PDx: torch.Tensor, gate_up_weight_e2FD: torch.Tensor, down_weight_eDF: torch.Tensor,
                            row_start_e: torch.Tensor, num_rows_e: torch.Tensor, *, activation: str = "silu",
                            fp8_options: tuple[bool, ...] = (False, True),
                            layouts: tuple[str, ...] = ("contiguous",)) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    """DeepGEMM paths for a benchmark case as ``(name, fn)`` pairs; [] when deep_gemm is not usable here.

    For ``scripts/bench_experts.py``: each ``fn()`` runs GEMM1, the torch activation and GEMM2 (fp8 also quantizes
    the activations) over every expert. The weights are converted (bf16 copy, or fp8 quantization) here, once per
    variant, and the masked layout is built here (``masked_pool``), outside the timed ``fn``.

    Args:
        x_PDx: ``[P, Dx]`` CUDA pool rows (bf16), segments 128-aligned.
        gate_up_weight_e2FD: ``[e, 2F, D]`` CUDA.
        down_weight_eDF: ``[e, D, F]`` CUDA.
        row_start_e: ``[e]`` int, first pool row of each expert (multiples of 128).
        num_rows_e: ``[e]`` int, valid rows of each expert.
        activation: ``"silu"`` or ``"situ"``.
        fp8_options: which variants to build: False = bf16, True = fp8.
        layouts: ``"contiguous"`` (``DeepGemmExperts.forward`` on the pool) and/or ``"masked"``
            (``DeepGemmExperts.forward_masked`` on ``masked_pool``'s copy). A masked variant whose DeepGEMM function
            is missing is left out with a printed note.

    Returns:
        cases: for each layout asked for, in ``layouts`` order, then per fp8 option:
        ``deep_gemm_bf16``/``deep_gemm_fp8`` (``fn() -> y_PDx`` ``[P, Dx]`` in ``x_PDx``'s dtype, padding rows zero)
        and ``deep_gemm_masked_bf16``/``deep_gemm_masked_fp8`` (``fn() -> y_eMDx`` ``[e, M, Dx]``, rows
        ``>= num_rows_e[i]`` of expert i zero). Empty when ``deep_gemm_status()`` is not available.
    """
    if not deep_gemm_status().available:
        return []
    experts = {fp8: DeepGemmExperts(gate_up_weight_e2FD, down_weight_eDF, activation, fp8=fp8) for fp8 in fp8_options}
    cases = []
    if "contiguous" in layouts:
        layout = ExpertLayout(row_start_e, num_rows_e, x_PDx.shape[0], 128)
        cases += [(f"deep_gemm_{'fp8' if fp8 else 'bf16'}", functools.partial(experts[fp8].forward, x_PDx, layout))
                  for fp8 in fp8_options]
    if "masked" in layouts:
        deep_gemm = import_deep_gemm()
        usable = [fp8 for fp8 in fp8_options if hasattr(deep_gemm, _MASKED_API[fp8])]
        for fp8 in sorted(set(fp8_options) - set(usable)):
            print(f"deep_gemm {deep_gemm_status().version} has no {_MASKED_API[fp8]}: the deep_gemm_masked_"
                  f"{'fp8' if fp8 else 'bf16'} rows are left out", flush=True)
        pool = masked_pool(x_PDx, row_start_e, num_rows_e) if usable else None
        cases += [(f"deep_gemm_masked_{'fp8' if fp8 else 'bf16'}", functools.partial(
            experts[fp8].forward_masked, pool.x_eMDx, pool.masked_m_e, pool.expected_m)) for fp8 in usable]
    return cases
