"""An independent oracle of the Kimi-K3 MoE block, compared with moe_ref (``reference_moe`` and 1-rank ``MegaMoE``).

Written from the semantics of the published serving code (SGLang ``python/sglang/srt/models/kimi_k3.py``:
``KimiK3MoE._forward_unfused``, ``_reduce_latent``, ``KimiK3MLP``, ``SituAndMul``; SGLang's ``RMSNorm`` and
DeepSeek-V3 ``biased_grouped_topk`` router), not from moe_ref: it shares no code with moe_ref (plain torch,
per-token loops). What it encodes:

- router: fp32 logits of the FULL hidden state (``MoEGate``), sigmoid scores, selection by score + bias
  (``e_score_correction_bias``, selection only), top-k, weights = scores renormalised, times
  ``routed_scaling_factor``;
- latent down-projection ``routed_expert_down_proj`` [L, D] of the hidden state, in the model dtype;
- routed experts in latent space: ``w2(situ(w1 z, w3 z))`` with SiTU in fp32,
  ``beta*tanh(g/beta)*sigmoid(g) * (lb*tanh(u/lb))``, cast back to the model dtype before w2;
- the weighted sum over the k experts, reduced across ranks IN LATENT SPACE, THEN ``routed_expert_norm``
  (RMSNorm over L, computed in fp32, weight applied in fp32, output in the model dtype: sum(norm) != norm(sum));
- latent up-projection ``routed_expert_up_proj`` [D, L];
- plus the shared experts (SiTU MLP of width ``moe_intermediate_size * num_shared_experts``) on the FULL hidden
  state, added in the model dtype.
"""
from __future__ import annotations

import math

import pytest
import torch

from moe_ref import MegaMoE
from moe_ref.core.config import preset
from moe_ref.reference import reference_moe
from moe_ref.testing import CALC_DIFF_TOLERANCES, calc_diff
from moe_ref.core.weights import MoEWeights

pytestmark = pytest.mark.unit

T = 12


def _k3_params(cfg, seed: int) -> dict:
    """Checkpoint-shaped K3 tensors (names as in the published checkpoint, fp32)."""
    gen = torch.Generator().manual_seed(seed)
    E, D, F, L = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.latent_dim
    S = cfg.shared_intermediate_size

    def rand(*shape):
        return torch.randn(*shape, generator=gen) / math.sqrt(shape[-1])

    return {
        "gate.weight": rand(E, D), "gate.e_score_correction_bias": 0.1 * torch.rand(E, generator=gen),
        "routed_expert_down_proj.weight": rand(L, D), "routed_expert_up_proj.weight": rand(D, L),
        "routed_expert_norm.weight": 1 + 0.1 * torch.randn(L, generator=gen),
        "experts.w1": [rand(F, L) for _ in range(E)], "experts.w3": [rand(F, L) for _ in range(E)],
        "experts.w2": [rand(L, F) for _ in range(E)],
        "shared_experts.gate_proj.weight": rand(S, D), "shared_experts.up_proj.weight": rand(S, D),
        "shared_experts.down_proj.weight": rand(D, S),
    }


def _situ(gate, up, beta, linear_beta):
    g, u = gate.float(), up.float()
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))


def k3_block_oracle(x, p, *, top_k, renormalize, scaling, beta, linear_beta, eps, use_norm, norm_before_sum=False):
    """The K3 MoE block, token by token. ``x [T, D]`` in the model dtype; ``p`` tensors cast to that dtype
    (router fp32). ``norm_before_sum`` moves the norm onto each expert's output (a deliberately wrong variant)."""
    dtype = x.dtype
    w = {k: ([t.to(dtype) for t in v] if isinstance(v, list) else v.to(dtype)) for k, v in p.items()}
    logits = x.float() @ p["gate.weight"].float().t()
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        scores = logits[t].sigmoid()
        chosen = torch.topk(scores + p["gate.e_score_correction_bias"].float(), top_k).indices
        weights = scores[chosen]
        if renormalize:
            weights = weights / weights.sum()
        weights = weights * scaling
        z = x[t] @ w["routed_expert_down_proj.weight"].t()
        latent = torch.zeros(z.shape[0], dtype=torch.float32)
        for j, e in enumerate(chosen.tolist()):
            h = _situ(z @ w["experts.w1"][e].t(), z @ w["experts.w3"][e].t(), beta, linear_beta).to(dtype)
            y_e = h @ w["experts.w2"][e].t()
            if norm_before_sum:
                y_e = _rms(y_e, p["routed_expert_norm.weight"], eps)
            latent += weights[j] * y_e.float()
        latent = latent.to(dtype)
        if use_norm and not norm_before_sum:
            latent = _rms(latent, p["routed_expert_norm.weight"], eps)
        routed = latent @ w["routed_expert_up_proj.weight"].t()
        shared_h = _situ(x[t] @ w["shared_experts.gate_proj.weight"].t(), x[t] @ w["shared_experts.up_proj.weight"].t(),
                         beta, linear_beta).to(dtype)
        out[t] = routed + shared_h @ w["shared_experts.down_proj.weight"].t()
    return out


