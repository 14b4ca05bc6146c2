"""The tensor names of one MoE layer in a checkpoint: each family's published layouts under a layer prefix, where a
layer's tensors are found (prefix, layout), and the hints a missing or misshapen tensor's error gives.

    MoEConfig.family --moe_ref.core.families (Family.layouts: TensorLayout per layout)--> names relative to a layer
    + layer prefix ("model.layers.3.") --layer_names--> LayerNames (full tensor names; per-expert ones hold {expert})
    checkpoint headers --detect_prefix / detect_layout--> the prefix and layout this checkpoint uses

``moe_ref.checkpoint.loading`` (plain weights), ``moe_ref.checkpoint.quantized`` (experts as stored) and
``moe_ref.checkpoint.synthetic`` (the writer) read and write through these names.

Shape legend: E experts, D hidden width, F expert intermediate, Dx expert input width.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from moe_ref.core.config import MoEConfig
from moe_ref.core.errors import UnsupportedCheckpointError
from moe_ref.core.families import FAMILIES, Family, TensorLayout, family_named
from moe_ref.core.families.deepseek_v3 import DEEPSEEK_V3
from moe_ref.checkpoint.reader import CheckpointReader

KNOWN_PREFIXES = ("model.layers.", "language_model.layers.", "model.language_model.layers.",
                  "language_model.model.layers.")


# --- names -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LayerNames:
    """Checkpoint names of one MoE layer in one layout (a family's ``TensorLayout`` under one layer's prefix).

    ``expert_form``: ``"per_expert"`` (``gate``/``up``/``down`` hold ``{expert}``: one 2-D tensor each),
    ``"stacked"`` (``gate [E, F, Dx]``, ``up [E, F, Dx]``, ``down [E, Dx, F]``; Step3) or
    ``"stacked_gate_up"`` (``gate_up [E, 2F, Dx]``, ``down [E, Dx, F]``; transformers 5.x; gpt-oss stores them
    ``transposed`` for ``x @ W`` with gate and up ``interleaved`` by column). ``bias`` is the selection-only
    ``e_score_correction_bias``; ``router_bias`` the gate's logit bias. Optional tensors are None when the family
    has no such tensor.
    """

    layout: str
    expert_form: str
    router: str
    bias: str | None
    gate: str | None
    up: str | None
    down: str
    gate_up: str | None
    shared_gate: str | None
    shared_up: str | None
    shared_down: str | None
    latent_down: str | None = None
    latent_up: str | None = None
    latent_norm: str | None = None
    router_bias: str | None = None
    gate_up_bias: str | None = None
    down_bias: str | None = None
    shared_expert_gate: str | None = None
    transposed: bool = False
    interleaved: bool = False


def names_family(family: str) -> Family:
    """The family whose names a ``MoEConfig.family`` reads: its own, or DeepSeek-V3's for ``custom``."""
    return family_named(family) or DEEPSEEK_V3


def family_layouts(family: str) -> tuple[str, ...]:
    """The layouts ``family`` is published in (``("hub", "fused")``, or ``("hub",)``), the Hub's first."""
    return names_family(family).layout_names


def layer_names(family: str, layout: str, layer_prefix: str) -> LayerNames:
    """The names of one MoE layer's tensors for ``family`` in ``layout``.

    Args:
        family: ``MoEConfig.family`` (a ``moe_ref.core.families`` name, or ``custom``: DeepSeek-V3's names).
        layout: ``"hub"`` (as published on the Hugging Face Hub) or ``"fused"`` (transformers 5.x fused experts).
        layer_prefix: e.g. ``"model.layers.3."``.

    Returns:
        ``LayerNames``; raises ``UnsupportedCheckpointError`` for a layout the family does not have.
    """
    fam = names_family(family)
    found = fam.layout(layout)
    if found is None:
        raise UnsupportedCheckpointError(
            f"layout={layout!r} does not exist for family {family!r}; its layouts: {', '.join(fam.layout_names)}",
            layout=layout, family=family)
    return _prefixed(found, layer_prefix)


def _prefixed(layout: TensorLayout, layer_prefix: str) -> LayerNames:
    def full(name: str | None) -> str | None:
        return None if name is None else layer_prefix + name

    return LayerNames(
        layout.name, layout.experts, router=full(layout.router), bias=full(layout.selection_bias),
        gate=full(layout.gate), up=full(layout.up), down=full(layout.down), gate_up=full(layout.gate_up),
        shared_gate=full(layout.shared_gate), shared_up=full(layout.shared_up), shared_down=full(layout.shared_down),
        latent_down=full(layout.latent_down), latent_up=full(layout.latent_up), latent_norm=full(layout.latent_norm),
        router_bias=full(layout.router_bias), gate_up_bias=full(layout.gate_up_bias), down_bias=full(layout.down_bias),
        shared_expert_gate=full(layout.shared_expert_gate), transposed=layout.transposed,
        interleaved=layout.interleaved)


def detect_prefix(ckpt: CheckpointReader, cfg: MoEConfig, layer_idx: int) -> str:
    """The first known prefix under which this layer's router exists (in any of the family's layouts); else the
    first one any key uses."""
    for candidate in KNOWN_PREFIXES:
        routers = {layer_names(cfg.family, layout, f"{candidate}{layer_idx}.").router
                   for layout in family_layouts(cfg.family)}
        if any(router in ckpt for router in routers):
            return candidate
    for candidate in KNOWN_PREFIXES:
        if any(name.startswith(candidate) for name in ckpt.names()):
            return candidate
    return KNOWN_PREFIXES[0]


