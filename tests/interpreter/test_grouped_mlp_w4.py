"""The 4-bit (W4A16) expert MLP, ``moe_ref.kernels.experts.grouped_mlp_w4``: its weight layout (group planes) against the
checkpoint's packing, its decode of every code (pair) in each x dtype and of every MXFP4 scale byte, the kernel against
its twin and against the dequantized fp32 weights through moe_ref's torch expert loop at the edges (an empty expert,
ragged segments, rows outside every segment, features not in whole 256-blocks, zero rows, all rows on one expert),
the W4A16 and FP8 checkpoint experts through the public Experts API, and the layer on quantized checkpoints."""

import dataclasses
import functools
import importlib

import pytest
import torch
import triton
import triton.language as tl

from moe_ref.core.activations import gated_activation
from moe_ref.core.errors import DTypeError, InvalidConfigError, QuantTensorValueError, ShapeError, UnknownNameError
from moe_ref.experts import ExpertLayout, make_experts
from moe_ref.experts.quantized import FP8BlockExperts, W4A16Experts, make_quantized_experts
from moe_ref.checkpoint.formats import (QUANTIZED_TENSOR_FIELDS, QuantFormat, QuantizedExpertWeights, QuantSpec,
                                        quantize_weight, w4_format_name)
from moe_ref.kernels.experts.gated_act import gated_activation_rows
from moe_ref.kernels.ep.pool_rows import pool_row_experts
from moe_ref.kernels.experts.w4 import (INT4_FOLD_MIN_SCALE, MXFP4_FOLD_MAX_SCALE_BYTE, MXFP4_MAX_SCALE_BYTE, MXFP4_PLANE_BITS,
                                W4Weight, a8_tables, a8_weights_eOI, block_major_scales, dequantize_int4,
                                dequantize_mxfp4, dequantize_planes, e2m1_to_float, from_group_planes, pack_fp4,
                                pack_int4, to_group_planes)
from moe_ref.kernels.experts.quantize_rows import quantize_rows_fp8_ref
from moe_ref.testing import CALC_DIFF_TOLERANCES, assert_bitwise_equal, calc_diff

gm = importlib.import_module("moe_ref.kernels.experts.grouped_mlp")  # the package re-exports a function of that name
w4 = importlib.import_module("moe_ref.kernels.experts.grouped_mlp_w4")

pytestmark = pytest.mark.interpreter

W4 = [QuantFormat.INT4_GROUP, QuantFormat.MXFP4]
X_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
COUNTS = [5, 0, 19]  # an empty expert, a ragged one; the interpreter's BLOCK_M is 16
# On a GPU the twin comparisons force one tile: autotuning every case compiles ~10 variants each (minutes in all)
GPU_TILES = ((16, 64, 4, 2), (16, 64, 4, 2))
A8_GPU_TILES = ((128, 64, 4, 3), (128, 64, 4, 3))  # W4A8's (grouped_mlp_w4.A8_TILES): one, for the same reason


