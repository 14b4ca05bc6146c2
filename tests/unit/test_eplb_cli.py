"""EPLB on the command line: ``moe-ref plan`` / ``check`` count physical slots (Ph = E + N, Ph / R per rank) with the
layer's own calls and coded errors, and ``moe-ref eplb simulate``'s modelled step (``moe_ref.eplb.expert_times``):
the interpolation, the slowest-rank rule, the shipped table's citations and the printed before/after.

Every CLI test calls ``main([...])`` in-process and checks the exit status, the code and the numbers.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from moe_ref import MegaMoE
from moe_ref.core.config import preset
from moe_ref.core.errors import CommandLineError
from moe_ref.eplb import Placement, plan_global
from moe_ref.eplb.expert_times import TABLE, ExpertTimes, expert_times, rank_us, step_times
from moe_ref.eplb.slots import resolve_slots
from moe_ref.eplb.trace import save_loads
from moe_ref.tools.cli import main

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
TINY = "tiny-kimi-k2"  # E = 16
E_TINY = preset(TINY).num_experts


def _run(capsys, argv):
    status = main(argv)
    out, err = capsys.readouterr()
    return status, out, err


def _coded_line(err: str, code: str) -> str:
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"moe-ref: [{code}] "), err
    return last


def _plan_numbers(out: str) -> tuple[int, int, int]:
    """(local slots, slots in all, TOTAL per rank bytes) from ``moe-ref plan``'s report."""
    local, total = map(int, re.search(r"local experts (\d+) of (\d+)", out).groups())
    per_rank = int(re.search(r"^TOTAL per rank\s+(\d+)", out, re.M).group(1))
    return local, total, per_rank


# --- plan / check: slots ----------------------------------------------------------------------------------
def test_plan_counts_slots_and_its_bytes_grow_with_the_redundant_count(capsys):
    rows = {}
    for n in (None, 8, 16):
        argv = ["plan", "--preset", "kimi-k2", "--ep", "8"] + ([] if n is None else ["--redundant-experts", str(n)])
        status, out, _ = _run(capsys, argv)
        assert status == 0
        rows[n] = _plan_numbers(out)
        if n is None:
            assert "EPLB" not in out
        else:
            assert f"Ph = E + redundant = 384 + {n} = {384 + n} physical expert slots, {(384 + n) // 8} per rank" in out
    assert [rows[n][:2] for n in (None, 8, 16)] == [(48, 384), (49, 392), (50, 400)]
    assert rows[None][2] < rows[8][2] < rows[16][2]  # more local segments: more receive-pool rows and counters
    status, out, _ = _run(capsys, ["plan", "--preset", "kimi-k2", "--ep", "8", "--redundant-experts", "0"])
    assert status == 0 and _plan_numbers(out) == rows[None] and "EPLB" not in out  # N = 0: no EPLB, as the layer


def test_plan_bytes_are_the_layer_s_own_buffer(capsys):
    """The printed plan is the one the layer's routed step builds (one process: R = 1, every slot local)."""
    layer = MegaMoE(TINY, seed=0, num_max_tokens_per_rank=64, alignment=128, num_redundant_experts=4)
    with torch.no_grad():
        layer(torch.randn(3, layer.cfg.hidden_size))
    status, out, _ = _run(capsys, ["plan", "--preset", TINY, "--ep", "1", "--redundant-experts", "4", "--dtype",
                                   "fp32", "--max-num-tokens", "64", "--alignment", "128"])
    assert status == 0
    assert _plan_numbers(out) == (E_TINY + 4, E_TINY + 4, layer.routed_step.plan.total_bytes)
    # and the routed experts' bytes count the slots: 20 slots of 3 matrices [2F, D] + [D, F] in fp32
    cfg = preset(TINY)
    assert f"routed experts per rank ({E_TINY + 4} of {E_TINY + 4}," in out
    slot_bytes = 4 * (2 * cfg.intermediate_size * cfg.hidden_size + cfg.hidden_size * cfg.intermediate_size)
    assert layer.gate_up_weight.numel() * 4 + layer.down_weight.numel() * 4 == (E_TINY + 4) * slot_bytes


