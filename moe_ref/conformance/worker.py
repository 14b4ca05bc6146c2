"""One rank of a conformance run (``python -m moe_ref.conformance.worker SPEC.json RANK``): join the group, run the
jobs (``(implementation, case id)`` pairs) in order, append one JSON line per step and per verdict, keyed by the job's
index, to ``<out>/rank<r>.jsonl`` (what ``spawn`` watches).
An exception outside a case's checks, or one that may leave the peers inside a collective, ends the process (exit
3) after its verdict is written: the parent restarts the group at the next case."""
from __future__ import annotations

import datetime
import json
import os
import sys


def main(spec_path: str, rank: int) -> int:
    import torch
    import torch.distributed as dist

    from moe_ref.conformance.registry import resolve
    from moe_ref.conformance.runner import run_case
    from moe_ref.conformance.scenarios import case_by_id

    spec = json.loads(open(spec_path).read())
    world, device_type = spec["world"], spec["device"]
    out = open(os.path.join(spec["out"], f"rank{rank}.jsonl"), "a", buffering=1)

    def emit(**record) -> None:
        out.write(json.dumps(record) + "\n")

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    group = None
    if world > 1:
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=spec["init"], rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=spec["deadline_s"]))
        group = dist.group.WORLD
    impls = {}
    for job, (impl_spec, case_id) in enumerate(spec["jobs"]):
        emit(job=job, step="begin")
        if impl_spec not in impls:
            impls[impl_spec] = resolve(impl_spec)
        verdict = run_case(impls[impl_spec], case_by_id(case_id, spec["seed"]), rank, world, group, device,
                           progress=lambda step, j=job: emit(job=j, step=step), timer=spec["timer"])
        emit(job=job, verdict=verdict.as_dict())
        if verdict.error is not None and world > 1:
            # the peers may be waiting inside a collective this rank left: leave now, without the process group's
            # teardown (which waits on them, or aborts the process)
            out.flush()
            os._exit(3)
    if group is not None:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
