"""The compiled CPU EP ops (csrc/ -> torch.ops.moe_ref.*_cpu, through moe_ref.kernels.runtime.native) vs their torch twins.

R fake ranks in one process (tests/interpreter/ep_sim.py: separate buffers, real base pointers). Each case runs
the chunk phase by phase on two copies of the same random buffer bytes, the twins on one and the compiled ops
on the other, and requires every rank's WHOLE buffer to be bitwise equal after EVERY phase, and the outputs too.
Also: the barrier (timeout recorded, no endless wait; epoch wrap; a peer one epoch ahead), pool overflow, the
MOE_REF_NATIVE=0 fallback. The run across 2 real processes over /dev/shm is tests/dist/test_native_ops_dist.py.

The library must be built (`make install`): without it these tests FAIL, they do not skip, unless
MOE_REF_NATIVE=0 is set deliberately (then only the fallback checks run).
"""
from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "interpreter"))

import ep_sim  # noqa: E402
from ep_sim import RankInputs, clone_world, expected_output, scaled_identity_experts  # noqa: E402

from moe_ref.kernels.runtime import native
from moe_ref.core.errors import ExpertIdError, PeerTimeoutError  # noqa: E402
from moe_ref.kernels.ep.ep_combine import ep_combine_push_ref, ep_combine_reduce_ref  # noqa: E402
from moe_ref.kernels.ep.ep_dispatch import ep_dispatch_ref  # noqa: E402
from moe_ref.kernels.ep.ep_layout import ep_layout_ref, ep_pre_dispatch_ref  # noqa: E402
from moe_ref.kernels.ep.ep_regions import EPRegions, masked_segment_rows  # noqa: E402
from moe_ref.kernels.ep.symm_signal import check_ep_status, symm_barrier_ref  # noqa: E402
from moe_ref.testing import assert_bitwise_equal  # noqa: E402

# the compiled ops are CPU ops: CPU buffers and inputs also on a machine with a GPU
make_world = functools.partial(ep_sim.make_world, device="cpu")
make_inputs = functools.partial(ep_sim.make_inputs, device="cpu")

FORCED_FALLBACK = os.environ.get(native.ENV_VAR, "1").strip().lower() in ("0", "false", "no", "off")
pytestmark = pytest.mark.unit
compiled_only = pytest.mark.skipif(FORCED_FALLBACK, reason=f"{native.ENV_VAR}=0 set deliberately: compiled ops off")

TWINS = (ep_pre_dispatch_ref, symm_barrier_ref, ep_dispatch_ref, ep_combine_push_ref, ep_combine_reduce_ref)


@pytest.fixture(autouse=True)
def _require_library():
    """Every test here but the fallback one fails (not skips) when the library is not active."""
    if not FORCED_FALLBACK:
        assert native.is_active(), f"compiled ops not active: {native.native_status()} (build with `make install`)"


def test_status_line_says_which_path():
    status = native.native_status()
    if FORCED_FALLBACK:
        assert not native.is_active() and status.startswith(f"fallback: {native.ENV_VAR}="), status
    else:
        assert native.is_active(), f"the compiled library is not active: {status} (run `make install`)"
        assert status.startswith("compiled ops: active"), status


# ---------------------------------------------------------------------------------------------------------
# a phase-by-phase chunk for R fake ranks, comparing the two worlds after every phase
# ---------------------------------------------------------------------------------------------------------
def _compare(world_n, world_t, regions, what, **case):
    for r in range(len(world_n)):
        for name in regions.offsets:  # region first: a better message
            assert_bitwise_equal(regions.view(world_n[r].local, name), regions.view(world_t[r].local, name),
                                 phase=what, rank=r, region=name, **case)
        assert_bitwise_equal(world_n[r].local, world_t[r].local, phase=what, rank=r, what="whole buffer", **case)


