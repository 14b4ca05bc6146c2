"""EPLB on CPU: the placement, the planner (DeepSeek's algorithm), the simulator, trace files and the CLI."""
import json

import pytest
import torch

from moe_ref.core.errors import CommandLineError, LoadTraceError, PlacementError, PlacementTopologyError, TopKError
from moe_ref.eplb.cli import main as eplb_main
from moe_ref.eplb.placement import Placement
from moe_ref.eplb.planner import balanced_packing, plan_global, plan_hierarchical, replicate
from moe_ref.eplb.simulate import balancedness, identity_placement, rank_rows, zipf_loads
from moe_ref.eplb.trace import load_loads, save_loads
from moe_ref.tools.cli import main

pytestmark = pytest.mark.unit


# --- hand-made loads with known placements ---------------------------------------------------------------

def test_one_hot_expert_gets_every_redundant_replica():
    load_LyE = torch.tensor([[100.0, 1, 1, 1, 1, 1, 1, 1]])
    placement = plan_global(load_LyE, num_physical=10, num_ranks=2)
    assert placement.replica_count_LyE.tolist() == [[3, 1, 1, 1, 1, 1, 1, 1]]
    # the three replicas (33.3 rows each) are spread so no rank holds more than two of them
    ranks_of_hot = placement.rank_of_slot(placement.logical_to_physical_LE_[0, 0])
    assert sorted(torch.bincount(ranks_of_hot, minlength=2).tolist()) == [1, 2]


def test_uniform_load_stays_balanced_with_and_without_redundancy():
    load_LyE = torch.full((2, 8), 5.0)
    for num_physical in (8, 12):
        result = balancedness(load_LyE, plan_global(load_LyE, num_physical, num_ranks=4))
        assert torch.equal(result.balancedness_after_Ly, torch.ones(2)), f"{num_physical=}"
        assert torch.equal(result.balancedness_before_Ly, torch.ones(2))


def test_four_experts_two_ranks_pairs_heaviest_with_lightest():
    load_LyE = torch.tensor([[4.0, 3, 2, 1]])
    placement = plan_global(load_LyE, num_physical=4, num_ranks=2)
    assert placement.physical_to_logical_LyPh.tolist() == [[0, 3, 1, 2]]
    assert rank_rows(load_LyE, placement).tolist() == [[5.0, 5.0]]
    # before: experts {0, 1} on rank 0 (7 rows), {2, 3} on rank 1 (3 rows)
    result = balancedness(load_LyE, placement)
    assert result.max_rank_rows_before_Ly.tolist() == [7.0] and result.max_rank_rows_after_Ly.tolist() == [5.0]


def test_balanced_packing_worked_example_and_ties():
    assert balanced_packing([5.0, 1.0, 4.0, 2.0], 2) == [0, 0, 1, 1]
    assert balanced_packing([1.0, 1.0, 1.0, 1.0], 2) == [0, 1, 0, 1]


def test_replicate_gives_spare_slots_by_load_per_replica():
    # 9 / 1 > 4 -> expert 0 gets a 2nd; 4.5 > 4 -> a 3rd; then 4 > 3 -> expert 1
    assert replicate(torch.tensor([9.0, 4.0, 1.0], dtype=torch.float64), 6).tolist() == [3, 2, 1]


def test_hierarchical_keeps_each_group_on_its_node_with_the_node_s_slots():
    # 2 groups of 4 experts on 2 nodes of 2 ranks, 6 slots per node: the hot group 1 goes first (to node 0) and its
    # 2 spare slots go to expert 4 (40 -> 20 -> 13.3 per replica); the cold node's spares go to its first experts
    load_LyE = torch.tensor([[1.0, 1, 1, 1, 40, 10, 10, 10]])
    placement = plan_hierarchical(load_LyE, num_physical=12, num_groups=2, num_nodes=2, num_ranks=4)
    assert placement.replica_count_LyE[0].tolist() == [2, 2, 1, 1, 3, 1, 1, 1]
    node_Ph = placement.rank_of_slot(torch.arange(12)) // 2
    assert set(placement.physical_to_logical_LyPh[0][node_Ph == 0].tolist()) == {4, 5, 6, 7}
    assert set(placement.physical_to_logical_LyPh[0][node_Ph == 1].tolist()) == {0, 1, 2, 3}


# --- properties over random loads ---------------------------------------------------------------------------

