"""scripts/ab_grouped_mlp.py `--ab alignment` end to end on the CPU (interpreter, a tiny model, timing and the
autotune choice stood in for): each pool runs every pool's tiles, the runs agree on the routed rows, and the row
holds every pool's facts and times."""

import pytest
import torch
import triton

from moe_ref.bench import cases
from moe_ref.kernels.experts import grouped_mlp_tiles as tiles
from script_loader import load_script

pytestmark = pytest.mark.interpreter


# h is left unwritten outside the segments (as the layer runs it): tiles read those rows and drop their results
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_alignment_case_runs_every_pool_with_every_pools_tiles(precision, monkeypatch):
    ab = load_script("ab_grouped_mlp")
    monkeypatch.setitem(ab.MODELS, "tiny", (4, 256, 128, 2))  # e, D, F, top-k
    chosen = {"A": tuple(map(tiles.config_of_tile, [(16, 128, 128, 4, 4), (16, 128, 128, 4, 4)])),
              "B": tuple(map(tiles.config_of_tile, [(32, 128, 64, 4, 3), (32, 64, 128, 4, 3)]))}
    tuned = []  # each pool's autotune call; the stand-in "chooses" A's tiles first, then B's

    def chosen_configs(inter, hidden):
        tuned.append((inter, hidden))
        return chosen["AB"[len(tuned) - 1]]

    timed = []

    def do_bench(fn):
        fn()
        timed.append(fn)
        return 0.5 + 0.25 * (len(timed) % 2)

    monkeypatch.setattr(ab, "chosen_configs", chosen_configs)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    weights = cases.make_weights(4, 256, 128, with_fp8=True, device="cpu")
    case = cases.make_case("tiny", 6, weights, seed=0, with_fp8=True, device="cpu")
    layout = (ab.triton_layout(precision, weights[2], weights[3]) if precision == "fp8" else
              ab.triton_layout(precision, weights[0], None))
    row = ab.alignment_case(case, precision, layout, ab.alignment_pools(), rounds=2)
    assert tuned == [(128, 256)] * 2
    assert row["ok"] and row["calc_diff"] < 1e-4
    pools = row["pools"]
    assert [pools[n]["alignment"] for n in pools] == [128, 1] and pools["B_align1"]["pool_rows"] == 6
    assert {pools[n]["rows_hint"] for n in pools} == {6} and {pools[n]["regime"] for n in pools} == {"decode"}
    assert pools["A_align128"]["tiles"] == {"gate_up": (16, 128, 128, 4, 4), "down": (16, 128, 128, 4, 4)}
    assert pools["B_align1"]["tiles"] == {"gate_up": (32, 128, 64, 4, 3), "down": (32, 64, 128, 4, 3)}
    # 4 distinct (pool, tiles) runs x 2 rounds, + grouped_mm each round for bf16
    assert len(timed) == 2 * (4 + (precision == "bf16"))
    assert set(row["us"]) == set(pools) and all(set(v) == set(pools) for v in row["us"].values())
    assert row["a_us"] == row["us"]["A_align128"]["A_align128"] and row["b_us"] == row["us"]["B_align1"]["B_align1"]
    assert (row["grouped_mm_us"] is not None) == (precision == "bf16")
