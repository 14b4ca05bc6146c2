"""The long soak: N calls per transport at EP2 and EP4 on CPU, random T per rank (0 and > cap
included), every output vs the oracle, RSS flat, no leaked shared memory. Writes JSON + markdown.

    python scripts/soak.py [--calls 5000] [--world-sizes 2,4] [--out results/soak | --record]

Writes <out>.json and <out>.md (default results/soak.*, outside the tracked tree); --record writes the recorded run
docs/results/soak.* instead.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "dist"))

from launch import torchrun  # noqa: E402
from test_soak import SOAK_WORKER, check_soak  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000, help="calls per transport (symm and a2a) per rank")
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--out", default=None, help="path stem of the JSON and markdown (default results/soak)")
    parser.add_argument("--record", action="store_true", help="write docs/results/soak.* (the recorded run)")
    parser.add_argument("--timeout", type=float, default=7200)
    args = parser.parse_args()
    if args.record and args.out is not None:
        parser.error("--record writes docs/results/soak: give --out or --record, not both")
    args.out = str(REPO / "docs" / "results" / "soak") if args.record else args.out or "results/soak"
    rows = []
    for world in (int(w) for w in args.world_sizes.split(",")):
        print(f"soak: {world} ranks, {args.calls} calls per transport ...", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            launch = torchrun(world, ["--calls", str(args.calls), "--every", "250"], Path(tmp), args.timeout,
                              worker=Path(SOAK_WORKER))
        verdict = "PASS"
        try:
            check_soak(launch, world, 2 * args.calls)
        except AssertionError as err:
            verdict = f"FAIL: {err}"
        reports = launch.results
        rows.append(dict(world_size=world, calls_per_rank=2 * args.calls, seconds=round(launch.seconds, 1),
                         mismatches=sum(r["mismatches"] for r in reports.values()),
                         leaked_shm_files=len(launch.leftovers),
                         rss_mib={rank: [round(v / 2**20, 1) for v in r["rss"]] for rank, r in reports.items()},
                         verdict=verdict))
        print(f"soak: {world} ranks: {verdict} in {launch.seconds:.0f} s", file=sys.stderr, flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    Path(args.out + ".json").write_text(json.dumps(dict(date=stamp, rows=rows), indent=1))
    lines = [f"# Soak ({stamp}, CPU, gloo, tiny-kimi-k2, cap 8, overflow chunk, T per rank random in [0, 16])", "",
             "| ranks | calls per rank (symm + a2a) | seconds | mismatches vs oracle | leaked shm files | RSS MiB rank 0 (first, warm, last) | verdict |",
             "|---:|---:|---:|---:|---:|---|---|"]
    for row in rows:
        rss = row["rss_mib"].get(0, [])
        rss_text = f"{rss[0]}, {rss[min(2, len(rss) - 1)]}, {rss[-1]}" if rss else "-"
        lines.append(f"| {row['world_size']} | {row['calls_per_rank']} | {row['seconds']} | {row['mismatches']} | "
                     f"{row['leaked_shm_files']} | {rss_text} | {row['verdict']} |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(row["verdict"] == "PASS" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
