"""Torch FP8 e4m3 quantizers: the one place moe_ref turns activations and weights into fp8 + fp32 scales.

    activations (rows)  x [..., Dx]    -> fp8 [..., Dx]    + scale [..., Db]                    per row, per 128 columns
                        x [..., Dx]    -> fp8 [..., Dx]    + scale [...]                        per row (W4A8)
    weights (matrices)  w [..., O, I]  -> fp8 [..., O, I]  + scale [..., Ob, Ib]                per 128x128 block

Both follow DeepGEMM's SM90 convention (plain fp32 scales, no UE8M0): ``scale = max(amax, 1e-4) / 448``
with IEEE division, value = ``x / scale`` rounded to nearest even. The Triton kernels quantize in-kernel
with the same formula (``_triton_utils.quantize_e4m3``); these are their torch twins' helpers,
and the expert backends quantize their weights once with ``quantize_fp8_per_block_128``.

Shape legend: T tokens of this rank (any rows: the quantizer is per row), Dx expert input width (the columns
quantized per row), O and I one weight matrix's output and input features, Db = ceil(Dx / 128),
Ob = ceil(O / 128), Ib = ceil(I / 128).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_ref.kernels.runtime._triton_utils import FP8_DTYPE, FP8_GROUP, FP8_MAX, FP8_MIN_AMAX, num_fp8_groups

__all__ = ["quantize_fp8_per_128", "dequantize_fp8_per_128", "quantize_fp8_per_row", "quantize_fp8_per_block_128",
           "dequantize_fp8_per_block_128"]


# --------------------------------------------------------------------------------------------------
# activations: per row, per 128 columns
# --------------------------------------------------------------------------------------------------
def quantize_fp8_per_128(x_TDx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the last dimension of `x_TDx` to fp8 e4m3 in groups of 128 columns.

    Args:
        x_TDx: `[..., Dx]` float tensor (bf16/fp16/fp32).

    Returns:
        x_fp8_TDx: `[..., Dx]` `torch.float8_e4m3fn`, `x / scale` rounded to nearest even.
        scale_TDb: `[..., Db]` fp32, `max(amax over the group, 1e-4) / 448`.
    """
    *lead, dim = x_TDx.shape
    num_groups = num_fp8_groups(dim)
    pad = num_groups * FP8_GROUP - dim
    x_float = F.pad(x_TDx.float(), (0, pad)) if pad else x_TDx.float()
    x_groups = x_float.reshape(*lead, num_groups, FP8_GROUP)
    amax = x_groups.abs().amax(dim=-1).clamp(min=FP8_MIN_AMAX)
    # NOTE: tensor / tensor, not tensor / 448: on CUDA torch turns division by a Python scalar into a
    # multiplication by its reciprocal, which rounds differently (1 ulp) from the kernel's IEEE division.
    scale_TDb = amax / torch.full_like(amax, FP8_MAX)
    x_fp8 = (x_groups / scale_TDb.unsqueeze(-1)).reshape(*lead, num_groups * FP8_GROUP)[..., :dim]
    return x_fp8.to(FP8_DTYPE), scale_TDb


def quantize_fp8_per_row(x_TDx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of `x_TDx` to fp8 e4m3 with ONE scale (the W4A8 experts' rows: their dots then need no
    rescaling inside the K loop).

    Args:
        x_TDx: `[..., Dx]` float tensor (bf16/fp16/fp32).

    Returns:
        x_fp8_TDx: `[..., Dx]` `torch.float8_e4m3fn`, `x / scale` rounded to nearest even.
        scale_T: `[...]` fp32, `max(amax over the row, 1e-4) / 448` (the per-128 recipe over the whole row).
    """
    x_float = x_TDx.float()
    amax = x_float.abs().amax(dim=-1).clamp(min=FP8_MIN_AMAX) if x_TDx.shape[-1] else torch.full(
        x_TDx.shape[:-1], FP8_MIN_AMAX, device=x_TDx.device)
    scale_T = amax / torch.full_like(amax, FP8_MAX)  # tensor / tensor: IEEE division, as the kernels' (see above)
    return (x_float / scale_T.unsqueeze(-1)).to(FP8_DTYPE), scale_T


def dequantize_fp8_per_128(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_fp8_per_128`: `x [..., Dx]` fp8 times `scale [..., Db]` fp32 -> `dtype`."""
    dim = x.shape[-1]
    scale_full = scale.float().repeat_interleave(FP8_GROUP, dim=-1)[..., :dim]
    return (x.float() * scale_full).to(dtype)


# --------------------------------------------------------------------------------------------------
# weights: per 128x128 block
# --------------------------------------------------------------------------------------------------
def quantize_fp8_per_block_128(weight_OI: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each ``[O, I]`` matrix of ``weight_OI`` to fp8 e4m3 with one fp32 scale per 128x128 block.

    Matrices are quantized one at a time (the fp32 temporaries hold one matrix, not all experts).
    Partial edge blocks (O or I not a multiple of 128) take the amax of their real elements.

    Example: w = [[0.5, -2.0]] (O=1, I=2) -> one block, amax 2.0, scale 2/448 = 0.004464,
        fp8 = [[112, -448]] (0.5 / scale = 112 exactly).

    Args:
        weight_OI: ``[..., O, I]`` bf16/fp16/fp32 (e.g. ``[e, 2F, Dx]`` expert weights), any device.

    Returns:
        weight_fp8_OI: ``[..., O, I]`` ``torch.float8_e4m3fn``, contiguous.
        scale_ObIb: ``[..., Ob, Ib]`` fp32, contiguous, ``max(block amax, 1e-4) / 448``.
    """
    *lead, n, k = weight_OI.shape
    num_n, num_k = num_fp8_groups(n), num_fp8_groups(k)
    device = weight_OI.device
    weight_fp8 = torch.empty(*lead, n, k, dtype=FP8_DTYPE, device=device)
    scale = torch.empty(*lead, num_n, num_k, dtype=torch.float32, device=device)
    flat_w, flat_q, flat_s = weight_OI.reshape(-1, n, k), weight_fp8.view(-1, n, k), scale.view(-1, num_n, num_k)
    for i in range(flat_w.shape[0]):
        padded = F.pad(flat_w[i].float(), (0, num_k * FP8_GROUP - k, 0, num_n * FP8_GROUP - n))
        blocks = padded.view(num_n, FP8_GROUP, num_k, FP8_GROUP)
        amax = blocks.abs().amax(dim=(1, 3)).clamp(min=FP8_MIN_AMAX)
        block_scale = amax / torch.full_like(amax, FP8_MAX)  # IEEE division, as in quantize_fp8_per_128
        quantized = (blocks / block_scale[:, None, :, None]).view(num_n * FP8_GROUP, num_k * FP8_GROUP)
        flat_q[i] = quantized[:n, :k].to(FP8_DTYPE)
        flat_s[i] = block_scale
    return weight_fp8, scale


def dequantize_fp8_per_block_128(weight: torch.Tensor, scale: torch.Tensor,
                                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_fp8_per_block_128`: `weight [..., O, I]` fp8 times its block scales
    `scale [..., Ob, Ib]` -> `dtype`."""
    n, k = weight.shape[-2:]
    scale_full = scale.float().repeat_interleave(FP8_GROUP, dim=-2)[..., :n, :]
    scale_full = scale_full.repeat_interleave(FP8_GROUP, dim=-1)[..., :k]
    return (weight.float() * scale_full).to(dtype)
