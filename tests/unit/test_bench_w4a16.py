"""scripts/bench_w4a16.py without a GPU: its plan (--dry-run), the sweep's tiles per launch, the peer configs, the
4-bit decode A/B's alternation, and the reduction and markdown of its results."""

import importlib.util
import os
import pathlib
import sys

import pytest
import torch

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


# tiles the library's rules leave out at this shape: BLOCK_K 48 splits a 32-wide scale group; 64x128x256 over 8 stages
# would stage more than AUTOTUNE_SMEM_LIMIT
BAD_K_STEP, TOO_MUCH_SMEM = (16, 64, 48, 4, 4), (64, 128, 256, 8, 8)


def test_dry_run_prints_the_plan_without_a_gpu(capsys):
    assert bw.main(["--dry-run", "--sweep", "--rows", "64", "--peer", "all", "--max-seconds", "100"]) == 0
    out = capsys.readouterr().out
    assert "rows [64]" in out and "--max-seconds 100" in out
    assert ("API rows: bf16, fp8_ckpt, int4_w4a16/convert, int4_w4a16/bits, mxfp4_w4a16/convert, mxfp4_w4a16/bits\n"
            in out)
    assert "4-bit decodes (MOE_REF_W4_DECODE, temporary A/B): convert, bits (alternating, 3 rounds, median)\n" in out
    assert "unpack" not in out and "elementwise" not in out and "packed" not in out
    every = str([bw.tile_label(t) for t in bw._tiles().DECODE_TILES_W4])
    for path in bw.W4_PATHS:
        for gemm in bw.GEMMS:
            assert f"sweep {path} {gemm}: {every}\n" in out  # one unpack: every W4 tile fits this shape
    assert "left out" not in out
    assert "peer files:" in out and "peer configs down:" in out


def test_dry_run_prints_the_tiles_left_out(capsys, monkeypatch):
    monkeypatch.setattr(bw._tiles(), "DECODE_TILES_W4", [(16, 64, 64, 4, 4), BAD_K_STEP, TOO_MUCH_SMEM])
    assert bw.main(["--dry-run", "--sweep", "--peer", "none"]) == 0
    out = capsys.readouterr().out
    assert "sweep int4_w4a16 gate_up: ['M16 N64 K64 w4 s4']\n" in out
    assert out.count("left out M16 N64 K48 w4 s4: a 4-bit k-step covers whole 32-wide scale groups") == 4
    assert out.count("left out M64 N128 K256 w8 s8: shared memory") == 4


def test_dry_run_of_one_decode(capsys):
    assert bw.main(["--dry-run", "--peer", "none", "--w4-decode", "bits"]) == 0
    out = capsys.readouterr().out
    assert "API rows: bf16, fp8_ckpt, int4_w4a16/bits, mxfp4_w4a16/bits\n" in out
    assert "4-bit decodes (MOE_REF_W4_DECODE, temporary A/B): bits (one)\n" in out


def test_arguments_are_checked():
    with pytest.raises(SystemExit):
        bw.main(["--dry-run", "--unpack", "packed"])  # one unpack now: the option is gone
    with pytest.raises(SystemExit):
        bw.main(["--dry-run", "--rows", "0"])
    args = bw._parse(["--peer", "none", "--sweep"])
    assert args.sweep and args.peer == "none" and not hasattr(args, "unpack")
    assert args.w4_decode == "both" and bw.decodes_of(args.w4_decode) == ("convert", "bits")
    assert bw.decodes_of(bw._parse(["--w4-decode", "convert"]).w4_decode) == ("convert",)
    with pytest.raises(SystemExit):
        bw.main(["--dry-run", "--w4-decode", "i2f"])


