"""The batch-invariant combine's push (``ep_combine_slots_push``) vs its torch twin, R fake ranks in one process
(separate buffers, real base pointers; ``ep_sim``): the same dispatched chunk pushed by both gives every rank's
WHOLE buffer bitwise equal, each live slot's row is its owner's expert row bit for bit, and ``sum_slots`` over the
region agrees with the float64 oracle."""

import pytest
import torch

from moe_ref.core.errors import DTypeError, ShapeError
from moe_ref.ep.batch_invariant import sum_slots
from moe_ref.kernels.ep.ep_combine_slots import ep_combine_slots_push, ep_combine_slots_push_ref
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
