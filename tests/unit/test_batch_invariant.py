"""The batch-invariant mode on one process (docs/batch_invariance.md): a token's output bits do not depend on its
batch, its row order, or the chunk count; the CPU scheme's assumption about the BLAS; the tie rule; the refusals;
the buffer plan's ``combine_slots`` region (invariant mode only)."""
from __future__ import annotations

import warnings

import pytest
import torch

from moe_ref import MegaMoE
from moe_ref.core.config import preset
from moe_ref.core.errors import BatchInvariantUnsupportedError, InvalidConfigError
from moe_ref.core.router import select_experts
from moe_ref.ep.batch_invariant import rows_with_other_bits, sum_slots
from moe_ref.ep.capacity import CapacityPlan
from moe_ref.experts import ExpertLayout, make_experts
from moe_ref.kernels.runtime.fixed_tiles import FIXED_ROW_BLOCK, fixed_tile_matmul_ref

pytestmark = pytest.mark.unit
SIZES = (1, 2, 3, 17, 64, 129)


def tokens(num: int, hidden: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(num, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fixed_shape_blas_call_gives_a_row_the_same_bits_anywhere(dtype):
    """The CPU scheme's assumption, on this machine: a row's result does not depend on T or its place in a block."""
    weight = tokens(80, 48, dtype, seed=2)
    x = tokens(160, 48, dtype)
    full = fixed_tile_matmul_ref(x, weight, torch.float32)
    for size in SIZES:
        for offset in (0, 5, FIXED_ROW_BLOCK - 1):
            assert rows_with_other_bits(fixed_tile_matmul_ref(x[offset:offset + size], weight, torch.float32),
                                  full[offset:offset + size]) == 0, (size, offset)


@pytest.mark.parametrize("preset", ["tiny-kimi-k2", "tiny-kimi-k3", "tiny-step3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_alone_equals_the_token_in_a_batch(preset, dtype):
    moe = MegaMoE(preset, seed=0, dtype=dtype, batch_invariant=True, num_max_tokens_per_rank=256, alignment=1)
    x = tokens(160, moe.cfg.hidden_size, dtype)
    with torch.no_grad():
        full = moe(x)
        for size in SIZES:
            offset = 160 - size if size > 3 else 7 * size
            assert rows_with_other_bits(moe(x[offset:offset + size]), full[offset:offset + size]) == 0, size
        # every token alone: the router's sigmoid of one token's logits ran a scalar path (other bits) where a batch's
        # ran the vector one, which a few positions only showed (moe_ref.core.fixed_chunks)
        alone = torch.cat([moe(x[t:t + 1]) for t in range(x.shape[0])])
        assert rows_with_other_bits(alone, full) == 0
        assert moe(x[:0]).shape == (0, moe.cfg.hidden_size)


def test_positive_control_the_default_mode_differs_for_a_lone_token_in_fp32():
    """Where the default mode is not invariant (a token alone: MKL's small-M path), the test above would see it."""
    moe = MegaMoE("tiny-kimi-k2", seed=0, num_max_tokens_per_rank=256, alignment=1)
    x = tokens(48, moe.cfg.hidden_size, torch.float32)
    with torch.no_grad():
        full = moe(x)
        alone = torch.cat([moe(x[i:i + 1]) for i in range(8)])
    assert rows_with_other_bits(alone, full[:8]) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_derangement_of_rows_inside_expert_segments_keeps_every_row(dtype):
    """(b): each expert segment's rows rotated by one (every row of a segment of >= 2 rows moves)."""
    gate_up = tokens(4 * 80, 48, dtype, seed=3).reshape(4, 80, 48)
    down = tokens(4 * 48, 40, dtype, seed=4).reshape(4, 48, 40)
    experts = make_experts("torch", gate_up, down)
    experts.batch_invariant = True
    counts = torch.tensor([37, 1, 0, 90])
    layout = ExpertLayout.from_counts(counts, alignment=1)
    x = tokens(int(counts.sum()), 48, dtype)
    perm = torch.cat([start + torch.roll(torch.arange(n), 1) for start, n in zip(layout.row_start_e.tolist(),
                                                                                   counts.tolist())])
    moved = float((perm != torch.arange(perm.numel())).float().mean())
    assert moved > 0.9, f"only {moved:.0%} of the rows moved"
    y = experts(x, layout)
    assert rows_with_other_bits(experts(x[perm], layout), y[perm]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_permutation_permutes_the_output_bitwise(dtype):
    moe = MegaMoE("tiny-deepseek-v3", seed=0, dtype=dtype, batch_invariant=True, num_max_tokens_per_rank=128)
    x = tokens(96, moe.cfg.hidden_size, dtype)
    perm = torch.roll(torch.arange(96), 17)
    with torch.no_grad():
        assert rows_with_other_bits(moe(x[perm]), moe(x)[perm]) == 0


@pytest.mark.parametrize("alignment", [1, 128])
def test_chunked_equals_unchunked(alignment):
    def run(cap, invariant):
        moe = MegaMoE("tiny-kimi-k2", seed=0, batch_invariant=invariant, num_max_tokens_per_rank=cap,
                      overflow="chunk", alignment=alignment)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the chunk policy's one warning
            return moe(tokens(100, moe.cfg.hidden_size, torch.float32))

    unchunked = run(128, True)
    for cap in (16, 1) if alignment == 1 else (16,):  # 100 chunks of 128-row segments would take seconds
        assert rows_with_other_bits(run(cap, True), unchunked) == 0, cap
    if alignment == 1:  # positive control: the default mode chunks differently there
        assert rows_with_other_bits(run(16, False), run(128, False)) > 0


def test_ties_in_top_k_go_to_the_lowest_expert_id():
    logits = torch.zeros(3, 8)
    logits[0, [6, 2, 5]] = 1.0  # three-way tie for the top 2
    logits[1] = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5])
    logits[2, [7, 1]] = 2.0
    ids, _ = select_experts(logits, 2, "softmax")
    assert ids.tolist() == [[2, 5], [0, 1], [1, 7]]


def test_sum_slots_adds_live_slots_in_order_in_fp32():
    rows = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [99.0, 99.0]]], dtype=torch.bfloat16)
    ids = torch.tensor([[4, 0, -1]])
    weights = torch.tensor([[0.5, 0.25, 7.0]])
    assert sum_slots(rows, ids, weights, torch.float32).tolist() == [[1.25, 2.0]]
    assert sum_slots(rows[:0], ids[:0], weights[:0], torch.bfloat16).shape == (0, 2)


