import pytest
import torch

from moe_ref.core.config import preset
from moe_ref.core.errors import NonFiniteError, ShapeError
from moe_ref.block import route
from moe_ref.core.router import select_experts

pytestmark = pytest.mark.unit


def _per_token_oracle(logits, k, scoring, bias, groups, kept, renorm, scale, group_rule="top2_sum"):
    """Plain-Python routing of one token at a time (independent of the vectorised version)."""
    ids, weights = [], []
    for row in logits.double():
        scores = row.sigmoid() if scoring == "sigmoid" else row.softmax(-1) if scoring == "softmax" else row
        sel = scores + (bias.double() if bias is not None else 0)
        size = len(row) // groups
        best = 2 if group_rule == "top2_sum" else 1  # top2_sum: the sum of the best two; max: the best one
        group_score = [sorted(sel[g * size:(g + 1) * size].tolist(), reverse=True)[:best] for g in range(groups)]
        order = sorted(range(groups), key=lambda g: (-sum(group_score[g]), g))[:kept]
        allowed = [e for e in range(len(row)) if e // size in order]
        chosen = sorted(allowed, key=lambda e: (-float(sel[e]), e))[:k]
        w = [float(scores[e]) for e in chosen]
        if scoring == "topk_softmax":  # gpt-oss: softmax over the chosen logits
            w = torch.tensor(w).softmax(-1).tolist()
        if renorm:
            w = [v / (sum(w) + 1e-20) for v in w]
        ids.append(chosen)
        weights.append([v * scale for v in w])
    return torch.tensor(ids), torch.tensor(weights)


@pytest.mark.parametrize("scoring, use_bias, groups, kept, renorm, scale, group_rule", [
    ("softmax", False, 1, 1, False, 1.0, "top2_sum"),     # Step3, Qwen3-MoE, OLMoE
    ("softmax", False, 1, 1, True, 1.0, "top2_sum"),      # Mixtral, HunYuan
    ("softmax", True, 1, 1, True, 1.0, "top2_sum"),       # Ernie-4.5 (selection bias)
    ("sigmoid", True, 1, 1, True, 2.827, "top2_sum"),     # Kimi-K2/K3
    ("sigmoid", True, 4, 2, True, 2.5, "top2_sum"),       # DeepSeek-V3 grouped
    ("sigmoid", False, 8, 3, False, 1.0, "top2_sum"),
    ("softmax", False, 8, 1, False, 16.0, "max"),         # DeepSeek-V2 group_limited_greedy
    ("topk_softmax", False, 1, 1, False, 1.0, "top2_sum"),  # gpt-oss
])
def test_select_experts_matches_per_token_oracle(scoring, use_bias, groups, kept, renorm, scale, group_rule):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(37, 32, generator=gen)
    bias = 0.2 * torch.rand(32, generator=gen) if use_bias else None
    ids, weights = select_experts(logits, 4, scoring, bias, groups, kept, renorm, scale, group_score=group_rule)
    want_ids, want_weights = _per_token_oracle(logits, 4, scoring, bias, groups, kept, renorm, scale, group_rule)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, want_ids), f"{scoring=} {groups=} {kept=}"
    torch.testing.assert_close(weights.double(), want_weights.double(), rtol=1e-6, atol=1e-7)


def test_bias_changes_selection_but_not_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    ids, weights = select_experts(logits, 2, "sigmoid", bias, renormalize=False)
    assert ids.tolist() == [[3, 0]]
    torch.testing.assert_close(weights, torch.sigmoid(torch.tensor([[-1.0, 2.0]])))


def test_grouped_topk_drops_strong_expert_in_weak_group():
    # Group 0 = experts 0-3 holds the single best expert, group 1 = 4-7 scores higher as a pair of top-2.
    logits = torch.tensor([[5.0, -9, -9, -9, 3.0, 3.0, -9, -9]])
    ids, _ = select_experts(logits, 2, "sigmoid", None, num_groups=2, num_topk_groups=1)
    assert ids.tolist() == [[4, 5]]


def test_renormalised_weights_sum_to_scaling_factor():
    _, weights = select_experts(torch.randn(9, 16), 4, "sigmoid", None, renormalize=True, routed_scaling_factor=2.5)
    torch.testing.assert_close(weights.sum(-1), torch.full((9,), 2.5))


def test_ties_pick_lower_expert_id_first():
    ids, _ = select_experts(torch.zeros(3, 8), 3, "softmax")
    assert ids.tolist() == [[0, 1, 2]] * 3


def test_zero_tokens():
    ids, weights = select_experts(torch.empty(0, 8), 2, "sigmoid")
    assert ids.shape == (0, 2) and weights.shape == (0, 2)


def test_route_rejects_nan_logits_naming_tokens():
    cfg = preset("tiny-kimi-k2")
    x = torch.randn(5, cfg.hidden_size)
    x[3, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"1 of 5 tokens .*\[3\]"):
        route(x, torch.randn(cfg.num_experts, cfg.hidden_size), cfg)


def test_route_rejects_wrong_width():
    cfg = preset("tiny-kimi-k2")
    with pytest.raises(ShapeError, match=r"\(5, 7\)"):
        route(torch.randn(5, 7), torch.randn(cfg.num_experts, cfg.hidden_size), cfg)
