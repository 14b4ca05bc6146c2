"""Tensor names follow the package's one shape legend (``moe_ref/__init__.py``), and pool rows are never spelled R.

The rule, applied to every module of ``moe_ref`` (parsed with ``ast``, nothing imported):

- Identifiers read: function and method names, their arguments, every ``ast.Name`` (assignment, loop and ``with``
  targets as well as uses), attribute names (``self.x_PDx = ...`` and ``obj.x_PDx``), and keyword names at call
  sites (``f(x_scale_PDb=...)``), so a rename that misses a call site shows up too.
- Skipped: ALL-CAPS names (constants and Triton constexprs such as ``BLOCK_M``/``BLOCK_K``, which follow the GEMM
  convention, not the legend) and names without an inner ``_``.
- A trailing ``_`` means "more dims follow" (``stacked_e2F_`` is ``[e, 2F, ...]``) and is dropped; the suffix is
  then the last ``_``-separated part.
- That part is a shape suffix iff it starts with an uppercase letter, with digits then an uppercase letter (``2F``),
  or with ``e`` alone or followed by an uppercase letter or digits then one (``e``, ``eDF``, ``e2FD``; not
  ``e4m3``). Lowercase words (``_ref``, ``_fp8``, ``_2d``) are not suffixes.
- A shape suffix must tokenize fully, greedily, longest legend symbol first (``Dx``, ``Db``, ``Eg``, ``Fb``, ``Ib``,
  ``Ob`` before single letters): digits before a symbol multiply it (``2F``), digits at the very end are a literal
  size (``recv_src_P3`` is ``[P, 3]``), and one trailing lowercase letter from ``QUALIFIERS`` names a stored form of
  the last dim (``gate_up_qweight_e2FDq``, ``packed_OIw``; documented in ``checkpoint.formats`` and ``kernels.experts.w4``).

Pool rows are P, R is EP ranks only:

- ``POOL_ONLY`` modules (the experts and the kernels they run) see one rank's receive pool and have no rank dim: no
  suffix there holds an R, and no constant there ends in ``_R``.
- A module whose names spell a dim R lists R in its ``Shape legend:`` line, which ``test_docstrings`` holds to the
  package meaning (EP ranks).
- The pool-row spellings this legend retired (``RETIRED``) are not identifiers anywhere in moe_ref, tests or scripts.
"""
import ast
import pathlib
import re

import pytest

from test_docstrings import parse_legend  # the one reading of a Shape legend paragraph

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "moe_ref"
# A stored form of the last dim: q stored (packed) width, s its scale width (checkpoint.formats' Dq/Fq, Ds/Fs);
# w int4 words, p fp4 byte pairs, g group-32 scales (kernels.experts.w4, checkpoint.formats).
QUALIFIERS = "qswpg"
POOL_ONLY = ("experts/**/*.py", "kernels/experts/grouped_mlp*.py", "kernels/experts/gated_act.py")
RETIRED = {"x_" + "RD", "x_scale_" + "RDb", "y_" + "RD", "h_" + "RF", "row_expert_" + "R", "x_fp8_" + "RD"}
_LETTER = re.compile(r"^(?:[A-Z][a-z]?|e)$")
_SUFFIX_START = re.compile(r"^(?:[A-Z]|[0-9]+[A-Z]|e(?:$|[A-Z]|[0-9]+[A-Z]))")


def legend_symbols(doc: str) -> set[str]:
    """The letters the ``Shape legend:`` paragraph defines (``test_docstrings.parse_legend``'s reading of it)."""
    legend = parse_legend(doc)
    assert legend, "no 'Shape legend:' paragraph"
    return set(legend)


SYMBOLS = legend_symbols(ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text())))
_BY_LENGTH = sorted(SYMBOLS, key=len, reverse=True)


def shape_suffix(name: str) -> str | None:
    """The shape suffix of an identifier under the module doc's rule, or None when it has none."""
    if name.upper() == name or "_" not in name.strip("_"):
        return None
    last = name.rstrip("_").rsplit("_", 1)[-1]
    return last if _SUFFIX_START.match(last) else None


def tokenize(suffix: str) -> list[str] | None:
    """Legend symbols of a suffix (a multiplier kept on its symbol: ``2F``; a literal size as its digits), or None
    when part of it is no symbol."""
    tokens, i = [], 0
    while i < len(suffix):
        digits = re.match(r"[0-9]*", suffix[i:]).group()
        j = i + len(digits)
        if digits and j == len(suffix) and tokens:
            tokens.append(digits)  # a literal size ends the suffix
            break
        symbol = next((s for s in _BY_LENGTH if suffix.startswith(s, j)), None)
        if symbol is not None:
            tokens.append(digits + symbol)
            i = j + len(symbol)
        elif not digits and tokens and j == len(suffix) - 1 and suffix[j] in QUALIFIERS:
            tokens[-1] += suffix[j]  # a stored form of the last dim
            i = len(suffix)
        else:
            return None
    return tokens


