"""FP8 experts and the lean pool, without running Triton kernels: the weight quantizer, which backends take
fp8 weights or fp8 rows, what the dispatcher hands the experts (format and pool prefix), and the pool
alignment each backend asks for. The kernels themselves run in tests/interpreter/test_fp8_layer.py."""
import pytest
import torch

from moe_ref.core.config import preset
from moe_ref.core.errors import DTypeError, InvalidConfigError
from moe_ref.experts import (ExpertLayout, Experts, GroupedMMExperts, TorchLoopExperts, TritonExperts, experts_class,
                             make_experts)
from moe_ref.kernels.experts.fp8 import (dequantize_fp8_per_128, dequantize_fp8_per_block_128, quantize_fp8_per_128,
                                 quantize_fp8_per_block_128)
from moe_ref.kernels.experts.grouped_mlp import deinterleave_gate_up
from moe_ref.layer import MegaMoE
from moe_ref.ep.options import EPOptions
from moe_ref.reference import routed_experts_reference
from moe_ref.ep.routed_step import make_modular_step
from moe_ref.testing import assert_close
from moe_ref.core.weights import MoEWeights

pytestmark = pytest.mark.unit

FP8 = torch.float8_e4m3fn


# --- the weight quantizer ----------------------------------------------------------------------------------------

def test_block_quantizer_worked_example():
    w_fp8, scale = quantize_fp8_per_block_128(torch.tensor([[0.5, -2.0]]))
    assert w_fp8.dtype == FP8 and w_fp8.float().tolist() == [[112.0, -448.0]]
    assert scale.shape == (1, 1) and scale.item() == pytest.approx(2.0 / 448)


