"""The overflow policy: the per-call agreement, chunk counts and boundaries, and the CAP001 message."""
from __future__ import annotations

import warnings

import pytest
import torch

from moe_ref.ep import overflow
from moe_ref.ep.capacity import CapacityPlan
from moe_ref.core.config import preset
from moe_ref.core.errors import CapacityExceededError, NonFiniteError, ShapeError
from moe_ref.ep.overflow import ChunkingWarning, OverflowPolicy

pytestmark = pytest.mark.unit


def _policy(name: str, cap: int, mode: str) -> OverflowPolicy:
    cfg = preset(name)
    return OverflowPolicy(cap, mode, lambda c: CapacityPlan.build(cfg, 2, c, torch.bfloat16).total_bytes)


def test_error_policy_names_rows_cap_fix_and_cost():
    policy = _policy("tiny-kimi-k2", 16, "error")
    needed_bytes, now_bytes = policy.buffer_bytes_for_cap(21), policy.buffer_bytes_for_cap(16)
    with pytest.raises(CapacityExceededError) as info:
        policy.num_chunks(12, 21, rank=1)
    message = str(info.value)
    for needle in ("[CAP001]", "rank 1 has num_tokens=12", "max over the EP group is 21 (another rank",
                   "num_max_tokens_per_rank=16", "num_max_tokens_per_rank=21", "MOE_REF_NUM_MAX_TOKENS_PER_RANK=21",
                   str(needed_bytes), str(now_bytes), "overflow='chunk'", "2 chunks"):
        assert needle in message, (needle, message)
    assert info.value.details["needed_bytes"] == needed_bytes
    assert isinstance(info.value, RuntimeError)


def test_chunk_counts_and_boundaries(monkeypatch):
    monkeypatch.setattr(overflow, "_ANNOUNCED", set())
    strict, chunked = _policy("tiny-step3", 16, "error"), _policy("tiny-step3", 16, "chunk")
    assert strict.num_chunks(0, 0) == 0  # nobody has rows: no chunk at all, on every rank
    assert strict.num_chunks(16, 16) == 1  # exactly the cap fits
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert chunked.num_chunks(3, 17) == 2  # cap + 1 -> 2 chunks, on every rank
        assert chunked.num_chunks(0, 48) == 3  # a rank with no rows still runs every chunk
        assert chunked.num_chunks(49, 49) == 4
    chunk_warnings = [w for w in caught if issubclass(w.category, ChunkingWarning)]
    assert len(chunk_warnings) == 1, "chunking is announced once per process"
    assert "17 rows per rank, above num_max_tokens_per_rank=16" in str(chunk_warnings[0].message)
    assert chunk_warnings[0].filename == "moe_ref"  # no caller's source line printed under it


def test_only_rank_0_announces_chunking(monkeypatch):
    monkeypatch.setattr(overflow, "_ANNOUNCED", set())
    chunked = _policy("tiny-step3", 16, "chunk")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert chunked.num_chunks(3, 17, rank=1) == 2
    assert not [w for w in caught if issubclass(w.category, ChunkingWarning)]
    assert chunked.chunk_bounds(3, 2) == [(0, 3), (3, 3)]  # the rank with 3 rows runs an empty second chunk
    assert chunked.chunk_bounds(40, 3) == [(0, 16), (16, 32), (32, 40)]


def test_agree_in_one_process_raises_the_problem_and_checks_the_bound():
    policy = _policy("tiny-kimi-k2", 16, "chunk")
    assert policy.agree(10, None, call_index=0) == 1
    with pytest.raises(NonFiniteError, match="NaN"):
        policy.agree(10, NonFiniteError("router logits are NaN"), call_index=1)
    with pytest.raises(ShapeError, match=r"num_tokens=10 > the max_num_tokens=8 promised"):
        policy.agree(10, None, call_index=2, max_num_tokens=8)
    assert policy.agree(10, None, call_index=3, max_num_tokens=10) == 1
