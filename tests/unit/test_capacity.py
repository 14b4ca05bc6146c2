"""CapacityPlan, SymmetricBuffer allocation and shared-memory leftovers (options: test_options.py; the
overflow policy: test_overflow.py; the one-process routed step: test_routed_step.py)."""
from __future__ import annotations

import math

import pytest
import torch

from moe_ref.ep.buffer import SymmetricBuffer
from moe_ref.ep.capacity import (
    REGION_ALIGN_BYTES,
    CapacityPlan,
    max_tokens_for_budget,
    num_recv_pool_rows,
    plan_for_topology,
    plan_report,
)
from moe_ref.core.config import ParallelConfig, preset
from moe_ref.core.errors import (
    ExpertsNotDivisibleError,
    InvalidConfigError,
    MemoryBudgetError,
)

pytestmark = pytest.mark.unit

TINY = ("tiny-kimi-k2", "tiny-kimi-k3", "tiny-deepseek-v3", "tiny-step3")
GIB = 1 << 30


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("MOE_REF_NUM_MAX_TOKENS_PER_RANK", "MOE_REF_OVERFLOW_POLICY", "MOE_REF_TRANSPORT"):
        monkeypatch.delenv(name, raising=False)


# --- the plan ------------------------------------------------------------------------------------------------

PLAN_CASES = [
    ("tiny-kimi-k2", 2, 16, torch.float32, False, 128),
    ("tiny-kimi-k3", 4, 7, torch.bfloat16, False, 8),
    ("tiny-deepseek-v3", 1, 1, torch.float16, True, 128),
    ("tiny-step3", 4, 33, torch.bfloat16, True, 64),  # K=3 > e=2: the pool uses min(K, e)
    ("kimi-k2", 8, 4096, torch.bfloat16, True, 128),
    ("step3", 8, 1024, torch.bfloat16, False, 128),
]


