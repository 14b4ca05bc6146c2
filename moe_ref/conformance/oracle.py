"""The independent oracle: float64 torch over the operands a rank actually consumed. It shares no code with the
implementations under test (not moe_ref's activations, quantizers, routing or reference): the recipe's weights come
from their codes and scales (``scenarios.dequantize``), FP8 activations are quantized here per token per 128
columns, and the MLP is written out below.

    y[t] = sum_j w[t, j] * down_e (silu(gate_e x[t]) * up_e x[t]),  e = ids[t, j], slots with e = -1 skipped

Limits (``LIMITS``): calc_diff as DeepGEMM's tests bound it (1e-3 per FP8 GEMM, two here; 1e-2 with one FP4
operand), tighter for plain dtypes; and a per-row max-abs bound against the row's largest value, so one wrong row
among many cannot hide in a whole-tensor statistic.

Shape legend: T tokens of this rank, K top-k, E experts, D hidden width, F expert intermediate.
"""
from __future__ import annotations

import torch

from moe_ref.conformance.api import ExpertWeights
from moe_ref.conformance.scenarios import dequantize, quantize_fp8_blocks, quantize_fp8_rows

# (calc_diff limit, per-row atol, per-row rtol of the row's max |y|) by dtype, or by the quant recipe
LIMITS = {
    "fp32": (1e-8, 1e-4, 1e-4),
    "fp16": (1e-5, 5e-3, 5e-3),
    "bf16": (1e-4, 2e-2, 3e-2),   # vLLM's modular-kernel tests: 3e-2
    "fp8_block": (2e-3, 5e-2, 1e-1),  # DeepGEMM: 1e-3 per FP8 GEMM, two GEMMs
    "int4": (1e-2, 5e-2, 1e-1),   # DeepGEMM: 1e-2 with one 4-bit operand
    "mxfp4": (1e-2, 5e-2, 1e-1),
}


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's scale-free difference ``1 - 2 sum(x y) / sum(x^2 + y^2)`` in float64 (0 = equal)."""
    x, y = x.double(), y.double()
    denominator = (x * x + y * y).sum()
    return 0.0 if denominator == 0 else float(1 - 2 * (x * y).sum() / denominator)


def fake_quant_fp8_rows(x_TD: torch.Tensor) -> torch.Tensor:
    """``x`` rounded as FP8 dispatch rounds it (``scenarios.quantize_fp8_rows``), in float64."""
    codes, scale = quantize_fp8_rows(x_TD)
    return codes.double() * scale.double().repeat_interleave(128, 1)[:, :x_TD.shape[1]]


def expert_weights_f64(weights: ExpertWeights, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up ``[2F, D]``, down ``[D, F]``) of one expert in float64, from its codes where the recipe has them."""
    if weights.quant == "none":
        return weights.gate_up_e2FD[expert].double(), weights.down_eDF[expert].double()
    one = slice(expert, expert + 1)
    return (dequantize(weights.gate_up_q[one], weights.gate_up_scale[one], weights.quant)[0],
            dequantize(weights.down_q[one], weights.down_scale[one], weights.quant)[0])


def _expert_mlp(x_ND: torch.Tensor, expert: int, weights: ExpertWeights, block_weights: bool) -> torch.Tensor:
    """``[N, D]`` float64: ``down(silu(gate x) * up x)`` of one expert over float64 rows; ``block_weights``: its
    plain weights rounded per 128 x 128 block first, as the harness's own fp8_block recipe stores weights."""
    gate_up_2FD, down_DF = (t.to(x_ND.device) for t in expert_weights_f64(weights, expert))
    if block_weights:
        gate_up_2FD, down_DF = (dequantize(*quantize_fp8_blocks(w[None]), "fp8_block")[0] for w in (gate_up_2FD, down_DF))
    gate_NF, up_NF = (x_ND @ gate_up_2FD.T).chunk(2, dim=-1)
    return (gate_NF * torch.sigmoid(gate_NF) * up_NF) @ down_DF.T


