"""Small collectives of an EP group: where they run, gathering a few integers, and agreeing on a failure.

Every function here is collective over ``group`` (all ranks call it, in the same order) and is the
identity for one process (``group`` None or of size 1). They carry the group's agreements:

    construction  agree_on_fields   every option that must match, one all_gather_object; claim_layer_index
                                    numbers the group's MoE layers in the order they are built
    each call     gather_ints       layer, call counter, row count, bound, problem code (moe_ref.ep.overflow),
                                    over the group's host group (gloo, CPU tensors: the GPU stream is not waited
                                    for; made with the EP group's own timeout)
    each chunk    agree_on_failure  did any rank fail inside the step, and (first chunk) the device-side checks
                                    (moe_ref.ep.routed_step): the call's one host sync on CUDA

so one rank's bad input, option or exception becomes a coded error on EVERY rank, and none waits for a
peer that has already left, nor longer than the EP group's timeout for one that stays away.
"""
from __future__ import annotations

import atexit
import contextlib
import time
from datetime import timedelta
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from moe_ref.core.errors import (CapacityMismatchError, GroupDisagreementError, GroupTimeoutError, MoERefError,
                                 PeerFailedError, error_class)
from moe_ref.ep.device_checks import DeviceChecks


@contextlib.contextmanager
def peer_errors(what: str, group=None):
    """Turn a failed collective of ``group`` (gloo and NCCL raise ``RuntimeError``) into a coded error naming
    ``what`` was running: ``GroupTimeoutError`` (ENV018, naming the group's timeout) when it ended at that timeout
    (a peer alive but away), else ``PeerFailedError`` (ENV005: a peer died or left). The package's own coded errors
    pass through."""
    start = time.monotonic()
    try:
        yield
    except MoERefError:
        raise
    except RuntimeError as err:
        waited = time.monotonic() - start
        detail = f"{type(err).__name__}: {str(err)[:300]}"
        timeout = group_timeout(group)
        # gloo says "Timed out waiting 2000ms for recv operation" on the rank whose wait ran out; that rank then
        # closes its connections, so a peer that waited about as long sees "Connection closed by peer" instead
        # (its own wait began a little later). A dead peer's closed connection comes without that wait.
        if "timed out" in str(err).lower() or (timeout is not None and waited >= timeout.total_seconds() / 2):
            limit = "unknown" if timeout is None else f"{timeout.total_seconds():g} s"
            raise GroupTimeoutError(
                f"{what} ended after {waited:.1f} s without every peer: the EP group's timeout is {limit}, and a rank "
                f"of the group is alive but did not make this call (it skipped a layer call, or is busy elsewhere) "
                f"or is slower than that. Make every rank call every EP layer in the same order (T = 0 on a rank "
                f"without tokens), or give the process group a longer timeout (init_process_group(..., "
                f"timeout=timedelta(seconds=N)) or new_group(..., timeout=...)); the group's collectives are out of "
                f"step now: rebuild the process group and the layers ({detail})",
                timeout_s=None if timeout is None else timeout.total_seconds(), waited_s=round(waited, 3)) from err
        raise PeerFailedError(f"{what} failed: a peer of the EP group died or left ({detail}); rebuild the process "
                              f"group and the layer") from err


def group_timeout(group) -> timedelta | None:
    """The timeout of ``group``'s collectives (the ``timeout=`` of ``init_process_group`` or ``new_group``), or None
    for one process or where torch does not say. NOTE: read from the backend's options (``_get_backend``,
    ``options._timeout``: torch has no public getter)."""
    if group is None:
        return None
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None


