"""The 4-bit weight formats' numerics in torch: packing, quantizing and the dequantizing twins of the W4A16
path of ``grouped_mlp`` (INT4 group 32 as compressed-tensors ``pack-quantized`` stores it; MXFP4 as its
``mxfp4-pack-quantized`` stores it, scale bytes decoding as ``2**(byte - 125)``: see
``moe_ref.checkpoint.formats`` for where each rule comes from).

Shape legend: O output features and I input features of one weight matrix ``[O, I]``. Packed widths: ``I/8``
int4 words (suffix ``w``), ``I/2`` fp4 byte pairs (suffix ``p``), ``I/32`` group scales (suffix ``g``).
"""
from __future__ import annotations

import torch

GROUP_SIZE = 32  # INT4 and MXFP4 scale groups along the input dimension
INT4_PER_WORD = 8
FP4_PER_BYTE = 2
E8M0_BIAS = 125  # compressed-tensors mxfp4: byte = log2(scale) + 125 (see moe_ref.checkpoint.formats)
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code & 7 -> |value|; bit 3 is the sign


# --------------------------------------------------------------------------------------------------
# INT4 (compressed-tensors pack-quantized): 8 offset-binary nibbles per int32, low nibble first
# --------------------------------------------------------------------------------------------------
def pack_int4(q_OI: torch.Tensor) -> torch.Tensor:
    """Pack int4 values ``q_OI [..., O, I]`` (int8 in [-8, 7], I % 8 == 0) into int32 ``[..., O, I/8]``.

    Example: row [1, -8, 0, 0, 0, 0, 0, 7] -> nibbles [9, 0, 8, 8, 8, 8, 8, 15] -> one word 0xF8888809
        (as int32: -125269999).
    """
    *lead, k = q_OI.shape
    nibbles = (q_OI.to(torch.int64) + 8).reshape(*lead, k // INT4_PER_WORD, INT4_PER_WORD)
    shifts = torch.arange(INT4_PER_WORD, device=q_OI.device, dtype=torch.int64) * 4
    words = (nibbles << shifts).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # two's complement wrap


def unpack_int4(packed_OIw: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int4``: int32 ``[..., O, I/8]`` -> int8 ``[..., O, I]`` in [-8, 7]."""
    shifts = torch.arange(INT4_PER_WORD, device=packed_OIw.device, dtype=torch.int32) * 4
    nibbles = (packed_OIw.unsqueeze(-1) >> shifts) & 0xF
    return (nibbles - 8).to(torch.int8).flatten(-2)


def quantize_int4(weight_OI: torch.Tensor, scale_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``[..., O, I]`` as compressed-tensors' symmetric int4 group-32 scheme does.

    ``scale = amax(group) / 8`` rounded to ``scale_dtype`` (a zero scale becomes that dtype's eps),
    ``q = clamp(round(w / scale), -8, 7)``.

    Returns:
        packed ``[..., O, I/8]`` int32, scale ``[..., O, I/32]`` ``scale_dtype``.
    """
    groups = weight_OI.float().unflatten(-1, (-1, GROUP_SIZE))
    scale = (groups.abs().amax(dim=-1) / 8).to(scale_dtype)
    scale = torch.where(scale == 0, torch.finfo(scale_dtype).eps, scale)
    q = torch.clamp(torch.round(groups / scale.float().unsqueeze(-1)), -8, 7).to(torch.int8).flatten(-2)
    return pack_int4(q), scale


def dequantize_int4(packed_OIw: torch.Tensor, scale_OIg: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``w = q * scale``: int32 ``[..., O, I/8]`` and ``[..., O, I/32]`` scales -> ``[..., O, I]`` ``dtype``."""
    q = unpack_int4(packed_OIw).float().unflatten(-1, (-1, GROUP_SIZE))
    return (q * scale_OIg.float().unsqueeze(-1)).flatten(-2).to(dtype)


# --------------------------------------------------------------------------------------------------
# MXFP4 (compressed-tensors mxfp4-pack-quantized): E2M1 pairs per byte, E8M0 scales with bias 125
# --------------------------------------------------------------------------------------------------
def pack_fp4(codes_OI: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes ``[..., O, I]`` (uint8 in [0, 15]) two per byte: element 2j low nibble, 2j+1 high."""
    pairs = codes_OI.to(torch.uint8).unflatten(-1, (-1, FP4_PER_BYTE))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4(packed_OIp: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_fp4``: uint8 ``[..., O, I/2]`` -> codes ``[..., O, I]`` uint8."""
    return torch.stack([packed_OIp & 0xF, packed_OIp >> 4], dim=-1).flatten(-2)


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 in [0, 15]) -> fp32 values (bit 3 = sign)."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=codes.device)
    value = magnitudes[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -value, value)


def float_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code of each fp32 value (ties to the smaller magnitude, |x| > 6 -> 6), sign from the sign bit."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=x.device)
    index = (x.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)  # first minimum: ties go down
    return (index + torch.signbit(x).long() * 8).to(torch.uint8)


def _power_of_two_floor_exponent(amax: torch.Tensor) -> torch.Tensor:
    """``floor(log2(round_to_power_2(amax)))`` as compressed-tensors computes it: a mantissa of 0.75 or more
    rounds up to the next power of two (bit arithmetic on fp32: add 2**21, keep sign and exponent)."""
    bits = amax.float().contiguous().view(torch.int32)
    exponent_bits = ((bits + (1 << 21)) >> 23) & 0xFF
    return exponent_bits.to(torch.int32) - 127


def quantize_mxfp4(weight_OI: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``[..., O, I]`` as compressed-tensors' mxfp4 scheme does, and store it as its compressor does.

    Per group of 32: ``E = floor(log2(round_to_power_2(amax)))``, dense scale ``s = 2**(E - 2)``,
    ``q = e2m1(w / s)``, stored scale byte ``127 + log2(s) - 2 = E + 123`` (decodes as ``2**(byte - 125)``).

    Example: a group of 6.0s -> E = 2, s = 1, q = 6.0 (code 7), byte 125.

    Returns:
        packed ``[..., O, I/2]`` uint8, scale ``[..., O, I/32]`` uint8.
    """
    groups = weight_OI.float().unflatten(-1, (-1, GROUP_SIZE))
    exponent = _power_of_two_floor_exponent(groups.abs().amax(dim=-1)).clamp(-E8M0_BIAS + 2, 255 - E8M0_BIAS + 2)
    scale = torch.exp2((exponent - 2).float())
    codes = float_to_e2m1(groups / scale.unsqueeze(-1)).flatten(-2)
    return pack_fp4(codes), (exponent - 2 + E8M0_BIAS).to(torch.uint8)


def e8m0_to_float(scale_u8: torch.Tensor) -> torch.Tensor:
    """Stored compressed-tensors MXFP4 scale bytes -> fp32 ``2**(byte - 125)``."""
    return torch.exp2(scale_u8.float() - E8M0_BIAS)


def dequantize_mxfp4(packed_OIp: torch.Tensor, scale_OIg: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``w = e2m1 * 2**(byte - 125)``: uint8 ``[..., O, I/2]`` and ``[..., O, I/32]`` -> ``[..., O, I]`` ``dtype``."""
    values = e2m1_to_float(unpack_fp4(packed_OIp)).unflatten(-1, (-1, GROUP_SIZE))
    return (values * e8m0_to_float(scale_OIg).unsqueeze(-1)).flatten(-2).to(dtype)
