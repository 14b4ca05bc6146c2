"""Cases of the multi-process EP tests (enumerators) and their inputs (generators), shared by the pytest
side (which parametrizes over the case ids) and the torchrun worker (which runs them). The 2- and 4-rank
launches run every case; the 8-rank launch runs the named selection ``LAUNCH_SUBSETS[8]`` (8 processes on
2 cores: start-up alone takes ~20 s), chosen to cover what changes with R=8. Token counts are written for
up to 8 ranks (no rank over the cap unless the scenario means it).

A case is a JSON-able dict with a unique ``id`` and a ``kind``:
- ``routed``: one preset x one routing scenario, run over both transports (symm and a2a), twice each;
  checked against the single-process reference, bitwise across repeats and transports, and (scenario
  ``chunk``) bitwise against an unchunked run with a big enough cap. ``pool_format="masked"`` also checks
  the masked pool's segment starts and the output bitwise against a contiguous pool. ``experts`` names the backend
  (default torch); ``triton`` with ``dispatch_fp8`` runs FP8 experts on the FP8 pool (the Triton kernel:
  interpreted on CPU), judged by calc_diff against the exact reference (``FP8_EXPERTS_LIMIT``).
- ``overflow_error``: one rank over the cap with policy ``error``: every rank raises CAP001 quickly.
- ``cap_mismatch``: ranks pass different caps: every rank raises CAP002 naming each rank's value.
- ``bad_ids``: one rank passes an out-of-range expert id: every rank raises INP005, none hangs.
- ``env``: cap, policy and transport come from the MOE_REF_* environment variables.
"""
from __future__ import annotations

import zlib

import torch

from moe_ref.testing import CALC_DIFF_TOLERANCES

PRESETS = ("tiny-kimi-k2", "tiny-kimi-k3", "tiny-deepseek-v3", "tiny-step3")
SCENARIOS = ("balanced", "all_to_one", "zero_tokens", "uneven", "masked", "t_eq_cap", "chunk", "router")
TRANSPORTS = ("symm", "a2a")
CAP = 16
# calc_diff of FP8 experts (x, gate_up, h and down each rounded to e4m3) vs the exact reference: measured
# ~2e-3 (FP8 dispatch alone ~0.7e-3); the limit of tests/gpu/test_deep_gemm.py for the same fp8 MLP recipe.
FP8_EXPERTS_LIMIT = CALC_DIFF_TOLERANCES[torch.float8_e4m3fn]


# The 8-rank launch: what changes with R=8, both transports in every routed case (each also asserts symm and
# a2a bitwise equal). all_to_one on tiny-step3 (8 experts: one per rank) sends every row to one expert of the
# last rank (hot rank); zero_tokens and chunk have a rank with no rows (chunk: rank 0 at cap+1, two chunks,
# bitwise equal to one unchunked call), uneven/bf16 eight different counts, masked/fp8-dispatch -1 slots (and
# FP8 dispatch), router the whole block, masked-pool all_to_one the masked pool format with a hot rank; the
# error cases: one rank over the cap (CAP001), eight different caps
# (CAP002 naming every rank's), one rank's bad id (INP005): a coded error on all 8 ranks within 10 s, over
# both transports, and the group usable afterwards.
LAUNCH_SUBSETS = {8: (
    "tiny-kimi-k2-zero_tokens", "tiny-kimi-k2-chunk", "tiny-kimi-k2-bf16", "tiny-kimi-k3-masked",
    "tiny-kimi-k3-router", "tiny-deepseek-v3-uneven", "tiny-deepseek-v3-fp8-dispatch", "tiny-step3-all_to_one",
    "tiny-step3-alignment-8-chunk", "tiny-kimi-k2-masked-pool-all_to_one",
    *(f"{kind}-{transport}" for kind in ("overflow-error", "cap-mismatch", "bad-ids") for transport in TRANSPORTS),
)}


def launch_cases(world_size: int, device: str = "cpu") -> list[dict]:
    """The cases of the launch at ``world_size`` ranks: every case, or the selection ``LAUNCH_SUBSETS`` names."""
    return enumerate_cases(world_size, device, subset=LAUNCH_SUBSETS.get(world_size))