@pytest.mark.parametrize("name, ep_size, cap, dtype, fp8, alignment", PLAN_CASES)
def test_plan_regions_are_disjoint_aligned_and_sized(name, ep_size, cap, dtype, fp8, alignment):
    cfg = preset(name)
    plan = CapacityPlan.build(cfg, ep_size, cap, dtype, fp8, alignment)
    case = dict(name=name, ep_size=ep_size, cap=cap, dtype=dtype, fp8=fp8, alignment=alignment)
    previous_end = 0
    for region in plan.regions:
        assert region.offset % REGION_ALIGN_BYTES == 0 and REGION_ALIGN_BYTES >= 16, (region, case)
        assert region.offset >= previous_end, f"{region.name} overlaps the previous region; {case}"
        assert region.nbytes == math.prod(region.shape) * region.dtype.itemsize, (region, case)
        previous_end = region.end
    assert previous_end <= plan.total_bytes < previous_end + REGION_ALIGN_BYTES, case
    assert plan.total_bytes == SymmetricBuffer.size_hint(cfg, ep_size, cap, dtype, fp8, alignment)
    assert sum(plan.group_bytes().values()) == plan.total_bytes, case

    dim, topk, num_local = cfg.expert_hidden_size, cfg.num_topk, cfg.num_experts // ep_size
    pool = plan.num_pool_rows
    wire = torch.float8_e4m3fn if fp8 else dtype
    R, e, K, C, P, Db = ep_size, num_local, topk, cap, pool, -(-dim // 128)
    expected = {"signal": ((R,), torch.int32), "epoch": ((1,), torch.int32), "status": ((2 + R,), torch.int32),
                "counter": ((1,), torch.int32), "num_tokens": ((1,), torch.int32),
                "send_count": ((R, e), torch.int32), "topk_ids": ((C, K), torch.int64),
                "topk_weights": ((C, K), torch.float32), "slot_rank": ((C, K), torch.int32), "x": ((C, dim), wire),
                "recv_num_tokens": ((R,), torch.int32), "num_rows": ((e,), torch.int64),
                "row_start": ((e,), torch.int64), "recv_base": ((R, e), torch.int64), "pool_end": ((1,), torch.int64),
                "recv_pos": ((R, C, K), torch.int32), "recv_weight": ((R, C, K), torch.float32),
                "recv_src": ((P, 3), torch.int32), "recv_x": ((P, dim), wire),
                "combine_partial": ((R, C, dim), dtype)}
    if fp8:
        expected["x_scale"] = ((C, Db), torch.float32)
        expected["recv_x_scale"] = ((P, Db), torch.float32)
    assert {r.name for r in plan.regions} == set(expected), case
    for name_, (shape, region_dtype) in expected.items():
        assert (plan.region(name_).shape, plan.region(name_).dtype) == (shape, region_dtype), (name_, case)


@pytest.mark.parametrize("name, ep_size, cap, dtype, fp8, alignment", PLAN_CASES)
def test_pool_rows_follow_the_formula(name, ep_size, cap, dtype, fp8, alignment):
    cfg = preset(name)
    num_local = cfg.num_experts // ep_size
    raw = ep_size * cap * min(cfg.num_topk, num_local) + num_local * (alignment - 1)
    expected = -(-raw // alignment) * alignment
    plan = CapacityPlan.build(cfg, ep_size, cap, dtype, fp8, alignment)
    assert plan.num_pool_rows == expected == num_recv_pool_rows(cfg, ep_size, cap, alignment)


def test_pool_formula_worked_example():
    # tiny-kimi-k2: E=16, K=4; EP 2 -> e=8: 2*16*4 + 8*127 = 1144 -> 1152
    assert num_recv_pool_rows(preset("tiny-kimi-k2"), 2, 16, 128) == 1152
    # tiny-step3: E=8, K=3; EP 4 -> e=2 < K: 4*10*2 + 2*7 = 94 -> 96
    assert num_recv_pool_rows(preset("tiny-step3"), 4, 10, 8) == 96


def test_plan_refuses_bad_arguments_with_coded_errors():
    cfg = preset("tiny-kimi-k2")
    with pytest.raises(ExpertsNotDivisibleError, match=r"num_experts=16 % ep_size=3"):
        CapacityPlan.build(cfg, 3, 16)
    with pytest.raises(InvalidConfigError, match=r"num_max_tokens_per_rank=0"):
        CapacityPlan.build(cfg, 2, 0)
    with pytest.raises(InvalidConfigError, match=r"activation_dtype=torch.float64"):
        CapacityPlan.build(cfg, 2, 16, torch.float64)
    with pytest.raises(KeyError, match="x_scale"):
        CapacityPlan.build(cfg, 2, 16).region("x_scale")  # no scales without FP8 dispatch


@pytest.mark.parametrize("fp8", [False, True])
def test_allocated_bytes_equal_plan_bytes_and_views_do_not_alias(fp8):
    plan = CapacityPlan.build(preset("tiny-deepseek-v3"), 2, 9, torch.bfloat16, fp8, 16)
    buffer = SymmetricBuffer(plan)
    assert buffer.nbytes == plan.total_bytes
    for i, region in enumerate(plan.regions):  # fill each region with its own byte, then read all back
        view = buffer.view(region.name)
        assert (tuple(view.shape), view.dtype) == (region.shape, region.dtype), region
        view.reshape(-1).view(torch.uint8).fill_(i + 1)
    for i, region in enumerate(plan.regions):
        assert bool((buffer.view(region.name).reshape(-1).view(torch.uint8) == i + 1).all()), region.name
    buffer.destroy()
    buffer.destroy()  # idempotent
    with pytest.raises(RuntimeError, match="destroyed"):
        buffer.view("x")


# --- topology: the DEP=32 double count --------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["kimi-k2", "deepseek-v3"])
def test_attention_dp_does_not_multiply_the_per_rank_buffer(name):
    """Pin: with attention DP at DEP=32 and 1024 tokens per rank, one rank's buffer is a few GiB and does not
    depend on dp_size (a peer multiplied the cap by dp_size as well: about 95 GiB per rank)."""
    cfg = preset(name)
    per_dp = {dp: plan_for_topology(cfg, ParallelConfig(ep_size=32, dp_size=dp, attention_dp=True), 1024).total_bytes
              for dp in (1, 8, 32)}
    assert len(set(per_dp.values())) == 1, f"{name}: per-rank bytes change with dp_size: {per_dp}"
    per_rank = per_dp[32]
    assert 1 * GIB < per_rank < 6 * GIB, f"{name}: {per_rank / GIB:.2f} GiB per rank at DEP=32, cap 1024"
    double_counted = CapacityPlan.build(cfg, 32, 1024 * 32).total_bytes
    assert double_counted > 80 * GIB, "the double count this test guards against would be ~100 GiB"
    assert per_rank * 20 < double_counted
    text = plan_report(cfg, ParallelConfig(ep_size=32, dp_size=32, attention_dp=True), 1024)
    assert str(per_rank) in text and "attention-dp on" in text and "do not depend on dp_size" in text


def test_plan_report_lists_every_region_and_totals():
    plan = CapacityPlan.build(preset("tiny-kimi-k2"), 2, 16, torch.float32)
    text = plan.report()
    for region in plan.regions:
        assert region.name in text and str(region.offset) in text and str(region.nbytes) in text
    assert "TOTAL per rank" in text and str(plan.total_bytes) in text
    assert str(plan.total_bytes * 2) in text  # over the EP group
    assert "2*16*4 + 8*127 -> 1152" in text


# --- budget search ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, ep_size, budget, fp8", [("kimi-k2", 8, 4 * GIB, False), ("kimi-k2", 32, 8 * GIB, True),
                                                        ("tiny-step3", 2, 100_000, False), ("step3", 8, 2 * GIB, False)])
