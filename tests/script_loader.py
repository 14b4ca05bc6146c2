"""Repository scripts as modules for the tests: `load_script("bench_experts")` is scripts/bench_experts.py, loaded
once per process, with scripts/ on sys.path first (the scripts import each other by name, as when run)."""
from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

SCRIPTS = pathlib.Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py as the module ``<name>_under_test`` (the first call executes it, later calls return it)."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    key = f"{name}_under_test"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]
