"""Dispatch and combine of an expert-parallel MoE layer: the contract every transport implements (the modular
routed step's transport half; ``moe_ref.ep.routed_step`` runs the overflow policy and the chunk loop around it).

    x_TD, topk_ids_TK, topk_weights_TK (this rank's tokens, one chunk of T <= C)
      dispatch(x, ids, w) -> DispatchHandle
        1. pre-dispatch  my rows (+ FP8 per-128 quantization), ids, weights, per-(rank, expert) counts and slot
                         ranks -> MY send regions                         (kernels.ep_pre_dispatch)
        2. exchange      every rank's rows routed to my experts -> MY receive pool, expert-major, each expert's
                         segment aligned, ordered by (source rank, token, slot); each token moves ONCE per
                         destination rank and is expanded into its slots there      (the transport's own)
      experts(expert_input(handle)) -> y                                 (Experts.__call__, the routed step)
      combine(y, handle) -> routed_TD [T, Dx]
        3. partials      on the expert owner: ONE partial row per (source, token) = sum_j w[t, j] * y[slot j], fp32,
                         slots in order, sent back to the source                       (the transport's own)
        4. reduce        on the source: the partials of the owning ranks, summed in rank order in fp32
                                                                                 (kernels.ep_combine_reduce)
      combine_slots(y, handle) -> routed_TD [T, Dx]          (batch_invariant; EP >= 2: ONE exchange per chunk)
        3'. slot rows    on the expert owner: every (source, token, slot) row, unweighted, exact in the activation
                         dtype -> the source's combine_slots[token, slot]       (the transport's own)
        4'. sum          on the source: sum_j w[t, j] * row[t, j], slots in order, fp32, rounded once (sum_slots)

Both transports fill the same regions (``CapacityPlan``, ``kernels.ep_regions``) with the same values, so the
pool, the partials and the output are bitwise the same whichever transport runs:

| transport | ``Dispatcher``                       | how rows move                                               |
|-----------|--------------------------------------|-------------------------------------------------------------|
| ``symm``  | ``symm.SymmDispatcher``              | peers' buffers mapped here (CUDA symmetric memory / shm): Triton kernels on CUDA (no host sync, CUDA-graph capturable), their torch twins on CPU; ``local`` = one rank |
| ``a2a``   | ``a2a.AllToAllDispatcher``           | ``all_to_all_single`` of counts, routing and rows (NCCL / gloo), host-driven |

``transport.make_dispatcher`` builds the one ``EPOptions.transport`` names.

Global expert e lives on rank ``e // e_local``. Masked slots (id -1) are never sent, counted or read.

NOTE: backends with ``Experts.computes_whole_segments`` (the torch loop) get whole aligned segments
(``Dispatcher.whole_segment_layout``): the padding rows are zeroed, so every expert GEMM has a multiple of
``alignment`` rows, which keeps each row's result independent of how many rows share its expert: MKL's CPU
GEMM takes another code path for small row counts (1-3, 5-7, 9-11 measured), so without this a chunked run
would differ from an unchunked one in the last bit. GPU backends skip the padding instead, and plan the pool
with their own, smaller ``Experts.segment_alignment`` (triton: 1, no padding rows at all).

Shape legend: T tokens of this rank, K top-k, Dx expert input width (hidden, or latent for Kimi-K3),
Db = ceil(Dx/128), E experts, e local experts, R EP ranks, C cap, P receive-pool rows.
"""
from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from moe_ref.kernels.runtime import ops
from moe_ref.ep.buffer import SymmetricBuffer, release_buffer
from moe_ref.ep.capacity import CapacityPlan
from moe_ref.core.config import MoEConfig
from moe_ref.ep.batch_invariant import sum_slots
from moe_ref.ep.device_checks import DeviceChecks
from moe_ref.ep.distributed import comm_device
from moe_ref.core.errors import (CapacityExceededError, DeviceError, DTypeError, ExpertIdError, InputError,
                                 InvalidConfigError, NonFiniteError, ShapeError)
