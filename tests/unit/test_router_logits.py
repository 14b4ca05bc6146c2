"""router_logits: the gate GEMM as cuBLAS's fp32-output GEMM of the stored bf16/fp16 operands on CUDA, the fp32 twin
(router_logits_ref) elsewhere and for other operands. Its numerics on a GPU: tests/gpu/test_kernels_cuda.py
(exact where fp32 holds every sum, within the order of the fp32 additions otherwise)."""
import importlib

import pytest
import torch

from moe_ref.core.errors import ShapeError
from moe_ref.kernels.router.router_logits import router_logits, router_logits_ref

module = importlib.import_module("moe_ref.kernels.router.router_logits")  # the package re-exports a function of that name

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_on_the_cpu_it_is_the_twin_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=gen).to(dtype)
    w = torch.randn(40, 96, generator=gen).to(dtype)
    got = router_logits(x, w)
    assert got.dtype == torch.float32 and got.shape == (7, 40)
    assert torch.equal(got, router_logits_ref(x, w))


def test_only_cuda_with_torchs_fp32_output_mm_takes_the_cublas_path():
    assert not module._mm_fp32_out(torch.device("cpu"))
    assert module._mm_fp32_out(torch.device("cuda")) == module._HAS_MM_DTYPE
    assert module._HAS_MM_DTYPE == ("dtype" in torch.ops.aten.mm.overloads())


@pytest.mark.parametrize("x_dtype,w_dtype,cublas", [(torch.bfloat16, torch.bfloat16, True),
                                                    (torch.float16, torch.float16, True),
                                                    (torch.float32, torch.float32, False),
                                                    (torch.bfloat16, torch.float32, False)])
def test_16_bit_operands_of_one_dtype_go_to_cublas_others_to_the_twin(x_dtype, w_dtype, cublas, monkeypatch):
    """The choice, on the meta device (shapes and dtypes only) with the CUDA rule forced on: the cuBLAS call asks for
    an fp32 output of the stored operands; the twin's upcast GEMM takes the rest."""
    if not module._HAS_MM_DTYPE:
        pytest.skip("this torch has no mm.dtype")
    calls = []
    monkeypatch.setattr(module, "_mm_fp32_out", lambda device: True)
    monkeypatch.setattr(module, "router_logits_ref", lambda x, w: calls.append("twin") or router_logits_ref(x, w))
    x = torch.empty(5, 64, dtype=x_dtype, device="meta")
    w = torch.empty(24, 64, dtype=w_dtype, device="meta")
    got = module.router_logits(x, w)
    assert got.dtype == torch.float32 and got.shape == (5, 24)
    assert calls == ([] if cublas else ["twin"])


def test_shapes_that_do_not_match_are_a_shape_error():
    with pytest.raises(ShapeError, match="router_logits takes x"):
        router_logits(torch.zeros(3, 64, dtype=torch.bfloat16), torch.zeros(4, 32, dtype=torch.bfloat16))