CASES = [  # (E, P, G, N, R)
    (16, 16, 1, 1, 4), (16, 20, 1, 1, 4), (32, 40, 4, 2, 4), (64, 72, 8, 2, 8), (24, 32, 6, 2, 8), (12, 18, 3, 3, 3),
]


@pytest.mark.parametrize("num_experts, num_physical, num_groups, num_nodes, num_ranks", CASES)
def test_random_loads_give_valid_balanced_placements(num_experts, num_physical, num_groups, num_nodes, num_ranks):
    generator = torch.Generator().manual_seed(num_experts * 1000 + num_physical)
    load_LyE = (torch.rand(6, num_experts, generator=generator) ** 4 * 1000).round()
    placement = plan_hierarchical(load_LyE, num_physical, num_groups, num_nodes, num_ranks)
    case = f"{num_experts=} {num_physical=} {num_groups=} {num_nodes=} {num_ranks=}"
    assert placement.physical_to_logical_LyPh.shape == (6, num_physical), case
    assert bool((placement.replica_count_LyE >= 1).all()), case
    assert placement.replica_count_LyE.sum(dim=1).tolist() == [num_physical] * 6, case
    # each group's replicas on one node, and each node holds P / N slots worth of its groups' experts
    group_LyPh = placement.physical_to_logical_LyPh // (num_experts // num_groups)
    node_LyPh = placement.rank_of_slot(torch.arange(num_physical)) // (num_ranks // num_nodes)
    for layer in range(6):
        for group in range(num_groups):
            assert len(set(node_LyPh[group_LyPh[layer] == group].tolist())) == 1, f"{case} {layer=} {group=}"
    result = balancedness(load_LyE, placement)
    assert bool((result.balancedness_after_Ly >= result.balancedness_before_Ly - 1e-12).all()), case
    assert bool((result.balancedness_after_Ly <= 1 + 1e-12).all()), case
    # the rows are conserved: every rank's rows add up to the layer's load
    assert torch.allclose(rank_rows(load_LyE, placement).sum(dim=1), load_LyE.double().sum(dim=1)), case


def test_plan_global_is_hierarchical_with_one_node_and_group():
    load_LyE = zipf_loads(3, 32, 4, 500, 1.2, seed=3)
    assert torch.equal(plan_global(load_LyE, 40, 8).physical_to_logical_LyPh,
                       plan_hierarchical(load_LyE, 40, 1, 1, 8).physical_to_logical_LyPh)


# --- replica choice ---------------------------------------------------------------------------------------

def _hot_placement() -> Placement:
    # expert 0: 3 replicas, expert 1: 2, experts 2..7 one each
    return plan_global(torch.tensor([[90.0, 40, 1, 1, 1, 1, 1, 1]]), num_physical=11, num_ranks=1)


def test_replica_for_lands_on_a_slot_of_the_expert():
    placement = _hot_placement()
    assert placement.replica_count_LyE[0, :2].tolist() == [3, 2]
    token_idx_T1 = torch.arange(1000).unsqueeze(1)
    topk_ids_TK = torch.randint(0, 8, (1000, 4), generator=torch.Generator().manual_seed(0))
    slots_TK = placement.replica_for(token_idx_T1, torch.arange(4).unsqueeze(0), topk_ids_TK)
    assert slots_TK.shape == (1000, 4) and bool(((slots_TK >= 0) & (slots_TK < 11)).all())
    assert torch.equal(placement.physical_to_logical_LyPh[0][slots_TK], topk_ids_TK)


def test_replica_for_is_deterministic_and_independent_of_batch_position():
    placement = _hot_placement()
    token_idx_T = torch.arange(5000, 5400)
    topk_ids_TK = torch.zeros(400, 2, dtype=torch.int64)
    slot_idx_1K = torch.arange(2).unsqueeze(0)
    slots_TK = placement.replica_for(token_idx_T.unsqueeze(1), slot_idx_1K, topk_ids_TK)
    assert torch.equal(slots_TK, placement.replica_for(token_idx_T.unsqueeze(1), slot_idx_1K, topk_ids_TK))
    perm_T = torch.randperm(400, generator=torch.Generator().manual_seed(1))  # the same tokens in another batch order
    assert torch.equal(placement.replica_for(token_idx_T[perm_T].unsqueeze(1), slot_idx_1K, topk_ids_TK),
                       slots_TK[perm_T])
    single = placement.replica_for(int(token_idx_T[7]), 1, 0)  # one token alone, plain ints
    assert int(single) == int(slots_TK[7, 1])


