"""2-GPU check of ``moe_ref.ep.mega_deep_gemm.make_mega_step`` (DeepGEMM SM90 mega-MoE + moe_ref's overflow policy).

    torchrun --standalone --nproc-per-node 2 tests/gpu/mega_worker.py [--json results/mega_worker.json]

Run by ``tests/gpu/test_deep_gemm.py::test_mega_moe_two_gpus``; runnable alone (needs the deep_gemm wheels:
``python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site
.whl/*.whl && export PYTHONPATH=/tmp/site:$PWD``).

Model: 16 experts (8 per rank), top-8, hidden 1024, intermediate 512 (SwiGLU), cap 128 rows per rank. Every
rank holds every expert's bf16 weights (same seed), so each rank checks its own tokens against
``routed_experts_reference`` on the same routing without gathering anything. Cases (all ranks, in order):

| case                 | rows per rank (rank0, rank1) | routing                              | policy | expect                |
|----------------------|------------------------------|--------------------------------------|--------|-----------------------|
| balanced             | 96, 96                       | uniform over all 16 experts          | error  | matches reference     |
| rank1_zero_tokens    | 100, 0                       | uniform                              | error  | rank 1 returns [0, D] |
| all_to_rank0         | 80, 80                       | only experts 0..7 (rank 0's)         | error  | matches reference     |
| masked_slots         | 96, 64                       | 30% slots -1, one token all -1       | error  | masked token row = 0  |
| at_cap               | 128, 128                     | uniform                              | error  | runs (T == cap)       |
| cap_plus_1_error     | 129, 5                       | uniform                              | error  | CAP001 on BOTH ranks  |
| cap_plus_1_chunk     | 129, 5                       | uniform                              | chunk  | == big-cap run        |
| three_chunks         | 257, 10                      | uniform                              | chunk  | == big-cap run        |
| all_empty            | 0, 0                         | -                                    | error  | [0, D], no launch     |

Per case each rank prints ``RESULT case=... rank=... T=... calc_diff=...`` and checks the received-row
counts (DeepGEMM's ``cumulative_local_expert_recv_stats``) against the (token, slot) pairs routed to its
experts; rank 0 prints ``SUMMARY``. Exit code 1 on any failure. calc_diff limit vs the bf16 reference:
5e-3 (fp8 activations, weights and intermediate; a CPU simulation of this recipe gave ~2e-3); chunked vs
the unchunked big-cap run: 1e-4 (same math, possibly other tile configs), bitwise equality reported.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from moe_ref.core.config import MoEConfig  # noqa: E402
from moe_ref.core.errors import CapacityExceededError  # noqa: E402
from moe_ref.reference import routed_experts_reference  # noqa: E402
from moe_ref.testing import calc_diff  # noqa: E402

NUM_EXPERTS, TOPK, HIDDEN, INTERMEDIATE, CAP, BIG_CAP = 16, 8, 1024, 512, 128, 512
LIMIT_VS_REFERENCE, LIMIT_CHUNK_VS_BIG = 5e-3, 1e-4

# (name, rows of rank 0, rows of rank 1, routing, policy)
CASES = [
    ("balanced", 96, 96, "uniform", "error"),
    ("rank1_zero_tokens", 100, 0, "uniform", "error"),
    ("all_to_rank0", 80, 80, "rank0", "error"),
    ("masked_slots", 96, 64, "masked", "error"),
    ("at_cap", CAP, CAP, "uniform", "error"),
    ("cap_plus_1_error", CAP + 1, 5, "uniform", "error"),
    ("cap_plus_1_chunk", CAP + 1, 5, "uniform", "chunk"),
    ("three_chunks", 2 * CAP + 1, 10, "uniform", "chunk"),
    ("all_empty", 0, 0, "uniform", "error"),
]


def make_inputs(case_idx: int, rank: int, num_tokens: int, routing: str, device):
    """This rank's x [T, D] bf16, ids [T, K] int64, weights [T, K] fp32 (seeded by case and rank)."""
    gen = torch.Generator(device="cpu").manual_seed(1000 * case_idx + rank)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).bfloat16()
    pool = NUM_EXPERTS if routing != "rank0" else NUM_EXPERTS // 2
    ids = torch.stack([torch.randperm(pool, generator=gen)[:TOPK] for _ in range(num_tokens)]) if num_tokens \
        else torch.empty(0, TOPK, dtype=torch.int64)
    weights = torch.rand(num_tokens, TOPK, generator=gen) + 0.05
    if routing == "masked" and num_tokens:
        drop = torch.rand(num_tokens, TOPK, generator=gen) < 0.3
        drop[0] = True  # token 0 has no expert at all: its output row must be exactly zero
        ids = ids.masked_fill(drop, -1)
        weights = weights.masked_fill(drop, 0.0)
    return x.to(device), ids.to(device), weights.float().to(device)


