"""One code path for a benchmark's ranks under torchrun (a process group) and for one plain process (world 1,
``group=None``: the ``local`` transport, no barrier, no collective), as scripts/bench_layer.py and profile_step.py run.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from moe_ref.core.config import MoEConfig
from moe_ref.ep.distributed import group_size_and_rank


def distributed() -> bool:
    """True when this process is in a process group (torchrun); False for one plain process."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def barrier() -> None:
    """A barrier over the ranks; nothing at world 1."""
    if distributed():
        dist.barrier()


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None) -> None:
    """``dist.all_to_all_single``; with no group (one process) every row stays here: a copy."""
    if group is None:
        output.copy_(input)
    else:
        dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group)


def all_ok(flag: bool, device) -> bool:
    """True when every rank passes True (so all ranks skip a broken path together); ``flag`` at world 1."""
    if not distributed():
        return flag
    tensor = torch.tensor([0 if flag else 1], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item()) == 0


def gather_floats(value: float, device) -> list[float]:
    """``value`` of every rank, in rank order; ``[value]`` at world 1."""
    if not distributed():
        return [value]
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor)
    return [float(t.item()) for t in out]


def init_ranks(args, name: str, timeout: timedelta):
    """This process's GPU, its group and the benchmark's MoE block: ``(device, group, rank, world, cfg)``.

    Under torchrun (``WORLD_SIZE`` set) the NCCL group over every rank; without it one plain process on GPU 0:
    ``group=None``, rank 0, world 1 (the ``local`` transport)."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{name}: needs a CUDA GPU and torch sees none (torch {torch.__version__}, CUDA build "
                         f"{torch.version.cuda or 'none'}); --help works anywhere")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    group = None
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
        group = dist.group.WORLD
    world, _ = group_size_and_rank(group)
    cfg = MoEConfig(num_experts=args.num_experts, num_topk=args.num_topk, hidden_size=args.hidden,
                    intermediate_size=args.intermediate, name=name)
    return device, group, rank(), world, cfg


def finish_ranks() -> None:
    """The end of what ``init_ranks`` started: a last barrier and the group torn down (nothing at world 1)."""
    if distributed():
        dist.barrier()
        dist.destroy_process_group()
