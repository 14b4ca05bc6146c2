"""Choosing a transport: which ``Dispatcher`` moves this EP group's rows, and the buffer it gets.

The transports are the rows of ``moe_ref.ep.options.TRANSPORTS`` (name -> dispatcher class, buffer kind, summary):
the one list that the options check names against, this factory builds from and the command line offers.

| ``EPOptions.transport`` | dispatcher                                  | buffer                                  |
|-------------------------|---------------------------------------------|-----------------------------------------|
| ``local``               | ``SymmDispatcher`` (one rank)               | private                                 |
| ``symm``                | ``SymmDispatcher``                          | CUDA symmetric memory, or shm on CPU    |
| ``a2a``                 | ``AllToAllDispatcher``                      | private                                 |
| ``auto``                | local for one rank; symm when every rank can map every peer's memory (one host, /dev/shm on CPU, CUDA symmetric memory on GPU); a2a otherwise |

With one rank every name builds ``local``. A new transport is a ``Dispatcher`` subclass (``moe_ref.ep.dispatch``) and
one row of ``TRANSPORTS``.
"""
from __future__ import annotations

import importlib
import socket

import torch
import torch.distributed as dist

from moe_ref.ep.buffer import acquire_buffer
from moe_ref.ep.capacity import CapacityPlan
from moe_ref.core.config import MoEConfig
from moe_ref.ep.dispatch import Dispatcher
from moe_ref.ep.distributed import group_size_and_rank
from moe_ref.core.errors import DistributedError, UnknownNameError
from moe_ref.ep.options import TRANSPORTS, EPOptions


def _same_host(group) -> bool:
    """Collective: do all ranks of ``group`` run on one host (same hostname)?"""
    world, _ = group_size_and_rank(group)
    hosts: list = [None] * world
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return len(set(hosts)) == 1


def _symm_cuda_importable() -> bool:
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
        return True
    except ImportError:
        return False


def make_dispatcher(cfg: MoEConfig, group, options: EPOptions) -> Dispatcher:
    """Plan, allocate and connect the dispatcher ``options.transport`` names (collective over ``group``).

    Args:
        cfg: the MoE block (``E`` must divide by the group size: CFG002).
        group: the EP process group, or None for one process.
        options: resolved options; uses the cap, transport, dtype, device, ``dispatch_fp8``, ``pool_format``,
            ``batch_invariant`` (its plan's ``combine_slots``) and
            ``alignment`` (which must be set: ``EPOptions.resolve`` sets it from the experts backend).

    Returns:
        A ``Dispatcher`` using the EP group's shared buffer for this plan (``buffer.acquire_buffer``: every MoE
        layer of a model with the same plan uses one). Raises ``CapacityMismatchError`` (CAP002) on every rank if the caps
        differ, ``MemoryBudgetError`` (CAP004) on every rank if a rank cannot hold the buffer; ``symm`` raises
        ``DistributedError`` (ENV003) on every rank when peers cannot be mapped, where ``auto`` falls back to
        ``a2a`` on every rank.
    """
    name, device = options.transport, torch.device(options.device)
    if name not in TRANSPORTS:
        raise UnknownNameError(f"transport={name!r}; supported: {', '.join(TRANSPORTS)}")
    world, _ = group_size_and_rank(group)
    plan = CapacityPlan.build(cfg, world, options.num_max_tokens_per_rank, options.dtype, options.dispatch_fp8,
                              options.alignment, options.pool_format, options.batch_invariant)
    if world == 1:
        return _build("local", plan, group, device)
    if TRANSPORTS[name].one_rank:
        many = ", ".join(repr(n) for n, t in TRANSPORTS.items() if not t.one_rank)
        raise DistributedError(f"transport={name!r} runs one process, but the group has {world} ranks; use {many}")
    if name != "auto":
        return _build(name, plan, group, device)
    if _same_host(group) and (device.type == "cpu" or _symm_cuda_importable()):
        try:
            return _build("symm", plan, group, device)
        except DistributedError:
            pass  # peers cannot be mapped here: fall back to the collectives' transport
    return _build("a2a", plan, group, device)


def _build(name: str, plan: CapacityPlan, group, device: torch.device) -> Dispatcher:
    """The dispatcher of ``TRANSPORTS[name]`` over the group's shared buffer of its kind (collective)."""
    transport = TRANSPORTS[name]
    kind = ("cuda" if device.type == "cuda" else "shm") if transport.symmetric_buffer else "private"
    module_name, class_name = transport.dispatcher.split(":")
    dispatcher_class = getattr(importlib.import_module(module_name), class_name)
    return dispatcher_class(plan, acquire_buffer(plan, group, kind=kind, device=device), group)
