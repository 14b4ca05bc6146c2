"""The device-side EP kernels (Triton interpreter) and their torch twins across real processes (torchrun,
gloo, /dev/shm heap), 2 and 4 ranks: every rank's output and whole buffer equal a one-process simulation of the
group bitwise, and outputs match the float64 oracle (see ep_kernels_cpu_worker.py)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from launch import torchrun  # noqa: E402

pytestmark = pytest.mark.dist

WORKER = Path(__file__).resolve().parent / "ep_kernels_cpu_worker.py"
LAUNCH_TIMEOUT_S = 240  # about 20 s (2 ranks) and 40 s (4 ranks) on an idle 2-core machine


@pytest.mark.parametrize("world_size", [2, 4])
def test_ep_kernels_and_twins_across_processes(world_size, tmp_path):
    launch = torchrun(world_size, [], tmp_path / "out", LAUNCH_TIMEOUT_S, worker=WORKER)
    assert launch.returncode == 0, f"{launch.returncode=} after {launch.seconds:.0f} s\n{launch.log[-4000:]}"
    assert sorted(launch.results) == list(range(world_size)), launch.log[-4000:]
    for rank, cases in launch.results.items():
        for case, result in cases.items():
            assert all(result["checks"].values()), f"{rank=} {case=} {result}"
    assert not launch.leftovers, f"files left in the shm folder: {launch.leftovers}"
