"""scripts/bench_layer.py (and profile_step.py, which uses it) as one plain process: world 1, no process group.

What runs without a GPU: the rank helpers at world 1, the 2-rank-only path's 'not available' row, and the a2a anchor
against the moe_ref routed step over the ``local`` transport (torch experts) on CPU. Timing needs CUDA.
"""
import importlib.util
import pathlib
import sys

import pytest
import torch
import torch.distributed as dist

from moe_ref.core.config import MoEConfig
from moe_ref.testing import calc_diff

pytestmark = pytest.mark.unit
SCRIPTS = pathlib.Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def bench_layer():
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location("bench_layer", SCRIPTS / "bench_layer.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(SCRIPTS))


def test_world_one_helpers_need_no_process_group(bench_layer):
    assert not dist.is_initialized()
    assert not bench_layer.distributed() and bench_layer.rank() == 0
    bench_layer.barrier()
    bench_layer.finish_ranks()
    assert bench_layer.gather_floats(1.5, "cpu") == [1.5]
    assert bench_layer.all_ok(True, "cpu") and not bench_layer.all_ok(False, "cpu")
    assert not dist.is_initialized()


def test_world_one_routed_steps_on_cpu(bench_layer):
    args = bench_layer.parse_args(["--num-experts", "8", "--num-topk", "2", "--hidden", "128", "--intermediate", "128"])
    cfg = MoEConfig(num_experts=8, num_topk=2, hidden_size=128, intermediate_size=128, name="world1")
    device = torch.device("cpu")
    weights = bench_layer.make_weights(args, 0, 8, device)
    inputs = bench_layer.make_inputs(args, 0, 16, device)
    row, output = bench_layer.run_path("deep_gemm_mega", args, cfg, None, 16, weights, inputs, None, device)
    assert output is None and row["status"] == "not available"
    assert row["error"].startswith("needs 2+ ranks, this run has 1: DeepGEMM's SM90 mega-MoE")
    anchor = bench_layer.build_a2a_grouped_mm(args, cfg, None, 16, weights, device)[0](*inputs)
    step, cleanup = bench_layer.build_moe_ref(args, cfg, None, 16, weights, device, backend="torch")
    assert step.transport_name == "local"
    assert anchor.float().norm() > 0 and calc_diff(step(*inputs), anchor) < 1e-4
    cleanup()
    identity = bench_layer.build_a2a_identity(args, cfg, None, 16, weights, device)[0](*inputs)
    step, cleanup = bench_layer.build_moe_ref(args, cfg, None, 16, weights, device, identity=True)
    assert calc_diff(step(*inputs), identity) < 1e-4
    cleanup()