def run_both(regions, inputs, *, fused=True, garbage_seed=3, y_dtype=None, y_padded=False, out_dtype=None, **case):
    """The chunk with twins and with compiled ops on identical worlds; returns (outs_native, outs_twin, world)."""
    world_n = make_world(regions, garbage_seed=garbage_seed)
    world_t = clone_world(world_n)
    polls = dict(max_polls=100)
    outs = {}
    for label, world, (pre, barrier, dispatch, push, reduce) in (("native", world_n, native.ops_table()),
                                                                  ("twin", world_t, TWINS)):
        for peers, inp in zip(world, inputs):
            pre(inp.x_TD, inp.topk_ids_TK, inp.topk_weights_TK, peers, regions, post=fused)
        if not fused:
            for peers in world:
                barrier(peers, regions, post=True, wait=False, **polls)
            for peers in world:
                barrier(peers, regions, post=False, wait=True, **polls)
        for peers in world:
            dispatch(peers, regions, wait=fused, **polls)
        ys = []
        for peers in world:
            my = peers.local
            y = scaled_identity_experts(peers, regions)(regions.view(my, "recv_x"),
                                                        regions.view(my, "recv_x_scale") if regions.fp8 else None)
            if y_dtype is not None:
                y = y.to(y_dtype)
            if y_padded:  # rows with a stride wider than Dx
                wide = torch.full((y.shape[0], y.shape[1] + 5), float("nan"), dtype=y.dtype)
                wide[:, :y.shape[1]] = y
                y = wide[:, :y.shape[1]]
            ys.append(y)
        for peers, y in zip(world, ys):
            push(y, peers, regions, post=fused)
        if not fused:
            for peers in world:
                barrier(peers, regions, post=True, wait=False, **polls)
            for peers in world:
                barrier(peers, regions, post=False, wait=True, **polls)
        outs[label] = [reduce(inp.x_TD.shape[0], peers, regions, out_dtype, wait=fused, **polls)
                       for peers, inp in zip(world, inputs)]
    _compare(world_n, world_t, regions, "after the chunk", **case)
    for r in range(len(inputs)):
        assert_bitwise_equal(outs["native"][r], outs["twin"][r], rank=r, what="out", **case)
    return outs["native"], outs["twin"], world_n


def run_phases_compared(regions, inputs, **case):
    """Each phase compared separately (pre-dispatch, dispatch, push) so a failure names its phase."""
    world_n = make_world(regions, garbage_seed=11)
    world_t = clone_world(world_n)
    pre_n, _, dispatch_n, push_n, reduce_n = native.ops_table()
    for peers_n, peers_t, inp in zip(world_n, world_t, inputs):
        pre_n(inp.x_TD, inp.topk_ids_TK, inp.topk_weights_TK, peers_n, regions, post=True)
        ep_pre_dispatch_ref(inp.x_TD, inp.topk_ids_TK, inp.topk_weights_TK, peers_t, regions, post=True)
    _compare(world_n, world_t, regions, "pre_dispatch", **case)
    for peers_n, peers_t in zip(world_n, world_t):
        dispatch_n(peers_n, regions, wait=True, max_polls=100)
        ep_dispatch_ref(peers_t, regions, wait=True, max_polls=100)
    _compare(world_n, world_t, regions, "dispatch", **case)
    for peers_n, peers_t in zip(world_n, world_t):
        y = scaled_identity_experts(peers_t, regions)(
            regions.view(peers_t.local, "recv_x"), regions.view(peers_t.local, "recv_x_scale") if regions.fp8 else None)
        push_n(y, peers_n, regions, post=True)
        ep_combine_push_ref(y, peers_t, regions, post=True)
    _compare(world_n, world_t, regions, "combine_push", **case)
    for r, (peers_n, peers_t, inp) in enumerate(zip(world_n, world_t, inputs)):
        out_n = reduce_n(inp.x_TD.shape[0], peers_n, regions, wait=True, max_polls=100)
        out_t = ep_combine_reduce_ref(inp.x_TD.shape[0], peers_t, regions, wait=True, max_polls=100)
        assert_bitwise_equal(out_n, out_t, rank=r, what="out", **case)
    _compare(world_n, world_t, regions, "combine_reduce", **case)
    return world_n