def test_check_counts_slots_and_eplb_lifts_the_divisibility_of_experts(capsys):
    status, out, _ = _run(capsys, ["check", "--preset", "kimi-k2", "--ep", "8", "--redundant-experts", "8"])
    assert status == 0 and "(49 expert slots per EP rank)" in out and "392 physical expert slots" in out
    # E = 16 over 6 ranks: no EPLB is CFG002; 2 redundant give 18 slots, 3 per rank (E need not divide by R)
    status, out, _ = _run(capsys, ["check", "--preset", TINY, "--ep", "6"])
    assert status == 1 and "[CFG002]" in out
    status, out, _ = _run(capsys, ["check", "--preset", TINY, "--ep", "6", "--redundant-experts", "2"])
    assert status == 0 and "(3 expert slots per EP rank)" in out
    status, out, _ = _run(capsys, ["plan", "--preset", TINY, "--ep", "6", "--redundant-experts", "2"])
    assert status == 0 and _plan_numbers(out)[:2] == (3, 18)


def test_a_bad_redundant_count_is_the_layer_s_cfg021_with_the_numbers(capsys):
    _, layer_problem = resolve_slots(preset(TINY), 4, 0, 3, None, torch.device("cpu"))  # the layer's own check
    status, _, err = _run(capsys, ["plan", "--preset", TINY, "--ep", "4", "--redundant-experts", "3"])
    assert status == 2
    line = _coded_line(err, "CFG021")
    assert line == f"moe-ref: {layer_problem}"
    assert "16 + 3 = 19 slots do not split over 4 ranks (19 % 4 = 3); use num_redundant_experts=0 or 4" in line
    status, out, _ = _run(capsys, ["check", "--preset", TINY, "--ep", "4", "--redundant-experts", "3"])
    assert status == 1 and f"  - {layer_problem}" in out
    status, _, err = _run(capsys, ["plan", "--preset", TINY, "--ep", "4", "--redundant-experts", "-1"])
    assert status == 2 and "num_redundant_experts=-1 must be None or an int >= 0" in _coded_line(err, "CFG021")


def test_placement_files_are_checked_layer_by_layer_with_the_layer_s_codes(tmp_path, capsys):
    path = tmp_path / "placement.json"
    plan_global(torch.rand(3, E_TINY, generator=torch.Generator().manual_seed(0)), E_TINY + 4, 4).save(path)
    status, out, _ = _run(capsys, ["plan", "--preset", TINY, "--ep", "4", "--placement", str(path)])
    assert status == 0 and _plan_numbers(out)[:2] == (5, 20) and f"placement {str(path)!r}" in out
    # the file holds 4 redundant slots, the flag asks 8: CFG023 naming both, and the layer of the file
    status, _, err = _run(capsys, ["plan", "--preset", TINY, "--ep", "4", "--placement", str(path),
                                   "--redundant-experts", "8"])
    assert status == 2 and "layer 0 of 3: the placement has slots 20 (the layer: 24)" in _coded_line(err, "CFG023")
    status, out, _ = _run(capsys, ["check", "--preset", TINY, "--ep", "2", "--placement", str(path)])
    assert status == 1 and "[CFG023]" in out and "ranks 4 (the layer: 2)" in out
    path.write_text("{}")
    status, _, err = _run(capsys, ["plan", "--preset", TINY, "--ep", "4", "--placement", str(path)])
    assert status == 2 and "is not a moe_ref.eplb.placement" in _coded_line(err, "CFG033")


# --- the step-time model ----------------------------------------------------------------------------------
def test_expert_time_interpolation_on_a_hand_made_table():
    t = ExpertTimes((1.0, 3.0, 5.0), (10.0, 20.0, 24.0))
    rows = torch.tensor([0.0, 0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 7.0])
    #                    none floor point  mid  point  mid  point  past the end: the last segment's slope (2 / row)
    assert t(rows).tolist() == [0.0, 10.0, 10.0, 15.0, 20.0, 22.0, 24.0, 28.0]
    assert t(torch.tensor([[2.0], [4.0]])).shape == (2, 1) and t(rows).dtype == torch.float64


@pytest.mark.parametrize("rows, us, words", [
    ((1.0,), (1.0,), "at least 2 points"), ((2.0, 1.0), (1.0, 2.0), "strictly increasing"),
    ((0.0, 1.0), (1.0, 2.0), "must be > 0"), ((1.0, 2.0), (3.0, 2.0), "non-decreasing"),
    ((1.0, float("nan")), (1.0, 2.0), "finite")])
def test_expert_times_refuse_tables_that_are_no_curve(rows, us, words):
    with pytest.raises(CommandLineError, match=words):
        ExpertTimes(rows, us)


