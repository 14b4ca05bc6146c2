"""``moe-ref bench --auto-table``: ``experts_backend="auto"``'s table for this GPU class, measured by the harness's
speed mode: moe_ref's expert backends alone on a pool (``pool_experts``: ``moe_ref/experts/<backend>[+masked]``),
each case's checks passed (the float64 oracle, re-run bits, rotated rows, a row alone) before it is timed.

    moe-ref bench --auto-table results/auto_table.json [--install] [--max-seconds 480]

What it times, in this order (so a run stopped by ``--max-seconds`` keeps whole points of the regimes that matter
most): fp8 then bf16, contiguous then masked pools, routed rows ascending (``ROWS``), every shape at each point
(``SHAPES``: Kimi-K2's 48 experts per rank at EP 8 and Step3's 48 at EP 1, D 7168, F 2048 / 5120), every candidate
backend installed here (``CANDIDATES``). A shape's tokens at a point are the point's rows over its top-k, rounded,
routed as the matrix's ``base`` (K distinct experts per token, uniform): its routed rows are within K / 2 of the
point's. fp8 = the ``fp8_block`` recipe: e4m3 weights with 128 x 128 block scales and the pool as FP8 dispatch sends
it. A backend that fails a check, or cannot run, is left out of that regime with the reason.

How the table is decided (``decide_order``, ``bucket_bounds``): at each point the backends measured on every shape are
ordered by the SUM over shapes of their us, fastest first; a point's rows per expert is its rows over the experts
(the shapes share their expert count); its bucket reaches halfway (the geometric mean) to the next point's, and the
last bucket of a dtype and pool format is unbounded.

Writes the table (this GPU class's entry replaced, the other classes kept from the file, or from the package's table
when the file does not exist yet; checked by ``moe_ref.experts.auto.validate_table`` before writing) and a markdown
summary beside it (``.md``). ``--install`` writes the package's table (``moe_ref/experts/auto_table.json``).
"""
from __future__ import annotations

import datetime
import json
import math
import os
import sys
import time

from moe_ref.conformance.adapters.moe_ref_pool import pool_name
from moe_ref.conformance.scenarios import shape_named, speed_case

DTYPES = ("fp8", "bf16")  # fp8 first: its prefill regimes are the ones DeepGEMM may win
POOL_FORMATS = ("contiguous", "masked")
QUANT_OF = {"fp8": "fp8_block", "bf16": "none"}
# the backends timed per (dtype, pool format)
CANDIDATES = {("fp8", "contiguous"): ("triton", "deep_gemm"), ("fp8", "masked"): ("triton", "deep_gemm"),
              ("bf16", "contiguous"): ("triton", "deep_gemm", "grouped_mm"),
              ("bf16", "masked"): ("triton", "deep_gemm")}
SHAPES = ("kimi-k2", "step3@ep1")
ROWS = (64, 512, 4096, 32768)
ABOUT = ("experts_backend='auto': per GPU class (compute capability), the expert backends fastest first per call "
         "regime (dtype, pool format, rows per expert), measured by `moe-ref bench --auto-table` on that GPU; a GPU "
         "class not listed runs Triton")


def tokens_for(rows: int, topk: int) -> int:
    """Tokens whose K slots give about ``rows`` routed rows."""
    return max(1, round(rows / topk))


def plan(shapes=SHAPES, rows=ROWS, candidates=CANDIDATES, dtypes=DTYPES, seed: int = 0
         ) -> list[tuple[tuple[str, str, int], str, str, str]]:
    """``[((dtype, pool format, rows), shape, backend, job's case id)]`` in the order they are measured."""
    points = []
    for dtype in dtypes:
        for pool_format in POOL_FORMATS:
            for num_rows in sorted(rows):
                for shape in shapes:
                    topk = shape_named(shape).topk
                    case_id = speed_case(shape, "bf16", QUANT_OF[dtype], tokens_for(num_rows, topk), seed).id
                    for backend in candidates.get((dtype, pool_format), ()):
                        points.append(((dtype, pool_format, num_rows), shape, backend, case_id))
    return points


