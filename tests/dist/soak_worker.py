"""torchrun worker of the soak test: thousands of calls of the public ``MegaMoE`` with random T per rank.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/dist/soak_worker.py --out DIR \\
        [--calls 10000] [--transports symm,a2a]

Each call draws T per rank in [0, 2 * cap] (0 and > cap included; overflow 'chunk'), compares the output with
the single-process reference, and every ``--every`` calls records the process's resident memory. Rank r
writes ``DIR/rank{r}.json``: calls, mismatches (with the first few described), RSS at start / after warm-up /
at the end, seconds. Every rank draws every rank's T from one seeded generator, so all agree without a
collective of their own.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import sys
import time
import warnings

import torch
import torch.distributed as dist

from moe_ref import MegaMoE
from moe_ref.reference import reference_moe
from moe_ref.core.weights import MoEWeights

PRESET = "tiny-kimi-k2"
CAP = 8


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--calls", type=int, default=200, help="calls per transport")
    parser.add_argument("--transports", default="symm,a2a")
    parser.add_argument("--every", type=int, default=50, help="record RSS every this many calls")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    draw = random.Random(1234)
    report = {"calls": 0, "mismatches": 0, "first_mismatches": [], "rss": [], "seconds": 0.0}
    start = time.perf_counter()
    for transport in args.transports.split(","):
        layer = MegaMoE(PRESET, dist.group.WORLD, num_max_tokens_per_rank=CAP, overflow="chunk",
                        transport=transport, seed=5)
        weights = MoEWeights.random(layer.cfg, seed=5)
        for call in range(args.calls):
            sizes = [draw.choice([0, CAP, CAP + 1, draw.randint(0, 2 * CAP)]) for _ in range(world)]
            x = torch.randn(sizes[rank], layer.cfg.hidden_size, generator=torch.Generator().manual_seed(call * 97 + rank))
            # serving engines call layers in inference mode; mixing the two modes in any order must work
            with torch.inference_mode() if call % 3 else torch.no_grad():
                y = layer(x)
            expected = reference_moe(x, weights, layer.cfg)
            report["calls"] += 1
            if y.shape != expected.shape or not torch.allclose(y, expected, atol=1e-5, rtol=1e-4):
                report["mismatches"] += 1
                if len(report["first_mismatches"]) < 5:
                    report["first_mismatches"].append(dict(transport=transport, call=call, sizes=sizes))
            if call % args.every == 0:
                report["rss"].append(rss_bytes())
        layer.destroy()
    report["rss"].append(rss_bytes())
    report["seconds"] = round(time.perf_counter() - start, 2)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