def _qweights(fmt, num_experts, hidden, inter, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    (gq, gs), (dq, ds) = quantize_weight(gate_up, fmt), quantize_weight(down, fmt)
    spec = QuantSpec(fmt, 128 if fmt == QuantFormat.FP8_BLOCK else 32)
    return QuantizedExpertWeights(spec, gq, gs, dq, ds, hidden_size=hidden, intermediate_size=inter).to(device)


def _planes(q: QuantizedExpertWeights):
    return q.group_planes()  # copies in the kernel's order (q keeps the checkpoint's)


def _pool(layout, hidden, dtype, device, seed=1):
    x_PDx = torch.randn(layout.num_pool_rows, hidden, generator=torch.Generator().manual_seed(seed))
    valid = torch.zeros(layout.num_pool_rows, dtype=torch.bool)
    for start, count in zip(layout.row_start_e.tolist(), layout.num_rows_e.tolist()):
        valid[start:start + count] = True
    x_PDx[~valid] = float("nan")  # rows outside every segment are never read
    return x_PDx.to(dtype).to(device), valid


# --------------------------------------------------------------------------------------------------
# the weight layout
# --------------------------------------------------------------------------------------------------
def _random_packed(fmt: str, rows: int, features: int, seed: int):
    """(packed, scales, codes) of random codes: INT4 int32 words and bf16 scales, MXFP4 bytes and scale bytes."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (2, rows, features), generator=gen, dtype=torch.uint8)
    if fmt == "int4":
        packed = pack_int4(codes.to(torch.int8) - 8)
        scales = torch.rand(2, rows, features // 32, generator=gen).bfloat16()
    else:
        packed = pack_fp4(codes)
        scales = torch.randint(100, 140, (2, rows, features // 32), generator=gen, dtype=torch.uint8)
    return packed, scales, codes


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
@pytest.mark.parametrize("features", [256, 96, 544])
@pytest.mark.parametrize("in_place", [False, True])
def test_group_planes_hold_the_checkpoints_codes_and_scales(fmt, features, in_place):
    packed, scales, codes = _random_packed(fmt, 5, features, seed=features)
    if in_place and features % 256:
        with pytest.raises(ShapeError, match="256"):
            to_group_planes(packed.clone(), scales, fmt, in_place=True)
        return
    stored = packed.clone()
    planes = to_group_planes(stored, scales, fmt, in_place=in_place)
    padded = triton.cdiv(features, 256) * 256
    assert planes.words_eOw.shape == (2, 5, padded // 8) and planes.words_eOw.dtype == torch.int32
    assert planes.block_scale.shape == (2, padded // 256, 5, 8) and planes.shape == (2, 5, features)
    # in place: the words are the stored tensor's own memory (no second copy), now in the kernel's order
    assert (planes.words_eOw.data_ptr() == stored.data_ptr()) == in_place
    assert torch.equal(stored, packed) != in_place
    back_packed, back_scales = from_group_planes(planes)
    assert torch.equal(back_packed, packed) and torch.equal(back_scales, scales)
    dequantize = dequantize_int4 if fmt == "int4" else dequantize_mxfp4
    assert torch.equal(dequantize_planes(planes), dequantize(packed, scales))
    # the padding features hold the code of 0.0
    whole = W4Weight(fmt, planes.words_eOw, torch.ones_like(planes.block_scale), padded)
    assert not dequantize_planes(whole)[..., features:].any()
    # the largest MXFP4 scale byte (the kernel's route), read once by the load's check and handed on; read by
    # W4Weight itself when not given
    assert planes.max_scale_byte == (int(scales.max()) if fmt == "mxfp4" else 0)
    assert whole.max_scale_byte == (1 if fmt == "mxfp4" else 0)


def test_group_planes_put_a_groups_feature_pairs_in_one_word():
    """Word i of half h holds feature 2i of group 4h + p (plane p) in its low 16 bits and feature 2i + 1 in its high
    16 bits: INT4 in nibble p of each half; MXFP4 with e|m and sign at (6, 15), (3, 12), (0, 14), (9, 13) for planes
    0..3 (the bits the PTX decode reads)."""
    codes = torch.full((1, 1, 256), 8, dtype=torch.uint8)  # INT4 0.0
    codes[0, 0, 32 * 5 + 6] = 3   # group 5 = half 1, plane 1; feature 6 = pair 3, even
    codes[0, 0, 32 * 2 + 7] = 9   # group 2 = half 0, plane 2; feature 7 = pair 3, odd
    words = to_group_planes(pack_int4(codes.to(torch.int8) - 8), torch.ones(1, 1, 8), "int4").words_eOw[0, 0]
    expected = torch.full((32,), 0x88888888, dtype=torch.int64)
    expected[16 + 3] = 0x88888838
    expected[3] = 0x89888888
    assert torch.equal(words.to(torch.int64) & 0xFFFFFFFF, expected), [hex(w & 0xFFFFFFFF) for w in words.tolist()]
    codes.fill_(0)  # MXFP4 0.0
    codes[0, 0, 32 * 5 + 6] = 3   # sign 0, e|m 3 at bits 3..5
    codes[0, 0, 32 * 2 + 7] = 9   # sign 1, e|m 1 at bit 16 + 0, sign at bit 16 + 14
    words = to_group_planes(pack_fp4(codes), torch.zeros(1, 1, 8, dtype=torch.uint8), "mxfp4").words_eOw[0, 0]
    expected = torch.zeros(32, dtype=torch.int64)
    expected[16 + 3] = 3 << 3
    expected[3] = (1 << 16) | (1 << 30)
    assert torch.equal(words.to(torch.int64), expected), words.tolist()


@pytest.mark.parametrize("fmt, scales, foldable", [
    ("int4", torch.tensor([0.0, 2.0**-122, -0.498, 0.498]).bfloat16(), True),  # zero, the smallest, the largest
    ("int4", torch.tensor([0.01, 0.5, 0.1, 0.2]).bfloat16(), False),  # s * 2**129 would overflow bf16
    ("int4", torch.tensor([0.01, -2.0**-123, 0.1, 0.2]).bfloat16(), False),  # w / 16 could be a subnormal
    ("int4", torch.tensor([0.01, 2.0**-133, 0.1, 0.2]).bfloat16(), False),
    ("int4", torch.tensor([0.01, 0.1, 0.2, -0.5]).bfloat16(), False),
    ("int4", torch.tensor([0.01, float("nan"), 0.1, 0.2]).bfloat16(), False),
    ("int4", torch.tensor([0.01, 0.02, 0.1, 0.2]).half(), False),  # the fold takes bf16 scales only
    ("int4", torch.tensor([0.01, 0.02, 0.1, 0.2]), False),
    ("mxfp4", torch.tensor([0, MXFP4_FOLD_MAX_SCALE_BYTE, 100, 1], dtype=torch.uint8), True),
    ("mxfp4", torch.tensor([0, 100, 1, MXFP4_FOLD_MAX_SCALE_BYTE + 1], dtype=torch.uint8), False),
])
def test_w4_weight_says_whether_the_kernel_may_fold_its_scales(fmt, scales, foldable):
    """``W4Weight.foldable`` (read once, at load) picks the kernel's route for bf16 x: scales multiplied into the decode
    (INT4 bf16 scales with |s| < ``INT4_FOLD_SCALE_LIMIT``, each 0 or at least ``INT4_FOLD_MIN_SCALE``; MXFP4 bytes up
    to ``MXFP4_FOLD_MAX_SCALE_BYTE``) or kept in fp32 (any other, e.g. a group with |w| up to 4 or more, a scale so
    small its weights would be subnormal, or fp16 scales)."""
    stored = torch.zeros(1, 1, 16, dtype=torch.int32) if fmt == "int4" else torch.zeros(1, 1, 64, dtype=torch.uint8)
    group_scales = scales.reshape(1, 1, 4)  # 128 input features
    assert to_group_planes(stored, group_scales, fmt).foldable is foldable
    assert W4Weight(fmt, torch.zeros(1, 1, 32, dtype=torch.int32), block_major_scales(group_scales, 128),
                    128).foldable is foldable  # read by W4Weight itself when the caller has not


def test_group_planes_refuse_an_mxfp4_scale_past_the_kernels_range():
    scales = torch.full((1, 1, 8), 238, dtype=torch.uint8)
    to_group_planes(torch.zeros(1, 1, 128, dtype=torch.uint8), scales, "mxfp4")  # the largest accepted
    scales[0, 0, 5] = 239
    with pytest.raises(QuantTensorValueError, match="239") as info:
        to_group_planes(torch.zeros(1, 1, 128, dtype=torch.uint8), scales, "mxfp4")
    assert info.value.code == "LOAD015"


def test_group_planes_refuse_an_unknown_format():
    with pytest.raises(UnknownNameError, match="nf4"):
        to_group_planes(torch.zeros(1, 1, 32, dtype=torch.int32), torch.zeros(1, 1, 8), "nf4")


@pytest.mark.parametrize("packed, scales", [
    (torch.zeros(1, 2, 5, dtype=torch.int32), torch.ones(1, 2, 1, dtype=torch.bfloat16)),  # 40 features: 1.25 groups
    (torch.zeros(1, 2, 8, dtype=torch.int32), torch.ones(1, 2, 3, dtype=torch.bfloat16)),  # 64 features, 3 scales
])
def test_group_planes_refuse_features_that_are_not_whole_groups(packed, scales):
    with pytest.raises(ShapeError, match="whole groups of 32") as info:
        to_group_planes(packed, scales, "int4")
    assert info.value.code == "INP001"


# --------------------------------------------------------------------------------------------------
# the decode, exhaustively
# --------------------------------------------------------------------------------------------------
@triton.jit
def _decode_plane_kernel(words_ptr, out_ptr, PLANE: tl.constexpr, W4: tl.constexpr, DTYPE: tl.constexpr,
                         ASM: tl.constexpr):
    """out `[16, 32]` = `_decode_plane` of plane PLANE of the `[16, 16]` int32 words."""
    rows, cols = tl.arange(0, 16), tl.arange(0, 16)
    words = tl.load(words_ptr + rows[:, None] * 16 + cols[None, :])
    tl.store(out_ptr + rows[:, None] * 32 + tl.arange(0, 32)[None, :], w4._decode_plane(words, PLANE, W4, DTYPE, ASM))


TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _every_code_pair(fmt: str, plane: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All 256 (even, odd) code pairs of one plane, as the kernel loads them: (even codes ``[256]``, odd codes, int32
    words ``[16, 16]``), the words carrying random codes of the other planes in their other bits."""
    even, odd = torch.arange(256, dtype=torch.int32) // 16, torch.arange(256, dtype=torch.int32) % 16
    other_planes = torch.randint(-2**31, 2**31 - 1, (256,), dtype=torch.int32,
                                 generator=torch.Generator().manual_seed(seed))
    if fmt == "int4":
        mask = 0x000F000F << (4 * plane)
        words = (((even | (odd << 16)) << (4 * plane)) | (other_planes & ~mask)).reshape(16, 16)
    else:  # e|m and sign at the plane's offsets in each half (the layout test pins them)
        em, sign = MXFP4_PLANE_BITS[plane]
        mask = (0x00070007 << em) | (0x00010001 << sign)
        pairs = even | (odd << 16)
        placed = ((pairs & 0x00070007) << em) | (((pairs >> 3) & 0x00010001) << sign)
        words = (placed | (other_planes & ~mask)).reshape(16, 16)
    return even, odd, words


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
@pytest.mark.parametrize("x_dtype", X_DTYPES)
@pytest.mark.parametrize("asm", [False, True], ids=["triton", "ptx"])
@pytest.mark.parametrize("plane", range(4))
def test_decode_is_exact_for_every_pair_of_codes(fmt, x_dtype, asm, plane, device):
    """All 256 (even, odd) code pairs of one plane, decoded where the kernel runs (the GPU, or the interpreter), bit
    for bit equal to the format's values in x's dtype, and in feature order (MXFP4 with bf16 x: times 2**-14, which
    the group scale takes back). The words carry the other planes' codes in their other nibbles, as the kernel loads
    them. ``asm``: the GPU's PTX decode (INT4 in 16-bit dtypes, MXFP4 with bf16 x; the others ignore it)."""
    if asm and device == "cpu":
        pytest.skip("PTX runs on a GPU only (the interpreter runs the Triton decode, asm=False)")
    even, odd, words = _every_code_pair(fmt, plane, seed=0)
    out = torch.empty(16, 32, dtype=x_dtype, device=device)
    _decode_plane_kernel[(1,)](words.to(device), out, PLANE=plane, W4=1 if fmt == "int4" else 2,
                               DTYPE=TL_DTYPES[x_dtype], ASM=asm)
    values = (lambda c: c.float() - 8) if fmt == "int4" else (lambda c: e2m1_to_float(c.to(torch.uint8)))
    unit = 2.0**-14 if (fmt, x_dtype) == ("mxfp4", torch.bfloat16) else 1.0
    expected = (torch.stack([values(even), values(odd)], dim=-1).reshape(16, 32) * unit).to(x_dtype)
    assert_bitwise_equal(out.cpu(), expected, fmt=fmt, x_dtype=x_dtype, plane=plane)


@triton.jit
def _block_scales_kernel(scale_ptr, out_ptr, ROWS: tl.constexpr, W4: tl.constexpr, DTYPE: tl.constexpr):
    rows = tl.arange(0, ROWS)
    scales = w4._load_block_scales(scale_ptr + rows[:, None] * 8 + tl.arange(0, 8)[None, :], 0, 0,
                                   (rows < ROWS)[:, None])
    for group in tl.static_range(8):
        tl.store(out_ptr + rows * 8 + group, w4._group_scale(scales[group], W4, DTYPE))


def _kernel_scales(scales_R8: torch.Tensor, w4_format: int, x_dtype, device) -> torch.Tensor:
    """What the fp32 route multiplies its dots by, per row and group, for one k-block's stored scales ``[R, 8]``."""
    out = torch.empty(scales_R8.shape[0] * 8, dtype=torch.float32, device=device)
    _block_scales_kernel[(1,)](scales_R8.contiguous().to(device), out, ROWS=scales_R8.shape[0], W4=w4_format,
                               DTYPE=TL_DTYPES[x_dtype])
    return out.cpu().reshape(-1, 8)


@triton.jit
def _folded_plane_kernel(words_ptr, scale_ptr, out_ptr, PLANE: tl.constexpr, W4: tl.constexpr):
    """out `[16, 32]` = plane PLANE of the `[16, 16]` int32 words, dequantized in the decode (FOLD) with the k-block's
    stored scales `[16, 8]` (group PLANE's)."""
    rows = tl.arange(0, 16)
    words = tl.load(words_ptr + rows[:, None] * 16 + tl.arange(0, 16)[None, :])
    mults, biases = w4._fold_multipliers(scale_ptr, 0, 0, 0, rows, rows < 16, W4, tl.zeros([16], tl.int32), False)
    tl.store(out_ptr + rows[:, None] * 32 + tl.arange(0, 32)[None, :],
             w4._folded_plane(words, PLANE, mults[PLANE], biases[PLANE], W4))


def _fold_scales(fmt: str, plane: int, gen: torch.Generator) -> torch.Tensor:
    """A k-block's stored scales ``[16, 8]`` the fold takes, group ``plane``'s column at its edges. INT4 bf16: both
    signs, zero, the smallest (``INT4_FOLD_MIN_SCALE``) and up to 0.498; MXFP4 bytes: 0, the largest, and between."""
    if fmt == "mxfp4":
        scales = torch.randint(0, MXFP4_FOLD_MAX_SCALE_BYTE + 1, (16, 8), dtype=torch.uint8, generator=gen)
        scales[:, plane] = torch.tensor([0, 1, 2, 60, 100, 110, 120, 123, 124, 125, 126, 126, 3, 64, 90, 118])
        return scales
    exponents = torch.randint(-121, -2, (16, 8), generator=gen).float()
    scales = (torch.rand(16, 8, generator=gen) + 1) * torch.exp2(exponents)
    scales[:, plane] = torch.tensor([0.0, INT4_FOLD_MIN_SCALE, -INT4_FOLD_MIN_SCALE * 1.5, 2.0**-120, 0.498, -0.498,
                                     1.0 / 3, 0.01, -0.01, 1e-3, 2.0**-20, -3e-5, 0.2, 0.1234, -0.3, 0.45])
    return scales.bfloat16()


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
@pytest.mark.parametrize("plane", range(4))
def test_folded_decode_is_the_correctly_rounded_bf16_weight(fmt, plane, device):
    """FOLD: every (even, odd) code pair of a plane, each row with its own scale at the fold's edges, decoded and
    scaled in one PTX FMA -> bit for bit the bf16 weight: INT4 ``bf16((code - 8) * s) / 16`` (the exact product
    rounded once, over the 16 the kernel multiplies its sums by), MXFP4 ``E2M1 * 2**(byte - 125)`` (exact). The words
    carry the other planes' codes, the scales' other groups their own values."""
    if device == "cpu":
        pytest.skip("FOLD is PTX: it runs on a GPU only")
    gen = torch.Generator().manual_seed(plane)
    even, odd, words = _every_code_pair(fmt, plane, seed=plane)
    scales = _fold_scales(fmt, plane, gen)
    out = torch.empty(16, 32, dtype=torch.bfloat16, device=device)
    _folded_plane_kernel[(1,)](words.to(device), scales.to(device), out, PLANE=plane, W4=1 if fmt == "int4" else 2)
    if fmt == "int4":
        codes = torch.stack([even, odd], dim=-1).reshape(16, 32).float() - 8
        # + 0.0: where the product is 0 the FMA gives +0 (code * s - 8 s), torch -0 for a negative code or scale
        expected = ((codes * scales[:, plane].float()[:, None] + 0.0).bfloat16().float() / 16).bfloat16()
    else:
        values = torch.stack([e2m1_to_float(even.to(torch.uint8)), e2m1_to_float(odd.to(torch.uint8))], dim=-1)
        expected = (values.reshape(16, 32) * torch.exp2(scales[:, plane].float() - 125)[:, None]).bfloat16()
    assert_bitwise_equal(out.cpu(), expected, fmt=fmt, plane=plane)


@triton.jit
def _fold_multipliers_kernel(scale_ptr, mult_ptr, bias_ptr, W4: tl.constexpr):
    rows = tl.arange(0, 16)
    mults, biases = w4._fold_multipliers(scale_ptr, 0, 0, 0, rows, rows < 16, W4, tl.zeros([16], tl.int32), False)
    for group in tl.static_range(8):
        tl.store(mult_ptr + rows * 8 + group, mults[group])
        tl.store(bias_ptr + rows * 8 + group, biases[group])


def _bf16_halves(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 words -> their (low, high) bf16 halves as fp32."""
    return tuple(((words >> shift) & 0xFFFF).to(torch.int16).view(torch.bfloat16).float() for shift in (0, 16))


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
def test_fold_multipliers_put_each_group_in_its_half(fmt, device):
    """FOLD's per-row multiplier and bias of group g sit in bf16 half ``g % 2`` (groups 2j, 2j + 1 share a register):
    INT4 ``s * 2**129`` (even groups: codes at bits 0..3) or ``s * 2**125`` (odd: bits 4..7), bias ``-s / 2``; MXFP4
    ``2**(byte + 1)`` for every byte at every group position, bias -0.0. One byte past ``MXFP4_FOLD_MAX_SCALE_BYTE``
    overflows bf16, which is why the launcher keeps larger bytes on the fp32 route."""
    if device == "cpu":
        pytest.skip("FOLD is PTX: it runs on a GPU only")
    if fmt == "mxfp4":  # every byte 0..127 at every group position
        scales = torch.cat([torch.roll(torch.arange(128, dtype=torch.uint8), shift).reshape(16, 8)
                            for shift in range(8)])
        expected_mult = torch.exp2(scales.float() + 1)
        expected_bias = torch.full(scales.shape, -0.0)
    else:
        gen = torch.Generator().manual_seed(0)
        scales = torch.cat([_fold_scales("int4", plane, gen) for plane in range(8)])
        multiplier = torch.exp2(torch.tensor([129.0, 125.0] * 4, dtype=torch.float64))  # 2**129 is past fp32's range
        expected_mult = (scales.double() * multiplier).float()
        expected_bias = -scales.float() / 2
    mults, biases = (torch.empty(scales.shape, dtype=torch.int32, device=device) for _ in range(2))
    for block in range(0, scales.shape[0], 16):
        _fold_multipliers_kernel[(1,)](scales[block:block + 16].contiguous().to(device), mults[block:block + 16],
                                       biases[block:block + 16], W4=1 if fmt == "int4" else 2)
    half = torch.arange(8) % 2 == 1  # odd groups: the high half
    (mult_lo, mult_hi), (bias_lo, bias_hi) = _bf16_halves(mults.cpu()), _bf16_halves(biases.cpu())
    got_mult, got_bias = torch.where(half, mult_hi, mult_lo), torch.where(half, bias_hi, bias_lo)
    ok = scales <= MXFP4_FOLD_MAX_SCALE_BYTE if fmt == "mxfp4" else torch.ones(scales.shape, dtype=torch.bool)
    assert_bitwise_equal(got_mult[ok], expected_mult[ok], fmt=fmt)
    assert_bitwise_equal(got_bias[ok], expected_bias[ok], fmt=fmt)
    if fmt == "mxfp4":
        assert torch.isinf(got_mult[scales == MXFP4_FOLD_MAX_SCALE_BYTE + 1]).all()


@triton.jit
def _cat_k_kernel(in_ptr, out_ptr, ROWS: tl.constexpr, COLS: tl.constexpr):
    rows = tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, COLS)[None, :]
    q0 = tl.load(in_ptr + rows * COLS + cols)  # Triton 3.6 compiles no generator expressions in a kernel
    q1 = tl.load(in_ptr + ROWS * COLS + rows * COLS + cols)
    q2 = tl.load(in_ptr + 2 * ROWS * COLS + rows * COLS + cols)
    q3 = tl.load(in_ptr + 3 * ROWS * COLS + rows * COLS + cols)
    tl.store(out_ptr + rows * 4 * COLS + tl.arange(0, 4 * COLS)[None, :],
             w4._cat_k(w4._cat_k(q0, q1), w4._cat_k(q2, q3)))


def test_cat_k_puts_the_planes_side_by_side_in_order(device):
    """ONE_DOT's operand: four decoded planes ``[R, 32]`` -> ``[R, 128]``, plane p's columns at 32 p .. 32 p + 31 (the
    order of x's 128 features it is dotted with)."""
    planes = torch.arange(4 * 16 * 32, dtype=torch.float32).reshape(4, 16, 32)
    out = torch.empty(16, 128, device=device)
    _cat_k_kernel[(1,)](planes.to(device), out, ROWS=16, COLS=32)
    assert torch.equal(out.cpu(), torch.cat(list(planes), dim=1))


@pytest.mark.parametrize("x_dtype", X_DTYPES)
def test_mxfp4_scale_bytes_decode_exactly(x_dtype, device):
    """Every E8M0 byte 0..239, at each of the 8 group positions of a row's scales -> 2**(byte - 125) (times 2**14 for
    bf16 x: the decode's 2**-14 taken back)."""
    unit = 14 if x_dtype == torch.bfloat16 else 0
    for shift in range(8):  # every byte at every position
        scales = torch.roll(torch.arange(256, dtype=torch.uint8), shift).reshape(32, 8)
        ok = scales <= MXFP4_MAX_SCALE_BYTE + 1  # 239 too: 2**128 overflows to inf, in the kernel as in fp32
        expected = torch.exp2(scales.double() - 125 + unit).float()
        assert_bitwise_equal(_kernel_scales(scales, 2, x_dtype, device)[ok], expected[ok], x_dtype=x_dtype)


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_int4_block_scales_reach_their_group(scale_dtype, device):
    """A row's 8 stored INT4 scales (bf16, fp16, fp32) in one load, split in registers: each group gets its own
    scale, bit for bit in fp32 (signs included)."""
    gen = torch.Generator().manual_seed(0)
    scales = (torch.randn(16, 8, generator=gen) * torch.exp2(torch.randint(-20, 4, (16, 8), generator=gen).float())
              ).to(scale_dtype)
    scales[1, 7] = -0.0
    got = _kernel_scales(scales, 1, torch.bfloat16, device)
    assert torch.equal(got.view(torch.int32), scales.float().view(torch.int32))


# --------------------------------------------------------------------------------------------------
# the kernel against its twin, and through the public API
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", W4)
@pytest.mark.parametrize("dtype", X_DTYPES)
@pytest.mark.parametrize("activation", ["silu", "situ"])
def test_w4_kernel_matches_twin(fmt, dtype, activation, device, assert_close):
    hidden, inter = 96, 32  # neither is whole 256-feature blocks: padded planes, masked x columns
    q = _qweights(fmt, len(COUNTS), hidden, inter, device)
    layout = ExpertLayout.from_counts(torch.tensor(COUNTS, device=device), alignment=16, num_pool_rows=64)
    x_PDx, valid = _pool(layout, hidden, dtype, device)
    args = (x_PDx, *_planes(q), layout.row_start_e, layout.num_rows_e, activation)
    tiles = GPU_TILES if device == "cuda" else None
    y_PDx, y_ref = w4.grouped_mlp_w4(*args, tiles=tiles), w4.grouped_mlp_w4_ref(*args)
    case = dict(fmt=fmt.value, dtype=dtype, activation=activation)
    assert (y_PDx.cpu()[~valid] == 0).all(), case
    assert_close(y_PDx, y_ref, dtype, **case)


@pytest.mark.parametrize("fmt", W4)
def test_w4_kernel_on_whole_blocks_all_rows_on_one_expert_and_forced_tiles(fmt, device, assert_close):
    """D = F = 256 (x's loads unmasked), every row on the last expert, the default tile and forced ones alike (wgmma,
    mma.sync, and BLOCK_M 8 over several M blocks of one expert)."""
    hidden = inter = 256
    q = _qweights(fmt, 3, hidden, inter, device, seed=8)
    layout = ExpertLayout.from_counts(torch.tensor([0, 0, 21], device=device), alignment=1)
    x_PDx, _ = _pool(layout, hidden, torch.bfloat16, device, seed=9)
    args = (x_PDx, *_planes(q), layout.row_start_e, layout.num_rows_e)
    y_ref = w4.grouped_mlp_w4_ref(*args)
    assert_close(w4.grouped_mlp_w4(*args), y_ref, torch.bfloat16, fmt=fmt.value)
    forced = w4.grouped_mlp_w4(*args, tiles=((32, 32, 4, 2), (16, 64, 4, 2)))
    assert_close(forced, y_ref, torch.bfloat16, fmt=fmt.value, tiles="forced")
    mma_sync = w4.grouped_mlp_w4(*args, tiles=((16, 32, 2, 3), (16, 32, 2, 4)))  # on Hopper: mma.sync, not wgmma
    assert_close(mma_sync, y_ref, torch.bfloat16, fmt=fmt.value, tiles="mma.sync")
    eight_rows = w4.grouped_mlp_w4(*args, tiles=((8, 32, 2, 2), (8, 64, 4, 3)))  # 21 rows: three M blocks of 8
    assert_close(eight_rows, y_ref, torch.bfloat16, fmt=fmt.value, tiles="BLOCK_M 8")
    one_block = w4.grouped_mlp_w4(*args, tiles=((32, 64, 4, 2), (32, 128, 8, 3)))  # 21 rows in one M block of 32
    assert_close(one_block, y_ref, torch.bfloat16, fmt=fmt.value, tiles="BLOCK_M 32")


@pytest.mark.parametrize("fmt", W4)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # the folded decode, and the fp32 route
def test_plain_launch_with_k_not_whole_blocks_on_every_tile(fmt, dtype, device, assert_close):
    """The plain GEMM (down's kind of launch) at K = 96 (a partial 256-feature block: x's group loads masked) and
    N = 192 against the dequantized weights, on every autotune tile on a GPU (the interpreter: its tile). Triton 3.6
    once computed this launch's store column wrong on the 8-row tiles of 2 or 4 warps when x's mask was per column:
    a misaligned-address fault on the H200 (2026-12-02)."""
    hidden, inter, pool = 96, 96, 64
    gate_up, _ = _planes(_qweights(fmt, len(COUNTS), hidden, inter, device, seed=3))
    layout = ExpertLayout.from_counts(torch.tensor(COUNTS, device=device), alignment=16, num_pool_rows=pool)
    x_PDx, valid = _pool(layout, hidden, dtype, device, seed=4)
    weight_eOI = dequantize_planes(gate_up).to(device)
    expected = torch.full((pool, 2 * inter), float("nan"), device=device)
    for expert, (start, count) in enumerate(zip(layout.row_start_e.tolist(), layout.num_rows_e.tolist())):
        expected[start:start + count] = x_PDx[start:start + count].float() @ weight_eOI[expert].T
    for tile in w4.TILES if device == "cuda" else [None]:
        c_PO = torch.full((pool, 2 * inter), float("nan"), device=device)
        w4.launch_w4_gemm(x_PDx, gate_up, c_PO, layout.row_start_e, layout.num_rows_e, rows_hint=24, tile=tile)
        case = dict(fmt=fmt.value, dtype=dtype, tile=tile)
        assert c_PO.cpu()[~valid].isnan().all(), case  # nothing written outside the segments
        assert_close(c_PO[valid.to(device)], expected[valid.to(device)], dtype, **case)


def test_int4_weights_past_the_fold_limit_keep_the_fp32_route(device, assert_close):
    """A gate_up group scale of 0.75 (|w| up to 6) is past ``INT4_FOLD_SCALE_LIMIT``: that weight is not foldable, so
    on a GPU its GEMM keeps the scale in fp32 while down (foldable) takes the folded decode; both match the twin."""
    q = _qweights(QuantFormat.INT4_GROUP, 3, 256, 256, device, seed=5)
    q.gate_up_scale_e2FDs[1, 7, 3] = 0.75
    planes = _planes(q)
    assert not planes[0].foldable and planes[1].foldable
    layout = ExpertLayout.from_counts(torch.tensor([4, 13, 0], device=device), alignment=1)
    x_PDx, _ = _pool(layout, 256, torch.bfloat16, device, seed=6)
    args = (x_PDx, *planes, layout.row_start_e, layout.num_rows_e)
    tiles = GPU_TILES if device == "cuda" else None
    assert_close(w4.grouped_mlp_w4(*args, tiles=tiles), w4.grouped_mlp_w4_ref(*args), torch.bfloat16)


def test_w4_kernel_with_no_rows_returns_an_empty_pool(device):
    q = _qweights(QuantFormat.INT4_GROUP, 2, 64, 32, device)
    layout = ExpertLayout.from_counts(torch.tensor([0, 0], device=device), alignment=1)
    y = w4.grouped_mlp_w4(torch.zeros(0, 64, device=device), *_planes(q), layout.row_start_e, layout.num_rows_e)
    assert y.shape == (0, 64) and y.dtype == torch.float32


def _on_a_coarse_grid(x_PDx: torch.Tensor) -> torch.Tensor:
    """x rounded to multiples of 2**-6 in [-4, 4] (NaN rows stay NaN): at most 8 significant bits, so bf16 holds
    every value exactly. Each product of such an x with a 4-bit weight (an INT4 code is an integer, an E2M1 value a
    multiple of 0.5; the bf16 decode's 2**-14 only moves the exponent) is then a multiple of 2**-7, and a group's 32
    of them sum to at most 32 * 4 * 8 = 2**10 in magnitude: every partial sum, in whatever order, needs at most
    17 of fp32's 24 significand bits. A group's fp32 dot is then exact, whichever summation order the dot's
    implementation picks (under the interpreter: numpy's BLAS, whose kernel and order depend on the CPU)."""
    return ((x_PDx.float() * 64).round().clamp(-256, 256) / 64).to(x_PDx.dtype)


FP32_UNIT_ROUNDOFF = 2.0**-24


def _assert_within_fp32_order_bound(h_PF, expected_PF, gate_up_P2F, x_PDx, weight_eOI, group_P, valid, act, case):
    """fp32 ``h = act(gate, up)`` of two launches whose fp32 dots may sum in different orders (under the
    interpreter ``tl.dot`` is numpy's BLAS, whose kernel, and so each element's summation order, depends on the CPU
    and on the element's place in the tile): equal within a bound of that order, element by element.

    Each launch's gate (and up) is within ``gamma_n * A`` of the exact sum (Higham's bound for a dot product of K
    terms in any order, FMA or not, with n = K + 2 roundings per term covering the product, the group scale's
    multiply and the additions), A = sum_k |w_k| |x_k|: the two launches differ by at most dg = 2 gamma_n A_gate and
    du = 2 gamma_n A_up. Both activations are h = s(gate) t(up) with |s'| <= 1.25 (SiLU 1.10; SiTU's gate
    sech^2 * sigmoid + |b tanh| sigmoid' <= 1 + 0.224), |t'| <= 1, |s(g)| <= |g|, |t(u)| <= |u|, so the exact
    activations of the two launches' inputs differ by at most 1.25 dg (|u| + du) + |g| du. Each launch then
    evaluates the activation in fp32 on its own inputs: within 16 u (b |t| + lb |s| + |s t|) of exact, u the unit
    roundoff, b = situ_beta and lb = situ_linear_beta where SiTU squashes (0 otherwise): exp within 2 ulps, and
    ``tanh = 1 - 2 / (exp(2y) + 1)`` loses up to ~10 u absolutely near 0, which beta scales (measured: the two
    launches' largest difference was 7.3e-6 on a host whose BLAS sums them differently)."""
    valid_c = valid.cpu()
    x = x_PDx.cpu().double()[valid_c].abs()
    weight = weight_eOI.cpu().double().abs()[group_P.cpu()[valid_c].long()]  # [V, 2F, D]: each row's expert
    sum_abs_V2F = torch.einsum("vd,vod->vo", x, weight)
    n = x.shape[1] + 2
    gamma = n * FP32_UNIT_ROUNDOFF / (1 - n * FP32_UNIT_ROUNDOFF)
    dg, du = (2 * gamma * sum_abs_V2F).chunk(2, dim=-1)
    gate, up = gate_up_P2F.cpu().double()[valid_c].abs().chunk(2, dim=-1)
    gate_max, up_max = gate + dg, up + du
    beta = act["situ_beta"] if act["activation"] == "situ" else 0.0
    linear_beta = act["situ_linear_beta"] if act["activation"] == "situ" else 0.0
    bound = (1.25 * dg * up_max + gate * du
             + 32 * FP32_UNIT_ROUNDOFF * (beta * up_max + linear_beta * gate_max + gate_max * up_max))
    got, want = h_PF.cpu().double()[valid_c], expected_PF.cpu().double()[valid_c]
    err = (got - want).abs()
    bad = ~(err <= bound)  # NaN on either side fails too
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} elements differ past the summation-order bound: "
                           f"max err {err.max().item():.3g}, max err / bound {(err / bound).max().item():.3g}, "
                           f"max bound {bound.max().item():.3g}; {case=}")


@pytest.mark.parametrize("fmt", W4)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("activation, situ_linear_beta", [("silu", 25.0), ("situ", 25.0), ("situ", 0.0)])
def test_gated_launch_is_the_plain_gemm_then_the_activation(fmt, dtype, activation, situ_linear_beta, device):
    """GEMM1 with the activation in its epilogue (a tile's weight rows: half gate, then the up rows of the same
    features) writes the h of the plain GEMM1 into fp32 ``[P, 2F]`` followed by ``gated_activation_rows`` (the same
    sums, the same fp32 activation, one rounding), and nothing outside the segments. F = 36 leaves the last tile's
    features partly past F; on a GPU every kind of tile (wgmma, mma.sync, 8 and 32 rows) for SiLU on bf16.

    The two launches put a weight row in different tiles and places, so their dots may sum in different orders: bf16
    x is drawn on a coarse grid that makes every group's fp32 dot exact (``_on_a_coarse_grid``; on a GPU both
    launches run one MMA sequence per element), so bf16 is compared bit for bit; fp32 x within the bound of the
    summation order (``_assert_within_fp32_order_bound``)."""
    hidden, inter, pool = 96, 36, 64
    weight = torch.randn(len(COUNTS), 2 * inter, hidden, generator=torch.Generator().manual_seed(3)) / hidden**0.5
    packed, scale = quantize_weight(weight, fmt)
    gate_up = to_group_planes(packed.to(device), scale.to(device), w4_format_name(fmt))
    layout = ExpertLayout.from_counts(torch.tensor(COUNTS, device=device), alignment=16, num_pool_rows=pool)
    x_PDx, valid = _pool(layout, hidden, dtype, device, seed=4)
    if dtype == torch.bfloat16:
        x_PDx = _on_a_coarse_grid(x_PDx)
    segments = (layout.row_start_e, layout.num_rows_e)
    group_P = pool_row_experts(*segments, pool)
    act = dict(activation=activation, situ_beta=4.0, situ_linear_beta=situ_linear_beta)
    tiles = [None]  # the interpreter's tile
    if device == "cuda":  # each kind of tile once (compiles take seconds each), the others at the decode tile
        every_kind = activation == "silu" and dtype == torch.bfloat16
        tiles = [(16, 64, 4, 3), (16, 128, 8, 3), (16, 32, 2, 3), (8, 32, 2, 2), (32, 64, 4, 2)]
        tiles = tiles if every_kind else tiles[:1]
    for tile in tiles:
        gate_up_P2F = torch.zeros(pool, 2 * inter, dtype=torch.float32, device=device)
        w4.launch_w4_gemm(x_PDx, gate_up, gate_up_P2F, *segments, rows_hint=24, tile=tile)
        expected, _ = gated_activation_rows(gate_up_P2F, group_P=group_P, out_dtype=dtype, **act)
        h_PF = torch.full((pool, inter), float("nan"), dtype=dtype, device=device)
        w4.launch_w4_gemm(x_PDx, gate_up, h_PF, *segments, rows_hint=24, tile=tile, **act)
        case = dict(fmt=fmt.value, dtype=dtype, tile=tile, **act)
        if dtype == torch.bfloat16:
            assert_bitwise_equal(h_PF.cpu()[valid], expected.cpu()[valid], **case)
        else:
            _assert_within_fp32_order_bound(h_PF, expected, gate_up_P2F, x_PDx, dequantize_planes(gate_up), group_P,
                                            valid, act, case)
        assert h_PF.cpu()[~valid].isnan().all(), case


@pytest.mark.parametrize("fmt", W4)
def test_w4a16_experts_equal_the_dequantized_fp32_torch_loop(fmt, device):
    hidden, inter = 96, 64  # 3 scale groups along D, 2 along F; several K steps
    q = _qweights(fmt, 3, hidden, inter, device, seed=2)
    layout = ExpertLayout.from_counts(torch.tensor([7, 0, 18], device=device), alignment=1)
    x_PDx, _ = _pool(layout, hidden, torch.float32, device, seed=3)
    experts = make_quantized_experts(q, "situ", backend="triton")
    assert isinstance(experts, W4A16Experts) and experts.segment_alignment == 1
    # checkpoint order (and D, F not whole 256-blocks, so never in place): a padded copy of the words
    assert q.with_group_planes() is q and experts.extra_nbytes() > q.gate_up_qweight_e2FDq.nbytes
    reference = make_experts("torch", *(w.cpu() for w in q.dequantize(torch.float32)), "situ")
    y, y_ref = experts(x_PDx, layout).cpu(), reference(x_PDx.cpu(), layout)
    diff = calc_diff(y, y_ref)
    assert diff <= 1e-5, f"{fmt=} {diff=}"
    assert calc_diff(y_ref, torch.zeros_like(y_ref)) == 1.0
    # and the torch backend of the same weights (dequantized per expert as its rows run) is that reference
    torch_experts = make_quantized_experts(q.to("cpu"), "situ", backend="torch")
    assert torch.equal(torch_experts(x_PDx.cpu(), layout), y_ref)


@pytest.mark.parametrize("fmt", W4)
def test_experts_on_weights_rewritten_in_place_hold_one_copy(fmt, device):
    """``with_group_planes`` rewrites the stored words in place (what the layer does with its own): the kernel then
    reads them with no copy, gives the same output as from a copy, and ``as_stored`` / ``dequantize`` / the torch
    backend still see the checkpoint's weights."""
    q = _qweights(fmt, 2, 256, 256, device, seed=11)
    stored = [t.clone() for t in q.tensors()]
    q_copy = dataclasses.replace(q, **dict(zip(QUANTIZED_TENSOR_FIELDS, stored)))  # q's own tensors get rewritten
    layout = ExpertLayout.from_counts(torch.tensor([3, 17], device=device), alignment=1)
    x_PDx, _ = _pool(layout, 256, torch.float32, device, seed=12)
    y_from_copy = make_quantized_experts(q, "silu", backend="triton")(x_PDx, layout)
    reference = make_quantized_experts(q.to("cpu"), "silu", backend="torch")(x_PDx.cpu(), layout)

    in_place = q.with_group_planes()
    assert in_place.nibble_order == "group_planes" and in_place.nbytes() == q.nbytes()
    assert in_place.gate_up_qweight_e2FDq.data_ptr() == q.gate_up_qweight_e2FDq.data_ptr()
    assert not torch.equal(in_place.gate_up_qweight_e2FDq, stored[0])  # rewritten
    experts = make_quantized_experts(in_place, "silu", backend="triton")
    assert experts.gate_up_planes.words_eOw.data_ptr() == in_place.gate_up_qweight_e2FDq.data_ptr()
    scales = experts.gate_up_planes.block_scale.nbytes + experts.down_planes.block_scale.nbytes
    assert experts.extra_nbytes() == scales
    assert torch.equal(experts(x_PDx, layout), y_from_copy)
    assert all(torch.equal(a, b) for a, b in zip(in_place.as_stored().tensors(), stored))
    assert all(torch.equal(a, b) for a, b in zip(in_place.dequantize(), q_copy.dequantize()))
    torch_experts = make_quantized_experts(in_place.to("cpu"), "silu", backend="torch")
    assert torch.equal(torch_experts(x_PDx.cpu(), layout), reference)


def test_fp8_checkpoint_experts_run_the_stored_weights(device):
    hidden, inter = 160, 128  # an edge block along D
    q = _qweights(QuantFormat.FP8_BLOCK, 3, hidden, inter, device, seed=4)
    layout = ExpertLayout.from_counts(torch.tensor([4, 9, 0], device=device), alignment=1)
    x_PDx, _ = _pool(layout, hidden, torch.float32, device, seed=5)
    experts = make_quantized_experts(q, "silu", backend="triton")
    assert isinstance(experts, FP8BlockExperts) and experts.accepts_fp8_input
    assert experts.fp8_weights.gate_up_fp8_e2FD is q.gate_up_qweight_e2FDq  # the checkpoint's tensor, not a copy
    reference = make_quantized_experts(q.to("cpu"), "silu", backend="torch")
    y, y_ref = experts(x_PDx, layout).cpu(), reference(x_PDx.cpu(), layout)
    assert calc_diff(y.float(), y_ref) <= CALC_DIFF_TOLERANCES[torch.float8_e4m3fn]


def test_fp8_checkpoint_experts_interleaved_in_place_hold_one_copy(device, assert_close):
    """``with_interleaved_gate_up`` moves an FP8 checkpoint's gate/up rows and scale rows in place into 128-row gate
    and up blocks (what the layer does with its own): the kernel reads them with no copy, gives the output of an
    interleaved copy bit for bit and the stacked rows' output within FP8's tolerance (one dot over gate and up per
    k-step against two: the fp32 sums may run in another order, numpy's BLAS choosing it under the interpreter, and
    h is re-quantized to e4m3, where one rounding may flip), and ``as_stored`` / ``dequantize`` / the torch backend
    still see the checkpoint's weights."""
    q = _qweights(QuantFormat.FP8_BLOCK, 3, 160, 256, device, seed=6)  # F 256: two gate and two up blocks
    stored = [t.clone() for t in q.tensors()]
    q_copy = dataclasses.replace(q, **dict(zip(QUANTIZED_TENSOR_FIELDS, stored)))  # q's own tensors get rewritten
    interleaved_copy = dataclasses.replace(q, **dict(zip(QUANTIZED_TENSOR_FIELDS, (t.clone() for t in stored))))
    interleaved_copy = interleaved_copy.with_interleaved_gate_up()
    layout = ExpertLayout.from_counts(torch.tensor([4, 9, 0], device=device), alignment=1)
    x_PDx, _ = _pool(layout, 160, torch.float32, device, seed=7)
    y_stacked = make_quantized_experts(q_copy, "silu", backend="triton")(x_PDx, layout)
    y_interleaved_copy = make_quantized_experts(interleaved_copy, "silu", backend="triton")(x_PDx, layout)
    reference = make_quantized_experts(q_copy.to("cpu"), "silu", backend="torch")(x_PDx.cpu(), layout)

    in_place = q.with_interleaved_gate_up()
    assert in_place.gate_up_interleaved and in_place.nbytes() == q.nbytes()
    assert in_place.gate_up_qweight_e2FDq.data_ptr() == q.gate_up_qweight_e2FDq.data_ptr()
    bits = [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in stored]
    assert torch.equal(in_place.gate_up_qweight_e2FDq[:, 128:256].view(torch.uint8), bits[0][:, 256:384])
    assert torch.equal(in_place.gate_up_scale_e2FDs[:, 1], stored[1][:, 2])  # up block 0's scales, second
    assert in_place.with_interleaved_gate_up() is in_place
    experts = make_quantized_experts(in_place, "silu", backend="triton")
    assert experts.fp8_weights.gate_up_interleaved
    assert experts.fp8_weights.gate_up_fp8_e2FD is in_place.gate_up_qweight_e2FDq
    y_PDx = experts(x_PDx, layout)
    assert torch.equal(y_PDx, y_interleaved_copy)  # the same kernel on the same bytes
    assert_close(y_PDx, y_stacked, "fp8", vs="stacked")
    assert all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a, b)
               for a, b in zip(in_place.as_stored().tensors(), bits))
    assert all(torch.equal(a, b) for a, b in zip(in_place.dequantize(), q_copy.dequantize()))
    assert torch.equal(in_place.dequantize_expert(1, "gate_up"), q_copy.dequantize_expert(1, "gate_up"))
    torch_experts = make_quantized_experts(in_place.to("cpu"), "silu", backend="torch")
    assert torch.equal(torch_experts(x_PDx.cpu(), layout), reference)


