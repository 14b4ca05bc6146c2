"""The batch-invariant combine's push (``ep_combine_slots_push``) vs its torch twin, R fake ranks in one process
(separate buffers, real base pointers; ``ep_sim``): the same dispatched chunk pushed by both gives every rank's
WHOLE buffer bitwise equal, each live slot's row is its owner's expert row bit for bit, and ``sum_slots`` over the
region agrees with the float64 oracle. The slot sum's kernel (``sum_slots_kernel``, called directly) equals
``sum_slots``' torch loop bitwise: dtypes, K, T, Dx, masked slots holding NaN/Inf, zero/negative/subnormal weights,
a strided rows view."""

import pytest
import torch

from moe_ref.core.errors import DTypeError, ShapeError
from moe_ref.ep.batch_invariant import rows_with_other_bits, sum_slots, sum_slots_ref
from moe_ref.kernels.ep.ep_combine_slots import ep_combine_slots_push, ep_combine_slots_push_ref, sum_slots_kernel
from moe_ref.kernels.ep.ep_dispatch import ep_dispatch_ref
from moe_ref.kernels.ep.ep_layout import ep_pre_dispatch_ref
from moe_ref.kernels.ep.ep_regions import EPRegions
from moe_ref.testing import assert_bitwise_equal

from ep_sim import clone_world, expected_output, make_inputs, make_world, scaled_identity_experts

pytestmark = pytest.mark.interpreter

CASES = {
    # name: (token counts per rank, e, K, C, Dx, dtype, alignment)
    "two_ranks_uneven_zero_fp16": ([4, 0], 2, 3, 4, 72, torch.float16, 4),
    "four_ranks_fp32": ([3, 5, 0, 2], 2, 3, 5, 72, torch.float32, 2),
    "two_ranks_bf16_wide": ([3, 2], 3, 4, 4, 130, torch.bfloat16, 1),
}
ORACLE_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (4e-2, 3e-2)}


@pytest.mark.parametrize("name", list(CASES))
def test_slot_push_matches_its_twin_and_returns_every_slot_row_exactly(name):
    counts, e, K, C, D, dtype, alignment = CASES[name]
    R = len(counts)
    regions = EPRegions.build(R, e, K, C, D, activation_dtype=dtype, alignment=alignment, slot_rows=True)
    inputs = [make_inputs(T, K, R * e, D, dtype, seed=10 * s + 5) for s, T in enumerate(counts)]
    world = make_world(regions, garbage_seed=4)  # random bytes: a row the push should write and did not shows
    for peers, inp in zip(world, inputs):
        ep_pre_dispatch_ref(inp.x_TD, inp.topk_ids_TK, inp.topk_weights_TK, peers, regions, post=True)
    for peers in world:
        ep_dispatch_ref(peers, regions, wait=True, max_polls=50)
    ys = [scaled_identity_experts(peers, regions)(regions.view(peers.local, "recv_x"), None) for peers in world]
    world_t = clone_world(world)
    for peers, y_PD in zip(world, ys):
        ep_combine_slots_push(y_PD, peers, regions)
    for peers, y_PD in zip(world_t, ys):
        ep_combine_slots_push_ref(y_PD, peers, regions)
    for s, inp in enumerate(inputs):
        assert_bitwise_equal(world[s].local, world_t[s].local, case=name, rank=s, what="whole buffer")
        slots_CKD = regions.view(world[s].local, "combine_slots")
        ids_TK = inp.topk_ids_TK
        num_live = 0
        for t, j in (ids_TK >= 0).nonzero().tolist():
            owner = int(ids_TK[t, j]) // e
            pos = int(regions.view(world[owner].local, "recv_pos")[s, t, j])
            assert_bitwise_equal(slots_CKD[t, j], ys[owner][pos], case=name, rank=s, token=t, slot=j)
            num_live += 1
        assert num_live == int((ids_TK >= 0).sum())
        got = sum_slots(slots_CKD[:ids_TK.shape[0]], ids_TK, inp.topk_weights_TK, dtype)
        atol, rtol = ORACLE_TOL[dtype]
        torch.testing.assert_close(got.double(), expected_output(inp, e, False), atol=atol * 4, rtol=rtol)
    assert sum(counts) > 0


def test_the_push_refuses_regions_without_the_slot_region_and_rows_in_another_dtype():
    plain = EPRegions.build(2, 1, 1, 2, 8, activation_dtype=torch.float32)
    world = make_world(plain, garbage_seed=None)
    with pytest.raises(ShapeError, match="slot_rows=True"):
        ep_combine_slots_push_ref(torch.zeros(1, 8), world[0], plain)
    regions = EPRegions.build(2, 1, 1, 2, 8, activation_dtype=torch.bfloat16, slot_rows=True)
    world = make_world(regions, garbage_seed=None)
    with pytest.raises(DTypeError, match="activation dtype"):
        ep_combine_slots_push_ref(torch.zeros(1, 8), world[0], regions)


