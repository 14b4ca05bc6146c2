"""The test tiers hold by construction, checked by parsing (nothing is imported or run):

- every test file under tests/<tier>/ sets its tier's marker at module level (`pytestmark`): unit, interpreter,
  dist; tests/gpu: cuda or cuda2. So `-m unit` or `-m "not dist"` selects whole tiers.
- nothing in tests/unit or tests/interpreter starts a process (subprocess, multiprocessing, torchrun, os.fork/exec/
  system, inductor's compile workers): such tests belong to tests/dist.
- scripts/*.py use the library's public names only: no `_`-prefixed module or name imported from moe_ref, and no
  `_`-prefixed attribute of a moe_ref module (helpers a script defines itself are its own business).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
TIER_MARKERS = {"unit": {"unit"}, "interpreter": {"interpreter"}, "dist": {"dist"}, "gpu": {"cuda", "cuda2"}}
NO_PROCESS_TIERS = ("unit", "interpreter")
PROCESS_MODULES = {"subprocess", "multiprocessing", "torch.multiprocessing", "concurrent.futures.process", "pty"}
PROCESS_CALLS = {"os.fork", "os.forkpty", "os.system", "os.popen", "os.spawnv", "os.spawnl", "os.spawnve",
                 "os.spawnle", "os.spawnvp", "os.spawnlp", "os.execv", "os.execve", "os.execvp", "os.execl",
                 "os.posix_spawn", "os.posix_spawnp", "concurrent.futures.ProcessPoolExecutor", "ProcessPoolExecutor",
                 "torchrun", "mp.spawn", "torch.multiprocessing.spawn"}
TORCHRUN_STRINGS = ("torch.distributed.run", "torchrun")
NO_WORKER_BACKENDS = {"eager", "aot_eager"}  # torch.compile's default (inductor) starts compile workers and a compiler


def _test_files(tier: str) -> list[Path]:
    return sorted((ROOT / "tests" / tier).glob("test_*.py"))


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` of a Name/Attribute chain, None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _marker_names(node: ast.AST) -> set[str]:
    """Marker names in a `pytestmark` value: `pytest.mark.X`, `pytest.mark.X(...)`, or a list/tuple of them."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return set().union(*(_marker_names(elt) for elt in node.elts)) if node.elts else set()
    if isinstance(node, ast.Call):
        node = node.func
    name = _dotted(node) or ""
    return {name.split(".")[-1]} if name.startswith("pytest.mark.") else set()


def module_markers(tree: ast.Module) -> set[str]:
    """The markers a module sets at its top level through ``pytestmark = ...`` (plain or annotated)."""
    markers = set()
    for stmt in tree.body:
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) \
            else []
        if any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets) and stmt.value is not None:
            markers |= _marker_names(stmt.value)
    return markers