def test_w4_argument_errors(device):
    q = _qweights(QuantFormat.MXFP4, 2, 64, 32, device)
    gate_up, down = _planes(q)
    layout = ExpertLayout.from_counts(torch.tensor([3, 2], device=device), alignment=1)
    x_PDx = torch.zeros(5, 64, device=device)
    with pytest.raises(DTypeError, match="grouped_mlp_w4"):  # the dense kernel points at the 4-bit one
        gm.grouped_mlp(x_PDx, q.gate_up_qweight_e2FDq, q.down_qweight_eDFq, layout.row_start_e, layout.num_rows_e,
                       gate_up_scale=q.gate_up_scale_e2FDs, down_scale=q.down_scale_eDFs)
    rows = (layout.row_start_e, layout.num_rows_e)
    with pytest.raises(DTypeError, match="bf16/fp16/fp32"):
        w4.grouped_mlp_w4(x_PDx.to(torch.float8_e4m3fn), gate_up, down, *rows)
    with pytest.raises(ShapeError, match="disagree"):
        w4.grouped_mlp_w4(torch.zeros(5, 96, device=device), gate_up, down, *rows)
    with pytest.raises(ShapeError, match="disagree"):
        w4.grouped_mlp_w4(x_PDx, gate_up, gate_up, *rows)
    int4_down = _planes(_qweights(QuantFormat.INT4_GROUP, 2, 64, 32, device))[1]
    with pytest.raises(DTypeError, match="one format"):
        w4.grouped_mlp_w4(x_PDx, gate_up, int4_down, *rows)
    with pytest.raises(UnknownNameError, match="gelu"):
        w4.grouped_mlp_w4(x_PDx, gate_up, down, *rows, activation="gelu")
    with pytest.raises(InvalidConfigError, match="BLOCK_M must be >= 8"):
        w4.launch_w4_gemm(x_PDx, gate_up, torch.empty(5, 64, device=device), *rows, rows_hint=5, tile=(4, 64, 4, 2))
    with pytest.raises(InvalidConfigError, match="BLOCK_N >= 16"):
        w4.launch_w4_gemm(x_PDx, gate_up, torch.empty(5, 64, device=device), *rows, rows_hint=5, tile=(8, 8, 4, 2))
    with pytest.raises(ShapeError, match=r"c must be \[P, O / 2\]"):  # gated: h has F columns, not 2F
        w4.launch_w4_gemm(x_PDx, gate_up, torch.empty(5, 64, device=device), *rows, rows_hint=5, activation="silu")
    with pytest.raises(ShapeError, match=r"c must be \[P, O\]"):
        w4.launch_w4_gemm(x_PDx, gate_up, torch.empty(5, 32, device=device), *rows, rows_hint=5)
    with pytest.raises(UnknownNameError, match="gelu"):
        w4.launch_w4_gemm(x_PDx, gate_up, torch.empty(5, 32, device=device), *rows, rows_hint=5, activation="gelu")


