"""experts_backend="auto" with the real Triton kernels (under the interpreter on CPU): where the table ranks Triton
first, AutoExperts' output equals a TritonExperts built apart over the same weights, bitwise (bf16: the caller's
tensors; fp8: auto's one stacked copy), with and without the layer's rows hint. DeepGEMM is a stand-in (it needs
SM90) that the table ranks first for many rows per expert; the GPU tier runs the real one
(tests/gpu/test_auto_experts_cuda.py)."""
import json

import pytest
import torch

from moe_ref.experts import ExpertLayout, Experts, TritonExperts, experts_class, register_experts, registry
from moe_ref.experts import auto
from moe_ref.kernels.experts.fp8 import quantize_fp8_per_128
from moe_ref.testing import assert_bitwise_equal

pytestmark = pytest.mark.interpreter

NUM_EXPERTS, HIDDEN, INTER = 4, 128, 128


class StandInDeepGemm(Experts):
    name, segment_alignment, supports_fp8 = "deep_gemm", 128, True

    def __init__(self, *args, fp8=False, fp8_weights=None):
        super().__init__(*args)
        self.fp8 = self.accepts_fp8_input = fp8 or fp8_weights is not None

    def forward(self, x_PDx, layout, x_scale_PDb=None):
        raise AssertionError("the table ranks Triton first at these rows")


@pytest.fixture
def auto_class(monkeypatch, tmp_path):
    """The auto class of a pretend GPU class 9.0/StandIn GPU whose table ranks Triton first up to 64 rows per expert."""
    def regime(dtype, bound, order):
        return {"dtype": dtype, "pool_format": "contiguous", "max_rows_per_expert": bound, "order": order,
                "measured": {"us": {"test": {name: 1.0 for name in order}}}}

    regimes = [regime(dtype, bound, order) for dtype in ("bf16", "fp8")
               for bound, order in ((64, ["triton", "deep_gemm"]), (None, ["deep_gemm", "triton"]))]
    header = {"date": "", "gpu": "StandIn GPU", "compute_capability": "9.0", "torch": "", "triton": "", "deep_gemm": "",
              "command": "moe-ref bench --auto-table (test)"}
    path = tmp_path / "auto_table.json"
    path.write_text(json.dumps({"format": auto.TABLE_FORMAT, "gpu_classes": {"9.0/StandIn GPU": {"header": header,
                                                                                               "regimes": regimes}}}))
    monkeypatch.setattr(auto, "TABLE_PATH", path)
    monkeypatch.setattr(auto, "gpu_class_of", lambda device: "9.0/StandIn GPU")
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    register_experts("deep_gemm", StandInDeepGemm)
    cls = experts_class("auto", "cuda")
    assert cls.held_backends == ("triton", "deep_gemm") and cls.segment_alignment == 128
    return cls


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("hint", [True, False], ids=["hint", "nohint"])
def test_auto_equals_triton_bitwise_where_the_table_ranks_it_first(auto_class, fp8, hint):
    gen = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen) * HIDDEN ** -0.5).bfloat16()
    down = (torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen) * INTER ** -0.5).bfloat16()
    counts = torch.tensor([5, 0, 130, 64])  # 49.75 rows per expert: Triton's bucket
    packed = ExpertLayout.from_counts(counts, 128)
    layout = ExpertLayout(packed.row_start_e, counts, packed.num_pool_rows, 128,
                          num_rows_hint=int(counts.sum()) if hint else None)
    x_PDx = torch.randn(layout.num_pool_rows, HIDDEN, generator=gen).bfloat16()
    inputs = quantize_fp8_per_128(x_PDx) if fp8 else (x_PDx, None)

    experts = auto_class(gate_up, down, fp8=fp8)
    y_PDx = experts(inputs[0], layout, inputs[1])
    assert experts.last_backend == "triton"
    alone = TritonExperts(gate_up, down, fp8_weights=experts.fp8_weights) if fp8 else TritonExperts(gate_up, down)
    assert alone.fp8_weights is experts.fp8_weights
    assert_bitwise_equal(y_PDx, alone(inputs[0], layout, inputs[1]), fp8=fp8, hint=hint)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("probed", [(), ("fp8",), ("bf16", "fp8")], ids=["none", "fp8", "bf16+fp8"])
def test_in_the_batch_invariant_mode_auto_runs_only_backends_giving_tritons_bits(auto_class, monkeypatch, fp8,
                                                                                probed):
    """At many rows per expert the table ranks the stand-in DeepGEMM first. In the batch-invariant mode auto runs it
    only for the weights' precisions where it was probed to give Triton's bits (``gives_triton_bits``); every other
    call runs Triton, with the mode passed on to each held backend. Outside the mode the table decides."""
    monkeypatch.setattr(auto, "gives_triton_bits", lambda name, device, precision: name == "triton" or
                        precision in probed)
    gen = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen) * HIDDEN ** -0.5).bfloat16()
    down = (torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen) * INTER ** -0.5).bfloat16()
    experts = auto_class(gate_up, down, fp8=fp8)
    counts = torch.tensor([300, 0, 130, 64])  # 123.5 rows per expert: the stand-in's bucket
    packed = ExpertLayout.from_counts(counts, 128)
    layout = ExpertLayout(packed.row_start_e, counts, packed.num_pool_rows, 128, num_rows_hint=int(counts.sum()))
    x_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    assert experts.pick(x_dtype, layout) == "deep_gemm"
    experts.batch_invariant = True
    assert all(backend.batch_invariant for backend in experts.backends.values())
    shares_bits = ("fp8" if fp8 else "bf16") in probed
    assert experts.invariant_backends == (("triton", "deep_gemm") if shares_bits else ("triton",))
    assert experts.pick(x_dtype, layout) == ("deep_gemm" if shares_bits else "triton"), (fp8, probed)
    experts.batch_invariant = False
    assert not any(backend.batch_invariant for backend in experts.backends.values())
    assert experts.pick(x_dtype, layout) == "deep_gemm"


def test_tritons_bits_are_keyed_by_capability_versions_and_precision(auto_class, monkeypatch):
    """``gives_triton_bits``: the probed (compute capability, backend, its version, Triton's version, precision)
    only; Triton itself always; a CPU device never."""
    import triton

    monkeypatch.setattr(auto, "TRITON_BITS_PROBED", frozenset({((9, 0), "deep_gemm", "0.1.4", "3.6.0", "fp8")}))
    monkeypatch.setattr(StandInDeepGemm, "installed_version", classmethod(lambda cls: "0.1.4"), raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    assert auto.gives_triton_bits("deep_gemm", "cuda", "fp8") and auto.gives_triton_bits("triton", "cpu", "bf16")
    assert not auto.gives_triton_bits("deep_gemm", "cuda", "bf16")
    assert not auto.gives_triton_bits("deep_gemm", "cpu", "fp8")
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    assert not auto.gives_triton_bits("deep_gemm", "cuda", "fp8")
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert not auto.gives_triton_bits("deep_gemm", "cuda", "fp8")
    monkeypatch.setattr(StandInDeepGemm, "installed_version", classmethod(lambda cls: "0.1.5"), raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert not auto.gives_triton_bits("deep_gemm", "cuda", "fp8")