def test_replica_for_spreads_evenly_over_many_tokens():
    placement = _hot_placement()
    for expert, count in ((0, 3), (1, 2)):
        for slot_idx in range(3):
            slots = placement.replica_for(torch.arange(30000), slot_idx, expert)
            hits = torch.bincount(slots, minlength=11)[placement.logical_to_physical_LE_[0, expert, :count]]
            assert bool((hits - 30000 / count).abs().max() < 0.02 * 30000 / count), f"{expert=} {slot_idx=} {hits=}"


# --- Placement checks and file ----------------------------------------------------------------------------

def test_logical_to_physical_is_padded_with_minus_one():
    placement = Placement(torch.tensor([[2, 0, 2, 1]]), num_experts=3, num_ranks=2)
    assert placement.logical_to_physical_LE_.tolist() == [[[1, -1], [3, -1], [0, 2]]]
    assert placement.replica_count_LyE.tolist() == [[1, 1, 2]]
    assert placement.rank_of_slot(torch.tensor([0, 1, 2, 3])).tolist() == [0, 0, 1, 1]


@pytest.mark.parametrize("table, num_experts, num_ranks, words", [
    ([[0, 1, 1, 1]], 3, 2, "logical expert 2 has no physical slot"),
    ([[0, 1, 2, 3]], 3, 2, "holds expert 3, outside"),
    ([[0, -1, 2, 1]], 3, 2, "holds expert -1"),
    ([[0, 1, 2]], 3, 2, "num_physical=3 slots do not split over num_ranks=2"),
    ([[0.0, 1.0]], 2, 1, "int64"),
])
def test_validate_refuses_bad_placements(table, num_experts, num_ranks, words):
    dtype = torch.float32 if isinstance(table[0][0], float) else torch.int64
    with pytest.raises(PlacementError, match=words) as info:
        Placement(torch.tensor(table, dtype=dtype), num_experts, num_ranks)
    assert info.value.code == "CFG033" and isinstance(info.value, ValueError)


