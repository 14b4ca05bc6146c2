"""Bench + correctness of the CUDA grouped W4A16 prototype (w4_gemm.cu) vs the repo's Triton kernel and bf16.

    python3 scripts/proto_w4_cuda/bench.py --out DIR     (from the repo root, one H200)

Per shape (gate_up N 4096 K 7168, down N 7168 K 2048) and row total (512, 4096; random per-expert counts, expert 0
forced empty): every kernel of w4_layout.KERNELS vs an fp32 reference on the exactly dequantized weights (calc_diff,
max abs; exit 1 if a CUDA calc_diff > 1e-4), then CUDA-graph timings (20 launches per graph) of each CUDA kernel, the
Triton `launch_w4_gemm` on the same weights, bf16 `torch._grouped_mm` (or a per-expert matmul loop) on the
dequantized bf16 weights, and a 1 GiB device copy. Writes DIR/proto_w4_cuda.json, prints a markdown table.
--dry-run: CPU only (argument parsing, the counts, the reference on tiny shapes).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repo root (moe_ref)
from w4_layout import DIAGNOSTIC, KERNELS, KTILE, RCHUNK, block_n, prepare, smem_bytes  # noqa: E402

E = 48
SHAPES = {"gate_up": (4096, 7168), "down": (7168, 2048)}
ROW_TOTALS = (512, 4096)
ITERS = 20
T0 = time.time()


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def calc_diff(a, b):
    a, b = a.double(), b.double()
    return (1 - 2 * (a * b).sum() / ((a * a).sum() + (b * b).sum())).item()


def make_counts(total, gen, device):
    idx = torch.randint(0, E, (total,), generator=gen)
    counts = torch.bincount(idx, minlength=E)
    counts[1] += counts[0]  # expert 0 empty: its CTAs must exit
    counts[0] = 0
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)[:-1]])
    return counts.int().to(device), starts.int().to(device), counts.tolist(), starts.tolist()


def reference(x, codes, scales, counts, starts):
    """fp32 x @ W_e^T with W_e = (code - 8) * scale exactly (fp32), per expert."""
    out = torch.zeros(x.shape[0], codes.shape[1], dtype=torch.float32, device=x.device)
    for e, (c, s) in enumerate(zip(counts, starts)):
        if c:
            w = (codes[e].float() - 8) * scales[e].float().repeat_interleave(32, -1)
            out[s:s + c] = x[s:s + c].float() @ w.T
    return out


class CudaKernels:
    def __init__(self):
        import cupy
        self.cupy = cupy
        cubin = os.path.join(HERE, "w4_gemm.cubin")
        self.source = "cubin"
        try:
            self.module = cupy.RawModule(path=cubin)
            self.module.get_function(next(iter(KERNELS)))
        except Exception as exc:  # noqa: BLE001
            log(f"cubin failed to load ({exc!r}); compiling w4_gemm.cu")
            code = open(os.path.join(HERE, "w4_gemm.cu")).read()
            try:
                self.module = cupy.RawModule(code=code, options=("-arch=sm_90a", "-std=c++17"), backend="nvcc")
                self.source = "nvcc"
            except Exception as exc2:  # noqa: BLE001
                log(f"nvcc backend failed ({exc2!r}); nvrtc")
                self.module = cupy.RawModule(code=code, options=("-arch=sm_90a", "-std=c++17"), backend="nvrtc")
                self.source = "nvrtc"
        self.funcs = {}
        for name in KERNELS:
            f = self.module.get_function(name)
            try:
                f.max_dynamic_shared_size_bytes = smem_bytes(name)
            except Exception as exc:  # noqa: BLE001
                log(f"{name}: cannot raise dynamic smem to {smem_bytes(name)} ({exc!r})")
            self.funcs[name] = f

    def launch(self, name, prep, x, out, starts_dev, counts_dev, n, k, zsplit):
        warps = KERNELS[name][0]
        grid = (n // block_n(name), E, zsplit)
        args = (np.uint64(prep["w"].data_ptr()), np.uint64(prep["s"].data_ptr()), np.uint64(x.data_ptr()),
                np.uint64(out.data_ptr()), np.uint64(starts_dev.data_ptr()), np.uint64(counts_dev.data_ptr()),
                np.int32(n), np.int32(k), np.int32(x.stride(0)), np.int32(out.stride(0)), np.int32(zsplit))
        with self.cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            self.funcs[name](grid, (warps * 32,), args, shared_mem=smem_bytes(name))


def time_fn(fn):
    """us per call: CUDA graph of ITERS calls, best of 5 replays (eager fallback if capture fails)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(ITERS):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        run, mode = graph.replay, "graph"
    except Exception as exc:  # noqa: BLE001
        log(f"graph capture failed ({exc!r}); timing eager launches")
        torch.cuda.synchronize()

        def run():
            for _ in range(ITERS):
                fn()
        mode = "eager"
    best = math.inf
    for _ in range(5):
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / ITERS)
    return best, mode


