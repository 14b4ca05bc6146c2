"""``moe-ref`` and ``moe_ref.tools.dist_check`` refuse bad flags, devices, paths and memory with one coded line.

Every test calls ``main([...])`` in-process and checks the exit status, the code and the numbers; the demo's
torchrun is replaced by a recorder (``subprocess.call``) so nothing is spawned. The tests that run ``python -m
moe_ref`` in a subprocess are in tests/dist/test_cli_dist.py.
"""
import json
import os
import socket
import stat

import pytest
import torch

from moe_ref.tools import cli, dist_check
from moe_ref.core import envs
from moe_ref.core.config import PRESETS, MoEConfig, preset
from moe_ref.core.errors import MoERefError
from moe_ref.testing import count_bytes
from moe_ref.core.weights import MoEWeights

pytestmark = pytest.mark.unit
GiB = 2**30


def _run(capsys, argv, entry=cli.main):
    status = entry(argv)
    out, err = capsys.readouterr()
    return status, out, err


def _one_coded_line(err: str, code: str, prefix: str = "moe-ref") -> str:
    """The last stderr line is ``<prefix>: [CODE] ...``; no traceback anywhere."""
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"{prefix}: [{code}] "), err
    return last


class _Torchrun(list):
    """Stands in for ``subprocess.call``: records the demo's command and its checkpoint folder's state."""

    status = 0

    def __call__(self, command, env=None):
        folder = command[command.index("--checkpoint") + 1]
        is_dir = os.path.isdir(folder)
        self.append(dict(command=command, folder=folder, existed=is_dir,
                         mode=stat.S_IMODE(os.stat(folder).st_mode) if is_dir else None,
                         entries=sorted(os.listdir(folder)) if is_dir else None))
        return self.status


@pytest.fixture
def no_spawn(monkeypatch):
    torchrun = _Torchrun()
    monkeypatch.setattr(cli.subprocess, "call", torchrun)
    monkeypatch.delenv("MOE_REF_NUM_MAX_TOKENS_PER_RANK", raising=False)
    monkeypatch.delenv("MOE_REF_DEBUG", raising=False)
    return torchrun


# --- flags out of range: CFG015 naming the flag, the value and the range ----------------------------------
@pytest.mark.parametrize("argv, flag, value, bound", [
    (["bench", "--tokens", "0"], "--tokens", "0", ">= 1"),
    (["bench", "--tokens", "16,-4"], "--tokens", "-4", ">= 1"),
    (["bench", "--ranks", "0"], "--ranks", "0", ">= 1"),
    (["demo", "--runs", "0"], "--runs", "0", ">= 1"),
    (["demo", "--runs", "-3"], "--runs", "-3", ">= 1"),
    (["demo", "--cap", "0"], "--cap", "0", ">= 1"),
    (["demo", "--cap", "-5"], "--cap", "-5", ">= 1"),
    (["demo", "--nproc", "0"], "--nproc", "0", ">= 1"),
    (["demo", "--tokens-per-rank", "-1"], "--tokens-per-rank", "-1", ">= 0"),
    (["plan", "--ep", "0"], "--ep", "0", ">= 1"),
    (["plan", "--max-num-tokens", "0"], "--max-num-tokens", "0", ">= 1"),
    (["plan", "--budget-gib", "0"], "--budget-gib", "0.0", "> 0"),
    (["check", "--tp", "-2"], "--tp", "-2", ">= 1"),
    (["bench", "--tokens", "eight"], "--tokens", "'eight'", ">= 1"),
])
def test_flag_out_of_range_is_cfg015_naming_flag_value_and_range(capsys, no_spawn, argv, flag, value, bound):
    status, out, err = _run(capsys, argv)
    line = _one_coded_line(err, "CFG015")
    assert status == 2 and f"argument {flag}: {value} " in line and bound in line, line
    assert len(err.strip().splitlines()) == 1 and not no_spawn


def test_unknown_command_is_cfg015(capsys):
    status, _, err = _run(capsys, ["bogus"])
    assert status == 2 and "'bogus'" in _one_coded_line(err, "CFG015")


class _Stream:
    def __init__(self, tty: bool):
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("value, tty, expected", [(None, True, True), (None, False, False), ("0", True, False),
                                                  ("on", False, True)])
