"""Transports: how routing and token rows move between ranks for dispatch and combine.

    pre-dispatch (MY buffer) --exchange_routing--> who sends which (token, slot) to whom
        --gather_rows--> my receive pool --experts--> --return_rows--> the SOURCE rank's combine slots

- ``local`` (``PeerMemoryTransport``, private memory): world size 1, copies inside my own buffer.
- ``symm`` (``PeerMemoryTransport``, shm files or CUDA symmetric memory): I PULL my experts' rows from every
  peer's buffer, and PUSH each result into its source's combine slots; a barrier after each step.
- ``a2a`` (``AllToAllTransport``, private memory): ``all_to_all_single`` (gloo on CPU, NCCL on GPU) of the
  counts, the entries and the rows, in both directions.

Both move the same entries in the same order, so the receive pool (and everything after it) is bitwise
the same whichever transport runs. An *entry* is one routed slot: ``(token_idx, slot_idx, local_expert)``
int64, and the entries a source sends to one destination are ordered by (local expert, token, slot); the
dispatcher's ``select`` function builds them from a ``topk_ids`` tensor, so both sides of a ``symm`` pull
compute them identically.

``make_transport`` builds the one ``EPOptions.transport`` names; ``auto`` is local for one
process; symm when every rank can map every peer's memory: one host with /dev/shm on CPU, CUDA symmetric
memory on GPU; a2a otherwise.

Shape legend: T tokens of this rank, K top-k, C cap, P receive-pool rows, Dx row width, N entries.
"""
from __future__ import annotations

import math
import socket
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from moe_ref.buffer import SymmetricBuffer
from moe_ref.capacity import CapacityPlan
from moe_ref.distributed import comm_device, group_size_and_rank
from moe_ref.errors import DistributedError, UnknownNameError
from moe_ref.options import TRANSPORTS

