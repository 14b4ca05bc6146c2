"""DeepGEMM detection and refusals, on any machine (CPU included): the probe never raises and always says why,
the experts backend refuses with ENV001 carrying that reason, the mega path refuses shapes with ENV002."""
import importlib
import importlib.util
import inspect
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from moe_ref import deep_gemm_backend
from moe_ref.config import preset
from moe_ref.deep_gemm_backend import (DeepGemmExperts, DeepGemmStatus, deep_gemm_grouped_cases, deep_gemm_status,
                                       grouped_layout_from_expert_layout)
from moe_ref.errors import BackendUnavailableError, ShapeUnsupportedError
from moe_ref.experts import Experts, ExpertLayout, make_experts
from moe_ref.mega_deep_gemm import DeepGemmMegaMoE, supports

pytestmark = pytest.mark.unit

_API = ("m_grouped_bf16_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_contiguous", "m_grouped_bf16_gemm_nt_masked",
        "m_grouped_fp8_gemm_nt_masked", "get_mk_alignment_for_contiguous_layout")


@pytest.fixture(autouse=True)
def fresh_probe():
    """Every test probes afresh and leaves no fake ``deep_gemm`` module behind."""
    real = sys.modules.get("deep_gemm")
    deep_gemm_backend._probe.cache_clear()
    yield
    deep_gemm_backend._probe.cache_clear()
    if sys.modules.get("deep_gemm") is not real:
        sys.modules.pop("deep_gemm", None)
        if real is not None:
            sys.modules["deep_gemm"] = real


def _fake_deep_gemm(tmp_path: Path, monkeypatch, body: str) -> None:
    """Put a package named ``deep_gemm`` whose ``__init__`` is ``body`` first on sys.path."""
    package = tmp_path / "fake_site" / "deep_gemm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(body))
    sys.modules.pop("deep_gemm", None)
    monkeypatch.syspath_prepend(str(package.parent))
    importlib.invalidate_caches()


def _pretend_gpu(monkeypatch, capability=(9, 0)) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "FakeGPU")


def _force_not_installed(monkeypatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "deep_gemm" else real_find_spec(name, *args))


def _weights(num_experts=2, hidden=128, intermediate=128):
    return (torch.randn(num_experts, 2 * intermediate, hidden), torch.randn(num_experts, hidden, intermediate))


# --- the probe ------------------------------------------------------------------------------------------

def test_status_here_never_raises_and_explains():
    status = deep_gemm_status(refresh=True)
    assert isinstance(status, DeepGemmStatus)
    assert status.reason
    if not status.available:
        assert status.mega_moe is False
    else:  # a GPU machine with the wheels installed
        assert status.version


def test_not_installed_names_the_wheels(monkeypatch):
    _force_not_installed(monkeypatch)
    status = deep_gemm_status(refresh=True)
    assert not status.available
    assert "not installed" in status.reason and "0.1.4" in status.reason and "0.1.11" in status.reason


def test_no_cuda_reported_without_importing_deep_gemm(tmp_path, monkeypatch):
    _fake_deep_gemm(tmp_path, monkeypatch, "raise RuntimeError('must not be imported without CUDA')")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    status = deep_gemm_status(refresh=True)
    assert not status.available
    assert "no CUDA device" in status.reason, status.reason
    assert "deep_gemm" not in sys.modules


def test_non_sm90_gpu_is_refused(tmp_path, monkeypatch):
    _fake_deep_gemm(tmp_path, monkeypatch, "raise RuntimeError('must not be imported on SM80')")
    _pretend_gpu(monkeypatch, capability=(8, 0))
    status = deep_gemm_status(refresh=True)
    assert not status.available and "SM80" in status.reason, status.reason


def test_import_failure_reason_carries_the_error(tmp_path, monkeypatch):
    _fake_deep_gemm(tmp_path, monkeypatch, "raise ImportError('undefined symbol: _ZN3c10fakeE')")
    _pretend_gpu(monkeypatch)
    status = deep_gemm_status(refresh=True)
    assert not status.available
    assert "import deep_gemm failed" in status.reason and "undefined symbol" in status.reason, status.reason


def test_missing_api_is_named(tmp_path, monkeypatch):
    _fake_deep_gemm(tmp_path, monkeypatch, "__version__ = '9.9.9'\n")
    _pretend_gpu(monkeypatch)
    status = deep_gemm_status(refresh=True)
    assert not status.available and status.version == "9.9.9"
    assert "lacks" in status.reason and "m_grouped_bf16_gemm_nt_contiguous" in status.reason, status.reason


def test_failing_tiny_call_is_caught(tmp_path, monkeypatch):
    functions = "".join(f"def {name}(*args, **kwargs):\n    raise RuntimeError('tensor does not have a device')\n"
                        for name in _API)
    _fake_deep_gemm(tmp_path, monkeypatch, "__version__ = '0.1.5.post3'\n" + functions)
    _pretend_gpu(monkeypatch)
    status = deep_gemm_status(refresh=True)
    assert not status.available and status.version == "0.1.5.post3"
    assert "grouped GEMM failed" in status.reason, status.reason


def test_unexpected_probe_error_is_reported_not_raised(monkeypatch):
    def boom():
        raise RuntimeError("metadata exploded")
    monkeypatch.setattr(deep_gemm_backend, "_installed_version", boom)
    status = deep_gemm_status(refresh=True)
    assert not status.available and "metadata exploded" in status.reason


def test_status_is_cached_until_refresh(monkeypatch):
    _force_not_installed(monkeypatch)
    first = deep_gemm_status(refresh=True)
    assert deep_gemm_status() is first
    assert deep_gemm_status(refresh=True) is not first


