"""EPLB in the layer on one GPU: replica routing is graph-safe (a captured call replays with the identity placement's
output equal to the no-EPLB layer's, bitwise) and its one kernel equals the torch twin bitwise, the telemetry counts
rows inside the graph's replays without a host sync, and after a rebalance (every slot moved on the device) a graph
captured again gives the same output. CPU twins: tests/unit/test_eplb_layer.py and (the kernel under the Triton
interpreter) tests/interpreter/test_replica_route.py."""
from __future__ import annotations

import pytest
import torch

from moe_ref import MegaMoE
from moe_ref.eplb import Placement
from moe_ref.eplb.slots import ExpertSlots
from moe_ref.kernels.router.replica_route import replica_route_ref
from moe_ref.testing import graphed

pytestmark = pytest.mark.cuda

PRESET = "tiny-kimi-k2"  # E = 16, K = 4


def _layers():
    common = dict(num_max_tokens_per_rank=64, dtype=torch.bfloat16, device="cuda", eager_graph_max_tokens=0)
    base = MegaMoE(PRESET, None, seed=0, **common)
    eplb = MegaMoE(PRESET, None, seed=0, num_redundant_experts=0,
                   placement=Placement(torch.arange(16).unsqueeze(0), 16, 1), **common)
    return base, eplb


def test_a_captured_call_maps_replicas_on_the_device_and_counts_rows():
    base, eplb = _layers()
    x = torch.randn(48, base.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        expected = base(x)
        replay = graphed(eplb, x.clone())
        eplb.reset_expert_load()
        for _ in range(3):
            y = replay(x)
        assert torch.equal(y, expected)
        assert int(eplb.expert_load().rows_Ph.sum()) == 3 * 48 * base.cfg.num_topk


def test_after_a_rebalance_a_graph_captured_again_gives_the_same_output():
    base, eplb = _layers()
    x = torch.randn(32, base.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        before = graphed(eplb, x.clone())(x).clone()
        eplb.rebalance(Placement(torch.arange(15, -1, -1).unsqueeze(0), 16, 1))  # every slot moves
        torch.testing.assert_close(graphed(eplb, x.clone())(x), before)
        assert eplb.expert_slots.local_experts() == list(range(15, -1, -1))


@pytest.mark.parametrize("num_tokens", [0, 1, 128, 4096])
def test_to_physical_on_cuda_equals_the_torch_twin(num_tokens):
    E, K, D = 48, 8, 7168  # Kimi-K2's per-rank share, with 16 redundant slots: experts 0, 1 in 3, 2-13 in 2
    placement = Placement(torch.tensor([[*range(E), 0, 0, 1, 1, *range(2, 14)]]), E, 1)
    slots = ExpertSlots(placement, 0, D, torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    ids = torch.randint(-2, E + 2, (num_tokens, K), device="cuda", generator=gen)  # masked (-1) and invalid ids too
    twin = replica_route_ref(x, ids, slots.key_columns, slots.key_multipliers, slots.replica_count_E,
                             slots.logical_to_physical_E_, slots.num_experts, slots.num_physical)
    assert torch.equal(slots.to_physical(x, ids), twin)
    assert torch.equal(slots.to_physical(x, ids.to(torch.int32)), twin)
