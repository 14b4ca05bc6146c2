"""CapacityPlan, SymmetricBuffer allocation, cap/policy resolution, the overflow decision, and the
one-process dispatcher (the EP=1 base case) under both overflow policies."""
from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings

import pytest
import torch

from moe_ref import capacity
from moe_ref.buffer import SymmetricBuffer, sweep_stale_shm_files
from moe_ref.capacity import (
    REGION_ALIGN_BYTES,
    CapacityPlan,
    ChunkingWarning,
    max_tokens_for_budget,
    num_chunks_for,
    num_recv_pool_rows,
    plan_for_topology,
    plan_report,
    resolve_cap,
    resolve_overflow,
)
from moe_ref.config import ParallelConfig, preset
from moe_ref.dispatch import make_dispatcher, place_entries, pre_dispatch_layout, select_entries
from moe_ref.errors import (
    CapacityExceededError,
    DTypeError,
    ExpertIdError,
    ExpertsNotDivisibleError,
    InvalidConfigError,
    MemoryBudgetError,
    UnknownNameError,
)
from moe_ref.experts import make_experts
from moe_ref.reference import moe_block, reference_moe, routed_experts_reference
from moe_ref.testing import assert_bitwise_equal, assert_close
from moe_ref.weights import MoEWeights

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
    expected = {"x": ((cap, dim), wire), "topk_ids": ((cap, topk), torch.int64),
                "topk_weights": ((cap, topk), torch.float32), "recv_x": ((pool, dim), wire),
                "recv_src": ((pool, 3), torch.int32), "combine": ((topk, cap, dim), dtype),
                "num_tokens": ((1,), torch.int64), "num_rows_per_expert": ((cfg.num_experts,), torch.int32),
                "num_recv_tokens_per_expert": ((num_local,), torch.int64)}
    if fp8:
        expected["x_scale"] = ((cap, -(-dim // 128)), torch.float32)
        expected["recv_x_scale"] = ((pool, -(-dim // 128)), torch.float32)
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


# --- cap and policy resolution ----------------------------------------------------------------------------------

def test_resolve_cap_argument_then_env_then_error(monkeypatch):
    monkeypatch.setenv("MOE_REF_NUM_MAX_TOKENS_PER_RANK", "512")
    assert resolve_cap(64) == 64
    assert resolve_cap(None) == 512
    monkeypatch.setenv("MOE_REF_NUM_MAX_TOKENS_PER_RANK", "0")
    with pytest.raises(InvalidConfigError, match=r"num_max_tokens_per_rank=0 \(from the MOE_REF_NUM_MAX_TOKENS_PER_RANK\)"):
        resolve_cap(None)
    monkeypatch.setenv("MOE_REF_NUM_MAX_TOKENS_PER_RANK", "lots")
    with pytest.raises(InvalidConfigError, match="'lots' is not an integer"):
        resolve_cap(None)
    monkeypatch.delenv("MOE_REF_NUM_MAX_TOKENS_PER_RANK")
    with pytest.raises(InvalidConfigError, match=r"\[CFG007\].*num_max_tokens_per_rank=N.*MOE_REF_NUM_MAX_TOKENS_PER_RANK=N"):
        resolve_cap(None)
    with pytest.raises(InvalidConfigError, match="must be a positive integer"):
        resolve_cap(-5)


def test_resolve_overflow_argument_then_env_then_error(monkeypatch):
    assert resolve_overflow(None) == "error"
    monkeypatch.setenv("MOE_REF_OVERFLOW_POLICY", "chunk")
    assert resolve_overflow(None) == "chunk"
    assert resolve_overflow("error") == "error"
    with pytest.raises(UnknownNameError, match=r"argument overflow='drop'; supported: error, chunk"):
        resolve_overflow("drop")
    monkeypatch.setenv("MOE_REF_OVERFLOW_POLICY", "drop")
    with pytest.raises(UnknownNameError, match=r"MOE_REF_OVERFLOW_POLICY='drop'"):
        resolve_overflow(None)


# --- the overflow decision ----------------------------------------------------------------------------------------

def test_error_policy_names_rows_cap_fix_and_cost():
    plan = CapacityPlan.build(preset("tiny-kimi-k2"), 2, 16, torch.bfloat16)
    needed_bytes = plan.with_cap(21).total_bytes
    with pytest.raises(CapacityExceededError) as info:
        num_chunks_for(12, 21, plan, "error", rank=1)
    message = str(info.value)
    for needle in ("[CAP001]", "rank 1 has num_tokens=12", "max over the EP group is 21 (another rank",
                   "num_max_tokens_per_rank=16", "num_max_tokens_per_rank=21", "MOE_REF_NUM_MAX_TOKENS_PER_RANK=21",
                   str(needed_bytes), str(plan.total_bytes), "overflow='chunk'", "2 chunks"):
        assert needle in message, (needle, message)
    assert info.value.details["needed_bytes"] == needed_bytes
    assert isinstance(info.value, RuntimeError)


def test_chunk_counts_and_boundaries(monkeypatch):
    monkeypatch.setattr(capacity, "_ANNOUNCED", set())
    plan = CapacityPlan.build(preset("tiny-step3"), 2, 16)
    assert num_chunks_for(0, 0, plan, "error") == 0  # nobody has rows: no chunk at all, on every rank
    assert num_chunks_for(16, 16, plan, "error") == 1  # exactly the cap fits
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert num_chunks_for(3, 17, plan, "chunk") == 2  # cap + 1 -> 2 chunks, on every rank
        assert num_chunks_for(0, 48, plan, "chunk") == 3  # a rank with no rows still runs every chunk
        assert num_chunks_for(49, 49, plan, "chunk") == 4
    chunk_warnings = [w for w in caught if issubclass(w.category, ChunkingWarning)]
    assert len(chunk_warnings) == 1, "chunking is announced once per process"
    assert "17 rows per rank, above num_max_tokens_per_rank=16" in str(chunk_warnings[0].message)


# --- the one-process dispatcher (EP=1 base case) ------------------------------------------------------------------

def _experts(cfg, weights):
    return make_experts("torch", weights.gate_up_weight_E2FD, weights.down_weight_EDF, cfg.activation,
                        cfg.situ_beta, cfg.situ_linear_beta)


@pytest.mark.parametrize("name", TINY)
def test_local_dispatcher_chunked_equals_unchunked_bitwise_and_matches_reference(name):
    cfg = preset(name)
    weights = MoEWeights.random(cfg, seed=1)
    x = torch.randn(37, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    experts = _experts(cfg, weights)
    outputs = {}
    for cap in (64, 16, 1):
        with make_dispatcher(cfg, None, cap, overflow="chunk") as dispatcher:
            assert dispatcher.transport_name == "local"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ChunkingWarning)
                outputs[cap] = moe_block(x, weights, cfg, lambda a, i, w: dispatcher.run(a, i, w, experts))
    assert_close(outputs[64], reference_moe(x, weights, cfg), torch.float32, name=name)
    assert_bitwise_equal(outputs[16], outputs[64], name=name, cap=16)
    assert_bitwise_equal(outputs[1], outputs[64], name=name, cap=1)


def test_local_dispatcher_edge_cases_and_counters():
    cfg = preset("tiny-kimi-k2")
    weights = MoEWeights.random(cfg, seed=3)
    experts = _experts(cfg, weights)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(16, cfg.hidden_size, generator=gen)
    ids = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(16)])
    ids[torch.rand(ids.shape, generator=gen) < 0.4] = -1
    ids[3] = -1
    w = torch.rand(16, 4, generator=gen)

    def reference(x_, ids_, w_):
        return routed_experts_reference(x_, ids_, w_, weights.gate_up_weight_E2FD, weights.down_weight_EDF,
                                        cfg.activation, cfg.situ_beta, cfg.situ_linear_beta)

    with make_dispatcher(cfg, None, 16) as dispatcher:
        y = dispatcher.run(x, ids, w, experts)  # T == cap, masked slots, a fully masked token
        assert_close(y, reference(x, ids, w), torch.float32)
        assert torch.equal(y[3], torch.zeros(cfg.hidden_size))
        empty = dispatcher.run(x[:0], ids[:0], w[:0], experts)
        assert empty.shape == (0, cfg.hidden_size)
        expected_counts = torch.bincount(ids[ids >= 0], minlength=16)
        assert torch.equal(dispatcher.num_recv_tokens_per_expert, expected_counts)  # masked slots never count
        dispatcher.run(x, ids, w, experts)
        assert torch.equal(dispatcher.num_recv_tokens_per_expert, 2 * expected_counts)  # accumulated over calls
        with pytest.raises(CapacityExceededError, match=r"rank 0 has num_tokens=17.*num_max_tokens_per_rank=17"):
            dispatcher.run(torch.cat([x, x[:1]]), torch.cat([ids, ids[:1]]), torch.cat([w, w[:1]]), experts)
        bad = ids.clone()
        bad[0, 0] = 16
        with pytest.raises(ExpertIdError, match=r"\[INP005\].*outside \[-1, 16\)"):
            dispatcher.run(x, bad, w, experts)
        twice = torch.tensor([[1, 1, 2, 3]] * 16)
        with pytest.raises(ExpertIdError, match="picks an expert twice"):
            dispatcher.run(x, twice, w, experts)
        with pytest.raises(DTypeError, match="planned for torch.float32"):
            dispatcher.run(x.bfloat16(), ids, w, experts)


def test_dispatch_handle_pool_layout_and_metadata():
    cfg = preset("tiny-step3")  # E=8, K=3
    weights = MoEWeights.random(cfg, seed=5)
    x = torch.randn(3, cfg.hidden_size)
    ids = torch.tensor([[5, 0, -1], [0, 7, 5], [-1, -1, 0]])
    w = torch.rand(3, 3)
    with make_dispatcher(cfg, None, 4, alignment=4) as dispatcher:
        handle = dispatcher.dispatch(x, ids, w)
        layout = handle.layout
        assert layout.num_rows_e.tolist() == [3, 0, 0, 0, 0, 2, 0, 1]
        assert layout.row_start_e.tolist() == [0, 4, 4, 4, 4, 4, 8, 8]  # expert-major, aligned to 4
        whole = dispatcher.whole_segment_layout(handle)
        assert whole.num_rows_e.tolist() == [4, 0, 0, 0, 0, 4, 0, 4]
        # (source rank, token, slot) per pool row, ordered by token then slot inside each expert; -1 on padding
        src = handle.recv_src_P3[:12].tolist()
        assert src[:4] == [[0, 0, 1], [0, 1, 0], [0, 2, 2], [-1, -1, -1]]
        assert src[4:8] == [[0, 0, 0], [0, 1, 2], [-1, -1, -1], [-1, -1, -1]]
        assert src[8:9] == [[0, 1, 1]]
        assert torch.equal(handle.recv_x_PD[[0, 1, 2]], x[[0, 1, 2]])
        assert bool((handle.recv_x_PD[[3, 6, 7, 9]] == 0).all()), "padding rows are zeroed"
        x_RD, x_scale_RDb = dispatcher.expert_input(handle)
        assert x_RD.shape[0] == layout.num_pool_rows == 12 and x_scale_RDb is None  # the used prefix only
        routed = dispatcher.combine(_experts(cfg, weights)(x_RD, whole), handle)
    expected = routed_experts_reference(x, ids, w, weights.gate_up_weight_E2FD, weights.down_weight_EDF,
                                        cfg.activation)
    assert_close(routed, expected, torch.float32)


def test_select_and_place_entries_order_by_source_token_slot():
    ids = torch.tensor([[2, 0], [3, 2]])
    entries = select_entries(ids, 2, 2)  # experts 2 and 3 -> local 0 and 1
    assert entries.tolist() == [[0, 0, 0], [1, 1, 0], [1, 0, 1]]
    from_rank1 = select_entries(torch.tensor([[3, 1]]), 2, 2)
    layout, pos = place_entries((entries, from_rank1), 2, 4, 16)
    assert layout.num_rows_e.tolist() == [2, 2] and layout.row_start_e.tolist() == [0, 4]
    assert pos[0].tolist() == [0, 1, 4] and pos[1].tolist() == [5]  # rank 0's rows first in each segment


def test_pre_dispatch_layout_counts_offsets_and_slots():
    layout = pre_dispatch_layout(torch.tensor([[2, 0], [3, -1]]), 2, 2)  # the docstring's example
    assert layout.num_rows_Re.tolist() == [[1, 0], [1, 1]] and layout.psum_rows_Re.tolist() == [[0, 1], [1, 2]]
    assert layout.token_idx_N.tolist() == [0, 0, 1] and layout.slot_idx_N.tolist() == [1, 0, 0]
    gen = torch.Generator().manual_seed(8)
    ids = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(23)])
    ids[torch.rand(ids.shape, generator=gen) < 0.3] = -1
    layout = pre_dispatch_layout(ids, 4, 4)
    assert int(layout.num_rows_Re.sum()) == int((ids >= 0).sum())  # masked slots are skipped
    per_dst = torch.cat([select_entries(ids, dst * 4, 4) for dst in range(4)])  # what the transports move
    assert torch.equal(layout.token_idx_N, per_dst[:, 0]) and torch.equal(layout.slot_idx_N, per_dst[:, 1])


def test_fp8_dispatch_dequantizes_before_the_experts():
    from moe_ref.kernels.pre_dispatch import dequantize_fp8_per_128, quantize_fp8_per_128

    cfg = preset("tiny-kimi-k3")
    weights = MoEWeights.random(cfg, seed=6)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(10, cfg.expert_hidden_size, generator=gen)
    ids = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(10)])
    w = torch.rand(10, 4, generator=gen)
    with make_dispatcher(cfg, None, 10, dispatch_fp8=True) as dispatcher:
        assert dispatcher.buffer.view("recv_x").dtype == torch.float8_e4m3fn
        y = dispatcher.run(x, ids, w, _experts(cfg, weights))
    x_seen = dequantize_fp8_per_128(*quantize_fp8_per_128(x), torch.float32)
    expected = routed_experts_reference(x_seen, ids, w, weights.gate_up_weight_E2FD, weights.down_weight_EDF,
                                        cfg.activation, cfg.situ_beta, cfg.situ_linear_beta)
    assert_close(y, expected, torch.float32)


def test_transport_name_from_argument_or_env(monkeypatch):
    cfg = preset("tiny-step3")
    monkeypatch.setenv("MOE_REF_TRANSPORT", "teleport")
    with pytest.raises(UnknownNameError, match=r"MOE_REF_TRANSPORT='teleport'; supported: auto, local, symm, a2a"):
        make_dispatcher(cfg, None, 4)
    monkeypatch.setenv("MOE_REF_TRANSPORT", "local")
    with make_dispatcher(cfg, None, 4) as dispatcher:
        assert dispatcher.transport_name == "local"
    with pytest.raises(UnknownNameError, match="argument transport='nvlink'"):
        make_dispatcher(cfg, None, 4, transport="nvlink")


# --- shared-memory leftovers -------------------------------------------------------------------------------------

def test_sweep_removes_files_of_dead_creators_only(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / f"moe_ref_0123456789ab_{dead_pid}_r1"
    live = tmp_path / f"moe_ref_0123456789ab_{os.getpid()}_r0"
    other = tmp_path / "unrelated_file"
    for path in (stale, live, other):
        path.write_bytes(b"x")
    removed = sweep_stale_shm_files(str(tmp_path))
    assert removed == [str(stale)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])
