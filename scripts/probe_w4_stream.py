"""Probe: how fast can the 4-bit kernel's weight stream go alone, and faster with k-step tiles contiguous in memory?

    python3 scripts/probe_w4_stream.py OUT.json      (a CUDA GPU)

Loads only (no decode, no MMA), in the shape of ``grouped_mlp_w4``'s programs: one program = BLOCK_N rows of one expert,
every k-block of 256 features, two 16-word halves a step. Kimi-K2's INT4 weights per rank (48 experts), the rows as
stored (``[e, O, K/8]`` int32) against k-step tiles contiguous (``[e, K/256, O, 32]``); torch's copy as the anchor.
"""
import json
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _stream(w_ptr, out_ptr, O, num_blocks_k, stride_e, BLOCK_N: tl.constexpr, CONTIG: tl.constexpr):
    num_pid_n = tl.cdiv(O, BLOCK_N)
    e = tl.program_id(0) // num_pid_n
    pid_n = tl.program_id(0) % num_pid_n
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, 16)
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.int32)
    base = w_ptr + e.to(tl.int64) * stride_e
    for kb in range(0, num_blocks_k):
        for half in tl.static_range(2):
            if CONTIG:  # [e, Kb, O, 32]
                p = base + kb * (O * 32) + offs_n[:, None] * 32 + half * 16 + offs_w[None, :]
            else:  # [e, O, Kb * 32]
                p = base + offs_n[:, None] * (num_blocks_k * 32) + kb * 32 + half * 16 + offs_w[None, :]
            acc ^= tl.load(p)
    tl.store(out_ptr + tl.program_id(0) * BLOCK_N * 16 + tl.arange(0, BLOCK_N)[:, None] * 16
             + offs_w[None, :], acc)


def main():
    rows = []
    for name, O, K in [("gate_up", 4096, 7168), ("down", 7168, 2048)]:
        E, Kb = 48, K // 256
        w = torch.randint(-2**31, 2**31 - 1, (E, O, Kb * 32), dtype=torch.int32, device="cuda")
        gb = w.numel() * 4 / 1e9
        for block_n, warps, stages in [(64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3)]:
            out = torch.empty(E * (O // block_n) * block_n * 16, dtype=torch.int32, device="cuda")
            for contig in (False, True):
                fn = lambda: _stream[(E * (O // block_n),)](w, out, O, Kb, O * Kb * 32, BLOCK_N=block_n, CONTIG=contig,
                                                             num_warps=warps, num_stages=stages)
                us = triton.testing.do_bench(fn, warmup=50, rep=300) * 1e3
                rows.append(dict(gemm=name, block_n=block_n, warps=warps, stages=stages, contiguous_k_steps=contig,
                                 us=round(us, 1), tb_per_s=round(gb / us * 1e3, 3)))
                print(json.dumps(rows[-1]), flush=True)
        copy = torch.empty_like(w)
        us = triton.testing.do_bench(lambda: copy.copy_(w), warmup=50, rep=300) * 1e3
        rows.append(dict(gemm=name, anchor="torch copy (read + write)", us=round(us, 1), tb_per_s=round(2 * gb / us * 1e3, 3)))
        print(json.dumps(rows[-1]), flush=True)
    json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
