"""torchrun worker of tests/dist/test_patch_dist.py: a transformers model patched over the EP group.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist/patch_worker.py --out OUT_DIR \
        --cases deepseek_v3:auto deepseek_v3:a2a

Each case ``<model_type>:<transport>``: every rank builds the same tiny model (tests/unit/hf_tiny_models.py, seed 0)
and ``patch_model(model, group=WORLD)`` (each rank keeps E / R experts); then runs ITS OWN prompt (a different
batch and length per rank) through the model, and 8 greedy ``generate`` steps, and compares with the same model
patched at one rank (group=None) and with transformers' unpatched model. Each rank writes one JSON line per case
to ``OUT_DIR/rank{r}.jsonl`` as the case ends.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "unit"))

import hf_tiny_models as tiny  # noqa: E402
from launch import join_group  # noqa: E402  (tests/dist, beside this worker)
from moe_ref.core.errors import MoERefError  # noqa: E402
from moe_ref.integrations.transformers import patch_model  # noqa: E402

GROUP_TIMEOUT_S = 120
NEW_TOKENS = 8
PROMPTS = ((2, 11), (1, 6), (3, 4), (1, 9))  # rank r feeds PROMPTS[r % 4]: (batch, length)


def run_case(rank: int, model_type: str, transport: str) -> dict:
    model = tiny.tiny_model(model_type)
    report = patch_model(model, dist.group.WORLD, num_max_tokens_per_rank=16, transport=transport)
    one_rank = tiny.tiny_model(model_type)
    patch_model(one_rank, num_max_tokens_per_rank=16)
    unpatched = tiny.tiny_model(model_type)
    batch, length = PROMPTS[rank % len(PROMPTS)]
    x = tiny.prompt(batch, length, seed=10 + rank)
    with torch.no_grad():
        logits = model(x).logits
        expected = one_rank(x).logits
        oracle = unpatched(x).logits
    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    generated = model.generate(x, **kwargs)  # the same number of forward calls on every rank
    scale = float(expected.abs().max())
    return dict(
        max_err_vs_one_rank=float((logits - expected).abs().max()), max_err_vs_transformers=float(
            (logits - oracle).abs().max()), scale=scale, generate_equal=bool(torch.equal(
                generated, one_rank.generate(x, **kwargs))), num_tokens=batch * length,
        local_experts=[b.num_local_experts for b in report.blocks], ep_size=report.ep_size,
        transport=model.model.layers[-1].mlp.moe.options.transport)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", nargs="+", required=True)
    args = parser.parse_args()
    rank, _, report = join_group(args.out, GROUP_TIMEOUT_S)
    for case in args.cases:
        model_type, transport = case.split(":")
        start = time.perf_counter()
        try:
            result = run_case(rank, model_type, transport)
        except BaseException as err:  # noqa: BLE001 - the error is the report; every rank meets the same one
            code = err.code if isinstance(err, MoERefError) else type(err).__name__
            result = dict(code=code, error=traceback.format_exc()[-2000:])
        report({"case": case, "seconds": round(time.perf_counter() - start, 3), **result})
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
