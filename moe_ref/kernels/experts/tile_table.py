"""The grouped MLP kernel's tiles per GPU class, recorded once so that a new token count never autotunes in a call.

    launch (n, k, experts, kernel flags, rows bucket) -> this GPU class's recorded tiles with the same kernel flags
    -> the nearest (same GEMM shape first, then rows per expert in log2) legal tile -> launched, no autotune

Why: autotuning is per rows bucket (a power of 2 of the routed rows) and costs seconds the first time a bucket is seen
(2.2-3.6 s at T = 64-300 on one H200, 2026-12-06: docs/results/first_calls_h200_2026-12-06.md), so a serving loop
whose T changes call to call paid it again and again during its first minutes. The table holds what the autotuner
chose for the shapes of the presets' per-rank shares over every rows bucket (``scripts/tune_tiles.py`` on the GPU,
``--install`` writes ``tile_table.json`` beside this module); a launch takes the recorded tile of its own key, else the
nearest one the kernel accepts (``grouped_mlp_tiles.config_problem``). A GPU class without a table of its own takes
the table of a recorded class of the same compute capability (``table_for``: an H200 takes an H100's; the same SMs,
instructions and shared memory, so every recorded tile compiles and runs there, where an autotune would cost seconds
per new token count); a launch whose flags no entry has, a capability with no table at all, and
``MOE_REF_AUTOTUNE=1`` autotune as before (``scripts/tune_tiles.py`` sets it).

Shape legend: n and k the GEMM's output and input features (GEMM1 n = F per half, k = Dx; GEMM2 n = Dx, k = F).
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

from moe_ref.core.errors import TileTableError

TABLE_PATH = Path(__file__).with_name("tile_table.json")
TABLE_FORMAT = 1
# The kernel flags a recorded tile is matched on (the others do not change which tiles compile or win:
# UPCAST is the interpreter's, BLOCK_E and N_ALIGNED follow the shape, SITU_LINEAR is a scalar epilogue)
MATCHED_FLAGS = ("ACTIVATION", "INTERLEAVED", "FP8", "QUANT_OUT", "USE_TMA", "PERSISTENT", "IEEE_FP32", "ADD")


@dataclass(frozen=True)
class TileEntry:
    """One recorded choice: the launch's GEMM shape, experts, matched flags and rows bucket, and the tile
    ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, GROUP_M])`` the autotuner chose for it."""

    n: int
    k: int
    experts: int
    rows: int
    flags: tuple  # MATCHED_FLAGS' values, in that order
    tile: tuple


def matched_flags(flags: dict) -> tuple:
    """The values of ``MATCHED_FLAGS`` in a launch's kernel flags (ints: ACTIVATION's code, the booleans as 0/1)."""
    return tuple(int(flags.get(name, 0)) for name in MATCHED_FLAGS)


def entry_json(entry: TileEntry) -> dict:
    """A ``TileEntry`` as the file stores it."""
    return {"n": entry.n, "k": entry.k, "experts": entry.experts, "rows": entry.rows,
            "flags": dict(zip(MATCHED_FLAGS, entry.flags)), "tile": list(entry.tile)}


def parse_table(text: str, where: str) -> dict[str, list[TileEntry]]:
    """``{gpu class: [TileEntry]}`` from the file's text; ``TileTableError`` (CFG036) naming ``where`` and the field."""
    def fail(field: str, why: str):
        raise TileTableError(f"{where}: {field}: {why}; restore it (git checkout moe_ref/kernels/experts/tile_table.json)"
                             " or record it again on the GPU (python scripts/tune_tiles.py --install)")

    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        fail("the file", f"not JSON ({exc})")
    if not isinstance(data, dict) or data.get("format") != TABLE_FORMAT:
        fail("format", f"must be {TABLE_FORMAT}")
    classes = data.get("gpu_classes")
    if not isinstance(classes, dict):
        fail("gpu_classes", "must map a GPU class ('9.0/NVIDIA H200') to its header and entries")
    table = {}
    for gpu_class, body in classes.items():
        entries = body.get("entries") if isinstance(body, dict) else None
        if not isinstance(entries, list) or not entries:
            fail(f"gpu_classes[{gpu_class!r}].entries", "must be a non-empty list")
        parsed = []
        for i, raw in enumerate(entries):
            try:
                tile = tuple(int(v) for v in raw["tile"])
                flags = tuple(int(raw["flags"][name]) for name in MATCHED_FLAGS)
                parsed.append(TileEntry(int(raw["n"]), int(raw["k"]), int(raw["experts"]), int(raw["rows"]), flags,
                                        tile))
            except (KeyError, TypeError, ValueError) as exc:
                fail(f"gpu_classes[{gpu_class!r}].entries[{i}]", f"needs n, k, experts, rows, flags {MATCHED_FLAGS} "
                     f"and tile (ints): {type(exc).__name__} {exc}")
            if len(tile) not in (5, 6) or min(tile) < 1 or min(parsed[-1].rows, parsed[-1].experts) < 1:
                fail(f"gpu_classes[{gpu_class!r}].entries[{i}]", "a tile is (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, "
                     "num_stages[, GROUP_M]) of positive ints, rows and experts >= 1")
        table[gpu_class] = parsed
    return table


