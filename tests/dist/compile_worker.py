"""torchrun worker of the compiled-layer tests: ``torch.compile(dynamic=True, fullgraph=True)`` around MegaMoE keeps
the layer's collective contract (every call runs the op on every rank, T = 0 included) and its coded errors.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist/compile_worker.py --out OUT_DIR

Each case is run by every rank and reported as one line of ``OUT_DIR/rank{r}.jsonl`` as soon as it ends
(``{"case", "code", "message", "seconds", "ok"}``); a rank that hangs never reports. ``seconds`` covers the
measured calls only: the graphs are compiled first by a warm-up every rank runs alike (T = 4 and T = 0).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

from launch import join_group  # noqa: E402  (tests/dist, beside this worker)
from moe_ref import MegaMoE
from moe_ref.core.config import preset
from moe_ref.core.errors import MoERefError

GROUP_TIMEOUT_S = 120
PRESET = "tiny-kimi-k2"
BACKENDS = ("inductor", "aot_eager")


def _tokens(rank: int, num_tokens: int, seed: int) -> torch.Tensor:
    return torch.randn(num_tokens, preset(PRESET).hidden_size, generator=torch.Generator().manual_seed(seed + rank))


def _code(err: BaseException) -> str:
    return err.code if isinstance(err, MoERefError) else type(err).__name__


def case_empty_rank(backend: str, rank: int, world: int) -> bool:
    """Rank 0 calls T = [4, 0, 4], the others [4, 4, 4]: every call runs on every rank; outputs == eager."""
    moe = MegaMoE(PRESET, dist.group.WORLD, num_max_tokens_per_rank=16, seed=0)
    f = torch.compile(lambda x: moe(x) + 1, fullgraph=True, dynamic=True, backend=backend)
    with torch.no_grad():
        for T in (4, 0):  # warm-up, alike on every rank: both graphs compiled before the clock starts
            f(_tokens(rank, T, 0))
        start = time.perf_counter()
        sizes = (4, 0, 4) if rank == 0 else (4, 4, 4)
        xs = [_tokens(rank, T, 10 * i) for i, T in enumerate(sizes)]
        compiled = [f(x) for x in xs]
        seconds = time.perf_counter() - start
        eager = [moe(x) + 1 for x in xs]
    moe.destroy()
    ok = all(c.shape == e.shape and torch.allclose(c, e, atol=1e-5, rtol=1e-5) for c, e in zip(compiled, eager))
    return ok, seconds


def case_grad_on_one_rank(backend: str, rank: int, world: int):
    """Grad mode on and rank 0's input requires grad: INP007 on every rank, as eager (not BackendCompilerFailed)."""
    moe = MegaMoE(PRESET, dist.group.WORLD, num_max_tokens_per_rank=16, seed=0)
    f = torch.compile(lambda x: moe(x) + 1, fullgraph=True, dynamic=True, backend=backend)
    start = time.perf_counter()
    try:
        f(_tokens(rank, 4, 0).requires_grad_(rank == 0))
    finally:
        seconds = time.perf_counter() - start
        moe.destroy()
    return None, seconds


CASES = [(f"{name}-{backend}", fn, backend) for backend in BACKENDS
         for name, fn in (("empty_rank", case_empty_rank), ("grad_on_one_rank", case_grad_on_one_rank))]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rank, world, report = join_group(args.out, GROUP_TIMEOUT_S)
    for name, fn, backend in CASES:
        code, message, ok, seconds = None, "", None, None
        start = time.perf_counter()
        try:
            ok, seconds = fn(backend, rank, world)
        except BaseException as err:  # noqa: BLE001 - the error IS the result
            code, message = _code(err), str(err)
        seconds = round(time.perf_counter() - start if seconds is None else seconds, 3)
        report({"case": name, "code": code, "message": message[:600], "seconds": seconds, "ok": ok})
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
