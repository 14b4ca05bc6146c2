"""``moe-ref eplb simulate``: plan a placement for a load trace and report each layer's balance before and after.

    --loads FILE | --zipf S -> load [Ly, E] (summed over the trace's windows) -> plan_global / plan_hierarchical
      -> balancedness (moe_ref.eplb.simulate) -> summary on stdout, JSON (+ PNG with matplotlib) under --out
      -> modelled step per layer before/after (moe_ref.eplb.expert_times: measured expert MLP times, --model,
         --expert-dtype, --times) on one step's rows: the trace / (windows x --steps-per-window)

The placement is planned on the same load it is judged on (the trace's windows summed): the best case a
placement made from that trace can reach. ``moe_ref.tools.cli`` mounts ``add_simulate_arguments`` and
``run_simulate`` as ``moe-ref eplb simulate``; ``main`` runs the same command on its own.

Shape legend: E experts (the model's logical experts), Ly MoE layers of a model.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from moe_ref.core.errors import CommandLineError, LoadTraceError
from moe_ref.eplb.expert_times import ExpertTimes, StepTimes, expert_times, read_table, step_times
from moe_ref.eplb.planner import check_topology, plan_global, plan_hierarchical
from moe_ref.eplb.simulate import Balancedness, balancedness, identity_placement, zipf_loads
from moe_ref.eplb.trace import load_loads

NUM_WORST_LAYERS = 5


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``eplb simulate`` (values are checked by ``run_simulate``, CFG015)."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--loads", default=None, help="load trace: .json or .pt, [windows, layers, experts] counts")
    source.add_argument("--zipf", type=float, default=None, metavar="S",
                        help="synthetic trace: Zipf exponent S over a per-layer random permutation of the experts")
    parser.add_argument("--experts", type=int, default=None, help="logical experts E (default: the trace's, or 256)")
    parser.add_argument("--top-k", type=int, default=8, help="experts per token (--zipf)")
    parser.add_argument("--layers", type=int, default=None, help="MoE layers (default: the trace's, or 61)")
    parser.add_argument("--tokens-per-rank", type=int, default=4096, help="tokens per rank per layer (--zipf)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic trace (--zipf)")
    parser.add_argument("--ep", type=int, default=8, help="EP ranks R")
    parser.add_argument("--redundant", type=int, default=32, help="redundant slots: P = experts + redundant")
    parser.add_argument("--nodes", type=int, default=1, help="nodes (hierarchical policy when > 1 or --groups > 1)")
    parser.add_argument("--groups", type=int, default=1, help="expert groups kept on one node")
    parser.add_argument("--out", default=None, help="folder for eplb_simulate.json, placement.json (+ .png)")
    parser.add_argument("--model", default="kimi-k2",
                        help="the expert time table's model for the modelled step (shipped: kimi-k2, step3; "
                             "default kimi-k2)")
    parser.add_argument("--expert-dtype", default="bf16",
                        help="its expert precision (shipped: bf16, fp8; kimi-k2 also int4, mxfp4; default bf16)")
    parser.add_argument("--times", default=None, metavar="FILE",
                        help="your own expert time table (JSON, the format of moe_ref.eplb.expert_times.TABLE)")
    parser.add_argument("--steps-per-window", type=int, default=1,
                        help="steps each trace window counts: one step's rows = trace / (windows x this)")
    parser.add_argument("--per-layer", action="store_true", help="print every layer's modelled step")


def _check_flags(args: argparse.Namespace) -> None:
    minimum = {"top_k": 1, "tokens_per_rank": 0, "ep": 1, "redundant": 0, "nodes": 1, "groups": 1,
               "experts": 1, "layers": 1, "steps_per_window": 1}
    for name, low in minimum.items():
        value = getattr(args, name)
        if value is not None and value < low:
            raise CommandLineError(f"eplb simulate: --{name.replace('_', '-')} {value} is out of range: needs an "
                                   f"integer >= {low}")
    if args.zipf is not None and not 0 <= args.zipf < math.inf:
        raise CommandLineError(f"eplb simulate: --zipf {args.zipf} is out of range: needs a finite number >= 0")


def _load(args: argparse.Namespace) -> tuple[torch.Tensor, str, int]:
    """The ``[Ly, E]`` load, a words description of where it came from, and the steps it counts (the trace's
    windows x ``--steps-per-window``; a Zipf load is one step)."""
    if args.zipf is None:
        trace = load_loads(args.loads)  # [windows, Ly, E]
        load_LyE = trace.sum(dim=0)
        wanted = {"--layers": (args.layers, load_LyE.shape[0]), "--experts": (args.experts, load_LyE.shape[1])}
        for flag, (given, found) in wanted.items():
            if given is not None and given != found:
                raise LoadTraceError(f"{args.loads}: the trace has {found} for {flag}, the command asked {given}; "
                                     f"drop {flag} or pass the trace's value")
        return load_LyE, f"trace {args.loads}", trace.shape[0] * args.steps_per_window
    num_layers, num_experts = args.layers or 61, args.experts or 256
    # refuse sizes before the (seconds-long) sampling; a trace's sizes are known only once it is read
    check_topology(num_experts, num_experts + args.redundant, args.groups, args.nodes, args.ep)
    identity_placement(1, num_experts, args.ep)
    tokens = args.tokens_per_rank * args.ep
    load_LyE = zipf_loads(num_layers, num_experts, args.top_k, tokens, args.zipf, args.seed)
    return load_LyE, (f"zipf s={args.zipf}, top-{args.top_k}, {args.tokens_per_rank} tokens/rank "
                     f"({tokens} tokens/layer), seed {args.seed}"), 1


def summarize(result: Balancedness) -> dict:
    """Means and minima over layers of balancedness, mean max-rank rows and their reduction (plain floats)."""
    before_Ly, after_Ly = result.balancedness_before_Ly, result.balancedness_after_Ly
    max_before, max_after = float(result.max_rank_rows_before_Ly.mean()), float(result.max_rank_rows_after_Ly.mean())
    return {"balancedness_before_mean": float(before_Ly.mean()), "balancedness_before_min": float(before_Ly.min()),
            "balancedness_after_mean": float(after_Ly.mean()), "balancedness_after_min": float(after_Ly.min()),
            "max_rank_rows_before_mean": max_before, "max_rank_rows_after_mean": max_after,
            "max_rank_rows_reduction": 1.0 - max_after / max_before if max_before > 0 else 0.0}


def _report_lines(header: str, result: Balancedness, summary: dict, step: StepTimes) -> list[str]:
    lines = [header,
             f"balancedness (mean / max rows per rank; 1 = even), over layers: "
             f"before mean {summary['balancedness_before_mean']:.3f} min {summary['balancedness_before_min']:.3f}"
             f" | after mean {summary['balancedness_after_mean']:.3f} min {summary['balancedness_after_min']:.3f}",
             f"max-rank rows, mean over layers: before {summary['max_rank_rows_before_mean']:.1f} -> after "
             f"{summary['max_rank_rows_after_mean']:.1f} ({100 * summary['max_rank_rows_reduction']:.1f}% fewer)",
             f"worst layers after: layer | balancedness before -> after | max-rank rows before -> after | "
             f"modelled step us before -> after"]
    after_Ly = result.balancedness_after_Ly
    for layer in torch.argsort(after_Ly)[:NUM_WORST_LAYERS].tolist():
        lines.append(f"  {layer:5d} | {float(result.balancedness_before_Ly[layer]):.3f} -> {float(after_Ly[layer]):.3f}"
                     f" | {float(result.max_rank_rows_before_Ly[layer]):.1f} -> "
                     f"{float(result.max_rank_rows_after_Ly[layer]):.1f} | {float(step.before_us_Ly[layer]):.1f} -> "
                     f"{float(step.after_us_Ly[layer]):.1f}")
    return lines


def _table_name(args: argparse.Namespace) -> str:
    return "the shipped table" if args.times is None else repr(args.times)


def _times(args: argparse.Namespace) -> ExpertTimes:
    """t(r) of ``--model`` / ``--expert-dtype`` from ``--times`` or the shipped table (CFG015 naming what it holds)."""
    return expert_times(read_table(args.times), args.model, args.expert_dtype, _table_name(args))


def _step_times(args: argparse.Namespace, times: ExpertTimes, load_LyE: torch.Tensor, num_steps: int,
                placement) -> tuple[list[str], dict, StepTimes]:
    """The modelled step lines, their JSON record and the ``StepTimes`` for one step's rows (load / num_steps)."""
    name = _table_name(args)
    result = step_times(load_LyE / num_steps, placement, times)
    before, after = float(result.before_us_Ly.sum()), float(result.after_us_Ly.sum())
    num_layers = load_LyE.shape[0]
    lines = [f"modelled step (expert MLP only, the slowest rank; {args.model} {args.expert_dtype} from {name}; "
             f"rows of one step = load / {num_steps}): per layer mean {before / num_layers:.1f} us -> "
             f"{after / num_layers:.1f} us; all {num_layers} layers {before:.1f} us -> {after:.1f} us, "
             f"speedup {result.speedup:.3f}x"]
    biggest = max(result.max_slot_rows_before, result.max_slot_rows_after)
    if biggest > times.max_rows:
        lines.append(f"  note: a slot gets up to {biggest:.1f} rows, above the table's largest point "
                     f"({times.max_rows:.1f} rows per expert): t extrapolated along its last segment")
    if args.per_layer:
        lines.append("  layer | modelled step us before -> after")
        lines += [f"  {layer:5d} | {b:.1f} -> {a:.1f}"
                  for layer, (b, a) in enumerate(zip(result.before_us_Ly.tolist(), result.after_us_Ly.tolist()))]
    record = {"model": args.model, "expert_dtype": args.expert_dtype, "table": name, "steps": num_steps,
              "points": {"rows_per_expert": list(times.rows), "us_per_expert": list(times.us)},
              "before_us": result.before_us_Ly.tolist(), "after_us": result.after_us_Ly.tolist(),
              "before_us_sum": before, "after_us_sum": after, "speedup": result.speedup}
    return lines, record, result


