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
                                  "moe_ref/quant/triton", "moe_ref/quant/triton+invariant", "peer:sglang", "peer:vllm",
                                  # the expert MLPs alone on a pool (kernel-only rows)
                                  "moe_ref/experts/triton", "moe_ref/experts/triton+masked",
                                  "moe_ref/experts/deep_gemm", "moe_ref/experts/deep_gemm+masked",
                                  "moe_ref/experts/grouped_mm", "moe_ref/experts/torch", "peer:sglang/experts",
                                  "peer:vllm/experts"])
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


@pytest.mark.parametrize("timer", ["graph", "kernels"])
def test_bench_times_a_checked_case_from_a_graph_and_by_its_kernels_beside_the_run_anchors(timer, capsys, tmp_path):
    from moe_ref.tools import cli

    import json

    table, jsonl = tmp_path / "bench.md", tmp_path / "bench.jsonl"
    status = cli.main(["bench", "--kind", "experts", "--device", "cuda", "--shape", "tiny128", "--dtype", "bf16",
                       "--tokens", "64", "--impl", "moe_ref/experts/triton", "--impl", "moe_ref/experts/grouped_mm",
                       "--timer", timer, "--table", str(table), "--jsonl", str(jsonl)])
    out = capsys.readouterr().out
    assert status == 0, out
    text = table.read_text()
    assert f"`--timer {timer}`" in text and "Anchors of this run: HBM copy" in text
    row = next(line for line in text.splitlines() if line.startswith("| moe_ref/experts/triton@1 | 64 | PASS |"))
    us, roof = float(row.split(" | ")[3].replace(",", "")), float(row.split(" | ")[6])
    assert us > 0 and 0 < roof <= 1.0, row
    grouped_mm = next(line for line in text.splitlines() if line.startswith("| moe_ref/experts/grouped_mm@1 |"))
    assert ("SKIP: not graph_safe" in grouped_mm) == (timer == "graph"), grouped_mm
    triton_rec = next(json.loads(line) for line in jsonl.read_text().splitlines() if '"moe_ref/experts/triton"' in line)
    if timer == "kernels":  # each kernel's time, summing to the row's
        assert triton_rec["kernels"] and sum(triton_rec["kernels"].values()) == pytest.approx(triton_rec["us"], rel=0.01)
    else:
        assert "kernels" not in triton_rec


def test_the_graph_check_fails_a_graph_safe_claim_that_syncs_the_host_and_passes_the_step_it_wraps():
    """A routed step that reads a routing value on the host (``int(ids.max())``, a common wrapper bug) is right in
    every eager check; captured in a CUDA graph it raises, and the graph check FAILs it. The step it wraps passes."""
    import dataclasses

    from moe_ref.conformance.runner import run_case

    step = registered()["moe_ref/triton"]

    class HostSync:
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, x_TD, topk_ids_TK, topk_weights_TK, out_TD):
            assert int(topk_ids_TK.max()) < 10 ** 6  # the host sync
            self.inner(x_TD, topk_ids_TK, topk_weights_TK, out_TD)

        def close(self):
            self.inner.close()

    case = next(c for c in all_cases() if c.scenario == "base" and c.shape.name != "tiny"
                and skip_reason(step, c, 1, "cuda") is None)
    wrapped = dataclasses.replace(step, name="graph:host_sync", factory=lambda problem: HostSync(step.factory(problem)))
    bad = run_case(wrapped, case, 0, 1, None, torch.device("cuda"))
    assert set(bad.failed) == {"graph"} and "raised" in bad.failed["graph"], bad.failed
    good = run_case(step, case, 0, 1, None, torch.device("cuda"))
    assert good.status() == "PASS", good.failed
