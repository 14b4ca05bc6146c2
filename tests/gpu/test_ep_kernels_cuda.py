"""The device-side EP kernels on CUDA: R fake ranks on one GPU (separate buffers, real device pointers) at
Kimi-like widths, kernel == twin bitwise; and the 2-GPU torchrun worker (symmetric memory, CUDA graph,
timeout, barrier cost) when two GPUs exist.

Run: `python -m pytest -q -m "cuda or cuda2" tests/gpu/test_ep_kernels_cuda.py` on a GPU machine.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "interpreter"))

pytestmark = [  # the two-GPU worker adds cuda2 (make test-gpu leaves cuda2 out)
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# name: (token counts per rank, e, K, C, Dx, dtype, fp8, alignment)
CASES = {
    "r2_bf16_kimi_width": ([32, 17], 8, 8, 32, 7168, torch.bfloat16, False, 1),
    "r2_fp8_kimi_width_a128": ([32, 0], 8, 8, 32, 7168, torch.bfloat16, True, 128),
    "r4_fp16_odd_width": ([9, 0, 16, 3], 3, 4, 16, 200, torch.float16, False, 4),
    "r2_fp8_kimi_width_masked_a128": ([32, 5], 8, 8, 32, 7168, torch.bfloat16, True, 128),
}


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(CASES))
def test_simulated_ranks_on_one_gpu_match_twins(name):
    from ep_sim import clone_world, expected_output, make_inputs, make_world, simulate_chunk

    from moe_ref.kernels.ep.ep_regions import EPRegions, masked_segment_rows
    from moe_ref.kernels.ep.symm_signal import check_ep_status
    from moe_ref.testing import assert_bitwise_equal

    counts, e, K, C, D, dtype, fp8, alignment = CASES[name]
    R = len(counts)
    masked_rows = masked_segment_rows(R, C, alignment) if "masked" in name else 0
    regions = EPRegions.build(R, e, K, C, D, activation_dtype=dtype, fp8=fp8, alignment=alignment,
                              masked_rows=masked_rows)
    inputs = [make_inputs(T, K, R * e, D, dtype, seed=s, device="cuda") for s, T in enumerate(counts)]
    world_k = make_world(regions, garbage_seed=11, device="cuda")
    world_t = clone_world(world_k)
    outs_k = simulate_chunk(world_k, regions, inputs, kernels=True, max_polls=10**6)
    outs_t = simulate_chunk(world_t, regions, inputs, kernels=False, max_polls=10**6)
    torch.cuda.synchronize()
    for r in range(R):
        check_ep_status(world_k[r], regions)
        assert_bitwise_equal(outs_k[r], outs_t[r], case=name, rank=r)
        assert_bitwise_equal(world_k[r].local, world_t[r].local, case=name, rank=r, what="whole buffer")
        want = expected_output(inputs[r], e, fp8)
        torch.testing.assert_close(outs_k[r].double(), want, atol=0.1, rtol=0.04, msg=f"{name=} rank {r}")


@pytest.mark.cuda2
def test_two_gpu_worker(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    out = tmp_path / "worker.json"
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    worker = os.path.join(os.path.dirname(__file__), "ep_kernels_worker.py")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           worker, "--json", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert all(case["ok"] for case in report["twins"].values())
    assert all(case["ok"] for case in report["graph"].values())
    assert report["timeout"]["ok"]
