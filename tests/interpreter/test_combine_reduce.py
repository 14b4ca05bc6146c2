"""combine_reduce (Triton) vs combine_reduce_ref (torch): fixed slot order, masked slots never read."""

import pytest
import torch

from moe_ref.kernels.combine_reduce import combine_reduce, combine_reduce_ref

pytestmark = pytest.mark.interpreter


def _inputs(num_tokens, capacity, num_topk, hidden, dtype, device, masked_fraction=0.3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    combine_KCD = torch.randn(num_topk, capacity, hidden, generator=gen).to(dtype)
    topk_ids_TK = torch.randint(0, 16, (num_tokens, num_topk), generator=gen)
    masked_TK = torch.rand(num_tokens, num_topk, generator=gen) < masked_fraction
    topk_ids_TK[masked_TK] = -1
    combine_KCD[:, :num_tokens][masked_TK.T] = float("nan")  # garbage in masked slots
    combine_KCD[:, num_tokens:] = float("nan")  # rows past T are never read either
    topk_weights_TK = torch.rand(num_tokens, num_topk, generator=gen)
    return combine_KCD.to(device), topk_ids_TK.to(device), topk_weights_TK.to(device)


@pytest.mark.parametrize("with_shared", [False, True])
def test_fp32_bitwise_with_nan_in_masked_slots(with_shared, device):
    combine_KCD, ids_TK, w_TK = _inputs(7, 9, 4, 70, torch.float32, device)
    shared_TD = torch.randn(7, 70, device=device) if with_shared else None
    y = combine_reduce(combine_KCD, ids_TK, w_TK, shared_TD)
    y_ref = combine_reduce_ref(combine_KCD, ids_TK, w_TK, shared_TD)
    assert not y.isnan().any(), f"{with_shared=}"
    assert torch.equal(y, y_ref), f"{with_shared=} max_err={(y - y_ref).abs().max().item()}"


@pytest.mark.parametrize("dtype,out_dtype", [(torch.bfloat16, None), (torch.float16, None),
                                             (torch.bfloat16, torch.float32)])
def test_half_inputs_and_out_dtype(dtype, out_dtype, device, assert_close):
    combine_KCD, ids_TK, w_TK = _inputs(5, 5, 3, 33, dtype, device, seed=1)
    shared_TD = torch.randn(5, 33, device=device).to(dtype)
    y = combine_reduce(combine_KCD, ids_TK, w_TK, shared_TD, out_dtype=out_dtype)
    y_ref = combine_reduce_ref(combine_KCD, ids_TK, w_TK, shared_TD, out_dtype=out_dtype)
    assert_close(y, y_ref, out_dtype or dtype, dtype=dtype, out_dtype=out_dtype)


def test_all_slots_masked_gives_shared_only(device):
    combine_KCD = torch.full((2, 3, 8), float("nan"), device=device)
    ids_TK = torch.full((3, 2), -1, device=device)
    shared_TD = torch.randn(3, 8, device=device)
    y = combine_reduce(combine_KCD, ids_TK, torch.ones(3, 2, device=device), shared_TD)
    assert torch.equal(y, shared_TD)
    y = combine_reduce(combine_KCD, ids_TK, torch.ones(3, 2, device=device))
    assert torch.equal(y, torch.zeros_like(y))


def test_zero_tokens(device):
    y = combine_reduce(torch.zeros(2, 4, 8, device=device), torch.zeros(0, 2, dtype=torch.int64, device=device),
                       torch.zeros(0, 2, device=device))
    assert y.shape == (0, 8) and y.dtype == torch.float32


def test_worked_example(device):
    combine_KCD = torch.tensor([[[2.0, 4.0]], [[float("nan"), float("nan")]]], device=device)
    y = combine_reduce(combine_KCD, torch.tensor([[5, -1]], device=device), torch.tensor([[0.5, 0.25]], device=device),
                       torch.ones(1, 2, device=device))
    assert y.tolist() == [[2.0, 3.0]]


def test_more_tokens_than_capacity_raises(device):
    with pytest.raises(ValueError, match="capacity"):
        combine_reduce(torch.zeros(2, 3, 8, device=device), torch.zeros(4, 2, dtype=torch.int64, device=device),
                       torch.zeros(4, 2, device=device))