@pytest.mark.parametrize("name, fmt, overrides", [
    ("tiny-kimi-k3", "mxfp4", dict(intermediate_size=32)),
    ("tiny-kimi-k2", "int4_group", dict(hidden_size=64, intermediate_size=32)),
    ("tiny-deepseek-v3", "fp8_block", dict(intermediate_size=128)),
])
def test_layer_loads_a_quantized_checkpoint_into_the_triton_quantized_experts(tmp_path, device, name, fmt, overrides):
    """MegaMoE.load_hf_weights with experts_backend='triton': W4A16 (INT4, MXFP4) or the FP8 block kernel run the
    stored tensors inside the routed step; compared with the layer's reference on the dequantized weights."""
    import dataclasses

    from moe_ref.core.config import preset
    from moe_ref.layer import MegaMoE
    from moe_ref.reference import reference_moe
    from moe_ref.checkpoint.synthetic import quantizable_config, write_synthetic_checkpoint

    cfg = quantizable_config(dataclasses.replace(preset(name), **overrides), fmt)
    written = write_synthetic_checkpoint(tmp_path, cfg, layer_idx=0, quant=fmt, seed=6, dtype=torch.float32)
    layer = MegaMoE(cfg, num_max_tokens_per_rank=32, experts_backend="triton", device=device)
    layer.load_hf_weights(tmp_path, layer_idx=0, progress=False)
    assert isinstance(layer.experts, FP8BlockExperts if fmt == "fp8_block" else W4A16Experts)
    assert layer.gate_up_weight is None and layer.quantized_experts.device.type == torch.device(device).type
    x = torch.randn(30, cfg.hidden_size, generator=torch.Generator().manual_seed(7)).to(device)
    with torch.inference_mode():
        y = layer(x)
        y_ref = reference_moe(x, written.to(device), cfg)
    layer.destroy()
    limit = CALC_DIFF_TOLERANCES[torch.float8_e4m3fn] if fmt == "fp8_block" else 1e-5
    assert calc_diff(y, y_ref) <= limit, (fmt, calc_diff(y, y_ref))
    assert calc_diff(y_ref, torch.zeros_like(y_ref)) == 1.0