def test_the_environment_switches_it_on_and_auto_resolves_to_the_holder(monkeypatch):
    monkeypatch.setenv("MOE_REF_BATCH_INVARIANT", "1")
    moe = MegaMoE("tiny-kimi-k2", seed=0)
    assert moe.options.batch_invariant and moe.options.experts_backend == "torch"
    assert moe.options.fingerprint()["batch_invariant"] == "True"


@pytest.mark.parametrize("option", [dict(experts_backend="grouped_mm"), dict(mega="auto")])
def test_options_that_cannot_hold_it_are_refused(option):
    with pytest.raises(BatchInvariantUnsupportedError, match="batch_invariant=True") as err:
        MegaMoE("tiny-kimi-k2", batch_invariant=True, **option)
    assert err.value.code == "CFG026" and next(iter(option)) in str(err.value)


@pytest.mark.parametrize("name,ep_size,cap,dtype,fp8", [("kimi-k2", 8, 256, torch.bfloat16, False),
                                                         ("tiny-kimi-k2", 2, 16, torch.float32, False),
                                                         ("deepseek-v3", 4, 64, torch.bfloat16, True)])
def test_the_plan_grows_by_the_slot_region_only_in_invariant_mode(name, ep_size, cap, dtype, fp8):
    cfg = preset(name)
    default = CapacityPlan.build(cfg, ep_size, cap, dtype, fp8, 1)
    invariant = CapacityPlan.build(cfg, ep_size, cap, dtype, fp8, 1, batch_invariant=True)
    slots = invariant.region("combine_slots")
    assert slots.shape == (cap, cfg.num_topk, cfg.expert_hidden_size) and slots.dtype == dtype
    assert slots.nbytes == cap * cfg.num_topk * cfg.expert_hidden_size * dtype.itemsize
    # the default plan is unchanged: no such region, and every region of it at the same place in the invariant one
    assert not default.has_region("combine_slots") and "combine_slots" not in default.report()
    assert [(r.name, r.offset, r.nbytes) for r in default.regions] == \
        [(r.name, r.offset, r.nbytes) for r in invariant.regions[:-1]]
    assert invariant.regions[-1].name == "combine_slots" and slots.offset == default.total_bytes
    assert invariant.total_bytes - default.total_bytes == -(-slots.nbytes // 128) * 128
    assert invariant.group_bytes()["combine"] - default.group_bytes()["combine"] == \
        invariant.total_bytes - default.total_bytes
    assert "combine_slots" in invariant.report()
    assert invariant.with_cap(2 * cap).has_region("combine_slots")  # the overflow error prices the same plan
    # one rank reads its pool directly: no region, no bytes
    one = CapacityPlan.build(cfg, 1, cap, dtype, fp8, 1, batch_invariant=True)
    assert one.total_bytes == CapacityPlan.build(cfg, 1, cap, dtype, fp8, 1).total_bytes


def test_a_dispatcher_without_the_slot_region_refuses_the_invariant_combine_at_ep_2():
    from moe_ref.ep.dispatch import Dispatcher

    class TwoRanks:  # just what combine_slots reads before the exchange
        world_size = 2
        plan = CapacityPlan.build(preset("tiny-kimi-k2"), 2, 4, torch.float32, alignment=1)
        buffer = type("Buffer", (), {"view": staticmethod(lambda name: torch.zeros(4, 8, dtype=torch.int64))})()

    handle = type("Handle", (), {"num_tokens": 0})()
    with pytest.raises(InvalidConfigError, match="batch_invariant=True") as err:
        Dispatcher.combine_slots(TwoRanks(), torch.zeros(0, 8), handle)
    assert err.value.code == "CFG007"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_which_replica_serves_a_token_does_not_change_its_bits(dtype):
    """Contract (e): with redundant expert slots (EPLB: 16 logical experts in 32 slots, two replicas each) a token's
    output equals the invariant layer's without replicas, bitwise, whichever replica the slot hash sends it to. The
    guard: every expert's two replicas both served rows (the hash really split them), so the equality covers rows
    computed on either copy."""
    cfg = preset("tiny-kimi-k2")
    plain = MegaMoE(cfg, seed=0, dtype=dtype, batch_invariant=True, num_max_tokens_per_rank=64)
    replicated = MegaMoE(cfg, seed=0, dtype=dtype, batch_invariant=True, num_max_tokens_per_rank=64,
                         num_redundant_experts=cfg.num_experts)
    x_TD = torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        y_plain, y_replicated = plain(x_TD), replicated(x_TD)
    load = replicated.expert_load()
    rows_per_replica = load.rows_Ph.view(cfg.num_experts, 2)  # slots 2e and 2e + 1 hold expert e (the even plan)
    assert torch.equal(load.physical_to_logical_Ph.view(cfg.num_experts, 2)[:, 1], torch.arange(cfg.num_experts))
    assert int((rows_per_replica > 0).all(dim=1).sum()) >= cfg.num_experts - 2, rows_per_replica.tolist()
    assert torch.equal(y_plain, y_replicated)
    plain.destroy()
    replicated.destroy()


def test_bench_invariants_kernel_rows_put_the_largest_differences_first_and_sum_each_layer():
    from script_loader import load_script

    bench = load_script("bench_invariant")
    rows = bench.kernel_rows("kimi-k2/48", "bf16", 4096, {"gemm": 100.0, "sum": 10.0, "router": 5.0},
                             {"gemm": 101.0, "slot_sum": 40.0, "router": 20.0}, top=3)
    assert [row.split(" | ")[3] for row in rows] == ["slot_sum", "router", "sum", "all kernels"]
    assert rows[0].endswith("| 0.0 | 40.0 |") and rows[-1].endswith("| 115.0 | 161.0 |")


def test_in_fixed_chunks_gives_an_element_the_same_bits_at_any_size_and_place():
    """Rows of [250, 300] logits (three chunks: rows cross chunk boundaries; a row alone is not a whole vector step)
    alone and in slices, sigmoid and a two-input activation; an exact function comes back exact; mismatched shapes are
    refused."""
    from moe_ref.core.activations import gated_activation
    from moe_ref.core.fixed_chunks import CHUNK, in_fixed_chunks

    logits = tokens(250, 300, torch.float32) * 3
    up = tokens(250, 300, torch.float32, seed=2)
    assert logits.numel() > 2 * CHUNK
    full = in_fixed_chunks(torch.sigmoid, logits)
    act = in_fixed_chunks(gated_activation, logits, up)
    for lo, hi in ((0, 1), (109, 110), (108, 111), (218, 219), (249, 250), (3, 120)):
        assert rows_with_other_bits(in_fixed_chunks(torch.sigmoid, logits[lo:hi]), full[lo:hi]) == 0, (lo, hi)
        assert rows_with_other_bits(in_fixed_chunks(gated_activation, logits[lo:hi], up[lo:hi]), act[lo:hi]) == 0
    assert torch.equal(in_fixed_chunks(lambda a: a * 2, logits), logits * 2)
    torch.testing.assert_close(full, logits.sigmoid(), rtol=1e-6, atol=1e-7)  # the same function, maybe other ulps
    assert in_fixed_chunks(torch.sigmoid, logits[:0]).shape == (0, 300)
    with pytest.raises(ValueError, match="one shape"):
        in_fixed_chunks(gated_activation, logits, up[:5])


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v2", "glm4_moe", "qwen3_moe", "qwen2_moe", "mixtral",
                                        "olmoe", "ernie4_5_moe", "hunyuan_v1_moe", "gpt_oss"])
