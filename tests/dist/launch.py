"""Launching a torchrun job from a test (private shared-memory folder, wall-clock limit, per-rank results), and the
two ends of the per-case reports that case workers write: ``join_group`` in the worker, ``read_reports`` in the test."""
from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from moe_ref.ep.buffer import sweep_stale_shm_files

REPO = Path(__file__).resolve().parents[2]
EP_WORKER = Path(__file__).resolve().parent / "ep_worker.py"


@dataclass
class Launch:
    returncode: int | None  # None: killed at the time limit
    seconds: float
    log: str
    leftovers: list[str]  # files left in the private MOE_REF_SHM_DIR after the job
    results: dict[int, dict]  # rank -> {case id -> result}


def _private_shm_dir() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.mkdtemp(prefix="moe_ref_test_", dir=base)


def torchrun(nproc: int, worker_args: list[str], out_dir: Path, timeout_s: float, worker: Path = EP_WORKER,
             env_overrides: dict[str, str] | None = None) -> Launch:
    """Run ``worker`` under torchrun with a private shm folder; kill the whole job at the limit.
    Each rank writes ``out_dir/rank{r}.json``; ``Launch.results`` holds them."""
    shm_dir = _private_shm_dir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MOE_REF_SHM_DIR": shm_dir,
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **(env_overrides or {})}
    for name in ("MOE_REF_NUM_MAX_TOKENS_PER_RANK", "MOE_REF_OVERFLOW_POLICY", "MOE_REF_TRANSPORT"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(worker),
           "--out", str(out_dir), *worker_args]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout_s)
        returncode = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its workers: the session we started
        log, _ = proc.communicate()
        returncode = None
    seconds = time.perf_counter() - start
    leftovers = sorted(os.listdir(shm_dir))
    if leftovers:  # the next buffer on this host would remove files of dead creators; report them first
        sweep_stale_shm_files(shm_dir)
    shutil.rmtree(shm_dir, ignore_errors=True)
    results = {}
    for rank in range(nproc):
        path = out_dir / f"rank{rank}.json"
        if path.exists():
            results[rank] = json.loads(path.read_text())
    return Launch(returncode, seconds, log, leftovers, results)


def join_group(out_dir: str, group_timeout_s: float) -> tuple[int, int, Callable[[dict], None]]:
    """A case worker's start: SIGTERM ends it (exit 143), one thread, warnings off, the gloo group; returns (rank,
    world, report), where ``report(result)`` appends one JSON line to ``out_dir/rank{r}.jsonl`` as the case ends
    (a rank that hangs never reports, which ``read_reports`` shows)."""
    import torch
    import torch.distributed as dist

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=group_timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(out_dir, exist_ok=True)
    out_path = os.path.join(out_dir, f"rank{rank}.jsonl")

    def report(result: dict) -> None:
        with open(out_path, "a") as f:
            f.write(json.dumps(result) + "\n")

    return rank, world, report


def read_reports(out_dir: Path, world_size: int) -> dict[int, dict[str, dict]]:
    """``{rank: {case: report}}`` from the lines ``join_group``'s ``report`` wrote (a rank that never reported a
    case has no entry for it)."""
    reports = {}
    for rank in range(world_size):
        path = out_dir / f"rank{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        reports[rank] = {r["case"]: r for r in map(json.loads, lines)}
    return reports
