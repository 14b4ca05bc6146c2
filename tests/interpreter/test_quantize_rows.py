"""quantize_rows_fp8 (Triton, one launch) vs its torch twins kernels.fp8.quantize_fp8_per_128 and, per row (the W4A8
experts' rows), kernels.fp8.quantize_fp8_per_row: the same bits."""

import pytest
import torch

from moe_ref.core.errors import DTypeError, ShapeError
from moe_ref.kernels.experts.quantize_rows import quantize_rows_fp8, quantize_rows_fp8_ref

pytestmark = pytest.mark.interpreter


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_rows,dim", [(1, 128), (17, 200), (40, 384), (3, 40)])  # partial row blocks and groups
@pytest.mark.parametrize("per_row", [False, True])
def test_matches_twin_bitwise(dtype, num_rows, dim, per_row, device):
    gen = torch.Generator().manual_seed(num_rows * dim)
    x_PDx = torch.randn(num_rows, dim, generator=gen) * torch.logspace(-6, 2, num_rows)[:, None]  # tiny to large rows
    x_PDx[0, :] = 0.0  # amax 0: the 1e-4 floor
    x_PDx[-1, -1] = 1e4 if dtype != torch.float16 else 6e4  # one large value: its group's scale, no other group's
    x_PDx = x_PDx.to(dtype).to(device)
    got, got_scale = quantize_rows_fp8(x_PDx, per_row=per_row)
    want, want_scale = quantize_rows_fp8_ref(x_PDx, per_row=per_row)
    assert got.shape == (num_rows, dim)
    assert got_scale.shape == ((num_rows,) if per_row else (num_rows, -(-dim // 128)))
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (dtype, num_rows, dim, per_row)
    assert torch.equal(got_scale, want_scale), (dtype, num_rows, dim, per_row)
    if per_row:  # one scale per row: the row's largest value maps to 448 (the amax floor aside)
        assert torch.equal(want_scale, x_PDx.float().abs().amax(-1).cpu().clamp(min=1e-4).to(device) / 448)


def test_row_strides_and_empty_inputs(device):
    """A view with a row stride (the first 100 columns of wider rows) quantizes as its copy; no rows, no launch."""
    wide = torch.randn(9, 256, generator=torch.Generator().manual_seed(1)).bfloat16().to(device)
    view = wide[:, :100]
    got, got_scale = quantize_rows_fp8(view)
    want, want_scale = quantize_rows_fp8_ref(view.contiguous())
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)) and torch.equal(got_scale, want_scale)
    empty, empty_scale = quantize_rows_fp8(torch.zeros(0, 256, dtype=torch.bfloat16, device=device))
    assert empty.shape == (0, 256) and empty_scale.shape == (0, 2)
    empty, empty_scale = quantize_rows_fp8(torch.zeros(0, 256, dtype=torch.bfloat16, device=device), per_row=True)
    assert empty.shape == (0, 256) and empty_scale.shape == (0,)
    got, got_scale = quantize_rows_fp8(view, per_row=True)
    want, want_scale = quantize_rows_fp8_ref(view.contiguous(), per_row=True)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)) and torch.equal(got_scale, want_scale)


def test_bad_inputs_are_coded_errors(device):
    with pytest.raises(ShapeError, match="contiguous last dimension"):
        quantize_rows_fp8(torch.zeros(8, 256, device=device).t())
    with pytest.raises(ShapeError, match=r"\[P, Dx\]"):
        quantize_rows_fp8(torch.zeros(2, 4, 128, device=device))
    with pytest.raises(DTypeError, match="bf16/fp16/fp32"):
        quantize_rows_fp8(torch.zeros(4, 128, dtype=torch.int32, device=device))
