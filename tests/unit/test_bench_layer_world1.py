"""scripts/bench_layer.py (and profile_step.py, which shares its paths) as one plain process: world 1, no process
group.

What runs without a GPU: the rank helpers at world 1 (`moe_ref.bench.ranks`), the 2-rank-only path's 'not available'
row, and the a2a anchor against the moe_ref routed step over the ``local`` transport (torch experts) on CPU
(`moe_ref.bench.layer_paths`, through the script's own command line and `run_path`). Timing needs CUDA.
"""
import pytest
import torch
import torch.distributed as dist

from moe_ref.bench import layer_paths, ranks
from moe_ref.core.config import MoEConfig
from moe_ref.testing import calc_diff
from script_loader import load_script

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def bench_layer():
    return load_script("bench_layer")


def test_world_one_helpers_need_no_process_group():
    assert not dist.is_initialized()
    assert not ranks.distributed() and ranks.rank() == 0
    ranks.barrier()
    ranks.finish_ranks()
    assert ranks.gather_floats(1.5, "cpu") == [1.5]
    assert ranks.all_ok(True, "cpu") and not ranks.all_ok(False, "cpu")
    assert not dist.is_initialized()


def test_world_one_routed_steps_on_cpu(bench_layer):
    args = bench_layer.parse_args(["--num-experts", "8", "--num-topk", "2", "--hidden", "128", "--intermediate", "128"])
    cfg = MoEConfig(num_experts=8, num_topk=2, hidden_size=128, intermediate_size=128, name="world1")
    device = torch.device("cpu")
    weights = layer_paths.make_weights(args, 0, 8, device)
    inputs = layer_paths.make_inputs(args, 0, 16, device)
    row, output = bench_layer.run_path("deep_gemm_mega", args, cfg, None, 16, weights, inputs, None, device)
    assert output is None and row["status"] == "not available"
    assert row["error"].startswith("needs 2+ ranks, this run has 1: DeepGEMM's SM90 mega-MoE")
    anchor = layer_paths.build_a2a_grouped_mm(args, cfg, None, 16, weights, device)[0](*inputs)
    step, cleanup = layer_paths.build_moe_ref(args, cfg, None, 16, weights, device, backend="torch")
    assert step.transport_name == "local"
    assert anchor.float().norm() > 0 and calc_diff(step(*inputs), anchor) < 1e-4
    cleanup()
    identity = layer_paths.build_a2a_identity(args, cfg, None, 16, weights, device)[0](*inputs)
    step, cleanup = layer_paths.build_moe_ref(args, cfg, None, 16, weights, device, identity=True)
    assert calc_diff(step(*inputs), identity) < 1e-4
    cleanup()
