"""Which local expert each receive-pool row belongs to, and zeroing the rows that belong to none: one launch each,
no host sync.

    pool_row_experts(row_start_e, num_rows_e, P) -> row_expert_P [P] int32: expert i on rows
        row_start_e[i] .. row_start_e[i] + num_rows_e[i] - 1, -1 on every other row (alignment padding, the pool's
        unused tail); DeepGEMM's contiguous "grouped layout"
    zero_rows_outside_segments(y_PD, row_expert_P) -> y_PD, its rows with row_expert_P < 0 zeroed in place

Why kernels: the torch twins take a dozen small ops (searchsorted, gathers, compares, a where over the whole
output) for what a layer's expert backends (DeepGEMM's, grouped_mm's) need on every call; on a slow host their
launches, and at prefill the where's full pass over ``[P, D]``, cost more than the work. The zeroing kernel writes
only the rows outside segments. ``*_ref`` are the torch twins (the CPU path, ``moe_ref.kernels.runtime.ops``).

Example: starts [0, 128, 128], counts [3, 0, 5], P = 256 -> rows 0-2 -> 0, rows 3-127 -> -1, rows 128-132 -> 2,
rows 133-255 -> -1 (an empty expert owns no row, even where its start is another expert's).

Shape legend: P receive-pool rows, D row width, e local experts.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_ref.core.errors import ShapeError
from moe_ref.kernels.runtime._triton_utils import cdiv, check_device, next_power_of_2
from moe_ref.kernels.runtime.launch import launch

__all__ = ["pool_row_experts", "pool_row_experts_ref", "zero_rows_outside_segments", "zero_rows_outside_segments_ref"]

BLOCK_P = 64
ZERO_BLOCK_D = 256


@triton.jit
def _pool_row_experts_kernel(row_start_ptr, num_rows_ptr, out_ptr, num_pool_rows, num_experts,
                             BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    """One program = BLOCK_P rows against every expert's segment (segments do not overlap: at most one holds a row)."""
    rows = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    experts = tl.arange(0, BLOCK_E)
    live_e = experts < num_experts
    start = tl.load(row_start_ptr + experts, mask=live_e, other=0).to(tl.int64)
    end = start + tl.load(num_rows_ptr + experts, mask=live_e, other=0).to(tl.int64)
    rows_64 = rows.to(tl.int64)
    inside = (rows_64[:, None] >= start[None, :]) & (rows_64[:, None] < end[None, :]) & live_e[None, :]
    expert = tl.max(tl.where(inside, experts[None, :], -1), axis=1)
    tl.store(out_ptr + rows, expert.to(tl.int32), mask=rows < num_pool_rows)


@triton.jit
def _zero_rows_kernel(y_ptr, row_expert_ptr, num_pool_rows, width, stride_y,
                      BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program = BLOCK_P rows x BLOCK_D columns; a block whose rows all lie in segments returns at once."""
    rows = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    in_pool = rows < num_pool_rows
    outside = in_pool & (tl.load(row_expert_ptr + rows, mask=in_pool, other=0) < 0)
    if tl.sum(outside.to(tl.int32), axis=0) > 0:
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        zeros = tl.zeros([BLOCK_P, BLOCK_D], dtype=y_ptr.dtype.element_ty)
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_y + cols[None, :], zeros,
                 mask=outside[:, None] & (cols < width)[None, :])


def pool_row_experts(row_start_e: torch.Tensor, num_rows_e: torch.Tensor, num_pool_rows: int) -> torch.Tensor:
    """``[P]`` int32 on the layout's device: the local expert of each pool row, -1 outside every segment. No host sync.

    Args:
        row_start_e: ``[e]`` int, the first pool row of each expert's segment (any order).
        num_rows_e: ``[e]`` int, the rows of each segment (segments do not overlap).
        num_pool_rows: P (rows past the last segment come out -1).
    """
    check_device("row_start_e", row_start_e)
    row_expert_P = torch.empty(num_pool_rows, dtype=torch.int32, device=row_start_e.device)
    if num_pool_rows == 0:
        return row_expert_P
    num_experts = row_start_e.numel()
    launch(_pool_row_experts_kernel, (cdiv(num_pool_rows, BLOCK_P),), row_start_e, num_rows_e, row_expert_P,
           num_pool_rows, num_experts, BLOCK_P=BLOCK_P, BLOCK_E=max(16, next_power_of_2(num_experts)))
    return row_expert_P


def pool_row_experts_ref(row_start_e: torch.Tensor, num_rows_e: torch.Tensor, num_pool_rows: int) -> torch.Tensor:
    """Torch twin of ``pool_row_experts`` (same arguments and result)."""
    device = row_start_e.device
    if row_start_e.numel() == 0:
        return torch.full((num_pool_rows,), -1, dtype=torch.int32, device=device)
    start_e = row_start_e.to(torch.int64)
    count_e = num_rows_e.to(device=device, dtype=torch.int64)
    # segments by start, an empty one before a non-empty one of the same start: the last segment starting at or
    # before a row is then the only one that can hold it
    order_e = torch.argsort(start_e * 2 + (count_e > 0), stable=True)
    start_s, end_s = start_e[order_e], (start_e + count_e)[order_e]
    rows_P = torch.arange(num_pool_rows, device=device)
    seg_P = (torch.searchsorted(start_s, rows_P, right=True) - 1).clamp(min=0)
    inside_P = (rows_P >= start_s[seg_P]) & (rows_P < end_s[seg_P])
    return torch.where(inside_P, order_e[seg_P], -1).to(torch.int32)


def zero_rows_outside_segments(y_PD: torch.Tensor, row_expert_P: torch.Tensor) -> torch.Tensor:
    """Zero, in place, the rows of ``y_PD`` ``[P, D]`` (unit stride along D) whose ``row_expert_P`` ``[P]`` is < 0;
    returns ``y_PD``. No host sync; only those rows are written."""
    check_device("y_PD", y_PD)
    num_pool_rows, width = y_PD.shape
    if y_PD.stride(-1) != 1:
        raise ShapeError(f"y_PD must have a unit stride along D, got strides {y_PD.stride()}")
    if num_pool_rows and width:
        launch(_zero_rows_kernel, (cdiv(num_pool_rows, BLOCK_P), cdiv(width, ZERO_BLOCK_D)), y_PD, row_expert_P,
               num_pool_rows, width, y_PD.stride(0), BLOCK_P=BLOCK_P, BLOCK_D=ZERO_BLOCK_D)
    return y_PD


def zero_rows_outside_segments_ref(y_PD: torch.Tensor, row_expert_P: torch.Tensor) -> torch.Tensor:
    """Torch twin of ``zero_rows_outside_segments``."""
    return y_PD.masked_fill_((row_expert_P < 0)[:, None], 0)
