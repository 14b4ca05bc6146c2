"""The rank processes of a conformance run: one process per rank (gloo on CPU, NCCL on GPUs) that stays alive across
the jobs of a run (every implementation and case at that rank count, in order), one deadline per job (a speed case's
``tune`` step has ``TUNE_DEADLINE_S``, and the job's deadline starts again after it). A job that
passes its deadline is a FAIL naming every rank's last step, never a stuck run: the group is killed and started
again at the next job; so is a group whose rank exited mid-job.

    run_jobs([(impl, case id), ...], world, device, deadline_s) -> {(impl, case id): merged record}
    run_cases(impl, case_ids, world, device, deadline_s)        -> {case id: merged record}

One group per rank count, not per implementation: starting the ranks (importing torch and moe_ref, joining the
group) costs seconds per process, more than the tiny cases themselves.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from moe_ref.core.errors import ConformanceSpawnError

POLL_S = 0.05
TUNE_DEADLINE_S = 1800.0  # seconds a speed case's tune (a config search: tens of compiles) may take


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Tail:
    """The whole JSON lines appended to one rank's file since the last ``poll`` (a line being written has no
    newline yet: it waits for the next poll), so each poll reads only what is new."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0

    def poll(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        return [json.loads(line) for line in data[:end].decode().splitlines() if line]


def merge(per_rank: dict[int, dict]) -> dict:
    """One case's record from every rank's verdict: FAIL if any rank failed, the reasons prefixed by rank; the
    slowest rank's time."""
    statuses = [v["status"] for v in per_rank.values()]
    status = "FAIL" if "FAIL" in statuses else "SKIP" if "SKIP" in statuses else "PASS"
    failed = {f"{check}@rank{r}": why for r, v in sorted(per_rank.items()) for check, why in v["failed"].items()}
    errors = [f"rank {r}: {v['error']}" for r, v in sorted(per_rank.items()) if v.get("error")]
    times = [v["us"] for v in per_rank.values() if v.get("us") is not None]
    tunes = [v["tune_s"] for v in per_rank.values() if v.get("tune_s") is not None]
    first = per_rank[min(per_rank)]
    return {"status": status, "failed": failed, "errors": errors, "us": max(times) if times else None,
            "tune_s": max(tunes) if tunes else None, "bytes": first.get("bytes", 0), "flops": first.get("flops", 0),
            "kernels": first.get("kernels")}


def run_jobs(jobs: list[tuple[str, str]], world: int, device: str, deadline_s: float, seed: int = 0,
             timer: str | None = None, on_done: Callable[[tuple[str, str], dict], None] | None = None,
             stop_at: float | None = None) -> dict[tuple[str, str], dict]:
    """Run ``jobs`` (``(implementation, case id)`` pairs: a registered name or ``module:attribute``, and a case id
    ``scenarios.case_by_id`` knows) at ``world`` ranks in one group of rank processes, restarted only after a hang or
    a rank's exit; returns each job's merged record (``merge``; a hang: FAIL with ``errors`` naming each rank's last
    step). ``timer``: time each job after its checks pass with this key of ``runner.TIMERS`` (speed cases); None:
    checks only. ``on_done(job, record)`` is called as each job's record is merged. ``stop_at`` (``time.monotonic()``):
    once passed, the group stops after the job it is in, and the jobs not run are absent from the result."""
    from moe_ref.conformance.runner import TIMERS

    if timer is not None and timer not in TIMERS:  # e.g. a bool in the place of the former ``speed`` flag
        raise TypeError(f"run_jobs: timer={timer!r}; one of {tuple(TIMERS)}, or None for the checks alone")
    results: dict[tuple[str, str], dict] = {}
    pending = list(dict.fromkeys(tuple(job) for job in jobs))
    while pending and (stop_at is None or time.monotonic() < stop_at):
        results.update(_one_group(pending, world, device, deadline_s, seed, timer, on_done or (lambda job, rec: None),
                                  stop_at))
        pending = [job for job in pending if job not in results]
    return results


def run_cases(impl_spec: str, case_ids: list[str], world: int, device: str, deadline_s: float, seed: int = 0,
              timer: str | None = None) -> dict[str, dict]:
    """``run_jobs`` for one implementation: ``{case id: merged record}``."""
    done = run_jobs([(impl_spec, case_id) for case_id in case_ids], world, device, deadline_s, seed, timer)
    return {case_id: done[(impl_spec, case_id)] for case_id in case_ids}


class _RankState:
    """What one rank reported: the verdict of each job index, and the last step of each job begun."""

    def __init__(self, path: Path):
        self.tail, self.verdicts, self.steps = _Tail(path), {}, {}

    def poll(self) -> None:
        for rec in self.tail.poll():
            if "verdict" in rec:
                self.verdicts[rec["job"]] = rec["verdict"]
            else:
                self.steps[rec["job"]] = rec["step"]


def _one_group(jobs, world, device, deadline_s, seed, timer, on_done, stop_at=None) -> dict[tuple[str, str], dict]:
    """Start the group on ``jobs``; return the records of the jobs it finished, plus the one it failed on."""
    out = Path(tempfile.mkdtemp(prefix="moe_ref_conform_"))
    shm = tempfile.mkdtemp(prefix="moe_ref_conform_", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    spec = {"jobs": [list(job) for job in jobs], "world": world, "device": device, "deadline_s": deadline_s,
            "seed": seed, "timer": timer, "out": str(out), "init": f"tcp://127.0.0.1:{_free_port()}"}
    (out / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MOE_REF_SHM_DIR": shm}
    procs = [subprocess.Popen([sys.executable, "-m", "moe_ref.conformance.worker", str(out / "spec.json"), str(r)],
                              stdout=open(out / f"rank{r}.log", "w"), stderr=subprocess.STDOUT, env=env,
                              start_new_session=True) for r in range(world)]
    ranks = [_RankState(out / f"rank{r}.jsonl") for r in range(world)]
    results: dict[tuple[str, str], dict] = {}
    begun: dict[int, float] = {}  # when the parent first saw each job begin (again, after its tune)
    tuned_jobs: set[int] = set()  # jobs seen in their tune step
    current = 0  # the index of the first job without a merged record (the jobs run in order)
    try:
        while True:
            time.sleep(POLL_S)
            for rank in ranks:
                rank.poll()
            while current < len(jobs) and all(current in rank.verdicts for rank in ranks):
                results[jobs[current]] = merge({r: rank.verdicts[current] for r, rank in enumerate(ranks)})
                on_done(jobs[current], results[jobs[current]])
                current += 1
            if current == len(jobs) or (stop_at is not None and time.monotonic() > stop_at):
                return results
            began = any(current in rank.steps for rank in ranks)
            exited = {r: p.poll() for r, p in enumerate(procs) if p.poll() is not None}
            if results and _left_before(current, ranks, exited):
                return results
            if not began and exited:
                impl_spec, case_id = jobs[current]
                raise ConformanceSpawnError(f"the {world} rank processes ended before {impl_spec} case {case_id} "
                                            f"began (exit {exited}): " + _tails(out, world))
            if began:
                # an implementation's own tuning (a speed case's ``tune``: a config search) has TUNE_DEADLINE_S;
                # the case's deadline starts again when it ends
                tuning = any(rank.steps.get(current) == "tune" for rank in ranks)
                if tuning:
                    tuned_jobs.add(current)
                elif current in tuned_jobs:
                    tuned_jobs.discard(current)
                    begun[current] = time.monotonic()
                limit_s = max(deadline_s, TUNE_DEADLINE_S) if tuning else deadline_s
                timed_out = time.monotonic() - begun.setdefault(current, time.monotonic()) > limit_s
                failed_rank = any(code != 0 for code in exited.values())
                if timed_out or failed_rank or len(exited) == world:
                    if failed_rank and not timed_out:
                        time.sleep(0.5)  # the failing rank's verdict is written before it exits
                        for rank in ranks:
                            rank.poll()
                        if all(current in rank.verdicts for rank in ranks):  # every rank finished it: no hang
                            results[jobs[current]] = merge({r: rank.verdicts[current] for r, rank in enumerate(ranks)})
                            on_done(jobs[current], results[jobs[current]])
                            return results
                        exited = {r: p.poll() for r, p in enumerate(procs) if p.poll() is not None}
                        if results and _left_before(current, ranks, exited):
                            return results
                    results[jobs[current]] = _abandoned(current, ranks, limit_s, timed_out, exited)
                    on_done(jobs[current], results[jobs[current]])
                    return results
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the rank and whatever it started: a session we created
            p.wait()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)


def _left_before(job: int, ranks: list[_RankState], exited: dict[int, int]) -> bool:
    """A rank left on purpose after the previous job raised (worker exit 3) without beginning ``job``: whatever its
    peers met in ``job`` (a dead peer in a collective) is no fault of ``job``; the group starts again at it."""
    return any(code == 3 and job not in ranks[r].steps for r, code in exited.items())


def _abandoned(job: int, ranks: list[_RankState], deadline_s: float, timed_out: bool, exited: dict) -> dict:
    """The record of a job the group did not finish: each rank's verdict where written, else its last step."""
    per_rank = {r: rank.verdicts[job] for r, rank in enumerate(ranks) if job in rank.verdicts}
    last_steps = [f"rank {r}: {'verdict' if r in per_rank else rank.steps.get(job, 'not begun')}"
                  + (f" (exit {exited[r]})" if r in exited else "") for r, rank in enumerate(ranks)]
    record = merge(per_rank) if per_rank else {"status": "FAIL", "failed": {}, "errors": [], "us": None,
                                               "tune_s": None, "bytes": 0, "flops": 0}
    record["status"] = "FAIL"
    why = f"hang: past the {deadline_s:g} s deadline" if timed_out else "a rank exited mid-case"
    record["failed"]["deadline" if timed_out else "exit"] = f"{why}; last steps: {'; '.join(last_steps)}"
    return record


def _tails(out: Path, world: int) -> str:
    return " | ".join(f"rank {r}: " + " / ".join((out / f"rank{r}.log").read_text().strip().splitlines()[-3:])
                      for r in range(world) if (out / f"rank{r}.log").exists())
