"""The sparse MoE blocks of a loaded transformers model, and their own tensors handed to a ``MegaMoE``.

    model --find_moe_blocks: each decoder layer's child holding a fused experts module--> BlockSite
    BlockSite --block_config: the model's config through moe_ref's family table--> MoEConfig
    BlockSite.block's state_dict (views)
      --CheckpointReader over the tensors in memory + load_moe_weights (each family's transformers 5.x names)-->
      MoEWeights of this rank's experts (views where the layout is moe_ref's, else converted once)
      --take_weights: the tensors become the layer's parameters (no copy)--> MegaMoE

A block is a module whose child ``experts`` holds transformers 5.x's fused ``gate_up_proj``/``down_proj`` and which
sits directly under a numbered decoder layer (``model.layers.3.mlp``). No family is named here: the config and the
tensor names go through moe_ref's own family table (``MoEConfig.from_hf_config``, ``load_moe_weights``).

Shape legend: E experts, e local experts, D hidden width, F expert intermediate.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
from torch import nn

from moe_ref.checkpoint.loading import load_moe_weights
from moe_ref.core.config import MoEConfig
from moe_ref.core.errors import BlockWeightsUnavailableError, UnknownFamilyError, UnsupportedModelError
from moe_ref.core.weights import EXPERT_FIELDS, MoEWeights
from moe_ref.layer import MegaMoE

_PLAIN_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# MegaMoE's expert parameters (allocated by a load), by MoEWeights field
_EXPERT_PARAMETERS = {"gate_up_weight_E2FD": "gate_up_weight", "down_weight_EDF": "down_weight",
                      "gate_up_bias_E2F": "gate_up_bias", "down_bias_ED": "down_bias"}
# "<prefix><layer index>.<child>": the block sits directly under a numbered decoder layer
_SITE = re.compile(r"^(?P<prefix>(?:.*\.)?)(?P<layer>\d+)\.(?P<attr>\w+)$")


@dataclass(frozen=True)
class BlockSite:
    """Where one sparse MoE block sits.

    Attributes:
        name: its module name, e.g. ``"model.layers.3.mlp"``.
        prefix: the text before the layer number (``"model.layers."``).
        layer_idx: the decoder layer.
        attr: its attribute on the decoder layer (``"mlp"``).
        parent: the decoder layer.
        block: the block module.
    """

    name: str
    prefix: str
    layer_idx: int
    attr: str
    parent: nn.Module
    block: nn.Module

    @property
    def experts(self) -> nn.Module:
        return self.block.experts


def is_fused_experts(module: nn.Module) -> bool:
    """A transformers 5.x experts module: all experts in stacked ``gate_up_proj``/``down_proj`` tensors."""
    return isinstance(getattr(module, "down_proj", None), torch.Tensor) and (
        isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
        or isinstance(getattr(module, "up_proj", None), torch.Tensor))


def find_moe_blocks(model: nn.Module) -> list[BlockSite]:
    """Every sparse MoE block of ``model``, in module order (the same on every rank of an identical model)."""
    modules = dict(model.named_modules())
    sites = []
    for name, module in modules.items():
        match = _SITE.match(name)
        experts = getattr(module, "experts", None)
        if match is None or not isinstance(experts, nn.Module) or not is_fused_experts(experts):
            continue
        parent = modules[name.rpartition(".")[0]]
        sites.append(BlockSite(name, match["prefix"], int(match["layer"]), match["attr"], parent, module))
    return sites


def text_config(model: nn.Module):
    """The transformers config of the model's decoder (``text_config`` of a multimodal wrapper)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def block_config(model: nn.Module) -> MoEConfig:
    """The ``MoEConfig`` of the model's MoE blocks, read from its config by moe_ref's family table.

    Raises ``UnsupportedModelError`` (CFG030) for a model_type moe_ref does not compute (the family table's own
    message, naming the supported ones, is kept in it)."""
    config = text_config(model)
    try:
        return MoEConfig.from_hf_config(config.to_dict())
    except UnknownFamilyError as err:
        raise UnsupportedModelError(
            f"{type(model).__name__} (model_type {getattr(config, 'model_type', None)!r}): moe_ref does not compute "
            f"this family's MoE block. {err.message}", model_type=getattr(config, "model_type", None)) from None


def check_block_tensors(site: BlockSite) -> None:
    """``BlockWeightsUnavailableError`` (LOAD022) unless every tensor of the block is materialized (not on the
    ``meta`` device: offloaded) and plain floating point (not quantized by a transformers quantizer)."""
    for key, tensor in site.block.state_dict().items():
        if tensor.is_meta:
            raise BlockWeightsUnavailableError(
                f"{site.name}.{key} is on the 'meta' device (offloaded by device_map); load the model fully on its "
                f"devices (no disk/CPU offload) before patch_model", name=f"{site.name}.{key}")
        if tensor.dtype not in _PLAIN_FLOATS:
            raise BlockWeightsUnavailableError(
                f"{site.name}.{key} is {tensor.dtype} (quantized by transformers?); patch_model takes bf16/fp16/fp32 "
                f"blocks: load the model unquantized, or read a quantized checkpoint with MegaMoE.load_hf_weights "
                f"(FP8/INT4/MXFP4 experts as stored)", name=f"{site.name}.{key}", dtype=str(tensor.dtype))


def block_weights(site: BlockSite, cfg: MoEConfig, layer: MegaMoE) -> MoEWeights:
    """The block's weights for ``layer``: this rank's experts and the whole router and shared experts, in the
    layer's dtype on its device. Where a tensor is already in moe_ref's layout, dtype and device, it is a view of
    the block's own (all experts at one rank); a partial expert range is copied, so the block's full tensors can
    be freed. The block's tensors must have passed ``check_block_tensors``."""
    tensors = {f"{site.name}.{key}": tensor for key, tensor in site.block.state_dict().items()}
    first, count = layer.first_local_expert, layer.num_local_experts
    weights = load_moe_weights(tensors, cfg, site.layer_idx, prefix=site.prefix, expert_range=(first, count),
                               dtype=layer.options.dtype, device=layer.options.device)
    if count < cfg.num_experts:  # a view would keep every rank's experts alive through the block's storage
        weights = dataclasses.replace(weights, **{name: getattr(weights, name).clone() for name in EXPERT_FIELDS
                                                  if getattr(weights, name) is not None})
    return weights


def take_weights(layer: MegaMoE, weights: MoEWeights) -> None:
    """Make ``weights``' tensors the layer's parameters and buffers themselves (no copy: ``load_state_dict`` with
    ``assign=True``, which checks every shape and name strictly and marks the layer loaded). The expert parameters
    (the layer allocates them at a load) are set first, so the load allocates no experts of its own."""
    with torch.no_grad():
        for field, attribute in _EXPERT_PARAMETERS.items():
            if getattr(weights, field) is not None:
                setattr(layer, attribute, nn.Parameter(getattr(weights, field), requires_grad=False))
    held = layer.weights()  # the layer's own tensors, by MoEWeights field
    key_of = {id(tensor): key for key, tensor in layer.state_dict(keep_vars=True).items()}
    state = {}
    for field in dataclasses.fields(MoEWeights):
        own, given = getattr(held, field.name), getattr(weights, field.name)
        if isinstance(own, torch.Tensor):
            state[key_of[id(own)]] = given
    layer.load_state_dict(state, strict=True, assign=True)
