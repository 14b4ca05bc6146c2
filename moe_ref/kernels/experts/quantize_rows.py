"""Rows to FP8 in one launch: what an FP8 experts backend does to activation-dtype rows it is handed (a pool dispatched
in bf16), where the torch twin takes about eight launches and fp32 temporaries.

    x_PDx [P, Dx] bf16/fp16/fp32 --per row, per 128 columns--> x_fp8_PDx [P, Dx] e4m3 + x_scale_PDb [P, Db] fp32

The recipe is ``kernels.fp8.quantize_fp8_per_128``'s (its torch twin, bit for bit on finite rows): scale = max(amax, 1e-4) / 448
with IEEE division, values ``x / scale`` rounded to nearest even; the pre-dispatch and gated-activation kernels
quantize with the same helper (``_triton_utils.quantize_e4m3``).

Shape legend: P receive-pool rows, Dx expert input width, Db = ceil(Dx / 128).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_ref.core.errors import DTypeError, ShapeError
from moe_ref.kernels.runtime._triton_utils import FP8_DTYPE, FP8_GROUP, cdiv, check_device, num_fp8_groups, quantize_e4m3
from moe_ref.kernels.experts.fp8 import quantize_fp8_per_128
from moe_ref.kernels.runtime.launch import launch

__all__ = ["quantize_rows_fp8", "quantize_rows_fp8_ref"]

# rows per program (one program: that many rows x one 128-column group), the gated activation's tile
BLOCK_P = 16

quantize_rows_fp8_ref = quantize_fp8_per_128  # the torch twin: same arguments, same bits


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


def quantize_rows_fp8(x_PDx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[P, Dx]`` rows -> (``[P, Dx]`` fp8 e4m3, ``[P, Db]`` fp32 scales), per row per 128 columns, in one launch.

    Args:
        x_PDx: ``[P, Dx]`` bf16/fp16/fp32, its last dimension contiguous; CUDA (or CPU under the interpreter).

    Returns:
        ``(x_fp8_PDx, x_scale_PDb)``, bit for bit ``quantize_rows_fp8_ref(x_PDx)`` where x_PDx is finite.

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
    x_scale_PDb = torch.empty(num_rows, num_fp8_groups(dim), dtype=torch.float32, device=x_PDx.device)
    if num_rows == 0 or dim == 0:
        return x_fp8_PDx, x_scale_PDb
    check_device("x_PDx", x_PDx)
    launch(_quantize_rows_kernel, (cdiv(num_rows, BLOCK_P), num_fp8_groups(dim)),
           x_PDx, x_fp8_PDx, x_scale_PDb, num_rows, dim, x_PDx.stride(0), x_fp8_PDx.stride(0), x_scale_PDb.stride(0),
           BLOCK_P=BLOCK_P, GROUP=FP8_GROUP, num_warps=4)
    return x_fp8_PDx, x_scale_PDb
