"""The 4-bit weight formats' numerics in torch: packing, quantizing and dequantizing (the twins of the W4A16
kernel, ``grouped_mlp_w4``) (INT4 group 32 as compressed-tensors ``pack-quantized`` stores it; MXFP4 as its
``mxfp4-pack-quantized`` stores it, scale bytes decoding as ``2**(byte - 125)``: see
``moe_ref.checkpoint.formats`` for where each rule comes from).

Also the W4A16 kernel's nibble order (``to_group_planes``: "group planes"), into which a checkpoint's packed 4-bit
weights are rewritten once, at load (``moe_ref.kernels.experts.grouped_mlp_w4`` says why).

Shape legend: O output features and I input features of one weight matrix ``[O, I]``, e local experts. Packed
widths: ``I/8`` int4 words (suffix ``w``), ``I/2`` fp4 byte pairs (suffix ``p``), ``I/32`` group scales (suffix
``g``), the checkpoint's packed width (suffix ``q``).
"""
from __future__ import annotations

import torch

from moe_ref.core.errors import QuantTensorValueError, ShapeError, UnknownNameError

GROUP_SIZE = 32  # INT4 and MXFP4 scale groups along the input dimension
INT4_PER_WORD = 8
FP4_PER_BYTE = 2
E8M0_BIAS = 125  # compressed-tensors mxfp4: byte = log2(scale) + 125 (see moe_ref.checkpoint.formats)
# the largest scale byte moe_ref accepts (2**113): the W4A16 kernel keeps 2**(byte - 125 + 14) finite in fp32 up to it
MXFP4_MAX_SCALE_BYTE = 238
# the largest scale byte the W4A16 kernel multiplies into its bf16 decode (``2**(byte + 1)`` must be a finite bf16:
# scales up to 2, i.e. groups with |w| below 12); weights with a larger byte keep the fp32 group scale
MXFP4_FOLD_MAX_SCALE_BYTE = 126
# INT4 with bf16 scales: the W4A16 kernel multiplies by ``s * 2**129`` in its bf16 decode, finite for |s| below this
# (groups with |w| below 4), and decodes ``w / 16``, a normal bf16 (so rounded as w is) for every nonzero |s| from the
# minimum on; weights with a scale outside keep the fp32 group scale
INT4_FOLD_SCALE_LIMIT = 0.5
INT4_FOLD_MIN_SCALE = 2.0**-122
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code & 7 -> |value|; bit 3 is the sign
# W4A8 (``grouped_mlp_w4(..., a8=True)``): each weight row is divided by a power of two, its A8 row scale, and cast to
# fp8 in the decode. MXFP4 goes to e5m2: E2M1 * 2**(1 - d) for a group d binades below the row's largest scale byte,
# exact down to e5m2's smallest subnormal (d <= 16). INT4 goes to e4m3 (3 mantissa bits: rounded), w / 16 normalized
# below 2**8 (e4m3's largest finite is 448); its bf16 multiplier 2**(8 - S) is finite for S >= -119.
A8_MXFP4_EXACT_SPREAD = 16
A8_INT4_TOP_EXPONENT = 8
A8_INT4_MIN_EXPONENT = -119


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


def check_mxfp4_scales(scale_u8: torch.Tensor, what: str, **fields) -> int:
    """The largest scale byte (0 when empty; one reduction, a host sync on a GPU); ``QuantTensorValueError`` (LOAD015)
    naming ``what`` (and carrying ``fields``) when it is above ``MXFP4_MAX_SCALE_BYTE``."""
    largest = int(scale_u8.max()) if scale_u8.numel() else 0
    if largest > MXFP4_MAX_SCALE_BYTE:
        raise QuantTensorValueError(
            f"{what} holds E8M0 scale byte {largest}, above {MXFP4_MAX_SCALE_BYTE} "
            f"(2**{MXFP4_MAX_SCALE_BYTE - E8M0_BIAS}): corrupt, or another scale bias than compressed-tensors' "
            f"{E8M0_BIAS}", found=largest, limit=MXFP4_MAX_SCALE_BYTE, **fields)
    return largest


