"""Gated activations of the expert MLP, in fp32: ``h = act(gate, up)``.

- ``silu`` (SwiGLU; DeepSeek-V3, Kimi-K2, Step3): ``silu(g) * u``.
- ``situ`` (Kimi-K3): ``beta*tanh(g/beta)*sigmoid(g) * (lb*tanh(u/lb))`` (``u`` when ``lb == 0``).
"""
from __future__ import annotations

import torch

from moe_ref.core.errors import UnknownNameError


def gated_activation(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu",
                     situ_beta: float = 4.0, situ_linear_beta: float = 25.0) -> torch.Tensor:
    """``[..., F] x [..., F] -> [..., F]`` in fp32, whatever the input dtype."""
    gate, up = gate.float(), up.float()
    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    if activation == "situ":
        squashed_gate = situ_beta * torch.tanh(gate / situ_beta) * torch.sigmoid(gate)
        squashed_up = situ_linear_beta * torch.tanh(up / situ_linear_beta) if situ_linear_beta else up
        return squashed_gate * squashed_up
    raise UnknownNameError(f"activation={activation!r}; supported: silu, situ")


def dense_mlp(x_TD: torch.Tensor, gate_up_weight_2SD: torch.Tensor, down_weight_DS: torch.Tensor,
              activation: str = "silu", situ_beta: float = 4.0, situ_linear_beta: float = 25.0) -> torch.Tensor:
    """One gated MLP (a shared expert, or one routed expert on its rows): ``[T, D] -> [T, D]``.

    GEMMs run in the weights' dtype with fp32 accumulation (torch's default), the activation in fp32;
    the output has ``x_TD``'s dtype.
    """
    # one fp32 copy of both halves (gated_activation's casts are then no-ops): the same values, one launch
    gate_up_T2S = (x_TD.to(gate_up_weight_2SD.dtype) @ gate_up_weight_2SD.t()).float()
    gate_TS, up_TS = gate_up_T2S.chunk(2, dim=-1)
    h_TS = gated_activation(gate_TS, up_TS, activation, situ_beta, situ_linear_beta)
    return (h_TS.to(down_weight_DS.dtype) @ down_weight_DS.t()).to(x_TD.dtype)
