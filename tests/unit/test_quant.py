"""moe_ref.checkpoint.formats: the published packing rules (pinned with hand-computed values), round trips, config parsing."""
from __future__ import annotations

import pytest
import torch

from moe_ref.core.errors import UnsupportedQuantizationError
from moe_ref.kernels.experts.fp8 import quantize_fp8_per_block_128
from moe_ref.checkpoint.formats import (
    E8M0_BIAS,
    QuantFormat,
    QuantSpec,
    dequantize_mxfp4,
    dequantize_weight,
    e2m1_to_float,
    expert_weight_bytes,
    float_to_e2m1,
    pack_fp4,
    pack_int4,
    quant_spec_from_config,
    quantize_int4,
    quantize_mxfp4,
    quantize_weight,
    unpack_fp4,
    unpack_int4,
)
from moe_ref.checkpoint.synthetic import QUANTIZATION_CONFIGS

pytestmark = pytest.mark.unit


# --- INT4 (compressed-tensors pack-quantized) -------------------------------------------------------------

def test_int4_packing_rule_offset_binary_low_nibble_first():
    q = torch.tensor([[1, -8, 0, 0, 0, 0, 0, 7]], dtype=torch.int8)
    packed = pack_int4(q)
    # nibbles q + 8 = [9, 0, 8, 8, 8, 8, 8, 15], nibble i at bits 4i -> 0xF8888809, stored as int32
    assert packed.dtype == torch.int32 and packed.shape == (1, 1)
    assert packed.item() == 0xF8888809 - 2**32
    assert torch.equal(unpack_int4(packed), q)


def test_int4_round_trip_through_the_published_rule():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 64, generator=gen).to(torch.bfloat16)
    packed, scale = quantize_int4(weight)
    assert packed.shape == (6, 8) and packed.dtype == torch.int32
    assert scale.shape == (6, 2) and scale.dtype == torch.bfloat16
    q = unpack_int4(packed)
    assert int(q.min()) >= -8 and int(q.max()) <= 7
    dense = dequantize_weight(packed, scale, QuantFormat.INT4_GROUP)
    # scale = amax/8 (bf16) and q in [-8, 7]: within half a step, except a positive amax that clips to 7 steps
    step = scale.float().repeat_interleave(32, dim=-1)
    err = (dense - weight.float()).abs()
    assert bool((err <= step * 1.01).all()) and bool((err[q != 7] <= step[q != 7] * 0.51).all())
    assert torch.equal(pack_int4(q), packed)


# --- MXFP4 (compressed-tensors mxfp4-pack-quantized) --------------------------------------------------------

def test_e8m0_bias_is_125_as_compressed_tensors_stores_it():
    # compressed-tensors: amax 6.0 -> round_to_power_2 = 4 -> dense scale 2**(2-2) = 1 -> stored 127 + 0 - 2 = 125
    packed, scale = quantize_mxfp4(torch.full((1, 32), 6.0))
    assert E8M0_BIAS == 125 and scale.tolist() == [[125]]
    assert packed.tolist() == [[0x77] * 16]  # code 7 (= 6.0) in both nibbles
    assert torch.equal(dequantize_mxfp4(packed, scale), torch.full((1, 32), 6.0))
    # a standard E8M0 reader (bias 127) would see 1.5: the checkpoint's scales are off by 4x for it
    assert 6.0 * 2.0 ** (125 - 127) == 1.5


def test_mxfp4_power_of_two_rounding_of_amax():
    # amax 7 = 1.75 * 4: its mantissa >= 0.75 rounds up to 8 -> dense scale 2 -> 7/2 = 3.5 -> e2m1 3 (tie goes down)
    weight = torch.zeros(1, 32)
    weight[0, 0] = 7.0
    packed, scale = quantize_mxfp4(weight)
    assert scale.item() == 3 - 2 + E8M0_BIAS
    assert dequantize_mxfp4(packed, scale)[0, 0].item() == 6.0


def test_fp4_packing_rule_low_nibble_is_the_even_element():
    codes = torch.tensor([[0xA, 0x5]], dtype=torch.uint8)  # -1.0, 3.0
    assert pack_fp4(codes).tolist() == [[0x5A]]
    assert torch.equal(unpack_fp4(pack_fp4(codes)), codes)
    assert e2m1_to_float(codes).tolist() == [[-1.0, 3.0]]
    every_code = torch.arange(16, dtype=torch.uint8)
    values = e2m1_to_float(every_code)
    assert values[:8].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert torch.equal(float_to_e2m1(values[1:]), every_code[1:])  # -0.0 (code 8) is the only alias


