"""scripts/bench_w4a16.py without a GPU: its plan (--dry-run), the sweep's tiles per rows regime, the autotuned tiles
it reads back (against the key the kernel really records), one sweep run, the peer configs, and the reduction and
markdown of its results."""

import importlib
import types

import pytest
import torch
import triton

from script_loader import load_script

pytestmark = pytest.mark.unit

bw = load_script("bench_w4a16")
w4k = importlib.import_module("moe_ref.kernels.experts.grouped_mlp_w4")  # the module, whatever the package re-exports
W4Weight = importlib.import_module("moe_ref.kernels.experts.w4").W4Weight


def test_dry_run_prints_the_plan_without_a_gpu(capsys):
    assert bw.main(["--dry-run", "--sweep", "--rows", "64", "4096", "--peer", "all", "--max-seconds", "100"]) == 0
    out = capsys.readouterr().out
    assert "rows [64, 4096]" in out and "--max-seconds 100" in out
    # one row per 4-bit path, W4A16 and W4A8
    assert "API rows: bf16, fp8_ckpt, fp8_ckpt_pool, int4_w4a16, mxfp4_w4a16, int4_w4a8, mxfp4_w4a8\n" in out
    assert "decode" not in out.lower()
    decode = [bw.tile_label(t) for t in w4k.TILES if t[0] <= 16]  # 64 rows: 1.3 per expert
    prefill = [bw.tile_label(t) for t in w4k.TILES if t[0] >= 32]  # 4096 rows: 85.3 per expert
    assert f"sweep 64 rows (1.3 per expert), per format and GEMM: {decode}\n" in out
    assert f"sweep 4096 rows (85.3 per expert), per format and GEMM: {prefill}\n" in out
    assert "peer files:" in out and "peer configs down:" in out


def test_dry_run_without_sweep_or_peer(capsys):
    assert bw.main(["--dry-run", "--peer", "none"]) == 0
    out = capsys.readouterr().out
    assert "rows [64, 512]" in out
    assert "sweep" not in out and "peer" not in out


def test_arguments_are_checked():
    with pytest.raises(SystemExit):
        bw.main(["--dry-run", "--w4-decode", "bits"])  # the decode A/B is gone with its switch
    with pytest.raises(SystemExit):
        bw.main(["--dry-run", "--rows", "0"])
    args = bw._parse(["--peer", "none", "--sweep"])
    assert args.sweep and args.peer == "none" and not hasattr(args, "w4_decode")


def test_sweep_tiles_follow_the_kernels_regimes():
    # 8-row blocks too up to 4 rows per expert, one 16-row block per expert up to 16 (decode), larger M blocks above;
    # every candidate a kernel tile
    assert {t[0] for t in bw.sweep_tiles(4 * bw.NUM_EXPERTS)} == {8, 16}
    assert {t[0] for t in bw.sweep_tiles(4 * bw.NUM_EXPERTS + 1)} == {16}
    assert bw.sweep_tiles(64) and {t[0] for t in bw.sweep_tiles(16 * bw.NUM_EXPERTS)} == {16}
    assert min(t[0] for t in bw.sweep_tiles(16 * bw.NUM_EXPERTS + 1)) >= 32
    assert set(bw.sweep_tiles(64)) | set(bw.sweep_tiles(4096)) == {tuple(t) for t in w4k.TILES}
    assert bw.sweep_tiles(4096, every_tile=True) == [tuple(t) for t in w4k.TILES]


def test_tile_label():
    assert bw.tile_label((16, 64, 4, 3)) == "M16 N64 w4 s3"
    assert bw.tile_label([128, 128, 8, 3]) == "M128 N128 w8 s3"  # as read back from the JSON
    assert bw.tile_label(None) == "?"


