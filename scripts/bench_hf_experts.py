#!/usr/bin/env python
"""transformers' experts implementations against ``experts_implementation="moe_ref"``, on one GPU.

    PYTHONPATH=. python3 scripts/bench_hf_experts.py --out results/hf_experts [--tokens 1 16 128 1024 4096]

One sparse MoE block of a transformers model built from a published config's MoE sizes (random bf16 weights, one
decoder layer), its experts switched with ``model.set_experts_implementation(NAME)`` as a user would, for NAME in
transformers' own entries (``eager``: the per-expert loop, ``grouped_mm``: torch's grouped GEMM, ``batched_mm``,
``deepgemm`` where it loads) and ``moe_ref`` (moe_ref's experts backend over the module's own weights). Per (model,
T, entry): us per block call (router, experts, shared experts: ``moe_ref.testing.bench``, L2 flushed, median of 20),
eagerly and replayed from a CUDA graph, and calc_diff of the block's output against ``grouped_mm``'s. An entry that
cannot run says why in its row. Writes hf_experts.json and hf_experts.md.

Models (the MoE sizes of their config.json): Qwen3-30B-A3B (qwen3_moe: E 128, top-8, D 2048, F 768) and
Mixtral-8x7B's shape scaled to one layer (mixtral: E 8, top-2, D 4096, F 14336).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moe_ref.testing import bench, calc_diff, graphed  # noqa: E402

MODELS = {
    "qwen3-30b-a3b": ("qwen3_moe", dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                                        num_experts_per_tok=8, intermediate_size=6144, norm_topk_prob=True)),
    "mixtral-8x7b": ("mixtral", dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                                     num_experts_per_tok=2)),
}
ENTRIES = ("grouped_mm", "moe_ref", "batched_mm", "eager", "deepgemm")


def build_block(model: str):
    """The MoE block of a one-layer model of ``model``'s MoE sizes (bf16, cuda) and the model owning it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, sizes = MODELS[model]
    config = AutoConfig.for_model(model_type, num_hidden_layers=1, vocab_size=1024, num_attention_heads=16,
                                  num_key_value_heads=4, head_dim=128, **sizes)
    torch.manual_seed(0)
    with torch.device("cuda"):
        lm = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    return lm, lm.model.layers[0].mlp


def time_entry(lm, block, entry: str, x: torch.Tensor, reference: torch.Tensor | None) -> dict:
    """One row: the block with ``entry``'s experts, eager and graphed, and its calc_diff against ``reference``."""
    try:
        lm.set_experts_implementation(entry)
        with torch.no_grad():
            first_start = time.perf_counter()
            out = block(x)
            out = out[0] if isinstance(out, tuple) else out
            torch.cuda.synchronize()
            first_ms = (time.perf_counter() - first_start) * 1e3
            eager_us = bench(lambda: block(x))
            try:
                replay = graphed(lambda inp: block(inp), x)
                graph_us = bench(lambda: replay(x))
            except Exception as exc:  # an entry that syncs the host cannot be captured: the row says so
                graph_us, why = None, f"graph: {type(exc).__name__}: {str(exc)[:120]}"
            else:
                why = ""
    except Exception as exc:
        return {"entry": entry, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    diff = None if reference is None else float(calc_diff(out.float(), reference.float()))
    return {"entry": entry, "first_call_ms": first_ms, "eager_us": eager_us, "graph_us": graph_us,
            "calc_diff_vs_grouped_mm": diff, "note": why, "output": out.detach().clone()}


def markdown(rows: list[dict], env: str) -> str:
    lines = [f"transformers experts implementations, one MoE block, bf16 ({env})", "",
             "| model | T | entry | eager us | graph us | x vs grouped_mm (eager) | first call ms | calc_diff | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['model']} | {row['tokens']} | {row['entry']} | - | - | - | - | - | {row['error']} |")
            continue
        base = next((r["eager_us"] for r in rows if r["model"] == row["model"] and r["tokens"] == row["tokens"]
                     and r["entry"] == "grouped_mm" and "error" not in r), None)
        speed = f"{base / row['eager_us']:.2f}x" if base else "-"
        graph = f"{row['graph_us']:.1f}" if row["graph_us"] else "-"
        diff = f"{row['calc_diff_vs_grouped_mm']:.1e}" if row["calc_diff_vs_grouped_mm"] is not None else "-"
        lines.append(f"| {row['model']} | {row['tokens']} | {row['entry']} | {row['eager_us']:.1f} | {graph} | "
                     f"{speed} | {row['first_call_ms']:.0f} | {diff} | {row['note']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/hf_experts")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 1024, 4096])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--entries", nargs="+", default=list(ENTRIES))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_hf_experts.py times CUDA kernels: run it on a GPU machine")
    import transformers

    import moe_ref.integrations.transformers  # noqa: F401  (registers "moe_ref")

    os.makedirs(args.out, exist_ok=True)
    env = (f"{time.strftime('%Y-%m-%d')}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
           f"transformers {transformers.__version__}")
    rows = []
    for model in args.models:
        lm, block = build_block(model)
        for tokens in args.tokens:
            x = torch.randn(1, tokens, lm.config.hidden_size, device="cuda", dtype=torch.bfloat16)
            reference = None
            for entry in args.entries:
                row = time_entry(lm, block, entry, x, reference)
                if entry == "grouped_mm" and "output" in row:
                    reference = row["output"]
                row.pop("output", None)
                rows.append({"model": model, "tokens": tokens, **row})
                print(json.dumps(rows[-1]), flush=True)
        del lm, block
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "hf_experts.json"), "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "hf_experts.md"), "w") as f:
        f.write(markdown(rows, env))
    print(markdown(rows, env))


if __name__ == "__main__":
    main()
