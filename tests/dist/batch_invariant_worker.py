"""torchrun worker of tests/dist/test_batch_invariant_dist.py: the same global tokens through a batch-invariant layer
at this EP size, over ``symm`` and ``a2a``, in fp32, bf16 and bf16 with FP8 dispatch.

    python -m torch.distributed.run --standalone --nproc-per-node R tests/dist/batch_invariant_worker.py --out OUT \
        [--model tiny-kimi-k2 | hf:<model_type>]

``--model``: a preset, ``hf:<model_type>`` (a transformers family's tiny config) or ``ckpt:<folder>`` (a synthetic
checkpoint, experts loaded as stored): ``build_layer``.

The G = 64 global tokens are split unevenly over the ranks (the last rank gets none at R = 4, two ranks none at R = 8:
two experts each) and chunked by a cap of 16 rows. Each rank reports, per case, the bytes of its output rows as hex,
with the global token index of each; the test compares them with one process's output on all 64 tokens, bitwise.
It also reports what each chunk's combine cost in transport calls (``count_combine_exchanges``), so the test can
require ONE exchange per chunk.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from launch import join_group  # noqa: E402  (tests/dist, beside this worker)
from moe_ref import MegaMoE

PRESET, NUM_TOKENS, SEED = "tiny-kimi-k2", 64, 0
# the case names the test compares: (activation dtype, FP8 dispatch)
RECIPES = {"float32": (torch.float32, False), "bfloat16": (torch.bfloat16, False), "bfloat16+fp8": (torch.bfloat16, True)}
SPLITS = {1: [64], 2: [40, 24], 4: [20, 24, 20, 0], 8: [12, 0, 20, 4, 8, 0, 17, 3]}


CHECKPOINT_LAYER = 1  # the MoE layer a ``ckpt:`` folder holds (the test writes it)


def build_layer(model: str, group=None, **options) -> MegaMoE:
    """A batch-invariant ``MegaMoE`` of ``model``: a preset name; ``hf:<model_type>``, a transformers family's tiny
    config (``tests/unit/hf_tiny_models.py``); or ``ckpt:<folder>``, a synthetic checkpoint loaded as stored (quantized
    experts kept quantized)."""
    from moe_ref.core.config import MoEConfig

    if model.startswith("hf:"):
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
        import hf_tiny_models as tiny

        cfg = MoEConfig.from_hf_config(tiny.tiny_model(model[3:]).config)
    elif model.startswith("ckpt:"):
        cfg = MoEConfig.from_hf_config(model[5:])
    else:
        cfg = model
    moe = MegaMoE(cfg, group, seed=SEED, batch_invariant=True, **options)
    if model.startswith("ckpt:"):
        moe.load_hf_weights(model[5:], layer_idx=CHECKPOINT_LAYER)
        assert moe.quantized_experts is not None, "the checkpoint's experts were not kept as stored"
    return moe


def global_tokens(hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """``[G, D]`` the tokens every EP size runs (the test builds the same)."""
    return torch.randn(NUM_TOKENS, hidden, generator=torch.Generator().manual_seed(7)).to(dtype)


def row_bytes(y_TD: torch.Tensor) -> list[str]:
    """Each row's bytes as hex (bf16 viewed as int16, fp32 as int32)."""
    as_int = y_TD.view(torch.int16 if y_TD.element_size() == 2 else torch.int32)
    return [row.numpy().tobytes().hex() for row in as_int]


def count_combine_exchanges(dispatcher) -> dict:
    """Count, inside ``dispatcher.combine_slots`` only, the chunks, the transport's exchanges (``a2a``: calls of
    ``all_to_all_single``; ``symm``: slot-row pushes), the ``symm`` barriers and the default combine's partial pushes
    (the K-round combine ran one per slot). Returns the live counters."""
    counts = {"chunks": 0, "exchanges": 0, "barriers": 0, "partial_pushes": 0}
    inside = [False]

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            if inside[0]:
                counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    combine_slots = dispatcher.combine_slots

    def combine_slots_counted(*args, **kwargs):
        counts["chunks"] += 1
        inside[0] = True
        try:
            return combine_slots(*args, **kwargs)
        finally:
            inside[0] = False

    dispatcher.combine_slots = combine_slots_counted
    dispatcher._return_partials = counted("partial_pushes", dispatcher._return_partials)
    if dispatcher.transport_name == "a2a":
        dist.all_to_all_single = counted("exchanges", dist.all_to_all_single)
    else:
        dispatcher._slots_push = counted("exchanges", dispatcher._slots_push)
        dispatcher._barrier = counted("barriers", dispatcher._barrier)
    return counts


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default=PRESET)
    args = parser.parse_args()
    rank, world, report = join_group(args.out, 60)
    lo = sum(SPLITS[world][:rank])
    hi = lo + SPLITS[world][rank]
    for transport in ("symm", "a2a"):
        for recipe, (dtype, fp8) in RECIPES.items():
            moe = build_layer(args.model, dist.group.WORLD, transport=transport, dtype=dtype, dispatch_fp8=fp8,
                              num_max_tokens_per_rank=16, overflow="chunk", alignment=1)
            all_to_all_single = dist.all_to_all_single
            counts = count_combine_exchanges(moe.routed_step.dispatcher)  # collective: builds the step
            try:
                with torch.no_grad():
                    y = moe(global_tokens(moe.cfg.hidden_size, dtype)[lo:hi])
            finally:
                dist.all_to_all_single = all_to_all_single
            report({"case": f"{transport}/{recipe}", "tokens": list(range(lo, hi)),
                    "rows": row_bytes(y), "combine": counts})
            moe.destroy()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
