"""The ``a2a`` transport: peers cannot map each other, so routing and rows move with ``all_to_all_single``
(gloo on CPU, NCCL on GPU), driven from the host.

It fills the same regions of a private buffer as the ``symm`` transport does in place, with the same shared
torch functions (``receive_layout_ref``, ``receive_rows_ref``, ``weighted_partials_ref``, ``sum_partials_ref``),
so both transports give bitwise-identical pools and outputs:

    pre-dispatch (my send regions)
    -> all_to_all [R, e + 2]: my slots per (rank, expert), my T, my tokens per rank          (host sync: .tolist())
    -> all_to_all per token sent: (token, ids, slot ranks, weights) and its row ONCE per destination rank
    -> receive layout + rows expanded into my pool
    experts
    -> partials: ONE row per (source, token) on the owner -> all_to_all back -> my combine_partial[owner, token]
    -> reduce (owners in rank order)
    batch-invariant combine instead: every live slot row on the owner, unweighted -> ONE all_to_all back -> my
    combine_slots[token, slot] -> sum_slots (slots in order, fp32)

Rows travel as raw bytes (``uint8`` views), so any dtype (bf16, fp8) crosses gloo and NCCL alike.

Shape legend: T tokens of this rank, K top-k, Dx expert input width, Db = ceil(Dx/128), e local experts,
R EP ranks, U tokens exchanged with one rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_ref.kernels.runtime import ops
from moe_ref.ep.buffer import SymmetricBuffer
from moe_ref.ep.capacity import CapacityPlan
from moe_ref.ep.dispatch import DispatchHandle, Dispatcher
from moe_ref.kernels.ep.ep_combine import slot_owners_TR, sum_partials_ref, weighted_partials_ref
from moe_ref.kernels.ep.ep_combine_slots import slot_rows_of_tokens
from moe_ref.kernels.ep.ep_dispatch import receive_layout_ref, receive_rows_ref
from moe_ref.kernels.ep.ep_regions import PeerBuffers
from moe_ref.kernels.ep.symm_signal import check_ep_status


@dataclass(frozen=True)
class Routes:
    """Who exchanged which tokens in one chunk (the a2a handle's ``routes``).

    Attributes:
        sent: per destination rank r, ``[U_r]`` int64 my tokens with >= 1 slot on r (ascending).
        received: per source rank s, ``[U_s]`` int64 tokens of s with >= 1 slot on my experts (ascending).
    """

    sent: tuple[torch.Tensor, ...]
    received: tuple[torch.Tensor, ...]

    @property
    def send_counts(self) -> list[int]:
        return [t.numel() for t in self.sent]

    @property
    def recv_counts(self) -> list[int]:
        return [t.numel() for t in self.received]


class AllToAllDispatcher(Dispatcher):
    """Dispatch/combine with collectives over a private buffer laid out like the symmetric one.

    Args:
        plan: the buffer plan. buffer: a private buffer of ``plan``. group: the EP process group.
    """

    transport_name = "a2a"

    def __init__(self, plan: CapacityPlan, buffer: SymmetricBuffer, group):
        super().__init__(plan, buffer, group)
        # pre-dispatch writes only MY send regions without post/wait, so every "peer" may be my own buffer
        self._mine_only = PeerBuffers.from_tensors(self.rank, [buffer.view_bytes()] * self.world_size)
        self._pre_dispatch = ops.ep_ops(buffer.device).pre_dispatch

    # --- collectives ---------------------------------------------------------------------------------------
    def _all_to_all(self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Rows ``[sum(send_counts), ...]`` of any dtype -> ``[sum(recv_counts), ...]``, moved as raw bytes."""
        row_shape = tuple(rows.shape[1:])
        row_bytes = math.prod(row_shape) * rows.element_size()
        raw = rows.contiguous().view(torch.uint8).reshape(rows.shape[0], row_bytes)
        received = torch.empty(sum(recv_counts), row_bytes, dtype=torch.uint8, device=self._comm_device)
        dist.all_to_all_single(received, raw.to(self._comm_device), output_split_sizes=recv_counts,
                               input_split_sizes=send_counts, group=self.group)
        return received.to(self.device).view(rows.dtype).reshape(sum(recv_counts), *row_shape)

    # --- steps ---------------------------------------------------------------------------------------------
    def _pre_dispatch_and_exchange(self, x_TD, topk_ids_TK, topk_weights_TK):
        view, regions = self.buffer.view, self.regions
        R, e, K = self.world_size, self.num_local_experts, regions.num_topk
        self._pre_dispatch(x_TD, topk_ids_TK, topk_weights_TK, self._mine_only, regions)
        num_tokens = x_TD.shape[0]
        to_rank_TR = slot_owners_TR(topk_ids_TK, e, R)
        sent = tuple(to_rank_TR[:, r].nonzero().flatten() for r in range(R))
        send_counts = [t.numel() for t in sent]
        header_R = torch.cat([view("send_count").to(torch.int64),
                              torch.tensor([[num_tokens, n] for n in send_counts], device=self.device)], dim=1)
        header_R = self._all_to_all(header_R, [1] * R, [1] * R)  # row s: source s's counts for me, T_s, U_s
        src_num_tokens, recv_counts = header_R[:, e:].t().tolist()  # NOTE: host sync
        # routing of each token sent, one row per (token, destination): token, ids, slot ranks, weight bits
        send_token_U = torch.cat(sent)
        meta_U = torch.cat([send_token_U[:, None], topk_ids_TK[send_token_U], view("slot_rank")[send_token_U].long(),
                            topk_weights_TK[send_token_U].view(torch.int32).long()], dim=1)
        meta_U = self._all_to_all(meta_U, send_counts, recv_counts)
        rows = [self._all_to_all(view(name)[send_token_U], send_counts, recv_counts)
                for name in (("x", "x_scale") if regions.fp8 else ("x",))]
        my = self.buffer.view_bytes()
        recv_base_Re = receive_layout_ref(my, regions, header_R[:, e].to(torch.int32), header_R[:, :e])
        self.num_recv_tokens_per_expert.add_(view("num_rows"))
        received, start = [], 0
        for src, (count, num_src_tokens) in enumerate(zip(recv_counts, src_num_tokens)):
            part = slice(start, start + count)
            token_U = meta_U[part, 0]
            view("recv_pos")[src, :num_src_tokens] = -1  # tokens of src not sent here have no slot here
            receive_rows_ref(my, regions, self.rank, src, recv_base_Re, token_U,
                             torch.ones(count, dtype=torch.bool, device=self.device), meta_U[part, 1:1 + K],
                             meta_U[part, 1 + K:1 + 2 * K], meta_U[part, 1 + 2 * K:].to(torch.int32).view(torch.float32),
                             rows[0][part], rows[1][part] if regions.fp8 else None)
            received.append(token_U)
            start += count
        check_ep_status(self._mine_only, regions)  # a pool overflow (INP005) recorded by the layout
        return Routes(sent, tuple(received))

    def _return_partials(self, y_PD, handle: DispatchHandle) -> None:
        view, routes = self.buffer.view, handle.routes
        parts = []
        for src, token_U in enumerate(routes.received):
            live_U = torch.ones(token_U.numel(), dtype=torch.bool, device=self.device)
            part_UD, _ = weighted_partials_ref(y_PD, view("recv_pos")[src][token_U], view("recv_weight")[src][token_U],
                                               live_U, self.plan.activation_dtype)
            parts.append(part_UD)
        back = self._all_to_all(torch.cat(parts), routes.recv_counts, routes.send_counts)
        partial_RCD, start = view("combine_partial"), 0
        for owner, token_U in enumerate(routes.sent):
            partial_RCD[owner, token_U] = back[start:start + token_U.numel()]
            start += token_U.numel()

    def _return_slot_rows(self, y_PD, handle: DispatchHandle) -> None:
        # ONE all_to_all of exactly the live slot rows: to source s, its tokens on my experts in order, each
        # token's slots here in order; the source knows which of its slots each owner holds from its own ids, so
        # it scatters them back in the same order with no counts exchanged
        view, routes, e = self.buffer.view, handle.routes, self.num_local_experts
        parts = [slot_rows_of_tokens(y_PD, view("recv_pos")[src][token_U]) for src, token_U in
                 enumerate(routes.received)]
        ids_TK = view("topk_ids")[:handle.num_tokens]
        owner_TK = torch.where(ids_TK >= 0, ids_TK // e, -1)
        recv_counts = torch.bincount(owner_TK[owner_TK >= 0], minlength=self.world_size).tolist()  # NOTE: host sync
        back = self._all_to_all(torch.cat(parts), [part.shape[0] for part in parts], recv_counts)
        slots_TKDx, start = view("combine_slots")[:handle.num_tokens], 0
        for owner, count in enumerate(recv_counts):
            slots_TKDx[owner_TK == owner] = back[start:start + count]
            start += count

    def _reduce(self, num_tokens):
        return sum_partials_ref(self.buffer.view("topk_ids")[:num_tokens], self.buffer.view("combine_partial"),
                                self.num_local_experts, self.plan.activation_dtype)
