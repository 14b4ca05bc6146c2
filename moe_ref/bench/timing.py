"""Timers the benchmark scripts share: `bench_us` (triton's do_bench, L2 flushed before every repetition, median),
`time_rounds` (every path timed in rounds of alternating order), `kernel_us` (the profiler's GPU kernel time of a
call, L2 flushed by a fill that is not counted), `kernel_table` / `gpu_kernels` / `runtime_calls` (where a call's
time goes), `measure_anchors` (HBM copy bandwidth and the bf16 GEMM peak), and for back-to-back eager calls
`host_and_wall_us`, `cprofile_text` and the CUDA runtime API names counted per call (`RUNTIME_KINDS`).
"""
from __future__ import annotations

import cProfile
import io
import pstats
import time
from typing import Callable

import torch

from moe_ref.bench.ranks import barrier

# runtime API names (CUDA runtime and driver) counted per eager call
RUNTIME_KINDS = {
    "kernel launches": ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC"),
    "synchronizations": ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"),
    "copies (memcpy)": ("cudaMemcpyAsync", "cudaMemcpy"),
}


def bench_us(fn: Callable[[], object], quick: bool, search: bool = False) -> float:
    """Median us per call of ``fn()`` by ``triton.testing.do_bench`` (L2 flushed before each repetition); ``quick``
    and ``search`` (a tuner search's brief look at each config) time shorter."""
    import triton.testing

    # do_bench flushes L2 before every repetition and returns the median in ms (warmup/rep in ms of GPU time);
    # a search times each config shorter still
    warmup, rep = (5, 20) if search else (10, 50) if quick else (25, 200)
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3


