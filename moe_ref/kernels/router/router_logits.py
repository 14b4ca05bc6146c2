"""The router's gate GEMM in one launch: bf16/fp16 operands as stored, products exact, fp32 sums and fp32 logits.

    router_logits(x_TD, gate_weight_ED) -> logits_TE [T, E] fp32          (router_logits_ref: the torch twin)

Why: the families compute the gate GEMM in fp32 (``F.linear(x.float(), w.float())``, ``core.router``). On a GPU
that is four launches per call: both casts (the gate weight's every call: E x D fp32 written and read again), an
fp32 SIMT GEMM and cuBLAS's split-K reduce, and at prefill the fp32 GEMM runs at CUDA-core speed. A product of
two bf16 (or two fp16) values is exact in fp32, so the tensor cores, fed the stored operands and accumulating in
fp32, compute the same sums up to their order of addition.

How: cuBLAS does exactly that when asked for an fp32 output (``torch.mm(x, w.t(), out_dtype=torch.float32)``,
torch's ``mm.dtype``, CUDA only). A Triton kernel of our own did the same in one launch; on one H200 cuBLAS was
faster at every T from 1 to 32768 (Kimi-K2's router: 10.4 against 17.3 us at T = 1, 242 against 695 us at
T = 32768) and as exact (``scripts/bench_router.py``, docs/results/bench_router_h200_2026-12-02.md), so the
library runs it. Where torch has no ``mm.dtype`` for the operands (the CPU, an older torch), and for other
operands (fp32, mixed dtypes), the twin runs.

Shape legend: T tokens, D hidden, E experts.
"""
from __future__ import annotations

import torch

from moe_ref.core.errors import ShapeError
from moe_ref.core.router import router_logits as router_logits_ref

__all__ = ["router_logits", "router_logits_ref"]

# operand dtypes whose products are exact in fp32 (x and the gate weight alike)
EXACT_PRODUCT_DTYPES = (torch.bfloat16, torch.float16)


def router_logits(x_TD: torch.Tensor, gate_weight_ED: torch.Tensor) -> torch.Tensor:
    """``[T, D] x [E, D] -> [T, E]`` fp32 logits (module doc); the twin's numerics up to the order of the sums.

    Args:
        x_TD: ``[T, D]`` bf16 or fp16.
        gate_weight_ED: ``[E, D]`` of x's dtype.

    Returns:
        ``[T, E]`` fp32. Other operands (fp32, mixed dtypes), and devices where torch cannot write an fp32 product of
        16-bit operands, go to ``router_logits_ref`` (fp32 operands need no cast there: one fp32 GEMM).
    """
    if x_TD.dim() != 2 or gate_weight_ED.dim() != 2 or x_TD.shape[1] != gate_weight_ED.shape[1]:
        raise ShapeError(f"router_logits takes x [T, D] and the gate weight [E, D]; got {tuple(x_TD.shape)} and "
                         f"{tuple(gate_weight_ED.shape)}")
    if (x_TD.dtype not in EXACT_PRODUCT_DTYPES or gate_weight_ED.dtype != x_TD.dtype
            or not _mm_fp32_out(x_TD.device)):
        return router_logits_ref(x_TD, gate_weight_ED)
    return torch.mm(x_TD, gate_weight_ED.t(), out_dtype=torch.float32)


def _mm_fp32_out(device: torch.device) -> bool:
    """Whether ``torch.mm(..., out_dtype=torch.float32)`` takes 16-bit operands on this device: this torch has the
    ``mm.dtype`` overload (2.11 on the GPU image and 2.13 here do) and the device is CUDA (the CPU has no kernel for
    it)."""
    return device.type == "cuda" and _HAS_MM_DTYPE


_HAS_MM_DTYPE = "dtype" in torch.ops.aten.mm.overloads()
