"""grouped_mlp's forced-config launcher path (`_launch_gemm(..., config=...)`, used by
scripts/tune_grouped_mlp.py) and the GROUP_M program order, vs the torch twin."""

import importlib

import pytest
import torch
import triton

from moe_ref.kernels.grouped_mlp import grouped_mlp_ref

pytestmark = pytest.mark.interpreter

gm = importlib.import_module("moe_ref.kernels.grouped_mlp")  # the package re-exports a function of that name


def _case(counts, hidden, inter, device, align=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    starts, row = [], 0
    for count in counts:
        starts.append(row)
        row += -(-count // align) * align
    num_rows = row + align
    x_RD = torch.randn(num_rows, hidden, generator=gen)
    gate_up = torch.randn(len(counts), 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(len(counts), hidden, inter, generator=gen) / inter**0.5
    return (x_RD.to(device), gate_up.to(device), down.to(device),
            torch.tensor(starts, dtype=torch.int64, device=device),
            torch.tensor(counts, dtype=torch.int32, device=device))


def _valid_rows(row_start_e, num_rows_e, num_rows):
    valid = torch.zeros(num_rows, dtype=torch.bool)
    for start, count in zip(row_start_e.tolist(), num_rows_e.tolist()):
        valid[start:start + count] = True
    return valid


def _run_forced(x_RD, gate_up, down, row_start_e, num_rows_e, config1, config2):
    """Both GEMMs as grouped_mlp launches them (silu, non-fp8), outputs pre-filled with NaN so a tile
    that no program writes shows up."""
    num_rows, hidden = x_RD.shape
    inter = down.shape[2]
    h_RF = torch.full((num_rows, inter), float("nan"), dtype=x_RD.dtype, device=x_RD.device)
    y_RD = torch.full((num_rows, hidden), float("nan"), dtype=x_RD.dtype, device=x_RD.device)
    common = dict(situ_beta=4.0, situ_linear_beta=25.0, fp8=False, quant_out=False, rows_hint=num_rows)
    gm._launch_gemm(x_RD, None, gate_up, None, h_RF, None, row_start_e, num_rows_e, n=inter, k=hidden,
                    activation="silu", config=config1, **common)
    gm._launch_gemm(h_RF, None, down, None, y_RD, None, row_start_e, num_rows_e, n=hidden, k=inter,
                    activation="none", config=config2, **common)
    return y_RD


def _config(block_m, block_n, block_k, group_m=None):
    meta = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k}
    if group_m is not None:
        meta["GROUP_M"] = group_m
    return triton.Config(meta, num_warps=4, num_stages=3)


@pytest.mark.parametrize("config1,config2", [
    (_config(16, 16, 16), _config(16, 32, 16)),                    # N tiles fastest (GROUP_M default 1)
    (_config(16, 16, 16, group_m=2), _config(16, 32, 32, group_m=3)),  # swizzled, groups across experts
    (_config(32, 32, 32, group_m=4), _config(16, 16, 16, group_m=8)),  # group larger than some experts
])
def test_forced_configs_match_twin(config1, config2, device):
    counts = [5, 0, 40, 17, 16]  # empty expert, ragged, multi-block, exact block
    x_RD, gate_up, down, row_start_e, num_rows_e = _case(counts, hidden=48, inter=40, device=device)
    y_RD = _run_forced(x_RD, gate_up, down, row_start_e, num_rows_e, config1, config2)
    y_ref = grouped_mlp_ref(x_RD, gate_up, down, row_start_e, num_rows_e)
    valid = _valid_rows(row_start_e, num_rows_e, x_RD.shape[0])
    got, want = y_RD.cpu()[valid], y_ref.cpu()[valid]
    assert not got.isnan().any(), f"rows left unwritten: {config1=} {config2=}"
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_forced_config_errors(device):
    x_RD, gate_up, down, row_start_e, num_rows_e = _case([3], hidden=16, inter=8, device=device)
    h_RF = torch.empty(x_RD.shape[0], 8, device=device)
    common = dict(n=8, k=16, activation="silu", situ_beta=4.0, situ_linear_beta=25.0, rows_hint=16)
    args = (x_RD, None, gate_up, None, h_RF, None, row_start_e, num_rows_e)
    with pytest.raises(ValueError, match="BLOCK_N must be 128"):
        gm._launch_gemm(*args, fp8=True, quant_out=True, config=_config(16, 64, 64), **common)
    with pytest.raises(ValueError, match="BLOCK_K must divide 128"):
        gm._launch_gemm(*args, fp8=True, quant_out=False, config=_config(16, 64, 96), **common)
    with pytest.raises(ValueError, match="missing"):
        gm._launch_gemm(*args, fp8=False, quant_out=False, config=triton.Config({"BLOCK_M": 16}), **common)


def test_regime_buckets():
    assert gm._regime(64, 48)[0] == "decode"
    assert gm._regime(4096, 48)[0] == "mid"  # 85 rows per expert
    assert gm._regime(32768, 48)[0] == "prefill"  # 683 rows per expert
    assert gm._regime(16, 0)[0] == "decode"


def test_config_problem_smem_and_registers():
    big = triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=5)
    facts = dict(n=2048, k=7168, fp8=False, quant_out=False, ieee_fp32=False)
    # GEMM1: 5 x (128 + 2 x 128) x 64 x 2 B = 240 KB
    assert "shared memory" in gm._config_problem(big, gated=True, smem_limit=227 * 1024, **facts)
    assert gm._config_problem(big, gated=False, smem_limit=227 * 1024, **facts) is None  # 160 KB
    wide = triton.Config({"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 64}, num_warps=8, num_stages=3)
    assert "register" in gm._config_problem(wide, gated=True, **facts)


def test_tile_lists_take_an_optional_group_m(monkeypatch):
    monkeypatch.setattr(gm, "_PREFILL_TILES", [(128, 256, 64, 8, 3, 8), (128, 128, 64, 8, 4, 1)])
    configs = gm._gpu_configs()
    tiles = [gm._tile(c) for c in configs]
    assert (128, 256, 64, 8, 3, 8) in tiles and (128, 128, 64, 8, 4) in tiles  # GROUP_M 1 drops out
    swizzled = configs[tiles.index((128, 256, 64, 8, 3, 8))]
    assert swizzled.kwargs["GROUP_M"] == 8 and swizzled.num_stages == 3
    named = {"rows_hint": 32768, "num_experts": 48, "N": 7168, "K": 2048}
    kept = [gm._tile(c) for c in gm._prune_configs(configs, named, ACTIVATION=0, FP8=False, QUANT_OUT=False)]
    assert kept == [(128, 256, 64, 8, 3, 8), (128, 128, 64, 8, 4)]
