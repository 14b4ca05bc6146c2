"""scripts/bench_experts.py's peers at their best, on the CPU (moe_ref.bench): the engines' tuner search spaces
(moe_ref.bench.peers.search: counts, pruning, that every config can run), the small and full searches with a
stand-in timer, the row labels, `--peer-search none` keeping the as-shipped rows of before, and (under
TRITON_INTERPRET=1, with the peer files of `make peers`; skipped without them) that a searched config is the one the
peer's kernel is launched with."""

import dataclasses
import importlib.util
import pathlib
import random
import sys

import pytest
import torch

import moe_ref.bench.peers as pm
from moe_ref.bench import cases, expert_report, expert_rows, timing
from moe_ref.bench.peers import search as peer_search
from moe_ref.experts import ExpertLayout

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parents[2]


ENGINES_DTYPES = [(e, d) for e in ("sglang", "vllm") for d in ("bf16", "fp8")]


# ------------------------------------------------------------------------------------------------
# the tuners' spaces
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine, dtype, tuner, runnable", [
    ("sglang", "bf16", 1920, 1248), ("sglang", "fp8", 1280, 1248), ("vllm", "bf16", 1920, 1248),
    ("vllm", "fp8", 640, 288)])
def test_tuner_space_counts_and_pruning(engine, dtype, tuner, runnable):
    space = pm.tuner_space(engine, dtype)
    assert len(space) == tuner
    assert len({tuple(sorted(c.items())) for c in space}) == tuner  # no repeats in the enumeration
    pruned = pm.pruned_space(engine, dtype)
    assert (pruned.tuner_size, len(pruned.configs)) == (tuner, runnable)
    assert sum(pruned.dropped.values()) == tuner - runnable
    for config in pruned.configs:  # every config left can run as the kernel's config
        assert config in space and pm.config_problems(engine, dtype, config) == [], config
    ran = {tuple(pm.effective_config(engine, dtype, c).values()) for c in pruned.configs}
    assert len(ran) == runnable  # no two run as the same config


def test_tuner_spaces_follow_the_engines_files():
    # SGLang (common_utils.get_configs_compute_bound, then `block_k % BLOCK_SIZE_K == 0` for [128, 128])
    sglang = pm.tuner_space("sglang", "fp8")
    assert {c["BLOCK_SIZE_K"] for c in sglang} == {64, 128} and {c["BLOCK_SIZE_N"] for c in sglang} == {32, 64, 128, 256}
    assert sglang[0] == {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1,
                         "num_warps": 4, "num_stages": 2}  # its loop order: stages, M, K, N, warps, group
    assert sglang[1]["GROUP_SIZE_M"] == 16 and sglang[4]["num_warps"] == 8
    # vLLM (benchmark_moe.get_configs_compute_bound: BLOCK_SIZE_K and BLOCK_SIZE_N multiples of the block)
    vllm = pm.tuner_space("vllm", "fp8")
    assert {c["BLOCK_SIZE_K"] for c in vllm} == {128, 256} and {c["BLOCK_SIZE_N"] for c in vllm} == {128, 256}
    assert vllm[0] == {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
                       "num_warps": 4, "num_stages": 2}  # itertools.product order: stages fastest
    assert vllm[1]["num_stages"] == 3
    # vLLM's launcher caps BLOCK_SIZE_K at 128 for block-FP8: the 256 half is dropped as a duplicate
    assert pm.pruned_space("vllm", "fp8").dropped["runs as another config"] == 288
    assert all(c["BLOCK_SIZE_K"] == 128 for c in pm.pruned_space("vllm", "fp8").configs)
    with pytest.raises(ValueError):
        pm.tuner_space("flashinfer", "bf16")


def test_config_problems_name_what_cannot_run():
    ok = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4,
          "num_stages": 3}
    assert pm.config_problems("sglang", "fp8", ok) == []
    assert pm.smem_bytes(ok, "fp8") == (64 + 128) * 128 * 3 and pm.smem_bytes(ok, "bf16") == 2 * (64 + 128) * 128 * 3
    assert any("shared memory" in p for p in pm.config_problems("sglang", "bf16", dict(ok, num_stages=5,
                                                                                        BLOCK_SIZE_M=256)))
    assert any("divide" in p for p in pm.config_problems("sglang", "fp8", dict(ok, BLOCK_SIZE_K=256)))
    assert pm.config_problems("vllm", "fp8", dict(ok, BLOCK_SIZE_K=256)) == []  # capped to 128 by the launcher
    assert any("power of two" in p for p in pm.config_problems("vllm", "bf16", dict(ok, BLOCK_SIZE_M=8)))
    assert pm.config_problems("vllm", "bf16", {"BLOCK_SIZE_M": 16}) == ["no BLOCK_SIZE_N", "no BLOCK_SIZE_K",
                                                                        "no GROUP_SIZE_M", "no num_warps",
                                                                        "no num_stages"]