def test_mxfp4_round_trip_through_the_published_rule():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(4, 96, generator=gen)
    packed, scale = quantize_mxfp4(weight)
    assert packed.shape == (4, 48) and packed.dtype == torch.uint8 and scale.shape == (4, 3)
    dense = dequantize_weight(packed, scale, QuantFormat.MXFP4)
    assert torch.equal(quantize_mxfp4(dense)[0], packed) and torch.equal(quantize_mxfp4(dense)[1], scale)
    rel = ((dense - weight).norm() / weight.norm()).item()
    assert 0.02 < rel < 0.2, rel  # 4-bit floats: lossy, but a wrong bias or nibble order would be far off


# --- FP8 blocks ---------------------------------------------------------------------------------------------

def test_fp8_block_round_trip_matches_weight_scale_inv_semantics():
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(130, 200, generator=gen)  # edge blocks on both dims
    qweight, scale = quantize_weight(weight, QuantFormat.FP8_BLOCK)
    assert qweight.dtype == torch.float8_e4m3fn and scale.shape == (2, 2)
    # weight_scale_inv multiplies: w = q * s per 128x128 block
    manual = qweight.float() * scale.repeat_interleave(128, 0)[:130].repeat_interleave(128, 1)[:, :200]
    assert torch.equal(dequantize_weight(qweight, scale, QuantFormat.FP8_BLOCK), manual)
    assert torch.equal(quantize_fp8_per_block_128(manual)[0].float(), qweight.float())


# --- quantization_config ------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", list(QuantFormat))
def test_published_configs_parse(fmt):
    spec = quant_spec_from_config({"model_type": "x", "quantization_config": QUANTIZATION_CONFIGS[fmt]})
    assert spec.format == fmt and spec.group_size == (128 if fmt == QuantFormat.FP8_BLOCK else 32)
    nested = quant_spec_from_config({"text_config": {"quantization_config": QUANTIZATION_CONFIGS[fmt]}})
    assert nested == spec


def test_minimal_scheme_and_the_text_configs_quantization_config_wins():
    minimal = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
               "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"],
                                             "weights": {"num_bits": 4, "group_size": 32}}}}
    raw = {"model_type": "kimi_k3", "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
           "text_config": {"quantization_config": minimal}}
    assert quant_spec_from_config(raw).format == QuantFormat.MXFP4


def test_no_quantization_config_is_none():
    assert quant_spec_from_config({"hidden_size": 8}) is None


def _ct(fmt, **weights):
    config = {**QUANTIZATION_CONFIGS[fmt]}
    group = {**config["config_groups"]["group_0"]}
    group["weights"] = {**group["weights"], **weights}
    config["config_groups"] = {"group_0": group}
    return {"quantization_config": config}


@pytest.mark.parametrize("raw,needle", [
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quant_method='awq'"),
    ({"quantization_config": {**QUANTIZATION_CONFIGS[QuantFormat.FP8_BLOCK], "weight_block_size": [64, 64]}},
     "weight_block_size=\\[64, 64\\]"),
    (_ct(QuantFormat.INT4_GROUP, group_size=128), "'group_size': 128"),
    (_ct(QuantFormat.INT4_GROUP, symmetric=False), "'symmetric': False"),
    (_ct(QuantFormat.MXFP4, num_bits=8), "'num_bits': 8"),
    ({"quantization_config": {**QUANTIZATION_CONFIGS[QuantFormat.INT4_GROUP], "format": "marlin-24",
                              "config_groups": {"g": {"weights": {"num_bits": 4}, "format": "marlin-24"}}}},
     "format='marlin-24'"),
    ({"quantization_config": [1, 2]}, "not an object"),
])
def test_unsupported_quantization_is_load008(raw, needle):
    with pytest.raises(UnsupportedQuantizationError, match=needle) as info:
        quant_spec_from_config(raw)
    assert info.value.code == "LOAD008"


def test_expert_weight_bytes_of_the_published_shapes():
    int4 = QuantSpec(QuantFormat.INT4_GROUP, 32)
    # Kimi-K2-Thinking, 192 experts per rank: packed int32 [F, D/8] + bf16 [F, D/32] per weight
    assert expert_weight_bytes(int4, 7168, 2048, 192) == 192 * 3 * (2048 * 896 * 4 + 2048 * 224 * 2)
    fp8 = QuantSpec(QuantFormat.FP8_BLOCK, 128)
    assert expert_weight_bytes(fp8, 7168, 2048, 1) == 3 * (2048 * 7168 + 16 * 56 * 4)
    mxfp4 = QuantSpec(QuantFormat.MXFP4, 32)
    assert expert_weight_bytes(mxfp4, 3584, 3072, 1) == 3 * (3072 * 1792 + 3072 * 112)
    assert expert_weight_bytes(None, 7168, 2048, 1) == 3 * 7168 * 2048 * 2  # bf16
