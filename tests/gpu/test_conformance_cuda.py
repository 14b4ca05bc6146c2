"""The conformance matrix on a GPU: moe_ref's Triton and DeepGEMM backends, its quantized experts as stored (W4A16
and FP8-block kernels, read through its checkpoint loader) and the SGLang/vLLM peers (read from their wheels in
.whl/), each through its routed step and (``moe_ref/experts/*``, ``peer:*/experts``) alone on a pool, over the
quantized tiny shape and the real per-rank shapes, at one rank, in the rank processes of a real run;
DeepGEMM's fused mega-MoE at two ranks (cuda2). A peer without its wheel FAILs with ENV001 in its record (run
`make peers` first)."""
import pytest
import torch

from moe_ref.conformance import registered
from moe_ref.conformance.runner import skip_reason
from moe_ref.conformance.scenarios import all_cases
from moe_ref.conformance.spawn import run_cases

# slow: the real per-rank shapes (GBs of experts, made on the GPU from a CUDA generator); make test-gpu-full runs it
pytestmark = [pytest.mark.cuda, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("name", ["moe_ref/triton", "moe_ref/triton+invariant", "moe_ref/deep_gemm",
                                  "moe_ref/quant/triton", "peer:sglang", "peer:vllm",
                                  # the expert MLPs alone on a pool (kernel-only rows)
                                  "moe_ref/experts/triton", "moe_ref/experts/triton+masked",
                                  "moe_ref/experts/deep_gemm", "moe_ref/experts/deep_gemm+masked",
                                  "moe_ref/experts/grouped_mm", "peer:sglang/experts", "peer:vllm/experts"])
def test_gpu_implementations_pass_their_cases(name):
    impl = registered()[name]
    missing = impl.unavailable() if impl.unavailable is not None else None
    if missing:
        pytest.skip(f"{name} is not here: {missing}")
    ids = [c.id for c in all_cases() if c.shape.name != "tiny" and skip_reason(impl, c, 1, "cuda") is None]
    assert ids, f"{name} declares no case here"
    results = run_cases(name, ids, 1, "cuda", deadline_s=300)
    failed = {c: r["failed"] or r["errors"] for c, r in results.items() if r["status"] != "PASS"}
    assert failed == {}


@pytest.mark.cuda2
@pytest.mark.timeout(1500)
def test_deep_gemm_mega_moe_passes_its_cases_at_two_ranks():
    """DeepGEMM's fused mega-MoE through the harness at 2 ranks (NCCL), judged by its declared FP8-block compute."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, found {torch.cuda.device_count()}")
    impl = registered()["moe_ref/mega/deep_gemm"]
    missing = impl.unavailable()
    if missing:
        pytest.skip(f"DeepGEMM's mega-MoE is not here: {missing}")
    ids = [c.id for c in all_cases() if skip_reason(impl, c, 2, "cuda") is None]
    assert ids, "moe_ref/mega/deep_gemm declares no case here"
    results = run_cases(impl.name, ids, 2, "cuda", deadline_s=300)
    failed = {c: r["failed"] or r["errors"] for c, r in results.items() if r["status"] != "PASS"}
    assert failed == {}
