"""The Triton kernels vs their torch twins on a CUDA GPU at realistic shapes (bf16 and FP8).

Run: `python -m pytest -q -m cuda tests/gpu` on a GPU machine. Skipped without CUDA. The kernel modules
are imported inside the tests, after the skip, so this module never decorates kernels for a GPU
on a machine that runs the interpreter tier.
"""

import pytest
import torch

from moe_ref.experts import ExpertLayout
from moe_ref.testing import calc_diff

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FP8 = torch.float8_e4m3fn
ALIGN = 128
# calc_diff (1 - cosine similarity, DeepGEMM's metric) limits per dtype, kernel vs twin
DIFF_LIMIT = {torch.bfloat16: 1e-4, torch.float16: 1e-5, "fp8": 1e-3}


def _layout(counts, device="cuda"):
    """(row_start_e int64, num_rows_e int32, pool rows): segments packed by ``ExpertLayout.from_counts``."""
    layout = ExpertLayout.from_counts(torch.tensor(counts, dtype=torch.int64), ALIGN)
    return (layout.row_start_e.to(device), layout.num_rows_e.to(device=device, dtype=torch.int32),
            max(layout.num_pool_rows, ALIGN))


# name -> (rows per expert, hidden D, intermediate F)
MLP_CASES = {
    "kimi_k2_decode": ([1, 0, 3, 2, 1, 0, 1, 8], 7168, 2048),
    "kimi_k2_prefill": ([700, 0, 128, 1000, 5, 257, 640, 383], 7168, 2048),
    "step3_mixed": ([64, 300, 0, 129], 7168, 5120),
    "k3_latent_situ": ([33, 200, 1, 0], 3584, 3072),
    "odd_dims": ([17, 0, 130], 1000, 520),
}


def _mlp_inputs(name, dtype, seed=0):
    counts, hidden, inter = MLP_CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    row_start_e, num_rows_e, num_rows = _layout(counts)
    num_experts = len(counts)
    x_PDx = torch.randn(num_rows, hidden, device="cuda", generator=gen)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter, device="cuda", generator=gen) / inter**0.5
    return x_PDx, gate_up, down, row_start_e, num_rows_e, sum(counts)


def _padding_is_zero(y_PDx, row_start_e, num_rows_e) -> bool:
    valid = torch.zeros(y_PDx.shape[0], dtype=torch.bool, device=y_PDx.device)
    for start, count in zip(row_start_e.tolist(), num_rows_e.tolist()):
        valid[start:start + count] = True
    return bool((y_PDx[~valid] == 0).all())


# slow: the prefill, step3 and odd shapes, 7-10 s each on an H200 (make test-gpu run of 2026-12-01 with --durations):
# each new (rows, N, K, dtype) autotunes the grouped GEMM over its tile list; decode and the situ shape stay
SLOW_HALF_CASES = ("kimi_k2_prefill", "step3_mixed", "odd_dims")


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW_HALF_CASES else name
                                  for name in MLP_CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_mlp_half(name, dtype):
    from moe_ref.kernels.experts.grouped_mlp import grouped_mlp, grouped_mlp_ref

    x_PDx, gate_up, down, row_start_e, num_rows_e, total = _mlp_inputs(name, dtype)
    args = (x_PDx.to(dtype), gate_up.to(dtype), down.to(dtype), row_start_e, num_rows_e)
    activation = "situ" if "situ" in name else "silu"
    y_ref = grouped_mlp_ref(*args, activation=activation)
    for hint in (None, total):  # both the R-keyed and the hinted tile regimes
        y_PDx = grouped_mlp(*args, activation=activation, num_rows_hint=hint)
        diff = calc_diff(y_PDx, y_ref)
        assert diff < DIFF_LIMIT[dtype], f"{name=} {dtype=} {hint=} {diff=:.2e}"
        assert _padding_is_zero(y_PDx, row_start_e, num_rows_e), f"{name=} {dtype=} {hint=}"


