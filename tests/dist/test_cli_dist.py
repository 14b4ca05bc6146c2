"""``python -m moe_ref`` in a subprocess: the console entry point's one coded line, and the whole quantized demo
(MXFP4, INT4) on two processes (its torchrun). Moved from tests/unit/test_cli.py, whose tests call ``main([...])``
in-process: every test that starts a process is in the dist tier."""
import os
import subprocess
import sys

import pytest

from moe_ref.core.config import preset

pytestmark = pytest.mark.dist


def _expert_bytes(cfg, quant: str, num_experts: int) -> int:
    from moe_ref.checkpoint.formats import QuantSpec, expert_weight_bytes
    from moe_ref.checkpoint.synthetic import quantizable_config

    cfg = quantizable_config(cfg, quant)
    return expert_weight_bytes(QuantSpec.published(quant), cfg.expert_hidden_size, cfg.intermediate_size, num_experts)


@pytest.mark.parametrize("name, quant", [("tiny-kimi-k3", "mxfp4"), ("tiny-step3", "int4_group")])
def test_make_demo_quant_on_two_processes(name, quant):
    """The whole demo: two ranks each load their half of a quantized checkpoint through MegaMoE.load_hf_weights
    (tiny-step3 int4_group: its quantized share_expert used to break the writer inside every process)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MOE_REF_DEBUG", "MOE_REF_NUM_MAX_TOKENS_PER_RANK", "MOE_REF_PROGRESS")}
    proc = subprocess.run([sys.executable, "-m", "moe_ref", "demo", "--preset", name, "--quant", quant,
                           "--runs", "1", "--tokens-per-rank", "80"], capture_output=True, text=True, timeout=240,
                          env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cfg = preset(name)
    held = _expert_bytes(cfg, quant, num_experts=cfg.num_experts // 2)  # half of the experts on each rank
    assert "on 2 ranks (cpu, fp32)" in proc.stdout and f"{held} bytes on the device" in proc.stdout
    assert proc.stdout.count("PASS") == 3 and "RESULT: PASS" in proc.stdout  # each rank, and the result
    assert "%|" not in proc.stderr  # no tqdm bar (forward calls, experts read) drawn into a pipe


def test_python_dash_m_prints_one_line_and_exits_2():
    env = {k: v for k, v in os.environ.items() if k != "MOE_REF_DEBUG"}
    proc = subprocess.run([sys.executable, "-m", "moe_ref", "bench", "--tokens", "0"], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and proc.stderr.startswith("moe-ref: [CFG015] ")
