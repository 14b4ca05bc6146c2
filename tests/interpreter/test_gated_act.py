"""gated_activation_rows (Triton) vs its torch twin over the valid rows of a masked and a contiguous pool."""

import pytest
import torch

from moe_ref.kernels.experts.fp8 import dequantize_fp8_per_128
from moe_ref.kernels.experts.gated_act import gated_activation_rows, gated_activation_rows_ref, valid_rows_P

pytestmark = pytest.mark.interpreter

POOLS = {
    # masked: M = 4 rows per expert, counts [1, 0, 4]: rows 0, 8, 9, 10, 11 valid (an empty and a full expert)
    "masked": dict(num_rows_e=torch.tensor([1, 0, 4]), masked_rows=4),
    # contiguous: DeepGEMM's grouped layout, -1 on padding rows (17 rows: a partial last block of 16)
    "contiguous": dict(group_P=torch.tensor([0, 0, -1, -1, 2, 2, 2, -1, -1, -1, -1, -1, -1, -1, -1, -1, 1],
                                            dtype=torch.int32)),
}


@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("width,activation,situ_linear_beta", [(128, "silu", 25.0), (200, "situ", 25.0),
                                                               (64, "situ", 0.0)])
@pytest.mark.parametrize("quant", [False, True], ids=["bf16_out", "fp8_out"])
def test_gated_activation_rows_matches_twin_on_valid_rows(pool, width, activation, situ_linear_beta, quant, device):
    index = {name: value.to(device) for name, value in POOLS[pool].items() if torch.is_tensor(value)}
    kwargs = dict(POOLS[pool], **index, activation=activation, situ_beta=4.0, situ_linear_beta=situ_linear_beta,
                  quant=quant)
    num_rows = 12 if pool == "masked" else 17
    gen = torch.Generator().manual_seed(width)
    gate_up = (torch.randn(num_rows, 2 * width, generator=gen) * 3).to(torch.bfloat16).to(device)
    valid = valid_rows_P(num_rows, **{k: v for k, v in kwargs.items() if k in ("group_P", "num_rows_e", "masked_rows")})
    gate_up[~valid] = float("nan")  # rows that are not valid must not reach a valid row's output
    h, h_scale = gated_activation_rows(gate_up, **kwargs)
    h_ref, h_scale_ref = gated_activation_rows_ref(gate_up, **kwargs)
    assert h.shape == (num_rows, width) and h.dtype == h_ref.dtype
    if quant:
        assert h_scale.shape == (num_rows, -(-width // 128))
        torch.testing.assert_close(h_scale[valid], h_scale_ref[valid], rtol=1e-5, atol=0)
        got, want = dequantize_fp8_per_128(h[valid], h_scale[valid]), dequantize_fp8_per_128(h_ref[valid],
                                                                                            h_scale_ref[valid])
        # one e4m3 step apart at most (the fp32 activations may differ in the last bits)
        torch.testing.assert_close(got, want, rtol=0.07, atol=h_scale[valid].max().item() * 2 ** -9)
    else:
        torch.testing.assert_close(h[valid].float(), h_ref[valid].float(), rtol=1e-2, atol=1e-5)
    assert torch.isfinite(h[valid].float()).all()


def test_bad_arguments_are_shape_errors():
    from moe_ref.core.errors import ShapeError

    gate_up = torch.zeros(8, 6)
    with pytest.raises(ShapeError, match="e \\* M rows"):
        gated_activation_rows_ref(gate_up, num_rows_e=torch.tensor([1, 2, 3]), masked_rows=4)
    with pytest.raises(ShapeError, match="group_P"):
        gated_activation_rows_ref(gate_up)
    with pytest.raises(ShapeError, match="\\[P, 2F\\]"):
        gated_activation_rows_ref(torch.zeros(8, 5), group_P=torch.zeros(8, dtype=torch.int32))


@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("tile", [(32, 4), (64, 8)])
def test_every_tile_gives_the_default_tiles_bits(pool, tile, device):
    """``scripts/tune_gated_act.py`` picks among tiles: a tile changes which program computes a row, never its
    value (each row's scale comes from its own 128 columns)."""
    index = {name: value.to(device) for name, value in POOLS[pool].items() if torch.is_tensor(value)}
    kwargs = dict(POOLS[pool], **index, quant=True)
    num_rows = 12 if pool == "masked" else 17
    gate_up = (torch.randn(num_rows, 2 * 200, generator=torch.Generator().manual_seed(3)) * 3).bfloat16().to(device)
    valid = valid_rows_P(num_rows, **{k: v for k, v in kwargs.items() if k in ("group_P", "num_rows_e", "masked_rows")})
    h, h_scale = gated_activation_rows(gate_up, **kwargs)
    h_tile, h_scale_tile = gated_activation_rows(gate_up, **kwargs, tile=tile)
    assert torch.equal(h[valid].view(torch.uint8), h_tile[valid].view(torch.uint8))
    assert torch.equal(h_scale[valid], h_scale_tile[valid])


@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("quant", [False, True], ids=["bf16_out", "fp8_out"])
def test_interleaved_columns_give_the_stacked_activation(pool, quant, device):
    """GEMM1's output over interleaved gate_up weights (128-column gate and up blocks, F = 256) gives the stacked
    columns' h, bit for bit, in the kernel and in its twin; a width that is not whole blocks is refused."""
    from moe_ref.core.errors import ShapeError
    from moe_ref.kernels.experts.grouped_mlp import interleave_gate_up

    index = {name: value.to(device) for name, value in POOLS[pool].items() if torch.is_tensor(value)}
    kwargs = dict(POOLS[pool], **index, quant=quant)
    num_rows = 12 if pool == "masked" else 17
    stacked = (torch.randn(num_rows, 2 * 256, generator=torch.Generator().manual_seed(5)) * 3).bfloat16().to(device)
    interleaved = interleave_gate_up(stacked.T[None], rows_per_block=128)[0].T.contiguous()
    assert torch.equal(interleaved[:, 128:256], stacked[:, 256:384])
    valid = valid_rows_P(num_rows, **{k: v for k, v in kwargs.items() if k in ("group_P", "num_rows_e", "masked_rows")})
    for run in (gated_activation_rows, gated_activation_rows_ref):
        h, h_scale = run(stacked, **kwargs)
        h_interleaved, h_scale_interleaved = run(interleaved, **kwargs, interleaved=True)
        bits = (lambda t: t[valid].view(torch.uint8)) if quant else (lambda t: t[valid])
        assert torch.equal(bits(h_interleaved), bits(h)), run.__name__
        if quant:
            assert torch.equal(h_scale_interleaved[valid], h_scale[valid]), run.__name__
    with pytest.raises(ShapeError, match="F % 128 == 0"):
        gated_activation_rows(stacked[:, :384], **kwargs, interleaved=True)
