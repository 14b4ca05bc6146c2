"""The gated activation between two grouped GEMMs, over the valid rows of a receive pool only, optionally
quantized to FP8: the glue of an experts backend whose GEMMs do not fuse it (the deep_gemm experts).

    gate_up_P2F [P, 2F] (F gate columns, then F up columns; or `interleaved`: alternating 128-column gate and up
                         blocks, GEMM1's output over interleaved gate_up weights) --act(gate, up) in fp32-->
        h_PF [P, F] in out_dtype                                                        (quant=False)
        h_PF [P, F] fp8 e4m3 + h_scale_PFb [P, Fb] fp32, per row per 128 columns       (quant=True)

A row is valid when the pool holds a received row there:
    masked pool (masked_rows = M > 0): row p is valid iff p % M < num_rows_e[p // M]
    contiguous pool:                   row p is valid iff group_P[p] >= 0 (DeepGEMM's grouped layout)
Other rows are neither read nor written (the next grouped GEMM skips them, combine never reads them): a masked
pool at decode is mostly such rows, and torch's elementwise ops would cost more than the GEMMs over them.

Activations (``moe_ref.core.activations.gated_activation``): silu(g) * u; situ: b * tanh(g / b) * sigmoid(g) times
lb * tanh(u / lb) (u when lb = 0). FP8 scales follow ``kernels.fp8.quantize_fp8_per_128``:
max(amax, 1e-4) / 448 with IEEE division, values rounded to nearest even.

Shape legend: P receive-pool rows, F expert intermediate, Fb = ceil(F / 128), e local experts, M rows reserved per
expert (masked pool).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_ref.core.activations import gated_activation
from moe_ref.core.errors import ShapeError
from moe_ref.kernels.runtime._triton_utils import (ACTIVATION_CODES, FP8_DTYPE, cdiv, check_device, gated_act, num_fp8_groups,
                                           quantize_e4m3)
from moe_ref.kernels.runtime.launch import launch

__all__ = ["gated_activation_rows", "gated_activation_rows_ref", "valid_rows_P"]

_ACTIVATIONS = {name: code for name, code in ACTIVATION_CODES.items() if code}  # gated ones only
# (rows per program, num_warps): one program computes that many rows x one 128-column group
DEFAULT_TILE = (16, 4)


@triton.jit
def _gated_act_kernel(
    gate_up_ptr, group_ptr, num_rows_ptr, h_ptr, h_scale_ptr,
    P, F, masked_rows, situ_beta, situ_linear_beta,
    stride_gu_r, stride_h_r, stride_s_r,
    ACTIVATION: tl.constexpr,      # 1 silu, 2 situ
    SITU_LINEAR: tl.constexpr,     # situ: squash up too (situ_linear_beta != 0)
    MASKED: tl.constexpr,          # validity from masked_rows / num_rows_ptr, else from group_ptr
    QUANT: tl.constexpr,           # fp8 e4m3 + per-128 scales, else h in h_ptr's dtype
    INTERLEAVED: tl.constexpr,     # gate_up's columns alternate 128-wide gate and up blocks (F % 128 == 0)
    BLOCK_P: tl.constexpr,
):
    """One program = BLOCK_P rows x one group of 128 columns; a block without a valid row returns at once.

    Example (masked, M=4, num_rows [1, 3], silu): rows 0, 4, 5, 6 are computed, rows 1-3 and 7 untouched.
    """
    offs_r = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    f0 = tl.program_id(1) * 128
    in_pool = offs_r < P
    if MASKED:
        expert = offs_r // masked_rows
        count = tl.load(num_rows_ptr + expert, mask=in_pool, other=0)
        valid = in_pool & (offs_r - expert * masked_rows < count)
    else:
        valid = in_pool & (tl.load(group_ptr + offs_r, mask=in_pool, other=-1) >= 0)
    if tl.sum(valid.to(tl.int32), axis=0) > 0:
        rows = offs_r.to(tl.int64)
        offs_f = f0 + tl.arange(0, 128)
        mask = valid[:, None] & (offs_f < F)[None, :]
        gate_col0, up_col0 = (f0, F + f0)
        if INTERLEAVED:
            gate_col0, up_col0 = (2 * f0, 2 * f0 + 128)
        offs_c = tl.arange(0, 128)
        gate = tl.load(gate_up_ptr + rows[:, None] * stride_gu_r + gate_col0 + offs_c[None, :], mask=mask, other=0.0)
        up = tl.load(gate_up_ptr + rows[:, None] * stride_gu_r + up_col0 + offs_c[None, :], mask=mask, other=0.0)
        # masked-off elements load as 0 and every activation maps (0, 0) to 0: the amax sees the valid ones only
        h = gated_act(gate.to(tl.float32), up.to(tl.float32), situ_beta, situ_linear_beta, ACTIVATION, SITU_LINEAR)
        if QUANT:
            h_fp8, scale = quantize_e4m3(h)
            tl.store(h_ptr + rows[:, None] * stride_h_r + offs_f[None, :], h_fp8, mask=mask)
            tl.store(h_scale_ptr + rows * stride_s_r + f0 // 128, scale, mask=valid)
        else:
            tl.store(h_ptr + rows[:, None] * stride_h_r + offs_f[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


def _check_args(gate_up_P2F, group_P, num_rows_e, masked_rows, activation, interleaved) -> None:
    if gate_up_P2F.dim() != 2 or gate_up_P2F.shape[1] % (256 if interleaved else 2):
        raise ShapeError(f"gate_up_P2F must be [P, 2F]{' with F % 128 == 0 (interleaved)' if interleaved else ''}, "
                         f"got {tuple(gate_up_P2F.shape)}"
                         f"{': pass interleaved=False for stacked gate and up columns' if interleaved else ''}")
    if activation not in _ACTIVATIONS:
        raise ShapeError(f"activation={activation!r}; supported: {', '.join(_ACTIVATIONS)}")
    if masked_rows:
        if num_rows_e is None or gate_up_P2F.shape[0] != num_rows_e.numel() * masked_rows:
            raise ShapeError(f"a masked pool of M={masked_rows} rows per expert needs num_rows_e [e] and "
                             f"e * M rows, got {tuple(gate_up_P2F.shape)} and "
                             f"{None if num_rows_e is None else tuple(num_rows_e.shape)}")
    elif group_P is None or group_P.shape != (gate_up_P2F.shape[0],):
        raise ShapeError(f"a contiguous pool needs group_P [{gate_up_P2F.shape[0]}], got "
                         f"{None if group_P is None else tuple(group_P.shape)}")


def _outputs(gate_up_P2F: torch.Tensor, quant: bool, out_dtype: torch.dtype):
    num_rows, width = gate_up_P2F.shape[0], gate_up_P2F.shape[1] // 2
    h_PF = torch.empty(num_rows, width, dtype=FP8_DTYPE if quant else out_dtype, device=gate_up_P2F.device)
    h_scale_PFb = (torch.empty(num_rows, num_fp8_groups(width), dtype=torch.float32, device=gate_up_P2F.device)
                   if quant else None)
    return h_PF, h_scale_PFb


def gated_activation_rows(gate_up_P2F: torch.Tensor, *, group_P: torch.Tensor | None = None,
                          num_rows_e: torch.Tensor | None = None, masked_rows: int = 0, activation: str = "silu",
                          situ_beta: float = 4.0, situ_linear_beta: float = 25.0, quant: bool = False,
                          out_dtype: torch.dtype = torch.bfloat16, interleaved: bool = False,
                          tile: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated activation of the valid rows of a pool (module doc); one launch, no host sync.

    Args:
        gate_up_P2F: ``[P, 2F]`` bf16/fp16/fp32, last dim contiguous: GEMM1's output, gate columns then up columns.
        group_P: ``[P]`` int32/int64, the expert of each row, -1 = no row (contiguous pool).
        num_rows_e, masked_rows: ``[e]`` int rows per expert and M > 0 (masked pool; P = e * M).
        activation, situ_beta, situ_linear_beta: as ``moe_ref.core.activations.gated_activation``.
        quant: return fp8 e4m3 + per-128 scales (the next GEMM's FP8 input), else ``out_dtype`` rows.
        interleaved: gate_up_P2F's columns alternate 128-column gate and up blocks (F % 128 == 0).
        tile: ``(rows per program, num_warps)``, for ``scripts/tune_gated_act.py``; None: ``DEFAULT_TILE``.

    Returns:
        ``(h_PF, h_scale_PFb)``: ``[P, F]`` (fp8 or ``out_dtype``) and ``[P, Fb]`` fp32 (None without ``quant``);
        rows that are not valid hold whatever the allocator gave.
    """
    _check_args(gate_up_P2F, group_P, num_rows_e, masked_rows, activation, interleaved)
    check_device("gate_up_P2F", gate_up_P2F)
    if gate_up_P2F.stride(-1) != 1:
        raise ShapeError(f"gate_up_P2F must have a contiguous last dimension, got strides {gate_up_P2F.stride()}")
    h_PF, h_scale_PFb = _outputs(gate_up_P2F, quant, out_dtype)
    num_rows, width = h_PF.shape
    if num_rows == 0:
        return h_PF, h_scale_PFb
    index = num_rows_e if masked_rows else group_P
    block_p, num_warps = tile or DEFAULT_TILE
    launch(_gated_act_kernel, (cdiv(num_rows, block_p), num_fp8_groups(width)),
        gate_up_P2F, index, index, h_PF, h_scale_PFb if quant else h_PF,
        num_rows, width, max(masked_rows, 1), float(situ_beta), float(situ_linear_beta or 1.0),
        gate_up_P2F.stride(0), h_PF.stride(0), h_scale_PFb.stride(0) if quant else 0,
        ACTIVATION=_ACTIVATIONS[activation], SITU_LINEAR=bool(situ_linear_beta), MASKED=bool(masked_rows),
        QUANT=quant, INTERLEAVED=interleaved, BLOCK_P=block_p, num_warps=num_warps,
    )
    return h_PF, h_scale_PFb