def test_progress_bars_on_a_terminal_unless_the_variable_says(monkeypatch, value, tty, expected):
    if value is None:
        monkeypatch.delenv("MOE_REF_PROGRESS", raising=False)
    else:
        monkeypatch.setenv("MOE_REF_PROGRESS", value)
    assert envs.show_progress(_Stream(tty)) is expected


# --- demo: device, checkpoint folder, memory, private temporary folder ------------------------------------
def test_demo_device_cuda_without_cuda_is_env006_naming_the_fix(capsys, no_spawn, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    status, _, err = _run(capsys, ["demo", "--device", "cuda", "--nproc", "2"])
    line = _one_coded_line(err, "ENV006")
    assert status == 2 and "needs 2 CUDA GPU(s)" in line and "sees 0" in line and "--device cpu" in line
    assert not no_spawn


def test_demo_device_cuda_with_too_few_gpus_names_the_count(capsys, no_spawn, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    status, _, err = _run(capsys, ["demo", "--device", "cuda", "--nproc", "4", "--skip-memory-check"])
    line = _one_coded_line(err, "ENV006")
    assert status == 2 and "needs 4 CUDA GPU(s)" in line and "sees 1" in line and "--nproc 1" in line
    assert not no_spawn


@pytest.mark.parametrize("path, reason", [("/proc/nope/x", "No such file or directory"),
                                          ("FILE/sub", "Not a directory")])
def test_demo_checkpoint_that_cannot_be_created_is_env015(capsys, no_spawn, tmp_path, path, reason):
    (tmp_path / "FILE").write_text("not a folder")
    path = path.replace("FILE", str(tmp_path / "FILE"))
    status, _, err = _run(capsys, ["demo", "--nproc", "1", "--checkpoint", path])
    line = _one_coded_line(err, "ENV015")
    assert status == 2 and repr(path) in line and reason in line and not no_spawn


def test_demo_nproc_that_does_not_divide_the_experts_is_cfg002_even_without_memory_check(capsys, no_spawn):
    status, _, err = _run(capsys, ["demo", "--nproc", "3", "--skip-memory-check"])  # tiny-kimi-k2: 16 experts
    line = _one_coded_line(err, "CFG002")
    assert status == 2 and "--nproc 3: the 16 experts of --preset tiny-kimi-k2" in line and not no_spawn
    assert "pass --nproc in [1, 2, 4, 8, 16]" in line and "ep_size" not in line  # the command's flags


def test_demo_memory_estimate_matches_what_dist_check_allocates():
    for name in ("tiny-kimi-k2", "tiny-kimi-k3", "tiny-deepseek-v3"):
        cfg = preset(name)
        weights = MoEWeights.random(cfg, dtype=torch.float32)
        held = lambda w: count_bytes(*(t for t in vars(w).values() if isinstance(t, torch.Tensor)))  # noqa: E731
        parts = cli.demo_memory_bytes(cfg, 2, 64, torch.float32)
        assert parts["all experts"] == held(weights), name
        assert parts["this rank's experts"] == held(weights.expert_slice(0, cfg.num_experts // 2)), name
        from moe_ref.ep.capacity import CapacityPlan
        assert parts["buffer"] == CapacityPlan.build(cfg, 2, 64, torch.float32, alignment=128).total_bytes


def test_demo_kimi_k2_on_a_laptop_refuses_with_the_bytes_before_allocating(capsys, no_spawn, monkeypatch):
    monkeypatch.setattr(cli, "available_memory_bytes", lambda gpu_index=None: (16 * GiB, "host memory"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    need = 2 * sum(cli.demo_memory_bytes(preset("kimi-k2"), 2, 64, torch.float32).values())
    status, _, err = _run(capsys, ["demo", "--preset", "kimi-k2"])
    line = _one_coded_line(err, "ENV016")
    assert status == 2 and need > 100 * GiB and not no_spawn
    assert f"({need} bytes)" in line and f"({16 * GiB} bytes) available" in line
    assert "--preset tiny-kimi-k2" in line and "--device cuda" in line and "--skip-memory-check" in line


def test_demo_skip_memory_check_goes_ahead_and_tells_the_ranks(capsys, no_spawn, monkeypatch):
    monkeypatch.setattr(cli, "available_memory_bytes", lambda gpu_index=None: (16 * GiB, "host memory"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    status, _, err = _run(capsys, ["demo", "--preset", "kimi-k2", "--skip-memory-check"])
    assert status == 0, err
    assert len(no_spawn) == 1 and "--skip-memory-check" in no_spawn[0]["command"]


def test_demo_uses_a_fresh_private_folder_and_removes_it(capsys, no_spawn, monkeypatch, tmp_path):
    monkeypatch.setattr(cli.tempfile, "tempdir", str(tmp_path))
    planted = tmp_path / "moe_ref_demo_tiny-kimi-k2"  # the predictable folder of old versions, pre-written
    planted.mkdir()
    (planted / "config.json").write_text("{}")
    status, out, err = _run(capsys, ["demo", "--nproc", "1"])
    assert status == 0, err
    call = no_spawn[0]
    assert call["existed"] and call["entries"] == [] and call["mode"] == 0o700, call
    assert os.path.dirname(call["folder"]) == str(tmp_path) and call["folder"] != str(planted)
    assert not os.path.exists(call["folder"]) and (planted / "config.json").exists()
    assert "--cap 64" in " ".join(call["command"]) and "demo [2/3]" in err and "demo [3/3]" in err


def test_demo_failure_still_removes_the_folder_and_passes_the_status(capsys, no_spawn, monkeypatch, tmp_path):
    monkeypatch.setattr(cli.tempfile, "tempdir", str(tmp_path))
    no_spawn.status = 1
    status, _, err = _run(capsys, ["demo", "--nproc", "1"])
    assert status == 1 and "torchrun exited with status 1" in err
    assert not os.path.exists(no_spawn[0]["folder"])


def test_demo_keeps_a_checkpoint_folder_the_user_gave(capsys, no_spawn, tmp_path):
    folder = tmp_path / "new" / "ckpt"
    status, _, err = _run(capsys, ["demo", "--nproc", "1", "--checkpoint", str(folder)])
    assert status == 0, err
    assert no_spawn[0]["folder"] == str(folder) and folder.is_dir()


# --- the cap from the environment ----------------------------------------------------------------------
@pytest.mark.parametrize("value", ["0", "-5"])
def test_env_cap_not_positive_is_cfg007_naming_the_variable(capsys, no_spawn, monkeypatch, value):
    monkeypatch.setenv("MOE_REF_NUM_MAX_TOKENS_PER_RANK", value)
    for argv in (["demo", "--nproc", "1"], ["plan", "--preset", "tiny-kimi-k2", "--ep", "2"]):
        status, _, err = _run(capsys, argv)
        line = _one_coded_line(err, "CFG007")  # resolved and checked by EPOptions, as the layer does
        assert status == 2 and f"num_max_tokens_per_rank={value} (from MOE_REF_NUM_MAX_TOKENS_PER_RANK)" in line, argv
        assert "must be an integer in [1, " in line, line
    assert not no_spawn


def test_the_cli_cap_is_the_layers_cap(monkeypatch):
    from moe_ref.ep.options import EPOptions

    monkeypatch.delenv("MOE_REF_NUM_MAX_TOKENS_PER_RANK", raising=False)
    assert cli.resolve_cap(None, default=64) == 64 and cli.resolve_cap(8, default=64) == 8
    for value in ("32", "4096"):
        monkeypatch.setenv("MOE_REF_NUM_MAX_TOKENS_PER_RANK", value)
        assert cli.resolve_cap(None, default=64) == EPOptions.resolve().num_max_tokens_per_rank == int(value)
        assert cli.resolve_cap(7, default=64) == 7


def test_env_cap_is_the_default_and_the_flag_wins(capsys, no_spawn, monkeypatch):
    monkeypatch.setenv("MOE_REF_NUM_MAX_TOKENS_PER_RANK", "32")
    status, out, _ = _run(capsys, ["plan", "--preset", "tiny-kimi-k2", "--ep", "2"])
    assert status == 0 and "cap = 32 rows" in out
    status, out, _ = _run(capsys, ["plan", "--preset", "tiny-kimi-k2", "--ep", "2", "--max-num-tokens", "8"])
    assert status == 0 and "cap = 8 rows" in out
    assert _run(capsys, ["demo", "--nproc", "1"])[0] == 0
    assert no_spawn[0]["command"][no_spawn[0]["command"].index("--cap") + 1] == "32"


# --- expert memory per rank in the checkpoint's precision (plan, info) ------------------------------------
def _expert_line(out: str, name: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(f"  {name} "))


def test_plan_prints_the_experts_bytes_per_rank_in_each_precision(capsys):
    from moe_ref.ep.capacity import format_bytes
    from moe_ref.checkpoint.formats import QuantSpec, expert_weight_bytes

    status, out, _ = _run(capsys, ["plan", "--preset", "kimi-k2", "--ep", "8"])
    assert status == 0 and "routed experts per rank (48 of 384, Dx=7168, F=2048" in out
    assert format_bytes(48 * 3 * 7168 * 2048 * 2) in _expert_line(out, "bf16")
    assert "<- this config (no quantization_config" in _expert_line(out, "bf16")
    for fmt, gib in (("fp8_block", "1.97 GiB"), ("int4_group", "1.11 GiB"), ("mxfp4", "1.05 GiB")):
        line = _expert_line(out, fmt)
        assert gib in line and format_bytes(expert_weight_bytes(QuantSpec.published(fmt), 7168, 2048, 48)) in line
        assert "<-" not in line
    status, out, _ = _run(capsys, ["plan", "--preset", "tiny-kimi-k3", "--ep", "2", "--dtype", "fp32"])
    assert status == 0 and format_bytes(8 * 3 * 32 * 24 * 4) in _expert_line(out, "fp32")
    assert "n/a: F=24 is not a multiple of 32 (D=32 is)" in _expert_line(out, "mxfp4")
    assert "n/a: F=24 must be a multiple of 128" in _expert_line(out, "fp8_block")


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    from moe_ref.checkpoint.synthetic import quantizable_config, write_synthetic_checkpoint

    folder = tmp_path_factory.mktemp("mxfp4")
    cfg = quantizable_config(preset("tiny-kimi-k3"), "mxfp4")
    write_synthetic_checkpoint(folder, cfg, quant="mxfp4")
    return cfg, folder


def test_plan_and_info_mark_the_checkpoints_precision_with_the_bytes_the_layer_holds(capsys, mxfp4_checkpoint):
    from moe_ref.ep.capacity import format_bytes
    from moe_ref.layer import MegaMoE

    cfg, folder = mxfp4_checkpoint
    held = MegaMoE(cfg).load_hf_weights(folder, layer_idx=0, progress=False).expert_nbytes()  # one rank: all experts
    status, out, _ = _run(capsys, ["plan", "--config", str(folder), "--ep", "1"])
    line = _expert_line(out, "mxfp4")
    assert status == 0 and format_bytes(held) in line and "<- the checkpoint (its quantization_config)" in line
    assert "<-" not in _expert_line(out, "bf16")
    status, out, _ = _run(capsys, ["info", "--config", str(folder), "--ep", "2"])
    assert status == 0 and "at ep=2: routed experts per rank (8 of 16" in out
    assert format_bytes(held // 2) in _expert_line(out, "mxfp4") and "<- the checkpoint" in _expert_line(out, "mxfp4")
    status, out, _ = _run(capsys, ["info"])
    assert status == 0 and "routed experts" not in out and "transports:" in out
    status, _, err = _run(capsys, ["info", "--preset", "tiny-kimi-k2", "--ep", "3"])
    assert status == 2 and "ep_size" in _one_coded_line(err, "CFG002")


# --- the quantized demo: MXFP4 checkpoint -> MegaMoE.load_hf_weights -> run -> dequantized reference --------
@pytest.mark.parametrize("num_gpus", [0, 2])
@pytest.mark.parametrize("quant", [None, "fp8_block", "int4_group", "mxfp4"])
@pytest.mark.parametrize("name", PRESETS)
def test_every_demo_preset_and_quant_pair_starts_or_is_refused_before_any_process(capsys, no_spawn, monkeypatch,
                                                                                  name, quant, num_gpus):
    """Every pair ``--help`` offers: the tiny presets start torchrun with the writer's checks passed (their
    checkpoints load back: tests/unit/test_synthetic.py); the real ones are ENV016 on a 16 GiB host, on CPU (all
    processes' bytes) and with GPUs (the writer's: every expert in bf16 on the host)."""
    monkeypatch.setattr(cli, "available_memory_bytes", lambda gpu_index=None: (16 * GiB, "host memory"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: num_gpus)
    status, out, err = _run(capsys, ["demo", "--preset", name, "--nproc", "2"] + (["--quant", quant] if quant else []))
    writer_bytes = cli.demo_memory_bytes(cli.synthetic_config(name, quant), 1, 1, torch.bfloat16)["all experts"]
    if name.startswith("tiny-") or (num_gpus and writer_bytes <= 16 * GiB):  # step3's experts: 10.6 GB in bf16
        assert status == 0, f"{name=} {quant=} {err}"
        command = no_spawn[0]["command"]
        assert command[command.index("--preset") + 1] == name
        assert command[command.index("--device") + 1] == ("cuda" if num_gpus else "cpu")
        assert ("--quant" in command) == (quant is not None) and (quant is None or quant in command), command
    else:
        line = _one_coded_line(err, "ENV016")
        assert status == 2 and "--preset tiny-" in line and not no_spawn, (name, quant)
        assert ("writing the synthetic" in line) == bool(num_gpus), line


@pytest.fixture
def plain_checkpoint(tmp_path):
    from moe_ref.checkpoint.synthetic import write_synthetic_checkpoint

    write_synthetic_checkpoint(tmp_path, preset("tiny-kimi-k2"))
    return tmp_path


def test_demo_refuses_a_checkpoint_folder_of_another_format_before_any_process(capsys, no_spawn, mxfp4_checkpoint,
                                                                              plain_checkpoint):
    _, folder = mxfp4_checkpoint
    for extra, asks in ((["--quant", "int4_group"], "--quant int4_group"), ([], "no --quant")):
        status, _, err = _run(capsys, ["demo", "--preset", "tiny-kimi-k3", "--checkpoint", str(folder), *extra])
        line = _one_coded_line(err, "LOAD016")
        assert status == 2 and not no_spawn, line
        assert f"'{folder}' already holds a checkpoint with mxfp4 routed experts" in line and asks in line
        assert "pass --quant mxfp4" in line and "another --checkpoint folder" in line and "load_moe_weights" not in line
    status, _, err = _run(capsys, ["demo", "--checkpoint", str(plain_checkpoint), "--quant", "fp8_block"])
    line = _one_coded_line(err, "LOAD016")
    assert status == 2 and "plain (unquantized) weights" in line and "pass no --quant" in line and not no_spawn


def test_demo_refuses_a_checkpoint_folder_of_a_format_moe_ref_does_not_read(capsys, no_spawn, plain_checkpoint):
    import json

    config = json.loads((plain_checkpoint / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (plain_checkpoint / "config.json").write_text(json.dumps(config))
    status, _, err = _run(capsys, ["demo", "--checkpoint", str(plain_checkpoint)])
    line = _one_coded_line(err, "LOAD016")
    assert status == 2 and "quant_method='awq' is not supported" in line and "another --checkpoint folder" in line
    assert "load_moe_weights" not in line and "Dequantize" not in line and not no_spawn


def test_demo_refuses_a_checkpoint_folder_of_another_model_naming_its_preset(capsys, no_spawn, mxfp4_checkpoint):
    _, folder = mxfp4_checkpoint
    status, _, err = _run(capsys, ["demo", "--preset", "tiny-deepseek-v3", "--quant", "mxfp4", "--checkpoint",
                                   str(folder)])
    line = _one_coded_line(err, "LOAD017")
    assert status == 2 and "holds another model than --preset tiny-deepseek-v3 with --quant mxfp4" in line
    assert "pass --preset tiny-kimi-k3 (the model it holds)" in line and not no_spawn


def test_demo_runs_a_checkpoint_folder_that_matches_its_flags(capsys, no_spawn, mxfp4_checkpoint):
    _, folder = mxfp4_checkpoint
    status, _, err = _run(capsys, ["demo", "--preset", "tiny-kimi-k3", "--quant", "mxfp4", "--checkpoint",
                                   str(folder), "--nproc", "1"])
    assert status == 0 and no_spawn[0]["folder"] == str(folder), err


def test_dist_check_refuses_a_checkpoint_folder_of_another_format(capsys, one_rank, mxfp4_checkpoint):
    _, folder = mxfp4_checkpoint
    status, _, err = _run(capsys, ["--preset", "tiny-kimi-k3", "--quant", "fp8_block", "--checkpoint", str(folder)],
                          dist_check.main)
    line = _one_coded_line(err, "LOAD016", "moe_ref.tools.dist_check")
    assert status == 2 and "pass --quant mxfp4" in line


def test_demo_quant_passes_the_format_and_sizes_to_the_ranks(capsys, no_spawn):
    status, out, err = _run(capsys, ["demo", "--preset", "tiny-kimi-k3", "--quant", "mxfp4", "--nproc", "1"])
    assert status == 0, err
    command = no_spawn[0]["command"]
    assert command[command.index("--quant") + 1] == "mxfp4"
    assert "routed experts stored as mxfp4 and run as stored (F=32, Dx=32)" in out


def _mxfp4_bytes(cfg, num_experts: int) -> int:
    from moe_ref.checkpoint.formats import QuantSpec, expert_weight_bytes
    from moe_ref.checkpoint.synthetic import quantizable_config

    cfg = quantizable_config(cfg, "mxfp4")
    return expert_weight_bytes(QuantSpec.published("mxfp4"), cfg.expert_hidden_size, cfg.intermediate_size, num_experts)


def test_dist_check_quant_needs_a_checkpoint_folder(capsys):
    status, _, err = _run(capsys, ["--quant", "mxfp4"], dist_check.main)
    assert status == 2 and "--quant needs --checkpoint" in _one_coded_line(err, "CFG015", "moe_ref.tools.dist_check")


def test_dist_check_quant_mxfp4_in_one_process(capsys, one_rank, tmp_path):
    status, out, err = _run(capsys, ["--preset", "tiny-kimi-k3", "--quant", "mxfp4", "--checkpoint", str(tmp_path),
                                     "--tokens-per-rank", "40", "--runs", "1"], dist_check.main)
    assert status == 0, err
    assert "routed experts in mxfp4" in err and "experts=torch_quant" in out
    held = _mxfp4_bytes(preset("tiny-kimi-k3"), num_experts=16)
    assert f"routed experts of rank 0: mxfp4 as stored in the checkpoint, {held} bytes on the device" in out
    assert "RESULT: PASS" in out


def test_dist_check_step3_int4_in_one_process(capsys, one_rank, tmp_path):
    """Step3's share_expert is quantized too under the compressed-tensors config (its ignore list names Kimi's
    shared_experts): the writer used to fail on its width (unflatten ... 40)."""
    status, out, err = _run(capsys, ["--preset", "tiny-step3", "--quant", "int4_group", "--checkpoint",
                                     str(tmp_path), "--tokens-per-rank", "40", "--runs", "1"], dist_check.main)
    assert status == 0, err
    assert "routed experts of rank 0: int4_group as stored in the checkpoint" in out and "RESULT: PASS" in out


# --- check first, print after; plurals; the explain line -------------------------------------------------
def test_info_and_plan_fail_before_printing_anything(capsys):
    status, out, err = _run(capsys, ["info", "--preset", "kimi-k2", "--ep", "5"])
    assert status == 2 and out == "" and "ep_size=5" in _one_coded_line(err, "CFG002")
    status, out, err = _run(capsys, ["plan", "--preset", "kimi-k2", "--budget-gib", "0.0001"])
    assert status == 2 and out == "" and "above the budget of 107374 bytes" in _one_coded_line(err, "CAP004")


def test_check_says_one_expert_per_rank(capsys):
    status, out, _ = _run(capsys, ["check", "--preset", "tiny-kimi-k2", "--ep", "16"])
    assert status == 0 and "(1 expert per EP rank)" in out
    status, out, _ = _run(capsys, ["check", "--preset", "tiny-kimi-k2", "--ep", "8"])
    assert status == 0 and "(2 experts per EP rank)" in out


def test_check_dispatch_fp8_accepts_what_the_layer_runs(capsys):
    """D = 48 runs with dispatch_fp8 (the layer and dist_check --dispatch-fp8); only deep_gemm needs 128s."""
    from moe_ref.layer import MegaMoE

    layer = MegaMoE("tiny-kimi-k2", num_max_tokens_per_rank=16, dispatch_fp8=True, seed=0)
    with torch.inference_mode():
        assert layer(torch.randn(5, 48)).shape == (5, 48)
    layer.destroy()
    status, out, err = _run(capsys, ["check", "--preset", "tiny-kimi-k2", "--dispatch-fp8"])
    assert status == 0 and out.startswith("OK: tiny-kimi-k2") and "CFG005" not in out + err
    assert "--dispatch-fp8 at Dx=48" in out and "the last over 48 columns" in out and "deep_gemm" in out
    status, out, _ = _run(capsys, ["check", "--preset", "kimi-k2", "--ep", "8", "--dispatch-fp8"])
    assert status == 0 and "(56 per row)" in out and "deep_gemm" not in out


def test_explain_an_unknown_code_is_one_coded_line(capsys):
    status, out, err = _run(capsys, ["explain", "XYZ999"])
    line = _one_coded_line(err, "CFG015")
    assert status == 2 and out == "" and "unknown error code 'XYZ999'" in line and "moe-ref explain --list" in line


# --- one line, or the traceback with --debug / MOE_REF_DEBUG ---------------------------------------------
def test_error_raised_inside_a_command_is_one_line(capsys):
    status, _, err = _run(capsys, ["plan", "--preset", "tiny-kimi-k2", "--ep", "3"])  # 16 experts on 3 ranks
    assert status == 2 and "ep_size" in _one_coded_line(err, "CFG002") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_shows_the_traceback(capsys, monkeypatch, how):
    argv = ["plan", "--preset", "tiny-kimi-k2", "--ep", "3"]
    if how == "flag":
        argv.append("--debug")
    else:
        monkeypatch.setenv("MOE_REF_DEBUG", "1")
    status, _, err = _run(capsys, argv)
    assert status == 2 and "Traceback" in err and err.strip().splitlines()[-1].startswith("moe-ref: [CFG002] ")


# --- moe_ref.tools.dist_check: the same checks, agreed by every rank -----------------------------------------
def test_dist_check_flags_are_checked_before_any_work(capsys):
    status, _, err = _run(capsys, ["--runs", "0"], dist_check.main)
    assert status == 2 and "argument --runs: 0" in _one_coded_line(err, "CFG015", "moe_ref.tools.dist_check")


def test_dist_check_device_cuda_without_cuda_before_the_process_group(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    status, _, err = _run(capsys, ["--device", "cuda"], dist_check.main)
    assert status == 2 and "sees 0" in _one_coded_line(err, "ENV006", "moe_ref.tools.dist_check")
    assert not torch.distributed.is_initialized()


@pytest.fixture
def one_rank(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port)).items():
        monkeypatch.setenv(key, value)
    yield
    assert not torch.distributed.is_initialized()  # main() tore the group down


def test_dist_check_memory_refusal_on_every_rank_before_allocating(capsys, monkeypatch, one_rank):
    monkeypatch.setattr(cli, "available_memory_bytes", lambda gpu_index=None: (8 * GiB, "host memory"))
    allocations = []
    monkeypatch.setattr(MoEWeights, "random", staticmethod(lambda *a, **k: allocations.append(a)))
    status, _, err = _run(capsys, ["--preset", "kimi-k2", "--cap", "64"], dist_check.main)
    line = _one_coded_line(err, "ENV016", "moe_ref.tools.dist_check")
    assert status == 2 and "rank 0: kimi-k2 over 1 process(es)" in line and f"({8 * GiB} bytes)" in line
    assert not allocations


def test_dist_check_unwritable_checkpoint_is_env015(capsys, one_rank):
    status, _, err = _run(capsys, ["--checkpoint", "/proc/nope/x"], dist_check.main)
    assert status == 2 and "'/proc/nope/x'" in _one_coded_line(err, "ENV015", "moe_ref.tools.dist_check")


def test_info_says_how_the_grouped_mlp_loads_its_tiles(capsys, monkeypatch):
    monkeypatch.setenv("MOE_REF_TMA", "0")
    status, out, _ = _run(capsys, ["info"])
    assert status == 0 and "grouped MLP tile loads: pointers (MOE_REF_TMA=0)" in out
    monkeypatch.delenv("MOE_REF_TMA")
    status, out, _ = _run(capsys, ["info"])
    from moe_ref.kernels.runtime._triton_utils import is_interpreter

    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
    expected = "TMA descriptors" if is_interpreter() or hopper else \
        "pointers (no CUDA device)" if not torch.cuda.is_available() else "pointers (compute capability"
    assert status == 0 and f"grouped MLP tile loads: {expected}" in out, out


def test_info_says_whether_4bit_experts_run_w4a8(capsys, monkeypatch):
    monkeypatch.delenv("MOE_REF_W4A8_ROWS_PER_EXPERT", raising=False)
    status, out, _ = _run(capsys, ["info"])
    assert status == 0 and "4-bit experts (INT4, MXFP4): W4A16\n" in out, out
    monkeypatch.setenv("MOE_REF_W4A8_ROWS_PER_EXPERT", "64")
    status, out, _ = _run(capsys, ["info"])
    assert status == 0 and "W4A8 (fp8 rows and MMAs) from 64 routed rows per local expert" in out, out
    monkeypatch.setenv("MOE_REF_W4A8_ROWS_PER_EXPERT", "-1")
    status, out, err = _run(capsys, ["info"])
    assert status != 0 and "MOE_REF_W4A8_ROWS_PER_EXPERT='-1' is not a number >= 0" in out + err


def test_info_says_which_cpu_ep_path_runs(capsys, monkeypatch):
    from moe_ref.kernels.runtime import native

    status, out, _ = _run(capsys, ["info"])
    assert status == 0 and f"CPU EP data path: {native.native_status()}" in out
    assert ("compiled ops: active" in out) == native.is_active()


def test_check_on_a_checkpoint_folder_agrees_with_the_loader(capsys, plain_checkpoint):
    """`moe-ref check --config <folder>` reports what load_hf_weights would raise (headers only), and OK when it
    would load."""
    from moe_ref import MegaMoE

    cfg = MoEConfig.from_hf_config(plain_checkpoint)
    assert cli.main(["check", "--config", str(plain_checkpoint)]) == 0
    assert capsys.readouterr().out.startswith("OK:")
    # drop one expert's tensor from the checkpoint: the loader and the check name the same code
    index = plain_checkpoint / "model.safetensors.index.json"
    layer = cfg.moe_layers[-1]
    if index.exists():
        data = json.loads(index.read_text())
        name = next(n for n in data["weight_map"] if f"layers.{layer}.mlp.experts.1." in n)
        del data["weight_map"][name]
        index.write_text(json.dumps(data))
    else:
        from safetensors.torch import load_file, save_file

        path = next(plain_checkpoint.glob("*.safetensors"))
        tensors = load_file(path)
        name = next(n for n in tensors if f"layers.{layer}.mlp.experts.1." in n)
        del tensors[name]
        save_file(tensors, path)
    with pytest.raises(MoERefError) as loaded:
        MegaMoE(plain_checkpoint, None).load_hf_weights(plain_checkpoint, layer)
    assert cli.main(["check", "--config", str(plain_checkpoint)]) == 1
    out = capsys.readouterr().out
    assert f"[{loaded.value.code}]" in out and name.rsplit(".", 1)[0] in out, out


def test_plan_batch_invariant_adds_the_combine_slots_region(capsys):
    """`plan --batch-invariant` at ep 8: the combine_slots region [cap, K, D] in bf16 (256 x 8 x 7168 x 2 B = 28 MiB)
    joins the plan and the total grows by exactly it; the default plan has no such region."""
    argv = ["plan", "--preset", "kimi-k2", "--ep", "8", "--max-num-tokens", "256"]
    default_code, default_out, _ = _run(capsys, argv)
    invariant_code, invariant_out, _ = _run(capsys, argv + ["--batch-invariant"])
    assert default_code == invariant_code == 0
    assert "combine_slots" not in default_out and "[256, 8, 7168]" in invariant_out

    def total(out: str) -> int:
        return int(next(line.split()[3] for line in out.splitlines() if line.startswith("TOTAL per rank")))

    assert total(invariant_out) - total(default_out) == 256 * 8 * 7168 * 2