from moe_ref.experts import ExpertLayout, Experts
from moe_ref.kernels.ep.ep_regions import EPRegions
from moe_ref.kernels.router.routing_check import routing_faults_T

# --- input checks ---------------------------------------------------------------------------------------------

def routing_value_problem(topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                          num_experts: int) -> InputError | None:
    """NaN/inf weights, ids outside ``[-1, E)``, or a token picking an expert twice, as a coded error, or None.

    NOTE: ONE host sync on a good input (the four statistics travel together); the details of a problem cost more.
    """
    if topk_ids_TK.numel() == 0:
        return None
    ids_TK = topk_ids_TK.to(torch.int64)
    bad_weight_T, dup_T = routing_faults_T(ids_TK, topk_weights_TK)
    num_bad_weights, low, high, num_dups = torch.stack(
        [bad_weight_T.sum(), ids_TK.min(), ids_TK.max(), dup_T.sum()]).tolist()  # NOTE: the one host sync
    if num_bad_weights:
        bad = bad_weight_T.nonzero().flatten()
        return NonFiniteError(f"topk weights are NaN/inf for {num_bad_weights} of {ids_TK.shape[0]} tokens (first: "
                              f"{bad[:8].tolist()})")
    if low < -1 or high >= num_experts:
        return ExpertIdError(f"topk ids span [{low}, {high}], outside [-1, {num_experts}) (-1 = masked slot)")
    if num_dups:
        token = int(dup_T.nonzero()[0, 0])
        return ExpertIdError(f"token {token} picks an expert twice: ids {topk_ids_TK[token].tolist()}")
    return None


def add_routing_value_check(checks: DeviceChecks, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                            num_experts: int) -> None:
    """Add to ``checks`` the device-side check of ``routing_value_problem`` (``ops.routing_check``, no host sync)."""
    def describe() -> InputError:
        return routing_value_problem(topk_ids_TK, topk_weights_TK, num_experts) or ExpertIdError(
            f"the device-side routing check failed on topk ids {tuple(topk_ids_TK.shape)} ({topk_ids_TK.dtype}, "
            f"E={num_experts}) and weights ({topk_weights_TK.dtype}), but the host re-check found no bad value; "
            f"please report this with the inputs")

    ops.routing_check(topk_ids_TK, topk_weights_TK, num_experts, flag=checks.slot(topk_ids_TK.device, describe))


