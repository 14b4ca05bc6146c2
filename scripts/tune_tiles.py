#!/usr/bin/env python
"""Record the grouped MLP kernel's tile table for this GPU class: what the autotuner picks for every launch the
layer makes, so that later processes launch those tiles and never autotune in a call (moe_ref.kernels.experts.tile_table).

    PYTHONPATH=. python3 scripts/tune_tiles.py --out results/tiles [--install] [--models kimi-k2/48 step3/48]

For each model share and precision (bf16; FP8 dispatch with FP8 experts), ``MegaMoE`` (one process, Triton experts,
cap ``--max-tokens``, launching path: no eager graphs) is called once at each T of 1, 2, 4, ... up to the cap and
at 3 * 2^i (every rows bucket of T * K, for any top-k), with ``MOE_REF_AUTOTUNE=1``: the autotuner chooses the tile of
each launch key (routed experts' two GEMMs, the shared experts' two), timing each candidate ``--rep`` ms. The choices
(``grouped_mlp.chosen_tiles``) become this GPU class's entries; the table keeps every other class it had.
Writes ``$OUT/tile_table.json`` (the whole table) and ``$OUT/tile_table.md``; ``--install`` also writes the package's
``moe_ref/kernels/experts/tile_table.json``. About 4 minutes per model and precision on one H100 (cold Triton cache).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

os.environ["MOE_REF_AUTOTUNE"] = "1"  # before any launch: the recorded tiles are the autotuner's

import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moe_ref import MegaMoE  # noqa: E402
from moe_ref.core.config import preset  # noqa: E402
from moe_ref.kernels.experts import grouped_mlp as gm  # noqa: E402
from moe_ref.kernels.experts import tile_table  # noqa: E402
from moe_ref.kernels.runtime.gpu_class import gpu_class_of  # noqa: E402

MODELS = ("kimi-k2/48", "step3/48", "deepseek-v3/32")  # preset / local experts (the per-rank share at EP 8, Step3's 48)


def build_layer(model: str, fp8: bool, cap: int) -> MegaMoE:
    name, experts = model.split("/")
    cfg = dataclasses.replace(preset(name), num_experts=int(experts), name=model)
    return MegaMoE(cfg, None, num_max_tokens_per_rank=cap, dtype=torch.bfloat16, device="cuda", seed=0,
                   experts_backend="triton", dispatch_fp8=fp8, eager_graph_max_tokens=0)


def token_counts(cap: int) -> list[int]:
    counts, t = set(), 1
    while t <= cap:
        counts.update({t, min(cap, 3 * t)})
        t *= 2
    return sorted(counts)


def record(model: str, fp8: bool, cap: int) -> float:
    moe = build_layer(model, fp8, cap)
    start = time.perf_counter()
    for tokens in token_counts(cap):
        moe(torch.randn(tokens, moe.cfg.hidden_size, device="cuda", dtype=torch.bfloat16))
        torch.cuda.synchronize()
    moe.destroy()
    del moe
    torch.cuda.empty_cache()
    return time.perf_counter() - start


def markdown(gpu_class: str, entries: list[dict], header: dict) -> str:
    lines = [f"Tile table of {gpu_class} ({header['date']}, `{header['command']}`, torch {header['torch']}, "
             f"triton {header['triton']})", "",
             "| n | k | experts | rows bucket | gated | fp8 | tma | persistent | tile (M, N, K, warps, stages[, group]) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for e in sorted(entries, key=lambda e: (e["n"], e["k"], e["experts"], tuple(e["flags"].values()), e["rows"])):
        f = e["flags"]
        lines.append(f"| {e['n']} | {e['k']} | {e['experts']} | {e['rows']} | {f['ACTIVATION']} | {f['FP8']} | "
                     f"{f['USE_TMA']} | {f['PERSISTENT']} | {tuple(e['tile'])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/tiles")
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    parser.add_argument("--rep", type=int, default=25, help="ms each candidate tile is timed (Triton's default: 100)")
    parser.add_argument("--install", action="store_true", help="also write the package's tile_table.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("tune_tiles.py records GPU tiles: run it on a GPU machine")
    # shorter timing per candidate than Triton's default (25 ms warm-up, 100 ms): the table holds ~100 keys
    gm.autotuned_kernel()._do_bench = lambda fn, quantiles: triton.testing.do_bench(
        fn, warmup=5, rep=args.rep, quantiles=quantiles)
    for model in args.models:
        for precision in args.precisions:
            seconds = record(model, precision == "fp8", args.max_tokens)
            print(f"{model} {precision}: {seconds:.0f} s, {len(gm.chosen_tiles())} keys so far", flush=True)
            write_table(args)  # after each: a run cut short keeps what it recorded


def write_table(args) -> None:
    """This GPU class's entries (what the autotuner chose so far) into the table, every other class kept."""
    gpu_class = gpu_class_of("cuda")
    entries = {}  # one entry per table key (the pool's bucket is not in it: the first choice of the key stays)
    for row in gm.chosen_tiles():
        entry = tile_table.TileEntry(n=row["n"], k=row["k"], experts=row["experts"], rows=row["rows"],
                                     flags=tile_table.matched_flags(row["flags"]), tile=tuple(row["tile"]))
        entries.setdefault((entry.n, entry.k, entry.experts, entry.rows, entry.flags), entry)
    header = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__,
              # an absolute --out names the machine's folders, not the command: written as the default
              "command": "python scripts/tune_tiles.py " + " ".join(
                  "results/tiles" if os.path.isabs(arg) else arg for arg in sys.argv[1:])}
    table = {"format": tile_table.TABLE_FORMAT, "about": "grouped MLP tiles per GPU class: scripts/tune_tiles.py",
             "gpu_classes": {}}
    if tile_table.TABLE_PATH.exists():
        table["gpu_classes"] = json.loads(tile_table.TABLE_PATH.read_text())["gpu_classes"]
    rows = [tile_table.entry_json(entry) for entry in entries.values()]
    table["gpu_classes"][gpu_class] = {"header": header, "entries": rows}
    text = json.dumps(table, indent=1) + "\n"
    tile_table.parse_table(text, "the table this run made")  # a table the package cannot read is never written
    os.makedirs(args.out, exist_ok=True)
    targets = [os.path.join(args.out, "tile_table.json")] + ([str(tile_table.TABLE_PATH)] if args.install else [])
    for target in targets:
        with open(target, "w") as f:
            f.write(text)
    with open(os.path.join(args.out, "tile_table.md"), "w") as f:
        f.write(markdown(gpu_class, rows, header))
    print(f"{gpu_class}: {len(rows)} entries -> {', '.join(targets)}", flush=True)

if __name__ == "__main__":
    main()