# slow: every shape but decode, 11-28 s each on an H200 (2026-12-01, `make test-gpu-full --durations`):
# each new (rows, N, K) autotunes the FP8 kernel over its tile list, one Triton compile per tile
SLOW_FP8_CASES = ("kimi_k2_prefill", "step3_mixed", "k3_latent_situ", "odd_dims")


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW_FP8_CASES else name
                                  for name in MLP_CASES])
def test_grouped_mlp_fp8(name):
    from moe_ref.kernels.experts.grouped_mlp import grouped_mlp, grouped_mlp_ref
    from moe_ref.kernels.ep.pre_dispatch import quantize_fp8_per_128

    x_PDx, gate_up, down, row_start_e, num_rows_e, total = _mlp_inputs(name, torch.float32, seed=1)
    x_fp8, x_scale = quantize_fp8_per_128(x_PDx)
    from moe_ref.kernels.experts.fp8 import quantize_fp8_per_block_128

    gate_up_fp8, gate_up_scale = quantize_fp8_per_block_128(gate_up)
    down_fp8, down_scale = quantize_fp8_per_block_128(down)
    activation = "situ" if "situ" in name else "silu"
    args = (x_fp8, gate_up_fp8, down_fp8, row_start_e, num_rows_e, activation)
    kwargs = dict(x_scale_PDb=x_scale, gate_up_scale=gate_up_scale, down_scale=down_scale)
    y_ref = grouped_mlp_ref(*args, **kwargs)
    y_PDx = grouped_mlp(*args, **kwargs, num_rows_hint=total)
    assert y_PDx.dtype == torch.bfloat16
    diff = calc_diff(y_PDx, y_ref)
    assert diff < DIFF_LIMIT["fp8"], f"{name=} {diff=:.2e}"
    assert _padding_is_zero(y_PDx, row_start_e, num_rows_e), f"{name=}"
    y_exact = grouped_mlp_ref(x_PDx, gate_up, down, row_start_e, num_rows_e, activation)
    assert calc_diff(y_PDx, y_exact) < 5e-3, f"{name=}: fp8 error vs the unquantized MLP too large"
    if gate_up.shape[1] % 256 == 0:  # F % 128 == 0: the same weights interleaved in 128-row gate and up blocks
        from moe_ref.kernels.experts.grouped_mlp import interleave_gate_up

        interleaved = dict(kwargs, gate_up_scale=interleave_gate_up(gate_up_scale, rows_per_block=1))
        y_interleaved = grouped_mlp(x_fp8, interleave_gate_up(gate_up_fp8), *args[2:], **interleaved,
                                    num_rows_hint=total, gate_up_interleaved=True)
        assert calc_diff(y_interleaved, y_ref) < DIFF_LIMIT["fp8"], f"{name=}: interleaved"
        assert calc_diff(y_interleaved, y_PDx) < 1e-6, f"{name=}: interleaved vs stacked rows"
        assert _padding_is_zero(y_interleaved, row_start_e, num_rows_e), f"{name=}: interleaved"


