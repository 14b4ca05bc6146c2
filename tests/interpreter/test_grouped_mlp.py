"""grouped_mlp (Triton) vs grouped_mlp_ref (torch) over expert-major pools with padding rows."""

import pytest
import torch

from moe_ref.kernels.fp8 import quantize_fp8_per_block_128
from moe_ref.kernels.grouped_mlp import grouped_mlp, grouped_mlp_ref
from moe_ref.kernels.pre_dispatch import quantize_fp8_per_128

pytestmark = pytest.mark.interpreter

FP8 = torch.float8_e4m3fn

# name -> rows per expert; segments start at multiples of ALIGN (the interpreter's BLOCK_M is 16)
LAYOUTS = {
    "empty_expert_and_ragged": [5, 0, 19],
    "all_rows_in_one_expert": [0, 0, 33],
    "block_multiple_and_single_row": [16, 1, 32],
}
ALIGN = 16


def _layout(counts, device):
    starts, row = [], 0
    for count in counts:
        starts.append(row)
        row += -(-count // ALIGN) * ALIGN
    num_rows = row + ALIGN  # a trailing padding block too
    return (torch.tensor(starts, dtype=torch.int64, device=device),
            torch.tensor(counts, dtype=torch.int32, device=device), num_rows)


def _valid_rows(row_start_e, num_rows_e, num_rows):
    valid = torch.zeros(num_rows, dtype=torch.bool)
    for start, count in zip(row_start_e.tolist(), num_rows_e.tolist()):
        valid[start:start + count] = True
    return valid


def _inputs(counts, hidden, inter, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    row_start_e, num_rows_e, num_rows = _layout(counts, device)
    num_experts = len(counts)
    x_RD = torch.randn(num_rows, hidden, generator=gen)
    x_RD[~_valid_rows(row_start_e, num_rows_e, num_rows)] = float("nan")  # padding garbage is never read
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    return (x_RD.to(dtype).to(device), gate_up.to(dtype).to(device), down.to(dtype).to(device),
            row_start_e, num_rows_e)


def _check_padding_zero(y_RD, row_start_e, num_rows_e, **case):
    pad = ~_valid_rows(row_start_e, num_rows_e, y_RD.shape[0])
    assert (y_RD.cpu()[pad] == 0).all(), f"padding rows must be zero: {case=}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("activation,situ_linear_beta", [("silu", 25.0), ("situ", 25.0), ("situ", 0.0)])
def test_matches_twin(layout, dtype, activation, situ_linear_beta, device, assert_close):
    hidden, inter = 48, 40  # not powers of two
    x_RD, gate_up, down, row_start_e, num_rows_e = _inputs(LAYOUTS[layout], hidden, inter, dtype, device)
    kwargs = dict(activation=activation, situ_beta=4.0, situ_linear_beta=situ_linear_beta)
    y_RD = grouped_mlp(x_RD, gate_up, down, row_start_e, num_rows_e, **kwargs)
    y_ref = grouped_mlp_ref(x_RD, gate_up, down, row_start_e, num_rows_e, **kwargs)
    case = dict(layout=layout, dtype=dtype, activation=activation, situ_linear_beta=situ_linear_beta)
    _check_padding_zero(y_RD, row_start_e, num_rows_e, **case)
    assert_close(y_RD, y_ref, dtype, **case)


@pytest.mark.parametrize("activation", ["silu", "situ"])
@pytest.mark.parametrize("hidden,inter", [(48, 40), (160, 136)])  # second: 2 scale groups on D and F
def test_fp8_matches_twin(activation, hidden, inter, device, assert_close):
    x_RD, gate_up, down, row_start_e, num_rows_e = _inputs(LAYOUTS["empty_expert_and_ragged"], hidden, inter,
                                                           torch.float32, device, seed=1)
    x_fp8, x_scale = quantize_fp8_per_128(x_RD.nan_to_num(0.0))
    gate_up_fp8, gate_up_scale = quantize_fp8_per_block_128(gate_up)
    down_fp8, down_scale = quantize_fp8_per_block_128(down)
    args = (x_fp8, gate_up_fp8, down_fp8, row_start_e, num_rows_e, activation)
    kwargs = dict(x_scale_RDb=x_scale, gate_up_scale=gate_up_scale, down_scale=down_scale)
    y_RD = grouped_mlp(*args, **kwargs)
    y_ref = grouped_mlp_ref(*args, **kwargs)
    assert y_RD.dtype == torch.bfloat16
    _check_padding_zero(y_RD, row_start_e, num_rows_e, activation=activation, hidden=hidden)
    assert_close(y_RD, y_ref, "fp8", activation=activation, hidden=hidden, inter=inter)
    # and close to the unquantized fp32 MLP (fp8 error budget)
    y_fp32 = grouped_mlp_ref(x_RD, gate_up, down, row_start_e, num_rows_e, activation)
    rel = (y_RD.float() - y_fp32).norm() / y_fp32.norm()
    assert rel < 0.1, f"{rel=} {activation=} {hidden=}"


def test_no_rows_at_all_gives_zeros(device):
    x_RD, gate_up, down, row_start_e, num_rows_e = _inputs([0, 0], 16, 8, torch.float32, device)
    y_RD = grouped_mlp(x_RD, gate_up, down, row_start_e, num_rows_e)
    assert torch.equal(y_RD, torch.zeros_like(y_RD))


def test_worked_example(device):
    x_RD = torch.tensor([[2.0]], device=device)
    gate_up = torch.tensor([[[1.0], [3.0]]], device=device)
    down = torch.tensor([[[1.0]]], device=device)
    y = grouped_mlp(x_RD, gate_up, down, torch.tensor([0], device=device), torch.tensor([1], device=device))
    assert abs(y.item() - 2.0 * torch.sigmoid(torch.tensor(2.0)).item() * 6.0) < 1e-5


def test_bad_shapes_raise_value_error(device):
    x_RD, gate_up, down, row_start_e, num_rows_e = _inputs([3], 16, 8, torch.float32, device)
    with pytest.raises(ValueError, match="weight shapes"):
        grouped_mlp(x_RD, gate_up[:, :15], down, row_start_e, num_rows_e)
    with pytest.raises(ValueError, match="activation"):
        grouped_mlp(x_RD, gate_up, down, row_start_e, num_rows_e, activation="gelu")
    with pytest.raises(ValueError, match="x_scale_RDb"):
        grouped_mlp(x_RD.to(FP8), gate_up.to(FP8), down.to(FP8), row_start_e, num_rows_e)
