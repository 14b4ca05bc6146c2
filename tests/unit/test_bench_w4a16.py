"""scripts/bench_w4a16.py without a GPU: its plan (--dry-run), the sweep's tiles per launch, the peer configs, and the
reduction and markdown of its results."""

import importlib.util
import pathlib
import sys

import pytest

pytestmark = pytest.mark.unit


def _bench():
    path = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "bench_w4a16.py"
    if "bench_w4a16_under_test" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_w4a16_under_test", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_w4a16_under_test"] = module
        spec.loader.exec_module(module)
    return sys.modules["bench_w4a16_under_test"]


bw = _bench()


def test_dry_run_prints_the_plan_without_a_gpu(capsys):
    assert bw.main(["--dry-run", "--sweep", "--rows", "64", "--peer", "all", "--max-seconds", "100"]) == 0
    out = capsys.readouterr().out
    assert "rows [64]" in out and "int4_w4a16/packed" in out and "--max-seconds 100" in out
    assert "sweep int4_w4a16 elementwise gate_up" in out and "sweep mxfp4_w4a16 packed down" in out
    assert "left out M16 N128 K128 w8 s4: shared memory" in out  # elementwise INT4 stages a word per value
    assert "peer files:" in out and "peer configs down:" in out


def test_arguments_are_checked():
    with pytest.raises(SystemExit):
        bw.main(["--dry-run", "--unpack", "nibbles"])
    with pytest.raises(SystemExit):
        bw.main(["--dry-run", "--rows", "0"])
    assert bw._parse(["--unpack", "packed", "--peer", "none"]).unpack == "packed"


def test_sweep_tiles_follow_the_library_rules():
    keep, left_out = bw.sweep_tiles(1, "gate_up", "elementwise")
    assert (16, 64, 64, 4, 4) in keep and all(tile[2] % 32 == 0 for tile in keep)
    assert dict(left_out)[(16, 128, 128, 8, 4)].startswith("shared memory")
    packed, none_left = bw.sweep_tiles(1, "gate_up", "packed")
    assert set(keep) < set(packed) and none_left == []


def test_peer_configs_divide_k():
    for gemm in bw.GEMMS:
        k = bw.gemm_shape(gemm)[1]
        configs = bw.peer_configs(gemm)
        assert configs and all(k % c["BLOCK_SIZE_K"] == 0 and c["BLOCK_SIZE_M"] == 16 for c in configs)


def test_best_runs_skip_failures_and_keep_the_fastest():
    runs = [dict(path="p", rows=64, gemm="down", us=5.0, ok=True), dict(path="p", rows=64, gemm="down", us=3.0, ok=False),
            dict(path="p", rows=64, gemm="down", error="OutOfResources"), dict(path="p", rows=64, gemm="down", us=4.0,
                                                                               ok=True),
            dict(path="p", rows=512, gemm="down", us=9.0, ok=True)]
    best = bw.best_runs(runs, ("path", "rows", "gemm"))
    assert [(r["rows"], r["us"]) for r in best] == [(64, 4.0), (512, 9.0)]


def test_markdown_of_a_result():
    results = {"device": "GPU", "results": [dict(rows=64, path="bf16", us=900.0, speedup_vs_bf16=1.0,
                                                 weight_gb_per_s=3800.0)],
               "sweep_best": [dict(path="int4_w4a16", unpack="packed", rows=64, gemm="down", label="M16 N64 K64 w4 s4",
                                   us=100.0, weight_gb_per_s=2000.0, autotuned_us=120.0,
                                   autotuned_label="M16 N32 K128 w4 s4", calc_diff=1e-7)],
               "peer": [dict(skipped="no peer file"), dict(label="sglang 0.5.23 k", rows=[dict(rows=64, gate_up_us=1.0,
                                                                                                  down_us=2.0, mlp_us=3.5,
                                                                                                  ours_vs_peer=0.5,
                                                                                                  calc_diff=2e-6)])],
               "stopped_early": "sweep at x"}
    text = bw.markdown(results)
    assert "| 64 | bf16 | 900.0 | 1.0 | 3800.0 | - |" in text
    assert "| int4_w4a16 | packed | 64 | down | M16 N64 K64 w4 s4 | 100.0 | 2000 | 120.0 | M16 N32 K128 w4 s4 |" in text
    assert "skipped (no peer file)" in text and "| 64 | 1.0 | 2.0 | 3.5 | 0.50 | 2.0e-06 |" in text
    assert "Stopped early" in text
