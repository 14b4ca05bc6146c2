"""Where an EP call's agreements run, at 2 ranks (gloo; the same code runs over NCCL on GPUs): the per-call
agreement on host integers over the group's gloo host group (no wait for the GPU), and exactly one collective on
the EP group per call (the failure agreement, which also reads the device checks: the call's one host sync on
CUDA), NaN logits on one rank still INP004 on every rank (tests/dist/host_group_worker.py)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from launch import read_reports, torchrun  # noqa: E402

pytestmark = pytest.mark.dist

WORLD_SIZE = 2
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_group_worker.py")


def test_one_collective_on_the_ep_group_per_call(tmp_path):
    launch = torchrun(WORLD_SIZE, [], tmp_path, 120, worker=WORKER)
    reports = read_reports(tmp_path, WORLD_SIZE)
    for rank in range(WORLD_SIZE):
        report = reports[rank].get("host_group")
        assert report is not None, f"{rank=}: never reported; rc={launch.returncode}\n{launch.log[-3000:]}"
        assert report["shared"] and report["host_is_gloo_not_world"], report
        assert report["gathers_per_call"] == ["host", "world"], report
        assert report["matches_reference"], report
        assert report["nan_code"] == "INP004", report
        assert report["gathers_nan_call"] == ["host", "world"], report
    assert launch.returncode == 0, launch.log[-3000:]
