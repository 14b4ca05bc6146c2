"""Helpers for tests and benchmarks, shipped with the package so users can check their own stacks.

- ``calc_diff(x, y)``: scale-free difference ``1 - 2*sum(x*y) / sum(x*x + y*y)`` in float64 (0 = equal).
- ``assert_close(actual, expected, dtype, **case)``: one tolerance table per dtype; the message carries
  every case parameter. ``CALC_DIFF_TOLERANCES``: the bound on ``calc_diff`` per dtype.
- ``assert_bitwise_equal(a, b, **case)``: exact equality, reporting the first mismatching coordinate.
- ``count_bytes(*tensors)``, ``bench(fn)`` (CUDA-event timing with L2 flush; wall clock on CPU).
- ``graphed(fn, *static_inputs)``: ``fn`` captured once in a CUDA graph, replayed with new inputs copied in.
- ``sync_debug_mode(mode)``: torch's CUDA sync debug mode (``"error"``: any host sync raises) inside a ``with``.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch

# (atol, rtol) per dtype of the compared outputs.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float8_e4m3fn: (1e-1, 1e-1),
}

# calc_diff bound per dtype of the compared path, for whole-layer comparisons in low precision where an
# elementwise tolerance would flag single bf16 roundings of large values (a path that differs only by
# rounding lands orders of magnitude below these; a wrong expert or slot lands near 1e-1).
CALC_DIFF_TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 1e-9,
    torch.float16: 1e-5,
    torch.bfloat16: 1e-4,
    # The FP8 recipe (x per 128 columns, weights per 128x128, h re-quantized): four roundings, measured
    # 2.0-2.15e-3 against the exact reference on CPU and H200; FP8 dispatch alone measured ~0.7e-3.
    torch.float8_e4m3fn: 4e-3,
}


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    denominator = (x * x + y * y).sum()
    if denominator == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denominator)


def _case(case: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in case.items())


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, **case) -> None:
    """``torch.testing.assert_close`` with the tolerance of ``dtype`` (default: ``expected.dtype``)."""
    atol, rtol = TOLERANCES[dtype or expected.dtype]
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}; {_case(case)}"
    try:
        torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)
    except AssertionError as err:
        raise AssertionError(f"{_case(case)}\n{err}") from None


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, **case) -> None:
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}; {_case(case)}"
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != {expected.dtype}; {_case(case)}"
    same = (actual.view(torch.uint8) == expected.view(torch.uint8)) if actual.numel() else torch.ones(0, dtype=torch.bool)
    if not bool(same.all()):
        first = (~same).nonzero()[0].tolist()
        raise AssertionError(f"not bitwise equal: first mismatch at byte index {first}; "
                             f"{int((~same).sum())} bytes differ; {_case(case)}")


def count_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def bench(fn: Callable[[], object], *, warmup: int = 5, iters: int = 20, flush_l2: bool = True,
          host_ahead: bool = False) -> float:
    """Median time of ``fn()`` in microseconds (CUDA events + L2 flush on GPU, wall clock on CPU).

    ``host_ahead``: queue the timed calls back to back (no sync between them, as a model queues its layers), so each
    call's events time its GPU work; by default each call starts on an idle GPU, so a call whose host work outlasts
    its kernels is timed by its host work."""
    if not torch.cuda.is_available():
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
        return sorted(times)[len(times) // 2]
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda") if flush_l2 else None
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(iters):
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        if not host_ahead:
            torch.cuda.synchronize()
        events.append((start, end))
    torch.cuda.synchronize()
    times = [start.elapsed_time(end) * 1e3 for start, end in events]
    return sorted(times)[len(times) // 2]


def graphed(fn: Callable[..., object], *static_inputs: torch.Tensor, warmups: int = 2) -> Callable[..., object]:
    """``fn(*static_inputs)`` captured once in a ``torch.cuda.CUDAGraph``, after ``warmups`` calls on a side stream
    (which compile and tune its kernels outside the capture, as torch's CUDA-graph docs do).

    Returns:
        ``replay(*inputs)``: copies each input into its static tensor, replays, and returns the captured output
        (the same tensor every call: clone it to keep one).
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn(*static_inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static_inputs)

    def replay(*inputs: torch.Tensor):
        for static, given in zip(static_inputs, inputs):
            static.copy_(given)
        graph.replay()
        return out

    return replay


@contextlib.contextmanager
def sync_debug_mode(mode: str):
    """``torch.cuda.set_sync_debug_mode(mode)`` inside the ``with`` (``"error"``: a synchronizing CUDA call raises;
    ``"warn"``: it warns), the previous mode restored after, also on an exception."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)