def test_budget_search_returns_the_largest_fitting_cap(name, ep_size, budget, fp8):
    cfg = preset(name)
    best = max_tokens_for_budget(cfg, ep_size, budget, torch.bfloat16, fp8)
    assert CapacityPlan.build(cfg, ep_size, best, torch.bfloat16, fp8).total_bytes <= budget
    assert CapacityPlan.build(cfg, ep_size, best + 1, torch.bfloat16, fp8).total_bytes > budget
    text = plan_report(cfg, ParallelConfig(ep_size=ep_size), 16, dispatch_fp8=fp8, budget_bytes=budget)
    assert f"{best} rows/rank" in text and f"MOE_REF_NUM_MAX_TOKENS_PER_RANK={best}" in text


def test_budget_too_small_is_a_coded_error_with_numbers():
    cfg = preset("kimi-k2")
    smallest = CapacityPlan.build(cfg, 8, 1).total_bytes
    with pytest.raises(MemoryBudgetError, match=rf"\[CAP004\].*needs {smallest} bytes.*budget of 1000 bytes"):
        max_tokens_for_budget(cfg, 8, 1000)
    assert "[CAP004]" in plan_report(cfg, ParallelConfig(ep_size=8), 16, budget_bytes=1000)


# --- shared-memory leftovers -------------------------------------------------------------------------------------

# test_sweep_removes_files_of_dead_creators_only starts a process (for a dead pid): tests/dist/test_shm_sweep.py


def test_a_buffer_larger_than_memory_is_refused_before_allocating():
    """``num_max_tokens_per_rank`` near the bound used to die inside the allocator with a bare error."""
    plan = CapacityPlan.build(preset("deepseek-v3"), 1, 1 << 20, torch.bfloat16)
    with pytest.raises(MemoryBudgetError, match=rf"\[CAP004\].*needs {plan.total_bytes} bytes .* free"):
        SymmetricBuffer(plan)
