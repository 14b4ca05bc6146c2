"""MegaMoE.load_hf_weights on quantized checkpoints: the routed experts stay as stored (no plain copy is ever
allocated, device bytes == the checkpoint's bytes of this rank's experts), the routed step runs them, and the
layer equals the reference built from the dequantized weights. Two ranks: tests/dist/test_cli_dist.py's demo test."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from moe_ref.core.config import preset
from moe_ref.core.errors import BackendUnavailableError, TensorShapeMismatchError
from moe_ref.experts.quantized import QuantTorchExperts
from moe_ref.layer import MegaMoE
from moe_ref.checkpoint.formats import expert_weight_bytes, quant_spec_from_config
from moe_ref.checkpoint.quantized import load_dequantized_weights
from moe_ref.reference import reference_moe
from moe_ref.checkpoint.synthetic import quantizable_config, write_synthetic_checkpoint
from moe_ref.testing import CALC_DIFF_TOLERANCES, assert_close, calc_diff
from moe_ref.core.weights import MoEWeights

pytestmark = pytest.mark.unit

LAYER = 1
# (preset, format, size overrides): INT4/MXFP4 need D, F multiples of 32; FP8 blocks need F % 128 == 0
CASES = {
    "kimi-k3-mxfp4": ("tiny-kimi-k3", "mxfp4", dict(intermediate_size=32)),
    "kimi-k2-thinking-int4": ("tiny-kimi-k2", "int4_group", dict(hidden_size=64, intermediate_size=32)),
    "deepseek-v3-fp8": ("tiny-deepseek-v3", "fp8_block", dict(intermediate_size=128)),
    "step3-fp8-stacked": ("tiny-step3", "fp8_block", dict(intermediate_size=128)),
}


def _checkpoint(tmp_path, case, **kwargs):
    name, fmt, overrides = CASES[case]
    cfg = quantizable_config(dataclasses.replace(preset(name), **overrides), fmt)
    written = write_synthetic_checkpoint(tmp_path, cfg, layer_idx=LAYER, quant=fmt, seed=3, dtype=torch.float32,
                                         **kwargs)
    return cfg, written


@pytest.fixture
def no_plain_experts(monkeypatch):
    """Fails the test if anything allocates the plain expert parameters."""
    def refuse(self):
        raise AssertionError("plain expert parameters allocated")

    monkeypatch.setattr(MegaMoE, "_expert_parameters", refuse)


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_checkpoint_runs_as_stored_and_equals_the_dequantized_reference(tmp_path, case, no_plain_experts):
    cfg, written = _checkpoint(tmp_path, case, num_shards=2)
    layer = MegaMoE(cfg, num_max_tokens_per_rank=64)
    assert layer.expert_nbytes() == 0 and layer.gate_up_weight is None  # nothing allocated before the load
    layer.load_hf_weights(tmp_path, layer_idx=LAYER)
    spec = quant_spec_from_config(tmp_path)
    assert layer.gate_up_weight is None and layer.down_weight is None
    assert layer.quantized_experts.gate_up_qweight_e2FDq.dtype == spec.weight_dtype
    assert layer.expert_nbytes() == expert_weight_bytes(spec, cfg.expert_hidden_size, cfg.intermediate_size,
                                                        cfg.num_experts)
    assert isinstance(layer.experts, QuantTorchExperts)  # the torch twin on CPU
    assert f"({spec.format.value} as stored)" in repr(layer)
    x = torch.randn(40, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        y = layer(x)
        y_ref = reference_moe(x, written, cfg)
    layer.destroy()
    assert_close(y, y_ref, torch.float32, case=case)
    assert calc_diff(y_ref, torch.zeros_like(y_ref)) == 1.0  # nonzero: the comparison can fail


def test_load_dequantized_weights_is_what_the_checkpoint_means(tmp_path):
    cfg, written = _checkpoint(tmp_path, "kimi-k3-mxfp4")
    loaded = load_dequantized_weights(tmp_path, cfg, LAYER)
    for field in dataclasses.fields(MoEWeights):
        a, b = getattr(loaded, field.name), getattr(written, field.name)
        assert a == b if not torch.is_tensor(a) else torch.equal(a, b.to(a.dtype)), field.name


def test_a_built_step_gets_the_quantized_experts_swapped_in_and_back(tmp_path):
    cfg, written = _checkpoint(tmp_path, "kimi-k2-thinking-int4")
    plain = MoEWeights.random(cfg, seed=8)
    layer = MegaMoE(cfg, num_max_tokens_per_rank=64, seed=8)
    x = torch.randn(20, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    assert_close(layer(x), reference_moe(x, plain, cfg), torch.float32)
    step, plain_bytes = layer.routed_step, layer.expert_nbytes()

    layer.load_hf_weights(tmp_path, layer_idx=LAYER, progress=False)
    assert layer.routed_step is step and step.experts is layer.experts  # same plan and buffers, experts swapped
    assert isinstance(step.experts, QuantTorchExperts) and layer.gate_up_weight is None  # the plain block is freed
    assert 0 < layer.expert_nbytes() < plain_bytes / 4
    assert_close(layer(x), reference_moe(x, written, cfg), torch.float32)

    layer.load_weights(plain)  # and back to plain weights
    assert layer.quantized_experts is None and layer.expert_nbytes() == plain_bytes
    assert not isinstance(step.experts, QuantTorchExperts)
    assert_close(layer(x), reference_moe(x, plain, cfg), torch.float32)
    layer.destroy()


def test_fp8_dispatch_over_quantized_experts(tmp_path):
    cfg, written = _checkpoint(tmp_path, "kimi-k3-mxfp4")
    cfg = dataclasses.replace(cfg, hidden_size=128)  # the FP8 rows need widths that are multiples of 128
    written = write_synthetic_checkpoint(tmp_path, cfg, layer_idx=LAYER, quant="mxfp4", seed=3, dtype=torch.float32)
    layer = MegaMoE(cfg, num_max_tokens_per_rank=64, dispatch_fp8=True)
    layer.load_hf_weights(tmp_path, layer_idx=LAYER, progress=False)
    x = torch.randn(30, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    y, y_ref = layer(x), reference_moe(x, written, cfg)
    layer.destroy()
    assert 0 < calc_diff(y, y_ref) <= CALC_DIFF_TOLERANCES[torch.float8_e4m3fn], calc_diff(y, y_ref)


def test_backends_without_quantized_kernels_are_refused_before_reading(tmp_path):
    cfg, _ = _checkpoint(tmp_path, "kimi-k3-mxfp4")
    (tmp_path / "model.safetensors").unlink()  # a read would be LOAD004: the refusal comes first
    layer = MegaMoE(cfg, experts_backend="grouped_mm")
    with pytest.raises(BackendUnavailableError, match=r"\[ENV001\].*grouped_mm.*mxfp4.*'triton' or 'torch'"):
        layer.load_hf_weights(tmp_path, layer_idx=LAYER)
    layer = MegaMoE(cfg)
    layer.uses_mega, layer.options = True, layer.options.replace(mega="deep_gemm")  # as agreed on SM90 GPUs
    with pytest.raises(BackendUnavailableError, match=r"\[ENV001\].*mega='deep_gemm'.*mxfp4.*mega='auto' or 'off'"):
        layer.load_hf_weights(tmp_path, layer_idx=LAYER)


def test_mega_auto_falls_back_to_the_own_path_for_quantized_experts(tmp_path, caplog):
    cfg, written = _checkpoint(tmp_path, "deepseek-v3-fp8")
    layer = MegaMoE(cfg, num_max_tokens_per_rank=64)
    layer.uses_mega, layer.options = True, layer.options.replace(mega="auto")  # as agreed on SM90 GPUs
    with caplog.at_level(logging.WARNING, logger="moe_ref.layer"):
        layer.load_hf_weights(tmp_path, layer_idx=LAYER, progress=False)
    assert not layer.uses_mega and "fp8_block" in caplog.text
    x = torch.randn(12, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    assert_close(layer(x), reference_moe(x, written, cfg), torch.float32)
    layer.destroy()


def test_a_bad_dense_tensor_leaves_the_layer_as_it_was(tmp_path):
    cfg, _ = _checkpoint(tmp_path, "kimi-k3-mxfp4")
    layer = MegaMoE(dataclasses.replace(cfg, shared_intermediate_size=cfg.shared_intermediate_size + 32), seed=1)
    before = layer.gate_weight.clone()
    with pytest.raises(TensorShapeMismatchError):  # the shared experts differ from this config
        layer.load_hf_weights(tmp_path, layer_idx=LAYER, progress=False)
    assert torch.equal(layer.gate_weight, before) and layer.quantized_experts is None
    assert layer.gate_up_weight is not None


def test_progress_bar_on_rank_0_on_a_terminal_or_as_moe_ref_progress_says(tmp_path, capsys, monkeypatch):
    """By default rank 0 draws the bar only on a terminal (pytest's captured stderr is none: no bar redrawn into
    a log); MOE_REF_PROGRESS=1 forces it; progress=False never draws."""
    cfg, _ = _checkpoint(tmp_path, "kimi-k3-mxfp4")
    monkeypatch.delenv("MOE_REF_PROGRESS", raising=False)
    MegaMoE(cfg).load_hf_weights(tmp_path, layer_idx=LAYER)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("MOE_REF_PROGRESS", "1")
    MegaMoE(cfg).load_hf_weights(tmp_path, layer_idx=LAYER)
    assert f"layer {LAYER} experts" in capsys.readouterr().err
    MegaMoE(cfg).load_hf_weights(tmp_path, layer_idx=LAYER, progress=False)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("case", list(CASES))
def test_a_batch_invariant_layer_runs_a_quantized_checkpoint_and_a_token_keeps_its_bits_alone(tmp_path, case):
    """Each format's experts as stored on the torch loop (dequantized per expert, rows in fixed blocks): a token alone
    or in a smaller batch gives the bits it gets inside the batch of 160."""
    from moe_ref.ep.batch_invariant import rows_with_other_bits

    cfg, _ = _checkpoint(tmp_path, case)
    layer = MegaMoE(cfg, num_max_tokens_per_rank=256, batch_invariant=True, alignment=1)
    layer.load_hf_weights(tmp_path, layer_idx=LAYER)
    assert isinstance(layer.experts, QuantTorchExperts) and layer.experts.batch_invariant
    x = torch.randn(160, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        full = layer(x)
        for size in (1, 2, 3, 17, 64, 129):
            offset = 160 - size if size > 3 else 7 * size
            assert rows_with_other_bits(layer(x[offset:offset + size]), full[offset:offset + size]) == 0, (case, size)
    layer.destroy()
