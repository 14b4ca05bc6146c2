"""``patch_model``: every sparse MoE block of a loaded transformers model becomes a ``MegaMoE`` over the block's own
tensors, in place; attention, norms, dense MLP layers, the cache and ``generate`` stay transformers'.

    patch_model(model, group, **layer_options)
      blocks.block_config: the model's config through moe_ref's family table       (else CFG030 on every rank)
      for each sparse MoE block, in module order (collective over ``group``: every rank patches the same model):
        MegaMoE(cfg, group, dtype/device of the block's experts, overflow="chunk" unless given)
        blocks.block_weights + take_weights: this rank's experts, the router, the shared experts; no copy where the
          layout is moe_ref's (one rank), no second read from disk
        decoder_layer.<attr> = PatchedMoEBlock(layer, the block's router)       (the old block is dropped)
      -> PatchReport

    PatchedMoEBlock.forward(hidden_states [..., D]) -> [..., D]  (flattened to [T, D] for the layer and back)
      the block's router is run too only where transformers records router logits (output_router_logits=True),
      so its recording hooks fire as in the unpatched model, or where the block also returned its router's
      weights (gpt-oss: ``(hidden, router_scores)``, which its decoder layer unpacks): then -> (y, router_scores)

What a block returns is found by calling it once on one token before it is replaced (``block_returns``): a tensor,
or a pair whose second item is its router's second output; anything else is refused (CFG030), since a decoder
layer that unpacks a pair would silently unpack a tensor's batch rows instead.

Shape legend: T tokens of this rank, D hidden width, E experts, e local experts.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moe_ref.core.errors import InvalidConfigError, UnsupportedModelError
from moe_ref.ep.distributed import group_size_and_rank
from moe_ref.integrations.transformers.blocks import (BlockSite, block_config, block_weights, check_block_tensors,
                                                      find_moe_blocks, take_weights, text_config)
from moe_ref.integrations.transformers.library import require_transformers
from moe_ref.layer import MegaMoE

logger = logging.getLogger(__name__)
# the block's child that routes (transformers 5.x names it "gate", gpt-oss "router"), kept for router logits
_ROUTER_ATTRS = ("gate", "router")
# set by patch_model: what the layer options default to where the caller leaves them out
_DEFAULT_OPTIONS = {"overflow": "chunk"}
# options that follow the model and cannot be chosen per layer here
_FIXED_OPTIONS = ("dtype", "device", "seed")


def _router_logits_requested() -> bool:
    """Whether transformers is recording ``router_logits`` in this forward (``output_router_logits=True``): its
    output-capturing context holds a ``router_logits`` list then. NOTE: that context is private to transformers
    (``transformers.utils.output_capturing._active_collector``, 5.x); where it is absent, no logits are recorded."""
    from transformers.utils import output_capturing

    collector = getattr(output_capturing, "_active_collector", None)
    collected = collector.get() if collector is not None else None
    return collected is not None and "router_logits" in collected


class PatchedMoEBlock(nn.Module):
    """A transformers sparse MoE block's place in its decoder layer, computed by a ``MegaMoE``.

    Args:
        moe: the layer holding the block's weights (this rank's experts).
        router: the block's own router module (its weight is the layer's gate weight: shared), run only when
            transformers records router logits; None: never run.
        name: the block's module name (for the repr and the report).
    """

    def __init__(self, moe: MegaMoE, router: nn.Module | None, name: str, returns_router_weights: bool = False):
        super().__init__()
        self.moe = moe
        self.router = router
        self.name = name
        self.returns_router_weights = returns_router_weights

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``hidden_states [..., D]`` (``[batch, seq, D]`` from the decoder layer) -> the same shape and dtype, and
        the router's weights ``[T, K]`` as the block returned them where it did (``returns_router_weights``).

        Collective over the layer's group (every rank calls it, with T = 0 where it has no tokens). Raises the
        layer's coded errors; with autograd on (``requires_grad`` input) ``GradientNotSupportedError`` (INP007):
        inference only."""
        x_TD = hidden_states.reshape(-1, hidden_states.shape[-1])
        routed = None
        if self.router is not None and (self.returns_router_weights or _router_logits_requested()):
            routed = self.router(x_TD)  # its forward hook records the logits, as in the unpatched model
        y = self.moe(x_TD).view(hidden_states.shape)
        return (y, routed[1]) if self.returns_router_weights else y

    def extra_repr(self) -> str:
        return f"name={self.name!r}" + (", returns_router_weights=True" if self.returns_router_weights else "")


