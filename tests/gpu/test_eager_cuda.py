"""One rank on CUDA: an eager MegaMoE call never waits for its GPU work (no host synchronization), and a failed
device check (NaN logits) is raised by the next call or by ``check()`` instead: on the launching path
(``eager_graph_max_tokens=0``) and on the layer's default, where a token count's later calls replay its CUDA graph
(``moe_ref.eager_graphs``; more of that path in test_eager_graphs_cuda.py)."""
from __future__ import annotations

import pytest
import torch

from moe_ref.core.config import preset
from moe_ref.core.errors import NonFiniteError
from moe_ref.layer import MegaMoE
from moe_ref.testing import sync_debug_mode

pytestmark = pytest.mark.cuda


# eager_graph_max_tokens: 0 launches every kernel each call; None (the default) replays T's graph from its 2nd call
GRAPH_BOUNDS = pytest.mark.parametrize("graph_tokens", [0, None], ids=["launching", "replaying"])


def _layer(dispatch_fp8: bool, graph_tokens: int | None) -> MegaMoE:
    return MegaMoE(preset("tiny-kimi-k2"), None, num_max_tokens_per_rank=64, overflow="chunk",
                   dispatch_fp8=dispatch_fp8, dtype=torch.bfloat16, device="cuda", seed=1,
                   eager_graph_max_tokens=graph_tokens)


@GRAPH_BOUNDS
@pytest.mark.parametrize("dispatch_fp8", [False, True])
@pytest.mark.parametrize("num_tokens", [0, 5, 64, 100])  # 100 > the cap: two chunks
def test_an_eager_call_on_one_gpu_does_not_synchronize(dispatch_fp8, num_tokens, graph_tokens):
    moe = _layer(dispatch_fp8, graph_tokens)
    x = torch.randn(num_tokens, moe.cfg.hidden_size, device="cuda").bfloat16()
    with torch.no_grad():
        for _ in range(2):  # the first calls compile and autotune the kernels (which synchronizes)
            expected = moe(x).clone()
        torch.cuda.synchronize()
        with sync_debug_mode("error"):  # any synchronizing CUDA call raises
            got = moe(x)
    torch.cuda.synchronize()
    assert torch.equal(got, expected), f"{dispatch_fp8=} {num_tokens=}"
    moe.destroy()


@GRAPH_BOUNDS
def test_nan_logits_are_raised_by_the_next_call_and_by_check(graph_tokens):
    moe = _layer(False, graph_tokens)
    x = torch.randn(8, moe.cfg.hidden_size, device="cuda").bfloat16()
    bad = x.clone()
    bad[3, 0] = float("nan")
    with torch.no_grad():
        moe(x)
        moe(bad)  # returns: the check's flag is read later (replaying: T's graph is captured and replayed here)
        torch.cuda.synchronize()  # the flags have arrived: the next call raises
        with pytest.raises(NonFiniteError, match=r"router logits are NaN/inf for 1 of 8 tokens"):
            moe(x)
        assert moe(x).shape == x.shape  # raised once; the layer goes on
        moe(bad)
        with pytest.raises(NonFiniteError):
            moe.check()
        moe.check()
    assert (moe.eager_graphs is None) if graph_tokens == 0 else (moe.eager_graphs.captures == 1)
    moe.destroy()
