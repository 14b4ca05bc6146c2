"""torchrun worker of the multi-process EP tests: runs many cases in one launch, writes per-rank JSON.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/dist/ep_worker.py \\
        --case-file cases.json --out OUT_DIR [--device cpu|cuda] [--fault none|raise|kill-after-setup|kill-in-setup]

Each rank writes ``OUT_DIR/rank{r}.json``: ``{case_id: {"checks": {name: bool}, "info": {...}}}`` or
``{case_id: {"error": traceback}}``. ``--fault`` runs a fault-injection scenario instead of the cases
(the pytest side then checks the launch fails fast and leaves nothing in MOE_REF_SHM_DIR).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ep_cases  # noqa: E402

from moe_ref.core.config import preset  # noqa: E402
from moe_ref.core.errors import CapacityExceededError, CapacityMismatchError, ExpertIdError  # noqa: E402
from moe_ref.experts import make_experts  # noqa: E402
from moe_ref.kernels.ep.ep_regions import masked_segment_rows  # noqa: E402
from moe_ref.kernels.ep.pre_dispatch import dequantize_fp8_per_128, quantize_fp8_per_128  # noqa: E402
from moe_ref.block import moe_block  # noqa: E402
from moe_ref.ep.options import EPOptions  # noqa: E402
from moe_ref.reference import reference_moe, routed_experts_reference  # noqa: E402
from moe_ref.ep.routed_step import make_modular_step  # noqa: E402
from moe_ref.testing import TOLERANCES, calc_diff  # noqa: E402
from moe_ref.core.weights import MoEWeights  # noqa: E402

GROUP_TIMEOUT_S = 60  # a desynchronised collective fails after this instead of hanging
DEVICE = torch.device("cpu")  # --device cuda: NCCL, CUDA symmetric memory, Triton kernels (one GPU per rank)


def local_experts(weights: MoEWeights, cfg, rank: int, world_size: int, backend: str = "torch", fp8: bool = False):
    num_local = cfg.num_experts // world_size
    mine = weights.expert_slice(rank * num_local, num_local)
    return make_experts(backend, mine.gate_up_weight_E2FD, mine.down_weight_EDF, cfg.activation, cfg.situ_beta,
                        cfg.situ_linear_beta, fp8=fp8)


def make_step(cfg, group, experts, **options):
    """The modular routed step (collective) with ``options`` resolved as MegaMoE would, on ``DEVICE``."""
    return make_modular_step(cfg, group, experts, EPOptions.resolve(device=DEVICE, **options))


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    atol, rtol = TOLERANCES[dtype]
    return a.shape == b.shape and bool(torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol))


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# --- routed cases --------------------------------------------------------------------------------------------

def run_routed(case: dict, group, rank: int, world: int) -> dict:
    cfg = preset(case["preset"])
    dtype = getattr(torch, case["dtype"])
    weights = MoEWeights.random(cfg, seed=7, device=DEVICE)
    backend = case.get("experts", "torch")
    fp8_experts = backend == "triton" and case["dispatch_fp8"]  # FP8 experts iff FP8 dispatch, as in MegaMoE
    experts = local_experts(weights, cfg, rank, world, backend, fp8=fp8_experts)
    scenario, cap = case["scenario"], case["cap"]
    pool_format = case.get("pool_format", "contiguous")
    policy = "chunk" if scenario == "chunk" else "error"
    num_local = cfg.num_experts // world
    routing = [ep_cases.routing_for(case, cfg, r, world) for r in range(world)]
    ids_TK, w_TK = (t.to(DEVICE) for t in routing[rank])
    num_tokens = ids_TK.shape[0]

    if scenario == "router":  # the whole block: router, (latent), routed step, (norm, up), shared experts
        x_TD = ep_cases.hidden_for(case, cfg, rank, num_tokens, dtype).to(DEVICE)
        expected = reference_moe(x_TD, weights, cfg)

        def compute(step):
            return moe_block(x_TD, weights, cfg, step)
    else:
        x_TD = ep_cases.expert_input_for(case, cfg, rank, num_tokens, dtype).to(DEVICE)
        x_ref = x_TD
        if case["dispatch_fp8"]:  # the reference sees what the experts see: the dequantized rows
            x_ref = dequantize_fp8_per_128(*quantize_fp8_per_128(x_TD), dtype)
        expected = routed_experts_reference(x_ref, ids_TK, w_TK, weights.gate_up_weight_E2FD, weights.down_weight_EDF,
                                            cfg.activation, cfg.situ_beta, cfg.situ_linear_beta)

        def compute(step):
            return step(x_TD, ids_TK, w_TK)

    checks, info, outputs = {}, {"num_tokens": num_tokens}, {}
    for transport in ep_cases.TRANSPORTS:
        # debug_checks: every chunk also checks that rows are conserved across the group (ENV007 otherwise)
        with make_step(cfg, group, experts, num_max_tokens_per_rank=cap, overflow=policy, transport=transport,
                       dtype=dtype, dispatch_fp8=case["dispatch_fp8"], alignment=case["alignment"],
                       pool_format=pool_format, debug_checks=True) as step:
            checks[f"{transport}: transport_name"] = step.transport_name == transport
            first = compute(step)
            second = compute(step)
            counted = step.num_recv_tokens_per_expert.cpu()
            if pool_format == "masked":  # expert i's rows start at i * M, M = align(R * cap, alignment)
                rows = masked_segment_rows(world, cap, case["alignment"])
                checks[f"{transport}: masked pool layout"] = (
                    step.dispatcher.buffer.view("row_start").tolist() == [i * rows for i in range(num_local)])
        outputs[transport] = first
        info[f"{transport}: max_abs_diff_vs_reference"] = max_abs_diff(first, expected)
        if fp8_experts:  # fp8 weights: judged by calc_diff against the exact reference
            info[f"{transport}: calc_diff_vs_reference"] = calc_diff(first, expected)
            checks[f"{transport}: matches reference (fp8 experts calc_diff)"] = (
                calc_diff(first, expected) <= ep_cases.FP8_EXPERTS_LIMIT)
        else:
            checks[f"{transport}: matches reference ({case['dtype']} tolerance)"] = close(first, expected, dtype)
        checks[f"{transport}: repeat bitwise"] = bitwise(first, second)
        if scenario != "router":  # the router's ids are not known up front; the others' are
            expected_counts = torch.zeros(num_local, dtype=torch.int64)
            for ids, _ in routing:
                mine = ids[(ids >= rank * num_local) & (ids < (rank + 1) * num_local)] - rank * num_local
                expected_counts += torch.bincount(mine, minlength=num_local)
            checks[f"{transport}: received-row counters"] = torch.equal(counted, 2 * expected_counts)
            info[f"{transport}: counters"] = counted.tolist()
    checks["symm and a2a bitwise equal"] = bitwise(outputs["symm"], outputs["a2a"])
    if pool_format == "masked":  # the same rows reach the same per-expert GEMMs as in a contiguous pool
        with make_step(cfg, group, experts, num_max_tokens_per_rank=cap, overflow=policy, transport="symm",
                       dtype=dtype, dispatch_fp8=case["dispatch_fp8"], alignment=case["alignment"]) as step:
            checks["masked pool == contiguous pool bitwise"] = bitwise(outputs["symm"], compute(step))
    if scenario == "chunk":
        big_cap = max(ep_cases.num_tokens_for(scenario, r, world, cap) for r in range(world))
        with make_step(cfg, group, experts, num_max_tokens_per_rank=big_cap, overflow="error", transport="symm",
                       dtype=dtype, dispatch_fp8=case["dispatch_fp8"], alignment=case["alignment"]) as step:
            unchunked = compute(step)
        checks["chunked == unchunked (big cap) bitwise"] = bitwise(outputs["symm"], unchunked)
    return {"checks": checks, "info": info}


# --- error cases ---------------------------------------------------------------------------------------------

def _expect_error(fn, error_type) -> tuple[BaseException | None, float]:
    start = time.perf_counter()
    try:
        fn()
    except error_type as err:
        return err, time.perf_counter() - start
    return None, time.perf_counter() - start


def run_overflow_error(case: dict, group, rank: int, world: int) -> dict:
    cfg, cap = preset(case["preset"]), case["cap"]
    weights = MoEWeights.random(cfg, seed=3, device=DEVICE)
    experts = local_experts(weights, cfg, rank, world)
    over = cap + 3
    num_tokens = over if rank == world - 1 else cap  # only the last rank is over the cap
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(num_tokens, cfg.expert_hidden_size, generator=gen)
    ids = torch.stack([torch.randperm(cfg.num_experts, generator=gen)[:cfg.num_topk] for _ in range(num_tokens)])
    w = torch.rand(num_tokens, cfg.num_topk, generator=gen)
    x, ids, w = x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE)
    checks, info = {}, {}
    with make_step(cfg, group, experts, num_max_tokens_per_rank=cap, overflow="error",
                   transport=case["transport"]) as step:
        err, elapsed = _expect_error(lambda: step(x, ids, w), CapacityExceededError)
        needed_bytes = step.plan.with_cap(over).total_bytes
        message = str(err)
        info.update(seconds_to_raise=elapsed, message=message)
        checks["CAP001 raised on this rank"] = err is not None and "[CAP001]" in message
        checks["raised within 10 s"] = elapsed < 10
        for needle in (f"num_tokens={num_tokens}", f"max over the EP group is {over}",
                       f"num_max_tokens_per_rank={cap}", f"num_max_tokens_per_rank={over}",
                       f"MOE_REF_NUM_MAX_TOKENS_PER_RANK={over}", str(needed_bytes), "overflow='chunk'"):
            checks[f"message names {needle!r}"] = needle in message
        # a known bound over the cap takes the same branch (the bound is checked in the same collective)
        err2, _ = _expect_error(lambda: step(x, ids, w, max_num_tokens=over), CapacityExceededError)
        checks["CAP001 with a known bound"] = err2 is not None
        # nobody is left inside a collective: the group still works
        ok = step(x[:cap], ids[:cap], w[:cap])
        checks["group usable afterwards"] = ok.shape == (cap, cfg.expert_hidden_size)
    return {"checks": checks, "info": info}


def run_cap_mismatch(case: dict, group, rank: int, world: int) -> dict:
    cfg = preset(case["preset"])
    caps = [case["cap"] + r for r in range(world)]
    err, elapsed = _expect_error(
        lambda: make_step(cfg, group, None, num_max_tokens_per_rank=caps[rank], transport=case["transport"]),
        CapacityMismatchError)
    message = str(err)
    checks = {"CAP002 raised on this rank": err is not None and "[CAP002]" in message,
              "raised within 10 s": elapsed < 10}
    for r, cap in enumerate(caps):
        checks[f"message names rank {r}: {cap}"] = f"rank {r}: {cap}" in message
    dist.barrier(group=group)
    return {"checks": checks, "info": {"message": message, "seconds_to_raise": elapsed}}


def run_bad_ids(case: dict, group, rank: int, world: int) -> dict:
    cfg, cap = preset(case["preset"]), case["cap"]
    weights = MoEWeights.random(cfg, seed=5, device=DEVICE)
    experts = local_experts(weights, cfg, rank, world)
    x = torch.randn(4, cfg.expert_hidden_size, device=DEVICE)
    ids = torch.tensor([[0, 1, 2]] * 4, dtype=torch.int64, device=DEVICE)
    if rank == world - 1:
        ids[2, 1] = cfg.num_experts  # out of range on one rank only
    w = torch.rand(4, cfg.num_topk, device=DEVICE)
    with make_step(cfg, group, experts, num_max_tokens_per_rank=cap, transport=case["transport"]) as step:
        err, elapsed = _expect_error(lambda: step(x, ids, w), ExpertIdError)
        message = str(err)
        checks = {"INP005 raised on this rank": err is not None and "[INP005]" in message,
                  "raised within 10 s": elapsed < 10}
        if rank == world - 1:
            checks["message names the bad id"] = f"[-1, {cfg.num_experts})" in message and str(cfg.num_experts) in message
        step(x, torch.tensor([[0, 1, 2]] * 4, device=DEVICE), w)  # the group still works
    return {"checks": checks, "info": {"message": message}}


def run_env(case: dict, group, rank: int, world: int) -> dict:
    cfg, cap = preset(case["preset"]), case["cap"]
    weights = MoEWeights.random(cfg, seed=9, device=DEVICE)
    experts = local_experts(weights, cfg, rank, world)
    os.environ.update(MOE_REF_NUM_MAX_TOKENS_PER_RANK=str(cap), MOE_REF_OVERFLOW_POLICY="chunk", MOE_REF_TRANSPORT="a2a")
    try:
        with make_step(cfg, group, experts) as step:
            num_tokens = 2 * cap + 1
            x = torch.randn(num_tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(rank)).to(DEVICE)
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                y = moe_block(x, weights, cfg, step)
            checks = {"cap from env": step.plan.num_max_tokens_per_rank == cap,
                      "policy from env": step.policy.mode == "chunk",
                      "transport from env": step.transport_name == "a2a",
                      "3 chunks match the reference": close(y, reference_moe(x, weights, cfg), torch.float32)}
    finally:
        for name in ("MOE_REF_NUM_MAX_TOKENS_PER_RANK", "MOE_REF_OVERFLOW_POLICY", "MOE_REF_TRANSPORT"):
            os.environ.pop(name, None)
    with make_step(cfg, group, experts, num_max_tokens_per_rank=cap) as step:
        checks["auto picks symm on one host"] = step.transport_name == "symm"
    return {"checks": checks, "info": {}}


RUNNERS = {"routed": run_routed, "overflow_error": run_overflow_error, "cap_mismatch": run_cap_mismatch,
           "bad_ids": run_bad_ids, "env": run_env}


# --- fault injection -------------------------------------------------------------------------------------------

def run_fault(fault: str, rank: int, world: int) -> None:
    """Fail on purpose; the launch must end quickly and leave nothing in MOE_REF_SHM_DIR."""
    import moe_ref.ep.buffer as buffer_module

    cfg = preset("tiny-kimi-k2")
    if fault == "kill-in-setup" and rank == world - 1:
        create = buffer_module.SymmetricBuffer._create_file

        def create_then_die(self, path, nbytes):  # my file exists, nobody has mapped it yet
            problem = create(self, path, nbytes)
            os.kill(os.getpid(), signal.SIGKILL)
            return problem
        buffer_module.SymmetricBuffer._create_file = create_then_die
    experts = local_experts(MoEWeights.random(cfg, seed=1), cfg, rank, world)
    step = make_step(cfg, dist.group.WORLD, experts, num_max_tokens_per_rank=8, transport="symm")
    x = torch.randn(8, cfg.hidden_size)
    weights = MoEWeights.random(cfg, seed=1)
    moe_block(x, weights, cfg, step)
    if fault == "raise" and rank == 0:
        raise RuntimeError("injected failure on rank 0 while holding a symmetric buffer")
    if fault == "kill-after-setup" and rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    moe_block(x, weights, cfg, step)  # peers wait here for the dead
    step.destroy()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case-file")
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--fault", default="none", choices=["none", "raise", "kill-after-setup", "kill-in-setup"])
    args = parser.parse_args()
    # torchrun stops the survivors of a failed rank with SIGTERM: exit through Python so cleanup runs
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    torch.set_num_threads(1)
    global DEVICE
    backend = "gloo"
    if args.device == "cuda":
        DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(DEVICE)
        backend = "nccl"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
                            **({"device_id": DEVICE} if DEVICE.type == "cuda" else {}))
    rank, world = dist.get_rank(), dist.get_world_size()
    from moe_ref.kernels.runtime.native import native_status

    print(f"[rank {rank}] CPU EP ops: {native_status()}", flush=True)
    if args.fault != "none":
        run_fault(args.fault, rank, world)
        dist.destroy_process_group()
        return 0
    with open(args.case_file) as f:
        cases = json.load(f)
    results = {}
    warnings.simplefilter("ignore")  # the chunking warning is checked in the unit tests
    for case in cases:
        start = time.perf_counter()
        # a fresh group per case: a case that fails part-way (ranks left inside different collectives) times
        # out on its own group and cannot poison the next cases
        group = dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        try:
            results[case["id"]] = RUNNERS[case["kind"]](case, group, rank, world)
        except Exception:
            results[case["id"]] = {"error": traceback.format_exc(limit=-8)}
        results[case["id"]]["seconds"] = time.perf_counter() - start
        dist.destroy_process_group(group)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