@dataclass(frozen=True)
class PatchedBlockInfo:
    """One replaced block (``PatchReport.blocks``)."""

    name: str
    layer_idx: int
    block_class: str
    num_experts: int
    num_local_experts: int
    shared_experts: bool
    shares_expert_storage: bool  # the layer's experts ARE the block's tensors (no copy was made)


@dataclass(frozen=True)
class PatchReport:
    """What ``patch_model`` replaced.

    Attributes:
        model_class, model_type, family: the model and moe_ref's family for it.
        blocks: the replaced blocks, in module order.
        dense_layers: decoder layers left as they were (no sparse MoE block).
        ep_size, rank: the group the layers run over.
    """

    model_class: str
    model_type: str
    family: str
    blocks: tuple[PatchedBlockInfo, ...]
    dense_layers: tuple[int, ...]
    ep_size: int
    rank: int

    def __str__(self) -> str:
        lines = [f"moe_ref.patch_model: {self.model_class} ({self.model_type}, family {self.family}): "
                 f"{len(self.blocks)} MoE blocks -> MegaMoE (ep_size={self.ep_size}, rank {self.rank}); "
                 f"{len(self.dense_layers)} dense layers kept {list(self.dense_layers)}"]
        for b in self.blocks:
            storage = "shared with the block" if b.shares_expert_storage else "copied"
            lines.append(f"  layer {b.layer_idx:3d} {b.name}: {b.block_class} -> MegaMoE, experts "
                         f"{b.num_local_experts}/{b.num_experts} on this rank ({storage})"
                         f"{', shared experts' if b.shared_experts else ''}")
        return "\n".join(lines)


def patch_model(model: nn.Module, group: dist.ProcessGroup | None = None, *, verbose: bool = False,
                **layer_options) -> PatchReport:
    """Replace every sparse MoE block of a loaded transformers model with a ``MegaMoE`` over its own weights.

    Collective over ``group``: every rank patches the same model (same config and weights), and afterwards calls
    the model on its own batch (T may differ per rank, 0 included) the same number of times; each rank keeps its
    ``E / ep_size`` experts (the others are freed with the block). Inference only (the layer has no backward).

    Args:
        model: a transformers 5.x model of a family moe_ref computes (``MoEConfig.from_hf_config`` knows its
            model_type), fully materialized in bf16/fp16/fp32 (no offload, no transformers quantizer).
        group: the EP process group, or None for one process.
        verbose: print the report (rank 0 only).
        layer_options: ``MegaMoE``'s options (``num_max_tokens_per_rank``, ``overflow``, ``transport``,
            ``experts_backend``...); ``overflow`` defaults to ``"chunk"`` so a prefill above the cap runs. dtype and
            device follow each block's experts.

    Returns:
        ``PatchReport`` (``str()`` gives one line per block).

    Raises:
        UnsupportedModelError (CFG030): no sparse MoE block, already patched, or a model_type moe_ref does not
        compute; BlockWeightsUnavailableError (LOAD022): offloaded or quantized block tensors;
        InvalidConfigError (CFG007): a dtype/device/seed option; the layer's construction and loading errors.
    """
    require_transformers()
    fixed = sorted(set(layer_options) & set(_FIXED_OPTIONS))
    if fixed:
        raise InvalidConfigError(f"patch_model takes no {', '.join(fixed)}: each MegaMoE takes its block's dtype and "
                                 f"device (the model's); convert the model before patching", field=fixed[0])
    sites = find_moe_blocks(model)
    if not sites:
        already = any(isinstance(m, PatchedMoEBlock) for m in model.modules())
        raise UnsupportedModelError(
            f"{type(model).__name__} has no sparse MoE block (a decoder layer child with a transformers 5.x fused "
            f"experts module){': it is patched already' if already else ''}", model_class=type(model).__name__)
    cfg = block_config(model)
    for site in sites:  # every refusal before any layer is built (construction is collective)
        check_block_tensors(site)
    routers = [router_of(site) for site in sites]
    returns = [block_returns(site, router, cfg.hidden_size) for site, router in zip(sites, routers)]
    options = {**_DEFAULT_OPTIONS, **layer_options}
    infos = tuple(_patch_block(site, cfg, group, options, router, pair)
                  for site, router, pair in zip(sites, routers, returns))
    report = PatchReport(type(model).__name__, str(getattr(text_config(model), "model_type", "")), cfg.family,
                         infos, _dense_layers(model, sites), *group_size_and_rank(group))
    logger.info("%s", report)
    if verbose and report.rank == 0:
        print(report)
    return report


