"""EPLB weight mover: a layer's expert weights moved to a new placement over the EP group (``MegaMoE.rebalance``).

    rebalance_slots(slots, new_placement, tensors, group)         collective over the EP group, between calls
      1. agree: every rank's problem with the new placement (CFG023, CFG033) and a digest of it, gathered; a coded
         error on every rank before any byte moves (CFG024 when the ranks were given different placements)
      2. canary before: a digest of sampled bytes of every slot, gathered: the expected digest of each logical
         expert (its first replica's)
      3. moves (``plan_moves``, the same list on every rank): a slot whose expert is unchanged stays; every other
         slot gets its new expert from a slot holding it in the old placement, on its own rank if one does (a
         local copy), else the holder ``slot % holders``; by point-to-point sends (``batch_isend_irecv``: NCCL on
         GPUs, gloo on CPU) of each tensor's slot as raw bytes, so plain, FP8-block (+ scales), INT4 and MXFP4
         experts move as they are held. Received slots land in side buffers and are written in place only after
         every send of the old values completed
      4. canary after: each local slot's digest against its new expert's; any mismatch is ENV019 on every rank
      5. the slots' device tables take the new placement, in place

Rule: no call of the layer may run half-moved. ``rebalance`` is a collective of its own, like a load: every rank
calls it, between calls of the layer (none in flight on any rank, no capture open); the next call runs with the new
placement everywhere. The layer rebuilds its experts and restarts its telemetry window after it.

Shape legend: e local slots, Ph physical slots, R EP ranks.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from moe_ref.core.errors import (PlacementDisagreementError, PlacementError, RebalanceCanaryError)
from moe_ref.ep.distributed import (comm_device, gather_ints, gather_objects, group_size_and_rank, peer_errors,
                                    problem_of, raise_agreed_problem)
from moe_ref.eplb.placement import Placement
from moe_ref.eplb.slots import ExpertSlots, placement_digest

CANARY_BYTES = 4096  # sampled bytes per slot and tensor


def plan_moves(old_Ph: list[int], new_Ph: list[int], slots_per_rank: int) -> list[tuple[int, int]]:
    """``[(destination slot, source slot)]`` for every slot whose logical expert changes, in slot order.

    The source holds the destination's new expert in ``old_Ph``: one on the destination's own rank if any (the
    first), else holder number ``destination % holders`` (spreading the sends of a popular expert).
    """
    holders: dict[int, list[int]] = {}
    for slot, expert in enumerate(old_Ph):
        holders.setdefault(expert, []).append(slot)
    moves = []
    for slot, expert in enumerate(new_Ph):
        if old_Ph[slot] == expert:
            continue
        rank = slot // slots_per_rank
        local = [q for q in holders[expert] if q // slots_per_rank == rank]
        moves.append((slot, local[0] if local else holders[expert][slot % len(holders[expert])]))
    return moves


def slot_canaries(tensors: list[torch.Tensor], num_local: int) -> torch.Tensor:
    """``[e]`` int64 on the tensors' device: a digest of up to ``CANARY_BYTES`` evenly spaced bytes of each local
    slot of each tensor (``tensors``: ``[e, ...]`` each, any dtype), combined over the tensors in order."""
    device = tensors[0].device if tensors else torch.device("cpu")
    digest_e = torch.zeros(num_local, dtype=torch.int64, device=device)
    for index, tensor in enumerate(tensors):
        bytes_eN = tensor.contiguous().view(num_local, -1).view(torch.uint8) if tensor.numel() else None
        if bytes_eN is None:
            continue
        n = bytes_eN.shape[1]
        take = min(n, CANARY_BYTES)
        positions = torch.arange(take, device=device) * n // take
        weights = torch.arange(1, take + 1, dtype=torch.int64, device=device)
        digest_e += (bytes_eN[:, positions].to(torch.int64) * weights).sum(dim=1) * (7919 * index + 1)
    return digest_e


def _agree_on_placement(slots: ExpertSlots, placement, group) -> Placement:
    """Step 1: the new placement, or a coded error on every rank."""
    problem = None
    if isinstance(placement, (str, os.PathLike)):
        try:
            placement = Placement.load(placement)
        except PlacementError as err:
            problem = err
    problem = problem or slots.fit_problem(placement)
    digest = None if problem is not None else placement_digest(placement)
    world, rank = group_size_and_rank(group)
    everyone = gather_objects((problem_of(problem), digest), group)
    raise_agreed_problem([p for p, _ in everyone], rank)
    digests = [d for _, d in everyone]
    if len(set(digests)) > 1:
        ranks_by_digest = {}
        for r, d in enumerate(digests):
            ranks_by_digest.setdefault(d, []).append(r)
        raise PlacementDisagreementError(f"rank {rank}: rebalance was given {len(ranks_by_digest)} different "
                                         f"placements (ranks per placement digest: {ranks_by_digest}); no weight moved")
    return placement


def _move(moves: list[tuple[int, int]], tensors: list[torch.Tensor], slots: ExpertSlots, group) -> None:
    """Step 3 for this rank: sends, receives and local copies of the moved slots, then the in-place writes."""
    e, me = slots.num_local, slots.rank
    ops, landed = [], []  # landed: (tensor, local slot, buffer holding its new value)
    for dst, src in moves:
        dst_rank, src_rank = dst // e, src // e
        for tensor in tensors:
            if dst_rank == me:
                buffer = tensor[src - me * e].clone() if src_rank == me else torch.empty_like(tensor[dst - me * e])
                if src_rank != me:
                    ops.append(dist.P2POp(dist.irecv, buffer.view(torch.uint8), src_rank, group=group))
                landed.append((tensor, dst - me * e, buffer))
            elif src_rank == me:
                ops.append(dist.P2POp(dist.isend, tensor[src - me * e].view(torch.uint8), dst_rank, group=group))
    if ops:
        with peer_errors("rebalance (point-to-point sends of expert weights)", group):
            for request in dist.batch_isend_irecv(ops):
                request.wait()
    with torch.inference_mode(False), torch.no_grad():
        for tensor, slot, buffer in landed:
            tensor[slot].copy_(buffer)


def rebalance_slots(slots: ExpertSlots, placement, tensors: list[torch.Tensor], group) -> None:
    """Move this rank's slots to ``placement`` (module doc; collective over ``group``, between calls).

    Args:
        slots: the layer's ``ExpertSlots`` (their placement is the old one; replaced on return).
        placement: a one-layer ``Placement`` (or a path to one) for the same E, R and Ph, the same on every rank.
        tensors: every tensor of this rank's experts, ``[e, ...]`` each, contiguous (plain weights and biases, or a
            quantized block's fields); empty when the layer holds no experts yet (then only the map changes).
        group: the EP group (None: one process).

    Raises, on every rank alike: CFG033 / CFG023 (a placement that does not fit), ``PlacementDisagreementError``
    (CFG024), ``RebalanceCanaryError`` (ENV019: then the weights are not what the new placement says).
    """
    placement = _agree_on_placement(slots, placement, group)
    old_Ph, new_Ph = slots.physical_to_logical_Ph.tolist(), placement.physical_to_logical_LyPh[0].tolist()
    device = comm_device(group, tensors[0].device if tensors else torch.device("cpu"))
    expected = None
    if tensors:
        before = [d for rank_digests in gather_ints([], group, device, device_values=slot_canaries(tensors, slots.num_local),
                                                    what="rebalance (canary before)") for d in rank_digests]
        expected = {}
        for slot, expert in enumerate(old_Ph):
            expected.setdefault(expert, before[slot])
    _move(plan_moves(old_Ph, new_Ph, slots.num_local), tensors, slots, group)
    slots.set_placement(placement)
    if expected is None:
        return
    after = slot_canaries(tensors, slots.num_local).tolist()
    wrong = [(slots.first_slot + i, new_Ph[slots.first_slot + i]) for i, digest in enumerate(after)
             if digest != expected[new_Ph[slots.first_slot + i]]]
    everyone = gather_objects(wrong, group)
    bad = [f"slot {slot} (expert {expert})" for rank_wrong in everyone for slot, expert in rank_wrong]
    if bad:
        raise RebalanceCanaryError(f"rank {slots.rank}: after the move {len(bad)} slots do not hold their expert's "
                                   f"bytes: {', '.join(bad[:8])}{' ...' if len(bad) > 8 else ''}")
