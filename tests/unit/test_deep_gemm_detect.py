"""DeepGEMM detection and refusals, on any machine (CPU included): the probe never raises and always says why,
the experts backend refuses with ENV001 carrying that reason, the mega path refuses shapes with ENV002."""
import importlib
import importlib.util
import inspect
import sys
import textwrap
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moe_ref.experts.deep_gemm import backend as deep_gemm_backend
from moe_ref.experts.deep_gemm import probe as deep_gemm_probe
from moe_ref.ep import overflow
from moe_ref.ep.capacity import CapacityPlan
from moe_ref.core.config import MoEConfig, preset
from moe_ref.experts.deep_gemm.backend import DeepGemmExperts, grouped_layout
from moe_ref.experts.deep_gemm.bench import deep_gemm_grouped_cases
from moe_ref.experts.deep_gemm.probe import DeepGemmStatus, deep_gemm_status
from moe_ref.core.errors import (BackendUnavailableError, CapacityExceededError, ExpertIdError, ShapeError,
                                 ShapeUnsupportedError)
from moe_ref.core.activations import dense_mlp
from moe_ref.experts import Experts, ExpertLayout, TorchLoopExperts, make_experts
from moe_ref.ep.mega_deep_gemm import DeepGemmMegaMoE, supports
from moe_ref.ep.overflow import OverflowPolicy
from moe_ref.ep.routed_step import MonolithicRoutedStep
from moe_ref.testing import calc_diff

pytestmark = pytest.mark.unit

_API = ("m_grouped_bf16_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_contiguous", "m_grouped_bf16_gemm_nt_masked",
        "m_grouped_fp8_fp4_gemm_nt_masked", "get_mk_alignment_for_contiguous_layout")


@pytest.fixture(autouse=True)
def fresh_probe():
    """Every test probes afresh and leaves no fake ``deep_gemm`` module behind."""
    real = sys.modules.get("deep_gemm")
    deep_gemm_probe._probe.cache_clear()
    yield
    deep_gemm_probe._probe.cache_clear()
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
    monkeypatch.setattr(deep_gemm_probe, "_installed_version", boom)
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


def test_experts_signature_extends_the_base_with_keyword_fp8_and_fp8_weights():
    """The base's positional parameters, then fp8 and fp8_weights by keyword. The base's keyword-only family math
    (gpt-oss's clamped SwiGLU and expert biases) is not taken: make_experts refuses that math for DeepGEMM (ENV020)
    before building it."""
    def described(fn, keyword_only):
        return [(p.name, p.default, p.kind) for p in inspect.signature(fn).parameters.values()
                if (p.kind == inspect.Parameter.KEYWORD_ONLY) == keyword_only]

    assert described(DeepGemmExperts.__init__, False) == described(Experts.__init__, False)
    assert described(DeepGemmExperts.__init__, True) == [("fp8", False, inspect.Parameter.KEYWORD_ONLY),
                                                         ("fp8_weights", None, inspect.Parameter.KEYWORD_ONLY)]


def test_bench_hook_returns_nothing_when_unusable(monkeypatch):
    _force_not_installed(monkeypatch)
    gate_up, down = _weights(2, 128, 128)
    x_PDx = torch.randn(256, 128)
    assert deep_gemm_grouped_cases(x_PDx, gate_up, down, torch.tensor([0, 128]), torch.tensor([3, 5])) == []


def test_grouped_layout_marks_padding_and_skips_empty_experts():
    layout = ExpertLayout(torch.tensor([0, 128, 128]), torch.tensor([3, 0, 5]), 256, 128)
    grouped_P = grouped_layout(layout, 384, torch.device("cpu"))  # a pool padded past the layout: -1 there too
    expected = torch.full((384,), -1, dtype=torch.int32)
    expected[0:3] = 0
    expected[128:133] = 2
    assert grouped_P.dtype == torch.int32 and torch.equal(grouped_P, expected)


# --- DeepGemmExperts' wiring, against a torch fake of DeepGEMM's grouped GEMMs (CPU) ----------------------
# The fake implements the documented semantics (per-row group ids with -1 padding; masked rows) and fills
# every row it does not own with NaN, so unmasked padding would show. The real kernels run in tests/gpu.

FP8 = torch.float8_e4m3fn


