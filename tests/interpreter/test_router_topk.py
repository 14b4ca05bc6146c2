"""router_topk (Triton) vs router_topk_ref (torch) at tiny shapes, plus the HF formula as an outside check."""

import pytest
import torch

from moe_ref.kernels.router.router_topk import router_topk, router_topk_ref

pytestmark = pytest.mark.interpreter


def _run_both(logits_TE, num_topk, **kwargs):
    return router_topk(logits_TE, num_topk, **kwargs), router_topk_ref(logits_TE, num_topk, **kwargs)


def _check(got, ref, assert_close, **case):
    (ids, weights), (ids_ref, weights_ref) = got, ref
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32, f"{ids.dtype=} {weights.dtype=} {case=}"
    assert torch.equal(ids.cpu(), ids_ref.cpu()), f"{ids=} {ids_ref=} {case=}"
    assert_close(weights, weights_ref, torch.float32, **case)


CASES = [
    # name, T, E, K, kwargs
    ("kimi_sigmoid_bias_scaled", 13, 16, 4, dict(bias=True, routed_scaling_factor=2.827)),
    ("step3_softmax_no_renorm", 9, 12, 3, dict(scoring="softmax", renormalize=False)),
    ("dsv3_groups_negative_bias", 11, 32, 4, dict(bias=True, num_groups=8, num_topk_groups=4,
                                                   routed_scaling_factor=2.5)),
    ("softmax_groups", 5, 16, 2, dict(scoring="softmax", num_groups=4, num_topk_groups=2)),
    ("non_pow2_experts_one_token", 1, 6, 6, dict()),
]


@pytest.mark.parametrize("name,num_tokens,num_experts,num_topk,kwargs", CASES, ids=[c[0] for c in CASES])
def test_router_matches_twin(name, num_tokens, num_experts, num_topk, kwargs, device, assert_close):
    torch.manual_seed(0)
    kwargs = dict(kwargs)
    logits_TE = torch.randn(num_tokens, num_experts, device=device) * 2
    if kwargs.pop("bias", False):
        kwargs["bias_E"] = torch.randn(num_experts, device=device) * 0.5  # includes negative entries
    got, ref = _run_both(logits_TE, num_topk, **kwargs)
    _check(got, ref, assert_close, name=name, num_tokens=num_tokens, num_experts=num_experts, num_topk=num_topk)
    assert bool((got[1] >= 0).all()), f"{name=}"


def test_ties_pick_lower_expert_id_first(device, assert_close):
    logits_TE = torch.zeros(3, 8, device=device)
    logits_TE[1, 5] = 1.0  # one clear winner, then ties
    got, ref = _run_both(logits_TE, 3)
    _check(got, ref, assert_close, case="ties")
    assert got[0].cpu().tolist() == [[0, 1, 2], [5, 0, 1], [0, 1, 2]]


def test_group_ties_pick_lower_group_first(device, assert_close):
    logits_TE = torch.zeros(2, 8, device=device)
    got, ref = _run_both(logits_TE, 2, num_groups=4, num_topk_groups=2)
    _check(got, ref, assert_close, case="group ties")
    assert got[0].cpu().tolist() == [[0, 1], [0, 1]]


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
def test_exactly_k_positive_logits(scoring, device, assert_close):
    num_topk = 3
    logits_TE = torch.full((4, 10), -30.0, device=device)
    for t in range(4):
        logits_TE[t, torch.tensor([t, (t + 3) % 10, 9])] = torch.tensor([1.0, 2.0, 3.0], device=device)
    got, ref = _run_both(logits_TE, num_topk, scoring=scoring)
    _check(got, ref, assert_close, scoring=scoring)
    for t in range(4):
        assert got[0][t].tolist() == [9, (t + 3) % 10, t], f"{t=} {scoring=} {got[0][t]=}"
    assert_close(got[1].sum(-1), torch.ones(4, device=device), torch.float32, scoring=scoring)


def test_zero_tokens(device):
    ids, weights = router_topk(torch.empty(0, 8, device=device), 2)
    assert ids.shape == (0, 2) and weights.shape == (0, 2)


def test_agrees_with_hf_formula_as_sets(device, assert_close):
    """HF DeepseekV3 topk (sorted=False, groups filled with 0.0): same expert sets when scores >= 0."""
    torch.manual_seed(1)
    num_tokens, num_experts, num_groups, num_topk_groups, num_topk = 7, 16, 4, 2, 4
    logits = torch.randn(num_tokens, num_experts, device=device)
    bias = torch.rand(num_experts, device=device) * 0.1  # non-negative: HF's 0.0 fill == our -inf
    scores = logits.sigmoid()
    select = scores + bias
    group_scores = select.view(num_tokens, num_groups, -1).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=num_topk_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(num_tokens, num_groups, num_experts // num_groups).reshape(num_tokens, -1)
    select = select.masked_fill(~score_mask.bool(), 0.0)
    hf_ids = torch.topk(select, k=num_topk, dim=-1, sorted=False)[1]
    hf_w = scores.gather(1, hf_ids)
    hf_w = hf_w / (hf_w.sum(dim=-1, keepdim=True) + 1e-20) * 2.5

    ids, weights = router_topk(logits, num_topk, bias_E=bias, num_groups=num_groups,
                               num_topk_groups=num_topk_groups, routed_scaling_factor=2.5)
    order, hf_order = ids.sort(-1), hf_ids.sort(-1)
    assert torch.equal(order.values.cpu(), hf_order.values.cpu()), f"{ids=} {hf_ids=}"
    assert_close(weights.gather(1, order.indices), hf_w.gather(1, hf_order.indices), torch.float32, case="hf")


@pytest.mark.parametrize("bad", [dict(num_topk=9), dict(num_groups=3), dict(scoring="relu"),
                                 dict(num_groups=4, num_topk_groups=1, num_topk=3)])
def test_bad_arguments_raise_value_error(bad, device):
    kwargs = dict(num_topk=2) | bad
    with pytest.raises(ValueError):
        router_topk(torch.zeros(2, 8, device=device), kwargs.pop("num_topk"), **kwargs)


@pytest.mark.parametrize("num_tokens", [1, 9, 70])  # one program, several (block_t = 8 interpreted, up to 64 on GPU)
@pytest.mark.parametrize("value, flagged", [(float("nan"), 1), (float("inf"), 1), (float("-inf"), 1), (3e38, 0),
                                            (None, 0)])
@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
def test_the_nonfinite_flag_matches_twin(num_tokens, value, flagged, scoring, device):
    logits_TE = torch.randn(num_tokens, 12, device=device)
    if value is not None:
        logits_TE[num_tokens - 1, 11] = value  # the last token's last expert: the edge of the last tile
    for router in (router_topk, router_topk_ref):
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        router(logits_TE, 3, scoring, nonfinite_flag=flag)
        assert int(flag) == flagged, router.__name__
    untouched = torch.full((1,), 5, dtype=torch.int32, device=device)  # only ever raised, never cleared
    router_topk(torch.randn(4, 12, device=device), 3, nonfinite_flag=untouched)
    assert int(untouched) == 5