def bf16_anchor(x, wbf, counts_list, counts_dev, starts_list):
    """torch._grouped_mm (x [P,K], W^T [E,K,N], offs = cumulative counts) or a per-expert matmul loop."""
    offs = torch.cumsum(counts_dev, 0).int()
    if hasattr(torch, "_grouped_mm"):
        try:
            wt = wbf.transpose(-2, -1)
            y = torch._grouped_mm(x, wt, offs=offs)
            return (lambda: torch._grouped_mm(x, wt, offs=offs)), y, "_grouped_mm"
        except Exception as exc:  # noqa: BLE001
            log(f"_grouped_mm failed ({exc!r}); per-expert loop")
    out = torch.empty(x.shape[0], wbf.shape[1], dtype=torch.bfloat16, device=x.device)

    def loop():
        for e, (c, s) in enumerate(zip(counts_list, starts_list)):
            if c:
                torch.matmul(x[s:s + c], wbf[e].T, out=out[s:s + c])
        return out
    return loop, loop(), "matmul loop"


def run_gpu(args):
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    results, failures = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}, []
    # HBM anchor
    a = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    time_fn(lambda: b.copy_(a))  # a first pass while the clocks come up
    us, _ = time_fn(lambda: b.copy_(a))
    results["copy_1GiB"] = {"us": us, "tbps": 2 * a.numel() / us / 1e6}
    log(f"copy 1 GiB: {us:.1f} us, {2 * a.numel() / us / 1e6:.2f} TB/s (read + write)")
    del a, b
    kernels = CudaKernels()
    results["cuda_source"] = kernels.source
    log(f"CUDA kernels loaded from {kernels.source}")
    try:
        from moe_ref.kernels.grouped_mlp_w4 import launch_w4_gemm, tuned_tiles
        from moe_ref.kernels.w4 import group_major_scales, W4Weight, _plane_words
    except Exception as exc:  # noqa: BLE001
        log(f"Triton path unavailable ({exc!r})")
        launch_w4_gemm = None
    names = [n for n in KERNELS if not args.kernels or n in args.kernels]
    for shape, (n, k) in SHAPES.items():
        codes = torch.randint(0, 16, (E, n, k), dtype=torch.uint8, device=dev)
        scales = (torch.rand(E, n, k // 32, device=dev) * 0.02 + 0.002).to(torch.bfloat16)
        preps = {bn: prepare(codes, scales, bn) for bn in sorted({block_n(nm) for nm in names})}
        wbf = ((codes.to(torch.bfloat16) - 8) * scales.repeat_interleave(32, -1))  # bf16 anchor weights (rounded)
        tri = None
        if launch_w4_gemm is not None:
            words = torch.empty(E, n, k // 8, dtype=torch.int32, device=dev)
            for e in range(E):
                words[e] = _plane_words(codes[e], "int4")
            tri = W4Weight("int4", words, group_major_scales(scales, k), k)
        log(f"{shape}: weights ready (N={n}, K={k})")
        for total in ROW_TOTALS:
            counts_dev, starts_dev, counts, starts = make_counts(total, gen, dev)
            active = sum(1 for c in counts if c)
            wbytes = active * (n * k // 2 + n * (k // 32) * 2)
            x = torch.randn(total, k, device=dev).to(torch.bfloat16)
            ref = reference(x, codes, scales, counts, starts)
            zsplit = max(1, math.ceil(total / E / RCHUNK))
            case = f"{shape} rows={total} (max/expert {max(counts)}, zsplit {zsplit})"

            def record(impl, us, mode, out):
                row = {"shape": shape, "N": n, "K": k, "rows": total, "impl": impl, "us": us, "mode": mode,
                       "weight_tbps": wbytes / us / 1e6 if us else None,
                       "calc_diff": calc_diff(out.float(), ref) if out is not None else None,
                       "max_abs": (out.float() - ref).abs().max().item() if out is not None else None}
                results["rows"].append(row)
                log(f"{case} {impl}: {us:.1f} us, {row['weight_tbps']:.2f} TB/s, calc_diff {row['calc_diff']:.2e}")
                return row

            for name in names:
                out = torch.zeros(total, n, dtype=torch.bfloat16, device=dev)
                prep = preps[block_n(name)]
                fn = lambda: kernels.launch(name, prep, x, out, starts_dev, counts_dev, n, k, zsplit)  # noqa: E731
                fn()
                torch.cuda.synchronize()
                check = out.clone()
                us, mode = time_fn(fn)
                row = record(name, us, mode, check)
                if not name.endswith(DIAGNOSTIC) and not row["calc_diff"] <= 1e-4:
                    failures.append(f"{case} {name}: calc_diff {row['calc_diff']}")
            if tri is not None:
                out = torch.zeros(total, n, dtype=torch.bfloat16, device=dev)
                fn = lambda: launch_w4_gemm(x, tri, out, starts_dev, counts_dev, n=n, activation="none",  # noqa: E731
                                            situ_beta=4.0, situ_linear_beta=0.0, rows_hint=total)
                try:
                    fn()  # autotunes once per key
                    torch.cuda.synchronize()
                    out.zero_()
                    fn()
                    torch.cuda.synchronize()
                    check = out.clone()
                    us, mode = time_fn(fn)
                    record("triton launch_w4_gemm", us, mode, check)
                except Exception as exc:  # noqa: BLE001
                    log(f"{case} triton failed: {exc!r}")
            fn, y, label = bf16_anchor(x, wbf, counts, counts_dev, starts)
            torch.cuda.synchronize()
            us, mode = time_fn(fn)
            record(f"bf16 {label} (weight TB/s as if 4-bit)", us, mode, y)
            del ref
        del codes, scales, preps, wbf, tri
        torch.cuda.empty_cache()
    if launch_w4_gemm is not None:
        results["triton_tiles"] = {str(kk): vv for kk, vv in tuned_tiles().items()}
    results["failures"] = failures
    return results


def table(results):
    lines = [f"# proto_w4_cuda ({results.get('device')}, kernels from {results.get('cuda_source')})", "",
             f"copy 1 GiB: {results['copy_1GiB']['tbps']:.2f} TB/s (read + write)", "",
             "| shape | rows | impl | us | weight TB/s | calc_diff | max abs |", "|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        lines.append(f"| {r['shape']} | {r['rows']} | {r['impl']} | {r['us']:.1f} | {r['weight_tbps']:.2f} | "
                     f"{r['calc_diff']:.2e} | {r['max_abs']:.3g} |")
    return "\n".join(lines)


def dry_run():
    """CPU: counts, layout and reference on a tiny shape."""
    gen = torch.Generator().manual_seed(0)
    counts_dev, starts_dev, counts, starts = make_counts(512, gen, "cpu")
    assert sum(counts) == 512 and counts[0] == 0
    n, k = 256, 128
    codes = torch.randint(0, 16, (E, n, k), dtype=torch.uint8)
    scales = (torch.rand(E, n, k // 32) * 0.02 + 0.002).to(torch.bfloat16)
    prep = prepare(codes, scales, 256)
    x = torch.randn(512, k).to(torch.bfloat16)
    ref = reference(x, codes, scales, counts, starts)
    print(f"dry run OK: counts max {max(counts)}, prep {tuple(prep['w'].shape)}, ref {tuple(ref.shape)}, "
          f"self calc_diff {calc_diff(ref, ref):.1e}; kernels {list(KERNELS)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/proto_w4_cuda")
    parser.add_argument("--kernels", nargs="*", help="subset of w4_layout.KERNELS (default all)")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    if args.dry_run or not torch.cuda.is_available():
        dry_run()
        if not args.dry_run:
            print("no CUDA GPU: dry run only", file=sys.stderr)
            return 2
        return 0
    results = run_gpu(args)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "proto_w4_cuda.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(table(results))
    log(f"wrote {path}")
    if results["failures"]:
        print("FAILED:\n" + "\n".join(results["failures"]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