@pytest.mark.parametrize("engine, dtype", ENGINES_DTYPES)
@pytest.mark.parametrize("rows_per_expert, cap", [(1, 16), (16, 16), (17, 32), (90, 128), (700, 1024)])
def test_small_search_subset_and_bound(engine, dtype, rows_per_expert, cap):
    assert pm.block_m_cap(rows_per_expert) == cap
    space = pm.pruned_space(engine, dtype).configs
    stage1 = pm.small_stage1(space, rows_per_expert)
    assert stage1 and len(stage1) <= 30 and all(c in space for c in stage1)
    assert all(c["BLOCK_SIZE_M"] <= cap and (c["GROUP_SIZE_M"], c["num_warps"], c["num_stages"]) == (1, 4, 3)
               for c in stage1)
    rng = random.Random(f"{engine}{dtype}{rows_per_expert}")
    seen = []

    def timer(config):
        seen.append(config)
        if config["num_stages"] == 5:
            raise RuntimeError("OutOfResources (stand-in)")
        return rng.uniform(1, 100)

    result = pm.search_config(engine, dtype, "small", timer, max_rows_per_expert=rows_per_expert)
    assert len(seen) == len(result.timed) + len(result.failed) <= 50
    assert all(c in space and c["BLOCK_SIZE_M"] <= cap for c in seen)
    assert len({tuple(c.values()) for c in seen}) == len(seen)  # each config timed once
    assert all(c["num_stages"] == 5 for c, _ in result.failed)
    assert result.best_us == min(us for _, us in result.timed) and (result.best, result.best_us) in result.timed
    tuned = pm.tuned_peer_config(engine, result, 100)
    assert tuned.up == tuned.down == result.best and tuned.source.startswith("tuned: small search")


def test_full_search_times_every_runnable_config_and_none_is_refused():
    result = pm.search_config("vllm", "fp8", "full", lambda c: c["BLOCK_SIZE_M"] + c["num_stages"] / 10,
                              max_rows_per_expert=5)
    assert len(result.timed) == 288 and result.best["BLOCK_SIZE_M"] == 16 and result.best["num_stages"] == 2
    with pytest.raises(ValueError, match="search mode"):
        pm.search_config("vllm", "fp8", "none", lambda c: 1.0, max_rows_per_expert=5)
    failed = pm.search_config("vllm", "fp8", "small", lambda c: 1 / 0, max_rows_per_expert=5)
    assert failed.best is None and failed.failed
    with pytest.raises(Exception, match="no config"):
        pm.tuned_peer_config("vllm", failed, 5)


# ------------------------------------------------------------------------------------------------
# bench_experts: labels, rows, --peer-search
# ------------------------------------------------------------------------------------------------
def test_row_labels_say_what_each_row_times():
    row_label = expert_report.row_label
    labels = {"sglang": "sglang 0.5.23"}
    assert "as shipped" in row_label("peer_sglang_bf16", labels) and "sglang 0.5.23" in row_label(
        "peer_sglang_bf16", labels)
    tuned = row_label("peer_vllm_tuned_fp8", labels, "small")
    assert "tuned" in tuned and "small search" in tuned
    assert "kernels only" in row_label("deep_gemm_kernels_fp8")
    assert "kernels only" in row_label("deep_gemm_masked_kernels_bf16") and "masked" in row_label(
        "deep_gemm_masked_kernels_bf16")
    assert "whole MLP" in row_label("deep_gemm_fp8") and "FP8 quant of h" in row_label("deep_gemm_masked_fp8")
    assert "FP8 quant" not in row_label("deep_gemm_bf16")
    assert "without the rows hint" in row_label("api_triton_fp8_nohint")
    assert "make_experts('deep_gemm')" in row_label("api_deep_gemm_fp8")
    assert "make_experts('deep_gemm')" in row_label("api_deep_gemm_bf16_nohint")
    assert "make_experts('triton')" in row_label("api_triton_bf16")
    assert "rows hint" in row_label("api_triton_bf16") and "without" not in row_label("api_triton_bf16")


