"""torchrun worker of the layer-lifecycle tests (tests/dist/test_lifecycle.py).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist/lifecycle_worker.py --out OUT_DIR

1. ``drop_after_failure``: rank 0's experts raise inside a call (every rank raises: MemoryError / ENV005); then
   every rank drops the layer, with the garbage collector off, and builds a new one with the same plan: the
   old layer must be gone on every rank (no reference cycle through the failure path keeps it, and its share of
   the group's buffer, on the failing rank only: CFG008 at the build), and the new one must give the reference.
2. teardown: a layer still holding the group (its step and buffer built, never destroyed) when the script calls
   ``dist.destroy_process_group()`` and exits: every rank must exit with status 0 (the pytest side runs this
   several times; gloo's destructor run during interpreter teardown aborted about one run in three).
Each rank writes one JSON line per case to ``OUT_DIR/rank{r}.jsonl`` as soon as it ends.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time

import torch
import torch.distributed as dist

from launch import join_group  # noqa: E402  (tests/dist, beside this worker)
from moe_ref import MegaMoE
from moe_ref.core.config import preset
from moe_ref.core.errors import MoERefError
from moe_ref.core.weights import MoEWeights
from moe_ref.reference import reference_moe

GROUP_TIMEOUT_S = 120
PRESET = "tiny-kimi-k2"
KEPT = []  # the layer alive at exit


def _layer() -> MegaMoE:
    return MegaMoE(PRESET, dist.group.WORLD, num_max_tokens_per_rank=16, transport="symm", seed=3)


def _tokens(rank: int) -> torch.Tensor:
    return torch.randn(6, preset(PRESET).hidden_size, generator=torch.Generator().manual_seed(7 + rank))


def _code(err: BaseException) -> str:
    return err.code if isinstance(err, MoERefError) else type(err).__name__


def case_drop_after_failure(rank: int) -> dict:
    gc.collect()
    gc.disable()
    try:
        layer = _layer()
        if rank == 0:
            experts = layer.experts

            def boom(*args, **kwargs):
                raise MemoryError("injected out-of-memory inside rank 0's experts")
            experts.forward = boom
            del experts, boom
        code = None
        try:
            with torch.no_grad():
                layer(_tokens(rank))
        except BaseException as err:  # noqa: BLE001 - the error IS the result
            code = _code(err)
        del layer  # on every rank; no gc.collect()
        new = _layer()
        x = _tokens(rank)
        with torch.no_grad():
            y = new(x)
        ok = bool(torch.allclose(y, reference_moe(x, MoEWeights.random(new.cfg, seed=3), new.cfg),
                                 atol=1e-5, rtol=1e-4))
        new.destroy()
        return {"failure_code": code, "ok": ok}
    finally:
        gc.enable()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rank, _, report = join_group(args.out, GROUP_TIMEOUT_S)

    start = time.perf_counter()
    try:
        result = case_drop_after_failure(rank)
    except BaseException as err:  # noqa: BLE001
        result = {"code": _code(err), "message": str(err)[:600]}
    report({"case": "drop_after_failure", "seconds": round(time.perf_counter() - start, 3), **result})
    dist.barrier()
    layer = _layer()  # held at exit, step and buffer built
    with torch.no_grad():
        layer(_tokens(rank))
    KEPT.append(layer)
    report({"case": "teardown", "ok": True})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
