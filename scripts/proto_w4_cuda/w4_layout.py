"""Weight preparation for w4_gemm.cu (run once per weight stack) and the kernels' table (names, tile sizes, smem).

Layout (see w4_gemm.cu's header): per expert e, n-block nb (BN features), k-tile kt (64 k), m-tile (16 features),
lane (g = lane // 4, t = lane % 4), k16 step j: one int32 word whose nibble at bits 4 s (s = p + 4 odd) is the code of
feature 16 mtile + g + 8 (p & 1), k 16 j + 2 t + 8 (p >> 1) + odd; scales [.., m-tile, g, (row g, g + 8), group].
"""
from __future__ import annotations

import torch

KTILE = 64
GROUP = 32
RCHUNK = 32

# name -> (warps, m-tiles per warp, stages, exact)
KERNELS = {
    "w4_gemm_w4_m4_s4_fold": (4, 4, 4, 0),
    "w4_gemm_w4_m4_s3_fold": (4, 4, 3, 0),
    "w4_gemm_w8_m2_s4_fold": (8, 2, 4, 0),
    "w4_gemm_w4_m2_s4_fold": (4, 2, 4, 0),
    "w4_gemm_w4_m2_s6_fold": (4, 2, 6, 0),
    "w4_gemm_w4_m4_s4_exact": (4, 4, 4, 1),
    "w4_gemm_w4_m2_s4_exact": (4, 2, 4, 1),
    "w4_gemm_w4_m4_s6_fold": (4, 4, 6, 0),
    "w4_gemm_w8_m4_s3_fold": (8, 4, 3, 0),
    "w4_wgmma_m4_s4_fold": (4, 4, 4, 0),
    "w4_wgmma_m4_s6_fold": (4, 4, 6, 0),
    "w4_wgmma_m2_s5_fold": (4, 2, 5, 0),
    "w4_gemm_w4_m4_s3_loadonly": (4, 4, 3, 2),  # diagnostic: wrong results by design
    "w4_gemm_w4_m4_s3_nomma": (4, 4, 3, 3),     # diagnostic: wrong results by design
    "w4_gemm_w4_m4_s3_mmaonly": (4, 4, 3, 4),   # diagnostic: wrong results by design
}
DIAGNOSTIC = ("loadonly", "nomma", "mmaonly")


def block_n(name: str) -> int:
    warps, mt, _, _ = KERNELS[name]
    return warps * mt * 16


def smem_bytes(name: str) -> int:
    warps, mt, stages, _ = KERNELS[name]
    bn = warps * mt * 16
    return stages * (bn * KTILE // 2 + bn * 4 + RCHUNK * KTILE * 2)


def prepare_words(codes_NK: torch.Tensor, bn: int) -> torch.Tensor:
    """Codes uint8 [N, K] (0..15) of one expert -> int32 [NB, KT, BN/16, 32 lanes, 4 j] words."""
    n, k = codes_NK.shape
    assert n % bn == 0 and k % KTILE == 0, (n, k, bn)
    # [NB, MTB, rhalf, g, KT, j, chalf, t, odd]: row in m-tile = 8 rhalf + g, k in step = 8 chalf + 2 t + odd
    v = codes_NK.reshape(n // bn, bn // 16, 2, 8, k // KTILE, 4, 2, 4, 2)
    # -> [NB, KT, MTB, g, t, j, odd, chalf, rhalf]; nibble slot s = 4 odd + 2 chalf + rhalf
    v = v.permute(0, 4, 1, 3, 7, 5, 8, 6, 2).reshape(n // bn, k // KTILE, bn // 16, 32, 4, 8).to(torch.int64)
    shifts = torch.arange(8, device=codes_NK.device, dtype=torch.int64) * 4
    words = (v << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def prepare_scales(scale_NG: torch.Tensor, bn: int) -> torch.Tensor:
    """Scales bf16 [N, K/32] of one expert -> bf16 [NB, KT, BN/16, 8 g, 2 (row g, g+8), 2 groups]."""
    n, groups = scale_NG.shape
    v = scale_NG.reshape(n // bn, bn // 16, 2, 8, groups // 2, 2)  # [NB, MTB, rhalf, g, KT, grp]
    return v.permute(0, 4, 1, 3, 2, 5).contiguous()


def prepare(codes_ENK: torch.Tensor, scale_ENG: torch.Tensor, bn: int) -> dict:
    """Codes uint8 [E, N, K] and bf16 scales [E, N, K/32] -> {"w": int32 [E, NB, KT, BN/16, 32, 4],
    "s": bf16 [E, NB, KT, BN/16, 8, 2, 2], "bn": bn} (one expert at a time: int64 temporaries stay small)."""
    e, n, k = codes_ENK.shape
    w = torch.empty(e, n // bn, k // KTILE, bn // 16, 32, 4, dtype=torch.int32, device=codes_ENK.device)
    s = torch.empty(e, n // bn, k // KTILE, bn // 16, 8, 2, 2, dtype=scale_ENG.dtype, device=codes_ENK.device)
    for i in range(e):
        w[i] = prepare_words(codes_ENK[i], bn)
        s[i] = prepare_scales(scale_ENG[i], bn)
    return {"w": w, "s": s, "bn": bn}