@pytest.mark.parametrize("name, fmt, overrides", [
    ("tiny-kimi-k3", "mxfp4", dict(intermediate_size=32)),
    ("tiny-kimi-k2", "int4_group", dict(hidden_size=64, intermediate_size=32)),
])
def test_layer_runs_w4a8_when_the_environment_asks(tmp_path, device, monkeypatch, name, fmt, overrides):
    """``MOE_REF_W4A8_ROWS_PER_EXPERT=0``: the layer's 4-bit experts run W4A8 at every call, within the FP8 recipe's
    bound of the layer's reference on the dequantized weights and unlike the W4A16 layer's output."""
    from moe_ref.core.config import preset
    from moe_ref.layer import MegaMoE
    from moe_ref.reference import reference_moe
    from moe_ref.checkpoint.synthetic import quantizable_config, write_synthetic_checkpoint

    cfg = quantizable_config(dataclasses.replace(preset(name), **overrides), fmt)
    written = write_synthetic_checkpoint(tmp_path, cfg, layer_idx=0, quant=fmt, seed=6, dtype=torch.float32)
    x = torch.randn(30, cfg.hidden_size, generator=torch.Generator().manual_seed(7)).to(device)
    outputs = {}
    for rows in ("0", None):
        if rows is None:
            monkeypatch.delenv("MOE_REF_W4A8_ROWS_PER_EXPERT")
        else:
            monkeypatch.setenv("MOE_REF_W4A8_ROWS_PER_EXPERT", rows)
        layer = MegaMoE(cfg, num_max_tokens_per_rank=32, experts_backend="triton", device=device)
        layer.load_hf_weights(tmp_path, layer_idx=0, progress=False)
        with torch.inference_mode():
            outputs[rows] = layer(x)
        assert layer.experts.a8_rows_per_expert == (0.0 if rows else None), (fmt, rows)
        layer.destroy()
    with torch.inference_mode():
        y_ref = reference_moe(x, written.to(device), cfg)
    assert calc_diff(outputs["0"], y_ref) <= CALC_DIFF_TOLERANCES[torch.float8_e4m3fn], fmt
    assert calc_diff(outputs["0"], outputs[None]) > 1e-6, fmt  # the two paths are told apart


