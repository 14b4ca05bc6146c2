"""experts_backend="auto" on an SM90 GPU with DeepGEMM: under a small table written here, each regime (bf16 / fp8
weights x contiguous / masked pool x few / many rows per expert) runs the backend the table ranks first, and
AutoExperts' output equals that backend's own output bitwise (the backend built separately over the same weights:
the caller's bf16 tensors, or the one FP8 copy auto made); DeepGEMM holds the shared tensors, not a copy.

Skipped, with ``deep_gemm_status().reason``, where DeepGEMM is not usable (auto would hold Triton alone there).
    python -m pytest -q -rs -m cuda tests/gpu/test_auto_experts_cuda.py
The first call of each shape JIT-compiles DeepGEMM kernels and autotunes Triton's (seconds each).
"""
import json

import pytest
import torch

from moe_ref.ep.options import EPOptions
from moe_ref.experts import ExpertLayout, experts_class, make_experts
from moe_ref.experts import auto
from moe_ref.experts.auto import AutoExperts
from moe_ref.experts.deep_gemm.probe import deep_gemm_status
from moe_ref.kernels.experts.fp8 import quantize_fp8_per_128
from moe_ref.testing import assert_bitwise_equal, sync_debug_mode

pytestmark = pytest.mark.cuda

NUM_EXPERTS, HIDDEN, INTER = 4, 512, 256
FEW, MANY = 8, 200  # rows per expert on either side of the table's bound (16)


def _regimes(dtype: str) -> list[dict]:
    """Contiguous: Triton for few rows, DeepGEMM for many; masked: the other way round (each backend runs in each
    pool format)."""
    def regime(pool_format, bound, order):
        return {"dtype": dtype, "pool_format": pool_format, "max_rows_per_expert": bound, "order": order,
                "measured": {"routed_rows": 0, "rows_per_expert": 0,
                             "us": {"test": {name: 1.0 for name in order}}}}

    return [regime("contiguous", 16, ["triton", "deep_gemm"]), regime("contiguous", None, ["deep_gemm", "triton"]),
            regime("masked", 16, ["deep_gemm", "triton"]), regime("masked", None, ["triton", "deep_gemm"])]


@pytest.fixture
def table(monkeypatch, tmp_path):
    status = deep_gemm_status()
    if not status.available:
        pytest.skip(f"deep_gemm not usable here (optional backend): {status.reason}")
    major, minor = torch.cuda.get_device_capability()
    gpu_class = auto.gpu_class_of("cuda")
    header = {"date": "test", "gpu": torch.cuda.get_device_name(), "compute_capability": f"{major}.{minor}",
              "torch": "", "triton": "", "deep_gemm": status.version, "command": "moe-ref bench --auto-table (test)"}
    path = tmp_path / "auto_table.json"
    path.write_text(json.dumps({"format": auto.TABLE_FORMAT, "gpu_classes": {gpu_class: {
        "header": header, "regimes": _regimes("bf16") + _regimes("fp8")}}}))
    monkeypatch.setattr(auto, "TABLE_PATH", path)


@pytest.fixture(scope="module")
def weights():
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=gen) * HIDDEN ** -0.5).bfloat16()
    down = (torch.randn(NUM_EXPERTS, HIDDEN, INTER, device="cuda", generator=gen) * INTER ** -0.5).bfloat16()
    return gate_up, down


