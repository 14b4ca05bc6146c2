"""EPLB inside MegaMoE on one CPU process: physical slots, replica routing, telemetry, rebalance, the slot map in
state_dict, the telemetry dump as a trace (the multi-rank move: tests/dist/test_eplb_dist.py).

The torch experts are row-invariant (whole aligned segments, moe_ref.ep.dispatch), and on one rank each token's
partial sums its k slots in slot order whichever slot serves it, so an EPLB layer's output is bitwise the
no-EPLB layer's here."""
from __future__ import annotations

import pytest
import torch

from moe_ref import MegaMoE
from moe_ref.core.config import preset
from moe_ref.core.errors import (ExpertSlotsError, PlacementError, PlacementMismatchError, RebalanceCanaryError,
                                 SlotWeightsError)
from moe_ref.core.weights import MoEWeights
from moe_ref.eplb import Placement, mover
from moe_ref.eplb.slots import ExpertSlots, resolve_slots
from moe_ref.eplb.telemetry import save_expert_loads
from moe_ref.eplb.trace import load_loads

pytestmark = pytest.mark.unit

PRESET = "tiny-kimi-k2"  # E = 16, K = 4, D = 48
CFG = preset(PRESET)
E, K, D = CFG.num_experts, CFG.num_topk, CFG.hidden_size


def _x(tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(tokens, D, generator=torch.Generator().manual_seed(seed))


def _placement(physical_to_logical: list[int], ranks: int = 1) -> Placement:
    return Placement(torch.tensor([physical_to_logical]), E, ranks)


def _slots(placement: Placement, rank: int = 0) -> ExpertSlots:
    return ExpertSlots(placement, rank, D, torch.device("cpu"))


@pytest.fixture(scope="module")
def reference():
    layer = MegaMoE(PRESET, seed=0)
    x = _x(97)
    with torch.no_grad():
        return x, layer(x)


# experts 0..15 once, then 4 more replicas of expert 5 (one expert on 5 slots)
HOT_EXPERT = 5
HOT = list(range(E)) + [HOT_EXPERT] * 4


@pytest.mark.parametrize("kwargs", [{"num_redundant_experts": 4}, {"placement": _placement(HOT)},
                                    {"num_redundant_experts": 0, "placement": _placement(list(reversed(range(E))))}],
                         ids=["planner_default", "one_expert_on_five_slots", "permuted_no_redundant"])
def test_output_is_the_no_eplb_layers_whichever_replica_serves(reference, kwargs):
    x, y_ref = reference
    layer = MegaMoE(PRESET, seed=0, **kwargs)
    with torch.no_grad():
        y = layer(x)
    assert torch.equal(y, y_ref)
    assert layer.gate_up_weight.shape[0] == layer.expert_slots.num_physical  # one rank holds every slot


def test_the_capacity_plan_and_shared_buffer_count_physical_slots():
    layer = MegaMoE(PRESET, seed=0, num_redundant_experts=4)
    with torch.no_grad():
        layer(_x(3))
    plan = layer.routed_step.plan
    assert plan.cfg.num_experts == E + 4 and plan.num_local_experts == E + 4
    assert layer.num_recv_tokens_per_expert.shape == (E + 4,)


def test_replica_choice_is_position_free_deterministic_and_balanced():
    slots = _slots(_placement(HOT))
    x, ids = _x(3000, seed=1), torch.full((3000, K), HOT_EXPERT)
    physical = slots.to_physical(x, ids)
    perm = torch.randperm(3000, generator=torch.Generator().manual_seed(2))
    assert torch.equal(slots.to_physical(x[perm], ids), physical[perm])  # another batch order
    assert torch.equal(torch.cat([slots.to_physical(x[:1000], ids[:1000]), slots.to_physical(x[1000:], ids[1000:])]),
                       physical)  # another chunking
    replicas = [HOT_EXPERT] + list(range(E, E + 4))
    counts = torch.bincount(physical.flatten(), minlength=E + 4)[replicas]
    assert counts.sum() == 3000 * K and counts.min() > 0.9 * counts.max()  # 5 replicas, about 2400 rows each


def test_masked_and_invalid_ids_stay_visible_to_the_routing_check():
    slots = _slots(_placement(HOT))
    physical = slots.to_physical(_x(1), torch.tensor([[-1, E, -5, 3]]))
    assert physical.tolist() == [[-1, E + 4, -5, 3]]


def test_telemetry_counts_every_row_over_a_window_and_resets():
    layer = MegaMoE(PRESET, seed=0, placement=_placement(HOT))
    with torch.no_grad():
        layer(_x(50))
        layer(_x(0))  # zero tokens add nothing
        load = layer.expert_load()
        assert int(load.rows_Ph.sum()) == 50 * K and load.max_rank_rows == 50 * K and load.balancedness == 1.0
        assert torch.equal(load.logical_rows_E.index_select(0, torch.tensor([HOT_EXPERT])),
                           load.rows_Ph[[HOT_EXPERT] + list(range(E, E + 4))].sum().view(1))
        layer.reset_expert_load()
        assert int(layer.expert_load().rows_Ph.sum()) == 0
        layer(_x(7, seed=3))
    assert int(layer.expert_load().rows_Ph.sum()) == 7 * K


def test_all_tokens_to_one_expert_land_on_its_replicas_only():
    layer = MegaMoE(PRESET, seed=0, placement=_placement(HOT))
    with torch.no_grad():
        layer.e_score_correction_bias[HOT_EXPERT] += 10.0  # every token picks the hot expert
        layer(_x(400))
    rows = layer.expert_load().rows_Ph
    replicas = [HOT_EXPERT] + list(range(E, E + 4))
    assert int(rows[replicas].sum()) == 400 and bool((rows[replicas] > 0).all())


def test_bad_combinations_are_coded_with_the_numbers():
    _, problem = resolve_slots(CFG, 4, 0, 3, None, torch.device("cpu"))
    assert isinstance(problem, ExpertSlotsError) and "19 % 4 = 3" in str(problem) and "0 or 4" in str(problem)
    _, problem = resolve_slots(CFG, 1, 0, -1, None, torch.device("cpu"))
    assert isinstance(problem, ExpertSlotsError)
    two_layers = Placement(torch.arange(E).repeat(2, 1), E, 1)
    _, problem = resolve_slots(CFG, 1, 0, None, two_layers, torch.device("cpu"))
    assert isinstance(problem, PlacementMismatchError) and "placement.layer(i)" in str(problem)
    _, problem = resolve_slots(CFG, 1, 0, 8, _placement(HOT), torch.device("cpu"))
    assert isinstance(problem, PlacementMismatchError) and "slots 20 (the layer: 24)" in str(problem)
    with pytest.raises(ExpertSlotsError):
        MegaMoE(PRESET, seed=0, num_redundant_experts=-2)
    with pytest.raises(ExpertSlotsError):
        MegaMoE(PRESET, seed=0).rebalance(_placement(HOT))  # built without EPLB


def test_a_placement_file_is_read_and_a_bad_one_refused(tmp_path):
    _placement(HOT).save(tmp_path / "placement.json")
    layer = MegaMoE(PRESET, seed=0, placement=tmp_path / "placement.json")
    assert layer.expert_slots.local_experts() == HOT
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(PlacementError):
        MegaMoE(PRESET, seed=0, placement=tmp_path / "bad.json")


def test_weights_lacking_a_slots_expert_are_refused():
    layer = MegaMoE(PRESET, placement=_placement(HOT))
    with pytest.raises(SlotWeightsError, match=r"lack \[8, 9"):
        layer.load_weights(MoEWeights.random(CFG, seed=0).expert_slice(0, 8))


def test_rebalance_moves_every_slot_and_keeps_the_output(reference):
    x, y_ref = reference
    layer = MegaMoE(PRESET, seed=0, num_redundant_experts=4)
    new = [(7 * p + 3) % E for p in range(E)] + [0, 1, 1, 2]
    layer.rebalance(_placement(new))
    full = MoEWeights.random(CFG, seed=0)
    assert layer.expert_slots.local_experts() == new
    assert torch.equal(layer.gate_up_weight, full.gate_up_weight_E2FD[new])
    assert torch.equal(layer.down_weight, full.down_weight_EDF[new])
    with torch.no_grad():
        assert torch.equal(layer(x), y_ref)


def test_the_slot_map_round_trips_through_state_dict(reference):
    x, y_ref = reference
    moved = MegaMoE(PRESET, seed=0, num_redundant_experts=4)
    moved.rebalance(_placement(list(reversed(range(E))) + [3, 3, 3, 3]))
    fresh = MegaMoE(PRESET, num_redundant_experts=4)  # the planner's even placement, no weights
    fresh.load_state_dict(moved.state_dict())
    assert fresh.expert_slots.local_experts() == moved.expert_slots.local_experts()
    with torch.no_grad():
        assert torch.equal(fresh(x), y_ref)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int32, torch.uint8, torch.bfloat16])
