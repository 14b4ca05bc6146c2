"""DeepGEMM paths for the expert benchmarks (``scripts/bench_experts.py``, ``tests/gpu/test_deep_gemm.py``).

One job: turn a benchmark case into ``(name, fn)`` pairs that run ``moe_ref.deep_gemm_backend.DeepGemmExperts``;
none when ``moe_ref.deep_gemm_probe`` says DeepGEMM cannot run here.

Shape legend: P receive-pool rows, Dx expert input width, F expert intermediate, e local experts.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from moe_ref.deep_gemm_backend import DeepGemmExperts
from moe_ref.deep_gemm_probe import deep_gemm_status
from moe_ref.experts import ExpertLayout

__all__ = ["deep_gemm_grouped_cases"]


def deep_gemm_grouped_cases(x_PDx: torch.Tensor, gate_up_weight_e2FD: torch.Tensor, down_weight_eDF: torch.Tensor,
                            row_start_e: torch.Tensor, num_rows_e: torch.Tensor, *, activation: str = "silu",
                            fp8_options: tuple[bool, ...] = (False, True)) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    """DeepGEMM paths for a benchmark case as ``(name, fn)`` pairs; [] when deep_gemm is not usable here.

    For ``scripts/bench_experts.py``: each ``fn()`` runs ``DeepGemmExperts.forward`` (GEMM1, torch
    activation, GEMM2; fp8 also quantizes the activations) over the whole pool and returns ``y_PDx``.
    The weights are converted (bf16 copy, or fp8 quantization) here, once, outside the timed ``fn``.

    Args:
        x_PDx: ``[P, Dx]`` CUDA pool rows (bf16), segments 128-aligned.
        gate_up_weight_e2FD: ``[e, 2F, D]`` CUDA.
        down_weight_eDF: ``[e, D, F]`` CUDA.
        row_start_e: ``[e]`` int, first pool row of each expert (multiples of 128).
        num_rows_e: ``[e]`` int, valid rows of each expert.
        activation: ``"silu"`` or ``"situ"``.
        fp8_options: which variants to build: False = ``deep_gemm_bf16``, True = ``deep_gemm_fp8``.

    Returns:
        cases: ``[("deep_gemm_bf16", fn), ("deep_gemm_fp8", fn)]`` (those asked for), each ``fn() -> y_PDx``
        ``[P, Dx]`` in ``x_PDx``'s dtype, padding rows zero. Empty when ``deep_gemm_status()`` is not available.
    """
    if not deep_gemm_status().available:
        return []
    layout = ExpertLayout(row_start_e, num_rows_e, x_PDx.shape[0], 128)
    cases = []
    for fp8 in fp8_options:
        experts = DeepGemmExperts(gate_up_weight_e2FD, down_weight_eDF, activation, fp8=fp8)
        cases.append((f"deep_gemm_{'fp8' if fp8 else 'bf16'}", functools.partial(experts.forward, x_PDx, layout)))
    return cases
