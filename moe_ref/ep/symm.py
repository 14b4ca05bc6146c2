"""The ``symm`` transport: every peer's buffer is mapped here, and the device moves the rows itself.

    pre-dispatch (+ post)  ->  dispatch (wait; pull rows routed to my experts from each source, once per token,
    expanded into my pool)  ->  experts  ->  combine push (one partial per (source, token) into the source's
    buffer, + post)  ->  reduce (wait; partials in rank order)
    batch-invariant combine: slot push (every slot row into the source's combine_slots)  ->  barrier  ->  sum_slots

On CUDA these are the Triton kernels of ``kernels.ep_*`` over torch symmetric memory: no host sync inside a call,
every wait bounded (a silent peer is recorded in MY ``status``, never an endless spin), so a decode call can be
captured in a CUDA graph. On CPU the same phases are the kernels' torch twins over the shared-memory heap (the
waits poll from the host). ``local`` is the same code with one rank and a private buffer.

Shape legend: T tokens of this rank, K top-k, Dx expert input width, R EP ranks, P receive-pool rows.
"""
from __future__ import annotations

from moe_ref.kernels.runtime import ops
from moe_ref.ep.buffer import SymmetricBuffer
from moe_ref.ep.capacity import CapacityPlan
from moe_ref.ep.dispatch import DispatchHandle, Dispatcher
from moe_ref.ep.device_checks import DeviceChecks
from moe_ref.core.errors import DistributedError
from moe_ref.kernels.ep.ep_combine_slots import ep_combine_slots_push, ep_combine_slots_push_ref
from moe_ref.kernels.ep.symm_signal import DEFAULT_TIMEOUT_US, check_ep_status, ep_status_problem, symm_barrier


class SymmDispatcher(Dispatcher):
    """Dispatch/combine over peers' mapped buffers (CUDA symmetric memory, shm files, or one private buffer).

    Args:
        plan: the buffer plan. buffer: a symmetric buffer of ``plan`` (or private with one rank).
        group: the EP process group, or None.
        timeout_us: bound of each device-side wait (a silent peer -> ``PeerTimeoutError``, ENV010).
    """

    def __init__(self, plan: CapacityPlan, buffer: SymmetricBuffer, group=None, *,
                 timeout_us: float = DEFAULT_TIMEOUT_US):
        super().__init__(plan, buffer, group)
        if not buffer.is_symmetric:
            raise DistributedError(f"the symm transport needs a symmetric buffer, got kind={buffer.kind!r}")
        self.transport_name = "local" if self.world_size == 1 else "symm"
        self.peers = buffer.peer_buffers()
        self.ops = ops.ep_ops(buffer.device)
        self.timeout_us = timeout_us
        # the batch-invariant combine's exchange (combine_slots): its push kernel, or the twin on the CPU, and the
        # barrier of the EP phases self.ops runs
        self._slots_push, self._barrier = ep_combine_slots_push, symm_barrier
        if not self.ops.on_device:
            from moe_ref.kernels.runtime import native  # as ops.ep_ops: the compiled CPU ops, or their twins

            self._slots_push, self._barrier = ep_combine_slots_push_ref, native.symm_barrier

    def _raise_recorded(self) -> None:
        """On the host path (twins), raise what a wait or the layout recorded in MY status right away."""
        if not self.ops.on_device:
            check_ep_status(self.peers, self.regions)

    def _pre_dispatch_and_exchange(self, x_TD, topk_ids_TK, topk_weights_TK):
        self.ops.pre_dispatch(x_TD, topk_ids_TK, topk_weights_TK, self.peers, self.regions, post=True)
        self.ops.dispatch(self.peers, self.regions, wait=True, timeout_us=self.timeout_us,
                          received_e=self.num_recv_tokens_per_expert)
        self._raise_recorded()
        return None

    def _num_pool_rows(self, num_tokens):
        if self.ops.on_device:
            # NOTE: pool_end lives on the device; reading it would sync. The experts get the whole pool (rows past
            # pool_end are masked by the segments) and a static estimate of the valid rows for their tile choice:
            # what this rank sends, about what it receives when ranks are balanced.
            return self.regions.num_pool_rows, num_tokens * self.regions.num_topk
        return super()._num_pool_rows(num_tokens)

    def _return_partials(self, y_PD, handle: DispatchHandle) -> None:
        self.ops.combine_push(y_PD, self.peers, self.regions, post=True)

    def _return_slot_rows(self, y_PD, handle: DispatchHandle) -> None:
        # one push of every slot row into its source's combine_slots, then one barrier (post + bounded wait): after
        # it every peer's rows for my tokens have landed (the next writer of combine_slots is the next chunk's
        # push, which follows that chunk's dispatch barrier, so my read here is never overwritten)
        self._slots_push(y_PD, self.peers, self.regions)
        self._barrier(self.peers, self.regions, timeout_us=self.timeout_us)
        self._raise_recorded()

    def _reduce(self, num_tokens):
        routed_TD = self.ops.combine_reduce(num_tokens, self.peers, self.regions, wait=True,
                                            timeout_us=self.timeout_us)
        self._raise_recorded()
        return routed_TD

    def add_device_checks(self, checks: DeviceChecks) -> None:
        status_code = self.regions.view(self.peers.local, "status")[:1]  # STATUS_OK = 0
        checks.add(status_code, lambda: ep_status_problem(self.peers, self.regions))
