"""Batch-invariant GEMMs: a row's order of additions does not depend on how many rows the call has, or where the
row sits among them (the batch-invariant mode's GEMMs: ``moe_ref.ep.batch_invariant``, docs/batch_invariance.md).

    fixed_tile_matmul(x_TI, w_OI, out_dtype)      -> [T, O]   Triton, a tile of one bits class per T, no split-K (CUDA)
    fixed_tile_matmul_ref(x_TI, w_OI, out_dtype)  -> [T, O]   the torch twin: BLAS on blocks of FIXED_ROW_BLOCK rows
    in_row_blocks(fn, x_TI)                       -> fn's rows, fn called on zero-padded [FIXED_ROW_BLOCK, I] copies
    same_bits_tile(tile, precision)               -> may the grouped MLP launch this tile in the mode (its bits class)
    forced_grouped_tiles(precision, device)       -> the grouped MLP's (GEMM1, GEMM2) pair where the class is that pair

Why: a GEMM library picks its kernel by the problem's shape (MKL takes another code path for 1-3 rows; cuBLAS and
the grouped MLP's autotuner pick tiles and split-K by the row count), and another kernel adds a row's products in
another order.
How, on CUDA: a program owns a BLOCK_M x BLOCK_N output tile and the whole K loop (no split-K), so a row's sum is a
chain of MMA steps along K whatever tile holds it. Where the MMA instructions' chain is the same for several tiles,
those tiles give a row the same bits, and the mode may pick among them by the row count (fast at every T) without
breaking the contract. Probed on one H100 (sm_90; 2026-12-07, ``scripts/probe_tile_bits.py``, docs/RESULTS.md): one
set of bits over every tile tried (bf16 and fp32 matmul: BLOCK_M and BLOCK_N 16-128, BLOCK_K 16-128, 4 or 8 warps,
3 or 5 stages; the bf16 grouped MLP: every tile of its lists, each schedule, TMA or pointer loads). The FP8 grouped
MLP scales each k-step's partial product before adding it, so its BLOCK_K is part of the order: its class is
BLOCK_K 128 (one scale group per step), any BLOCK_N. (BLOCK_N 256 gave other bits while it scaled a partial product
by each scale in turn; since every tile multiplies by the product of the two scales in one FMA, as DeepGEMM does, each
BLOCK_K 128 tile gives DeepGEMM's bits in every row: a later probe the same day.) On a GPU not probed
(``SAME_BITS_CAPABILITIES``) and under the interpreter every GEMM keeps one tile per precision. The GPU suite checks
the class on the GPU it runs on (tests/gpu/test_batch_invariant_cuda.py).
How, on the CPU: every call the BLAS sees has the same shape: the rows are copied into zero-padded blocks of
FIXED_ROW_BLOCK rows. The assumption, checked on the machine by tests/unit/test_batch_invariant.py: a BLAS call of
one fixed shape gives a row the same bits wherever it sits in the block and whatever the other rows hold.

The twin is not bitwise equal to the kernel (another order of additions); each is invariant on its own.

Shape legend: T rows (tokens, or pool rows), I input features (the reduced width), O output features.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
import triton
import triton.language as tl

from moe_ref.core.errors import DTypeError, ShapeError
from moe_ref.kernels.runtime._triton_utils import cdiv, check_device, is_interpreter
from moe_ref.kernels.runtime.launch import launch

__all__ = ["FIXED_ROW_BLOCK", "GROUPED_MLP_TILES", "SAME_BITS_CAPABILITIES", "classes_probed", "fixed_tile_matmul",
           "fixed_tile_matmul_ref", "forced_grouped_tiles", "in_row_blocks", "matmul_tile", "same_bits_tile",
           "tile_precision"]

# Rows of every BLAS call on the CPU path: small, so a decode step pads few rows.
FIXED_ROW_BLOCK = 16
# Compute capabilities where the bits classes below were probed (module doc); elsewhere one tile per precision.
SAME_BITS_CAPABILITIES = ((9, 0),)
# fixed_tile_matmul's tiles (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): per operand precision, rules
# (largest T, largest O, tile), the first that fits the call; all of one bits class where probed. The fastest of
# the probe's candidates on one H100 (us per GEMM, 2026-12-07): the router's [T, 7168] x [384, 7168] at T <= 128
# 18 us on (64, 16, 128) against 49 on the single tile (64, 64, 64) and 11-13 for cuBLAS; at T = 4096 65 against 69
# and 44; a shared expert's [T, 7168] x [4096, 7168] 35-37 us at T <= 128, level with cuBLAS.
_MATMUL_TILE_RULES = {
    "16bit": ((256, 1024, (64, 16, 128, 4, 5)), (2048, 1024, (64, 64, 128, 4, 5)), (None, 1024, (128, 128, 64, 4, 5)),
              (32, None, (16, 32, 128, 4, 5)), (256, None, (64, 64, 128, 4, 5)), (None, None, (128, 128, 64, 8, 3))),
    "fp32": ((256, None, (16, 16, 32, 4, 2)), (None, None, (64, 64, 32, 4, 2))),
}
# the one tile per precision where no class was probed (the first mode's tiles)
_MATMUL_TILES = {"16bit": (64, 64, 64, 4, 3), "fp32": (32, 64, 32, 4, 2)}
_INTERPRETER_TILE = (16, 32, 32, 1, 1)  # small and fast on the CPU interpreter (its own fixed tile)
# The grouped MLP's one (GEMM1, GEMM2) tile pair per precision, as its tile lists write them (BLOCK_M, BLOCK_N,
# BLOCK_K, num_warps, num_stages): legal for each GEMM (fp8: BLOCK_N 128 for GEMM1's fp8 epilogue and the
# interleaved gate/up blocks, BLOCK_K dividing 128). Where a precision's class was probed the mode launches any tile
# of the class (``same_bits_tile``); elsewhere this pair, whatever the row count.
GROUPED_MLP_TILES = {
    "16bit": ((64, 128, 64, 4, 4), (64, 128, 64, 4, 4)),
    "fp8": ((64, 128, 128, 8, 3), (64, 128, 128, 8, 3)),
    "fp32": ((32, 64, 32, 4, 2), (32, 64, 32, 4, 2)),
}


def classes_probed(device: torch.device) -> bool:
    """Whether the bits classes hold on ``device``: a CUDA device of ``SAME_BITS_CAPABILITIES``, not interpreted."""
    return (device.type == "cuda" and not is_interpreter()
            and _capability_probed(device.index if device.index is not None else torch.cuda.current_device()))


@functools.lru_cache(maxsize=None)
def _capability_probed(index: int) -> bool:
    # asked at every grouped launch in the batch-invariant mode: once per GPU
    return tuple(torch.cuda.get_device_capability(index)) in SAME_BITS_CAPABILITIES


def tile_precision(fp8: bool, ieee_fp32: bool) -> str:
    """The precision the tile rules key on: ``"fp8"`` (e4m3 operands), ``"fp32"`` (IEEE fp32 operands), else
    ``"16bit"``."""
    return "fp8" if fp8 else "fp32" if ieee_fp32 else "16bit"


def same_bits_tile(tile: tuple, precision: str) -> bool:
    """Whether the grouped MLP's ``tile`` (BLOCK_M, BLOCK_N, BLOCK_K, ...) is in the bits class of ``precision``
    (``"16bit"``, ``"fp8"``, ``"fp32"``) on a probed GPU (module doc): any tile for 16-bit operands; BLOCK_K 128 for
    FP8; for fp32 (not probed) only ``GROUPED_MLP_TILES``' pair."""
    if precision == "16bit":
        return True
    if precision == "fp8":
        return tile[2] == 128
    return tuple(tile[:5]) in GROUPED_MLP_TILES[precision]


