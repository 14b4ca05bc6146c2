"""docs/results/ holds exactly the raw files the docs cite, few and small; README.md stays short; tracked text names no
work log or machine path.

Citations: docs/RESULTS.md and README.md cite a raw file as ``docs/results/<name>``; ``<name>`` may end in ``.*``
(every extension of that stem, e.g. the ``.json``, ``.md`` and ``.png`` of one run).
"""
import fnmatch
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
CITING = ("docs/RESULTS.md", "README.md")
_CITE = re.compile(r"docs/results/([A-Za-z0-9_.*-]+[A-Za-z0-9*])")


def _citations() -> set[str]:
    return {m.group(1) for doc in CITING for m in _CITE.finditer((ROOT / doc).read_text())}


def test_every_results_file_is_cited():
    cited = _citations()
    files = sorted(p.name for p in RESULTS.iterdir())
    uncited = [f for f in files if not any(fnmatch.fnmatchcase(f, c) for c in cited)]
    assert not uncited, f"files in docs/results/ cited by neither {CITING}: {uncited}"


def test_every_citation_exists():
    files = [p.name for p in RESULTS.iterdir()]
    missing = sorted(c for c in _citations() if not fnmatch.filter(files, c))
    assert not missing, f"cited in {CITING} but not in docs/results/: {missing}"


# --- a record, not a diary: the raw files stay few and small, the README teaches use -------------------------
MAX_RESULTS_FILES = 40
MAX_RESULTS_BYTES = 1_500_000  # 1.5 MB, the sum of the files' sizes
MAX_README_LINES = 260


def test_results_folder_stays_small():
    files = [p for p in RESULTS.iterdir() if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    assert len(files) <= MAX_RESULTS_FILES, (
        f"docs/results/ has {len(files)} files (at most {MAX_RESULTS_FILES}): keep the latest run per question "
        "in docs/RESULTS.md and git rm the superseded files (git keeps them)")
    assert total <= MAX_RESULTS_BYTES, (
        f"docs/results/ holds {total} bytes (at most {MAX_RESULTS_BYTES}): keep a run's markdown summary, "
        "not its plots and profiler dumps")


def test_readme_stays_short():
    num_lines = len((ROOT / "README.md").read_text().splitlines())
    assert num_lines <= MAX_README_LINES, (
        f"README.md has {num_lines} lines (at most {MAX_README_LINES}): it teaches use; mechanisms go to "
        "docs/design.md, GPU commands to docs/gpu.md, figures to docs/RESULTS.md")


# --- no work-log references and no paths of a machine -----------------------------------------------------
# Flagged in every tracked text file:
#   "call 3", "calls 1-3" (numbered runs of a work log; a command-line flag such as `--calls 30` is fine),
#   "issue 12", "session 4" (an outside tracker's numbers, a work log's sessions): say what the thing is instead.
# Flagged outside docs/results/ (raw outputs kept as the GPU machine printed them):
#   "/work/", "/root/" and "/tmp/", except "/tmp/site", the folder the GPU suite's shell commands install optional
#   wheels into on the GPU machine (scripts/gpu_suite.sh, tests/gpu/mega_worker.py's usage line). Write a temporary
#   path with `tempfile` or `$TMPDIR` instead. This file itself is skipped: it spells the patterns out.
_LOG = re.compile(r"(?<![-\w])(?:calls? \d|issue \d|session \d)", re.I)
_PATH = re.compile(r"/work/|/root/|/tmp/(?!site\b)")


def _ignored_top_folders() -> set[str]:
    """Top-level folders that .gitignore or the checkout's own .git/info/exclude name (``/name/`` or ``name/``)."""
    names = {".git", ".venv", ".pytest_cache", "build", "results", ".whl", ".gl"}  # .gitignore's folders
    for rules in (ROOT / ".gitignore", ROOT / ".git" / "info" / "exclude"):
        if rules.is_file():
            for line in rules.read_text().splitlines():
                m = re.fullmatch(r"/?([^/*?\[!#\s][^/*?\[]*)/", line.strip())
                if m:
                    names.add(m.group(1))
    return names


def _tracked_text_files():
    """The project's files (no process started: the folders the repository tracks, minus what .gitignore lists)."""
    top_ignored = _ignored_top_folders()
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        if (not path.is_file() or rel.parts[0] in top_ignored or rel.parts[0].endswith(".egg-info")
                or "__pycache__" in rel.parts):
            continue
        if path.suffix in (".so", ".pyc"):
            continue
        name = rel.as_posix()
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue
        yield name, data.decode("utf-8", "replace")


def test_no_work_log_references_or_machine_paths():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    found = []
    for name, text in _tracked_text_files():
        if name == "tests/unit/test_results_cited.py":  # this file spells the patterns out
            continue
        raw_output = name.startswith("docs/results/")
        for lineno, line in enumerate(text.splitlines(), 1):
            if _LOG.search(line) or (not raw_output and _PATH.search(line)):
                found.append(f"{name}:{lineno}: {line.strip()[:120]}")
    assert not found, "work-log references or machine paths:\n" + "\n".join(found)


def test_every_results_file_the_code_names_exists():
    """The package, tests and csrc may point at a raw file (e.g. the tuner run behind a tile list): it must be there.
    (scripts/ are left out: a benchmark's ``--record`` names the file it would write.)"""
    files = [p.name for p in RESULTS.iterdir()]
    missing = [f"{name}: docs/results/{m.group(1)}" for name, text in _tracked_text_files()
               if name.startswith(("moe_ref/", "tests/", "csrc/")) and name != "tests/unit/test_results_cited.py"
               for m in _CITE.finditer(text) if not fnmatch.filter(files, m.group(1))]
    assert not missing, "raw files named in code but absent from docs/results/:\n" + "\n".join(missing)
