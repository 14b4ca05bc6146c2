"""The fault table: one rank disagrees or fails; every rank raises a coded error within 10 s, and the
next call is correct. 2, 4 and 8 ranks, CPU (gloo, shared-memory transport), public ``MegaMoE`` only.

Each rank reports each case as soon as it ends (tests/dist/fault_worker.py); a rank that hangs never reports,
and the launch is killed at ``LAUNCH_TIMEOUT_S``: such a case fails here for the missing rank, not later in
torchrun. The process group's own timeout is 120 s, so nothing but the layer can end a case within 10 s.
The same launch then runs calls out of step (two layers crossed, a layer called on one rank only, a step destroyed
on one rank: ENV004 / ENV017 on every rank). A launch of its own per case, the layer on an EP group with a 2 s
timeout, has one rank stay alive but stop calling: the others raise ENV018 within that timeout, not when the absent
rank's process ends.
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fault_worker import CASES, ORDER_CASES, STOP_AWAY_S, STOP_TIMEOUT_S  # noqa: E402
from launch import read_reports, torchrun  # noqa: E402

pytestmark = pytest.mark.dist

WORLD_SIZES = (2, 4, 8)  # 8: the code paths of an EP 8 group, ~22 s of the suite on 2 cores
LAUNCH_TIMEOUT_S = 300
CASE_DEADLINE_S = 10.0
FAULT_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_worker.py")


@pytest.fixture(scope="session")
def fault_reports(tmp_path_factory):
    """``fault_reports(world) -> (launch, {rank: {case: report}})``, one cached launch per world size."""
    cache = {}

    def get(world_size: int, compile_backend: str | None = None):
        key = (world_size, compile_backend)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"faults{world_size}{compile_backend or ''}")
            flags = ["--kill"] if compile_backend is None else ["--compile", compile_backend]
            launch = torchrun(world_size, flags, out, LAUNCH_TIMEOUT_S, worker=FAULT_WORKER)
            cache[key] = (launch, read_reports(out, world_size))
        return cache[key]
    return get


_CASES = [pytest.param(world, None, case, id=f"{world}ranks-{case[0]}")
          for world in WORLD_SIZES for case in CASES + ORDER_CASES]
# The same table with every call through torch.compile(fullgraph=True, dynamic=True), 2 ranks, both backends: the
# layer is one custom op there, and every call must still be collective (T = 0 and failures included). Compiling
# happens inside the case, so these cases get a longer deadline; it still proves no rank waited for the group's
# own timeout (GROUP_TIMEOUT_S = 120 s).
COMPILED_DEADLINE_S = 60.0
_CASES += [pytest.param(2, backend, case, id=f"2ranks-{backend}-{case[0]}")
           for backend in ("aot_eager", "inductor") for case in CASES if case[2] is not None]


@pytest.mark.parametrize("world_size, compile_backend, case", _CASES)
def test_every_rank_raises_a_coded_error_fast_and_recovers(fault_reports, world_size, compile_backend, case):
    name, build, call, faulty, code_at_fault, code_elsewhere = case
    launch, reports = fault_reports(world_size, compile_backend)
    deadline = CASE_DEADLINE_S if compile_backend is None else COMPILED_DEADLINE_S
    faulty_rank = faulty % world_size
    for rank in range(world_size):
        report = reports[rank].get(name)
        assert report is not None, (f"{world_size=} {compile_backend=} {rank=} {name}: this rank never reported (it "
                                    f"hung or died); launch rc={launch.returncode}\n{launch.log[-3000:]}")
        expected = code_at_fault if rank == faulty_rank else code_elsewhere
        assert report["code"] == expected, f"{world_size=} {compile_backend=} {rank=} {name}: {report}"
        assert report["seconds"] < deadline, f"{world_size=} {compile_backend=} {rank=} {name}: too slow: {report}"
        if call is not None:
            assert report["next_ok"] is True, (f"{world_size=} {compile_backend=} {rank=} {name}: the next call was "
                                               f"wrong: {report}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_dead_peer_is_a_coded_error_on_the_survivors(fault_reports, world_size):
    launch, reports = fault_reports(world_size)
    for rank in range(world_size - 1):  # the last rank killed itself
        report = reports[rank].get("dead_peer")
        assert report is not None, f"{world_size=} {rank=}: never reported after the peer died\n{launch.log[-3000:]}"
        assert report["code"] == "ENV005", f"{world_size=} {rank=}: {report}"
        assert report["seconds"] < CASE_DEADLINE_S, f"{world_size=} {rank=}: {report}"
    assert launch.leftovers == [], f"files left in MOE_REF_SHM_DIR: {launch.leftovers}"


STOP_DEADLINE_S = STOP_TIMEOUT_S + 4.0  # the group's timeout plus room for a loaded machine, far below STOP_AWAY_S
assert STOP_DEADLINE_S + 2 <= STOP_AWAY_S


# The wait is in the per-call agreement, before the transport moves anything: each transport runs at one world size.
@pytest.mark.parametrize("world_size, transport", [(2, "symm"), (4, "a2a")])
def test_a_live_peer_that_stops_calling_is_a_coded_error_within_the_group_timeout(tmp_path, world_size, transport):
    launch = torchrun(world_size, ["--stop-calling", transport], tmp_path, LAUNCH_TIMEOUT_S, worker=FAULT_WORKER)
    reports = read_reports(tmp_path, world_size)
    for rank in range(world_size):
        report = reports[rank].get("peer_stops_calling")
        assert report is not None, (f"{world_size=} {transport=} {rank=}: never reported; rc={launch.returncode}\n"
                                    f"{launch.log[-3000:]}")
        if rank == world_size - 1:  # the absent rank: alive all along, made no call
            assert report["code"] is None and report["seconds"] >= STOP_AWAY_S, report
            continue
        assert report["code"] == "ENV018", f"{world_size=} {transport=} {rank=}: {report}"
        assert report["seconds"] < STOP_DEADLINE_S, f"{world_size=} {transport=} {rank=}: too slow: {report}"
        assert f"the EP group's timeout is {STOP_TIMEOUT_S} s" in report["message"], report