def forced_grouped_tiles(precision: str, device: torch.device) -> tuple | None:
    """The grouped MLP's forced (GEMM1, GEMM2) tile pair in the batch-invariant mode on ``device``:
    ``GROUPED_MLP_TILES[precision]`` where the class is that pair (a GPU not probed, the interpreter, fp32), None
    where the launch may take any tile of the class (``same_bits_tile``: the tile table's or the autotuner's)."""
    if classes_probed(device) and precision != "fp32":
        return None
    return GROUPED_MLP_TILES[precision]


def matmul_tile(precision: str, num_rows: int, num_cols: int, device: torch.device) -> tuple:
    """``fixed_tile_matmul``'s tile for a ``[num_rows, I] x [num_cols, I]`` call of ``precision`` (``"16bit"`` or
    ``"fp32"``) on ``device``: by the rules where the class was probed, else the precision's one tile."""
    if is_interpreter():
        return _INTERPRETER_TILE
    if not classes_probed(device):
        return _MATMUL_TILES[precision]
    for max_rows, max_cols, tile in _MATMUL_TILE_RULES[precision]:
        if (max_rows is None or num_rows <= max_rows) and (max_cols is None or num_cols <= max_cols):
            return tile
    raise AssertionError("the last rule of each precision takes every call")


_TL_OUT = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit(do_not_specialize=["M"])  # M == 1 or M % 16 == 0 must not compile another kernel
def _fixed_tile_matmul_kernel(
    a_ptr, b_ptr, c_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    OUT_DTYPE: tl.constexpr,
    IEEE: tl.constexpr,            # fp32 operands: IEEE products (no TF32)
    UPCAST: tl.constexpr,          # interpreter: dot in fp32 (its dot reads bf16 as raw 16-bit integers)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program = one BLOCK_M x BLOCK_N tile of c = a @ b.T over the whole K loop (no split-K), fp32 sums.

    Example: M=3, N=2, K=4, a = ones, b = [[1, 2, 3, 4], [0, 0, 0, 1]] -> every row of c is [10, 1]."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        b = tl.load(b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk,
                    mask=(offs_n[None, :] < N) & (offs_k[:, None] < K), other=0.0)
        if UPCAST:  # exact: a product of two 16-bit floats is exact in fp32, and the sums are fp32 either way
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to(OUT_DTYPE),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def _check_args(x_TI: torch.Tensor, w_OI: torch.Tensor, out_dtype: torch.dtype) -> None:
    if x_TI.dim() != 2 or w_OI.dim() != 2 or x_TI.shape[1] != w_OI.shape[1]:
        raise ShapeError(f"fixed-tile matmul takes x [T, I] and w [O, I]; got {tuple(x_TI.shape)} and "
                         f"{tuple(w_OI.shape)}")
    for name, dtype in (("x_TI", x_TI.dtype), ("w_OI", w_OI.dtype), ("out_dtype", out_dtype)):
        if dtype not in _TL_OUT:
            raise DTypeError(f"{name} must be fp32/fp16/bf16, got {dtype}")


