"""The overflow policy: one small collective per call decides, for every rank alike, how the call runs.

    per call, on every rank:  [layer, 0, call counter, T, max_num_tokens or -1, problem?, device checks' flags
                              (where the routed step reads them here: not the modular step at EP >= 2, which reads
                              them after its experts)] --gather_ints (one host sync; none over a gloo host group)-->
      a rank builds the step     -> StepBuiltOnSomeRanksError (ENV017) on every rank (it was destroyed there only)
      layers or counters differ  -> StepOutOfSyncError (ENV004) on every rank; neither raises count the call
      max_num_tokens differs     -> GroupDisagreementError (CFG008) on every rank
      some rank has a problem    -> that problem's coded error on every rank (bad shape/dtype/device, NaN,
        or a failed device check    ids out of range, weights not loaded, a gradient requested, a peer that
                                    timed out in an earlier call, ...)
      max_r T_r > cap, 'error'   -> CapacityExceededError (CAP001) on every rank, before any row moves
      else                       -> n = ceil(max_r T_r / cap) chunks (0 when nobody has rows); every rank
                                    runs all n, with zero rows where it has none left

``OverflowPolicy.agree`` is that collective; ``RoutedStep`` (moe_ref.ep.routed_step) runs the chunk loop for
every kind of routed step. The collective runs even with ``max_num_tokens`` (the promised bound is then
checked on every rank instead of trusted): it is what makes one rank's bad input an error on all ranks.
Building a routed step starts with the same collective (``OverflowPolicy.agree_to_build``: [layer, 1, 0, ...]),
before any collective of its own, so a rank building a step meets the peers' calls there and every rank raises.
``layer`` is the layer's index in build order on the EP group (``EPOptions.layer_index``; -1 where unknown).
A peer that never joins is ``GroupTimeoutError`` (ENV018) after the EP group's timeout (moe_ref.ep.distributed).

Shape legend: T tokens of this rank, C cap (``num_max_tokens_per_rank``), R EP ranks.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from moe_ref.ep.capacity import format_bytes
from moe_ref.ep.device_checks import DeviceChecks
from moe_ref.ep.distributed import gather_ints, gather_objects, group_size_and_rank, problem_of, raise_agreed_problem
from moe_ref.core.errors import (CapacityExceededError, GroupDisagreementError, MoERefError, ShapeError,
                                 StepBuiltOnSomeRanksError, StepOutOfSyncError)
from moe_ref.ep.options import OVERFLOW_POLICIES


class ChunkingWarning(UserWarning):
    """A batch larger than the cap is being split into chunks (overflow policy ``chunk``)."""


# NOTE: the one piece of module state: chunking is announced once per process, not once per call.
_ANNOUNCED: set[str] = set()
# The agreement's row starts with [layer index or -1, 1 when building the step else 0, call counter]: the stamp.
STAMP_LENGTH = 3


@dataclass(frozen=True)
class OverflowPolicy:
    """What every rank does when a rank's batch exceeds the cap, and the per-call agreement behind it.

    Args:
        num_max_tokens_per_rank: C, the cap.
        mode: ``"error"`` or ``"chunk"``.
        buffer_bytes_for_cap: the per-rank buffer bytes a given cap would take (prices a larger cap in CAP001).
        layer_index: the layer's index in build order on the EP group (``EPOptions.layer_index``), carried by every
            agreement; None: unknown (-1 in the agreement).
    """

    num_max_tokens_per_rank: int
    mode: str
    buffer_bytes_for_cap: Callable[[int], int]
    layer_index: int | None = None

    def __post_init__(self):
        if self.mode not in OVERFLOW_POLICIES:  # EPOptions validated it; a direct construction may not have
            raise ValueError(f"mode={self.mode!r}; supported: {', '.join(OVERFLOW_POLICIES)}")

    def stamp(self, call_index: int, building: bool = False) -> list[int]:
        """``[layer index or -1, building, call_index]``: which call of which layer this rank is in."""
        return [-1 if self.layer_index is None else self.layer_index, int(building), call_index]

    def agree_to_build(self, *, group=None, device: torch.device | str = "cpu") -> None:
        """The first collective of building this layer's routed step, on the group (and device) of its per-call
        agreement: a row of the same length, so it meets a peer's ``agree`` as well as a peer's build.

        Raises on every rank, before the step's own collectives: ``StepBuiltOnSomeRanksError`` (ENV017) when the
        peers are calling this layer (its step was destroyed on some ranks only), ``StepOutOfSyncError`` (ENV004)
        when they build or call another layer. NOTE: syncs the host (one ``all_gather`` of 10 int64 per rank).
        """
        world, rank = group_size_and_rank(group)
        if world == 1:
            return
        stamp = self.stamp(0, building=True)
        rows = gather_ints(stamp + [0, -1, 0], group, device, device_values=DeviceChecks().flags(torch.device(device)),
                           what=f"rank {rank}'s agreement to build the routed step of {_call_name(stamp)}")
        check_same_call([r[:STAMP_LENGTH] for r in rows], rank)

    def agree(self, num_tokens: int, problem: MoERefError | None, *, call_index: int, group=None,
              device: torch.device | str = "cpu", max_num_tokens: int | None = None,
              device_checks: DeviceChecks | None = None) -> int:
        """The per-call collective: returns the number of chunks every rank runs, or raises on every rank.

        Args:
            num_tokens: T, this rank's rows in this call.
            problem: what is wrong with this rank's input (a coded error, not raised yet), or None.
            call_index: how many calls of this layer this rank made before (the same on every rank when all are in
                step).
            group, device: the EP group and where its small collectives run.
            max_num_tokens: a bound on T the caller promises for every rank (checked, and it must be given
                on every rank or none).
            device_checks: value checks computed on the device (``moe_ref.ep.device_checks``), read here with the
                rest; a failed one is this rank's problem when ``problem`` is None.

        Returns:
            ``ceil(max_r T_r / C)`` (0 when no rank has rows). NOTE: syncs the host (one ``all_gather`` of 10
            int64 per rank; a second, object collective only when some rank reported a problem).

        Raises on every rank alike: ENV017 / ENV004 when the ranks are not at the same call of the same layer
        (``check_same_call``; the caller does not count such a call), then CFG008, the agreed problem, CAP001.
        """
        world, rank = group_size_and_rank(group)
        if problem is None and max_num_tokens is not None and num_tokens > max_num_tokens:
            problem = ShapeError(f"rank {rank} has num_tokens={num_tokens} > the max_num_tokens={max_num_tokens} "
                                 f"promised for every rank; pass a true bound or None")
        bound = -1 if max_num_tokens is None else int(max_num_tokens)
        checks = device_checks or DeviceChecks()
        stamp = self.stamp(call_index)
        rows = gather_ints(stamp + [num_tokens, bound, int(problem is not None)], group, device,
                           device_values=checks.flags(torch.device(device)),
                           what=f"rank {rank}'s per-call agreement ({_call_name(stamp)})")
        check_same_call([r[:STAMP_LENGTH] for r in rows], rank)
        rows = [r[STAMP_LENGTH:] for r in rows]
        bounds = [r[1] for r in rows]
        if len(set(bounds)) > 1:
            raise GroupDisagreementError(
                f"max_num_tokens differs across the EP group ({', '.join(f'rank {r}: {b if b >= 0 else None}' for r, b in enumerate(bounds))}); "
                f"pass the same bound on every rank or None on every rank", bounds=bounds)
        if any(any(r[2:]) for r in rows):
            if problem is None:
                problem = checks.problem(rows[rank][3:])
            raise_agreed_problem(gather_objects(problem_of(problem), group), rank)
        group_max_tokens = max(r[0] for r in rows)
        return self.num_chunks(num_tokens, group_max_tokens, rank=rank)

    def num_chunks(self, num_tokens: int, group_max_tokens: int, *, rank: int = 0) -> int:
        """``ceil(group_max_tokens / C)``, the same on every rank; under ``error`` at most 1, else CAP001.

        Under ``chunk`` with more than one chunk rank 0 issues a ``ChunkingWarning``, once per process.
        """
        cap = self.num_max_tokens_per_rank
        num_chunks = -(-group_max_tokens // cap)
        if num_chunks <= 1:
            return num_chunks
        if self.mode == "error":
            raise self._exceeded_error(num_tokens, group_max_tokens, rank)
        if "chunk" not in _ANNOUNCED and rank == 0:  # once, from rank 0, without a source line
            _ANNOUNCED.add("chunk")
            warnings.warn_explicit(
                f"moe_ref: the EP group fed up to {group_max_tokens} rows per rank, above num_max_tokens_per_rank="
                f"{cap}; overflow policy 'chunk' splits each call into ceil({group_max_tokens}/{cap}) = {num_chunks} "
                f"chunks on every rank (slower, same result). Raise the cap to {group_max_tokens} (costs "
                f"{format_bytes(self.buffer_bytes_for_cap(group_max_tokens))} per rank) to avoid it. "
                f"This warning is shown once per process, by rank 0.", ChunkingWarning, filename="moe_ref", lineno=0,
                module="moe_ref.ep.overflow")
        return num_chunks

    def chunk_bounds(self, num_tokens: int, num_chunks: int) -> list[tuple[int, int]]:
        """``[(lo, hi)]`` row ranges of this rank's chunks: every rank gets ``num_chunks`` of them, empty
        ones (lo == hi) where it has no rows left."""
        cap = self.num_max_tokens_per_rank
        return [(min(c * cap, num_tokens), min((c + 1) * cap, num_tokens)) for c in range(num_chunks)]

    def _exceeded_error(self, num_tokens: int, group_max_tokens: int, rank: int) -> CapacityExceededError:
        cap = self.num_max_tokens_per_rank
        needed_bytes = self.buffer_bytes_for_cap(group_max_tokens)
        now_bytes = self.buffer_bytes_for_cap(cap)
        culprit = "this rank" if num_tokens == group_max_tokens else "another rank of the EP group"
        return CapacityExceededError(
            f"rank {rank} has num_tokens={num_tokens}; the max over the EP group is {group_max_tokens} ({culprit}), "
            f"above the cap num_max_tokens_per_rank={cap}. Raise it to at least {group_max_tokens}: pass "
            f"num_max_tokens_per_rank={group_max_tokens} or set MOE_REF_NUM_MAX_TOKENS_PER_RANK={group_max_tokens} "
            f"on every rank (the buffer then takes {needed_bytes} bytes = {format_bytes(needed_bytes)} per rank, now "
            f"{now_bytes} bytes = {format_bytes(now_bytes)}), or split the batch with overflow='chunk' "
            f"(MOE_REF_OVERFLOW_POLICY=chunk) into {-(-group_max_tokens // cap)} chunks",
            rank=rank, num_tokens=num_tokens, group_max_tokens=group_max_tokens, cap=cap,
            needed_cap=group_max_tokens, needed_bytes=needed_bytes)


def check_same_call(stamps: list[list[int]], rank: int) -> None:
    """Raise unless every rank is at the same call of the same layer (each rank gets the same stamps, so each
    raises the same error).

    Args:
        stamps: per rank, ``[layer index or -1, building, call counter]`` (``OverflowPolicy.stamp``), rank order.
        rank: this rank.

    Raises ``StepBuiltOnSomeRanksError`` (ENV017) when some ranks build the routed step of the layer the others
    call, else ``StepOutOfSyncError`` (ENV004; also for a build beside calls of layers without an index, which may
    be another layer's first call); both name each rank's layer and call.
    """
    if all(s == stamps[0] for s in stamps):
        return
    where = ", ".join(f"rank {r}: {_call_name(s)}" for r, s in enumerate(stamps))
    details = dict(layers=[s[0] for s in stamps], calls=[None if s[1] else s[2] for s in stamps])
    if len({s[0] for s in stamps}) == 1 and stamps[0][0] >= 0 and len({s[1] for s in stamps}) > 1:
        builders = [str(r) for r, s in enumerate(stamps) if s[1]]
        raise StepBuiltOnSomeRanksError(
            f"rank {rank}: rank{'s' if len(builders) > 1 else ''} {', '.join(builders)} build the routed step of "
            f"{_call_name(stamps[0][:1])} again while the others call the step they kept ({where}): destroy() was "
            f"called on some ranks only. No row moved and no rank counted this call; call destroy() on every rank "
            f"of the EP group or on none", **details)
    raise StepOutOfSyncError(
        f"rank {rank}: the ranks of the EP group are not at the same call of the same layer ({where}; MoE layers "
        f"are numbered in the order they were built on the EP group). No row moved and no rank counted this call. "
        f"Make every rank call the same layers in the same order, each as many times (T = 0 on a rank without "
        f"tokens)", **details)


def _call_name(stamp: list[int]) -> str:
    """``layer L call #N`` (layer index L at its call index N), ``layer L (building its routed step)`` or, for a bare
    index, ``layer L``."""
    layer = f"layer {stamp[0]}" if stamp[0] >= 0 else "a layer without an index"
    if len(stamp) == 1:
        return layer
    return f"{layer} (building its routed step)" if stamp[1] else f"{layer} call #{stamp[2]}"
