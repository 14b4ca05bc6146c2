"""The batch-invariant mode (``MegaMoE(..., batch_invariant=True)``, ``MOE_REF_BATCH_INVARIANT=1``): for fixed
weights, a token's output bits do not depend on the other tokens of its batch, its row order in an expert segment,
the chunk count or the EP size. The contract, what holds it and what it costs: docs/batch_invariance.md.

    route:   gate GEMM (tiles of one bits class, fp32 sums) -> the family's top-k (row-wise; ties: the lowest id)
    experts: the torch loop in FIXED_ROW_BLOCK-row blocks (CPU) | the Triton grouped MLP on tiles of one bits
             class (CUDA: kernels.runtime.fixed_tiles.same_bits_tile; a GPU not probed: one tile pair), or
             DeepGEMM where auto ranks it and it was probed to give the same bits (experts.auto.gives_triton_bits)
    combine: every (token, slot) expert row comes back unreduced, one exchange (Dispatcher.combine_slots); the home
             rank sums its K weighted rows in slot order in fp32, rounding once (sum_slots: one Triton launch on
             CUDA, its torch twin elsewhere): the same sum at any EP
    finish:  latent projections, shared experts (CUDA: the grouped MLP as the routed experts run it) and their gate
             through matmul; RMSNorm and the activation row-wise

Each GEMM outside the routed experts goes through ``matmul``: ``kernels.runtime.fixed_tiles``' Triton kernel on
CUDA, its twin (BLAS on fixed row blocks) elsewhere.

Shape legend: T tokens, K top-k, D hidden, Dx expert input width, E experts, S shared intermediate, I input and O output features of one weight matrix.
"""
from __future__ import annotations

import torch

from moe_ref.core.activations import gated_activation
from moe_ref.core.fixed_chunks import in_fixed_chunks
from moe_ref.core.errors import BatchInvariantUnsupportedError, MoERefError
from moe_ref.ep.options import BATCH_INVARIANT_BACKENDS, EPOptions
from moe_ref.kernels.ep.ep_combine_slots import sum_slots_kernel
from moe_ref.kernels.runtime._triton_utils import is_interpreter
from moe_ref.kernels.runtime import ops
from moe_ref.kernels.runtime.fixed_tiles import fixed_tile_matmul, fixed_tile_matmul_ref


def options_problem(options: EPOptions) -> MoERefError | None:
    """Why ``options`` cannot hold the contract (CFG026, not raised: the construction agrees on it), or None.

    Held: ``mega='off'`` with the torch experts loop on the CPU; on CUDA the Triton grouped MLP (bf16, fp16, fp32;
    FP8 dispatch included), or auto running it and, for FP8 weights, a backend probed to give its bits (DeepGEMM);
    any transport, pool format and alignment."""
    if not options.batch_invariant:
        return None
    where = options.source.get("batch_invariant", "the argument")
    holders = BATCH_INVARIANT_BACKENDS.get(options.device.type, ())
    # the Triton interpreter runs the CUDA path's kernels on the CPU (the tests of its invariance)
    interpreted_triton = options.experts_backend == "triton" and is_interpreter()
    if options.experts_backend not in holders and not interpreted_triton:
        names = " or ".join(f"experts_backend={name!r}" for name in holders) or "no experts backend"
        return BatchInvariantUnsupportedError(
            f"batch_invariant=True (from {where}) with experts_backend={options.experts_backend!r} (from "
            f"{options.source.get('experts_backend', 'the argument')}) on {options.device.type}: only {names} "
            f"holds the contract there (kernels giving a row the same bits at every row count); pass "
            f"experts_backend='auto' or turn the mode off", field="experts_backend")
    if options.mega != "off":
        return BatchInvariantUnsupportedError(
            f"batch_invariant=True (from {where}) with mega={options.mega!r}: DeepGEMM's fused mega-MoE picks its "
            f"kernels by the row count; pass mega='off' (moe_ref's own routed step holds the contract)", field="mega")
    return None


