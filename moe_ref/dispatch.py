"""Dispatch and combine of an expert-parallel MoE layer, over any transport (the modular routed step's
transport half; ``moe_ref.routed_step`` runs the overflow policy and the chunk loop around it).

    x_TD, topk_ids_TK, topk_weights_TK (this rank's tokens)
      1. overflow policy (moe_ref.overflow): one collective -> error on every rank | n chunks
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

from moe_ref import ops
from moe_ref.capacity import CapacityPlan
from moe_ref.config import MoEConfig
from moe_ref.distributed import comm_device
from moe_ref.errors import (CapacityExceededError, DeviceError, DTypeError, ExpertIdError, InputError, NonFiniteError,
                            ShapeError)
from moe_ref.experts import ExpertLayout, Experts
from moe_ref.options import EPOptions
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


def routed_input_problem(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                         cfg: MoEConfig, activation_dtype: torch.dtype,
                         device: torch.device) -> InputError | None:
    """What is wrong with the routed step's input on this rank (a coded error, NOT raised), or None.

    Checks: ``x_TD`` is ``[T, Dx]`` in ``activation_dtype`` on ``device``; ids ``[T, K]`` int64 (or int32) and
    weights ``[T, K]`` floating on ``device``; weights finite; ids in ``[-1, E)`` with no expert picked twice by
    one token. Both kinds of routed step (modular and monolithic) use this one check. NOTE: syncs the host.
    """
    dim, topk = cfg.expert_hidden_size, cfg.num_topk
    for name, tensor in (("x_TD", x_TD), ("topk_ids_TK", topk_ids_TK), ("topk_weights_TK", topk_weights_TK)):
        if not isinstance(tensor, torch.Tensor):
            return ShapeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device != torch.device(device):
            return DeviceError(f"{name} is on {tensor.device}, the layer on {device}; move it with .to('{device}')")
    if x_TD.dim() != 2 or x_TD.shape[1] != dim:
        return ShapeError(f"x_TD has shape {tuple(x_TD.shape)}; expected [T, {dim}] (the expert input width of "
                          f"{cfg.name})")
    num_tokens = x_TD.shape[0]
    if tuple(topk_ids_TK.shape) != (num_tokens, topk) or tuple(topk_weights_TK.shape) != (num_tokens, topk):
        return ShapeError(f"topk ids {tuple(topk_ids_TK.shape)} and weights {tuple(topk_weights_TK.shape)} must "
                          f"both be [T={num_tokens}, K={topk}]")
    if x_TD.dtype != activation_dtype:
        return DTypeError(f"x_TD has dtype {x_TD.dtype}; the layer runs {activation_dtype} (cast with "
                          f"x.to({activation_dtype}))")
    if topk_ids_TK.dtype not in (torch.int64, torch.int32) or not topk_weights_TK.dtype.is_floating_point:
        return DTypeError(f"topk ids must be int64 (or int32) and weights floating, got {topk_ids_TK.dtype} and "
                          f"{topk_weights_TK.dtype}")
    if num_tokens and not bool(torch.isfinite(topk_weights_TK).all()):
        bad = (~torch.isfinite(topk_weights_TK)).any(dim=1).nonzero().flatten()
        return NonFiniteError(f"topk weights are NaN/inf for {bad.numel()} of {num_tokens} tokens (first: "
                              f"{bad[:8].tolist()})")
    ids_problem = check_topk_ids(topk_ids_TK, cfg.num_experts)
    return None if ids_problem is None else ExpertIdError(ids_problem)


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
    """Dispatch/combine of one EP group over one transport, one chunk at a time (the transport half of the
    modular routed step, ``moe_ref.routed_step.ModularRoutedStep``).

    One process (group None or world size 1) is the base case: the ``local`` transport copies inside its
    own buffer. Build with ``make_dispatcher``.

    Attributes:
        plan: the buffer plan. rank, world_size: in the EP group. num_local_experts: e.
        first_local_expert: global id of my first expert (``rank * e``). transport_name: local, symm or a2a.
        num_recv_tokens_per_expert: ``[e]`` int64 (a view of the buffer's counter), rows my experts received
            over all calls (non-masked slots; what expert load balancers read).
    """

    def __init__(self, plan: CapacityPlan, transport: Transport, group=None):
        self.plan, self.transport, self.group = plan, transport, group
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

    # --- one chunk -------------------------------------------------------------------------------------
    def dispatch(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor) -> DispatchHandle:
        """Pre-dispatch my rows and pull my experts' rows from every rank (collective; one chunk).

        Args:
            x_TD: ``[T, Dx]`` activation dtype, T <= cap (the routed step splits larger batches).
            topk_ids_TK: ``[T, K]`` int64 global expert ids, -1 = masked slot.
            topk_weights_TK: ``[T, K]`` fp32.

        Returns:
            ``DispatchHandle`` with the receive pool and its layout. Adds the received rows per local expert
            to ``num_recv_tokens_per_expert``. Raises ``CapacityExceededError`` (CAP001, on this rank only)
            when T > cap, and the input errors of ``routed_input_problem``.

        NOTE: a bad input raises on THIS rank only (its peers are already inside the collective): the routed
        step (``moe_ref.routed_step``) checks inputs in its per-call collective before calling this.
        """
        problem = routed_input_problem(x_TD, topk_ids_TK, topk_weights_TK, self.plan.cfg, self.plan.activation_dtype,
                                       self.buffer.device)
        if problem is not None:
            raise problem
        num_tokens, cap = x_TD.shape[0], self.plan.num_max_tokens_per_rank
        if num_tokens > cap:
            raise CapacityExceededError(
                f"dispatch() got num_tokens={num_tokens} rows on rank {self.rank}, above num_max_tokens_per_rank="
                f"{cap}; run the routed step (its overflow policy chunks or raises on every rank) or raise the cap "
                f"(MOE_REF_NUM_MAX_TOKENS_PER_RANK)", rank=self.rank, num_tokens=num_tokens, cap=cap)
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
        buf = self.buffer
        buf.view("num_tokens").fill_(x_TD.shape[0])
        counts_E = buf.view("num_rows_per_expert")
        counts_E.zero_()
        ops.pre_dispatch(x_TD.contiguous(), topk_ids_TK.to(torch.int64).contiguous(),
                         topk_weights_TK.to(torch.float32).contiguous(), buf.view("x"),
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
        self.transport.return_rows(handle.exchange, handle.recv_pos, y_RD.to(self.plan.activation_dtype))
        return ops.combine_reduce(self.buffer.view("combine"), handle.topk_ids_TK, handle.topk_weights_TK,
                      out_dtype=self.plan.activation_dtype)

    def destroy(self) -> None:
        """Release the buffer (and peer mappings). Not collective."""
        self.transport.destroy()

    def __enter__(self) -> "Dispatcher":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()


def make_dispatcher(cfg: MoEConfig, group, options: EPOptions) -> Dispatcher:
    """Plan, allocate and connect a dispatcher (collective over ``group``).

    Args:
        cfg: the MoE block (``E`` must divide by the group size: CFG002).
        group: the EP process group, or None for one process.
        options: resolved options; uses the cap, transport, dtype, device, ``dispatch_fp8`` and ``alignment``
            (which must be set: ``EPOptions.resolve`` sets it from the experts backend).

    Returns:
        A ``Dispatcher``. Raises ``CapacityMismatchError`` (CAP002) on every rank if the caps differ,
        ``MemoryBudgetError`` (CAP004) on every rank if a rank cannot hold the buffer.
    """
    world = 1 if group is None else torch.distributed.get_world_size(group)
    plan = CapacityPlan.build(cfg, world, options.num_max_tokens_per_rank, options.dtype, options.dispatch_fp8,
                              options.alignment)
    return Dispatcher(plan, make_transport(options.transport, plan, group, options.device), group)
