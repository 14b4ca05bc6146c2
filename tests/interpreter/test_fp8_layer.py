"""FP8 end to end in one process: MegaMoE with FP8 dispatch and Triton FP8 experts (fp8 pool + per-128 row
scales in, fp8 weights with 128x128 block scales) at tiny shapes that keep every FP8 group whole
(D = F = 128). Under the interpreter on CPU; on the GPU when there is one.

Two bounds, both calc_diff:
- vs the torch twin of the same FP8 recipe (``grouped_mlp_ref`` over the same quantized pool and weights):
  ``TWIN_LIMIT`` = 1e-4. Only accumulation order and the odd e4m3 flip of h differ (measured ~8e-6);
  a wrong scale, expert or row lands orders of magnitude above.
- vs the exact reference (``reference_moe``, unquantized weights): ``CALC_DIFF_TOLERANCES[fp8]`` = 4e-3. FP8
  experts round four times on the way (x, gate_up, h, down), each ~5e-4 of calc_diff: measured 2.0-2.15e-3 at
  every seed here, against 0.6-0.8e-3 for FP8 dispatch alone.
"""

import warnings

import pytest
import torch

from moe_ref.core.config import MoEConfig
from moe_ref.experts import ExpertLayout, TritonExperts
from moe_ref.kernels.experts.fp8 import quantize_fp8_per_128
from moe_ref.kernels.experts.grouped_mlp import grouped_mlp_ref
from moe_ref.layer import MegaMoE
from moe_ref.ep.options import EPOptions
from moe_ref.reference import reference_moe, routed_experts_reference
from moe_ref.ep.routed_step import make_modular_step
from moe_ref.testing import CALC_DIFF_TOLERANCES, calc_diff
from moe_ref.core.weights import MoEWeights

pytestmark = pytest.mark.interpreter

FP8 = torch.float8_e4m3fn
CFG = MoEConfig(num_experts=8, num_topk=2, hidden_size=128, intermediate_size=128, name="fp8-tiny")
TWIN_LIMIT = 1e-4
FP8_EXPERTS_LIMIT = CALC_DIFF_TOLERANCES[torch.float8_e4m3fn]


def _twin_forward(experts: TritonExperts):
    """``experts.forward`` on the torch twin of the kernel, same quantized weights and inputs."""
    def forward(x_PDx, layout, x_scale_PDb=None):
        assert x_PDx.dtype == FP8, "the dispatcher must hand fp8 experts the fp8 pool"
        weights = experts.fp8_weights
        return grouped_mlp_ref(x_PDx, weights.gate_up_fp8_e2FD, weights.down_fp8_eDF, layout.row_start_e,
                               layout.num_rows_e, experts.activation, x_scale_PDb=x_scale_PDb,
                               gate_up_scale=weights.gate_up_scale_e2FbDb, down_scale=weights.down_scale_eDbFb,
                               gate_up_interleaved=weights.gate_up_interleaved)
    return forward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_fp8_dispatch_and_fp8_triton_experts(dtype, device, monkeypatch):
    layer = MegaMoE(CFG, num_max_tokens_per_rank=32, experts_backend="triton", dispatch_fp8=True, dtype=dtype,
                    device=device, seed=3)
    assert layer.fp8_experts and layer.experts.accepts_fp8_input
    assert layer.options.alignment == layer.routed_step.plan.alignment == TritonExperts.segment_alignment == 1
    x = torch.randn(30, CFG.hidden_size, generator=torch.Generator().manual_seed(4)).to(dtype=dtype, device=device)
    with torch.inference_mode():
        y = layer(x)
        assert layer(x[:0]).shape == (0, CFG.hidden_size)
        monkeypatch.setattr(layer.experts, "forward", _twin_forward(layer.experts))
        y_twin = layer(x)
        ref = reference_moe(x, MoEWeights.random(CFG, seed=3, dtype=dtype, device=device), CFG)
    layer.destroy()
    assert y.dtype == dtype and y.shape == x.shape
    case = dict(dtype=dtype, vs_twin=calc_diff(y, y_twin), vs_exact=calc_diff(y, ref))
    assert case["vs_twin"] <= TWIN_LIMIT, case
    assert case["vs_exact"] <= FP8_EXPERTS_LIMIT, case
    assert case["vs_exact"] > CALC_DIFF_TOLERANCES[torch.float32], f"not fp8 at all? {case}"


def test_dispatcher_fp8_pool_into_fp8_experts_with_empty_experts_masked_slots_and_chunks(device):
    """The modular routed step + TritonExperts(fp8=True) directly: two hot experts (the other six empty), masked slots, and
    a chunked run (cap 8 over 20 tokens) against an unchunked one."""
    weights = MoEWeights.random(CFG, seed=5, device=device)
    experts = TritonExperts(weights.gate_up_weight_E2FD, weights.down_weight_EDF, fp8=True)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(20, CFG.hidden_size, generator=gen).to(device)
    ids = torch.tensor([[5, 1]] * 20, device=device)
    ids[::3, 1] = -1
    w = torch.rand(20, 2, generator=gen).to(device)
    outputs = {}
    for cap, overflow in ((20, "error"), (8, "chunk")):
        options = EPOptions.resolve(num_max_tokens_per_rank=cap, overflow=overflow, dispatch_fp8=True, alignment=1,
                                    device=device)
        with make_modular_step(CFG, None, experts, options) as step:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the chunking warning (tests/unit/test_overflow.py checks it)
                outputs[cap] = step(x, ids, w)
    ref = routed_experts_reference(x, ids, w, weights.gate_up_weight_E2FD, weights.down_weight_EDF, CFG.activation)
    case = dict(vs_exact=calc_diff(outputs[20], ref), chunked_vs_not=calc_diff(outputs[8], outputs[20]))
    assert case["vs_exact"] <= FP8_EXPERTS_LIMIT, case
    assert case["chunked_vs_not"] <= TWIN_LIMIT, case


def test_fp8_experts_quantize_activation_rows_themselves(device):
    """Given bf16 rows (outside the dispatcher), the fp8 backend quantizes them per 128 columns itself:
    the same result as handing it the quantized rows, in the rows' dtype."""
    weights = MoEWeights.random(CFG, seed=8, dtype=torch.bfloat16, device=device)
    experts = TritonExperts(weights.gate_up_weight_E2FD, weights.down_weight_EDF, fp8=True)
    layout = ExpertLayout.from_counts(torch.tensor([3, 0, 0, 0, 0, 0, 0, 17], device=device), 1)
    x = torch.randn(20, CFG.hidden_size, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16).to(device)
    y = experts(x, layout)
    x_fp8, x_scale = quantize_fp8_per_128(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, experts(x_fp8, layout, x_scale))
