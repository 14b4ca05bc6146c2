"""The conformance harness: every mutant is caught by the check made for it, the correct base and moe_ref's own
backends and transports pass, a hang is a FAIL naming each rank's last step, and the ledger turns a pass into XPASS."""
import dataclasses
import json

import pytest
import torch

from moe_ref.conformance import Capabilities, implementation, registered, resolve
from moe_ref.conformance.report import apply_ledger, record
from moe_ref.conformance.runner import run_case, skip_reason
from moe_ref.conformance.scenarios import all_cases
from moe_ref.conformance.spawn import run_cases, run_jobs
from moe_ref.core.errors import ConformanceImplError
from moe_ref.kernels.experts.fp8 import (dequantize_fp8_per_128, dequantize_fp8_per_block_128, quantize_fp8_per_128,
                                        quantize_fp8_per_block_128)

pytestmark = pytest.mark.unit
CASES = {c.id: c for c in all_cases()}


def _failed(name, case_id):
    impl = registered()[name]
    assert skip_reason(impl, CASES[case_id], 1, "cpu") is None
    verdict = run_case(impl, CASES[case_id], 0, 1, None, torch.device("cpu"))
    return set(verdict.failed)


# (mutant, a case that must catch it, the check that must)
CAUGHT = [("mutant:segment_offset", "tiny/fp32/base", "oracle"),
          ("mutant:masked_row_dropped", "tiny/fp32/mask1", "poison"),
          ("mutant:wrong_scale", "tiny128/bf16-fp8_block/base", "oracle"),
          ("mutant:atomic_combine", "tiny/fp32/base", "rerun"),
          ("mutant:write_past_t", "tiny/fp32/base", "guard"),
          ("mutant:no_capacity_check", "tiny/fp32/cap+1", "overflow"),
          ("mutant:masked_to_last_rank", "tiny/fp32/mask0.3", "counts"),
          ("mutant:masked_to_last_rank", "tiny/fp32/mask0.3", "payload"),
          ("mutant:pool_segment_offset", "tiny/fp32/base", "finite"),
          ("mutant:pool_in_place", "tiny/bf16/base", "input"),
          ("mutant:pool_split_k", "tiny/fp32/base", "rerun"),
          ("mutant:pool_shared_scale", "tiny/fp32/base", "alone")]
BASE_OF_KIND = {"dispatch_combine": "dispatch:correct", "pool_experts": "pool:correct", "routed_step": "correct"}


@pytest.mark.parametrize("name,case_id,check", CAUGHT)
def test_each_mutant_is_caught_by_its_check_and_the_correct_base_passes_there(name, case_id, check):
    assert check in _failed(name, case_id)
    base = BASE_OF_KIND[registered()[name].kind]
    assert _failed(base, case_id) == set()  # the positive control: the same case passes without the bug


@pytest.mark.parametrize("name", ["moe_ref/torch", "moe_ref/torch+chunk", "moe_ref/torch+invariant",
                                  "moe_ref/dispatch/local", "example:sglang-style", "moe_ref/experts/torch",
                                  "moe_ref/experts/torch+masked", "moe_ref/experts/grouped_mm"])
def test_moe_ref_and_the_worked_example_pass_the_tiny_matrix_at_one_rank(name):
    impl = registered()[name]
    failures = {}
    for case in CASES.values():
        if case.shape.name == "tiny" and case.dtype == "bf16" and skip_reason(impl, case, 1, "cpu") is None:
            verdict = run_case(impl, case, 0, 1, None, torch.device("cpu"))
            if verdict.status() != "PASS":
                failures[case.id] = verdict.failed or verdict.error
    assert failures == {}


