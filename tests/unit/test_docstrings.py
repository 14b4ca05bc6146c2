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


# --- one shape legend ------------------------------------------------------------------------------------
# The package docstring (moe_ref/__init__.py) holds THE legend; every module's "Shape legend:" line may use
# only its letters, each with the same meaning. A definition agrees when the words before its first
# parenthesis share a word with the package's definition (generic words such as "rows" and "width" aside),
# so "R ranks" agrees with "R EP ranks" and "R pool rows" does not.
# PENDING: modules whose legend still disagrees and whose owner has not fixed it yet (each line says which
# letters). The test fails when one of them agrees, so the entry is removed with the fix.
PENDING = {
}
_LETTER = re.compile(r"^(?:[A-Z][a-z]?|e)$")
_STOP = {"the", "and", "for", "its", "one", "this", "per", "all", "with", "that", "are", "not", "then", "else",
         "from", "each", "row", "rows", "width"}


def _legend_items(text: str) -> list[str]:
    items, depth, current = [], 0, ""
    for ch in text.replace("`", ""):
        depth += (ch in "([") - (ch in ")]")
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    return [item.strip() for item in items + [current] if item.strip()]


def parse_legend(doc: str) -> dict[str, str] | None:
    """``{letter: definition}`` from the paragraph that starts a line with ``Shape legend:``; None without one.

    Items are comma-separated (commas inside brackets or parentheses don't split): ``T tokens``, ``Db = ...``,
    ``N x K one matrix`` (both letters get the definition), ``Nb, Kb = ...`` (a bare letter takes the next one's).
    """
    match = re.search(r"^[ \t]*Shape legend:(.*?)(?:\n\s*\n|\Z)", doc, re.S | re.M)
    if not match:
        return None
    legend, pending = {}, []
    for item in _legend_items(" ".join(match.group(1).split()).rstrip(".")):
        tokens, letters, i = item.split(), [], 0
        while i < len(tokens) and (_LETTER.match(tokens[i]) or (letters and tokens[i] in ("x", "and", "/"))):
            if _LETTER.match(tokens[i]):
                letters.append(tokens[i])
            i += 1
        if i < len(tokens) and tokens[i] == "=":
            i += 1
        definition = " ".join(tokens[i:])
        if not letters:
            pending = []
        elif not definition:
            pending += letters
        else:
            legend.update({letter: definition for letter in pending + letters})
            pending = []
    return legend


def _words(text: str) -> set[str]:
    words = {w for w in re.findall(r"[a-z0-9]+", text.lower()) if len(w) >= 3}
    return {w[:-1] if w.endswith("s") and len(w) > 3 else w for w in words} - _STOP


def legend_conflicts(module_legend: dict[str, str], package_legend: dict[str, str]) -> list[str]:
    """One line per letter that is not in the package legend or means something else there."""
    problems = []
    for letter, definition in module_legend.items():
        if letter not in package_legend:
            problems.append(f"{letter} ({definition!r}) is not in the package legend")
            continue
        head = _words(re.split(r"[(;:]", definition)[0])
        if head and not head & _words(package_legend[letter]):
            problems.append(f"{letter} is {definition!r} here, {package_legend[letter]!r} in the package legend")
    return problems


def _module_legends():
    for info in pkgutil.walk_packages(moe_ref.__path__, "moe_ref."):
        if info.name.endswith("__main__"):
            continue
        legend = parse_legend(importlib.import_module(info.name).__doc__ or "")
        if legend is not None:
            yield info.name, legend


def test_package_legend_defines_every_letter_once():
    legend = parse_legend(moe_ref.__doc__)
    assert {"T", "C", "K", "N", "E", "e", "G", "R", "P", "M", "D", "L", "Dx", "F", "S", "Db"} <= set(legend)
    assert "R" in legend and "rank" in _words(legend["R"]) and "pool" in _words(legend["P"])


def test_parse_legend_forms():
    assert parse_legend("x\n\nShape legend: T tokens, C = cap = ``n`` (rows, one rank), N x K one matrix ``[out, in]``,"
                        "\nNb, Kb = ceil(./128) blocks, e = E / R local experts.\n\nmore") == {
        "T": "tokens", "C": "cap = n (rows, one rank)", "N": "one matrix [out, in]", "K": "one matrix [out, in]",
        "Nb": "ceil(./128) blocks", "Kb": "ceil(./128) blocks", "e": "E / R local experts"}
    package = {"R": "EP ranks (processes of the expert-parallel group)", "Dx": "expert input width (the row width)"}
    assert legend_conflicts({"R": "ranks", "Dx": "row width"}, package) == []
    assert len(legend_conflicts({"R": "pool rows", "Q": "anything"}, package)) == 2


def test_every_module_legend_agrees_with_the_package_legend():
    package_legend = parse_legend(moe_ref.__doc__)
    conflicts, fixed = [], []
    for name, legend in _module_legends():
        problems = legend_conflicts(legend, package_legend)
        if name in PENDING:
            if not problems:
                fixed.append(name)
        elif problems:
            conflicts += [f"{name}: {p}" for p in problems]
    assert not conflicts, "\n".join(conflicts)
    assert not fixed, f"these modules now agree with the package legend; remove them from PENDING: {fixed}"
