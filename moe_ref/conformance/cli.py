"""``moe-ref conform``: run the scenario matrix on one or more implementations at the given rank counts.

    moe-ref conform --impl pkg.module:factory [--ranks 1,2,4] [--device cpu|cuda] [--cases 'tiny/*'] [--speed]
                    [--jsonl out.jsonl] [--matrix out.md] [--csv out.csv] [--plot out.png] [--ledger known.json]
    moe-ref conform --mutants [--write-doc docs/conform.md]   # every mutant at 1, 2, 4 ranks: the caught-by table
    moe-ref conform --list                                    # registered implementations and case ids
    moe-ref conform --impl moe_ref/triton --device cuda --cases kimi-k2/bf16/T512 --speed  # a speed case by its id

Exit status 1 when a case of an implementation other than a mutant FAILs, a ledgered case passes (XPASS), or a
mutant is caught by no check; 0 otherwise (``failing``).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from fnmatch import fnmatchcase

from moe_ref.conformance.registry import registered, resolve
from moe_ref.conformance.report import apply_ledger, caught_by, matrix, plot, read_ledger, record
from moe_ref.conformance.runner import skip_reason
from moe_ref.conformance.scenarios import all_cases, case_by_id, speed_tokens
from moe_ref.conformance.spawn import run_jobs
from moe_ref.core.errors import ConformanceLedgerError

MUTANT_PREFIX = "mutant:"
DOC_BEGIN, DOC_END = "<!-- caught-by: begin (moe-ref conform --mutants --write-doc) -->", "<!-- caught-by: end -->"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--impl", action="append", default=[], help="module:attribute or a registered name (repeatable)")
    p.add_argument("--mutants", action="store_true", help="run the shipped mutants (and their correct base)")
    p.add_argument("--ranks", default="1", help="comma-separated rank counts (default 1)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--cases", default="*", help="fnmatch pattern(s) of case ids, comma-separated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline", type=float, default=120.0, help="seconds per case before it is a hang (FAIL)")
    p.add_argument("--speed", action="store_true", help="time each passing case (us, GB/s, TFLOP/s)")
    p.add_argument("--ledger", default=None, help="JSON {'impl@ranks/case': 'reason'} of known failures")
    p.add_argument("--jsonl", default=None)
    p.add_argument("--matrix", default=None)
    p.add_argument("--csv", default=None)
    p.add_argument("--plot", default=None, help="a PNG of the speed columns (needs matplotlib)")
    p.add_argument("--write-doc", default=None, help="with --mutants: rewrite the caught-by table in this file")
    p.add_argument("--list", action="store_true")


def run(args) -> int:
    from moe_ref.conformance.mutants import CORRECT_BASES, MUTANT_NAMES

    cases = all_cases(args.seed)
    if args.list:
        for name, impl in sorted(registered().items()):
            print(f"{name:28s} {impl.kind:17s} {impl.label}")
        print("\n".join(c.id for c in cases))
        return 0
    patterns = args.cases.split(",")
    chosen = [c for c in cases if any(fnmatchcase(c.id, p) for p in patterns)]
    # a speed case (moe-ref bench's <shape>/<recipe>/T<n>, as its REPRO names it) is given by its id
    chosen += [case_by_id(p, args.seed) for p in patterns if speed_tokens(p.rsplit("/", 1)[-1]) is not None]
    if not chosen:
        raise ConformanceLedgerError(f"--cases {args.cases!r} matches no case; `moe-ref conform --list` names them")
    specs = list(args.impl) + ([*CORRECT_BASES, *MUTANT_NAMES] if args.mutants else [])
    ranks = [int(r) for r in re.split(r"[ ,]+", "1,2,4" if args.mutants and args.ranks == "1" else args.ranks) if r]
    ledger = read_ledger(args.ledger)
    impls = [resolve(spec) for spec in specs]
    skips = {(impl.name, world, c.id): skip_reason(impl, c, world, args.device)
             for impl in impls for world in ranks for c in chosen}
    ran: dict[tuple[str, int, str], dict] = {}
    for world in ranks:
        # one group of rank processes per rank count, case-major: the case's inputs and weights are made once per
        # rank for every implementation that runs it
        jobs = [(impl.spec or impl.name, c.id) for c in chosen for impl in impls if not skips[(impl.name, world, c.id)]]
        by_spec = {impl.spec or impl.name: impl.name for impl in impls}
        timer = "events" if args.speed else None  # --speed: the wall time per call, as moe-ref bench's default
        for (spec, case_id), merged in run_jobs(jobs, world, args.device, args.deadline, args.seed,
                                                timer).items():
            ran[(by_spec[spec], world, case_id)] = merged
    records = []
    for impl in impls:
        for world in ranks:
            for case in chosen:
                key = (impl.name, world, case.id)
                rec = apply_ledger(record(impl, case, world, args.device, ran.get(key), skips[key]), ledger)
                records.append(rec)
                if rec["status"] in ("FAIL", "XPASS") and not impl.name.startswith(MUTANT_PREFIX):
                    print(f"{rec['status']} {rec['id']}: {rec['reason'][:300]}\n  REPRO: {rec['repro']}",
                          file=sys.stderr)
    _write(args, records)
    return 1 if failing(records) else 0


def failing(records: list[dict]) -> list[str]:
    """Why the run fails: a FAIL or XPASS of any implementation but a mutant, and a mutant that no check caught
    (the mutants exist to fail; one that passes everything means a check went blind)."""
    bad = [r["id"] for r in records if r["status"] in ("FAIL", "XPASS") and not r["impl"].startswith(MUTANT_PREFIX)]
    mutants = {r["impl"] for r in records if r["impl"].startswith(MUTANT_PREFIX) and r["status"] != "SKIP"}
    caught = {r["impl"] for r in records if r["impl"].startswith(MUTANT_PREFIX) and r["status"] == "FAIL"}
    return bad + [f"{name}: caught by no check" for name in sorted(mutants - caught)]


def _write(args, records: list[dict]) -> None:
    if args.jsonl:
        with open(args.jsonl, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    for path, fmt in ((args.matrix, "md"), (args.csv, "csv")):
        if path:
            with open(path, "w") as f:
                f.write(matrix(records, fmt) + "\n")
    if args.plot and not plot(records, args.plot):
        print(f"--plot {args.plot}: not written (matplotlib not installed, or no timed case)", file=sys.stderr)
    counts = {s: sum(r["status"] == s for r in records) for s in ("PASS", "FAIL", "SKIP", "XFAIL", "XPASS")}
    print(", ".join(f"{n} {s}" for s, n in counts.items()))
    if args.mutants:
        table = caught_by([r for r in records if r["status"] != "SKIP"])
        print(table)
        if args.write_doc:
            with open(args.write_doc) as f:
                text = f.read()
            head, _, rest = text.partition(DOC_BEGIN)
            _, _, tail = rest.partition(DOC_END)
            with open(args.write_doc, "w") as f:
                f.write(f"{head}{DOC_BEGIN}\n{table}\n{DOC_END}{tail}")
