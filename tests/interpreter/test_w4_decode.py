"""The grouped MLP kernel's two 4-bit decodes (``MOE_REF_W4_DECODE``: ``convert``, ``bits``; a temporary A/B) give
the same bits: the decoded tiles of every INT4 code under every bf16 and fp16 scale (and many fp32 ones), of every
MXFP4 code under every scale byte; ``grouped_mlp``'s outputs on odd shapes. Each also equals the torch twin's
dequantized weights wherever the twin defines them."""

import importlib

import pytest
import torch
import triton
import triton.language as tl

from moe_ref.core import envs
from moe_ref.experts import ExpertLayout
from moe_ref.kernels._triton_utils import is_interpreter
from moe_ref.kernels.w4 import dequantize_int4, dequantize_mxfp4, pack_fp4, pack_int4
from moe_ref.testing import assert_bitwise_equal

gm = importlib.import_module("moe_ref.kernels.grouped_mlp")  # the package re-exports a function of that name
_load_b_tile = gm._load_b_tile

# the interpreter's numpy warns where fp32 products overflow or meet inf * 0: those cases are meant
pytestmark = [pytest.mark.interpreter, pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

DECODES = envs.W4_DECODES
X_DTYPES = [torch.bfloat16, torch.float16, torch.float32]  # the dtype the decoded tile is rounded to (x's)
BLOCK_N = 512  # decoded rows (weight output features) per program


@triton.jit
def _decode_kernel(b_ptr, scale_ptr, x_ptr, out_ptr, K, N, stride_b_n, stride_scale_n,
                   W4: tl.constexpr, W4_DECODE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """out `[ceil(K / BLOCK_K) * BLOCK_K, N]` fp32: the b tiles `_load_b_tile` hands the kernel's dot (dequantized,
    rounded to x's dtype, then widened), every k-step, the masked rows past K included."""
    first_row = tl.program_id(0) * BLOCK_N
    offs_n = first_row + tl.arange(0, BLOCK_N)
    for k0 in range(0, K, BLOCK_K):
        tile = _load_b_tile(None, b_ptr, scale_ptr, 0, first_row, N, k0, K, stride_b_n, stride_scale_n, x_ptr, W4, 8,
                            W4_DECODE, False, True, BLOCK_K, BLOCK_N)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        tl.store(out_ptr + offs_k[:, None] * N + offs_n[None, :], tile, mask=(offs_n < N)[None, :])


def decode(packed_OIw: torch.Tensor, scale_OIg: torch.Tensor, w4: int, decode_name: str, x_dtype: torch.dtype,
           block_k: int = 32) -> torch.Tensor:
    """The kernel's dequantized weight `[O, I]` in x's dtype, as fp32 on the CPU (INT4 int32 words or MXFP4 bytes
    read as words; decoded where the tensors are)."""
    words = packed_OIw.view(torch.int32)
    num_rows, k = words.shape[0], words.shape[1] * 8
    out = torch.empty(triton.cdiv(k, block_k) * block_k, num_rows, device=words.device)
    _decode_kernel[(triton.cdiv(num_rows, BLOCK_N),)](
        words, scale_OIg, torch.zeros(1, dtype=x_dtype, device=words.device), out, k, num_rows, words.stride(0),
        scale_OIg.stride(0), W4=w4, W4_DECODE=DECODES.index(decode_name), BLOCK_K=block_k, BLOCK_N=BLOCK_N)
    return out[:k].T.contiguous().cpu()


def decode_both(packed_OIw, scale_OIg, w4: int, x_dtype: torch.dtype, device: str, block_k: int = 32,
                **case) -> torch.Tensor:
    """Both decodes of one CPU weight on `device`, checked bitwise equal (padding rows of the last k-step too);
    returns one, on the CPU."""
    packed_OIw, scale_OIg = packed_OIw.to(device), scale_OIg.to(device)
    outs = [decode(packed_OIw, scale_OIg, w4, name, x_dtype, block_k) for name in DECODES]
    assert_bitwise_equal(outs[1], outs[0], w4=w4, x_dtype=x_dtype, block_k=block_k, **case)
    return outs[0]


def assert_equal_values(actual: torch.Tensor, expected: torch.Tensor, **case) -> None:
    """Bitwise equal (signed zeros, infinities), NaN where the other is NaN (its payload not compared)."""
    nan = actual.isnan()
    assert torch.equal(nan, expected.isnan()), case
    assert_bitwise_equal(actual[~nan], expected[~nan], **case)


def every_code_row(num_rows: int) -> torch.Tensor:
    """`[num_rows, 32]` codes: 0..15, then 15..0 (each code at an even and an odd position of its word)."""
    codes = torch.cat([torch.arange(16), torch.arange(15, -1, -1)])
    return codes.repeat(num_rows, 1)


def int4_scales(dtype: torch.dtype) -> torch.Tensor:
    """Every bf16 or fp16 bit pattern (signs, zeros, denormals, infinities, NaNs), or 65536 random fp32 patterns
    with fp32's specials and extremes."""
    if dtype != torch.float32:
        return torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    randoms = torch.randint(-2**31, 2**31, (2**16,), dtype=torch.int64, generator=torch.Generator().manual_seed(0))
    info = torch.finfo(torch.float32)
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), info.max, -info.max, info.tiny,
                             info.tiny / 2**23, 1.0, 0.5, 3.0e-3])
    return torch.cat([randoms.to(torch.int32).view(torch.float32), specials])


