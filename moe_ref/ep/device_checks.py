"""Value checks that run on the device and are read once per call, by the per-call agreement.

    layer:        logits finite?                      -> the router kernel raises checks.slot(...)
    routed step:  weights finite, ids in [-1, E),     -> the routing-check kernel raises checks.slot(...)
                  no expert picked twice
    dispatcher:   a wait or the layout recorded a     -> checks.add(status code, describe)
                  failure in an earlier call
    OverflowPolicy.agree: checks.flags() travel in its one all_gather -> every rank sees every rank's flags

A flag is a one-element integer tensor, nonzero when its check fails, computed without a host sync. Reading the
flags separately would cost one host sync each; folded into the agreement's all_gather they cost none more. Only a
rank whose flag is set calls its check's ``describe`` (which may sync to name the bad tokens), and the group then
raises that coded error on every rank, as for a problem found on the host.

One rank on CUDA needs no agreement, so nothing would read the flags but a host sync. There ``DeferredChecks`` keeps
them: each call's flags are copied to pinned memory behind an event, and a later call (or ``MegaMoE.check()``) reads
those that have arrived and raises the first failed check's error. The call whose values were bad has already
returned (its output holds NaN or the rows of ignored slots); the next one raises. The data-path kernels treat ids
outside [0, E) as masked slots, so bad values never write out of bounds.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

import torch

from moe_ref.core.errors import MoERefError

__all__ = ["DeviceChecks", "DeferredChecks"]

# slots of the flags vector every rank sends (a fixed length, so ranks that ran fewer checks still gather alike)
MAX_CHECKS = 4


class DeviceChecks:
    """Device-side checks of one call, in the order they were added.

    Their flags live in one zeroed ``[MAX_CHECKS]`` int32 vector on the device (allocated by the first check): a
    kernel raises its check's slot itself (``slot``: the router's NaN/inf logits, the routing-value check), or a
    flag computed elsewhere is copied into the next slot (``add``). Reading them all is then one tensor, with no
    concatenation.
    """

    def __init__(self) -> None:
        self._slots: torch.Tensor | None = None
        self._describe: list[Callable[[], MoERefError]] = []

    def slot(self, device: torch.device, describe: Callable[[], MoERefError]) -> torch.Tensor:
        """Add one check whose flag a kernel raises: returns its ``[1]`` int32 slot, zero, for the kernel to set
        nonzero when the check fails (not read here).

        Args:
            device: where the flags live (the first check's device decides).
            describe: builds the coded error (not raised); called only when the flag was read as nonzero. It may
                return None when its exact re-check finds no problem (a flag that can raise a false alarm).
        """
        if len(self._describe) == MAX_CHECKS:
            raise ValueError(f"at most {MAX_CHECKS} device checks per call")
        if self._slots is None:
            self._slots = torch.zeros(MAX_CHECKS, dtype=torch.int32, device=device)
        self._describe.append(describe)
        index = len(self._describe) - 1
        return self._slots[index:index + 1]

    def add(self, flag: torch.Tensor, describe: Callable[[], MoERefError]) -> None:
        """Add one check whose flag is already computed: a one-element integer or bool tensor, nonzero when the
        check fails, copied into the next slot (one launch; not read here). ``describe`` as in ``slot``."""
        self.slot(flag.device, describe).copy_(flag.reshape(1))

    def stacked(self) -> torch.Tensor | None:
        """The flags in order (``[MAX_CHECKS]`` int32, unused slots 0; the vector itself, no launch); None without
        checks. No host sync."""
        return self._slots

    def flags(self, device: torch.device) -> torch.Tensor:
        """``[MAX_CHECKS]`` int64 on ``device``: the flags in order, zero-padded. No host sync."""
        if self._slots is None:
            return torch.zeros(MAX_CHECKS, dtype=torch.int64, device=device)
        return self._slots.to(device=device, dtype=torch.int64)

    def problem(self, flags: list[int]) -> MoERefError | None:
        """The coded error of the first failed check in ``flags`` (this rank's, as read), or None."""
        for flag, describe in zip(flags, self._describe):
            problem = describe() if flag else None
            if problem is not None:  # a describe() that re-checks exactly may find a flag was a false alarm
                return problem
        return None


class DeferredChecks:
    """Device checks of earlier calls, read once their flags have reached the host (no host sync in a call).

    Until its flags are read, a call's checks keep the tensors their ``describe`` names the bad tokens from alive
    (the router logits ``[T, E]`` fp32, the top-k ids and weights): usually until the next call, at most
    ``max_pending`` calls.

    Args:
        max_pending: calls whose flags may stay unread; beyond that the oldest is waited for (the GPU still has
            the newer calls queued, so it does not drain).
    """

    def __init__(self, max_pending: int = 4) -> None:
        self.max_pending = max_pending
        self._pending: deque[tuple[torch.Tensor, torch.cuda.Event | None, DeviceChecks]] = deque()
        self._spare: list[tuple[torch.Tensor, torch.cuda.Event]] = []  # pinned vectors and events read already

    def record(self, checks: DeviceChecks, device: torch.device) -> None:
        """Queue ``checks``' flags for a later read: one copy to pinned memory behind an event (CUDA). The pinned
        vector and the event are reused once read (no pinned allocation per call)."""
        flags = checks.stacked()
        if flags is None:
            return
        event = None
        if flags.is_cuda:
            if not self._spare:
                with torch.inference_mode(False):  # reused by later calls, in or out of inference mode
                    self._spare.append((torch.empty(MAX_CHECKS, dtype=torch.int32, pin_memory=True),
                                        torch.cuda.Event()))
            host, event = self._spare.pop()
            host.copy_(flags, non_blocking=True)
            event.record()
            flags = host
        self._pending.append((flags, event, checks))

    def raise_pending(self, wait: bool = False) -> None:
        """Raise the first failed check among the calls whose flags have arrived (all of them with ``wait``,
        which syncs the host); forget the rest. No host sync without ``wait`` (except past ``max_pending``)."""
        while self._pending:
            flags, event, checks = self._pending[0]
            if event is not None and not event.query():  # not arrived yet
                if not (wait or len(self._pending) > self.max_pending):
                    return
                event.synchronize()
            self._pending.popleft()
            problem = checks.problem(flags.tolist())
            if event is not None:
                self._spare.append((flags, event))
            if problem is not None:
                self._pending.clear()
                raise problem

    def __len__(self) -> int:
        return len(self._pending)