def detect_layout(ckpt: CheckpointReader, cfg: MoEConfig, layer_prefix: str, first: int) -> LayerNames:
    """The family's layout whose expert tensors exist for this layer (``hub`` when none does: its names
    then appear in the missing-tensor error)."""
    layouts = family_layouts(cfg.family)
    for layout in layouts:
        names = layer_names(cfg.family, layout, layer_prefix)
        probe = names.gate_up or names.gate.format(expert=first)
        if probe in ckpt:
            return names
    return layer_names(cfg.family, layouts[0], layer_prefix)


# --- hints for the loader's errors -----------------------------------------------------------------------------------------

def ranges(values) -> str:
    """``[1, 2, 3, 5]`` -> ``"1-3, 5"``."""
    values, out, start = sorted(set(values)), [], None
    for i, v in enumerate(values):
        start = v if start is None else start
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(f"{start}-{v}" if v != start else f"{v}")
            start = None
    return ", ".join(out)


def missing_hint(ckpt: CheckpointReader, cfg: MoEConfig, layer_idx: int, name: str) -> str:
    """Why a tensor may be missing: a dense layer, another prefix or layout, or similar names."""
    hints = []
    if not cfg.is_moe_layer(layer_idx):
        hints.append(f"Layer {layer_idx} is a dense layer in this config; its MoE layers are "
                     f"{ranges(cfg.moe_layers)}.")
    match = re.match(r"^(.*?)(\d+)\.(.*)$", name)
    if match:
        prefix, _, suffix = match.groups()
        pattern = re.compile(r"^(.*?)(\d+)\." + re.escape(suffix) + "$")
        elsewhere = [(m.group(1), int(m.group(2))) for m in map(pattern.match, ckpt.names()) if m]
        here = sorted(layer for p, layer in elsewhere if p == prefix)
        if here:
            hints.append(f"The checkpoint has '{prefix}<L>.{suffix}' for layers {ranges(here)}.")
        other_prefixes = sorted({p for p, layer in elsewhere if p != prefix and layer == layer_idx})
        if other_prefixes:
            hints.append(f"It exists under another prefix: pass prefix={other_prefixes[0]!r}.")
        if "experts." in suffix and len(elsewhere) == 0:
            hints.append("Looked for the layouts " + " and ".join(
                f"{layout!r} ({_expert_probe(cfg.family, layout, prefix + str(layer_idx) + '.')})"
                for layout in family_layouts(cfg.family)) + ".")
    other_family = _other_family_router(ckpt, cfg.family, layer_idx)
    if other_family:
        hints.append(f"The checkpoint has {other_family[1]!r} ({other_family[0]} naming): is the config's family "
                     f"({cfg.family}) right? Build it with MoEConfig.from_hf_config('<checkpoint dir>').")
    similar = _similar_names(ckpt, name, layer_idx)
    if similar:
        hints.append(f"Similar names in the checkpoint: {', '.join(similar)}.")
    if not hints:
        hints.append("Check layer_idx, the config's family, and prefix= (the text before the layer number).")
    return " ".join(hints)


def _other_family_router(ckpt: CheckpointReader, family: str, layer_idx: int) -> tuple[str, str] | None:
    """``(naming, router name)`` of another family's router found for this layer, else None (the first family in
    registry order whose router name differs from this family's and is in the checkpoint)."""
    own = {layout.router for layout in names_family(family).layouts}
    for other in FAMILIES:
        for layout in other.layouts:
            if layout.router in own:
                continue
            for prefix in KNOWN_PREFIXES:
                if f"{prefix}{layer_idx}.{layout.router}" in ckpt:
                    return other.models, f"{prefix}{layer_idx}.{layout.router}"
    return None


def _expert_probe(family: str, layout: str, layer_prefix: str) -> str:
    names = layer_names(family, layout, layer_prefix)
    return names.gate_up or names.gate


def _similar_names(ckpt: CheckpointReader, name: str, layer_idx: int, limit: int = 3) -> list[str]:
    """Names of the same layer (any prefix) closest to ``name``, else names with the same last two parts."""
    same_layer = [n for n in ckpt.names() if _layer_of(n) == layer_idx]
    close = difflib.get_close_matches(name, same_layer, n=limit, cutoff=0.75)
    if close:
        return close
    tail = ".".join(name.split(".")[-2:])
    return sorted(n for n in ckpt.names() if n.endswith(tail))[:limit]


def _layer_of(name: str) -> int | None:
    """The first integer component of a dotted name (the layer number in every family's naming)."""
    match = re.search(r"(?:^|\.)(\d+)(?:\.|$)", name)
    return int(match.group(1)) if match else None


def shape_hint(found: tuple[int, ...], expected: tuple[int, ...]) -> str:
    if len(found) == len(expected) == 2 and found == expected[::-1]:
        return "It looks transposed (stored [in, out] instead of nn.Linear's [out, in]). "
    if len(found) == len(expected) == 3 and found[0] == expected[0] and found[1:] == expected[:0:-1]:
        return "Its last two dims look swapped. "
    return ""
