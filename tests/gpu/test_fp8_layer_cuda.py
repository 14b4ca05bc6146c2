"""MegaMoE on one GPU at Kimi-K2 expert shapes (hidden 7168, expert intermediate 2048; 8 experts, top-4 to
keep the weights small): the Triton experts backend (named: where DeepGEMM is installed, the default is "auto") in bf16, and with ``dispatch_fp8`` (FP8 pool +
Triton FP8 experts), against the bf16 single-process reference by calc_diff, at a decode and a prefill
batch. Also checks the lean pool: the experts get exactly the routed rows (triton's alignment is 1).

Run: `python -m pytest -q -m cuda tests/gpu/test_fp8_layer_cuda.py` on a GPU machine. Skipped without CUDA.

Limits: bf16 ``CALC_DIFF_TOLERANCES[bf16]`` (1e-4); FP8 experts 4e-3 (x, gate_up, h and down each rounded to
e4m3: ~2e-3 measured on CPU; tests/gpu/test_deep_gemm.py's limit for the same fp8 MLP recipe).
"""
import pytest
import torch

from moe_ref.core.config import MoEConfig
from moe_ref.reference import reference_moe
from moe_ref.testing import CALC_DIFF_TOLERANCES, calc_diff
from moe_ref.core.weights import MoEWeights

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CFG = MoEConfig(num_experts=8, num_topk=4, hidden_size=7168, intermediate_size=2048, name="kimi-k2-shapes-8-experts")
FP8_EXPERTS_LIMIT = CALC_DIFF_TOLERANCES[torch.float8_e4m3fn]


@pytest.fixture(scope="module")
def weights():
    return MoEWeights.random(CFG, seed=0, dtype=torch.bfloat16, device="cuda")


@pytest.mark.parametrize("num_tokens", [16, 512], ids=["decode", "prefill"])
@pytest.mark.parametrize("dispatch_fp8", [False, True], ids=["bf16", "fp8"])
def test_layer_matches_bf16_reference(weights, num_tokens, dispatch_fp8, monkeypatch):
    from moe_ref.experts import TritonExperts
    from moe_ref.layer import MegaMoE
    from moe_ref.layer.runtime import warm_up_counts

    layer = MegaMoE(CFG, num_max_tokens_per_rank=512, dispatch_fp8=dispatch_fp8, experts_backend="triton",
                    dtype=torch.bfloat16, device="cuda").load_weights(weights)
    experts = layer.experts
    assert isinstance(experts, TritonExperts) and experts.fp8 == dispatch_fp8 == experts.accepts_fp8_input
    assert layer.routed_step.plan.alignment == TritonExperts.segment_alignment == 1
    pool_rows, hints = [], []
    forward = experts.forward
    plan_pool_rows = layer.routed_step.plan.num_pool_rows

    def recording_forward(x_PDx, layout, x_scale_PDb=None):
        pool_rows.append(x_PDx.shape[0])
        hints.append((layout.num_rows_hint, layout.zero_unused_rows))
        assert x_PDx.dtype == (torch.float8_e4m3fn if dispatch_fp8 else torch.bfloat16)
        return forward(x_PDx, layout, x_scale_PDb)

    monkeypatch.setattr(experts, "forward", recording_forward)
    x = torch.randn(num_tokens, CFG.hidden_size, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    x = x.bfloat16()
    with torch.inference_mode():
        y = layer(x)
        ref = reference_moe(x, weights, CFG)
    layer.destroy()
    diff = calc_diff(y, ref)
    limit = FP8_EXPERTS_LIMIT if dispatch_fp8 else CALC_DIFF_TOLERANCES[torch.bfloat16]
    case = dict(num_tokens=num_tokens, dispatch_fp8=dispatch_fp8, diff=diff, limit=limit, pool_rows=pool_rows)
    print(f"MegaMoE on CUDA: {case}")
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all(), case
    assert diff <= limit, case
    # the device-side dispatch hands the whole pool (its used end stays on the device: no host sync), with the rows
    # this rank sent as the tile hint, and lets the experts leave rows past the segments unwritten. The calls before
    # the last are the first call's warm-up (runtime.warm_up, where tiles are recorded for this GPU): the same pool.
    assert set(pool_rows) == {plan_pool_rows}, case
    assert hints[-1] == (num_tokens * CFG.num_topk, False), case
    warm_up_hints = [(t * CFG.num_topk, False) for t in warm_up_counts(512)]
    assert hints[:-1] in ([], warm_up_hints), case
