"""Records and renderings: one JSON line per (implementation, ranks, case) with its REPRO command, the ledger of
known failures (a ledgered case that passes is an unexpected pass, and fails the run), the markdown/CSV matrix, the
mutants' caught-by table, and a plot of the speed columns when matplotlib is installed (never required)."""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from moe_ref.core.errors import ConformanceLedgerError


def record(impl, case, world: int, device: str, merged: dict | None, skip: str | None) -> dict:
    """The JSON-lines record of one case (``merged``: from ``spawn.merge``; None when skipped)."""
    status = "SKIP" if skip else merged["status"]
    us = None if merged is None else merged["us"]
    rec = {"id": f"{impl.name}@{world}/{case.id}", "impl": impl.name, "case": case.id, "ranks": world,
           "device": device, "seed": case.seed, "status": status,
           "reason": skip or "; ".join(f"{k}: {v}" for k, v in (merged or {}).get("failed", {}).items()),
           "errors": [] if merged is None else merged["errors"], "failed_checks": sorted(
               {k.split("@")[0] for k in (merged or {}).get("failed", {})}),
           "us": us, "GB/s": None, "TFLOP/s": None,
           "tune_s": None if merged is None or merged.get("tune_s") is None else round(merged["tune_s"], 1),
           "capabilities": impl.caps.describe(),
           "repro": f"moe-ref conform --impl {impl.spec or impl.name} --ranks {world} --device {device} "
                    f"--cases '{case.id}' --seed {case.seed // 1000}"}
    if merged is not None and merged.get("kernels"):
        rec["kernels"] = merged["kernels"]  # rank 0's us per call of each kernel (--timer kernels)
    if us:
        rec["GB/s"] = round(merged["bytes"] / us / 1e3, 2)
        rec["TFLOP/s"] = round(merged["flops"] / us / 1e6, 3)
    return rec


def read_ledger(path: str | None) -> dict[str, str]:
    """``{"<impl>@<ranks>/<case id>": "why it fails"}`` (fnmatch patterns allowed in the keys), or {}."""
    if not path:
        return {}
    try:
        ledger = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ConformanceLedgerError(f"ledger {path}: {err}") from None
    if not isinstance(ledger, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in ledger.items()):
        raise ConformanceLedgerError(f"ledger {path} must be a JSON object of strings")
    return ledger


def apply_ledger(rec: dict, ledger: dict[str, str]) -> dict:
    """XFAIL for a ledgered FAIL (with the ledger's reason), XPASS (a failure of the run) for a ledgered PASS."""
    from fnmatch import fnmatchcase

    why = next((v for k, v in ledger.items() if fnmatchcase(rec["id"], k)), None)
    if why is not None and rec["status"] in ("FAIL", "PASS"):
        rec["status"] = "XFAIL" if rec["status"] == "FAIL" else "XPASS"
        rec["ledger"] = why
    return rec


def matrix(records: list[dict], fmt: str = "md") -> str:
    """Cases down, ``impl@ranks`` across; each cell the status (and us where timed)."""
    columns = sorted({f"{r['impl']}@{r['ranks']}" for r in records})
    cases = list(dict.fromkeys(r["case"] for r in records))
    cell = {(r["case"], f"{r['impl']}@{r['ranks']}"): r["status"] + (f" {r['us']:.0f}us" if r["us"] else "")
            for r in records}
    rows = [[case] + [cell.get((case, col), "") for col in columns] for case in cases]
    if fmt == "csv":
        buf = io.StringIO()
        csv.writer(buf).writerows([["case", *columns], *rows])
        return buf.getvalue()
    lines = ["| case | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def caught_by(records: list[dict]) -> str:
    """The mutants' table: for each implementation, the checks that failed and the first scenarios they failed in."""
    by_impl: dict[str, dict[str, list[str]]] = {}
    for r in records:
        for check in r["failed_checks"]:
            by_impl.setdefault(r["impl"], {}).setdefault(check, []).append(f"{r['case']}@{r['ranks']}")
    names = list(dict.fromkeys(r["impl"] for r in records))
    lines = ["| implementation | caught by (check: first scenarios) |", "|---|---|"]
    for name in names:
        checks = by_impl.get(name, {})
        text = "; ".join(f"**{c}**: {', '.join(cases[:3])}{' ...' if len(cases) > 3 else ''} ({len(cases)})"
                         for c, cases in sorted(checks.items())) or "none: passes every case"
        lines.append(f"| {name} | {text} |")
    return "\n".join(lines)


def plot(records: list[dict], path: str) -> bool:
    """A bar chart of us per case and implementation into ``path``; False (nothing written) without matplotlib or
    without timed cases."""
    timed = [r for r in records if r["us"]]
    try:
        import matplotlib
    except ImportError:
        return False
    if not timed:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    labels = [f"{r['impl']}@{r['ranks']} {r['case']}" for r in timed]
    ax.barh(labels, [r["us"] for r in timed])
    ax.set_xlabel("us per call")
    fig.tight_layout()
    fig.savefig(path)
    return True
