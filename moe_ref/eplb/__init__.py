"""Expert-parallel load balancing (EPLB), the CPU half: placements, the planner and the simulator.

    load [Ly, E] per window -> planner (plan_global / plan_hierarchical) -> Placement -> simulate (balancedness)

Owners: ``placement.Placement`` (the physical -> logical map, replica choice, file format), ``planner`` (DeepSeek's
EPLB algorithm), ``simulate`` (rows per rank before/after, synthetic Zipf loads), ``trace`` (load-trace files),
``cli`` (``moe-ref eplb simulate``). Stage 4, beside ``moe_ref.ep``; imports only ``moe_ref.core``.
"""
from moe_ref.eplb.placement import Placement
from moe_ref.eplb.planner import plan_global, plan_hierarchical
from moe_ref.eplb.simulate import balancedness, zipf_loads

__all__ = ["Placement", "plan_global", "plan_hierarchical", "balancedness", "zipf_loads"]
