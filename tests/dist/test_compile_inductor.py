"""The default torch.compile backend (inductor, C++ on CPU) compiles the small decoder layer around MegaMoE in one
graph. Moved from tests/unit/test_compile.py: inductor starts processes (its compile worker pool and the C++
compiler), so this test is in the dist tier."""
from __future__ import annotations

import pytest
import torch

from moe_ref.core.config import preset
from moe_ref.layer import MegaMoE

pytestmark = pytest.mark.dist


class TinyDecoderLayer(torch.nn.Module):
    """norm -> linear "attention" stand-in -> residual -> MegaMoE -> residual (as in tests/unit/test_compile.py)."""

    def __init__(self, moe: MegaMoE):
        super().__init__()
        hidden = moe.cfg.hidden_size
        self.norm = torch.nn.RMSNorm(hidden)
        self.mix = torch.nn.Linear(hidden, hidden)
        self.moe = moe

    def forward(self, x):
        x = x + self.mix(self.norm(x))
        return x + self.moe(x)


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