def _pool(rows_per_expert: int, masked: bool) -> tuple[torch.Tensor, ExpertLayout]:
    """Uneven counts around ``rows_per_expert`` (one expert empty), rows in a 128-aligned or masked pool, with the
    layer's static rows hint; noise everywhere, padding included."""
    counts = [rows_per_expert * 2, 0, rows_per_expert, rows_per_expert + 1]
    num_rows_e = torch.tensor(counts, device="cuda")
    if masked:
        max_rows = -(-max(counts) // 128) * 128
        layout = ExpertLayout(torch.arange(NUM_EXPERTS, device="cuda") * max_rows, num_rows_e, NUM_EXPERTS * max_rows,
                              128, num_rows_hint=sum(counts), masked_rows=max_rows)
    else:
        packed = ExpertLayout.from_counts(num_rows_e, 128)
        layout = ExpertLayout(packed.row_start_e, num_rows_e, packed.num_pool_rows, 128, num_rows_hint=sum(counts))
    gen = torch.Generator(device="cuda").manual_seed(rows_per_expert)
    return torch.randn(layout.num_pool_rows, HIDDEN, device="cuda", generator=gen).bfloat16(), layout


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("masked", [False, True], ids=["contiguous", "masked"])
@pytest.mark.parametrize("rows_per_expert", [FEW, MANY])
def test_auto_runs_the_backend_the_table_ranks_first_bitwise(table, weights, fp8, masked, rows_per_expert):
    experts = make_experts("auto", *weights, fp8=fp8)
    assert isinstance(experts, AutoExperts) and set(experts.backends) >= {"triton", "deep_gemm"}, experts.left_out
    expected = {(False, FEW): "triton", (False, MANY): "deep_gemm", (True, FEW): "deep_gemm",
                (True, MANY): "triton"}[(masked, rows_per_expert)]
    x_PDx, layout = _pool(rows_per_expert, masked)
    inputs = quantize_fp8_per_128(x_PDx) if fp8 else (x_PDx, None)
    y_PDx = experts(inputs[0], layout, inputs[1])
    case = dict(fp8=fp8, masked=masked, rows_per_expert=rows_per_expert, backend=expected)
    assert experts.last_backend == expected, case
    alone = make_experts(expected, *weights, fp8_weights=experts.fp8_weights)  # the same weights, built apart
    assert_bitwise_equal(y_PDx, alone(inputs[0], layout, inputs[1]), **case)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("masked", [False, True], ids=["contiguous", "masked"])
@pytest.mark.parametrize("rows_per_expert", [FEW, MANY])
def test_a_call_with_the_rows_hint_does_not_synchronize(table, weights, fp8, masked, rows_per_expert):
    """With the layer's static rows hint, no backend auto picks makes the host wait for the GPU (torch's sync debug
    mode raises on a synchronizing call made through torch: a read of a device value, a blocking copy). An eager
    prefill call profiled on an H200 left the GPU idle ~240 us per call (docs/RESULTS.md, 2026-12-02 fifth)."""
    experts = make_experts("auto", *weights, fp8=fp8)
    x_PDx, layout = _pool(rows_per_expert, masked)
    inputs = quantize_fp8_per_128(x_PDx) if fp8 else (x_PDx, None)
    expected = experts(inputs[0], layout, inputs[1]).clone()  # the first call compiles and autotunes (synchronizes)
    torch.cuda.synchronize()
    with sync_debug_mode("error"):
        got = experts(inputs[0], layout, inputs[1])
    torch.cuda.synchronize()
    assert_bitwise_equal(got, expected, fp8=fp8, masked=masked, backend=experts.last_backend)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_deep_gemm_holds_the_shared_weights(table, weights, fp8):
    experts = make_experts("auto", *weights, fp8=fp8)
    deep_gemm = experts.backends["deep_gemm"]
    gate_up_weight, down_weight = deep_gemm._gate_up_weight, deep_gemm._down_weight
    if fp8:
        shared = experts.fp8_weights
        assert gate_up_weight[0] is shared.gate_up_fp8_e2FD and down_weight[1] is shared.down_scale_eDbFb
        assert experts.backends["triton"].fp8_weights is shared and shared.gate_up_interleaved
        assert deep_gemm.gate_up_interleaved
    else:
        assert gate_up_weight.untyped_storage().data_ptr() == weights[0].untyped_storage().data_ptr()
        assert down_weight.untyped_storage().data_ptr() == weights[1].untyped_storage().data_ptr()


def test_the_layer_plans_the_auto_pool(table):
    options = EPOptions.resolve(experts_backend="auto", device="cuda")
    assert (options.experts_backend, options.alignment) == ("auto", 128)
    assert experts_class("auto", "cuda").held_backends == ("triton", "deep_gemm")
    assert options.fingerprint()["experts_backend"] == "auto (triton+deep_gemm)"
