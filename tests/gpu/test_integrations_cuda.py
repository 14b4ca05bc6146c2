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

# calc_diff (1 - cosine similarity) of the logits, moe_ref vs transformers, per dtype: the expert GEMMs' rounding
# (bf16 outputs; fp32 through Triton's dot) moves the logits of a 2-layer model by about this much
DIFF_LIMIT = {torch.bfloat16: 1e-4, torch.float32: 1e-6}
MODEL_TYPES = ("deepseek_v3", "qwen3_moe", "mixtral")


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
        diff = calc_diff(ours(x).logits, default(x).logits)
    runner = next(m.__dict__["_moe_ref_runner"] for m in ours.modules() if "_moe_ref_runner" in m.__dict__)
    backend = runner.step.experts.name
    assert backend != "torch", backend  # a CUDA backend ran (triton, or auto's pick)
    assert diff < DIFF_LIMIT[dtype], f"{model_type=} {dtype=} {diff=} {backend=}"


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
        diff = calc_diff(patched(x).logits, reference(x).logits)
    assert diff < DIFF_LIMIT[dtype], f"{model_type=} {dtype=} {diff=}"