def test_placement_file_round_trip(tmp_path):
    placement = plan_hierarchical(zipf_loads(4, 16, 2, 300, 1.0, seed=5), 24, 4, 2, 4)
    placement.save(tmp_path / "p.json")
    again = Placement.load(tmp_path / "p.json")
    assert torch.equal(again.physical_to_logical_LyPh, placement.physical_to_logical_LyPh)
    assert (again.num_experts, again.num_ranks) == (16, 4)
    (tmp_path / "bad.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(PlacementError, match="bad.json"):
        Placement.load(tmp_path / "bad.json")
    record = json.loads((tmp_path / "p.json").read_text())
    record["physical_to_logical"][0][0] = 99
    (tmp_path / "edited.json").write_text(json.dumps(record))
    with pytest.raises(PlacementError, match="holds expert 99"):
        Placement.load(tmp_path / "edited.json")


@pytest.mark.parametrize("sizes, words", [
    (dict(num_physical=7, num_groups=1, num_nodes=1, num_ranks=1), "num_physical=7 < num_experts=8"),
    (dict(num_physical=10, num_groups=1, num_nodes=1, num_ranks=4), "num_physical=10 % num_ranks=4 = 2"),
    (dict(num_physical=12, num_groups=2, num_nodes=4, num_ranks=6), "num_ranks=6 % num_nodes=4 = 2"),
    (dict(num_physical=12, num_groups=3, num_nodes=1, num_ranks=4), "num_experts=8 % num_groups=3 = 2"),
    (dict(num_physical=12, num_groups=2, num_nodes=4, num_ranks=4), "num_groups=2 % num_nodes=4 = 2"),
    (dict(num_physical=12, num_groups=1, num_nodes=1, num_ranks=0), "num_ranks=0"),
])
def test_planner_refuses_sizes_it_cannot_place(sizes, words):
    with pytest.raises(PlacementTopologyError, match=words) as info:
        plan_hierarchical(torch.ones(1, 8), **sizes)
    assert info.value.code == "CFG034"


@pytest.mark.parametrize("load", [torch.ones(8), -torch.ones(2, 8), torch.full((2, 8), float("nan"))])
def test_planner_refuses_bad_loads(load):
    with pytest.raises(LoadTraceError):
        plan_global(load, 8, 2)


def test_identity_placement_needs_experts_divisible_by_ranks():
    with pytest.raises(PlacementTopologyError, match="num_experts=10 % num_ranks=4 = 2"):
        identity_placement(1, 10, 4)


# --- synthetic loads and trace files ---------------------------------------------------------------------

def test_zipf_loads_sum_skew_and_seed():
    load_LyE = zipf_loads(3, 64, 8, 2000, 1.0, seed=7)
    assert load_LyE.dtype == torch.int64 and load_LyE.sum(dim=1).tolist() == [16000] * 3
    assert bool((load_LyE <= 2000).all())  # top-k experts are distinct: at most one row per token per expert
    assert torch.equal(load_LyE, zipf_loads(3, 64, 8, 2000, 1.0, seed=7))
    assert not torch.equal(load_LyE[0], load_LyE[1])  # each layer its own permutation
    skewed, uniform = load_LyE[0].double(), zipf_loads(1, 64, 8, 2000, 0.0, seed=7)[0].double()
    assert skewed.max() > 4 * skewed.mean() and uniform.max() < 1.5 * uniform.mean()
    with pytest.raises(TopKError):
        zipf_loads(1, 4, 5, 10, 1.0)


@pytest.mark.parametrize("suffix", [".json", ".pt"])
def test_load_trace_round_trip(tmp_path, suffix):
    loads_WLyE = torch.stack([zipf_loads(2, 16, 2, 100, 1.0, seed=s) for s in range(3)])
    save_loads(tmp_path / f"trace{suffix}", loads_WLyE)
    assert torch.equal(load_loads(tmp_path / f"trace{suffix}"), loads_WLyE.double())


def test_load_trace_refuses_bad_files(tmp_path):
    (tmp_path / "ragged.json").write_text(json.dumps({"format": "moe_ref.eplb.loads", "loads": [[[1, 2], [3]]]}))
    (tmp_path / "other.json").write_text(json.dumps({"loads": [[1, 2]]}))
    torch.save(torch.ones(4), tmp_path / "flat.pt")
    torch.save({"a": 1}, tmp_path / "dict.pt")
    for name in ("ragged.json", "other.json", "flat.pt", "dict.pt", "missing.json"):
        with pytest.raises(LoadTraceError, match=name):
            load_loads(tmp_path / name)


# --- the CLI ------------------------------------------------------------------------------------------------

def test_cli_simulates_a_tiny_trace(tmp_path, capsys):
    save_loads(tmp_path / "trace.json", torch.stack([zipf_loads(3, 16, 2, 200, 1.5, seed=s) for s in range(2)]))
    status = main(["eplb", "simulate", "--loads", str(tmp_path / "trace.json"), "--ep", "4", "--redundant", "4",
                   "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert status == 0 and "3 layers, 16 experts, EP 4, 20 slots" in out and "worst layers" in out
    record = json.loads((tmp_path / "out" / "eplb_simulate.json").read_text())
    summary = record["summary"]
    assert summary["balancedness_after_mean"] >= summary["balancedness_before_mean"]
    assert len(record["per_layer"]["balancedness_after"]) == 3 and summary["max_rank_rows_reduction"] > 0
    assert Placement.load(tmp_path / "out" / "placement.json").num_physical == 20


def test_cli_zipf_hierarchical_and_refusals(tmp_path, capsys):
    assert main(["eplb", "simulate", "--zipf", "1.0", "--experts", "32", "--layers", "2", "--tokens-per-rank", "64",
                 "--ep", "4", "--redundant", "8", "--nodes", "2", "--groups", "4"]) == 0
    assert "hierarchical (2 nodes, 4 groups)" in capsys.readouterr().out
    save_loads(tmp_path / "trace.pt", torch.ones(2, 16))
    assert main(["eplb", "simulate", "--loads", str(tmp_path / "trace.pt"), "--experts", "32"]) == 2
    assert "CFG035" in capsys.readouterr().err
    assert main(["eplb", "simulate", "--zipf", "1.0", "--redundant", "30"]) == 2
    assert "CFG034" in capsys.readouterr().err
    with pytest.raises(CommandLineError, match="--zipf -1.0"):
        eplb_main(["simulate", "--zipf", "-1.0"])
