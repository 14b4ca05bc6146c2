"""DeepGEMM paths for the expert benchmarks (``scripts/bench_experts.py``, ``tests/gpu/test_deep_gemm.py``).

One job: turn a benchmark case into ``(name, fn)`` pairs that run ``moe_ref.experts.deep_gemm.backend.DeepGemmExperts``;
none when ``moe_ref.experts.deep_gemm.probe`` says DeepGEMM cannot run here.

    pool x_PDx (expert-major, 128-aligned segments)
      contiguous: DeepGemmExperts.forward(x_PDx, layout)                          -> y_PDx
      masked:     masked_pool(...) once, outside fn: the segments copied into [e, M, Dx] + masked_m_e (device)
                  DeepGemmExperts.forward_masked(x_eMDx, masked_m_e, expected_m)  -> y_eMDx
    deep_gemm_grouped_cases: the whole expert MLP (GEMM1, activation (+ per-128 FP8 quantization of h), GEMM2)
    deep_gemm_kernel_cases:  the two grouped GEMMs alone, as DeepGEMM's tests call them: every operand (FP8 x and h
                             with their scales laid out once by DeepGEMM's own layout helper) built outside fn

Shape legend: P receive-pool rows, Dx expert input width, F expert intermediate, e local experts, M rows reserved
per expert in DeepGEMM's masked layout.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import torch

from moe_ref.experts.deep_gemm.backend import DeepGemmExperts, grouped_layout
from moe_ref.experts.deep_gemm.probe import call_deep_gemm, deep_gemm_status, import_deep_gemm
from moe_ref.experts import ExpertLayout
from moe_ref.kernels.runtime._triton_utils import FP8_DTYPE

__all__ = ["deep_gemm_grouped_cases", "deep_gemm_kernel_cases", "MaskedPool", "masked_pool"]

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
    raw_PDx = x_PDx.view(torch.uint8) if x_PDx.dtype == FP8_DTYPE else x_PDx  # fp8 has no index_put: move bytes
    x_eMDx = raw_PDx.new_zeros(num_experts, max_rows, x_PDx.shape[1])
    x_eMDx[valid_eM] = raw_PDx[rows_eM[valid_eM]]
    x_eMDx = x_eMDx.view(x_PDx.dtype)
    # vLLM's BatchedDeepGemmExperts.estimate_expected_m: rows per expert rounded up to 16, in [16, M]
    expected_m = min(max_rows, max(16, -(-(num_routed // max(num_experts, 1)) // 16) * 16))
    return MaskedPool(x_eMDx, counts_e.to(torch.int32), expected_m)


def deep_gemm_grouped_cases(x_PDx: torch.Tensor, gate_up_weight_e2FD: torch.Tensor, down_weight_eDF: torch.Tensor,
                            row_start_e: torch.Tensor, num_rows_e: torch.Tensor, *, activation: str = "silu",
                            fp8_options: tuple[bool, ...] = (False, True),
                            layouts: tuple[str, ...] = ("contiguous",),
                            x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
                            ) -> list[tuple[str, Callable[[], torch.Tensor]]]:
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
        x_fp8: ``(x_fp8_PDx, x_scale_PDb)``, the FP8 pool as dispatched (e4m3 rows + fp32 per-128 scales): the fp8
            variants take it, so they time GEMM1, the activation with h's quantization, and GEMM2; None: they
            quantize ``x_PDx`` per call too.

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
    inputs = {False: (x_PDx, None), True: x_fp8 if x_fp8 is not None else (x_PDx, None)}
    if "contiguous" in layouts:
        layout = ExpertLayout(row_start_e, num_rows_e, x_PDx.shape[0], 128)
        cases += [(f"deep_gemm_{'fp8' if fp8 else 'bf16'}", functools.partial(experts[fp8].forward, inputs[fp8][0],
                                                                               layout, inputs[fp8][1]))
                  for fp8 in fp8_options]
    if "masked" in layouts:
        deep_gemm = import_deep_gemm()
        usable = [fp8 for fp8 in fp8_options if hasattr(deep_gemm, _MASKED_API[fp8])]
        for fp8 in sorted(set(fp8_options) - set(usable)):
            print(f"deep_gemm {deep_gemm_status().version} has no {_MASKED_API[fp8]}: the deep_gemm_masked_"
                  f"{'fp8' if fp8 else 'bf16'} rows are left out", flush=True)
        for fp8 in usable:
            x, scale = inputs[fp8]
            pool = masked_pool(x, row_start_e, num_rows_e)
            scale_eMDb = None if scale is None else masked_pool(scale, row_start_e, num_rows_e).x_eMDx
            cases.append((f"deep_gemm_masked_{'fp8' if fp8 else 'bf16'}", functools.partial(
                experts[fp8].forward_masked, pool.x_eMDx, pool.masked_m_e, pool.expected_m, scale_eMDb)))
    return cases


def _laid_out(deep_gemm, operand):
    """An FP8 operand ``(x, sf)`` with its fp32 scales in the layout the SM90 kernel reads (MN-major, TMA-aligned:
    ``deep_gemm.get_mn_major_tma_aligned_tensor``, which DeepGEMM otherwise applies per call); bf16 as it is."""
    if not isinstance(operand, tuple):
        return operand
    layout_fn = getattr(deep_gemm, "get_mn_major_tma_aligned_tensor", None)
    return operand if layout_fn is None else (operand[0], layout_fn(operand[1]))


def deep_gemm_kernel_cases(x_PDx: torch.Tensor, gate_up_weight_e2FD: torch.Tensor, down_weight_eDF: torch.Tensor,
                           row_start_e: torch.Tensor, num_rows_e: torch.Tensor, *, activation: str = "silu",
                           fp8_options: tuple[bool, ...] = (False, True), layouts: tuple[str, ...] = ("contiguous",),
                           x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
                           ) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    """DeepGEMM's two grouped GEMMs alone, as its own tests call them, as ``(name, fn)`` pairs; [] when deep_gemm is
    not usable here.

    Built once here, outside ``fn``: the weights (``DeepGemmExperts``: bf16, or fp8 with 128x128 block scales), the
    GEMM1 input (bf16 rows, or the FP8 pool ``x_fp8`` (quantized here with DeepGEMM's ``per_token_cast_to_fp8`` when
    None), its scales laid out once, ``_laid_out``), the grouped layout (contiguous) or the masked copy, GEMM1's
    output, and h (the activation, fp8 with per-128 scales laid out once), computed once from GEMM1's output. Timed
    in ``fn``: GEMM1 then GEMM2, into preallocated outputs; ``fn() -> y`` (contiguous: ``[P, Dx]`` bf16, rows
    outside every segment unwritten; masked: ``[e, M, Dx]``, rows past an expert's count unwritten).

    Names: ``deep_gemm_kernels_{bf16,fp8}`` (contiguous), ``deep_gemm_masked_kernels_{bf16,fp8}`` (masked, left
    out with a printed note when the masked function is missing). Arguments as ``deep_gemm_grouped_cases``.
    """
    if not deep_gemm_status().available:
        return []
    deep_gemm = import_deep_gemm()
    cases = []
    for fp8 in fp8_options:
        experts = DeepGemmExperts(gate_up_weight_e2FD, down_weight_eDF, activation, fp8=fp8)
        rows = (x_fp8 if x_fp8 is not None else None) if fp8 else (x_PDx, None)
        if fp8 and rows is None:
            from deep_gemm.utils import per_token_cast_to_fp8

            rows = per_token_cast_to_fp8(x_PDx, use_ue8m0=False)
        kind = "fp8" if fp8 else "bf16"
        if "contiguous" in layouts:
            layout = ExpertLayout(row_start_e, num_rows_e, x_PDx.shape[0], 128)
            num_padded = -(-x_PDx.shape[0] // experts.mk_alignment) * experts.mk_alignment
            a_PD = experts._gemm_input(*rows)
            a_PD = tuple(_pad(part, num_padded) for part in a_PD) if fp8 else _pad(a_PD, num_padded)
            group_P = grouped_layout(layout, num_padded, x_PDx.device)
            gate_up_P2F = experts._grouped_gemm(a_PD, experts._gate_up_weight, group_P)
            h_PF = _laid_out(deep_gemm, experts._activation(gate_up_P2F, group_P=group_P))
            a_PD = _laid_out(deep_gemm, a_PD)
            y_PD = torch.empty(num_padded, x_PDx.shape[1], dtype=torch.bfloat16, device=x_PDx.device)
            cases.append((f"deep_gemm_kernels_{kind}", functools.partial(
                _two_gemms, deep_gemm, fp8, "contiguous", (a_PD, experts._gate_up_weight, gate_up_P2F, group_P),
                (h_PF, experts._down_weight, y_PD, group_P), x_PDx.shape[0])))
        if "masked" in layouts:
            if not hasattr(deep_gemm, _MASKED_API[fp8]):
                print(f"deep_gemm {deep_gemm_status().version} has no {_MASKED_API[fp8]}: the deep_gemm_masked_"
                      f"kernels_{kind} row is left out", flush=True)
                continue
            pool = masked_pool(rows[0], row_start_e, num_rows_e)
            scale = None if rows[1] is None else masked_pool(rows[1], row_start_e, num_rows_e).x_eMDx
            masked_m = pool.masked_m_e.contiguous()
            a_eMD = experts._gemm_input(pool.x_eMDx, scale)
            gate_up_eM2F = experts._masked_gemm(a_eMD, experts._gate_up_weight, masked_m, pool.expected_m)
            num_experts, max_rows = pool.x_eMDx.shape[:2]
            h_PF = experts._activation(gate_up_eM2F.view(num_experts * max_rows, -1), num_rows_e=masked_m,
                                       masked_rows=max_rows)
            h_eMF = tuple(part.view(num_experts, max_rows, -1) for part in h_PF) if fp8 else \
                h_PF.view(num_experts, max_rows, -1)
            h_eMF, a_eMD = _laid_out(deep_gemm, h_eMF), _laid_out(deep_gemm, a_eMD)
            y_eMD = torch.empty(num_experts, max_rows, x_PDx.shape[1], dtype=torch.bfloat16, device=x_PDx.device)
            cases.append((f"deep_gemm_masked_kernels_{kind}", functools.partial(
                _two_gemms, deep_gemm, fp8, "masked", (a_eMD, experts._gate_up_weight, gate_up_eM2F, masked_m),
                (h_eMF, experts._down_weight, y_eMD, masked_m), None, pool.expected_m)))
    return cases


def _pad(rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``rows`` with zero rows appended up to ``num_rows`` (bytes for fp8)."""
    if rows.shape[0] == num_rows:
        return rows.contiguous()
    raw = rows.view(torch.uint8) if rows.dtype == FP8_DTYPE else rows
    return torch.nn.functional.pad(raw, (0, 0, 0, num_rows - rows.shape[0])).view(rows.dtype)


def _two_gemms(deep_gemm, fp8: bool, layout: str, first: tuple, second: tuple, num_rows: int | None,
               expected_m: int | None = None) -> torch.Tensor:
    """GEMM1 then GEMM2 of ``deep_gemm_kernel_cases`` (each ``(a, b, d, grouped layout or masked_m)``), as DeepGEMM's
    tests call them (SM90 fp32 scales: ``disable_ue8m0_cast=True``); returns GEMM2's output."""
    if layout == "contiguous":
        name = "m_grouped_fp8_gemm_nt_contiguous" if fp8 else "m_grouped_bf16_gemm_nt_contiguous"
    else:
        name = _MASKED_API[fp8]
    extra = () if layout == "contiguous" else (expected_m,)
    options = dict(disable_ue8m0_cast=True) if fp8 else {}
    for a, b, d, groups in (first, second):
        call_deep_gemm(deep_gemm, name, a, b, d, groups, *extra, **options)
    out = second[2]
    return out if num_rows is None else out[:num_rows]
