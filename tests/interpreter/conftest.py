"""Interpreter-tier setup: run the Triton kernels on CPU (`TRITON_INTERPRET=1`) when there is no GPU.

The variable must be set before the kernel modules are decorated by `triton.jit` (Triton reads it at
decoration time). If some earlier test module already imported `moe_ref.kernels` compiled for a GPU,
the kernel modules are reloaded here so that these tests get interpreted kernels. On a CUDA machine
the same tests run on the GPU at their tiny shapes.
"""

import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

_KERNEL_MODULES = (  # dependency order
    "moe_ref.kernels.runtime._triton_utils",
    "moe_ref.kernels.runtime.launch",
    "moe_ref.kernels.runtime.fixed_tiles",
    "moe_ref.kernels.ep.pre_dispatch",
    "moe_ref.kernels.router.router_topk",
    "moe_ref.kernels.router.routing_check",
    "moe_ref.kernels.router.replica_route",
    "moe_ref.kernels.experts.gated_act",
    "moe_ref.kernels.experts.grouped_mlp",
    "moe_ref.kernels.experts.grouped_mlp_w4",
    "moe_ref.kernels",
)
if not torch.cuda.is_available() and "moe_ref.kernels.runtime._triton_utils" in sys.modules:
    if not sys.modules["moe_ref.kernels.runtime._triton_utils"].is_interpreter():
        for _name in _KERNEL_MODULES:
            if _name in sys.modules:
                importlib.reload(sys.modules[_name])

# (atol, rtol) of kernel vs twin, per output dtype. bf16/fp16 allow a few output ulps (h is rounded to
# the input dtype between the GEMMs, so one flipped rounding propagates); fp8 allows an e4m3 step of h.
TOLERANCE = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (3e-2, 2e-2),
    "fp8": (6e-2, 4e-2),
}


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def assert_close():
    """`assert_close(actual, expected, key, **case)`: tolerance from TOLERANCE[key], case in the message."""

    def check(actual: torch.Tensor, expected: torch.Tensor, key, **case) -> None:
        atol, rtol = TOLERANCE[key]
        assert actual.shape == expected.shape, f"{actual.shape=} {expected.shape=} {case=}"
        assert actual.dtype == expected.dtype, f"{actual.dtype=} {expected.dtype=} {case=}"
        a, e = actual.float().cpu(), expected.float().cpu()
        err = (a - e).abs()
        bad = err > atol + rtol * e.abs()
        bad |= a.isnan() != e.isnan()
        if bad.any():
            idx = tuple(int(i) for i in bad.nonzero()[0])
            raise AssertionError(f"{int(bad.sum())} mismatches, first at {idx}: {a[idx].item()=} {e[idx].item()=} "
                                 f"max_err={err.nan_to_num().max().item():.3g} {atol=} {rtol=} {case=}")

    return check


class DotSpy:
    """The emulated dot's call count and the stock dot (to compare against)."""

    def __init__(self, stock):
        self.stock, self.calls = stock, 0


@pytest.fixture
def row_invariant_dot(monkeypatch):
    """Under the interpreter: its ``create_dot`` with the stock dtypes (8-bit floats read as fp16, the product and
    sum in the accumulator's dtype, plus the accumulator), each output element summed over K by numpy's reduction,
    which depends on the element's own products and the tile shape only. The stock dot is ``numpy.matmul``, whose
    order of additions for a row depends on the row's place in the call, so no kernel built on it is row-invariant
    under the interpreter however fixed its tile (tests/interpreter/test_fixed_tiles.py says more). None on a GPU."""
    if torch.cuda.is_available():
        yield None
        return
    import numpy as np
    from triton.runtime import interpreter

    spy = DotSpy(interpreter.InterpreterBuilder.create_dot)

    def create_dot(builder, a, b, d, input_precision, max_num_imprecise_acc):
        spy.calls += 1
        a_data, b_data = a.data, b.data
        if (a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating()) or \
                (b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating()):
            a_data = interpreter._convert_float(a_data, a.dtype, interpreter.tl.float16, None).view(np.float16)
            b_data = interpreter._convert_float(b_data, b.dtype, interpreter.tl.float16, None).view(np.float16)
        acc_dtype = d.data.dtype
        products = a_data.astype(acc_dtype)[..., :, :, None] * b_data.astype(acc_dtype)[..., None, :, :]
        return interpreter.TensorHandle(products.sum(axis=-2, dtype=acc_dtype) + d.data, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
    yield spy