def enumerate_cases(world_size: int, device: str = "cpu", subset=None) -> list[dict]:
    """Every case at ``world_size`` ranks on ``device`` (``cpu``: gloo; ``cuda``: NCCL), or only those whose
    ids ``subset`` lists (an unknown id raises: a renamed case must not silently leave a selection)."""
    cases = [dict(id=f"{preset}-{scenario}", kind="routed", preset=preset, scenario=scenario, cap=CAP,
                  dtype="float32", dispatch_fp8=False, alignment=128)
             for preset in PRESETS for scenario in SCENARIOS]
    cases += [
        dict(id="tiny-kimi-k2-bf16", kind="routed", preset="tiny-kimi-k2", scenario="uneven", cap=CAP,
             dtype="bfloat16", dispatch_fp8=False, alignment=128),
        dict(id="tiny-deepseek-v3-fp8-dispatch", kind="routed", preset="tiny-deepseek-v3", scenario="masked", cap=CAP,
             dtype="float32", dispatch_fp8=True, alignment=128),
        dict(id="tiny-step3-alignment-8-chunk", kind="routed", preset="tiny-step3", scenario="chunk", cap=CAP,
             dtype="float32", dispatch_fp8=False, alignment=8),
        # the masked pool format: every row to the last rank's experts (all_to_one), and FP8 rows over two chunks
        dict(id="tiny-kimi-k2-masked-pool-all_to_one", kind="routed", preset="tiny-kimi-k2", scenario="all_to_one",
             cap=CAP, dtype="bfloat16", dispatch_fp8=False, alignment=16, pool_format="masked"),
        dict(id="tiny-deepseek-v3-masked-pool-fp8-chunk", kind="routed", preset="tiny-deepseek-v3", scenario="chunk",
             cap=CAP, dtype="float32", dispatch_fp8=True, alignment=128, pool_format="masked"),
    ]
    # Triton experts run where Triton can: on the GPU, or interpreted on a machine without one (~1 s a call,
    # so at one world size); a GPU machine's CPU launch leaves them to its cuda launch.
    if world_size == 2 and (device == "cuda" or not torch.cuda.is_available()):
        cases.append(dict(id="tiny-kimi-k2-fp8-triton-experts", kind="routed", preset="tiny-kimi-k2", scenario="uneven",
                          cap=CAP, dtype="bfloat16", dispatch_fp8=True, alignment=1, experts="triton"))
    for transport in TRANSPORTS:
        cases += [
            dict(id=f"overflow-error-{transport}", kind="overflow_error", preset="tiny-kimi-k2", transport=transport,
                 cap=CAP),
            dict(id=f"cap-mismatch-{transport}", kind="cap_mismatch", preset="tiny-kimi-k2", transport=transport,
                 cap=CAP),
            dict(id=f"bad-ids-{transport}", kind="bad_ids", preset="tiny-step3", transport=transport, cap=CAP),
        ]
    cases.append(dict(id="env-a2a-chunk", kind="env", preset="tiny-kimi-k3", cap=CAP))
    if subset is None:
        return cases
    unknown = set(subset) - {case["id"] for case in cases}
    if unknown:
        raise KeyError(f"no such case at {world_size} ranks on {device}: {sorted(unknown)}")
    return [case for case in cases if case["id"] in subset]


def _generator(case_id: str, rank: int, salt: str = "") -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"{case_id}/{rank}/{salt}".encode()))


def num_tokens_for(scenario: str, rank: int, world_size: int, cap: int) -> int:
    """Rows rank ``rank`` feeds in ``scenario``."""
    return {
        "balanced": cap, "all_to_one": cap, "t_eq_cap": cap, "masked": cap - 2, "router": min(10 + rank, cap),
        "zero_tokens": 0 if rank == 0 else cap // 2 + rank,
        "uneven": (3, cap, 7, 11, 1, 9, 5, 13)[rank % 8],
        # rank 0 one row over the cap (two chunks); from 4 ranks on, the last rank feeds none (it still joins
        # every chunk's collectives)
        "chunk": (cap + 1 if rank == 0 else 0 if world_size >= 4 and rank == world_size - 1
                  else max(cap - 2 * rank, 0)),
    }[scenario]


def _distinct_ids(gen, num_tokens, num_experts, num_topk, first=0) -> torch.Tensor:
    if num_tokens == 0:
        return torch.empty(0, num_topk, dtype=torch.int64)
    return torch.stack([first + torch.randperm(num_experts, generator=gen)[:num_topk] for _ in range(num_tokens)])


def routing_for(case: dict, cfg, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_ids_TK int64, topk_weights_TK fp32)`` of rank ``rank`` (any rank can build any rank's)."""
    scenario, cap = case["scenario"], case["cap"]
    num_tokens = num_tokens_for(scenario, rank, world_size, cap)
    E, K = cfg.num_experts, cfg.num_topk
    gen = _generator(case["id"], rank, "routing")
    if scenario == "balanced":  # every expert gets the same load (up to one row)
        slots_TK = torch.arange(num_tokens)[:, None] * K + torch.arange(K)[None, :] + rank * num_tokens * K
        ids = slots_TK % E
    elif scenario == "all_to_one":  # every token of every rank picks the last rank's experts only
        num_local = E // world_size
        picked = min(K, num_local)
        ids = torch.full((num_tokens, K), -1, dtype=torch.int64)
        ids[:, :picked] = _distinct_ids(gen, num_tokens, num_local, picked, first=(world_size - 1) * num_local)
    else:
        ids = _distinct_ids(gen, num_tokens, E, K)
        if scenario == "masked" and num_tokens:
            ids[torch.rand(ids.shape, generator=gen) < 0.3] = -1
            ids[0] = -1  # a token with every slot masked
    weights = torch.rand(num_tokens, K, generator=gen, dtype=torch.float32) + 0.05
    return ids.to(torch.int64), weights


def expert_input_for(case: dict, cfg, rank: int, num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """``[T, Dx]`` expert input rows of rank ``rank``."""
    gen = _generator(case["id"], rank, "x")
    return torch.randn(num_tokens, cfg.expert_hidden_size, generator=gen).to(dtype)


def hidden_for(case: dict, cfg, rank: int, num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """``[T, D]`` hidden states (the ``router`` scenario runs the whole block)."""
    gen = _generator(case["id"], rank, "hidden")
    return torch.randn(num_tokens, cfg.hidden_size, generator=gen).to(dtype)