def _identifiers(tree: ast.AST):
    """``(line, name)`` of every identifier the rule reads."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.lineno, node.name
        elif isinstance(node, ast.arg):
            yield node.lineno, node.arg
        elif isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, ast.keyword) and node.arg:
            yield node.value.lineno, node.arg


def _modules(root: pathlib.Path = PACKAGE):
    for path in sorted(root.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def _rank_symbols(suffix: str) -> bool:
    return any(token.lstrip("0123456789").rstrip(QUALIFIERS) == "R" for token in tokenize(suffix) or [])


def test_package_legend_is_parsed():
    assert {"T", "C", "K", "N", "U", "E", "e", "G", "Eg", "R", "P", "M", "D", "L", "Dx", "F", "S", "O", "I",
            "Db", "Fb", "Ob", "Ib"} <= SYMBOLS


@pytest.mark.parametrize("name, tokens", [
    ("topk_ids_TK", ["T", "K"]), ("x_PDx", ["P", "Dx"]), ("x_scale_PDb", ["P", "Db"]),
    ("gate_up_weight_e2FD", ["e", "2F", "D"]), ("grouped_TGEg", ["T", "G", "Eg"]), ("num_rows_e", ["e"]),
    ("stacked_e2F_", ["e", "2F"]), ("recv_src_P3", ["P", "3"]), ("gate_up_qweight_e2FDq", ["e", "2F", "Dq"]),
    ("ptrs_R", ["R"]), ("scale_e2FbDb", ["e", "2Fb", "Db"]),
])
def test_rule_reads_shape_suffixes(name, tokens):
    assert tokenize(shape_suffix(name)) == tokens


@pytest.mark.parametrize("name", ["grouped_mlp_ref", "float8_e4m3fn", "b_2d", "BLOCK_R", "MoEConfig", "_LAZY",
                                  "x_", "num_rows"])
def test_rule_skips_other_names(name):
    assert shape_suffix(name) is None


@pytest.mark.parametrize("suffix", ["PW", "Rx", "PDxy", "2", "eZ", "PDq2"])
def test_rule_rejects_unknown_letters(suffix):
    assert tokenize(suffix) is None


def test_every_shape_suffix_uses_the_legend():
    bad = sorted({f"{path.relative_to(ROOT)}:{line} {name}" for path, tree in _modules()
                  for line, name in _identifiers(tree)
                  if (suffix := shape_suffix(name)) and tokenize(suffix) is None})
    assert not bad, f"shape suffixes that are not legend symbols {sorted(SYMBOLS)}:\n" + "\n".join(bad)


def test_pool_only_modules_have_no_rank_dim():
    paths = sorted({path for pattern in POOL_ONLY for path in PACKAGE.glob(pattern)})
    assert any(path.name == "base.py" for path in paths) and any(path.name == "gated_act.py" for path in paths)
    bad = []
    for path in paths:
        for line, name in _identifiers(ast.parse(path.read_text())):
            suffix = shape_suffix(name)
            if (suffix and _rank_symbols(suffix)) or (name.upper() == name and name.endswith("_R")):
                bad.append(f"{path.relative_to(ROOT)}:{line} {name}")
    assert not bad, "pool rows are P (R is EP ranks; these modules have none):\n" + "\n".join(sorted(set(bad)))


def test_modules_that_spell_ranks_declare_R():
    bad = []
    for path, tree in _modules():
        users = sorted({name for _, name in _identifiers(tree) if (suffix := shape_suffix(name))
                        and _rank_symbols(suffix)})
        doc = ast.get_docstring(tree) or ""
        if users and ("Shape legend:" not in doc or "R" not in legend_symbols(doc)):
            bad.append(f"{path.relative_to(ROOT)}: {', '.join(users[:4])} but no R in its Shape legend line")
    assert not bad, "\n".join(bad)


def test_retired_pool_row_names_are_gone():
    bad = sorted({f"{path.relative_to(ROOT)}:{line} {name}"
                  for top in ("moe_ref", "tests", "scripts") for path, tree in _modules(ROOT / top)
                  for line, name in _identifiers(tree) if name in RETIRED})
    assert not bad, "\n".join(bad)