@functools.lru_cache(maxsize=None)
def load_table(path: Path = TABLE_PATH) -> dict[str, list[TileEntry]]:
    """The table file's entries per GPU class (read once; {} when the file is absent)."""
    if not path.exists():
        return {}
    return parse_table(path.read_text(), str(path))


def table_for(gpu_class: str | None, path: Path = TABLE_PATH) -> tuple[str, list[TileEntry]] | None:
    """``(the class whose table applies, its entries)`` for ``gpu_class`` (``"9.0/NVIDIA H200"``): its own table,
    else the first recorded class (in name order) of the same compute capability; None when neither exists."""
    table = load_table(path)
    if gpu_class is None:
        return None
    if gpu_class in table:
        return gpu_class, table[gpu_class]
    capability = gpu_class.split("/", 1)[0]
    sibling = next((name for name in sorted(table) if name.split("/", 1)[0] == capability), None)
    return None if sibling is None else (sibling, table[sibling])


def header_of(gpu_class: str | None, path: Path = TABLE_PATH) -> tuple[str, dict, int] | None:
    """(the class whose table applies (``table_for``), its header: date, gpu, torch, triton, command; its number of
    entries), None when none applies (``moe-ref info`` prints it). A malformed file is ``TileTableError`` (CFG036)
    here too."""
    found = table_for(gpu_class, path)
    if found is None:
        return None
    source, entries = found
    return source, json.loads(path.read_text())["gpu_classes"][source].get("header", {}), len(entries)


def candidates(entries: list[TileEntry], *, n: int, k: int, num_experts: int, flags: dict,
               rows_bucket: int) -> list[tuple]:
    """The recorded tiles a launch may take, best first: entries with the launch's matched flags, those of its own
    GEMM shape (n, k) first, then of its experts count, then by the distance of their rows per expert to the
    launch's in log2 (ties: the smaller rows); each tile once. [] when no entry has the launch's flags.

    Example: a launch of n 2048, k 7168, 48 experts, 3000 rows bucket 4096 (85 rows per expert) over entries of
    that shape recorded at rows 2048 and 8192 takes 2048's tile first (42.7 and 171 rows per expert: equal log2
    distance, the smaller wins)."""
    want = matched_flags(flags)
    rows_per_expert = math.log2(max(rows_bucket, 1) / max(num_experts, 1))

    def distance(entry: TileEntry) -> tuple:
        return ((entry.n, entry.k) != (n, k), entry.experts != num_experts,
                abs(math.log2(entry.rows / entry.experts) - rows_per_expert), entry.rows)

    ordered = sorted((entry for entry in entries if entry.flags == want), key=distance)
    return list(dict.fromkeys(entry.tile for entry in ordered))
