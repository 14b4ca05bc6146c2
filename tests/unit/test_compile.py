"""torch.compile(fullgraph=True, backend="aot_eager") of a small decoder layer around MegaMoE: no graph break,
output == eager bitwise."""
from __future__ import annotations

import pytest
import torch

from moe_ref.core.config import preset
from moe_ref.layer import MegaMoE

# aot_eager only here: inductor starts processes (its compile workers, the C++ compiler), so its test is
# tests/dist/test_compile_inductor.py
pytestmark = pytest.mark.unit


class TinyDecoderLayer(torch.nn.Module):
    """norm -> linear "attention" stand-in -> residual -> MegaMoE -> residual."""

    def __init__(self, moe: MegaMoE):
        super().__init__()
        hidden = moe.cfg.hidden_size
        self.norm = torch.nn.RMSNorm(hidden)
        self.mix = torch.nn.Linear(hidden, hidden)
        self.moe = moe

    def forward(self, x):
        x = x + self.mix(self.norm(x))
        return x + self.moe(x)


def test_compiled_decoder_layer_has_no_graph_break_and_matches_eager():
    cfg = preset("tiny-kimi-k2")
    torch.manual_seed(0)
    model = TinyDecoderLayer(MegaMoE(cfg, num_max_tokens_per_rank=16, seed=1)).eval()
    x = torch.randn(7, cfg.hidden_size)
    with torch.no_grad():
        eager = model(x)
        explanation = torch._dynamo.explain(model)(x)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        assert torch.equal(compiled(x), eager)
        assert torch.equal(compiled(x * 2), model(x * 2))  # a new input, same graph
    assert int(model.moe.num_recv_tokens_per_expert.sum()) > 0  # the layer really ran inside the op


def test_custom_op_fake_gives_the_output_shape():
    cfg = preset("tiny-kimi-k2")
    moe = MegaMoE(cfg, num_max_tokens_per_rank=16, seed=1)
    with torch._subclasses.fake_tensor.FakeTensorMode():
        x = torch.empty(cfg.hidden_size, 5).t()  # any input layout: the output is contiguous, as the real op's
        y = torch.ops.moe_ref.mega_moe(x, torch.zeros(1, dtype=torch.int64), moe._op_id, -1, False)
        assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous()
