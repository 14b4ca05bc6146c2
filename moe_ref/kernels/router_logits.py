"""The router's gate GEMM in one launch: bf16/fp16 operands as stored, products exact, fp32 sums and fp32 logits.

    router_logits(x_TD, gate_weight_ED) -> logits_TE [T, E] fp32          (router_logits_ref: the torch twin)

Why: the families compute the gate GEMM in fp32 (``F.linear(x.float(), w.float())``, ``core.router``). On a GPU
that is four launches per call: both casts (the gate weight's every call: E x D fp32 written and read again), an
fp32 SIMT GEMM and cuBLAS's split-K reduce, and at prefill the fp32 GEMM runs at CUDA-core speed (22.5 GFLOP at
T = 4096 for Kimi-K2's router). A product of two bf16 (or two fp16) values is exact in fp32, so the tensor cores,
fed the stored operands and accumulating in fp32, compute the same sums up to their order of addition: one launch,
half the weight bytes, tensor-core speed.

Each logit is summed by one program in a fixed order (no split-K, no atomics), so calls are deterministic. The
result differs from the twin's by the order of the fp32 additions (tests: calc_diff and an absolute bound).

Shape legend: T tokens, D hidden, E experts.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_ref.core.errors import ShapeError
from moe_ref.core.router import router_logits as router_logits_ref
from moe_ref.kernels._triton_utils import cdiv, check_device, is_interpreter
from moe_ref.kernels.launch import launch

__all__ = ["router_logits", "router_logits_ref"]

# operand dtypes the kernel takes (x and the gate weight alike): their products are exact in fp32
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
# (largest T, (BLOCK_T, BLOCK_E, BLOCK_K, num_warps, num_stages)): few tokens spread the experts over programs (one
# program streams 16 experts' rows of the weight: E / 16 programs), more tokens widen the tile as the token blocks
# alone fill the GPU (T / BLOCK_T x E / BLOCK_E programs: 192 for Kimi-K2's E 384 at T 1024 and 4096). Chosen by
# that count, not tuned on a GPU yet (scripts/bench_router.py measures them).
_TILES = ((16, (16, 16, 256, 4, 4)), (128, (64, 16, 128, 4, 4)), (2048, (64, 32, 128, 4, 4)),
          (None, (128, 64, 64, 8, 4)))
_INTERPRETER_TILE = (16, 16, 32, 1, 1)


@triton.jit
def _router_logits_kernel(x_ptr, w_ptr, out_ptr, T, E, D, stride_x_t, stride_w_e, stride_o_t,
                          BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                          UPCAST: tl.constexpr):
    """One program = BLOCK_T tokens x BLOCK_E experts, summed over D in BLOCK_K steps (fp32 accumulators).
    UPCAST (the CPU interpreter, whose bf16 dot is wrong): the operands go to fp32 first, exactly."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    live_t, live_e = offs_t < T, offs_e < E
    x_rows = x_ptr + offs_t.to(tl.int64)[:, None] * stride_x_t
    w_rows = w_ptr + offs_e.to(tl.int64)[:, None] * stride_w_e
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        live_k = offs_k < D
        x = tl.load(x_rows + offs_k[None, :], mask=live_t[:, None] & live_k[None, :], other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=live_e[:, None] & live_k[None, :], other=0.0)
        if UPCAST:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc)
    tl.store(out_ptr + offs_t.to(tl.int64)[:, None] * stride_o_t + offs_e[None, :], acc,
             mask=live_t[:, None] & live_e[None, :])


def router_logits_tile(num_tokens: int) -> tuple[int, int, int, int, int]:
    """``(BLOCK_T, BLOCK_E, BLOCK_K, num_warps, num_stages)`` of a launch over ``num_tokens`` tokens."""
    if is_interpreter():
        return _INTERPRETER_TILE
    return next(tile for largest, tile in _TILES if largest is None or num_tokens <= largest)


def router_logits(x_TD: torch.Tensor, gate_weight_ED: torch.Tensor) -> torch.Tensor:
    """``[T, D] x [E, D] -> [T, E]`` fp32 logits (module doc); the twin's numerics up to the order of the sums.

    Args:
        x_TD: ``[T, D]`` bf16 or fp16, unit stride along D.
        gate_weight_ED: ``[E, D]`` of x's dtype, unit stride along D.

    Returns:
        ``[T, E]`` fp32, contiguous. Other operands (fp32, mixed dtypes, a non-unit stride along D) go to
        ``router_logits_ref`` (fp32 operands need no cast there: one fp32 GEMM).
    """
    if x_TD.dim() != 2 or gate_weight_ED.dim() != 2 or x_TD.shape[1] != gate_weight_ED.shape[1]:
        raise ShapeError(f"router_logits takes x [T, D] and the gate weight [E, D]; got {tuple(x_TD.shape)} and "
                         f"{tuple(gate_weight_ED.shape)}")
    if (x_TD.dtype not in KERNEL_DTYPES or gate_weight_ED.dtype != x_TD.dtype or x_TD.stride(-1) != 1
            or gate_weight_ED.stride(-1) != 1):
        return router_logits_ref(x_TD, gate_weight_ED)
    check_device("x_TD", x_TD)
    (num_tokens, hidden), num_experts = x_TD.shape, gate_weight_ED.shape[0]
    logits_TE = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=x_TD.device)
    if logits_TE.numel() == 0:
        return logits_TE
    block_t, block_e, block_k, num_warps, num_stages = router_logits_tile(num_tokens)
    launch(_router_logits_kernel, (cdiv(num_tokens, block_t), cdiv(num_experts, block_e)),
           x_TD, gate_weight_ED, logits_TE, num_tokens, num_experts, hidden, x_TD.stride(0), gate_weight_ED.stride(0),
           logits_TE.stride(0), BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k, UPCAST=is_interpreter(),
           num_warps=num_warps, num_stages=num_stages)
    return logits_TE
