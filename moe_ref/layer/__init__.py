"""``MegaMoE``, the drop-in expert-parallel MoE block, and the modules it is made of (``megamoe`` holds the class and
its numbered forward steps; ``construction``, ``weights``, ``calls`` and ``runtime`` one concern each)."""
from moe_ref.layer.construction import as_config
from moe_ref.layer.megamoe import MegaMoE
from moe_ref.layer.runtime import release_all_at_exit

__all__ = ["MegaMoE", "as_config", "release_all_at_exit"]