def process_starts(tree: ast.Module) -> list[str]:
    """Where a module may start a process: imports of process modules, process-starting calls, a torchrun command
    line, the launch helper of tests/dist, torch.compile with a backend that starts compile workers."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names
                      if a.name in PROCESS_MODULES or a.name.split(".")[0] in ("subprocess", "multiprocessing")]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module in PROCESS_MODULES or node.module.split(".")[0] in ("subprocess", "multiprocessing") \
                    or node.module == "launch":
                found.append(f"line {node.lineno}: from {node.module} import ...")
            elif node.module == "concurrent.futures" and any(a.name == "ProcessPoolExecutor" for a in node.names):
                found.append(f"line {node.lineno}: from concurrent.futures import ProcessPoolExecutor")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func) or ""
            if name in PROCESS_CALLS or name.split(".")[0] in ("subprocess", "multiprocessing"):
                found.append(f"line {node.lineno}: {name}(...)")
            if name == "torch.compile":
                backend = next((kw.value for kw in node.keywords if kw.arg == "backend"), None)
                if not (isinstance(backend, ast.Constant) and backend.value in NO_WORKER_BACKENDS):
                    found.append(f"line {node.lineno}: torch.compile without backend in {sorted(NO_WORKER_BACKENDS)}")
            args = [a for a in node.args if isinstance(a, (ast.List, ast.Tuple))]
            for seq in args:
                if any(isinstance(e, ast.Constant) and e.value in TORCHRUN_STRINGS for e in seq.elts):
                    found.append(f"line {node.lineno}: a torchrun command line")
    return found


@pytest.mark.parametrize("tier", sorted(TIER_MARKERS))
def test_every_test_file_sets_its_tier_marker(tier):
    files = _test_files(tier)
    assert files, f"no test files in tests/{tier}"
    wrong = {}
    for path in files:
        markers = module_markers(_parse(path))
        if not markers & TIER_MARKERS[tier]:
            wrong[path.name] = sorted(markers)
    assert not wrong, (f"tests/{tier}: these files set no module-level pytestmark of "
                       f"{sorted(TIER_MARKERS[tier])} (they set {wrong})")


def test_no_other_tier_marker_at_module_level():
    """A file in tests/unit that says `pytestmark = pytest.mark.dist` is in the wrong folder."""
    tier_of = {marker: tier for tier, markers in TIER_MARKERS.items() for marker in markers}
    misplaced = []
    for tier in TIER_MARKERS:
        for path in _test_files(tier):
            others = {tier_of[m] for m in module_markers(_parse(path)) if m in tier_of} - {tier}
            misplaced += [f"tests/{tier}/{path.name} is marked {sorted(others)}"] if others else []
    assert not misplaced, "\n".join(misplaced)


@pytest.mark.parametrize("tier", NO_PROCESS_TIERS)
def test_no_process_is_started_outside_dist(tier):
    starts = {}
    for path in sorted((ROOT / "tests" / tier).glob("*.py")):  # helpers and conftest too
        found = process_starts(_parse(path))
        if found:
            starts[path.name] = found
    assert not starts, f"tests/{tier} may start processes (move those tests to tests/dist): {starts}"


def test_the_checks_see_what_they_look_for():
    """The parsers above on small sources, so a check that silently finds nothing fails here."""
    assert module_markers(ast.parse("import pytest\npytestmark = pytest.mark.unit")) == {"unit"}
    assert module_markers(ast.parse("pytestmark = [pytest.mark.cuda, pytest.mark.skipif(True, reason='x')]")) \
        == {"cuda", "skipif"}
    assert module_markers(ast.parse("def f():\n    pytestmark = pytest.mark.unit")) == set()
    bad = ["import subprocess", "from multiprocessing import Pool", "import torch.multiprocessing as mp",
           "from launch import torchrun", "os.fork()", "subprocess.run(['x'])",
           "x = [sys.executable, '-m', 'torch.distributed.run']\nrun([sys.executable, '-m', 'torch.distributed.run'])",
           "torch.compile(model)", "torch.compile(model, backend='inductor')"]
    for source in bad:
        assert process_starts(ast.parse(source)), source
    assert not process_starts(ast.parse("torch.compile(model, fullgraph=True, backend='aot_eager')"))
    assert not process_starts(ast.parse("monkeypatch.setattr(cli.subprocess, 'call', recorder)"))


# --- scripts use public library names only ---------------------------------------------------------------------
def _moe_ref_bindings(tree: ast.Module) -> tuple[set[str], list[str]]:
    """(local names bound to a moe_ref module, private imports) of a script.

    A name is bound to a moe_ref module by `import moe_ref...`, `from moe_ref.x import module`,
    `name = importlib.import_module("moe_ref...")`, or `name = helper()` where the script's own `helper` returns
    `importlib.import_module("moe_ref...")`.
    """
    def imports_moe_ref_module(call: ast.AST) -> bool:
        return (isinstance(call, ast.Call) and (_dotted(call.func) or "").endswith("import_module") and call.args
                and isinstance(call.args[0], ast.Constant) and str(call.args[0].value).startswith("moe_ref"))

    helpers = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
               and any(isinstance(n, ast.Return) and imports_moe_ref_module(n.value) for n in ast.walk(node))}
    bound, private = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "moe_ref":
                    bound.add((alias.asname or alias.name).split(".")[0])
                    if any(part.startswith("_") for part in alias.name.split(".")):
                        private.append(f"line {node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "moe_ref":
            module_private = any(part.startswith("_") for part in node.module.split("."))
            for alias in node.names:
                bound.add(alias.asname or alias.name)  # a module or not: attributes of either must be public
                if module_private or (alias.name.startswith("_") and not alias.name.startswith("__")):
                    private.append(f"line {node.lineno}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value
            if imports_moe_ref_module(value) or (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                                                  and value.func.id in helpers):
                bound.add(node.targets[0].id)
                if imports_moe_ref_module(value) and any(p.startswith("_") for p in value.args[0].value.split(".")):
                    private.append(f"line {node.lineno}: import_module({value.args[0].value!r})")
    return bound, private


def private_library_uses(tree: ast.Module) -> list[str]:
    """Private moe_ref names a script imports or reads as an attribute of a moe_ref module."""
    bound, found = _moe_ref_bindings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_scripts_use_public_library_names_only():
    scripts = sorted((ROOT / "scripts").glob("*.py"))
    assert scripts
    uses = {path.name: found for path in scripts if (found := private_library_uses(_parse(path)))}
    assert not uses, f"scripts reach private moe_ref names (make them public or use a public one): {uses}"


def test_the_script_check_sees_private_uses():
    bad = ["from moe_ref.kernels.runtime._triton_utils import is_interpreter", "import moe_ref.kernels.runtime._triton_utils",
           "from moe_ref.kernels.experts.grouped_mlp import _autotuned_kernel",
           "import importlib\ngm = importlib.import_module('moe_ref.kernels.experts.grouped_mlp')\ngm._launch_gemm()",
           "import importlib\ndef _gm():\n    return importlib.import_module('moe_ref.kernels.experts.grouped_mlp')\n"
           "gm = _gm()\ngm._launch_gemm()",
           "from moe_ref.kernels import grouped_mlp\ngrouped_mlp._num_sms(0)", "import moe_ref\nmoe_ref.kernels._x"]
    for source in bad:
        assert private_library_uses(ast.parse(source)), source
    good = ["from moe_ref.kernels import is_interpreter", "def _mine():\n    pass\n_mine()",
            "from moe_ref.kernels import grouped_mlp\ngrouped_mlp.launch_gemm()", "self._cache = {}"]
    for source in good:
        assert not private_library_uses(ast.parse(source)), source
