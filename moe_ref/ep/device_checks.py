"""Value checks that run on the device and are read once per call, by the per-call agreement.

    layer:        logits finite?                      -> checks.add(flag, describe)
    routed step:  weights finite, ids in [-1, E),     -> checks.add(flag, describe)
                  no expert picked twice
    dispatcher:   a wait or the layout recorded a     -> checks.add(status code, describe)
                  failure in an earlier call
    OverflowPolicy.agree: checks.flags() travel in its one all_gather -> every rank sees every rank's flags

A flag is a one-element integer tensor, nonzero when its check fails, computed without a host sync. Reading the
flags separately would cost one host sync each; folded into the agreement's all_gather they cost none more. Only a
rank whose flag is set calls its check's ``describe`` (which may sync to name the bad tokens), and the group then
raises that coded error on every rank, as for a problem found on the host.
"""
from __future__ import annotations

from typing import Callable

import torch

from moe_ref.core.errors import MoERefError

__all__ = ["DeviceChecks"]

# slots of the flags vector every rank sends (a fixed length, so ranks that ran fewer checks still gather alike)
MAX_CHECKS = 4


class DeviceChecks:
    """Device-side checks of one call, in the order they were added."""

    def __init__(self) -> None:
        self._flags: list[torch.Tensor] = []
        self._describe: list[Callable[[], MoERefError]] = []

    def add(self, flag: torch.Tensor, describe: Callable[[], MoERefError]) -> None:
        """Add one check.

        Args:
            flag: one-element integer or bool tensor, nonzero when the check fails (not read here).
            describe: builds the coded error (not raised); called only when ``flag`` was read as nonzero.
        """
        if len(self._flags) == MAX_CHECKS:
            raise ValueError(f"at most {MAX_CHECKS} device checks per call")
        self._flags.append(flag.reshape(1))
        self._describe.append(describe)

    def flags(self, device: torch.device) -> torch.Tensor:
        """``[MAX_CHECKS]`` int64 on ``device``: the flags in order, zero-padded. No host sync."""
        flags = torch.zeros(MAX_CHECKS, dtype=torch.int64, device=device)
        for i, flag in enumerate(self._flags):
            flags[i:i + 1].copy_(flag)
        return flags

    def problem(self, flags: list[int]) -> MoERefError | None:
        """The coded error of the first failed check in ``flags`` (this rank's, as read), or None."""
        for flag, describe in zip(flags, self._describe):
            if flag:
                return describe()
        return None