def matmul(x_TI: torch.Tensor, w_OI: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``x_TI @ w_OI.T`` ``[T, O]`` in ``out_dtype`` with a per-row order that does not depend on T: the fixed-tile
    Triton kernel on CUDA, its twin elsewhere."""
    return (fixed_tile_matmul if x_TI.is_cuda else fixed_tile_matmul_ref)(x_TI, w_OI, out_dtype)


def router_logits(x_TD: torch.Tensor, gate_weight_ED: torch.Tensor) -> torch.Tensor:
    """``[T, D] x [E, D] -> [T, E]`` fp32 gate logits (``ops.router_logits``' numerics, tiles of one bits class)."""
    return matmul(x_TD, gate_weight_ED, torch.float32)


def dense_mlp(x_TD: torch.Tensor, gate_up_weight_2SD: torch.Tensor, down_weight_DS: torch.Tensor,
              activation: str = "silu", situ_beta: float = 4.0, situ_linear_beta: float = 25.0) -> torch.Tensor:
    """The shared experts' gated MLP ``[T, D] -> [T, D]`` in x's dtype, batch-invariant: with 16-bit weights on CUDA
    the default mode's kernel (``ops.dense_mlp``: the grouped MLP, one expert owning every row) on tiles of one bits
    class, as the routed experts; elsewhere ``activations.dense_mlp``'s roundings (each GEMM rounded to the
    weights' dtype, the activation in fp32) through ``matmul``."""
    weights_dtype = gate_up_weight_2SD.dtype
    if x_TD.is_cuda and weights_dtype in (torch.bfloat16, torch.float16):
        return ops.dense_mlp(x_TD, gate_up_weight_2SD, down_weight_DS, activation, situ_beta, situ_linear_beta,
                             batch_invariant=True)
    gate_up_T2S = matmul(x_TD.to(weights_dtype), gate_up_weight_2SD, weights_dtype).float()
    gate_TS, up_TS = gate_up_T2S.chunk(2, dim=-1)
    h_TS = in_fixed_chunks(lambda gate, up: gated_activation(gate, up, activation, situ_beta, situ_linear_beta),
                           gate_TS, up_TS)
    return matmul(h_TS.to(weights_dtype), down_weight_DS, weights_dtype).to(x_TD.dtype)


def sum_slots(rows: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, out_dtype: torch.dtype,
              pool_row_TK: torch.Tensor | None = None) -> torch.Tensor:
    """A token's routed output at its home rank: ``sum_j w[t, j] * row(t, j)`` over its live slots (id >= 0), j in
    order, fp32 from +0.0 with separate multiply and add roundings, rounded once to ``out_dtype``. On CUDA one Triton
    launch (``kernels.ep.ep_combine_slots.sum_slots_kernel``, no host sync), elsewhere its torch twin
    ``sum_slots_ref``: the same roundings in the same order, so the two agree bitwise (tested:
    tests/interpreter/test_combine_slots.py, tests/gpu/test_batch_invariant_cuda.py).

    Args:
        rows: ``[T, K, Dx]`` each slot's expert output, unweighted (masked slots: any bytes, never summed); or, with
            ``pool_row_TK``, the expert pool ``[P, Dx]`` itself (one rank: no ``[T, K, Dx]`` gather is made).
        topk_ids_TK: ``[T, K]`` int64, -1 = masked. topk_weights_TK: ``[T, K]`` fp32.
        pool_row_TK: ``[T, K]`` the pool row of each slot (< 0: a zero row), or None.

    Returns:
        ``[T, Dx]`` out_dtype. The rows are the same bits at any EP size, so is this sum.
    """
    if pool_row_TK is not None and rows.shape[0] == 0:  # an empty pool: every slot masked; give the reads a row
        rows = rows.new_zeros(1, rows.shape[1])
    if rows.is_cuda:
        return sum_slots_kernel(rows, topk_ids_TK, topk_weights_TK, out_dtype, pool_row_TK)
    return sum_slots_ref(rows, topk_ids_TK, topk_weights_TK, out_dtype, pool_row_TK)


def sum_slots_ref(rows: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                  out_dtype: torch.dtype, pool_row_TK: torch.Tensor | None = None) -> torch.Tensor:
    """Torch twin of ``sum_slots``' kernel (same arguments and result, bitwise; any device): a loop over the K slots,
    ``torch.where`` keeping acc where a slot is masked (its product is computed and dropped, so its row's bytes never
    reach acc)."""
    acc_TDx = torch.zeros(topk_ids_TK.shape[0], rows.shape[-1], dtype=torch.float32, device=rows.device)
    live_TK = topk_ids_TK >= 0
    for slot in range(topk_ids_TK.shape[1]):
        if pool_row_TK is None:
            row_TDx = rows[:, slot]
        else:
            row_T = pool_row_TK[:, slot].long()
            row_TDx = torch.where((row_T >= 0)[:, None], rows[row_T.clamp(min=0)], 0)
        product_TDx = topk_weights_TK[:, slot:slot + 1] * row_TDx.float()
        acc_TDx = torch.where(live_TK[:, slot:slot + 1], acc_TDx + product_TDx, acc_TDx)
    return acc_TDx.to(out_dtype)


def rows_with_other_bits(a_TN: torch.Tensor, b_TN: torch.Tensor) -> int:
    """How many rows of two same-shape float tensors differ in any bit (NaNs with equal bits count as equal): the
    check the contract is tested with."""
    as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    a_bits, b_bits = a_TN.view(as_int[a_TN.element_size()]), b_TN.view(as_int[b_TN.element_size()])
    return int((a_bits != b_bits).reshape(a_TN.shape[0], -1).any(dim=1).sum())
