"""Meeting users where their models already are: checkpoints by repo id from the local hub cache, and loaded
transformers models.

    from_pretrained("org/name" | folder, layer_idx, group=..., **layer_options)   (MegaMoE.from_pretrained)
      --moe_ref.checkpoint.hub: the snapshot folder, offline--> MegaMoE(config.json) --load_hf_weights--> layer
    moe_ref.integrations.transformers (imports transformers; registers experts_implementation="moe_ref"):
      patch_model(model, group=..., **layer_options): every sparse MoE block -> a MegaMoE over the block's own tensors
      the "moe_ref" entry of transformers' ExpertsInterface: moe_ref's expert kernels on a model's experts modules

``import moe_ref`` and ``import moe_ref.integrations`` import neither transformers nor huggingface_hub.
"""
__all__ = ["from_pretrained"]


def __getattr__(name):
    if name == "from_pretrained":
        from moe_ref.layer import MegaMoE

        return MegaMoE.from_pretrained
    raise AttributeError(f"module 'moe_ref.integrations' has no attribute {name!r}")