SUM_CASES = [  # (T, K, Dx, rows dtype, out dtype)
    (5, 8, 300, torch.bfloat16, torch.bfloat16),
    (129, 8, 128, torch.bfloat16, torch.bfloat16),
    (129, 3, 7, torch.float16, torch.float32),
    (1, 8, 300, torch.float32, torch.float32),
    (5, 1, 1, torch.float32, torch.bfloat16),
    (5, 3, 128, torch.float16, torch.bfloat16),
    (1, 1, 7, torch.bfloat16, torch.float32),
    (5, 8, 7, torch.float32, torch.float32),
    (0, 8, 128, torch.bfloat16, torch.bfloat16),
    (5, 3, 0, torch.bfloat16, torch.float32),
]


def slot_sum_inputs(T: int, K: int, Dx: int, dtype: torch.dtype, seed: int = 0, device: str = "cpu"):
    """``(rows [T, K, Dx], ids [T, K] int64, weights [T, K] fp32)``: about a quarter of the slots masked (-1), token
    1 wholly masked, masked rows NaN / +Inf / -Inf; weights mixed-sign with exact zeros, -0.0 and fp32 subnormals
    (token 2: subnormal weights only, so its sum is subnormal)."""
    gen = torch.Generator().manual_seed(seed)
    rows_TKDx = (torch.randn(T, K, Dx, generator=gen) * 4).to(dtype)
    ids_TK = torch.randint(0, 64, (T, K), generator=gen)
    ids_TK[torch.rand(T, K, generator=gen) < 0.25] = -1
    weights_TK = torch.randn(T, K, generator=gen)
    special_TK = torch.randint(0, 6, (T, K), generator=gen)
    weights_TK = torch.where(special_TK == 0, 0.0, weights_TK)
    weights_TK = torch.where(special_TK == 1, -0.0, weights_TK)
    weights_TK = torch.where(special_TK == 2, weights_TK * 1e-39, weights_TK)  # subnormal
    if T > 1:
        ids_TK[1] = -1
    if T > 2:
        ids_TK[2, 0] = 7
        weights_TK[2] = torch.tensor([1e-40, -3e-41, 2e-45] * K)[:K]
    masked_TK = ids_TK < 0
    fill = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
    rows_TKDx[masked_TK] = fill[torch.arange(int(masked_TK.sum())) % 3][:, None].expand(-1, Dx)
    return rows_TKDx.to(device), ids_TK.to(device), weights_TK.to(device)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, **case) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, case)
    if got.numel():
        assert rows_with_other_bits(got, want) == 0, case


@pytest.mark.parametrize("T, K, Dx, dtype, out_dtype", SUM_CASES)
def test_slot_sum_kernel_equals_the_torch_loop_bitwise(T, K, Dx, dtype, out_dtype, device):
    rows_TKDx, ids_TK, weights_TK = slot_sum_inputs(T, K, Dx, dtype, seed=T + 10 * K + Dx, device=device)
    got_TDx = sum_slots_kernel(rows_TKDx, ids_TK, weights_TK, out_dtype)
    want_TDx = sum_slots_ref(rows_TKDx, ids_TK, weights_TK, out_dtype)
    assert_same_bits(got_TDx, want_TDx, T=T, K=K, Dx=Dx, dtype=dtype, out_dtype=out_dtype)
    assert not got_TDx.isnan().any() and not got_TDx.isinf().any()  # no masked NaN/Inf row leaked
    if T > 1 and Dx:
        assert rows_with_other_bits(got_TDx[1:2], torch.zeros_like(got_TDx[1:2])) == 0  # a masked token: +0.0
    if T > 2 and Dx and out_dtype == torch.float32:
        assert got_TDx[2].abs().max() < torch.finfo(torch.float32).tiny  # the subnormal weights' sum stays subnormal
        assert got_TDx[2].ne(0).any()


def test_slot_sum_inputs_tell_summation_orders_apart():
    """The check has teeth: on these inputs the same slots summed in reverse order differ in many rows."""
    rows_TKDx, ids_TK, weights_TK = slot_sum_inputs(129, 8, 128, torch.bfloat16, seed=1)
    forward_TDx = sum_slots_ref(rows_TKDx, ids_TK, weights_TK, torch.float32)
    reverse_TDx = sum_slots_ref(rows_TKDx.flip(1), ids_TK.flip(1), weights_TK.flip(1), torch.float32)
    assert rows_with_other_bits(forward_TDx, reverse_TDx) > 10


def test_slot_sum_kernel_reads_a_strided_rows_view_and_int32_ids(device):
    T, K, Dx = 5, 3, 300
    base_TKDx, ids_TK, weights_TK = slot_sum_inputs(T, 2 * K, Dx + 20, torch.bfloat16, seed=3, device=device)
    rows_TKDx = base_TKDx[:, ::2, 10:10 + Dx]  # strides along T and K, unit stride along Dx
    ids_TK, weights_TK = ids_TK[:, ::2], weights_TK[:, 1::2]
    want_TDx = sum_slots_ref(rows_TKDx, ids_TK, weights_TK, torch.bfloat16)
    assert_same_bits(sum_slots_kernel(rows_TKDx, ids_TK, weights_TK, torch.bfloat16), want_TDx)
    assert_same_bits(sum_slots_kernel(rows_TKDx, ids_TK.to(torch.int32), weights_TK, torch.bfloat16), want_TDx)