# --- the experts backend --------------------------------------------------------------------------------

def test_experts_refuse_with_env001_and_the_status_reason(monkeypatch):
    _force_not_installed(monkeypatch)
    reason = deep_gemm_status(refresh=True).reason
    gate_up, down = _weights()
    with pytest.raises(BackendUnavailableError) as info:
        DeepGemmExperts(gate_up, down, fp8=True)
    assert info.value.code == "ENV001" and reason in str(info.value)
    with pytest.raises(BackendUnavailableError, match="not installed"):
        make_experts("deep_gemm", gate_up, down)


def test_experts_signature_extends_the_base_with_keyword_fp8():
    base = list(inspect.signature(Experts.__init__).parameters.values())
    ours = list(inspect.signature(DeepGemmExperts.__init__).parameters.values())
    assert [(p.name, p.default, p.kind) for p in ours[:len(base)]] == [(p.name, p.default, p.kind) for p in base]
    extra = ours[len(base):]
    assert [(p.name, p.default, p.kind) for p in extra] == [("fp8", False, inspect.Parameter.KEYWORD_ONLY)]


def test_bench_hook_returns_nothing_when_unusable(monkeypatch):
    _force_not_installed(monkeypatch)
    assert deep_gemm_grouped_cases(4, 512, 256, 128) == []


def test_grouped_layout_marks_padding_and_skips_empty_experts():
    layout = ExpertLayout(torch.tensor([0, 128, 128]), torch.tensor([3, 0, 5]), 256, 128)
    grouped_R, valid_R = grouped_layout_from_expert_layout(layout, 256, torch.device("cpu"))
    expected = torch.full((256,), -1, dtype=torch.int32)
    expected[0:3] = 0
    expected[128:133] = 2
    assert grouped_R.dtype == torch.int32 and torch.equal(grouped_R, expected)
    assert torch.equal(valid_R, expected >= 0)


def test_grouped_layout_matches_row_expert_for_packed_layouts():
    for counts in ([0, 0, 0], [5, 0, 0], [0, 0, 7], [130, 0, 128, 1], [1, 2, 3, 4]):
        layout = ExpertLayout.from_counts(torch.tensor(counts), 128)
        grouped_R, _ = grouped_layout_from_expert_layout(layout, layout.num_pool_rows + 128, torch.device("cpu"))
        expected = torch.cat([layout.row_expert_R(), torch.full((128,), -1, dtype=torch.int64)])
        assert torch.equal(grouped_R.long(), expected), counts


# --- the mega path ----------------------------------------------------------------------------------------

def test_mega_refuses_step3_intermediate_5120():
    ok, reason = supports(preset("step3"), 8)
    assert not ok and "intermediate_size=5120" in reason and "4096" in reason


def test_mega_refuses_kimi_k3_situ():
    ok, reason = supports(preset("kimi-k3"), 8)
    assert not ok and "situ" in reason and "SwiGLU" in reason


@pytest.mark.parametrize("name, ep_size", [("kimi-k2", 2), ("kimi-k2", 8), ("deepseek-v3", 2)])
def test_mega_accepts_swiglu_models(name, ep_size):
    ok, reason = supports(preset(name), ep_size)
    assert ok and reason.startswith("ok"), reason


@pytest.mark.parametrize("name, ep_size, words", [("kimi-k2", 1, "ep_size=1"), ("kimi-k2", 5, "% ep_size=5"),
                                                  ("tiny-kimi-k2", 2, "multiples of 128")])
def test_mega_refuses_topologies_and_small_shapes(name, ep_size, words):
    ok, reason = supports(preset(name), ep_size)
    assert not ok and words in reason, reason


def test_mega_runtime_check_adds_the_status_reason(monkeypatch):
    _force_not_installed(monkeypatch)
    ok, reason = supports(preset("kimi-k2"), 2, check_runtime=True)
    assert not ok and "not installed" in reason


@pytest.mark.parametrize("name, words", [("step3", "5120"), ("kimi-k3", "situ")])
def test_mega_construction_raises_env002_before_touching_anything(name, words):
    cfg = preset(name)
    gate_up, down = _weights(1, 128, 128)  # wrong shapes on purpose: the shape refusal comes first
    with pytest.raises(ShapeUnsupportedError) as info:
        DeepGemmMegaMoE(cfg, None, 4096, "error", gate_up, down)
    assert info.value.code == "ENV002" and words in str(info.value)


# --- docstrings (tests/unit/test_docstrings.py skips these modules; same check here) ----------------------

def test_documented_args_exist_in_deep_gemm_modules():
    spec = importlib.util.spec_from_file_location("_docstring_check", Path(__file__).with_name("test_docstrings.py"))
    checker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checker)
    stale = []
    for module in (deep_gemm_backend, importlib.import_module("moe_ref.mega_deep_gemm")):
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            targets = [(name, obj)]
            if inspect.isclass(obj):
                targets = [(name, obj.__init__)] + [(f"{name}.{m}", f) for m, f in vars(obj).items()
                                                    if inspect.isfunction(f) and not m.startswith("_")]
                doc_of = {name: inspect.getdoc(obj)}
            else:
                doc_of = {}
            for qualname, target in targets:
                if not callable(target):
                    continue
                doc = doc_of.get(qualname) or inspect.getdoc(target) or ""
                params = set(inspect.signature(target).parameters)
                stale += [f"{qualname}: {arg}" for arg in checker._documented_args("\n" + doc) if arg not in params]
    assert not stale, stale
