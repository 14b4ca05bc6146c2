"""MegaMoE's choice of the routed-step engine (``mega``): refusal, fallback and delegation, on CPU.

The DeepGEMM kernel itself runs only on SM90 GPUs (tests/gpu/mega_worker.py); here a stand-in with the
same interface checks that the layer hands it the routed step and uses its output and counters.
"""
import pytest
import torch

from moe_ref.ep import mega_deep_gemm
from moe_ref.core.config import preset
from moe_ref.core.errors import ShapeUnsupportedError, UnknownNameError
from moe_ref.layer import MegaMoE
from moe_ref.reference import reference_moe, routed_experts_reference
from moe_ref.testing import assert_close
from moe_ref.core.weights import MoEWeights

pytestmark = pytest.mark.unit


def test_unknown_mega_name():
    with pytest.raises(UnknownNameError, match="mega='fused'"):
        MegaMoE("tiny-kimi-k2", mega="fused")


def test_deep_gemm_refused_at_construction_with_the_limits_named():
    with pytest.raises(ShapeUnsupportedError, match=r"ENV002.*multiples of 128.*ep_size=1.*mega='auto'"):
        MegaMoE("tiny-step3", mega="deep_gemm", seed=0)  # hidden 48 (not % 128), one process


def test_auto_falls_back_to_moe_ref_and_matches_reference(caplog):
    cfg = preset("tiny-kimi-k3")  # SiTU: refused by the mega kernel
    with caplog.at_level("WARNING", logger="moe_ref.layer"):
        layer = MegaMoE(cfg, mega="auto", seed=4)
    assert "mega='auto' uses moe_ref's own EP path on every rank: rank 0: activation='situ'" in caplog.text
    x = torch.randn(20, cfg.hidden_size)
    assert_close(layer(x), reference_moe(x, MoEWeights.random(cfg, seed=4), cfg), torch.float32)
    assert not layer.uses_mega
    layer.destroy()


class FakeMega:
    """Stand-in for DeepGemmMegaMoE: the routed step with the torch reference, counting its calls."""

    built = []

    def __init__(self, cfg, group, cap, gate_up, down):
        self.cfg, self.gate_up, self.down, self.calls = cfg, gate_up, down, 0
        self.group, self.ep_size, self.device = group, 1, gate_up.device
        self.num_recv_tokens_per_expert_e = torch.zeros(gate_up.shape[0], dtype=torch.int32)
        FakeMega.built.append(self)

    def launch(self, x, ids, weights):
        self.calls += 1
        self.num_recv_tokens_per_expert_e += torch.bincount(ids[ids >= 0], minlength=self.gate_up.shape[0]).int()
        return routed_experts_reference(x, ids, weights, self.gate_up, self.down).bfloat16()

    def destroy(self):
        pass


def test_layer_delegates_the_routed_step_to_the_mega_engine(monkeypatch):
    monkeypatch.setattr(mega_deep_gemm, "DeepGemmMegaMoE", FakeMega)
    monkeypatch.setattr(MegaMoE, "_mega_supported_here", lambda self: (True, "pretend CUDA SM90"))
    FakeMega.built.clear()
    cfg = preset("tiny-kimi-k2")
    layer = MegaMoE(cfg, mega="auto", seed=2)
    x = torch.randn(12, cfg.hidden_size)
    y = layer(x)
    monkeypatch.undo()
    (engine,) = FakeMega.built
    assert engine.calls == 1 and layer.uses_mega and layer.routed_step.engine is engine  # moe_ref's buffer never built
    assert int(layer.num_recv_tokens_per_expert.sum()) == 12 * cfg.num_topk
    # The engine's bf16 output is cast back; within bf16 of the fp32 reference.
    assert_close(y, reference_moe(x, MoEWeights.random(cfg, seed=2), cfg), torch.bfloat16)
