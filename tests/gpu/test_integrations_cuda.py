"""moe_ref inside transformers models on a CUDA GPU (bf16 and fp32, tiny models of tests/unit/hf_tiny_models.py):
``experts_implementation="moe_ref"`` (moe_ref's CUDA experts backend over the module's own weights) against
transformers' default (grouped_mm), and ``patch_model`` against the unpatched model.

Run: ``python -m pytest -q -m cuda tests/gpu/test_integrations_cuda.py``. Skipped without CUDA."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from moe_ref.testing import calc_diff

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "unit"))

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# fp32: calc_diff (1 - cosine similarity) of moe_ref's logits against transformers' (the expert GEMMs' fp32 sums in
# another order). bf16: both are compared with the fp32 model, and moe_ref's error may be at most twice transformers'
# own bf16 error (plus a floor): a fixed bf16 limit failed at 1.4e-4 where transformers' own error is of that size
FP32_LIMIT = 1e-6
BF16_ERROR_FACTOR, BF16_FLOOR = 2.0, 2e-5
MODEL_TYPES = ("deepseek_v3", "qwen3_moe", "mixtral")


def _check_logits(ours_logits, model_type: str, dtype: torch.dtype, x: torch.Tensor, reference_logits) -> None:
    """fp32: ours within FP32_LIMIT of transformers'; bf16: ours within BF16_ERROR_FACTOR x transformers' own bf16
    error, both measured against the fp32 model on the same weights."""
    if dtype == torch.float32:
        diff = calc_diff(ours_logits, reference_logits)
        assert diff < FP32_LIMIT, f"{model_type=} {dtype=} {diff=}"
        return
    with torch.no_grad():
        exact = _model(model_type, torch.float32)(x).logits
    ours, theirs = calc_diff(ours_logits.float(), exact), calc_diff(reference_logits.float(), exact)
    assert ours <= BF16_ERROR_FACTOR * theirs + BF16_FLOOR, f"{model_type=} bf16 error {ours=} vs transformers' {theirs=}"


def _model(model_type: str, dtype: torch.dtype):
    import hf_tiny_models as tiny

    return tiny.tiny_model(model_type).to(device="cuda", dtype=dtype)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    import hf_tiny_models as tiny

    return tiny.saved_once(tmp_path_factory.mktemp("hf_cuda"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_experts_implementation_moe_ref_on_cuda(model_type, dtype, saved):
    import hf_tiny_models as tiny
    from transformers import AutoModelForCausalLM

    import moe_ref.integrations.transformers  # noqa: F401  (registers "moe_ref")

    path = saved(model_type)
    default = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map="cuda").eval()
    ours = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map="cuda",
                                                experts_implementation="moe_ref").eval()
    x = tiny.prompt(batch=3, length=40).cuda()
    with torch.no_grad():
        ours_logits, default_logits = ours(x).logits, default(x).logits
    runner = next(m.__dict__["_moe_ref_runner"] for m in ours.modules() if "_moe_ref_runner" in m.__dict__)
    backend = runner.step.experts.name
    assert backend != "torch", backend  # a CUDA backend ran (triton, or auto's pick)
    _check_logits(ours_logits, model_type, dtype, x, default_logits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_patched_model_on_cuda(model_type, dtype):
    import hf_tiny_models as tiny

    from moe_ref.integrations.transformers import patch_model

    reference, patched = _model(model_type, dtype), _model(model_type, dtype)
    report = patch_model(patched, num_max_tokens_per_rank=64)
    assert report.blocks and all(b.shares_expert_storage for b in report.blocks), str(report)
    x = tiny.prompt(batch=3, length=40).cuda()  # 120 rows, cap 64: chunked
    with torch.no_grad():
        patched_logits, reference_logits = patched(x).logits, reference(x).logits
    _check_logits(patched_logits, model_type, dtype, x, reference_logits)
