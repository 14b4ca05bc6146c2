import pytest
import torch

from moe_ref.core.activations import gated_activation
from moe_ref.core.config import preset
from moe_ref.experts import ExpertLayout, make_experts
from moe_ref.reference import reference_moe, routed_experts_reference
from moe_ref.core.weights import MoEWeights

pytestmark = pytest.mark.unit


def _naive(x, ids, w, gate_up, down, activation="silu"):
    """Token by token, slot by slot, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    F = down.shape[2]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            h = gate_up[e].double() @ x[t].double()
            act = gated_activation(h[:F], h[F:], activation).double()
            out[t] += float(w[t, j]) * (down[e].double() @ act)
    return out


@pytest.mark.parametrize("activation", ["silu", "situ"])
def test_routed_reference_matches_naive_with_masked_slots(activation):
    gen = torch.Generator().manual_seed(0)
    E, D, F, T, K = 6, 12, 10, 9, 3
    gate_up, down = torch.randn(E, 2 * F, D, generator=gen), torch.randn(E, D, F, generator=gen) / 3
    x = torch.randn(T, D, generator=gen)
    ids = torch.randint(0, E, (T, K), generator=gen)
    ids[2, 1] = ids[5, 0] = ids[5, 2] = -1
    w = torch.rand(T, K, generator=gen)
    got = routed_experts_reference(x, ids, w, gate_up, down, activation)
    torch.testing.assert_close(got.double(), _naive(x, ids, w, gate_up, down, activation), rtol=1e-5, atol=1e-5)


def test_all_tokens_to_one_expert_and_empty_batch():
    gen = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(4, 8, 6, generator=gen), torch.randn(4, 6, 4, generator=gen)
    x = torch.randn(7, 6, generator=gen)
    ids, w = torch.full((7, 1), 2), torch.ones(7, 1)
    torch.testing.assert_close(routed_experts_reference(x, ids, w, gate_up, down).double(),
                               _naive(x, ids, w, gate_up, down), rtol=1e-5, atol=1e-5)
    assert routed_experts_reference(x[:0], ids[:0], w[:0], gate_up, down).shape == (0, 6)


@pytest.mark.parametrize("name", ["tiny-kimi-k2", "tiny-kimi-k3", "tiny-deepseek-v3", "tiny-step3"])
def test_reference_moe_shapes_dtypes_and_zero_tokens(name):
    cfg = preset(name)
    weights = MoEWeights.random(cfg, seed=3)
    x = torch.randn(11, cfg.hidden_size)
    y = reference_moe(x, weights, cfg)
    assert y.shape == x.shape and torch.isfinite(y).all()
    assert reference_moe(x[:0], weights, cfg).shape == (0, cfg.hidden_size)
    # Row independence: a token's output does not depend on the rest of the batch.
    torch.testing.assert_close(reference_moe(x[4:5], weights, cfg), y[4:5], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["torch", "grouped_mm"])
def test_expert_backends_agree_and_zero_padding(backend):
    gen = torch.Generator().manual_seed(0)
    e, D, F = 3, 16, 8
    gate_up, down = torch.randn(e, 2 * F, D, generator=gen), torch.randn(e, D, F, generator=gen)
    layout = ExpertLayout.from_counts(torch.tensor([5, 0, 3]), alignment=4)
    assert layout.row_start_e.tolist() == [0, 8, 8] and layout.num_pool_rows == 12
    x = torch.randn(layout.num_pool_rows, D, generator=gen)
    y = make_experts(backend, gate_up, down)(x, layout)
    assert torch.count_nonzero(y[5:8]) == 0 and torch.count_nonzero(y[11:]) == 0
    ids = torch.tensor([0] * 5 + [2] * 3)[:, None]
    rows = torch.cat([x[0:5], x[8:11]])
    want = routed_experts_reference(rows, ids, torch.ones(8, 1), gate_up[[0, 1, 2]], down)
    torch.testing.assert_close(torch.cat([y[0:5], y[8:11]]), want, rtol=1e-4, atol=1e-4)