@pytest.mark.parametrize("num_experts,num_topk,kwargs", [
    (384, 8, dict(bias=True, routed_scaling_factor=2.827)),                    # Kimi-K2
    (896, 16, dict(bias=True)),                                                 # Kimi-K3
    (256, 8, dict(bias=True, num_groups=8, num_topk_groups=4, routed_scaling_factor=2.5)),  # DeepSeek-V3
    (48, 3, dict(scoring="softmax", renormalize=False)),                        # Step3
])
def test_router_topk(num_experts, num_topk, kwargs):
    from moe_ref.kernels.router.router_topk import router_topk, router_topk_ref

    torch.manual_seed(0)
    kwargs = dict(kwargs)
    logits_TE = torch.randn(4096, num_experts, device="cuda")
    if kwargs.pop("bias", False):
        kwargs["bias_E"] = torch.randn(num_experts, device="cuda") * 0.1
    ids, weights = router_topk(logits_TE, num_topk, **kwargs)
    ids_ref, weights_ref = router_topk_ref(logits_TE, num_topk, **kwargs)
    # sigmoid/exp may differ by an ulp between Triton and torch: allow rare near-tie swaps
    mismatch = (ids != ids_ref).any(dim=1).float().mean().item()
    assert mismatch < 1e-3, f"{num_experts=} {num_topk=} {mismatch=}"
    same = (ids == ids_ref).all(dim=1)
    torch.testing.assert_close(weights[same], weights_ref[same], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("num_tokens", [1, 16, 64, 100, 4096])
@pytest.mark.parametrize("num_experts", [384, 256])  # Kimi-K2, DeepSeek-V3
def test_router_logits(num_tokens, num_experts):
    """The gate GEMM (cuBLAS on the bf16 operands, fp32 sums and output) at a real router's shape (D 7168): exact
    where fp32 holds every sum (small integers), within D * eps * sum|x w| of the fp32 twin on random values, and the
    same top-k as the twin's logits but for near ties."""
    from moe_ref.kernels.router.router_logits import router_logits, router_logits_ref
    from moe_ref.kernels.router.router_topk import router_topk

    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    hidden = 7168
    ints = [torch.randint(-8, 9, shape, device="cuda", generator=gen).bfloat16()
            for shape in ((num_tokens, hidden), (num_experts, hidden))]
    assert torch.equal(router_logits(*ints), router_logits_ref(*ints))
    x = torch.randn(num_tokens, hidden, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(num_experts, hidden, device="cuda", generator=gen) / hidden ** 0.5).bfloat16()
    got, want = router_logits(x, w), router_logits_ref(x, w)
    bound = hidden * torch.finfo(torch.float32).eps * (x.float().abs() @ w.float().abs().t())
    assert ((got - want).abs() <= bound).all()
    ids, _ = router_topk(got, 8, "sigmoid")
    ids_ref, _ = router_topk(want, 8, "sigmoid")
    assert (ids != ids_ref).any(dim=1).float().mean().item() < 1e-2


@pytest.mark.parametrize("buf_dtype", [torch.bfloat16, FP8])
def test_pre_dispatch(buf_dtype):
    from moe_ref.kernels.ep.pre_dispatch import pre_dispatch, pre_dispatch_ref

    num_tokens, capacity, hidden, num_topk, num_experts = 3000, 4096, 7168, 8, 384
    x_TD = torch.randn(num_tokens, hidden, device="cuda").bfloat16()
    ids_TK = torch.randint(0, num_experts, (num_tokens, num_topk), device="cuda")
    ids_TK[torch.rand(num_tokens, num_topk, device="cuda") < 0.1] = -1
    w_TK = torch.rand(num_tokens, num_topk, device="cuda")
    results = []
    for fn in (pre_dispatch, pre_dispatch_ref):
        bufs = dict(
            buf_x_CD=torch.zeros(capacity, hidden, dtype=buf_dtype, device="cuda"),
            buf_x_scale_CDb=torch.zeros(capacity, hidden // 128, device="cuda"),
            buf_topk_ids_CK=torch.zeros(capacity, num_topk, dtype=torch.int64, device="cuda"),
            buf_topk_weights_CK=torch.zeros(capacity, num_topk, device="cuda"),
            num_rows_per_expert_E=torch.zeros(num_experts, dtype=torch.int32, device="cuda"),
        )
        fn(x_TD, ids_TK, w_TK, **bufs)
        results.append(bufs)
    for name in results[0]:
        a, b = results[0][name], results[1][name]
        if a.dtype == FP8:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b), f"{name} differs ({buf_dtype=}); mismatches={(a != b).sum().item()}"


@pytest.mark.parametrize("num_rows,dim", [(64, 7168), (4099, 7168), (33, 200)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_rows_fp8(num_rows, dim, dtype):
    """The FP8 experts' row quantizer against its torch twin: the same bits."""
    from moe_ref.kernels.experts.quantize_rows import quantize_rows_fp8, quantize_rows_fp8_ref

    x_PDx = (torch.randn(num_rows, dim, device="cuda") * 3).to(dtype)
    x_PDx[0] = 0.0  # the 1e-4 amax floor
    got, got_scale = quantize_rows_fp8(x_PDx)
    want, want_scale = quantize_rows_fp8_ref(x_PDx)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)) and torch.equal(got_scale, want_scale)