def test_a_table_s_calls_become_per_expert_points():
    table = {"models": {"m": {"experts_measured": 4, "dtypes": {"bf16": {"points": [
        {"rows": 4, "us": 40.0}, {"rows": 8, "us": 60.0}]}}}}}
    t = expert_times(table, "m", "bf16")
    assert (t.rows, t.us) == ((1.0, 2.0), (10.0, 15.0))
    with pytest.raises(CommandLineError, match="it holds m"):
        expert_times(table, "x", "bf16")
    with pytest.raises(CommandLineError, match="it holds bf16"):
        expert_times(table, "m", "fp8")


def test_a_layer_s_step_is_its_slowest_rank_summing_its_slots():
    t = ExpertTimes((1.0, 2.0), (1.0, 2.0))  # t(r) = r from 1 row on, 1 below
    load_LyE = torch.tensor([[4.0, 2.0, 1.0, 1.0]])
    # without EPLB: rank 0 holds experts 0, 1 (4 + 2 us), rank 1 experts 2, 3 (1 + 1 us): the step is 6, not the
    # mean (4) nor the sum (8); with experts 0 and 1 on both ranks: 2 + 1 + 1 each side
    placement = Placement(torch.tensor([[0, 1, 2, 0, 3, 1]]), 4, 2)
    assert rank_us(load_LyE, placement, t).tolist() == [[4.0, 4.0]]
    result = step_times(load_LyE, placement, t)
    assert result.before_us_Ly.tolist() == [6.0] and result.after_us_Ly.tolist() == [4.0] and result.speedup == 1.5
    # half a row on a replica still reads the weights, t(0.5) = t(1) = 1: rank 0 holds expert 2 twice (0.5 rows each)
    # and expert 0: 1 + 1 + 4; rank 1 expert 1 and expert 3 twice: 2 + 1 + 1
    split = Placement(torch.tensor([[2, 2, 0, 1, 3, 3]]), 4, 2)
    assert rank_us(load_LyE, split, t).tolist() == [[6.0, 4.0]]


def test_rank_time_is_the_sum_over_each_rank_s_slots_on_random_placements():
    gen = torch.Generator().manual_seed(3)
    t = ExpertTimes((0.5, 4.0, 30.0), (2.0, 3.0, 40.0))
    load_LyE = torch.randint(0, 50, (3, 12), generator=gen).double()
    placement = plan_global(load_LyE, 16, 4)
    got_LyR = rank_us(load_LyE, placement, t)
    for layer in range(3):
        count = torch.bincount(placement.physical_to_logical_LyPh[layer], minlength=12)
        for rank in range(4):
            slots = placement.physical_to_logical_LyPh[layer, rank * 4:(rank + 1) * 4].tolist()
            want = sum(float(t(load_LyE[layer, e] / count[e])) for e in slots)
            assert got_LyR[layer, rank].item() == pytest.approx(want, rel=1e-12)


def test_every_shipped_point_is_a_recorded_measurement():
    """Each point's rows and us are the cells of the row it names in the results file it names (once there)."""
    checked = 0
    for model, entry in TABLE["models"].items():
        assert entry["experts_measured"] == 48
        for dtype, curve in entry["dtypes"].items():
            for point in curve["points"]:
                lines = (ROOT / point["source"]).read_text().splitlines()
                header = next(line for line in lines if line.startswith("| ") and "| us |" in line)
                names = [c.strip() for c in header.strip("|").split("|")]
                hits = [line for line in lines if line.startswith(point["row"])]
                assert len(hits) == 1, (point, len(hits))
                cells = [c.strip() for c in hits[0].strip("|").split("|")]
                assert float(cells[names.index("us")]) == point["us"], point
                assert int(cells[names.index("rows")]) == point["rows"], point
                checked += 1
            expert_times(TABLE, model, dtype)  # a valid curve: increasing rows, non-decreasing us
    assert checked == 20
    assert "48 experts" in (ROOT / "docs/results/quantized_experts_decode_h200_2026-12-02.md").read_text()
    assert "Kimi-K2 48 local experts" in (ROOT / "scripts/bench_experts.py").read_text()
    assert "Step3 48 experts" in (ROOT / "scripts/bench_experts.py").read_text()


