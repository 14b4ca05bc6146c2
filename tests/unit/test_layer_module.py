"""MegaMoE keeps nn.Module's conventions: state_dict round trips into a fresh layer (plain and quantized experts),
a partial one leaves it refusing calls (INP006), nothing is allocated for the experts before a load, it pickles,
dtype/device conversions are a coded refusal (CFG016) naming how to build the layer wanted, an error raised under
torch.compile leaves grad mode as it was, the repr names dtype, device, EP size, cap and policy."""
from __future__ import annotations

import io
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_ref.core.config import preset
from moe_ref.core.errors import LayerConversionError, LayerNotPicklableError, WeightsNotLoadedError
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


# --- the nn.Module contract: grad mode, partial loads, nothing allocated before a load, pickling, conversions ------

# backends that start no compile workers, spelled as literals (tests/unit/test_tiers.py reads them)
NO_WORKER_COMPILES = {"eager": lambda module: torch.compile(module, backend="eager"),
                      "aot_eager": lambda module: torch.compile(module, backend="aot_eager")}


@pytest.mark.parametrize("backend", sorted(NO_WORKER_COMPILES))
def test_an_error_raised_under_torch_compile_leaves_grad_mode_on(backend):
    """The op used to run inside a no_grad() block, which dynamo compiles to grad-off / op / grad-on: an error from
    the op skipped the grad-on and left autograd off for the rest of the process."""
    from moe_ref.core.errors import MoERefError

    cfg = preset("tiny-kimi-k2")
    layer = MegaMoE(cfg, num_max_tokens_per_rank=8, seed=4)
    compiled = NO_WORKER_COMPILES[backend](layer)
    x = _x(cfg, T=3)
    calls = {"INP002": lambda: compiled(x.bfloat16()), "INP007": lambda: compiled(x.clone().requires_grad_()),
             "CAP001": lambda: compiled(_x(cfg, T=9)), "INP008": lambda: compiled(x, max_num_tokens=-1)}
    try:
        for code, call in calls.items():
            with pytest.raises(MoERefError) as err:
                call()
            assert err.value.code == code and torch.is_grad_enabled(), (backend, code, str(err.value))
        assert "max_num_tokens=-1" in str(err.value)  # the compiled op names the negative bound it was given
        y = compiled(x)
        assert torch.is_grad_enabled() and not y.requires_grad
        with torch.no_grad():
            assert torch.equal(y, layer(x))
    finally:
        torch.set_grad_enabled(True)  # never leave the rest of the suite without autograd


@pytest.mark.parametrize("missing", ["down_weight", "gate_up_weight", "gate_weight", "shared_down_weight",
                                     "e_score_correction_bias"])
def test_a_partial_state_dict_leaves_the_layer_unloaded(missing):
    cfg = preset("tiny-kimi-k2")
    source = MegaMoE(cfg, num_max_tokens_per_rank=16, seed=4)
    state = source.state_dict()
    fresh = MegaMoE(cfg, num_max_tokens_per_rank=16)
    result = fresh.load_state_dict({k: v for k, v in state.items() if k != missing}, strict=False)
    assert result.missing_keys == [missing]
    with pytest.raises(WeightsNotLoadedError, match=rf"\[INP006\].*{missing}"):
        with torch.no_grad():
            fresh(_x(cfg))
    fresh.load_state_dict({missing: state[missing]}, strict=False)  # the rest of the weights: now it runs
    with torch.no_grad():
        assert torch.equal(fresh(_x(cfg)), source(_x(cfg)))
    source.load_state_dict({"gate_weight": state["gate_weight"]}, strict=False)  # a loaded layer stays loaded
    with torch.no_grad():
        assert torch.equal(fresh(_x(cfg)), source(_x(cfg)))


def test_a_strict_load_that_fails_leaves_the_layer_unloaded():
    cfg = preset("tiny-kimi-k2")
    state = {k: v for k, v in MegaMoE(cfg, seed=4).state_dict().items() if k != "down_weight"}
    fresh = MegaMoE(cfg)
    with pytest.raises(RuntimeError, match="down_weight"):
        fresh.load_state_dict(state)
    with pytest.raises(WeightsNotLoadedError, match="down_weight"), torch.no_grad():
        fresh(_x(cfg))


