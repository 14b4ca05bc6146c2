"""``_triton_utils.to_e4m3`` (every FP8 quantizer's cast) and ``to_e5m2`` (the W4A8 kernel's MXFP4 weights) vs
torch's ``.to(torch.float8_e4m3fn)`` / ``.to(torch.float8_e5m2)``, bit for bit.

On a GPU each cast is one PTX ``cvt.rn.satfinite`` per two values; under the interpreter it rounds in fp32 first.
Both must give torch's bits at the values where a rounding can go wrong: every value of the format, every midpoint
between two neighbours (ties go to the even code) and one fp32 ulp either side of it, the subnormal range, the top
of the range (447.9 -> 448 in e4m3), signed zeros, and values too small for any code.
"""

import pytest
import torch
import triton
import triton.language as tl

from moe_ref.kernels.runtime._triton_utils import to_e4m3, to_e5m2

pytestmark = pytest.mark.interpreter


@triton.jit
def _cast_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, E5M2: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if E5M2:
        y = to_e5m2(x)
    else:
        y = to_e4m3(x)
    tl.store(y_ptr + offs, y, mask=mask)


def _hard_values(fp8: torch.dtype, extra: list[float]) -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).float()
    grid = torch.unique(codes[torch.isfinite(codes) & (codes >= 0)])  # 0 .. the largest finite, ascending
    mid = (grid[:-1].double() + grid[1:].double()) / 2  # exact in fp32: neighbours differ by a power of two
    mid = mid.float()
    below, above = torch.nextafter(mid, torch.zeros_like(mid)), torch.nextafter(mid, torch.full_like(mid, 1e9))
    positive = torch.cat([grid, mid, below, above, torch.tensor(extra)])
    return torch.cat([positive, -positive])


# per format: (its torch dtype, the largest finite, the random magnitudes' log2 range, values the grid may miss)
FORMATS = {
    "e4m3": (torch.float8_e4m3fn, 448.0, (-12, 8.8), [447.9, 2 ** -10, 2 ** -10 * 1.0001, 2 ** -12, 1e-30, 0.0]),
    "e5m2": (torch.float8_e5m2, 57344.0, (-18, 15.8), [57343.0, 2 ** -17, 1.5 * 2 ** -17, 2 ** -19, 1e-30, 0.0]),
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("values", ["hard", "random"])
def test_fp8_casts_give_torchs_bits(fmt, values, device):
    fp8, largest, (low, high), extra = FORMATS[fmt]
    if values == "hard":
        x = _hard_values(fp8, extra)
    else:  # magnitudes from 2**low to the largest finite, both signs
        gen = torch.Generator().manual_seed(0)
        x = torch.exp2(torch.empty(4099).uniform_(low, high, generator=gen)).clamp(max=largest)
        x = x * torch.where(torch.rand(4099, generator=gen) < 0.5, -1.0, 1.0)
    x = x.to(device)
    got = torch.empty(x.shape, dtype=fp8, device=device)
    _cast_kernel[(triton.cdiv(x.numel(), 256),)](x, got, x.numel(), BLOCK=256, E5M2=fmt == "e5m2")
    want = x.cpu().to(fp8)
    mismatch = got.cpu().view(torch.uint8) != want.view(torch.uint8)
    assert not mismatch.any(), (f"{fmt}: {int(mismatch.sum())} of {x.numel()} differ, "
                                f"e.g. {x.cpu()[mismatch][:5].tolist()}")