class _Tuner:
    """Stands in for Triton's autotuner in `launch_w4_gemm`: launches nothing, "chooses" the next of `CHOICES`."""

    CHOICES: list = []

    def __init__(self, tiles):
        block_m, block_n, warps, stages = self.CHOICES.pop(0)
        self.best_config = triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps,
                                         num_stages=stages)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _fake_planes(fmt: str, gemm: str) -> W4Weight:
    """A W4Weight of the bench's shape for `gemm` without its memory (broadcast zeros: only shapes and dtypes are
    read when nothing launches)."""
    out, k = bw.gemm_shape(gemm)
    scale_dtype = torch.bfloat16 if fmt == "int4" else torch.uint8
    words = torch.zeros((), dtype=torch.int32).expand(bw.NUM_EXPERTS, out, k // 8)
    block_scale = torch.zeros((), dtype=scale_dtype).expand(bw.NUM_EXPERTS, -(-k // 256), out, 8)  # block-major
    return W4Weight(fmt, words, block_scale, k)


def _autotuned_launch(fmt: str, gemm: str, rows: int) -> None:
    """The bench's own launch of `gemm` (gate_up with its SiLU into h [P, F], down into y [P, D]), autotuned."""
    n, k = bw.gemm_shape(gemm)
    x = torch.zeros(4, k, dtype=torch.bfloat16)
    c = torch.zeros(4, n // 2 if gemm == "gate_up" else n, dtype=torch.bfloat16)
    segments = torch.zeros(bw.NUM_EXPERTS, dtype=torch.int32)
    case = dict(rows=rows, layout=types.SimpleNamespace(row_start_e=segments, num_rows_e=segments))
    bw._launch(case, _fake_planes(fmt, gemm), gemm, x, c)


def test_autotuned_tiles_read_the_key_the_kernel_records(monkeypatch):
    # the key comes from launch_w4_gemm itself (not the interpreter's fixed tile), so a change of its layout shows
    monkeypatch.setattr(w4k, "is_interpreter", lambda: False)
    monkeypatch.setattr(w4k, "_autotuned", _Tuner)
    monkeypatch.setattr(w4k, "_TUNED", {})
    monkeypatch.setattr(_Tuner, "CHOICES", [(16, 64, 4, 3), (64, 128, 8, 3), (16, 128, 8, 3)])
    _autotuned_launch("int4", "gate_up", 64)
    _autotuned_launch("int4", "down", 600)  # rows bucket 1024
    _autotuned_launch("mxfp4", "gate_up", 64)
    assert len(w4k.tuned_tiles()) == 3
    assert bw.autotuned_tiles(64, torch.bfloat16) == {"gate_up": (16, 64, 4, 3), "down": None}
    assert bw.autotuned_tiles(1000, torch.bfloat16) == {"gate_up": None, "down": (64, 128, 8, 3)}
    assert bw.autotuned_tiles(64, torch.uint8) == {"gate_up": (16, 128, 8, 3), "down": None}
    assert bw.autotuned_tiles(100, torch.bfloat16) == {"gate_up": None, "down": None}  # rows bucket 128
    assert bw.autotuned_tiles(64, torch.float16) == {"gate_up": None, "down": None}  # fp16 INT4 scales: not run


def test_autotuned_tiles_need_this_scripts_experts_and_bf16_x():
    key = (64, 2 * bw.INTER, bw.HIDDEN, bw.NUM_EXPERTS, (1, True, 1), torch.bfloat16, torch.bfloat16)
    assert bw.autotuned_tiles(64, torch.bfloat16, {key: (16, 64, 4, 3)})["gate_up"] == (16, 64, 4, 3)
    other_experts = (*key[:3], 8, *key[4:])
    fp16_x = (*key[:5], torch.float16, key[6])
    assert bw.autotuned_tiles(64, torch.bfloat16, {other_experts: (16, 64, 4, 3), fp16_x: (16, 64, 4, 4)}) == {
        "gate_up": None, "down": None}


def _sweep_case(monkeypatch, launch):
    """(case, weight, ref) of a 2-row sweep at 64 rows, with `launch(out, tile)` in place of the kernel and a fixed
    10 us from the timer."""
    monkeypatch.setattr(bw, "launch_w4_gemm", lambda a, weight, out, *args, tile, **kwargs: launch(out, tile))
    monkeypatch.setattr(bw, "bench", lambda fn: fn() or 10.0)
    segments = torch.zeros(bw.NUM_EXPERTS, dtype=torch.int32)
    case = dict(rows=64, touched=0.5, layout=types.SimpleNamespace(row_start_e=segments, num_rows_e=segments))
    weight = types.SimpleNamespace(nbytes=lambda: 4_000_000)
    ref = dict(out=torch.arange(8.0).reshape(2, 4), us=12.0, label="M16 N64 w4 s3")
    return case, weight, ref


def test_a_sweep_run_is_checked_against_the_autotuned_output(monkeypatch):
    tiles = []

    def launch(out, tile):
        tiles.append(tile)
        out.copy_(torch.arange(8.0).reshape(2, 4) * (1.0 if tile[1] == 64 else -1.0))  # N128 tiles wrong

    case, weight, ref = _sweep_case(monkeypatch, launch)
    run = bw.sweep_run("int4_w4a16", case, weight, "down", None, ref, (16, 64, 4, 4))
    assert tiles and set(tiles) == {(16, 64, 4, 4)}  # forced, every call
    assert run["ok"] and run["calc_diff"] < bw.SWEEP_CALC_DIFF_LIMIT and run["us"] == 10.0
    assert (run["path"], run["rows"], run["gemm"], run["tile"], run["label"]) == (
        "int4_w4a16", 64, "down", [16, 64, 4, 4], "M16 N64 w4 s4")
    assert (run["autotuned_us"], run["autotuned_label"]) == (12.0, "M16 N64 w4 s3")
    assert run["weight_gb_per_s"] == pytest.approx(4_000_000 * 0.5 / 10.0 / 1e3)
    assert bw.outcome(run) == "10 us (autotuned M16 N64 w4 s3: 12 us)"
    wrong = bw.sweep_run("int4_w4a16", case, weight, "down", None, ref, (16, 128, 4, 3))
    assert not wrong["ok"] and bw.outcome(wrong).endswith(f"FAIL calc_diff {wrong['calc_diff']:.1e}")


def test_a_tile_that_fails_is_recorded_but_a_lost_context_is_not(monkeypatch):
    def launch(out, tile):
        raise RuntimeError("out of resources: shared memory" if tile[3] == 4 else "an illegal memory access")

    case, weight, ref = _sweep_case(monkeypatch, launch)
    run = bw.sweep_run("mxfp4_w4a16", case, weight, "gate_up", None, ref, (16, 64, 4, 4))
    assert run["error"] == "RuntimeError: out of resources: shared memory" and "us" not in run
    assert bw.outcome(run) == run["error"]
    with pytest.raises(RuntimeError, match="illegal"):
        bw.sweep_run("mxfp4_w4a16", case, weight, "gate_up", None, ref, (16, 64, 4, 3))


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
    best = bw.best_runs(runs, bw.SWEEP_BEST_KEYS)
    assert [(r["rows"], r["us"]) for r in best] == [(64, 4.0), (512, 9.0)]


def test_api_row_one_per_path(monkeypatch):
    monkeypatch.setattr(bw, "bench", lambda fn: fn() is not None and 250.0)
    graphed = []
    monkeypatch.setattr(bw, "graphed", lambda fn: graphed.append(fn) or fn)  # each row times its call captured too
    case = dict(rows=64, x=torch.ones(2, 4), layout=None, touched=0.5)
    bf16, y = bw.api_row("bf16", lambda x, layout: x, 4_000_000_000, None, case, None)
    assert torch.equal(y, case["x"]) and len(graphed) == 1
    assert bf16 == dict(rows=64, path="bf16", us=250.0, speedup_vs_bf16=1.0, graph_us=250.0, graph_speedup_vs_bf16=1.0,
                        weight_gb_per_s=8000.0)
    int4, y = bw.api_row("int4_w4a16", lambda x, layout: 2 * x, 1_000_000_000, lambda x, layout: x, case,
                         base=dict(us=500.0, graph_us=1000.0))
    assert torch.equal(y, 2 * case["x"])
    assert (int4["path"], int4["speedup_vs_bf16"], int4["graph_speedup_vs_bf16"], int4["weight_gb_per_s"]) == (
        "int4_w4a16", 2.0, 4.0, 2000.0)
    assert int4["calc_diff_vs_dequantized_fp32"] > 0  # y vs the reference's x
    same, _ = bw.api_row("mxfp4_w4a16", lambda x, layout: x, 1, lambda x, layout: x, case,
                         base=dict(us=500.0, graph_us=500.0))
    assert same["calc_diff_vs_dequantized_fp32"] == pytest.approx(0.0, abs=1e-7)


def test_markdown_of_a_result():
    results = {"device": "GPU",
               "results": [dict(rows=64, path="bf16", us=900.0, speedup_vs_bf16=1.0, weight_gb_per_s=3800.0),
                           dict(rows=64, path="int4_w4a16", us=600.0, speedup_vs_bf16=1.5, weight_gb_per_s=1500.0,
                                graph_us=550.0, graph_speedup_vs_bf16=1.6,
                                calc_diff_vs_dequantized_fp32=3e-6,
                                autotuned_tiles={"gate_up": [16, 64, 4, 3], "down": None})],
               "sweep_best": [dict(path="int4_w4a16", rows=64, gemm="down", label="M16 N64 w4 s4",
                                   us=100.0, weight_gb_per_s=2000.0, autotuned_us=120.0,
                                   autotuned_label="M16 N128 w4 s3", calc_diff=1e-7)],
               "peer": [dict(skipped="no peer file"), dict(label="sglang 0.5.23 k", rows=[dict(rows=64, gate_up_us=1.0,
                                                                                                  down_us=2.0, mlp_us=3.5,
                                                                                                  ours_vs_peer=0.5,
                                                                                                  calc_diff=2e-6)])],
               "stopped_early": "sweep at x"}
    text = bw.markdown(results)
    assert "| calc_diff vs fp32 dequantized | autotuned tiles gate_up / down |" in text
    assert "| 64 | bf16 | 900.0 | 1.0 | - | - | 3800.0 | - | - |" in text  # a row of before: no graph figure
    assert "| 64 | int4_w4a16 | 600.0 | 1.5 | 550.0 | 1.6 | 1500.0 | 3.0e-06 | M16 N64 w4 s3 / ? |" in text
    assert "| format | rows | GEMM | tile | us | weight GB/s | autotuned us | autotuned tile | calc_diff |" in text
    assert "| int4_w4a16 | 64 | down | M16 N64 w4 s4 | 100.0 | 2000 | 120.0 | M16 N128 w4 s3 | 1.0e-07 |" in text
    assert "skipped (no peer file)" in text and "| 64 | 1.0 | 2.0 | 3.5 | 0.50 | 2.0e-06 |" in text
    assert "Stopped early" in text
    assert "decode" not in text.lower()
