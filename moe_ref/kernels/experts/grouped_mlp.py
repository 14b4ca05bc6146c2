"""Grouped expert MLP over an expert-major receive pool: GEMM1 (gate||up) + fused activation, then GEMM2.

    router -> pre_dispatch -> dispatch -> [grouped_mlp] -> combine -> combine_reduce

    h[r] = act(x[r] @ gate_up[i, :F].T, x[r] @ gate_up[i, F:].T)   for r in expert i's segment   [P, F]
    y[r] = h[r] @ down[i].T                                                                        [P, Dx]
    y[r] = 0 for pool rows outside every segment (alignment padding)

One `@triton.jit` kernel (`_grouped_gemm_kernel`) runs both GEMMs: GEMM1 loads gate and up tiles of the same
columns so its epilogue applies the activation (FP8: re-quantizes h per row per 128 columns); GEMM2 is plain.
Programs find their expert on the device (a cumsum of per-expert block counts), so there is no host sync. The grid
(`SCHEDULES`): "grid" has one program per tile of the pool's upper bound (cdiv(P, BLOCK_M) + e row blocks; the
surplus exit at once); "hinted" counts the tiles of the rows hint instead, and its programs walk any tiles past it,
so a pool much bigger than its rows (the layer's whole pool, 128-aligned segments) launches no surplus programs;
"persistent" walks the live tiles on ~2 programs per SM (kept for A/B). The default (None) is "hinted" in the decode
regime (<= 32 rows per expert: 0.9-1.6% faster than "grid" on one H200, docs/RESULTS.md) and "grid" above it (not
measured there; a pool's padding is a small share of its rows).
Tiles: autotuned per regime (`grouped_mlp_tiles`) or forced via `launch_gemm(..., config=...)`
(`grouped_mlp(..., configs=...)` for both GEMMs); in the batch-invariant mode (`batch_invariant=True`) only tiles
that give a row the same bits (`moe_ref.kernels.runtime.fixed_tiles`). Loads: TMA descriptors on Hopper+ (pointer
loads for unaligned rows, `MOE_REF_TMA=0`).
FP8: per-row per-128 x scales times 128x128 weight block scales, applied per k-step (one FMA when the tile
shares one weight scale). FP8 row blocks under 64 rows (decode) swap the MMA's operands, `acc.T = W @ x.T`, so the
weights fill the 64-row side of Hopper's FP8 wgmma (docs/RESULTS.md, "Defaults, and the measurement
that decided each").
4-bit weights have a kernel of their own: `moe_ref.kernels.experts.grouped_mlp_w4`.

Shape legend: P receive-pool rows, Dx expert input width, F expert intermediate, e local experts, O and I one
weight matrix's output and input features (the kernel's GEMM sizes N and K), Db = ceil(Dx / 128),
Fb = ceil(F / 128), 2Fb = ceil(2F / 128). The arguments keep the names of ``moe_ref.experts``' backends
(``x_PDx``, ``x_scale_PDb``, ``gate_up_weight_e2FD``, ``down_weight_eDF``); the weights' D is Dx.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from moe_ref.core import envs
from moe_ref.core.activations import gated_activation
from moe_ref.core.errors import DTypeError, InvalidConfigError, ShapeError, UnknownNameError

from moe_ref.kernels.runtime._triton_utils import (
    ACTIVATION_CODES,
    FP8_DTYPE,
    cdiv,
    check_device,
    gated_act,
    is_interpreter,
    launch_options,
    next_power_of_2,
    num_fp8_groups,
    quantize_e4m3,
    split_halves,
)
from moe_ref.kernels.experts import grouped_mlp_tiles as tiles
from moe_ref.kernels.experts import tile_table
from moe_ref.kernels.experts.grouped_mlp_tiles import GATE_UP_BLOCK
from moe_ref.kernels.runtime import fixed_tiles
from moe_ref.kernels.runtime.gpu_class import gpu_class_of
from moe_ref.kernels.runtime.launch import bound_launches_on, launch
from moe_ref.kernels.ep.pre_dispatch import dequantize_fp8_per_128, quantize_fp8_per_128

try:  # host-side TMA descriptors (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton: pointer loads only
    TensorDescriptor = None

__all__ = ["GATE_UP_BLOCK", "SCHEDULES", "autotuned_kernel", "chosen_tiles", "clear_tuned_configs", "deinterleave_gate_up",
           "grouped_mlp", "grouped_mlp_ref", "interleave_gate_up", "launch_gemm", "table_config", "tiles_recorded"]

SCHEDULES = ("grid", "hinted", "persistent")  # how many programs a launch has (module docstring)


# --------------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------------
@triton.jit
def _load_b_tile(b_desc, b_base, b_scale_base, expert_row0, first_row, num_b_rows, k0, K, stride_b_n, stride_b_scale_n,
                 USE_TMA: tl.constexpr, UPCAST: tl.constexpr, BLOCK_K: tl.constexpr, WIDTH: tl.constexpr):
    """`[BLOCK_K, WIDTH]` tile of b.T: b rows first_row.. (of this expert's num_b_rows), columns k0.. .
    Rows and columns past the ends read as 0. `expert_row0`: this expert's first row in b viewed as 2D (TMA).
    UPCAST: in fp32."""
    offs_b = first_row + tl.arange(0, WIDTH)
    mask_b = offs_b < num_b_rows
    # one return: Triton types every return statement, also those of branches a constexpr leaves out
    if USE_TMA:
        tile = b_desc.load([(expert_row0 + first_row).to(tl.int32), k0]).T
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        tile = tl.load(b_base + offs_b[None, :] * stride_b_n + offs_k[:, None],
                       mask=(offs_k < K)[:, None] & mask_b[None, :], other=0.0)
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _fp8_product(a, b, SWAP_AB: tl.constexpr):
    """FP8 ``a [BLOCK_M, BLOCK_K] @ b [BLOCK_K, W]`` in the accumulator's orientation: ``[BLOCK_M, W]``, or with
    SWAP_AB its transpose ``[W, BLOCK_M]`` = the weight tile (the MMA's A) @ x's tile transposed (its B), so that a
    narrow row block still fills the 64-row side of Hopper's wgmma (`_gemm_tile`)."""
    # one return in these helpers: Triton types every return statement, also those a constexpr leaves out
    if SWAP_AB:
        product = tl.dot(tl.trans(b), tl.trans(a))
    else:
        product = tl.dot(a, b)
    return product


@triton.jit
def _promote(acc, partial, scale_a, b_scale_base, first_col, stride_b_scale_n, k0, num_cols,
             ONE_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
    """FP8: acc + partial * (x scale (per row) * weight scale (per 128 columns of b, from b's column first_col)).
    ONE_SCALE: the tile's BLOCK_N columns share one 128x128 weight block, folded into the row scales. Either way
    each element takes one product of its two scales and one FMA, as DeepGEMM's SM90 promotion, so an element's
    bits do not depend on BLOCK_N. SWAP_AB: acc and partial are transposed (`_fp8_product`)."""
    if ONE_SCALE:
        scale_b = tl.load(b_scale_base + (first_col // 128) * stride_b_scale_n + k0 // 128)
        if SWAP_AB:
            acc += partial * (scale_a * scale_b)[None, :]
        else:
            acc += partial * (scale_a * scale_b)[:, None]
    else:
        offs_col = first_col + tl.arange(0, BLOCK_N)
        scale_b = tl.load(b_scale_base + (offs_col // 128) * stride_b_scale_n + k0 // 128, mask=offs_col < num_cols,
                          other=0.0)
        if SWAP_AB:
            acc += partial * (scale_b[:, None] * scale_a[None, :])
        else:
            acc += partial * (scale_a[:, None] * scale_b[None, :])
    return acc


@triton.jit
def _promote_halves(acc, partial, scale_a, b_scale_base, first_row, stride_b_scale_n, k0, BLOCK_N: tl.constexpr,
                    SWAP_AB: tl.constexpr):
    """FP8, interleaved gate/up: acc + partial * x scale (per row) * weight scale, for a `[BLOCK_M, 2 * BLOCK_N]`
    tile whose b rows first_row.. are one 128-row gate block then its up block (BLOCK_N == 128): the gate columns
    take weight scale row first_row // 128, the up columns the next (one select and one FMA per element).
    SWAP_AB: acc and partial are transposed, `[2 * BLOCK_N, BLOCK_M]`."""
    scale_gate = tl.load(b_scale_base + (first_row // 128) * stride_b_scale_n + k0 // 128)
    scale_up = tl.load(b_scale_base + (first_row // 128 + 1) * stride_b_scale_n + k0 // 128)
    is_up = tl.arange(0, 2 * BLOCK_N) >= BLOCK_N
    if SWAP_AB:
        acc += partial * tl.where(is_up[:, None], (scale_a * scale_up)[None, :], (scale_a * scale_gate)[None, :])
    else:
        acc += partial * tl.where(is_up[None, :], (scale_a * scale_up)[:, None], (scale_a * scale_gate)[:, None])
    return acc


@triton.jit
def _mma(a, b, acc, IEEE_FP32: tl.constexpr):
    """acc + a @ b on the tensor cores (fp32 inputs: ieee, not tf32)."""
    if IEEE_FP32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def expert_table(num_rows_ptr, num_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """The expert table of a grouped GEMM over an expert-major pool, vectorised over the e experts (``BLOCK_E`` >=
    e): ``(offs_e, num_rows_e, num_blocks_e, block_end_e)``, the rows of each expert, its BLOCK_M blocks and their
    running end (``expert_block_rows`` finds a block's expert in it; also used by ``grouped_mlp_w4``)."""
    offs_e = tl.arange(0, BLOCK_E)
    num_rows_e = tl.load(num_rows_ptr + offs_e, mask=offs_e < num_experts, other=0).to(tl.int32)
    num_blocks_e = tl.cdiv(num_rows_e, BLOCK_M)
    return offs_e, num_rows_e, num_blocks_e, tl.cumsum(num_blocks_e, axis=0)


@triton.jit
def expert_block_rows(pid_m, offs_e, num_rows_e, num_blocks_e, block_end_e, row_start_ptr, R, BLOCK_M: tl.constexpr):
    """M block ``pid_m`` (of all experts' blocks, ``pid_m < sum(num_blocks_e)``) in the ``expert_table``:
    ``(expert, row0, rows, mask_m)``, its expert (int64), first pool row (int64), its ``[BLOCK_M]`` pool rows and
    which of them are inside the expert's segment and the pool of ``R`` rows."""
    expert = tl.sum((block_end_e <= pid_m).to(tl.int32))
    block_in_expert = pid_m - tl.sum(tl.where(offs_e < expert, num_blocks_e, 0))
    rows_left = tl.sum(tl.where(offs_e == expert, num_rows_e, 0)) - block_in_expert * BLOCK_M
    row0 = tl.load(row_start_ptr + expert).to(tl.int64) + block_in_expert * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    return expert.to(tl.int64), row0, row0 + offs_m, (offs_m < rows_left) & (row0 + offs_m < R)


@triton.jit
def _grouped_gemm_kernel(
    # pointers
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, c_scale_ptr, row_start_ptr, num_rows_ptr,
    add_ptr,                       # ADD: [R, N] of c's dtype, added to c (else c, unread)
    a_desc, b_desc,                # TMA descriptors of a [R, K] and b [e * rows of b, K] (USE_TMA), else None
    # sizes
    R, N, K, num_experts, situ_beta, situ_linear_beta,
    rows_hint,                     # autotune key only: ~total routed rows, power of 2 (unused in the body)
    pool_rows_bucket,              # autotune key only: R rounded up to a power of 2 (unused in the body)
    # strides (elements; the last dimension of a, b, c is contiguous)
    stride_a_r, stride_a_scale_r, stride_b_e, stride_b_n, stride_b_scale_e, stride_b_scale_n,
    stride_c_r, stride_c_scale_r, stride_add_r,
    # meta
    ACTIVATION: tl.constexpr,      # 0: c = a @ b.T; 1 silu, 2 situ: b has 2N rows (gate and up), c = act(gate, up)
    INTERLEAVED: tl.constexpr,     # gated: b's rows alternate 128-row gate and up blocks (one dot, BLOCK_N == 128; FP8
                                   # scale rows alike); else N gate rows, then N up rows
    SITU_LINEAR: tl.constexpr,     # situ only: apply lb * tanh(up / lb) (situ_linear_beta != 0)
    FP8: tl.constexpr,             # a, b are fp8 e4m3 with per-128 scales
    QUANT_OUT: tl.constexpr,       # write c as fp8 e4m3 + per-row per-128 scales (needs BLOCK_N == 128)
    USE_TMA: tl.constexpr,         # load the a and b tiles through a_desc/b_desc (Hopper TMA), not pointers
    N_ALIGNED: tl.constexpr,       # N % 128 == 0: the up half of a gate||up tile starts a scale group too
    UPCAST: tl.constexpr,          # interpreter: dot in fp32 (its bf16 dot is wrong)
    IEEE_FP32: tl.constexpr,       # fp32 inputs: ieee dot instead of tf32
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,         # next_power_of_2(num_experts)
    GROUP_M: tl.constexpr = 1,     # program order: 1 = N fastest (pid_m = pid // num_pid_n); G > 1 = L2 swizzle
    PERSISTENT: tl.constexpr = False,  # programs walk the live tiles, grid-strided (else one per upper-bound tile)
    ADD: tl.constexpr = False,     # c = a @ b.T + add, summed in fp32 and rounded once (no activation, no fp8 out)
    ROUND_GATE_UP: tl.constexpr = False,  # gated: round gate and up to bf16 before the activation, as DeepGEMM's
                                          # GEMM1 writes them (the batch-invariant mode, bf16 and FP8)
):
    """One program = BLOCK_M rows of one expert x BLOCK_N output columns (x2 for gate and up).

    Example: e=2, num_rows_e=[3, 0], row_start_e=[0, 128], BLOCK_M=2 -> blocks per expert [2, 0];
        pid_m 0 -> expert 0 rows 0..1, pid_m 1 -> expert 0 row 2 (row 3 masked), pid_m >= 2 -> exit.
        With silu, N=F=1, K=D=1, a[0]=[2.0], b[0]=[[1.0], [3.0]] (gate row, up row):
        gate=2, up=6, c[0] = silu(2) * 6 = 1.7616 * 6 = 10.569.
    """
    num_pid_n = tl.cdiv(N, BLOCK_N)
    offs_e, num_rows_e, num_blocks_e, block_end_e = expert_table(num_rows_ptr, num_experts, BLOCK_M, BLOCK_E)
    num_pid_m = tl.sum(num_blocks_e)
    if PERSISTENT:  # "hinted", "persistent": the programs walk every live tile, grid-strided
        for tile in range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0)):
            pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
            _gemm_tile(pid_m, pid_n, offs_e, num_rows_e, num_blocks_e, block_end_e, a_ptr, a_scale_ptr, b_ptr,
                       b_scale_ptr, c_ptr, c_scale_ptr, row_start_ptr, add_ptr, a_desc, b_desc, R, N, K, situ_beta,
                       situ_linear_beta, stride_a_r, stride_a_scale_r, stride_b_e, stride_b_n, stride_b_scale_e,
                       stride_b_scale_n, stride_c_r, stride_c_scale_r, stride_add_r, ACTIVATION, INTERLEAVED,
                       SITU_LINEAR, FP8, QUANT_OUT, USE_TMA, N_ALIGNED, UPCAST, IEEE_FP32, ADD, ROUND_GATE_UP,
                       BLOCK_M, BLOCK_N, BLOCK_K)
    else:  # one program per tile of the upper-bound grid; the surplus programs exit at once
        pid_m, pid_n = _tile_coords(tl.program_id(0), tl.num_programs(0) // num_pid_n, num_pid_n, GROUP_M)
        if pid_m < num_pid_m:
            _gemm_tile(pid_m, pid_n, offs_e, num_rows_e, num_blocks_e, block_end_e, a_ptr, a_scale_ptr, b_ptr,
                       b_scale_ptr, c_ptr, c_scale_ptr, row_start_ptr, add_ptr, a_desc, b_desc, R, N, K, situ_beta,
                       situ_linear_beta, stride_a_r, stride_a_scale_r, stride_b_e, stride_b_n, stride_b_scale_e,
                       stride_b_scale_n, stride_c_r, stride_c_scale_r, stride_add_r, ACTIVATION, INTERLEAVED,
                       SITU_LINEAR, FP8, QUANT_OUT, USE_TMA, N_ALIGNED, UPCAST, IEEE_FP32, ADD, ROUND_GATE_UP,
                       BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of tile number `tile`. GROUP_M == 1: N tiles fastest. GROUP_M > 1: GROUP_M consecutive M
    blocks (any experts) sweep the N tiles together, M fastest, so tiles that run at the same time share weight
    tiles (and a few x row blocks) in L2; the last group may be short."""
    if GROUP_M == 1:
        return tile // num_pid_n, tile % num_pid_n
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (tile // num_pid_in_group) * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    return first_pid_m + (tile % num_pid_in_group) % group_size_m, (tile % num_pid_in_group) // group_size_m


@triton.jit
def _gemm_tile(
    pid_m, pid_n, offs_e, num_rows_e, num_blocks_e, block_end_e,
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, c_scale_ptr, row_start_ptr, add_ptr, a_desc, b_desc,
    R, N, K, situ_beta, situ_linear_beta,
    stride_a_r, stride_a_scale_r, stride_b_e, stride_b_n, stride_b_scale_e, stride_b_scale_n,
    stride_c_r, stride_c_scale_r, stride_add_r,
    ACTIVATION: tl.constexpr, INTERLEAVED: tl.constexpr, SITU_LINEAR: tl.constexpr, FP8: tl.constexpr,
    QUANT_OUT: tl.constexpr, USE_TMA: tl.constexpr,
    N_ALIGNED: tl.constexpr, UPCAST: tl.constexpr, IEEE_FP32: tl.constexpr, ADD: tl.constexpr,
    ROUND_GATE_UP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """M block `pid_m` (of all experts' blocks, `pid_m < sum(num_blocks_e)`) x N tile `pid_n` of one grouped GEMM;
    arguments as `_grouped_gemm_kernel`'s, plus the expert table (`num_rows_e`, their BLOCK_M blocks and the
    blocks' running end, over `offs_e`)."""
    expert, row0, rows, mask_m = expert_block_rows(pid_m, offs_e, num_rows_e, num_blocks_e, block_end_e, row_start_ptr,
                                                   R, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + rows[:, None] * stride_a_r + offs_k[None, :]
    # TMA coordinates: the tile's first pool row, and this expert's first row of b viewed as [e * rows of b, K]
    # (rows the tile reads past its segment belong to the next expert or the padding: masked at the store)
    row0_tma = row0.to(tl.int32)
    num_b_rows = N
    if ACTIVATION != 0:
        num_b_rows = 2 * N
    expert_b_row0 = expert * (stride_b_e // stride_b_n)
    b_base = b_ptr + expert * stride_b_e
    b_scale_base = b_scale_ptr + expert * stride_b_scale_e
    # FP8 row blocks under 64 rows swap the MMA's operands, as the FP8 fused-MoE kernels of vLLM and SGLang do on
    # SM90: wgmma's A side needs 64 rows, and below it Triton 3.6 emits mma.sync, which has no e4m3 on sm_90 and
    # converts every weight to fp16 in registers. The accumulators are then transposed until the epilogue.
    SWAP_AB: tl.constexpr = FP8 and BLOCK_M < 64 and BLOCK_N >= 64
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_halves = tl.zeros([2 * BLOCK_N, BLOCK_M], dtype=tl.float32)  # interleaved: gate rows, then up rows
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_halves = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)  # interleaved: gate columns, then up columns

    # --- main loop over K ------------------------------------------------------------------------------
    for k0 in range(0, K, BLOCK_K):
        if USE_TMA:  # out-of-bounds rows and columns come back as 0
            a = a_desc.load([row0_tma, k0])
        else:
            a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k < K - k0)[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
        if FP8:
            scale_a = tl.load(a_scale_ptr + rows * stride_a_scale_r + k0 // 128, mask=mask_m, other=0.0)
        if ACTIVATION != 0 and INTERLEAVED:
            # one dot over 2 * BLOCK_N b rows (BLOCK_N == 128): the gate block of output columns offs_n, then its
            # up block
            b = _load_b_tile(b_desc, b_base, b_scale_base, expert_b_row0, pid_n * 2 * BLOCK_N, num_b_rows, k0, K,
                             stride_b_n, stride_b_scale_n, USE_TMA, UPCAST, BLOCK_K,
                             2 * BLOCK_N)
            if FP8:  # the block scales are interleaved alike: rows 2 * pid_n (gate) and 2 * pid_n + 1 (up)
                acc_halves = _promote_halves(acc_halves, _fp8_product(a, b, SWAP_AB), scale_a, b_scale_base,
                                             pid_n * 2 * BLOCK_N, stride_b_scale_n, k0, BLOCK_N, SWAP_AB)
            else:
                acc_halves = _mma(a, b, acc_halves, IEEE_FP32)
        else:
            b = _load_b_tile(b_desc, b_base, b_scale_base, expert_b_row0, pid_n * BLOCK_N, N, k0, K, stride_b_n,
                             stride_b_scale_n, USE_TMA, UPCAST, BLOCK_K, BLOCK_N)
            if FP8:
                acc = _promote(acc, _fp8_product(a, b, SWAP_AB), scale_a, b_scale_base, pid_n * BLOCK_N,
                               stride_b_scale_n, k0, N, 128 % BLOCK_N == 0, BLOCK_N, SWAP_AB)
            else:
                acc = _mma(a, b, acc, IEEE_FP32)
            if ACTIVATION != 0:  # the up rows follow the N gate rows
                b_up = _load_b_tile(b_desc, b_base, b_scale_base, expert_b_row0, N + pid_n * BLOCK_N, num_b_rows, k0,
                                    K, stride_b_n, stride_b_scale_n, USE_TMA, UPCAST,
                                    BLOCK_K, BLOCK_N)
                if FP8:
                    acc_up = _promote(acc_up, _fp8_product(a, b_up, SWAP_AB), scale_a, b_scale_base,
                                      N + pid_n * BLOCK_N, stride_b_scale_n, k0, 2 * N,
                                      128 % BLOCK_N == 0 and N_ALIGNED, BLOCK_N, SWAP_AB)
                else:
                    acc_up = _mma(a, b_up, acc_up, IEEE_FP32)
        a_ptrs += BLOCK_K
    if SWAP_AB:
        acc, acc_up, acc_halves = tl.trans(acc), tl.trans(acc_up), tl.trans(acc_halves)
    if ACTIVATION != 0 and INTERLEAVED:
        acc, acc_up = split_halves(acc_halves)

    # --- epilogue: activation (fp32), optional fp8 re-quantization, store ----------------------------
    if ROUND_GATE_UP:
        acc, acc_up = acc.to(tl.bfloat16).to(tl.float32), acc_up.to(tl.bfloat16).to(tl.float32)
    acc = gated_act(acc, acc_up, situ_beta, situ_linear_beta, ACTIVATION, SITU_LINEAR)
    c_ptrs = c_ptr + rows[:, None] * stride_c_r + offs_n[None, :]
    mask_c = mask_m[:, None] & mask_n[None, :]
    if QUANT_OUT:
        # BLOCK_N == 128 and pid_n * 128 is a group start: this tile's columns are exactly scale group pid_n
        acc = tl.where(mask_c, acc, 0.0)
        c_fp8, scale_c = quantize_e4m3(acc)
        tl.store(c_ptrs, c_fp8, mask=mask_c)
        tl.store(c_scale_ptr + rows * stride_c_scale_r + pid_n, scale_c, mask=mask_m)
    else:
        if ADD:
            acc += tl.load(add_ptr + rows[:, None] * stride_add_r + offs_n[None, :], mask=mask_c,
                           other=0.0).to(tl.float32)
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_c)


# the persistent schedule's grid: programs per SM (two, so one program's epilogue overlaps another's main loop)
PERSISTENT_PROGRAMS_PER_SM = 2


# --------------------------------------------------------------------------------------------------
# autotune (the tile lists and their pruning live in moe_ref.kernels.experts.grouped_mlp_tiles)
# --------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def autotuned_kernel(same_bits: bool = False):
    """The grouped GEMM kernel wrapped in `triton.autotune` over `tiles.gpu_configs()` (built once, cached); with
    `same_bits` (the batch-invariant mode) over the tiles of the launch's bits class only
    (`moe_ref.kernels.runtime.fixed_tiles.same_bits_tile`), so that its choice never changes a row's bits.

    What `launch_gemm(config=None)` launches on a GPU; its `.cache` maps each autotune key (rows_hint, the pool's
    rows bucket, N, K, num_experts and the kernel flags) to the `triton.Config` that won, which the benchmarks report.
    The pool's rows are in the key because the upper-bound grid grows with them: a pool of 128-aligned segments at
    decode holds ~12x the rows it uses, and the tiles tuned on a back-to-back pool of the same rows hint ran 3-5%
    slower there than on their own pool (2026-12-01, one H200; git history of docs/RESULTS.md).

    Args:
        same_bits: prune to the launch's bits class.

    Returns:
        the `triton.runtime.Autotuner` around `_grouped_gemm_kernel` (call as `autotuned_kernel()[grid](...)`).
    """
    return triton.autotune(
        configs=tiles.gpu_configs(),
        key=["rows_hint", "pool_rows_bucket", "N", "K", "num_experts", "ACTIVATION", "INTERLEAVED", "FP8", "QUANT_OUT",
             "USE_TMA", "PERSISTENT"],
        prune_configs_by={"early_config_prune": functools.partial(tiles.prune_configs, same_bits=same_bits)},
    )(_grouped_gemm_kernel)


# --------------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------------
def tma_unavailable_reason(device: torch.device | str | None = None) -> str | None:
    """Why launches on `device` (default: the current CUDA device) use pointer loads, or None when they use
    TMA descriptors (4-bit weights and rows that are not 16-byte aligned still use pointers). `moe-ref info`
    prints it."""
    if TensorDescriptor is None:
        return f"triton {triton.__version__} has no host-side TensorDescriptor"
    if not envs.tma():
        return "MOE_REF_TMA=0"
    if is_interpreter():
        return None
    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        return "no CUDA device"
    major, minor = _capability(torch.device(device if device is not None else torch.cuda.current_device()))
    return f"compute capability {major}.{minor} < 9.0 (TMA needs Hopper or newer)" if major < 9 else None


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tma_possible(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the a and b tiles can be loaded with TMA descriptors: where `tma_unavailable_reason` is None, with
    16-byte aligned bases and row strides (TMA's rules), b contiguous (its rows make one matrix)."""
    if _tma_reason(a.device, envs.tma(), is_interpreter()) is not None or not b.is_contiguous():
        return False
    return all(t.data_ptr() % 16 == 0 and (t.stride(-2) * t.element_size()) % 16 == 0 for t in (a, b))


@functools.lru_cache(maxsize=None)
def _tma_reason(device: torch.device, tma_switch: bool, interpreter: bool) -> str | None:
    """`tma_unavailable_reason(device)` for these values of the MOE_REF_TMA switch and the interpreter flag, which it
    reads: looked up once per value (every launch asks)."""
    return tma_unavailable_reason(device)


def launch_gemm(a, a_scale, b, b_scale, c, c_scale, row_start_e, num_rows_e, *, n, k, activation,
                situ_beta, situ_linear_beta, fp8, quant_out, rows_hint, interleaved: bool = False,
                config: triton.Config | None = None, tma: bool | None = None, schedule: str | None = None,
                add: torch.Tensor | None = None, batch_invariant: bool = False):
    """One grouped GEMM: GEMM1 (`activation` "silu"/"situ", b = gate_up, its rows stacked or `interleaved`)
    or GEMM2 (`activation` "none"). `grouped_mlp` runs it twice; the tuner and the tests call it alone.

    Args:
        a: `[P, k]` rows of the pool: bf16/fp16/fp32, or `torch.float8_e4m3fn` with `a_scale` (`fp8`).
        a_scale: `[P, ceil(k/128)]` fp32 per-row per-128 scales of an fp8 `a`; None otherwise.
        b: `[e, N_b, k]` weights of a's dtype (fp8 for fp8 a), N_b = 2n for GEMM1 (gate rows then up rows, or
            alternating 128-row blocks when `interleaved`), n for GEMM2.
        b_scale: fp32 `[e, ceil(N_b/128), ceil(k/128)]` block scales of fp8 b, or 4-bit group-32 scales
            `[e, N_b, k/32]` (bf16/fp16/fp32, or uint8 E8M0 for MXFP4); None for unquantized b.
        c: `[P, n]` output, written in place: bf16/fp16/fp32 (a's dtype; bf16 for fp8 a without `quant_out`),
            or `torch.float8_e4m3fn` when `quant_out`.
        c_scale: `[P, ceil(n/128)]` fp32, written with c's per-128 scales when `quant_out`; None otherwise.
        row_start_e: `[e]` int64/int32 first pool row of each expert.
        num_rows_e: `[e]` int32/int64 rows of each expert (0 = empty expert).
        n, k: output width and reduction width of this GEMM (GEMM1: n = F, k = D; GEMM2: n = D, k = F).
        activation: "silu" or "situ" (GEMM1: h = act(gate) * up, in fp32), "none" (GEMM2).
        situ_beta, situ_linear_beta: SiTU's beta and lb (floats; ignored by "silu"/"none").
        fp8: a and b are e4m3 with scales.
        quant_out: c is e4m3 with `c_scale` (GEMM1 writing h for an fp8 GEMM2).
        rows_hint: int, about the number of live pool rows (autotune key, bucketed to a power of 2).
        interleaved: GEMM1's b rows (and fp8 b_scale's rows) alternate gate and up blocks (`interleave_gate_up`);
            needs n % 128 == 0, and a forced config BLOCK_N 128.
        config: None, or a `triton.Config` forcing the tile (see below).
        tma: None (TMA where possible), True (force; error where impossible), False (pointer loads).
        schedule: one of `SCHEDULES` (the module docstring): the launch's number of programs; None: "hinted" in
            the decode regime of `rows_hint`, "grid" above it.
        add: None, or `[P, n]` of c's dtype (unit stride along n): c = a @ b.T + add on the rows inside segments,
            summed in fp32 and rounded once (GEMM2 only: `activation="none"`, not `quant_out`).
        batch_invariant: launch only tiles of the precision's bits class (`fixed_tiles.same_bits_tile`: the tile
            table's first in the class, else the autotuner over the class), or the one forced tile where the class is
            one (`fixed_tiles.forced_grouped_tiles`), so a row's bits do not depend on the row count. GEMM1 on bf16
            or FP8 rows also rounds gate and up to bf16 before the activation, as the activation of DeepGEMM's
            experts reads them (`experts.deep_gemm`: its GEMM1 writes bf16), so the two run one arithmetic up to the
            GEMMs'.

    Returns:
        what the Triton launch returns (c and c_scale are written in place).

    `config=None` (what `grouped_mlp` does): on a GPU, autotune over `tiles.gpu_configs()` pruned to this
    launch's regime, once per shape key (`tuned_launch_key`); later launches of that key run the chosen config
    directly; under the interpreter, a fixed small tile. `config=triton.Config({"BLOCK_M", "BLOCK_N",
    "BLOCK_K"[, "GROUP_M"]}, num_warps=, num_stages=)` forces that tile (no autotune, no regime or
    heuristic pruning; one compile per distinct config and kernel flags): used by
    `scripts/tune_grouped_mlp.py` and the tests. A config that would compute a wrong result (fp8 group
    rules) raises ValueError; one that does not fit the GPU fails in Triton (OutOfResources).
    `tma=None` loads the a and b tiles through TMA descriptors where `_tma_possible` (else pointers);
    True forces TMA (InvalidConfigError, a ValueError, where it is impossible), False forces pointers.
    `schedule`: "grid" launches one program per tile of the pool's upper bound, "hinted" one per tile of the rows
    hint's (programs walk the tiles past it), "persistent" `PERSISTENT_PROGRAMS_PER_SM` programs per SM walking the
    live tiles.
    Returns what the Triton launch returns (on a GPU the compiled kernel: `n_regs`, `n_spills`,
    `metadata.shared`; `grouped_mlp` ignores it).
    """
    num_rows, num_experts = a.shape[0], b.shape[0]
    rows_bucket = next_power_of_2(max(1, rows_hint))  # the autotune key's rows
    precision = fixed_tiles.tile_precision(fp8, ieee_fp32=a.dtype == torch.float32)
    if batch_invariant and config is None:
        forced = fixed_tiles.forced_grouped_tiles(precision, a.device)
        config = None if forced is None else tiles.config_of_tile(forced[0 if activation != "none" else 1])
    if schedule is None:
        schedule = "hinted" if tiles.regime(rows_bucket, num_experts)[0] == "decode" else "grid"
    if schedule not in SCHEDULES:
        raise UnknownNameError(f"schedule={schedule!r} must be one of {', '.join(SCHEDULES)}")
    if add is not None and (activation != "none" or quant_out or add.shape != (num_rows, n) or add.dtype != c.dtype
                            or add.stride(-1) != 1):
        raise InvalidConfigError(f"add [P, n] {tuple(add.shape)} {add.dtype}: only GEMM2 (activation 'none', no fp8 "
                                 f"output) adds a [P, n] = {(num_rows, n)} tensor of c's dtype {c.dtype}, unit "
                                 f"stride along n")
    if interleaved and (activation == "none" or n % GATE_UP_BLOCK):
        raise InvalidConfigError(f"interleaved gate/up rows: GEMM1 only (activation {activation!r}) with n % "
                                 f"{GATE_UP_BLOCK} == 0 (n={n}); pass interleaved=False with stacked rows otherwise")
    pool_bucket = next_power_of_2(max(1, num_rows))  # and the pool's
    possible = _tma_possible(a, b)
    if tma and not possible:
        raise InvalidConfigError("tma=True, but these tensors cannot use TMA descriptors (a GPU "
                                 "older than Hopper, MOE_REF_TMA=0, or bases/row strides not 16-byte aligned)")
    use_tma = possible if tma is None else tma
    dummy = c
    a_scale = dummy if a_scale is None else a_scale
    b_scale = dummy if b_scale is None else b_scale
    c_scale = dummy if c_scale is None else c_scale
    flags = dict(
        ACTIVATION=ACTIVATION_CODES[activation], INTERLEAVED=interleaved, SITU_LINEAR=bool(situ_linear_beta), FP8=fp8,
        QUANT_OUT=quant_out, USE_TMA=use_tma, N_ALIGNED=n % 128 == 0,
        UPCAST=is_interpreter(), IEEE_FP32=a.dtype == torch.float32, BLOCK_E=next_power_of_2(num_experts),
        PERSISTENT=schedule != "grid", ADD=add is not None,
        ROUND_GATE_UP=batch_invariant and activation != "none" and (fp8 or a.dtype == torch.bfloat16),
    )
    max_programs = None
    if schedule == "persistent":
        max_programs = 4 if is_interpreter() else PERSISTENT_PROGRAMS_PER_SM * _num_sms(a.device)

    def grid(meta):
        """Programs of a launch with tile ``meta``: the tiles of the pool's upper bound (``cdiv(rows, BLOCK_M) + e`` row
        blocks, any split of the rows over the experts), of the hint's rows ("hinted"), or the persistent count."""
        tiles_of = lambda rows: (cdiv(rows, meta["BLOCK_M"]) + num_experts) * cdiv(n, meta["BLOCK_N"])  # noqa: E731
        upper = tiles_of(num_rows)
        if schedule == "hinted":
            return (min(upper, tiles_of(rows_hint)),)
        return (upper if max_programs is None else min(upper, max_programs),)

    def arguments(meta: dict | None) -> tuple:
        """The kernel's positional arguments; a TMA launch's descriptors take the block shapes of the tile ``meta``
        (None: placeholders, set by the autotuner's pre-hook for each config it runs)."""
        if use_tma:
            a_block, b_block = tiles.tma_block_shapes(meta, flags) if meta is not None else ([16, 16], [16, 16])
            a_desc = TensorDescriptor(a, list(a.shape), list(a.stride()), a_block)
            # b's rows as one [e * N_b, k] matrix over b's own storage (contiguous: `_tma_possible`)
            b_desc = TensorDescriptor(b, [num_experts * b.shape[1], k], [b.stride(1), 1], b_block)
        else:
            a_desc = b_desc = None
        b_scale_strides = (b_scale.stride(0), b_scale.stride(1)) if fp8 else (0, 0)
        return (
            a, a_scale, b, b_scale, c, c_scale, row_start_e, num_rows_e, dummy if add is None else add, a_desc,
            b_desc, num_rows, n, k, num_experts, float(situ_beta),
            float(situ_linear_beta) if situ_linear_beta else 1.0, rows_bucket, pool_bucket,
            a.stride(0), a_scale.stride(0) if fp8 else 0, b.stride(0), b.stride(1), *b_scale_strides,
            c.stride(0), c_scale.stride(0) if quant_out else 0, 0 if add is None else add.stride(0),
        )

    def keywords(options: dict) -> dict:
        """Every keyword of a launch: the kernel's flags, ``options`` (the tile's meta-parameters and launch options)
        and the compile options (none under the interpreter)."""
        return {**flags, **options, **({} if is_interpreter() else launch_options(fp_fusion=True))}

    if config is not None:
        options = tiles.forced_options(config)  # checks the meta keys first
        error = tiles.config_error(config, fp8=fp8, quant_out=quant_out, interleaved=interleaved)
        if error:
            raise InvalidConfigError(f"forced config {config}: {error}")
        return launch(_grouped_gemm_kernel, grid(options), *arguments(config.kwargs), **keywords(options))
    if is_interpreter():
        meta = tiles.interpreter_meta(quant_out, interleaved)
        return launch(_grouped_gemm_kernel, grid(meta), *arguments(meta), **keywords(meta))
    # The autotuner runs once per shape key; later launches of that key go straight to the kernel with the config
    # it chose and its launch keywords, merged once (no autotuner key work or pre-hook per call). The key holds
    # everything the autotuner's does (its key arguments and every tensor's dtype), and more;
    # MOE_REF_BOUND_LAUNCH=0 keeps the autotuner.
    # A GPU class with a recorded tile table launches the recorded tile (no autotune at a new token count:
    # moe_ref.kernels.experts.tile_table); where it has none, or MOE_REF_AUTOTUNE=1, the autotuner chooses.
    tensors = (a, a_scale, b, b_scale, c, c_scale)
    key = (*tuned_launch_key((rows_bucket, pool_bucket), n, k, num_experts, flags, tensors), batch_invariant)
    tuned = _TUNED.get(key) if bound_launches_on() else None
    if tuned is None:
        recorded = table_config(a.device, n=n, k=k, num_experts=num_experts, flags=flags, rows_bucket=rows_bucket,
                                same_bits=precision if batch_invariant else None)
        if recorded is not None:
            tuned = recorded, keywords(tiles.forced_options(recorded))
            _TUNED[key], _CHOSEN_BY[key] = tuned, ("table", flags)
    if tuned is not None:
        chosen, keywords = tuned
        return launch(_grouped_gemm_kernel, grid(keywords), *arguments(chosen.kwargs), **keywords)
    tuner = autotuned_kernel(same_bits=batch_invariant)
    out = tuner[grid](*arguments(None), **keywords({}))
    _TUNED[key] = tuner.best_config, keywords(tiles.forced_options(tuner.best_config))
    _CHOSEN_BY[key] = ("autotune", flags)
    return out


def _recorded_entries(device: torch.device) -> list | None:
    """The tile table's entries for ``device``'s GPU class (``tile_table.table_for``: its own, or a recorded class of
    its compute capability), or None: none applies, or ``MOE_REF_AUTOTUNE=1``."""
    found = None if envs.autotune() else tile_table.table_for(gpu_class_of(device))
    return None if found is None else found[1]


def tiles_recorded(device: torch.device) -> bool:
    """Whether launches on ``device`` take recorded tiles (``tile_table``): a table for its GPU class, and
    ``MOE_REF_AUTOTUNE`` unset. Where not, the first launch of each shape key autotunes (seconds)."""
    return _recorded_entries(device) is not None


def table_config(device: torch.device, *, n: int, k: int, num_experts: int, flags: dict,
                 rows_bucket: int, same_bits: str | None = None) -> triton.Config | None:
    """The recorded tile of a launch (``tile_table.candidates``' first one the kernel accepts for it, and with
    ``same_bits``, a precision, one of its bits class: ``fixed_tiles.same_bits_tile``), or None: no table for
    ``device``'s GPU class, no entry with the launch's flags, none legal, or ``MOE_REF_AUTOTUNE=1``."""
    entries = _recorded_entries(device)
    if entries is None:
        return None
    facts = dict(n=n, k=k, gated=flags["ACTIVATION"] != 0, fp8=flags["FP8"], quant_out=flags["QUANT_OUT"],
                 ieee_fp32=flags["IEEE_FP32"], interleaved=flags["INTERLEAVED"] and flags["ACTIVATION"] != 0)
    for tile in tile_table.candidates(entries, n=n, k=k, num_experts=num_experts, flags=flags,
                                      rows_bucket=rows_bucket):
        config = tiles.config_of_tile(tile)
        if tiles.config_problem(config, **facts) is None and (same_bits is None
                                                               or fixed_tiles.same_bits_tile(tile, same_bits)):
            return config
    return None


# shape key -> (the config the autotuner or the tile table chose for it, every keyword of its launch: the kernel's
# flags, the tile, the compile options); filled by launch_gemm, with who chose (``"table"`` or ``"autotune"``) and the
# launch's kernel flags
_TUNED: dict[tuple, tuple[triton.Config, dict]] = {}
_CHOSEN_BY: dict[tuple, tuple[str, dict]] = {}


def chosen_tiles() -> list[dict]:
    """What each shape key launched so far: ``{"rows", "pool", "n", "k", "experts", "flags", "tile", "source"}``
    (rows and pool: the key's power-of-2 buckets; flags: the kernel flags; tile: ``tiles.tile_of``; source: "table"
    or "autotune"). ``scripts/tune_tiles.py`` records the autotuned ones as a GPU class's table."""
    rows = []
    for key, (source, flags) in _CHOSEN_BY.items():
        rows_bucket, pool_bucket, n, k, num_experts = key[:5]
        rows.append({"rows": rows_bucket, "pool": pool_bucket, "n": n, "k": k, "experts": num_experts,
                     "flags": dict(flags), "tile": tiles.tile_of(_TUNED[key][0]), "source": source})
    return rows


def clear_tuned_configs() -> None:
    """Forget every tile autotune chose (`autotuned_kernel().cache` and `launch_gemm`'s record of it), so the next
    launch of each shape key autotunes again, on its own arguments.

    The key holds the rows hint and the pool's rows bucket, not the pool's layout, so in one process the pool tuned
    first picks the tile of every pool with the same key: a benchmark comparing such pools calls this before each
    one's first launch.

    Args:
        none.

    Returns:
        None.
    """
    _TUNED.clear()
    _CHOSEN_BY.clear()
    for same_bits in (False, True):
        autotuned_kernel(same_bits).cache.clear()


def tuned_launch_key(rows_buckets: tuple[int, int], n: int, k: int, num_experts: int, flags: dict,
                     tensors: tuple) -> tuple:
    """The key ``launch_gemm`` keeps the autotuner's choice under: the autotuner's own key (rows buckets, N, K,
    experts, kernel flags, tensor dtypes) plus the remaining flags, so a launch never reuses a config tuned for
    different compile-time flags.

    Args:
        rows_buckets: ``next_power_of_2`` of the rows hint and of the pool's rows (the kernel's ``rows_hint`` and
            ``pool_rows_bucket`` arguments).
        n, k, num_experts: the GEMM's sizes.
        flags: the kernel's constexpr flags of this launch.
        tensors: the launch's tensor arguments (their dtypes enter the key).

    Returns:
        a hashable tuple.
    """
    # the flags' order is fixed by launch_gemm, so their values alone key them
    return (*rows_buckets, n, k, num_experts, tuple(flags.values()), tuple(t.dtype for t in tensors))


def _check_args(x_PDx, gate_up_weight_e2FD, down_weight_eDF, row_start_e, num_rows_e, activation,
                x_scale_PDb, gate_up_scale, down_scale) -> bool:
    """Validate shapes/dtypes; returns whether this is the fp8 path."""
    if activation not in ("silu", "situ"):
        raise UnknownNameError(f"{activation=} must be 'silu' or 'situ'")
    if x_PDx.dim() != 2 or gate_up_weight_e2FD.dim() != 3 or down_weight_eDF.dim() != 3:
        raise ShapeError(f"expected x_PDx [R, D], gate_up [e, 2F, D], down [e, D, F]; got {tuple(x_PDx.shape)}, "
                         f"{tuple(gate_up_weight_e2FD.shape)}, {tuple(down_weight_eDF.shape)}")
    _check_layout_args(row_start_e, num_rows_e, gate_up_weight_e2FD.shape[0])
    if gate_up_weight_e2FD.dtype in (torch.int32, torch.uint8):
        raise DTypeError(f"packed 4-bit weights ({gate_up_weight_e2FD.dtype}) run on moe_ref.kernels.experts.grouped_mlp_w4 "
                         "(to_group_planes once, then grouped_mlp_w4), not grouped_mlp")
    _, hidden = x_PDx.shape
    num_experts, two_f, hidden_w = gate_up_weight_e2FD.shape
    inter = two_f // 2
    if two_f % 2 or hidden_w != hidden or tuple(down_weight_eDF.shape) != (num_experts, hidden, inter):
        raise ShapeError(f"weight shapes disagree: {tuple(x_PDx.shape)=}, {tuple(gate_up_weight_e2FD.shape)=}, "
                         f"{tuple(down_weight_eDF.shape)=} (want gate_up [e, 2F, D], down [e, D, F])")
    fp8 = x_PDx.dtype == FP8_DTYPE
    if fp8:
        expected = {
            "x_scale_PDb": (x_scale_PDb, (x_PDx.shape[0], num_fp8_groups(hidden))),
            "gate_up_scale": (gate_up_scale, (num_experts, num_fp8_groups(two_f), num_fp8_groups(hidden))),
            "down_scale": (down_scale, (num_experts, num_fp8_groups(hidden), num_fp8_groups(inter))),
        }
        for name, (tensor, shape) in expected.items():
            if tensor is None or tuple(tensor.shape) != shape or tensor.dtype != torch.float32:
                got = None if tensor is None else (tuple(tensor.shape), tensor.dtype)
                raise DTypeError(f"fp8 grouped_mlp needs {name} fp32 {shape}, got {got}")
        if gate_up_weight_e2FD.dtype != FP8_DTYPE or down_weight_eDF.dtype != FP8_DTYPE:
            raise DTypeError(f"fp8 x_PDx needs fp8 weights, got {gate_up_weight_e2FD.dtype}, {down_weight_eDF.dtype}")
    else:
        if x_PDx.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise DTypeError(f"x_PDx must be bf16/fp16/fp32 or {FP8_DTYPE}, got {x_PDx.dtype}")
        if gate_up_weight_e2FD.dtype != x_PDx.dtype or down_weight_eDF.dtype != x_PDx.dtype:
            raise DTypeError(f"weights must match {x_PDx.dtype=}: got {gate_up_weight_e2FD.dtype}, {down_weight_eDF.dtype}")
    return fp8


def _check_layout_args(row_start_e, num_rows_e, num_experts: int) -> None:
    for name, tensor in (("row_start_e", row_start_e), ("num_rows_e", num_rows_e)):
        if tuple(tensor.shape) != (num_experts,) or tensor.dtype not in (torch.int32, torch.int64):
            raise DTypeError(f"{name} must be int32/int64 [{num_experts}], got {tuple(tensor.shape)} {tensor.dtype}")


def grouped_mlp(
    x_PDx: torch.Tensor,
    gate_up_weight_e2FD: torch.Tensor,
    down_weight_eDF: torch.Tensor,
    row_start_e: torch.Tensor,
    num_rows_e: torch.Tensor,
    activation: str = "silu",
    situ_beta: float = 4.0,
    situ_linear_beta: float = 25.0,
    x_scale_PDb: torch.Tensor | None = None,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    *,
    num_rows_hint: int | None = None,
    zero_unused_rows: bool = True,
    gate_up_interleaved: bool = False,
    schedule: str | None = None,
    configs: tuple[triton.Config, triton.Config] | None = None,
    add_PDx: torch.Tensor | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Run every local expert's gated MLP on its rows of the receive pool (two Triton launches).

    Args:
        x_PDx: `[P, Dx]` bf16/fp16/fp32, or `torch.float8_e4m3fn` with `x_scale_PDb`; expert i owns rows
            `row_start_e[i] : row_start_e[i] + num_rows_e[i]` (segments must not overlap).
        gate_up_weight_e2FD: `[e, 2F, D]`, rows 0..F-1 gate, F..2F-1 up; x's dtype (fp8 for fp8 x). Packed 4-bit
            weights run on `moe_ref.kernels.experts.grouped_mlp_w4`.
        down_weight_eDF: `[e, D, F]`, same dtype rule.
        row_start_e: `[e]` int64 (or int32) first pool row of each expert (128-aligned by the dispatcher;
            any value works here).
        num_rows_e: `[e]` int32/int64 rows of each expert (0 = empty expert).
        activation: "silu" (h = silu(gate) * up) or "situ"
            (h = beta * tanh(gate / beta) * sigmoid(gate) * (lb * tanh(up / lb), or up if lb == 0)), fp32.
        situ_beta, situ_linear_beta: SiTU's beta and lb (Kimi-K3: 4.0, 25.0).
        x_scale_PDb: `[P, Db]` fp32 per-row per-128 scales of an fp8 x.
        gate_up_scale: `[e, ceil(2F/128), ceil(D/128)]` fp32 128x128 block scales of fp8 gate_up.
        down_scale: `[e, ceil(D/128), ceil(F/128)]` fp32 128x128 block scales of fp8 down.
        num_rows_hint: optional, about `sum(num_rows_e)` (known to the host without a sync, e.g. T * K);
            only picks GPU tile sizes (autotune key, bucketed to a power of 2). Default P.
        zero_unused_rows: rows outside every segment come out as 0 (True) or are left unwritten (False: the
            device-side dispatch passes its whole pool and reads only rows inside segments).
        gate_up_interleaved: gate_up's rows alternate 128-row gate and up blocks, and fp8 gate_up_scale's rows
            alike (`interleave_gate_up`, done once at load; F % 128 == 0): GEMM1 then runs one dot over 256
            weight rows per k-step instead of two over 128.
        schedule: how many programs each GEMM launches, one of `SCHEDULES` (the module docstring), or None (by the
            rows hint's regime); the same bytes for each.
        configs: None (autotune both GEMMs), or (GEMM1's, GEMM2's) `triton.Config` forcing their tiles, as
            `launch_gemm(..., config=...)` does (benchmarks comparing one tile on several inputs).
        add_PDx: None, or `[P, Dx]` of y's dtype added to the MLP's output in GEMM2's epilogue (its fp32 sums plus
            add, rounded once): the shared experts' output and the routed one summed without a launch of its own.
        batch_invariant: tiles of the precision's bits class only (`launch_gemm`): a row's bits do not depend on
            the rows hint or the other rows (the batch-invariant mode).

    Returns:
        y_PDx: `[P, Dx]` in x's dtype (bf16 for fp8 x), plus `add_PDx` on the rows inside segments; rows outside
        every segment are 0 (or unwritten).
        The intermediate h is kept in x's dtype (fp8 + per-128 scales on the fp8 path). No host sync.
    """
    fp8 = _check_args(x_PDx, gate_up_weight_e2FD, down_weight_eDF, row_start_e, num_rows_e, activation,
                          x_scale_PDb, gate_up_scale, down_scale)
    num_rows, hidden = x_PDx.shape
    num_experts, two_f, _ = gate_up_weight_e2FD.shape
    inter = two_f // 2
    out_dtype = torch.bfloat16 if fp8 else x_PDx.dtype
    device = x_PDx.device
    # the kernels write every row inside a segment; the rest is zeroed only when asked (a memset of the whole
    # pool: ~0.5 GB at 32768 routed rows of Kimi-K2, which the device-side dispatch never reads)
    allocate = torch.zeros if zero_unused_rows or num_experts == 0 or inter == 0 else torch.empty
    y_PDx = allocate(num_rows, hidden, dtype=out_dtype, device=device)
    if num_rows == 0 or num_experts == 0 or hidden == 0 or inter == 0:
        return y_PDx
    check_device("x_PDx", x_PDx)
    tensors = {"x_PDx": x_PDx, "gate_up_weight_e2FD": gate_up_weight_e2FD, "down_weight_eDF": down_weight_eDF,
               "x_scale_PDb": x_scale_PDb, "gate_up_scale": gate_up_scale, "down_scale": down_scale}
    for name, tensor in tensors.items():
        if tensor is not None and not tensor.is_contiguous():
            raise ShapeError(f"{name} must be contiguous (strides {tensor.stride()})")
    row_start_e = row_start_e.contiguous()
    num_rows_e = num_rows_e.contiguous()
    rows_hint = num_rows if num_rows_hint is None else num_rows_hint
    gate_up_config, down_config = (None, None) if configs is None else configs

    # GEMM1: h = act(x @ gate.T, x @ up.T)
    h_PF = torch.empty(num_rows, inter, dtype=FP8_DTYPE if fp8 else x_PDx.dtype, device=device)
    h_scale_PFb = torch.empty(num_rows, num_fp8_groups(inter), dtype=torch.float32, device=device) if fp8 else None
    launch_gemm(x_PDx, x_scale_PDb, gate_up_weight_e2FD, gate_up_scale, h_PF, h_scale_PFb, row_start_e, num_rows_e,
                n=inter, k=hidden, activation=activation, situ_beta=situ_beta, situ_linear_beta=situ_linear_beta,
                fp8=fp8, quant_out=fp8, rows_hint=rows_hint, interleaved=gate_up_interleaved,
                config=gate_up_config, schedule=schedule, batch_invariant=batch_invariant)
    # GEMM2: y = h @ down.T
    launch_gemm(h_PF, h_scale_PFb, down_weight_eDF, down_scale, y_PDx, None, row_start_e, num_rows_e,
                n=hidden, k=inter, activation="none", situ_beta=situ_beta, situ_linear_beta=situ_linear_beta,
                fp8=fp8, quant_out=False, rows_hint=rows_hint, config=down_config, schedule=schedule,
                add=add_PDx, batch_invariant=batch_invariant)
    return y_PDx


def interleave_gate_up(stacked_e2F_: torch.Tensor, rows_per_block: int = GATE_UP_BLOCK) -> torch.Tensor:
    """`[e, 2F, ...]` rows gate 0..F-1 then up 0..F-1 -> a contiguous copy whose rows alternate blocks of
    `rows_per_block` gate rows and the same up rows (`grouped_mlp(..., gate_up_interleaved=True)`). Weights take
    blocks of 128 rows; their FP8 block scales, one row per 128 weight rows, take `rows_per_block=1`. F must be a
    multiple of `rows_per_block`.

    Example (rows_per_block 2): rows [g0, g1, g2, g3, u0, u1, u2, u3] -> [g0, g1, u0, u1, g2, g3, u2, u3].
    """
    num_experts, two_f = stacked_e2F_.shape[:2]
    _check_gate_up_blocks(two_f // 2, rows_per_block)
    halves = stacked_e2F_.reshape(num_experts, 2, two_f // 2 // rows_per_block, rows_per_block,
                                  *stacked_e2F_.shape[2:])
    return halves.transpose(1, 2).reshape(stacked_e2F_.shape).contiguous()


def deinterleave_gate_up(interleaved_e2F_: torch.Tensor, rows_per_block: int = GATE_UP_BLOCK) -> torch.Tensor:
    """Inverse of `interleave_gate_up` (a contiguous copy).

    Example (rows_per_block 2): rows [g0, g1, u0, u1, g2, g3, u2, u3] -> [g0, g1, g2, g3, u0, u1, u2, u3].
    """
    num_experts, two_f = interleaved_e2F_.shape[:2]
    _check_gate_up_blocks(two_f // 2, rows_per_block)
    blocks = interleaved_e2F_.reshape(num_experts, two_f // 2 // rows_per_block, 2, rows_per_block,
                                      *interleaved_e2F_.shape[2:])
    return blocks.transpose(1, 2).reshape(interleaved_e2F_.shape).contiguous()


def _check_gate_up_blocks(inter: int, rows_per_block: int) -> None:
    if rows_per_block < 1 or inter % rows_per_block:
        raise ShapeError(f"gate/up interleaving in blocks of {rows_per_block} rows needs F % {rows_per_block} == 0, "
                         f"got F={inter}: keep these rows stacked (gate_up_interleaved=False)")


# --------------------------------------------------------------------------------------------------
# torch twin
# --------------------------------------------------------------------------------------------------
def _dequantize_block_128(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8 `[N, K]` weight with fp32 128x128 block scales `[ceil(N/128), ceil(K/128)]` -> fp32."""
    n, k = w.shape
    scale_full = scale.repeat_interleave(128, dim=0)[:n].repeat_interleave(128, dim=1)[:, :k]
    return w.float() * scale_full


def grouped_mlp_ref(
    x_PDx: torch.Tensor,
    gate_up_weight_e2FD: torch.Tensor,
    down_weight_eDF: torch.Tensor,
    row_start_e: torch.Tensor,
    num_rows_e: torch.Tensor,
    activation: str = "silu",
    situ_beta: float = 4.0,
    situ_linear_beta: float = 25.0,
    x_scale_PDb: torch.Tensor | None = None,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    *,
    num_rows_hint: int | None = None,
    zero_unused_rows: bool = True,
    gate_up_interleaved: bool = False,
    add_PDx: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch twin of `grouped_mlp` (same arguments and return): a loop over experts in fp32.

    Matches the kernel's roundings: h is rounded to x's dtype (non-fp8) or re-quantized to fp8 per row
    per 128 columns (fp8) before GEMM2 (unused rows always come out as 0). NOTE: `.tolist()` on the row counts syncs the host.
    """
    fp8 = _check_args(x_PDx, gate_up_weight_e2FD, down_weight_eDF, row_start_e, num_rows_e, activation,
                          x_scale_PDb, gate_up_scale, down_scale)
    if gate_up_interleaved:
        gate_up_weight_e2FD = deinterleave_gate_up(gate_up_weight_e2FD)
        if gate_up_scale is not None:
            gate_up_scale = deinterleave_gate_up(gate_up_scale, rows_per_block=1)
    num_rows, hidden = x_PDx.shape
    inter = gate_up_weight_e2FD.shape[1] // 2
    out_dtype = torch.bfloat16 if fp8 else x_PDx.dtype
    y_PDx = torch.zeros(num_rows, hidden, dtype=out_dtype, device=x_PDx.device)
    for i, (start, count) in enumerate(zip(row_start_e.tolist(), num_rows_e.tolist())):
        if count == 0:
            continue
        rows = slice(start, start + count)
        if fp8:
            seg_x_PDx = dequantize_fp8_per_128(x_PDx[rows], x_scale_PDb[rows])
            gate_up_2FDx = _dequantize_block_128(gate_up_weight_e2FD[i], gate_up_scale[i])
            down_DxF = _dequantize_block_128(down_weight_eDF[i], down_scale[i])
        else:
            seg_x_PDx = x_PDx[rows].float()
            gate_up_2FDx = gate_up_weight_e2FD[i].float()
            down_DxF = down_weight_eDF[i].float()
        seg_gate_up_P2F = seg_x_PDx @ gate_up_2FDx.T
        seg_h_PF = gated_activation(seg_gate_up_P2F[:, :inter], seg_gate_up_P2F[:, inter:], activation, situ_beta,
                                    situ_linear_beta)
        if fp8:
            seg_h_PF = dequantize_fp8_per_128(*quantize_fp8_per_128(seg_h_PF))
        else:
            seg_h_PF = seg_h_PF.to(x_PDx.dtype).float()
        seg_y_PDx = seg_h_PF @ down_DxF.T
        if add_PDx is not None:
            seg_y_PDx = seg_y_PDx + add_PDx[rows].float()
        y_PDx[rows] = seg_y_PDx.to(out_dtype)
    return y_PDx
