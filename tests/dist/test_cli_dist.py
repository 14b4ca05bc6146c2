"""``python -m moe_ref`` in a subprocess: the console entry point's one coded line, and the whole MXFP4 demo on
two processes (its torchrun). Moved from tests/unit/test_cli.py, whose tests call ``main([...])`` in-process:
every test that starts a process is in the dist tier."""
import os
import subprocess
import sys

import pytest

from moe_ref.core.config import preset

pytestmark = pytest.mark.dist


def _mxfp4_bytes(cfg, num_experts: int) -> int:
    from moe_ref.checkpoint.formats import QuantSpec, expert_weight_bytes
    from moe_ref.checkpoint.synthetic import quantizable_config

    cfg = quantizable_config(cfg, "mxfp4")
    return expert_weight_bytes(QuantSpec.published("mxfp4"), cfg.expert_hidden_size, cfg.intermediate_size, num_experts)


def test_make_demo_quant_mxfp4_on_two_processes():
    """The whole demo: two ranks each load their half of an MXFP4 checkpoint through MegaMoE.load_hf_weights."""
    env = {k: v for k, v in os.environ.items() if k not in ("MOE_REF_DEBUG", "MOE_REF_NUM_MAX_TOKENS_PER_RANK")}
    proc = subprocess.run([sys.executable, "-m", "moe_ref", "demo", "--preset", "tiny-kimi-k3", "--quant", "mxfp4",
                           "--runs", "1", "--tokens-per-rank", "80"], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    held = _mxfp4_bytes(preset("tiny-kimi-k3"), num_experts=8)  # half of the 16 experts on each rank
    assert "on 2 ranks (cpu, fp32)" in proc.stdout and f"{held} bytes on the device" in proc.stdout
    assert proc.stdout.count("PASS") == 3 and "RESULT: PASS" in proc.stdout  # each rank, and the result


def test_python_dash_m_prints_one_line_and_exits_2():
    env = {k: v for k, v in os.environ.items() if k != "MOE_REF_DEBUG"}
    proc = subprocess.run([sys.executable, "-m", "moe_ref", "bench", "--experts", "0"], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and proc.stderr.startswith("moe-ref: [CFG015] ")