def test_layer_keeps_one_copy_of_its_4bit_experts_and_saves_them_as_stored(tmp_path, device):
    """D = F = 256: the layer rewrites its INT4 experts in place for the kernel at load (the same bytes), and its
    state_dict still holds the checkpoint's tensors, which a fresh layer loads to the same outputs."""
    import dataclasses

    from moe_ref.core.config import preset
    from moe_ref.layer import MegaMoE
    from moe_ref.checkpoint.synthetic import quantizable_config, write_synthetic_checkpoint

    cfg = quantizable_config(dataclasses.replace(preset("tiny-kimi-k2"), hidden_size=256, intermediate_size=256,
                                                 num_experts=4, num_topk=2),
                             "int4_group")
    write_synthetic_checkpoint(tmp_path, cfg, layer_idx=0, quant="int4_group", seed=13, dtype=torch.float32)
    layer = MegaMoE(cfg, num_max_tokens_per_rank=16, experts_backend="triton", device=device)
    layer.load_hf_weights(tmp_path, layer_idx=0, progress=False)
    assert layer.quantized_experts.nibble_order == "group_planes"  # at load: no checkpoint-order object escapes
    as_stored = {k: v.clone() for k, v in layer.state_dict().items() if k.startswith("quantized_experts.")}
    held = layer.expert_nbytes()
    x = torch.randn(12, cfg.hidden_size, generator=torch.Generator().manual_seed(14)).to(device)
    with torch.inference_mode():
        y = layer(x)
    assert layer.quantized_experts.nibble_order == "group_planes" and layer.expert_nbytes() == held
    assert layer.experts.gate_up_planes.words_eOw.data_ptr() == layer.quantized_experts.gate_up_qweight_e2FDq.data_ptr()
    saved = layer.state_dict()
    assert all(torch.equal(saved[k], v) for k, v in as_stored.items()), "state_dict must hold the checkpoint's order"
    fresh = MegaMoE(cfg, num_max_tokens_per_rank=16, experts_backend="triton", device=device)
    fresh.load_state_dict(saved)
    assert fresh.quantized_experts.nibble_order == "group_planes"
    with torch.inference_mode():
        assert torch.equal(fresh(x), y)
    layer.destroy()
    fresh.destroy()