# name: (token counts per rank, e, K, C, Dx, dtype, fp8, alignment, one_expert, masked)
CASES = {
    "one_rank_fp32": ([5], 3, 2, 6, 40, torch.float32, False, 1, None, 0.2),
    "two_ranks_zero_tokens_fp16_align4": ([4, 0], 2, 3, 4, 72, torch.float16, False, 4, None, 0.2),
    "two_ranks_full_cap_fp8_fp32": ([6, 6], 2, 2, 6, 200, torch.float32, True, 1, None, 0.2),
    "four_ranks_uneven_one_expert": ([3, 5, 0, 2], 2, 3, 5, 72, torch.float32, False, 2, 3, 0.2),
    "four_ranks_bf16_fp8_odd_dx": ([2, 4, 1, 3], 1, 2, 4, 131, torch.bfloat16, True, 4, None, 0.2),
    "three_ranks_bf16_odd_dx_align128": ([7, 2, 7], 3, 4, 7, 33, torch.bfloat16, False, 128, None, 0.3),
    "two_ranks_all_masked": ([3, 2], 2, 2, 3, 16, torch.bfloat16, False, 1, None, 1.0),
    "two_ranks_all_to_one_expert_k1": ([6, 6], 4, 1, 6, 24, torch.float16, True, 1, 5, 0.0),
    "three_ranks_all_zero": ([0, 0, 0], 2, 2, 3, 16, torch.float32, False, 2, None, 0.2),
}


@compiled_only
@pytest.mark.parametrize("name", list(CASES))
def test_chunk_compiled_matches_twins_bitwise(name):
    counts, e, K, C, D, dtype, fp8, alignment, one_expert, masked = CASES[name]
    R = len(counts)
    regions = EPRegions.build(R, e, K, C, D, activation_dtype=dtype, fp8=fp8, alignment=alignment)
    inputs = [make_inputs(T, K, R * e, D, dtype, seed=10 * s + 1, one_expert=one_expert, masked=masked)
              for s, T in enumerate(counts)]
    world = run_phases_compared(regions, inputs, case=name)
    for r, inp in enumerate(inputs):
        check_ep_status(world[r], regions)
    outs_n, _, _ = run_both(regions, inputs, case=name)
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 4e-2}[dtype] * 4
    for r, inp in enumerate(inputs):
        want = expected_output(inp, e, fp8)
        assert ((outs_n[r].double() - want).abs() <= tol * (1 + want.abs())).all(), f"{name} rank {r} vs oracle"


@compiled_only
@pytest.mark.parametrize("name", ["two_ranks_zero_tokens_fp16_align4", "four_ranks_uneven_one_expert",
                                  "two_ranks_all_to_one_expert_k1"])
def test_masked_pool_compiled_matches_twins_bitwise(name):
    counts, e, K, C, D, dtype, fp8, alignment, one_expert, masked = CASES[name]
    R = len(counts)
    regions = EPRegions.build(R, e, K, C, D, activation_dtype=dtype, fp8=fp8, alignment=alignment,
                              masked_rows=masked_segment_rows(R, C, alignment))
    inputs = [make_inputs(T, K, R * e, D, dtype, seed=10 * s + 1, one_expert=one_expert, masked=masked)
              for s, T in enumerate(counts)]
    world = run_phases_compared(regions, inputs, case=name)
    for r in range(R):
        check_ep_status(world[r], regions)
        assert regions.view(world[r].local, "row_start").tolist() == [i * regions.masked_rows for i in range(e)]


@compiled_only
def test_masked_segment_overflow_compiled_like_the_twin():
    regions = EPRegions.build(1, 2, 1, 3, 8, activation_dtype=torch.float32, alignment=2, masked_rows=2)
    inputs = [make_inputs(3, 1, 2, 8, torch.float32, seed=0, masked=0.0, one_expert=0)]
    world = run_phases_compared(regions, inputs, case="masked overflow")
    with pytest.raises(ExpertIdError, match="a local expert received 3 rows"):
        check_ep_status(world[0], regions)


@compiled_only
@pytest.mark.parametrize("variant", ["standalone_barriers", "y_fp32_strided_out_fp32", "y_bf16_into_fp16"])
def test_chunk_variants_bitwise(variant):
    dtype = torch.float16 if variant == "y_bf16_into_fp16" else torch.bfloat16
    regions = EPRegions.build(3, 2, 3, 5, 66, activation_dtype=dtype, fp8=False, alignment=4)
    inputs = [make_inputs(T, 3, 6, 66, dtype, seed=5 + s) for s, T in enumerate([5, 1, 3])]
    kwargs = {"standalone_barriers": dict(fused=False),
              "y_fp32_strided_out_fp32": dict(y_dtype=torch.float32, y_padded=True, out_dtype=torch.float32),
              "y_bf16_into_fp16": dict(y_dtype=torch.bfloat16)}[variant]
    run_both(regions, inputs, case=variant, **kwargs)


