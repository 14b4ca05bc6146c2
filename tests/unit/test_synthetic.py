"""The synthetic checkpoint writer: every tiny preset in every quantized format loads back from its own config.json
and gives the weights written; what config.json cannot express, or a format cannot store, is refused before
anything is written."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_ref.checkpoint.formats import QuantFormat
from moe_ref.checkpoint.quantized import load_dequantized_weights
from moe_ref.checkpoint.synthetic import (check_synthetic_layout, config_differences, quantizable_config,
                                          write_synthetic_checkpoint)
from moe_ref.core.config import PRESETS, REAL_PRESETS, MoEConfig, preset
from moe_ref.core.errors import ConfigNotExpressibleError, InvalidConfigError
from moe_ref.layer import MegaMoE
from moe_ref.reference import reference_moe
from moe_ref.testing import calc_diff

pytestmark = pytest.mark.unit

TINY = [name for name in PRESETS if name.startswith("tiny-")]
FORMATS = [fmt.value for fmt in QuantFormat]
WEIGHTS = ("gate_weight_ED", "bias_E", "gate_up_weight_E2FD", "down_weight_EDF", "shared_gate_up_weight_2SD",
           "shared_down_weight_DS", "latent_down_weight_LD", "latent_up_weight_DL", "latent_norm_weight_L")


@pytest.mark.parametrize("quant", FORMATS)
@pytest.mark.parametrize("name", TINY)
def test_every_tiny_preset_in_every_format_loads_back_from_its_own_config_json(tmp_path, name, quant):
    cfg = quantizable_config(preset(name), quant)
    written = write_synthetic_checkpoint(tmp_path, cfg, quant=quant, seed=3)
    back = MoEConfig.from_hf_config(tmp_path)
    assert config_differences(cfg, back) == {}, f"{name=} {quant=}"

    loaded = load_dequantized_weights(tmp_path, back, 0)  # the library's loader, every expert dequantized
    for field in WEIGHTS:
        want, got = getattr(written, field), getattr(loaded, field)
        assert (want is None) == (got is None), f"{name=} {quant=} {field=}"
        if want is not None:
            assert torch.equal(got.float(), want.float()), f"{name=} {quant=} {field=}"

    layer = MegaMoE(tmp_path, None, num_max_tokens_per_rank=32, dtype=torch.float32)
    layer.load_hf_weights(tmp_path, 0, progress=False)
    assert layer.quantized_experts is not None and layer.quantized_experts.spec.format.value == quant
    x = torch.randn(12, back.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        y, y_ref = layer(x), reference_moe(x, loaded, back)
    layer.destroy()
    assert calc_diff(y, y_ref) <= 1e-10, f"{name=} {quant=} {calc_diff(y, y_ref)=}"


@pytest.mark.parametrize("quant", FORMATS)
@pytest.mark.parametrize("name", REAL_PRESETS)
def test_every_real_preset_in_every_format_passes_the_writers_checks(name, quant):
    """What ``moe-ref demo --preset <real> --quant <format>`` would write (the sizes are too large to write here)."""
    cfg = quantizable_config(preset(name), quant)
    assert check_synthetic_layout(cfg, quant).format.value == quant
    if cfg.family != "step3":
        assert cfg.shared_intermediate_size == cfg.num_shared_experts * cfg.intermediate_size, f"{name=} {quant=}"


def test_quantizable_config_keeps_the_shared_width_config_json_derives():
    cfg = quantizable_config(preset("tiny-kimi-k3"), "mxfp4")  # F 24 -> 32, two shared experts
    assert (cfg.intermediate_size, cfg.latent_dim, cfg.shared_intermediate_size) == (32, 32, 64)
    cfg = quantizable_config(preset("tiny-kimi-k2"), "fp8_block")  # F 40 -> 128, one shared expert
    assert (cfg.intermediate_size, cfg.shared_intermediate_size) == (128, 128)
    cfg = quantizable_config(preset("tiny-step3"), "int4_group")  # its own share_expert_dim, stored quantized
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.shared_intermediate_size) == (64, 64, 64)
    assert quantizable_config(preset("tiny-step3"), "fp8_block").shared_intermediate_size == 40


def test_a_shared_width_config_json_cannot_express_is_refused_before_writing(tmp_path):
    cfg = dataclasses.replace(preset("tiny-kimi-k2"), intermediate_size=64)  # S stays 40; config.json says 1 x 64
    folder = tmp_path / "ckpt"
    with pytest.raises(ConfigNotExpressibleError) as err:
        write_synthetic_checkpoint(folder, cfg)
    message = str(err.value)
    assert err.value.code == "CFG022" and isinstance(err.value, ValueError)
    assert "shared_intermediate_size=40 reads back as 64" in message and "set shared_intermediate_size=64" in message
    assert not folder.exists()


def test_quantized_shared_experts_of_a_size_the_format_cannot_store_are_refused(tmp_path):
    """Step3's share_expert is quantized under the compressed-tensors configs (their ignore list names Kimi's
    shared_experts); S = 40 is no whole number of groups of 32."""
    cfg = dataclasses.replace(quantizable_config(preset("tiny-step3"), "int4_group"), shared_intermediate_size=40)
    with pytest.raises(InvalidConfigError, match=r"shared experts it quantizes need multiples of 32, not S=40"):
        write_synthetic_checkpoint(tmp_path / "ckpt", cfg, quant="int4_group")
    assert not (tmp_path / "ckpt").exists()


def test_routed_sizes_the_format_cannot_store_are_refused_naming_them(tmp_path):
    with pytest.raises(InvalidConfigError, match=r"tiny-kimi-k3 with quant='mxfp4': F=24 is not a multiple of 32"):
        write_synthetic_checkpoint(tmp_path / "ckpt", preset("tiny-kimi-k3"), quant="mxfp4")
    assert not (tmp_path / "ckpt").exists()
