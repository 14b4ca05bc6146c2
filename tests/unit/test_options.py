"""EPOptions: every option resolved once (argument, then environment, then default) and checked."""
from __future__ import annotations

import pytest
import torch

from moe_ref.core.errors import DeviceUnavailableError, DTypeError, InvalidConfigError, UnknownNameError
from moe_ref.experts import TorchLoopExperts
from moe_ref.ep.options import DEFAULT_NUM_MAX_TOKENS_PER_RANK, MAX_NUM_MAX_TOKENS_PER_RANK, EPOptions

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("MOE_REF_NUM_MAX_TOKENS_PER_RANK", "MOE_REF_OVERFLOW_POLICY", "MOE_REF_TRANSPORT",
                 "MOE_REF_EXPERTS_BACKEND", "MOE_REF_DEBUG_CHECKS"):
        monkeypatch.delenv(name, raising=False)


def test_cap_argument_then_env_then_default(monkeypatch):
    assert EPOptions.resolve().num_max_tokens_per_rank == DEFAULT_NUM_MAX_TOKENS_PER_RANK
    monkeypatch.setenv("MOE_REF_NUM_MAX_TOKENS_PER_RANK", "512")
    assert EPOptions.resolve(num_max_tokens_per_rank=64).num_max_tokens_per_rank == 64
    resolved = EPOptions.resolve()
    assert resolved.num_max_tokens_per_rank == 512
    assert resolved.source["num_max_tokens_per_rank"] == "MOE_REF_NUM_MAX_TOKENS_PER_RANK"


@pytest.mark.parametrize("env, needle", [("0", "=0 (from MOE_REF_NUM_MAX_TOKENS_PER_RANK)"),
                                         ("-5", "=-5 (from MOE_REF_NUM_MAX_TOKENS_PER_RANK)"),
                                         ("lots", "'lots' is not an integer")])
def test_bad_env_cap_is_refused_and_named(monkeypatch, env, needle):
    """A cap of 0 used to become 4096 silently, and -5 from the env was blamed on the argument."""
    monkeypatch.setenv("MOE_REF_NUM_MAX_TOKENS_PER_RANK", env)
    with pytest.raises(InvalidConfigError) as info:
        EPOptions.resolve()
    assert "[CFG007]" in str(info.value) and needle in str(info.value)


@pytest.mark.parametrize("cap", [0, -5, MAX_NUM_MAX_TOKENS_PER_RANK + 1, 10**12, 2.5, True])
def test_bad_argument_cap_is_refused(cap):
    with pytest.raises(InvalidConfigError, match=r"\[CFG007\].*\(from the argument\) must be an integer in \[1, "):
        EPOptions.resolve(num_max_tokens_per_rank=cap)


def test_names_are_checked_and_sources_named(monkeypatch):
    assert EPOptions.resolve().overflow == "error"
    monkeypatch.setenv("MOE_REF_OVERFLOW_POLICY", "chunk")
    assert EPOptions.resolve().overflow == "chunk" and EPOptions.resolve(overflow="error").overflow == "error"
    with pytest.raises(UnknownNameError, match=r"overflow='drop' \(from the argument\); supported: error, chunk"):
        EPOptions.resolve(overflow="drop")
    monkeypatch.setenv("MOE_REF_OVERFLOW_POLICY", "drop")
    with pytest.raises(UnknownNameError, match=r"overflow='drop' \(from MOE_REF_OVERFLOW_POLICY\)"):
        EPOptions.resolve()
    monkeypatch.setenv("MOE_REF_TRANSPORT", "teleport")
    with pytest.raises(UnknownNameError, match=r"transport='teleport' \(from MOE_REF_TRANSPORT\); supported: auto"):
        EPOptions.resolve(overflow="error")
    monkeypatch.setenv("MOE_REF_TRANSPORT", "a2a")
    assert EPOptions.resolve(overflow="error", transport="auto").transport == "a2a"  # the operator's env decides auto
    assert EPOptions.resolve(overflow="error", transport="local").transport == "local"
    with pytest.raises(UnknownNameError, match="mega='on'"):
        EPOptions.resolve(overflow="error", mega="on")
    with pytest.raises(UnknownNameError, match="experts_backend='cutlass'"):
        EPOptions.resolve(overflow="error", experts_backend="cutlass")


