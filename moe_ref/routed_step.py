"""The routed step: one contract, two kinds (as vLLM's modular and monolithic fused-MoE kernels).

    RoutedStep.__call__(x_TD, topk_ids_TK, topk_weights_TK, problem=None)        collective over the EP group
      1. input check (routed_input_problem) + the caller's own problem (NaN logits, weights not loaded, ...)
      2. OverflowPolicy.agree: ONE small collective -> a coded error on every rank, or n chunks
      3. for each of the n chunks (every rank runs all n; empty ones where it has no rows left):
           run_chunk(x, ids, w) -> routed rows                                   (the kind's own work)
      -> routed_TD [T, Dx]

    ModularRoutedStep    = Dispatcher (pre-dispatch, dispatch, combine, reduce over a transport) x Experts
                           run_chunk: dispatch -> experts -> agree_on_failure -> combine
    MonolithicRoutedStep = one fused engine that dispatches, computes and combines in one launch
                           (DeepGEMM's SM90 FP8 mega-MoE, moe_ref.mega_deep_gemm): run_chunk = engine.launch

The layer holds exactly one ``RoutedStep``; a new transport goes into moe_ref.transport, a new experts
backend into moe_ref.experts' registry, a new fused engine behind ``MonolithicRoutedStep``.

Shape legend: T tokens of this rank, K top-k, Dx expert input width, C cap, e local experts.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import torch

from moe_ref.capacity import CapacityPlan
from moe_ref.config import MoEConfig
from moe_ref.dispatch import Dispatcher, make_dispatcher, routed_input_problem
from moe_ref.distributed import agree_on_failure, comm_device, group_size_and_rank, peer_errors
from moe_ref.errors import MoERefError
from moe_ref.experts import Experts
from moe_ref.options import EPOptions
from moe_ref.overflow import OverflowPolicy


class RoutedStep(ABC):
    """``y[t] = sum_j w[t, j] * Expert_{ids[t, j]}(x[t])`` over the experts of the whole EP group.

    Args:
        cfg: the MoE block.
        group: the EP process group, or None for one process.
        policy: the overflow policy (cap, ``error`` | ``chunk``).
        activation_dtype, device: of the rows this step takes.

    Attributes:
        rank, world_size: in the group. calls: how many calls this rank has made (agreed every call).
    """

    def __init__(self, cfg: MoEConfig, group, policy: OverflowPolicy, activation_dtype: torch.dtype,
                 device: torch.device):
        self.cfg, self.group, self.policy = cfg, group, policy
        self.activation_dtype, self.device = activation_dtype, torch.device(device)
        self.world_size, self.rank = group_size_and_rank(group)
        self.comm_device = comm_device(group, self.device)
        self.calls = 0

    def __call__(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, *,
                 problem: MoERefError | None = None, max_num_tokens: int | None = None) -> torch.Tensor:
        """Run the routed step (collective: every rank of the group calls it, T may be 0).

        Args:
            x_TD: ``[T, Dx]`` expert input in the activation dtype.
            topk_ids_TK: ``[T, K]`` int64 (int32 accepted) global expert ids, -1 = masked slot.
            topk_weights_TK: ``[T, K]`` fp32 routing weights (``routed_scaling_factor`` folded in).
            problem: a coded error the caller found on this rank and has not raised (it is raised on every rank).
            max_num_tokens: a bound on T promised for every rank (checked; must be given on all ranks or none).

        Returns:
            ``routed_TD`` ``[T, Dx]`` in the activation dtype.

        Raises, on EVERY rank alike: any rank's input problem (its code), ``CapacityExceededError`` (CAP001)
        under ``error``, ``StepOutOfSyncError`` (ENV004), ``GroupDisagreementError`` (CFG008), and, when a rank
        fails inside a chunk, its own error there and ``PeerFailedError`` (ENV005) on the others.
        NOTE: syncs the host (the per-call agreement, and the data path's own syncs).
        """
        if problem is None:
            problem = routed_input_problem(x_TD, topk_ids_TK, topk_weights_TK, self.cfg, self.activation_dtype,
                                           self.device)
        num_tokens = x_TD.shape[0] if problem is None else 0
        call_index, self.calls = self.calls, self.calls + 1
        num_chunks = self.policy.agree(num_tokens, problem, call_index=call_index, group=self.group,
                                       device=self.comm_device, max_num_tokens=max_num_tokens)
        if num_chunks == 0:
            return x_TD.new_empty(0, self.cfg.expert_hidden_size)
        topk_ids_TK = topk_ids_TK.to(torch.int64)
        topk_weights_TK = topk_weights_TK.to(torch.float32)
        routed = [self.run_chunk(x_TD[lo:hi], topk_ids_TK[lo:hi], topk_weights_TK[lo:hi])
                  for lo, hi in self.policy.chunk_bounds(num_tokens, num_chunks)]
        return routed[0] if len(routed) == 1 else torch.cat(routed)

    @abstractmethod
    def run_chunk(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor) -> torch.Tensor:
        """One chunk of at most C rows (collective; T may be 0) -> ``[T, Dx]`` in the activation dtype."""

    @property
    @abstractmethod
    def num_recv_tokens_per_expert(self) -> torch.Tensor:
        """``[e]`` int64: rows each local expert received, summed over all calls (for load balancers)."""

    @abstractmethod
    def destroy(self) -> None:
        """Release the step's buffers (not collective; call on every rank when done)."""

    def __enter__(self) -> "RoutedStep":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()


class ModularRoutedStep(RoutedStep):
    """A transport (``Dispatcher``) composed with local experts (``Experts``): N transports x M backends.

    Args:
        dispatcher: plan, buffer and transport of this rank (``make_dispatcher``).
        experts: this rank's experts (built over the local weight slices).
        policy: the overflow policy.
    """

    def __init__(self, dispatcher: Dispatcher, experts: Experts, policy: OverflowPolicy):
        plan = dispatcher.plan
        super().__init__(plan.cfg, dispatcher.group, policy, plan.activation_dtype, dispatcher.buffer.device)
        self.dispatcher, self.experts = dispatcher, experts

    @property
    def plan(self) -> CapacityPlan:
        return self.dispatcher.plan

    @property
    def transport_name(self) -> str:
        return self.dispatcher.transport_name

    @property
    def num_recv_tokens_per_expert(self) -> torch.Tensor:
        return self.dispatcher.num_recv_tokens_per_expert

    def run_chunk(self, x_TD, topk_ids_TK, topk_weights_TK):
        with peer_errors(f"dispatch over the {self.transport_name} transport"):
            handle = self.dispatcher.dispatch(x_TD, topk_ids_TK, topk_weights_TK)
        failure, y_RD = None, None
        try:
            experts = self.experts
            layout = self.dispatcher.whole_segment_layout(handle) if experts.computes_whole_segments else handle.layout
            x_RD, x_scale_RDb = self.dispatcher.expert_input(handle, experts)
            y_RD = experts(x_RD, layout, x_scale_RDb)
        except Exception as err:  # noqa: BLE001 - every failure is agreed with the peers, then re-raised
            failure = err
        # NOTE: one tiny collective per chunk, so a rank whose experts failed never leaves its peers waiting
        # in combine: every rank raises (the failing one its own error, the others PeerFailedError).
        agree_on_failure(failure, self.group, self.comm_device)
        with peer_errors(f"combine over the {self.transport_name} transport"):
            return self.dispatcher.combine(y_RD, handle)

    def destroy(self) -> None:
        self.dispatcher.destroy()


class FusedEngine(Protocol):
    """What ``MonolithicRoutedStep`` needs from a fused engine (``mega_deep_gemm.DeepGemmMegaMoE``)."""

    num_recv_tokens_per_expert_e: torch.Tensor

    def launch(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor) -> torch.Tensor:
        """One collective launch over at most C rows (T may be 0) -> ``[T, D]``."""

    def destroy(self) -> None:
        """Release the engine's buffers."""


class MonolithicRoutedStep(RoutedStep):
    """One fused engine does dispatch, GEMMs and combine in a launch; moe_ref keeps the checks and the policy.

    Args:
        cfg, group, policy, activation_dtype, device: as ``RoutedStep``.
        engine: the fused engine (its ``launch`` returns its own dtype; cast here to the activation dtype).
    """

    def __init__(self, cfg: MoEConfig, group, policy: OverflowPolicy, activation_dtype: torch.dtype,
                 device: torch.device, engine: FusedEngine):
        super().__init__(cfg, group, policy, activation_dtype, device)
        self.engine = engine

    @property
    def num_recv_tokens_per_expert(self) -> torch.Tensor:
        return self.engine.num_recv_tokens_per_expert_e.to(torch.int64)

    def run_chunk(self, x_TD, topk_ids_TK, topk_weights_TK):
        with peer_errors("the fused engine's launch"):
            return self.engine.launch(x_TD, topk_ids_TK, topk_weights_TK).to(self.activation_dtype)

    def destroy(self) -> None:
        self.engine.destroy()


def overflow_policy(cfg: MoEConfig, ep_size: int, options: EPOptions) -> OverflowPolicy:
    """The overflow policy of ``options``, pricing caps with moe_ref's own buffer plan."""
    def buffer_bytes_for_cap(cap: int) -> int:
        return CapacityPlan.build(cfg, ep_size, cap, options.dtype, options.dispatch_fp8, options.alignment).total_bytes

    return OverflowPolicy(options.num_max_tokens_per_rank, options.overflow, buffer_bytes_for_cap)


def make_modular_step(cfg: MoEConfig, group, experts: Experts, options: EPOptions) -> ModularRoutedStep:
    """Plan, allocate and connect the modular routed step (collective over ``group``)."""
    dispatcher = make_dispatcher(cfg, group, options)
    return ModularRoutedStep(dispatcher, experts, overflow_policy(cfg, dispatcher.world_size, options))
