"""Device-side EP kernels (ep_layout, ep_dispatch, ep_combine, symm_signal) vs their torch twins, R fake ranks
in one process (separate buffers, real base pointers), phases run rank by rank.

Each case runs a whole chunk twice from the same random buffer bytes, once with the kernels and once with
the twins, and requires every rank's WHOLE buffer (pool, metadata, partials, untouched bytes) and output to
be bitwise equal; it also checks the pool and the outputs against an independent oracle.
"""

import pytest
import torch

from moe_ref.core.errors import ExpertIdError, PeerTimeoutError
from moe_ref.kernels.ep.ep_layout import ep_layout, ep_layout_ref
from moe_ref.kernels.ep.ep_regions import EPRegions, masked_segment_rows
from moe_ref.kernels.ep.symm_signal import check_ep_status, symm_barrier, symm_barrier_ref
from moe_ref.testing import assert_bitwise_equal

from ep_sim import DEVICE, check_pool_semantics, clone_world, expected_output, make_inputs, make_world, simulate_chunk

pytestmark = pytest.mark.interpreter

# (atol, rtol) of the output vs the float64 oracle (rounding of partials and outputs to the activation dtype)
ORACLE_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (4e-2, 3e-2)}

CASES = {
    # name: (token counts per rank, e, K, C, Dx, dtype, fp8, alignment, one_expert)
    "one_rank": ([5], 3, 2, 6, 40, torch.float32, False, 1, None),
    "two_ranks_uneven_zero": ([4, 0], 2, 3, 4, 72, torch.float16, False, 4, None),
    "two_ranks_full_cap_fp8": ([6, 6], 2, 2, 6, 200, torch.float32, True, 1, None),
    "four_ranks_one_expert": ([3, 5, 0, 2], 2, 3, 5, 72, torch.float32, False, 2, 3),
    "four_ranks_bf16_fp8": ([2, 4, 1, 3], 1, 2, 4, 130, torch.bfloat16, True, 4, None),
    "two_ranks_bf16": ([3, 2], 3, 4, 4, 64, torch.bfloat16, False, 1, None),
    # 2 dispatch programs (R * C) write the padding rows of 5 experts: each loops over several
    "one_rank_more_experts_than_programs": ([2], 5, 3, 2, 16, torch.float32, False, 4, None),
}


# the masked pool format (expert i owns rows [i * M, (i + 1) * M), M = masked_segment_rows): same fields
MASKED_CASES = {
    "masked_two_ranks_uneven_zero_align4": ([4, 0], 2, 3, 4, 72, torch.float16, False, 4, None),
    "masked_four_ranks_one_expert_fp8": ([3, 5, 0, 2], 2, 3, 5, 72, torch.bfloat16, True, 2, 3),
}


@pytest.mark.parametrize("name", list(CASES) + list(MASKED_CASES))
def test_chunk_kernels_match_twins_and_oracle(name):
    counts, e, K, C, D, dtype, fp8, alignment, one_expert = {**CASES, **MASKED_CASES}[name]
    R = len(counts)
    masked_rows = masked_segment_rows(R, C, alignment) if name in MASKED_CASES else 0
    regions = EPRegions.build(R, e, K, C, D, activation_dtype=dtype, fp8=fp8, alignment=alignment,
                              masked_rows=masked_rows)
    inputs = [make_inputs(T, K, R * e, D, dtype, seed=10 * s + 1, one_expert=one_expert) for s, T in enumerate(counts)]
    world_k = make_world(regions, garbage_seed=3)
    world_t = clone_world(world_k)
    outs_k = simulate_chunk(world_k, regions, inputs, kernels=True)
    outs_t = simulate_chunk(world_t, regions, inputs, kernels=False)
    for r in range(R):
        check_ep_status(world_k[r], regions)
        assert_bitwise_equal(outs_k[r], outs_t[r], case=name, rank=r, what="out")
        for region in regions.offsets:
            assert_bitwise_equal(regions.view(world_k[r].local, region), regions.view(world_t[r].local, region),
                                 case=name, rank=r, region=region)
        assert_bitwise_equal(world_k[r].local, world_t[r].local, case=name, rank=r, what="whole buffer")
    check_pool_semantics(world_k, regions, inputs)
    atol, rtol = ORACLE_TOL[dtype]
    if fp8:
        atol, rtol = atol + 1e-6, rtol + 1e-6  # the oracle dequantizes the same fp8 rows
    for r, inp in enumerate(inputs):
        want = expected_output(inp, e, fp8)
        torch.testing.assert_close(outs_k[r].double(), want, atol=atol * 4, rtol=rtol, msg=f"{name=} rank {r}")