def routed_input_problem(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                         cfg: MoEConfig, activation_dtype: torch.dtype,
                         device: torch.device, *, check_values: bool = True) -> InputError | None:
    """What is wrong with the routed step's input on this rank (a coded error, NOT raised), or None.

    Checks: ``x_TD`` is ``[T, Dx]`` in ``activation_dtype`` on ``device``; ids ``[T, K]`` int64 (or int32) and
    weights ``[T, K]`` floating on ``device``; weights finite; ids in ``[-1, E)`` with no expert picked twice by
    one token. Both kinds of routed step (modular and monolithic) use this one check. NOTE: the value checks
    sync the host; ``check_values=False`` (CUDA-graph capture) checks shapes, dtypes and devices only.
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
    return routing_value_problem(topk_ids_TK, topk_weights_TK, cfg.num_experts) if check_values else None


# --- pool helpers -------------------------------------------------------------------------------------------

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
    return ExpertLayout(layout.row_start_e, aligned_e, layout.num_pool_rows, layout.alignment, packed=layout.packed)


# --- the handle ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DispatchHandle:
    """What ``dispatch`` produced and ``combine`` consumes (one chunk). Tensors are views into the buffer,
    valid until the next ``dispatch`` of the same dispatcher.

    Attributes:
        num_tokens: T, rows of this rank in this chunk.
        recv_x_PD: ``[P, Dx]`` the receive pool (activation dtype, or fp8 e4m3 with FP8 dispatch); rows outside
            the segments of ``layout`` hold stale data.
        recv_x_scale_PDb: ``[P, Db]`` fp32 scales of the pool (FP8 dispatch), else None.
        recv_src_P3: ``[P, 3]`` int32 ``(source rank, token, slot)`` of each pool row below the used end, -1 on
            padding rows.
        layout: the local experts' segments in the pool (device tensors ``row_start_e`` and ``num_rows_e``, views
            of the buffer's ``row_start``/``num_rows``), ``num_pool_rows`` = the rows handed to the experts.
        routes: the transport's own record of who sent what (a2a: the tokens exchanged with each rank), or None.
    """

    num_tokens: int
    recv_x_PD: torch.Tensor
    recv_x_scale_PDb: torch.Tensor | None
    recv_src_P3: torch.Tensor
    layout: ExpertLayout
    routes: Any = None


# --- the dispatcher --------------------------------------------------------------------------------------------

class Dispatcher(ABC):
    """Dispatch/combine of one EP group over one transport, one chunk at a time (the transport half of the
    modular routed step, ``moe_ref.ep.routed_step.ModularRoutedStep``). Build with ``transport.make_dispatcher``.

    Subclasses implement the transport: ``_pre_dispatch_and_exchange`` (steps 1-2), ``_return_partials`` (step 3,
    leaving every partial of my tokens in MY ``combine_partial``) and ``_reduce`` (step 4); the batch-invariant
    combine's one exchange is ``_return_slot_rows`` (into MY ``combine_slots``).

    Attributes:
        plan: the buffer plan; regions: its ``EPRegions``. rank, world_size: in the EP group.
        num_local_experts: e. transport_name: local, symm or a2a.
        num_recv_tokens_per_expert: ``[e]`` int64, rows my experts received over all calls of this dispatcher
            (non-masked slots; what expert load balancers read). Not in the buffer, which layers share.
    """

    transport_name = "abstract"

    def __init__(self, plan: CapacityPlan, buffer: SymmetricBuffer, group=None):
        self.plan, self.buffer, self.group = plan, buffer, group
        self.regions: EPRegions = plan.ep_regions
        self.rank, self.world_size = buffer.rank, buffer.world_size
        self.num_local_experts = plan.num_local_experts
        self.device = buffer.device
        self._comm_device = comm_device(group, buffer.device)
        self.num_recv_tokens_per_expert = torch.zeros(self.num_local_experts, dtype=torch.int64, device=self.device)
        # NOTE: my use of the shared buffer ends with destroy() or, for a dispatcher dropped without it, when it is
        # garbage-collected (the buffer registry must not keep a dropped layer's buffer alive)
        self._release = weakref.finalize(self, release_buffer, buffer)

    # --- what a transport implements ------------------------------------------------------------------
    @abstractmethod
    def _pre_dispatch_and_exchange(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor,
                                   topk_weights_TK: torch.Tensor) -> Any:
        """Steps 1-2 (collective): fill my send regions, then my receive regions (``recv_num_tokens``,
        ``num_rows``, ``row_start``, ``recv_base``, ``pool_end``, ``recv_pos``, ``recv_weight``, ``recv_src``,
        ``recv_x`` (+ scales)), and add ``num_rows`` to ``num_recv_tokens_per_expert``. Returns the handle's
        ``routes``."""

    def _num_pool_rows(self, num_tokens: int) -> tuple[int, int | None]:
        """(rows of the pool handed to the experts, a host-side estimate of the valid rows or None). Here: the
        used end of the pool, read from the buffer (NOTE: a host sync; the device-side path overrides it)."""
        return int(self.buffer.view("pool_end")[0]), None

    @abstractmethod
    def _return_partials(self, y_PD: torch.Tensor, handle: DispatchHandle) -> None:
        """Step 3 (collective): one partial row per (source, token) from the expert owners into each source's
        ``combine_partial[owner, token]``."""

    @abstractmethod
    def _reduce(self, num_tokens: int) -> torch.Tensor:
        """Step 4: ``[T, Dx]`` activation dtype from MY ``topk_ids`` and ``combine_partial``."""

    def add_device_checks(self, checks: DeviceChecks) -> None:
        """Add the check of a failure the device recorded in an earlier call and has not reported yet (a peer
        that never signalled, a pool overflow); read with the per-call agreement (no host sync here)."""

    # --- one chunk -------------------------------------------------------------------------------------
    def dispatch(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, *,
                 check_values: bool = True) -> DispatchHandle:
        """Pre-dispatch my rows and bring my experts' rows from every rank (collective; one chunk).

        Args:
            x_TD: ``[T, Dx]`` activation dtype, T <= cap (the routed step splits larger batches).
            topk_ids_TK: ``[T, K]`` int64 global expert ids, -1 = masked slot.
            topk_weights_TK: ``[T, K]`` fp32.
            check_values: check ids and weights values (host syncs); False inside CUDA-graph capture.

        Returns:
            ``DispatchHandle`` with the receive pool and its layout. Adds the received rows per local expert
            to ``num_recv_tokens_per_expert``. Raises ``CapacityExceededError`` (CAP001, on this rank only)
            when T > cap, and the input errors of ``routed_input_problem``.

        NOTE: a bad input raises on THIS rank only (its peers are already inside the collective): the routed
        step (``moe_ref.ep.routed_step``) checks inputs in its per-call collective before calling this.
        """
        problem = routed_input_problem(x_TD, topk_ids_TK, topk_weights_TK, self.plan.cfg, self.plan.activation_dtype,
                                       self.device, check_values=check_values)
        if problem is not None:
            raise problem
        num_tokens, cap = x_TD.shape[0], self.plan.num_max_tokens_per_rank
        if num_tokens > cap:
            raise CapacityExceededError(
                f"dispatch() got num_tokens={num_tokens} rows on rank {self.rank}, above num_max_tokens_per_rank="
                f"{cap}; run the routed step (its overflow policy chunks or raises on every rank) or raise the cap "
                f"(MOE_REF_NUM_MAX_TOKENS_PER_RANK)", rank=self.rank, num_tokens=num_tokens, cap=cap)
        routes = self._pre_dispatch_and_exchange(x_TD.contiguous(), topk_ids_TK.to(torch.int64).contiguous(),
                                                 topk_weights_TK.to(torch.float32).contiguous())
        num_rows_e = self.buffer.view("num_rows")
        num_pool_rows, hint = self._num_pool_rows(num_tokens)
        # the whole pool goes to the experts exactly when the host does not know its used end (hint given):
        # then rows past it need not be zeroed (combine reads rows inside segments only)
        layout = ExpertLayout(self.buffer.view("row_start"), num_rows_e, num_pool_rows, self.plan.alignment, hint,
                              zero_unused_rows=hint is None, masked_rows=self.regions.masked_rows,
                              packed=not self.regions.masked_rows)
        return DispatchHandle(num_tokens=num_tokens, recv_x_PD=self.buffer.view("recv_x"),
                              recv_x_scale_PDb=self.buffer.view("recv_x_scale") if self.plan.dispatch_fp8 else None,
                              recv_src_P3=self.buffer.view("recv_src"), layout=layout, routes=routes)

    def whole_segment_layout(self, handle: DispatchHandle) -> ExpertLayout:
        """Zero the pool's alignment padding and return the layout whose segments cover it, so every
        expert GEMM has a multiple of ``alignment`` rows (see the module NOTE). Host sync."""
        return zero_padding_rows(handle.layout, [self.buffer.view(name) for name in ("recv_x", "recv_x_scale")
                                                 if self.plan.has_region(name)])

    def expert_input(self, handle: DispatchHandle,
                     experts: Experts | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The pool rows as ``experts`` take them: the one place that decides the experts' input format.

        Only the first ``handle.layout.num_pool_rows`` rows are passed: the aligned end of the last
        segment where the host knows it, the whole pool on CUDA, where reading it would sync. With FP8
        dispatch, a backend with ``accepts_fp8_input`` gets the fp8 rows and their scales as dispatched (views,
        no copy); any other backend, and ``experts=None``, gets them dequantized to the activation dtype.

        Args:
            handle: from ``dispatch`` of this chunk (call ``whole_segment_layout`` first if the backend needs
                it: the padding must be zeroed before the rows are dequantized).
            experts: the backend that will run them, or None.

        Returns:
            x_PD: ``[P, Dx]`` view of the pool (activation dtype, or fp8 e4m3), or its dequantized copy.
            x_scale_PDb: ``[P, Db]`` fp32 view of the scales when ``x_PD`` is fp8, else None.
        """
        num_rows = handle.layout.num_pool_rows
        x_PD = handle.recv_x_PD[:num_rows]
        if handle.recv_x_scale_PDb is None:
            return x_PD, None
        x_scale_PDb = handle.recv_x_scale_PDb[:num_rows]
        if experts is not None and experts.accepts_fp8_input:
            return x_PD, x_scale_PDb
        from moe_ref.kernels.experts.fp8 import dequantize_fp8_per_128

        return dequantize_fp8_per_128(x_PD, x_scale_PDb, self.plan.activation_dtype), None

    def combine(self, y_PD: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Send one weighted partial per (token, rank) back to each source and reduce mine (collective; one chunk).

        Args:
            y_PD: ``[P, Dx]`` expert outputs over the rows ``expert_input`` gave (any float dtype; rows are read
                only at received positions, so padding rows are ignored).
            handle: from ``dispatch`` of the same chunk.

        Returns:
            ``routed_TD``: ``[T, Dx]`` activation dtype, ``sum_r sum_{j on r} w[t, j] * expert_j(x[t])``: fp32 sums
            with slots in order on each owner, then owners in rank order.
        """
        y_PD = y_PD if y_PD.stride(-1) == 1 else y_PD.contiguous()
        self._return_partials(y_PD, handle)
        return self._reduce(handle.num_tokens)

    def combine_slots(self, y_PD: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """The batch-invariant combine (``moe_ref.ep.batch_invariant``): every (token, slot) expert row comes back
        unreduced and MY tokens' K rows are summed here in slot order in fp32 (``sum_slots``), so the sum is the
        same bits at any EP size (collective; one chunk; arguments and result as ``combine``).

        One rank reads the rows straight from the pool. Several make ONE exchange (``_return_slot_rows``): each
        owner sends every slot row it computed, exact in the activation dtype, into the source's ``combine_slots``
        ``[C, K, Dx]`` (the batch-invariant plan's region). NOTE: K x Dx values per token travel back, where
        ``combine`` sends one partial per owning rank."""
        view, num_tokens = self.buffer.view, handle.num_tokens
        y_PD = y_PD.to(self.plan.activation_dtype).contiguous()  # the rows travel exactly in the activation dtype
        ids_TK = view("topk_ids")[:num_tokens]
        weights_TK = view("topk_weights")[:num_tokens]
        if self.world_size == 1:  # the rows are read where they sit in the pool
            return sum_slots(y_PD, ids_TK, weights_TK, self.plan.activation_dtype, view("recv_pos")[0, :num_tokens])
        if not self.plan.has_region("combine_slots"):
            raise InvalidConfigError(
                f"combine_slots at EP {self.world_size} needs the batch-invariant plan (its combine_slots "
                f"region); build the dispatcher with batch_invariant=True", field="batch_invariant")
        self._return_slot_rows(y_PD, handle)
        return sum_slots(view("combine_slots")[:num_tokens], ids_TK, weights_TK, self.plan.activation_dtype)

    def _return_slot_rows(self, y_PD: torch.Tensor, handle: DispatchHandle) -> None:
        """``combine_slots``' exchange (collective, ONE per chunk): every slot row of my pool to its source's
        ``combine_slots[token, slot]``, unweighted, in the activation dtype. On return MY ``combine_slots[:T]``
        holds the row of every live slot of my tokens (a transport that signals waits for its peers here)."""
        raise NotImplementedError(f"the {self.transport_name} transport has no batch-invariant combine")

    def destroy(self) -> None:
        """Release my use of the shared buffer (freed with its last user; not collective; idempotent)."""
        self._release()

    def __enter__(self) -> "Dispatcher":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()