def test_every_transformers_family_keeps_a_tokens_bits_alone(model_type):
    """The contract over every family the layer loads (their routers, shared-expert gates, activations and biases):
    each of 48 tokens alone gives the bits it gets in the batch, fp32 and bf16."""
    import hf_tiny_models as tiny  # tests/unit, beside this file (transformers imported only here)

    from moe_ref.core.config import MoEConfig

    cfg = MoEConfig.from_hf_config(tiny.tiny_model(model_type).config)
    for dtype in (torch.float32, torch.bfloat16):
        moe = MegaMoE(cfg, seed=0, dtype=dtype, batch_invariant=True, num_max_tokens_per_rank=64, alignment=1)
        x = tokens(48, cfg.hidden_size, dtype)
        with torch.no_grad():
            full = moe(x)
            alone = torch.cat([moe(x[t:t + 1]) for t in range(x.shape[0])])
        assert rows_with_other_bits(alone, full) == 0, (model_type, dtype)
        assert full.abs().sum() > 0  # the experts ran: not a layer of zeros


@pytest.mark.parametrize("preset_name", ["tiny-kimi-k2", "tiny-step3"])
def test_fp8_dispatch_keeps_a_tokens_bits_alone(preset_name):
    """FP8 dispatch on the CPU (rows sent as e4m3 with one scale per token per 128 columns): each of 64 tokens alone
    gives the bits it gets in the batch."""
    import dataclasses

    cfg = dataclasses.replace(preset(preset_name), hidden_size=256, intermediate_size=128)
    moe = MegaMoE(cfg, seed=0, dtype=torch.bfloat16, batch_invariant=True, dispatch_fp8=True,
                  num_max_tokens_per_rank=128, alignment=1)
    x = tokens(64, cfg.hidden_size, torch.bfloat16)
    with torch.no_grad():
        full = moe(x)
        alone = torch.cat([moe(x[t:t + 1]) for t in range(x.shape[0])])
    assert rows_with_other_bits(alone, full) == 0
    assert full.abs().sum() > 0


@pytest.mark.parametrize("preset_name", ["tiny-kimi-k2", "tiny-kimi-k3", "tiny-step3", "tiny-deepseek-v3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_cut_at_random_places_gives_the_batchs_bits(preset_name, dtype):
    """200 tokens cut into pieces of random lengths 1-40 (seeded), each piece one call: the pieces' rows are the
    batch's bits, whatever T each call had (every T from 1 to 40 is likely among them)."""
    moe = MegaMoE(preset_name, seed=0, dtype=dtype, batch_invariant=True, num_max_tokens_per_rank=256, alignment=1)
    x = tokens(200, moe.cfg.hidden_size, dtype, seed=3)
    lengths = torch.randint(1, 41, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    bounds, start = [], 0
    for length in lengths:
        if start >= 200:
            break
        bounds.append((start, min(200, start + length)))
        start += length
    with torch.no_grad():
        full = moe(x)
        pieces = torch.cat([moe(x[lo:hi]) for lo, hi in bounds])
    assert len(bounds) > 5 and bounds[-1][1] == 200
    assert rows_with_other_bits(pieces, full) == 0, bounds
