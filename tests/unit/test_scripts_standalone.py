"""No script imports another: scripts/*.py are entry points, and the code they share is ``moe_ref.bench``.

Checked by parsing every script (nothing is imported or run). A script must not
- import a module named like a script in scripts/ (``import bench_experts``, ``from peer_moe import ...``), nor any
  module relatively;
- load one through importlib or runpy (``importlib.import_module("bench_w4a16")``, ``__import__``,
  ``runpy.run_module``), nor load any file as a module (``spec_from_file_location``, ``SourceFileLoader``,
  ``runpy.run_path``, ``imp.load_source``);
- put its own folder on ``sys.path`` (what lets a sibling import work when the script runs).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
SCRIPT_NAMES = frozenset(path.stem for path in SCRIPTS.glob("*.py"))
# calls that load a module by name: the first argument names it
NAMED_LOADS = {"importlib.import_module", "__import__", "runpy.run_module"}
# calls that load a file as a module: a script has no file to load
FILE_LOADS = {"importlib.util.spec_from_file_location", "importlib.machinery.SourceFileLoader", "runpy.run_path",
              "imp.load_source"}
# spellings of the script's own folder
OWN_FOLDER = {"os.path.dirname(os.path.abspath(__file__))", "os.path.dirname(__file__)",
              "os.path.dirname(os.path.realpath(__file__))", "str(Path(__file__).parent)",
              "str(Path(__file__).resolve().parent)", "str(pathlib.Path(__file__).parent)",
              "str(pathlib.Path(__file__).resolve().parent)"}


def _dotted(node: ast.AST, imported: dict[str, str]) -> str:
    """``a.b.c`` of a Name/Attribute chain, its first name spelled as imported (``from runpy import run_path`` makes
    ``run_path`` ``runpy.run_path``; a script's own ``run_path`` stays ``run_path``); "" for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""
    return ".".join([imported.get(node.id, node.id), *reversed(parts)])


def script_loads(tree: ast.Module, scripts: frozenset[str] = SCRIPT_NAMES) -> list[str]:
    """Where a script imports or loads another script (one line per place, with its line number)."""
    imported = {alias.asname or alias.name: f"{node.module}.{alias.name}" for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and not node.level for alias in node.names}
    imported.update({alias.asname: alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                     for alias in node.names if alias.asname})
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] in scripts]
        elif isinstance(node, ast.ImportFrom):
            if node.level or (node.module or "").split(".")[0] in scripts:
                found.append(f"line {node.lineno}: from {'.' * node.level}{node.module or ''} import ...")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func, imported)
            first = node.args[0] if node.args else None
            if name in NAMED_LOADS:
                if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
                    found.append(f"line {node.lineno}: {name}(...) of a module named at run time")
                elif first.value.split(".")[0] in scripts:
                    found.append(f"line {node.lineno}: {name}({first.value!r})")
            elif name in FILE_LOADS:
                found.append(f"line {node.lineno}: {name}(...) loads a file as a module")
            elif name in ("sys.path.insert", "sys.path.append") and node.args:
                where = ast.unparse(node.args[-1])
                if where in OWN_FOLDER:
                    found.append(f"line {node.lineno}: {name}({where}) puts scripts/ on sys.path")
    return found


def test_there_are_scripts_to_check():
    assert {"bench_experts", "peer_moe", "bench_w4a16", "profile_step", "bench_layer"} <= SCRIPT_NAMES


@pytest.mark.parametrize("path", sorted(SCRIPTS.glob("*.py")), ids=lambda path: path.name)
def test_no_script_imports_another(path):
    found = script_loads(ast.parse(path.read_text(), filename=str(path)))
    assert not found, f"{path.name} reaches another script (move the shared code into moe_ref.bench): {found}"


def test_the_check_sees_each_way_of_loading_a_script():
    """The parser on small sources, so a check that silently finds nothing fails here."""
    scripts = frozenset({"bench_experts", "peer_moe"})
    bad = ["import bench_experts", "import peer_moe as pm", "from bench_experts import MODELS",
           "from peer_moe.x import y", "from . import helper", "def f():\n    from peer_moe import check",
           "import importlib\nimportlib.import_module('bench_experts')", "__import__('peer_moe')",
           "import importlib\nname = 'peer_moe'\nimportlib.import_module(name)",
           "import runpy\nrunpy.run_module('bench_experts')", "import runpy\nrunpy.run_path('scripts/peer_moe.py')",
           "from runpy import run_path as load\nload('scripts/peer_moe.py')", "from importlib import import_module\n"
           "import_module('peer_moe.x')", "import importlib as il\nil.import_module('bench_experts')",
           "import importlib.util\nimportlib.util.spec_from_file_location('m', 'scripts/peer_moe.py')",
           "import os, sys\nsys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))"]
    for source in bad:
        assert script_loads(ast.parse(source), scripts), source
    good = ["import moe_ref.bench.peers as pm", "from moe_ref.bench.cases import MODELS", "import torch, json",
            "import importlib\nimportlib.import_module('moe_ref.kernels.experts.grouped_mlp')",
            "import os, sys\nsys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))",
            "from moe_ref.bench import peers\npeers.check(['x'])",
            "def run_path(name):\n    return name\nrun_path('a2a_grouped_mm')"]  # a script's own function
    for source in good:
        assert not script_loads(ast.parse(source), scripts), source