@pytest.mark.parametrize("fused_signals", [True, False])
def test_chunk_repeats_bitwise_and_second_chunk_reuses_buffers(fused_signals):
    regions = EPRegions.build(2, 2, 2, 4, 48, activation_dtype=torch.float32, alignment=2)
    world = make_world(regions, garbage_seed=5)
    world_t = clone_world(world)
    first = [make_inputs(T, 2, 4, 48, torch.float32, seed=s) for s, T in enumerate([4, 3])]
    second = [make_inputs(T, 2, 4, 48, torch.float32, seed=7 + s) for s, T in enumerate([1, 4])]
    outs_1 = simulate_chunk(world, regions, first, kernels=True, fused_signals=fused_signals)
    outs_2 = simulate_chunk(world, regions, second, kernels=True, fused_signals=fused_signals)
    outs_1_again = simulate_chunk(world, regions, first, kernels=True, fused_signals=fused_signals)
    for inputs in (first, second, first):
        simulate_chunk(world_t, regions, inputs, kernels=False, fused_signals=fused_signals)
    for r in range(2):
        assert_bitwise_equal(outs_1[r], outs_1_again[r], rank=r)
        torch.testing.assert_close(outs_2[r].double(), expected_output(second[r], 2, False), atol=1e-5, rtol=1e-5)
        assert int(regions.view(world[r].local, "epoch")[0]) == 6  # two barriers per chunk
        assert_bitwise_equal(world[r].local, world_t[r].local, rank=r, what="whole buffer after 3 chunks")


def test_layout_counts_and_slot_ranks_example():
    regions = EPRegions.build(2, 2, 2, 4, 8, activation_dtype=torch.float32)
    ids_TK = torch.tensor([[2, 0], [2, -1], [0, 2]], device=DEVICE)
    for layout in (ep_layout, ep_layout_ref):
        world = make_world(regions, garbage_seed=1)
        layout(ids_TK, world[0], regions)
        my = world[0].local
        assert regions.view(my, "send_count").tolist() == [[2, 0], [3, 0]], layout.__name__
        assert regions.view(my, "slot_rank")[:3].tolist() == [[0, 0], [1, -1], [1, 2]], layout.__name__
        assert int(regions.view(my, "num_tokens")[0]) == 3


