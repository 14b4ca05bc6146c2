"""The conformance harness on moe_ref's quantized experts and on its own weights: the scenarios' INT4 / MXFP4 / FP8
packing is what the published layouts say (moe_ref's loader reads it back to the same values), moe_ref's quantized
torch experts pass those cases, a packing mistake is caught, the CPU weights are the seeded recipe they always were,
an implementation missing here SKIPs with why, and the run's exit status blames everything but the mutants."""
import dataclasses

import pytest
import torch

from moe_ref.checkpoint.formats import QuantFormat, dequantize_weight
from moe_ref.conformance import registered
from moe_ref.conformance import scenarios
from moe_ref.conformance.adapters.moe_ref_quant import FORMATS
from moe_ref.conformance.cli import failing
from moe_ref.conformance.runner import run_case, skip_reason
from moe_ref.conformance.scenarios import (all_cases, dequantize, dequantized_as, global_weights, published_form)

pytestmark = pytest.mark.unit
CASES = {c.id: c for c in all_cases()}
QUANT_CASES = [f"tiny128/bf16-{q}/base" for q in ("int4", "mxfp4", "fp8_block")]


@pytest.mark.parametrize("case_id", QUANT_CASES)
def test_the_published_packing_reads_back_as_the_oracles_values(case_id):
    case = CASES[case_id]
    weights = global_weights(case, 2)
    fmt = QuantFormat(FORMATS[case.quant])
    for codes, scale in ((weights.gate_up_q, weights.gate_up_scale), (weights.down_q, weights.down_scale)):
        packed, stored_scale = published_form(codes, scale, case.quant)
        read = torch.stack([dequantize_weight(packed[i], stored_scale[i], fmt) for i in range(packed.shape[0])])
        assert torch.equal(read, dequantize(codes, scale, case.quant).float())  # moe_ref dequantizes in fp32


@pytest.mark.parametrize("case_id", QUANT_CASES + ["tiny128/bf16-int4/mask0.3"])
def test_moe_refs_quantized_torch_experts_pass_through_the_checkpoint_loader(case_id):
    impl = registered()["moe_ref/quant/torch"]
    assert skip_reason(impl, CASES[case_id], 1, "cpu") is None
    verdict = run_case(impl, CASES[case_id], 0, 1, None, torch.device("cpu"))
    assert (verdict.status(), verdict.failed) == ("PASS", {})


def test_a_wrong_mxfp4_scale_bias_is_caught_by_the_oracle(monkeypatch):
    monkeypatch.setattr(scenarios, "MXFP4_SCALE_BIAS", 127)  # E8M0's usual bias: every weight 4x too large
    verdict = run_case(registered()["moe_ref/quant/torch"], CASES["tiny128/bf16-mxfp4/base"], 0, 1, None,
                       torch.device("cpu"))
    assert "oracle" in verdict.failed


def test_cpu_weights_are_the_seeded_recipe_and_dequantize_per_expert_alike():
    case = CASES["tiny/fp32/base"]
    gen = torch.Generator().manual_seed(case.seed + 7919)
    shape = case.shape
    gate_up = torch.randn(2 * shape.experts_per_rank, 2 * shape.intermediate, shape.hidden, generator=gen)
    weights = global_weights(case, 2, torch.device("cpu"))
    assert torch.equal(weights.gate_up_e2FD, gate_up / shape.hidden ** 0.5)
    quant = global_weights(CASES["tiny128/bf16-fp8_block/base"], 1)
    assert torch.equal(dequantized_as(quant.down_q, quant.down_scale, "fp8_block", torch.bfloat16),
                       dequantize(quant.down_q, quant.down_scale, "fp8_block").to(torch.bfloat16))


def test_an_implementation_unavailable_here_skips_with_why():
    impl = dataclasses.replace(registered()["moe_ref/grouped_mm"], unavailable=lambda: "torch 2.8 has no grouped_mm")
    assert skip_reason(impl, CASES["tiny/fp32/base"], 1, "cpu") == "unavailable here: torch 2.8 has no grouped_mm"
    assert skip_reason(impl, CASES["tiny/fp32/base"], 1, "cuda") == "unavailable here: torch 2.8 has no grouped_mm"
    assert skip_reason(registered()["moe_ref/grouped_mm"], CASES["tiny/fp32/base"], 1, "cpu") is None


def test_the_exit_status_blames_failures_but_a_mutants_and_a_mutant_no_check_caught():
    def rec(impl, status):
        return {"id": f"{impl}@1/tiny/fp32/base", "impl": impl, "status": status}

    assert failing([rec("mutant:write_past_t", "FAIL"), rec("correct", "PASS")]) == []
    assert failing([rec("mutant:write_past_t", "FAIL"), rec("moe_ref/torch", "FAIL")]) == [
        "moe_ref/torch@1/tiny/fp32/base"]
    assert failing([rec("mutant:write_past_t", "PASS")]) == ["mutant:write_past_t: caught by no check"]
