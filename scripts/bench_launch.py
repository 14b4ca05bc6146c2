#!/usr/bin/env python
"""Host cost of one Triton launch, by path: Triton's own launcher against moe_ref's bound launch.

    PYTHONPATH=. python3 scripts/bench_launch.py --out results/launch

Rows (us of host time per call, back-to-back calls; the GPU work is a few us and runs behind):
- ``triton``: ``kernel[grid](...)`` (Triton binds and specializes every argument each call);
- ``bound``: ``moe_ref.kernels.runtime.launch.launch(kernel, grid, ...)`` once its key is bound (what moe_ref's kernels use);
- ``compiled run``: the compiled kernel's launcher object called directly with prepared arguments (Triton's floor);
- ``C launcher, addresses`` (Triton 3.6): the C launcher behind that object, tensors passed as their addresses (what
  a bound launch calls there: the floor of moe_ref's path);
- public wrappers, bound launches on and off (``launch.bound_launches``): ``router_topk`` (Kimi-K2's 384 experts,
  T = 16) and ``routing_check`` (the argument checks, allocations and the launch a layer call pays);
- ``grouped_mlp`` (its two GEMMs loading tiles through host TMA descriptors, a small decode shape, tiles forced):
  bound launches off, bound with the descriptors encoded at every launch (Triton 3.6's launcher wrapper, as before
  the bound path kept encodings), and bound as shipped (each descriptor encoded once per base address);
- anchors: ``torch.add`` of two small tensors and ``torch.empty`` (a torch op's host cost on this host).
Writes ``bench_launch.json`` and ``bench_launch.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moe_ref.kernels.runtime import launch as bound_launch  # noqa: E402
from moe_ref.kernels.router.router_topk import router_topk  # noqa: E402
from moe_ref.kernels.router.routing_check import routing_check  # noqa: E402


@triton.jit
def _sixteen_args_kernel(a, b, c, d, e, f, g, h, n, m, s0, s1, s2, alpha, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    value = tl.load(a + offs, mask=mask) + tl.load(b + offs, mask=mask)
    if FLAG:
        value = value * alpha
    tl.store(c + offs, value, mask=mask)


def host_us(fn, calls: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return round(host, 2)


def grouped_mlp_rows(calls: int) -> dict[str, float]:
    """Host us per ``grouped_mlp`` call (8 experts, D = F = 256, 2 rows each: a few us of GPU work), by launch path."""
    from moe_ref.kernels.experts import grouped_mlp_tiles as tiles
    from moe_ref.kernels.experts.grouped_mlp import grouped_mlp, tma_unavailable_reason

    if tma_unavailable_reason() is not None:
        return {}
    gen = torch.Generator(device="cuda").manual_seed(0)
    experts, width = 8, 256
    gate_up = torch.randn(experts, 2 * width, width, device="cuda", generator=gen).bfloat16()
    down = torch.randn(experts, width, width, device="cuda", generator=gen).bfloat16()
    num_rows_e = torch.full((experts,), 2, dtype=torch.int32, device="cuda")
    row_start_e = torch.arange(0, 2 * experts, 2, dtype=torch.int64, device="cuda")
    x = torch.randn(2 * experts, width, device="cuda", generator=gen).bfloat16()
    tile = tiles.config_of_tile((16, 64, 128, 4, 4))

    def call():
        grouped_mlp(x, gate_up, down, row_start_e, num_rows_e, num_rows_hint=2 * experts, configs=(tile, tile))

    rows = {}
    with bound_launch.bound_launches(False):
        rows["grouped_mlp, triton"] = host_us(call, calls)
    # the bound path as it was before it kept encodings: Triton's wrapper encodes each descriptor at every launch
    bound_launch.clear_bound_kernels()
    with bound_launch.descriptor_encodings(False):
        rows["grouped_mlp, bound, descriptors encoded per launch"] = host_us(call, calls)
    bound_launch.clear_bound_kernels()
    rows["grouped_mlp, bound"] = host_us(call, calls)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="results/launch")
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_launch: needs a CUDA GPU", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    tensors = [torch.randn(1024, device="cuda") for _ in range(8)]
    kernel_args = (*tensors, 1000, 7, 16, 32, 3, 2.0)
    options = dict(BLOCK=1024, FLAG=True)
    compiled = _sixteen_args_kernel[(1,)](*kernel_args, **options)
    stream = triton.runtime.driver.active.get_current_stream(torch.cuda.current_device())
    every_arg = (*kernel_args, 1024, True)
    rows = {
        "triton": host_us(lambda: _sixteen_args_kernel[(1,)](*kernel_args, **options), args.calls),
        "bound": host_us(lambda: bound_launch.launch(_sixteen_args_kernel, (1,), *kernel_args, **options), args.calls),
        "compiled run": host_us(lambda: compiled.run(1, 1, 1, stream, compiled.function, compiled.packed_metadata,
                                                     None, None, None, *every_arg), args.calls),
    }
    launcher = compiled.run
    if hasattr(launcher, "launch_pdl") and triton.__version__.startswith("3.6"):
        # what a bound launch calls on Triton 3.6: the C launcher, tensors passed as their addresses
        addresses = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in every_arg)
        flags = (launcher.launch_cooperative_grid, launcher.launch_pdl, None, None, compiled.packed_metadata,
                 None, None, None)
        rows["C launcher, addresses"] = host_us(lambda: launcher.launch(1, 1, 1, stream, compiled.function, *flags,
                                                                        *addresses), args.calls)
    logits = torch.randn(16, 384, device="cuda")
    bias = torch.randn(384, device="cuda")
    ids, weights = router_topk(logits, 8, "sigmoid", bias, 8, 4, True, 2.827)
    for on in (True, False):
        label = "bound" if on else "triton"
        with bound_launch.bound_launches(on):
            rows[f"router_topk, {label}"] = host_us(lambda: router_topk(logits, 8, "sigmoid", bias, 8, 4, True, 2.827),
                                                    args.calls)
            rows[f"routing_check, {label}"] = host_us(lambda: routing_check(ids, weights, 384), args.calls)
    rows.update(grouped_mlp_rows(args.calls))
    rows["torch.add (anchor)"] = host_us(lambda: torch.add(tensors[0], tensors[1], out=tensors[3]), args.calls)
    rows["torch.empty (anchor)"] = host_us(lambda: torch.empty(1024, device="cuda"), args.calls)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
            "command": "python3 scripts/bench_launch.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    with open(os.path.join(args.out, "bench_launch.json"), "w") as f:
        json.dump({"meta": meta, "host_us_per_call": rows}, f, indent=1)
    lines = [f"# Host cost per Triton launch ({meta['device']}, torch {meta['torch']}, triton {meta['triton']}, "
             f"{meta['date']})", "", f"`{meta['command']}`", "", "| path | host us per call |", "|---|---:|"]
    lines += [f"| {name} | {us:.1f} |" for name, us in rows.items()]
    with open(os.path.join(args.out, "bench_launch.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
