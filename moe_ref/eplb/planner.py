"""EPLB planner: from per-expert load to a Placement that evens the rows each rank computes (CPU, pure functions).

    load [Ly, E] -> (a) pack expert groups onto nodes -> (b) replicate the heaviest experts within each node
      -> (c) pack the replicas onto the node's ranks -> Placement (moe_ref.eplb.placement)

The algorithm is DeepSeek's EPLB as described in its README (hierarchical policy; the global policy is the same
with one node and one group), written here from that description:

(a) The G expert groups (E / G consecutive experts each) are packed onto the N nodes, G / N groups per node,
    balancing the summed load of a node's groups (balanced packing, below). Keeping a group on one node keeps
    group-limited routing's traffic inside the node.
(b) Each node has P / N slots for its E / N experts. Every expert gets one; each spare slot goes, one at a time,
    to the expert with the largest load / replica count (ties: the lowest expert id).
(c) Each replica carries load / replica count of its expert; the node's P / N replicas are packed onto its
    R / N ranks, P / R each, with balanced packing. A rank's slots list its experts in increasing id order.

Balanced packing: items in decreasing weight order (ties: lower index first) each go to the least loaded bin that
still has room (ties: the lower bin). Ranks are numbered node by node: node n owns ranks
[n * R / N, (n + 1) * R / N).

Shape legend: E experts (the model's logical experts), G expert groups, Eg experts per group (E / G), R EP ranks,
Ly MoE layers of a model, Ph physical expert slots of a layer (``num_physical``: E + redundant replicas).
"""
from __future__ import annotations

import torch

from moe_ref.core.errors import LoadTraceError, PlacementTopologyError
from moe_ref.eplb.placement import Placement


def check_load(load_LyE: torch.Tensor) -> torch.Tensor:
    """The load as a float64 ``[Ly, E]`` table, or ``LoadTraceError`` (CFG035) naming what is wrong.

    Args:
        load_LyE: ``[Ly, E]``, any real dtype: rows routed to each logical expert per layer (finite, ``>= 0``).

    Returns:
        load_LyE: ``[Ly, E]`` ``torch.float64`` on CPU.
    """
    if not isinstance(load_LyE, torch.Tensor) or load_LyE.dim() != 2 or load_LyE.numel() == 0:
        got = list(load_LyE.shape) if isinstance(load_LyE, torch.Tensor) else type(load_LyE).__name__
        raise LoadTraceError(f"expert load must be a non-empty [layers, experts] tensor, got {got}")
    if load_LyE.is_complex() or load_LyE.dtype == torch.bool:
        raise LoadTraceError(f"expert load must be real counts, got dtype {load_LyE.dtype}")
    load_LyE = load_LyE.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(load_LyE).all()) or bool((load_LyE < 0).any()):
        raise LoadTraceError(f"expert load must be finite and >= 0; min {float(load_LyE.min())}, "
                             f"max {float(load_LyE.max())}")
    return load_LyE


def check_topology(num_experts: int, num_physical: int, num_groups: int, num_nodes: int, num_ranks: int) -> None:
    """Raise ``PlacementTopologyError`` (CFG034) with the numbers when the planner cannot place these sizes.

    Args:
        num_experts: E logical experts.
        num_physical: P physical slots (E + redundant).
        num_groups: G expert groups.
        num_nodes: N nodes.
        num_ranks: R EP ranks (GPUs), R / N per node.
    """
    sizes = dict(num_experts=num_experts, num_physical=num_physical, num_groups=num_groups, num_nodes=num_nodes,
                 num_ranks=num_ranks)
    small = [f"{name}={value}" for name, value in sizes.items() if value < 1]
    if small:
        raise PlacementTopologyError(f"{', '.join(small)}: every size must be >= 1")
    rules = [
        (num_physical < num_experts, f"{num_physical=} < {num_experts=}: each expert needs a slot; "
                                     f"use num_physical >= {num_experts} (redundant >= 0)"),
        (num_physical % num_ranks, f"{num_physical=} % {num_ranks=} = {num_physical % num_ranks}: slots must split "
                                   f"evenly over ranks; add {-num_physical % num_ranks} redundant slots"),
        (num_ranks % num_nodes, f"{num_ranks=} % {num_nodes=} = {num_ranks % num_nodes}: every node needs the "
                                f"same number of ranks"),
        (num_experts % num_groups, f"{num_experts=} % {num_groups=} = {num_experts % num_groups}: groups must "
                                   f"split the experts evenly"),
        (num_groups % num_nodes, f"{num_groups=} % {num_nodes=} = {num_groups % num_nodes}: every node holds the "
                                 f"same number of groups; use a group count that is a multiple of the nodes"),
    ]
    for broken, message in rules:
        if broken:
            raise PlacementTopologyError(message)


