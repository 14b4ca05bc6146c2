"""The batch-invariant mode on one GPU (docs/batch_invariance.md): the fixed-tile GEMM against its twin; a token alone
equals the token in a batch (bf16, fp32, FP8 dispatch; Kimi-K2, Kimi-K3's latent path, Step3); eager launches,
the layer's eager-graph replays, a user's CUDA graph and torch.compile give the same bits; the default mode's lone
token differs where it does (positive control, reported, not asserted: cuBLAS and the autotuner may agree); the slot
sum's one-launch kernel equals its torch loop bitwise at Kimi-K2's sizes."""
from __future__ import annotations

import pytest
import torch

from moe_ref import MegaMoE
from moe_ref.ep.batch_invariant import rows_with_other_bits, sum_slots, sum_slots_ref
from moe_ref.kernels.runtime.fixed_tiles import fixed_tile_matmul, fixed_tile_matmul_ref

pytestmark = pytest.mark.cuda
SIZES = (1, 2, 3, 17, 64, 129)


def tokens(num: int, hidden: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(num, hidden, device="cuda", generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fixed_tile_matmul_is_row_invariant_and_near_its_twin(dtype):
    a, b = tokens(300, 7168 // 8, dtype), tokens(384, 7168 // 8, dtype, seed=2)
    full = fixed_tile_matmul(a, b, torch.float32)
    for size in SIZES:
        assert rows_with_other_bits(fixed_tile_matmul(a[-size:], b, torch.float32), full[-size:]) == 0, size
    torch.testing.assert_close(full, fixed_tile_matmul_ref(a.cpu(), b.cpu(), torch.float32).cuda(), rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("preset", ["tiny-kimi-k2", "tiny-kimi-k3", "tiny-step3"])
@pytest.mark.parametrize("dtype, dispatch_fp8", [(torch.bfloat16, False), (torch.bfloat16, True),
                                                 (torch.float32, False)])
def test_a_token_alone_equals_the_token_in_a_batch(preset, dtype, dispatch_fp8):
    moe = MegaMoE(preset, seed=0, dtype=dtype, device="cuda", batch_invariant=True, dispatch_fp8=dispatch_fp8,
                  num_max_tokens_per_rank=256, eager_graph_max_tokens=0)
    x = tokens(160, moe.cfg.hidden_size, dtype)
    with torch.no_grad():
        full = moe(x)
        for size in SIZES:
            assert rows_with_other_bits(moe(x[-size:]), full[-size:]) == 0, size
        default = MegaMoE(preset, seed=0, dtype=dtype, device="cuda", dispatch_fp8=dispatch_fp8,
                          num_max_tokens_per_rank=256, eager_graph_max_tokens=0)
        print(f"default mode, a lone token vs in the batch: {rows_with_other_bits(default(x[-1:]), default(x)[-1:])} "
              f"row(s) differ")
    moe.destroy()


def test_eager_replay_graph_and_compile_agree_bitwise():
    moe = MegaMoE("tiny-kimi-k2", seed=0, dtype=torch.bfloat16, device="cuda", batch_invariant=True,
                  num_max_tokens_per_rank=64)
    x = tokens(24, moe.cfg.hidden_size, torch.bfloat16)
    with torch.no_grad():
        launched = moe.eager_forward(x, read_checks_now=True).clone()  # read_checks_now: no eager graph
        replayed = [moe(x).clone() for _ in range(3)][-1]  # the second call captures, the third replays
        static = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = moe(static)
        graph.replay()
        compiled = torch.compile(moe, fullgraph=True)(x)
    torch.cuda.synchronize()
    for name, y in (("eager graph", replayed), ("user graph", captured), ("torch.compile", compiled)):
        assert rows_with_other_bits(y, launched) == 0, name
    moe.destroy()


@pytest.mark.parametrize("num_tokens", [1, 128, 4096])
def test_slot_sum_kernel_equals_the_torch_loop_bitwise_at_kimi_k2_sizes(num_tokens):
    """K = 8, Dx = 7168, bf16 rows: about a quarter of the slots masked (their rows NaN, never summed), token 0 wholly
    masked where T > 1, a few zero and subnormal weights (the kernel must not flush them)."""
    K, Dx = 8, 7168
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    rows_TKDx = (torch.randn(num_tokens, K, Dx, device="cuda", generator=gen) * 4).to(torch.bfloat16)
    ids_TK = torch.randint(0, 384, (num_tokens, K), device="cuda", generator=gen)
    ids_TK[torch.rand(num_tokens, K, device="cuda", generator=gen) < 0.25] = -1
    if num_tokens > 1:
        ids_TK[0] = -1
    rows_TKDx[ids_TK < 0] = float("nan")
    weights_TK = torch.rand(num_tokens, K, device="cuda", generator=gen)
    special_TK = torch.randint(0, 8, (num_tokens, K), device="cuda", generator=gen)
    weights_TK = torch.where(special_TK == 0, 0.0, torch.where(special_TK == 1, weights_TK * 1e-39, weights_TK))
    got_TDx = sum_slots(rows_TKDx, ids_TK, weights_TK, torch.bfloat16)  # CUDA: the kernel
    assert rows_with_other_bits(got_TDx, sum_slots_ref(rows_TKDx, ids_TK, weights_TK, torch.bfloat16)) == 0
    assert not got_TDx.isnan().any()
    got_fp32_TDx = sum_slots(rows_TKDx, ids_TK, weights_TK, torch.float32)
    assert rows_with_other_bits(got_fp32_TDx, sum_slots_ref(rows_TKDx, ids_TK, weights_TK, torch.float32)) == 0
