"""Quantized checkpoints in a batch-invariant layer on the Triton experts (under the interpreter on CPU; on the GPU
when there is one): FP8-block experts run on the grouped MLP with the flag set (its tiles of one bits class); INT4
and MXFP4 run on the W4A16 kernel on one tile pair at every row count (``grouped_mlp_w4.BATCH_INVARIANT_TILES``), a
token alone giving the bits it has in a batch; an experts class that does not hold the mode is refused with CFG027
when the layer first builds its experts."""
import dataclasses

import pytest
import torch

from moe_ref.checkpoint.synthetic import quantizable_config, write_synthetic_checkpoint
from moe_ref.core.config import preset
from moe_ref.core.errors import BatchInvariantExpertsError
from moe_ref.ep.batch_invariant import rows_with_other_bits
from moe_ref.experts.quantized import FP8BlockExperts, W4A16Experts
from moe_ref.kernels.experts import grouped_mlp_w4
from moe_ref.layer import MegaMoE

pytestmark = pytest.mark.interpreter
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _invariant_layer(tmp_path, fmt: str, overrides: dict, dtype=torch.bfloat16) -> MegaMoE:
    cfg = quantizable_config(dataclasses.replace(preset("tiny-kimi-k2"), **overrides), fmt)
    write_synthetic_checkpoint(tmp_path, cfg, layer_idx=1, quant=fmt, seed=3, dtype=torch.float32)
    layer = MegaMoE(cfg, num_max_tokens_per_rank=32, batch_invariant=True, experts_backend="triton",
                    dtype=dtype, device=DEVICE)
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
def test_a_four_bit_checkpoints_token_alone_equals_the_token_in_a_batch(tmp_path, fmt, row_invariant_dot):
    """fp32 activations (no output rounding hides a difference in the last bits): tokens 0, 5 and 12 alone give the
    bits they have inside a batch of 13 through the layer's invariant path on the W4A16 kernel (the interpreter runs
    its one tile, its dot made row-invariant as the GPU's MMA is: conftest; the tile a GPU launches is the next
    test's)."""
    layer = _invariant_layer(tmp_path, fmt, dict(hidden_size=64, intermediate_size=32), dtype=torch.float32)
    x = torch.randn(13, 64, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    with torch.inference_mode():
        batch = layer(x)
        assert isinstance(layer.experts, W4A16Experts) and layer.experts.batch_invariant
        for i in (0, 5, 12):
            assert rows_with_other_bits(layer(x[i:i + 1]), batch[i:i + 1]) == 0, f"token {i} alone, {fmt}"
    layer.destroy()


def test_the_w4a16_kernel_takes_one_tile_pair_at_every_row_count_in_the_mode(monkeypatch):
    """On a GPU the mode's launches force ``BATCH_INVARIANT_TILES`` (GEMM1's, then GEMM2's) whatever the rows hint;
    the default mode's autotune (tile None). The launches are recorded, not run (a GPU decides the interpreter's
    tile otherwise)."""
    launched = []
    monkeypatch.setattr(grouped_mlp_w4, "is_interpreter", lambda: False)
    monkeypatch.setattr(grouped_mlp_w4, "check_device", lambda *args: None)
    monkeypatch.setattr(grouped_mlp_w4, "launch_w4_gemm", lambda *args, tile, **kwargs: launched.append(tile))
    fake = lambda e, o, i: type("W", (), {"shape": (e, o, i), "fmt": "int4"})()  # noqa: E731 - shapes, format only
    gate_up, down = fake(4, 64, 32), fake(4, 32, 32)
    for rows_hint in (1, 64, 4096):
        for invariant in (True, False):
            grouped_mlp_w4.grouped_mlp_w4(torch.zeros(8, 32), gate_up, down, torch.zeros(4, dtype=torch.int64),
                                          torch.full((4,), 2), num_rows_hint=rows_hint, batch_invariant=invariant)
    pair = list(grouped_mlp_w4.BATCH_INVARIANT_TILES)
    assert launched == (pair + [None, None]) * 3


def test_an_experts_class_that_does_not_hold_the_mode_is_refused_with_cfg027(tmp_path, monkeypatch):
    monkeypatch.setattr(W4A16Experts, "honours_batch_invariant", False)
    layer = _invariant_layer(tmp_path, "int4_group", dict(hidden_size=64, intermediate_size=32))
    with pytest.raises(BatchInvariantExpertsError, match="W4A16Experts, whose kernel does not give a row the same") \
            as err:
        layer(torch.randn(5, 64, device=DEVICE).bfloat16())  # the experts are built at first use: every rank alike
    assert err.value.code == "CFG027"
    layer.destroy()