def bucket_bounds(rows_per_expert: list[float]) -> list[float | None]:
    """Each measured point's bucket upper bound (rows per expert, inclusive): halfway to the next point on a log
    scale (the geometric mean), None (unbounded) for the last.

    Example: [1.333, 10.67, 85.33, 682.7] -> [3.77, 30.17, 241.4, None]."""
    points = sorted(rows_per_expert)
    return [round(math.sqrt(a * b), 2) for a, b in zip(points, points[1:])] + [None]


def decide_order(us_by_shape: dict[str, dict[str, float]]) -> tuple[list[str], dict[str, float]]:
    """(backends fastest first, their summed us): the backends measured on every shape, by the sum of their us over
    the shapes (ties keep the candidates' order)."""
    common = [name for name in next(iter(us_by_shape.values()), {})
              if all(name in times for times in us_by_shape.values())]
    totals = {name: sum(times[name] for times in us_by_shape.values()) for name in common}
    return sorted(common, key=lambda name: totals[name]), totals


def build_regimes(measured: dict[tuple[str, str, int], dict], num_experts: int) -> list[dict]:
    """The table's regimes from the finished points (``measured[(dtype, pool, rows)]`` = ``{"us": {shape: {backend:
    us}}, "left_out": {backend: why}}``): per dtype and pool format, one regime per point, bucketed."""
    regimes = []
    for dtype in DTYPES:
        for pool_format in POOL_FORMATS:
            rows = sorted(r for d, p, r in measured if (d, p) == (dtype, pool_format))
            for num_rows, bound in zip(rows, bucket_bounds([r / num_experts for r in rows])):
                point = measured[(dtype, pool_format, num_rows)]
                order, totals = decide_order(point["us"])
                regimes.append({"dtype": dtype, "pool_format": pool_format, "max_rows_per_expert": bound,
                                "order": order,
                                "measured": {"routed_rows": num_rows, "rows_per_expert": round(num_rows / num_experts, 3),
                                             "us": point["us"], "total_us": {n: round(t, 2) for n, t in totals.items()},
                                             "left_out": point["left_out"]}})
    return regimes


def measure(points, device: str, deadline_s: float, max_seconds: float, seed: int = 0, log=print,
            impl_of=pool_name) -> tuple[dict[tuple[str, str, int], dict], list[str]]:
    """(finished points, notes): each point's us per shape and backend from the harness's speed cases (checked
    first), backends not installed here or failing a check in ``left_out``; a point no backend finished on every
    shape, or not reached within ``max_seconds``, is named in the notes instead. ``impl_of(backend, pool format)``:
    the implementation timed for a backend (``pool_name``)."""
    from moe_ref.conformance.registry import resolve
    from moe_ref.conformance.report import record
    from moe_ref.conformance.runner import skip_reason
    from moe_ref.conformance.scenarios import case_by_id
    from moe_ref.conformance.spawn import run_jobs

    start = time.monotonic()
    results = {point: {"us": {}, "left_out": {}} for point, *_ in points}
    jobs, where = [], {}
    for point, shape, backend, case_id in points:
        impl = resolve(impl_of(backend, point[1]))
        why = skip_reason(impl, case_by_id(case_id, seed), 1, device)
        if why is not None:
            results[point]["left_out"][backend] = why
            continue
        jobs.append((impl.spec, case_id))
        where.setdefault(jobs[-1], []).append((point, shape, backend))

    def report(job, merged) -> None:
        for point, shape, backend in where[job]:
            if merged["status"] == "PASS" and merged["us"]:
                results[point]["us"].setdefault(shape, {})[backend] = round(merged["us"], 2)
                shown = f"{merged['us']:10.1f} us"
            else:
                impl = resolve(job[0])
                rec = record(impl, case_by_id(job[1], seed), 1, device, merged, None)
                results[point]["left_out"][backend] = f"{shape}: {merged['status']}: {rec['reason'][:300]}"
                shown = f"{merged['status']}: {rec['reason'][:120]}"
            log(f"[{time.monotonic() - start:6.1f} s] {point[0]} {point[1]:10s} rows {point[2]:6d} {shape:10s} "
                f"{backend:10s} {shown}")

    done = run_jobs(jobs, 1, device, deadline_s, seed, timer="events", on_done=report,
                    stop_at=start + max_seconds)
    measured, notes = {}, []
    for point in dict.fromkeys(p for p, *_ in points):
        missing = [job for job in jobs if job not in done and point in (w[0] for w in where[job])]
        if missing:
            notes.append(f"{point[0]} {point[1]} rows {point[2]}: not measured (--max-seconds {max_seconds:g} reached)")
        elif not decide_order(results[point]["us"])[0] or len(results[point]["us"]) < len(
                {shape for p, shape, *_ in points if p == point}):
            notes.append(f"{point[0]} {point[1]} rows {point[2]}: no backend passed on every shape "
                         f"({results[point]['left_out']})")
        else:
            measured[point] = results[point]
    return measured, notes


