"""Documented arguments must exist in the signature (stale docstrings are a bug)."""
import importlib
import inspect
import pkgutil
import re

import pytest

import moe_ref

pytestmark = pytest.mark.unit


def _public_callables():
    for info in pkgutil.walk_packages(moe_ref.__path__, "moe_ref."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != info.name:
                continue
            if inspect.isfunction(obj):
                yield f"{info.name}.{name}", obj
            elif inspect.isclass(obj):
                yield f"{info.name}.{name}", obj
                for meth_name, meth in vars(obj).items():
                    if inspect.isfunction(meth) and (not meth_name.startswith("_") or meth_name == "__init__"):
                        yield f"{info.name}.{name}.{meth_name}", meth


def _documented_args(doc: str) -> list[str]:
    match = re.search(r"\n\s*Args:\n(.*?)(\n\s*\n|\n\s*Returns:|\Z)", doc, re.S)
    if not match:
        return []
    lines = [line for line in match.group(1).splitlines() if line.strip()]
    indent = len(lines[0]) - len(lines[0].lstrip()) if lines else 0
    names = []
    for line in lines:  # argument lines sit at the first line's indent; deeper lines continue them
        head = re.match(r"([A-Za-z_][\w, ]*):", line[indent:]) if len(line) - len(line.lstrip()) == indent else None
        if head:
            names += [n.strip() for n in head.group(1).split(",") if n.strip()]
    return names


def test_documented_args_exist():
    stale = []
    for qualname, obj in _public_callables():
        doc = inspect.getdoc(obj) or ""
        target = obj.__init__ if inspect.isclass(obj) else obj
        try:
            params = set(inspect.signature(target).parameters)
        except (TypeError, ValueError):
            continue
        for name in _documented_args("\n" + doc):
            if name not in params and not any(p.startswith("*") for p in params):
                stale.append(f"{qualname}: documents {name!r}, signature has {sorted(params)}")
    assert not stale, "\n".join(stale)