class _AllocationLimit(TorchDispatchMode):
    """Refuses, before allocating it, any tensor of more than ``limit`` bytes off the meta device; ``largest`` is
    the largest one allocated."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit, self.largest = limit, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                    torch.ops.aten.zeros.default, torch.ops.aten.full.default):
            device = torch.device(kwargs.get("device") or "cpu")
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            nbytes = math.prod(args[0]) * dtype.itemsize
            if device.type != "meta":
                if nbytes > self.limit:
                    raise MemoryError(f"{func}: {nbytes} bytes ({list(args[0])} {dtype}) > the test's limit")
                self.largest = max(self.largest, nbytes)
        return func(*args, **kwargs)


def test_a_kimi_k2_sized_layer_raises_inp006_before_allocating_its_experts():
    """Kimi-K2 at EP 1: gate_up alone is 384 x 4096 x 7168 bf16 = 22.5 GB. A call before any load used to allocate
    every local expert first (a bare allocator error where that fails); now neither construction nor the call
    allocates them, and the call raises INP006. The largest legitimate tensor is the shared gate_up, 59 MB."""
    limit = 256 << 20
    with _AllocationLimit(limit) as allocations:
        layer = MegaMoE("kimi-k2", num_max_tokens_per_rank=1, dtype=torch.bfloat16, alignment=1)
        x = torch.zeros(1, layer.cfg.hidden_size, dtype=torch.bfloat16)
        with pytest.raises(WeightsNotLoadedError, match=r"\[INP006\].*routed experts"), torch.no_grad():
            layer(x)
    assert 0 < allocations.largest <= limit
    assert layer.gate_up_weight is None and layer.down_weight is None and layer.expert_nbytes() == 0
    stand_in = layer.experts  # what the routed step was built with: meta tensors of the experts' shapes
    assert stand_in.gate_up_weight_e2FD.is_meta and stand_in.gate_up_weight_e2FD.shape == (384, 4096, 7168)
    layer.destroy()


def test_the_layer_pickles_after_a_call_and_stays_usable():
    """pickle.dumps used to fail on the routed step's overflow policy (a local function); the copy leaves the
    runtime objects out and builds its own, and pickling does not tear down the live layer."""
    import copy
    import pickle

    cfg = preset("tiny-kimi-k2")
    layer = MegaMoE(cfg, num_max_tokens_per_rank=16, seed=4)
    with torch.no_grad():
        y = layer(_x(cfg))
        step = layer.routed_step
        restored = pickle.loads(pickle.dumps(layer))
        buffer = io.BytesIO()
        torch.save(layer, buffer)
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=False)
        for other in (restored, saved, copy.deepcopy(layer)):
            assert other._routed_step is None and other._op_id != layer._op_id
            assert torch.equal(other(_x(cfg)), y)
            other.destroy()
        assert layer.routed_step is step and torch.equal(layer(_x(cfg)), y)
        assert torch.equal(torch.compile(restored, backend="eager")(_x(cfg)), y)  # its own op id works
    layer.destroy()


def test_a_layer_over_a_process_group_refuses_to_pickle():
    import pickle

    layer = MegaMoE("tiny-kimi-k2", num_max_tokens_per_rank=16, seed=4)
    layer.group = object()  # stands for a ProcessGroup: what the check looks at, without starting one in pytest
    with pytest.raises(LayerNotPicklableError, match=r"\[CFG020\].*state_dict"):
        pickle.dumps(layer)


def test_cuda_and_meta_conversions_are_a_coded_refusal_with_a_fix_that_works():
    cfg = preset("tiny-kimi-k2")
    layer = MegaMoE(cfg, num_max_tokens_per_rank=16, seed=4)
    with pytest.raises(LayerConversionError, match=r"\[CFG016\].*load_state_dict"):
        layer.cuda()  # a torch without CUDA failed the probe with a bare AssertionError
    with pytest.raises(LayerConversionError) as err:
        layer.to("meta")
    assert "device='meta'" not in str(err.value) and "device='cpu'" in str(err.value)
    assert layer.gate_weight.device.type == "cpu"
    MegaMoE(cfg, num_max_tokens_per_rank=16, dtype=torch.float32, device="cpu")  # the message's suggestion builds