def fixed_tile_matmul(x_TI: torch.Tensor, w_OI: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``x_TI @ w_OI.T`` with fp32 sums, rounded once to ``out_dtype``: the tile of ``matmul_tile`` (one bits class
    for every T; module doc).

    Args:
        x_TI: ``[T, I]`` fp32/fp16/bf16 (CUDA, or the CPU under the interpreter).
        w_OI: ``[O, I]``; cast to a's dtype when it differs (a product of two 16-bit values is exact in fp32).
        out_dtype: fp32, fp16 or bf16.

    Returns:
        ``[T, O]`` out_dtype. No host sync.
    """
    _check_args(x_TI, w_OI, out_dtype)
    check_device("x_TI", x_TI)
    w_OI = w_OI.to(x_TI.dtype)
    num_rows, num_cols = x_TI.shape[0], w_OI.shape[0]
    y_TO = torch.empty(num_rows, num_cols, dtype=out_dtype, device=x_TI.device)
    if num_rows == 0 or num_cols == 0:
        return y_TO
    if x_TI.shape[1] == 0:
        return y_TO.zero_()
    ieee = x_TI.dtype == torch.float32
    block_m, block_n, block_k, warps, stages = matmul_tile(tile_precision(False, ieee), num_rows, num_cols,
                                                           x_TI.device)
    launch(_fixed_tile_matmul_kernel, (cdiv(num_rows, block_m), cdiv(num_cols, block_n)),
           x_TI, w_OI, y_TO, num_rows, num_cols, x_TI.shape[1],
           x_TI.stride(0), x_TI.stride(1), w_OI.stride(0), w_OI.stride(1), y_TO.stride(0), y_TO.stride(1),
           OUT_DTYPE=_TL_OUT[out_dtype], IEEE=ieee, UPCAST=is_interpreter(), BLOCK_M=block_m, BLOCK_N=block_n,
           BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return y_TO


def fixed_tile_matmul_ref(x_TI: torch.Tensor, w_OI: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Torch twin of ``fixed_tile_matmul`` (same arguments): ``torch.matmul`` on FIXED_ROW_BLOCK-row blocks
    (``in_row_blocks``), in ``out_dtype`` when both operands have it (the weights' dtype, as
    ``activations.dense_mlp``), else in fp32 with both cast (as ``router.router_logits``)."""
    _check_args(x_TI, w_OI, out_dtype)
    compute = out_dtype if x_TI.dtype == w_OI.dtype == out_dtype else torch.float32
    b_KN = w_OI.to(compute).t()
    return in_row_blocks(lambda a_block: a_block.to(compute) @ b_KN, x_TI).to(out_dtype)


def in_row_blocks(fn: Callable[[torch.Tensor], torch.Tensor], x_TI: torch.Tensor) -> torch.Tensor:
    """``fn`` (a row-wise function: row i of its output depends on row i of its input only) over ``x_TI``, called
    on fresh zero-padded copies of FIXED_ROW_BLOCK rows each, so every GEMM inside ``fn`` has one shape.

    Args:
        fn: ``[FIXED_ROW_BLOCK, K] -> [FIXED_ROW_BLOCK, N]``.
        x_TI: ``[T, I]`` any dtype.

    Returns:
        ``[T, O]``: fn's rows for x's rows (the padding rows' results dropped); ``fn(x_TI)`` itself when T == 0.
    """
    num_rows = x_TI.shape[0]
    if num_rows == 0:
        return fn(x_TI)
    outputs = []
    for lo in range(0, num_rows, FIXED_ROW_BLOCK):
        rows = x_TI[lo:lo + FIXED_ROW_BLOCK]
        # a fresh allocation: the BLAS sees one shape AND one alignment, whatever x's offset
        block = x_TI.new_zeros(FIXED_ROW_BLOCK, *x_TI.shape[1:])
        block[:rows.shape[0]] = rows
        outputs.append(fn(block)[:rows.shape[0]])
    return torch.cat(outputs)