def _cast_rows(x):  # fp8 per row per 128 columns, scale amax/448 (DeepGEMM's SM90 activation recipe)
    m, k = x.shape
    groups = x.float().view(m, k // 128, 128)
    scale = groups.abs().amax(-1).clamp(min=1e-4) / 448
    return (groups / scale[..., None]).to(FP8).view(m, k), scale


def _cast_blocks(w):  # fp8 128x128 blocks
    n, k = w.shape
    blocks = w.float().view(n // 128, 128, k // 128, 128)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-4) / 448
    return (blocks / scale[:, None, :, None]).to(FP8).view(n, k), scale


def _rows_value(a):
    if isinstance(a, tuple):
        q, scale = a
        return (q.float().view(*q.shape[:-1], -1, 128) * scale[..., None]).view(q.shape)
    assert a.dtype == torch.bfloat16
    return a.float()


def _weight_value(b, g):
    if isinstance(b, tuple):
        q, scale = b[0][g], b[1][g]
        n, k = q.shape
        return (q.float().view(n // 128, 128, k // 128, 128) * scale[:, None, :, None]).view(n, k)
    assert b.dtype == torch.bfloat16 and b.is_contiguous()
    return b[g].float()


def _fake_deep_gemm_module() -> types.ModuleType:
    calls = []

    def contiguous(a, b, d, grouped_layout, use_psum_layout=False, **kwargs):
        rows = (a[0] if isinstance(a, tuple) else a)
        assert rows.is_contiguous() and rows.shape[0] % 128 == 0 and d.dtype == torch.bfloat16
        assert kwargs.get("disable_ue8m0_cast", True) is True
        calls.append(("contiguous", tuple(rows.shape), dict(kwargs, use_psum_layout=use_psum_layout)))
        d.fill_(float("nan"))  # rows no group covers stay unwritten
        value = _rows_value(a)
        if use_psum_layout:  # [G] segment ends; group g starts at the 128-aligned end of group g - 1
            if module.refuse_psum:
                raise RuntimeError("Assertion error: not use_psum_layout")
            assert grouped_layout.dtype == torch.int32 and grouped_layout.shape == (module.weights_of(b).shape[0],)
            start = 0
            for g, end in enumerate(grouped_layout.tolist()):
                d[start:end] = (value[start:end] @ _weight_value(b, g).t()).bfloat16()
                start = -(-end // 128) * 128
            return
        assert grouped_layout.dtype == torch.int32 and grouped_layout.shape == (rows.shape[0],)
        for g in torch.unique(grouped_layout[grouped_layout >= 0]).tolist():
            mask = grouped_layout == g
            d[mask] = (value[mask] @ _weight_value(b, g).t()).bfloat16()

    def masked(a, b, d, masked_m, expected_m, **kwargs):
        rows = (a[0] if isinstance(a, tuple) else a)
        assert rows.dim() == 3 and rows.is_contiguous() and masked_m.dtype == torch.int32 and expected_m > 0
        calls.append(("masked", tuple(rows.shape), kwargs))
        d.fill_(float("nan"))
        value = _rows_value(a)
        for g, m in enumerate(masked_m.tolist()):
            d[g, :m] = (value[g, :m] @ _weight_value(b, g).t()).bfloat16()

    module = types.ModuleType("deep_gemm")
    module.__version__ = "0.1.4-fake"
    module.calls = calls
    module.refuse_psum = False  # True: the psum form raises, as a build whose kernels refuse it
    module.weights_of = lambda b: b[0] if isinstance(b, tuple) else b
    module.m_grouped_bf16_gemm_nt_contiguous = module.m_grouped_fp8_gemm_nt_contiguous = contiguous
    module.m_grouped_bf16_gemm_nt_masked = module.m_grouped_fp8_fp4_gemm_nt_masked = masked
    module.get_mk_alignment_for_contiguous_layout = lambda: 128
    utils = types.ModuleType("deep_gemm.utils")
    utils.per_token_cast_to_fp8 = lambda x, use_ue8m0, gran_k=128, use_packed_ue8m0=False: _cast_rows(x)
    utils.per_block_cast_to_fp8 = lambda x, use_ue8m0, gran_k=128: _cast_blocks(x)
    module.utils = utils
    return module


@pytest.fixture
def fake_deep_gemm(monkeypatch):
    module = _fake_deep_gemm_module()
    monkeypatch.setitem(sys.modules, "deep_gemm", module)
    monkeypatch.setitem(sys.modules, "deep_gemm.utils", module.utils)
    monkeypatch.setattr(deep_gemm_probe, "_probe", lambda: DeepGemmStatus(True, "0.1.4-fake", "fake", False))
    monkeypatch.setattr(deep_gemm_backend, "_require_cuda", lambda name, tensor: None)
    return module


def _small_weights(num_experts=3, hidden=256, intermediate=128, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return ((torch.randn(num_experts, 2 * intermediate, hidden, generator=gen) * hidden ** -0.5).bfloat16(),
            (torch.randn(num_experts, hidden, intermediate, generator=gen) * intermediate ** -0.5).bfloat16())


@pytest.mark.parametrize("fp8, limit", [(False, 1e-4), (True, 1e-2)], ids=["bf16", "fp8"])
@pytest.mark.parametrize("counts, num_pool_rows", [([3, 0, 130], None), ([0, 0, 5], 300), ([0, 0, 0], 128)])
def test_experts_wiring_matches_torch_loop(fake_deep_gemm, fp8, limit, counts, num_pool_rows):
    weights = _small_weights()
    layout = ExpertLayout.from_counts(torch.tensor(counts), 128, num_pool_rows)
    x_PDx = torch.randn(layout.num_pool_rows, 256).bfloat16()
    y_PDx = DeepGemmExperts(*weights, fp8=fp8)(x_PDx, layout)
    reference = TorchLoopExperts(*weights).forward(x_PDx, layout)
    assert y_PDx.shape == x_PDx.shape and y_PDx.dtype == torch.bfloat16 and bool(torch.isfinite(y_PDx).all())
    assert bool((y_PDx[layout.row_expert_P() < 0] == 0).all())
    assert calc_diff(y_PDx, reference) < limit, calc_diff(y_PDx, reference)
    shapes = {call[1] for call in fake_deep_gemm.calls}
    assert shapes == {(-(-layout.num_pool_rows // 128) * 128, 256), (-(-layout.num_pool_rows // 128) * 128, 128)}
    assert all(call[2]["use_psum_layout"] for call in fake_deep_gemm.calls)  # from_counts packs its segments


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("form", ["psum", "rows", "psum refused"])
def test_a_pool_past_its_last_segment_in_each_contiguous_form(fake_deep_gemm, fp8, form):
    """A packed pool sized for a cap (as the dispatcher's): segment ends (psum: the GEMMs stop at the last segment),
    the expert of each row (an unpacked layout), or psum refused by the build (the row form from then on, the reason
    kept); the same rows each way, every row outside a segment zero."""
    import dataclasses

    fake_deep_gemm.refuse_psum = form == "psum refused"
    weights = _small_weights()
    layout = ExpertLayout.from_counts(torch.tensor([3, 0, 130]), 128, num_pool_rows=128 * 9)
    layout = layout if form != "rows" else dataclasses.replace(layout, packed=False)
    x_PDx = torch.randn(layout.num_pool_rows, 256).bfloat16()
    experts = DeepGemmExperts(*weights, fp8=fp8)
    y_PDx = experts(x_PDx, layout)
    reference = TorchLoopExperts(*weights).forward(x_PDx, layout)
    assert bool((y_PDx[layout.row_expert_P() < 0] == 0).all()) and bool(torch.isfinite(y_PDx).all())
    assert calc_diff(y_PDx, reference) < (1e-2 if fp8 else 1e-4)
    forms = [call[2]["use_psum_layout"] for call in fake_deep_gemm.calls if call[0] == "contiguous"]
    assert forms == {"psum": [True, True], "rows": [False, False], "psum refused": [True, False, False]}[form]
    assert (experts.psum_refused is not None) == (form == "psum refused")


@pytest.mark.parametrize("fp8, limit", [(False, 1e-4), (True, 1e-2)], ids=["bf16", "fp8"])
def test_experts_masked_wiring_matches_dense_mlp(fake_deep_gemm, fp8, limit):
    gate_up, down = _small_weights()
    masked_m = torch.tensor([0, 7, 64], dtype=torch.int64)  # int64 is converted
    x_eMD = torch.randn(3, 64, 256).bfloat16()
    y_eMD = DeepGemmExperts(gate_up, down, fp8=fp8).forward_masked(x_eMD, masked_m, 16)
    assert y_eMD.shape == x_eMD.shape and bool(torch.isfinite(y_eMD).all())
    outs, refs = [], []
    for i, rows in enumerate(masked_m.tolist()):
        assert bool((y_eMD[i, rows:] == 0).all())
        outs.append(y_eMD[i, :rows])
        refs.append(dense_mlp(x_eMD[i, :rows], gate_up[i], down[i]))
    assert calc_diff(torch.cat(outs), torch.cat(refs)) < limit


def test_experts_refuse_bad_layouts_and_shapes(fake_deep_gemm):
    experts = DeepGemmExperts(*_small_weights())
    with pytest.raises(ShapeError, match="alignment"):
        experts(torch.zeros(128, 256).bfloat16(), ExpertLayout.from_counts(torch.tensor([3, 0, 5]), 64))
    with pytest.raises(ShapeError, match="D=256"):
        experts(torch.zeros(128, 255).bfloat16(), ExpertLayout.from_counts(torch.tensor([3, 0, 5]), 128))
    with pytest.raises(ShapeError, match="expected_m"):
        experts.forward_masked(torch.zeros(3, 8, 256), torch.zeros(3, dtype=torch.int32), 0)
    gate_up, down = _small_weights(hidden=200)
    with pytest.raises(deep_gemm_backend.FP8AlignmentError):
        DeepGemmExperts(gate_up, down, fp8=True)


def test_bench_hook_paths_run_the_experts(fake_deep_gemm):
    weights = _small_weights()
    layout = ExpertLayout.from_counts(torch.tensor([3, 0, 130]), 128)
    x_PDx = torch.randn(layout.num_pool_rows, 256).bfloat16()
    cases = deep_gemm_grouped_cases(x_PDx, *weights, layout.row_start_e, layout.num_rows_e)
    assert [name for name, _ in cases] == ["deep_gemm_bf16", "deep_gemm_fp8"]
    reference = TorchLoopExperts(*weights).forward(x_PDx, layout)
    for name, fn in cases:
        assert calc_diff(fn(), reference) < (1e-2 if name.endswith("fp8") else 1e-4), name


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
        DeepGemmMegaMoE(cfg, None, 4096, gate_up, down)
    assert info.value.code == "ENV002" and words in str(info.value)


# --- the mega path's overflow policy around the kernel (CPU, kernel stubbed) ------------------------------

class _FakeMegaKernel:
    """Stands in for ``deep_gemm.fp8_mega_moe``: records each launch and returns the dequantized x rows."""

    def __init__(self):
        self.launches = []

    def fp8_mega_moe(self, y, l1_weights, l2_weights, buffer, **kwargs):
        rows = y.shape[0]
        self.launches.append(dict(rows=rows, topk_idx=buffer.topk_idx[:rows].clone(), kwargs=kwargs))
        y.copy_((buffer.x[:rows].float() * buffer.x_sf[:rows].repeat_interleave(128, dim=1)).bfloat16())


def _stub_mega(cap: int, overflow: str) -> MonolithicRoutedStep:
    """The monolithic routed step over a DeepGemmMegaMoE whose buffer is plain CPU tensors (cap aligned up to
    64 as DeepGEMM does) and whose kernel is ``_FakeMegaKernel``: exercises the policy, chunking, pre-dispatch
    and dummy launches around ``launch``."""
    cfg = MoEConfig(num_experts=4, num_topk=2, hidden_size=256, intermediate_size=128, name="stub")
    mega = DeepGemmMegaMoE.__new__(DeepGemmMegaMoE)
    rows = -(-cap // 64) * 64
    mega.cfg, mega.group, mega.ep_size, mega.rank = cfg, None, 2, 0
    mega.num_max_tokens_per_rank = cap
    mega.activation_clamp, mega.fast_math = None, True
    mega.num_local_experts, mega.hidden_size, mega.intermediate_size = 2, 256, 128
    mega.device = torch.device("cpu")
    mega._deep_gemm, mega._l1_weights, mega._l2_weights = _FakeMegaKernel(), None, None
    mega.buffer = SimpleNamespace(x=torch.zeros(rows, 256, dtype=torch.float8_e4m3fn), x_sf=torch.zeros(rows, 2),
                                  topk_idx=torch.full((rows, 2), 7, dtype=torch.int64),  # stale garbage
                                  topk_weights=torch.zeros(rows, 2), destroy=lambda: None)
    mega.num_rows_per_expert_E = torch.zeros(4, dtype=torch.int32)
    mega.num_recv_tokens_per_expert_e = torch.zeros(2, dtype=torch.int32)
    policy = OverflowPolicy(cap, overflow, lambda c: CapacityPlan.build(cfg, 2, c, torch.bfloat16, True).total_bytes)
    return MonolithicRoutedStep(cfg, None, policy, torch.bfloat16, torch.device("cpu"), mega)


def _peer_reports(monkeypatch, num_tokens: int, problem: tuple[str, str] | None = None) -> None:
    """Pretend a second rank reported ``num_tokens`` rows (and ``problem``) in the per-call collective."""
    def gather_ints(values, group, device, device_values=None, what=None):  # this rank's device checks all passed
        no_flags = [0] * len(device_values)
        stamp = list(values[:overflow.STAMP_LENGTH])  # the same layer at the same call: the peer is in step
        bound = values[overflow.STAMP_LENGTH + 1]
        return [list(values) + no_flags, [*stamp, num_tokens, bound, int(bool(problem)), *no_flags]]

    monkeypatch.setattr(overflow, "gather_ints", gather_ints)
    monkeypatch.setattr(overflow, "gather_objects", lambda obj, group: [obj, problem])


def _tokens(num_tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(num_tokens)]) if num_tokens \
        else torch.empty(0, 2, dtype=torch.int64)
    return torch.randn(num_tokens, 256, generator=gen).bfloat16(), ids, torch.rand(num_tokens, 2, generator=gen)


def test_mega_within_cap_is_one_launch_with_the_routing_in_the_buffer():
    mega = _stub_mega(8, "error")
    x, ids, weights = _tokens(5)
    y = mega(x, ids, weights)
    (launch,) = mega.engine._deep_gemm.launches
    assert launch["rows"] == 5 and torch.equal(launch["topk_idx"], ids)
    assert launch["kwargs"]["recipe"] == (128, 128, 128) and launch["kwargs"]["activation"] == "swiglu"
    assert launch["kwargs"]["cumulative_local_expert_recv_stats"] is mega.engine.num_recv_tokens_per_expert_e
    assert y.shape == (5, 256) and y.dtype == torch.bfloat16 and calc_diff(y, x) < 1e-3


def test_mega_error_policy_raises_cap001_before_any_launch():
    mega = _stub_mega(8, "error")
    with pytest.raises(CapacityExceededError) as info:
        mega(*_tokens(9))
    assert info.value.code == "CAP001" and "num_tokens=9" in str(info.value) and "=8" in str(info.value)
    assert mega.engine._deep_gemm.launches == []


@pytest.mark.filterwarnings("ignore::moe_ref.ep.overflow.ChunkingWarning")
def test_mega_chunk_policy_launches_every_chunk_and_concatenates():
    mega = _stub_mega(8, "chunk")
    x, ids, weights = _tokens(17)
    y = mega(x, ids, weights)
    assert [launch["rows"] for launch in mega.engine._deep_gemm.launches] == [8, 8, 1]
    assert torch.equal(mega.engine._deep_gemm.launches[2]["topk_idx"], ids[16:])
    assert y.shape == (17, 256) and calc_diff(y, x) < 1e-3


@pytest.mark.filterwarnings("ignore::moe_ref.ep.overflow.ChunkingWarning")
def test_mega_rank_with_fewer_rows_still_launches_every_chunk_with_masked_dummies(monkeypatch):
    _peer_reports(monkeypatch, 17)  # a peer has 17 rows
    mega = _stub_mega(8, "chunk")
    x, ids, weights = _tokens(3)
    y = mega(x, ids, weights)
    launches = mega.engine._deep_gemm.launches
    assert [launch["rows"] for launch in launches] == [3, 1, 1]
    for dummy in launches[1:]:  # 0 rows here: a 1-row launch whose only row routes nowhere
        assert bool((dummy["topk_idx"] == -1).all()), dummy["topk_idx"]
    assert y.shape == (3, 256)


def test_mega_error_policy_raises_on_the_small_rank_too(monkeypatch):
    _peer_reports(monkeypatch, 9)
    mega = _stub_mega(8, "error")
    with pytest.raises(CapacityExceededError, match="max over the EP group is 9"):
        mega(*_tokens(2))
    assert mega.engine._deep_gemm.launches == []


def test_mega_no_rows_anywhere_launches_nothing():
    mega = _stub_mega(8, "error")
    y = mega(*_tokens(0))
    assert y.shape == (0, 256) and mega.engine._deep_gemm.launches == []


def test_mega_bad_ids_here_or_on_a_peer_stop_every_rank(monkeypatch):
    mega = _stub_mega(8, "error")
    x, ids, weights = _tokens(4)
    with pytest.raises(ExpertIdError):
        mega(x, ids.masked_fill(ids == 3, 4), weights)
    _peer_reports(monkeypatch, 4, ("INP005", "topk ids span [0, 9], outside [-1, 4)"))
    with pytest.raises(ExpertIdError, match=r"another rank.*rank 1: \[INP005\] topk ids span"):
        mega(x, ids, weights)
    assert mega.engine._deep_gemm.launches == []


def test_mega_accepts_int32_ids_and_masked_slots():
    mega = _stub_mega(8, "error")
    x, ids, weights = _tokens(4)
    ids[1] = -1
    mega(x, ids.to(torch.int32), weights)
    (launch,) = mega.engine._deep_gemm.launches
    assert launch["topk_idx"].dtype == torch.int64 and torch.equal(launch["topk_idx"], ids)
