"""The grouped MLP's GPU launch path, driven on the CPU with stand-ins for Triton's autotuner and the kernel: the
autotuner runs once per shape key, later launches of that key go straight to the kernel with the config it chose
(no autotuner work per call), a different key tunes again, and bound launches off (MOE_REF_BOUND_LAUNCH=0) keep the autotuner."""
from __future__ import annotations

import importlib
import json

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
    monkeypatch.setattr(gm, "autotuned_kernel", lambda same_bits=False: tuner)
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


# --- the recorded tile table (moe_ref.kernels.experts.tile_table) ---------------------------------------------------
from moe_ref.core.errors import TileTableError  # noqa: E402
from moe_ref.kernels.experts import tile_table  # noqa: E402

STAND_IN_CLASS = "9.0/Stand-in GPU"


def _entry(rows: int, tile: tuple, n: int = 32, k: int = 64, activation: int = 1) -> tile_table.TileEntry:
    flags = tile_table.matched_flags({"ACTIVATION": activation, "USE_TMA": False, "PERSISTENT": True})
    return tile_table.TileEntry(n=n, k=k, experts=3, rows=rows, flags=flags, tile=tile)


@pytest.fixture
def with_table(gpu_path, monkeypatch):
    """The GPU path on a stand-in GPU class whose table the test fills (``entries.extend(...)``)."""
    entries: list = []
    monkeypatch.setattr(gm, "gpu_class_of", lambda device: STAND_IN_CLASS)
    monkeypatch.setattr(tile_table, "load_table", lambda path=None: {STAND_IN_CLASS: entries})
    monkeypatch.setattr(gm, "_CHOSEN_BY", {})
    monkeypatch.delenv("MOE_REF_AUTOTUNE", raising=False)
    return (*gpu_path, entries)


def _tile_of_call(call: dict) -> tuple:
    return tuple(call[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"))


def test_a_recorded_tile_is_launched_without_autotune(with_table):
    """rows hint 24 (bucket 32, 10.7 rows per expert): of the entries at rows 16 and 256 the nearer in log2 rows per
    expert (16) wins; no autotuner call, and chosen_tiles says the table chose."""
    tuner, kernel, entries = with_table
    entries.extend([_entry(256, (64, 32, 64, 4, 3)), _entry(16, (16, 32, 32, 4, 2))])
    _launch()
    assert not tuner.calls and _tile_of_call(kernel.calls[0]) == (16, 32, 32, 4, 2)
    assert [row["source"] for row in gm.chosen_tiles()] == ["table"]


def test_a_tile_the_launch_cannot_take_is_skipped(with_table):
    """The nearest entry's tile is wider than the problem (BLOCK_N 256 > n 32): the next candidate is launched."""
    tuner, kernel, entries = with_table
    entries.extend([_entry(32, (16, 256, 64, 4, 3)), _entry(4096, (32, 32, 64, 4, 3))])
    _launch()
    assert not tuner.calls and _tile_of_call(kernel.calls[0]) == (32, 32, 64, 4, 3)


@pytest.mark.parametrize("why", ["other flags", "MOE_REF_AUTOTUNE=1", "another compute capability"])
def test_without_a_usable_entry_the_autotuner_chooses(with_table, monkeypatch, why):
    tuner, kernel, entries = with_table
    entries.append(_entry(32, (16, 32, 32, 4, 2), activation=0 if why == "other flags" else 1))
    if why == "MOE_REF_AUTOTUNE=1":
        monkeypatch.setenv("MOE_REF_AUTOTUNE", "1")
    if why == "another compute capability":
        monkeypatch.setattr(gm, "gpu_class_of", lambda device: "10.0/Another GPU")
    _launch()
    assert len(tuner.calls) == 1 and not kernel.calls
    assert [row["source"] for row in gm.chosen_tiles()] == ["autotune"]


def test_a_class_without_its_own_table_takes_one_of_its_compute_capability(with_table, monkeypatch):
    """An H200 with only an H100 table recorded launches the H100's tile, no autotune."""
    tuner, kernel, entries = with_table
    entries.append(_entry(32, (16, 32, 32, 4, 2)))
    monkeypatch.setattr(gm, "gpu_class_of", lambda device: "9.0/Another GPU")
    _launch()
    assert not tuner.calls and _tile_of_call(kernel.calls[0]) == (16, 32, 32, 4, 2)


def test_table_for_prefers_the_class_then_its_capability_and_header_of_names_the_source(tmp_path):
    body = lambda gpu: {"header": {"gpu": gpu, "date": "2026-12-07"},  # noqa: E731
                        "entries": [{"n": 1, "k": 1, "experts": 1, "rows": 1, "tile": [16, 16, 16, 4, 2],
                                     "flags": dict.fromkeys(tile_table.MATCHED_FLAGS, 0)}]}
    path = tmp_path / "tile_table.json"
    path.write_text(json.dumps({"format": 1, "gpu_classes": {"9.0/B GPU": body("B"), "9.0/A GPU": body("A"),
                                                             "8.0/C GPU": body("C")}}))
    tile_table.load_table.cache_clear()
    try:
        assert tile_table.table_for("9.0/B GPU", path)[0] == "9.0/B GPU"
        assert tile_table.table_for("9.0/New GPU", path)[0] == "9.0/A GPU"  # the first in name order
        assert tile_table.table_for("10.0/New GPU", path) is None and tile_table.table_for(None, path) is None
        assert tile_table.header_of("9.0/New GPU", path) == ("9.0/A GPU", {"gpu": "A", "date": "2026-12-07"}, 1)
    finally:
        tile_table.load_table.cache_clear()


def test_candidates_prefer_the_launch_shape_then_its_rows_per_expert():
    entries = [_entry(4096, (1, 1, 1, 1, 1), n=64), _entry(8192, (2, 2, 2, 2, 2)), _entry(2048, (3, 3, 3, 3, 3)),
               _entry(64, (4, 4, 4, 4, 4))]
    order = tile_table.candidates(entries, n=32, k=64, num_experts=3, flags={"ACTIVATION": 1, "PERSISTENT": True},
                                  rows_bucket=4096)
    # same shape first; 2048 and 8192 are one log2 step away (the smaller wins the tie), 64 six; the other shape last
    assert [tile[0] for tile in order] == [3, 2, 4, 1]


@pytest.mark.parametrize("text, field", [
    ("{", "not JSON"), ('{"format": 2, "gpu_classes": {}}', "format"),
    ('{"format": 1, "gpu_classes": {"9.0/X": {"entries": []}}}', "entries"),
    ('{"format": 1, "gpu_classes": {"9.0/X": {"entries": [{"n": 1, "k": 1, "experts": 1, "rows": 1, "tile": [1]}]}}}',
     "entries[0]"),
])
def test_a_malformed_table_is_cfg036_naming_the_field(text, field):
    with pytest.raises(TileTableError, match="CFG036") as err:
        tile_table.parse_table(text, "tile_table.json")
    assert field in str(err.value) and "tune_tiles.py" in str(err.value)


def test_the_shipped_table_parses():
    """Every GPU class recorded in the package's file (none until a GPU run records one) parses and names tiles of
    five or six ints."""
    if not tile_table.TABLE_PATH.exists():
        pytest.skip("no tile table recorded yet (scripts/tune_tiles.py --install on a GPU writes it)")
    table = tile_table.parse_table(tile_table.TABLE_PATH.read_text(), str(tile_table.TABLE_PATH))
    assert table and all(len(entry.tile) in (5, 6) for entries in table.values() for entry in entries)
