"""The routed step: one contract, two kinds (as vLLM's modular and monolithic fused-MoE kernels).

    RoutedStep.__call__(x_TD, topk_ids_TK, topk_weights_TK, problem=None)        collective over the EP group
      1. input check (routed_input_problem: shapes, dtypes, devices) + the caller's own problem (weights not
         loaded, ...); on the device, without a host sync (moe_ref.ep.device_checks): the routing values
         (dispatch.add_routing_value_check), the caller's device checks (NaN logits) and what the device
         recorded in an earlier call (a silent peer, a pool overflow)
      2. OverflowPolicy.agree: ONE small collective on host integers -> a coded error on every rank, or n chunks.
         It carries the layer's index and call count: ranks at different calls of different layers raise ENV004
         (ENV017 where some build the step again) and count no call.
         Modular step at EP >= 2: over the group's gloo host group (waits for no GPU work); the device checks are
         read in step 3's first failure agreement. Monolithic step: over the EP group, reading the device checks
         too. One rank on CUDA has no one to agree with: the chunks follow from T, and the device checks are read
         by a later call (DeferredChecks: no host sync)
      3. for each of the n chunks (every rank runs all n; empty ones where it has no rows left):
           run_chunk(x, ids, w) -> routed rows                                   (the kind's own work)
      -> routed_TD [T, Dx]

    ModularRoutedStep    = Dispatcher (pre-dispatch, dispatch, combine, reduce over a transport) x Experts
                           run_chunk: dispatch -> experts -> agree_on_failure (+ the device checks, first chunk:
                           the call's one host sync on CUDA, after the heavy kernels are queued) -> combine
    MonolithicRoutedStep = one fused engine that dispatches, computes and combines in one launch
                           (DeepGEMM's SM90 FP8 mega-MoE, moe_ref.ep.mega_deep_gemm): run_chunk = engine.launch

The layer holds exactly one ``RoutedStep``; a new transport goes into moe_ref.ep.transport, a new experts
backend into moe_ref.experts' registry, a new fused engine behind ``MonolithicRoutedStep``. Building a modular
step starts with ``OverflowPolicy.agree_to_build`` on the per-call agreement's group, before its own collectives, so
a rank whose step was destroyed alone meets its peers' calls there (ENV017 on every rank) instead of a deadlock.

CUDA-graph capture (decode): while the current CUDA stream is capturing, steps 1-2 keep only what needs no
host sync (shapes, dtypes, devices; T <= cap, one chunk; the device checks only when the caller passes
``device_checks`` to read after each replay, as the layer's eager graphs do) and the modular step's failure
agreement is skipped:
the ``symm`` data path then runs entirely on the device, and a failure its waits record is reported by the
next eager call, on every rank (step 1). Replays run with the inputs copied into the captured tensors.

Shape legend: T tokens of this rank, K top-k, Dx expert input width, Db = ceil(Dx/128), C cap, e local experts,
P receive-pool rows, R EP ranks.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import torch

from moe_ref.ep.capacity import CapacityPlan
from moe_ref.core.config import MoEConfig
from moe_ref.ep.device_checks import DeferredChecks, DeviceChecks
from moe_ref.ep.dispatch import Dispatcher, add_routing_value_check, routed_input_problem
from moe_ref.ep.distributed import (agree_on_failure, comm_device, gather_ints, group_size_and_rank, host_group,
                                    peer_errors)
from moe_ref.core.errors import (CapacityExceededError, ConservationError, MoERefError, NonFiniteError,
                                 StepOutOfSyncError)
from moe_ref.experts import Experts, check_pool_format
from moe_ref.kernels.ep.ep_combine import slot_owners_TR
from moe_ref.ep.options import EPOptions
from moe_ref.ep.overflow import OverflowPolicy
from moe_ref.ep.transport import make_dispatcher


class RoutedStep(ABC):
    """``y[t] = sum_j w[t, j] * Expert_{ids[t, j]}(x[t])`` over the experts of the whole EP group.

    Args:
        cfg: the MoE block.
        group: the EP process group, or None for one process.
        policy: the overflow policy (cap, ``error`` | ``chunk``).
        activation_dtype, device: of the rows this step takes.

    Attributes:
        rank, world_size: in the group. calls: how many calls of this layer this rank has made (agreed every
            call, with the layer's index: ``policy.layer_index``).
        deferred_checks: ``DeferredChecks`` when the device checks are read by a later call (one rank on CUDA,
            without ``debug_checks``), else None (they are read in the call's agreement).
    """

    def __init__(self, cfg: MoEConfig, group, policy: OverflowPolicy, activation_dtype: torch.dtype,
                 device: torch.device, *, debug_checks: bool = False):
        self.cfg, self.group, self.policy = cfg, group, policy
        self.activation_dtype, self.device = activation_dtype, torch.device(device)
        self.world_size, self.rank = group_size_and_rank(group)
        self.comm_device = comm_device(group, self.device)
        self.calls = 0
        self.debug_checks = debug_checks
        # EP >= 2, modular step: the gloo group of the per-call agreement, whose device checks are then read after
        # the experts (ModularRoutedStep); None: the agreement runs over ``group`` and reads them itself
        self.host_group = None
        defer = self.world_size == 1 and self.device.type == "cuda" and not debug_checks
        self.deferred_checks = DeferredChecks() if defer else None

    def check(self) -> None:
        """Wait for the calls made so far and raise the first device check they failed (one rank on CUDA, where
        calls do not wait for their checks). NOTE: syncs the host."""
        if self.deferred_checks is not None:
            self.deferred_checks.raise_pending(wait=True)

    def __call__(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, *,
                 problem: MoERefError | None = None, max_num_tokens: int | None = None,
                 device_checks: DeviceChecks | None = None, read_checks_now: bool = False) -> torch.Tensor:
        """Run the routed step (collective: every rank of the group calls it, T may be 0).

        Args:
            x_TD: ``[T, Dx]`` expert input in the activation dtype.
            topk_ids_TK: ``[T, K]`` int64 (int32 accepted) global expert ids, -1 = masked slot.
            topk_weights_TK: ``[T, K]`` fp32 routing weights (``routed_scaling_factor`` folded in).
            problem: a coded error the caller found on this rank and has not raised (it is raised on every rank).
            max_num_tokens: a bound on T promised for every rank (checked; must be given on all ranks or none).
            device_checks: the caller's checks computed on the device (NaN logits, ...); this step adds its own
                (routing values, a failure recorded in an earlier call) and reads them all in its agreement.
            read_checks_now: read them in this call's agreement even on one rank on CUDA (one host sync), where
                they are otherwise read by a later call.

        Returns:
            ``routed_TD`` ``[T, Dx]`` in the activation dtype.

        Raises, on EVERY rank alike: any rank's input problem (its code), ``CapacityExceededError`` (CAP001)
        under ``error``, ``StepOutOfSyncError`` (ENV004: ranks at different calls of different layers, not counted)
        or its ``StepBuiltOnSomeRanksError`` (ENV017), ``GroupDisagreementError`` (CFG008), and, when a rank
        fails inside a chunk, its own error there and ``PeerFailedError`` (ENV005) on the others. On the ranks that
        called: ``GroupTimeoutError`` (ENV018) when a peer did not join within the EP group's timeout.
        NOTE: syncs the host once per chunk (plus the data path's own syncs off CUDA): in the modular step at
        EP >= 2, the failure agreement after the experts (the per-call agreement runs over the gloo host group);
        else the per-call agreement. One rank on CUDA does not sync: a failed device check (routing values, NaN
        logits) is raised by a later call or ``check()``.
        """
        if self.capturing():
            return self._captured_call(x_TD, topk_ids_TK, topk_weights_TK, problem, device_checks)
        if self.deferred_checks is not None:
            self.deferred_checks.raise_pending()  # an earlier call's failed device check (no wait)
        deferred = None if read_checks_now else self.deferred_checks
        in_chunk = self.host_group is not None  # the device checks are read after the first chunk's experts
        if problem is None:
            problem = routed_input_problem(x_TD, topk_ids_TK, topk_weights_TK, self.cfg, self.activation_dtype,
                                           self.device, check_values=False)
        checks = device_checks or DeviceChecks()
        if problem is None:
            add_routing_value_check(checks, topk_ids_TK, topk_weights_TK, self.cfg.num_experts)
        self.add_device_checks(checks)
        num_tokens = x_TD.shape[0] if problem is None else 0
        call_index, self.calls = self.calls, self.calls + 1
        try:
            num_chunks = self.policy.agree(num_tokens, problem, call_index=call_index,
                                           group=self.host_group if in_chunk else self.group,
                                           device="cpu" if in_chunk else self.comm_device,
                                           max_num_tokens=max_num_tokens,
                                           device_checks=None if deferred is not None or in_chunk else checks)
        except StepOutOfSyncError:
            # the ranks met at different calls: none ran, so none counts it (the next call in step runs); a call
            # that fails otherwise (a peer that never came included) was made here, and stays counted
            self.calls = call_index
            raise
        if deferred is not None:
            deferred.record(checks, self.device)
        chunk_checks = checks if in_chunk else None
        if num_chunks == 0:
            if chunk_checks is not None:  # no chunk to read them after: read them now (the call's one sync)
                agree_on_failure(None, self.group, self.comm_device, device_checks=chunk_checks)
            return x_TD.new_empty(0, self.cfg.expert_hidden_size)
        topk_ids_TK = topk_ids_TK.to(torch.int64)
        topk_weights_TK = topk_weights_TK.to(torch.float32)
        routed = [self.run_chunk(x_TD[lo:hi], topk_ids_TK[lo:hi], topk_weights_TK[lo:hi],
                                 device_checks=chunk_checks if index == 0 else None)
                  for index, (lo, hi) in enumerate(self.policy.chunk_bounds(num_tokens, num_chunks))]
        return routed[0] if len(routed) == 1 else torch.cat(routed)

    def capturing(self) -> bool:
        """Whether this call is being captured into a CUDA graph (no host sync allowed)."""
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _captured_call(self, x_TD, topk_ids_TK, topk_weights_TK, problem, device_checks) -> torch.Tensor:
        """One chunk with the checks that need no host sync (see the module doc). With ``device_checks`` (the
        layer's own eager graphs, ``moe_ref.eager_graphs``, which read them after each replay) the routing-value
        check and the step's own device checks are captured into them too."""
        problem = problem or routed_input_problem(x_TD, topk_ids_TK, topk_weights_TK, self.cfg, self.activation_dtype,
                                                  self.device, check_values=False)
        if problem is None and x_TD.shape[0] > self.policy.num_max_tokens_per_rank:
            problem = CapacityExceededError(
                f"a captured call has num_tokens={x_TD.shape[0]} > num_max_tokens_per_rank="
                f"{self.policy.num_max_tokens_per_rank}; a CUDA graph runs one chunk: capture with at most the cap",
                rank=self.rank, num_tokens=x_TD.shape[0], cap=self.policy.num_max_tokens_per_rank)
        if problem is not None:
            raise problem
        if device_checks is not None:
            add_routing_value_check(device_checks, topk_ids_TK, topk_weights_TK, self.cfg.num_experts)
            self.add_device_checks(device_checks)
        self.calls += 1
        return self.run_chunk(x_TD, topk_ids_TK.to(torch.int64), topk_weights_TK.to(torch.float32))

    def add_device_checks(self, checks: DeviceChecks) -> None:
        """Add the check of a failure an earlier call recorded on the device and has not reported yet."""

    @abstractmethod
    def run_chunk(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                  device_checks: DeviceChecks | None = None) -> torch.Tensor:
        """One chunk of at most C rows (collective; T may be 0) -> ``[T, Dx]`` in the activation dtype.
        ``device_checks``: the call's device checks, to read in this chunk's failure agreement (``host_group``)."""

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
        batch_invariant: combine with ``Dispatcher.combine_slots`` (``moe_ref.ep.batch_invariant``).
    """

    def __init__(self, dispatcher: Dispatcher, experts: Experts, policy: OverflowPolicy, *,
                 debug_checks: bool = False, batch_invariant: bool = False):
        plan = dispatcher.plan
        check_pool_format(experts, plan.pool_format)
        super().__init__(plan.cfg, dispatcher.group, policy, plan.activation_dtype, dispatcher.buffer.device,
                         debug_checks=debug_checks)
        self.dispatcher, self.experts = dispatcher, experts
        self.batch_invariant = batch_invariant
        self.host_group = host_group(self.group)

    @property
    def plan(self) -> CapacityPlan:
        return self.dispatcher.plan

    @property
    def transport_name(self) -> str:
        return self.dispatcher.transport_name

    @property
    def num_recv_tokens_per_expert(self) -> torch.Tensor:
        return self.dispatcher.num_recv_tokens_per_expert

    def add_device_checks(self, checks: DeviceChecks) -> None:
        self.dispatcher.add_device_checks(checks)

    def run_chunk(self, x_TD, topk_ids_TK, topk_weights_TK, device_checks=None):
        capturing = self.capturing()
        with peer_errors(f"dispatch over the {self.transport_name} transport", self.group):
            # NOTE: the values were checked (and agreed) by __call__; only the public dispatch() checks them itself
            handle = self.dispatcher.dispatch(x_TD, topk_ids_TK, topk_weights_TK, check_values=False)
        if self.debug_checks:
            self._check_dispatch_conserved(handle)
        failure, y_PDx = None, None
        try:
            experts = self.experts
            layout = self.dispatcher.whole_segment_layout(handle) if experts.computes_whole_segments else handle.layout
            x_PDx, x_scale_PDb = self.dispatcher.expert_input(handle, experts)
            y_PDx = experts(x_PDx, layout, x_scale_PDb)
            if self.debug_checks:
                self._check_finite_expert_output(y_PDx, handle.layout)
        except Exception as err:  # noqa: BLE001 - every failure is agreed with the peers, then re-raised
            if capturing:
                raise
            failure = err
        # NOTE: one tiny collective per chunk, so a rank whose experts failed never leaves its peers waiting
        # in combine: every rank raises (the failing one its own error, the others PeerFailedError). With the
        # call's device checks in it (first chunk, EP >= 2) it is the call's one host sync, after dispatch and
        # experts are queued; a failed check raises here, before combine (bad ids were masked slots until then).
        # Skipped in CUDA-graph capture (it syncs the host), where a failure aborts the capture on that rank instead.
        if not capturing:
            agree_on_failure(failure, self.group, self.comm_device, device_checks=device_checks)
        with peer_errors(f"combine over the {self.transport_name} transport", self.group):
            combine = self.dispatcher.combine_slots if self.batch_invariant else self.dispatcher.combine
            routed_TD = combine(y_PDx, handle)
        if self.debug_checks:
            self._check_every_slot_returned(handle)
        return routed_TD

    # --- debug checks (debug_checks=True): nothing lost, nothing duplicated ------------------------------
    def _check_dispatch_conserved(self, handle) -> None:
        """Rows each source sent == rows the group received from it (count and float64 checksum of the wire
        rows), then poison my combine partials so that ``_check_every_slot_returned`` sees any not written.

        NOTE: one extra all_gather per chunk and host syncs; for debugging only. The poisoning happens before
        the failure agreement, a collective no peer leaves before this rank entered it, so no peer's combine
        write can precede it."""
        view, world = self.dispatcher.buffer.view, self.world_size
        ids_TK = view("topk_ids")[:handle.num_tokens]
        sent_x = view("x")[:handle.num_tokens].double().sum(dim=1)  # per token, the wire row as stored
        live_TK = ids_TK >= 0
        sent_count = int(live_TK.sum())
        sent_sum = float((sent_x[:, None] * live_TK).sum())
        received = handle.layout.row_expert_P() >= 0  # rows inside a segment (either pool format)
        rows = received.numel()
        src_P = handle.recv_src_P3[:rows, 0].long()
        recv_x = handle.recv_x_PD[:rows].double().sum(dim=1)
        counts = [int(((src_P == s) & received).sum()) for s in range(world)]
        sums = [float(recv_x[(src_P == s) & received].sum()) for s in range(world)]
        # checksums travel as integers: float64 sums scaled, then rounded (a difference far above rounding shows)
        everyone = gather_ints([sent_count, round(sent_sum * 1e6), *counts, *(round(v * 1e6) for v in sums)],
                               self.group, self.comm_device)
        problems = []
        for src in range(world):
            got = sum(row[2 + src] for row in everyone)
            got_sum = sum(row[2 + world + src] for row in everyone)
            want, want_sum = everyone[src][0], everyone[src][1]
            if got != want or abs(got_sum - want_sum) > max(1, abs(want_sum)) * 1e-9 + 64:
                problems.append(f"rank {src} sent {want} rows (checksum {want_sum / 1e6:.6g}), the group received {got} "
                                f"(checksum {got_sum / 1e6:.6g})")
        if problems:
            raise ConservationError(f"rank {self.rank}: dispatch did not conserve rows: {'; '.join(problems)}",
                                    problems=problems)
        view("combine_partial")[:, :handle.num_tokens].fill_(float("nan"))

    def _check_finite_expert_output(self, y_PDx: torch.Tensor, layout) -> None:
        """The experts' rows are finite (the combine check below poisons unwritten partials with NaN, so a
        non-finite expert output would otherwise read as a lost row). Local; raised through the failure agreement."""
        expert_P = layout.row_expert_P()
        bad_P = (expert_P >= 0) & ~torch.isfinite(y_PDx[:expert_P.numel()].float()).all(dim=-1)
        if bool(bad_P.any()):
            experts = sorted(set(expert_P[bad_P].tolist()))
            raise NonFiniteError(f"rank {self.rank}: the {self.experts.name} experts returned NaN/inf in "
                                 f"{int(bad_P.sum())} of {int((expert_P >= 0).sum())} rows (local experts {experts}); "
                                 f"check the expert weights and the input rows")

    def _check_every_slot_returned(self, handle) -> None:
        """Every owner of a slot of mine wrote its partial back (no NaN poison left). Local check."""
        partial_RTD = self.dispatcher.buffer.view("combine_partial")[:, :handle.num_tokens]
        ids_TK = self.dispatcher.buffer.view("topk_ids")[:handle.num_tokens]
        owners_RT = slot_owners_TR(ids_TK, self.dispatcher.num_local_experts, self.world_size).t()
        missing_RT = owners_RT & torch.isnan(partial_RTD).any(dim=-1)
        if bool(missing_RT.any()):
            owner, token = missing_RT.nonzero()[0].tolist()
            raise ConservationError(f"rank {self.rank}: combine left {int(missing_RT.sum())} of {int(owners_RT.sum())} "
                                    f"(token, owner) partials unwritten (first: token {token} from rank {owner})")

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

    def run_chunk(self, x_TD, topk_ids_TK, topk_weights_TK, device_checks=None):
        with peer_errors("the fused engine's launch", self.group):
            return self.engine.launch(x_TD, topk_ids_TK, topk_weights_TK).to(self.activation_dtype)

    def destroy(self) -> None:
        self.engine.destroy()


def overflow_policy(cfg: MoEConfig, ep_size: int, options: EPOptions) -> OverflowPolicy:
    """The overflow policy of ``options``, pricing caps with moe_ref's own buffer plan."""
    def buffer_bytes_for_cap(cap: int) -> int:
        return CapacityPlan.build(cfg, ep_size, cap, options.dtype, options.dispatch_fp8, options.alignment,
                                  options.pool_format, options.batch_invariant).total_bytes

    return OverflowPolicy(options.num_max_tokens_per_rank, options.overflow, buffer_bytes_for_cap,
                          layer_index=options.layer_index)


def make_modular_step(cfg: MoEConfig, group, experts: Experts, options: EPOptions) -> ModularRoutedStep:
    """Plan, allocate and connect the modular routed step (collective over ``group``).

    First the build agreement (``OverflowPolicy.agree_to_build``, over the host group where the step's per-call
    agreements run): raises ENV017 / ENV004 on every rank when the peers call this layer or build another one."""
    policy = overflow_policy(cfg, group_size_and_rank(group)[0], options)
    policy.agree_to_build(group=host_group(group), device="cpu")
    return ModularRoutedStep(make_dispatcher(cfg, group, options), experts, policy, debug_checks=options.debug_checks,
                             batch_invariant=options.batch_invariant)
