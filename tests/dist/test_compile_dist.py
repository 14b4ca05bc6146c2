"""torch.compile(dynamic=True, fullgraph=True) around MegaMoE at 2 ranks (gloo), inductor and aot_eager: a rank
with T = 0 still runs the op (its peers would wait 30 s and raise ENV005 otherwise), outputs equal eager, and a
gradient asked for on one rank is INP007 on every rank. Every rank must report each case within its deadline
(tests/dist/compile_worker.py)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compile_worker import CASES  # noqa: E402
from launch import read_reports, torchrun  # noqa: E402

pytestmark = pytest.mark.dist

WORLD_SIZE = 2
LAUNCH_TIMEOUT_S = 480
CASE_DEADLINE_S = 10.0
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_worker.py")


@pytest.fixture(scope="module")
def compile_reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile")
    launch = torchrun(WORLD_SIZE, [], out, LAUNCH_TIMEOUT_S, worker=WORKER)
    return launch, read_reports(out, WORLD_SIZE)


@pytest.mark.parametrize("case", [name for name, _, _ in CASES])
def test_compiled_layer_keeps_the_collective_contract(compile_reports, case):
    launch, reports = compile_reports
    for rank in range(WORLD_SIZE):
        report = reports[rank].get(case)
        assert report is not None, (f"{rank=} {case}: this rank never reported (it hung or died); "
                                    f"launch rc={launch.returncode}\n{launch.log[-3000:]}")
        assert report["seconds"] < CASE_DEADLINE_S, f"{rank=} {case}: too slow: {report}"
        if case.startswith("empty_rank"):
            assert report["code"] is None and report["ok"] is True, f"{rank=} {case}: {report}"
        else:
            assert report["code"] == "INP007", f"{rank=} {case}: {report}"
    assert launch.returncode == 0, launch.log[-3000:]