def test_layer_interleaves_its_fp8_experts_in_place_and_saves_them_as_stored(tmp_path, device):
    """An FP8 checkpoint (F = 256): the layer interleaves its experts' gate/up rows in place at load for the FP8 kernel
    (the same bytes), and its state_dict still holds the checkpoint's stacked tensors, which a fresh layer loads to
    the same outputs."""
    import dataclasses

    from moe_ref.core.config import preset
    from moe_ref.layer import MegaMoE
    from moe_ref.checkpoint.reader import CheckpointReader
    from moe_ref.checkpoint.synthetic import quantizable_config, write_synthetic_checkpoint

    cfg = quantizable_config(dataclasses.replace(preset("tiny-kimi-k2"), hidden_size=256, intermediate_size=256,
                                                 num_experts=4, num_topk=2),
                             "fp8_block")
    write_synthetic_checkpoint(tmp_path, cfg, layer_idx=0, quant="fp8_block", seed=15, dtype=torch.float32)
    layer = MegaMoE(cfg, num_max_tokens_per_rank=16, experts_backend="triton", device=device)
    layer.load_hf_weights(tmp_path, layer_idx=0, progress=False)
    assert layer.quantized_experts.gate_up_interleaved  # at load: no checkpoint-order object escapes
    held = layer.expert_nbytes()
    x = torch.randn(12, cfg.hidden_size, generator=torch.Generator().manual_seed(16)).to(device)
    with torch.inference_mode():
        y = layer(x)
    assert layer.expert_nbytes() == held
    assert layer.experts.fp8_weights.gate_up_fp8_e2FD is layer.quantized_experts.gate_up_qweight_e2FDq
    saved = layer.state_dict()
    stacked = saved["quantized_experts.gate_up_qweight_e2FDq"]
    reader = CheckpointReader(tmp_path)
    first = layer.quantized_experts.first_expert
    name = next(n for n in reader.names() if n.endswith(f"experts.{first}.up_proj.weight"))
    up = reader.read(name).view(torch.uint8)  # the checkpoint's own up rows of this rank's first expert
    assert torch.equal(stacked[0, cfg.intermediate_size:].cpu().view(torch.uint8), up)
    fresh = MegaMoE(cfg, num_max_tokens_per_rank=16, experts_backend="triton", device=device)
    fresh.load_state_dict(saved)
    assert fresh.quantized_experts.gate_up_interleaved
    with torch.inference_mode():
        assert torch.equal(fresh(x), y)
    layer.destroy()
    fresh.destroy()


# --------------------------------------------------------------------------------------------------
# W4A8 (grouped_mlp_w4(..., a8=True)): fp8 rows, the weights cast to fp8 in the decode
# --------------------------------------------------------------------------------------------------
def test_a8_tables_scale_each_row_by_a_power_of_two():
    """Per weight row: MXFP4's row scale is ``2**(S - 126)`` for its largest byte S, its multipliers' exponent addend
    ``(254 - S) << 7`` in both bf16 halves, exact while the row's bytes span at most 16; INT4's row scale is
    ``2**(floor(log2 max|s|) - 4)``, its bf16 multiplier the inverse times 16; an all-zero row takes S = 0; INT4 rows
    whose largest scale is below 2**-119 are refused (their multiplier would overflow bf16)."""
    row_scale, fold, exact, supported = a8_tables("mxfp4", block_major_scales(
        torch.tensor([[[120, 118], [101, 117]]], dtype=torch.uint8), 64), 64)  # spreads 2 and 16
    assert_bitwise_equal(row_scale, torch.tensor([[2.0**-6, 2.0**-9]]))
    assert fold.tolist() == [[(134 << 7) * 0x00010001, (137 << 7) * 0x00010001]]
    assert exact and supported
    assert not a8_tables("mxfp4", block_major_scales(torch.tensor([[[120, 103]]], dtype=torch.uint8), 64), 64)[2]
    scales = torch.tensor([[[0.01, -0.02], [0.0, 0.0], [0.5, 0.25]]], dtype=torch.bfloat16)
    row_scale, fold, exact, supported = a8_tables("int4", block_major_scales(scales, 64), 64)
    assert_bitwise_equal(row_scale, torch.tensor([[2.0**-10, 2.0**-4, 2.0**-5]]))
    assert [hex(word & 0xFFFF) for word in fold[0].tolist()] == ["0x4680", "0x4380", "0x4400"]  # 2**14, 2**8, 2**9
    assert not exact and supported
    tiny = torch.tensor([[[2.0**-121, 0.0]]], dtype=torch.bfloat16)
    assert not a8_tables("int4", block_major_scales(tiny, 64), 64)[3]


def _fp8_unit_rows(num_rows: int, features: int, device) -> torch.Tensor:
    """Row i: 448 at feature i, else 0 (fp8 448 with row scale exactly 1), so a GEMM's row i is 448 times weight
    column i times the weight row's A8 scale: the kernel's fp8 weights, recovered exactly."""
    return (torch.eye(features)[:num_rows] * 448).to(device)


A8_ROUTES = [(fmt, route) for fmt in W4 for route in ("one dot a half block", "one dot a group")] + [
    (QuantFormat.INT4_GROUP, "fp32 route")]  # every MXFP4 weight folds in W4A8 (its multipliers are <= 2**127)


@pytest.mark.parametrize("hidden", [96, 256])
@pytest.mark.parametrize("fmt, route", A8_ROUTES)
def test_a8_kernel_multiplies_the_twins_fp8_weights(fmt, hidden, route, device):
    """The fp8 weights the W4A8 kernel multiplies are ``a8_weights_eOI``'s, bit for bit: MXFP4 exact in e5m2, INT4 its
    bf16 weight over the row scale rounded to nearest-even e4m3, including ties. On a GPU each decode route: the
    PTX fold with one K-128 dot a half block (BLOCK_N >= 64), with one dot a group (BLOCK_N 32), and the Triton route
    of weights the fold cannot take (an INT4 scale of 0.75); the interpreter runs the Triton route."""
    q = _qweights(fmt, 2, hidden, 64, device, seed=21)
    if route == "fp32 route":
        q.gate_up_scale_e2FDs[1, 5, 0] = 0.75
    gate_up, _ = _planes(q)
    assert gate_up.a8_supported and gate_up.a8_exact == (fmt == QuantFormat.MXFP4)
    x_fp8, x_scale = quantize_rows_fp8_ref(_fp8_unit_rows(hidden, hidden, device), per_row=True)
    assert bool((x_scale == 1).all())
    tile = {"one dot a half block": (32, 64, 4, 3), "one dot a group": (32, 32, 4, 3), "fp32 route": (32, 64, 4, 3)}
    layout = ExpertLayout.from_counts(torch.tensor([hidden, hidden], device=device), alignment=1)
    x_PI = torch.cat([x_fp8, x_fp8])
    c_PO = torch.empty(2 * hidden, 128, device=device)
    w4.launch_w4_gemm(x_PI, gate_up, c_PO, layout.row_start_e, layout.num_rows_e, rows_hint=2 * hidden,
                      tile=tile[route] if device == "cuda" else None, x_scale=torch.cat([x_scale, x_scale]))
    got_eOI = c_PO.cpu().reshape(2, hidden, 128).transpose(1, 2).contiguous()
    got = got_eOI / gate_up.a8_row_scale_eO.cpu()[..., None] / 448
    # + 0.0: a dot's sum of -0.0 products and +0.0 is +0.0, so MXFP4's code -0 comes back as +0
    assert_bitwise_equal(got + 0.0, a8_weights_eOI(gate_up).cpu() + 0.0, fmt=fmt.value, hidden=hidden, route=route)


