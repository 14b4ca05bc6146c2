"""Messages that name the real cause: max_num_tokens of the wrong type (INP008), strict MOE_REF_* switches
(CFG017), alignment=True refused, a huge alignment named as the cause of CAP004, 4-bit shape problems naming
only the dimension at fault."""
from __future__ import annotations

import os

import pytest
import torch

from moe_ref.core import envs
from moe_ref.core.errors import (ArgumentTypeError, EnvVarError, InvalidConfigError, MemoryBudgetError,
                                 MoERefError)
from moe_ref.layer import MegaMoE

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("bound", ["4", 4.0, True])
def test_max_num_tokens_of_the_wrong_type_is_a_coded_type_error(bound):
    moe = MegaMoE("tiny-kimi-k2", num_max_tokens_per_rank=16, seed=0)
    x = torch.randn(3, moe.cfg.hidden_size)
    with torch.no_grad():
        with pytest.raises(ArgumentTypeError) as err:
            moe(x, max_num_tokens=bound)
        assert isinstance(err.value, TypeError) and err.value.code == "INP008"
        assert "max_num_tokens" in str(err.value) and repr(bound) in str(err.value)
        assert moe(x, max_num_tokens=4).shape == x.shape  # the next call works


@pytest.mark.parametrize("value, expected", [(" 0 ", False), ("0", False), ("OFF", False), ("1", True),
                                             (" true", True), ("", None)])
def test_switches_read_documented_values(monkeypatch, value, expected):
    monkeypatch.setenv("MOE_REF_DEBUG_CHECKS", value)
    assert envs.debug_checks() is expected


@pytest.mark.parametrize("name, read", [("MOE_REF_DEBUG_CHECKS", envs.debug_checks), ("MOE_REF_TMA", envs.tma),
                                        ("MOE_REF_NATIVE", envs.native_ops), ("MOE_REF_DEBUG", envs.debug)])
def test_a_switch_with_another_value_is_refused_naming_the_variable(monkeypatch, name, read):
    monkeypatch.setenv(name, "garbage")
    with pytest.raises(EnvVarError) as err:
        read()
    assert err.value.code == "CFG017" and name in str(err.value) and "'garbage'" in str(err.value)


def test_a_switch_follows_every_change_of_its_variable(monkeypatch):
    """Parsed values are remembered per raw value (some switches are read on every launch): a change of the
    variable is still seen at once, and a bad value is refused on every read."""
    for value, expected in (("1", True), ("0", False), ("1", True), (None, None), ("off", False)):
        if value is None:
            monkeypatch.delenv("MOE_REF_BOUND_LAUNCH", raising=False)
        else:
            monkeypatch.setenv("MOE_REF_BOUND_LAUNCH", value)
        assert envs._switch("MOE_REF_BOUND_LAUNCH") is expected, value
    monkeypatch.setenv("MOE_REF_BOUND_LAUNCH", "garbage")
    for _ in range(2):
        with pytest.raises(EnvVarError):
            envs.bound_launch()


def test_the_layer_refuses_a_bad_debug_checks_value(monkeypatch):
    monkeypatch.setenv("MOE_REF_DEBUG_CHECKS", "maybe")
    with pytest.raises(EnvVarError, match="MOE_REF_DEBUG_CHECKS='maybe'"):
        MegaMoE("tiny-kimi-k2", num_max_tokens_per_rank=16)


