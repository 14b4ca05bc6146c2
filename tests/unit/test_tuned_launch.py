"""The grouped MLP's GPU launch path, driven on the CPU with stand-ins for Triton's autotuner and the kernel: the
autotuner runs once per shape key, later launches of that key go straight to the kernel with the config it chose
(no autotuner work per call), a different key tunes again, and bound launches off (MOE_REF_BOUND_LAUNCH=0) keep the autotuner."""
from __future__ import annotations

import importlib

import pytest
import torch
import triton

from moe_ref.kernels.experts import grouped_mlp_tiles as tiles

gm = importlib.import_module("moe_ref.kernels.experts.grouped_mlp")  # the package re-exports a function of that name

pytestmark = pytest.mark.unit

CHOSEN = triton.Config({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=3,
                       pre_hook=tiles.set_tma_block_shapes)


class _Launches:
    """Records ``kernel[grid](*args, **kwargs)`` calls; as the autotuner, it also 'chooses' ``CHOSEN``."""

    def __init__(self):
        self.calls: list[dict] = []
        self.best_config = None
        self.cache: dict = {}  # the autotuner's key -> config (what clear_tuned_configs empties)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append(kwargs)
            self.best_config = CHOSEN
            return "launched"
        return launch


@pytest.fixture
def gpu_path(monkeypatch):
    """launch_gemm as on a GPU, with the autotuner and the kernel replaced by recorders."""
    tuner, kernel = _Launches(), _Launches()
    monkeypatch.setattr(gm, "is_interpreter", lambda: False)
    monkeypatch.setattr(gm, "autotuned_kernel", lambda: tuner)
    monkeypatch.setattr(gm, "_grouped_gemm_kernel", kernel)
    monkeypatch.setattr(gm, "launch", lambda jit_fn, grid, *args, **kwargs: jit_fn[grid](*args, **kwargs))
    monkeypatch.setattr(gm, "_TUNED", {})
    monkeypatch.setattr(tiles, "is_interpreter", lambda: False)
    return tuner, kernel


def _launch(activation="silu", rows_hint=24, hidden=64):
    a = torch.zeros(24, hidden, dtype=torch.bfloat16)
    b = torch.zeros(3, 2 * 32 if activation != "none" else 32, hidden, dtype=torch.bfloat16)
    c = torch.zeros(24, 32, dtype=torch.bfloat16)
    row_start_e, num_rows_e = torch.tensor([0, 8, 16]), torch.tensor([8, 8, 8])
    return gm.launch_gemm(a, None, b, None, c, None, row_start_e, num_rows_e, n=32, k=hidden, activation=activation,
                          situ_beta=4.0, situ_linear_beta=25.0, fp8=False, quant_out=False, rows_hint=rows_hint)


def test_the_autotuner_runs_once_per_shape_key(gpu_path):
    tuner, kernel = gpu_path
    _launch()
    assert len(tuner.calls) == 1 and not kernel.calls
    for _ in range(3):
        _launch()
    assert len(tuner.calls) == 1 and len(kernel.calls) == 3  # the later launches skip the autotuner
    assert {k: kernel.calls[0][k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")} == \
        {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}
    assert kernel.calls[0]["ACTIVATION"] == tuner.calls[0]["ACTIVATION"]  # the same kernel flags as tuned
    assert kernel.calls[0]["enable_fp_fusion"] is True


@pytest.mark.parametrize("change", [dict(activation="none"), dict(rows_hint=200), dict(hidden=128)])
def test_another_key_tunes_again(gpu_path, change):
    tuner, kernel = gpu_path
    _launch()
    _launch(**change)
    assert len(tuner.calls) == 2 and not kernel.calls
    _launch(rows_hint=17)  # the same power-of-2 bucket as 24: the first key's choice
    assert len(tuner.calls) == 2 and len(kernel.calls) == 1


def test_the_switch_keeps_the_autotuner(gpu_path, monkeypatch):
    tuner, kernel = gpu_path
    from moe_ref.kernels.runtime import launch as bl

    monkeypatch.setenv("MOE_REF_BOUND_LAUNCH", "0")
    monkeypatch.setattr(bl, "_on", None)  # the switch is read at the process's first launch: read it again
    for _ in range(3):
        _launch()
    assert len(tuner.calls) == 3 and not kernel.calls
    with bl.bound_launches(True):  # on again: the config the autotuner chose for the key, without it
        for _ in range(2):
            _launch()
    assert len(tuner.calls) == 3 and len(kernel.calls) == 2


def test_clear_tuned_configs_makes_the_next_launch_tune_again(gpu_path):
    """The key holds the rows hint, not the pool: after clear_tuned_configs the same key tunes again (on the next
    launch's own arguments) instead of reusing the first launch's choice."""
    tuner, kernel = gpu_path
    _launch()
    tuner.cache["a key"] = CHOSEN
    _launch()
    assert len(tuner.calls) == 1 and len(kernel.calls) == 1
    gm.clear_tuned_configs()
    assert tuner.cache == {}
    _launch()
    assert len(tuner.calls) == 2 and len(kernel.calls) == 1


def test_a_pool_of_another_size_bucket_tunes_again(gpu_path):
    """The same rows hint over a pool of 24 rows and one of 200 (128-aligned segments hold more padding rows): each
    pool size bucket gets its own tile, so a benchmark's second pool does not run the first pool's."""
    tuner, kernel = gpu_path
    _launch()
    a = torch.zeros(200, 64, dtype=torch.bfloat16)
    b = torch.zeros(3, 2 * 32, 64, dtype=torch.bfloat16)
    c = torch.zeros(200, 32, dtype=torch.bfloat16)
    row_start_e, num_rows_e = torch.tensor([0, 128, 192]), torch.tensor([8, 8, 8])
    gm.launch_gemm(a, None, b, None, c, None, row_start_e, num_rows_e, n=32, k=64, activation="silu", situ_beta=4.0,
                   situ_linear_beta=25.0, fp8=False, quant_out=False, rows_hint=24)
    assert len(tuner.calls) == 2 and not kernel.calls
    _launch()  # the first pool's bucket: its own choice, no tuning
    assert len(tuner.calls) == 2 and len(kernel.calls) == 1


def test_the_default_schedule_follows_the_rows_hints_regime(gpu_path):
    """schedule=None: "hinted" (programs walk the tiles, grid from the hint) up to 32 rows per expert, "grid" above."""
    tuner, _ = gpu_path
    _launch(rows_hint=24)  # 8 rows per expert: decode
    _launch(rows_hint=3 * 512)  # 512 rows per expert: prefill
    assert [call["PERSISTENT"] for call in tuner.calls] == [True, False]
