"""One rank on CUDA: eager calls of a token count replay the CUDA graph the layer captured for it
(``moe_ref.eager_graphs``) and return the bits of the launch-by-launch eager path, device checks included."""
from __future__ import annotations

import pytest
import torch

from moe_ref import eager_graphs
from moe_ref.core.config import preset
from moe_ref.core.weights import MoEWeights
from moe_ref.layer import MegaMoE
from moe_ref.testing import sync_debug_mode

pytestmark = pytest.mark.cuda


def _layer(dispatch_fp8: bool = False, **options) -> MegaMoE:
    return MegaMoE(preset("tiny-kimi-k2"), None, num_max_tokens_per_rank=64, overflow="chunk",
                   dispatch_fp8=dispatch_fp8, dtype=torch.bfloat16, device="cuda", seed=1, **options)


def _inputs(num_tokens: int, width: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(num_tokens, width, device="cuda", generator=gen).bfloat16()


@pytest.mark.parametrize("dispatch_fp8", [False, True])
def test_replays_equal_the_launching_path_bitwise(dispatch_fp8):
    moe, launching = _layer(dispatch_fp8), _layer(dispatch_fp8, eager_graph_max_tokens=0)
    width = moe.cfg.hidden_size
    with torch.no_grad():
        for num_tokens in (1, 5, 64):
            for call in range(4):  # the first eager, the second captured and replayed, then replays of new inputs
                x = _inputs(num_tokens, width, seed=100 * num_tokens + call)
                got, want = moe(x), launching(x)
                assert torch.equal(got, want), f"{dispatch_fp8=} {num_tokens=} {call=}"
        assert moe.eager_graphs.captures == 3 and len(moe.eager_graphs) == 3
        assert launching.eager_graphs is None
        assert moe.routed_step.calls == launching.routed_step.calls == 12
        assert torch.equal(moe.num_recv_tokens_per_expert, launching.num_recv_tokens_per_expert)
    moe.destroy()
    launching.destroy()


def test_a_replay_does_not_synchronize_and_its_output_is_not_overwritten():
    moe = _layer()
    x, y = (_inputs(8, moe.cfg.hidden_size, seed) for seed in (1, 2))
    with torch.no_grad():
        moe(x)
        first = moe(x)  # captured and replayed
        torch.cuda.synchronize()
        expected_first = first.clone()
        with sync_debug_mode("error"):  # any synchronizing CUDA call raises
            second = moe(y)
        torch.cuda.synchronize()
    assert torch.equal(first, expected_first), "a later replay overwrote an earlier call's output"
    assert not torch.equal(second, first)
    moe.destroy()


def test_layers_sharing_the_graph_buffers_keep_their_own_outputs():
    first, second = _layer(), MegaMoE(preset("tiny-kimi-k2"), None, num_max_tokens_per_rank=64, overflow="chunk",
                                      dtype=torch.bfloat16, device="cuda", seed=2)
    twins = [MegaMoE(preset("tiny-kimi-k2"), None, num_max_tokens_per_rank=64, overflow="chunk", dtype=torch.bfloat16,
                     device="cuda", seed=seed, eager_graph_max_tokens=0) for seed in (1, 2)]
    with torch.no_grad():
        outputs = []
        for call in range(4):  # alternating layers, one T: replays of both layers' graphs interleave
            x = _inputs(6, first.cfg.hidden_size, call)
            outputs += [(first(x), twins[0](x)), (second(x), twins[1](x))]
        torch.cuda.synchronize()
    assert first.eager_graphs.captures == second.eager_graphs.captures == 1
    for index, (got, want) in enumerate(outputs):
        assert torch.equal(got, want), f"output {index} changed after later replays"
    for layer in (first, second, *twins):
        layer.destroy()


def test_tokens_above_the_bound_and_a_users_own_capture_take_the_eager_path():
    moe = _layer(eager_graph_max_tokens=16)
    with torch.no_grad():
        big = _inputs(32, moe.cfg.hidden_size, 3)
        for _ in range(3):
            moe(big)
        assert moe.eager_graphs.captures == 0
        x = _inputs(4, moe.cfg.hidden_size, 4)
        moe(x)
        moe(x)
        assert moe.eager_graphs.captures == 1
        static_x = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # a user's capture of the same T: the layer's graph is not nested in it
            static_y = moe(static_x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, moe(x))
        assert moe.eager_graphs.captures == 1
    moe.destroy()


def test_loading_weights_drops_the_graphs():
    moe = _layer()
    fresh = _layer(eager_graph_max_tokens=0)
    x = _inputs(8, moe.cfg.hidden_size, 6)
    new_weights = MoEWeights.random(moe.cfg, seed=7, dtype=torch.bfloat16)
    with torch.no_grad():
        moe(x)
        moe(x)
        assert len(moe.eager_graphs) == 1
        moe.load_weights(new_weights)
        fresh.load_weights(new_weights)
        assert len(moe.eager_graphs) == 0
        for _ in range(3):
            assert torch.equal(moe(x), fresh(x))
    assert moe.eager_graphs.captures == 2
    moe.destroy()
    fresh.destroy()


def test_the_least_recently_used_graph_goes_past_the_limit(monkeypatch):
    monkeypatch.setattr(eager_graphs, "MAX_GRAPHS", 2)
    moe = _layer()
    with torch.no_grad():
        for num_tokens in (1, 2, 3):
            x = _inputs(num_tokens, moe.cfg.hidden_size, num_tokens)
            moe(x)
            moe(x)
        assert len(moe.eager_graphs) == 2 and moe.eager_graphs.captures == 3
        x = _inputs(1, moe.cfg.hidden_size, 1)
        launching = _layer(eager_graph_max_tokens=0)
        assert torch.equal(moe(x), launching(x))  # T = 1 was dropped: captured again, same bits
        assert moe.eager_graphs.captures == 4
    moe.destroy()
    launching.destroy()


def test_calls_in_and_out_of_inference_mode_mix():
    moe = _layer()
    x = _inputs(4, moe.cfg.hidden_size, 8)
    with torch.inference_mode():
        moe(x)
        a = moe(x)  # captured in inference mode
    with torch.no_grad():
        b = moe(x)  # replayed outside it
    assert torch.equal(a, b)
    moe.destroy()


def test_the_first_call_warms_every_token_count_up_and_leaves_no_trace():
    """One rank on CUDA, Triton experts on recorded tiles: the first eager call runs the layer on zero tokens of each
    ``runtime.warm_up_counts`` first (the kernel variants of every rows bucket loaded up front); afterwards the call
    count and the per-expert rows are those of the user's calls alone, and the outputs equal a layer that skipped the
    warm-up, bit for bit."""
    from moe_ref.kernels.experts.grouped_mlp import tiles_recorded
    from moe_ref.layer import runtime

    warmed, cold = _layer(), _layer()
    cold._warm = True  # as if warmed already: its first call runs only the user's tokens
    seen = []
    device_work = warmed._device_work
    warmed._device_work = lambda x_TD, *args, **kwargs: (seen.append(x_TD.shape[0]), device_work(x_TD, *args,
                                                                                                    **kwargs))[1]
    width = warmed.cfg.hidden_size
    with torch.no_grad():
        for num_tokens in (5, 5, 17):
            x = _inputs(num_tokens, width, seed=num_tokens)
            assert torch.equal(warmed(x), cold(x)), num_tokens
    if tiles_recorded(torch.device("cuda")) and warmed.experts.name == "triton":
        assert seen[:8] == runtime.warm_up_counts(64) == [1, 2, 3, 4, 8, 16, 32, 64]
    else:  # tiles autotuned here (no table for this GPU class): each bucket is left to the call that meets it
        assert seen[0] == 5, seen
    assert warmed.routed_step.calls == cold.routed_step.calls == 3
    assert torch.equal(warmed.num_recv_tokens_per_expert, cold.num_recv_tokens_per_expert)
    assert int(warmed.num_recv_tokens_per_expert.sum()) == (5 + 5 + 17) * warmed.cfg.num_topk


def test_the_repr_reports_the_graphs_and_their_pool():
    """After a capture the layer's repr names its graphs, and the device's graph pool reserves memory (the
    allocator snapshot's pool ids match the pool the graphs were captured into)."""
    moe = _layer()
    x = _inputs(5, moe.cfg.hidden_size, seed=1)
    with torch.no_grad():
        for _ in range(3):
            moe(x)
    memory = eager_graphs.graph_memory(moe.options.device)
    assert memory["graphs"] >= 1 and memory["pool_bytes"] and memory["pool_bytes"] > 0, memory
    assert memory["io_bytes"] >= 2 * moe.options.eager_graph_max_tokens * moe.cfg.hidden_size * 2
    assert "eager graphs 1 (at most 32" in repr(moe), repr(moe)