def test_layout_many_slots_several_blocks():
    """More slots than one BLOCK_N and ids outside [0, E): kernel == twin, and ranks count per expert."""
    regions = EPRegions.build(2, 3, 4, 40, 8, activation_dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    ids_TK = torch.randint(-1, 7, (40, 4), generator=gen).to(DEVICE)  # 6 = E is out of range: never counted
    world_k, world_t = make_world(regions, garbage_seed=2), make_world(regions, garbage_seed=2)
    ep_layout(ids_TK, world_k[1], regions)
    ep_layout_ref(ids_TK, world_t[1], regions)
    assert_bitwise_equal(world_k[1].local, world_t[1].local)
    slot_rank = regions.view(world_k[1].local, "slot_rank")
    for g in range(6):
        assert sorted(slot_rank[ids_TK == g].tolist()) == list(range(int((ids_TK == g).sum())))
    assert (slot_rank[(ids_TK < 0) | (ids_TK >= 6)] == -1).all()


@pytest.mark.parametrize("barrier", [symm_barrier, symm_barrier_ref])
def test_silent_peer_gives_coded_timeout_not_a_hang(barrier):
    regions = EPRegions.build(3, 1, 1, 2, 8, activation_dtype=torch.float32)
    world = make_world(regions, garbage_seed=None)
    barrier(world[1], regions, post=True, wait=False, max_polls=20)  # rank 2 never posts
    barrier(world[0], regions, max_polls=20)
    with pytest.raises(PeerTimeoutError, match=r"peer\(s\) \[2\] never signalled barrier epoch 1") as err:
        check_ep_status(world[0], regions)
    assert err.value.code == "ENV010" and err.value.details["peers"] == [2]
    # a later wait does not wait again (the call is already broken): returns with the first error kept
    barrier(world[0], regions, max_polls=10**9)
    assert regions.view(world[0].local, "status").tolist() == [1, 1, 0, 0, 1]


def test_peer_one_barrier_ahead_is_not_missing():
    regions = EPRegions.build(2, 1, 1, 2, 8, activation_dtype=torch.float32)
    world = make_world(regions, garbage_seed=None)
    symm_barrier(world[1], regions, post=True, wait=False, max_polls=5)
    symm_barrier(world[1], regions, post=True, wait=False, max_polls=5)  # rank 1 already posted epoch 2
    symm_barrier(world[0], regions, max_polls=5)
    check_ep_status(world[0], regions)


def test_pool_overflow_is_reported_not_written_past_the_pool():
    regions = EPRegions.build(1, 2, 2, 3, 8, activation_dtype=torch.float32, num_pool_rows=4)
    world = make_world(regions, garbage_seed=4)
    inputs = [make_inputs(3, 2, 2, 8, torch.float32, seed=0, masked=0.0)]  # 6 slots > 4 pool rows
    tail_before = world[0].local[regions.end:].clone()
    simulate_chunk(world, regions, inputs, kernels=True)
    with pytest.raises(ExpertIdError, match="need 6 pool rows but the pool has 4"):
        check_ep_status(world[0], regions)
    assert torch.equal(world[0].local[regions.end:], tail_before)


@pytest.mark.parametrize("kernels", [True, False], ids=["kernel", "twin"])
def test_masked_segment_overflow_is_reported_and_stays_in_its_segment(kernels):
    # M = 2 rows per expert (smaller than the worst case, so it can overflow): 3 tokens all pick local expert 0
    regions = EPRegions.build(1, 2, 1, 3, 8, activation_dtype=torch.float32, alignment=2, masked_rows=2)
    world = make_world(regions, garbage_seed=5)
    inputs = [make_inputs(3, 1, 2, 8, torch.float32, seed=0, masked=0.0, one_expert=0)]
    segment_1 = regions.view(world[0].local, "recv_x")[2:].clone()
    simulate_chunk(world, regions, inputs, kernels=kernels)
    with pytest.raises(ExpertIdError, match="a local expert received 3 rows but each segment of the masked pool has 2"):
        check_ep_status(world[0], regions)
    assert torch.equal(regions.view(world[0].local, "recv_x")[2:], segment_1), "expert 1's segment was written"
    assert regions.view(world[0].local, "row_start").tolist() == [0, 2]
    assert regions.view(world[0].local, "recv_pos")[0, :3, 0].tolist() == [0, 1, -1]


def test_fused_wait_in_dispatch_reports_a_silent_peer():
    from moe_ref.kernels.ep.ep_dispatch import ep_dispatch
    from moe_ref.kernels.ep.ep_layout import ep_pre_dispatch

    regions = EPRegions.build(2, 2, 2, 4, 16, activation_dtype=torch.float32)
    world = make_world(regions, garbage_seed=6)
    inp = make_inputs(3, 2, 4, 16, torch.float32, seed=1)
    ep_pre_dispatch(inp.x_TD, inp.topk_ids_TK, inp.topk_weights_TK, world[0], regions, post=True)  # rank 1 silent
    assert int(regions.view(world[1].local, "signal")[0]) == 1, "rank 0's last layout program posted to rank 1"
    assert int(regions.view(world[0].local, "counter")[0]) == 0, "the arrival counter is reset for the next use"
    ep_dispatch(world[0], regions, wait=True, max_polls=20)
    with pytest.raises(PeerTimeoutError, match=r"peer\(s\) \[1\]"):
        check_ep_status(world[0], regions)


@pytest.mark.parametrize("kernels", [True, False], ids=["kernel", "twin"])
def test_dispatch_adds_the_received_rows_to_the_running_count(kernels):
    """``received_e``: the rows each local expert received are added to it by the layout step (the dispatcher's
    ``num_recv_tokens_per_expert``), call after call; both implementations alike. A count of the wrong shape,
    dtype or device is refused before anything is written."""
    from moe_ref.core.errors import ShapeError
    from moe_ref.kernels.ep.ep_dispatch import ep_dispatch, ep_dispatch_ref
    from moe_ref.kernels.ep.ep_layout import ep_pre_dispatch, ep_pre_dispatch_ref

    pre, dispatch = (ep_pre_dispatch, ep_dispatch) if kernels else (ep_pre_dispatch_ref, ep_dispatch_ref)
    regions = EPRegions.build(2, 3, 2, 6, 16, activation_dtype=torch.float32)
    world = make_world(regions, garbage_seed=7)
    received = [torch.tensor([5, 0, 7], dtype=torch.int64, device=DEVICE) for _ in world]
    expected = [r.clone() for r in received]
    for call in range(2):
        inputs = [make_inputs(T, 2, 6, 16, torch.float32, seed=20 * call + s) for s, T in enumerate([6, 4])]
        for peers, inp in zip(world, inputs):
            pre(inp.x_TD, inp.topk_ids_TK, inp.topk_weights_TK, peers, regions, post=True)
        for peers, count in zip(world, received):
            dispatch(peers, regions, wait=True, max_polls=50, received_e=count)
        for r, peers in enumerate(world):
            check_ep_status(peers, regions)
            expected[r] += regions.view(peers.local, "num_rows")
            assert torch.equal(received[r], expected[r]), f"{call=} rank {r}"
    for bad in (torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int32)):
        with pytest.raises(ShapeError, match="received_e must be"):
            dispatch(world[0], regions, received_e=bad)