@compiled_only
def test_many_tokens_several_threads_and_layout_chunks():
    """T*K above the layout's parallel chunk (16384 slots) and many row tasks: thread splits change nothing."""
    regions = EPRegions.build(2, 4, 4, 4200, 24, activation_dtype=torch.bfloat16, fp8=True, alignment=8)
    gen = torch.Generator().manual_seed(1)
    inputs = []
    for s, T in enumerate([4200, 700]):
        ids = torch.rand(T, 8, generator=gen).argsort(dim=1)[:, :4]  # distinct experts per token
        ids[torch.rand(T, 4, generator=gen) < 0.1] = -1
        x = (torch.randn(T, 24, generator=gen) * 3).to(torch.bfloat16)
        inputs.append(RankInputs(x, ids, torch.rand(T, 4, generator=gen)))
    run_both(regions, inputs, case="many_tokens")


@compiled_only
def test_layout_alone_and_ids_outside_range():
    regions = EPRegions.build(2, 3, 4, 40, 8, activation_dtype=torch.float32)
    ids_TK = torch.randint(-3, 9, (40, 4), generator=torch.Generator().manual_seed(0))  # 6..8 >= E, -3..-1 masked
    world_n = make_world(regions, garbage_seed=2)
    world_t = clone_world(world_n)
    native.ep_layout(ids_TK, world_n[1], regions, post=True)
    ep_layout_ref(ids_TK, world_t[1], regions, post=True)
    _compare(world_n, world_t, regions, "layout")
    example = EPRegions.build(2, 2, 2, 4, 8, activation_dtype=torch.float32)
    world = make_world(example, garbage_seed=1)
    native.ep_layout(torch.tensor([[2, 0], [2, -1], [0, 2]]), world[0], example)
    assert example.view(world[0].local, "send_count").tolist() == [[2, 0], [3, 0]]
    assert example.view(world[0].local, "slot_rank")[:3].tolist() == [[0, 0], [1, -1], [1, 2]]


@compiled_only
def test_fp8_quantization_extremes_bitwise():
    """Rows of zeros (amax floor 1e-4), tiny and huge values, a partial last 128-group: same bytes as torch."""
    D = 300
    regions = EPRegions.build(1, 2, 2, 6, D, activation_dtype=torch.float32, fp8=True)
    x = torch.randn(6, D) * torch.tensor([0.0, 1e-7, 1.0, 1e4, 3e38, 1e-30])[:, None]
    x[2, 5] = -0.0
    ids = torch.tensor([[0, 1]] * 6)
    w = torch.rand(6, 2)
    world_n = make_world(regions, garbage_seed=8)
    world_t = clone_world(world_n)
    native.ep_pre_dispatch(x, ids, w, world_n[0], regions)
    ep_pre_dispatch_ref(x, ids, w, world_t[0], regions)
    _compare(world_n, world_t, regions, "fp8 pre_dispatch")


@compiled_only
def test_same_errors_as_twins():
    from moe_ref.core.errors import DTypeError, ShapeError

    regions = EPRegions.build(2, 2, 2, 4, 8, activation_dtype=torch.bfloat16)
    world = make_world(regions)
    x = torch.zeros(5, 8, dtype=torch.bfloat16)
    with pytest.raises(ShapeError):
        native.ep_pre_dispatch(x, torch.zeros(5, 2, dtype=torch.int64), torch.zeros(5, 2), world[0], regions)
    with pytest.raises(DTypeError):
        native.ep_pre_dispatch(x[:2].float(), torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2), world[0], regions)
    with pytest.raises(ShapeError):
        native.ep_combine_reduce(5, world[0], regions)
    with pytest.raises(ValueError):
        native.symm_barrier(world[0], regions, post=False, wait=False)