def test_backend_and_alignment_follow_the_device_and_backend():
    cpu = EPOptions.resolve()
    assert cpu.experts_backend == "torch" and cpu.alignment == 128
    assert EPOptions.resolve(experts_backend="grouped_mm").alignment == 16
    assert EPOptions.resolve(experts_backend="triton").alignment == 1
    assert EPOptions.resolve(experts_backend="triton", alignment=8).alignment == 8
    with pytest.raises(InvalidConfigError, match="alignment=0"):
        EPOptions.resolve(alignment=0)
    with pytest.raises(DTypeError, match="dtype=torch.int8"):
        EPOptions.resolve(dtype=torch.int8)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a machine without CUDA gives")
def test_cuda_device_without_cuda_is_a_coded_error():
    with pytest.raises(DeviceUnavailableError, match=r"\[ENV006\] device='cuda' but torch sees 0 CUDA device"):
        EPOptions.resolve(device="cuda")


def test_fingerprint_holds_what_must_match():
    a, b = EPOptions.resolve(), EPOptions.resolve(overflow="chunk")
    assert a.fingerprint() != b.fingerprint() and a.fingerprint() == EPOptions.resolve().fingerprint()
    assert set(a.fingerprint()) >= {"num_max_tokens_per_rank", "overflow", "transport", "experts_backend",
                                    "dispatch_fp8", "alignment", "mega", "dtype"}


def test_debug_checks_from_env(monkeypatch):
    assert not EPOptions.resolve().debug_checks
    monkeypatch.setenv("MOE_REF_DEBUG_CHECKS", "1")
    assert EPOptions.resolve().debug_checks and not EPOptions.resolve(debug_checks=False).debug_checks



class NarrowExperts(TorchLoopExperts):
    """A backend that declares it runs contiguous pools only (what a registered custom backend may do)."""

    name = "narrow"
    pool_formats = ("contiguous",)


def test_pool_format_from_env_and_a_backend_that_refuses_it(monkeypatch):
    from moe_ref.experts import register_experts, registry
    from moe_ref.core.config import preset
    from moe_ref.ep.routed_step import make_modular_step
    from moe_ref.core.weights import MoEWeights

    monkeypatch.setenv("MOE_REF_POOL_FORMAT", "masked")
    options = EPOptions.resolve()
    assert options.pool_format == "masked" and options.source["pool_format"] == "MOE_REF_POOL_FORMAT"
    assert options.fingerprint()["pool_format"] == "masked"

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # the registration ends with the test
    register_experts("narrow", NarrowExperts)  # the public extension point, as a user's backend calls it
    with pytest.raises(InvalidConfigError, match="pool_format='masked' .from MOE_REF_POOL_FORMAT.: the narrow "
                                                 "experts run contiguous pools only"):
        EPOptions.resolve(experts_backend="narrow")
    assert EPOptions.resolve(experts_backend="narrow", pool_format="contiguous").pool_format == "contiguous"
    # an instance handed to the modular step directly is checked where it meets the plan
    cfg = preset("tiny-step3")
    weights = MoEWeights.random(cfg, seed=0)
    narrow = NarrowExperts(weights.gate_up_weight_E2FD, weights.down_weight_EDF)
    with pytest.raises(InvalidConfigError, match="the narrow experts run contiguous pools only"):
        make_modular_step(cfg, None, narrow, EPOptions.resolve(num_max_tokens_per_rank=4, pool_format="masked",
                                                               experts_backend="torch"))
