"""The routed step in one process (the EP=1 base case of ModularRoutedStep): chunking, edge cases, the
pool layout, FP8 dispatch, transports by name, and a failure inside the experts."""
from __future__ import annotations

import warnings

import pytest
import torch

from moe_ref.core.config import preset
from moe_ref.block import moe_block
from moe_ref.ep.transport import make_dispatcher
from moe_ref.core.errors import (CapacityExceededError, ConservationError, DTypeError, ExpertIdError, NonFiniteError,
                                 UnknownNameError)
from moe_ref.experts import make_experts
from moe_ref.ep.options import EPOptions
from moe_ref.ep.overflow import ChunkingWarning
from moe_ref.reference import reference_moe, routed_experts_reference
from moe_ref.ep.routed_step import make_modular_step
from moe_ref.testing import assert_bitwise_equal, assert_close
from moe_ref.core.weights import MoEWeights

pytestmark = pytest.mark.unit

TINY = ("tiny-kimi-k2", "tiny-kimi-k3", "tiny-deepseek-v3", "tiny-step3")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("MOE_REF_NUM_MAX_TOKENS_PER_RANK", "MOE_REF_OVERFLOW_POLICY", "MOE_REF_TRANSPORT"):
        monkeypatch.delenv(name, raising=False)


def _step(cfg, cap, experts, **options):
    return make_modular_step(cfg, None, experts, EPOptions.resolve(num_max_tokens_per_rank=cap, **options))



def _experts(cfg, weights):
    return make_experts("torch", weights.gate_up_weight_E2FD, weights.down_weight_EDF, cfg.activation,
                        cfg.situ_beta, cfg.situ_linear_beta)


@pytest.mark.parametrize("name", TINY)
def test_local_step_chunked_equals_unchunked_bitwise_and_matches_reference(name):
    cfg = preset(name)
    weights = MoEWeights.random(cfg, seed=1)
    x = torch.randn(37, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    experts = _experts(cfg, weights)
    outputs = {}
    for cap in (64, 16, 1):
        with _step(cfg, cap, experts, overflow="chunk") as step:
            assert step.transport_name == "local"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ChunkingWarning)
                outputs[cap] = moe_block(x, weights, cfg, step)
    assert_close(outputs[64], reference_moe(x, weights, cfg), torch.float32, name=name)
    assert_bitwise_equal(outputs[16], outputs[64], name=name, cap=16)
    assert_bitwise_equal(outputs[1], outputs[64], name=name, cap=1)


def test_local_step_edge_cases_and_counters():
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

    with _step(cfg, 16, experts) as step:
        y = step(x, ids, w)  # T == cap, masked slots, a fully masked token
        assert_close(y, reference(x, ids, w), torch.float32)
        assert torch.equal(y[3], torch.zeros(cfg.hidden_size))
        empty = step(x[:0], ids[:0], w[:0])
        assert empty.shape == (0, cfg.hidden_size)
        expected_counts = torch.bincount(ids[ids >= 0], minlength=16)
        assert torch.equal(step.num_recv_tokens_per_expert, expected_counts)  # masked slots never count
        step(x, ids, w)
        assert torch.equal(step.num_recv_tokens_per_expert, 2 * expected_counts)  # accumulated over calls
        with pytest.raises(CapacityExceededError, match=r"rank 0 has num_tokens=17.*num_max_tokens_per_rank=17"):
            step(torch.cat([x, x[:1]]), torch.cat([ids, ids[:1]]), torch.cat([w, w[:1]]))
        bad = ids.clone()
        bad[0, 0] = 16
        with pytest.raises(ExpertIdError, match=r"\[INP005\].*outside \[-1, 16\)"):
            step(x, bad, w)
        twice = torch.tensor([[1, 1, 2, 3]] * 16)
        with pytest.raises(ExpertIdError, match="picks an expert twice"):
            step(x, twice, w)
        with pytest.raises(DTypeError, match="the layer runs torch.float32"):
            step(x.bfloat16(), ids, w)
        with pytest.raises(NonFiniteError, match="topk weights are NaN/inf for 1 of 16 tokens"):
            step(x, ids, w.masked_fill(torch.arange(16)[:, None] == 5, float("nan")))
        assert_close(step(x, ids.int(), w), reference(x, ids, w), torch.float32)  # int32 ids, as the mega step
        assert step.calls == 9  # every call counted, the refused ones too (ranks stay in step)