def time_rounds(paths: list[tuple[str, Callable[[], object]]], rounds: int,
                time_path: Callable[[str, Callable[[], object]], tuple[float, str]]
                ) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Time every path ``rounds`` times, every other round in reverse order, so that a GPU slowing down (or warming up)
    over the run favours no path. Returns ({name: us of each round}, {name: how it was timed}); a row takes the
    fastest round. Example: paths a, b and 3 rounds run a b, b a, a b."""
    per_round: dict[str, list[float]] = {name: [] for name, _ in paths}
    timing_of: dict[str, str] = {}
    for round_index in range(rounds):
        for name, fn in paths if round_index % 2 == 0 else paths[::-1]:
            us, timing_of[name] = time_path(name, fn)
            per_round[name].append(us)
    return per_round, timing_of


def kernel_us(fn: Callable[[], object], quick: bool) -> tuple[float, dict[str, float]]:
    """(us per call, {kernel name: us per call}, largest first): the GPU time of the kernels ``fn`` launches, summed,
    from the profiler (as DeepGEMM's own tests time its kernels), L2 flushed before each call by a 256 MB float64
    fill.

    The fill's kernel is told apart by its exact name, seen in a profile of the fill alone; a call that launches a
    kernel of that very name raises (its time could not be told apart) rather than be undercounted."""
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(256 * 1024 * 1024 // 8, dtype=torch.float64, device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        flush.fill_(1.0)
        torch.cuda.synchronize()
    flush_names = {event.name for event in prof.events() if _device(event) == "CUDA"}
    calls = 10 if quick else 30
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.fill_(1.0)
            fn()
        torch.cuda.synchronize()
    per_kernel = kernels_without_flush(prof.events(), flush_names, calls)
    return sum(per_kernel.values()), per_kernel


def kernels_without_flush(events, flush_names: set[str], calls: int) -> dict[str, float]:
    """``{kernel name: GPU us per call}``, largest first, of a profile's CUDA events over ``calls`` calls, each after
    one L2 flush whose kernels are named ``flush_names``; those are left out. Raises when the flush's kernels appear
    more often than once per call (the call launches one of them: its time cannot be told apart) or no other
    kernel ran.

    Example: two calls, the flush kernel "fill"; events fill 80, A 10, fill 80, A 12 -> {"A": 11.0}."""
    kernels = [event for event in events if _device(event) == "CUDA"]
    flushes = sum(event.name in flush_names for event in kernels)
    per_kernel = _us_per_call([event for event in kernels if event.name not in flush_names], calls)
    if flushes != calls * len(flush_names):
        raise RuntimeError(f"the call launches the L2 flush's own kernel ({sorted(flush_names)}): its kernel time "
                           "cannot be told apart")
    if not per_kernel:
        raise RuntimeError("the profiler saw no kernel of the call")
    return per_kernel


def kernel_table(fn: Callable[[], object], calls: int = 10) -> tuple[dict[str, float], float, dict[str, list[float]]]:
    """Where a row's time goes (``--kernel-table``; torch profiler, ``calls`` calls back to back, no L2 flush):
    ``gpu_kernels``'s kernels and GPU span from a profile of the GPU, then ``runtime_calls`` from a second profile with
    the CPU recorded too."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    profiles = []
    for activities in ([ProfilerActivity.CUDA], [ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        with profile(activities=activities) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        profiles.append(prof.events())
    return (*gpu_kernels(profiles[0], calls), runtime_calls(profiles[1], calls))


def _device(event) -> str:
    return str(getattr(event, "device_type", "")).rsplit(".", 1)[-1]  # DeviceType.CUDA -> CUDA


def _us_per_call(kernel_events, calls: int) -> dict[str, float]:
    """``{kernel name: summed GPU us / calls}`` of device events (each event's own span: the kernel's run time),
    largest first, not rounded."""
    table: dict[str, float] = {}
    for event in kernel_events:
        table[event.name] = table.get(event.name, 0.0) + event.time_range.elapsed_us() / calls
    return dict(sorted(table.items(), key=lambda item: -item[1]))


def gpu_kernels(events, calls: int) -> tuple[dict[str, float], float]:
    """``({kernel name: GPU us per call}, GPU span us per call)`` of a profile's CUDA events over ``calls`` calls.

    Kernels come largest first. The span runs from the first kernel's start to the last one's end, divided by
    ``calls``. What it holds beyond the kernels' sum is the GPU waiting between them, for the host or for a copy.

    Example: two calls, kernels A at [0, 10) and [30, 40), B at [10, 20) and [40, 50) us ->
    ({"A": 10.0, "B": 10.0}, 25.0): 20 us of kernels per call in a 25 us span.
    """
    kernels = [event for event in events if _device(event) == "CUDA"]
    span = (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)) / calls \
        if kernels else 0.0
    return {name: round(us, 1) for name, us in _us_per_call(kernels, calls).items()}, round(span, 1)


def runtime_calls(events, calls: int) -> dict[str, list[float]]:
    """``{CUDA runtime/driver call: [calls per call, host us per call]}`` of a profile's CPU events over ``calls``
    calls, most host time first. A ``cudaFree``, ``cudaMalloc``, ``cudaStreamSynchronize`` or ``cudaMemcpy`` in an
    eager call is where its host can wait on the GPU. The profile's own closing ``cudaDeviceSynchronize`` is left out.
    """
    found: dict[str, list[float]] = {}
    for event in events:
        if _device(event) == "CPU" and event.name.startswith("cu") and event.name != "cudaDeviceSynchronize":
            entry = found.setdefault(event.name, [0.0, 0.0])
            entry[0] += 1 / calls
            entry[1] += event.time_range.elapsed_us() / calls
    return {name: [round(n, 2), round(us, 1)] for name, (n, us) in sorted(found.items(), key=lambda item: -item[1][1])}


def measure_anchors(quick: bool) -> dict:
    """HBM copy bandwidth (read + write) and bf16 matmul peak, measured now on this GPU."""
    numel = (2 << 30) // 2
    src = torch.empty(numel, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    copy_us = bench_us(lambda: dst.copy_(src), quick)
    del src, dst
    a = torch.randn(8192, 8192, device="cuda").bfloat16()
    b = torch.randn(8192, 8192, device="cuda").bfloat16()
    gemm_us = bench_us(lambda: a @ b, quick)
    del a, b
    return {"hbm_bytes_per_s": 2 * numel * 2 / (copy_us * 1e-6), "bf16_flops_per_s": 2 * 8192**3 / (gemm_us * 1e-6),
            "copy_us": copy_us, "gemm_8192_us": gemm_us}


def roofline_s(bytes_moved: float, flops: float, anchors: dict, fp8: bool = False) -> tuple[float, str]:
    """(seconds, bound): the least time ``bytes_moved`` and ``flops`` take on the GPU of ``anchors``
    (``measure_anchors``): max(bytes / HBM copy bandwidth, FLOPs / bf16 GEMM peak, doubled for ``fp8``: an estimate),
    and which of the two bounds it ("memory" or "compute").

    Example: 3e9 bytes and 4e11 FLOPs on 3e12 B/s and 8e14 FLOP/s -> (1e-3, "memory")."""
    memory_s = bytes_moved / anchors["hbm_bytes_per_s"]
    compute_s = flops / (anchors["bf16_flops_per_s"] * (2 if fp8 else 1))
    return max(memory_s, compute_s), "memory" if memory_s > compute_s else "compute"


def host_and_wall_us(fn, inputs, calls: int) -> tuple[float, float]:
    """(host us per call until the calls return, wall us per call until the GPU is done)."""
    barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn(*inputs)
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return host / calls * 1e6, wall / calls * 1e6


def cprofile_text(fn, inputs, calls: int, rank: int) -> str:
    """cProfile of ``calls`` eager calls on rank 0 (the others run them unprofiled): the top functions by cumulative
    and by own time, every moe_ref function, and the callers of the calls that can synchronize."""
    profiler = cProfile.Profile() if rank == 0 else None
    barrier()
    if profiler:
        profiler.enable()
    for _ in range(calls):
        fn(*inputs)
    torch.cuda.synchronize()
    if not profiler:
        return ""
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats(45)
    stats.sort_stats("tottime").print_stats(60)
    stats.sort_stats("cumulative").print_stats("moe_ref", 120)  # every moe_ref function a call runs
    stats.print_callers("synchronize|tolist|item|all_reduce|all_gather|_run|run\\b")
    return text.getvalue()
