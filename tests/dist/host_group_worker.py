"""torchrun worker of tests/dist/test_host_group.py: where each call's agreements run.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist/host_group_worker.py --out OUT_DIR

Two layers on the WORLD group (gloo here; NCCL on GPUs): their routed steps share one host group, a gloo group of
the same ranks that is not WORLD. Every collective of ``moe_ref.ep.distributed.gather_ints`` is recorded with the
group it ran on: per call, the per-call agreement must run on the host group and exactly one gather on WORLD (the
failure agreement, which also reads the device checks: on NCCL the call's one host sync); the output must equal
the single-process reference. Rank 1 then feeds NaN: every rank must raise INP004 from that one gather.
Each rank writes one JSON line to ``OUT_DIR/rank{r}.jsonl``.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from launch import join_group  # noqa: E402  (tests/dist, beside this worker)
from moe_ref import MegaMoE
from moe_ref.core.config import preset
from moe_ref.core.errors import MoERefError
from moe_ref.core.weights import MoEWeights
from moe_ref.ep import distributed
from moe_ref.reference import reference_moe

PRESET = "tiny-kimi-k2"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rank, world, report = join_group(args.out, 120)
    layers = [MegaMoE(PRESET, dist.group.WORLD, num_max_tokens_per_rank=16, transport="symm", seed=3)
              for _ in range(2)]
    gathers = []
    original = distributed.gather_ints

    def recording(values, group=None, device="cpu", device_values=None, **kwargs):
        gathers.append("world" if group is dist.group.WORLD else "host" if group is steps()[0].host_group else "other")
        return original(values, group, device, device_values, **kwargs)

    def steps():
        return [layer.routed_step for layer in layers]

    result: dict = {"case": "host_group"}
    with torch.no_grad():
        x = torch.randn(3 + rank, preset(PRESET).hidden_size, generator=torch.Generator().manual_seed(rank))
        for layer in layers:
            layer(x[:1])  # builds each step (its own construction collectives are not counted)
        host = steps()[0].host_group
        result["shared"] = all(step.host_group is host for step in steps())
        result["host_is_gloo_not_world"] = host is not dist.group.WORLD and "gloo" in str(dist.get_backend(host))
        patched = [distributed, sys.modules["moe_ref.ep.overflow"]]
        for module in patched:
            module.gather_ints = recording
        try:
            y = layers[0](x)
            result["gathers_per_call"] = list(gathers)
            want = reference_moe(x, MoEWeights.random(preset(PRESET), seed=3), preset(PRESET))
            result["matches_reference"] = bool(torch.allclose(y, want, atol=1e-5, rtol=1e-5))
            gathers.clear()
            bad = x.clone()
            if rank == 1:
                bad[0, 0] = float("nan")
            try:
                layers[1](bad)
                result["nan_code"] = None
            except MoERefError as err:
                result["nan_code"] = err.code
            result["gathers_nan_call"] = list(gathers)
        finally:
            for module in patched:
                module.gather_ints = original
    report(result)
    for layer in layers:
        layer.destroy()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