def _fp8_inputs(weights: ExpertWeights, compute: str | None) -> tuple[bool, bool]:
    """(round the activations per token per 128, round plain weights per block): the recipe's or the declared
    compute's FP8 block arithmetic."""
    block_weights = compute == "fp8_block" and weights.quant == "none"
    return weights.quant == "fp8_block" or block_weights, block_weights


def oracle_moe(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
               weights: ExpertWeights, compute: str | None = None) -> torch.Tensor:
    """``[T, D]`` float64 on x's device: the routed experts of every token over ALL experts (``weights`` holds E).
    ``compute``: the implementation's ``Capabilities.compute``; ``"fp8_block"`` on plain weights rounds them per
    128 x 128 block, and the activations per token per 128 columns, as an FP8 block recipe does."""
    fp8_x, block_weights = _fp8_inputs(weights, compute)
    x = fake_quant_fp8_rows(x_TD) if fp8_x else x_TD.double()
    y_TD = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    ids_TK, w_TK = topk_ids_TK.to(x.device).long(), topk_weights_TK.to(x.device).double()
    for expert in torch.unique(ids_TK[ids_TK >= 0]).tolist():
        token_N, slot_N = (ids_TK == expert).nonzero(as_tuple=True)
        out_ND = _expert_mlp(x[token_N], expert, weights, block_weights)
        y_TD.index_add_(0, token_N, w_TK[token_N, slot_N, None] * out_ND)
    return y_TD


def oracle_rows(x_PD: torch.Tensor, expert_P: torch.Tensor, weights: ExpertWeights,
                compute: str | None = None) -> torch.Tensor:
    """``[P, D]`` float64 on x's device: each pool row through its expert (``expert_P``, -1: a row outside every
    segment, NaN here); the activations rounded as ``oracle_moe`` rounds them."""
    fp8_x, block_weights = _fp8_inputs(weights, compute)
    live_P = expert_P >= 0
    y_PD = torch.full(x_PD.shape, float("nan"), dtype=torch.float64, device=x_PD.device)
    x_ND = x_PD[live_P]
    x_ND = fake_quant_fp8_rows(x_ND) if fp8_x else x_ND.double()
    rows_N = live_P.nonzero().flatten()
    for expert in torch.unique(expert_P[live_P]).tolist():
        mine = expert_P[rows_N] == expert
        y_PD[rows_N[mine]] = _expert_mlp(x_ND[mine], expert, weights, block_weights)
    return y_PD


def compare(actual_TD: torch.Tensor, expected_TD: torch.Tensor, limit_key: str) -> str | None:
    """Why ``actual`` is not within ``LIMITS[limit_key]`` of the float64 ``expected`` (None: it is)."""
    if actual_TD.shape != expected_TD.shape:
        return f"shape {tuple(actual_TD.shape)}, expected {tuple(expected_TD.shape)}"
    if actual_TD.numel() == 0:
        return None
    actual = actual_TD.double().cpu()
    expected = expected_TD.cpu()
    if not torch.isfinite(actual).all():
        rows = (~torch.isfinite(actual)).any(-1).nonzero().flatten()
        return f"{rows.numel()} rows hold NaN/inf (first rows {rows[:5].tolist()})"
    limit, atol, rtol = LIMITS[limit_key]
    diff = calc_diff(actual, expected)
    if diff > limit:
        return f"calc_diff {diff:.3g} > {limit:g} ({limit_key})"
    err_T = (actual - expected).abs().amax(-1)
    bound_T = atol + rtol * expected.abs().amax(-1)
    bad = (err_T > bound_T).nonzero().flatten()
    if bad.numel():
        row = int(bad[0])
        return (f"{bad.numel()} of {err_T.numel()} rows off by more than {atol:g} + {rtol:g} * row max "
                f"(row {row}: max |err| {float(err_T[row]):.3g}, bound {float(bound_T[row]):.3g})")
    return None
