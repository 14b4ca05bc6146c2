"""routing_check (Triton) vs routing_check_ref (torch) and the expected flag, at the edge cases of each check."""

import pytest
import torch

from moe_ref.kernels.router.routing_check import routing_check, routing_check_ref

pytestmark = pytest.mark.interpreter

NUM_EXPERTS = 16


def _good(num_tokens, num_topk, seed=0, ids_dtype=torch.int64, weights_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:num_topk] for _ in range(num_tokens)]) \
        if num_tokens else torch.empty(0, num_topk, dtype=torch.int64)
    ids[torch.rand(ids.shape, generator=gen) < 0.3] = -1  # masked slots, repeated -1 in a token is fine
    return ids.to(ids_dtype), torch.rand(num_tokens, num_topk, generator=gen).to(weights_dtype)


def _spoil(kind, ids, weights):
    ids, weights = ids.clone(), weights.clone()
    t = ids.shape[0] - 1  # the last token: the kernel's last, partly masked block
    if kind == "nan":
        weights[t, -1] = float("nan")
    elif kind == "inf":
        weights[t, 0] = -float("inf")
    elif kind == "id_eq_E":
        ids[t, 0] = NUM_EXPERTS
    elif kind == "id_minus_2":
        ids[t, -1] = -2
    elif kind == "duplicate":
        ids[t, 0], ids[t, -1] = 3, 3
    return ids, weights


@pytest.mark.parametrize("num_tokens,num_topk", [(0, 8), (1, 1), (1, 8), (65, 8), (130, 6), (64, 3)])
@pytest.mark.parametrize("kind", ["fine", "nan", "inf", "id_eq_E", "id_minus_2", "duplicate"])
def test_routing_check_matches_twin_and_expectation(num_tokens, num_topk, kind, device):
    ids, weights = _good(num_tokens, num_topk)
    if num_tokens and not (kind == "duplicate" and num_topk < 2):
        ids, weights = _spoil(kind, ids, weights)
        expected = int(kind != "fine")
    else:
        expected = 0
    ids, weights = ids.to(device), weights.to(device)
    got, twin = routing_check(ids, weights, NUM_EXPERTS), routing_check_ref(ids, weights, NUM_EXPERTS)
    assert got.dtype == twin.dtype == torch.int32 and got.shape == twin.shape == (1,)
    assert int(got) == int(twin) == expected


def test_routing_check_dtypes_and_strides(device):
    ids, weights = _good(70, 8, seed=1, ids_dtype=torch.int32, weights_dtype=torch.bfloat16)
    ids, weights = ids.to(device), weights.to(device)
    assert int(routing_check(ids, weights, NUM_EXPERTS)) == 0
    wide = torch.full((70, 16), 5, dtype=torch.int32, device=device)  # a strided view: padding columns repeat id 5
    wide[:, :8] = ids
    assert int(routing_check(wide[:, :8], weights, NUM_EXPERTS)) == 0
    ids[69, 2], ids[69, 5] = 7, 7
    wide[:, :8] = ids
    assert int(routing_check(wide[:, :8], weights, NUM_EXPERTS)) == int(routing_check_ref(ids, weights, NUM_EXPERTS)) == 1


@pytest.mark.parametrize("kind", ["fine", "nan"])
def test_routing_check_raises_a_given_flag(kind, device):
    ids, weights = _good(9, 4)
    if kind == "nan":
        ids, weights = _spoil(kind, ids, weights)
    ids, weights = ids.to(device), weights.to(device)
    for check in (routing_check, routing_check_ref):
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        assert check(ids, weights, NUM_EXPERTS, flag=flag) is flag
        assert int(flag) == int(kind == "nan"), check.__name__
