"""EPLB's rebalance at EP 2 and EP 4 on gloo CPU ranks (tests/dist/eplb_worker.py): the layer's output before and
after a move agrees on every rank (within fp32 tolerance: the owners of a token's slots change, and with them the
order the combine sums their partials in), every slot then holds its logical expert's weights, the planned move
lowers the max-rank rows of a skewed router, a rank with no tokens takes part, quantized dtypes move as bytes, and
ranks given different placements all raise CFG024. Every rank must report every case within its deadline."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from launch import read_reports, torchrun  # noqa: E402

pytestmark = pytest.mark.dist

LAUNCH_TIMEOUT_S = 90
CASE_DEADLINE_S = 15.0
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "eplb_worker.py")
CASES = ["rebalance_keeps_output", "zero_tokens_on_one_rank", "different_placements", "quantized_bytes_cross_ranks"]


@pytest.fixture(scope="module", params=[2, 4], ids=["ep2", "ep4"])
def world_and_reports(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"eplb_ep{request.param}")
    launch = torchrun(request.param, [], out, LAUNCH_TIMEOUT_S, worker=WORKER)
    return request.param, launch, read_reports(out, request.param)


def _reports(world_and_reports, case):
    world, launch, reports = world_and_reports
    out = []
    for rank in range(world):
        report = reports[rank].get(case)
        assert report is not None, f"{rank=} {case}: never reported; rc={launch.returncode}\n{launch.log[-3000:]}"
        assert "error" not in report and report["seconds"] < CASE_DEADLINE_S, f"{rank=} {case}: {report}"
        out.append(report)
    return out


def test_rebalance_keeps_the_output_moves_every_slot_and_evens_the_rows(world_and_reports):
    reports = _reports(world_and_reports, "rebalance_keeps_output")
    for rank, report in enumerate(reports):
        assert report["max_abs_output_diff"] < 1e-5 and report["slots_ok"] is True, f"{rank=}: {report}"
        assert report["max_rank_rows_after"] < report["max_rank_rows_before"], f"{rank=}: {report}"
    assert len({r["max_rank_rows_after"] for r in reports}) == 1  # the gathered load is the same everywhere


def test_a_rank_without_tokens_takes_part_in_the_move(world_and_reports):
    for rank, report in enumerate(_reports(world_and_reports, "zero_tokens_on_one_rank")):
        assert report["shape_ok"] is True and report["close"] is True, f"{rank=}: {report}"
        assert (report["tokens"] == 0) == (rank == 1)


def test_ranks_given_different_placements_all_raise_cfg024(world_and_reports):
    for rank, report in enumerate(_reports(world_and_reports, "different_placements")):
        assert report["code"] == "CFG024" and report["kept_old_map"] is True, f"{rank=}: {report}"


def test_quantized_dtypes_move_between_ranks_as_bytes(world_and_reports):
    for rank, report in enumerate(_reports(world_and_reports, "quantized_bytes_cross_ranks")):
        assert report["bytes_ok"] is True, f"{rank=}: {report}"
