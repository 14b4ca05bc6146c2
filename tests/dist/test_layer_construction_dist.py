"""MegaMoE's construction at 2 ranks (gloo, tests/dist/layer_construction_worker.py): a seed of the wrong type
(INP009) or an experts backend that cannot run (ENV001) on ONE rank is that coded error on every rank, fast, and the
next layer builds and runs; a layer over a real process group refuses to pickle (CFG020) on every rank."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from launch import read_reports, torchrun  # noqa: E402

pytestmark = pytest.mark.dist

WORLD_SIZE = 2
LAUNCH_TIMEOUT_S = 120
CASE_DEADLINE_S = 10.0
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "layer_construction_worker.py")
EXPECTED = {"seed_of_the_wrong_type_on_one_rank": "INP009", "triton_experts_unusable_on_one_rank": "ENV001",
            "pickle_a_layer_over_the_group": "CFG020"}


@pytest.fixture(scope="module")
def launch_and_reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("layer_construction")
    launch = torchrun(WORLD_SIZE, [], out, LAUNCH_TIMEOUT_S, worker=WORKER)
    return launch, read_reports(out, WORLD_SIZE)


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_every_rank_raises_the_code_and_the_next_layer_works(launch_and_reports, case):
    launch, reports = launch_and_reports
    for rank in range(WORLD_SIZE):
        report = reports[rank].get(case)
        assert report is not None, f"{rank=} {case}: never reported; rc={launch.returncode}\n{launch.log[-3000:]}"
        assert report["code"] == EXPECTED[case], f"{rank=} {case}: {report}"
        assert report["seconds"] < CASE_DEADLINE_S and report["next_ok"] is True, f"{rank=} {case}: {report}"
