"""scripts/bench_eager.py on the CPU: the Triton-launch-path A/B turns bound launches off for its own calls only,
the markdown reads a row of every route and each checkpoint row's speed-up, and a checkpoint is written once and
loads as the layer the script builds."""
from __future__ import annotations

import os

import pytest

from script_loader import load_script

pytestmark = pytest.mark.unit
bench = load_script("bench_eager")


def test_only_the_triton_launch_calls_run_with_bound_launches_off(monkeypatch):
    from moe_ref.kernels.runtime import launch as bl

    monkeypatch.setattr(bl, "_on", True)
    with bench.launch_path("eager_launches"):
        assert bl.bound_launches_on()
    with bench.launch_path(bench.TRITON_LAUNCH):
        assert not bl.bound_launches_on()
    assert bl.bound_launches_on()
    with pytest.raises(RuntimeError), bench.launch_path(bench.TRITON_LAUNCH):
        raise RuntimeError("a failed call")
    assert bl.bound_launches_on()


def test_the_markdown_has_a_line_per_row_with_the_launch_counts(tmp_path):
    row = {"dispatch": "fp8", "tokens": 16, "eager_wall_us": 748.0, "eager_host_us": 627.0, "eager_host_work_us": 61.0,
           "eager_launches_wall_us": 1895.0, "eager_launches_host_us": 1893.0, "eager_launches_host_work_us": 880.0,
           "graph_us": 734.0,
           "eager_over_graph": 1.02, "launches": 0.0, "graph_launches": 1.0, "copies": 3.0,
           "eager_launches_launches": 20.0, "eager_launches_graph_launches": 0.0, "eager_launches_copies": 2.0}
    meta = {"device": "GPU", "torch": "t", "triton": "tr", "date": "d", "command": "c"}
    bench.write_markdown(str(tmp_path), meta, [row])
    text = (tmp_path / "bench_eager.md").read_text()
    line = next(line for line in text.splitlines() if line.startswith("| random | fp8 | 16 |"))
    assert "| 748 | 627 | 61 | 1895 | 1893 | 880 |" in line and "| 0 + 1 + 3 | 20 + 0 + 2 |" in line
    header = next(line for line in text.splitlines() if line.startswith("| weights | dispatch |"))
    separator = text.splitlines()[text.splitlines().index(header) + 1]
    assert header.count("|") == separator.count("|") == line.count("|")


def test_host_work_is_timed_on_an_idle_gpu_for_fewer_calls_than_the_checks_leave_unread(monkeypatch):
    """Each sample starts after a sync and times fewer calls than DeferredChecks lets stay unread, so no call
    waits for the GPU."""
    from moe_ref.ep.device_checks import DeferredChecks

    assert bench.HOST_WORK_CALLS < DeferredChecks().max_pending
    events = []
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: events.append("sync"))
    result = bench.host_work_us({"eager": lambda x: events.append("call")}, None, repeats=2)
    assert events == (["sync"] + ["call"] * bench.HOST_WORK_CALLS + ["sync"]) * 2
    assert set(result) == {"eager"} and result["eager"] >= 0


def test_checkpoint_rows_get_their_speedup_over_the_random_row_of_the_same_case():
    rows = [{"weights": "random", "dispatch": "bf16", "tokens": 16, "eager_wall_us": 1400.0, "graph_us": 1390.0},
            {"weights": "int4_group", "dispatch": "bf16", "tokens": 16, "eager_wall_us": 600.0, "graph_us": 595.0},
            {"weights": "int4_group", "dispatch": "fp8", "tokens": 16, "eager_wall_us": 500.0}]  # no random fp8 row
    lines = bench.speedup_lines(rows)
    assert lines[-1] == "| int4_group | bf16 | 16 | 2.33x | 2.34x |" and not any("| fp8 |" in line for line in lines)
    assert bench.speedup_lines(rows[:1]) == []


def test_a_checkpoint_is_written_once_and_loads_at_the_layer_the_script_reads(tmp_path, monkeypatch):
    import torch

    from moe_ref import MegaMoE
    from moe_ref.checkpoint.synthetic import quantizable_config
    from moe_ref.core.config import preset

    cfg = quantizable_config(preset("tiny-kimi-k2"), "int4_group")
    writes = []
    write = bench.write_synthetic_checkpoint
    monkeypatch.setattr(bench, "write_synthetic_checkpoint", lambda *a, **k: writes.append(a) or write(*a, **k))
    folder = bench.checkpoint_folder(cfg, "int4_group", str(tmp_path))
    assert bench.checkpoint_folder(cfg, "int4_group", str(tmp_path)) == folder and len(writes) == 1
    assert os.listdir(tmp_path) == [os.path.basename(folder)]  # written beside, then renamed into place
    layer = MegaMoE(cfg, None, num_max_tokens_per_rank=8).load_hf_weights(folder, layer_idx=bench.CHECKPOINT_LAYER)
    assert layer.quantized_experts is not None
    y = layer(torch.randn(5, cfg.hidden_size))
    assert y.shape == (5, cfg.hidden_size) and bool(torch.isfinite(y).all())
