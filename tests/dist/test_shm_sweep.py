"""The shared-memory sweep removes the files of dead creators only. Moved from tests/unit/test_capacity.py: it
starts a process (to get the pid of a process that has ended), so it is in the dist tier."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from moe_ref.ep.buffer import sweep_stale_shm_files

pytestmark = pytest.mark.dist


def test_sweep_removes_files_of_dead_creators_only(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / f"moe_ref_0123456789ab_{dead_pid}_r1"
    live = tmp_path / f"moe_ref_0123456789ab_{os.getpid()}_r0"
    other = tmp_path / "unrelated_file"
    for path in (stale, live, other):
        path.write_bytes(b"x")
    removed = sweep_stale_shm_files(str(tmp_path))
    assert removed == [str(stale)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])