def test_the_pool_holds_each_live_slot_in_its_experts_segment_and_nan_elsewhere():
    from moe_ref.conformance.scenarios import expert_pool, quantize_fp8_rows, rows_deranged_in_segments

    x_TD = torch.arange(1, 4 * 256 + 1, dtype=torch.float32).view(4, 256) / 100
    ids_TK = torch.tensor([[2, 0], [-1, 2], [2, -1], [0, 3]])
    pool, expert_P, row_TK = expert_pool(x_TD, ids_TK, 4, alignment=4)
    assert pool.num_rows_e.tolist() == [2, 0, 3, 1] and pool.row_start_e.tolist() == [0, 4, 4, 8]
    assert pool.num_rows == 6 and pool.masked_rows == 0 and pool.x_PD.shape == (12, 256)
    ends = (pool.row_start_e + pool.num_rows_e).tolist()  # packed, as the pool adapters tell the backends
    assert pool.row_start_e.tolist() == [0] + [-(-end // 4) * 4 for end in ends[:-1]]
    assert expert_P.tolist() == [0, 0, -1, -1, 2, 2, 2, -1, 3, -1, -1, -1]
    assert row_TK.tolist() == [[4, 0], [-1, 5], [6, -1], [1, 8]]  # an expert's rows in (token, slot) order
    live_TK = ids_TK >= 0
    assert torch.equal(pool.x_PD[row_TK[live_TK]], x_TD[live_TK.nonzero()[:, 0]])
    assert bool(pool.x_PD[expert_P < 0].isnan().all())
    masked, masked_expert_P, _ = expert_pool(x_TD, ids_TK, 4, alignment=4, layout="masked", fp8=True)
    assert masked.masked_rows == 4 and masked.row_start_e.tolist() == [0, 4, 8, 12] and masked.x_PD.shape[0] == 16
    codes, scale = quantize_fp8_rows(masked.x_PD[masked_expert_P >= 0])
    assert torch.equal(masked.x_fp8_PD[masked_expert_P >= 0].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(masked.x_scale_PDb[masked_expert_P >= 0], scale) and scale.shape == (6, 2)
    src_P = rows_deranged_in_segments(pool)
    assert src_P.tolist() == [1, 0, 2, 3, 5, 6, 4, 7, 8, 9, 10, 11]  # segments of 2+ rows rotated, the rest stay
    empty, empty_expert_P, _ = expert_pool(x_TD[:0], ids_TK[:0], 4, alignment=4)
    assert empty.x_PD.shape == (0, 256) and empty.num_rows == 0 and empty_expert_P.numel() == 0


def test_one_group_runs_every_job_a_raise_restarts_it_and_a_hang_fails_with_every_ranks_last_step(tmp_path,
                                                                                                    monkeypatch):
    (tmp_path / "bad_impls.py").write_text(
        "import time\nfrom moe_ref.conformance import Capabilities, implementation\n"
        "CAPS = Capabilities(dtypes=('fp32', 'bf16'), ep_sizes=(2,))\n"
        "@implementation('hangs', kind='routed_step', caps=CAPS)\n"
        "def hangs(problem):\n"
        "    def run(x, ids, w, out):\n"
        "        if problem.rank == 1:\n            time.sleep(1000)\n        out.zero_()\n    return run\n"
        "@implementation('raises', kind='routed_step', caps=CAPS)\n"
        "def raises(problem):\n"
        "    def run(x, ids, w, out):\n"
        "        if problem.rank == 1:\n            raise RuntimeError('planted')\n        out.zero_()\n    return run\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    # rank 1 leaves after the raise (its peers may sit in a collective): the group starts again at the next job,
    # which is not blamed for it
    jobs = [("moe_ref/torch", "tiny/bf16/uneven"), ("bad_impls:raises", "tiny/bf16/uneven"),
            ("moe_ref/torch", "tiny/fp32/cap+1")]
    done = run_jobs(jobs, 2, "cpu", 60)
    assert {job: r["status"] for job, r in done.items()} == {jobs[0]: "PASS", jobs[1]: "FAIL", jobs[2]: "PASS"}
    assert done[jobs[1]]["errors"] == ["rank 1: RuntimeError: planted"]
    failed = set(done[jobs[1]]["failed"])  # rank 0 zeroed its rows: its oracle checks fail; no hang or exit blamed
    assert "raised@rank1" in failed and not {"exit", "deadline"} & {check.split("@")[0] for check in failed}
    hung = run_cases("bad_impls:hangs", ["tiny/fp32/base"], 2, "cpu", 6)["tiny/fp32/base"]
    assert hung["status"] == "FAIL"
    assert "rank 0: verdict" in hung["failed"]["deadline"] and "rank 1: run" in hung["failed"]["deadline"]


def test_ledger_marks_known_failures_and_unexpected_passes():
    impl, case = registered()["correct"], CASES["tiny/fp32/base"]
    passed = record(impl, case, 1, "cpu", {"status": "PASS", "failed": {}, "errors": [], "us": None}, None)
    assert apply_ledger(passed, {"correct@1/tiny/*": "known"})["status"] == "XPASS"
    assert "--cases 'tiny/fp32/base'" in passed["repro"] and json.dumps(passed)


def test_bad_declarations_are_coded_errors():
    with pytest.raises(ConformanceImplError):
        Capabilities(overflow="error")  # no cap declared
    with pytest.raises(ConformanceImplError):
        implementation("x", kind="experts", caps=Capabilities(ep_sizes=(2,)))(lambda problem: None)
    with pytest.raises(ConformanceImplError):
        resolve("no_such_module_here:factory")


def test_a_tune_has_its_own_deadline_and_the_case_deadline_starts_after_it(tmp_path, monkeypatch):
    from moe_ref.conformance import spawn

    (tmp_path / "tuned_impls.py").write_text(
        "import time\nfrom moe_ref.conformance import implementation, registered\n"
        "CORRECT = registered()['correct']\n"
        "class Tuned:\n"
        "    def __init__(self, problem, seconds):\n"
        "        self.inner, self.seconds = CORRECT.factory(problem), seconds\n"
        "    def __call__(self, x, ids, w, out):\n        self.inner(x, ids, w, out)\n"
        "    def tune(self, x, ids, w):\n        time.sleep(self.seconds)\n"
        "@implementation('slow_tune', kind=CORRECT.kind, caps=CORRECT.caps)\n"
        "def slow_tune(problem):\n    return Tuned(problem, 7)\n"
        "@implementation('endless_tune', kind=CORRECT.kind, caps=CORRECT.caps)\n"
        "def endless_tune(problem):\n    return Tuned(problem, 1000)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(spawn, "TUNE_DEADLINE_S", 9.0)
    slow, endless = ("tuned_impls:slow_tune", "tiny/fp32/T12"), ("tuned_impls:endless_tune", "tiny/fp32/T12")
    done = run_jobs([slow], 1, "cpu", 5, timer="events")  # a 7 s tune under a 5 s case deadline
    assert done[slow]["status"] == "PASS" and done[slow]["tune_s"] >= 7, done[slow]
    hung = run_jobs([endless], 1, "cpu", 5, timer="events")[endless]
    assert hung["status"] == "FAIL" and "past the 9 s deadline" in hung["failed"]["deadline"]
    assert "rank 0: tune" in hung["failed"]["deadline"] and hung["tune_s"] is None


def _row_blocks_fp8(x_TD: torch.Tensor) -> torch.Tensor:
    """x rounded as moe_ref's kernels round activations (e4m3 per row per 128 columns): the toy's own rounding."""
    return dequantize_fp8_per_128(*quantize_fp8_per_128(x_TD))


def _square_blocks_fp8(w_OI: torch.Tensor) -> torch.Tensor:
    """w rounded as moe_ref's kernels round weights (e4m3 per 128 x 128 block)."""
    return dequantize_fp8_per_block_128(*quantize_fp8_per_block_128(w_OI))


class _Fp8BlockToy:
    """An experts implementation that computes FP8 blocks on plain weights, as DeepGEMM's mega-MoE does: x per token
    per 128 columns, the weights per 128 x 128 block, the intermediate re-quantized per 128; fp32 sums."""

    def __init__(self, problem):
        self.gate_up = [_square_blocks_fp8(w) for w in problem.weights.gate_up_e2FD.float()]
        self.down = [_square_blocks_fp8(w) for w in problem.weights.down_eDF.float()]

    def __call__(self, x_TD, topk_ids_TK, topk_weights_TK, out_TD):
        x = _row_blocks_fp8(x_TD.float())
        y = torch.zeros(x.shape)
        for t, j in (topk_ids_TK >= 0).nonzero().tolist():
            expert = int(topk_ids_TK[t, j])
            gate, up = (x[t:t + 1] @ self.gate_up[expert].T).chunk(2, dim=-1)
            h = _row_blocks_fp8(torch.nn.functional.silu(gate) * up)
            y[t] += float(topk_weights_TK[t, j]) * (h @ self.down[expert].T)[0]
        out_TD.copy_(y)


@pytest.mark.parametrize("compute, status", [("fp8_block", "PASS"), (None, "FAIL")])
def test_an_fp8_computing_implementation_is_judged_by_its_declared_compute(compute, status):
    """The same FP8-block implementation on plain bf16 weights: PASSes where it declares compute='fp8_block' (the
    oracle rounds as it does, FP8 limits), FAILs the bf16 oracle where it declares nothing: the capability matters."""
    impl = dataclasses.replace(registered()["correct"], name="fp8_toy", factory=_Fp8BlockToy,
                               caps=Capabilities(dtypes=("bf16",), compute=compute))
    for case_id in ("tiny/bf16/base", "tiny/bf16/mask0.3", "tiny/bf16/one_expert"):
        verdict = run_case(impl, CASES[case_id], 0, 1, None, torch.device("cpu"))
        assert verdict.status() == status, (case_id, verdict.failed, verdict.error)
        if status == "FAIL":
            assert "calc_diff" in verdict.failed["oracle"] and "(bf16)" in verdict.failed["oracle"]
    with pytest.raises(ConformanceImplError, match="compute 'fp4'"):
        Capabilities(compute="fp4")


def test_deep_gemm_mega_runs_only_the_shapes_and_rank_counts_it_takes():
    """The mega-MoE adapter's cases on 2 GPUs: the real SwiGLU shapes within its limits; tiny widths (not multiples of
    128), Step3 (F 5120 > 4096) and one rank SKIP with the kernel's own reason. (It runs on 2+ GPUs only:
    tests/gpu/test_conformance_cuda.py.)"""
    impl = registered()["moe_ref/mega/deep_gemm"]
    assert impl.caps.compute == "fp8_block" and impl.caps.devices == ("cuda",)
    impl = dataclasses.replace(impl, unavailable=None)  # the DeepGEMM probe needs a GPU
    assert skip_reason(impl, CASES["kimi-k2/bf16/base"], 2, "cuda") is None
    assert skip_reason(impl, CASES["deepseek-v3/bf16/base"], 4, "cuda") is None
    assert "multiples of 128" in skip_reason(impl, CASES["tiny/bf16/base"], 2, "cuda")
    assert "intermediate_size=5120 > 4096" in skip_reason(impl, CASES["step3/bf16/base"], 2, "cuda")
    assert "ep_sizes" in skip_reason(impl, CASES["kimi-k2/bf16/base"], 1, "cuda")
    assert skip_reason(impl, CASES["kimi-k2/bf16/base"], 2, "cpu") is not None


def test_the_graph_checks_other_routing_moves_every_live_slot_and_keeps_a_tokens_experts_distinct():
    from moe_ref.conformance.runner import shifted_routing

    ids = torch.tensor([[0, 3], [-1, 0], [1, -1]])
    shifted = shifted_routing(ids, 4)
    assert shifted.tolist() == [[1, 0], [-1, 1], [2, -1]]
    live = ids >= 0
    assert bool((shifted[live] != ids[live]).all()) and bool((shifted[~live] == -1).all())
    counts = [torch.bincount(t[t >= 0], minlength=4).tolist() for t in (ids, shifted)]
    assert counts[0] != counts[1]  # other segment sizes: a plan frozen at capture shows


def test_run_jobs_takes_a_timer_name_or_none_and_conform_times_only_with_speed(capsys):
    from moe_ref.tools import cli

    for bad in (True, False, "wall"):
        with pytest.raises(TypeError, match="timer="):
            run_jobs([("correct", "tiny/fp32/base")], 1, "cpu", 60, 0, bad)
    import tempfile

    for flags, timed in (([], False), (["--speed"], True)):
        with tempfile.TemporaryDirectory() as tmp:
            status = cli.main(["conform", "--impl", "correct", "--cases", "tiny/fp32/base", "--jsonl",
                               f"{tmp}/r.jsonl", *flags])
            out = capsys.readouterr().out
            record = json.loads(open(f"{tmp}/r.jsonl").read().splitlines()[0])
        assert status == 0, out
        assert (record["us"] is not None) == timed, record