def test_cli_reports_a_bad_moe_ref_debug_as_one_coded_line(monkeypatch, capsys):
    from moe_ref.tools.cli import main

    monkeypatch.setenv("MOE_REF_DEBUG", "garbage")
    assert main(["explain", "CFG017"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moe-ref: [CFG017] MOE_REF_DEBUG='garbage'") and len(err.splitlines()) == 1


def test_alignment_must_not_be_a_bool():
    with pytest.raises(InvalidConfigError, match="alignment=True"):
        MegaMoE("tiny-kimi-k2", num_max_tokens_per_rank=16, alignment=True)


def test_a_huge_alignment_is_named_as_the_cause():
    moe = MegaMoE("tiny-kimi-k2", num_max_tokens_per_rank=16, alignment=2 ** 40, seed=0)
    with torch.no_grad(), pytest.raises(MemoryBudgetError) as err:
        moe(torch.randn(3, moe.cfg.hidden_size))
    message = str(err.value)
    assert err.value.code == "CAP004" and f"alignment={2 ** 40}" in message and "Lower alignment" in message
    assert "lower the cap" not in message


def test_4bit_shape_problem_names_only_the_dimension_at_fault():
    from moe_ref.checkpoint.formats import shape_problem

    assert shape_problem("mxfp4", 48, 64) == "D=48 is not a multiple of 32 (F=64 is)"
    assert shape_problem("int4_group", 64, 24) == "F=24 is not a multiple of 32 (D=64 is)"
    assert shape_problem("mxfp4", 48, 24) == "D=48 and F=24 are not multiples of 32"
    assert shape_problem("mxfp4", 64, 32) is None
    assert issubclass(EnvVarError, MoERefError)


def test_max_num_tokens_of_the_wrong_type_under_compile():
    """aot_eager here; inductor (which starts compile workers) in tests/dist/test_compile_inductor.py."""
    moe = MegaMoE("tiny-kimi-k2", num_max_tokens_per_rank=16, seed=0)
    f = torch.compile(lambda x: moe(x, max_num_tokens="4"), fullgraph=True, backend="aot_eager")
    with torch.no_grad(), pytest.raises(ArgumentTypeError, match="max_num_tokens"):
        f(torch.randn(3, moe.cfg.hidden_size))

@pytest.mark.parametrize("name", envs.SWITCHES)
def test_a_cpu_layer_refuses_a_bad_value_of_every_switch(monkeypatch, name):
    """Also the switches only a GPU path reads (MOE_REF_TMA, MOE_REF_BOUND_LAUNCH): a typo is no silent default."""
    monkeypatch.setenv(name, "x")
    with pytest.raises(EnvVarError) as err:
        MegaMoE("tiny-kimi-k2", num_max_tokens_per_rank=16)
    assert err.value.code == "CFG017" and f"{name}='x'" in str(err.value)


@pytest.mark.parametrize("name, value, option, expected", [
    ("MOE_REF_OVERFLOW_POLICY", "Chunk", "overflow", "chunk"), ("MOE_REF_TRANSPORT", " LOCAL ", "transport", "local"),
    ("MOE_REF_POOL_FORMAT", "Masked", "pool_format", "masked"),
    ("MOE_REF_EXPERTS_BACKEND", "Torch", "experts_backend", "torch")])
def test_named_choices_are_read_in_any_case_like_the_switches(monkeypatch, name, value, option, expected):
    monkeypatch.setenv(name, value)
    moe = MegaMoE("tiny-kimi-k2", num_max_tokens_per_rank=16)
    assert getattr(moe.options, option) == expected and moe.options.source[option] == name


def test_a_shm_folder_that_cannot_hold_a_file_is_cap005_naming_it(monkeypatch, tmp_path):
    from moe_ref.core.config import preset
    from moe_ref.core.errors import ShmDirectoryError
    from moe_ref.ep.buffer import SymmetricBuffer
    from moe_ref.ep.capacity import CapacityPlan

    plan = CapacityPlan.build(preset("tiny-kimi-k2"), 1, 16, torch.float32)
    (tmp_path / "file").write_text("")
    cases = [(str(tmp_path / "missing"), "does not exist"), (str(tmp_path / "file"), "is not a directory")]
    if os.path.isdir("/proc"):  # no files can be created there; the free-space test used to blame the cap
        cases.append(("/proc", "(filesystem proc, not tmpfs): no file can be created there"))
    for folder, problem in cases:
        monkeypatch.setenv("MOE_REF_SHM_DIR", folder)
        with pytest.raises(ShmDirectoryError) as err:
            SymmetricBuffer(plan, None, kind="shm")
        message = str(err.value)
        assert err.value.code == "CAP005" and isinstance(err.value, MemoryBudgetError), message
        assert f"MOE_REF_SHM_DIR={folder!r}" in message and problem in message, message
        assert f"{plan.total_bytes} bytes" in message and "transport='a2a'" in message
        assert "lower the cap" not in message