def balanced_packing(weights: list[float], num_bins: int) -> list[int]:
    """Pack ``len(weights)`` items into ``num_bins`` bins of ``len(weights) / num_bins`` items each.

    Args:
        weights: one weight per item (``len(weights) % num_bins == 0``).
        num_bins: the bins.

    Returns:
        bin_of_item: the bin of each item, in item order.

    Example: weights [5, 1, 4, 2] into 2 bins -> 5 to bin 0, 4 to bin 1, 2 to bin 1 (4 < 5), 1 to bin 0:
    ``[0, 0, 1, 1]`` (bin loads 6 and 6).
    """
    capacity = len(weights) // num_bins
    loads, sizes, bin_of_item = [0.0] * num_bins, [0] * num_bins, [0] * len(weights)
    for item in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        target = min((b for b in range(num_bins) if sizes[b] < capacity), key=lambda b: (loads[b], b))
        bin_of_item[item] = target
        loads[target] += weights[item]
        sizes[target] += 1
    return bin_of_item


def replicate(load_E: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Replica counts for experts sharing ``num_slots`` slots: one each, then each spare slot to the expert with the
    largest load per replica (ties: the lowest index).

    Args:
        load_E: ``[E]`` ``torch.float64``: the load of the experts (here: one node's experts).
        num_slots: slots to fill (``>= E``).

    Returns:
        replica_count_E: ``[E]`` ``torch.int64``, summing to ``num_slots``.
    """
    replica_count_E = torch.ones_like(load_E, dtype=torch.int64)
    for _ in range(num_slots - load_E.numel()):
        replica_count_E[int(torch.argmax(load_E / replica_count_E))] += 1  # argmax: the first of equal maxima
    return replica_count_E


def _plan_layer(load_E: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int,
                num_ranks: int) -> list[int]:
    """One layer's physical -> logical list (P entries) by steps (a)-(c) of the module doc."""
    num_experts = load_E.numel()
    experts_per_group, groups_per_node = num_experts // num_groups, num_groups // num_nodes
    ranks_per_node, slots_per_rank = num_ranks // num_nodes, num_physical // num_ranks
    group_load_G = load_E.view(num_groups, experts_per_group).sum(dim=1)
    node_of_group = balanced_packing(group_load_G.tolist(), num_nodes)
    physical_to_logical = [0] * num_physical
    for node in range(num_nodes):
        groups = [g for g in range(num_groups) if node_of_group[g] == node]
        assert len(groups) == groups_per_node
        experts = torch.cat([torch.arange(g * experts_per_group, (g + 1) * experts_per_group) for g in groups])
        replica_count_E = replicate(load_E[experts], num_physical // num_nodes)
        replica_experts = torch.repeat_interleave(experts, replica_count_E).tolist()
        replica_loads = torch.repeat_interleave(load_E[experts] / replica_count_E, replica_count_E).tolist()
        rank_of_replica = balanced_packing(replica_loads, ranks_per_node)
        for local_rank in range(ranks_per_node):
            rank = node * ranks_per_node + local_rank
            held = sorted(e for e, r in zip(replica_experts, rank_of_replica) if r == local_rank)
            physical_to_logical[rank * slots_per_rank:(rank + 1) * slots_per_rank] = held
    return physical_to_logical


def plan_hierarchical(load_LyE: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int,
                      num_ranks: int) -> Placement:
    """Place every layer's experts: groups onto nodes, replicas within nodes, replicas onto ranks (module doc).

    Args:
        load_LyE: ``[Ly, E]``, real, finite, ``>= 0``: rows routed to each logical expert per layer (CFG035 if not).
        num_physical: P physical slots per layer, E + redundant.
        num_groups: G expert groups (experts ``[g * E / G, (g + 1) * E / G)``); a group's replicas stay on one node.
        num_nodes: N nodes; node n owns ranks ``[n * R / N, (n + 1) * R / N)``.
        num_ranks: R EP ranks, P / R slots each.

    Returns:
        placement: the ``Placement`` (``physical_to_logical_LyPh`` ``[Ly, Ph]`` int64) over ``num_ranks`` ranks.

    Raises ``PlacementTopologyError`` (CFG034) for sizes it cannot place (``check_topology``).
    """
    load_LyE = check_load(load_LyE)
    num_experts = load_LyE.shape[1]
    check_topology(num_experts, num_physical, num_groups, num_nodes, num_ranks)
    physical_to_logical_LyPh = torch.tensor(
        [_plan_layer(load_E, num_physical, num_groups, num_nodes, num_ranks) for load_E in load_LyE],
        dtype=torch.int64)
    return Placement(physical_to_logical_LyPh, num_experts, num_ranks)


def plan_global(load_LyE: torch.Tensor, num_physical: int, num_ranks: int) -> Placement:
    """Place every layer's experts over all ranks at once: ``plan_hierarchical`` with one node and one group.

    Args:
        load_LyE: ``[Ly, E]``, real, finite, ``>= 0``: rows routed to each logical expert per layer.
        num_physical: P physical slots per layer, E + redundant.
        num_ranks: R EP ranks, P / R slots each.

    Returns:
        placement: the ``Placement`` over ``num_ranks`` ranks.
    """
    return plan_hierarchical(load_LyE, num_physical, num_groups=1, num_nodes=1, num_ranks=num_ranks)
