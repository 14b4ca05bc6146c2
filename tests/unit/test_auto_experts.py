"""experts_backend="auto" on the CPU: the measured table (loading, validation, buckets), what auto holds on a GPU
class (stand-in backends registered for the test, DeepGEMM made "available" through its probe, a pretend SM90
device), the pick per regime, one shared copy of the weights, the options and their fingerprint, `moe-ref info`,
and the decisions, plan and loop of `moe-ref bench --auto-table`. The kernels themselves run in tests/gpu."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from moe_ref.conformance import auto_table as auto_table_run
from moe_ref.core.errors import AutoTableError, GroupDisagreementError
from moe_ref.ep.distributed import check_fields_agree
from moe_ref.ep.options import EPOptions
from moe_ref.experts import (ExpertLayout, Experts, FP8ExpertWeights, TorchLoopExperts, TritonExperts, experts_class,
                             make_experts, register_experts, registry)
from moe_ref.experts import auto
from moe_ref.experts.auto import AutoExperts, auto_plan, auto_table, find_regime, validate_table
from moe_ref.experts.deep_gemm import probe as deep_gemm_probe
from moe_ref.experts.deep_gemm.backend import DeepGemmExperts
from moe_ref.experts.deep_gemm.probe import DeepGemmStatus
from moe_ref.kernels.runtime._triton_utils import FP8_DTYPE
from moe_ref.tools.cli import auto_backend_lines, main

pytestmark = pytest.mark.unit

tune = auto_table_run
NUM_EXPERTS, HIDDEN, INTER = 4, 128, 128


# --------------------------------------------------------------------------------------------------
# stand-ins and a table
# --------------------------------------------------------------------------------------------------
class StandIn(Experts):
    """Records what it was built with; its output rows are all ``tag`` (so a test sees which backend ran)."""

    tag = 0.0
    supports_fp8 = True

    def __init__(self, gate_up_weight_e2FD, down_weight_eDF, activation="silu", situ_beta=4.0, situ_linear_beta=25.0,
                 *, fp8=False, fp8_weights=None):
        super().__init__(gate_up_weight_e2FD, down_weight_eDF, activation, situ_beta, situ_linear_beta)
        self.fp8 = self.accepts_fp8_input = fp8 or fp8_weights is not None
        self.fp8_weights = fp8_weights

    def forward(self, x_PDx, layout, x_scale_PDb=None):
        return torch.full(x_PDx.shape, self.tag, dtype=torch.bfloat16 if x_PDx.dtype == FP8_DTYPE else x_PDx.dtype)


class StandInTriton(StandIn):
    name, tag, segment_alignment = "triton", 1.0, 1


class StandInDeepGemm(StandIn):
    name, tag, segment_alignment = "deep_gemm", 2.0, 128

    @classmethod
    def unavailable_reason(cls):
        return DeepGemmExperts.unavailable_reason()  # the real probe's answer (faked by the fixtures)


class StandInGroupedMM(StandIn):
    name, tag, segment_alignment, supports_fp8 = "grouped_mm", 3.0, 16, False


def regime(dtype, pool_format, bound, order):
    return {"dtype": dtype, "pool_format": pool_format, "max_rows_per_expert": bound, "order": list(order),
            "measured": {"routed_rows": 64, "rows_per_expert": 1.0,
                         "us": {"kimi-k2": {name: 10.0 + i for i, name in enumerate(order)}}}}


CLASS = "9.0/StandIn GPU"  # the sm90 fixture's GPU class


def header(compute_capability="9.0"):
    return {"date": "2026-12-02", "gpu": "StandIn GPU", "compute_capability": compute_capability, "torch": "2.x",
            "triton": "3.x", "deep_gemm": "0.1.4", "command": "moe-ref bench --auto-table"}


# fp8: deep_gemm above 30 rows per expert on contiguous pools, Triton below and on masked pools;
# bf16: grouped_mm at decode, deep_gemm at prefill.
REGIMES = [regime("fp8", "contiguous", 3.77, ["triton", "deep_gemm"]),
           regime("fp8", "contiguous", 30.17, ["triton", "deep_gemm"]),
           regime("fp8", "contiguous", None, ["deep_gemm", "triton"]),
           regime("fp8", "masked", None, ["triton", "deep_gemm"]),
           regime("bf16", "contiguous", 3.77, ["grouped_mm", "triton"]),
           regime("bf16", "contiguous", None, ["deep_gemm", "triton"])]
TABLE = {"format": 2, "about": "test", "gpu_classes": {CLASS: {"header": header(), "regimes": REGIMES}}}


@pytest.fixture
def stand_ins(monkeypatch):
    """The stand-ins registered as triton, deep_gemm and grouped_mm (the registry is restored after the test)."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    for cls in (StandInTriton, StandInDeepGemm, StandInGroupedMM):
        register_experts(cls.name, cls)


