import inspect

import pytest

from moe_ref.core import errors
from moe_ref.tools.cli import main

pytestmark = pytest.mark.unit


def _coded_classes():
    return [c for _, c in inspect.getmembers(errors, inspect.isclass)
            if issubclass(c, errors.MoERefError) and "code" in c.__dict__ and c is not errors.MoERefError]


def test_every_coded_error_has_a_catalogue_entry_and_unique_code():
    classes = _coded_classes()
    codes = [c.code for c in classes]
    assert len(codes) == len(set(codes)) and len(codes) >= 15
    for cls in classes:
        entry = cls.explanation()
        assert entry.cause and entry.trigger and entry.solutions and entry.example, cls.code


def test_errors_subclass_the_builtin_callers_expect():
    assert issubclass(errors.TopKError, ValueError)
    assert issubclass(errors.DTypeError, TypeError)
    assert issubclass(errors.CapacityExceededError, RuntimeError)
    assert issubclass(errors.MissingTensorError, KeyError)


def test_message_carries_code_and_pointer():
    err = errors.CapacityExceededError("rank 1 fed 5000 rows > cap 4096")
    assert str(err) == "[CAP001] rank 1 fed 5000 rows > cap 4096 (see: moe-ref explain CAP001)"
    assert str(errors.MissingTensorError("x missing")).startswith("[LOAD001] x missing")


def test_explain_cli_prints_entry(capsys):
    assert main(["explain", "cap001"]) == 0
    out = capsys.readouterr().out
    assert "CAP001" in out and "MOE_REF_NUM_MAX_TOKENS_PER_RANK" in out and "Example fix" in out


def test_explain_unknown_code_lists_known(capsys):
    assert main(["explain", "NOPE1"]) == 2
    assert "CAP001" in capsys.readouterr().err


def test_explain_list(capsys):
    assert main(["explain", "--list"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == len(errors.CATALOGUE)


def test_eplb_errors_are_config_errors_with_entries():
    for cls, code in ((errors.PlacementError, "CFG033"), (errors.PlacementTopologyError, "CFG034"),
                      (errors.LoadTraceError, "CFG035")):
        assert cls.code == code and issubclass(cls, errors.ConfigError) and issubclass(cls, ValueError)
        assert errors.error_class(code) is cls and "eplb" in errors.explain(code).lower(), code