def test_dispatch_handle_pool_layout_and_metadata():
    cfg = preset("tiny-step3")  # E=8, K=3
    weights = MoEWeights.random(cfg, seed=5)
    x = torch.randn(3, cfg.hidden_size)
    ids = torch.tensor([[5, 0, -1], [0, 7, 5], [-1, -1, 0]])
    w = torch.rand(3, 3)
    with make_dispatcher(cfg, None, EPOptions.resolve(num_max_tokens_per_rank=4, alignment=4)) as dispatcher:
        handle = dispatcher.dispatch(x, ids, w)
        layout = handle.layout
        assert layout.num_rows_e.tolist() == [3, 0, 0, 0, 0, 2, 0, 1]
        assert layout.row_start_e.tolist() == [0, 4, 4, 4, 4, 4, 8, 8]  # expert-major, aligned to 4
        ends = (layout.row_start_e + layout.num_rows_e).tolist()
        assert layout.packed and layout.row_start_e.tolist() == [0] + [-(-end // 4) * 4 for end in ends[:-1]]
        whole = dispatcher.whole_segment_layout(handle)
        assert whole.num_rows_e.tolist() == [4, 0, 0, 0, 0, 4, 0, 4] and whole.packed
        # (source rank, token, slot) per pool row, ordered by token then slot inside each expert; -1 on padding
        src = handle.recv_src_P3[:12].tolist()
        assert src[:4] == [[0, 0, 1], [0, 1, 0], [0, 2, 2], [-1, -1, -1]]
        assert src[4:8] == [[0, 0, 0], [0, 1, 2], [-1, -1, -1], [-1, -1, -1]]
        assert src[8:9] == [[0, 1, 1]]
        assert torch.equal(handle.recv_x_PD[[0, 1, 2]], x[[0, 1, 2]])
        assert bool((handle.recv_x_PD[[3, 6, 7, 9]] == 0).all()), "padding rows are zeroed"
        x_PDx, x_scale_PDb = dispatcher.expert_input(handle)
        assert x_PDx.shape[0] == layout.num_pool_rows == 12 and x_scale_PDb is None  # the used prefix only
        routed = dispatcher.combine(_experts(cfg, weights)(x_PDx, whole), handle)
    expected = routed_experts_reference(x, ids, w, weights.gate_up_weight_E2FD, weights.down_weight_EDF,
                                        cfg.activation)
    assert_close(routed, expected, torch.float32)


def test_fp8_dispatch_dequantizes_before_the_experts():
    from moe_ref.kernels.ep.pre_dispatch import dequantize_fp8_per_128, quantize_fp8_per_128

    cfg = preset("tiny-kimi-k3")
    weights = MoEWeights.random(cfg, seed=6)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(10, cfg.expert_hidden_size, generator=gen)
    ids = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(10)])
    w = torch.rand(10, 4, generator=gen)
    with _step(cfg, 10, _experts(cfg, weights), dispatch_fp8=True) as step:
        assert step.dispatcher.buffer.view("recv_x").dtype == torch.float8_e4m3fn
        y = step(x, ids, w)
    x_seen = dequantize_fp8_per_128(*quantize_fp8_per_128(x), torch.float32)
    expected = routed_experts_reference(x_seen, ids, w, weights.gate_up_weight_E2FD, weights.down_weight_EDF,
                                        cfg.activation, cfg.situ_beta, cfg.situ_linear_beta)
    assert_close(y, expected, torch.float32)


def test_transport_name_from_argument_or_env(monkeypatch):
    cfg = preset("tiny-step3")
    monkeypatch.setenv("MOE_REF_TRANSPORT", "local")
    with make_dispatcher(cfg, None, EPOptions.resolve(num_max_tokens_per_rank=4)) as dispatcher:
        assert dispatcher.transport_name == "local"
    with pytest.raises(UnknownNameError, match="transport='nvlink'"):
        make_dispatcher(cfg, None, EPOptions.resolve(num_max_tokens_per_rank=4).replace(transport="nvlink"))


def test_an_exception_inside_the_experts_reaches_the_caller_and_the_step_stays_usable():
    cfg = preset("tiny-kimi-k2")
    weights = MoEWeights.random(cfg, seed=9)
    experts = _experts(cfg, weights)
    x = torch.randn(5, cfg.hidden_size)
    ids, w = torch.tensor([[0, 1, 2, 3]] * 5), torch.full((5, 4), 0.25)
    with _step(cfg, 8, experts) as step:
        expected = step(x, ids, w)
        original = experts.forward
        experts.forward = lambda *a, **k: (_ for _ in ()).throw(MemoryError("simulated OOM in the experts"))
        with pytest.raises(MemoryError, match="simulated OOM"):
            step(x, ids, w)
        experts.forward = original
        assert_bitwise_equal(step(x, ids, w), expected)


def test_debug_checks_pass_on_a_good_call_and_catch_lost_or_corrupted_rows():
    cfg = preset("tiny-kimi-k2")
    weights = MoEWeights.random(cfg, seed=11)
    experts = _experts(cfg, weights)
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(9, cfg.hidden_size, generator=gen)
    ids = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(9)])
    ids[2, 1:] = -1  # masked slots are neither sent nor expected back
    w = torch.rand(9, 4, generator=gen)
    with _step(cfg, 16, experts, debug_checks=True) as step:
        plain = step(x, ids, w)
        dispatcher = step.dispatcher
        exchange, return_partials = dispatcher._pre_dispatch_and_exchange, dispatcher._return_partials

        def corrupt(*args):
            routes = exchange(*args)
            dispatcher.buffer.view("recv_x")[3] += 1.0  # a received row changes on the way
            return routes
        dispatcher._pre_dispatch_and_exchange = corrupt
        with pytest.raises(ConservationError, match=r"\[ENV007\].*rank 0 sent 33 rows .* received 33"):
            step(x, ids, w)
        dispatcher._pre_dispatch_and_exchange = exchange

        def lose_one(y_MD, handle):  # what the transport does, less the partial of token 4
            return_partials(y_MD, handle)
            dispatcher.buffer.view("combine_partial")[0, 4] = float("nan")
        dispatcher._return_partials = lose_one
        with pytest.raises(ConservationError, match=r"combine left 1 of 9 \(token, owner\) partials unwritten "
                                                    r"\(first: token 4 from rank 0\)"):
            step(x, ids, w)
        dispatcher._return_partials = return_partials
        assert_bitwise_equal(step(x, ids, w), plain)  # the checks change nothing when all is well


def test_public_dispatch_refuses_out_of_range_ids_instead_of_dropping_them():
    cfg = preset("tiny-step3")  # E=8, K=3
    with make_dispatcher(cfg, None, EPOptions.resolve(num_max_tokens_per_rank=4)) as dispatcher:
        with pytest.raises(ExpertIdError, match=r"\[INP005\].*outside \[-1, 8\)"):
            dispatcher.dispatch(torch.randn(2, cfg.hidden_size), torch.tensor([[0, 1, 9], [2, 3, 4]]), torch.rand(2, 3))