@pytest.mark.parametrize("fmt", W4)
@pytest.mark.parametrize("activation", ["none", "silu"])
def test_a8_gemms_match_the_twins_sums(fmt, activation, device, assert_close):
    """Each W4A8 launch against the twin's fp8 operands: the plain GEMM's fp32 output within fp32 summation order
    (every fp8 product is exact in fp32), GEMM1 with its activation within h's bf16 rounding; an empty expert and a
    ragged one, K = 96 (a partial 256-feature block). On a GPU the plain GEMM's bound is that of Hopper's fp8 wgmma,
    which keeps fewer bits than fp32 while it accumulates (measured 1.4e-4 to 2e-3 relative error per element on one
    H100, 2026-12-07): 2**-10 of the sum of the products' magnitudes."""
    q = _qweights(fmt, len(COUNTS), 96, 32, device, seed=22)
    gate_up, _ = _planes(q)
    layout = ExpertLayout.from_counts(torch.tensor(COUNTS, device=device), alignment=16, num_pool_rows=64)
    x_PDx, valid = _pool(layout, 96, torch.bfloat16, device, seed=23)
    x_fp8, x_scale = quantize_rows_fp8_ref(torch.where(valid.to(device)[:, None], x_PDx, 0), per_row=True)
    gated = activation != "none"
    out_dtype = torch.bfloat16 if gated else torch.float32
    c_PO = torch.zeros(64, 32 if gated else 64, dtype=out_dtype, device=device)
    w4.launch_w4_gemm(x_fp8, gate_up, c_PO, layout.row_start_e, layout.num_rows_e, rows_hint=24, x_scale=x_scale,
                      activation=activation, tile=A8_GPU_TILES[0] if device == "cuda" else None)
    weight_eOI, row_scale_eO = a8_weights_eOI(gate_up).to(device), gate_up.a8_row_scale_eO.to(device)
    expected, magnitude = torch.zeros(64, 64, device=device), torch.zeros(64, 64, device=device)
    for expert, (start, count) in enumerate(zip(layout.row_start_e.tolist(), layout.num_rows_e.tolist())):
        rows = slice(start, start + count)
        scales = row_scale_eO[expert] * x_scale[rows, None]
        expected[rows] = (x_fp8[rows].float() @ weight_eOI[expert].T) * scales
        magnitude[rows] = (x_fp8[rows].float().abs() @ weight_eOI[expert].abs().T) * scales
    rows = valid.to(device)
    case = dict(fmt=fmt.value, activation=activation)
    if gated:
        expected = gated_activation(expected[:, :32], expected[:, 32:], activation).to(out_dtype)
    if device == "cuda" and not gated:
        err = (c_PO[rows] - expected[rows]).abs()
        assert bool((err <= 2.0**-10 * magnitude[rows]).all()), (case, err.max().item())
    else:
        assert_close(c_PO[rows], expected[rows], out_dtype, **case)


@pytest.mark.parametrize("fmt", W4)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a8_mlp_matches_its_twin_and_stays_near_w4a16(fmt, dtype, device):
    """The W4A8 MLP (x and h per row in e4m3) against its twin and against the W4A16 twin (within the FP8 recipe's
    bound); rows outside the segments stay 0. Against its own twin the bound is looser than one GEMM's: an ulp of h
    from the dots' summation order can move h's row scale, and with it the row's e4m3 values (measured 1.8e-4 in
    bf16, against 1e-3 here)."""
    q = _qweights(fmt, len(COUNTS), 96, 32, device, seed=22)
    layout = ExpertLayout.from_counts(torch.tensor(COUNTS, device=device), alignment=16, num_pool_rows=64)
    x_PDx, valid = _pool(layout, 96, dtype, device, seed=23)
    args = (x_PDx, *_planes(q), layout.row_start_e, layout.num_rows_e)
    y_PDx = w4.grouped_mlp_w4(*args, a8=True, tiles=A8_GPU_TILES if device == "cuda" else None)
    y_a8_ref, y_w4a16_ref = w4.grouped_mlp_w4_ref(*args, a8=True), w4.grouped_mlp_w4_ref(*args)
    case = dict(fmt=fmt.value, dtype=dtype)
    assert y_PDx.dtype == dtype and (y_PDx.cpu()[~valid] == 0).all(), case
    rows = valid.to(device)
    assert calc_diff(y_PDx[rows], y_a8_ref[rows]) <= 1e-3, case
    assert calc_diff(y_PDx[rows], y_w4a16_ref[rows]) <= CALC_DIFF_TOLERANCES[torch.float8_e4m3fn], case


def test_a8_mlp_with_every_row_on_one_expert_and_no_rows(device):
    """W4A8 on whole blocks (K = 256) with every row on the last expert, and a pool with no rows."""
    q = _qweights(QuantFormat.MXFP4, 3, 256, 256, device, seed=24)
    layout = ExpertLayout.from_counts(torch.tensor([0, 0, 37], device=device), alignment=1)
    x_PDx, _ = _pool(layout, 256, torch.bfloat16, device, seed=25)
    args = (x_PDx, *_planes(q), layout.row_start_e, layout.num_rows_e)
    assert calc_diff(w4.grouped_mlp_w4(*args, a8=True), w4.grouped_mlp_w4_ref(*args, a8=True)) <= 1e-3
    empty = ExpertLayout.from_counts(torch.tensor([0, 0, 0], device=device), alignment=1)
    y = w4.grouped_mlp_w4(torch.zeros(0, 256, dtype=torch.bfloat16, device=device), *_planes(q), empty.row_start_e,
                          empty.num_rows_e, a8=True)
    assert y.shape == (0, 256)


def test_a8_launch_refuses_rows_it_cannot_take(device):
    """x must be e4m3 with one fp32 scale per row; INT4 weights whose largest scale in a row is below 2**-119 are
    refused with the way out (W4A16)."""
    q = _qweights(QuantFormat.INT4_GROUP, 1, 64, 32, device)
    gate_up, _ = _planes(q)
    layout = ExpertLayout.from_counts(torch.tensor([4], device=device), alignment=1)
    x_fp8, x_scale = quantize_rows_fp8_ref(torch.randn(4, 64, device=device), per_row=True)
    c = torch.empty(4, 64, device=device)
    launch = functools.partial(w4.launch_w4_gemm, row_start_e=layout.row_start_e, num_rows_e=layout.num_rows_e,
                               rows_hint=4)
    with pytest.raises(DTypeError, match="one scale per row"):
        launch(x_fp8.float(), gate_up, c, x_scale=x_scale)
    with pytest.raises(DTypeError, match="one scale per row"):
        launch(x_fp8, gate_up, c, x_scale=x_scale[:, None])
    q.gate_up_scale_e2FDs[0, 3] = 2.0**-121
    tiny, _ = _planes(q)
    with pytest.raises(InvalidConfigError, match="W4A16"):
        launch(x_fp8, tiny, c, x_scale=x_scale)


@pytest.mark.parametrize("fmt", W4)
def test_w4a16_experts_run_w4a8_from_their_rows_threshold(fmt, device, monkeypatch):
    """``W4A16Experts(a8_rows_per_expert=n)``: a call whose rows hint reaches n rows per local expert runs W4A8 (the
    A8 twin's output), one below it W4A16 (the W4A16 twin's); ``MOE_REF_W4A8_ROWS_PER_EXPERT`` sets n when the argument
    is not given, a bad value is a coded error; never in the batch-invariant mode; weights the W4A8 kernel cannot take
    stay W4A16."""
    q = _qweights(fmt, 3, 96, 64, device, seed=26)
    layout = ExpertLayout.from_counts(torch.tensor([7, 0, 18], device=device), alignment=1)  # 25 rows: 8.3 each
    x_PDx, _ = _pool(layout, 96, torch.bfloat16, device, seed=27)
    args = (x_PDx, *_planes(q), layout.row_start_e, layout.num_rows_e, "silu")
    y_a8, y_w4a16 = w4.grouped_mlp_w4_ref(*args, a8=True), w4.grouped_mlp_w4_ref(*args)
    assert calc_diff(y_a8, y_w4a16) > 1e-5  # the two paths are told apart
    at, above = W4A16Experts(q, a8_rows_per_expert=25 / 3), W4A16Experts(q, a8_rows_per_expert=9)
    assert at.runs_a8(25, 3) and not above.runs_a8(25, 3)
    assert calc_diff(at(x_PDx, layout), y_a8) <= 1e-3
    assert calc_diff(above(x_PDx, layout), y_w4a16) <= CALC_DIFF_TOLERANCES[torch.bfloat16]
    monkeypatch.setenv("MOE_REF_W4A8_ROWS_PER_EXPERT", "4")
    assert W4A16Experts(q).a8_rows_per_expert == 4.0 and W4A16Experts(q, a8_rows_per_expert=9).runs_a8(25, 3) is False
    monkeypatch.setenv("MOE_REF_W4A8_ROWS_PER_EXPERT", "prefill")
    with pytest.raises(InvalidConfigError, match="MOE_REF_W4A8_ROWS_PER_EXPERT='prefill'"):
        W4A16Experts(q)
    monkeypatch.delenv("MOE_REF_W4A8_ROWS_PER_EXPERT")
    assert W4A16Experts(q).a8_rows_per_expert is None
    at.batch_invariant = True
    assert not at.runs_a8(25, 3)
    if fmt == QuantFormat.INT4_GROUP:
        q.down_scale_eDFs[0, 1] = 2.0**-121
        assert W4A16Experts(q, a8_rows_per_expert=0).a8_rows_per_expert is None