# (topk_ids_TK [T, K] int64 of a source rank, destination rank) -> entries [N, 3] int64
SelectFn = Callable[[torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class RoutingExchange:
    """Who sends what, agreed by ``exchange_routing``.

    Attributes:
        recv_entries: per source rank s, ``[N_s, 3]`` int64 ``(token_idx, slot_idx, local_expert)`` of the slots
            of s routed to my experts, ordered by (local expert, token, slot).
        send_entries: per destination rank r, ``[N_r, 3]`` int64, my slots routed to r's experts in the order
            they are sent (a2a only; None for peer-memory transports, which pull instead).
    """

    recv_entries: tuple[torch.Tensor, ...]
    send_entries: tuple[torch.Tensor, ...] | None = None


class Transport(ABC):
    """Moves routing and rows of one rank's ``SymmetricBuffer`` to and from its peers.

    Every method is collective over the group (all ranks call it, in the same order).
    """

    name = "abstract"

    def __init__(self, buffer: SymmetricBuffer):
        self.buffer = buffer
        self.rank, self.world_size = buffer.rank, buffer.world_size

    @abstractmethod
    def exchange_routing(self, select: SelectFn) -> RoutingExchange:
        """Agree on the entries each rank receives. Call after pre-dispatch filled my ``num_tokens``,
        ``x`` (+``x_scale``), ``topk_ids`` and ``topk_weights`` regions."""

    @abstractmethod
    def gather_rows(self, exchange: RoutingExchange, recv_pos: tuple[torch.Tensor, ...]) -> None:
        """Fill my pool: ``recv_x[recv_pos[s][i]] = x of source s at token recv_entries[s][i, 0]`` (and the
        scales with FP8 dispatch). ``recv_pos[s]`` is ``[N_s]`` int64."""

    @abstractmethod
    def return_rows(self, exchange: RoutingExchange, recv_pos: tuple[torch.Tensor, ...], y_PD: torch.Tensor) -> None:
        """Send each result row back: ``combine[slot, token]`` of the source = ``y_PD[recv_pos[s][i]]``. On
        return MY combine region holds every non-masked slot of my tokens."""

    def destroy(self) -> None:
        self.buffer.destroy()


class PeerMemoryTransport(Transport):
    """``symm`` (shm or CUDA symmetric memory) and ``local`` (one rank): peers' buffers are mapped here.

    Dispatch: barrier (my pre-dispatch is visible), then I read each peer's ``num_tokens`` and ``topk_ids``
    and pull the rows routed to my experts. Combine: I write results into the source's ``combine`` region,
    then barrier (every result has landed before any source reduces).
    """

    def __init__(self, buffer: SymmetricBuffer):
        super().__init__(buffer)
        if not buffer.is_symmetric:
            raise DistributedError(f"PeerMemoryTransport needs a symmetric buffer, got kind={buffer.kind!r}")
        self.name = "local" if self.world_size == 1 else "symm"

    def exchange_routing(self, select):
        self.buffer.barrier()
        recv = []
        for peer in range(self.world_size):
            num_tokens = int(self.buffer.peer_view(peer, "num_tokens")[0])  # NOTE: host sync
            recv.append(select(self.buffer.peer_view(peer, "topk_ids")[:num_tokens], self.rank))
        return RoutingExchange(tuple(recv))

    def gather_rows(self, exchange, recv_pos):
        has_scale = self.buffer.plan.dispatch_fp8
        recv_x = self.buffer.view("recv_x")
        recv_scale = self.buffer.view("recv_x_scale") if has_scale else None
        for peer, (entries, pos) in enumerate(zip(exchange.recv_entries, recv_pos)):
            if entries.shape[0] == 0:
                continue
            token_idx = entries[:, 0]
            recv_x[pos] = self.buffer.peer_view(peer, "x").index_select(0, token_idx)
            if has_scale:
                recv_scale[pos] = self.buffer.peer_view(peer, "x_scale").index_select(0, token_idx)

    def return_rows(self, exchange, recv_pos, y_PD):
        for peer, (entries, pos) in enumerate(zip(exchange.recv_entries, recv_pos)):
            if entries.shape[0]:
                combine_KCD = self.buffer.peer_view(peer, "combine")
                combine_KCD[entries[:, 1], entries[:, 0]] = y_PD.index_select(0, pos)
        self.buffer.barrier()


class AllToAllTransport(Transport):
    """``a2a``: peers cannot map each other; counts, entries and rows move with ``all_to_all_single``.

    Rows travel as raw bytes (``uint8`` views), so any dtype (bf16, fp8) crosses gloo and NCCL alike.
    Each source sends one row per routed slot (the simplest correct form; see DESIGN.md on traffic).
    """

    name = "a2a"

    def __init__(self, buffer: SymmetricBuffer, group):
        super().__init__(buffer)
        self.group = group
        self.device = comm_device(group, buffer.device)

    def _all_to_all(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Rows ``send [sum(send_counts), W]`` -> ``[sum(recv_counts), W]`` of the same dtype."""
        width = send.shape[1]
        recv = torch.empty(sum(recv_counts), width, dtype=send.dtype, device=self.device)
        dist.all_to_all_single(recv, send.to(self.device).contiguous(), output_split_sizes=recv_counts,
                               input_split_sizes=send_counts, group=self.group)
        return recv.to(self.buffer.device)

    def _all_to_all_bytes(self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Like ``_all_to_all`` but moves the raw bytes of each row (works for every dtype)."""
        row_shape = tuple(rows.shape[1:])
        row_bytes = math.prod(row_shape) * rows.element_size()
        raw = rows.contiguous().view(torch.uint8).reshape(rows.shape[0], row_bytes)
        received = self._all_to_all(raw, send_counts, recv_counts)
        return received.view(rows.dtype).reshape(sum(recv_counts), *row_shape)

    def exchange_routing(self, select):
        num_tokens = int(self.buffer.view("num_tokens")[0])
        my_ids_TK = self.buffer.view("topk_ids")[:num_tokens]
        send = tuple(select(my_ids_TK, peer) for peer in range(self.world_size))
        send_counts = [entries.shape[0] for entries in send]
        counts = torch.tensor(send_counts, dtype=torch.int64, device=self.device)
        recv_counts_R = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts_R, counts, group=self.group)
        recv_counts = recv_counts_R.tolist()  # NOTE: host sync
        flat = self._all_to_all(torch.cat(send), send_counts, recv_counts)
        return RoutingExchange(tuple(torch.split(flat, recv_counts)), send)

    def gather_rows(self, exchange, recv_pos):
        send_counts = [e.shape[0] for e in exchange.send_entries]
        recv_counts = [e.shape[0] for e in exchange.recv_entries]
        send_token_idx = torch.cat([e[:, 0] for e in exchange.send_entries])
        all_pos = torch.cat(recv_pos)
        regions = [("x", "recv_x")] + ([("x_scale", "recv_x_scale")] if self.buffer.plan.dispatch_fp8 else [])
        for src_name, dst_name in regions:
            rows = self.buffer.view(src_name).index_select(0, send_token_idx)
            self.buffer.view(dst_name)[all_pos] = self._all_to_all_bytes(rows, send_counts, recv_counts)

    def return_rows(self, exchange, recv_pos, y_PD):
        send_counts = [e.shape[0] for e in exchange.send_entries]
        recv_counts = [e.shape[0] for e in exchange.recv_entries]
        back = self._all_to_all_bytes(y_PD.index_select(0, torch.cat(recv_pos)), recv_counts, send_counts)
        sent = torch.cat(exchange.send_entries)
        self.buffer.view("combine")[sent[:, 1], sent[:, 0]] = back


# --- choosing a transport ------------------------------------------------------------------------------------

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


def make_transport(name: str | None, plan: CapacityPlan, group=None, device: torch.device | str = "cpu") -> Transport:
    """Allocate the buffer for ``plan`` and the transport that moves it (collective over ``group``).

    Args:
        name: ``auto``, ``local``, ``symm`` or ``a2a`` (``EPOptions.transport``, already resolved).
        plan: the buffer plan (same on every rank; checked: CAP002).
        group: the EP process group, or None for one process.
        device: ``cpu`` (gloo, shm) or a CUDA device (NCCL, CUDA symmetric memory).

    Returns:
        A ``Transport`` owning its ``SymmetricBuffer``. ``symm`` raises ``DistributedError`` (ENV003) on every
        rank when peers cannot be mapped; ``auto`` then falls back to ``a2a`` on every rank.
    """
    if name not in TRANSPORTS:
        raise UnknownNameError(f"transport={name!r}; supported: {', '.join(TRANSPORTS)}")
    device = torch.device(device)
    world, _ = group_size_and_rank(group)
    if world == 1:
        return PeerMemoryTransport(SymmetricBuffer(plan, group, kind="private", device=device))
    if name == "local":
        raise DistributedError(f"transport='local' runs one process, but the group has {world} ranks; use "
                               f"'auto', 'symm' or 'a2a'")
    if name == "a2a":
        return AllToAllTransport(SymmetricBuffer(plan, group, kind="private", device=device), group)
    kind = "cuda" if device.type == "cuda" else "shm"
    if name == "auto" and not (_same_host(group) and (kind == "shm" or _symm_cuda_importable())):
        return AllToAllTransport(SymmetricBuffer(plan, group, kind="private", device=device), group)
    try:
        return PeerMemoryTransport(SymmetricBuffer(plan, group, kind=kind, device=device))
    except DistributedError:
        if name == "symm":
            raise
    return AllToAllTransport(SymmetricBuffer(plan, group, kind="private", device=device), group)
