#!/usr/bin/env python
"""Regenerate the table of ``experts_backend="auto"`` on this GPU: per call regime, the installed expert backends
fastest first (``moe_ref/experts/auto_table.json``, read by ``moe_ref.experts.auto``; needs CUDA except --dry-run).

    python scripts/tune_experts_auto.py [--out results/auto_table.json | --install] [--models kimi-k2,step3]
                                        [--rows 64,512,4096,32768] [--max-seconds 540] [--iters 20] [--dry-run]

What it times, per regime and routed-row count (points run in this order: fp8 then bf16, contiguous then masked, rows
ascending, every model shape at each point, so a run stopped by --max-seconds keeps whole points of the regimes
that matter most):
- model shapes: bench_experts' MODELS (`moe_ref.bench.cases`; per rank at EP 8: Kimi-K2 48 experts, D 7168,
  F 2048; Step3 48 experts, D 7168, F 5120) and its cases (`make_case`: routed rows spread uniformly at random over
  the experts);
- dtype: bf16, or fp8 = the weights quantized once (`FP8ExpertWeights`, gate/up interleaved in 128-row blocks as
  `FP8ExpertWeights.quantize` lays them out) and shared by every backend, as `AutoExperts` shares them, fed the FP8
  pool as dispatched;
- pool format: contiguous (segments 128-aligned: the pool a layer plans for auto with DeepGEMM) or masked (expert
  i's rows at i * M, M = the largest count rounded up to 128: `moe_ref.experts.deep_gemm.bench.masked_pool`);
- backends: triton and deep_gemm, plus grouped_mm for bf16 contiguous; each one installed here
  (`Experts.unavailable_reason`), built with the public `make_experts(name, ..., fp8_weights=...)` and called on
  the pool with the layout the layer's device-side dispatch hands it (`num_rows_hint` = the routed rows,
  `zero_unused_rows=False`: `moe_ref.bench.cases.api_layout`, `api_call`);
- each backend's first call (Triton's autotune, DeepGEMM's JIT compile) is untimed and checked against Triton's
  output on the routed rows (calc_diff within `moe_ref.testing.CALC_DIFF_TOLERANCES`); a backend that fails, or
  cannot be built, is left out of that regime with the reason; then `moe_ref.testing.bench(host_ahead=True)`
  times it (CUDA events, L2 flushed, median of --iters; the calls queued back to back as a model queues its layers,
  so the table orders the backends by GPU time: timed one by one on an idle GPU, this host's launch work, ~0.2-0.5
  ms per call, decided the rows at 4096 rows and below).

How the table is decided (`decide_order`, `bucket_bounds`): at each point the backends measured on every model
shape are ordered by the SUM over model shapes of their us, fastest first. A point's rows per expert is its routed
rows / the experts (the models must share their expert count); its bucket reaches halfway (the geometric mean) to
the next point's, and the last bucket of a dtype and pool format is unbounded.

Writes: the table to --out (default results/auto_table.json; --install: the package's table
moe_ref/experts/auto_table.json, the one ``moe_ref.experts.auto`` reads) with this GPU class's entry replaced, the
other classes kept from --out, or from the package's table when --out does not exist yet (checked by
`moe_ref.experts.auto.validate_table` before writing), a markdown summary beside it (.md), and a progress line per
measurement with the elapsed seconds. It stops cleanly once --max-seconds have passed (checked before every
measurement), writing the points it finished (the header says which were left out). One H200 with DeepGEMM:

    python scripts/tune_experts_auto.py --out results/auto_table.json   # then copy it to moe_ref/experts/
    python scripts/tune_experts_auto.py --install                       # or write the package's table directly
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moe_ref.bench.cases import (ALIGN, MODELS, ROWS, Pool, api_call, api_layout, case_pool, make_case,  # noqa: E402
                                 make_weights)
from moe_ref.core.errors import MoERefError  # noqa: E402
from moe_ref.experts import FP8ExpertWeights, experts_class, make_experts  # noqa: E402
from moe_ref.experts.auto import TABLE_FORMAT, TABLE_PATH, format_regimes, gpu_class_name, validate_table  # noqa: E402
from moe_ref.kernels.ep.ep_regions import POOL_FORMATS  # noqa: E402  (contiguous, masked)
from moe_ref.testing import CALC_DIFF_TOLERANCES, bench, calc_diff  # noqa: E402

DTYPES = ("fp8", "bf16")  # fp8 first: its prefill regimes are the ones DeepGEMM may win
# The backends timed per (dtype, pool format); triton first: every other backend is checked against it.
CANDIDATES = {("fp8", "contiguous"): ("triton", "deep_gemm"), ("fp8", "masked"): ("triton", "deep_gemm"),
              ("bf16", "contiguous"): ("triton", "deep_gemm", "grouped_mm"),
              ("bf16", "masked"): ("triton", "deep_gemm")}
ABOUT = ("experts_backend='auto': per GPU class (compute capability), the expert backends fastest first per call "
         "regime (dtype, pool format, rows per expert), measured by scripts/tune_experts_auto.py on that GPU; a GPU "
         "class not listed runs Triton")
DEFAULT_OUT = "results/auto_table.json"  # outside the tracked tree: --install writes the package's table
TOLERANCE = {"bf16": CALC_DIFF_TOLERANCES[torch.bfloat16], "fp8": CALC_DIFF_TOLERANCES[torch.float8_e4m3fn]}


# ------------------------------------------------------------------------------------------------
# the plan and the decisions (no CUDA)
# ------------------------------------------------------------------------------------------------
def plan_points(rows: list[int]) -> list[tuple[str, str, int]]:
    """``(dtype, pool format, routed rows)`` in the order they are measured."""
    return [(dtype, pool_format, num_rows) for dtype in DTYPES for pool_format in POOL_FORMATS
            for num_rows in sorted(rows)]


def num_experts_of(models: list[str]) -> int:
    """The models' shared expert count (a point's rows per expert must mean one thing for every model)."""
    counts = {MODELS[model][0] for model in models}
    if len(counts) != 1:
        raise SystemExit(f"--models {','.join(models)} have different expert counts {sorted(counts)}: time models "
                         f"with one expert count per run")
    return counts.pop()


def bucket_bounds(rows_per_expert: list[float]) -> list[float | None]:
    """Each measured point's bucket upper bound (rows per expert, inclusive): halfway to the next point on a log
    scale (the geometric mean), None (unbounded) for the last.

    Example: [1.333, 10.67, 85.33, 682.7] -> [3.77, 30.17, 241.4, None]."""
    points = sorted(rows_per_expert)
    return [round(math.sqrt(a * b), 2) for a, b in zip(points, points[1:])] + [None]


def decide_order(us_by_model: dict[str, dict[str, float]]) -> tuple[list[str], dict[str, float]]:
    """(backends fastest first, their summed us): the backends measured on every model shape, by the sum of their us
    over the shapes (ties keep the candidates' order)."""
    common = [name for name in next(iter(us_by_model.values()))
              if all(name in times for times in us_by_model.values())]
    totals = {name: sum(times[name] for times in us_by_model.values()) for name in common}
    return sorted(common, key=lambda name: totals[name]), totals


def build_regimes(measured: dict[tuple[str, str, int], dict], num_experts: int) -> list[dict]:
    """The table's regimes from the finished points (``measured[(dtype, pool, rows)]`` = ``{"us": {model: {backend:
    us}}, "left_out": {backend: why}}``): per dtype and pool format, one regime per point, bucketed."""
    regimes = []
    for dtype in DTYPES:
        for pool_format in POOL_FORMATS:
            rows = sorted(r for d, p, r in measured if (d, p) == (dtype, pool_format))
            for num_rows, bound in zip(rows, bucket_bounds([r / num_experts for r in rows])):
                point = measured[(dtype, pool_format, num_rows)]
                order, totals = decide_order(point["us"])
                measured_here = {"routed_rows": num_rows, "rows_per_expert": round(num_rows / num_experts, 3),
                                 "us": point["us"], "total_us": {n: round(t, 2) for n, t in totals.items()},
                                 "left_out": point["left_out"]}
                regimes.append({"dtype": dtype, "pool_format": pool_format, "max_rows_per_expert": bound,
                                "order": order, "measured": measured_here})
    return regimes


def dry_run(models: list[str], rows: list[int], out: str) -> int:
    num_experts = num_experts_of(models)
    points = plan_points(rows)
    print(f"plan: {len(points)} points x {len(models)} model shapes, written to {out} (and .md beside it)")
    for model in models:
        e, hidden, inter, topk = MODELS[model]
        print(f"  model {model}: {e} experts, D {hidden}, F {inter}, top-{topk}")
    bounds = bucket_bounds([r / num_experts for r in rows])
    for num_rows, bound in zip(sorted(rows), bounds):
        print(f"  rows {num_rows}: {num_rows / num_experts:.2f} rows per expert, bucket <= "
              f"{'unbounded' if bound is None else bound}")
    for (dtype, pool_format), names in CANDIDATES.items():
        print(f"  {dtype} {pool_format}: {', '.join(names)} (those installed on the GPU)")
    measurements = sum(len(CANDIDATES[(d, p)]) for d, p, _ in points) * len(models)
    print(f"  at most {measurements} measurements; no CUDA used (dry run)")
    return 0


# ------------------------------------------------------------------------------------------------
# measuring (CUDA)
# ------------------------------------------------------------------------------------------------
def masked_pool_of(case) -> Pool:
    """The case's rows as a masked pool (expert i at rows i * M, M = the largest count rounded up to 128), bf16 and
    the FP8 pool as dispatched (``moe_ref.experts.deep_gemm.bench.masked_pool`` copies the segments)."""
    from moe_ref.experts.deep_gemm.bench import masked_pool

    def flat(x_PDx):
        pool = masked_pool(x_PDx, case.row_start_e, case.num_rows_e)
        num_experts, max_rows, width = pool.x_eMDx.shape
        return pool.x_eMDx.view(num_experts * max_rows, width), max_rows

    x_PDx, max_rows = flat(case.x_PDx)
    row_start_e = torch.arange(len(case.counts), device=x_PDx.device, dtype=torch.int64) * max_rows
    pool = Pool(ALIGN, x_PDx, row_start_e, case.num_rows_e, masked_rows=max_rows)
    if case.fp8 is not None:
        pool.x_fp8, pool.x_scale = flat(case.fp8["x"])[0], flat(case.fp8["x_scale"])[0]
    return pool


class Tuner:
    """Measures the points of one run, holding each model's weights (bf16 and the shared FP8 copy) and each backend
    built over them once (``device``: CUDA; the CPU tests run its loop with stand-in backends)."""

    def __init__(self, models: list[str], seed: int, iters: int, max_seconds: float, device: str = "cuda"):
        self.models, self.seed, self.iters, self.max_seconds, self.device = models, seed, iters, max_seconds, device
        self.start = time.time()
        self.weights, self.experts, self.build_errors = {}, {}, {}
        for model in models:
            torch.manual_seed(seed)
            num_experts, hidden, inter, _ = MODELS[model]
            self.weights[model] = make_weights(num_experts, hidden, inter, True, device)
        self.log(f"weights of {', '.join(models)} ready")

    def elapsed(self) -> float:
        return time.time() - self.start

    def out_of_time(self) -> bool:
        return self.elapsed() > self.max_seconds

    def log(self, text: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {text}", flush=True)

    def backend(self, model: str, dtype: str, name: str):
        """The backend ``name`` over the model's weights (built once), or None with the reason kept."""
        key = (model, dtype, name)
        if key not in self.experts and key not in self.build_errors:
            gate_up, down, *fp8 = self.weights[model]
            try:
                fp8_weights = FP8ExpertWeights(*fp8).interleaved() if dtype == "fp8" else None
                self.experts[key] = make_experts(name, gate_up, down, "silu", fp8_weights=fp8_weights)
            except MoERefError as err:
                self.build_errors[key] = f"cannot be built: {err}"
        return self.experts.get(key)

    def measure_point(self, dtype: str, pool_format: str, num_rows: int) -> dict | None:
        """``{"us": {model: {backend: us}}, "left_out": {backend: why}}`` at one point; None when time ran out."""
        names, left_out = [], {}
        for name in CANDIDATES[(dtype, pool_format)]:
            reason = experts_class(name, self.device).unavailable_reason()
            if reason is None:
                names.append(name)
            else:
                left_out[name] = f"not installed here: {reason}"
        us = {}
        for model in self.models:
            case = make_case(model, num_rows, self.weights[model], self.seed, True, self.device)
            pool = case_pool(case, ALIGN) if pool_format == "contiguous" else masked_pool_of(case)
            layout = api_layout(pool, num_rows)
            valid_P = (layout.row_expert_P() >= 0).to(pool.x_PDx.device)
            us[model], reference, reference_name = {}, None, None
            for name in names:
                if self.out_of_time():
                    return None
                experts = self.backend(model, dtype, name)
                if experts is None:
                    left_out[name] = self.build_errors[(model, dtype, name)]
                    continue
                fn = api_call(experts, pool, layout, dtype == "fp8")
                first = time.time()
                try:
                    out = fn()[valid_P].float()  # compile, autotune, JIT: not timed (the indexing waits for it)
                except Exception as err:  # noqa: BLE001 - a backend failing here is left out of the regime, not the run
                    left_out[name] = f"{model}: the first call failed: {type(err).__name__}: {str(err)[:300]}"
                    continue
                first_s = time.time() - first
                if reference is None:  # triton's, unless it failed
                    reference, reference_name = out, name
                diff = calc_diff(out, reference)
                if not diff < TOLERANCE[dtype]:
                    left_out[name] = f"{model}: calc_diff {diff:.2e} vs {reference_name} (limit {TOLERANCE[dtype]:.0e})"
                    continue
                us[model][name] = round(bench(fn, iters=self.iters, host_ahead=True), 2)
                self.log(f"{dtype} {pool_format:10s} rows {num_rows:6d} {model:8s} {name:10s} {us[model][name]:10.1f} "
                         f"us (first call {first_s:.1f} s, calc_diff vs {reference_name} {diff:.1e})")
            del case, pool
            if self.device == "cuda":
                torch.cuda.empty_cache()
        return {"us": us, "left_out": left_out}


def run(models: list[str], rows: list[int], seed: int, iters: int, max_seconds: float,
        device: str = "cuda") -> tuple[dict, list[str]]:
    """(measured points, notes): every finished point; the notes name the points left out (time ran out, or no
    backend ran on every model shape)."""
    tuner = Tuner(models, seed, iters, max_seconds, device)
    measured, notes = {}, []
    for point in plan_points(rows):
        result = None if tuner.out_of_time() else tuner.measure_point(*point)
        if result is None:
            notes.append(f"{point[0]} {point[1]} rows {point[2]}: not measured (--max-seconds {max_seconds:g} reached)")
        elif not decide_order(result["us"])[0]:
            notes.append(f"{point[0]} {point[1]} rows {point[2]}: no backend ran on every model shape "
                         f"({result['left_out']})")
        else:
            measured[point] = result
            continue
        tuner.log(notes[-1])
    return measured, notes


def header(argv: list[str], notes: list[str], seconds: float) -> dict:
    """This run: date, GPU, compute capability, versions and the command."""
    import triton

    from moe_ref.experts.deep_gemm.probe import deep_gemm_status

    status = deep_gemm_status()
    major, minor = torch.cuda.get_device_capability()
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "gpu": torch.cuda.get_device_name(), "compute_capability": f"{major}.{minor}", "torch": torch.__version__,
            "triton": triton.__version__,
            "deep_gemm": status.version if status.available else f"not usable: {status.reason[:160]}",
            "command": " ".join(["python", "scripts/tune_experts_auto.py", *argv]), "seconds": round(seconds),
            "complete": not notes, "notes": notes}


def write_table(entry: dict, out: str) -> str:
    """Put this GPU class's ``entry`` into the table (the other classes kept: from ``out`` if it exists, else from the
    package's table), check it, write it to ``out`` with the markdown summary beside it; returns the markdown's path."""
    base = out if os.path.exists(out) else str(TABLE_PATH)
    with open(base) as f:
        existing = json.load(f)
    validate_table(existing, base)  # an invalid file stops the run here, before anything is written
    table = {"format": TABLE_FORMAT, "about": ABOUT, "gpu_classes": dict(existing["gpu_classes"])}
    gpu_class = gpu_class_name(entry["header"]["compute_capability"], entry["header"]["gpu"])
    table["gpu_classes"][gpu_class] = entry
    checked = validate_table(table, out)  # never write a table moe_ref would refuse
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".tmp", "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    os.replace(out + ".tmp", out)
    markdown_path = os.path.splitext(out)[0] + ".md"
    with open(markdown_path, "w") as f:
        f.write(markdown(checked.gpu_classes[gpu_class]))
    return markdown_path


def markdown(entry) -> str:
    h = entry.header
    lines = [f"# experts_backend='auto' table, GPU class {h['compute_capability']} ({h['gpu']})", "",
             f"Measured {h['date']} by `{h['command']}` in {h.get('seconds', '?')} s: torch {h['torch']}, "
             f"triton {h['triton']}, deep_gemm {h['deep_gemm']}. Per regime the backends are ordered by the sum over "
             "model shapes of their us (bench_experts' cases, the layer's layout with its rows hint, L2 flushed).", ""]
    lines += format_regimes(entry)
    lines += [""] + [f"- {note}" for note in h.get("notes", [])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="the table file (default results/auto_table.json)")
    parser.add_argument("--install", action="store_true",
                        help="write the package's table (moe_ref/experts/auto_table.json) instead of --out")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma list of {sorted(MODELS)}")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma list of routed row counts")
    parser.add_argument("--max-seconds", type=float, default=540.0,
                        help="stop starting measurements after this many seconds and write what was finished")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per measurement (the median is kept)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dry-run", action="store_true", help="print the plan; needs no GPU")
    args = parser.parse_args(argv)
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {unknown}; known: {sorted(MODELS)}")
    rows = sorted({int(r) for r in args.rows.split(",")})
    if args.install and args.out is not None:
        parser.error("--install writes the package's table: give --out or --install, not both")
    out = str(TABLE_PATH) if args.install else args.out or DEFAULT_OUT
    if args.dry_run:
        return dry_run(models, rows, out)
    if not torch.cuda.is_available():
        print("tune_experts_auto needs a CUDA GPU (--dry-run prints the plan without one)", file=sys.stderr)
        return 2
    num_experts = num_experts_of(models)
    start = time.time()
    measured, notes = run(models, rows, args.seed, args.iters, args.max_seconds)
    entry = {"header": header(argv, notes, time.time() - start), "regimes": build_regimes(measured, num_experts)}
    markdown_path = write_table(entry, out)
    print(open(markdown_path).read())
    print(f"wrote {out} and {markdown_path} in {time.time() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
