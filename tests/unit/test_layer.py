"""MegaMoE in one process: every family and dtype against the single-process reference, and its input errors."""
import pytest
import torch

from moe_ref.core.config import preset
from moe_ref.core.errors import (ArgumentTypeError, ConfigFileError, ConstructorArgumentTypeError, DTypeError,
                                 GradientNotSupportedError, InvalidConfigError, ShapeError, TensorShapeMismatchError,
                                 UnknownNameError, WeightsNotLoadedError)
from moe_ref.layer import MegaMoE
from moe_ref.reference import reference_moe
from moe_ref.testing import CALC_DIFF_TOLERANCES, assert_close, calc_diff
from moe_ref.core.weights import MoEWeights

pytestmark = pytest.mark.unit
PRESETS = ["tiny-kimi-k2", "tiny-kimi-k3", "tiny-deepseek-v3", "tiny-step3"]


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_layer_matches_reference(name, dtype):
    cfg = preset(name)
    layer = MegaMoE(cfg, num_max_tokens_per_rank=64, dtype=dtype, seed=7)
    x = torch.randn(50, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.inference_mode():
        y = layer(x)
        ref = reference_moe(x, MoEWeights.random(cfg, seed=7, dtype=dtype), cfg)
    layer.destroy()
    assert y.dtype == dtype and y.shape == x.shape
    if dtype == torch.float32:
        assert_close(y, ref, torch.float32, name=name)
    else:
        assert calc_diff(y, ref) <= CALC_DIFF_TOLERANCES[dtype], f"{name=} {dtype=} {calc_diff(y, ref)=}"


def test_chunked_equals_big_cap_bitwise_and_counts_rows(monkeypatch):
    from moe_ref.ep import overflow

    monkeypatch.setattr(overflow, "_ANNOUNCED", set())  # chunking is announced once per process
    cfg = preset("tiny-kimi-k2")
    x = torch.randn(100, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    small = MegaMoE(cfg, num_max_tokens_per_rank=16, overflow="chunk", seed=3)
    big = MegaMoE(cfg, num_max_tokens_per_rank=128, seed=3)
    y_small = small(x)  # (the once-per-process ChunkingWarning is tested in tests/unit/test_overflow.py)
    y_big = big(x)
    assert torch.equal(y_small, y_big)
    assert int(small.num_recv_tokens_per_expert.sum()) == 100 * cfg.num_topk  # no masked slots from the router
    small.destroy(), big.destroy()


@pytest.mark.parametrize("backend", ["torch", "grouped_mm"])
def test_masked_pool_equals_contiguous_pool(backend, monkeypatch):
    from moe_ref.ep import overflow

    monkeypatch.setattr(overflow, "_ANNOUNCED", set())
    cfg = preset("tiny-kimi-k2")
    x = torch.randn(37, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    out = {}
    for pool in ("contiguous", "masked"):  # cap 16 < 37 rows: three chunks, the last one partial
        layer = MegaMoE(cfg, num_max_tokens_per_rank=16, overflow="chunk", experts_backend=backend, seed=5,
                        pool_format=pool, debug_checks=True)
        out[pool] = layer(x)
        assert layer.routed_step.plan.pool_format == pool
        if pool == "masked":  # M = align(R * C, alignment) rows per expert (torch 128, grouped_mm 16) at i * M
            rows = layer.options.alignment
            assert layer.routed_step.plan.num_pool_rows == cfg.num_experts * rows
            row_start = layer.routed_step.dispatcher.buffer.view("row_start")
            assert row_start.tolist() == [i * rows for i in range(cfg.num_experts)]
        layer.destroy()
    if backend == "torch":  # the same per-expert GEMMs on the same rows
        assert torch.equal(out["masked"], out["contiguous"])
    else:
        assert_close(out["masked"], out["contiguous"], torch.float32, name=backend)


def test_pool_format_errors_name_the_choices():
    cfg = preset("tiny-step3")
    with pytest.raises(UnknownNameError, match=r"CFG\d+.*pool_format='strided'.*contiguous, masked"):
        MegaMoE(cfg, num_max_tokens_per_rank=8, seed=0, pool_format="strided")


def test_overflow_error_names_numbers_and_fix():
    cfg = preset("tiny-step3")
    layer = MegaMoE(cfg, num_max_tokens_per_rank=8, overflow="error", seed=0)
    with pytest.raises(RuntimeError, match=r"CAP001.*9.*8.*MOE_REF_NUM_MAX_TOKENS_PER_RANK"):
        layer(torch.randn(9, cfg.hidden_size))
    layer.destroy()


def test_zero_tokens():
    cfg = preset("tiny-deepseek-v3")
    layer = MegaMoE(cfg, num_max_tokens_per_rank=8, seed=0)
    assert layer(torch.empty(0, cfg.hidden_size)).shape == (0, cfg.hidden_size)
    layer.destroy()


def test_input_errors_are_coded():
    cfg = preset("tiny-kimi-k2")
    layer = MegaMoE(cfg, num_max_tokens_per_rank=8, seed=0)
    with pytest.raises(ShapeError, match=r"\(2, 3, 48\).*x.view\(-1, 48\)"):
        layer(torch.randn(2, 3, cfg.hidden_size))
    with pytest.raises(DTypeError, match="bfloat16.*float32"):
        layer(torch.randn(3, cfg.hidden_size, dtype=torch.bfloat16))
    with pytest.raises(DTypeError, match="int8"):
        MegaMoE(cfg, dtype=torch.int8)
    wrong = MoEWeights.random(preset("tiny-step3"), seed=0)
    with pytest.raises(TensorShapeMismatchError, match=r"experts \[0, 16\) are not all held"):
        layer.load_weights(wrong)
    layer.destroy()


def test_built_from_hf_config_dict_and_preset_name():
    from moe_ref.core.config import hf_config_dict

    cfg = preset("tiny-kimi-k3")
    assert MegaMoE(hf_config_dict(cfg)).cfg.latent_dim == cfg.latent_dim
    assert MegaMoE("tiny-kimi-k3").cfg == cfg


def test_inference_mode_and_normal_calls_mix_in_any_order():
    """The buffers used to be built inside the first call: under inference_mode they became inference
    tensors and the next normal call failed ("Inplace update to inference tensor")."""
    cfg = preset("tiny-kimi-k2")
    x = torch.randn(10, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        layer = MegaMoE(cfg, num_max_tokens_per_rank=16, seed=2)  # built inside inference mode too
        first = layer(x)
    expected = reference_moe(x, MoEWeights.random(cfg, seed=2), cfg)
    with torch.no_grad():
        assert torch.equal(layer(x), first)
    with torch.inference_mode():
        assert torch.equal(layer(x), first)
    assert torch.equal(layer(x), first)  # grad mode on: nothing requires grad, so it runs
    assert_close(first, expected, torch.float32)
    layer.destroy()


def test_gradient_requested_is_a_coded_error():
    cfg = preset("tiny-kimi-k2")
    layer = MegaMoE(cfg, num_max_tokens_per_rank=16, seed=2)
    x = torch.randn(4, cfg.hidden_size, requires_grad=True)
    with pytest.raises(GradientNotSupportedError, match=r"\[INP007\].*no backward"):
        layer(x)
    layer.gate_up_weight.requires_grad_(True)
    with pytest.raises(GradientNotSupportedError):
        layer(x.detach())
    with torch.no_grad():
        assert layer(x).shape == x.shape  # no gradient wanted: fine
    layer.destroy()


def test_unloaded_weights_are_a_coded_error_until_loaded():
    cfg = preset("tiny-step3")
    layer = MegaMoE(cfg, num_max_tokens_per_rank=16)
    x = torch.randn(4, cfg.hidden_size)
    with pytest.raises(WeightsNotLoadedError, match=r"\[INP006\].*load_hf_weights"):
        layer(x)
    layer.load_weights(MoEWeights.random(cfg, seed=4))
    assert_close(layer(x), reference_moe(x, MoEWeights.random(cfg, seed=4), cfg), torch.float32)
    layer.destroy()


@pytest.mark.parametrize("bad", [None, 3, ["tiny-kimi-k2"]])
def test_config_of_the_wrong_type_is_a_coded_error(bad):
    with pytest.raises(InvalidConfigError, match=r"\[CFG0"):
        MegaMoE(bad)


@pytest.mark.parametrize("arguments, name", [(dict(group="WORLD"), "group"), (dict(group=0), "group"),
                                             (dict(seed="a"), "seed"), (dict(seed=1.5), "seed"),
                                             (dict(seed=True), "seed"), (dict(device=None), "device")])
def test_constructor_arguments_of_the_wrong_type_are_coded(arguments, name):
    with pytest.raises(ConstructorArgumentTypeError) as err:
        MegaMoE("tiny-kimi-k2", num_max_tokens_per_rank=8, **arguments)
    assert err.value.code == "INP009" and isinstance(err.value, TypeError)
    assert f"{name}={arguments[name]!r}" in str(err.value)


def test_a_cpu_device_index_is_the_cpu():
    """device='cpu:0' was kept as is; every input (on 'cpu') then failed INP003 'move it with .to('cpu:0')'."""
    cfg = preset("tiny-kimi-k2")
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    layer = MegaMoE(cfg, num_max_tokens_per_rank=8, seed=3, device="cpu:0")
    assert layer.options.device == torch.device("cpu")
    assert torch.equal(layer(x), MegaMoE(cfg, num_max_tokens_per_rank=8, seed=3)(x))


def test_triton_experts_off_cuda_are_refused_at_construction_outside_the_interpreter(monkeypatch):
    """They were built, and the first call failed with INP003 naming an internal tensor. The interpreter tier
    (TRITON_INTERPRET=1, on in this suite without a GPU) runs Triton on the CPU and keeps building them."""
    from moe_ref.core.errors import BackendUnavailableError
    from moe_ref.layer import construction

    cfg = preset("tiny-kimi-k2")
    monkeypatch.setattr(construction, "is_interpreter", lambda: False)
    with pytest.raises(BackendUnavailableError, match=r"\[ENV001\] experts_backend='triton'.*'auto'.*'torch'"):
        MegaMoE(cfg, num_max_tokens_per_rank=8, experts_backend="triton", seed=0)
    monkeypatch.setattr(construction, "is_interpreter", lambda: True)
    assert MegaMoE(cfg, num_max_tokens_per_rank=8, experts_backend="triton").experts.name.startswith("triton")


@pytest.mark.parametrize("missing", ["nonexistent/models/kimi-k2", "kimi-k2/config.json", "absolute"])
def test_a_missing_config_path_is_named_as_a_path_not_a_preset(tmp_path, missing):
    path = str(tmp_path / "models" / "kimi-k2") if missing == "absolute" else missing
    with pytest.raises(ConfigFileError) as err:
        MegaMoE(path)
    assert err.value.code == "CFG010" and repr(path) in str(err.value) and "tiny-kimi-k2" in str(err.value)
    assert MegaMoE("tiny-kimi-k2").cfg.name == "tiny-kimi-k2"  # preset names still work


@pytest.mark.parametrize("bound", [-1, -5])
def test_a_negative_max_num_tokens_is_an_argument_error(bound):
    """-1 was taken as a promise ('num_tokens=3 > the max_num_tokens=-1 promised', INP001)."""
    layer = MegaMoE("tiny-kimi-k2", num_max_tokens_per_rank=8, seed=0)
    x = torch.randn(3, layer.cfg.hidden_size)
    with pytest.raises(ArgumentTypeError, match=rf"\[INP008\] max_num_tokens={bound} .*>= 0"):
        layer(x, max_num_tokens=bound)
    assert layer(x, max_num_tokens=3).shape == x.shape
