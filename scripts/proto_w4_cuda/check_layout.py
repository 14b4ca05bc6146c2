"""CPU check of w4_gemm.cu's index math (no GPU): an emulation of what each thread of each warp loads, decodes and
multiplies, written from the PTX fragment tables of mma.m16n8k16 (.bf16, A row, B col) and ldmatrix, run on the
output of w4_layout.prepare.

  1. inverse of prepare: every thread's word nibbles and scale loads -> (feature, k) -> must equal the codes/scales;
  2. the whole kernel emulated (cp.async staging with the x swizzle, ldmatrix.x4 addresses, bf16 decode with the
     folded scale or the exact path, MMA by fragments, epilogue addresses) vs a torch reference.

    .venv/bin/python scripts/proto_w4_cuda/check_layout.py
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from w4_layout import KERNELS, KTILE, RCHUNK, prepare  # noqa: E402

# PTX ISA, "Matrix fragments for mma.m16n8k16 with floating point type" (groupID g = lane >> 2, t = lane % 4)
def a_elem(lane, reg, half):  # A 16x16: (row, col) of register a_reg's half (0 low, 1 high)
    g, t = lane >> 2, lane & 3
    return g + 8 * (reg & 1), 2 * t + 8 * (reg >> 1) + half


def b_elem(lane, reg, half):  # B 16x8: (k, n)
    g, t = lane >> 2, lane & 3
    return 2 * t + 8 * reg + half, g


def c_elem(lane, i):  # C 16x8: (row, col) of c_i
    g, t = lane >> 2, lane & 3
    return g + 8 * (i >> 1), 2 * t + (i & 1)


def check_inverse(codes, scales, bn):
    E, N, K = codes.shape
    prep = prepare(codes, scales, bn)
    w, s = prep["w"], prep["s"]
    rec = torch.full_like(codes, 255)
    rec_s = torch.zeros_like(scales)
    for lane in range(32):
        g = lane >> 2
        for j in range(4):
            word = w[:, :, :, :, lane, j].to(torch.int64) & 0xFFFFFFFF  # [E, NB, KT, MTB]
            for p in range(4):
                pair = (word >> (4 * p)) & 0x000F000F  # what lop3 keeps of q >> 4p
                for half, val in ((0, pair & 0xF), (1, (pair >> 16) & 0xF)):
                    r, c = a_elem(lane, p, half)
                    for nb in range(N // bn):
                        for mt in range(bn // 16):
                            for kt in range(K // KTILE):
                                rec[:, nb * bn + mt * 16 + r, kt * KTILE + 16 * j + c] = val[:, nb, kt, mt].to(torch.uint8)
        # scales: the kernel reads uint2 at byte mt*64 + g*8 of the stage's scale block: 4 bf16
        flat = s.reshape(E, N // bn, K // KTILE, bn // 16, 32)  # 32 bf16 per m-tile
        four = flat[..., 4 * g: 4 * g + 4]  # [.., (row g grp0, row g grp1, row g+8 grp0, row g+8 grp1)]
        for nb in range(N // bn):
            for mt in range(bn // 16):
                for kt in range(K // KTILE):
                    f = nb * bn + mt * 16 + g
                    rec_s[:, f, 2 * kt] = four[:, nb, kt, mt, 0]
                    rec_s[:, f, 2 * kt + 1] = four[:, nb, kt, mt, 1]
                    rec_s[:, f + 8, 2 * kt] = four[:, nb, kt, mt, 2]
                    rec_s[:, f + 8, 2 * kt + 1] = four[:, nb, kt, mt, 3]
    assert torch.equal(rec, codes), "weight layout inverse mismatch"
    assert torch.equal(rec_s, scales), "scale layout inverse mismatch"
    return prep


def emulate(name, prep, x, row_start, num_rows, N, K, zsplit=1):
    """The kernel, thread by thread (lanes vectorized), on CPU; returns out [P, N] fp32 (unwritten rows NaN)."""
    warps, MT, stages, exact = KERNELS[name]
    bn = warps * MT * 16
    assert prep["bn"] == bn
    E = num_rows.numel()
    P = x.shape[0]
    out = torch.full((P, N), float("nan"))
    wflat = prep["w"].reshape(E, N // bn, K // KTILE, bn // 16 * 32, 4)  # uint4 units
    sflat = prep["s"].reshape(E, N // bn, K // KTILE, bn // 16, 32)
    lanes = torch.arange(32)
    for e in range(E):
        count, start = int(num_rows[e]), int(row_start[e])
        for nb in range(N // bn):
            for z in range(zsplit):
                chunk = z
                while chunk * RCHUNK < count:
                    row0 = start + chunk * RCHUNK
                    rc = min(RCHUNK, count - chunk * RCHUNK)
                    ntiles = (rc + 7) >> 3
                    xrows = ((rc + 15) >> 4) << 4
                    acc = torch.zeros(warps, MT, 4, 32, 4)
                    for kt in range(K // KTILE):
                        # x stage: 32 rows x 128 bytes, chunk c of row r at r*128 + ((c ^ (r & 7)) * 16)
                        xs = torch.full((RCHUNK * 64,), float("nan"))
                        for r in range(xrows):
                            for c in range(8):
                                val = x[row0 + r, kt * KTILE + c * 8: kt * KTILE + c * 8 + 8] if r < rc else torch.zeros(8)
                                pos = (r * 128 + ((c ^ (r & 7)) << 4)) // 2
                                xs[pos: pos + 8] = val
                        for wp in range(warps):
                            for j in range(4):
                                # ldmatrix.x4: lane l gives the row address of matrix l>>3, row l&7; thread i gets
                                # (row i>>2, cols 2(i&3), +1) of each matrix
                                b = torch.zeros(4, 2, 32, 2)  # [n-tile, reg, lane, half]
                                for p in range(2):
                                    if 2 * p >= ntiles:
                                        continue
                                    mats = []
                                    for mi in range(4):
                                        rows = []
                                        for r in range(8):
                                            lane = mi * 8 + r
                                            tok = p * 16 + ((lane >> 3) >> 1) * 8 + (lane & 7)
                                            kc = j * 2 + ((lane >> 3) & 1)
                                            addr = (tok * 128 + ((kc ^ (lane & 7)) << 4)) // 2
                                            rows.append(xs[addr: addr + 8])
                                        mats.append(torch.stack(rows))  # [8, 8]
                                    for mi, (nt, reg) in enumerate(((2 * p, 0), (2 * p, 1), (2 * p + 1, 0), (2 * p + 1, 1))):
                                        b[nt, reg, :, 0] = mats[mi][lanes >> 2, 2 * (lanes & 3)]
                                        b[nt, reg, :, 1] = mats[mi][lanes >> 2, 2 * (lanes & 3) + 1]
                                for m in range(MT):
                                    mt = wp * MT + m
                                    q = wflat[e, nb, kt, mt * 32 + lanes, j].to(torch.int64) & 0xFFFFFFFF
                                    sv = sflat[e, nb, kt, mt].float().reshape(8, 4)[lanes >> 2]  # [32, 4]
                                    grp = j >> 1
                                    a = torch.zeros(4, 32, 2)
                                    for p in range(4):
                                        pair = (q >> (4 * p)) & 0x000F000F
                                        codes2 = torch.stack([pair & 0xF, (pair >> 16) & 0xF], -1).float()
                                        val = codes2 - 8.0  # (128 + code) - 136, exact in bf16
                                        if not exact:
                                            sc = sv[:, grp] if (p & 1) == 0 else sv[:, 2 + grp]
                                            val = (val * sc[:, None]).to(torch.bfloat16).float()  # one rounding
                                        a[p] = val
                                    # MMA by fragments: build A [16,16] and B [16,8] from the lanes, C = A @ B
                                    A = torch.full((16, 16), float("nan"))
                                    for ln in range(32):
                                        for p in range(4):
                                            for h in range(2):
                                                A[a_elem(ln, p, h)] = a[p, ln, h]
                                    for nt in range(4):
                                        if nt >= ntiles:
                                            continue
                                        B = torch.full((16, 8), float("nan"))
                                        for ln in range(32):
                                            for reg in range(2):
                                                for h in range(2):
                                                    B[b_elem(ln, reg, h)] = b[nt, reg, ln, h]
                                        C = A.double() @ B.double()
                                        for ln in range(32):
                                            d = torch.tensor([C[c_elem(ln, i)] for i in range(4)], dtype=torch.float32)
                                            if exact:
                                                sf = torch.tensor([sv[ln, grp], sv[ln, grp], sv[ln, 2 + grp], sv[ln, 2 + grp]])
                                                if j & 1:  # the kernel flushes tmp (steps 2grp, 2grp+1) here
                                                    acc[wp, m, nt, ln] += (tmp[(wp, m, nt, ln)] + d) * sf
                                                else:
                                                    tmp[(wp, m, nt, ln)] = d
                                            else:
                                                acc[wp, m, nt, ln] += d
                    # epilogue
                    for wp in range(warps):
                        for m in range(MT):
                            for ln in range(32):
                                g, t = ln >> 2, ln & 3
                                f = nb * bn + (wp * MT + m) * 16 + g
                                for nt in range(ntiles):
                                    tk = nt * 8 + 2 * t
                                    if tk < rc:
                                        out[row0 + tk, f] = acc[wp, m, nt, ln, 0]
                                        out[row0 + tk, f + 8] = acc[wp, m, nt, ln, 2]
                                    if tk + 1 < rc:
                                        out[row0 + tk + 1, f] = acc[wp, m, nt, ln, 1]
                                        out[row0 + tk + 1, f + 8] = acc[wp, m, nt, ln, 3]
                    chunk += zsplit
    return out


tmp: dict = {}


def main():
    torch.manual_seed(0)
    for bn in (128, 256):
        E, N, K = 2, 2 * bn, 128
        codes = torch.randint(0, 16, (E, N, K), dtype=torch.uint8)
        scales = (torch.rand(E, N, K // 32) * 0.02 + 0.001).to(torch.bfloat16)
        check_inverse(codes, scales, bn)
        print(f"layout inverse OK (bn={bn}, E={E}, N={N}, K={K})")

    E, K = 3, 128
    num_rows = torch.tensor([0, 5, 37], dtype=torch.int32)
    row_start = torch.cat([torch.zeros(1, dtype=torch.int64), num_rows.cumsum(0)[:-1].long()]).int()
    P = int(num_rows.sum())
    x = torch.randn(P, K).to(torch.bfloat16).float()
    for name in ("w4_gemm_w4_m2_s4_fold", "w4_gemm_w4_m2_s4_exact", "w4_gemm_w4_m4_s4_fold"):
        warps, mt, _, exact = KERNELS[name]
        bn = warps * mt * 16
        N = bn
        codes = torch.randint(0, 16, (E, N, K), dtype=torch.uint8)
        scales = (torch.rand(E, N, K // 32) * 0.02 + 0.001).to(torch.bfloat16)
        prep = prepare(codes, scales, bn)
        wdq = (codes.float() - 8) * scales.float().repeat_interleave(32, -1)
        ref = torch.full((P, N), float("nan"))
        for e in range(E):
            s, c = int(row_start[e]), int(num_rows[e])
            ref[s:s + c] = x[s:s + c] @ wdq[e].T
        for zsplit in ((1, 2) if name.endswith("m2_s4_fold") else (1,)):
            tmp.clear()
            got = emulate(name, prep, x, row_start, num_rows, N, K, zsplit)
            assert not got.isnan().any(), "unwritten outputs"
            a, b = got.double(), ref.double()
            diff = 1 - 2 * (a * b).sum() / ((a * a).sum() + (b * b).sum())
            err = (a - b).abs().max().item()
            print(f"emulated {name} zsplit={zsplit}: calc_diff={diff.item():.3e} max_abs={err:.3e}")
            assert diff < (1e-12 if exact else 1e-4), diff
    print("check_layout: all OK")


if __name__ == "__main__":
    main()