def header(command: str, notes: list[str], seconds: float) -> dict:
    """This run: date, GPU, compute capability, versions and the command (CUDA)."""
    import torch
    import triton

    from moe_ref.experts.deep_gemm.probe import deep_gemm_status

    status = deep_gemm_status()
    major, minor = torch.cuda.get_device_capability()
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "gpu": torch.cuda.get_device_name(), "compute_capability": f"{major}.{minor}", "torch": torch.__version__,
            "triton": triton.__version__,
            "deep_gemm": status.version if status.available else f"not usable: {status.reason[:160]}",
            "command": command, "seconds": round(seconds), "complete": not notes, "notes": notes}


def write_table(entry: dict, out: str) -> str:
    """Put this GPU class's ``entry`` into the table (the other classes kept: from ``out`` if it exists, else from the
    package's table), check it, write it to ``out`` with the markdown summary beside it; returns the markdown's path."""
    from moe_ref.experts.auto import TABLE_FORMAT, TABLE_PATH, gpu_class_name, validate_table

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
    from moe_ref.experts.auto import format_regimes

    h = entry.header
    lines = [f"# experts_backend='auto' table, GPU class {h['compute_capability']} ({h['gpu']})", "",
             f"Measured {h['date']} by `{h['command']}` in {h.get('seconds', '?')} s: torch {h['torch']}, "
             f"triton {h['triton']}, deep_gemm {h['deep_gemm']}. Per regime the backends are ordered by the sum over "
             "shapes of their us (the harness's speed cases on a pool: checked, then timed with L2 flushed).", ""]
    lines += format_regimes(entry)
    lines += [""] + [f"- {note}" for note in h.get("notes", [])]
    return "\n".join(lines) + "\n"


def run(args) -> int:
    """``moe-ref bench --auto-table OUT``: measure, decide, write (CUDA; else ``DeviceUnavailableError``, ENV006)."""
    import torch

    from moe_ref.core.errors import DeviceUnavailableError
    from moe_ref.experts.auto import TABLE_PATH

    if not torch.cuda.is_available():
        raise DeviceUnavailableError("moe-ref bench --auto-table measures the table of this machine's GPU class, and "
                                     "torch sees no CUDA device here: run it on the GPU whose table you want")
    out = str(TABLE_PATH) if args.install else args.auto_table
    start = time.monotonic()
    points = plan(seed=args.seed)
    print(f"auto table: {len(points)} measurements ({len(SHAPES)} shapes, rows {', '.join(map(str, ROWS))}), "
          f"at most {args.max_seconds:g} s, into {out}", flush=True)
    measured, notes = measure(points, "cuda", args.deadline, args.max_seconds, args.seed,
                              log=lambda line: print(line, flush=True))
    num_experts = shape_named(SHAPES[0]).experts_per_rank
    command = " ".join(["moe-ref", *sys.argv[1:]])
    entry = {"header": header(command, notes, time.monotonic() - start), "regimes": build_regimes(measured, num_experts)}
    markdown_path = write_table(entry, out)
    with open(markdown_path) as f:
        print(f.read())
    print(f"wrote {out} and {markdown_path} in {time.monotonic() - start:.0f} s", flush=True)
    return 0