def e8m0_to_float(scale_u8: torch.Tensor) -> torch.Tensor:
    """Stored compressed-tensors MXFP4 scale bytes -> fp32 ``2**(byte - 125)``."""
    return torch.exp2(scale_u8.float() - E8M0_BIAS)


def dequantize_mxfp4(packed_OIp: torch.Tensor, scale_OIg: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``w = e2m1 * 2**(byte - 125)``: uint8 ``[..., O, I/2]`` and ``[..., O, I/32]`` -> ``[..., O, I]`` ``dtype``."""
    values = e2m1_to_float(unpack_fp4(packed_OIp)).unflatten(-1, (-1, GROUP_SIZE))
    return (values * e8m0_to_float(scale_OIg).unsqueeze(-1)).flatten(-2).to(dtype)


# --------------------------------------------------------------------------------------------------
# the W4A16 kernel's nibble order ("group planes", ``moe_ref.kernels.experts.grouped_mlp_w4``), laid out once at load
# --------------------------------------------------------------------------------------------------
PLANE_BLOCK = 256  # input features per k-step of the kernel: 8 groups of 32
WORDS_PER_BLOCK = PLANE_BLOCK // INT4_PER_WORD  # 32
GROUPS_PER_BLOCK = PLANE_BLOCK // GROUP_SIZE  # 8
W4_FORMATS = ("int4", "mxfp4")
_ZERO_CODE = {"int4": 8, "mxfp4": 0}  # the code of 0.0 (INT4 is offset binary)
# MXFP4 in a group-plane word, per plane: (offset of its code's e|m bits, offset of its sign bit) in each 16-bit half,
# so that the decode moves them into a bf16's bits 6..8 and 15 with few instructions: plane 0 in place (one mask),
# plane 1 by one shift (3), plane 2 by one multiply (shifts 6 and 1 at once), plane 3 by two shifts
# (``grouped_mlp_w4._decode_mxfp4_bf16_plane_asm``)
MXFP4_PLANE_BITS = ((6, 15), (3, 12), (0, 14), (9, 13))


class W4Weight:
    """One stack of 4-bit expert weights in the W4A16 kernel's order (``to_group_planes``).

    Attributes:
        fmt: "int4" (codes ``q + 8``, scales bf16/fp16/fp32) or "mxfp4" (E2M1 codes, E8M0 scale bytes decoding as
            ``2**(byte - 125)``).
        words_eOw: int32 ``[e, O, w]`` (w = I rounded up to 256, over 8), the group planes.
        block_scale: ``[e, ceil(I/256), O, 8]`` group scales by k-block of 256 features, each row's 8 contiguous
            (``block_major_scales``; the stored dtype: bf16/fp16/fp32, or
            uint8 for MXFP4).
        in_features: I before padding.
        max_scale_byte: MXFP4's largest scale byte (0 for INT4). Given by the caller that read it already, else read
            here (a host sync, at load).
        foldable: whether the kernel may multiply the scales into its bf16 decode (bf16 x): MXFP4 bytes up to
            ``MXFP4_FOLD_MAX_SCALE_BYTE``, INT4 bf16 scales below ``INT4_FOLD_SCALE_LIMIT`` and each 0 or at least
            ``INT4_FOLD_MIN_SCALE`` (INT4: one reduction and a host sync, at load).
        a8_row_scale_eO: fp32 ``[e, O]``, the power of two each weight row is divided by before its fp8 cast in the
            W4A8 kernel (``a8_tables``). a8_fold_eO: int32 ``[e, O]``, the same for the PTX decode (MXFP4: the
            multiplier's exponent addend; INT4: the bf16 multiplier ``16 / row scale`` in both halves).
        a8_exact: MXFP4 whose fp8 weights equal the stored ones (every row's scale bytes within
            ``A8_MXFP4_EXACT_SPREAD`` of each other); INT4 is rounded to e4m3, never exact.
        a8_supported: whether the W4A8 kernel takes these weights (INT4: every row's largest scale at least
            ``2**A8_INT4_MIN_EXPONENT``, or the row all zero).
    """

    def __init__(self, fmt: str, words_eOw: torch.Tensor, block_scale: torch.Tensor, in_features: int,
                 max_scale_byte: int | None = None):
        self.fmt, self.words_eOw, self.block_scale = fmt, words_eOw, block_scale
        self.in_features = in_features
        if max_scale_byte is None:
            max_scale_byte = int(block_scale.max()) if fmt == "mxfp4" and block_scale.numel() else 0
        self.max_scale_byte = max_scale_byte
        if fmt == "mxfp4":
            self.foldable = max_scale_byte <= MXFP4_FOLD_MAX_SCALE_BYTE
        else:
            self.foldable = block_scale.dtype == torch.bfloat16 and _in_fold_range(block_scale)
        self.a8_row_scale_eO, self.a8_fold_eO, self.a8_exact, self.a8_supported = a8_tables(fmt, block_scale,
                                                                                            in_features)

    @property
    def shape(self) -> tuple[int, int, int]:
        """(e, O, I) of the weight this holds."""
        return self.words_eOw.shape[0], self.words_eOw.shape[1], self.in_features

    def nbytes(self) -> int:
        return self.words_eOw.nbytes + self.block_scale.nbytes


def a8_tables(fmt: str, block_scale: torch.Tensor, in_features: int) -> tuple[torch.Tensor, torch.Tensor, bool, bool]:
    """The W4A8 kernel's per-row normalization of block-major scales ``[e, ceil(I/256), O, 8]`` (``W4Weight``'s
    attributes of the same names): ``(a8_row_scale_eO, a8_fold_eO, a8_exact, a8_supported)``; one host sync.

    MXFP4, S the row's largest scale byte: row scale ``2**(S - 126)``, so a weight ``E2M1 * 2**(byte - 125)`` becomes
    ``E2M1 * 2**(byte - S + 1)`` (at most 12); the PTX decode's multiplier ``2**(byte - S + 127)`` has the exponent
    field ``byte + 254 - S``, i.e. ``(byte << 7) + addend`` in each bf16 half, addend ``(254 - S) << 7``.
    INT4, S = floor(log2(the row's largest |scale|)) (0 for an all-zero row): row scale ``2**(S - 4)``, so ``w`` becomes
    ``w * 2**(4 - S)``, below 2**8 (|w| <= 8 |s|); the PTX decode gives ``w / 16`` and multiplies it by ``2**(8 - S)``.

    Example: MXFP4 row bytes [120, 118] -> row scale 2**-6, addend 134 << 7 in both halves (exact: spread 2 <= 16).
        INT4 row scales [0.01, -0.02] -> S = -6, row scale 2**-10, multiplier 2**14.
    """
    num_experts, _, num_rows, _ = block_scale.shape
    # the row's groups past I (block padding, scale 0) must not count: reductions over the stored dtype, no fp32 copy
    real = torch.arange(block_scale.shape[1] * GROUPS_PER_BLOCK, device=block_scale.device)
    real = real.view(-1, 1, GROUPS_PER_BLOCK) < in_features // GROUP_SIZE  # [blocks, 1, 8]
    if fmt == "mxfp4":
        if block_scale.shape[1] == 0 or in_features < GROUP_SIZE:  # no real group (known on the host: no sync)
            top = low = torch.zeros(num_experts, num_rows, device=block_scale.device)
        else:
            top = block_scale.amax(dim=(1, 3)).float()
            low = torch.where(real, block_scale, 255).amin(dim=(1, 3)).float()
        exact = bool(((top - low) <= A8_MXFP4_EXACT_SPREAD).all()) if top.numel() else True
        row_scale = torch.exp2(top - 126.0)
        fold = ((254 - top.to(torch.int64)) << 7) * 0x00010001
        return row_scale, fold.to(torch.int32), exact, True
    amax = block_scale.abs().amax(dim=(1, 3)).float() if block_scale.numel() else torch.zeros(
        num_experts, num_rows, device=block_scale.device)
    exponent = torch.where(amax > 0, torch.frexp(amax).exponent - 1, 0).to(torch.int64)
    supported = bool((exponent >= A8_INT4_MIN_EXPONENT).all()) if exponent.numel() else True
    multiplier = (A8_INT4_TOP_EXPONENT - exponent).clamp(max=127)  # a bf16 power of two: ((k + 127) << 7) per half
    fold = ((multiplier + 127) << 7) * 0x00010001
    return torch.exp2((exponent - 4).float()), fold.to(torch.int32), False, supported


def _in_fold_range(scales: torch.Tensor) -> bool:
    """Whether every |s| is below ``INT4_FOLD_SCALE_LIMIT`` and each is 0 or at least ``INT4_FOLD_MIN_SCALE`` (True
    when empty; a NaN is not in it). One reduction, a host sync on a GPU."""
    if scales.numel() == 0:
        return True
    magnitude = scales.abs()
    low, high = torch.aminmax(torch.where(magnitude == 0, INT4_FOLD_MIN_SCALE, magnitude))
    return bool((low >= INT4_FOLD_MIN_SCALE) & (high < INT4_FOLD_SCALE_LIMIT))


def _codes(packed: torch.Tensor, fmt: str) -> torch.Tensor:
    """4-bit codes (uint8 0..15, ``[..., O, I]``) of a checkpoint's packed weight (INT4: ``q + 8``)."""
    if fmt == "int4":
        return (unpack_int4(packed).to(torch.int16) + 8).to(torch.uint8)
    return unpack_fp4(packed)


def _packed(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """Inverse of ``_codes``: the checkpoint's packing of codes ``[..., O, I]``."""
    if fmt == "int4":
        return pack_int4(codes.to(torch.int8) - 8)
    return pack_fp4(codes)


def _field_shifts(fmt: str, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Bit offsets in a group-plane word of the 8 codes it holds, index ``odd * 4 + plane``: INT4 the nibble
    ``4 (odd * 4 + plane)``, the whole code; MXFP4 (e|m offsets, sign offsets): ``MXFP4_PLANE_BITS`` in the low 16-bit
    half for the even feature, the high half for the odd one."""
    if fmt == "int4":
        return torch.arange(INT4_PER_WORD, device=device, dtype=torch.int64) * 4, None
    em, sign = ([16 * odd + bits[field] for odd in range(2) for bits in MXFP4_PLANE_BITS] for field in range(2))
    return torch.tensor(em, device=device, dtype=torch.int64), torch.tensor(sign, device=device, dtype=torch.int64)


def _plane_words(codes_OI: torch.Tensor, fmt: str) -> torch.Tensor:
    """Codes ``[O, I]`` (one expert) -> int32 group-plane words ``[O, w]``, I padded with the code of 0.0."""
    num_rows, in_features = codes_OI.shape
    padded = -(-in_features // PLANE_BLOCK) * PLANE_BLOCK
    codes_OI = torch.nn.functional.pad(codes_OI, (0, padded - in_features), value=_ZERO_CODE[fmt])
    # features (block, half, plane, word, odd) -> words (block, half, word) of codes (odd, plane)
    codes = codes_OI.reshape(num_rows, padded // PLANE_BLOCK, 2, 4, 16, 2).movedim(-3, -1).flatten(-2).to(torch.int64)
    shifts, sign_shifts = _field_shifts(fmt, codes_OI.device)
    if sign_shifts is None:
        words = (codes << shifts).sum(dim=-1)
    else:  # MXFP4: e|m and the sign at their own places (MXFP4_PLANE_BITS); the bits never overlap, so + is |
        words = ((codes & 7) << shifts).sum(dim=-1) + ((codes >> 3) << sign_shifts).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).reshape(num_rows, padded // 8)


def _plane_codes(words_Ow: torch.Tensor, in_features: int, fmt: str) -> torch.Tensor:
    """Inverse of ``_plane_words``: codes uint8 ``[O, I]`` in feature order."""
    num_rows, num_words = words_Ow.shape
    shifts, sign_shifts = _field_shifts(fmt, words_Ow.device)
    words = words_Ow.to(torch.int64).unsqueeze(-1)
    if sign_shifts is None:
        codes = (words >> shifts) & 0xF  # [O, words, (odd, plane)]
    else:
        codes = ((words >> shifts) & 7) | (((words >> sign_shifts) & 1) << 3)
    codes = codes.reshape(num_rows, num_words // WORDS_PER_BLOCK, 2, 16, 2, 4).movedim(-1, -3)
    return codes.reshape(num_rows, num_words * INT4_PER_WORD)[:, :in_features].to(torch.uint8)


def block_major_scales(scale_eOg: torch.Tensor, in_features: int) -> torch.Tensor:
    """``[e, O, I/32]`` scales -> ``[e, ceil(I/256), O, 8]``: per block of 256 input features, each row's 8 group
    scales side by side (the kernel loads them as one vector per row; padding groups 0: their codes are 0.0)."""
    num_experts, num_rows, _ = scale_eOg.shape
    blocks = -(-in_features // PLANE_BLOCK)
    padded = torch.nn.functional.pad(scale_eOg, (0, blocks * GROUPS_PER_BLOCK - scale_eOg.shape[-1]))
    return padded.reshape(num_experts, num_rows, blocks, GROUPS_PER_BLOCK).transpose(1, 2).contiguous()


def to_group_planes(packed_eOq: torch.Tensor, scale_eOg: torch.Tensor, fmt: str, *,
                    in_place: bool = False) -> W4Weight:
    """A checkpoint's packed 4-bit weight -> the W4A16 kernel's order; run once, at load, one expert at a time.

    Per row, a block of 256 input features (8 groups of 32) is 32 words; words ``16 h .. 16 h + 15`` hold groups
    ``4 h .. 4 h + 3``: word i holds feature 2i of group ``4 h + p`` (plane p) in its low 16 bits and feature 2i + 1
    in its high 16 bits. INT4: in nibble p of each half, so ``(word >> 4 p) & 0x000F000F`` is the pair at bits 0..3
    and 16..19. MXFP4: each code's e|m bits and sign bit at the offsets ``MXFP4_PLANE_BITS[p]`` of each half. 16
    words give the group's 32 features (``grouped_mlp_w4._decode_plane``).

    Args:
        packed_eOq: INT4 int32 ``[e, O, I/8]`` (compressed-tensors pack-quantized) or MXFP4 uint8 ``[e, O, I/2]``.
        scale_eOg: ``[e, O, I/32]`` group scales (INT4 bf16/fp16/fp32, MXFP4 uint8 E8M0).
        fmt: "int4" or "mxfp4".
        in_place: write the words into ``packed_eOq``'s own memory (no second copy of the weights; it then holds
            group planes, not the checkpoint's order). Needs I % 256 == 0 and a contiguous ``packed_eOq``.

    Raises:
        ShapeError (INP001): input features not whole groups of 32, or scales not ``[e, O, I/32]``.
        QuantTensorValueError (LOAD015): an MXFP4 scale byte above ``MXFP4_MAX_SCALE_BYTE``.

    Returns:
        ``W4Weight``: rows padded to whole blocks with the code of 0.0; scales a block-major copy.

    Example: INT4, I = 256, codes 1 for features 0, 32, 64, 96 (feature 0 of groups 0..3), else the code c: word 0
        nibbles 0..3 = 1, nibbles 4..7 = c (feature 1 of groups 0..3). MXFP4, code 0xB (sign 1, e|m 3) for feature 0
        of group 1 (plane 1): bits 3..5 of word 0 = 3, bit 12 = 1.
    """
    if fmt not in W4_FORMATS:
        raise UnknownNameError(f"4-bit format {fmt!r}: expected one of {', '.join(W4_FORMATS)}")
    num_experts, num_rows, stored = packed_eOq.shape
    in_features = stored * (INT4_PER_WORD if fmt == "int4" else FP4_PER_BYTE)
    if in_features % GROUP_SIZE or tuple(scale_eOg.shape) != (num_experts, num_rows, in_features // GROUP_SIZE):
        # the kernel masks x by whole groups (grouped_mlp_w4._load_x_groups)
        raise ShapeError(f"4-bit weights of {in_features} input features with scales {tuple(scale_eOg.shape)}: "
                         f"want whole groups of {GROUP_SIZE} and scales [e, O, I/{GROUP_SIZE}] = "
                         f"{(num_experts, num_rows, in_features // GROUP_SIZE)}")
    max_scale_byte = check_mxfp4_scales(scale_eOg, "an MXFP4 scale tensor") if fmt == "mxfp4" else 0
    if in_place:
        if in_features % PLANE_BLOCK or not packed_eOq.is_contiguous():
            raise ShapeError(f"group planes in place need I % {PLANE_BLOCK} == 0 and contiguous packed weights "
                             f"(I = {in_features}, contiguous: {packed_eOq.is_contiguous()})")
        words = packed_eOq.view(torch.int32)
    else:
        words = torch.empty(num_experts, num_rows, -(-in_features // PLANE_BLOCK) * PLANE_BLOCK // 8,
                            dtype=torch.int32, device=packed_eOq.device)
    for i in range(num_experts):  # one expert's int64 temporaries at a time
        words[i] = _plane_words(_codes(packed_eOq[i], fmt), fmt)
    return W4Weight(fmt, words, block_major_scales(scale_eOg, in_features), in_features, max_scale_byte)


def packed_from_planes(words_eOw: torch.Tensor, fmt: str, in_features: int) -> torch.Tensor:
    """Group-plane words ``[e, O, w]`` -> the checkpoint's packing (a new tensor, one expert at a time): INT4 int32
    ``[e, O, I/8]``, MXFP4 uint8 ``[e, O, I/2]``."""
    return torch.stack([_packed(_plane_codes(words_Ow, in_features, fmt), fmt) for words_Ow in words_eOw])


def from_group_planes(weight: W4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``to_group_planes``: (packed ``[e, O, I/8]`` int32 or ``[e, O, I/2]`` uint8, scales ``[e, O, I/32]``)
    as the checkpoint stores them (new tensors)."""
    groups = weight.in_features // GROUP_SIZE
    return (packed_from_planes(weight.words_eOw, weight.fmt, weight.in_features),
            weight.block_scale.transpose(1, 2).flatten(-2)[..., :groups].contiguous())


def dequantize_planes(weight: W4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[e, O, I]`` weights in ``dtype`` (fp32: exact, every 4-bit value times its scale)."""
    packed, scale = from_group_planes(weight)
    dequantize = dequantize_int4 if weight.fmt == "int4" else dequantize_mxfp4
    return dequantize(packed, scale, dtype)


def a8_weights_eOI(weight: W4Weight) -> torch.Tensor:
    """``[e, O, I]`` fp32: the fp8 values the W4A8 kernel multiplies (the twin's weights). Each weight, exact in fp32
    (INT4 then rounded to bf16, as the kernel's decode rounds it), over its row's A8 scale (``a8_row_scale_eO``),
    cast to fp8: MXFP4 e5m2 (exact where ``a8_exact``), INT4 e4m3 (rounded to nearest even)."""
    w = dequantize_planes(weight)
    if weight.fmt == "int4":
        w = w.to(torch.bfloat16).float()
    w = w / weight.a8_row_scale_eO.unsqueeze(-1)
    return w.to(torch.float8_e5m2 if weight.fmt == "mxfp4" else torch.float8_e4m3fn).float()