def valid_rows_P(num_rows: int, *, group_P: torch.Tensor | None = None, num_rows_e: torch.Tensor | None = None,
                 masked_rows: int = 0) -> torch.Tensor:
    """``[P]`` bool: the rows ``gated_activation_rows`` computes (module doc)."""
    if masked_rows:
        rows_P = torch.arange(num_rows, device=num_rows_e.device)
        return rows_P % masked_rows < num_rows_e.repeat_interleave(masked_rows)
    return group_P >= 0


def gated_activation_rows_ref(gate_up_P2F: torch.Tensor, *, group_P: torch.Tensor | None = None,
                              num_rows_e: torch.Tensor | None = None, masked_rows: int = 0, activation: str = "silu",
                              situ_beta: float = 4.0, situ_linear_beta: float = 25.0, quant: bool = False,
                              out_dtype: torch.dtype = torch.bfloat16,
                              interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Torch twin of ``gated_activation_rows`` (same arguments; invalid rows come out as zeros here)."""
    from moe_ref.kernels.experts.fp8 import quantize_fp8_per_128

    _check_args(gate_up_P2F, group_P, num_rows_e, masked_rows, activation, interleaved)
    valid_P = valid_rows_P(gate_up_P2F.shape[0], group_P=group_P, num_rows_e=num_rows_e, masked_rows=masked_rows)
    if interleaved:  # [P, Fb, gate|up, 128] -> gate [P, F], up [P, F]
        blocks = gate_up_P2F.reshape(gate_up_P2F.shape[0], -1, 2, 128)
        gate, up = blocks[:, :, 0].flatten(1), blocks[:, :, 1].flatten(1)
    else:
        gate, up = gate_up_P2F.chunk(2, dim=-1)
    h_PF = torch.where(valid_P[:, None], gated_activation(gate, up, activation, situ_beta, situ_linear_beta), 0.0)
    if quant:
        return quantize_fp8_per_128(h_PF)
    return h_PF.to(out_dtype), None
