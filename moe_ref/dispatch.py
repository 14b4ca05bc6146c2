"""Dispatch and combine of an expert-parallel MoE layer, over any transport; ``Dispatcher.run`` is the
routed step of the layer.

    x_TD, topk_ids_TK, topk_weights_TK (this rank's tokens)
      1. overflow policy: max rows over the EP group vs the cap -> error (CAP001 on every rank) | n chunks
      per chunk:
      2. pre-dispatch   (kernels.pre_dispatch)  my rows, ids, weights -> MY buffer's send regions
      3. dispatch       (Transport)             entries per (source, local expert); my experts' rows -> my
                                                receive pool, expert-major, segments aligned, ordered by
                                                (source rank, token, slot); receive metadata (src, token, slot)
      4. experts        (Experts.__call__)      the used prefix of the pool -> result rows (an FP8 pool goes as
                                                is to backends with ``accepts_fp8_input``, dequantized to the others)
      5. combine        (Transport)             each result row -> the SOURCE rank's combine[slot, token]
      6. reduce         (kernels.combine_reduce) y[t] = sum_j w[t, j] * combine[j, t], fp32, slot order 0..K-1
      -> routed_TD [T, Dx]

Global expert e lives on rank ``e // e_local``. Masked slots (id -1) are never sent, counted or read.
The pool order is a pure function of every rank's ``topk_ids``, so both transports fill the pool
identically and give bitwise-identical results.

NOTE: backends with ``Experts.computes_whole_segments`` (the torch loop) get whole aligned segments
(``Dispatcher.whole_segment_layout``): the padding rows are zeroed, so their outputs are zero (gated MLPs
without bias map 0 to 0) and are never sent back. Every expert GEMM then has a multiple of ``alignment``
rows, which keeps each row's result independent of how many rows share its expert: MKL's CPU GEMM takes
another code path for small row counts (1-3, 5-7, 9-11 measured), so without this a chunked run would
differ from an unchunked one in the last bit. With the default alignment (128) chunked and unchunked runs
agree bitwise with the torch expert backend. GPU backends skip the padding instead (zeroing it would
write ~e * 127 rows per call, which dominates decode), and plan the pool with their own, smaller
``Experts.segment_alignment`` (triton: 1, no padding rows at all).

NOTE: the experts get only the used prefix of the pool, ``recv_x[:R]`` with R the aligned end of the last
segment (``ExpertLayout.num_pool_rows``; a host int from the one sync ``place_entries`` already makes), not
all P rows the plan reserves for the worst case: at decode P is ~20x the routed rows, and a backend's
output of P rows would be allocated and zeroed on every call.

Shape legend: T tokens of this rank, K top-k, Dx expert input width (hidden, or latent for Kimi-K3),
E experts, e local experts, R EP ranks, C cap, P receive-pool rows, N routed entries.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_ref.buffer import comm_device
from moe_ref.capacity import CapacityPlan, group_max, num_chunks_for, resolve_cap, resolve_overflow
from moe_ref.config import MoEConfig
from moe_ref.errors import CapacityExceededError, DTypeError, ExpertIdError, ShapeError
from moe_ref.experts import ExpertLayout, Experts
from moe_ref.transport import RoutingExchange, Transport, make_transport

# --- layout (pure functions of topk ids) ------------------------------------------------------------------


def select_entries(topk_ids_TK: torch.Tensor, first_expert: int, num_local_experts: int) -> torch.Tensor:
    """The slots of ``topk_ids_TK`` routed to experts ``[first_expert, first_expert + e)``.

    Args:
        topk_ids_TK: ``[T, K]`` int64 global expert ids, -1 = masked (never selected).
        first_expert, num_local_experts: the destination rank's expert block.

    Returns:
        ``entries_N3``: ``[N, 3]`` int64 rows ``(token_idx, slot_idx, local_expert)``, ordered by
        (local expert, token, slot).

    Example: ids [[2, 0], [1, 3]], block [2, 4) -> [[0, 0, 0], [1, 1, 1]].
    """
    live_TK = (topk_ids_TK >= first_expert) & (topk_ids_TK < first_expert + num_local_experts)
    token_idx_N, slot_idx_N = live_TK.nonzero(as_tuple=True)  # row-major: ordered by (token, slot)
    local_N = topk_ids_TK[token_idx_N, slot_idx_N] - first_expert
    order_N = torch.sort(local_N, stable=True).indices
    return torch.stack([token_idx_N, slot_idx_N, local_N], dim=1)[order_N]


@dataclass(frozen=True)
class SendLayout:
    """Where this rank's routed slots go: the source-side view of a dispatch (the a2a transport sends its
    rows in exactly this order; the symm transport's receivers pull them in it).

    Attributes:
        num_rows_Re: ``[R, e]`` int64, non-masked slots per (destination rank, local expert).
        psum_rows_Re: ``[R, e]`` int64, exclusive prefix sum of ``num_rows_Re`` in (rank, expert) order: the
            first entry of each (rank, expert) block.
        token_idx_N: ``[N]`` int64, the token of each entry; entries ordered by (rank, expert, token, slot).
        slot_idx_N: ``[N]`` int64, the top-k slot of each entry.
    """

    num_rows_Re: torch.Tensor
    psum_rows_Re: torch.Tensor
    token_idx_N: torch.Tensor
    slot_idx_N: torch.Tensor


def pre_dispatch_layout(topk_ids_TK: torch.Tensor, ep_size: int, num_local_experts: int) -> SendLayout:
    """Per (destination rank, local expert) row counts, offsets and slot indices of ``topk_ids_TK``.

    Args:
        topk_ids_TK: ``[T, K]`` int64 global expert ids, -1 = masked (skipped).
        ep_size: R, ranks of the EP group (global expert e lives on rank ``e // num_local_experts``).
        num_local_experts: e.

    Returns:
        ``SendLayout``. Example: ids [[2, 0], [3, -1]], R=2, e=2 -> num_rows_Re [[1, 0], [1, 1]],
        psum_rows_Re [[0, 1], [1, 2]], token_idx_N [0, 0, 1], slot_idx_N [1, 0, 0].
    """
    token_idx_N, slot_idx_N = (topk_ids_TK >= 0).nonzero(as_tuple=True)
    expert_N = topk_ids_TK[token_idx_N, slot_idx_N]
    order_N = torch.sort(expert_N, stable=True).indices  # global id = rank * e + local: (rank, expert) order
    num_rows_Re = torch.bincount(expert_N, minlength=ep_size * num_local_experts).view(ep_size, num_local_experts)
    flat = num_rows_Re.reshape(-1)
    psum_rows_Re = (torch.cumsum(flat, 0) - flat).view(ep_size, num_local_experts)
    return SendLayout(num_rows_Re, psum_rows_Re, token_idx_N[order_N], slot_idx_N[order_N])


def place_entries(recv_entries: tuple[torch.Tensor, ...], num_local_experts: int, alignment: int,
                  num_pool_rows: int) -> tuple[ExpertLayout, tuple[torch.Tensor, ...]]:
    """Pool positions of the received entries: expert-major, each expert segment aligned, and inside a
    segment ordered by (source rank, token, slot).

    Args:
        recv_entries: per source rank, ``[N_s, 3]`` from ``select_entries`` (ordered by expert, token, slot).
        num_local_experts: e.
        alignment: rows each segment starts on.
        num_pool_rows: P, rows of the pool.

    Returns:
        layout: ``ExpertLayout`` of the e segments (``num_rows_e`` counts the received rows); its
            ``num_pool_rows`` is the used prefix: the aligned end of the last segment (<= P).
        recv_pos: per source rank, ``[N_s]`` int64 pool row of each entry.

    Example: e=2, alignment 4, source 0 sends experts [0, 1], source 1 sends [0]
        -> segment 0 = rows 0 (src 0), 1 (src 1); segment 1 starts at 4 -> recv_pos ([0, 4], [1]).
    """
    device = recv_entries[0].device
    counts_Re = torch.stack([torch.bincount(e[:, 2], minlength=num_local_experts) for e in recv_entries])
    layout = ExpertLayout.from_counts(counts_Re.sum(0), alignment)  # segments back to back; NOTE: host sync
    used = layout.num_pool_rows
    if used > num_pool_rows:
        raise ExpertIdError(f"the received rows need {used} pool rows but the pool has {num_pool_rows}: a token "
                            f"picked the same expert twice (each token must route to distinct experts)")
    before_src_Re = torch.cumsum(counts_Re, 0) - counts_Re  # rows of lower source ranks in each segment
    recv_pos = []
    for src, entries in enumerate(recv_entries):
        local_N = entries[:, 2]
        first_entry_e = torch.cumsum(counts_Re[src], 0) - counts_Re[src]  # entries are grouped by expert
        within_N = torch.arange(entries.shape[0], device=device) - first_entry_e[local_N]
        recv_pos.append(layout.row_start_e[local_N] + before_src_Re[src, local_N] + within_N)
    return layout, tuple(recv_pos)


def zero_padding_rows(layout: ExpertLayout, pools: list[torch.Tensor]) -> ExpertLayout:
    """Zero the alignment padding of every segment in ``pools`` (``[P, ...]`` tensors) and return the layout
    whose segments cover it (what the experts compute).

    Example: starts [0, 4], counts [3, 1], alignment 4 -> rows 3, 5, 6, 7 zeroed; compute counts [4, 4].
    """
    aligned_e = (layout.num_rows_e + layout.alignment - 1) // layout.alignment * layout.alignment
    pad_e = aligned_e - layout.num_rows_e
    num_pad = int(pad_e.sum())  # NOTE: host sync
    if num_pad:
        first_pad_e = layout.row_start_e + layout.num_rows_e
        before_e = torch.cumsum(pad_e, 0) - pad_e
        seg_N = torch.repeat_interleave(torch.arange(pad_e.numel(), device=pad_e.device), pad_e)
        rows_N = first_pad_e[seg_N] + torch.arange(num_pad, device=pad_e.device) - before_e[seg_N]
        for pool in pools:
            pool[rows_N] = 0
    return ExpertLayout(layout.row_start_e, aligned_e, layout.num_pool_rows, layout.alignment)


def check_topk_ids(topk_ids_TK: torch.Tensor, num_experts: int) -> str | None:
    """A description of what is wrong with ``topk_ids_TK`` (ids outside ``[-1, E)``, or one token picking an
    expert twice), or None. NOTE: syncs the host."""
    if topk_ids_TK.numel() == 0:
        return None
    low, high = int(topk_ids_TK.min()), int(topk_ids_TK.max())
    if low < -1 or high >= num_experts:
        return f"topk ids span [{low}, {high}], outside [-1, {num_experts}) (-1 = masked slot)"
    sorted_TK = topk_ids_TK.sort(dim=1).values
    dup_T = ((sorted_TK[:, 1:] == sorted_TK[:, :-1]) & (sorted_TK[:, 1:] >= 0)).any(dim=1)
    if bool(dup_T.any()):
        token = int(dup_T.nonzero()[0, 0])
        return f"token {token} picks an expert twice: ids {topk_ids_TK[token].tolist()}"
    return None


# --- the handle ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DispatchHandle:
    """What ``dispatch`` produced and ``combine`` consumes (one chunk). Tensors are views into the buffer,
    valid until the next ``dispatch`` of the same dispatcher.

    Attributes:
        num_tokens: T, rows of this rank in this chunk.
        topk_ids_TK: ``[T, K]`` int64 (view of my ``topk_ids`` region), -1 = masked.
        topk_weights_TK: ``[T, K]`` fp32 (view of my ``topk_weights`` region).
        recv_x_PD: ``[P, Dx]`` the receive pool (activation dtype, or fp8 with FP8 dispatch); rows outside
            the segments of ``layout`` hold stale data, and rows from ``layout.num_pool_rows`` on are unused.
        recv_x_scale_PDb: ``[P, ceil(Dx/128)]`` fp32 scales of the pool (FP8 dispatch), else None.
        recv_src_P3: ``[P, 3]`` int32 ``(source rank, token, slot)`` of each pool row, -1 on padding rows.
        layout: the local experts' segments in the pool (``num_rows_e`` = rows received; ``num_pool_rows`` =
            the used prefix, the aligned end of the last segment).
        recv_pos: per source rank, ``[N_s]`` int64 pool rows of the entries received from it.
        exchange: the agreed entries (see ``RoutingExchange``).
    """

    num_tokens: int
    topk_ids_TK: torch.Tensor
    topk_weights_TK: torch.Tensor
    recv_x_PD: torch.Tensor
    recv_x_scale_PDb: torch.Tensor | None
    recv_src_P3: torch.Tensor
    layout: ExpertLayout
    recv_pos: tuple[torch.Tensor, ...]
    exchange: RoutingExchange

    @property
    def num_recv_rows(self) -> int:
        """Rows received from all ranks (non-masked slots routed to my experts)."""
        return sum(int(p.numel()) for p in self.recv_pos)


# --- the dispatcher ------------------------------------------------------------------------------------------

class Dispatcher:
    """Dispatch/combine of one EP group over one transport; ``run`` is the whole routed step.

    One process (group None or world size 1) is the base case: the ``local`` transport copies inside its
    own buffer. Build with ``make_dispatcher``.

    Attributes:
        plan: the buffer plan. rank, world_size: in the EP group. num_local_experts: e.
        first_local_expert: global id of my first expert (``rank * e``). transport_name: local, symm or a2a.
        overflow: ``"error"`` or ``"chunk"``.
        num_recv_tokens_per_expert: ``[e]`` int64 (a view of the buffer's counter), rows my experts received
            over all calls (non-masked slots; what expert load balancers read).
    """

    def __init__(self, plan: CapacityPlan, transport: Transport, group=None, *, overflow: str = "error"):
        self.plan, self.transport, self.group = plan, transport, group
        self.overflow = resolve_overflow(overflow)
        self.rank, self.world_size = transport.rank, transport.world_size
        self.num_local_experts = plan.num_local_experts
        self.first_local_expert = self.rank * self.num_local_experts
        self.buffer = transport.buffer
        self._comm_device = comm_device(group, self.buffer.device)

    @property
    def transport_name(self) -> str:
        return self.transport.name

    @property
    def num_recv_tokens_per_expert(self) -> torch.Tensor:
        return self.buffer.view("num_recv_tokens_per_expert")

    # --- checks ----------------------------------------------------------------------------------------
    def _check_inputs(self, x_TD, topk_ids_TK, topk_weights_TK) -> None:
        plan = self.plan
        dim, topk = plan.cfg.expert_hidden_size, plan.cfg.num_topk
        if x_TD.dim() != 2 or x_TD.shape[1] != dim:
            raise ShapeError(f"x_TD has shape {tuple(x_TD.shape)}; expected [T, {dim}] (the expert input width of "
                             f"{plan.cfg.name})")
        num_tokens = x_TD.shape[0]
        if tuple(topk_ids_TK.shape) != (num_tokens, topk) or tuple(topk_weights_TK.shape) != (num_tokens, topk):
            raise ShapeError(f"topk ids {tuple(topk_ids_TK.shape)} and weights {tuple(topk_weights_TK.shape)} must "
                             f"both be [T={num_tokens}, K={topk}]")
        if x_TD.dtype != plan.activation_dtype:
            raise DTypeError(f"x_TD has dtype {x_TD.dtype}; this dispatcher was planned for {plan.activation_dtype} "
                             f"(pass activation_dtype=... to make_dispatcher)")
        if topk_ids_TK.dtype != torch.int64 or topk_weights_TK.dtype != torch.float32:
            raise DTypeError(f"topk ids must be int64 and weights float32, got {topk_ids_TK.dtype} and "
                             f"{topk_weights_TK.dtype}")

    # --- one chunk -------------------------------------------------------------------------------------
    def dispatch(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor) -> DispatchHandle:
        """Pre-dispatch my rows and pull my experts' rows from every rank (collective; one chunk).

        Args:
            x_TD: ``[T, Dx]`` activation dtype, T <= cap (``run`` splits larger batches).
            topk_ids_TK: ``[T, K]`` int64 global expert ids, -1 = masked slot.
            topk_weights_TK: ``[T, K]`` fp32.

        Returns:
            ``DispatchHandle`` with the receive pool and its layout. Adds the received rows per local expert
            to ``num_recv_tokens_per_expert``. Raises ``CapacityExceededError`` (CAP001, on this rank only)
            when T > cap: use ``run`` for the group-wide policy.
        """
        self._check_inputs(x_TD, topk_ids_TK, topk_weights_TK)
        num_tokens, cap = x_TD.shape[0], self.plan.num_max_tokens_per_rank
        if num_tokens > cap:
            raise CapacityExceededError(
                f"dispatch() got num_tokens={num_tokens} rows on rank {self.rank}, above num_max_tokens_per_rank="
                f"{cap}; call run() (overflow policy) or raise the cap (MOE_REF_NUM_MAX_TOKENS_PER_RANK)",
                rank=self.rank, num_tokens=num_tokens, cap=cap)
        self._pre_dispatch(x_TD, topk_ids_TK, topk_weights_TK)
        num_local = self.num_local_experts

        def select(ids_TK: torch.Tensor, dst: int) -> torch.Tensor:
            return select_entries(ids_TK, dst * num_local, num_local)

        exchange = self.transport.exchange_routing(select)
        layout, recv_pos = place_entries(exchange.recv_entries, num_local, self.plan.alignment, self.plan.num_pool_rows)
        recv_src_P3 = self.buffer.view("recv_src")
        recv_src_P3.fill_(-1)
        for src, (entries, pos) in enumerate(zip(exchange.recv_entries, recv_pos)):
            recv_src_P3[pos, 0] = src
            recv_src_P3[pos, 1:] = entries[:, :2].to(torch.int32)
        self.transport.gather_rows(exchange, recv_pos)
        self.num_recv_tokens_per_expert.add_(layout.num_rows_e)
        return DispatchHandle(
            num_tokens=num_tokens, topk_ids_TK=self.buffer.view("topk_ids")[:num_tokens],
            topk_weights_TK=self.buffer.view("topk_weights")[:num_tokens], recv_x_PD=self.buffer.view("recv_x"),
            recv_x_scale_PDb=self.buffer.view("recv_x_scale") if self.plan.dispatch_fp8 else None,
            recv_src_P3=recv_src_P3, layout=layout, recv_pos=recv_pos,
            exchange=exchange)

    def _pre_dispatch(self, x_TD, topk_ids_TK, topk_weights_TK) -> None:
        from moe_ref.kernels.pre_dispatch import pre_dispatch, pre_dispatch_ref

        buf = self.buffer
        buf.view("num_tokens").fill_(x_TD.shape[0])
        counts_E = buf.view("num_rows_per_expert")
        counts_E.zero_()
        kernel = pre_dispatch if x_TD.is_cuda else pre_dispatch_ref
        kernel(x_TD.contiguous(), topk_ids_TK.contiguous(), topk_weights_TK.contiguous(), buf.view("x"),
               buf.view("x_scale") if self.plan.dispatch_fp8 else None, buf.view("topk_ids"),
               buf.view("topk_weights"), counts_E)

    def whole_segment_layout(self, handle: DispatchHandle) -> ExpertLayout:
        """Zero the pool's alignment padding and return the layout whose segments cover it, so every
        expert GEMM has a multiple of ``alignment`` rows (see the module NOTE). Host sync."""
        return zero_padding_rows(handle.layout, [self.buffer.view(name) for name in ("recv_x", "recv_x_scale")
                                                 if self.plan.has_region(name)])

    def expert_input(self, handle: DispatchHandle,
                     experts: Experts | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The pool rows as ``experts`` take them: the one place that decides the experts' input format.

        Only the used prefix ``[:R]`` is passed (R = ``handle.layout.num_pool_rows``, the aligned end of the
        last segment; see the module NOTE). With FP8 dispatch, a backend with ``accepts_fp8_input`` gets the
        fp8 rows and their scales as dispatched (views, no copy); any other backend, and ``experts=None``,
        gets them dequantized to the activation dtype.

        Args:
            handle: from ``dispatch`` of this chunk (call ``whole_segment_layout`` first if the backend needs
                it: the padding must be zeroed before the rows are dequantized).
            experts: the backend that will run them, or None.

        Returns:
            x_RD: ``[R, Dx]`` view of the pool (activation dtype, or fp8 e4m3), or its dequantized copy.
            x_scale_RDb: ``[R, ceil(Dx/128)]`` fp32 view of the scales when ``x_RD`` is fp8, else None.
        """
        num_rows = handle.layout.num_pool_rows
        x_RD = handle.recv_x_PD[:num_rows]
        if handle.recv_x_scale_PDb is None:
            return x_RD, None
        x_scale_RDb = handle.recv_x_scale_PDb[:num_rows]
        if experts is not None and experts.accepts_fp8_input:
            return x_RD, x_scale_RDb
        from moe_ref.kernels.fp8 import dequantize_fp8_per_128

        return dequantize_fp8_per_128(x_RD, x_scale_RDb, self.plan.activation_dtype), None

    def combine(self, y_RD: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Send every result row back to its source's combine slots and reduce mine (collective; one chunk).

        Args:
            y_RD: ``[R, Dx]`` expert outputs on the used prefix of the pool (any float dtype; rows are read only
                at the received positions ``handle.recv_pos``, so padding rows are ignored).
            handle: from ``dispatch`` of the same chunk.

        Returns:
            ``routed_TD``: ``[T, Dx]`` activation dtype, ``sum_j w[t, j] * expert_j(x[t])`` in fp32, slots in order.
        """
        from moe_ref.kernels.combine_reduce import combine_reduce, combine_reduce_ref

        self.transport.return_rows(handle.exchange, handle.recv_pos, y_RD.to(self.plan.activation_dtype))
        kernel = combine_reduce if y_RD.is_cuda else combine_reduce_ref
        return kernel(self.buffer.view("combine"), handle.topk_ids_TK, handle.topk_weights_TK,
                      out_dtype=self.plan.activation_dtype)

    # --- the routed step ---------------------------------------------------------------------------------
    def run(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, experts: Experts,
            *, max_num_tokens: int | None = None) -> torch.Tensor:
        """The routed step: overflow policy, then per chunk pre-dispatch, dispatch, experts, combine, reduce.

        Args:
            x_TD: ``[T, Dx]`` expert input in the activation dtype (T may be 0).
            topk_ids_TK: ``[T, K]`` int64 global expert ids, -1 = masked slot.
            topk_weights_TK: ``[T, K]`` fp32 routing weights.
            experts: this rank's local experts (``make_experts`` over the local weight slices); they get the
                used prefix of the pool in the format ``expert_input`` picks for them.
            max_num_tokens: a bound on T known to hold on EVERY rank; skips the group all_reduce (and makes
                bad ids raise on the offending rank only).

        Returns:
            ``routed_TD``: ``[T, Dx]`` in ``x_TD``'s dtype.

        Raises (on every rank alike, before any rows move): ``CapacityExceededError`` (CAP001) with policy
        ``error`` when a rank has more rows than the cap; ``ExpertIdError`` (INP005) for ids outside
        ``[-1, E)`` or a token picking an expert twice. NOTE: syncs the host (the group max, the layout).
        """
        self._check_inputs(x_TD, topk_ids_TK, topk_weights_TK)
        num_tokens = x_TD.shape[0]
        problem = check_topk_ids(topk_ids_TK, self.plan.cfg.num_experts)
        if max_num_tokens is None:
            group_max_tokens, any_problem = group_max([num_tokens, int(problem is not None)], self.group,
                                                      self._comm_device)
        else:
            if num_tokens > max_num_tokens:
                raise ShapeError(f"rank {self.rank} has num_tokens={num_tokens} > the max_num_tokens={max_num_tokens} "
                                 f"promised for every rank; pass a true bound or None")
            group_max_tokens, any_problem = max_num_tokens, int(problem is not None)
        if any_problem:
            raise ExpertIdError(f"rank {self.rank}: {problem}" if problem else
                                f"rank {self.rank}: another rank of the EP group passed invalid topk ids (its "
                                f"error names them); no rows were moved")
        num_chunks = num_chunks_for(num_tokens, group_max_tokens, self.plan, self.overflow, rank=self.rank)
        cap = self.plan.num_max_tokens_per_rank
        routed = []
        for chunk in range(num_chunks):  # every rank runs every chunk, with zero rows where it has none left
            lo, hi = min(chunk * cap, num_tokens), min((chunk + 1) * cap, num_tokens)
            handle = self.dispatch(x_TD[lo:hi], topk_ids_TK[lo:hi], topk_weights_TK[lo:hi])
            layout = self.whole_segment_layout(handle) if experts.computes_whole_segments else handle.layout
            x_RD, x_scale_RDb = self.expert_input(handle, experts)
            routed.append(self.combine(experts(x_RD, layout, x_scale_RDb), handle))
        if not routed:
            return x_TD.new_empty(0, x_TD.shape[1])
        return routed[0] if len(routed) == 1 else torch.cat(routed)

    def destroy(self) -> None:
        """Release the buffer (and peer mappings). Not collective."""
        self.transport.destroy()

    def __enter__(self) -> "Dispatcher":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()


def make_dispatcher(cfg: MoEConfig, group, num_max_tokens_per_rank: int | None, *, overflow: str | None = None,
                    transport: str | None = None, activation_dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu", dispatch_fp8: bool = False, alignment: int = 128) -> Dispatcher:
    """Plan, allocate and connect a dispatcher (collective over ``group``).

    Args:
        cfg: the MoE block (``E`` must divide by the group size: CFG002).
        group: the EP process group, or None for one process.
        num_max_tokens_per_rank: the cap (rows one rank feeds per call); None: ``MOE_REF_NUM_MAX_TOKENS_PER_RANK``.
        overflow: ``error`` | ``chunk``; None: ``MOE_REF_OVERFLOW_POLICY``, else ``error``.
        transport: ``auto`` | ``local`` | ``symm`` | ``a2a``; None or ``auto``: ``MOE_REF_TRANSPORT``, else auto.
        activation_dtype: dtype of the rows (fp32, bf16, fp16).
        device: ``cpu`` or a CUDA device.
        dispatch_fp8: ship rows as fp8 + per-128 scales (the experts get them as is if they accept fp8 input,
            else dequantized).
        alignment: rows each expert segment of the pool starts on (pass the backend's
            ``Experts.segment_alignment``; 128 suits every backend).

    Returns:
        A ``Dispatcher``. Raises ``CapacityMismatchError`` (CAP002) on every rank if the caps differ.
    """
    world = 1 if group is None else torch.distributed.get_world_size(group)
    plan = CapacityPlan.build(cfg, world, resolve_cap(num_max_tokens_per_rank), activation_dtype, dispatch_fp8,
                              alignment)
    overflow = resolve_overflow(overflow)
    return Dispatcher(plan, make_transport(transport, plan, group, device), group, overflow=overflow)
