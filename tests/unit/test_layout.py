"""The floor plan holds: every module sits in a stage, imports only from its own stage or lower ones, and the
package's imports have no cycle (the stage table is in ``moe_ref/__init__.py`` and the README)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "moe_ref"

# Lowest first. A module's stage is that of the longest prefix of its dotted name listed here.
STAGES = {
    "moe_ref.core": 0, "moe_ref.testing": 0,
    "moe_ref.kernels": 1,
    "moe_ref.checkpoint": 2,
    "moe_ref.experts": 3,
    "moe_ref.ep": 4, "moe_ref.eplb": 4,
    "moe_ref.block": 5, "moe_ref.eager_graphs": 5, "moe_ref.layer": 5, "moe_ref.custom_ops": 5, "moe_ref.reference": 5,
    "moe_ref.tools": 6, "moe_ref.__main__": 6, "moe_ref.bench": 6,
    "moe_ref.integrations": 6,
    "moe_ref.conformance": 6,
}
STAGE_NAMES = ["core", "kernels", "checkpoint", "experts", "ep", "layer", "tools"]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _stage(module: str) -> int | None:
    for prefix in sorted(STAGES, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return STAGES[prefix]
    return None


def _imports(module: str) -> set[str]:
    """The moe_ref modules ``module`` imports, at module level or inside functions."""
    found = set()
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        found.update(n for n in names if n in MODULES and n != module)
    return found


GRAPH = {m: _imports(m) for m in MODULES if m != "moe_ref"}  # the root only re-exports, lazily


def test_every_module_has_a_stage():
    assert [m for m in GRAPH if _stage(m) is None] == []


def test_no_module_imports_from_a_higher_stage():
    upward = [f"{m} ({STAGE_NAMES[_stage(m)]}) imports {d} ({STAGE_NAMES[_stage(d)]})"
              for m, deps in GRAPH.items() for d in sorted(deps) if d != "moe_ref" and _stage(d) > _stage(m)]
    assert upward == []


def test_no_import_cycles():
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(GRAPH.get(m, ())):
            if state.get(d) == 1:
                cycles.append(" -> ".join(path[path.index(d):] + [d]))
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_the_readme_lists_the_stage_folders():
    readme = (ROOT / "README.md").read_text()
    for folder in ("core/", "kernels/", "checkpoint/", "experts/", "ep/", "tools/"):
        assert f"moe_ref/{folder}" in readme or f"`{folder}`" in readme, folder


def test_the_graph_sees_imports():
    """The checks above would pass on an empty graph: make sure a known edge is seen."""
    assert "moe_ref.core.errors" in GRAPH["moe_ref.ep.options"]
    assert "moe_ref.experts.registry" in GRAPH["moe_ref.experts.backends"]
    assert "moe_ref.core.envs" in GRAPH["moe_ref.kernels.experts.grouped_mlp"]  # `from moe_ref.core import envs`
    assert "moe_ref.kernels.runtime.native" in GRAPH["moe_ref.kernels.runtime.ops"]  # imported inside a function