def test_slot_sum_kernel_refuses_bad_shapes_and_dtypes(device):
    rows_TKDx, ids_TK, weights_TK = slot_sum_inputs(2, 3, 8, torch.bfloat16, device=device)
    with pytest.raises(ShapeError, match="contiguous last dimension"):
        sum_slots_kernel(rows_TKDx.transpose(1, 2)[:, :3], ids_TK, weights_TK, torch.bfloat16)
    with pytest.raises(ShapeError, match="topk_ids_TK must be"):
        sum_slots_kernel(rows_TKDx, ids_TK[:, :2], weights_TK, torch.bfloat16)
    with pytest.raises(DTypeError, match="fp32"):
        sum_slots_kernel(rows_TKDx, ids_TK, weights_TK.to(torch.bfloat16), torch.bfloat16)
    with pytest.raises(DTypeError, match="out_dtype"):
        sum_slots_kernel(rows_TKDx, ids_TK, weights_TK, torch.int32)


def as_pool(rows_TKDx: torch.Tensor, seed: int = 0):
    """``(pool [P, Dx], pool_row [T, K] int64)`` holding ``rows_TKDx``' rows shuffled into a pool with NaN rows
    between them (never read): what one rank's combine hands ``sum_slots``. One live slot gets no row (-1): a zero row."""
    T, K, Dx = rows_TKDx.shape
    gen = torch.Generator().manual_seed(seed)
    num_pool_rows = 2 * T * K + 1
    slot_of_row = torch.randperm(num_pool_rows, generator=gen)[:T * K]
    pool_PDx = torch.full((num_pool_rows, Dx), float("nan"), dtype=rows_TKDx.dtype, device=rows_TKDx.device)
    pool_PDx[slot_of_row.to(rows_TKDx.device)] = rows_TKDx.reshape(T * K, Dx)
    return pool_PDx, slot_of_row.reshape(T, K).to(rows_TKDx.device)


@pytest.mark.parametrize("T, K, Dx, dtype, out_dtype", SUM_CASES)
def test_slot_sum_reads_the_pool_in_place_with_the_same_bits(T, K, Dx, dtype, out_dtype, device):
    """One rank's form (rows read where they sit in the pool, no ``[T, K, Dx]`` gather) equals the gathered form
    bitwise, kernel and twin, int64 and int32 rows; a live slot without a row (-1) sums a zero row in both."""
    rows_TKDx, ids_TK, weights_TK = slot_sum_inputs(T, K, Dx, dtype, seed=T + 10 * K + Dx + 1, device=device)
    pool_PDx, pool_row_TK = as_pool(rows_TKDx, seed=T + K)
    if T > 3:
        live = (ids_TK[3] >= 0).nonzero()
        if live.numel():
            pool_row_TK[3, live[0, 0]] = -1
            rows_TKDx[3, live[0, 0]] = 0
    want_TDx = sum_slots_ref(rows_TKDx, ids_TK, weights_TK, out_dtype)
    for pool_row in (pool_row_TK, pool_row_TK.to(torch.int32)):
        assert_same_bits(sum_slots_ref(pool_PDx, ids_TK, weights_TK, out_dtype, pool_row), want_TDx, T=T, K=K)
        assert_same_bits(sum_slots_kernel(pool_PDx, ids_TK, weights_TK, out_dtype, pool_row), want_TDx, T=T, K=K)
    assert_same_bits(sum_slots(pool_PDx, ids_TK, weights_TK, out_dtype, pool_row_TK), want_TDx)


def test_slot_sum_over_an_empty_pool_gives_zeros(device):
    ids_TK = torch.full((3, 2), -1, device=device)
    weights_TK = torch.ones(3, 2, device=device)
    got_TDx = sum_slots(torch.empty(0, 8, dtype=torch.bfloat16, device=device), ids_TK, weights_TK, torch.bfloat16,
                        torch.full((3, 2), -1, device=device))
    assert_same_bits(got_TDx, torch.zeros(3, 8, dtype=torch.bfloat16, device=device))


def test_slot_sum_kernel_refuses_a_pool_form_of_the_wrong_shape(device):
    rows_TKDx, ids_TK, weights_TK = slot_sum_inputs(2, 3, 8, torch.bfloat16, device=device)
    pool_PDx, pool_row_TK = as_pool(rows_TKDx)
    with pytest.raises(ShapeError, match="pool"):
        sum_slots_kernel(rows_TKDx, ids_TK, weights_TK, torch.bfloat16, pool_row_TK)
    with pytest.raises(ShapeError, match="pool_row_TK must be"):
        sum_slots_kernel(pool_PDx, ids_TK, weights_TK, torch.bfloat16, pool_row_TK[:, :2])
    with pytest.raises(DTypeError, match="pool_row_TK"):
        sum_slots_kernel(pool_PDx, ids_TK, weights_TK, torch.bfloat16, pool_row_TK.float())
