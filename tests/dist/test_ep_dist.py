"""Expert parallelism across processes (torchrun, gloo, CPU): both transports, 2, 4 and 8 ranks.

One torchrun launch per world size runs the cases of ``ep_cases.launch_cases`` (process start-up is the
expensive part on 2 cores): every case at 2 and 4 ranks, the selection ``ep_cases.LAUNCH_SUBSETS[8]`` at 8
(what changes with R=8; start-up alone is ~20 s there); each parametrized test then asserts one case on
every rank. The 8-rank tests' ids contain ``8ranks`` (``pytest -k 8ranks`` runs that launch alone). Fault
launches check that a failing or killed rank ends the job quickly and leaves nothing in the shared-memory
folder. Every launch has a wall-clock limit, so a hang fails the test instead of stalling the suite.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ep_cases  # noqa: E402
from launch import Launch, torchrun  # noqa: E402


pytestmark = pytest.mark.dist

WORLD_SIZES = (2, 4, 8)
LAUNCH_TIMEOUT_S = 240  # the cases of one world size (about 15-35 s when the machine is idle)
FAULT_TIMEOUT_S = 90  # a failing job must end well within this (the worker's group timeout is 60 s)


@pytest.fixture(scope="session")
def launches(tmp_path_factory):
    """``launches(world_size)``: the (cached) launch running the cases of that world size."""
    cache: dict[int, Launch] = {}

    def get(world_size: int) -> Launch:
        if world_size not in cache:
            folder = tmp_path_factory.mktemp(f"ep{world_size}")
            case_file = folder / "cases.json"
            case_file.write_text(json.dumps(ep_cases.launch_cases(world_size)))
            cache[world_size] = torchrun(world_size, ["--case-file", str(case_file)], folder / "out", LAUNCH_TIMEOUT_S)
        return cache[world_size]
    return get


def _tail(log: str, lines: int = 40) -> str:
    return "\n".join(log.splitlines()[-lines:])


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda world_size: f"{world_size}ranks")
def test_launch_finishes_and_leaves_no_shared_memory(launches, world_size):
    launch = launches(world_size)
    assert launch.returncode is not None, f"{world_size=}: the job hung past {LAUNCH_TIMEOUT_S} s\n{_tail(launch.log)}"
    assert launch.returncode == 0, f"{world_size=}: rc={launch.returncode}\n{_tail(launch.log)}"
    assert sorted(launch.results) == list(range(world_size)), f"{world_size=}: missing rank results"
    assert launch.leftovers == [], f"{world_size=}: files left in MOE_REF_SHM_DIR: {launch.leftovers}"
    from moe_ref.kernels.runtime.native import is_active

    if is_active():  # built here (make install): the ranks ran the compiled ops, not the twins
        assert launch.log.count("CPU EP ops: compiled ops: active") == world_size, _tail(launch.log)
    print(f"\n{world_size} ranks: {len(ep_cases.launch_cases(world_size))} cases in {launch.seconds:.1f} s")


_CASES = [pytest.param(world_size, case, id=f"{world_size}ranks-{case['id']}")
          for world_size in WORLD_SIZES for case in ep_cases.launch_cases(world_size)]


@pytest.mark.parametrize("world_size, case", _CASES)
def test_case(launches, world_size, case):
    launch = launches(world_size)
    assert launch.results, f"{world_size=}: no results (rc={launch.returncode})\n{_tail(launch.log)}"
    for rank in range(world_size):
        result = launch.results.get(rank, {}).get(case["id"])
        assert result is not None, f"{world_size=} {rank=} {case=}: no result"
        assert "error" not in result, f"{world_size=} {rank=} case={case['id']}:\n{result['error']}"
        assert result["checks"], f"{world_size=} {rank=} case={case['id']}: no checks ran"
        failed = [name for name, ok in result["checks"].items() if not ok]
        assert not failed, f"{world_size=} {rank=} case={case['id']}: failed {failed}; info={result['info']}"


def test_every_case_with_the_torch_twins(tmp_path):
    """CI runs the compiled CPU ops (``make install`` builds them); this launch forces their torch twins
    (``MOE_REF_NATIVE=0``), so both CPU implementations of the symm data path pass every case at 2 ranks."""
    case_file = tmp_path / "cases.json"
    cases = ep_cases.enumerate_cases(2)
    case_file.write_text(json.dumps(cases))
    launch = torchrun(2, ["--case-file", str(case_file)], tmp_path / "out", LAUNCH_TIMEOUT_S,
                      env_overrides={"MOE_REF_NATIVE": "0"})
    assert launch.returncode == 0, f"rc={launch.returncode}\n{_tail(launch.log)}"
    assert sorted(launch.results) == [0, 1]
    assert launch.log.count("CPU EP ops: fallback: MOE_REF_NATIVE=0") == 2, _tail(launch.log)
    failures = []
    for rank, results in sorted(launch.results.items()):
        assert len(results) == len(cases), f"rank {rank}: {len(results)} of {len(cases)} cases reported"
        for case_id, result in results.items():
            if "error" in result:
                failures.append(f"rank {rank} {case_id}: {result['error'].strip().splitlines()[-1]}")
            else:
                failures += [f"rank {rank} {case_id}: {name}" for name, ok in result["checks"].items() if not ok]
    assert not failures, "\n".join(failures)


@pytest.mark.cuda2
def test_cases_on_two_gpus(tmp_path):
    """The same cases on 2 GPUs: NCCL, CUDA symmetric memory and the Triton pre-dispatch/combine kernels, plus
    FP8 dispatch into Triton FP8 experts."""
    case_file = tmp_path / "cases.json"
    case_file.write_text(json.dumps(ep_cases.enumerate_cases(2, device="cuda")))
    launch = torchrun(2, ["--case-file", str(case_file), "--device", "cuda"], tmp_path / "out", LAUNCH_TIMEOUT_S)
    assert launch.returncode == 0, f"rc={launch.returncode}\n{_tail(launch.log)}"
    failures = []
    for rank, results in sorted(launch.results.items()):
        for case_id, result in results.items():
            if "error" in result:
                failures.append(f"rank {rank} {case_id}: {result['error'].strip().splitlines()[-1]}")
            else:
                failures += [f"rank {rank} {case_id}: {name} ({result['info']})"
                             for name, ok in result["checks"].items() if not ok]
    assert sorted(launch.results) == [0, 1] and not failures, "\n".join(failures)


@pytest.mark.parametrize("fault", ["raise", "kill-after-setup", "kill-in-setup"])
def test_failed_rank_ends_job_and_releases_shared_memory(tmp_path, fault):
    """A rank raising, or SIGKILLed after or during the buffer's setup: the job ends within seconds (no
    hang) and no segment is left behind."""
    launch = torchrun(2, ["--fault", fault], tmp_path / "out", FAULT_TIMEOUT_S)
    assert launch.returncode is not None, f"{fault=}: the job hung past {FAULT_TIMEOUT_S} s\n{_tail(launch.log)}"
    assert launch.returncode != 0, f"{fault=}: the injected failure did not fail the job\n{_tail(launch.log)}"
    expected = "injected failure" if fault == "raise" else "SIGKILL"
    assert expected in launch.log, f"{fault=}: the job failed for another reason\n{_tail(launch.log)}"
    assert launch.seconds < 60, f"{fault=}: took {launch.seconds:.1f} s to fail"
    assert launch.leftovers == [], f"{fault=}: files left in MOE_REF_SHM_DIR: {launch.leftovers}"
