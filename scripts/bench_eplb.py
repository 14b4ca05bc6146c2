#!/usr/bin/env python
"""What EPLB costs inside the layer on one GPU: replica routing and load telemetry, eager and in a CUDA graph.

    PYTHONPATH=. python3 scripts/bench_eplb.py --out results/eplb [--tokens 128 4096]

``MegaMoE`` (one process, the ``local`` transport) at a per-rank share of Kimi-K2 (48 experts, top-8, H 7168,
F 2048, bf16, the default experts backend), three layers holding the same weights:
- ``base``: no EPLB;
- ``replicas``: EPLB with the identity placement (``num_redundant_experts=0``, slot p holds expert p): every call
  maps the router's ids to slots (``ExpertSlots.to_physical``, one launch of ``kernels.router.replica_route``: the
  hidden-state key, the replica hash and the table gather) and the step is otherwise the base's, so
  ``replicas - base`` is the cost of replica routing; its output must equal the base's bitwise;
- ``redundant``: ``num_redundant_experts = E / 8`` (the planner's placement for an even load): more, smaller
  expert segments (reported; not part of the cost).
Telemetry adds nothing to a call: it is the routed step's own per-slot row counter (``num_recv_tokens_per_expert``,
added to by the dispatch on the device); ``expert_load_us`` is the report's cost (a host sync), paid per window.
Per T and route (``eager``: kernels launched from Python, ``eager_graph_max_tokens=0``; ``graph``: the call captured
once in a ``torch.cuda.CUDAGraph`` and replayed), each layer's time per call (median of ``--repeats`` runs of
``--calls`` calls, the layers alternating run by run) and ``overhead_pct = (replicas - base) / base``; also
``to_physical_us``, the mapping alone (that one launch, eager). Goal: <= 2 % at T = 128 and 4096. Writes
``bench_eplb.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moe_ref import MegaMoE  # noqa: E402
from moe_ref.bench.timing import host_and_wall_us  # noqa: E402
from moe_ref.core.config import preset  # noqa: E402
from moe_ref.eplb import Placement  # noqa: E402
from moe_ref.testing import graphed  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="results/eplb")
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    parser.add_argument("--num-experts", type=int, default=48)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per layer; the median is reported")
    return parser.parse_args(argv)


def build_layers(args) -> dict[str, MegaMoE]:
    cfg = dataclasses.replace(preset("kimi-k2"), num_experts=args.num_experts, name=f"kimi-k2/{args.num_experts}")
    common = dict(num_max_tokens_per_rank=max(args.tokens), dtype=torch.bfloat16, device="cuda",
                  eager_graph_max_tokens=0)
    base = MegaMoE(cfg, None, seed=0, **common)
    identity = Placement(torch.arange(cfg.num_experts).unsqueeze(0), cfg.num_experts, 1)
    replicas = MegaMoE(cfg, None, placement=identity, num_redundant_experts=0, **common)
    redundant = MegaMoE(cfg, None, num_redundant_experts=cfg.num_experts // 8, **common)
    for layer in (replicas, redundant):
        layer.load_weights(base.weights())
    return {"base": base, "replicas": replicas, "redundant": redundant}


def time_layers(fns: dict, x: torch.Tensor, args) -> dict[str, float]:
    """Wall us per call of each fn: the median of ``--repeats`` runs, the fns alternating run by run."""
    runs = {name: [] for name in fns}
    for fn in fns.values():
        host_and_wall_us(fn, (x,), 3)  # warm
    for _ in range(args.repeats):
        for name, fn in fns.items():
            runs[name].append(host_and_wall_us(fn, (x,), args.calls)[1])
    return {name: statistics.median(values) for name, values in runs.items()}


def mapping_us(layer: MegaMoE, x: torch.Tensor, calls: int) -> float:
    ids = torch.randint(0, layer.cfg.num_experts, (x.shape[0], layer.cfg.num_topk), device=x.device)
    return host_and_wall_us(lambda x_: layer.expert_slots.to_physical(x_, ids), (x,), calls)[1]


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    layers = build_layers(args)
    rows = []
    with torch.no_grad():
        for tokens in args.tokens:
            x = torch.randn(tokens, layers["base"].cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
            same = bool(torch.equal(layers["base"](x), layers["replicas"](x)))
            for route in ("eager", "graph"):
                fns = dict(layers) if route == "eager" else {n: graphed(l, x.clone()) for n, l in layers.items()}
                us = time_layers(fns, x, args)
                rows.append({"tokens": tokens, "route": route, **{f"{n}_us": round(v, 1) for n, v in us.items()},
                             "overhead_pct": round(100 * (us["replicas"] - us["base"]) / us["base"], 2),
                             "redundant_vs_base_pct": round(100 * (us["redundant"] - us["base"]) / us["base"], 2),
                             "to_physical_us": round(mapping_us(layers["replicas"], x, args.calls), 1),
                             "output_bitwise_equal": same})
                print(json.dumps(rows[-1]), flush=True)
        load_start = time.perf_counter()
        load = layers["replicas"].expert_load()
        expert_load_us = (time.perf_counter() - load_start) * 1e6
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "host": platform.node(),
              "date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:], "rows": rows,
              "expert_load_us": round(expert_load_us, 1), "telemetry_rows": int(load.rows_Ph.sum()),
              "seconds": round(time.perf_counter() - start, 1)}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_eplb.json"), "w") as f:
        json.dump(record, f, indent=1)
    header = "| T | route | base us | replicas us | overhead % | to_physical us | redundant us | bitwise |"
    lines = [f"EPLB cost on {record['device']} ({record['date']}, torch {record['torch']})", "", header,
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['tokens']} | {r['route']} | {r['base_us']} | {r['replicas_us']} | {r['overhead_pct']} | "
              f"{r['to_physical_us']} | {r['redundant_us']} | {r['output_bitwise_equal']} |" for r in rows]
    lines.append(f"\nexpert_load() report: {record['expert_load_us']} us (host sync, once per window)")
    with open(os.path.join(args.out, "bench_eplb.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
