"""Expert-parallel load balancing (EPLB): placements, the planner, the simulator, and the layer's side of it.

    load [Ly, E] per window -> planner (plan_global / plan_hierarchical) -> Placement -> simulate (balancedness)
    MegaMoE(num_redundant_experts=, placement=) -> slots (replica routing) -> telemetry (expert_load) -> mover

Owners: ``placement.Placement`` (the physical -> logical map, the replica rule, file format), ``planner`` (DeepSeek's
EPLB algorithm), ``simulate`` (rows per rank before/after, synthetic Zipf loads), ``trace`` (load-trace files),
``expert_times`` (the simulator's modelled step: measured expert MLP times, the slowest rank), ``cli`` (``moe-ref eplb
simulate``), ``slots`` (a layer's physical slots and replica routing on the device),
``telemetry`` (rows per slot gathered into ``ExpertLoad``, the dump format), ``mover`` (``rebalance``: weights moved
point to point, canary). Stage 4, beside ``moe_ref.ep`` (docs/eplb.md).
"""
from moe_ref.eplb.placement import Placement
from moe_ref.eplb.planner import plan_global, plan_hierarchical
from moe_ref.eplb.simulate import balancedness, zipf_loads

__all__ = ["Placement", "plan_global", "plan_hierarchical", "balancedness", "zipf_loads"]