@pytest.mark.parametrize("x_dtype", X_DTYPES)
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_int4_every_code_under_every_scale(scale_dtype, x_dtype, device):
    scale_O = int4_scales(scale_dtype)
    packed_OIw = pack_int4((every_code_row(len(scale_O)) - 8).to(torch.int8))
    scale_OIg = scale_O[:, None].contiguous()
    case = dict(scale_dtype=scale_dtype, x_dtype=x_dtype)
    decoded = decode_both(packed_OIw, scale_OIg, 1, device=device, **case)
    if is_interpreter() and x_dtype == torch.bfloat16:
        return  # the interpreter rounds fp32 to bf16 with ties away from zero (both decodes alike); a GPU runs the rest
    expected = dequantize_int4(packed_OIw, scale_OIg, x_dtype).float()
    rows = slice(None)
    if is_interpreter() and scale_dtype == torch.bfloat16:
        # the interpreter's bf16 -> fp32 conversion loses denormals (both decodes alike): not these scales' rows
        rows = (scale_O.float().abs() >= torch.finfo(torch.bfloat16).tiny) | (scale_O.float() == 0)
    assert_equal_values(decoded[rows], expected[rows], **case)


@pytest.mark.parametrize("x_dtype", X_DTYPES)
def test_mxfp4_every_code_under_every_scale_byte(x_dtype, device):
    """Bytes 0 (the smallest scale, 2**-125), 125 (1.0), 251 (the largest a finite weight quantizes to), 253
    (2**128 = inf in both): equal to the twin for 0..253; 254 and 255 wrap the kernel's fp32 exponent (as before the
    A/B), still the same bits in both decodes."""
    scale_bytes = torch.arange(256, dtype=torch.uint8)
    packed_OIp = pack_fp4(every_code_row(256).to(torch.uint8))
    scale_OIg = scale_bytes[:, None].contiguous()
    decoded = decode_both(packed_OIp, scale_OIg, 2, x_dtype, device)
    expected = dequantize_mxfp4(packed_OIp, scale_OIg, x_dtype).float()
    assert_equal_values(decoded[:254], expected[:254], x_dtype=x_dtype)
    assert (decoded[:253, 8].view(torch.int32) == -2**31).all()  # code 8, -0.0, under every finite scale
    assert decoded[125, :16].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                          -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    if x_dtype != torch.float16:  # fp16 has neither end
        assert decoded[0, 1].item() == 2.0**-126 and decoded[251, 5].item() == 3 * 2.0**126
    assert decoded[251, 7].item() == float("inf") and decoded[253, 1].item() == float("inf")  # 6 * 2**126, 2**127


@pytest.mark.parametrize("w4", [1, 2])
def test_a_k_step_past_the_end(w4, device):
    """K = 96 with BLOCK_K 64: the second k-step's words and scale group past K load as 0; both decodes agree on
    those padding rows too; the real rows equal the twin's."""
    gen = torch.Generator().manual_seed(1)
    codes_OI = torch.randint(0, 16, (40, 96), generator=gen)
    if w4 == 1:
        packed, scale = pack_int4((codes_OI - 8).to(torch.int8)), torch.rand(40, 3, generator=gen).bfloat16()
        expected = dequantize_int4(packed, scale)
    else:
        packed = pack_fp4(codes_OI.to(torch.uint8))
        scale = torch.randint(110, 135, (40, 3), generator=gen).to(torch.uint8)
        expected = dequantize_mxfp4(packed, scale)
    assert_bitwise_equal(decode_both(packed, scale, w4, torch.float32, device, block_k=64), expected, w4=w4)


