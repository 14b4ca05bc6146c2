"""One symmetric buffer per EP group, shared by every MoE layer with the same plan."""
from __future__ import annotations

import pytest
import torch

from moe_ref.ep.buffer import live_shared_buffers
from moe_ref.ep.capacity import plan_report
from moe_ref.core.config import ParallelConfig, preset
from moe_ref.layer import MegaMoE
from moe_ref.reference import reference_moe
from moe_ref.testing import assert_close
from moe_ref.core.weights import MoEWeights

pytestmark = pytest.mark.unit


def test_many_layers_share_one_buffer_and_keep_their_own_counters():
    cfg = preset("tiny-kimi-k2")
    before = live_shared_buffers()
    layers = [MegaMoE(cfg, num_max_tokens_per_rank=23, seed=seed) for seed in range(6)]  # caps no other test uses
    other_cap = MegaMoE(cfg, num_max_tokens_per_rank=11, seed=9)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(5 + i, cfg.hidden_size, generator=gen) for i in range(len(layers))]
    with torch.no_grad():
        for _ in range(2):  # interleaved: every layer's call overwrites the shared regions
            for seed, (layer, x) in enumerate(zip(layers, xs)):
                assert_close(layer(x), reference_moe(x, MoEWeights.random(cfg, seed=seed), cfg), torch.float32)
        other_cap(xs[0])
    assert live_shared_buffers() == before + 2  # one per plan: cap 23 and cap 11
    buffers = {id(layer.routed_step.dispatcher.buffer) for layer in layers}
    assert len(buffers) == 1
    counts = [int(layer.num_recv_tokens_per_expert.sum()) for layer in layers]
    assert counts == [2 * cfg.num_topk * x.shape[0] for x in xs], counts  # each layer counts its own rows
    for layer in layers[:-1]:
        layer.destroy()
    assert live_shared_buffers() == before + 2  # the last user keeps it
    with torch.no_grad():
        y = layers[-1](xs[-1])
    assert_close(y, reference_moe(xs[-1], MoEWeights.random(cfg, seed=5), cfg), torch.float32)
    layers[-1].destroy()
    other_cap.destroy()
    assert live_shared_buffers() == before


def test_plan_prints_the_model_total_for_one_shared_buffer():
    cfg = preset("kimi-k2")
    text = plan_report(cfg, ParallelConfig(ep_size=8), 4096)
    assert f"Model total: {len(cfg.moe_layers)} MoE layers share ONE buffer per rank" in text


def test_a_layer_dropped_without_destroy_releases_its_use_of_the_buffer():
    import gc

    cfg = preset("tiny-kimi-k2")
    before = live_shared_buffers()
    layer = MegaMoE(cfg, num_max_tokens_per_rank=29, seed=0)
    with torch.no_grad():
        layer(torch.randn(3, cfg.hidden_size))
    assert live_shared_buffers() == before + 1
    del layer
    gc.collect()
    assert live_shared_buffers() == before