# ---------------------------------------------------------------------------------------------------------
# barrier, timeout, overflow
# ---------------------------------------------------------------------------------------------------------
@compiled_only
def test_silent_peer_timeout_recorded_like_the_twin_and_no_second_wait():
    regions = EPRegions.build(3, 1, 1, 2, 8, activation_dtype=torch.float32)
    world_n = make_world(regions, garbage_seed=None)
    world_t = clone_world(world_n)
    for world, barrier in ((world_n, native.symm_barrier), (world_t, symm_barrier_ref)):
        barrier(world[1], regions, post=True, wait=False, max_polls=20)  # rank 2 never posts
        barrier(world[0], regions, max_polls=20)
    _compare(world_n, world_t, regions, "timeout")
    with pytest.raises(PeerTimeoutError, match=r"peer\(s\) \[2\] never signalled barrier epoch 1") as err:
        check_ep_status(world_n[0], regions)
    assert err.value.code == "ENV010"
    start = time.monotonic()
    native.symm_barrier(world_n[0], regions, max_polls=10**12)  # status set: returns without waiting
    assert time.monotonic() - start < 1.0
    assert regions.view(world_n[0].local, "status").tolist() == [1, 1, 0, 0, 1]


@compiled_only
def test_timeout_by_time_bound():
    """max_polls unbounded, a 50 ms time bound: the wait ends (no endless wait) and records the silent peer."""
    regions = EPRegions.build(2, 1, 1, 2, 8, activation_dtype=torch.float32)
    world = make_world(regions, garbage_seed=None)
    native.symm_barrier(world[0], regions, post=True, wait=False)
    start = time.monotonic()
    native.ep_dispatch(world[0], regions, wait=True, timeout_us=50_000)
    seconds = time.monotonic() - start
    assert 0.04 <= seconds < 5.0, f"{seconds=}"
    assert regions.view(world[0].local, "status").tolist() == [1, 1, 0, 1]
    # after a timeout dispatch receives nothing (the kernels' contract)
    assert regions.view(world[0].local, "recv_num_tokens").tolist() == [0, 0]
    assert int(regions.view(world[0].local, "pool_end")[0]) == 0
    out = native.ep_combine_reduce(0, world[0], regions, wait=True, timeout_us=1e9, max_polls=10**12)
    assert out.shape == (0, 8)


@compiled_only
def test_wait_releases_the_gil():
    """Another Python thread of the process runs while a rank waits: torch.ops releases the GIL around the op
    and the compiled wait never takes it back (a wait holding it would stall a watchdog thread for the bound)."""
    import threading

    regions = EPRegions.build(2, 1, 1, 2, 8, activation_dtype=torch.float32)
    world = make_world(regions, garbage_seed=None)
    native.symm_barrier(world[0], regions, post=True, wait=False)  # rank 1 stays silent
    ticks, stop = [], threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.005)

    thread = threading.Thread(target=ticker)
    thread.start()
    time.sleep(0.02)
    start = time.monotonic()
    native.symm_barrier(world[0], regions, post=False, wait=True, timeout_us=300_000)
    end = time.monotonic()
    stop.set()
    thread.join()
    during = [t for t in ticks if start < t < end]
    assert len(during) >= 5, f"{len(during)} ticks of the other thread during a {end - start:.2f} s wait"
    assert regions.view(world[0].local, "status").tolist() == [1, 1, 0, 1]


@compiled_only
def test_epoch_wrap_and_peer_one_epoch_ahead():
    regions = EPRegions.build(2, 1, 1, 2, 8, activation_dtype=torch.float32)
    world_n = make_world(regions, garbage_seed=None)
    for peers in world_n:
        regions.view(peers.local, "epoch").fill_(2**31 - 1)
        regions.view(peers.local, "signal").fill_(2**31 - 1)
    world_t = clone_world(world_n)
    for world, barrier in ((world_n, native.symm_barrier), (world_t, symm_barrier_ref)):
        barrier(world[1], regions, post=True, wait=False, max_polls=5)
        barrier(world[1], regions, post=True, wait=False, max_polls=5)  # rank 1 one epoch ahead
        barrier(world[0], regions, max_polls=5)
    _compare(world_n, world_t, regions, "wrap")
    check_ep_status(world_n[0], regions)
    assert int(regions.view(world_n[0].local, "epoch")[0]) == -2**31


