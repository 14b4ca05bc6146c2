"""What scripts/bench_experts.py reports of a timed row: what it times in words (`row_label`), its metrics against
the roofline of this GPU's measured anchors (`case_metrics`: us, TFLOP/s, weight GB/s, roofline fraction, bound), the
JSON row (`make_row`), the versions that ran (`versions`), the markdown table (`markdown`) and the plot (`plot`).
"""
from __future__ import annotations

import os

from moe_ref.bench.cases import Case
from moe_ref.bench.timing import roofline_s

def row_label(path: str, peer_labels: dict | None = None, search: str = "none") -> str:
    """What a row times, in words, for the JSON (`label`) and the markdown."""
    dtype = path.rsplit("_", 1)[-1] if path.endswith(("bf16", "fp8")) else ""
    if path.startswith("graph_"):
        return row_label(path[len("graph_"):], peer_labels, search) + ", captured in a CUDA graph and replayed"
    if path.startswith("api_"):
        backend = path[len("api_"):].removesuffix("_nohint").rsplit("_", 1)[0]  # api_deep_gemm_fp8 -> deep_gemm
        hint = "without the rows hint (host sync)" if path.endswith("_nohint") else "rows hint"
        return f"moe_ref make_experts('{backend}') on its pool (segment_alignment), {hint}"
    if path.startswith("peer_"):
        engine = path.split("_")[1]
        label = (peer_labels or {}).get(engine, engine)
        if "_tuned_" in path:
            return f"{label} fused_moe_kernel, tuned ({search} search of its tuner's space, this shape)"
        return f"{label} fused_moe_kernel, as shipped (tuned file or default rule)"
    if path.startswith("deep_gemm_"):
        layout = "masked" if "_masked" in path else "contiguous"
        if "_kernels_" in path:
            return f"DeepGEMM {layout}: kernels only (2 grouped GEMMs, pre-quantized inputs, profiler kernel time)"
        return f"DeepGEMM {layout}: whole MLP (GEMM1 + act{' + FP8 quant of h' if dtype == 'fp8' else ''} + GEMM2)"
    return {"triton_bf16": "moe_ref kernels.grouped_mlp direct", "triton_fp8": "moe_ref kernels.grouped_mlp direct",
            "grouped_mm_bf16": "torch grouped_mm + SiLU-and-mul (packed rows)",
            "loop_bf16": "torch per-expert loop (packed rows)"}.get(path, path)


def case_metrics(case: Case, path: str, us: float, anchors: dict) -> dict:
    """A row's metrics at `us` per call: TFLOP/s, GB/s of the weights of the experts that got rows (1 byte each for an
    FP8 row, 2 else), the fraction of the roofline (max of bytes / HBM bandwidth and FLOPs / peak, from `anchors`;
    FP8 peak = 2x the measured bf16 one, an estimate) and which bound it is."""
    hidden, inter = case.gate_up.shape[2], case.down.shape[2]
    active = sum(1 for c in case.counts if c > 0)
    fp8 = "fp8" in path.split("_")  # api_triton_fp8, api_auto_fp8_nohint, graph_api_auto_fp8, peer_vllm_tuned_fp8
    weight_bytes = active * 3 * inter * hidden * (1 if fp8 else 2)
    act_bytes = case.num_rows * (hidden * 2 + inter * 2 * 2 + hidden * 2)  # x, h (w + r), y
    flops = 6 * case.num_rows * hidden * inter
    least_s, bound = roofline_s(weight_bytes + act_bytes, flops, anchors, fp8)
    return {"us": us, "tflops": flops / (us * 1e-6) / 1e12, "weight_gbps": weight_bytes / (us * 1e-6) / 1e9,
            "roofline_fraction": least_s / (us * 1e-6), "bound": bound}