def _write_png(path: Path, result: Balancedness) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(result.balancedness_before_Ly.numpy(), label="before (E / R experts per rank)")
    ax.plot(result.balancedness_after_Ly.numpy(), label="after EPLB")
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("mean / max rows per rank")
    ax.set_ylim(0, 1.05)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def run_simulate(args: argparse.Namespace) -> int:
    """Run ``eplb simulate`` for parsed flags: print the summary, write the files under ``--out``; returns 0."""
    _check_flags(args)
    times = _times(args)  # a bad --times / --model / --expert-dtype before the (seconds-long) sampling and planning
    load_LyE, source, num_steps = _load(args)
    num_layers, num_experts = load_LyE.shape
    num_physical = num_experts + args.redundant
    hierarchical = args.nodes > 1 or args.groups > 1
    if hierarchical:
        placement = plan_hierarchical(load_LyE, num_physical, args.groups, args.nodes, args.ep)
    else:
        placement = plan_global(load_LyE, num_physical, args.ep)
    result = balancedness(load_LyE, placement)
    summary = summarize(result)
    policy = f"hierarchical ({args.nodes} nodes, {args.groups} groups)" if hierarchical else "global"
    header = (f"EPLB simulate (CPU): {num_layers} layers, {num_experts} experts, EP {args.ep}, {num_physical} slots "
              f"({args.redundant} redundant, {placement.slots_per_rank} per rank), {policy} policy; load: {source}")
    step_lines, step_record, step = _step_times(args, times, load_LyE, num_steps, placement)
    print("\n".join(_report_lines(header, result, summary, step) + step_lines))
    if args.out is not None:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        record = {"command": {k: v for k, v in vars(args).items() if k not in ("fn", "command", "eplb_command")},
                  "num_layers": num_layers, "num_experts": num_experts, "num_physical": num_physical,
                  "policy": policy, "load": source, "summary": summary, "step_time": step_record,
                  "per_layer": {"balancedness_before": result.balancedness_before_Ly.tolist(),
                                "balancedness_after": result.balancedness_after_Ly.tolist(),
                                "max_rank_rows_before": result.max_rank_rows_before_Ly.tolist(),
                                "max_rank_rows_after": result.max_rank_rows_after_Ly.tolist(),
                                "mean_rank_rows": result.mean_rank_rows_Ly.tolist()}}
        (out / "eplb_simulate.json").write_text(json.dumps(record, indent=1))
        placement.save(out / "placement.json")
        written = "eplb_simulate.json, placement.json" + (", eplb_simulate.png"
                                                           if _write_png(out / "eplb_simulate.png", result) else "")
        print(f"wrote {written} under {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``eplb simulate ...`` on its own (``moe-ref eplb`` mounts the same flags); returns the exit status.

    Args:
        argv: the words after ``eplb`` (default: ``sys.argv[1:]``).
    """
    parser = argparse.ArgumentParser(prog="moe-ref eplb")
    sub = parser.add_subparsers(dest="eplb_command", required=True)
    add_simulate_arguments(sub.add_parser("simulate", help="plan a placement for a load trace and report balance"))
    args = parser.parse_args(argv)
    return run_simulate(args)


if __name__ == "__main__":
    raise SystemExit(main())
