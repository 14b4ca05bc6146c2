"""grouped_mlp's weight-only 4-bit path (INT4 pack-quantized, MXFP4) vs its twin and vs the dequantized fp32
weights through moe_ref's torch expert loop; FP8 checkpoint experts through the public Experts API."""

import importlib

import pytest
import torch
import triton

from moe_ref.core import envs
from moe_ref.core.errors import DTypeError, InvalidConfigError
from moe_ref.experts import ExpertLayout, make_experts
from moe_ref.experts.quantized import FP8BlockExperts, W4A16Experts, make_quantized_experts
from moe_ref.checkpoint.formats import QuantFormat, QuantizedExpertWeights, QuantSpec, quantize_weight
from moe_ref.testing import CALC_DIFF_TOLERANCES, calc_diff

gm = importlib.import_module("moe_ref.kernels.grouped_mlp")  # the package re-exports a function of that name

pytestmark = pytest.mark.interpreter

W4 = [QuantFormat.INT4_GROUP, QuantFormat.MXFP4]
COUNTS = [5, 0, 19]  # an empty expert, a ragged one; the interpreter's BLOCK_M is 16


@pytest.fixture(params=envs.W4_DECODES)
def w4_decode(request, monkeypatch) -> str:
    """The test runs under each 4-bit decode of the temporary A/B (`MOE_REF_W4_DECODE`)."""
    monkeypatch.setenv("MOE_REF_W4_DECODE", request.param)
    return request.param


def _qweights(fmt, num_experts, hidden, inter, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    (gq, gs), (dq, ds) = quantize_weight(gate_up, fmt), quantize_weight(down, fmt)
    spec = QuantSpec(fmt, 128 if fmt == QuantFormat.FP8_BLOCK else 32)
    return QuantizedExpertWeights(spec, gq, gs, dq, ds, hidden_size=hidden, intermediate_size=inter).to(device)


def _pool(layout, hidden, dtype, device, seed=1):
    x_PDx = torch.randn(layout.num_pool_rows, hidden, generator=torch.Generator().manual_seed(seed))
    valid = torch.zeros(layout.num_pool_rows, dtype=torch.bool)
    for start, count in zip(layout.row_start_e.tolist(), layout.num_rows_e.tolist()):
        valid[start:start + count] = True
    x_PDx[~valid] = float("nan")  # rows outside every segment are never read
    return x_PDx.to(dtype).to(device), valid


@pytest.mark.parametrize("fmt", W4)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "situ"])
def test_w4_kernel_matches_twin(fmt, dtype, activation, w4_decode, device, assert_close):
    hidden, inter = 64, 32
    q = _qweights(fmt, len(COUNTS), hidden, inter, device)
    layout = ExpertLayout.from_counts(torch.tensor(COUNTS, device=device), alignment=16, num_pool_rows=64)
    x_PDx, valid = _pool(layout, hidden, dtype, device)
    args = (x_PDx, q.gate_up_qweight_e2FDq, q.down_qweight_eDFq, layout.row_start_e, layout.num_rows_e, activation)
    scales = dict(gate_up_scale=q.gate_up_scale_e2FDs, down_scale=q.down_scale_eDFs)
    y_PDx, y_ref = gm.grouped_mlp(*args, **scales), gm.grouped_mlp_ref(*args, **scales)
    case = dict(fmt=fmt.value, dtype=dtype, activation=activation, w4_decode=w4_decode)
    assert (y_PDx.cpu()[~valid] == 0).all(), case
    assert_close(y_PDx, y_ref, dtype, **case)


@pytest.mark.parametrize("fmt", W4)
def test_w4_interleaved_gate_up_matches_twin(fmt, w4_decode, device, assert_close):
    """Packed 4-bit gate_up rows and their per-row group scales interleaved together (gate j, up j)."""
    hidden, inter = 64, 32
    q = _qweights(fmt, len(COUNTS), hidden, inter, device)
    layout = ExpertLayout.from_counts(torch.tensor(COUNTS, device=device), alignment=16, num_pool_rows=64)
    x_PDx, valid = _pool(layout, hidden, torch.float16, device)
    gate_up, gate_up_scale = (gm.interleave_gate_up(t) for t in (q.gate_up_qweight_e2FDq, q.gate_up_scale_e2FDs))
    args = (x_PDx, gate_up, q.down_qweight_eDFq, layout.row_start_e, layout.num_rows_e, "silu")
    kwargs = dict(gate_up_scale=gate_up_scale, down_scale=q.down_scale_eDFs, gate_up_interleaved=True)
    y_PDx, y_ref = gm.grouped_mlp(*args, **kwargs), gm.grouped_mlp_ref(*args, **kwargs)
    stacked = (x_PDx, q.gate_up_qweight_e2FDq, q.down_qweight_eDFq, layout.row_start_e, layout.num_rows_e, "silu")
    assert torch.equal(y_ref, gm.grouped_mlp_ref(*stacked, gate_up_scale=q.gate_up_scale_e2FDs,
                                                 down_scale=q.down_scale_eDFs))
    assert (y_PDx.cpu()[~valid] == 0).all()
    assert_close(y_PDx, y_ref, torch.float16, fmt=fmt.value, w4_decode=w4_decode)


