"""A transformers DeepSeek-V3 MoE block vs MegaMoE over 2 ranks (torchrun, gloo), loaded from the block's own
checkpoint in the fused and the per-expert naming (issue: drop-in layer parity on 1 and 2 ranks; the 1-rank
half is tests/unit/test_hf_parity.py)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from launch import torchrun  # noqa: E402

pytestmark = pytest.mark.dist
HF_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_worker.py")
CASES = [f"{layout}-groups{g}" for layout in ("fused", "hub") for g in (4, 1)]


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf2")
    return torchrun(2, [], folder, 180, worker=HF_WORKER)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rank", [0, 1])
def test_megamoe_on_two_ranks_matches_transformers(launch, case, rank):
    assert launch.returncode == 0, f"rc={launch.returncode}\n" + "\n".join(launch.log.splitlines()[-30:])
    result = launch.results[rank][case]
    assert result["ok"], f"{case=} {rank=}: {result}"
    assert result["local_experts"] == 8  # 16 experts over 2 ranks: each rank holds (and read) only its half
