"""MegaMoE decode captured in a CUDA graph and replayed with new inputs == eager, bitwise:
one GPU (the local transport) and two GPUs (symm, beside a2a). Runs tests/gpu/graph_worker.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parent / "graph_worker.py"
REPO = WORKER.parents[2]

pytestmark = pytest.mark.cuda  # the two-GPU case adds cuda2 (make test-gpu leaves cuda2 out)


def _run(nproc: int, out: Path) -> dict[int, dict]:
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                     f"--nproc-per-node={nproc}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1"}
    proc = subprocess.run([*launcher, str(WORKER), "--out", str(out)], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in range(nproc)}


def _failures(results: dict[int, dict]) -> list[str]:
    failures = []
    for rank, cases in results.items():
        assert cases, f"rank {rank}: no cases ran"
        for case, result in cases.items():
            if "error" in result:
                failures.append(f"rank {rank} {case}: {result['error']}")
                continue
            assert result["checks"], f"rank {rank} {case}: no checks"
            failures += [f"rank {rank} {case}: {name} ({result['info']})" for name, ok in result["checks"].items()
                         if not ok]
    return failures


@pytest.mark.cuda
# slow: spawns tests/gpu/graph_worker.py, a fresh process that compiles every kernel again (36 s as gpu_suite.sh's
# graph1 step, which runs the same worker)
@pytest.mark.slow
def test_graph_replay_equals_eager_one_gpu(tmp_path):
    results = _run(1, tmp_path)
    assert not _failures(results), "\n".join(_failures(results))


@pytest.mark.cuda2
def test_graph_replay_equals_eager_two_gpus(tmp_path):
    results = _run(2, tmp_path)
    assert sorted(results) == [0, 1]
    assert not _failures(results), "\n".join(_failures(results))
