"""The rank processes of a conformance run: one process per rank (gloo on CPU, NCCL on GPUs), the cases in order,
one deadline per case. A case that passes its deadline is a FAIL naming every rank's last step, never a stuck run:
the group is killed and started again at the next case; so is a group whose rank exited mid-case.

    run_cases(impl, cases, world, device, deadline_s) -> {case id: merged record}
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

from moe_ref.core.errors import ConformanceSpawnError

POLL_S = 0.05


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    # a line being written has no newline yet: keep only whole lines
    text = path.read_text()
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines() if line]


def merge(per_rank: dict[int, dict]) -> dict:
    """One case's record from every rank's verdict: FAIL if any rank failed, the reasons prefixed by rank; the
    slowest rank's time."""
    statuses = [v["status"] for v in per_rank.values()]
    status = "FAIL" if "FAIL" in statuses else "SKIP" if "SKIP" in statuses else "PASS"
    failed = {f"{check}@rank{r}": why for r, v in sorted(per_rank.items()) for check, why in v["failed"].items()}
    errors = [f"rank {r}: {v['error']}" for r, v in sorted(per_rank.items()) if v.get("error")]
    times = [v["us"] for v in per_rank.values() if v.get("us") is not None]
    first = per_rank[min(per_rank)]
    return {"status": status, "failed": failed, "errors": errors, "us": max(times) if times else None,
            "bytes": first.get("bytes", 0), "flops": first.get("flops", 0)}


def run_cases(impl_spec: str, case_ids: list[str], world: int, device: str, deadline_s: float, seed: int = 0,
              speed: bool = False) -> dict[str, dict]:
    """Run ``case_ids`` of ``impl_spec`` (a registered name or ``module:attribute``) at ``world`` ranks; returns each
    case's merged record (``merge``; a hang: FAIL with ``errors`` naming each rank's last step)."""
    results: dict[str, dict] = {}
    pending = list(case_ids)
    while pending:
        results.update(_one_group(impl_spec, pending, world, device, deadline_s, seed, speed))
        pending = [c for c in pending if c not in results]
    return results


def _one_group(impl_spec, case_ids, world, device, deadline_s, seed, speed) -> dict[str, dict]:
    """Start the group on ``case_ids``; return the records of the cases it finished, plus the one it failed on."""
    out = Path(tempfile.mkdtemp(prefix="moe_ref_conform_"))
    shm = tempfile.mkdtemp(prefix="moe_ref_conform_", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    spec = {"impl": impl_spec, "cases": case_ids, "world": world, "device": device, "deadline_s": deadline_s,
            "seed": seed, "speed": speed, "out": str(out), "init": f"tcp://127.0.0.1:{_free_port()}"}
    (out / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MOE_REF_SHM_DIR": shm}
    procs = [subprocess.Popen([sys.executable, "-m", "moe_ref.conformance.worker", str(out / "spec.json"), str(r)],
                              stdout=open(out / f"rank{r}.log", "w"), stderr=subprocess.STDOUT, env=env,
                              start_new_session=True) for r in range(world)]
    results: dict[str, dict] = {}
    begun: dict[str, float] = {}  # when the parent first saw each case begin
    try:
        started = time.monotonic()
        while True:
            time.sleep(POLL_S)
            lines = {r: _read_lines(out / f"rank{r}.jsonl") for r in range(world)}
            verdicts = {r: {rec["case"]: rec["verdict"] for rec in recs if "verdict" in rec} for r, recs in lines.items()}
            for case_id in case_ids:
                if case_id not in results and all(case_id in verdicts[r] for r in range(world)):
                    results[case_id] = merge({r: verdicts[r][case_id] for r in range(world)})
            current = next((c for c in case_ids if c not in results), None)
            if current is None:
                return results
            begins = [rec for recs in lines.values() for rec in recs if rec.get("case") == current]
            exited = {r: p.poll() for r, p in enumerate(procs) if p.poll() is not None}
            since = time.monotonic() - started if not begins else None
            if not begins and exited and since is not None:
                raise ConformanceSpawnError(f"the {world} rank processes of {impl_spec} ended before case {current} "
                                            f"began (exit {exited}): " + _tails(out, world))
            if begins:
                timed_out = time.monotonic() - begun.setdefault(current, time.monotonic()) > deadline_s
                failed_rank = any(code != 0 for code in exited.values())
                if timed_out or failed_rank or len(exited) == world:
                    if failed_rank and not timed_out:
                        time.sleep(0.5)  # the failing rank's verdict is written before it exits
                    results[current] = _abandoned(current, out, world, deadline_s, timed_out, exited)
                    return results
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the rank and whatever it started: a session we created
            p.wait()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)


def _abandoned(case_id: str, out: Path, world: int, deadline_s: float, timed_out: bool, exited: dict) -> dict:
    """The record of a case the group did not finish: each rank's verdict where written, else its last step."""
    per_rank, last_steps = {}, []
    for r in range(world):
        recs = [rec for rec in _read_lines(out / f"rank{r}.jsonl") if rec.get("case") == case_id]
        verdict = next((rec["verdict"] for rec in recs if "verdict" in rec), None)
        if verdict is not None:
            per_rank[r] = verdict
        last_steps.append(f"rank {r}: {recs[-1]['step'] if recs and 'step' in recs[-1] else 'verdict' if verdict else 'not begun'}"
                          + (f" (exit {exited[r]})" if r in exited else ""))
    record = merge(per_rank) if per_rank else {"status": "FAIL", "failed": {}, "errors": [], "us": None, "bytes": 0,
                                               "flops": 0}
    record["status"] = "FAIL"
    why = f"hang: past the {deadline_s:g} s deadline" if timed_out else "a rank exited mid-case"
    record["failed"]["deadline" if timed_out else "exit"] = f"{why}; last steps: {'; '.join(last_steps)}"
    return record


def _tails(out: Path, world: int) -> str:
    return " | ".join(f"rank {r}: " + " / ".join((out / f"rank{r}.log").read_text().strip().splitlines()[-3:])
                      for r in range(world) if (out / f"rank{r}.log").exists())