def test_the_decodes_alternate_each_under_its_switch(monkeypatch):
    monkeypatch.setenv("MOE_REF_W4_DECODE", "convert")  # what the caller had: back afterwards
    seen = []

    def fn():
        seen.append(os.environ["MOE_REF_W4_DECODE"])
        return len(seen)

    monkeypatch.setattr(bw, "bench", lambda f: f() and 10.0 * len(seen))
    timed = bw.time_decodes(fn, ("convert", "bits"), rounds=3)
    assert seen == ["convert", "bits"] * 4  # 3 timed rounds, then each output
    assert timed == {"convert": (30.0, 7), "bits": (40.0, 8)}  # medians of 10/30/50 and 20/40/60 us
    assert os.environ["MOE_REF_W4_DECODE"] == "convert"
    monkeypatch.delenv("MOE_REF_W4_DECODE")
    seen.clear()
    assert bw.time_decodes(fn, ("bits",)) == {"bits": (10.0, 2)} and seen == ["bits", "bits"]  # one round alone
    assert "MOE_REF_W4_DECODE" not in os.environ


def test_sweep_tiles_follow_the_library_rules(monkeypatch):
    for w4 in (1, 2):
        for gemm in bw.GEMMS:
            assert bw.sweep_tiles(w4, gemm) == ([tuple(t) for t in bw._tiles().DECODE_TILES_W4], [])
    monkeypatch.setattr(bw._tiles(), "DECODE_TILES_W4", [BAD_K_STEP, (16, 64, 64, 4, 4), TOO_MUCH_SMEM])
    keep, left_out = bw.sweep_tiles(1, "gate_up")
    assert keep == [(16, 64, 64, 4, 4)] and [tile for tile, _ in left_out] == [BAD_K_STEP, TOO_MUCH_SMEM]
    assert dict(left_out)[BAD_K_STEP].startswith("a 4-bit k-step")
    assert dict(left_out)[TOO_MUCH_SMEM].startswith("shared memory ~512 KB")  # 8 x (64 x 2 + 2 x 128 x 0.5) x 256


def test_autotune_key_matches_the_kernel():
    gm = bw._gm()
    assert bw.AUTOTUNE_KEY == tuple(gm.autotuned_kernel().keys)
    key = dict(zip(bw.AUTOTUNE_KEY, bw.autotune_key(64, 1, "gate_up", "bits")))
    assert key == dict(rows_hint=64, N=bw.INTER, K=bw.HIDDEN, num_experts=bw.NUM_EXPERTS,
                       ACTIVATION=gm._ACTIVATIONS["silu"], INTERLEAVED=False, FP8=False, QUANT_OUT=False, W4=1,
                       W4_DECODE=1, USE_TMA=False, PERSISTENT=False)
    down = dict(zip(bw.AUTOTUNE_KEY, bw.autotune_key(65, 2, "down", "convert")))
    assert (down["rows_hint"], down["N"], down["K"], down["ACTIVATION"], down["W4"], down["W4_DECODE"]) == (
        128, bw.HIDDEN, bw.INTER, gm._ACTIVATIONS["none"], 2, 0)


def test_autotuned_tile_reads_the_autotune_cache(monkeypatch):
    tiles = bw._tiles()
    want = bw.autotune_key(512, 2, "down", "bits")
    dtypes = ("torch.bfloat16", "torch.int32", "torch.uint8")
    cache = {(*want[:-2], True, False, False) + dtypes: tiles.config_of_tile((16, 128, 32, 4, 4)),  # an extra flag
             bw.autotune_key(512, 1, "down", "bits") + dtypes: tiles.config_of_tile((16, 32, 128, 4, 4)),  # INT4
             bw.autotune_key(512, 2, "down", "convert") + dtypes: tiles.config_of_tile((16, 64, 64, 4, 4)),
             want + dtypes: tiles.config_of_tile((16, 64, 256, 8, 3))}

    class Kernel:
        pass

    kernel = Kernel()
    kernel.cache = cache
    monkeypatch.setattr(bw, "_gm", lambda: type("GM", (), {"autotuned_kernel": staticmethod(lambda: kernel)}))
    assert bw._autotuned_tile(512, 2, "down", "bits") == (16, 64, 256, 8, 3)
    assert bw._autotuned_tile(512, 2, "down", "convert") == (16, 64, 64, 4, 4)
    assert bw._autotuned_tile(300, 1, "down", "bits") == (16, 32, 128, 4, 4)  # rows bucketed to 512
    assert bw._autotuned_tile(512, 2, "gate_up", "bits") is None


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


