"""Rows to FP8 in one launch: what an FP8 experts backend does to activation-dtype rows it is handed (a pool dispatched
in bf16), where the torch twin takes about eight launches and fp32 temporaries.

    x_PDx [P, Dx] bf16/fp16/fp32 --per row, per 128 columns--> x_fp8_PDx [P, Dx] e4m3 + x_scale_PDb [P, Db] fp32
                                 --per row (per_row=True)---> x_fp8_PDx [P, Dx] e4m3 + x_scale_P [P] fp32  (W4A8)

The recipe is ``kernels.fp8.quantize_fp8_per_128``'s (its torch twin, bit for bit on finite rows): scale = max(amax, 1e-4) / 448
with IEEE division, values ``x / scale`` rounded to nearest even; the pre-dispatch and gated-activation kernels
quantize with the same helper (``_triton_utils.quantize_e4m3``). Per row, the same recipe over the whole row
(``kernels.fp8.quantize_fp8_per_row``): a program reads its rows twice, for the amax, then to quantize.

Shape legend: P receive-pool rows, Dx expert input width, Db = ceil(Dx / 128).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_ref.core.errors import DTypeError, ShapeError
from moe_ref.kernels.runtime._triton_utils import (FP8_DTYPE, FP8_GROUP, cdiv, check_device, div_rn, fp8_scale,
                                                   num_fp8_groups, quantize_e4m3, to_e4m3)
from moe_ref.kernels.experts.fp8 import quantize_fp8_per_128, quantize_fp8_per_row
from moe_ref.kernels.runtime.launch import launch

__all__ = ["quantize_rows_fp8", "quantize_rows_fp8_ref"]

# rows per program (one program: that many rows x one 128-column group), the gated activation's tile
BLOCK_P = 16



def quantize_rows_fp8_ref(x_PDx: torch.Tensor, *, per_row: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch twin of ``quantize_rows_fp8``: same arguments, same bits."""
    return (quantize_fp8_per_row if per_row else quantize_fp8_per_128)(x_PDx)


@triton.jit
def _quantize_rows_kernel(x_ptr, x_fp8_ptr, x_scale_ptr, P, D, stride_x_r, stride_q_r, stride_s_r,
                          BLOCK_P: tl.constexpr, GROUP: tl.constexpr):
    """One program = BLOCK_P rows x one group of GROUP (128) columns; columns past D read as 0 (they do not raise
    the group's amax) and are not written.

    Example: D = 200, rows [[1.0] * 200]: group 0 (columns 0-127) and group 1 (128-199) both get scale
    1 / 448 = 0.002232, every value 448.0 in e4m3.
    """
    offs_r = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_c = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    rows = offs_r.to(tl.int64)
    mask = (offs_r < P)[:, None] & (offs_c < D)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x_r + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
    x_fp8, scale = quantize_e4m3(x)
    tl.store(x_fp8_ptr + rows[:, None] * stride_q_r + offs_c[None, :], x_fp8, mask=mask)
    tl.store(x_scale_ptr + rows * stride_s_r + tl.program_id(1), scale, mask=offs_r < P)


@triton.jit
def _quantize_whole_rows_kernel(x_ptr, x_fp8_ptr, x_scale_ptr, P, D, stride_x_r, stride_q_r,
                                BLOCK_P: tl.constexpr, GROUP: tl.constexpr):
    """One program = BLOCK_P whole rows, read GROUP columns at a time: first their amax, then their values over the
    row's one scale.

    Example: D = 200, rows [[1.0] * 100 + [2.0] * 100]: scale 2 / 448, values 224.0 then 448.0 in e4m3.
    """
    offs_r = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    rows = offs_r.to(tl.int64)
    amax = tl.zeros([BLOCK_P], dtype=tl.float32)
    for col in range(0, D, GROUP):
        offs_c = col + tl.arange(0, GROUP)
        mask = (offs_r < P)[:, None] & (offs_c < D)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x_r + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    scale = fp8_scale(amax)
    for col in range(0, D, GROUP):
        offs_c = col + tl.arange(0, GROUP)
        mask = (offs_r < P)[:, None] & (offs_c < D)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x_r + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(x_fp8_ptr + rows[:, None] * stride_q_r + offs_c[None, :], to_e4m3(div_rn(x, scale[:, None])),
                 mask=mask)
    tl.store(x_scale_ptr + rows, scale, mask=offs_r < P)


def quantize_rows_fp8(x_PDx: torch.Tensor, *, per_row: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``[P, Dx]`` rows -> (``[P, Dx]`` fp8 e4m3, ``[P, Db]`` fp32 scales), per row per 128 columns, in one launch.

    Args:
        x_PDx: ``[P, Dx]`` bf16/fp16/fp32, its last dimension contiguous; CUDA (or CPU under the interpreter).
        per_row: one scale per row instead (the scales are then ``[P]``; the W4A8 experts' rows).

    Returns:
        ``(x_fp8_PDx, x_scale_PDb)`` (``x_scale_P`` per row), bit for bit ``quantize_rows_fp8_ref(x_PDx,
        per_row=per_row)`` where x_PDx is finite.

    Raises:
        ShapeError: x_PDx is not 2-D with a contiguous last dimension.
        DTypeError: x_PDx is not bf16/fp16/fp32.
    """
    if x_PDx.dim() != 2 or (x_PDx.shape[1] > 1 and x_PDx.stride(1) != 1):
        raise ShapeError(f"x_PDx must be [P, Dx] with a contiguous last dimension, got shape {tuple(x_PDx.shape)} "
                         f"strides {x_PDx.stride()}: pass x.reshape(-1, x.shape[-1]).contiguous()")
    if x_PDx.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise DTypeError(f"x_PDx must be bf16/fp16/fp32 to quantize to fp8, got {x_PDx.dtype}: cast it first "
                         f"(x.to(torch.bfloat16))")
    num_rows, dim = x_PDx.shape
    x_fp8_PDx = torch.empty(num_rows, dim, dtype=FP8_DTYPE, device=x_PDx.device)
    if per_row:
        if num_rows == 0 or dim == 0:
            return quantize_rows_fp8_ref(x_PDx, per_row=True)
        check_device("x_PDx", x_PDx)
        x_scale_P = torch.empty(num_rows, dtype=torch.float32, device=x_PDx.device)
        launch(_quantize_whole_rows_kernel, (cdiv(num_rows, BLOCK_P),), x_PDx, x_fp8_PDx, x_scale_P, num_rows, dim,
               x_PDx.stride(0), x_fp8_PDx.stride(0), BLOCK_P=BLOCK_P, GROUP=FP8_GROUP, num_warps=4)
        return x_fp8_PDx, x_scale_P
    x_scale_PDb = torch.empty(num_rows, num_fp8_groups(dim), dtype=torch.float32, device=x_PDx.device)
    if num_rows == 0 or dim == 0:
        return x_fp8_PDx, x_scale_PDb
    check_device("x_PDx", x_PDx)
    launch(_quantize_rows_kernel, (cdiv(num_rows, BLOCK_P), num_fp8_groups(dim)),
           x_PDx, x_fp8_PDx, x_scale_PDb, num_rows, dim, x_PDx.stride(0), x_fp8_PDx.stride(0), x_scale_PDb.stride(0),
           BLOCK_P=BLOCK_P, GROUP=FP8_GROUP, num_warps=4)
    return x_fp8_PDx, x_scale_PDb
