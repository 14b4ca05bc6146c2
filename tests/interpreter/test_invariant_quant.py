"""Quantized checkpoints in a batch-invariant layer on the Triton experts (under the interpreter on CPU; on the GPU
when there is one): FP8-block experts run on the grouped MLP with the flag set (its tiles of one bits class); INT4
and MXFP4 run on the W4A16 kernel, whose tiles follow the row count, and are refused with CFG027 (when the experts are
built: the first call)."""
import dataclasses

import pytest
import torch

from moe_ref.checkpoint.synthetic import quantizable_config, write_synthetic_checkpoint
from moe_ref.core.config import preset
from moe_ref.core.errors import BatchInvariantExpertsError
from moe_ref.experts.quantized import FP8BlockExperts
from moe_ref.layer import MegaMoE

pytestmark = pytest.mark.interpreter
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _invariant_layer(tmp_path, fmt: str, overrides: dict) -> MegaMoE:
    cfg = quantizable_config(dataclasses.replace(preset("tiny-kimi-k2"), **overrides), fmt)
    write_synthetic_checkpoint(tmp_path, cfg, layer_idx=1, quant=fmt, seed=3, dtype=torch.float32)
    layer = MegaMoE(cfg, num_max_tokens_per_rank=32, batch_invariant=True, experts_backend="triton",
                    dtype=torch.bfloat16, device=DEVICE)
    layer.load_hf_weights(tmp_path, layer_idx=1)
    return layer


def test_fp8_block_experts_take_the_flag_in_a_batch_invariant_layer(tmp_path):
    layer = _invariant_layer(tmp_path, "fp8_block", dict(hidden_size=128, intermediate_size=128))
    assert isinstance(layer.experts, FP8BlockExperts) and layer.experts.batch_invariant
    with torch.inference_mode():
        y = layer(torch.randn(5, 128, device=DEVICE).bfloat16())
    assert y.shape == (5, 128) and bool(torch.isfinite(y).all())
    layer.destroy()


@pytest.mark.parametrize("fmt", ["int4_group", "mxfp4"])
def test_four_bit_experts_on_the_w4a16_kernel_are_refused_with_cfg027(tmp_path, fmt):
    layer = _invariant_layer(tmp_path, fmt, dict(hidden_size=64, intermediate_size=32))
    with pytest.raises(BatchInvariantExpertsError, match="W4A16Experts, whose tiles follow the row count") as err:
        layer(torch.randn(5, 64, device=DEVICE).bfloat16())  # the experts are built at first use: every rank alike
    assert err.value.code == "CFG027"
    layer.destroy()