def test_markdown_of_a_result():
    results = {"device": "GPU", "results": [dict(rows=64, path="bf16", us=900.0, speedup_vs_bf16=1.0,
                                                 weight_gb_per_s=3800.0)],
               "sweep_best": [dict(path="int4_w4a16", rows=64, gemm="down", label="M16 N64 K64 w4 s4",
                                   us=100.0, weight_gb_per_s=2000.0, autotuned_us=120.0,
                                   autotuned_label="M16 N32 K128 w4 s4", calc_diff=1e-7)],
               "peer": [dict(skipped="no peer file"), dict(label="sglang 0.5.23 k", rows=[dict(rows=64, gate_up_us=1.0,
                                                                                                  down_us=2.0, mlp_us=3.5,
                                                                                                  ours_vs_peer=0.5,
                                                                                                  calc_diff=2e-6)])],
               "stopped_early": "sweep at x"}
    text = bw.markdown(results)
    assert "| 64 | bf16 | 900.0 | 1.0 | 3800.0 | - |" in text
    assert "| format | rows | GEMM | tile | us | weight GB/s | autotuned us | autotuned tile | calc_diff |" in text
    assert "| int4_w4a16 | 64 | down | M16 N64 K64 w4 s4 | 100.0 | 2000 | 120.0 | M16 N32 K128 w4 s4 | 1.0e-07 |" in text
    assert "unpack" not in text
    assert "skipped (no peer file)" in text and "| 64 | 1.0 | 2.0 | 3.5 | 0.50 | 2.0e-06 |" in text
    assert "Stopped early" in text
    assert "4-bit decodes" not in text  # no row timed two decodes


def test_markdown_says_whether_the_decodes_gave_the_same_bits():
    rows = [dict(rows=64, path=f"int4_w4a16/{d}", w4_decode=d, us=1.0, speedup_vs_bf16=1.0, weight_gb_per_s=1.0,
                 bitwise_eq_decodes=True) for d in bw.W4_DECODES]
    text = bw.markdown({"results": rows})
    assert "| 64 | int4_w4a16/convert | 1.0 |" in text and "| 64 | int4_w4a16/bits | 1.0 |" in text
    assert "outputs bitwise equal: all\n" in text
    rows[1]["bitwise_eq_decodes"] = False
    assert "outputs bitwise equal: NO for 64 int4_w4a16/bits\n" in bw.markdown({"results": rows})


def test_api_rows_give_a_4bit_path_one_row_per_decode():
    case = dict(rows=64, x=torch.ones(2, 4), layout=None, touched=0.5)

    def experts(x, layout):  # as if the decodes disagreed in one value
        return x * (2.0 if os.environ["MOE_REF_W4_DECODE"] == "bits" else 1.0)

    def reference(x, layout):
        return x

    (bf16, y), = bw.api_rows("bf16", lambda x, layout: x, 4000, None, dict(case), ("convert", "bits"), None)
    assert torch.equal(y, case["x"])
    assert bf16["path"] == "bf16" and bf16["speedup_vs_bf16"] == 1.0 and "w4_decode" not in bf16
    assert "calc_diff_vs_dequantized_fp32" not in bf16
    rows = bw.api_rows("int4_w4a16", experts, 1000, reference, case, ("convert", "bits"), base_us=bf16["us"])
    assert [(r["path"], r["w4_decode"], r["bitwise_eq_decodes"]) for r, _ in rows] == [
        ("int4_w4a16/convert", "convert", False), ("int4_w4a16/bits", "bits", False)]
    assert rows[0][0]["calc_diff_vs_dequantized_fp32"] == 0.0 and rows[1][0]["calc_diff_vs_dequantized_fp32"] > 0
    assert torch.equal(rows[1][1], 2 * case["x"])
    (one, _), = bw.api_rows("mxfp4_w4a16", lambda x, layout: x, 1000, None, case, ("bits",), base_us=1.0)
    assert one["path"] == "mxfp4_w4a16/bits" and "bitwise_eq_decodes" not in one