@pytest.mark.parametrize("shape", [(3, 256, 384), (2, 300, 200), (130, 7)], ids=["whole-blocks", "ragged", "2d"])
def test_block_quantizer_scales_blocks_and_round_trips(shape):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=gen).bfloat16()
    w[..., :5, :3] *= 100  # one loud block: its scale must not leak into the neighbours
    w_fp8, scale = quantize_fp8_per_block_128(w)
    *lead, n, k = shape
    assert w_fp8.shape == w.shape and w_fp8.is_contiguous() and scale.is_contiguous()
    assert scale.shape == (*lead, -(-n // 128), -(-k // 128)) and scale.dtype == torch.float32
    w_flat, s_flat = w.float().reshape(-1, n, k), scale.reshape(-1, *scale.shape[-2:])
    for i in range(w_flat.shape[0]):  # each scale is its block's amax / 448
        for nb in range(s_flat.shape[1]):
            for kb in range(s_flat.shape[2]):
                block = w_flat[i, nb * 128:(nb + 1) * 128, kb * 128:(kb + 1) * 128]
                assert s_flat[i, nb, kb].item() == pytest.approx(block.abs().max().item() / 448, rel=1e-6), (i, nb, kb)
    back = dequantize_fp8_per_block_128(w_fp8, scale)
    block_amax = scale.repeat_interleave(128, -2)[..., :n, :].repeat_interleave(128, -1)[..., :k] * 448
    assert bool(((back - w.float()).abs() <= block_amax / 16).all()), f"{shape=}: beyond e4m3's half step"


# --- which backends take fp8 weights / fp8 rows --------------------------------------------------------------------

def _weights(e=2, hidden=128, inter=128, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(e, 2 * inter, hidden, generator=gen) / hidden ** 0.5,
            torch.randn(e, hidden, inter, generator=gen) / inter ** 0.5)


@pytest.mark.parametrize("backend", ["torch", "grouped_mm"])
def test_fp8_weights_refused_by_backends_without_them(backend):
    with pytest.raises(InvalidConfigError, match=rf"'{backend}' has no fp8 weights.*'triton', 'deep_gemm' or 'auto'"):
        make_experts(backend, *_weights(), fp8=True)


def test_triton_fp8_quantizes_weights_once_and_takes_fp8_rows():
    gate_up, down = _weights(e=3, hidden=256, inter=128)
    experts = make_experts("triton", gate_up, down, fp8=True)
    assert isinstance(experts, TritonExperts) and experts.fp8 and experts.accepts_fp8_input
    weights = experts.fp8_weights
    assert weights.gate_up_fp8_e2FD.dtype == FP8 and weights.gate_up_scale_e2FbDb.shape == (3, 2, 2)
    assert weights.down_fp8_eDF.dtype == FP8 and weights.down_scale_eDbFb.shape == (3, 2, 1)
    # the fp8 gate_up rows and their scale rows are stored interleaved in 128-row blocks (F = 128: one gate block,
    # then one up block per expert), quantized from the stacked rows' 128x128 blocks
    assert weights.gate_up_interleaved
    stacked, stacked_scale = quantize_fp8_per_block_128(gate_up)
    assert torch.equal(deinterleave_gate_up(weights.gate_up_fp8_e2FD).view(torch.uint8), stacked.view(torch.uint8))
    assert torch.equal(deinterleave_gate_up(weights.gate_up_scale_e2FbDb, rows_per_block=1), stacked_scale)
    bf16_experts = make_experts("triton", gate_up, down)
    assert not bf16_experts.fp8 and not bf16_experts.accepts_fp8_input
    assert not TorchLoopExperts(gate_up, down).accepts_fp8_input


def test_fp8_rows_refused_without_fp8_input_and_scales_required():
    gate_up, down = _weights()
    layout = ExpertLayout.from_counts(torch.tensor([2, 1]), 1)
    x_fp8, x_scale = quantize_fp8_per_128(torch.randn(3, 128))
    with pytest.raises(DTypeError, match="'torch'.*dequantize first"):
        TorchLoopExperts(gate_up, down)(x_fp8, layout, x_scale)
    with pytest.raises(DTypeError, match="exactly for fp8 rows"):
        TritonExperts(gate_up, down, fp8=True)(x_fp8, layout)  # scales missing
    with pytest.raises(DTypeError, match="exactly for fp8 rows"):
        TorchLoopExperts(gate_up, down)(torch.randn(3, 128), layout, x_scale)  # scales of nothing


# --- what the dispatcher hands the experts ----------------------------------------------------------------------------

class RecordingExperts(Experts):
    """Records what it is given; computes the torch loop on the (dequantized) rows. ``accepts_fp8_input``
    is set per test class below."""

    name = "recording"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def forward(self, x_PDx, layout, x_scale_PDb=None):
        self.calls.append(dict(x_PDx=x_PDx, x_scale_PDb=x_scale_PDb, layout=layout))
        x_float = x_PDx if x_scale_PDb is None else dequantize_fp8_per_128(x_PDx, x_scale_PDb, torch.float32)
        return TorchLoopExperts.forward(self, x_float, layout)


class RecordingFP8Experts(RecordingExperts):
    accepts_fp8_input = True


def _routing(cfg, num_tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, cfg.expert_hidden_size, generator=gen)
    ids = torch.stack([torch.randperm(cfg.num_experts, generator=gen)[:cfg.num_topk] for _ in range(num_tokens)])
    ids[torch.rand(ids.shape, generator=gen) < 0.2] = -1
    return x, ids, torch.rand(num_tokens, cfg.num_topk, generator=gen)


@pytest.mark.parametrize("experts_cls", [RecordingFP8Experts, RecordingExperts], ids=["accepts-fp8", "activation-dtype"])
def test_fp8_pool_goes_as_is_only_to_backends_that_accept_it(experts_cls):
    cfg = preset("tiny-kimi-k3")
    weights = MoEWeights.random(cfg, seed=6)
    x, ids, w = _routing(cfg, 10, seed=7)
    experts = experts_cls(weights.gate_up_weight_E2FD, weights.down_weight_EDF, cfg.activation, cfg.situ_beta,
                          cfg.situ_linear_beta)
    options = EPOptions.resolve(num_max_tokens_per_rank=10, dispatch_fp8=True, alignment=4)
    with make_modular_step(cfg, None, experts, options) as step:
        y = step(x, ids, w)
        (call,) = experts.calls
        buffer = step.dispatcher.buffer
        pool, pool_scale = buffer.view("recv_x"), buffer.view("recv_x_scale")
        if experts.accepts_fp8_input:  # the pool itself (views of the buffer), not a dequantized copy
            assert call["x_PDx"].dtype == FP8 and call["x_PDx"].data_ptr() == pool.data_ptr()
            assert call["x_scale_PDb"].data_ptr() == pool_scale.data_ptr()
        else:
            assert call["x_PDx"].dtype == torch.float32 and call["x_scale_PDb"] is None
    x_seen = dequantize_fp8_per_128(*quantize_fp8_per_128(x), torch.float32)
    expected = routed_experts_reference(x_seen, ids, w, weights.gate_up_weight_E2FD, weights.down_weight_EDF,
                                        cfg.activation, cfg.situ_beta, cfg.situ_linear_beta)
    assert_close(y, expected, torch.float32, experts=experts_cls.__name__)


@pytest.mark.parametrize("alignment", [1, 4, 128])
@pytest.mark.parametrize("whole_segments", [False, True])
def test_experts_get_only_the_used_prefix_of_the_pool(alignment, whole_segments):
    cfg = preset("tiny-step3")  # E=8, K=3
    weights = MoEWeights.random(cfg, seed=1)
    x, ids, w = _routing(cfg, 12, seed=2)
    experts = RecordingExperts(weights.gate_up_weight_E2FD, weights.down_weight_EDF, cfg.activation)
    experts.computes_whole_segments = whole_segments
    with make_modular_step(cfg, None, experts, EPOptions.resolve(num_max_tokens_per_rank=12, alignment=alignment)) as step:
        y = step(x, ids, w)
        num_pool_rows = step.plan.num_pool_rows
    counts_e = torch.bincount(ids[ids >= 0], minlength=cfg.num_experts)
    used = int(((counts_e + alignment - 1) // alignment * alignment).sum())  # the last segment's aligned end
    (call,) = experts.calls
    case = dict(alignment=alignment, whole_segments=whole_segments, used=used, num_pool_rows=num_pool_rows)
    assert call["x_PDx"].shape == (used, cfg.hidden_size) and call["layout"].num_pool_rows == used, case
    assert used < num_pool_rows, case
    if alignment == 1:
        assert used == int((ids >= 0).sum()), case  # no padding rows at all
    expected = routed_experts_reference(x, ids, w, weights.gate_up_weight_E2FD, weights.down_weight_EDF, cfg.activation)
    assert_close(y, expected, torch.float32, **case)


# --- the layer: alignment and fp8 experts follow the backend -------------------------------------------------------

@pytest.mark.parametrize("backend, alignment", [("auto", 128), ("torch", 128), ("grouped_mm", 16), ("triton", 1)])
def test_layer_pool_alignment_follows_the_backend(backend, alignment):
    cfg = preset("tiny-kimi-k2")
    layer = MegaMoE(cfg, num_max_tokens_per_rank=8, experts_backend=backend, seed=0)
    assert experts_class(backend).segment_alignment == alignment
    assert layer.options.alignment == alignment and layer.routed_step.plan.alignment == alignment, backend
    layer.destroy()
    explicit = MegaMoE(cfg, num_max_tokens_per_rank=8, experts_backend=backend, alignment=8, seed=0)
    assert explicit.routed_step.plan.alignment == 8
    explicit.destroy()


@pytest.mark.parametrize("backend, fp8_experts", [("triton", True), ("torch", False), ("auto", False)])
def test_layer_runs_fp8_experts_iff_fp8_dispatch_and_the_backend_has_them(backend, fp8_experts):
    cfg = preset("tiny-kimi-k2")
    layer = MegaMoE(cfg, num_max_tokens_per_rank=8, experts_backend=backend, dispatch_fp8=True, seed=0)
    assert layer.fp8_experts == fp8_experts and layer.experts.fp8 == fp8_experts, backend
    assert layer.experts.accepts_fp8_input == fp8_experts
    bf16_dispatch = MegaMoE(cfg, num_max_tokens_per_rank=8, experts_backend=backend, seed=0)
    assert not bf16_dispatch.fp8_experts and not bf16_dispatch.experts.fp8
    assert GroupedMMExperts.supports_fp8 is False and TritonExperts.supports_fp8 is True
