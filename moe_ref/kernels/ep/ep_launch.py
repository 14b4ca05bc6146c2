"""Launch shapes of the EP row-moving kernels, in one place (``scripts/bench_dispatch.py --sweep`` varies them).

A program of ``ep_dispatch`` moves one (source, token) row, ``dispatch_block_bytes`` per step, with
``dispatch_warps`` warps; a program of ``ep_combine_push`` reduces one (source, token) over its slots here and a
program of ``ep_combine_reduce`` sums one token's partials, ``combine_block_cols`` columns per step with
``combine_warps`` warps. The Triton interpreter (CPU tests) keeps its own small blocks. Read at launch (and so at
CUDA-graph capture); every value gives the same bytes, only the speed differs.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EPLaunch", "EP_LAUNCH"]


@dataclass
class EPLaunch:
    dispatch_block_bytes: int = 8192
    dispatch_warps: int = 4
    # 2048 columns (was 1024): combine halves 11% faster at 4096 tokens, 18% at 128 (one H200, R = 1, bf16 and FP8;
    # docs/results/bench_dispatch_sweep_1gpu_2026-12-01.json); warps and dispatch blocks changed nothing measurable
    combine_block_cols: int = 2048
    combine_warps: int = 4


# NOTE: module state on purpose: the one set of launch shapes every EP kernel call reads
EP_LAUNCH = EPLaunch()
