"""The bound launch path (``moe_ref.kernels.runtime.launch``) on a GPU: a bound kernel computes what Triton's own launch
computes, also on the arguments Triton specializes on (an unaligned base, a size of 1 or a multiple of 16), and
the whole layer gives the same bits with and without it (``bound_launches(False)``, as ``MOE_REF_BOUND_LAUNCH=0``)."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from moe_ref.core.config import preset
from moe_ref.kernels.runtime import launch as bl
from moe_ref.layer import MegaMoE

pytestmark = pytest.mark.cuda


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr, SQUARE: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    if SQUARE:
        x = x * x
    tl.store(out_ptr + offs, alpha * x + tl.load(y_ptr + offs, mask=mask), mask=mask)


def _axpy(x, y, alpha, square=False):
    out = torch.full_like(x, -1.0)
    n = x.numel()
    bl.launch(_axpy_kernel, (triton.cdiv(n, 128),), x, y, out, n, alpha, BLOCK=128, **({"SQUARE": True} if square else {}))
    return out


@pytest.mark.parametrize("n", [1, 16, 100, 1000, 4096])
def test_a_bound_kernel_computes_what_triton_computes(n, monkeypatch):
    bl.clear_bound_kernels()
    through_triton = []
    triton_run = _axpy_kernel.run
    monkeypatch.setattr(_axpy_kernel, "run", lambda *a, **k: through_triton.append(1) or triton_run(*a, **k))
    storage = torch.randn(3, n + 1, device="cuda")
    for offset in (0, 1, 0):  # aligned, then an unaligned base (another specialization), then aligned again
        x, y = storage[0, offset:offset + n], storage[1, offset:offset + n]
        for alpha, square in ((0.5, False), (2.0, False), (2.0, True), (-1.0, False)):
            want = alpha * (x * x if square else x) + y
            torch.testing.assert_close(_axpy(x, y, alpha, square), want, rtol=1e-6, atol=1e-6)
    # one Triton launch per key (aligned / unaligned base x SQUARE or not); the other 8 of 12 ran bound
    assert len(through_triton) == 4 and bl.bound_kernels() == 4


def test_bound_launches_call_tritons_c_launcher_where_it_is_safe():
    """On Triton 3.6 (the GPU image) a bound kernel without scratch memory calls the C launcher directly (what the
    launcher object would call); the launcher object is recognized by its source, so check it is recognized here."""
    bl.clear_bound_kernels()
    x = torch.randn(100, device="cuda")
    for _ in range(2):
        _axpy(x, x, 1.0)
    bounds = [bound for sites in bl._SITES.values() for _, bound_of in sites.entries for bound in bound_of.values()]
    assert len(bounds) == 1
    (bound,) = bounds
    launcher = bound.compiled.run
    if triton.__version__.startswith("3.6"):
        assert bound.call is launcher.launch
    else:  # another Triton: the launcher object unless it has 3.6's shape
        assert bound.call is (launcher.launch if bl._c_launcher(launcher) is not None else launcher)


@pytest.mark.parametrize("dispatch_fp8", [False, True])
def test_the_layer_gives_the_same_bits_with_and_without_bound_launches(dispatch_fp8):
    # eager_graph_max_tokens=0: every call launches its kernels (a replayed graph would not launch any)
    moe = MegaMoE(preset("tiny-kimi-k2"), None, num_max_tokens_per_rank=64, overflow="chunk",
                  dispatch_fp8=dispatch_fp8, dtype=torch.bfloat16, device="cuda", seed=3, eager_graph_max_tokens=0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = [torch.randn(t, moe.cfg.hidden_size, device="cuda", generator=gen).bfloat16() for t in (5, 64, 1, 5, 100)]
    with torch.no_grad():
        bl.clear_bound_kernels()
        bound = [moe(x).clone() for x in inputs for _ in range(2)]
        assert bl.bound_kernels() > 0
        bl.clear_bound_kernels()
        with bl.bound_launches(False):
            plain = [moe(x).clone() for x in inputs for _ in range(2)]
        assert bl.bound_kernels() == 0
    for i, (got, want) in enumerate(zip(bound, plain)):
        assert torch.equal(got, want), f"input {i // 2} call {i % 2}"
    moe.destroy()


def test_a_tma_kernel_bound_computes_what_triton_computes_on_every_pool():
    """The grouped GEMM with host TMA descriptors, bound: on Triton 3.6 it calls the C launcher with descriptors encoded
    once per base address (``_EncodedDescriptors``), so pools at other addresses, met in turn, must each get their
    own encoding: every launch gives the bits of Triton's own launch on the same pool."""
    from moe_ref.kernels.experts import grouped_mlp_tiles as tiles
    from moe_ref.kernels.experts.grouped_mlp import launch_gemm

    gen = torch.Generator(device="cuda").manual_seed(1)
    num_experts, n, k = 4, 256, 512
    b = torch.randn(num_experts, n, k, device="cuda", generator=gen).bfloat16()
    num_rows_e = torch.tensor([3, 0, 70, 1], dtype=torch.int32, device="cuda")
    row_start_e = torch.tensor([0, 3, 3, 73], dtype=torch.int64, device="cuda")
    pools = [torch.randn(80, k, device="cuda", generator=gen).bfloat16() for _ in range(3)]
    config = tiles.config_of_tile((64, 128, 64, 4, 3))

    def gemm(a):
        c = torch.zeros(a.shape[0], n, dtype=torch.bfloat16, device="cuda")
        launch_gemm(a, None, b, None, c, None, row_start_e, num_rows_e, n=n, k=k, activation="none", situ_beta=4.0,
                    situ_linear_beta=0.0, fp8=False, quant_out=False, rows_hint=74, config=config, tma=True)
        return c

    bl.clear_bound_kernels()
    with bl.bound_launches(False):
        want = [gemm(a) for a in pools]
    got = [gemm(pools[i]) for i in (0, 1, 2, 0, 2, 1, 0)]
    for i, c in zip((0, 1, 2, 0, 2, 1, 0), got):
        assert torch.equal(c, want[i]), f"pool {i}"
    bounds = [bound for sites in bl._SITES.values() for _, bound_of in sites.entries for bound in bound_of.values()]
    assert len(bounds) == 1
    if triton.__version__.startswith("3.6"):  # the image's Triton: its descriptor wrapper is recognized and bypassed
        (bound,) = bounds
        assert bound.descriptors is not None and len(bound.descriptors.encoded) == 3
