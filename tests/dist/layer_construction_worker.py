"""torchrun worker of tests/dist/test_layer_construction_dist.py: construction problems that only one rank has are
coded errors on EVERY rank (the construction's one collective carries them), and a layer over a real process group
refuses to pickle (CFG020).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist/layer_construction_worker.py --out DIR

Each rank writes one line per case to ``DIR/rank{r}.jsonl`` as the case ends (``{"case", "code", "seconds",
"next_ok"}``); ``next_ok``: a layer built right after it on every rank gives the one-process reference's output.
"""
from __future__ import annotations

import argparse
import pickle
import sys
import time

import torch
import torch.distributed as dist

from launch import join_group  # noqa: E402  (tests/dist, beside this worker)
from moe_ref import MegaMoE
from moe_ref.core.errors import MoERefError
from moe_ref.core.weights import MoEWeights
from moe_ref.layer import construction
from moe_ref.reference import reference_moe

GROUP_TIMEOUT_S = 60
PRESET = "tiny-kimi-k2"


def seed_of_the_wrong_type_on_one_rank(rank: int) -> None:
    MegaMoE(PRESET, dist.group.WORLD, num_max_tokens_per_rank=8, seed="a" if rank == 1 else 3)


def triton_experts_unusable_on_one_rank(rank: int) -> None:
    # every rank asks for Triton off CUDA; only rank 1 has the interpreter (pretended here)
    construction.is_interpreter = lambda: rank == 1
    MegaMoE(PRESET, dist.group.WORLD, num_max_tokens_per_rank=8, experts_backend="triton")


def pickle_a_layer_over_the_group(rank: int) -> None:
    pickle.dumps(MegaMoE(PRESET, dist.group.WORLD, num_max_tokens_per_rank=8, seed=3))


CASES = [seed_of_the_wrong_type_on_one_rank, triton_experts_unusable_on_one_rank, pickle_a_layer_over_the_group]


def _next_ok(rank: int) -> bool:
    layer = MegaMoE(PRESET, dist.group.WORLD, num_max_tokens_per_rank=16, seed=3)
    x = torch.randn(5, layer.cfg.hidden_size, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        y = layer(x)
    layer.destroy()
    return bool(torch.allclose(y, reference_moe(x, MoEWeights.random(layer.cfg, seed=3), layer.cfg), atol=1e-5,
                               rtol=1e-4))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    rank, world, report = join_group(parser.parse_args().out, GROUP_TIMEOUT_S)
    for case in CASES:
        start, code = time.perf_counter(), None
        try:
            case(rank)
        except MoERefError as err:
            code = err.code
        seconds = time.perf_counter() - start
        construction.is_interpreter = lambda: False  # this process runs no Triton interpreter
        report({"case": case.__name__, "code": code, "seconds": round(seconds, 3), "next_ok": _next_ok(rank)})
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
