"""pre_dispatch (Triton) vs pre_dispatch_ref (torch): copies, fp8 per-128 quantization, per-expert counts."""

import pytest
import torch

from moe_ref.kernels.ep.pre_dispatch import (
    dequantize_fp8_per_128,
    pre_dispatch,
    pre_dispatch_ref,
    quantize_fp8_per_128,
)

pytestmark = pytest.mark.interpreter

FP8 = torch.float8_e4m3fn


def _inputs(num_tokens, hidden, num_topk, num_experts, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x_TD = (torch.randn(num_tokens, hidden, generator=gen) * 3).to(dtype)
    if num_tokens:
        x_TD[0, :] = 0.0  # an all-zero row: scale floors at 1e-4 / 448
        x_TD[-1, 5] = 1000.0  # one outlier column group
    if num_tokens > 2:  # tiny negatives next to a large value: e4m3 subnormals and -0.0 after scaling
        x_TD[1, :] = -torch.linspace(1e-6, 1e-2, hidden).to(dtype)
        x_TD[1, ::128] = 50.0
    ids_TK = torch.randint(0, num_experts, (num_tokens, num_topk), generator=gen)
    ids_TK[torch.rand(num_tokens, num_topk, generator=gen) < 0.25] = -1
    w_TK = torch.rand(num_tokens, num_topk, generator=gen)
    return x_TD.to(device), ids_TK.to(device), w_TK.to(device)


def _buffers(capacity, hidden, num_topk, num_experts, buf_dtype, device):
    return dict(
        buf_x_CD=torch.zeros(capacity, hidden, dtype=buf_dtype, device=device),
        buf_x_scale_CDb=torch.full((capacity, -(-hidden // 128)), -1.0, device=device),
        buf_topk_ids_CK=torch.full((capacity, num_topk), -7, dtype=torch.int64, device=device),
        buf_topk_weights_CK=torch.full((capacity, num_topk), -7.0, device=device),
        num_rows_per_expert_E=torch.zeros(num_experts, dtype=torch.int32, device=device),
    )


def _assert_same_buffers(got, ref, **case):
    for name in got:
        a, b = got[name], ref[name]
        if a.dtype == FP8:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b), f"{name} differs: {case=}"


@pytest.mark.parametrize("x_dtype,buf_dtype,hidden", [
    (torch.float32, torch.float32, 40),
    (torch.float16, torch.float16, 130),
    (torch.bfloat16, torch.bfloat16, 64),
    (torch.float32, FP8, 200),      # D not a multiple of 128: a partial last scale group
    (torch.bfloat16, FP8, 256),
    (torch.float16, FP8, 48),
])
def test_matches_twin_bitwise(x_dtype, buf_dtype, hidden, device):
    num_tokens, capacity, num_topk, num_experts = 6, 8, 3, 5
    x_TD, ids_TK, w_TK = _inputs(num_tokens, hidden, num_topk, num_experts, x_dtype, device)
    got = _buffers(capacity, hidden, num_topk, num_experts, buf_dtype, device)
    ref = _buffers(capacity, hidden, num_topk, num_experts, buf_dtype, device)
    pre_dispatch(x_TD, ids_TK, w_TK, **got)
    pre_dispatch_ref(x_TD, ids_TK, w_TK, **ref)
    _assert_same_buffers(got, ref, x_dtype=x_dtype, buf_dtype=buf_dtype, hidden=hidden)
    expected_counts = torch.bincount(ids_TK[ids_TK >= 0].cpu(), minlength=num_experts).int()
    assert torch.equal(got["num_rows_per_expert_E"].cpu(), expected_counts), f"{x_dtype=} {buf_dtype=}"
    assert (got["buf_topk_ids_CK"][num_tokens:] == -7).all(), "rows past T must stay untouched"


def test_masked_slots_not_counted_and_counts_accumulate(device):
    x_TD = torch.randn(3, 16, device=device)
    ids_TK = torch.tensor([[3, -1], [3, 0], [-1, -1]], device=device)
    bufs = _buffers(4, 16, 2, 4, torch.float32, device)
    pre_dispatch(x_TD, ids_TK, torch.rand(3, 2, device=device), **bufs)
    assert bufs["num_rows_per_expert_E"].tolist() == [1, 0, 0, 2]
    pre_dispatch(x_TD, ids_TK, torch.rand(3, 2, device=device), **bufs)  # caller zeroes; a 2nd chunk adds
    assert bufs["num_rows_per_expert_E"].tolist() == [2, 0, 0, 4]


def test_zero_tokens_writes_nothing(device):
    x_TD, ids_TK, w_TK = _inputs(0, 32, 2, 4, torch.float32, device)
    bufs = _buffers(4, 32, 2, 4, FP8, device)
    pre_dispatch(x_TD, ids_TK, w_TK, **bufs)
    assert (bufs["buf_topk_ids_CK"] == -7).all() and (bufs["num_rows_per_expert_E"] == 0).all()


def test_more_tokens_than_capacity_raises(device):
    x_TD, ids_TK, w_TK = _inputs(5, 32, 2, 4, torch.float32, device)
    with pytest.raises(ValueError, match="capacity=4"):
        pre_dispatch(x_TD, ids_TK, w_TK, **_buffers(4, 32, 2, 4, torch.float32, device))


def test_fp8_buffer_without_scales_raises(device):
    x_TD, ids_TK, w_TK = _inputs(2, 32, 2, 4, torch.float32, device)
    bufs = _buffers(4, 32, 2, 4, FP8, device)
    bufs["buf_x_scale_CDb"] = None
    with pytest.raises(ValueError, match="buf_x_scale_CDb"):
        pre_dispatch(x_TD, ids_TK, w_TK, **bufs)


def test_quantize_roundtrip_within_e4m3_step():
    x_TD = torch.randn(5, 300) * torch.logspace(-3, 3, 5)[:, None]
    x_fp8, scale = quantize_fp8_per_128(x_TD)
    assert x_fp8.dtype == FP8 and scale.shape == (5, 3) and scale.dtype == torch.float32
    back = dequantize_fp8_per_128(x_fp8, scale, torch.float32)
    group_amax = scale.repeat_interleave(128, dim=1)[:, :300] * 448
    assert ((back - x_TD).abs() <= group_amax * 2**-4).all()
    assert x_fp8.float().abs().max() <= 448