# --- moe-ref eplb simulate: the modelled step -------------------------------------------------------------
def _hand_step_us(load_LyE: torch.Tensor, physical_to_logical_LyPh: list, num_ranks: int) -> list[float]:
    """The model by loops: t(r) = r (0 at 0, 1 below 1 row), slots summed per rank, the slowest rank."""
    out = []
    for layer, table in enumerate(physical_to_logical_LyPh):
        per_rank = len(table) // num_ranks
        ranks = []
        for rank in range(num_ranks):
            total = 0.0
            for e in table[rank * per_rank:(rank + 1) * per_rank]:
                rows = float(load_LyE[layer, e]) / table.count(e)
                total += 0.0 if rows == 0 else max(rows, 1.0)
            ranks.append(total)
        out.append(max(ranks))
    return out


def test_simulate_prints_the_modelled_step_on_a_tiny_trace(tmp_path, capsys):
    one_step_LyE = torch.tensor([[40.0, 20.0, 10.0, 10.0], [10.0, 10.0, 10.0, 10.0]])
    save_loads(tmp_path / "trace.json", torch.stack([one_step_LyE * 3, one_step_LyE * 3]))  # 2 windows of 3 steps
    times = {"format": "moe_ref.eplb.expert_times", "version": 1, "models": {"toy": {"experts_measured": 1,
             "dtypes": {"bf16": {"points": [{"rows": 1, "us": 1.0}, {"rows": 1000, "us": 1000.0}]}}}}}
    (tmp_path / "times.json").write_text(json.dumps(times))
    status, out, _ = _run(capsys, ["eplb", "simulate", "--loads", str(tmp_path / "trace.json"), "--ep", "2",
                                   "--redundant", "2", "--times", str(tmp_path / "times.json"), "--model", "toy",
                                   "--steps-per-window", "3", "--per-layer", "--out", str(tmp_path / "out")])
    assert status == 0
    placement = json.loads((tmp_path / "out" / "placement.json").read_text())["physical_to_logical"]
    before = _hand_step_us(one_step_LyE, [[0, 1, 2, 3], [0, 1, 2, 3]], 2)
    after = _hand_step_us(one_step_LyE, placement, 2)
    assert before == [60.0, 20.0]
    speedup = sum(before) / sum(after)
    assert speedup > 1.0
    assert f"rows of one step = load / 6): per layer mean {sum(before) / 2:.1f} us -> {sum(after) / 2:.1f} us" in out
    assert f"all 2 layers {sum(before):.1f} us -> {sum(after):.1f} us, speedup {speedup:.3f}x" in out
    for layer in range(2):
        assert f"  {layer:5d} | {before[layer]:.1f} -> {after[layer]:.1f}" in out
    record = json.loads((tmp_path / "out" / "eplb_simulate.json").read_text())["step_time"]
    assert record["before_us"] == before and record["after_us"] == pytest.approx(after, rel=1e-12)
    assert record["steps"] == 6 and record["speedup"] == pytest.approx(speedup, rel=1e-12)


def test_simulate_uses_the_shipped_table_by_default_and_names_extrapolation(tmp_path, capsys):
    save_loads(tmp_path / "trace.json", torch.tensor([[[4000.0, 10.0, 10.0, 10.0]]]))
    status, out, _ = _run(capsys, ["eplb", "simulate", "--loads", str(tmp_path / "trace.json"), "--ep", "2",
                                   "--redundant", "0"])
    assert status == 0 and "kimi-k2 bf16 from the shipped table" in out
    t = expert_times(TABLE, "kimi-k2", "bf16")
    before = float(t(torch.tensor(4000.0)) + t(torch.tensor(10.0)))  # rank 0: experts 0 and 1
    assert f"per layer mean {before:.1f} us -> {before:.1f} us" in out and "speedup 1.000x" in out
    assert f"a slot gets up to 4000.0 rows, above the table's largest point ({32768 / 48:.1f} rows" in out


@pytest.mark.parametrize("flags, words", [
    (["--model", "llama"], "--model 'llama' is not in the shipped table; it holds kimi-k2, step3"),
    (["--model", "step3", "--expert-dtype", "int4"], "it holds bf16, fp8"),
    (["--steps-per-window", "0"], "--steps-per-window 0 is out of range"),
    (["--times", "missing.json"], "--times 'missing.json' is not a moe_ref.eplb.expert_times")])
def test_simulate_refuses_bad_time_flags_with_cfg015(flags, words, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, _, err = _run(capsys, ["eplb", "simulate", "--zipf", "1.0", "--experts", "8", "--layers", "1",
                                   "--ep", "2", "--redundant", "2", *flags])
    assert status == 2 and words in _coded_line(err, "CFG015")
