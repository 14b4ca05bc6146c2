"""Which 4-bit GEMM tiles Triton compiles with a wrong store column index (no GPU needed).

    PYTHONPATH=<triton 3.6 wheel unpacked> python docs/results/ptx_w4_store_index_triton36_2026-12-03.py

Compiles `launch_w4_gemm` for sm_90a (tests/dist/sm90_compile_worker.py's recorder) at (K, N) = (96, 192),
(96, 72) and (256, 192), plain and gated, for every tile of `grouped_mlp_w4.TILES`, and prints the cases whose global
store address derives from the high half of a 64-bit `mov.b64 {_, %r}` combine: the pattern of the miscompile that
compute-sanitizer caught on the H200 (pid_n * 32 | (tid >> 2), the x load's row lane, or-ed into the plain store's
column).
"""
import re
import sys

import torch

sys.argv = sys.argv[:1]
sys.path.insert(0, "tests/dist")
import sm90_compile_worker as worker  # noqa: E402
from moe_ref.kernels.w4 import to_group_planes  # noqa: E402

w4 = worker.w4


def store_index_ok(ptx: str) -> bool:
    """False when a global store's address derives (within 6 steps) from a 'mov.b64 {_, %r}' high half."""
    highs = set(re.findall(r'mov\.b64\s+\{_, (%r\d+)\}', ptx))
    defs = {m.group(1): re.findall(r'%r\w*\d+', m.group(2))
            for m in re.finditer(r'\n\s*[a-z][\w.]*\s+(%r\w*\d+), ([^;]*);', ptx)}
    for m in re.finditer(r'st\.global[\w.]* \[ (%rd\d+)', ptx):
        frontier, seen = [m.group(1)], set()
        for _ in range(6):
            frontier = [arg for r in frontier if r not in seen and not seen.add(r) for arg in defs.get(r, [])]
        if seen & highs:
            return False
    return True


def compiled_ptx(fmt: str, k: int, n: int, tile: tuple, activation: str, int4_scale: float) -> str:
    experts = 3
    if fmt == "int4":
        packed = torch.zeros(experts, n, k // 8, dtype=torch.int32)
        scale = torch.full((experts, n, k // 32), int4_scale, dtype=torch.bfloat16)
    else:
        packed = torch.zeros(experts, n, k // 2, dtype=torch.uint8)
        scale = torch.ones(experts, n, k // 32, dtype=torch.uint8)
    weight = to_group_planes(packed, scale, fmt)
    out_n, out_dtype = (n, torch.float32) if activation == "none" else (n // 2, torch.bfloat16)
    return worker.compile_launch(w4, "_w4_gemm_kernel", lambda: w4.launch_w4_gemm(
        torch.zeros(64, k, dtype=torch.bfloat16), weight, torch.zeros(64, out_n, dtype=out_dtype),
        torch.tensor([0, 16, 40]), torch.tensor([8, 5, 11], dtype=torch.int32), rows_hint=24, tile=tile,
        activation=activation)).asm["ptx"]


bad = 0
for fmt, int4_scale in (("int4", 0.25), ("int4", 1.0), ("mxfp4", 0.0)):  # INT4 0.25: folded decode; 1.0: fp32 route
    for k, n in ((96, 192), (96, 72), (256, 192)):
        for activation in ("none", "silu"):
            for tile in w4.TILES:
                if not store_index_ok(compiled_ptx(fmt, k, n, tile, activation, int4_scale)):
                    bad += 1
                    print(f"wrong store index: {fmt} (INT4 scale {int4_scale}) K={k} N={n} {activation} {tile}",
                          flush=True)
print(f"triton {worker.triton.__version__}: {bad} case(s) with a wrong store index")
