"""scripts/bench_router.py on the CPU: its table reads every path's eager and graph figure, and the plot is drawn."""
from __future__ import annotations

import pytest

from script_loader import load_script

pytestmark = pytest.mark.unit
bench = load_script("bench_router")

ROW = dict(router="kimi-k2", tokens=16, experts=384, max_abs_diff_vs_fp32=3.8e-6, weight_gbps=2100.0,
           us={"moe_ref": (5.0, 4.0), "torch fp32": (21.0, 18.0), "torch bf16 (anchor)": (6.0, 5.0)})
META = dict(device="GPU", torch="2.11", triton="3.6", date="2026-12-01", command="python3 scripts/bench_router.py")


def test_the_table_has_each_path_eager_and_in_a_graph(tmp_path):
    text = bench.markdown({"meta": META, "rows": [ROW]})
    assert "| kimi-k2 | 16 | 5.0 / 4.0 | 21.0 / 18.0 | 6.0 / 5.0 | 2100 | 4.50 | 3.80e-06 |" in text
    pytest.importorskip("matplotlib")
    bench.plot({"meta": META, "rows": [ROW, {**ROW, "tokens": 128}]}, str(tmp_path / "router.png"))
    assert (tmp_path / "router.png").stat().st_size > 0


def test_without_a_gpu_it_says_so(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the script would run")
    assert bench.main(["--out", "unused"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