def _rms(v, weight, eps):
    v32 = v.float()
    return (v32 * torch.rsqrt(v32.pow(2).mean() + eps) * weight.float()).to(v.dtype)


def _as_moe_weights(p, dtype) -> MoEWeights:
    """The interface mapping only: moe_ref stacks each expert's w1 (gate) rows above its w3 (up) rows."""
    return MoEWeights(
        gate_weight_ED=p["gate.weight"].to(dtype),
        gate_up_weight_E2FD=torch.stack([torch.cat([g, u]) for g, u in zip(p["experts.w1"], p["experts.w3"])]).to(dtype),
        down_weight_EDF=torch.stack(p["experts.w2"]).to(dtype),
        bias_E=p["gate.e_score_correction_bias"].float(),
        shared_gate_up_weight_2SD=torch.cat([p["shared_experts.gate_proj.weight"],
                                             p["shared_experts.up_proj.weight"]]).to(dtype),
        shared_down_weight_DS=p["shared_experts.down_proj.weight"].to(dtype),
        latent_down_weight_LD=p["routed_expert_down_proj.weight"].to(dtype),
        latent_up_weight_DL=p["routed_expert_up_proj.weight"].to(dtype),
        latent_norm_weight_L=p["routed_expert_norm.weight"].to(dtype),
    )


def _oracle(x, p, cfg, **variant):
    settings = dict(top_k=cfg.num_topk, renormalize=cfg.renormalize, scaling=cfg.routed_scaling_factor,
                    beta=cfg.situ_beta, linear_beta=cfg.situ_linear_beta, eps=cfg.rms_norm_eps, use_norm=cfg.latent_norm)
    return k3_block_oracle(x, p, **{**settings, **variant})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_ref_matches_the_k3_oracle(dtype):
    cfg = preset("tiny-kimi-k3")
    assert cfg.activation == "situ" and cfg.latent_dim and cfg.latent_norm and cfg.has_shared_experts
    p = _k3_params(cfg, seed=0)
    x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = _oracle(x, p, cfg)
    weights = _as_moe_weights(p, dtype)
    moe = MegaMoE(cfg, dtype=dtype, num_max_tokens_per_rank=T)
    moe.load_weights(weights)
    with torch.no_grad():
        layer_out = moe(x)
    bound = CALC_DIFF_TOLERANCES[dtype]
    for name, actual in (("reference_moe", reference_moe(x, weights, cfg)), ("MegaMoE", layer_out)):
        diff = calc_diff(actual.float(), expected.float())
        assert diff <= bound, f"{name} vs K3 oracle: {diff=} > {bound} ({dtype=})"


def test_the_oracle_tells_where_the_norm_sits():
    """The comparison can fail: norming each expert's output before the sum (or dropping the norm) is far off."""
    cfg = preset("tiny-kimi-k3")
    p = _k3_params(cfg, seed=2)
    x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    actual = reference_moe(x, _as_moe_weights(p, torch.float32), cfg)
    assert calc_diff(actual, _oracle(x, p, cfg)) <= CALC_DIFF_TOLERANCES[torch.float32]
    assert calc_diff(actual, _oracle(x, p, cfg, norm_before_sum=True)) > 1e-3
    assert calc_diff(actual, _oracle(x, p, cfg, use_norm=False)) > 1e-3