@pytest.fixture
def sm90(monkeypatch):
    """A pretend SM90 CUDA device (nothing runs on it: the tests only read its class)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "StandIn GPU")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def use_table(monkeypatch, tmp_path, table=TABLE) -> str:
    path = tmp_path / "auto_table.json"
    path.write_text(json.dumps(table))
    monkeypatch.setattr(auto, "TABLE_PATH", path)
    return str(path)


def deep_gemm_usable(monkeypatch, usable: bool) -> None:
    status = DeepGemmStatus(usable, "0.1.4", "stand-in probe: " + ("usable" if usable else "no SM90 here"))
    monkeypatch.setattr(deep_gemm_probe, "_probe", lambda: status)


@pytest.fixture
def table_here(monkeypatch, tmp_path, stand_ins, sm90):
    use_table(monkeypatch, tmp_path)
    deep_gemm_usable(monkeypatch, True)


def weights(dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen).to(dtype),
            torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen).to(dtype))


def layout(rows_per_expert: int, *, masked: bool = False, alignment: int = 128) -> ExpertLayout:
    """A layout over ``NUM_EXPERTS`` experts with ``rows_per_expert`` rows each and the layer's static hint."""
    num_rows_e = torch.full((NUM_EXPERTS,), rows_per_expert, dtype=torch.int64)
    if masked:
        max_rows = -(-rows_per_expert // 128) * 128
        return ExpertLayout(torch.arange(NUM_EXPERTS) * max_rows, num_rows_e, NUM_EXPERTS * max_rows, 128,
                            num_rows_hint=NUM_EXPERTS * rows_per_expert, masked_rows=max_rows)
    base = ExpertLayout.from_counts(num_rows_e, alignment)
    return ExpertLayout(base.row_start_e, num_rows_e, base.num_pool_rows, alignment,
                        num_rows_hint=NUM_EXPERTS * rows_per_expert, zero_unused_rows=False)


def call(experts, lay: ExpertLayout, dtype=torch.bfloat16) -> torch.Tensor:
    """``experts`` on a pool of ``lay``: the FP8 pool (rows + scales) for fp8 experts, else ``dtype`` rows."""
    x_PDx = torch.zeros(lay.num_pool_rows, HIDDEN, dtype=dtype)
    if experts.fp8:
        return experts(x_PDx.to(FP8_DTYPE), lay, torch.ones(lay.num_pool_rows, HIDDEN // 128))
    return experts(x_PDx, lay)


class StandInNoGroupedMM(StandInGroupedMM):
    @classmethod
    def unavailable_reason(cls):
        return "stand-in torch has no grouped_mm"


# --------------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------------
def test_the_committed_table_is_valid_and_every_class_was_made_by_the_script():
    table = auto_table()
    assert table.path == str(auto.TABLE_PATH)
    for gpu_class, entry in table.gpu_classes.items():  # none until a GPU run wrote one
        assert auto.gpu_class_name(entry.header["compute_capability"], entry.header["gpu"]) == gpu_class
        assert entry.header["command"].startswith(("python scripts/tune_experts_auto.py", "moe-ref bench --auto-table")), \
            gpu_class
        assert all(regime.measured["us"] for regime in entry.regimes), gpu_class


def test_auto_table_is_read_once_per_path(monkeypatch, tmp_path):
    path = use_table(monkeypatch, tmp_path)
    first = auto_table()
    assert auto_table() is first and auto_table(path) is first
    assert first.gpu_classes[CLASS].regimes[2].order == ("deep_gemm", "triton")
    assert first.gpu_classes[CLASS].regimes[0].max_rows_per_expert == 3.77


def _broken(edit):
    table = copy.deepcopy(TABLE)
    edit(table)
    return table


def _regimes(table):
    return table["gpu_classes"][CLASS]["regimes"]


@pytest.mark.parametrize("edit, field", [
    (lambda t: t.update(format=1), "format"),
    (lambda t: t.update(gpu_classes=[]), "gpu_classes"),
    (lambda t: t["gpu_classes"].update({"H200": t["gpu_classes"][CLASS]}), "gpu_classes['H200']"),
    (lambda t: t["gpu_classes"][CLASS]["header"].pop("command"), f"gpu_classes[{CLASS!r}].header"),
    (lambda t: t["gpu_classes"][CLASS]["header"].update(compute_capability="8.0"), f"gpu_classes[{CLASS!r}].header"),
    (lambda t: t["gpu_classes"][CLASS]["header"].update(gpu="Other GPU"), f"gpu_classes[{CLASS!r}].header"),
    (lambda t: _regimes(t)[1].update(dtype="fp16"), f"gpu_classes[{CLASS!r}].regimes[1].dtype"),
    (lambda t: _regimes(t)[1].update(pool_format="ragged"), f"gpu_classes[{CLASS!r}].regimes[1].pool_format"),
    (lambda t: _regimes(t)[0].update(max_rows_per_expert=0), f"gpu_classes[{CLASS!r}].regimes[0].max_rows_per_expert"),
    (lambda t: _regimes(t)[0].update(max_rows_per_expert=True), f"gpu_classes[{CLASS!r}].regimes[0].max_rows_per_expert"),
    (lambda t: _regimes(t)[0].pop("max_rows_per_expert"), f"gpu_classes[{CLASS!r}].regimes[0].max_rows_per_expert"),
    (lambda t: _regimes(t)[0].update(order=[]), f"gpu_classes[{CLASS!r}].regimes[0].order"),
    (lambda t: _regimes(t)[0].update(order=["triton", "triton"]), f"gpu_classes[{CLASS!r}].regimes[0].order"),
    (lambda t: _regimes(t)[0].update(order=["auto"]), f"gpu_classes[{CLASS!r}].regimes[0].order"),
    (lambda t: _regimes(t)[0]["measured"]["us"]["kimi-k2"].pop("deep_gemm"),
     f"gpu_classes[{CLASS!r}].regimes[0].measured.us"),
    (lambda t: _regimes(t)[0]["measured"]["us"]["kimi-k2"].update(triton=-1.0),
     f"gpu_classes[{CLASS!r}].regimes[0].measured.us"),
    (lambda t: _regimes(t)[1].update(max_rows_per_expert=2.0), f"gpu_classes[{CLASS!r}].regimes"),  # not increasing
    (lambda t: _regimes(t)[3].update(max_rows_per_expert=99.0), f"gpu_classes[{CLASS!r}].regimes"),  # last one bounded
])
def test_a_bad_field_is_cfg019_naming_the_file_and_the_field(edit, field):
    with pytest.raises(AutoTableError) as info:
        validate_table(_broken(edit), "some/auto_table.json")
    assert info.value.code == "CFG019" and isinstance(info.value, ValueError)
    assert str(info.value).startswith(f"[CFG019] some/auto_table.json: {field}: "), str(info.value)
    assert info.value.details["field"] == field


def test_a_file_that_is_not_json_is_cfg019_naming_it(tmp_path):
    path = tmp_path / "auto_table.json"
    path.write_text('{"format": 1, "gpu_classes": {')
    with pytest.raises(AutoTableError, match=rf"CFG019\] {path}: cannot be read as JSON"):
        auto_table(path)


@pytest.mark.parametrize("rows_per_expert, bound", [(0.5, 3.77), (3.77, 3.77), (3.7701, 30.17), (30.17, 30.17),
                                                     (30.1701, None), (1e9, None)])
def test_a_call_falls_in_the_first_bucket_it_does_not_exceed(rows_per_expert, bound):
    regimes = validate_table(TABLE, "t").gpu_classes[CLASS].regimes
    found = find_regime(regimes, "fp8", "contiguous", rows_per_expert)
    assert (found.dtype, found.pool_format, found.max_rows_per_expert) == ("fp8", "contiguous", bound)


def test_a_regime_the_table_lacks_is_none():
    regimes = validate_table(TABLE, "t").gpu_classes[CLASS].regimes
    assert find_regime(regimes, "bf16", "masked", 1.0) is None and find_regime(regimes, None, "contiguous", 1.0) is None
    assert find_regime(regimes, "fp8", "masked", 1e6).order == ("triton", "deep_gemm")


# --------------------------------------------------------------------------------------------------
# what auto holds here, and its class
# --------------------------------------------------------------------------------------------------
def test_with_deep_gemm_usable_auto_holds_it_and_plans_128_row_segments(table_here):
    cls = experts_class("auto", "cuda")
    assert issubclass(cls, AutoExperts) and cls.name == "auto"
    assert cls.held_backends == ("triton", "deep_gemm", "grouped_mm") and cls.segment_alignment == 128
    assert cls.supports_fp8 and not cls.computes_whole_segments
    assert cls.describe() == "auto (triton+deep_gemm+grouped_mm)"
    assert experts_class("auto", "cuda") is cls  # made once per held set


def test_without_deep_gemm_auto_is_plain_triton(monkeypatch, tmp_path, sm90):
    use_table(monkeypatch, tmp_path)  # the real backends: DeepGEMM's probe says no
    deep_gemm_usable(monkeypatch, False)
    table = copy.deepcopy(TABLE)
    table["gpu_classes"][CLASS]["regimes"] = [r for r in REGIMES if r["dtype"] == "fp8"]  # grouped_mm not ranked
    use_table(monkeypatch, tmp_path, table)
    assert experts_class("auto", "cuda") is TritonExperts and TritonExperts.segment_alignment == 1
    plan = auto_plan("cuda")
    assert plan.held == ("triton",) and plan.unavailable == {"deep_gemm": "stand-in probe: no SM90 here"}


def test_a_gpu_class_missing_from_the_table_means_triton_only(monkeypatch, tmp_path, stand_ins, sm90):
    use_table(monkeypatch, tmp_path)
    deep_gemm_usable(monkeypatch, True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (10, 0))
    plan = auto_plan("cuda")
    assert (plan.gpu_class, plan.table, plan.held) == ("10.0/StandIn GPU", None, ("triton",))
    assert experts_class("auto", "cuda") is StandInTriton  # the registered triton


def test_another_gpu_of_the_same_capability_does_not_inherit_a_table(monkeypatch, tmp_path, stand_ins, sm90):
    """An H100 beside a table measured on an H200 (both 9.0) runs plain Triton, not the H200's choices."""
    use_table(monkeypatch, tmp_path)
    deep_gemm_usable(monkeypatch, True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Other GPU of the same capability")
    plan = auto_plan("cuda")
    assert (plan.gpu_class, plan.table, plan.held) == ("9.0/Other GPU of the same capability", None, ("triton",))
    assert experts_class("auto", "cuda") is StandInTriton


def test_auto_on_the_cpu_is_the_torch_loop(table_here):
    assert experts_class("auto", "cpu") is TorchLoopExperts
    assert isinstance(make_experts("auto", *weights(torch.float32)), TorchLoopExperts)


def test_only_backends_first_somewhere_are_held(table_here, monkeypatch, tmp_path):
    table = copy.deepcopy(TABLE)
    table["gpu_classes"][CLASS]["regimes"] = [regime("bf16", "contiguous", None, ["grouped_mm", "deep_gemm"])]
    use_table(monkeypatch, tmp_path, table)
    cls = experts_class("auto", "cuda")
    assert cls.held_backends == ("triton", "grouped_mm") and cls.segment_alignment == 16


# --------------------------------------------------------------------------------------------------
# the pick, and one copy of the weights
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows_per_expert, masked, alignment, expected", [
    (1, False, 128, "triton"),       # fp8 decode: <= 3.77 rows per expert, Triton first
    (20, False, 128, "triton"),      # <= 30.17
    (31, False, 128, "deep_gemm"),   # prefill: the unbounded bucket ranks deep_gemm first
    (200, True, 128, "triton"),      # the same rows on a masked pool: the masked order
    (200, False, 16, "triton"),      # a pool of 16-row segments: deep_gemm cannot run it, the next in order runs
])
def test_fp8_picks_by_regime(table_here, rows_per_expert, masked, alignment, expected):
    experts = experts_class("auto", "cuda")(*weights(), fp8=True)
    assert set(experts.backends) == {"triton", "deep_gemm"} and "grouped_mm" in experts.left_out  # no fp8 weights
    y_PDx = call(experts, layout(rows_per_expert, masked=masked, alignment=alignment))
    case = dict(rows_per_expert=rows_per_expert, masked=masked, alignment=alignment)
    assert experts.last_backend == expected, case
    assert y_PDx.dtype == torch.bfloat16 and bool((y_PDx == experts.backends[expected].tag).all()), case


@pytest.mark.parametrize("rows_per_expert, dtype, expected", [(1, torch.bfloat16, "grouped_mm"),
                                                              (200, torch.bfloat16, "deep_gemm"),
                                                              (200, torch.float32, "triton")])
def test_bf16_picks_by_regime_and_other_dtypes_run_triton(table_here, rows_per_expert, dtype, expected):
    experts = experts_class("auto", "cuda")(*weights(dtype))
    y_PDx = call(experts, layout(rows_per_expert), dtype)
    assert experts.last_backend == expected and bool((y_PDx == experts.backends[expected].tag).all())
    if dtype != torch.bfloat16:  # the table ranks bf16 calls only: fp32 weights are not handed to the others
        assert set(experts.backends) == {"triton"} and "not contiguous bf16" in experts.left_out["deep_gemm"]


def test_without_a_rows_hint_auto_counts_the_rows_once_and_passes_the_count(table_here):
    experts = experts_class("auto", "cuda")(*weights(), fp8=True)
    seen = []
    experts.backends["deep_gemm"].forward = lambda x, lay, scale=None: seen.append(lay.num_rows_hint) or x.bfloat16()
    lay = layout(100)
    lay = ExpertLayout(lay.row_start_e, lay.num_rows_e, lay.num_pool_rows, lay.alignment)  # no hint
    call(experts, lay)
    assert experts.last_backend == "deep_gemm" and seen == [NUM_EXPERTS * 100]


def test_bf16_weights_are_the_callers_tensors_in_every_backend(table_here):
    gate_up, down = weights()
    experts = experts_class("auto", "cuda")(gate_up, down)
    assert set(experts.backends) == {"triton", "deep_gemm", "grouped_mm"}
    for name, backend in experts.backends.items():
        assert backend.gate_up_weight_e2FD.untyped_storage().data_ptr() == gate_up.untyped_storage().data_ptr(), name
        assert backend.down_weight_eDF.untyped_storage().data_ptr() == down.untyped_storage().data_ptr(), name


def test_fp8_weights_are_quantized_once_and_shared(table_here, monkeypatch):
    calls = []
    real = FP8ExpertWeights.quantize
    monkeypatch.setattr(FP8ExpertWeights, "quantize", staticmethod(lambda *a: calls.append(1) or real(*a)))
    experts = experts_class("auto", "cuda")(*weights(), fp8=True)
    assert calls == [1] and experts.fp8 and experts.accepts_fp8_input
    shared = experts.fp8_weights
    for name, backend in experts.backends.items():
        assert backend.fp8_weights is shared, name
    assert shared.gate_up_fp8_e2FD.dtype == FP8_DTYPE and shared.gate_up_scale_e2FbDb.shape == (NUM_EXPERTS, 2, 1)


def test_the_real_triton_backend_runs_the_shared_interleaved_fp8_rows(monkeypatch, tmp_path, sm90):
    """With the real TritonExperts beside a stand-in deep_gemm: Triton holds the shared tensors (interleaved, as it
    quantizes alone), and the stand-in gets the same ones."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    register_experts("deep_gemm", StandInDeepGemm)
    use_table(monkeypatch, tmp_path)
    deep_gemm_usable(monkeypatch, True)
    experts = make_experts("triton", *weights(), fp8=True)
    assert experts.fp8_weights.gate_up_interleaved  # alone, Triton interleaves its own copy
    experts = experts_class("auto", "cuda")(*weights(), fp8=True)
    triton, shared = experts.backends["triton"], experts.fp8_weights
    assert isinstance(triton, TritonExperts) and triton.fp8_weights is shared and shared.gate_up_interleaved
    assert experts.backends["deep_gemm"].fp8_weights is shared


def test_a_backend_that_refuses_the_weights_is_left_out_with_its_reason(table_here, monkeypatch):
    from moe_ref.core.errors import ShapeUnsupportedError

    def refuse(self, *args, **kwargs):
        raise ShapeUnsupportedError("stand-in: D=128 cannot be tiled")

    monkeypatch.setattr(StandInDeepGemm, "__init__", refuse)
    experts = experts_class("auto", "cuda")(*weights(), fp8=True)
    assert set(experts.backends) == {"triton"} and "D=128 cannot be tiled" in experts.left_out["deep_gemm"]
    call(experts, layout(200))
    assert experts.last_backend == "triton"  # the regime ranks deep_gemm first; the next held one runs


# --------------------------------------------------------------------------------------------------
# options, fingerprint, quantized checkpoints, info
# --------------------------------------------------------------------------------------------------
def test_options_resolve_auto_and_ranks_that_differ_fail_alike(table_here, monkeypatch):
    with_deep_gemm = EPOptions.resolve(experts_backend="auto", device="cuda")
    assert (with_deep_gemm.experts_backend, with_deep_gemm.alignment) == ("auto", 128)
    rank0 = with_deep_gemm.fingerprint()  # as rank 0 sends it
    assert rank0["experts_backend"] == "auto (triton+deep_gemm+grouped_mm)"
    deep_gemm_usable(monkeypatch, False)  # rank 1's machine: no DeepGEMM, no grouped_mm
    register_experts("grouped_mm", StandInNoGroupedMM)
    without = EPOptions.resolve(experts_backend="auto", device="cuda")
    assert (without.experts_backend, without.alignment) == ("triton", 1)
    everyone = [rank0, without.fingerprint()]
    for rank in (0, 1):  # each rank gathered both and raises the same coded error
        with pytest.raises(GroupDisagreementError, match=r"alignment: rank 0=128, rank 1=1; experts_backend: "
                                                         r"rank 0=auto \(triton\+deep_gemm\+grouped_mm\), "
                                                         r"rank 1=triton\)"):
            check_fields_agree(everyone, rank)


def test_an_fp8_checkpoint_runs_on_the_auto_class_where_it_holds_deep_gemm(table_here, monkeypatch):
    from moe_ref.checkpoint.formats import QuantFormat
    from moe_ref.experts.quantized import FP8BlockExperts, quantized_experts_class

    assert quantized_experts_class(QuantFormat.FP8_BLOCK, "auto", "cuda") is experts_class("auto", "cuda")
    assert quantized_experts_class(QuantFormat.MXFP4, "auto", "cuda").name == "w4a16"
    deep_gemm_usable(monkeypatch, False)
    register_experts("grouped_mm", StandInNoGroupedMM)
    assert quantized_experts_class(QuantFormat.FP8_BLOCK, "auto", "cuda") is FP8BlockExperts


def test_info_prints_the_table_in_use_and_what_auto_holds(table_here, monkeypatch, tmp_path):
    lines = "\n".join(auto_backend_lines())
    assert "experts_backend='auto' on StandIn GPU (GPU class 9.0/StandIn GPU): table " in lines
    assert "measured 2026-12-02 on StandIn GPU" in lines
    assert "| fp8 | contiguous | <= 3.77 | triton, deep_gemm |" in lines
    assert "| fp8 | masked | any | triton, deep_gemm |" in lines and "kimi-k2: triton 10.0, deep_gemm 11.0" in lines
    assert "holds here: triton, deep_gemm, grouped_mm" in lines
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (8, 9))
    assert auto_backend_lines() == [f"experts_backend='auto' on StandIn GPU (GPU class 8.9/StandIn GPU): GPU class not in the "
                                    f"table ({tmp_path / 'auto_table.json'}): triton only"]


def test_info_on_a_machine_without_gpu(capsys):
    assert main(["info"]) == 0
    assert "experts_backend='auto': no GPU: the torch loop (CPU)" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------------
# moe-ref bench --auto-table (moe_ref.conformance.auto_table): the decisions, the plan, the loop
# --------------------------------------------------------------------------------------------------
def test_buckets_reach_halfway_on_a_log_scale_and_the_last_is_unbounded():
    assert tune.bucket_bounds([64 / 48, 512 / 48, 4096 / 48, 32768 / 48]) == [3.77, 30.17, 241.36, None]
    assert tune.bucket_bounds([5.0]) == [None]
    assert tune.bucket_bounds([40.0, 10.0]) == [20.0, None]  # sorted first


def test_the_order_is_decided_by_the_sum_over_model_shapes():
    us = {"kimi-k2": {"triton": 100.0, "deep_gemm": 150.0}, "step3": {"triton": 400.0, "deep_gemm": 300.0}}
    assert tune.decide_order(us) == (["deep_gemm", "triton"], {"triton": 500.0, "deep_gemm": 450.0})
    one_shape_only = {"kimi-k2": {"triton": 100.0, "deep_gemm": 50.0}, "step3": {"triton": 400.0}}
    assert tune.decide_order(one_shape_only)[0] == ["triton"]  # deep_gemm not measured on step3: left out


def test_the_regimes_make_a_valid_table_and_it_keeps_other_classes(tmp_path):
    def point(triton, deep_gemm):
        return {"us": {"kimi-k2": {"triton": triton, "deep_gemm": deep_gemm}}, "left_out": {"grouped_mm": "absent"}}

    measured = {("fp8", "contiguous", 64): point(100.0, 200.0), ("fp8", "contiguous", 4096): point(900.0, 600.0),
                ("bf16", "masked", 512): point(300.0, 310.0)}
    regimes = tune.build_regimes(measured, 48)
    assert [(r["dtype"], r["pool_format"], r["max_rows_per_expert"], r["order"]) for r in regimes] == [
        ("fp8", "contiguous", 10.67, ["triton", "deep_gemm"]), ("fp8", "contiguous", None, ["deep_gemm", "triton"]),
        ("bf16", "masked", None, ["triton", "deep_gemm"])]
    out = tmp_path / "auto_table.json"
    out.write_text(json.dumps({"format": 2, "gpu_classes": {"8.0/StandIn GPU": TABLE["gpu_classes"][CLASS] | {
        "header": header("8.0")}}}))
    markdown_path = tune.write_table({"header": header() | {"seconds": 1, "notes": ["bf16 contiguous rows 64: ..."]},
                                      "regimes": regimes}, str(out))
    table = validate_table(json.loads(out.read_text()), str(out))
    assert set(table.gpu_classes) == {"8.0/StandIn GPU", CLASS}
    assert table.gpu_classes[CLASS].regimes[1].measured["us"]["kimi-k2"]["deep_gemm"] == 600.0
    text = open(markdown_path).read()
    assert "| fp8 | contiguous | <= 10.67 | triton, deep_gemm |" in text and "- bf16 contiguous rows 64: ..." in text


def test_it_refuses_to_write_a_table_moe_ref_would_refuse(tmp_path):
    out = tmp_path / "auto_table.json"
    bad = [regime("fp8", "contiguous", 5.0, ["triton"])]  # bounded last bucket
    with pytest.raises(AutoTableError, match="must end with one unbounded bucket"):
        tune.write_table({"header": header(), "regimes": bad}, str(out))
    assert not out.exists()


def test_the_plan_times_fp8_first_and_every_shape_near_the_points_rows():
    points = tune.plan(rows=(64, 4096))
    assert len(points) == 2 * 2 * (2 + 2 + 3 + 2)  # rows x shapes x the candidates of each dtype and pool format
    assert points[0] == (("fp8", "contiguous", 64), "kimi-k2", "triton", "kimi-k2/bf16-fp8_block/T8")
    assert (("fp8", "contiguous", 64), "step3@ep1", "deep_gemm", "step3@ep1/bf16-fp8_block/T21") in points
    assert (("bf16", "contiguous", 4096), "step3@ep1", "grouped_mm", "step3@ep1/bf16/T1365") in points
    assert [p[0][:2] for p in points][::8][:4] == [("fp8", "contiguous"), ("fp8", "masked"), ("bf16", "contiguous"),
                                                   ("bf16", "contiguous")]


def test_auto_table_needs_cuda_and_install_needs_auto_table(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--auto-table", "x.json", "--skip-memory-check"]) == 2
    assert "[ENV006]" in capsys.readouterr().err
    assert main(["bench", "--install", "--skip-memory-check"]) == 2
    err = capsys.readouterr().err
    assert "[CFG015]" in err and "needs --auto-table" in err


CPU_CANDIDATES = {("bf16", "contiguous"): ("torch", "wrong"), ("bf16", "masked"): ("torch",)}


def cpu_impl(backend: str, pool_format: str) -> str:
    """The torch experts on a pool, or a planted bug (a segment read one row early) for ``wrong``."""
    from moe_ref.conformance.adapters.moe_ref_pool import pool_name

    return "mutant:pool_segment_offset" if backend == "wrong" else pool_name(backend, pool_format)


def test_the_loop_times_checked_cases_and_leaves_a_wrong_backend_out(tmp_path):
    points = tune.plan(shapes=("tiny", "tiny128"), rows=(24, 60), candidates=CPU_CANDIDATES, dtypes=("bf16",))
    lines = []
    measured, notes = tune.measure(points, "cpu", 120.0, 600.0, log=lines.append, impl_of=cpu_impl)
    assert notes == [] and sorted(measured) == [("bf16", "contiguous", 24), ("bf16", "contiguous", 60),
                                                ("bf16", "masked", 24), ("bf16", "masked", 60)]
    for point in measured.values():
        assert set(point["us"]) == {"tiny", "tiny128"}
        assert all(set(times) == {"torch"} and times["torch"] > 0 for times in point["us"].values())
    assert "FAIL" in measured[("bf16", "contiguous", 24)]["left_out"]["wrong"]
    assert any("bf16 masked     rows     60 tiny128    torch" in line for line in lines), lines
    regimes = tune.build_regimes(measured, 4)
    assert [(r["dtype"], r["pool_format"], r["max_rows_per_expert"], r["order"]) for r in regimes] == [
        ("bf16", "contiguous", 9.49, ["torch"]), ("bf16", "contiguous", None, ["torch"]),
        ("bf16", "masked", 9.49, ["torch"]), ("bf16", "masked", None, ["torch"])]


def test_the_loop_stops_at_max_seconds_and_says_what_it_left_out():
    points = tune.plan(shapes=("tiny",), rows=(24,), candidates=CPU_CANDIDATES, dtypes=("bf16",))
    measured, notes = tune.measure(points, "cpu", 120.0, 0.0, impl_of=cpu_impl)
    assert measured == {} and notes == ["bf16 contiguous rows 24: not measured (--max-seconds 0 reached)",
                                        "bf16 masked rows 24: not measured (--max-seconds 0 reached)"]


# --------------------------------------------------------------------------------------------------
# inside the routed step (the layer's path): the pool the step plans, its hint, one call per regime
# --------------------------------------------------------------------------------------------------
class LoopTriton(TorchLoopExperts):
    """The torch loop registered as "triton": real results, so the step's output can be compared; given the
    dispatcher's own layout, as the kernels are (not whole padded segments)."""
    name, segment_alignment, supports_fp8, computes_whole_segments = "triton", 1, True, False

    def __init__(self, *args, fp8=False, fp8_weights=None):
        super().__init__(*args)
        self.fp8 = self.accepts_fp8_input = False


class LoopDeepGemm(LoopTriton):
    name, segment_alignment = "deep_gemm", 128

    @classmethod
    def unavailable_reason(cls):
        return DeepGemmExperts.unavailable_reason()


def test_the_routed_step_runs_auto_per_call_regime_on_the_pool_it_plans(monkeypatch, tmp_path, sm90):
    """A layer's modular step over auto: the pool planned with auto's 128-row segments, each call's rows per expert
    choosing the backend (few rows: triton; many: deep_gemm), and the step's output the bits of the same step over
    the same loop held alone."""
    from moe_ref.core.config import preset
    from moe_ref.core.weights import MoEWeights
    from moe_ref.ep.routed_step import make_modular_step
    from moe_ref.testing import assert_bitwise_equal

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    register_experts("triton", LoopTriton)
    register_experts("deep_gemm", LoopDeepGemm)
    use_table(monkeypatch, tmp_path, {"format": 2, "about": "test", "gpu_classes": {CLASS: {"header": header(),
              "regimes": [regime("bf16", "contiguous", 2.0, ["triton", "deep_gemm"]),
                          regime("bf16", "contiguous", None, ["deep_gemm", "triton"])]}}})
    deep_gemm_usable(monkeypatch, True)
    cfg = preset("tiny-kimi-k2")  # 16 experts, top-4
    weights = MoEWeights.random(cfg, seed=1)
    gate_up, down = weights.gate_up_weight_E2FD.bfloat16(), weights.down_weight_EDF.bfloat16()
    cls = experts_class("auto", "cuda")
    assert cls.segment_alignment == 128
    auto_experts = cls(gate_up, down, cfg.activation, cfg.situ_beta, cfg.situ_linear_beta)
    plain = LoopTriton(gate_up, down, cfg.activation, cfg.situ_beta, cfg.situ_linear_beta)
    options = EPOptions.resolve(num_max_tokens_per_rank=64, alignment=cls.segment_alignment, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    with make_modular_step(cfg, None, auto_experts, options) as step, \
            make_modular_step(cfg, None, plain, options) as step_plain:
        for num_tokens, expected in ((2, "triton"), (64, "deep_gemm")):  # 8 / 16 and 256 / 16 rows per expert
            x = torch.randn(num_tokens, cfg.hidden_size, generator=gen).bfloat16()
            ids = torch.stack([torch.randperm(cfg.num_experts, generator=gen)[:cfg.num_topk] for _ in range(num_tokens)])
            w = torch.rand(num_tokens, cfg.num_topk, generator=gen)
            y = step(x, ids, w)
            assert auto_experts.last_backend == expected, num_tokens
            assert_bitwise_equal(y, step_plain(x, ids, w), num_tokens=num_tokens)
