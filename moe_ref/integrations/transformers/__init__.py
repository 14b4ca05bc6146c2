"""moe_ref inside transformers models (transformers 5.x; importing this package imports transformers, and registers
``experts_implementation="moe_ref"``; ENV022 without it).

    patch_model(model, group=None, **layer_options) -> PatchReport                       (patch.py, blocks.py)
      each sparse MoE block -> PatchedMoEBlock(MegaMoE over the block's own tensors): router, expert
      parallelism over ``group``, overflow policy, shared experts: moe_ref's whole block
    from_pretrained(..., experts_implementation="moe_ref")                                (experts_interface.py)
      transformers' router and block, moe_ref's expert kernels on the experts module's own weights (one process)

Pick ``patch_model`` for expert parallelism across ranks (each rank keeps E / ep_size experts) and moe_ref's router;
pick ``experts_implementation="moe_ref"`` to swap only the expert GEMMs, as transformers' own entries (``grouped_mm``,
``batched_mm``, ``deepgemm``, ``sonicmoe``) do.
"""
from moe_ref.integrations.transformers.experts_interface import EXPERTS_IMPLEMENTATION, experts_forward, register
from moe_ref.integrations.transformers.patch import PatchedMoEBlock, PatchReport, patch_model

__all__ = ["patch_model", "PatchReport", "PatchedMoEBlock", "register", "experts_forward", "EXPERTS_IMPLEMENTATION"]

register()
