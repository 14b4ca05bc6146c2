"""DeepGEMM backend on SM90: grouped bf16/fp8 and masked experts vs ``TorchLoopExperts`` at Kimi-K2-like
per-rank shapes (8 local experts, D 7168, F 2048, uneven rows with an empty expert), and the 2-GPU mega path
(``tests/gpu/mega_worker.py`` under torchrun).

Run on the GPU machine (the wheels from .whl installed, see the module docstring of mega_worker.py):
    python -m pytest -q -rs -m "cuda or cuda2" tests/gpu/test_deep_gemm.py
Skipped, with ``deep_gemm_status().reason`` shown, when deep_gemm is not usable: it is an optional backend.
The first call of each shape JIT-compiles a DeepGEMM kernel (seconds to a minute each).

calc_diff limits (DeepGEMM's metric, 1 - cosine similarity):
- bf16 vs TorchLoopExperts: 1e-4 (DeepGEMM's own bf16 GEMM tests use 1e-5 per GEMM; here two GEMMs and
  an activation, each rounded to bf16, with another accumulation order than torch).
- fp8 vs TorchLoopExperts (bf16): 4e-3. DeepGEMM's fp8 tests use 1e-3 per single GEMM (a CPU simulation
  of one fp8 GEMM at these shapes: 6.8e-4). The MLP chains two fp8 GEMMs and re-quantizes h: the same
  simulation gives 2.0e-3, so 4e-3 leaves a 2x margin.
- fp8 vs a torch simulation of the same fp8 recipe (same quantized weights and activations): 1e-3
  (only accumulation order and rounding flips differ; printed for diagnosis).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_ref.core.activations import dense_mlp
from moe_ref.experts.deep_gemm.backend import DeepGemmExperts
from moe_ref.experts.deep_gemm.bench import deep_gemm_grouped_cases
from moe_ref.experts.deep_gemm.probe import deep_gemm_status
from moe_ref.core.errors import ShapeError
from moe_ref.experts import ExpertLayout, TorchLoopExperts, make_experts
from moe_ref.testing import CALC_DIFF_TOLERANCES, calc_diff

pytestmark = pytest.mark.cuda

NUM_EXPERTS, HIDDEN, INTERMEDIATE = 8, 7168, 2048
COUNTS = [5, 0, 130, 64, 300, 1, 128, 257]  # uneven, one empty expert, one exactly 128
LIMIT = {"bf16": CALC_DIFF_TOLERANCES[torch.bfloat16], "fp8": CALC_DIFF_TOLERANCES[torch.float8_e4m3fn], "fp8_vs_sim": 1e-3}
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def status():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    status = deep_gemm_status()
    print(f"\ndeep_gemm_status: {status}")
    if not status.available:
        pytest.skip(f"deep_gemm not usable here (optional backend): {status.reason}")
    return status


@pytest.fixture(scope="module")
def weights(status):
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, device="cuda", generator=gen)
               * HIDDEN ** -0.5).bfloat16()
    down = (torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, device="cuda", generator=gen)
            * INTERMEDIATE ** -0.5).bfloat16()
    return gate_up, down


@pytest.fixture(scope="module")
def pool(weights):
    """Pool rows (padding rows hold noise too: they must come out zero), layout, reference, valid mask."""
    layout = ExpertLayout.from_counts(torch.tensor(COUNTS, device="cuda"), 128)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x_PDx = torch.randn(layout.num_pool_rows, HIDDEN, device="cuda", generator=gen).bfloat16()
    reference = TorchLoopExperts(*weights).forward(x_PDx, layout)
    valid_P = layout.row_expert_P() >= 0
    return x_PDx, layout, reference, valid_P


def _check_pool_output(y_PDx, pool, limit, label):
    x_PDx, layout, reference, valid_P = pool
    assert y_PDx.shape == x_PDx.shape and y_PDx.dtype == x_PDx.dtype, (label, y_PDx.shape, y_PDx.dtype)
    assert torch.isfinite(y_PDx).all(), f"{label}: non-finite output"
    assert bool((y_PDx[~valid_P] == 0).all()), f"{label}: padding rows are not zero"
    diff = calc_diff(y_PDx[valid_P], reference[valid_P])
    print(f"{label}: calc_diff vs TorchLoopExperts = {diff:.3e} (limit {limit:.0e}); counts={COUNTS}")
    assert diff < limit, f"{label}: calc_diff={diff:.3e} >= {limit:.0e}; counts={COUNTS}, D={HIDDEN}, F={INTERMEDIATE}"
    return diff


def test_status_reports_version_and_mega_api(status):
    assert status.version, status
    if status.version == "0.1.4":
        assert status.mega_moe, f"0.1.4 ships the SM90 mega-MoE API, the probe says otherwise: {status}"


def test_grouped_bf16_matches_torch_loop(weights, pool):
    experts = DeepGemmExperts(*weights)
    _check_pool_output(experts(pool[0], pool[1]), pool, LIMIT["bf16"], "deep_gemm bf16 grouped")


def test_grouped_fp8_matches_torch_loop_and_fp8_simulation(weights, pool):
    from moe_ref.kernels.experts.fp8 import quantize_fp8_per_128
    from moe_ref.kernels.experts.grouped_mlp import deinterleave_gate_up

    experts = DeepGemmExperts(*weights, fp8=True)
    assert experts.gate_up_interleaved  # F % 128 == 0: quantized interleaved, GEMM1's columns alike
    x_PDx, layout = pool[0], pool[1]
    y_PDx = experts(x_PDx, layout)
    _check_pool_output(y_PDx, pool, LIMIT["fp8"], "deep_gemm fp8 grouped")

    def dequant_rows(x):  # the backend's row quantizer's recipe (the FP8 pool's and h's)
        q, s = quantize_fp8_per_128(x)
        return (q.float().view(q.shape[0], -1, 128) * s[..., None]).view(q.shape)

    def dequant_blocks(w, s):
        n, k = w.shape
        return (w.float().view(n // 128, 128, k // 128, 128) * s[:, None, :, None]).view(n, k)

    simulated = torch.zeros_like(y_PDx)
    (w13, s13), (w2, s2) = experts._gate_up_weight, experts._down_weight
    for i, (start, count) in enumerate(zip(layout.row_start_e.tolist(), layout.num_rows_e.tolist())):
        if count:
            w13_dense = dequant_blocks(w13[i], s13[i])
            if experts.gate_up_interleaved:  # 128-row gate and up blocks, as quantized: put them back stacked
                w13_dense = deinterleave_gate_up(w13_dense[None])[0]
            gate_up = (dequant_rows(x_PDx[start:start + count]) @ w13_dense.t()).bfloat16()
            gate, up = gate_up.float().chunk(2, dim=-1)
            h = torch.nn.functional.silu(gate) * up
            simulated[start:start + count] = (dequant_rows(h) @ dequant_blocks(w2[i], s2[i]).t()).bfloat16()
    valid_P = pool[3]
    diff = calc_diff(y_PDx[valid_P], simulated[valid_P])
    print(f"deep_gemm fp8 grouped: calc_diff vs torch fp8 simulation = {diff:.3e} (limit {LIMIT['fp8_vs_sim']:.0e})")
    assert diff < LIMIT["fp8_vs_sim"], f"calc_diff vs fp8 simulation {diff:.3e}"


def test_pool_rows_not_a_multiple_of_128_and_all_padding(weights):
    experts = DeepGemmExperts(*weights)
    counts = torch.tensor([3, 0, 0, 0, 0, 0, 0, 5], device="cuda")
    layout = ExpertLayout.from_counts(counts, 128, num_pool_rows=300)  # 256 used + 44 trailing rows
    x_PDx = torch.randn(300, HIDDEN, device="cuda").bfloat16()
    y_PDx = experts(x_PDx, layout)
    reference = TorchLoopExperts(*weights).forward(x_PDx, layout)
    diff = calc_diff(y_PDx, reference)
    assert y_PDx.shape == (300, HIDDEN) and diff < LIMIT["bf16"], diff
    assert bool((y_PDx[layout.row_expert_P() < 0] == 0).all())

    empty = ExpertLayout.from_counts(torch.zeros(NUM_EXPERTS, dtype=torch.int64, device="cuda"), 128,
                                     num_pool_rows=128)
    y_empty = experts(torch.randn(128, HIDDEN, device="cuda").bfloat16(), empty)
    assert bool((y_empty == 0).all()), "a pool of padding rows only must come out zero"
    assert experts(torch.empty(0, HIDDEN, device="cuda", dtype=torch.bfloat16),
                   ExpertLayout.from_counts(torch.zeros(NUM_EXPERTS, dtype=torch.int64), 128)).shape == (0, HIDDEN)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_packed_pool_with_an_unused_tail_as_segment_ends_and_as_rows(weights, fp8):
    """A pool sized for a cap, far past its last segment (as the dispatcher hands it over): the psum form (segment
    ends; the GEMMs stop at the last segment) and the row form (every block scheduled) both give the experts' rows,
    the tail and the padding zero."""
    import dataclasses

    counts = torch.tensor([5, 0, 130, 1, 0, 0, 64, 0], device="cuda")
    packed = ExpertLayout.from_counts(counts, 128, num_pool_rows=128 * 40)  # 640 rows used of 5120
    assert packed.packed
    x_PDx = torch.randn(packed.num_pool_rows, HIDDEN, device="cuda").bfloat16()
    reference = TorchLoopExperts(*weights).forward(x_PDx, packed)
    valid_P = packed.row_expert_P() >= 0
    limit = LIMIT["fp8" if fp8 else "bf16"]
    for layout in (packed, dataclasses.replace(packed, packed=False)):
        experts = DeepGemmExperts(*weights, fp8=fp8)
        y_PDx = experts(x_PDx, layout)
        label = f"packed={layout.packed} psum={experts._psum} refused={experts.psum_refused}"
        print(f"deep_gemm {'fp8' if fp8 else 'bf16'} {label}")
        assert bool((y_PDx[~valid_P] == 0).all()), label
        diff = calc_diff(y_PDx[valid_P], reference[valid_P])
        assert diff < limit, (label, diff)


def test_layout_alignment_below_deep_gemm_alignment_is_refused(weights):
    experts = DeepGemmExperts(*weights)
    layout = ExpertLayout.from_counts(torch.tensor(COUNTS, device="cuda"), 64)
    with pytest.raises(ShapeError, match="alignment"):
        experts(torch.zeros(layout.num_pool_rows, HIDDEN, device="cuda", dtype=torch.bfloat16), layout)


def test_make_experts_builds_deep_gemm(weights):
    assert isinstance(make_experts("deep_gemm", *weights), DeepGemmExperts)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_masked_layout_matches_dense_mlp(weights, fp8):
    gate_up, down = weights[0][:4], weights[1][:4]
    experts = DeepGemmExperts(gate_up, down, fp8=fp8)
    max_rows = 256
    masked_m = torch.tensor([0, 1, 77, 256], dtype=torch.int32, device="cuda")
    x_eMD = torch.randn(4, max_rows, HIDDEN, device="cuda").bfloat16()
    y_eMD = experts.forward_masked(x_eMD, masked_m, expected_m=64)
    assert y_eMD.shape == x_eMD.shape and y_eMD.dtype == torch.bfloat16
    outs, refs = [], []
    for i, rows in enumerate(masked_m.tolist()):
        assert bool((y_eMD[i, rows:] == 0).all()), f"expert {i}: rows beyond masked_m={rows} are not zero"
        outs.append(y_eMD[i, :rows])
        refs.append(dense_mlp(x_eMD[i, :rows], gate_up[i], down[i]))
    diff = calc_diff(torch.cat(outs), torch.cat(refs))
    limit = LIMIT["fp8" if fp8 else "bf16"]
    print(f"deep_gemm {'fp8' if fp8 else 'bf16'} masked: calc_diff vs dense_mlp = {diff:.3e} (limit {limit:.0e})")
    assert diff < limit, diff


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_masked_receive_pool_runs_the_masked_gemms_in_place(weights, fp8):
    """A masked receive pool (ExpertLayout.masked_rows = M: expert i at rows [i*M, i*M + count)) through forward,
    the rows past each count holding noise: valid rows match the torch loop, the others come out zero."""
    max_rows = 384
    counts = torch.tensor(COUNTS, device="cuda")
    layout = ExpertLayout(torch.arange(NUM_EXPERTS, device="cuda") * max_rows, counts, NUM_EXPERTS * max_rows, 128,
                          num_rows_hint=int(counts.sum()), masked_rows=max_rows)
    x_PDx = torch.randn(NUM_EXPERTS * max_rows, HIDDEN, device="cuda").bfloat16()
    y_PDx = DeepGemmExperts(*weights, fp8=fp8)(x_PDx, layout)
    reference = TorchLoopExperts(*weights).forward(x_PDx, layout)
    valid_P = layout.row_expert_P() >= 0
    assert y_PDx.shape == x_PDx.shape and bool((y_PDx[~valid_P] == 0).all())
    diff = calc_diff(y_PDx[valid_P], reference[valid_P])
    limit = LIMIT["fp8" if fp8 else "bf16"]
    print(f"deep_gemm {'fp8' if fp8 else 'bf16'} masked pool: calc_diff vs TorchLoopExperts = {diff:.3e}")
    assert diff < limit, diff


@pytest.mark.parametrize("masked", [False, True], ids=["contiguous", "masked"])
def test_fp8_pool_as_dispatched_equals_rows_quantized_by_the_backend(weights, pool, masked):
    """The FP8 pool (fp8 rows + per-128 scales, kernels.fp8's recipe) gives the bits of bf16 rows quantized by the
    backend: it quantizes them with the same recipe (kernels.quantize_rows). (With DeepGEMM's own helper, which
    multiplies by the reciprocal, the two were calc_diff ~1.5e-4 apart on an H200.)"""
    from moe_ref.kernels.experts.fp8 import quantize_fp8_per_128

    x_PDx, layout, _, valid_P = pool
    if masked:
        max_rows = 384
        layout = ExpertLayout(torch.arange(NUM_EXPERTS, device="cuda") * max_rows, layout.num_rows_e, NUM_EXPERTS *
                              max_rows, 128, num_rows_hint=sum(COUNTS), masked_rows=max_rows)
        x_PDx = torch.randn(NUM_EXPERTS * max_rows, HIDDEN, device="cuda").bfloat16()
        valid_P = layout.row_expert_P() >= 0
    experts = DeepGemmExperts(*weights, fp8=True)
    from_bf16 = experts(x_PDx, layout)
    x_fp8_PDx, x_scale_PDb = quantize_fp8_per_128(x_PDx)
    from_fp8 = experts(x_fp8_PDx, layout, x_scale_PDb)
    assert from_fp8.dtype == torch.bfloat16 and bool((from_fp8[~valid_P] == 0).all())
    assert torch.equal(from_fp8[valid_P], from_bf16[valid_P]), calc_diff(from_fp8[valid_P], from_bf16[valid_P])


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_masked_layout_replays_in_a_cuda_graph(weights, fp8):
    experts = DeepGemmExperts(weights[0][:4], weights[1][:4], fp8=fp8)
    static_x = torch.randn(4, 128, HIDDEN, device="cuda").bfloat16()
    static_m = torch.tensor([3, 0, 100, 128], dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (JIT compile) outside the capture
        for _ in range(2):
            experts.forward_masked(static_x, static_m, 32)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = experts.forward_masked(static_x, static_m, 32)
    new_x = torch.randn_like(static_x)
    new_m = torch.tensor([128, 7, 0, 64], dtype=torch.int32, device="cuda")
    static_x.copy_(new_x)
    static_m.copy_(new_m)
    graph.replay()
    torch.cuda.synchronize()
    eager = experts.forward_masked(new_x, new_m, 32)
    diff = calc_diff(static_y, eager)
    assert diff < 1e-6 and bool((static_y[2] == 0).all()) and bool((static_y[1, 7:] == 0).all()), diff


def test_bench_hook_paths_match_the_reference(weights, pool):
    x_PDx, layout, reference, valid_P = pool
    cases = deep_gemm_grouped_cases(x_PDx, *weights, layout.row_start_e, layout.num_rows_e,
                                    layouts=("contiguous", "masked"))
    assert [name for name, _ in cases] == ["deep_gemm_bf16", "deep_gemm_fp8", "deep_gemm_masked_bf16",
                                           "deep_gemm_masked_fp8"]
    for name, fn in cases:
        limit = LIMIT["fp8" if name.endswith("fp8") else "bf16"]
        if "masked" not in name:
            _check_pool_output(fn(), pool, limit, f"bench hook {name}")
            continue
        y_eMD = fn()  # [e, M, D]: expert i's rows first, zero past its count
        valid_eM = torch.arange(y_eMD.shape[1], device="cuda")[None, :] < layout.num_rows_e.to("cuda")[:, None]
        assert y_eMD.shape == (NUM_EXPERTS, 384, HIDDEN) and bool((y_eMD[~valid_eM] == 0).all()), name
        diff = calc_diff(y_eMD[valid_eM], reference[valid_P])
        print(f"bench hook {name}: calc_diff vs TorchLoopExperts = {diff:.3e} (limit {limit:.0e}); counts={COUNTS}")
        assert diff < limit, f"bench hook {name}: calc_diff={diff:.3e} >= {limit:.0e}; counts={COUNTS}"


# --- 2 GPUs: the mega path ------------------------------------------------------------------------------

@pytest.mark.cuda2
@pytest.mark.timeout(1500)
def test_mega_moe_two_gpus(status):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, found {torch.cuda.device_count()}")
    if not status.mega_moe:
        pytest.skip(f"deep_gemm {status.version} has no SM90 mega-MoE API: {status.reason}")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(REPO / "tests" / "gpu" / "mega_worker.py")]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1400)
    log = proc.stdout + proc.stderr
    print(log[-20000:])
    results = [line for line in log.splitlines() if line.startswith(("RESULT", "SUMMARY"))]
    assert proc.returncode == 0, f"mega_worker failed (rc={proc.returncode}):\n" + "\n".join(results) + \
        f"\n--- log tail ---\n{log[-6000:]}"
    assert any(line.startswith("SUMMARY") and "all passed" in line for line in results), "\n".join(results)
