"""torchrun worker: a transformers DeepSeek-V3 MoE block vs ``MegaMoE`` loaded from its checkpoint, EP over
the group. Every rank builds the same HF block from one seed; rank 0 writes its weights as safetensors in the
fused (transformers 5.x) and per-expert (Hub) namings; every rank loads each into ``MegaMoE`` (reading only its
own experts), runs its own tokens (uneven counts, one rank with none) and compares with HF's module.

    torchrun --nproc-per-node 2 tests/dist/hf_worker.py --out DIR
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
import test_hf_parity as hf  # noqa: E402  (the HF block builders and checkpoint writers)

from moe_ref.layer import MegaMoE  # noqa: E402
from moe_ref.testing import TOLERANCES  # noqa: E402

TOKENS_PER_RANK = (70, 0, 33, 5)  # rank r feeds TOKENS_PER_RANK[r % 4] tokens


def run_case(rank: int, world: int, layout: str, n_group: int, topk_group: int, folder: Path) -> dict:
    config = hf.hf_config(n_group, topk_group)
    cfg, moe = hf.moe_config(config), hf.hf_moe(config, seed=21)
    path = folder / f"{layout}_{n_group}" / "model.safetensors"
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        (hf.save_fused if layout == "fused" else hf.save_hub)(moe, path)
    dist.barrier()
    layer = MegaMoE(cfg, dist.group.WORLD, num_max_tokens_per_rank=32, overflow="chunk", dtype=torch.float32)
    layer.load_hf_weights(path.parent, layer_idx=hf.LAYER)
    num_tokens = TOKENS_PER_RANK[rank % len(TOKENS_PER_RANK)]
    x_TD = torch.randn(num_tokens, config.hidden_size, generator=torch.Generator().manual_seed(100 + rank))
    with torch.no_grad():
        expected_TD = moe(x_TD)
        actual_TD = layer(x_TD)
    layer.destroy()
    atol, rtol = TOLERANCES[torch.float32]
    err = (actual_TD - expected_TD).abs()
    ok = actual_TD.shape == expected_TD.shape and bool((err <= atol + rtol * expected_TD.abs()).all())
    return dict(ok=ok, num_tokens=num_tokens, max_abs_err=float(err.max()) if err.numel() else 0.0,
                local_experts=layer.num_local_experts)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for layout in ("fused", "hub"):
        for n_group, topk_group in hf.GROUPINGS:
            name = f"{layout}-groups{n_group}"
            try:
                results[name] = run_case(rank, world, layout, n_group, topk_group, out)
            except Exception:  # report per case; the collective order is the same on every rank
                results[name] = dict(ok=False, error=traceback.format_exc())
                raise
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
