"""The grouped MLP kernels compile for Hopper (sm_90a), checked on a CPU: each weight format (the 4-bit kernel in each
x dtype), gate/up layout, TMA or pointer loads and GEMM, at representative tiles of the autotune lists; so do the
routing check (its first H200 run found a global that Triton's compiler refuses and the interpreter accepts) and every
kernel of the device-side EP data path (pre-dispatch, layout, receive layout, dispatch, combine push and reduce, barrier; bf16 and FP8 rows).

The interpreter tests run the kernel's Python, so a kernel that Triton's compiler rejects (for instance two
returns of different types in branches a constexpr removes, found on an H200 on 2026-12-01) passes
them all. `sm90_compile_worker.py` compiles each variant down to a cubin with Triton's bundled ptxas, in a
subprocess without TRITON_INTERPRET."""

import json
import os
import subprocess
import sys

import pytest

# a subprocess compiles the kernels (in tests/unit until the tiers: every test that starts a process is dist)
pytestmark = pytest.mark.dist
HOPPER_SHARED_BYTES = 232448  # cudaDevAttrMaxSharedMemoryPerBlockOptin on sm_90
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sm90_compile_worker.py")


def test_kernels_compile_for_sm90_in_every_variant():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, WORKER], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    planned, *reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["case"] for r in reports] == planned["cases"] and len(reports) >= 22, done.stdout[-2000:]
    failed = {r["case"]: r["error"] for r in reports if r["error"]}
    assert not failed, "\n\n".join(f"{case}: {error}" for case, error in failed.items())
    # the kernels really went through the backend (a cubin each; the GEMMs' pipelines hold shared memory)
    assert all(r["cubin_bytes"] > 0 for r in reports), reports
    assert all(r["shared_bytes"] > 0 for r in reports if r["kind"] in ("grouped_mlp", "grouped_mlp_w4")), reports
    # and fit a Hopper SM (227 KiB a block on the H100 and H200): a tile past it fails at launch, not here
    too_big = {r["case"]: r["shared_bytes"] for r in reports if r["shared_bytes"] > HOPPER_SHARED_BYTES}
    assert not too_big, too_big
    assert sum(r["kernels"] for r in reports if r["kind"] == "ep") == 11, reports  # 7 EP kernels, 4 of them twice


def test_sass_report_counts_the_main_loop():
    """`--sass`: only the named cases, each with its registers and its main loop's opcodes (the 4-bit decode tile:
    its dots are Hopper wgmma; its INT4 decode one lop3 and one packed FMA a plane, one shift a word, and no byte
    permutes: each FMA reads its scale's bf16 half through an operand swizzle)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, WORKER, "--sass", "w4 int4 gate_up bf16"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    planned, *reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert planned["cases"] == ["w4 int4 gate_up bf16, decode tile"] and len(reports) == 1, done.stdout[-2000:]
    (sass,) = reports[0]["sass"]
    ops = sass["loop_ops"]
    assert sass["registers"] > 0 and sass["loop_instructions"] == sum(ops.values()) > 0, sass
    assert any(op.startswith("HGMMA") for op in ops), ops
    assert ops.get("HFMA2.BF16_V2", 0) > 0 and ops["HFMA2.BF16_V2"] <= ops.get("LOP3.LUT", 0), ops
    assert sum(count for op, count in ops.items() if op.startswith("SHF")) <= ops["HFMA2.BF16_V2"] // 4, ops
    assert "PRMT" not in ops, ops


def test_sass_of_the_8_row_tiles():
    """BLOCK_M 8 (``grouped_mlp_w4.TILES``) compiles for both formats; on 2 warps it is mma.sync (HMMA m16n8k16: no
    warpgroup to run wgmma). On 4 warps Triton 3.6 (the GPU image) also picks mma.sync, newer ones wgmma n8."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, WORKER, "--sass", "w4 8-row tile"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    planned, *reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(planned["cases"]) == 2 and len(reports) == 2, done.stdout[-2000:]
    by_case = {report["case"]: report for report in reports}
    assert all(report["error"] is None and report["sass"][0]["loop_instructions"] > 0 for report in reports), reports
    (two_warps,) = by_case["w4 8-row tile, int4 gate_up bf16"]["sass"]
    ops = two_warps["loop_ops"]
    assert ops.get("HMMA.16816.F32.BF16", 0) > 0 and not any(op.startswith("HGMMA") for op in ops), ops
