"""MegaMoE keeps nn.Module's conventions: state_dict round trips into a fresh layer (plain and quantized experts),
dtype/device conversions are a coded refusal (CFG016) naming how to build the layer wanted, the repr names
dtype, device, EP size, cap and policy."""
from __future__ import annotations

import io

import pytest
import torch

from moe_ref.core.config import preset
from moe_ref.core.errors import LayerConversionError
from moe_ref.layer import MegaMoE

pytestmark = pytest.mark.unit


def _x(cfg, T=9):
    return torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("name", ["tiny-kimi-k2", "tiny-kimi-k3"])
def test_state_dict_round_trips_into_a_fresh_layer(name):
    cfg = preset(name)
    source = MegaMoE(cfg, num_max_tokens_per_rank=16, seed=4)
    state = source.state_dict()
    assert "gate_up_weight" in state and "down_weight" in state
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    fresh = MegaMoE(cfg, num_max_tokens_per_rank=16)  # unseeded: no experts allocated
    assert fresh.gate_up_weight is None
    fresh.load_state_dict(torch.load(buffer), strict=True)
    with torch.no_grad():
        assert torch.equal(fresh(_x(cfg)), source(_x(cfg)))
    # into a bf16 layer: the values are cast, the layer is bf16 throughout
    bf16 = MegaMoE(cfg, num_max_tokens_per_rank=16, dtype=torch.bfloat16)
    bf16.load_state_dict(state)
    with torch.no_grad():
        y = bf16(_x(cfg).bfloat16())
    assert y.dtype == torch.bfloat16 and torch.allclose(y.float(), source(_x(cfg)).detach(), atol=0.1, rtol=0.1)


def test_a_state_dict_without_experts_is_refused_when_strict():
    cfg = preset("tiny-kimi-k2")
    state = {k: v for k, v in MegaMoE(cfg, seed=4).state_dict().items() if "gate_up" not in k}
    with pytest.raises(RuntimeError, match="gate_up_weight"):
        MegaMoE(cfg).load_state_dict(state)


@pytest.mark.parametrize("case", ["kimi-k2-thinking-int4", "deepseek-v3-fp8"])
def test_quantized_experts_round_trip_as_stored(tmp_path, case):
    from test_quant_layer import LAYER, _checkpoint

    cfg, _ = _checkpoint(tmp_path, case)
    source = MegaMoE(cfg, num_max_tokens_per_rank=64).load_hf_weights(tmp_path, layer_idx=LAYER)
    state = source.state_dict()
    assert "gate_up_weight" not in state and "quantized_experts.gate_up_qweight_e2FDq" in state
    fresh = MegaMoE(cfg, num_max_tokens_per_rank=64)
    fresh.load_state_dict(state, strict=True)
    assert fresh.gate_up_weight is None and fresh.quantized_experts.spec == source.quantized_experts.spec
    assert fresh.expert_nbytes() == source.expert_nbytes()
    with torch.no_grad():
        assert torch.equal(fresh(_x(cfg)), source(_x(cfg)))
    plain = MegaMoE(cfg, num_max_tokens_per_rank=64, seed=1)  # quantized experts replace plain ones
    plain.load_state_dict(state)
    assert plain.gate_up_weight is None and plain.quantized_experts is not None
    with torch.no_grad():
        assert torch.equal(plain(_x(cfg)), source(_x(cfg)))


@pytest.mark.parametrize("convert", [lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.double(),
                                     lambda m: torch.nn.Sequential(m).to(torch.bfloat16)],
                         ids=["to-bf16", "half", "double", "parent-to-bf16"])
def test_dtype_conversions_are_a_coded_refusal(convert):
    cfg = preset("tiny-kimi-k2")
    layer = MegaMoE(cfg, num_max_tokens_per_rank=16, seed=4)
    with pytest.raises(LayerConversionError) as err:
        convert(layer)
    assert err.value.code == "CFG016" and "dtype=torch.float32" in str(err.value)
    assert "load_state_dict" in str(err.value)
    assert layer.gate_weight.dtype == torch.float32  # nothing was converted
    assert layer.float() is layer and layer.to("cpu") is layer and layer.to(torch.float32) is layer  # no change: fine
    with torch.no_grad():
        layer(_x(cfg))
    bf16 = MegaMoE(cfg, num_max_tokens_per_rank=16, seed=4, dtype=torch.bfloat16)
    with pytest.raises(LayerConversionError, match="dtype=torch.float32"):
        bf16.float()


def test_repr_names_dtype_device_ep_size_cap_and_policy():
    text = repr(MegaMoE("tiny-kimi-k2", num_max_tokens_per_rank=16, overflow="chunk", dtype=torch.bfloat16))
    for part in ("dtype=torch.bfloat16", "device=cpu", "ep_size=1", "cap=16", "overflow=chunk"):
        assert part in text, (part, text)


def test_a_layer_whose_experts_raised_is_freed_without_gc():
    """No reference cycle through the failure path (frame -> stored exception -> traceback -> frame): the layer,
    its step and the shared buffer go as soon as the caller drops the layer and the exception."""
    import gc
    import weakref

    from moe_ref.ep.buffer import live_shared_buffers

    cfg = preset("tiny-kimi-k2")
    layer = MegaMoE(cfg, num_max_tokens_per_rank=13, seed=4)  # a cap no other test uses: its own shared buffer
    experts = layer.experts

    def boom(*args, **kwargs):
        raise MemoryError("injected inside the experts")

    experts.forward = boom
    gc.collect()
    gc.disable()
    held_before = live_shared_buffers()
    try:
        with torch.no_grad():
            with pytest.raises(MemoryError):
                layer(_x(cfg))
        assert live_shared_buffers() == held_before + 1
        ref, step_ref = weakref.ref(layer), weakref.ref(layer.routed_step)
        del layer, experts, boom
        assert ref() is None and step_ref() is None, "the layer or its step is held by a reference cycle"
        assert live_shared_buffers() == held_before
    finally:
        gc.enable()