def comm_device(group, device: torch.device | str = "cpu") -> torch.device:
    """Where small collectives of ``group`` run: the CUDA device for NCCL, else the CPU (gloo)."""
    if group is not None and "nccl" in str(dist.get_backend(group)).lower():
        device = torch.device(device)
        return device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_size_and_rank(group) -> tuple[int, int]:
    """``(world size, rank)`` of ``group``; ``(1, 0)`` for None."""
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def group_max(values: Sequence[int], group=None, device: torch.device | str = "cpu") -> list[int]:
    """Element-wise max of small integers over the group (one tiny ``all_reduce``).

    Returns the maxima, the same on every rank. NOTE: syncs the host (``.tolist()``).
    """
    if group is None or dist.get_world_size(group) == 1:
        return list(values)
    tensor = torch.tensor(list(values), dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()


def gather_ints(values: Sequence[int], group=None, device: torch.device | str = "cpu",
                device_values: torch.Tensor | None = None, what: str = "the per-call agreement (all_gather)"
                ) -> list[list[int]]:
    """Every rank's ``values`` (same length on every rank): one ``all_gather`` of an int64 vector.

    Args:
        device_values: ``[n]`` integers computed on the device (same n on every rank), appended to ``values``
            without a read of their own.
        what: what the gather is, for the error when it fails (``peer_errors``).

    Returns ``[world][len(values) + n]``, rank order. NOTE: syncs the host (once).
    """
    world, _ = group_size_and_rank(group)
    if world == 1:
        return [list(values) + ([] if device_values is None else device_values.reshape(-1).tolist())]
    mine = host_ints_to(values, torch.device(device))
    if device_values is not None:
        mine = torch.cat([mine, device_values.to(device=device, dtype=torch.int64).reshape(-1)])
    gathered = [torch.empty_like(mine) for _ in range(world)]
    with peer_errors(what, group):
        dist.all_gather(gathered, mine, group=group)
        return torch.stack(gathered).tolist()


def host_ints_to(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """``[n]`` int64 on ``device`` without a host sync: a plain ``torch.tensor(values, device=cuda)`` copies from
    pageable memory and waits for the stream, i.e. for every kernel queued before it; from pinned memory the copy
    is queued like a kernel."""
    host = torch.tensor(list(values), dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def gather_objects(obj, group=None) -> list:
    """Every rank's picklable ``obj``, rank order (``all_gather_object``)."""
    world, _ = group_size_and_rank(group)
    if world == 1:
        return [obj]
    out: list = [None] * world
    with peer_errors("an agreement of the EP group (all_gather_object)", group):
        dist.all_gather_object(out, obj, group=group)
    return out


def agree_on_fields(fields: Mapping[str, str], group=None, *, what: str = "the layer") -> None:
    """Collective: raise on EVERY rank unless all ranks hold the same ``fields`` (see ``check_fields_agree``)."""
    world, rank = group_size_and_rank(group)
    if world > 1:
        check_fields_agree(gather_objects(dict(fields), group), rank, what=what)


def check_fields_agree(everyone: Sequence[Mapping[str, str]], rank: int, *, what: str = "the layer") -> None:
    """Raise unless every rank's ``fields`` (name -> value as text; gathered, rank order) are the same.

    Raises ``CapacityMismatchError`` (CAP002) when the cap ``num_max_tokens_per_rank`` differs, else
    ``GroupDisagreementError`` (CFG008); the message lists every differing field with each rank's value.
    """
    names = sorted(set().union(*everyone)) if everyone else []
    differing = {name: [str(d.get(name)) for d in everyone] for name in names
                 if len({str(d.get(name)) for d in everyone}) > 1}
    if not differing:
        return
    lines = "; ".join(f"{name}: " + ", ".join(f"rank {r}={v}" for r, v in enumerate(values))
                      for name, values in differing.items())
    message = (f"the ranks of the EP group built {what} with different options ({lines}); this is rank {rank}. "
               f"Build it from the same arguments and environment on every rank")
    if "num_max_tokens_per_rank" in differing:
        raise CapacityMismatchError(message + " (the cap: pass the same num_max_tokens_per_rank or set "
                                    "MOE_REF_NUM_MAX_TOKENS_PER_RANK for all ranks)",
                                    caps=differing["num_max_tokens_per_rank"], differing=differing)
    raise GroupDisagreementError(message, differing=differing, rank=rank)


def raise_agreed_problem(problems: Sequence[tuple[str, str] | None], rank: int) -> None:
    """Raise on this rank the error that the group agreed on (nothing when every entry is None).

    Args:
        problems: per rank, ``(code, message)`` of its problem or None (the result of ``gather_objects``).
        rank: this rank.

    The rank with the problem raises its own error's class with its message; the others raise the same
    class, naming the rank(s) and their messages, so every rank raises a coded error of one kind.
    """
    bad = [(r, p) for r, p in enumerate(problems) if p is not None]
    if not bad:
        return
    first_rank, (code, _) = bad[0]
    mine = problems[rank]
    if mine is not None:
        raise error_class(mine[0])(mine[1], rank=rank)
    summary = "; ".join(f"rank {r}: [{c}] {m}" for r, (c, m) in bad)
    raise error_class(code)(f"rank {rank}: another rank of the EP group cannot run this call, so no rank does "
                            f"({summary})", rank=rank, failed_ranks=[r for r, _ in bad])


def agree_on_failure(failure: BaseException | None, group=None, device: torch.device | str = "cpu",
                     device_checks: DeviceChecks | None = None) -> None:
    """Collective: if any rank failed inside a step, or a device-side check failed on any rank, raise on every rank.

    Args:
        failure: the exception this rank caught inside the step, or None.
        device_checks: this rank's device-side checks of the call (``moe_ref.ep.device_checks``), read here in the
            same all_gather as the failure flags; None when they were read already.

    Raises, on every rank: the failing rank its own exception and the others ``PeerFailedError`` (ENV005), naming
    the failed ranks and their errors; else, when a device check failed, the rank's own coded error on that rank
    and the same class naming it on the others (``raise_agreed_problem``). NOTE: syncs the host (once).
    """
    world, rank = group_size_and_rank(group)
    if world == 1 and device_checks is None:
        if failure is not None:
            try:
                raise failure
            finally:  # NOTE: a local holding the exception its own traceback holds is a reference cycle
                del failure  # (frame -> exception -> traceback -> frame), freed only by gc.collect()
        return
    flags = gather_ints([int(failure is not None)], group, device,
                        device_values=None if device_checks is None else device_checks.flags(torch.device(device)))
    if not any(any(row) for row in flags):
        return
    problem = None
    if failure is None and device_checks is not None:
        problem = device_checks.problem(flags[rank][1:])  # None when a re-check finds the flag was a false alarm
    described = None if failure is None else f"{type(failure).__name__}: {failure}"
    everyone = gather_objects((described, problem_of(problem)), group)
    if failure is not None:
        try:
            raise failure
        finally:
            del failure  # no cycle through this frame (see above)
    failed = [(r, m) for r, (m, _) in enumerate(everyone) if m is not None]
    if failed:
        summary = "; ".join(f"rank {r}: {m}" for r, m in failed)
        raise PeerFailedError(f"rank {rank}: the routed step failed on another rank ({summary}); no rank returns a "
                              f"partial result", failed_ranks=[r for r, _ in failed])
    raise_agreed_problem([p for _, p in everyone], rank)


# --- the host group: agreements on host integers that never wait for the GPU ------------------------------------

# NOTE: process-wide state: EP group -> its gloo host group, made once and kept (shared by the routed steps of every
# layer on that group): a group made with use_local_synchronization is named by its ranks, so one made again after
# a destroy would meet the first one's stale addresses in the store. Destroyed at exit (destroy_host_groups).
_HOST_GROUPS: dict = {}
# NOTE: process-wide state: EP group -> how many MoE layers were built on it (claim_layer_index).
_LAYER_COUNTS: dict = {}


def _group_key(group) -> tuple:
    return getattr(group, "group_name", None), id(group)


def host_group(group):
    """A gloo group of ``group``'s ranks, for the per-call agreement on host integers: on CPU tensors, so it waits
    for no GPU work (an NCCL all_gather read by the host waits for every kernel queued before it). Made with
    ``group``'s own timeout (``group_timeout``), so a peer that stays away is an error after the time the caller
    chose, not torch's default 30 min. Collective over ``group``'s members the first time
    (``new_group(..., use_local_synchronization=True)``); None for one process."""
    world, _ = group_size_and_rank(group)
    if world == 1:
        return None
    key = _group_key(group)
    host = _HOST_GROUPS.get(key)
    if host is None or not _alive(host):
        with peer_errors("building the EP group's host group (new_group)", group):
            host = dist.new_group(dist.get_process_group_ranks(group), backend="gloo", use_local_synchronization=True,
                                  timeout=group_timeout(group))
        _HOST_GROUPS[key] = host
    return host


def claim_layer_index(group) -> int:
    """The next index of a MoE layer built on ``group``: 0, 1, 2, ... in build order (not collective; building a
    layer is, so the k-th layer built on the group has index k on every rank). The per-call agreement carries it,
    so ranks calling different layers raise StepOutOfSyncError (ENV004) instead of pairing their calls."""
    key = _group_key(group)
    index = _LAYER_COUNTS.get(key, 0)
    _LAYER_COUNTS[key] = index + 1
    return index


def _alive(process_group) -> bool:
    """Whether ``process_group`` is still registered (``dist.destroy_process_group()`` destroys every group)."""
    try:
        dist.get_process_group_ranks(process_group)
        return True
    except (KeyError, ValueError, RuntimeError):
        return False


@atexit.register
def destroy_host_groups() -> None:
    """Destroy the host groups while the interpreter is intact (gloo's destructor can abort during its teardown)."""
    for host in _HOST_GROUPS.values():
        if _alive(host):
            dist.destroy_process_group(host)
    _HOST_GROUPS.clear()


def problem_of(err: MoERefError | None) -> tuple[str, str] | None:
    """``(code, message)`` of a coded error (what ``raise_agreed_problem`` rebuilds on other ranks)."""
    return None if err is None else (err.code, err.message)
