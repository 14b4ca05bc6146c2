"""A transformers model patched by ``moe_ref.integrations.transformers.patch_model`` over 2 CPU ranks (torchrun,
gloo; tests/dist/patch_worker.py): each rank keeps half the experts and runs its own prompt; its logits equal the
same model patched at one rank and transformers' own model within fp32 rounding, and greedy ``generate`` gives the
same tokens. Every family moe_ref reads (tests/unit/hf_tiny_models.py) over the default transport, DeepSeek-V3 over
``a2a`` too. Plus: ``import moe_ref`` imports neither transformers nor huggingface_hub (a fresh process)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "unit"))

from launch import read_reports, torchrun  # noqa: E402
from test_integrations_transformers import FAMILIES  # noqa: E402

pytestmark = pytest.mark.dist

WORLD_SIZE = 2
LAUNCH_TIMEOUT_S = 300
RTOL = 1e-5  # fp32: relative to the largest logit
WORKER = os.path.join(HERE, "patch_worker.py")
CASES = [f"{t}:auto" for t in FAMILIES] + ["deepseek_v3:a2a"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("patch_dist")
    launch = torchrun(WORLD_SIZE, ["--cases", *CASES], out, LAUNCH_TIMEOUT_S, worker=WORKER)
    return launch, read_reports(out, WORLD_SIZE)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_a_model_patched_over_two_ranks_equals_one_rank(launched, case, rank):
    launch, reports = launched
    result = reports[rank].get(case)
    assert result is not None, f"{rank=} never reported {case}; rc={launch.returncode}\n{launch.log[-3000:]}"
    assert "error" not in result, f"{case=} {rank=}: {result.get('code')}\n{result['error']}"
    assert result["ep_size"] == WORLD_SIZE and all(n * WORLD_SIZE == 8 for n in result["local_experts"]), result
    bound = RTOL * result["scale"]
    assert result["max_err_vs_one_rank"] <= bound, f"{case=} {rank=}: {result}"
    assert result["max_err_vs_transformers"] <= bound, f"{case=} {rank=}: {result}"
    assert result["generate_equal"], f"{case=} {rank=}: {result}"
    if case.endswith(":a2a"):
        assert result["transport"] == "a2a", result


def test_every_rank_exits_cleanly(launched):
    launch, _ = launched
    assert launch.returncode == 0, f"rc={launch.returncode}\n{launch.log[-3000:]}"
    assert launch.leftovers == [], launch.leftovers


def test_import_moe_ref_imports_neither_transformers_nor_huggingface_hub():
    code = ("import sys, moe_ref, moe_ref.integrations, moe_ref.checkpoint.hub; "
            "bad = [m for m in ('transformers', 'huggingface_hub') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
