"""EPLB on CPU ranks: a MegaMoE with redundant expert slots under a skewed router, its real rows per rank before
and after a rebalance planned from its own telemetry, and its output before and after.

    python -m torch.distributed.run --standalone --nproc-per-node 4 scripts/eplb_cpu_ranks.py [--json PATH]

Steps (every rank): build the layer (seeded weights, ``num_redundant_experts``; the planner's placement for an even
load), skew its router (a selection bias favouring a few experts, Zipf-like), run ``--steps`` calls, read
``expert_load()``, plan (``plan_global`` on the gathered logical rows), ``rebalance``, run the same calls again.
Rank 0 prints a table: rows per rank, max-rank rows and balancedness (mean / max rows per rank) before and after,
the largest output difference, and whether every slot holds its logical expert's weights after the move.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch
import torch.distributed as dist

from moe_ref import MegaMoE
from moe_ref.core.weights import MoEWeights
from moe_ref.eplb import plan_global


def skew_bias(num_experts: int, strength: float, seed: int) -> torch.Tensor:
    """``[E]`` fp32 selection bias: ``strength / rank`` for the experts of a seeded permutation (rank from 1)."""
    order = torch.randperm(num_experts, generator=torch.Generator().manual_seed(seed))
    bias = torch.empty(num_experts)
    bias[order] = strength / torch.arange(1, num_experts + 1, dtype=torch.float32)
    return bias


def slots_hold_their_experts(layer: MegaMoE, reference: MoEWeights) -> bool:
    """Every local slot's weights bitwise equal its logical expert's in ``reference`` (all experts)."""
    experts = torch.tensor(layer.expert_slots.local_experts())
    return (torch.equal(layer.gate_up_weight, reference.gate_up_weight_E2FD[experts])
            and torch.equal(layer.down_weight, reference.down_weight_EDF[experts]))


def measure(group, preset: str, redundant: int, tokens_per_rank: int, steps: int, strength: float,
            seed: int) -> dict:
    """Run the steps of the module doc on this rank; returns the (rank-independent) summary plus this rank's checks."""
    rank = dist.get_rank(group) if group is not None else 0
    layer = MegaMoE(preset, group, seed=seed, num_redundant_experts=redundant, num_max_tokens_per_rank=tokens_per_rank)
    with torch.no_grad():
        layer.e_score_correction_bias += skew_bias(layer.cfg.num_experts, strength, seed)
    inputs = [torch.randn(tokens_per_rank, layer.cfg.hidden_size,
                          generator=torch.Generator().manual_seed(seed * 1000 + rank * 100 + step))
              for step in range(steps)]
    with torch.no_grad():
        before_out = [layer(x) for x in inputs]
        before = layer.expert_load()
        placement = plan_global(before.logical_rows_E.unsqueeze(0), layer.expert_slots.num_physical,
                                layer.world_size)
        layer.rebalance(placement)
        after_out = [layer(x) for x in inputs]
        after = layer.expert_load()
    diff = max(float((a - b).abs().max()) if a.numel() else 0.0 for a, b in zip(before_out, after_out))
    layer.destroy()
    return {"preset": preset, "ranks": layer.world_size, "experts": layer.cfg.num_experts,
            "slots": layer.expert_slots.num_physical, "tokens_per_rank": tokens_per_rank, "steps": steps,
            "skew": strength,
            "before": {"rows_per_rank": before.rows_per_rank_R.tolist(), "max_rank_rows": before.max_rank_rows,
                       "balancedness": before.balancedness},
            "after": {"rows_per_rank": after.rows_per_rank_R.tolist(), "max_rank_rows": after.max_rank_rows,
                      "balancedness": after.balancedness},
            "max_abs_output_diff": diff,
            "slots_hold_their_experts": slots_hold_their_experts(layer, MoEWeights.random(layer.cfg, seed=seed))}


def table(result: dict) -> str:
    lines = [f"EPLB on {result['ranks']} gloo CPU ranks: {result['preset']}, E={result['experts']}, "
             f"Ph={result['slots']}, {result['tokens_per_rank']} tokens/rank x {result['steps']} steps, "
             f"skew {result['skew']}",
             f"{'':<8} {'rows per rank':<40} {'max-rank rows':>14} {'balancedness':>13}"]
    for name in ("before", "after"):
        side = result[name]
        lines.append(f"{name:<8} {str(side['rows_per_rank']):<40} {side['max_rank_rows']:>14} "
                     f"{side['balancedness']:>13.3f}")
    lines.append(f"max |output after - output before| = {result['max_abs_output_diff']:.3g}; every slot holds "
                 f"its expert's weights: {result['slots_hold_their_experts']}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny-kimi-k2")
    parser.add_argument("--redundant", type=int, default=4, help="redundant slots (E + redundant must split over R)")
    parser.add_argument("--tokens-per-rank", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--skew", type=float, default=0.5, help="selection-bias strength (0: the router as is)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write rank 0's result here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    result = measure(dist.group.WORLD, args.preset, args.redundant, args.tokens_per_rank, args.steps, args.skew,
                     args.seed)
    if dist.get_rank() == 0:
        print(table(result))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
