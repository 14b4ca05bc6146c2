"""scripts/ab_grouped_mlp.py's `--ab alignment` on the CPU: the pools it compares (128-aligned vs the Triton experts'
own), that both get the layer's rows hint and so the same regime (and the padded pool without the hint another),
how it reads each pool's autotune choice, its report, and the dry run."""

import types

import pytest

from moe_ref.kernels.experts import grouped_mlp_tiles as tiles
from script_loader import load_script

pytestmark = pytest.mark.unit


ab = load_script("ab_grouped_mlp")


def test_pools_and_their_regimes():
    pools = ab.alignment_pools(nohint=True)
    assert pools == {"A_align128": {"alignment": 128}, "B_align1": {"alignment": 1},
                     "C_align128_nohint": {"alignment": 128, "hint": False}}
    # Kimi-K2 at 64 routed rows over 48 experts: the hint (64) is the regime's, whatever the pool's rows
    for name in ("A_align128", "B_align1"):
        assert ab.hint_and_regime(pools[name], 64, 4480, 48, fp8=False) == (64, "decode")
    assert ab.hint_and_regime(pools["C_align128_nohint"], 64, 4480, 48, fp8=False) == (4480, "mid")
    decode = ab.autotune_candidates(64, 48, 7168, 2048, fp8=True)
    assert set(decode["gate_up"]) <= {tiles.normalize_tile(t) for t in tiles.DECODE_TILES_FP8}
    assert all(tile[1] == 128 for tile in decode["gate_up"])  # FP8 gate_up: BLOCK_N 128


def test_dry_run_prints_each_pool(capsys):
    assert ab.main(["--ab", "alignment", "--dry-run", "--models", "kimi-k2", "--rows", "64", "--nohint"]) == 0
    out = capsys.readouterr().out
    assert "A_align128           bf16  P=  4480 rows hint     64 -> decode" in out
    assert "B_align1             bf16  P=    64 rows hint     64 -> decode" in out
    assert "C_align128_nohint    fp8   P=  4480 rows hint   4480 -> mid" in out
    assert "35 of 48 experts get rows" in out
    args = ab._parse(["--ab", "alignment"])
    assert (args.models, args.rows) == (["kimi-k2", "step3"], [64, 512])
    assert ab._parse([]).rows == [64, 512, 4096, 32768]


def test_chosen_configs_reads_both_gemms_from_the_autotuner_cache(monkeypatch):
    gate_up = tiles.config_of_tile((16, 64, 128, 4, 4))
    down = tiles.config_of_tile((32, 128, 64, 4, 4))
    # a cache key holds the values of the real autotuner's key arguments, in its order: gate_up N = F, K = D; down
    # N = D, K = F
    names = ab.gm.autotuned_kernel().keys
    assert "N" in names and "K" in names and "pool_rows_bucket" in names

    def key(n, k):
        values = {"rows_hint": 64, "pool_rows_bucket": 8192, "N": n, "K": k, "num_experts": 48}
        return tuple(values.get(name, 0) for name in names)

    cache = {key(2048, 7168): gate_up, key(7168, 2048): down}
    monkeypatch.setattr(ab.gm, "autotuned_kernel", lambda: types.SimpleNamespace(cache=cache, keys=names))
    assert ab.chosen_configs(2048, 7168) == (gate_up, down)


def test_report_separates_layout_from_tiles():
    row = {"model": "kimi-k2", "rows": 64, "precision": "bf16", "calc_diff": 0.0, "ok": True,
           "grouped_mm_us": 1100.0, "a": "A_align128", "b": "B_align1", "a_us": 730.0, "b_us": 1015.0,
           "speedup": 730.0 / 1015.0,
           "pools": {"A_align128": {"alignment": 128, "pool_rows": 4480, "rows_hint": 64, "regime": "decode",
                                    "tiles": {"gate_up": (16, 64, 128, 4, 4), "down": (32, 128, 64, 4, 4)}},
                     "B_align1": {"alignment": 1, "pool_rows": 64, "rows_hint": 64, "regime": "decode",
                                  "tiles": {"gate_up": (32, 64, 128, 4, 4), "down": (16, 64, 128, 4, 4)}}},
           "us": {"A_align128": {"A_align128": 730.0, "B_align1": 1010.0},
                  "B_align1": {"A_align128": 731.0, "B_align1": 1015.0}},
           "b_over_a_same_tiles": {"A_align128": 731.0 / 730.0, "B_align1": 1015.0 / 1010.0}}
    lines = ab.alignment_lines(row)
    assert len(lines) == 3 and "A's tiles   730.0 us  B's tiles  1010.0 us" in lines[0]
    assert "A / B 0.719" in lines[2] and "A's tiles 1.001, B's tiles 1.005" in lines[2]
    table = "\n".join(ab.alignment_markdown({"cases": [row]}))
    assert "| kimi-k2 | 64 | bf16 | B_align1 | 64 | 64 -> decode | (32, 64, 128, 4, 4); (16, 64, 128, 4, 4) | " \
           "731.0 | 1015.0 | 1100.0 | 0.0e+00 |" in table
    assert "| kimi-k2 | 64 | bf16 | 730.0 | 1015.0 | 0.719 | 1.001 | 1.005 |" in table


def test_variants_table_has_a_column_per_schedule():
    row = {"model": "kimi-k2", "rows": 64, "precision": "fp8", "variants": ["grid", "hinted", "persistent"],
           "us": {"grid": 430.0, "hinted": 420.0, "persistent": 450.0},
           "speedup": {"grid": 1.0, "hinted": 430.0 / 420.0, "persistent": 430.0 / 450.0},
           "calc_diff": {"grid": 0.0, "hinted": 0.0, "persistent": 2e-9}, "ok": True}
    assert ab.variants("schedule", "bf16", None, None).keys() == \
        {"grid", "hinted", "persistent"}
    lines = ab.variants_markdown({"cases": [row]})
    assert lines[0] == ("| model | rows | precision | grid us | hinted us | persistent us | A / hinted | "
                        "A / persistent | max calc_diff vs A |")
    assert lines[2] == "| kimi-k2 | 64 | fp8 | 430.0 | 420.0 | 450.0 | 1.024 | 0.956 | 2.0e-09 |"