def expected_recv_counts(ids_TK: torch.Tensor, rank: int, group) -> torch.Tensor:
    """(token, slot) pairs routed to each of my local experts, summed over every rank's tokens."""
    counts_E = torch.bincount(ids_TK[ids_TK >= 0].flatten(), minlength=NUM_EXPERTS).to(torch.int64)
    dist.all_reduce(counts_E, group=group)
    num_local = NUM_EXPERTS // dist.get_world_size(group)
    return counts_E[rank * num_local:(rank + 1) * num_local].to(torch.int32)


def run_case(case_idx, case, layers, all_weights, rank, world, group, device) -> dict:
    name, rows0, rows1, routing, policy = case
    num_tokens = (rows0, rows1)[rank] if rank < 2 else 0
    x, ids, weights = make_inputs(case_idx, rank, num_tokens, routing, device)
    result = dict(case=name, rank=rank, T=num_tokens, policy=policy, ok=True, notes=[])
    layer = layers[policy]
    stats_before = layer.num_recv_tokens_per_expert.clone()
    start = time.perf_counter()
    try:
        y = layer(x, ids, weights)
        torch.cuda.synchronize()
    except CapacityExceededError as err:
        result["seconds"] = round(time.perf_counter() - start, 3)
        result["error"] = str(err)
        expect_error = name == "cap_plus_1_error"
        result["ok"] = expect_error and err.code == "CAP001" and str(CAP + 1) in str(err) and str(CAP) in str(err)
        if not expect_error:
            result["notes"].append("unexpected CAP001")
        return result
    result["seconds"] = round(time.perf_counter() - start, 3)
    if name == "cap_plus_1_error":
        result["ok"] = False
        result["notes"].append("expected CapacityExceededError (CAP001) on every rank, got none")
        return result
    if tuple(y.shape) != (num_tokens, HIDDEN) or y.dtype != torch.bfloat16:
        result["ok"] = False
        result["notes"].append(f"output {tuple(y.shape)} {y.dtype}, expected ({num_tokens}, {HIDDEN}) bf16")
        return result
    reference = routed_experts_reference(x, ids, weights, *all_weights)
    diff = calc_diff(y, reference) if num_tokens else 0.0
    result["calc_diff"] = diff
    if not diff < LIMIT_VS_REFERENCE or not bool(torch.isfinite(y).all()):
        result["ok"] = False
        result["notes"].append(f"calc_diff vs reference {diff:.3e} >= {LIMIT_VS_REFERENCE:.0e} or non-finite")
    if routing == "masked" and num_tokens and not bool((y[0] == 0).all()):
        result["ok"] = False
        result["notes"].append("token 0 has every slot masked but its output row is not zero")
    if policy == "chunk":
        y_big = layers["big"](x, ids, weights)
        chunk_diff = calc_diff(y, y_big) if num_tokens else 0.0
        result["calc_diff_vs_big_cap"] = chunk_diff
        result["bitwise_equal_to_big_cap"] = bool(torch.equal(y, y_big))
        if not chunk_diff < LIMIT_CHUNK_VS_BIG:
            result["ok"] = False
            result["notes"].append(f"chunked vs big-cap calc_diff {chunk_diff:.3e} >= {LIMIT_CHUNK_VS_BIG:.0e}")
    received = layer.num_recv_tokens_per_expert - stats_before
    expected = expected_recv_counts(ids, rank, group)
    if name != "all_empty" and not torch.equal(received.cpu(), expected.cpu()):
        result["ok"] = False
        result["notes"].append(f"received rows per local expert {received.tolist()} != routed {expected.tolist()}")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="rank 0 writes all results here")
    args = parser.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    from moe_ref.experts.deep_gemm.probe import deep_gemm_status
    from moe_ref.ep.mega_deep_gemm import make_mega_step
    from moe_ref.ep.options import EPOptions

    status = deep_gemm_status()
    print(f"[rank {rank}] deep_gemm_status: {status}", flush=True)
    if not (status.available and status.mega_moe):
        print(f"SUMMARY rank={rank} FAILED: deep_gemm mega-MoE not usable: {status.reason}", flush=True)
        return 1
    cfg = MoEConfig(num_experts=NUM_EXPERTS, num_topk=TOPK, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                    name="mega-worker")
    gen = torch.Generator(device="cpu").manual_seed(7)
    gate_up_all = (torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=gen) * HIDDEN ** -0.5).bfloat16()
    down_all = (torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=gen) * INTERMEDIATE ** -0.5).bfloat16()
    gate_up_all, down_all = gate_up_all.to(device), down_all.to(device)
    num_local = NUM_EXPERTS // world
    local = (gate_up_all[rank * num_local:(rank + 1) * num_local], down_all[rank * num_local:(rank + 1) * num_local])

    start = time.perf_counter()
    def mega_step(cap: int, overflow: str):
        options = EPOptions.resolve(num_max_tokens_per_rank=cap, overflow=overflow, dtype=torch.bfloat16, device=device,
                                    experts_backend="deep_gemm")
        return make_mega_step(cfg, group, options, *local)

    layers = {"error": mega_step(CAP, "error"), "chunk": mega_step(CAP, "chunk"), "big": mega_step(BIG_CAP, "error")}
    print(f"[rank {rank}] built 3 mega steps (caps {CAP}, {CAP}, {BIG_CAP}) in {time.perf_counter() - start:.1f} s; "
          f"symmetric buffer {layers['error'].engine.buffer_bytes} bytes at cap {CAP}", flush=True)

    results = []
    for case_idx, case in enumerate(CASES):
        try:
            result = run_case(case_idx, case, layers, (gate_up_all, down_all), rank, world, group, device)
        except Exception:  # noqa: BLE001 - report, then stop every rank (a peer may be inside the kernel)
            print(f"RESULT case={case[0]} rank={rank} ok=False EXCEPTION\n{traceback.format_exc()}", flush=True)
            sys.stdout.flush()
            os._exit(1)
        notes = "; ".join(result["notes"])
        print(f"RESULT case={result['case']} rank={rank} T={result['T']} policy={result['policy']} "
              f"ok={result['ok']} seconds={result.get('seconds')} calc_diff={result.get('calc_diff', float('nan')):.3e} "
              f"vs_big_cap={result.get('calc_diff_vs_big_cap', '-')} bitwise={result.get('bitwise_equal_to_big_cap', '-')}"
              f"{' error=' + result['error'][:160] if 'error' in result else ''}{' NOTES: ' + notes if notes else ''}",
              flush=True)
        results.append(result)
        dist.barrier()

    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    failed = sorted({(r["case"], r["rank"]) for per_rank in gathered for r in per_rank if not r["ok"]})
    if rank == 0:
        print(f"SUMMARY {len(CASES)} cases x {world} ranks: " +
              ("all passed" if not failed else f"FAILED {failed}"), flush=True)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump({"status": status.__dict__, "results": gathered}, f, indent=1, default=str)
    for layer in layers.values():
        layer.destroy()
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