def test_the_mover_moves_quantized_words_and_scales_as_bytes(dtype):
    """vLLM's check: weights encoded as their logical expert's id, every slot checked after the move."""
    old, new = list(range(E)) + [0, 1, 2, 3], [HOT_EXPERT] * 4 + list(range(E))
    slots = _slots(_placement(old))

    def encoded(experts):
        codes = torch.tensor(experts, dtype=torch.float32).view(-1, 1, 1) * 10 + torch.arange(6.0).view(1, 2, 3)
        return codes.to(dtype) if dtype != torch.float8_e4m3fn else (codes / 64).to(dtype)

    tensors = [encoded(old), encoded(old)[:, :1].contiguous()]
    mover.rebalance_slots(slots, _placement(new), tensors, None)
    assert slots.local_experts() == new
    for tensor, expected in zip(tensors, [encoded(new), encoded(new)[:, :1]]):
        assert torch.equal(tensor.view(torch.uint8), expected.contiguous().view(torch.uint8))


def test_the_canary_catches_a_move_that_lost_a_slot(monkeypatch):
    layer = MegaMoE(PRESET, seed=0, num_redundant_experts=4)
    monkeypatch.setattr(mover, "_move", lambda *args: None)  # nothing moves
    with pytest.raises(RebalanceCanaryError, match="slots do not hold"):
        layer.rebalance(_placement(list(reversed(range(E))) + [0, 1, 2, 3]))


def test_the_telemetry_dump_reads_as_a_trace(tmp_path):
    layer = MegaMoE(PRESET, seed=0, placement=_placement(HOT))
    with torch.no_grad():
        layer(_x(30))
    load = layer.expert_load()
    save_expert_loads(tmp_path / "telemetry.json", [load, load])
    trace = load_loads(tmp_path / "telemetry.json")
    assert trace.shape == (1, 2, E)
    assert torch.equal(trace[0, 1], load.logical_rows_E.double()) and int(trace[0, 0].sum()) == 30 * K