@compiled_only
def test_pool_overflow_recorded_and_nothing_written_past_the_pool():
    regions = EPRegions.build(1, 2, 2, 3, 8, activation_dtype=torch.float32, num_pool_rows=4)
    inputs = [make_inputs(3, 2, 2, 8, torch.float32, seed=0, masked=0.0)]  # 6 slots > 4 pool rows
    world = make_world(regions, garbage_seed=4)
    tail = torch.full((64,), 7, dtype=torch.uint8)
    big = torch.cat([world[0].local, tail])
    from moe_ref.kernels.ep.ep_regions import PeerBuffers

    peers = PeerBuffers.from_tensors(0, [big])
    twin = PeerBuffers.from_tensors(0, [big.clone()])
    for p, (pre, _, dispatch, _, _) in ((peers, native.ops_table()), (twin, TWINS)):
        pre(inputs[0].x_TD, inputs[0].topk_ids_TK, inputs[0].topk_weights_TK, p, regions, post=True)
        dispatch(p, regions, wait=True, max_polls=10)
    assert_bitwise_equal(peers.local, twin.local, what="overflowing dispatch")
    assert torch.equal(peers.local[regions.end:], tail)
    with pytest.raises(ExpertIdError, match="need 6 pool rows but the pool has 4"):
        check_ep_status(peers, regions)


# ---------------------------------------------------------------------------------------------------------
# the fallback switch and 2 real processes
# ---------------------------------------------------------------------------------------------------------
def test_env_var_forces_the_fallback(monkeypatch):
    """MOE_REF_NATIVE=0 decides for the fallback (the import-time decision), and with the fallback decided every
    function runs its twin (same bytes as the twins, trivially; and no compiled op is called)."""
    for value in ("0", "off"):
        monkeypatch.setenv(native.ENV_VAR, value)
        active, status = native._load()
        assert not active and status.startswith(f"fallback: {native.ENV_VAR}={value}"), status
    monkeypatch.setattr(native, "_ACTIVE", False)

    class NoCompiledOps:
        def __getattr__(self, name):
            raise AssertionError(f"compiled op {name} called although the fallback was decided")

    monkeypatch.setattr(torch.ops, "moe_ref", NoCompiledOps(), raising=False)
    regions = EPRegions.build(2, 2, 2, 4, 16, activation_dtype=torch.bfloat16, fp8=True, alignment=2)
    inputs = [make_inputs(T, 2, 4, 16, torch.bfloat16, seed=s) for s, T in enumerate([4, 2])]
    run_both(regions, inputs, case="fallback")


@compiled_only
def test_dispatch_adds_the_received_rows_to_the_running_count():
    """``received_e`` through the compiled dispatch: the rows each local expert received, added call after call, as
    the twin and the Triton kernel add them (tests/interpreter/test_ep_kernels.py)."""
    regions = EPRegions.build(1, 3, 2, 6, 16, activation_dtype=torch.float32)
    world = make_world(regions, garbage_seed=8)
    received = torch.tensor([4, 0, 1], dtype=torch.int64)
    expected, live_slots = received.clone(), 0
    for call in range(2):
        inp = make_inputs(5, 2, 3, 16, torch.float32, seed=call)
        live_slots += int((inp.topk_ids_TK >= 0).sum())
        native.ep_pre_dispatch(inp.x_TD, inp.topk_ids_TK, inp.topk_weights_TK, world[0], regions, post=True)
        native.ep_dispatch(world[0], regions, wait=True, received_e=received)
        check_ep_status(world[0], regions)
        expected += regions.view(world[0].local, "num_rows")
        assert torch.equal(received, expected), f"{call=}"
    assert int(received.sum()) == 5 + live_slots  # one rank owns every expert: each live slot counted once
    from moe_ref.core.errors import ShapeError

    with pytest.raises(ShapeError, match="received_e must be"):  # refused before the op runs, as by the twin
        native.ep_dispatch(world[0], regions, received_e=torch.zeros(3, dtype=torch.int32))
    assert torch.equal(received, expected)
