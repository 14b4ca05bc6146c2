"""``_triton_utils.to_e4m3`` (every FP8 quantizer's cast) vs torch's ``.to(torch.float8_e4m3fn)``, bit for bit.

On a GPU the cast is one PTX ``cvt.rn.satfinite.e4m3x2.f32`` per two values; under the interpreter it rounds in
fp32 first. Both must give torch's bits at the values where a rounding can go wrong: every e4m3 value, every
midpoint between two neighbours (ties go to the even code) and one fp32 ulp either side of it, the subnormal
range, the top of the range (447.9 -> 448), signed zeros, and values too small for any code.
"""

import pytest
import torch
import triton
import triton.language as tl

from moe_ref.kernels.runtime._triton_utils import to_e4m3

pytestmark = pytest.mark.interpreter


@triton.jit
def _cast_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, to_e4m3(tl.load(x_ptr + offs, mask=mask, other=0.0)), mask=mask)


def _hard_values() -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = torch.unique(codes[torch.isfinite(codes) & (codes >= 0)])  # 0 .. 448, ascending
    mid = (grid[:-1].double() + grid[1:].double()) / 2  # exact in fp32: neighbours differ by a power of two
    mid = mid.float()
    below, above = torch.nextafter(mid, torch.zeros_like(mid)), torch.nextafter(mid, torch.full_like(mid, 1e9))
    extra = torch.tensor([447.9, 2 ** -10, 2 ** -10 * 1.0001, 2 ** -12, 1e-30, 0.0])
    positive = torch.cat([grid, mid, below, above, extra])
    return torch.cat([positive, -positive])


@pytest.mark.parametrize("values", ["hard", "random"])
def test_to_e4m3_gives_torchs_bits(values, device):
    if values == "hard":
        x = _hard_values()
    else:  # magnitudes from 2**-12 to 448, both signs
        gen = torch.Generator().manual_seed(0)
        x = torch.exp2(torch.empty(4099).uniform_(-12, 8.8, generator=gen)).clamp(max=448.0)
        x = x * torch.where(torch.rand(4099, generator=gen) < 0.5, -1.0, 1.0)
    x = x.to(device)
    got = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=device)
    _cast_kernel[(triton.cdiv(x.numel(), 256),)](x, got, x.numel(), BLOCK=256)
    want = x.cpu().to(torch.float8_e4m3fn)
    mismatch = got.cpu().view(torch.uint8) != want.view(torch.uint8)
    assert not mismatch.any(), f"{int(mismatch.sum())} of {x.numel()} differ, e.g. {x.cpu()[mismatch][:5].tolist()}"
