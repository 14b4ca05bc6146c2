"""The compiled CPU EP ops across 2 real processes over /dev/shm (tests/dist/native_ops_cpu_worker.py); the
one-process checks of the same ops are tests/unit/test_native_ops.py. Moved here from that file: it starts
torchrun, so it belongs to the dist tier.

The library must be built (`make install`): without it this test FAILS, unless MOE_REF_NATIVE=0 is set
deliberately (then it skips).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from moe_ref.kernels.runtime import native  # noqa: E402

pytestmark = pytest.mark.dist

FORCED_FALLBACK = os.environ.get(native.ENV_VAR, "1").strip().lower() in ("0", "false", "no", "off")


@pytest.mark.skipif(FORCED_FALLBACK, reason=f"{native.ENV_VAR}=0 set deliberately: compiled ops off")
def test_compiled_ops_across_two_processes(tmp_path):
    from launch import torchrun

    assert native.is_active(), f"compiled ops not active: {native.native_status()} (build with `make install`)"
    worker = HERE / "native_ops_cpu_worker.py"
    launch = torchrun(2, [], tmp_path / "out", 90, worker=worker)  # ~10 s on an idle 2-core machine
    assert launch.returncode == 0, f"{launch.returncode=} after {launch.seconds:.0f} s\n{launch.log[-4000:]}"
    assert sorted(launch.results) == [0, 1], f"not every rank reported\n{launch.log[-4000:]}"
    for rank, cases in launch.results.items():
        assert cases, f"rank {rank} reported no case"
        for case, result in cases.items():
            assert all(result["checks"].values()), f"{rank=} {case=} {result}"
    assert not launch.leftovers, f"files left in the shm folder: {launch.leftovers}"