def _cpu_case(counts=(5, 0, 19), hidden=256, inter=256, fp8=False):
    gen = torch.Generator().manual_seed(0)
    layout = ExpertLayout.from_counts(torch.tensor(counts), cases.ALIGN)
    num_pool_rows = max(layout.num_pool_rows, cases.ALIGN)
    x_packed = torch.randn(sum(counts), hidden, generator=gen)
    x_PDx = torch.zeros(num_pool_rows, hidden)
    x_PDx[cases.segment_rows(layout.row_start_e, layout.num_rows_e, num_pool_rows)] = x_packed
    gate_up = torch.randn(len(counts), 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(len(counts), hidden, inter, generator=gen) / inter**0.5
    return cases.Case("tiny", sum(counts), list(counts), x_PDx, layout.row_start_e, layout.num_rows_e.to(torch.int32),
                      x_packed, gate_up, down)


def test_pools_follow_the_backend_alignment():
    case = _cpu_case()
    assert cases.case_pool(case, cases.ALIGN).x_PDx is case.x_PDx
    packed = cases.case_pool(case, 1)  # triton's segment_alignment: no padding rows at all
    assert packed.x_PDx.shape[0] == 24 and torch.equal(packed.x_PDx, case.x_packed)
    assert packed.row_start_e.tolist() == [0, 5, 5] and packed.num_rows_e.tolist() == [5, 0, 19]
    sixteen = cases.case_pool(case, 16)
    assert sixteen.row_start_e.tolist() == [0, 16, 16] and sixteen.x_PDx.shape[0] == 48
    case.path_pools["p"] = sixteen
    out = sixteen.x_PDx * 2
    assert torch.equal(cases.routed_rows(case, out, "p"), case.x_packed * 2)


def test_api_paths_run_on_the_backends_pool_with_and_without_the_hint(monkeypatch):
    from moe_ref.experts import experts_class

    case = _cpu_case()
    seen = []

    class Recorder:
        def __call__(self, x, layout, x_scale=None):
            seen.append((x.shape[0], layout.alignment, layout.num_rows_hint))
            return x

    monkeypatch.setattr(expert_rows, "_API_EXPERTS", {})
    import moe_ref.experts as experts_module

    monkeypatch.setattr(experts_module, "make_experts", lambda *a, **k: Recorder())
    paths = expert_rows.api_paths(case)
    assert [name for name, _ in paths] == ["api_triton_bf16", "api_triton_bf16_nohint"]
    for _, fn in paths:
        fn()
    alignment = experts_class("triton").segment_alignment
    assert seen == [(24, alignment, 24), (24, alignment, None)]


@pytest.fixture
def h200(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")


def _peer(engine_name):
    for path in pm.default_peer_files():
        if pathlib.Path(path).name.startswith(engine_name + "-"):
            return pm.load_peer_kernel(path)
    pytest.skip(f"no {engine_name} peer file in .whl/ (`make peers`)")


@pytest.mark.parametrize("engine_name", ["sglang", "vllm"])
def test_peer_search_none_keeps_the_as_shipped_rows(h200, engine_name):
    peer, case = _peer(engine_name), _cpu_case()
    log = {"searches": []}
    paths = expert_rows.peer_paths(case, peer, "none", log=log)
    assert [name for name, _, _ in paths] == [f"peer_{engine_name}_bf16"]
    want = pm.peer_config(peer.wheel, 3, 256, "bf16", "NVIDIA H200", case.num_rows, hidden=256)
    assert paths[0][2].up == want.up and paths[0][2].source == want.source and log["searches"] == []
    row = expert_report.make_row(case, paths[0][0], 10.0, {"bf16_flops_per_s": 1e15, "hbm_bytes_per_s": 4e12},
                                 config=paths[0][2], peer_labels={engine_name: peer.label})
    assert row["tuned"] is False and "as shipped" in row["label"] and row["config"]["up"] == want.up


class _LaunchSpy:
    """Stands in for the peer's `fused_moe_kernel`: records each launch's tile arguments, then launches it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(**kwargs):
            self.launches.append({k: kwargs[k] for k in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K",
                                                         "GROUP_SIZE_M")})
            return self.kernel[grid](**kwargs)

        return launch


@pytest.mark.parametrize("engine_name", ["sglang", "vllm"])
def test_searched_config_reaches_the_kernel(h200, monkeypatch, engine_name):
    """The search's winner is the config of the tuned row, and the interpreter runs the peer's kernel with it (both
    GEMMs), matching our twin."""
    from moe_ref.kernels.experts.grouped_mlp import grouped_mlp_ref
    from moe_ref.testing import calc_diff

    peer, case = _peer(engine_name), _cpu_case()
    spy = _LaunchSpy(peer.gemm)
    peer = dataclasses.replace(peer, gemm=spy)
    chosen = {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 16, "num_warps": 8,
              "num_stages": 2}
    assert chosen in pm.pruned_space(engine_name, "bf16").configs

    def search(engine, dtype, mode, timer, **kwargs):  # the real search, with a timer that prefers `chosen`
        return pm.search_config(engine, dtype, mode, lambda c: 1.0 if c == chosen else 2.0, **kwargs)

    monkeypatch.setattr(peer_search, "search_config", search)
    monkeypatch.setattr(expert_rows, "device_smem_limit", lambda: pm.SMEM_LIMIT_SM90)
    log = {"searches": []}
    paths = expert_rows.peer_paths(case, peer, "full", log=log)  # full: every runnable config, so `chosen` is timed
    assert [name for name, _, _ in paths] == [f"peer_{engine_name}_bf16", f"peer_{engine_name}_tuned_bf16"]
    name, fn, config = paths[1]
    assert config.up == config.down == chosen and log["searches"][0]["best"] == chosen
    assert log["searches"][0]["timed"] == 1248
    y = fn()
    assert spy.launches == [{k: chosen[k] for k in spy.launches[0]}] * 2  # GEMM1 and GEMM2 with the searched tiles
    want = grouped_mlp_ref(case.x_PDx, case.gate_up, case.down, case.row_start_e, case.num_rows_e)
    valid = cases.segment_rows(case.row_start_e, case.num_rows_e, case.x_PDx.shape[0])
    assert calc_diff(y[valid], want[valid]) < 1e-4
    row = expert_report.make_row(case, name, 5.0, {"bf16_flops_per_s": 1e15, "hbm_bytes_per_s": 4e12},
                                 config=config, search="full", peer_labels={engine_name: peer.label})
    assert row["tuned"] is True and row["config"]["up"] == chosen and "tuned (full search" in row["label"]
    assert "tuned" in expert_report.markdown({"env": {"gpu": "x", "torch": "t", "triton": "t", "peer_search": "full"},
                                               "anchors": {"hbm_bytes_per_s": 4e12, "bf16_flops_per_s": 1e15},
                                               "cases": [row]})


# ------------------------------------------------------------------------------------------------
# DeepGEMM rows: kernels only vs whole MLP, on the stand-in deep_gemm of test_deep_gemm_detect.py
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def fake_deep_gemm(monkeypatch):
    return _install_fake(_test_module("test_deep_gemm_detect"), monkeypatch)


def _test_module(name):
    key = f"{name}_for_peers"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, ROOT / "tests" / "unit" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def _install_fake(detect, monkeypatch):
    module = detect._fake_deep_gemm_module()
    monkeypatch.setitem(sys.modules, "deep_gemm", module)
    monkeypatch.setitem(sys.modules, "deep_gemm.utils", module.utils)
    monkeypatch.setattr(detect.deep_gemm_probe, "_probe",
                        lambda: detect.DeepGemmStatus(True, "0.1.4-fake", "fake", False))
    monkeypatch.setattr(detect.deep_gemm_backend, "_require_cuda", lambda name, tensor: None)
    return module


def test_deep_gemm_kernel_rows_time_only_the_two_gemms(fake_deep_gemm):
    from moe_ref.experts import TorchLoopExperts
    from moe_ref.experts.deep_gemm.bench import deep_gemm_grouped_cases, deep_gemm_kernel_cases
    from moe_ref.kernels.experts.fp8 import quantize_fp8_per_128
    from moe_ref.testing import calc_diff

    case = _cpu_case(counts=(3, 0, 130), hidden=256, inter=128)
    weights = (case.gate_up.bfloat16(), case.down.bfloat16())
    x = case.x_PDx.bfloat16()
    x_fp8 = quantize_fp8_per_128(x)
    layout = ExpertLayout(case.row_start_e, case.num_rows_e, x.shape[0], 128)
    reference = TorchLoopExperts(*weights).forward(x, layout)
    valid = layout.row_expert_P() >= 0
    args = (x, *weights, case.row_start_e, case.num_rows_e)
    options = dict(layouts=("contiguous", "masked"), x_fp8=x_fp8)
    whole = deep_gemm_grouped_cases(*args, **options)
    kernels = deep_gemm_kernel_cases(*args, **options)
    assert [n for n, _ in whole] == ["deep_gemm_bf16", "deep_gemm_fp8", "deep_gemm_masked_bf16", "deep_gemm_masked_fp8"]
    assert [n for n, _ in kernels] == ["deep_gemm_kernels_bf16", "deep_gemm_masked_kernels_bf16",
                                       "deep_gemm_kernels_fp8", "deep_gemm_masked_kernels_fp8"]
    for name, fn in whole + kernels:
        fake_deep_gemm.calls.clear()
        y = fn()
        assert len(fake_deep_gemm.calls) == 2, name  # GEMM1 and GEMM2, nothing else of deep_gemm's
        if y.dim() == 3:  # masked [e, M, D]: expert i's first counts[i] rows
            counts = torch.tensor(case.counts)
            y = y[torch.arange(y.shape[1])[None, :] < counts[:, None]]
        else:
            y = y[valid]
        limit = 1e-2 if name.endswith("fp8") else 1e-4
        assert calc_diff(y.float(), reference[valid].float()) < limit, name
    # the fp8 whole-MLP rows start from the FP8 pool as dispatched: no quantization of x inside them
    assert whole[1][1].args[0].dtype == torch.float8_e4m3fn and whole[1][1].args[2] is x_fp8[1]


def test_paths_selects_rows_by_name_or_prefix():
    assert expert_rows.selected("api_deep_gemm_fp8", None)
    assert expert_rows.selected("api_deep_gemm_fp8", "api_deep_gemm_,deep_gemm_kernels_")
    assert expert_rows.selected("deep_gemm_kernels_fp8", "api_deep_gemm_,deep_gemm_kernels_")
    assert not expert_rows.selected("deep_gemm_masked_fp8", "api_deep_gemm_,deep_gemm_kernels_")
    assert not expert_rows.selected("api_triton_bf16", "api_triton_fp8")


def test_graph_rows_are_labelled_and_keep_their_dtype_suffix():
    label = expert_report.row_label("graph_api_auto_fp8")
    assert "make_experts('auto')" in label and "CUDA graph" in label
    assert expert_rows.selected("graph_api_auto_fp8".removeprefix("graph_"), "api_auto_")


def test_rounds_alternate_the_order_and_keep_every_round():
    """--rounds: each path is timed once per round, every other round in reverse order (a GPU slowing down over the run
    favours no path); every round's time is kept, the row takes the fastest."""
    order, clock = [], iter(range(100, 0, -1))  # a "GPU" that gets faster with every call

    def time_path(name, fn):
        order.append(name)
        return float(next(clock)), f"timed {name}"

    paths = [("a", None), ("b", None), ("c", None)]
    per_round, timing_of = timing.time_rounds(paths, 3, time_path)
    assert order == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert per_round == {"a": [100.0, 95.0, 94.0], "b": [99.0, 96.0, 93.0], "c": [98.0, 97.0, 92.0]}
    assert timing_of == {"a": "timed a", "b": "timed b", "c": "timed c"}
    assert timing.time_rounds(paths, 1, lambda name, fn: (1.0, "x"))[0] == {"a": [1.0], "b": [1.0], "c": [1.0]}


def test_fp8_rows_count_one_byte_per_weight_whatever_their_suffix():
    """The row metrics read a path's dtype from any part of its name: an FP8 row without the hint (`..._fp8_nohint`)
    moves the same one-byte weights as the hinted one, so at the same time its weight GB/s is the same."""
    counts = [3, 0, 5]
    case = cases.Case("tiny", sum(counts), counts, torch.zeros(8, 256), torch.zeros(3), torch.zeros(3),
                      torch.zeros(8, 256), torch.zeros(3, 2 * 128, 256), torch.zeros(3, 256, 128))
    anchors = {"hbm_bytes_per_s": 4e12, "bf16_flops_per_s": 7e14}
    metrics = {path: expert_report.case_metrics(case, path, 100.0, anchors) for path in
               ("api_triton_fp8", "api_auto_fp8_nohint", "graph_api_auto_fp8", "api_triton_bf16_nohint")}
    one_byte = 2 * 3 * 128 * 256 / 100e-6 / 1e9  # two experts with rows, gate_up + down, 1 byte each
    for path in ("api_triton_fp8", "api_auto_fp8_nohint", "graph_api_auto_fp8"):
        assert metrics[path]["weight_gbps"] == pytest.approx(one_byte), path
    assert metrics["api_triton_bf16_nohint"]["weight_gbps"] == pytest.approx(2 * one_byte)


# ------------------------------------------------------------------------------------------------
# --kernel-table: kernels, GPU span and runtime calls per call, from profiler events
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Range:
    start: float
    end: float

    def elapsed_us(self) -> float:
        return self.end - self.start


@dataclasses.dataclass
class _Event:
    name: str
    device_type: str
    time_range: _Range


def test_gpu_kernels_sums_per_call_and_measures_the_span():
    """Two calls of kernels A and B with 5 us of GPU idle after each call: 20 us of kernels in a 25 us span per call;
    CPU events are not kernels."""
    events = [_Event("A", "DeviceType.CUDA", _Range(0, 10)), _Event("B", "DeviceType.CUDA", _Range(10, 20)),
              _Event("A", "DeviceType.CUDA", _Range(25, 35)), _Event("B", "DeviceType.CUDA", _Range(35, 50)),
              _Event("cudaLaunchKernel", "DeviceType.CPU", _Range(-5, 100))]
    kernels, span = timing.gpu_kernels(events, calls=2)
    assert kernels == {"B": 12.5, "A": 10.0} and list(kernels) == ["B", "A"]  # largest first
    assert span == 25.0
    assert timing.gpu_kernels([], calls=2) == ({}, 0.0)


def test_runtime_calls_counts_the_host_side_cuda_calls_per_call():
    events = [_Event("cudaLaunchKernel", "DeviceType.CPU", _Range(0, 4)) for _ in range(6)] + [
        _Event("cudaFree", "DeviceType.CPU", _Range(10, 210)), _Event("cuLaunchKernelEx", "DeviceType.CPU", _Range(0, 2)),
        _Event("cudaDeviceSynchronize", "DeviceType.CPU", _Range(300, 900)),  # the profile's own, left out
        _Event("aten::empty", "DeviceType.CPU", _Range(0, 50)),  # not a runtime call
        _Event("cudaFree", "DeviceType.CUDA", _Range(0, 1))]  # not a host event
    assert timing.runtime_calls(events, calls=2) == {"cudaFree": [0.5, 100.0], "cudaLaunchKernel": [3.0, 12.0],
                                                     "cuLaunchKernelEx": [0.5, 1.0]}


def test_kernel_time_leaves_the_l2_flush_out_and_refuses_a_call_that_launches_its_kernel():
    """Two calls, each after one flush ("fill"): the flush is left out, the rest summed per call, largest first."""
    flush = {"fill<double>"}

    def profile(*kernels):
        t, events = 0.0, []
        for name, us in kernels:
            events.append(_Event(name, "DeviceType.CUDA", _Range(t, t + us)))
            t += us
        return events + [_Event("cudaLaunchKernel", "DeviceType.CPU", _Range(0, 1))]

    two_calls = profile(("fill<double>", 80), ("A", 10), ("B", 4), ("fill<double>", 80), ("A", 12), ("B", 6))
    assert timing.kernels_without_flush(two_calls, flush, calls=2) == {"A": 11.0, "B": 5.0}
    launches_the_fill = profile(("fill<double>", 80), ("fill<double>", 3), ("A", 10), ("fill<double>", 80), ("A", 10))
    with pytest.raises(RuntimeError, match="launches the L2 flush's own kernel"):
        timing.kernels_without_flush(launches_the_fill, flush, calls=2)
    with pytest.raises(RuntimeError, match="no kernel"):
        timing.kernels_without_flush(profile(("fill<double>", 80), ("fill<double>", 80)), flush, calls=2)