@pytest.mark.parametrize("fmt", W4)
def test_w4a16_experts_equal_the_dequantized_fp32_torch_loop(fmt, device):
    hidden, inter = 96, 64  # 3 scale groups along D, 2 along F; several K steps
    q = _qweights(fmt, 3, hidden, inter, device, seed=2)
    layout = ExpertLayout.from_counts(torch.tensor([7, 0, 18], device=device), alignment=1)
    x_PDx, _ = _pool(layout, hidden, torch.float32, device, seed=3)
    experts = make_quantized_experts(q, "situ", backend="triton")
    assert isinstance(experts, W4A16Experts) and experts.segment_alignment == 1
    reference = make_experts("torch", *(w.cpu() for w in q.dequantize(torch.float32)), "situ")
    y, y_ref = experts(x_PDx, layout).cpu(), reference(x_PDx.cpu(), layout)
    diff = calc_diff(y, y_ref)
    assert diff <= 1e-5, f"{fmt=} {diff=}"
    assert calc_diff(y_ref, torch.zeros_like(y_ref)) == 1.0
    # and the torch backend of the same weights (dequantized per expert as its rows run) is that reference
    torch_experts = make_quantized_experts(q.to("cpu"), "situ", backend="torch")
    assert torch.equal(torch_experts(x_PDx.cpu(), layout), y_ref)


def test_fp8_checkpoint_experts_run_the_stored_weights(device):
    hidden, inter = 160, 128  # an edge block along D
    q = _qweights(QuantFormat.FP8_BLOCK, 3, hidden, inter, device, seed=4)
    layout = ExpertLayout.from_counts(torch.tensor([4, 9, 0], device=device), alignment=1)
    x_PDx, _ = _pool(layout, hidden, torch.float32, device, seed=5)
    experts = make_quantized_experts(q, "silu", backend="triton")
    assert isinstance(experts, FP8BlockExperts) and experts.accepts_fp8_input
    assert experts.gate_up_fp8_e2FD is q.gate_up_qweight_e2FDq  # the checkpoint's tensor, not a re-quantized copy
    reference = make_quantized_experts(q.to("cpu"), "silu", backend="torch")
    y, y_ref = experts(x_PDx, layout).cpu(), reference(x_PDx.cpu(), layout)
    assert calc_diff(y.float(), y_ref) <= CALC_DIFF_TOLERANCES[torch.float8_e4m3fn]


def test_w4_argument_errors(device):
    q = _qweights(QuantFormat.MXFP4, 2, 64, 32, device)
    layout = ExpertLayout.from_counts(torch.tensor([3, 2], device=device), alignment=1)
    x_PDx = torch.zeros(5, 64, device=device)
    with pytest.raises(DTypeError, match="gate_up_scale"):
        gm.grouped_mlp(x_PDx, q.gate_up_qweight_e2FDq, q.down_qweight_eDFq, layout.row_start_e, layout.num_rows_e)
    with pytest.raises(DTypeError, match="down_scale"):
        gm.grouped_mlp(x_PDx, q.gate_up_qweight_e2FDq, q.down_qweight_eDFq, layout.row_start_e, layout.num_rows_e,
                       gate_up_scale=q.gate_up_scale_e2FDs, down_scale=q.down_scale_eDFs.to(torch.bfloat16))
    config = triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16}, num_warps=4, num_stages=2)
    with pytest.raises(InvalidConfigError, match="multiple of 32"):
        gm.launch_gemm(x_PDx, None, q.gate_up_qweight_e2FDq, q.gate_up_scale_e2FDs, torch.empty(5, 32, device=device),
                        None, layout.row_start_e, layout.num_rows_e, n=32, k=64, activation="silu", situ_beta=4.0,
                        situ_linear_beta=25.0, fp8=False, quant_out=False, rows_hint=5, w4=2, config=config)


@pytest.mark.parametrize("name, fmt, overrides", [
    ("tiny-kimi-k3", "mxfp4", dict(intermediate_size=32)),
    ("tiny-kimi-k2", "int4_group", dict(hidden_size=64, intermediate_size=32)),
    ("tiny-deepseek-v3", "fp8_block", dict(intermediate_size=128)),
])
def test_layer_loads_a_quantized_checkpoint_into_the_triton_quantized_experts(tmp_path, device, name, fmt, overrides):
    """MegaMoE.load_hf_weights with experts_backend='triton': W4A16 (INT4, MXFP4) or the FP8 block kernel run the
    stored tensors inside the routed step; compared with the layer's reference on the dequantized weights."""
    import dataclasses

    from moe_ref.core.config import preset
    from moe_ref.layer import MegaMoE
    from moe_ref.reference import reference_moe
    from moe_ref.checkpoint.synthetic import write_synthetic_checkpoint

    cfg = dataclasses.replace(preset(name), **overrides)
    written = write_synthetic_checkpoint(tmp_path, cfg, layer_idx=0, quant=fmt, seed=6, dtype=torch.float32)
    layer = MegaMoE(cfg, num_max_tokens_per_rank=32, experts_backend="triton", device=device)
    layer.load_hf_weights(tmp_path, layer_idx=0, progress=False)
    assert isinstance(layer.experts, FP8BlockExperts if fmt == "fp8_block" else W4A16Experts)
    assert layer.gate_up_weight is None and layer.quantized_experts.device.type == torch.device(device).type
    x = torch.randn(30, cfg.hidden_size, generator=torch.Generator().manual_seed(7)).to(device)
    with torch.inference_mode():
        y = layer(x)
        y_ref = reference_moe(x, written.to(device), cfg)
    layer.destroy()
    limit = CALC_DIFF_TOLERANCES[torch.float8_e4m3fn] if fmt == "fp8_block" else 1e-5
    assert calc_diff(y, y_ref) <= limit, (fmt, calc_diff(y, y_ref))
    assert calc_diff(y_ref, torch.zeros_like(y_ref)) == 1.0

