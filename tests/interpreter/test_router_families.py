"""router_topk (Triton) vs its torch twin for the router rules the families added (``moe_ref.core.families``):
DeepSeek-V2's max-scored groups, gpt-oss's softmax over the top-k logits, Ernie's softmax with a selection bias."""

import pytest
import torch

from moe_ref.kernels.router.router_topk import router_topk, router_topk_ref

pytestmark = pytest.mark.interpreter

CASES = [
    # name, T, E, K, kwargs
    ("deepseek_v2_group_limited_greedy", 11, 16, 2, dict(scoring="softmax", num_groups=8, num_topk_groups=1,
                                                         group_score="max", renormalize=False,
                                                         routed_scaling_factor=16.0)),
    ("max_groups_of_one_expert", 7, 8, 3, dict(scoring="softmax", num_groups=8, num_topk_groups=3, group_score="max")),
    ("gpt_oss_topk_softmax", 13, 12, 4, dict(scoring="topk_softmax", renormalize=False)),
    ("topk_softmax_renormalized_scaled", 9, 10, 3, dict(scoring="topk_softmax", routed_scaling_factor=2.0)),
    ("ernie_softmax_selection_bias", 10, 16, 6, dict(scoring="softmax", bias=True)),
]


@pytest.mark.parametrize("name,num_tokens,num_experts,num_topk,kwargs", CASES, ids=[c[0] for c in CASES])
def test_family_rules_match_twin(name, num_tokens, num_experts, num_topk, kwargs, device, assert_close):
    torch.manual_seed(0)
    kwargs = dict(kwargs)
    logits_TE = torch.randn(num_tokens, num_experts, device=device) * 2
    if kwargs.pop("bias", False):
        kwargs["bias_E"] = torch.rand(num_experts, device=device) * 0.1
    ids, weights = router_topk(logits_TE, num_topk, **kwargs)
    ids_ref, weights_ref = router_topk_ref(logits_TE, num_topk, **kwargs)
    case = dict(name=name, num_tokens=num_tokens, num_experts=num_experts, num_topk=num_topk)
    assert torch.equal(ids.cpu(), ids_ref.cpu()), f"{ids=} {ids_ref=} {case=}"
    assert_close(weights, weights_ref, torch.float32, **case)


def test_topk_softmax_is_the_softmax_of_the_chosen_logits(device, assert_close):
    """gpt-oss's rule from its own formula: top-k of the logits, then softmax over those k values."""
    torch.manual_seed(1)
    logits_TE = torch.randn(6, 8, device=device) * 3
    ids, weights = router_topk(logits_TE, 3, scoring="topk_softmax", renormalize=False)
    top_values, top_ids = logits_TE.topk(3, dim=-1)
    assert torch.equal(ids.cpu(), top_ids.cpu())
    assert_close(weights, top_values.softmax(dim=-1), torch.float32, case="gpt-oss formula")


def test_max_group_score_differs_from_top2_sum(device):
    """A case where the two group rules keep different groups, so the kernel's GROUP_MAX switch is exercised."""
    # sigmoid scores: group 0 = (0.993, 0.000): max 0.993, sum 0.993; group 1 = (0.953, 0.948): max 0.953, sum 1.90
    logits_TE = torch.tensor([[5.0, -9.0, 3.0, 2.9]], device=device)
    by_max, _ = router_topk(logits_TE, 1, scoring="sigmoid", num_groups=2, num_topk_groups=1, group_score="max")
    by_sum, _ = router_topk(logits_TE, 1, scoring="sigmoid", num_groups=2, num_topk_groups=1)
    assert by_max.tolist() == [[0]] and by_sum.tolist() == [[2]], (by_max, by_sum)