# --------------------------------------------------------------------------------------------------
# grouped_mlp, both decodes, bitwise
# --------------------------------------------------------------------------------------------------
def _crafted_weights(w4: int, num_experts: int, rows: int, cols: int, scale_dtype: torch.dtype, gen):
    """Packed `[e, rows, cols]` weights of uniform random codes (all 16, -0.0 among them) and their scales: INT4
    scales up to 1/32 with some zero and denormal ones; MXFP4 bytes 0, 1 (weights of 2**-126..) and 112..124
    (weights up to 3)."""
    codes = torch.randint(0, 16, (num_experts, rows, cols), generator=gen)
    groups = (num_experts, rows, cols // 32)
    if w4 == 1:
        scale = torch.rand(groups, generator=gen) / 32
        scale[..., 0] = torch.where(torch.rand(groups[:2], generator=gen) < 0.2, 0.0, scale[..., 0])
        scale.view(-1)[::7] = torch.finfo(scale_dtype).tiny / 4
        return pack_int4((codes - 8).to(torch.int8)), scale.to(scale_dtype)
    scale = torch.randint(112, 125, groups, generator=gen)
    scale.view(-1)[::5] = 0
    scale.view(-1)[1::11] = 1
    return pack_fp4(codes.to(torch.uint8)), scale.to(torch.uint8)


@pytest.fixture
def both_decodes(monkeypatch):
    """`run(fn)` -> [fn() with MOE_REF_W4_DECODE=convert, fn() with bits]."""

    def run(fn):
        outs = []
        for name in DECODES:
            monkeypatch.setenv("MOE_REF_W4_DECODE", name)
            outs.append(fn())
        return outs

    return run


@pytest.mark.parametrize("w4, dtype, scale_dtype", [
    (1, torch.bfloat16, torch.bfloat16), (1, torch.float16, torch.float16), (1, torch.float32, torch.float32),
    (1, torch.bfloat16, torch.float32), (2, torch.bfloat16, torch.uint8), (2, torch.float16, torch.uint8),
    (2, torch.float32, torch.uint8)])
@pytest.mark.parametrize("interleaved", [False, True])
def test_grouped_mlp_same_bits_both_decodes_odd_shapes(both_decodes, device, w4, dtype, scale_dtype, interleaved):
    """D 96, F 32 under a forced 16x64x64 tile: K ends mid k-step in both GEMMs, N mid tile (F 32 < 64, D 96),
    ragged experts (one empty) leave masked rows. (Against the twin: the decoded tiles above, and
    test_grouped_mlp_w4a16.py under both decodes.)"""
    hidden, inter, counts = 96, 32, [5, 0, 19]
    gen = torch.Generator().manual_seed(2)
    gate_up, gate_up_scale = _crafted_weights(w4, len(counts), 2 * inter, hidden, scale_dtype, gen)
    down, down_scale = _crafted_weights(w4, len(counts), hidden, inter, scale_dtype, gen)
    if interleaved:
        gate_up, gate_up_scale = gm.interleave_gate_up(gate_up), gm.interleave_gate_up(gate_up_scale)
    layout = ExpertLayout.from_counts(torch.tensor(counts), alignment=16, num_pool_rows=64)
    x_PDx = torch.randn(64, hidden, generator=gen).to(dtype)
    tile = triton.Config({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=2)
    args = [t.to(device) for t in (x_PDx, gate_up, down, layout.row_start_e, layout.num_rows_e)]
    kwargs = dict(gate_up_scale=gate_up_scale.to(device), down_scale=down_scale.to(device),
                  gate_up_interleaved=interleaved)
    convert, bits = both_decodes(lambda: gm.grouped_mlp(*args, "silu", configs=(tile, tile), **kwargs).cpu())
    case = dict(w4=w4, dtype=dtype, scale_dtype=scale_dtype, interleaved=interleaved)
    assert_bitwise_equal(bits, convert, **case)
    assert bits.abs().max() > 0 and not bits.isnan().any(), case