def _patch_block(site: BlockSite, cfg, group, options: dict, router: nn.Module | None,
                 returns_router_weights: bool) -> PatchedBlockInfo:
    """Build the block's MegaMoE, hand it the block's tensors and put it in the block's place."""
    experts = site.experts
    reference = experts.down_proj
    layer = MegaMoE(cfg, group, dtype=reference.dtype, device=reference.device, **options)
    weights = block_weights(site, cfg, layer)
    take_weights(layer, weights)
    gate_up = getattr(experts, "gate_up_proj", None)
    shares = gate_up is not None and layer.gate_up_weight.data_ptr() == gate_up.data_ptr()
    setattr(site.parent, site.attr, PatchedMoEBlock(layer, router, site.name, returns_router_weights))
    return PatchedBlockInfo(site.name, site.layer_idx, type(site.block).__name__, cfg.num_experts,
                            layer.num_local_experts, cfg.has_shared_experts, shares)


def router_of(site: BlockSite) -> nn.Module | None:
    """The block's router module (its child ``gate`` or ``router``), or None."""
    return next((getattr(site.block, a) for a in _ROUTER_ATTRS if isinstance(getattr(site.block, a, None), nn.Module)),
                None)


def block_returns(site: BlockSite, router: nn.Module | None, hidden_size: int) -> bool:
    """Whether the block returns ``(hidden, router weights)`` rather than a tensor: found by calling it (and its
    router) once on one seeded token ``[1, 1, hidden_size]``. ``UnsupportedModelError`` (CFG030) for any other
    output."""
    weight = site.experts.down_proj
    x = torch.randn(1, 1, hidden_size, generator=torch.Generator().manual_seed(0)).to(weight.device, weight.dtype)
    with torch.no_grad():
        out = site.block(x)
        if isinstance(out, torch.Tensor):
            return False
        pair = isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], torch.Tensor) and router is not None
        if pair:
            routed = router(x.reshape(-1, x.shape[-1]))
            if isinstance(routed, tuple) and len(routed) > 1 and torch.equal(routed[1], out[1]):
                return True
    raise UnsupportedModelError(
        f"{site.name} ({type(site.block).__name__}) returns {type(out).__name__}"
        f"{f' of {len(out)}' if isinstance(out, tuple) else ''}, not a tensor nor (hidden, its router's weights): "
        f"patch_model cannot return what this block returns", block=site.name)


def _dense_layers(model: nn.Module, sites: list[BlockSite]) -> tuple[int, ...]:
    num_layers = getattr(text_config(model), "num_hidden_layers", None)
    patched = {site.layer_idx for site in sites}
    return tuple(i for i in range(num_layers or 0) if i not in patched)
