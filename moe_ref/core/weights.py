"""The tensors of one MoE block, in moe_ref's canonical layout, independent of any checkpoint naming.

Shape legend: E experts (the arrays hold all E, or one rank's block of e under the same names), D hidden,
F expert intermediate, S shared-MLP intermediate (all shared experts fused), L latent width (Kimi-K3; experts
then see L, not D: the expert weights' D is Dx, expert input width).

``gate_up_weight_E2FD`` stacks each expert's gate rows (0..F-1) then its up rows (F..2F-1), so one GEMM
computes both; ``down_weight_EDF`` is the down projection. Families with biases keep them in the same order:
``gate_up_bias_E2F`` (gate, then up) and ``down_bias_ED`` (gpt-oss), the gate's ``router_bias_E`` (gpt-oss);
Qwen2-MoE's shared-expert gate is ``shared_gate_weight_D``. Loaders (``moe_ref.checkpoint.loading``) fill this from
each family's checkpoint names; ``MoEWeights.random`` makes seeded weights for tests and demos.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from moe_ref.core.config import MoEConfig

# the fields that hold one row per held expert (sliced by ``expert_slice``; the rest are whole)
EXPERT_FIELDS = ("gate_up_weight_E2FD", "down_weight_EDF", "gate_up_bias_E2F", "down_bias_ED")


@dataclass
class MoEWeights:
    """Weights of one MoE block. Expert tensors may hold a contiguous block of experts
    ``[first_expert, first_expert + E_held)``; router, shared and latent tensors are always whole."""

    gate_weight_ED: torch.Tensor  # [E, D] router, bf16/fp32 (the router GEMM runs in fp32)
    gate_up_weight_E2FD: torch.Tensor  # [E_held, 2F, Dx] with Dx = L for a latent MoE, else D
    down_weight_EDF: torch.Tensor  # [E_held, Dx, F]
    bias_E: torch.Tensor | None = None  # [E] fp32 selection-only bias (e_score_correction_bias)
    shared_gate_up_weight_2SD: torch.Tensor | None = None  # [2S, D]
    shared_down_weight_DS: torch.Tensor | None = None  # [D, S]
    latent_down_weight_LD: torch.Tensor | None = None  # [L, D]  Kimi-K3 routed_expert_down_proj
    latent_up_weight_DL: torch.Tensor | None = None  # [D, L]  Kimi-K3 routed_expert_up_proj
    latent_norm_weight_L: torch.Tensor | None = None  # [L]    Kimi-K3 routed_expert_norm
    first_expert: int = 0
    router_bias_E: torch.Tensor | None = None  # [E] the gate Linear's bias, added to the logits (gpt-oss)
    gate_up_bias_E2F: torch.Tensor | None = None  # [E_held, 2F] expert biases, gate then up (gpt-oss)
    down_bias_ED: torch.Tensor | None = None  # [E_held, Dx]
    shared_gate_weight_D: torch.Tensor | None = None  # [D] Qwen2-MoE shared_expert_gate: sigmoid(x @ w) scales shared

    @property
    def num_held_experts(self) -> int:
        return self.gate_up_weight_E2FD.shape[0]

    def expert_slice(self, first: int, count: int) -> "MoEWeights":
        """The same block with only experts ``[first, first + count)`` (views, no copy)."""
        lo = first - self.first_expert
        if lo < 0 or lo + count > self.num_held_experts:
            from moe_ref.core.errors import TensorShapeMismatchError

            raise TensorShapeMismatchError(
                f"experts [{first}, {first + count}) are not all held (held: [{self.first_expert}, "
                f"{self.first_expert + self.num_held_experts})): the weights belong to another config or rank")
        held = {name: getattr(self, name) for name in EXPERT_FIELDS}
        return dataclasses.replace(self, first_expert=first, **{
            name: None if value is None else value[lo:lo + count] for name, value in held.items()})

    def to(self, *args, **kwargs) -> "MoEWeights":
        """Move/cast every tensor (the bias stays fp32)."""
        moved = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = value.to(*args, **kwargs)
                if f.name == "bias_E":
                    value = value.float()
            moved[f.name] = value
        return MoEWeights(**moved)

    @staticmethod
    def random(cfg: MoEConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu") -> "MoEWeights":
        """Seeded random weights for ``cfg`` (all experts), scaled so activations stay O(1)."""
        gen = torch.Generator(device="cpu").manual_seed(seed)

        def rand(*shape, fan_in):
            return (torch.randn(*shape, generator=gen) / fan_in ** 0.5).to(dtype=dtype, device=device)

        E, D, F, Dx = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.expert_hidden_size
        S, L = cfg.shared_intermediate_size, cfg.latent_dim
        return MoEWeights(
            gate_weight_ED=rand(E, D, fan_in=D),
            gate_up_weight_E2FD=rand(E, 2 * F, Dx, fan_in=Dx),
            down_weight_EDF=rand(E, Dx, F, fan_in=F),
            bias_E=(0.1 * torch.rand(E, generator=gen)).to(device) if cfg.use_selection_bias else None,
            shared_gate_up_weight_2SD=rand(2 * S, D, fan_in=D) if cfg.has_shared_experts else None,
            shared_down_weight_DS=rand(D, S, fan_in=S) if cfg.has_shared_experts else None,
            latent_down_weight_LD=rand(L, D, fan_in=D) if L else None,
            latent_up_weight_DL=rand(D, L, fan_in=L) if L else None,
            latent_norm_weight_L=(1 + 0.1 * torch.randn(L, generator=gen)).to(dtype=dtype, device=device) if L else None,
            router_bias_E=rand(E, fan_in=1) if cfg.router_bias else None,
            gate_up_bias_E2F=rand(E, 2 * F, fan_in=Dx) if cfg.expert_bias else None,
            down_bias_ED=rand(E, Dx, fan_in=F) if cfg.expert_bias else None,
            shared_gate_weight_D=rand(D, fan_in=D) if cfg.shared_expert_gate else None,
        )
