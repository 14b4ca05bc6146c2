"""Repository scripts as modules, for the tests of a script's own command line and report: `load_script("bench_w4a16")`
is scripts/bench_w4a16.py, loaded once per process. The scripts import only moe_ref (their shared code is
`moe_ref.bench`) and never each other, so scripts/ is not put on sys.path: a script that imported a sibling would fail
to load here."""
from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

SCRIPTS = pathlib.Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py as the module ``<name>_under_test`` (the first call executes it, later calls return it)."""
    key = f"{name}_under_test"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]
