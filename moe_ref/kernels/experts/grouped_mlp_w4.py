"""Grouped expert MLP over 4-bit weights (W4A16: INT4 or MXFP4 weights, bf16/fp16/fp32 activations).

    router -> pre_dispatch -> dispatch -> [grouped_mlp_w4] -> combine -> combine_reduce

The same MLP as ``moe_ref.kernels.experts.grouped_mlp`` (GEMM1 gate||up, the activation, then GEMM2, on an expert-major
pool), with the weights kept 4-bit in memory and decoded in registers:

    gate_up[r] = sum_g s_gate_up[g] * (x[r, g] @ q_gate_up[:, g].T)      (fp32 sums, ``_w4_gemm_kernel``)
    h[r] = act(gate_up[r, :F], gate_up[r, F:])                           (its epilogue, rounded to x's dtype)
    y[r] = sum_g s_down[g] * (h[r, g] @ q_down[:, g].T)                  g: the groups of 32 input features

GEMM1 and the activation are one launch, GEMM2 the other. A GEMM1 program's BLOCK_N weight rows are BLOCK_N / 2 gate
rows and the up rows of the same output features: its main loop is the plain GEMM's (one weight stream, one
accumulator), and the epilogue pairs the accumulator's two halves. A program with a gate tile and an up tile (two
streams, two accumulators) ran 1-6% slower at decode than the plain GEMM with the activation a kernel of its own
(docs/RESULTS.md, "Tried and not kept"); this one saves that kernel and the fp32 round
trip of ``[P, 2F]``: 386.2 -> 363.8 us for MXFP4 at 512 rows of 48 Kimi-K2 experts, both GEMMs at (16, 64, 4, 3)
(2026-12-02, one H200; docs/RESULTS.md, "Tried and not kept").

Why a kernel of its own, and its weight layout. Decoding 4-bit weights is cheap only where it happens in the
registers the tensor cores read; a decoded tile that goes back through shared memory costs more than the bytes it
saves. Triton keeps the decode in the MMA's register layout when (a) the weight is the MMA's A operand (the kernel
computes ``out.T = W @ x.T``: on Hopper ``wgmma`` takes A from registers, B from shared memory) and (b) the decode
is elementwise on the loaded words (a per-row operand broadcast along them is fine).

With bf16 x the decode's last packed FMA also applies the group's scale (``FOLD``), so the dots accumulate in place,
none waiting for its result, and on the wgmma tiles (BLOCK_M >= 16, BLOCK_N >= 64) one dot takes the 4 groups of a
half block, their decoded planes put side by side in registers (``ONE_DOT``):
- MXFP4: the scale is a power of two, so the weights come out exact in bf16.
- INT4: ``bf16((code - 8) * s) / 16``, the product rounded once (the bf16 weights compressed-tensors' own
  dequantization gives, and the peers' W4A16 kernels use) over 16, the power of two that lets each plane be read
  where it lies in its word; the kernel multiplies its fp32 sums by 16.
- Each FMA reads its group's multiplier from one bf16 half of a register two groups share (an operand swizzle).
- Scales the bf16 FMA cannot hold (INT4 |s| >= ``w4.INT4_FOLD_SCALE_LIMIT``, nonzero below ``w4.INT4_FOLD_MIN_SCALE``
  or not bf16, MXFP4 bytes above ``w4.MXFP4_FOLD_MAX_SCALE_BYTE``: ``W4Weight.foldable``), and fp16/fp32 x, take the
  fp32 route: one dot per group of 32 input features, its scale multiplying the dot's fp32 result.
Measured at 512 rows of 48 Kimi-K2 experts, best forced tiles (2026-12-02, one H200; docs/RESULTS.md): the fold took
INT4 from 453.6 to 400.0 us ("INT4 scales folded into the decode"); reading the planes where they lie and the scales
from one half took it from 395.9 to 374.0 us in one run, (16, 64, 4, 3) from 399 to 328 sm_90a instructions a
k-block, and MXFP4 (its multipliers two instructions a pair of groups) from 395.2 to 388.5 us ("INT4 planes read
where they lie").

The decode in the MMA's registers needs each group's 32 codes together, in the order the registers take them:
``moe_ref.kernels.experts.w4.to_group_planes`` rewrites each weight row once, at load (in place where it can). In a block of
256 input features (8 groups), word i of half h holds feature 2i of group ``4 h + p`` (plane p) in its low 16 bits and
feature 2i + 1 in its high 16 bits: INT4 in nibble p of each half, so ``(word >> 4 p) & 0x000F000F`` is the pair;
MXFP4 with each code's e|m and sign bits where the PTX decode wants few instructions to move them
(``w4.MXFP4_PLANE_BITS``). A packed subtract or multiply turns the pair into the register pair the MMA reads
(``_decode_pairs``), and 16 words are one group, its x operand 32 contiguous columns. Rows are padded to whole blocks
(the code of 0.0; x's padding reads as 0), scales are stored block-major (``[e, I/256, O, 8]``: a row's 8 scales of one
k-block are one vector load).

Numerics: folded, the dots take bf16 weights as above (MXFP4 exact, INT4 rounded once); on the fp32 route the codes
are exact in x's dtype and each group's dot accumulates in fp32 and is scaled in fp32 (more exact than the bf16
weights: calc_diff 2.8e-6 against 5.8e-6 for INT4 at Kimi-K2's shape). The twin (``grouped_mlp_w4_ref``) multiplies
by the exactly dequantized fp32 weights, so kernel and twin differ by fp32 summation order, INT4's weight rounding and
the roundings of h and y to x's dtype that follow: tests compare them with a tolerance, and the decode itself bit for
bit (INT4 folded: against torch's ``bf16((code - 8) * s) / 16``).

Shape legend: P receive-pool rows, Dx expert input width, F expert intermediate, e local experts, O and I one
weight matrix's output and input features. Suffixes of a stored last dim: ``q`` the checkpoint's packed width,
``w`` int32 words of 8 codes (I rounded up to whole 256-feature blocks, over 8), ``g`` group-32 scales.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from moe_ref.core.activations import gated_activation
from moe_ref.core.errors import DTypeError, InvalidConfigError, ShapeError, UnknownNameError
from moe_ref.kernels.runtime._triton_utils import (ACTIVATION_CODES, FP8_DTYPE, cdiv, check_device, gated_act,
                                                   div_rn, is_interpreter, launch_options, next_power_of_2,
                                                   split_halves, to_e4m3, to_e5m2)
from moe_ref.kernels.experts.grouped_mlp import expert_block_rows, expert_table
from moe_ref.kernels.experts.quantize_rows import quantize_rows_fp8, quantize_rows_fp8_ref
from moe_ref.kernels.runtime.launch import launch
from moe_ref.kernels.experts.w4 import (A8_INT4_MIN_EXPONENT, MXFP4_PLANE_BITS, PLANE_BLOCK, WORDS_PER_BLOCK,
                                        W4Weight, a8_weights_eOI, dequantize_planes)

__all__ = ["TILES", "clear_tuned_tiles", "grouped_mlp_w4", "grouped_mlp_w4_ref", "launch_w4_gemm", "tiles_for",
           "tuned_tiles"]

_FORMATS = {"int4": 1, "mxfp4": 2}  # the kernel's W4 flag
_MXFP4_PLANE_BITS = tl.constexpr(MXFP4_PLANE_BITS)  # read by the Triton decode
_NEG_ZERO_BF16X2 = tl.constexpr(-2147450880)  # 0x80008000: -0.0 in both bf16 halves, MXFP4's decode bias
# The PTX that puts plane p's two codes into the bf16 halves of register t, per plane (``_placed_fma_asm``):
# MXFP4's e|m at bits 6..8 and its sign at bit 15 (``_decode_mxfp4_bf16_plane_asm``); INT4's code at bits 0..3 (even
# planes) or 4..7 (odd planes), planes 2 and 3 from the word shifted right by 8 (``_decode_int4_bf16_plane_asm``)
_MXFP4_BF16_PLACE = tl.constexpr((
    "and.b32 t, $2, 0x81C081C0; ",
    "shl.b32 t, $2, 3; and.b32 t, t, 0x81C081C0; ",
    "and.b32 t, $2, 0x40074007; mul.lo.u32 t, t, 66; and.b32 t, t, 0x81C081C0; ",
    "shr.b32 t, $2, 3; shl.b32 s, $2, 2; and.b32 s, s, 0x80008000; lop3.b32 t, t, 0x01C001C0, s, 0xea; ",
))
_INT4_BF16_PLACE = tl.constexpr((
    "and.b32 t, $2, 0x000F000F; ",
    "and.b32 t, $2, 0x00F000F0; ",
    "and.b32 t, $2, 0x000F000F; ",
    "and.b32 t, $2, 0x00F000F0; ",
))


# --------------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------------
@triton.jit
def _decode(codes, W4: tl.constexpr, DTYPE: tl.constexpr):
    """Exact DTYPE values of int32 4-bit codes 0..15 (one per element; the fp32 path): INT4 ``code - 8``, MXFP4
    E2M1 (s|ee|m: e > 0 -> ``2**(e-1) * (1 + m/2)``, e == 0 -> ``m / 2``; bit 3 the sign).

    Example: INT4 code 3 -> -5.0; MXFP4 code 0xB (s 1, e 01, m 1) -> -1.5; 0x1 -> 0.5.
    """
    if W4 == 1:
        return (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # 2**23 + code - (2**23 + 8)
    mag = codes & 7
    bits = tl.where(mag < 2, mag * 0x3F000000, (mag << 22) + 0x3F000000) | ((codes & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _decode_pairs(pairs, W4: tl.constexpr, DTYPE: tl.constexpr):
    """``[BLOCK_N, 16]`` int32 holding two codes each (bits 0..3: feature 2i of a group, bits 16..19: feature
    2i + 1; the other bits are ignored: INT4 words come shifted, not masked) -> the group's
    ``[BLOCK_N, 32]`` exact values in DTYPE, features in order (MXFP4 with bf16 x: the values times 2**-14, a factor
    ``_group_scale`` takes back: it saves a multiply per value). The Triton decode, which the interpreter runs;
    ``_decode_plane`` picks the PTX decodes (the same bits) on a GPU.

    16-bit DTYPEs decode both codes of a word at once: the word becomes two 16-bit patterns, then one packed
    subtract or multiply makes them exact. INT4: ``0x4300 | code`` is 128 + code in bf16 (``0x6400``: 1024 + code in
    fp16), minus 136 (1032). MXFP4: ``e|m`` placed in fp16's lowest exponent bits and top mantissa bit, and the
    sign, is 2**-14 times the E2M1 value (subnormal in fp16 for e == 0, which fp16 keeps everywhere: bf16 subnormals
    would be flushed by the interpreter); fp16 x then multiplies by 2**14, bf16 x converts (2**-15 is a normal
    bf16). Joined as (2i, 2i + 1), the word is already the register pair the MMA reads: Triton keeps the whole
    decode in the MMA operand's registers. The arithmetic is written in fp32 (the interpreter's 16-bit floats are
    not IEEE), which LLVM narrows back to packed 16-bit instructions.

    Example (bf16, INT4): word 0x000B0003 -> patterns 0x4303, 0x430B -> 131 - 136 = -5.0, 139 - 136 = 3.0.
        (MXFP4) word 0x00010003: codes 3 (e 01, m 1) and 1 (e 00, m 1) -> fp16 patterns 0x0600 (1.5 * 2**-14) and
        0x0200 (2**-15) -> 1.5, 0.5 (bf16 x: 1.5 * 2**-14, 2**-15).
    """
    pairs = pairs & 0x000F000F
    if DTYPE == tl.float32:
        values = tl.join(_decode(pairs & 0xF, W4, DTYPE), _decode((pairs >> 16) & 0xF, W4, DTYPE))
        values = tl.reshape(values, (pairs.shape[0], 2 * pairs.shape[1]))
    else:
        values = _decode_16bit_pairs(pairs, W4, DTYPE)
    return values.to(DTYPE)


@triton.jit
def _decode_int4_pairs_asm(words, DTYPE: tl.constexpr):
    """INT4 ``_decode_pairs`` in two PTX instructions per word: one ``lop3`` keeps the two codes and ORs in the
    magic exponent ((w & 0x000F000F) | 0x43004300: 128 + code in bf16, 1024 + code in fp16), one packed FMA
    subtracts 136 (1032). Written as PTX because LLVM emits the mask and the OR as two instructions."""
    if DTYPE == tl.bfloat16:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b32 t, one, bias; mov.b32 one, 0x3F803F80; mov.b32 bias, 0xC308C308; "
            "lop3.b32 t, $2, 0x000F000F, 0x43004300, 0xea; fma.rn.bf16x2 t, t, one, bias; mov.b32 {$0, $1}, t; }",
            "=h,=h,r", [words], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
    else:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b32 t, one, bias; mov.b32 one, 0x3C003C00; mov.b32 bias, 0xE408E408; "
            "lop3.b32 t, $2, 0x000F000F, 0x64006400, 0xea; fma.rn.f16x2 t, t, one, bias; mov.b32 {$0, $1}, t; }",
            "=h,=h,r", [words], dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
    return tl.reshape(tl.join(lo, hi), (words.shape[0], 2 * words.shape[1]))


@triton.jit
def _decode_plane(words, PLANE: tl.constexpr, W4: tl.constexpr, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """Group plane PLANE (0..3) of ``[BLOCK_N, 16]`` words (``w4.to_group_planes``: features 2i and 2i + 1 of the
    group in the low and high 16 bits) -> its ``[BLOCK_N, 32]`` values, as ``_decode_pairs`` gives them. ASM (a GPU)
    picks the PTX decodes, the same bits in fewer instructions: INT4 in a 16-bit DTYPE (``_decode_int4_pairs_asm``),
    MXFP4 with bf16 x (``_decode_mxfp4_bf16_plane_asm``, which reads the plane's bits where they are)."""
    if ASM and W4 == 2 and DTYPE == tl.bfloat16:
        return _decode_mxfp4_bf16_plane_asm(words, PLANE, tl.full((words.shape[0],), 0x77807780, tl.int32))
    if ASM and W4 == 1 and DTYPE != tl.float32:
        return _decode_int4_pairs_asm(words >> (4 * PLANE), DTYPE)
    if W4 == 2:
        return _decode_pairs(_mxfp4_plane_pairs(words, PLANE), W4, DTYPE)
    return _decode_pairs(words >> (4 * PLANE), W4, DTYPE)


@triton.jit
def _mxfp4_plane_pairs(words, PLANE: tl.constexpr):
    """MXFP4 plane PLANE's two codes per word at bits 0..3 and 16..19 (``_decode_pairs``' input), gathered from
    their e|m and sign offsets (``w4.MXFP4_PLANE_BITS``)."""
    EM: tl.constexpr = _MXFP4_PLANE_BITS[PLANE][0]
    SIGN: tl.constexpr = _MXFP4_PLANE_BITS[PLANE][1]
    return ((words >> EM) & 0x00070007) | (((words >> SIGN) & 0x00010001) << 3)


@triton.jit
def _decode_mxfp4_bf16_plane_asm(words, PLANE: tl.constexpr, multiplier):
    """MXFP4 codes of plane PLANE for bf16 x in PTX, times ``multiplier`` (int32 ``[BLOCK_N]``, a power of two in both
    bf16 halves).

    Each code's e|m goes to bf16's two lowest exponent bits and top mantissa bit (bits 6..8, mask ``0x01C001C0``) and
    its sign to bit 15: that bf16 is 2**-126 times the E2M1 value, a subnormal when e == 0. ``w4.MXFP4_PLANE_BITS``
    places the planes so that this takes one mask (plane 0), a shift and a mask (plane 1), a mask, one multiply by
    ``2**6 + 2**1`` (e|m up by 6 and the sign up by 1 at once, the two copies never overlapping) and a mask (plane 2),
    or two shifts, a mask and a merge (plane 3): 14 instructions a word with the FMAs, against 19 with the codes in
    nibbles. One packed FMA by the multiplier then makes the value normal and exact: 2**112 gives the
    ``_decode_pairs`` values (2**-14 * E2M1), a group's ``2**(byte + 1)`` its dequantized weights
    (``E2M1 * 2**(byte - 125)``). The GPU's bf16 FMA keeps subnormal inputs (the interpreter's would not: it runs the
    Triton route); the decode tests check every code pair of every plane.

    Example: plane 1 code 0x9 (sign 1, e 00, m 1: -0.5) at bits 3..5 = 1, bit 12 = 1 -> shifted left by 3 and masked:
    0x8040 (-2**-127) -> times 2**112: -2**-15 = -0.5 * 2**-14.
    """
    return _placed_fma_asm(words, _MXFP4_BF16_PLACE, PLANE, multiplier,
                           tl.full(multiplier.shape, _NEG_ZERO_BF16X2, tl.int32))


@triton.jit
def _placed_fma_asm(words, PLACES: tl.constexpr, PLANE: tl.constexpr, multiplier, bias):
    """``[BLOCK_N, 16]`` int32 words -> ``[BLOCK_N, 32]`` bf16: per word, the PTX ``PLACES[PLANE]`` puts the plane's
    two codes' bits into the two bf16 halves of ``t`` (scratch register ``s``), then one packed FMA,
    ``t * multiplier + bias``, gives the pair in feature order (2i, 2i + 1). ``multiplier``, ``bias``: ``[BLOCK_N]``
    int32, per row, the plane's bf16 in half ``PLANE % 2`` (low for even planes: the scales of groups 2j and 2j + 1
    share a register). The FMA reads that half twice: ptxas makes it an operand swizzle, not an instruction."""
    place: tl.constexpr = PLACES[PLANE]
    half: tl.constexpr = "{l, l}" if PLANE % 2 == 0 else "{h, h}"
    lo, hi = tl.inline_asm_elementwise(
        "{ .reg .b32 s, t, m, b; .reg .b16 l, h; " + place + "mov.b32 {l, h}, $3; mov.b32 m, " + half + "; "
        "mov.b32 {l, h}, $4; mov.b32 b, " + half + "; fma.rn.bf16x2 t, t, m, b; mov.b32 {$0, $1}, t; }",
        "=h,=h,r,r,r", [words, tl.broadcast_to(multiplier[:, None], words.shape),
                        tl.broadcast_to(bias[:, None], words.shape)], dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True, pack=1)
    return tl.reshape(tl.join(lo, hi), (words.shape[0], 2 * words.shape[1]))


@triton.jit
def _decode_int4_bf16_plane_asm(words, PLANE: tl.constexpr, multiplier, bias):
    """INT4 codes of plane PLANE for bf16 x in PTX, dequantized over 16: ``round_bf16((code - 8) * s) / 16``, one
    rounding (the kernel multiplies its fp32 sums by 16).

    The plane's two codes are masked where they are, in the word (planes 0, 1) or in the word shifted right by 8
    (planes 2, 3; one shift for both): at bits 0..3 of each bf16 half (even planes) that is ``code * 2**-133``, at bits
    4..7 (odd planes) ``code * 2**-129``, subnormal or normal without a gap. One packed FMA by ``multiplier``
    (``s * 2**129`` or ``s * 2**125``) plus ``bias`` (``-s / 2``) gives ``(code * s - 8 s) / 16`` exactly, rounded
    once to bf16, the same bits as the product rounded, then over 16, where that is normal (every nonzero
    |s| >= ``w4.INT4_FOLD_MIN_SCALE``).
    """
    if PLANE >= 2:
        words = words >> 8
    return _placed_fma_asm(words, _INT4_BF16_PLACE, PLANE, multiplier, bias)


@triton.jit
def _decode_16bit_pairs(pairs, W4: tl.constexpr, DTYPE: tl.constexpr):
    """`_decode_pairs` for a 16-bit DTYPE (fp32 values, exact in DTYPE): both codes of a word at once."""
    PATTERN: tl.constexpr = tl.float16 if W4 == 2 else DTYPE
    if W4 == 2:
        bits = (pairs & 0x00070007) * 0x200 + (pairs & 0x00080008) * 0x1000
    elif DTYPE == tl.bfloat16:
        bits = pairs | 0x43004300
    else:
        bits = pairs | 0x64006400
    lo = (bits & 0xFFFF).to(tl.int16).to(PATTERN, bitcast=True)
    hi = (bits >> 16).to(tl.int16).to(PATTERN, bitcast=True)
    values = tl.reshape(tl.join(lo, hi), (pairs.shape[0], 2 * pairs.shape[1])).to(tl.float32)
    if W4 == 2 and DTYPE == tl.float16:
        values = values * 16384.0
    elif W4 == 1 and DTYPE == tl.bfloat16:
        values = values - 136.0
    elif W4 == 1:
        values = values - 1032.0
    # MXFP4 in bf16 stays 2**-14 * E2M1 (normal bf16 numbers, so exact): the 2**14 is in the group scale
    return values


@triton.jit
def _load_block_scales(s_rows, kb, stride_s_b, mask):
    """The stored group scales of k-block ``kb`` (its 8 groups) for a tile's rows: one ``[BLOCK_N, 8]`` load (a row's
    8 scales are contiguous, ``w4.block_major_scales``), split in registers into 8 ``[BLOCK_N]``, group order."""
    return _split_groups(tl.load(s_rows + kb * stride_s_b, mask=mask, other=0))


@triton.jit
def _split_groups(tile):
    """``[BLOCK_N, 8]`` -> its 8 columns ``[BLOCK_N]``, in order (register moves only)."""
    evens, odds = tl.split(tl.reshape(tile, (tile.shape[0], 4, 2)))  # groups 0 2 4 6 | 1 3 5 7
    g04, g26 = tl.split(tl.reshape(evens, (tile.shape[0], 2, 2)))
    g15, g37 = tl.split(tl.reshape(odds, (tile.shape[0], 2, 2)))
    g0, g4 = tl.split(g04)
    g2, g6 = tl.split(g26)
    g1, g5 = tl.split(g15)
    g3, g7 = tl.split(g37)
    return g0, g1, g2, g3, g4, g5, g6, g7


@triton.jit
def _group_scale(scale, W4: tl.constexpr, DTYPE: tl.constexpr):
    """A group's stored scales ``[BLOCK_N]`` as the fp32 route's dot takes them: fp32, INT4 as stored, MXFP4 E8M0
    bytes ``2**(byte - 125)``, times 2**14 where x is bf16 (its decoded values are 2**-14 times E2M1's,
    ``_decode_16bit_pairs``)."""
    if W4 == 2 and DTYPE == tl.bfloat16:
        scale = ((scale.to(tl.int32) + 16) << 23).to(tl.float32, bitcast=True)
    elif W4 == 2:
        scale = ((scale.to(tl.int32) + 2) << 23).to(tl.float32, bitcast=True)
    else:
        scale = scale.to(tl.float32)
    return scale  # one return: Triton types every return statement, also those of branches a constexpr leaves out


@triton.jit
def _group_dot(acc, words, PLANE: tl.constexpr, x_t, scale, W4: tl.constexpr, UPCAST: tl.constexpr,
               IEEE_FP32: tl.constexpr, ASM: tl.constexpr):
    """``acc + scale * (q @ x_t)`` for one group of 32 input features: q ``[BLOCK_N, 32]`` decoded from plane PLANE
    of ``words`` (``_decode_plane``), x_t ``[32, BLOCK_M]``, ``scale`` the group's ``[BLOCK_N]`` fp32 scales
    (``_group_scale``), applied to the fp32 dot (the route without FOLD)."""
    q = _decode_plane(words, PLANE, W4, x_t.dtype, ASM)
    # one return: Triton types every return statement, also those of branches a constexpr leaves out
    if UPCAST:
        product = tl.dot(q.to(tl.float32), x_t.to(tl.float32), input_precision="ieee")
    elif IEEE_FP32:
        product = tl.dot(q, x_t, input_precision="ieee")
    else:
        product = tl.dot(q, x_t)
    return acc + product * scale[:, None]


@triton.jit
def _folded_plane(words, PLANE: tl.constexpr, multiplier, bias, W4: tl.constexpr):
    """Plane PLANE of ``[BLOCK_N, 16]`` words, dequantized in the decode (FOLD): ``[BLOCK_N, 32]`` bf16.
    ``multiplier``, ``bias``: the group's, as ``_fold_multipliers`` gives them (MXFP4 has no bias)."""
    if W4 == 2:
        q = _decode_mxfp4_bf16_plane_asm(words, PLANE, multiplier)
    else:
        q = _decode_int4_bf16_plane_asm(words, PLANE, multiplier, bias)
    return q


@triton.jit
def _int4_fold_pair(word):
    """Two stored INT4 bf16 scales (groups 2j: low half, 2j + 1: high) -> the groups' decode multipliers (low
    ``s * 2**129``, high ``s * 2**125``) and biases (``-s / 2``), each pair an int32
    (``_decode_int4_bf16_plane_asm``'s). Three packed multiplies, exact for the scales ``W4Weight.foldable`` admits."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 big, shift, half; mov.b32 big, 0x7F007F00; mov.b32 shift, 0x3E804080; "
        "mov.b32 half, 0xBF00BF00; mul.rn.bf16x2 $0, $2, big; mul.rn.bf16x2 $0, $0, shift; "
        "mul.rn.bf16x2 $1, $2, half; }",
        "=r,=r,r", [word], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _mxfp4_fold_pair(word, BYTES: tl.constexpr, addend, A8: tl.constexpr):
    """Scale bytes BYTES (``"10"``: bytes 0 and 1, ``"32"``: 2 and 3) of ``word``, groups 2j and 2j + 1 -> their
    ``2**(byte + 1)`` as bf16 in the low and high half (``_decode_mxfp4_bf16_plane_asm``'s multipliers):
    ``(byte + 128) << 7``, no carry for bytes up to ``w4.MXFP4_FOLD_MAX_SCALE_BYTE``. A byte permute puts the two
    bytes at the bottom of the halves, one multiply-add shifts and offsets both. A8: ``(byte << 7) + addend`` with the
    row's ``addend`` (``[BLOCK_N]`` int32, ``w4.a8_tables``), the multipliers ``2**(byte - S + 127)`` (S the row's
    largest byte: at most 2**127, so any byte folds)."""
    if A8:
        pair = tl.inline_asm_elementwise(
            "{ .reg .b32 t; prmt.b32 t, $1, 0, 0x4" + BYTES[0] + "4" + BYTES[1] + "; mad.lo.u32 $0, t, 128, $2; }",
            "=r,r,r", [word, tl.broadcast_to(addend, word.shape)], dtype=tl.int32, is_pure=True, pack=1)
    else:
        pair = tl.inline_asm_elementwise(
            "{ .reg .b32 t; prmt.b32 t, $1, 0, 0x4" + BYTES[0] + "4" + BYTES[1] + "; "
            "mad.lo.u32 $0, t, 128, 0x40004000; }", "=r,r", [word], dtype=tl.int32, is_pure=True, pack=1)
    return pair


@triton.jit
def _fold_multipliers(s_ptr, s_row0, kb, stride_s_b, offs_n, mask, W4: tl.constexpr, a8_fold, A8: tl.constexpr):
    """FOLD: k-block ``kb``'s 8 groups -> (multipliers, biases), 8 ``[BLOCK_N]`` int32 each, for ``_folded_plane``:
    group g's in half ``g % 2``, groups 2j and 2j + 1 sharing a register (INT4 as ``_int4_fold_pair``; MXFP4 as
    ``_mxfp4_fold_pair``, whose decode adds -0.0: no bias). A8: MXFP4's multipliers take the rows' ``a8_fold``
    (``[BLOCK_N]`` int32) addends; INT4's are unchanged (``_a8_weights`` normalizes the decoded tile)."""
    if W4 == 2:  # a row's 8 scale bytes as 2 int32 words, four groups each
        words = (s_ptr + s_row0 + kb * stride_s_b).to(tl.pointer_type(tl.int32), bitcast=True) + offs_n[:, None] * 2
        w03, w47 = tl.split(tl.load(words + tl.arange(0, 2)[None, :], mask=mask[:, None], other=0))
        m01, m23 = _mxfp4_fold_pair(w03, "10", a8_fold, A8), _mxfp4_fold_pair(w03, "32", a8_fold, A8)
        m45, m67 = _mxfp4_fold_pair(w47, "10", a8_fold, A8), _mxfp4_fold_pair(w47, "32", a8_fold, A8)
        b01 = tl.full(m01.shape, _NEG_ZERO_BF16X2, tl.int32)
        b23, b45, b67 = b01, b01, b01
    else:  # a row's 8 bf16 scales as 4 int32 words, two groups each
        words = (s_ptr + s_row0 + kb * stride_s_b).to(tl.pointer_type(tl.int32), bitcast=True) + offs_n[:, None] * 4
        tile = tl.load(words + tl.arange(0, 4)[None, :], mask=mask[:, None], other=0)
        w02, w13 = tl.split(tl.reshape(tile, (tile.shape[0], 2, 2)))  # words 0 2 | 1 3
        w0, w2 = tl.split(w02)
        w1, w3 = tl.split(w13)
        m01, b01 = _int4_fold_pair(w0)
        m23, b23 = _int4_fold_pair(w1)
        m45, b45 = _int4_fold_pair(w2)
        m67, b67 = _int4_fold_pair(w3)
    return (m01, m01, m23, m23, m45, m45, m67, m67), (b01, b01, b23, b23, b45, b45, b67, b67)


