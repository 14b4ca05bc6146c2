"""torchrun worker (or one process): MegaMoE decode on CUDA captured in a CUDA graph, replayed with new inputs.

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 tests/gpu/graph_worker.py --out DIR
    python3 tests/gpu/graph_worker.py --out DIR                      (one process, the local transport)

Per case (bf16 rows, or FP8 dispatch into FP8 Triton experts; the contiguous or the masked receive pool; DeepGEMM's
masked GEMMs on a masked pool where deep_gemm is usable), on every rank with its own T (uneven):
- eager symm outputs for 3 inputs; the same inputs through a2a (the host-driven transport): bitwise equal;
- eager vs the single-process reference (the whole block on the full weights) within the dtype tolerance;
- one call captured in a CUDA graph, replayed with each input copied in: bitwise equal to eager, and the
  received-rows counter advanced by every replay;
- the next eager call after the replays still matches (ranks stay in step).
Each rank writes rank{r}.json: {case: {"checks": {name: bool}, "info": {...}}} or {"error": traceback}.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from moe_ref.layer import MegaMoE  # noqa: E402
from moe_ref.reference import reference_moe  # noqa: E402
from moe_ref.testing import calc_diff  # noqa: E402
from moe_ref.core.weights import MoEWeights  # noqa: E402

SEED = 11


def config():
    """A Kimi-K2-style block, small enough to build fast: sigmoid + bias + groups, 64 experts, top-8, 1 shared."""
    from moe_ref.core.config import preset

    return dataclasses.replace(preset("tiny-kimi-k2"), name="graph-kimi-k2", hidden_size=1024, intermediate_size=256,
                               num_experts=64, num_topk=8, num_groups=1, num_topk_groups=1)


# (dispatch_fp8, pool_format, experts backend)
CASES = [(False, "contiguous", "triton"), (True, "contiguous", "triton"), (False, "masked", "triton"),
         (True, "masked", "deep_gemm")]


def run_case(cfg, group, rank, world, device, fp8: bool, pool_format: str, backend: str) -> dict:
    checks, info = {}, {}
    num_tokens = 24 + 8 * rank  # uneven on purpose
    cap = 64
    gen = torch.Generator(device="cpu").manual_seed(100 + rank)
    inputs = [torch.randn(num_tokens, cfg.hidden_size, generator=gen).to(device, torch.bfloat16) for _ in range(3)]
    layers = {}
    outputs = {}
    for transport in (["symm", "a2a"] if world > 1 else ["local"]):
        layer = MegaMoE(cfg, group, num_max_tokens_per_rank=cap, transport=transport, experts_backend=backend,
                        dispatch_fp8=fp8, dtype=torch.bfloat16, device=device, seed=SEED, pool_format=pool_format)
        with torch.inference_mode():
            outputs[transport] = [layer(x).clone() for x in inputs]
        layers[transport] = layer
        info[f"{transport}: transport"] = layer.routed_step.transport_name
    first = "symm" if world > 1 else "local"
    if world > 1:
        checks["symm == a2a bitwise (eager)"] = all(torch.equal(a, b) for a, b in zip(outputs["symm"], outputs["a2a"]))
    weights = MoEWeights.random(cfg, seed=SEED, dtype=torch.bfloat16, device=device)  # what the layer loaded
    diffs = [calc_diff(y, reference_moe(x, weights, cfg)) for x, y in zip(inputs, outputs[first])]
    info["calc_diff vs reference"] = max(diffs)
    bound = 1e-2 if fp8 else 1e-3
    checks[f"eager matches the reference (calc_diff < {bound})"] = max(diffs) < bound

    layer = layers[first]
    counter = layer.num_recv_tokens_per_expert.clone()
    static_x = inputs[0].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.inference_mode():
        with torch.cuda.stream(stream):
            for _ in range(2):
                layer(static_x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = layer(static_x)
        replays = []
        for x in inputs:
            static_x.copy_(x)
            graph.replay()
            replays.append(static_y.clone())
        torch.cuda.synchronize()
        checks["graph replay == eager bitwise"] = all(torch.equal(a, b) for a, b in zip(replays, outputs[first]))
        info["replay max abs diff"] = max(float((a.float() - b.float()).abs().max()) for a, b in zip(replays, outputs[first]))
        grew = int((layer.num_recv_tokens_per_expert - counter).sum())
        info["received rows counted over 2 warmups + 3 replays"] = grew
        checks["replays count received rows"] = grew > 0
        after = layer(inputs[1])
        checks["eager after replays == eager"] = torch.equal(after, outputs[first][1])
    for layer in layers.values():
        layer.destroy()
    return {"checks": checks, "info": info}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    group = None
    if world > 1:
        rank = int(os.environ["RANK"])
        torch.cuda.set_device(rank)  # one GPU per rank: torch symmetric memory refuses ranks sharing a device
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
        group = dist.group.WORLD
    else:
        rank = 0
    device = torch.device("cuda", torch.cuda.current_device())
    cfg = config()
    results = {}
    from moe_ref.experts.deep_gemm.probe import deep_gemm_status

    for fp8, pool_format, backend in CASES:
        name = f"fp8={fp8} pool={pool_format} experts={backend}"
        if backend == "deep_gemm" and not deep_gemm_status().available:
            print(f"[rank {rank}] {name}: not run, deep_gemm is not usable here ({deep_gemm_status().reason})")
            continue
        try:
            results[name] = run_case(cfg, group, rank, world, device, fp8, pool_format, backend)
        except Exception:  # noqa: BLE001 - reported per case
            results[name] = {"error": traceback.format_exc()}
        print(f"[rank {rank}] {name}: {json.dumps(results[name], default=str)[:2000]}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
