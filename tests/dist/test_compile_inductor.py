"""The default torch.compile backend (inductor, C++ on CPU) around MegaMoE: the small decoder layer in one graph, any
input layout, and gradients refused with INP007 as in eager. In the dist tier: inductor starts processes (its compile
worker pool and the C++ compiler)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from moe_ref.core.config import preset
from moe_ref.layer import MegaMoE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_compile import TinyDecoderLayer  # noqa: E402  (the decoder layer the aot_eager tests compile)

pytestmark = pytest.mark.dist


def test_inductor_compiles_the_decoder_layer_in_one_graph():
    """The default backend (inductor, C++ on CPU) too; it fuses the norm differently from eager, so the
    comparison is close rather than bitwise (the MoE node itself runs the eager layer: see the aot_eager test in
    tests/unit/test_compile.py)."""
    cfg = preset("tiny-kimi-k2")
    torch.manual_seed(0)
    model = TinyDecoderLayer(MegaMoE(cfg, num_max_tokens_per_rank=16, seed=1)).eval()
    x = torch.randn(7, cfg.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, fullgraph=True)(x), model(x), atol=1e-5, rtol=1e-5)


def test_any_input_layout_compiles_and_matches_eager():
    """A column-major [T, D] input (x.t() of a [D, T] tensor): the op's fake states the real output's layout
    (contiguous), so inductor's generated code agrees with what the op returns; compiled == eager."""
    cfg = preset("tiny-kimi-k2")
    moe = MegaMoE(cfg, num_max_tokens_per_rank=64, seed=1)
    x = torch.randn(cfg.hidden_size, 5).t()
    assert not x.is_contiguous()
    with torch.no_grad():
        eager = moe(x)
        assert eager.is_contiguous()
        for backend in ("inductor", "aot_eager"):
            torch._dynamo.reset()
            compiled = torch.compile(moe, fullgraph=True, dynamic=True, backend=backend)  # the op's output is the graph's
            torch.testing.assert_close(compiled(x), eager, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(compiled(x.contiguous()), eager, atol=1e-5, rtol=1e-5)


def test_compiled_call_with_gradients_raises_inp007_like_eager():
    import pytest

    from moe_ref.core.errors import GradientNotSupportedError

    cfg = preset("tiny-kimi-k2")
    moe = MegaMoE(cfg, num_max_tokens_per_rank=16, seed=1)
    x = torch.randn(4, cfg.hidden_size, requires_grad=True)
    with pytest.raises(GradientNotSupportedError) as eager_err:
        moe(x)
    for backend in ("inductor", "aot_eager"):
        torch._dynamo.reset()
        compiled = torch.compile(lambda t: moe(t) + 1, fullgraph=True, dynamic=True, backend=backend)
        with pytest.raises(GradientNotSupportedError) as err:
            compiled(x)
        assert err.value.code == eager_err.value.code == "INP007"
    with torch.no_grad():  # the same layer still works afterwards
        assert torch.equal(moe(x.detach()), moe(x.detach()))


def test_max_num_tokens_of_the_wrong_type_under_inductor():
    import pytest

    from moe_ref.core.errors import ArgumentTypeError

    moe = MegaMoE("tiny-kimi-k2", num_max_tokens_per_rank=16, seed=0)
    f = torch.compile(lambda x: moe(x, max_num_tokens="4"), fullgraph=True)
    with torch.no_grad(), pytest.raises(ArgumentTypeError, match="max_num_tokens"):
        f(torch.randn(3, moe.cfg.hidden_size))
