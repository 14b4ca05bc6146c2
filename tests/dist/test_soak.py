"""Soak: many calls with random T per rank (0 and > cap included), both transports, every output vs the
oracle, resident memory flat, nothing left in the shared-memory folder. CI runs a short soak (``-m soak``
is part of the default run); ``scripts/soak.py`` runs the long one (10,000 calls at EP2 and EP4)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from launch import torchrun  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.soak]

SOAK_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "soak_worker.py")
# RSS may grow while allocator pools and caches warm up; after the first records it must stay flat.
RSS_GROWTH_LIMIT_BYTES = 16 << 20


def check_soak(launch, world_size: int, calls_per_rank: int) -> None:
    """Assertions shared by the short CI soak and scripts/soak.py's long one."""
    assert launch.returncode == 0, f"{world_size=}: rc={launch.returncode}\n{launch.log[-3000:]}"
    assert sorted(launch.results) == list(range(world_size)), f"{world_size=}: missing ranks"
    assert launch.leftovers == [], f"{world_size=}: leaked shared-memory files {launch.leftovers}"
    for rank, report in launch.results.items():
        assert report["calls"] == calls_per_rank, (rank, report["calls"])
        assert report["mismatches"] == 0, (rank, report["first_mismatches"])
        rss = report["rss"]
        warm = rss[min(2, len(rss) - 1)]
        assert rss[-1] - warm <= RSS_GROWTH_LIMIT_BYTES, f"{rank=}: RSS grew {rss[-1] - warm} bytes: {rss}"


@pytest.mark.parametrize("world_size", [2])
def test_short_soak(tmp_path, world_size):
    calls = 150
    launch = torchrun(world_size, ["--calls", str(calls)], tmp_path / "out", 400, worker=SOAK_WORKER)
    check_soak(launch, world_size, 2 * calls)
