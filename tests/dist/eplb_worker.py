"""torchrun worker of tests/dist/test_eplb_dist.py: EPLB's rebalance over gloo CPU ranks.

    python -m torch.distributed.run --standalone --nproc-per-node R tests/dist/eplb_worker.py --out DIR

Each rank writes one line per case to ``DIR/rank{r}.jsonl`` as the case ends (``{"case", "seconds", ...}``):
- ``rebalance_keeps_output``: scripts/eplb_cpu_ranks.py's measurement (skewed router, telemetry, plan, rebalance):
  output before vs after, every slot's weights vs its logical expert's, max-rank rows before and after.
- ``zero_tokens_on_one_rank``: rank 1 calls with no tokens before and after a rebalance; the others' outputs agree.
- ``different_placements``: rank 0 is given another placement than the others: the code every rank raises.
- ``quantized_bytes_cross_ranks``: FP8 / INT4-word / MXFP4-byte tensors encoded by logical expert moved between
  ranks (slots reversed, so every slot moves): every slot's bytes checked after the move.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from launch import join_group  # noqa: E402  (tests/dist, beside this worker)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
from eplb_cpu_ranks import measure  # noqa: E402
from moe_ref import MegaMoE  # noqa: E402
from moe_ref.core.errors import MoERefError  # noqa: E402
from moe_ref.eplb import Placement, mover  # noqa: E402
from moe_ref.eplb.slots import ExpertSlots  # noqa: E402

GROUP_TIMEOUT_S = 60
PRESET = "tiny-kimi-k2"  # E = 16, K = 4, D = 48
E = 16


def rebalance_keeps_output(rank: int, world: int) -> dict:
    result = measure(dist.group.WORLD, PRESET, redundant=world, tokens_per_rank=64, steps=2, strength=0.5, seed=1)
    return {"max_abs_output_diff": result["max_abs_output_diff"], "slots_ok": result["slots_hold_their_experts"],
            "max_rank_rows_before": result["before"]["max_rank_rows"],
            "max_rank_rows_after": result["after"]["max_rank_rows"],
            "rows": sum(result["after"]["rows_per_rank"])}


def zero_tokens_on_one_rank(rank: int, world: int) -> dict:
    layer = MegaMoE(PRESET, dist.group.WORLD, seed=2, num_redundant_experts=world, num_max_tokens_per_rank=32)
    x = torch.randn(0 if rank == 1 else 20, layer.cfg.hidden_size, generator=torch.Generator().manual_seed(rank))
    num_physical = layer.expert_slots.num_physical
    with torch.no_grad():
        before = layer(x)
        layer.rebalance(Placement(torch.tensor([[(p * 5 + 1) % E for p in range(num_physical)]]), E, world))
        after = layer(x)
    layer.destroy()
    return {"tokens": x.shape[0], "shape_ok": after.shape == x.shape,
            "close": bool(torch.allclose(before, after, atol=1e-6, rtol=1e-5))}


def different_placements(rank: int, world: int) -> dict:
    layer = MegaMoE(PRESET, dist.group.WORLD, seed=2, num_redundant_experts=world, num_max_tokens_per_rank=8)
    num_physical = layer.expert_slots.num_physical
    shift = 3 if rank == 0 else 1
    before, code = layer.expert_slots.local_experts(), None
    try:
        layer.rebalance(Placement(torch.tensor([[(p + shift) % E for p in range(num_physical)]]), E, world))
    except MoERefError as err:
        code = err.code
    kept = layer.expert_slots.local_experts() == before
    layer.destroy()
    return {"code": code, "kept_old_map": kept}


def quantized_bytes_cross_ranks(rank: int, world: int) -> dict:
    num_physical = E + world
    old = list(range(E)) + list(range(world))
    new = list(reversed(old))
    slots = ExpertSlots(Placement(torch.tensor([old]), E, world), rank, 48, torch.device("cpu"))
    mine = slice(rank * slots.num_local, (rank + 1) * slots.num_local)

    def encoded(experts, dtype):
        codes = torch.tensor(experts, dtype=torch.float32).view(-1, 1, 1) + torch.arange(8.0).view(1, 2, 4) / 16
        return (codes / 32).to(dtype) if dtype.is_floating_point else (codes * 16).to(dtype)

    dtypes = [torch.float8_e4m3fn, torch.int32, torch.uint8, torch.float32]  # FP8 + scales, INT4 words, MXFP4
    tensors = [encoded(old[mine], dtype) for dtype in dtypes]
    mover.rebalance_slots(slots, Placement(torch.tensor([new]), E, world), tensors, dist.group.WORLD)
    ok = all(torch.equal(t.view(torch.uint8), encoded(new[mine], d).view(torch.uint8)) for t, d in zip(tensors, dtypes))
    return {"bytes_ok": ok, "slots": num_physical}


CASES = [rebalance_keeps_output, zero_tokens_on_one_rank, different_placements, quantized_bytes_cross_ranks]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    rank, world, report = join_group(parser.parse_args().out, GROUP_TIMEOUT_S)
    for case in CASES:
        start = time.perf_counter()
        try:
            result = case(rank, world)
        except MoERefError as err:
            result = {"error": err.code, "message": str(err)[:500]}
        report({"case": case.__name__, "seconds": round(time.perf_counter() - start, 3), **result})
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
