"""Gated activations of the expert MLP, in fp32: ``h = act(gate, up)``.

- ``silu`` (SwiGLU; DeepSeek, Kimi-K2, Qwen, Mixtral, ...): ``silu(g) * u``.
- ``situ`` (Kimi-K3): ``beta*tanh(g/beta)*sigmoid(g) * (lb*tanh(u/lb))`` (``u`` when ``lb == 0``).
- ``swigluoai`` (gpt-oss's clamped SwiGLU): ``g = min(g, limit)``, ``u = clamp(u, -limit, limit)``,
  ``(u + 1) * g * sigmoid(alpha * g)``.
"""
from __future__ import annotations

import torch

from moe_ref.core.errors import UnknownNameError
from moe_ref.core.fixed_chunks import in_fixed_chunks


def gated_activation(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu",
                     situ_beta: float = 4.0, situ_linear_beta: float = 25.0, *, swiglu_alpha: float = 1.702,
                     swiglu_limit: float = 7.0) -> torch.Tensor:
    """``[..., F] x [..., F] -> [..., F]`` in fp32, whatever the input dtype.

    Args:
        gate, up: the two halves of the first GEMM's output.
        activation: ``silu``, ``situ`` or ``swigluoai``.
        situ_beta, situ_linear_beta: SiTU's betas (``situ``).
        swiglu_alpha, swiglu_limit: the clamped SwiGLU's alpha and limit (``swigluoai``).
    """
    gate, up = gate.float(), up.float()
    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    if activation == "situ":
        squashed_gate = situ_beta * torch.tanh(gate / situ_beta) * torch.sigmoid(gate)
        squashed_up = situ_linear_beta * torch.tanh(up / situ_linear_beta) if situ_linear_beta else up
        return squashed_gate * squashed_up
    if activation == "swigluoai":
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
        return (up + 1) * (gate * torch.sigmoid(gate * swiglu_alpha))
    raise UnknownNameError(f"activation={activation!r}; supported: silu, situ, swigluoai")


def dense_mlp(x_TD: torch.Tensor, gate_up_weight_2SD: torch.Tensor, down_weight_DS: torch.Tensor,
              activation: str = "silu", situ_beta: float = 4.0, situ_linear_beta: float = 25.0, *,
              swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0, gate_up_bias_2S: torch.Tensor | None = None,
              down_bias_D: torch.Tensor | None = None, fixed_chunks: bool = False) -> torch.Tensor:
    """One gated MLP (a shared expert, or one routed expert on its rows): ``[T, D] -> [T, D]``.

    GEMMs run in the weights' dtype with fp32 accumulation (torch's default), the activation in fp32;
    the output has ``x_TD``'s dtype.

    Args:
        x_TD: ``[T, D]`` input rows.
        gate_up_weight_2SD: ``[2S, D]`` gate rows, then up rows.
        down_weight_DS: ``[D, S]``.
        activation, situ_beta, situ_linear_beta, swiglu_alpha, swiglu_limit: see ``gated_activation``.
        gate_up_bias_2S: ``[2S]`` bias of the first GEMM (gate, then up), or None (gpt-oss's experts have one).
        down_bias_D: ``[D]`` bias of the down GEMM, or None.
        fixed_chunks: compute the activation in fixed chunks (``moe_ref.core.fixed_chunks``: its bits do not depend
            on T; the batch-invariant mode's CPU path).
    """
    # one fp32 copy of both halves (gated_activation's casts are then no-ops): the same values, one launch
    gate_up_T2S = (x_TD.to(gate_up_weight_2SD.dtype) @ gate_up_weight_2SD.t()).float()
    if gate_up_bias_2S is not None:
        gate_up_T2S = gate_up_T2S + gate_up_bias_2S.float()
    gate_TS, up_TS = gate_up_T2S.chunk(2, dim=-1)
    def act(gate, up):
        return gated_activation(gate, up, activation, situ_beta, situ_linear_beta, swiglu_alpha=swiglu_alpha,
                                swiglu_limit=swiglu_limit)

    h_TS = in_fixed_chunks(act, gate_TS, up_TS) if fixed_chunks else act(gate_TS, up_TS)
    y_TD = h_TS.to(down_weight_DS.dtype) @ down_weight_DS.t()
    if down_bias_D is not None:
        y_TD = y_TD + down_bias_D.to(y_TD.dtype)
    return y_TD.to(x_TD.dtype)