@triton.jit
def _a8_weights(q, a8_fold, W4: tl.constexpr):
    """W4A8 on the PTX route: a decoded ``[BLOCK_N, K]`` bf16 tile (``_folded_plane``s) -> the fp8 tile the dot takes.
    MXFP4 comes out of the decode already divided by its rows' A8 scales (``_mxfp4_fold_pair``): e5m2 (``to_e5m2``;
    exact where ``W4Weight.a8_exact``). INT4 comes out as ``w / 16``: times the rows' bf16 ``2**(8 - S)`` (the low
    half of ``a8_fold``, exact), then rounded to e4m3 (``to_e4m3``)."""
    if W4 == 2:
        q8 = to_e5m2(q.to(tl.float32))
    else:
        norm = (a8_fold & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
        q8 = to_e4m3((q * norm[:, None]).to(tl.float32))
    return q8


@triton.jit
def _a8_group_dot(acc, words, PLANE: tl.constexpr, x_t, scale, inv_row_scale, W4: tl.constexpr,
                  UPCAST: tl.constexpr):
    """W4A8 on the Triton route (the interpreter; GPU weights the fold cannot take): ``acc + q8 @ x_t`` for one
    group of 32 input features, q8 the group's weights (exact in fp32: value times scale), INT4's rounded to bf16 as
    the fold rounds them, over the rows' A8 scales (``inv_row_scale``, ``[BLOCK_N]`` fp32 powers of two), cast to
    fp8 (MXFP4 e5m2, exact; INT4 e4m3); x_t ``[32, BLOCK_M]`` e4m3."""
    w = _decode_plane(words, PLANE, W4, tl.float32, False) * _group_scale(scale, W4, tl.float32)[:, None]
    if W4 == 1:  # to the nearest bf16 (even on ties) on the bit pattern: the interpreter's bf16 cast is not IEEE
        bits = w.to(tl.int32, bitcast=True)
        w = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    w = w * inv_row_scale[:, None]
    if W4 == 2:
        q8 = to_e5m2(w)
    else:
        q8 = to_e4m3(w)
    if UPCAST:  # the interpreter's fp8 dot is not IEEE: fp32 operands (every fp8 value is exact in fp32)
        acc = tl.dot(q8.to(tl.float32), x_t.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(q8, x_t, acc)
    return acc


@triton.jit
def _cat_k(a, b):
    """``[R, K]`` and ``[R, K]`` -> ``[R, 2 K]``, a's columns then b's. In registers: join puts the pair in one
    thread, so that with the planes' decodes the MMA operand's layout needs no shared-memory round trip."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (a.shape[0], 2 * a.shape[1]))


@triton.jit
def _load_x_groups(x_cols, group, mask_m, offs_k, K, EVEN_K: tl.constexpr):
    """x's tile of the input features from group ``group`` on (``offs_k``: 32 per group in it), transposed: the
    dot's B ``[len(offs_k), BLOCK_M]``; 0 outside the rows and K."""
    if EVEN_K:  # no column mask: the load stays vectorized, so pipelined
        x_t = tl.load(x_cols + group * 32, mask=mask_m[None, :], other=0.0)
    elif offs_k.shape[0] == 32:
        # one group, and K % 32 == 0: the group is in K or past it, one condition. (A mask per column made Triton 3.6
        # compute the plain store's column index wrong on the 8-row tiles of 2 or 4 warps: a misaligned-address
        # fault at K = 96, N = 128 or 192 on one H200, 2026-12-02.)
        in_k = tl.full([1, 1], group * 32, tl.int32) < K  # a tensor: the interpreter's group is a Python int
        x_t = tl.load(x_cols + group * 32, mask=mask_m[None, :] & in_k, other=0.0)
    else:  # four groups side by side (ONE_DOT): the last ones may be past K
        x_t = tl.load(x_cols + group * 32, mask=mask_m[None, :] & (group * 32 + offs_k < K)[:, None], other=0.0)
    return x_t


@triton.jit
def _w4_gemm_kernel(
    x_ptr, w_ptr, s_ptr, c_ptr, row_start_ptr, num_rows_ptr,
    x_scale_ptr, a8_scale_ptr, a8_fold_ptr,  # A8: x's per-row scales [R]; the weight rows' A8 scales and fold words
    R, N, K, num_blocks_k, num_experts,
    rows_hint,                     # autotune key only (unused in the body)
    situ_beta, situ_linear_beta,
    stride_x_r, stride_w_e, stride_w_n, stride_s_e, stride_s_b, stride_c_r, stride_a8_e,
    W4: tl.constexpr,              # 1 INT4, 2 MXFP4
    ACTIVATION: tl.constexpr,      # 0: c = x @ W_e.T; 1 silu, 2 situ: W_e has 2N rows (gate, up), c = act(gate, up)
    SITU_LINEAR: tl.constexpr,     # situ: squash up too (situ_linear_beta != 0)
    IEEE_FP32: tl.constexpr,       # fp32 x: ieee dots
    UPCAST: tl.constexpr,          # interpreter: dots in fp32 (its 16-bit dot is wrong)
    EVEN_K: tl.constexpr,          # K % 256 == 0: x's loads need no column mask (and stay vectorized, so pipelined)
    ASM: tl.constexpr,             # a GPU: 4-bit decode in PTX (INT4; MXFP4 with bf16 x); the interpreter runs Triton's
    BLOCK_M: tl.constexpr,         # pool rows per program (the MMA's N)
    BLOCK_N: tl.constexpr,         # output features per program (the MMA's M)
    BLOCK_E: tl.constexpr,         # next_power_of_2(num_experts)
    FOLD: tl.constexpr,            # a GPU, bf16 x and W4Weight.foldable (A8: MXFP4, or foldable INT4): the decode
                                   # applies the scales
    A8: tl.constexpr,              # W4A8: x e4m3 with one scale per row, the weights cast to fp8 in the decode
):
    """``c = x @ W_e.T`` (or ``act(gate, up)``) on each expert's rows. One program = BLOCK_N weight rows x BLOCK_M rows
    of one expert, as ``acc.T [BLOCK_N, BLOCK_M]`` = the decoded weight tile (A, registers) @ x's tile transposed (B).
    Gated, the tile's weight rows are OUT_N = BLOCK_N / 2 gate rows and the up rows of the same output features, so
    the main loop is the plain GEMM's (one weight stream, one accumulator) and the epilogue pairs the halves.
    The expert table is found on the device (``grouped_mlp.expert_table``, upper-bound grid, surplus exits).
    A8 (W4A8): each weight row is divided by its A8 scale (a power of two, ``w4.a8_tables``) and cast to fp8 (MXFP4
    e5m2, exact; INT4 e4m3), x is e4m3 with one scale per row, so the fp8 dots accumulate in place and both scales
    multiply the fp32 sums once, in the epilogue."""
    OUT_N: tl.constexpr = BLOCK_N // 2 if ACTIVATION != 0 else BLOCK_N  # output features per program
    num_pid_n = tl.cdiv(N, OUT_N)
    offs_e, num_rows_e, num_blocks_e, block_end_e = expert_table(num_rows_ptr, num_experts, BLOCK_M, BLOCK_E)
    pid_m = tl.program_id(0) // num_pid_n
    pid_n = tl.program_id(0) % num_pid_n
    if pid_m >= tl.sum(num_blocks_e):
        return
    expert, _, rows, mask_m = expert_block_rows(pid_m, offs_e, num_rows_e, num_blocks_e, block_end_e, row_start_ptr, R,
                                                BLOCK_M)
    if ACTIVATION != 0:  # weight row j: the gate (j < OUT_N) or up row (N further on) of output feature offs_n[j]
        offs_j = tl.arange(0, BLOCK_N)
        offs_n = pid_n * OUT_N + offs_j % OUT_N
        w_row = offs_n + (offs_j // OUT_N) * N
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        w_row = offs_n
    mask_n = offs_n < N
    offs_w = tl.arange(0, 16)
    # FOLD on the wgmma tiles (BLOCK_M >= 16, BLOCK_N >= 64): the weights come out of the decode scaled, so one dot
    # takes a half block's four groups (K 128), with a quarter of the dots' descriptors: 449 -> 414 sm_90a
    # instructions a k-step at (16, 64, 4, 3). At prefill it was the faster form on every tile that is the fastest of
    # its case: INT4 gate_up at 4096 rows of 48 Kimi-K2 experts, (32, 64, 4, 3), 1,082.9 -> 872.8 us; MXFP4 at
    # (128, 128, 8, 3) 690.7 -> 654.0 us (2026-12-07, one H100, `scripts/bench_w4a16.py --sweep --every-tile` with
    # the form forced per tile). The mma.sync tiles (BLOCK_M 8, BLOCK_N 32) keep one dot a group.
    ONE_DOT: tl.constexpr = FOLD and BLOCK_M >= 16 and BLOCK_N >= 64
    offs_k = tl.arange(0, 128 if ONE_DOT else 32)
    w_rows = w_ptr + expert * stride_w_e + w_row[:, None] * stride_w_n + offs_w[None, :]
    s_rows = s_ptr + expert * stride_s_e + w_row[:, None] * 8 + tl.arange(0, 8)[None, :]
    x_cols = x_ptr + rows[None, :] * stride_x_r + offs_k[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if A8:
        a8_scale = tl.load(a8_scale_ptr + expert * stride_a8_e + w_row, mask=mask_n, other=1.0)
        a8_fold = tl.load(a8_fold_ptr + expert * stride_a8_e + w_row, mask=mask_n, other=0)
    else:
        a8_scale = tl.full([BLOCK_N], 1.0, tl.float32)
        a8_fold = tl.zeros([BLOCK_N], tl.int32)
    a8_inv_scale = div_rn(tl.full([BLOCK_N], 1.0, tl.float32), a8_scale)  # powers of two: exact
    for kb in range(0, num_blocks_k):
        # a k-block's scales load in the loop step that uses them: loaded a step ahead they would stay live across the
        # step (92 registers against 80), and INT4 ran 5% slower so (2026-12-02, one H200)
        if FOLD:
            mults, biases = _fold_multipliers(s_ptr, expert * stride_s_e, kb, stride_s_b, w_row, mask_n, W4, a8_fold,
                                              A8)
        else:
            scales = _load_block_scales(s_rows, kb, stride_s_b, mask_n[:, None])
        for half in tl.static_range(2):  # 16 words: groups 4 half .. 4 half + 3 of this block
            words = tl.load(w_rows + kb * 32 + half * 16, mask=mask_n[:, None], other=0)
            if ONE_DOT:  # groups 4 half .. 4 half + 3 side by side, one K-128 dot
                x_t = _load_x_groups(x_cols, kb * 8 + half * 4, mask_m, offs_k, K, EVEN_K)
                q01 = _cat_k(_folded_plane(words, 0, mults[half * 4], biases[half * 4], W4),
                             _folded_plane(words, 1, mults[half * 4 + 1], biases[half * 4 + 1], W4))
                q23 = _cat_k(_folded_plane(words, 2, mults[half * 4 + 2], biases[half * 4 + 2], W4),
                             _folded_plane(words, 3, mults[half * 4 + 3], biases[half * 4 + 3], W4))
                if A8:
                    acc = tl.dot(_a8_weights(_cat_k(q01, q23), a8_fold, W4), x_t, acc)
                else:
                    acc = tl.dot(_cat_k(q01, q23), x_t, acc)
            else:
                for plane in tl.static_range(4):
                    x_t = _load_x_groups(x_cols, kb * 8 + half * 4 + plane, mask_m, offs_k, K, EVEN_K)
                    if FOLD:  # the weights come out of the decode scaled: the dots accumulate in place
                        q = _folded_plane(words, plane, mults[half * 4 + plane], biases[half * 4 + plane], W4)
                        if A8:
                            acc = tl.dot(_a8_weights(q, a8_fold, W4), x_t, acc)
                        else:
                            acc = tl.dot(q, x_t, acc)
                    elif A8:
                        acc = _a8_group_dot(acc, words, plane, x_t, scales[half * 4 + plane], a8_inv_scale, W4,
                                            UPCAST)
                    else:
                        scale = _group_scale(scales[half * 4 + plane], W4, x_t.dtype)
                        acc = _group_dot(acc, words, plane, x_t, scale, W4, UPCAST, IEEE_FP32, ASM)
    if A8:  # both scales once (the weight rows' a power of two): the dots summed unscaled fp8 products
        x_scale = tl.load(x_scale_ptr + rows, mask=mask_m, other=0.0)
        acc = acc * a8_scale[:, None] * x_scale[None, :]
    elif FOLD and W4 == 1:
        acc = acc * 16.0  # the decode's 2**-4 (exact)
    if ACTIVATION != 0:  # fp32 gate and up of the same features -> h, rounded once to c's dtype
        gate, up = split_halves(tl.trans(acc))  # [BLOCK_M, OUT_N] each
        h = gated_act(gate, up, situ_beta, situ_linear_beta, ACTIVATION, SITU_LINEAR)
        offs_h = pid_n * OUT_N + tl.arange(0, OUT_N)
        tl.store(c_ptr + rows[:, None] * stride_c_r + offs_h[None, :], h.to(c_ptr.dtype.element_ty),
                 mask=mask_m[:, None] & (offs_h < N)[None, :])
    else:
        c_ptrs = c_ptr + rows[None, :] * stride_c_r + offs_n[:, None]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])


# (BLOCK_M, BLOCK_N, num_warps, num_stages). On Hopper, BLOCK_M 16 with BLOCK_N >= 64 per 4 warps runs wgmma (one
# group's dot waits before its scale, unless FOLD; every dot builds shared-memory descriptors), BLOCK_N 32 on 2 warps
# the older mma.sync; BLOCK_M 8 runs mma.sync (m16n8k16; Triton 3.6, the GPU image's: newer ones take wgmma n8 on 4
# warps), with half the accumulators per weight (INT4: half the FFMAs that scale them) and no descriptors: 10-20% fewer
# instructions per weight than the wgmma tile, and 2.5-2.7x bf16 at 64 rows of 48 experts (2026-12-02, one H200).
# They pay where an expert's rows fit 8. The prefill tiles (BLOCK_M >= 32), at 1024 and 4096 rows of 48 Kimi-K2
# experts (2026-12-07, one H100): (32, 64, 4, 3) was the fastest in six cases of eight, (128, 128, 8, 3) in MXFP4's two
# at 4096 rows; INT4 cannot launch that one (233,472 bytes of shared memory, 1 KiB past Hopper's), hence its 2-stage
# twin; (64, 128, 4, 3) took 1.5-2.4x the best in every case, either dot form, and is gone; (64, 64, 4, 3) and
# (128, 64, 4, 3) are untried.
TILES = [(8, 32, 2, 2), (8, 64, 4, 2), (8, 64, 4, 3), (8, 128, 4, 2),
         (16, 64, 4, 2), (16, 64, 4, 3), (16, 64, 4, 4), (16, 64, 4, 5), (16, 128, 4, 3), (16, 128, 8, 3),
         (16, 32, 2, 3), (16, 32, 2, 4), (32, 64, 4, 3), (32, 128, 4, 3), (64, 64, 4, 3), (64, 128, 8, 3),
         (128, 64, 4, 3), (128, 128, 8, 2), (128, 128, 8, 3)]
INTERPRETER_TILE = (16, 16, 1, 1)
# The batch-invariant mode's one (GEMM1, GEMM2) tile pair, whatever the row count: a row's sums then run one K loop
# and one MMA shape in every batch (the kernel has no split-K), so its bits do not depend on the other rows. The tiles
# above differ in their dot forms (one dot a group of 32, or a K-128 dot a half block) and their MMA instructions,
# so autotune's choice among them would change a row's bits. (32, 64, 4, 3) was the fastest prefill tile in six of
# eight cases above; at decode it computes 32-row blocks for the few rows of each expert.
BATCH_INVARIANT_TILES = ((32, 64, 4, 3), (32, 64, 4, 3))
# W4A8's candidates: the decode and the fp8 cast are paid once per BLOCK_M rows while the fp8 MMAs halve, so only
# wide tiles can win. A CPU count of the main loop's sm_90a instructions (tests/dist/sm90_compile_worker.py --sass
# "128-row tile", 2026-12-07, Triton 3.9): at (128, 128, 8, 3) 698 (MXFP4) / 689 (INT4) a k-block, 8 fp8 wgmma,
# against the W4A16 tiles' 489 / 392 and 16 bf16 ones; at BLOCK_M 64 the same instructions feed half the rows. On one
# H100 autotune took (128, 64, 4, 3) for MXFP4 and (128, 128, 8, 3) for INT4 at 4096 and 8192 rows (2026-12-07;
# docs/RESULTS.md, "Quantized experts").
A8_TILES = ((128, 128, 8, 3), (128, 64, 4, 3), (64, 128, 8, 3))
FEW_ROWS_PER_EXPERT = 4  # up to this many rows per expert (on average), the BLOCK_M 8 tiles are tried too
DECODE_ROWS_PER_EXPERT = 16  # up to this many, the BLOCK_M 16 tiles (one M block per expert)


def tiles_for(rows_per_expert: float, *, a8: bool = False) -> list[tuple]:
    """The ``TILES`` autotune tries at this many rows per expert (on average): BLOCK_M 8 and 16 up to
    ``FEW_ROWS_PER_EXPERT`` (autotune weighs an 8-row tile against the second M block of an expert with more rows),
    BLOCK_M 16 up to ``DECODE_ROWS_PER_EXPERT``, the larger ones above. W4A8 (``a8``, a prefill path) tries
    ``A8_TILES`` at any count.

    Example: 64 rows over 48 experts (1.3 each) -> the BLOCK_M 8 and 16 tiles; 512 rows (10.7) -> BLOCK_M 16."""
    if a8:
        return list(A8_TILES)
    if rows_per_expert <= FEW_ROWS_PER_EXPERT:
        return [t for t in TILES if t[0] <= 16]
    if rows_per_expert <= DECODE_ROWS_PER_EXPERT:
        return [t for t in TILES if t[0] == 16]
    return [t for t in TILES if t[0] >= 32]


@functools.lru_cache(maxsize=None)
def _autotuned(tiles: tuple) -> triton.runtime.Autotuner:
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in tiles]
    return triton.autotune(configs, key=["rows_hint", "N", "K", "num_experts", "W4", "ACTIVATION", "A8"])(
        _w4_gemm_kernel)


# autotune key (rows bucket, N, K, experts, kernel flags, x dtype, scale dtype) -> the tile it chose
_TUNED: dict[tuple, tuple] = {}


def tuned_tiles() -> dict[tuple, tuple]:
    """A copy of what autotuning chose so far: ``{(rows bucket, N, K, experts, kernel flags, x dtype, scale dtype):
    (BLOCK_M, BLOCK_N, num_warps, num_stages)}`` (what benchmarks report)."""
    return dict(_TUNED)


def clear_tuned_tiles() -> None:
    """Forget every chosen tile (the next launch of each key autotunes again)."""
    _TUNED.clear()


def launch_w4_gemm(x, weight: W4Weight, c, row_start_e, num_rows_e, *, rows_hint: int, tile: tuple | None = None,
                   activation: str = "none", situ_beta: float = 4.0, situ_linear_beta: float = 25.0,
                   x_scale: torch.Tensor | None = None):
    """One grouped GEMM of ``grouped_mlp_w4``: ``c[rows of e] = x[rows of e] @ W_e.T`` for every local expert e, or with
    an activation ``c[rows of e] = act(x @ gate_e.T, x @ up_e.T)`` (GEMM1 and the activation in one launch).

    Args:
        x: ``[P, I]`` bf16/fp16/fp32 pool rows (W4A8: fp8 e4m3, with ``x_scale``). weight: ``W4Weight`` of
            ``[e, O, I]`` (gated: O = 2N, N gate rows then N up rows). c: ``[P, O]``, gated ``[P, N]`` (any float
            dtype: the fp32 accumulator, or the fp32 activation of two, is rounded to it); rows outside every segment
            are not written.
        row_start_e, num_rows_e: ``[e]`` int32/int64 segments. rows_hint: about the live rows (autotune key).
        tile: None (autotune once per key; the interpreter runs ``INTERPRETER_TILE``) or
            (BLOCK_M, BLOCK_N, num_warps, num_stages), forced; BLOCK_N counts weight rows (gated: half of them gate).
        activation, situ_beta, situ_linear_beta: ``"none"``, or as ``grouped_mlp``.
        x_scale: None, or W4A8: ``[P]`` fp32, x's one scale per row (``quantize_rows_fp8(..., per_row=True)``); the
            weights must be ``a8_supported``.
    """
    if activation not in ACTIVATION_CODES:
        raise UnknownNameError(f"{activation=} must be one of {', '.join(ACTIVATION_CODES)}")
    num_rows, (num_experts, n, _) = x.shape[0], weight.shape
    gated = activation != "none"
    out_n = n // 2 if gated else n
    if (gated and n % 2) or tuple(c.shape) != (num_rows, out_n):
        want = "[P, O / 2] with O even (gate and up rows)" if gated else "[P, O]"
        raise ShapeError(f"x [P, I] {tuple(x.shape)}, weight [e, O, I] {weight.shape} and c {tuple(c.shape)} disagree: "
                         f"c must be {want} ({activation=})")
    a8 = x_scale is not None
    if a8:
        _check_a8(x, x_scale, weight)
    rows_bucket = next_power_of_2(max(1, rows_hint))
    args = (x, weight.words_eOw, weight.block_scale, c, row_start_e, num_rows_e,
            x_scale if a8 else weight.a8_row_scale_eO, weight.a8_row_scale_eO, weight.a8_fold_eO,
            num_rows, out_n, weight.in_features,
            weight.words_eOw.shape[-1] // WORDS_PER_BLOCK, num_experts, rows_bucket, situ_beta, situ_linear_beta,
            x.stride(0), weight.words_eOw.stride(0), weight.words_eOw.stride(1), weight.block_scale.stride(0),
            weight.block_scale.stride(1), c.stride(0), weight.a8_row_scale_eO.stride(0))
    fold = (weight.fmt == "mxfp4" or weight.foldable) if a8 else x.dtype == torch.bfloat16 and weight.foldable
    flags = dict(W4=_FORMATS[weight.fmt], ACTIVATION=ACTIVATION_CODES[activation],
                 SITU_LINEAR=bool(situ_linear_beta), IEEE_FP32=x.dtype == torch.float32, UPCAST=is_interpreter(),
                 EVEN_K=weight.in_features % PLANE_BLOCK == 0, ASM=not is_interpreter(),
                 BLOCK_E=next_power_of_2(num_experts), FOLD=fold and not is_interpreter(), A8=a8)

    def grid(block_m: int, block_n: int) -> tuple:
        return ((cdiv(num_rows, block_m) + num_experts) * cdiv(out_n, block_n // 2 if gated else block_n),)

    if tile is None and is_interpreter():
        tile = INTERPRETER_TILE
    if tile is None:
        key = (rows_bucket, n, weight.in_features, num_experts, tuple(flags.values()), x.dtype,
               weight.block_scale.dtype)
        tile = _TUNED.get(key)
        if tile is None:
            tuner = _autotuned(tuple(tiles_for(rows_hint / max(1, num_experts), a8=a8)))
            out = tuner[lambda meta: grid(meta["BLOCK_M"], meta["BLOCK_N"])](*args, **flags,
                                                                              **launch_options(fp_fusion=True))
            best = tuner.best_config
            _TUNED[key] = (best.kwargs["BLOCK_M"], best.kwargs["BLOCK_N"], best.num_warps, best.num_stages)
            return out
    block_m, block_n, warps, stages = tile
    if block_m < 8 or block_n < 16:
        raise InvalidConfigError(f"tile {tile}: BLOCK_M must be >= 8 and BLOCK_N >= 16 (tl.dot)")
    extra = {} if is_interpreter() else launch_options(fp_fusion=True)
    return launch(_w4_gemm_kernel, grid(block_m, block_n), *args, **flags, BLOCK_M=block_m, BLOCK_N=block_n,
                  num_warps=warps, num_stages=stages, **extra)


def _check_a8(x: torch.Tensor, x_scale: torch.Tensor, weight: W4Weight) -> None:
    if x.dtype != FP8_DTYPE or x_scale.dtype != torch.float32 or tuple(x_scale.shape) != (x.shape[0],):
        raise DTypeError(f"W4A8 takes fp8 e4m3 x [P, I] and fp32 x_scale [P] (one scale per row), got x {x.dtype} "
                         f"{tuple(x.shape)} and x_scale {x_scale.dtype} {tuple(x_scale.shape)}: "
                         f"quantize_rows_fp8(x, per_row=True) makes them")
    if not weight.a8_supported:
        raise InvalidConfigError(f"W4A8 cannot take these {weight.fmt} weights: a row's largest scale is below "
                                 f"2**{A8_INT4_MIN_EXPONENT} (its multiplier would not be a finite bf16); run them "
                                 f"W4A16 (a8=False)")


def _check(x_PDx, gate_up: W4Weight, down: W4Weight) -> None:
    if x_PDx.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise DTypeError(f"4-bit weights take bf16/fp16/fp32 x_PDx, got {x_PDx.dtype}")
    num_experts, two_f, hidden = gate_up.shape
    if x_PDx.dim() != 2 or x_PDx.shape[1] != hidden or two_f % 2 or down.shape != (num_experts, hidden, two_f // 2):
        raise ShapeError(f"x_PDx [P, Dx] {tuple(x_PDx.shape)}, gate_up [e, 2F, Dx] {gate_up.shape} and down [e, Dx, F] "
                         f"{down.shape} disagree")
    if gate_up.fmt != down.fmt:
        raise DTypeError(f"gate_up is {gate_up.fmt}, down is {down.fmt}: one format per layer")


def grouped_mlp_w4(x_PDx: torch.Tensor, gate_up: W4Weight, down: W4Weight, row_start_e: torch.Tensor,
                   num_rows_e: torch.Tensor, activation: str = "silu", situ_beta: float = 4.0,
                   situ_linear_beta: float = 25.0, *, num_rows_hint: int | None = None, zero_unused_rows: bool = True,
                   tiles: tuple[tuple, tuple] | None = None, batch_invariant: bool = False,
                   a8: bool = False) -> torch.Tensor:
    """Every local expert's gated MLP on its rows of the pool, with 4-bit weights (two launches, no host sync).

    Args:
        x_PDx: ``[P, Dx]`` bf16/fp16/fp32; expert i owns rows ``row_start_e[i] : row_start_e[i] + num_rows_e[i]``.
        gate_up: ``W4Weight`` of ``[e, 2F, Dx]`` (rows 0..F-1 gate, F..2F-1 up). down: ``W4Weight`` of ``[e, Dx, F]``.
        row_start_e, num_rows_e: ``[e]`` int32/int64.
        activation, situ_beta, situ_linear_beta: as ``grouped_mlp``.
        num_rows_hint: about ``sum(num_rows_e)`` (autotune key; default P). zero_unused_rows: as ``grouped_mlp``.
        tiles: None, or (GEMM1's, GEMM2's) (BLOCK_M, BLOCK_N, num_warps, num_stages), forced.
        batch_invariant: with ``tiles`` None, the mode's one pair ``BATCH_INVARIANT_TILES`` at every row count (the
            interpreter: its own tile, as always), so a row's bits do not depend on the other rows.
        a8: W4A8, a prefill path: x and h are quantized to fp8 e4m3 with one scale per row
            (``quantize_rows_fp8(..., per_row=True)``), the weights are cast to fp8 in the decode (MXFP4 e5m2 exactly
            where ``W4Weight.a8_exact``; INT4 rounded to e4m3), and the GEMMs run fp8 MMAs (``launch_w4_gemm``'s
            ``x_scale``). The weights must be ``a8_supported``.

    Returns:
        y_PDx ``[P, Dx]`` in x's dtype; GEMM1's sums stay fp32 into the activation, h is rounded to x's dtype between
        the GEMMs.
    """
    if activation not in ("silu", "situ"):
        raise UnknownNameError(f"{activation=} must be 'silu' or 'situ'")
    _check(x_PDx, gate_up, down)
    num_rows, hidden = x_PDx.shape
    num_experts, two_f, _ = gate_up.shape
    inter = two_f // 2
    allocate = torch.zeros if zero_unused_rows else torch.empty
    y_PDx = allocate(num_rows, hidden, dtype=x_PDx.dtype, device=x_PDx.device)
    if num_rows == 0 or num_experts == 0 or inter == 0 or hidden == 0:
        return y_PDx.zero_()
    check_device("x_PDx", x_PDx)
    if not x_PDx.is_contiguous():
        raise ShapeError(f"x_PDx must be contiguous (strides {x_PDx.stride()})")
    rows_hint = num_rows if num_rows_hint is None else num_rows_hint
    if tiles is None and batch_invariant and not is_interpreter():
        tiles = BATCH_INVARIANT_TILES
    tile1, tile2 = (None, None) if tiles is None else tiles
    if a8:
        # rows outside the segments stay 0, so their per-row quantization reads no stale bits
        h_PF = torch.zeros(num_rows, inter, dtype=x_PDx.dtype, device=x_PDx.device)
        x_fp8_PDx, x_scale_P = quantize_rows_fp8(x_PDx, per_row=True)
        launch_w4_gemm(x_fp8_PDx, gate_up, h_PF, row_start_e, num_rows_e, rows_hint=rows_hint, tile=tile1,
                       activation=activation, situ_beta=situ_beta, situ_linear_beta=situ_linear_beta,
                       x_scale=x_scale_P)
        h_fp8_PF, h_scale_P = quantize_rows_fp8(h_PF, per_row=True)
        launch_w4_gemm(h_fp8_PF, down, y_PDx, row_start_e, num_rows_e, rows_hint=rows_hint, tile=tile2,
                       x_scale=h_scale_P)
        return y_PDx
    h_PF = torch.empty(num_rows, inter, dtype=x_PDx.dtype, device=x_PDx.device)  # only the segments' rows are written
    launch_w4_gemm(x_PDx, gate_up, h_PF, row_start_e, num_rows_e, rows_hint=rows_hint, tile=tile1,
                   activation=activation, situ_beta=situ_beta, situ_linear_beta=situ_linear_beta)
    launch_w4_gemm(h_PF, down, y_PDx, row_start_e, num_rows_e, rows_hint=rows_hint, tile=tile2)
    return y_PDx


# --------------------------------------------------------------------------------------------------
# torch twin
# --------------------------------------------------------------------------------------------------
def _gemm_ref(x_PI: torch.Tensor, weight_OI: torch.Tensor, row_scale_O: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` in fp32; W4A8 (``row_scale_O``): x's fp8 rows with their per-row scales, W the fp8 values
    (``w4.a8_weights_eOI``), the two scales applied to the sums as the kernel applies them."""
    if row_scale_O is None:
        return x_PI.float() @ weight_OI.T
    x_fp8_PI, x_scale_P = quantize_rows_fp8_ref(x_PI, per_row=True)
    return (x_fp8_PI.float() @ weight_OI.T) * row_scale_O * x_scale_P[:, None]


def grouped_mlp_w4_ref(x_PDx, gate_up: W4Weight, down: W4Weight, row_start_e, num_rows_e, activation="silu",
                       situ_beta=4.0, situ_linear_beta=25.0, *, num_rows_hint=None, zero_unused_rows=True,
                       tiles=None, batch_invariant=False, a8=False) -> torch.Tensor:
    """Plain-torch twin of ``grouped_mlp_w4`` (same arguments and return): per expert, the weights dequantized
    exactly in fp32 (W4A8: the fp8 weights and per-row fp8 rows the kernel multiplies), h rounded to x's dtype.
    NOTE: ``.tolist()`` on the row counts syncs the host."""
    _check(x_PDx, gate_up, down)
    inter = gate_up.shape[1] // 2
    if a8:
        gate_up_e2FD, down_eDF = a8_weights_eOI(gate_up), a8_weights_eOI(down)
        gate_up_scale_e2F, down_scale_eD = gate_up.a8_row_scale_eO, down.a8_row_scale_eO
    else:
        gate_up_e2FD, down_eDF = dequantize_planes(gate_up), dequantize_planes(down)
    y_PDx = torch.zeros_like(x_PDx)
    for i, (start, count) in enumerate(zip(row_start_e.tolist(), num_rows_e.tolist())):
        if count == 0:
            continue
        rows = slice(start, start + count)
        gate_up_P2F = _gemm_ref(x_PDx[rows], gate_up_e2FD[i], gate_up_scale_e2F[i] if a8 else None)
        h_PF = gated_activation(gate_up_P2F[:, :inter], gate_up_P2F[:, inter:], activation, situ_beta,
                                situ_linear_beta).to(x_PDx.dtype)
        y_PDx[rows] = _gemm_ref(h_PF, down_eDF[i], down_scale_eD[i] if a8 else None).to(x_PDx.dtype)
    return y_PDx
