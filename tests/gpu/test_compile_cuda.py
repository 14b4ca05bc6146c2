"""torch.compile(mode="reduce-overhead", fullgraph=True) of a model around MegaMoE on one GPU: the layer's custom op
runs inside the compiled CUDA graph (the routed step's capture path) and replays with new inputs == eager."""
from __future__ import annotations

import pytest
import torch

from moe_ref.core.config import preset
from moe_ref.layer import MegaMoE

pytestmark = pytest.mark.cuda


class Residual(torch.nn.Module):
    def __init__(self, moe: MegaMoE):
        super().__init__()
        self.moe = moe

    def forward(self, x):
        return x + self.moe(x)


@pytest.mark.cuda
@pytest.mark.parametrize("dispatch_fp8", [False, True])
def test_reduce_overhead_replays_equal_eager(dispatch_fp8):
    cfg = preset("tiny-kimi-k2")
    model = Residual(MegaMoE(cfg, num_max_tokens_per_rank=64, dispatch_fp8=dispatch_fp8, dtype=torch.bfloat16,
                             device="cuda", seed=1)).eval()
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = [torch.randn(24, cfg.hidden_size, device="cuda", generator=gen).bfloat16() for _ in range(5)]
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        eager = [model(x).clone() for x in inputs]
        got = [compiled(x).clone() for x in inputs]  # first calls warm up and record, later ones replay
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(got, eager)):
        assert torch.equal(a, b), f"input {i}: max abs diff {(a.float() - b.float()).abs().max().item()}"
    model.moe.destroy()