def markdown(results: dict) -> str:
    """The run's markdown: versions, anchors, one table line per row, then the peers' files, configs and notes."""
    anchors = results["anchors"]
    lines = [f"# bench_experts ({results['env']['gpu']}, torch {results['env']['torch']}, "
             f"triton {results['env']['triton']})", "",
             f"HBM copy: {anchors['hbm_bytes_per_s'] / 1e12:.2f} TB/s; bf16 matmul 8192^3: "
             f"{anchors['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s", "",
             versions_line(results["env"]), "",
             f"Peer search: {results['env'].get('peer_search', 'none')} (rows `peer_*_tuned_*` run the fastest config of "
             "the engine's own tuner space found for that exact shape; rows `peer_<engine>_<dtype>` run it as shipped; "
             "search time is not in any row). DeepGEMM rows say \"kernels only\" (profiler kernel time of its two "
             "grouped GEMMs on pre-quantized inputs) or \"whole MLP\".", "",
             "| model | rows | path | what | us | TFLOP/s | weight GB/s | x vs grouped_mm | roofline frac | bound |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---|"]
    for row in results["cases"]:
        speedup = f"{row['x_vs_grouped_mm']:.2f}" if row.get("x_vs_grouped_mm") else "-"
        what = row.get("label", "") + (f" `{short_config(row['config'])}`" if row.get("config") else "")
        lines.append(f"| {row['model']} | {row['num_rows']} | {row['path']} | {what} | {row['us']:.1f} | "
                     f"{row['tflops']:.1f} | {row['weight_gbps']:.0f} | {speedup} | {row['roofline_fraction']:.2f} | "
                     f"{row['bound']} |")
    peer = results.get("peer")
    if peer:
        lines += [""] + [f"{note}." for note in peer["loaded"]]
        if peer.get("configs"):
            lines.append("A peer's timing excludes its align step (routing inputs built once outside the timed "
                         "region), as ours excludes the dispatch. Their tile configs:")
            rows_of = {}  # one line per (model, path, config) with the row counts that use it
            for c in peer["configs"]:
                key = (c["model"], c["path"], c["source"], str(c["up"]), str(c["down"]))
                rows_of.setdefault(key, []).append(str(c["num_rows"]))
            lines += [f"- {model} {path} rows {'/'.join(rows)}: {source}: up {up}, down {down}"
                      for (model, path, source, up, down), rows in rows_of.items()]
        lines += [f"- {note}" for note in peer.get("notes", [])]
    return "\n".join(lines) + "\n"


def short_config(config: dict) -> str:
    """`BM/BN/BK/GM w s` of a peer row's GEMM1 config (GEMM2's too when it differs)."""
    def one(c):
        return (f"{c.get('BLOCK_SIZE_M')}/{c.get('BLOCK_SIZE_N')}/{c.get('BLOCK_SIZE_K')}/{c.get('GROUP_SIZE_M')} "
                f"w{c.get('num_warps')} s{c.get('num_stages')}")

    up, down = one(config["up"]), one(config["down"])
    return up if up == down else f"up {up}, down {down}"


def versions_line(env: dict) -> str:
    """One line naming torch, triton, deep_gemm and the peer files of the run's env."""
    peers = ", ".join(env.get("peer_files", [])) or "none"
    return (f"Versions: torch {env.get('torch')}, triton {env.get('triton')}, deep_gemm {env.get('deep_gemm')}, "
            f"peer files {peers}.")


def make_row(case: Case, name: str, us: float, anchors: dict, *, config=None, search: str = "none",
             peer_labels: dict | None = None, timing: str = "do_bench median (L2 flushed)") -> dict:
    """One JSON row: the metrics, what the row times (`label`), how it was timed, and for a peer its config."""
    row = {"model": case.model, "num_rows": case.num_rows, "path": name, "label": row_label(name, peer_labels, search),
           "tuned": "_tuned_" in name, "timing": timing, **case_metrics(case, name, us, anchors)}
    if config is not None:
        row["config"] = {"up": config.up, "down": config.down, "source": config.source}
    return row


def versions(peers: list) -> dict:
    """What ran: the peer files (wheel or fused-moe zip names) and the deep_gemm version (None when absent)."""
    try:
        from moe_ref.experts.deep_gemm.probe import deep_gemm_status

        status = deep_gemm_status()
        deep_gemm = status.version if status.available else f"unavailable ({status.reason[:120]})"
    except Exception as exc:  # noqa: BLE001 - informational
        deep_gemm = f"unknown ({exc!r})"
    return {"peer_files": [os.path.basename(peer.wheel) for peer in peers], "deep_gemm": deep_gemm}


def plot(results: dict, path: str) -> None:
    """TFLOP/s per routed-row count, a line per path, a panel per model, to `path` (PNG; nothing without
    matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        print("matplotlib not available: no plot", flush=True)
        return
    models = sorted({row["model"] for row in results["cases"]})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = [r for r in results["cases"] if r["model"] == model]
        for name in sorted({r["path"] for r in rows}):
            points = sorted((r["num_rows"], r["tflops"]) for r in rows if r["path"] == name)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        ax.axhline(results["anchors"]["bf16_flops_per_s"] / 1e12, color="gray", linestyle="--", label="bf16 peak")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("routed rows")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(model)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", flush=True)
