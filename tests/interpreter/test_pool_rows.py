"""kernels.pool_rows (Triton, interpreted) vs its torch twins vs a per-expert loop: the expert of each pool row, and
zeroing the rows outside every segment, at the edges (empty experts sharing a start, unsorted segments, no expert,
no row, a pool longer than its segments, masked layouts, many experts)."""

import pytest
import torch

from moe_ref.kernels.ep.pool_rows import (pool_row_experts, pool_row_experts_ref, zero_rows_outside_segments,
                                       zero_rows_outside_segments_ref)

pytestmark = pytest.mark.interpreter


def _loop_oracle(row_start_e, num_rows_e, num_pool_rows):
    expert_P = torch.full((num_pool_rows,), -1, dtype=torch.int32)
    for i, (start, count) in enumerate(zip(row_start_e.tolist(), num_rows_e.tolist())):
        expert_P[start:start + count] = i
    return expert_P


CASES = {  # name: (row_start_e, num_rows_e, P)
    "packed, empty experts sharing starts": ([0, 128, 128, 256], [3, 0, 5, 0], 384),
    "empty expert after the one it shares a start with": ([0, 0, 8], [5, 0, 2], 16),
    "unsorted segments": ([64, 0, 32], [10, 7, 1], 80),
    "no expert": ([], [], 8),
    "no row": ([0, 0], [0, 0], 0),
    "pool longer than its segments": ([0, 3], [3, 2], 40),
    "masked: 4 experts x M = 8": ([0, 8, 16, 24], [8, 0, 3, 1], 32),
    "many experts, one row each": (list(range(0, 2 * 300, 2)), [1] * 300, 601),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_expert_of_each_row_matches_the_loop(name, device):
    starts, counts, num_pool_rows = CASES[name]
    row_start_e, num_rows_e = torch.tensor(starts, dtype=torch.int64), torch.tensor(counts, dtype=torch.int32)
    expected = _loop_oracle(row_start_e, num_rows_e, num_pool_rows)
    twin = pool_row_experts_ref(row_start_e, num_rows_e, num_pool_rows)
    got = pool_row_experts(row_start_e.to(device), num_rows_e.to(device), num_pool_rows)
    assert twin.dtype == got.dtype == torch.int32
    assert torch.equal(twin, expected), name
    assert torch.equal(got.cpu(), expected), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width", [7, 300])
def test_zeroing_writes_the_rows_outside_segments_only(dtype, width, device):
    starts, counts, num_pool_rows = CASES["packed, empty experts sharing starts"]
    row_expert_P = _loop_oracle(torch.tensor(starts), torch.tensor(counts), num_pool_rows)
    y = torch.randn(num_pool_rows, width, generator=torch.Generator().manual_seed(width)).to(dtype)
    y[row_expert_P < 0] = float("nan")  # unwritten rows may hold anything
    want = zero_rows_outside_segments_ref(y.clone(), row_expert_P)
    got = y.to(device)
    assert zero_rows_outside_segments(got, row_expert_P.to(device)) is got  # in place
    assert torch.equal(got.cpu(), want)
    assert torch.equal(want[row_expert_P >= 0], y[row_expert_P >= 0]) and not want[row_expert_P < 0].any()


def test_zeroing_a_strided_view_is_refused():
    from moe_ref.core.errors import ShapeError

    with pytest.raises(ShapeError, match="unit stride"):
        zero_rows_outside_segments(torch.zeros(4, 6)[:, ::2], torch.zeros(4, dtype=torch.int32))
