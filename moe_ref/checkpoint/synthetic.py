"""Write a small synthetic checkpoint of one MoE layer in a model family's real layout (nothing is downloaded).

    MoEConfig --MoEWeights.random(seed)--> canonical tensors
      --split into the family's checkpoint names (moe_ref.checkpoint.loading.layer_names)-->
      (quant=...: routed experts quantized and stored as the published checkpoints store them, moe_ref.checkpoint.formats)
      config.json (+ quantization_config) + model.safetensors  (or shards + model.safetensors.index.json)

Used by the loader's tests, the HF parity tests and ``moe-ref demo``. Shape legend as in ``moe_ref.core.weights``.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from moe_ref.core.config import MoEConfig, hf_config_dict
from moe_ref.core.errors import ConfigNotExpressibleError, InvalidConfigError
from moe_ref.checkpoint.loading import LayerNames, layer_names
from moe_ref.checkpoint.reader import INDEX_FILE, SINGLE_FILE
from moe_ref.checkpoint.formats import (FP8_BLOCK, GROUP_SIZE, QuantFormat, QuantSpec, dequantize_weight,
                                        quant_spec_from_config, quantize_weight, shape_problem)
from moe_ref.core.weights import MoEWeights

# the prefix each family's published checkpoints use before the layer number
FAMILY_PREFIX = {"kimi_k3": "language_model.layers."}
DEFAULT_PREFIX = "model.layers."

# quantization_config as the published checkpoints write it: DeepSeek-V3/R1 and Kimi-K2-Instruct (fp8),
# Kimi-K2-Thinking/K2.5 (compressed-tensors pack-quantized int4), Kimi-K3 (compressed-tensors mxfp4).
_CT_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
QUANTIZATION_CONFIGS = {
    QuantFormat.FP8_BLOCK: {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]},
    QuantFormat.INT4_GROUP: {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized", "input_activations": None,
                                      "output_activations": None,
                                      "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                                  "group_size": GROUP_SIZE, "dynamic": False, "actorder": None,
                                                  "observer": "minmax", "block_structure": None}}},
        "ignore": _CT_IGNORE, "kv_cache_scheme": None},
    QuantFormat.MXFP4: {
        "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "format": "mxfp4-pack-quantized",
                                      "input_activations": None, "output_activations": None,
                                      "weights": {"num_bits": 4, "type": "float", "symmetric": True,
                                                  "strategy": "group", "group_size": GROUP_SIZE, "dynamic": False,
                                                  "observer": "minmax"}}},
        "ignore": _CT_IGNORE + ["re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"], "kv_cache_scheme": None},
}


def quantizable_config(cfg: MoEConfig, quant: str | QuantFormat) -> MoEConfig:
    """``cfg`` with the sizes rounded up to what ``quant`` stores (``moe_ref.checkpoint.formats.shape_problem``),
    kept expressible by the family's config.json (``check_synthetic_layout``): F (and for groups of 32 the
    experts' input width Dx: the latent for Kimi-K3, else D) to multiples of 32, or F to a multiple of 128 for
    FP8 blocks; the shared experts' width S follows F where config.json derives it (``n_shared_experts x
    moe_intermediate_size``: DeepSeek-V3, Kimi-K2/K3); Step3's own ``share_expert_dim`` goes to a multiple of 32
    for the 4-bit formats, whose published ignore lists name Kimi's ``shared_experts``, not Step3's
    ``share_expert``, so it is stored quantized. The tiny presets' odd sizes need it; real models already fit.

    Example: tiny-kimi-k3 (F 24, L 32, 2 shared experts: S 48) with mxfp4 -> F 32, L 32, S 64.
    """
    fmt = QuantFormat(quant)
    multiple = FP8_BLOCK if fmt == QuantFormat.FP8_BLOCK else GROUP_SIZE
    F = _round_up(cfg.intermediate_size, multiple)
    changes = {"intermediate_size": F}
    if fmt != QuantFormat.FP8_BLOCK:
        width = "latent_dim" if cfg.latent_dim else "hidden_size"
        changes[width] = _round_up(getattr(cfg, width), GROUP_SIZE)
    if cfg.has_shared_experts:
        changes["shared_intermediate_size"] = (
            cfg.num_shared_experts * F if cfg.family != "step3" else
            cfg.shared_intermediate_size if fmt == QuantFormat.FP8_BLOCK else
            _round_up(cfg.shared_intermediate_size, GROUP_SIZE))
    return dataclasses.replace(cfg, **changes)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _prefix(cfg: MoEConfig, prefix: str | None) -> str:
    """The text before the layer number: ``prefix``, else the family's published one."""
    return FAMILY_PREFIX.get(cfg.family, DEFAULT_PREFIX) if prefix is None else prefix


def check_synthetic_layout(cfg: MoEConfig, quant: str | QuantFormat | None = None, *, layout: str = "hub",
                           layer_idx: int = 0, prefix: str | None = None,
                           quantization_config: dict | None = None) -> QuantSpec | None:
    """Refuse, before anything is written, what ``write_synthetic_checkpoint`` could not write so that it loads
    back from its own config.json; return the ``QuantSpec`` of ``quant`` (None for plain weights). The arguments
    are ``write_synthetic_checkpoint``'s.

    Raises:
        ConfigNotExpressibleError (CFG022): a field of ``cfg`` that the family's config.json cannot hold (read
            back, it would give another value), e.g. a shared-expert width S other than ``n_shared_experts x F``
            for DeepSeek-V3/Kimi.
        InvalidConfigError (CFG007): ``quantization_config`` does not describe ``quant``, or leaves the routed
            experts unquantized; ``quant`` with the fused layout; a quantized weight whose sizes the format
            cannot store (routed experts: ``shape_problem``; shared experts: D and S multiples of 32 in groups).
    """
    _check_expressible(cfg, layer_idx)
    if quant is None:
        return None
    fmt = QuantFormat(quant)
    qc = QUANTIZATION_CONFIGS[fmt] if quantization_config is None else quantization_config
    spec = quant_spec_from_config({"quantization_config": qc})
    if spec is None or spec.format != fmt:
        raise InvalidConfigError(f"quantization_config {qc!r} does not describe quant={fmt.value!r}",
                                 field="quantization_config")
    names = layer_names(cfg.family, layout, f"{_prefix(cfg, prefix)}{layer_idx}.")
    if names.expert_form == "stacked_gate_up":
        raise InvalidConfigError(f"quant={fmt.value!r} needs layout='hub' (the published per-expert or stacked "
                                 f"names), not {layout!r}", field="layout")
    gate_module = names.gate.format(expert=0).removesuffix(".weight")
    routed, rule = spec.quantizes(gate_module)
    if not routed:
        raise InvalidConfigError(f"quant={fmt.value!r}: the quantization_config leaves the routed experts "
                                 f"unquantized ({rule}); write that checkpoint with quant=None",
                                 field="quantization_config")
    problem = shape_problem(fmt, cfg.expert_hidden_size, cfg.intermediate_size)
    shared = cfg.has_shared_experts and spec.quantizes(names.shared_gate.removesuffix(".weight"))[0]
    if problem is None and shared and fmt != QuantFormat.FP8_BLOCK:
        sizes = (("D", cfg.hidden_size), ("S", cfg.shared_intermediate_size))
        bad = [f"{name}={value}" for name, value in sizes if value % GROUP_SIZE]
        problem = bad and f"the shared experts it quantizes need multiples of {GROUP_SIZE}, not {' and '.join(bad)}"
    if problem:
        raise InvalidConfigError(f"{cfg.name} with quant={fmt.value!r}: {problem}; quantizable_config(cfg, "
                                 f"{fmt.value!r}) rounds the sizes up", field="quant")
    return spec


def config_differences(cfg: MoEConfig, other: MoEConfig) -> dict[str, tuple]:
    """``{field: (cfg's value, other's value)}`` for the fields where two configs of an MoE block differ: those
    the dataclass compares, the name aside (the model's, like its layer counts, which a config.json sets, not the
    block); empty for the same block."""
    return {f.name: (getattr(cfg, f.name), getattr(other, f.name)) for f in dataclasses.fields(cfg)
            if f.compare and f.name != "name" and getattr(cfg, f.name) != getattr(other, f.name)}


def _check_expressible(cfg: MoEConfig, layer_idx: int) -> None:
    """CFG022 unless ``cfg`` read back from the config.json the writer writes gives ``cfg`` (but its name and MoE
    layer list, which the file sets)."""
    differ = config_differences(cfg, MoEConfig.from_hf_config(_config_for_layer(cfg, layer_idx)))
    if not differ:
        return
    lines = "; ".join(f"{name}={wrote!r} reads back as {read!r}" for name, (wrote, read) in differ.items())
    hint = ""
    if "shared_intermediate_size" in differ and cfg.family != "step3":
        hint = (f" ({cfg.family}'s config.json has no field for the shared experts' width: it is n_shared_experts x "
                f"moe_intermediate_size = {cfg.num_shared_experts} x {cfg.intermediate_size}); set "
                f"shared_intermediate_size={cfg.num_shared_experts * cfg.intermediate_size}")
    raise ConfigNotExpressibleError(
        f"{cfg.name}: a {cfg.family} config.json cannot express this config, so the checkpoint would not load "
        f"back from it: {lines}{hint or '; change those fields to what the config.json holds'} "
        f"(quantizable_config(cfg, quant) keeps a preset expressible)", fields=sorted(differ))


def write_synthetic_checkpoint(
    out_dir: str | os.PathLike, cfg: MoEConfig, *, layer_idx: int = 0, seed: int = 0,
    dtype: torch.dtype = torch.bfloat16, layout: str = "hub", num_shards: int = 1, quant: str | None = None,
    prefix: str | None = None, quantization_config: dict | None = None,
) -> MoEWeights:
    """Write ``config.json`` and the safetensors of MoE layer ``layer_idx`` with seeded random weights.

    Args:
        out_dir: folder to write into (created if needed).
        cfg: the block to write; ``cfg.family`` picks the names.
        layer_idx: the layer number in the names; config.json makes it an MoE layer (layers before it are
            dense: ``first_k_dense_replace = layer_idx``, or Step3 ``moe_layers_enum = "layer_idx"``).
        seed: seed of ``MoEWeights.random``.
        dtype: dtype of every stored tensor except the bias (fp32).
        layout: ``"hub"`` (as published: per-expert tensors for DeepSeek-V3/Kimi-K2/Kimi-K3, stacked 3-D
            ``moe.*`` tensors for Step3) or ``"fused"`` (transformers 5.x ``experts.gate_up_proj [E, 2F, D]``,
            ``experts.down_proj [E, D, F]``; DeepSeek-V3/Kimi-K2 only).
        num_shards: 1 writes ``model.safetensors``; more writes that many shard files plus
            ``model.safetensors.index.json`` (tensors split in name order).
        quant: None (plain ``dtype`` weights) or a ``moe_ref.checkpoint.formats.QuantFormat`` value (``"fp8_block"``,
            ``"int4_group"``, ``"mxfp4"``): config.json gets the published ``quantization_config``
            (``QUANTIZATION_CONFIGS``) and every Linear layer of the block that it quantizes
            (``QuantSpec.quantizes``) is stored quantized under the published names/dtypes/shapes (hub layout
            only): the routed experts always, the shared experts too under fp8 (DeepSeek-V3, Kimi-K2-Instruct,
            Step3 FP8), not under the compressed-tensors configs (their ``ignore`` lists ``shared_experts``)
            but for Step3, whose ``share_expert`` that list does not name. Router, bias and Kimi-K3's latent
            tensors stay in ``dtype``. ``quantizable_config(cfg, quant)`` gives sizes that fit.
        prefix: the text before the layer number; default: the family's published one (e.g.
            ``"language_model.model.layers."`` writes Kimi-K2.5's naming).
        quantization_config: with ``quant``, written instead of the published one (e.g. with another ignore
            list); the modules it quantizes are the ones stored quantized.

    Returns:
        The ``MoEWeights`` written (all experts, tensors in ``dtype``, bias fp32), to compare a load against;
        with ``quant``, each weight stored quantized is its dequantized stored value in fp32 (what the
        checkpoint means).

    Raises:
        ``check_synthetic_layout``'s errors (CFG022: a config its config.json cannot express; CFG007: sizes the
        format cannot store), before anything is written; CFG007 for a bad ``num_shards``.
    """
    if num_shards < 1:
        raise InvalidConfigError(f"num_shards={num_shards} must be >= 1", field="num_shards")
    spec = check_synthetic_layout(cfg, quant, layout=layout, layer_idx=layer_idx, prefix=prefix,
                                  quantization_config=quantization_config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = MoEWeights.random(cfg, seed=seed, dtype=dtype)
    names = layer_names(cfg.family, layout, f"{_prefix(cfg, prefix)}{layer_idx}.")
    tensors = checkpoint_tensors(weights, cfg, names)
    config = _config_for_layer(cfg, layer_idx)
    if spec is not None:
        weights = _quantize_experts(tensors, weights, cfg, names, spec)
        weights = _quantize_shared(tensors, weights, names, spec)
        config["quantization_config"] = (QUANTIZATION_CONFIGS[spec.format] if quantization_config is None
                                         else quantization_config)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    _save_sharded(tensors, out, num_shards)
    return weights


def _store_quantized(tensors: dict[str, torch.Tensor], name: str, spec: QuantSpec) -> torch.Tensor:
    """Replace weight ``name`` in ``tensors`` (in place) by its stored form in ``spec``; return the dequantized
    stored value (fp32)."""
    fmt, stem = spec.format, name[:-len(".weight")]
    dense = tensors.pop(name)
    qweight, scale = quantize_weight(dense, fmt)
    tensors[f"{stem}.{spec.weight_suffix}"] = qweight.contiguous()
    tensors[f"{stem}.{spec.scale_suffix}"] = scale.contiguous()
    if fmt == QuantFormat.INT4_GROUP:
        tensors[f"{stem}.weight_shape"] = torch.tensor(list(dense.shape[-2:]), dtype=torch.int32)
    return dequantize_weight(qweight, scale, fmt)


def _quantize_shared(tensors: dict[str, torch.Tensor], weights: MoEWeights, names: LayerNames,
                     spec: QuantSpec) -> MoEWeights:
    """Store the shared experts quantized where ``spec`` (the config's rule) quantizes them; return ``weights``
    with those dequantized (fp32) from what was stored."""
    if weights.shared_gate_up_weight_2SD is None:
        return weights
    parts = []
    for name in (names.shared_gate, names.shared_up, names.shared_down):
        quantized, _ = spec.quantizes(name[:-len(".weight")])
        parts.append(_store_quantized(tensors, name, spec) if quantized else None)
    if parts == [None, None, None]:
        return weights
    gate_SD, up_SD = weights.shared_gate_up_weight_2SD.chunk(2, dim=0)
    gate_SD, up_SD, down_DS = (p if p is not None else w.float()
                               for p, w in zip(parts, (gate_SD, up_SD, weights.shared_down_weight_DS)))
    return dataclasses.replace(weights, shared_gate_up_weight_2SD=torch.cat([gate_SD, up_SD]),
                               shared_down_weight_DS=down_DS)


def _quantize_experts(tensors: dict[str, torch.Tensor], weights: MoEWeights, cfg: MoEConfig, names: LayerNames,
                      spec: QuantSpec) -> MoEWeights:
    """Replace the expert weights in ``tensors`` (in place) by their stored quantized form; return ``weights``
    with the experts dequantized (fp32) from what was stored (``check_synthetic_layout`` has checked that every
    routed expert is quantized and that ``spec`` can store it)."""
    dense = {}
    templates = (names.gate, names.up, names.down)
    experts = [None] if names.expert_form == "stacked" else range(cfg.num_experts)
    for template in templates:
        for expert in experts:
            name = template if expert is None else template.format(expert=expert)
            dense[(template, expert)] = _store_quantized(tensors, name, spec)
    stack = (lambda t: dense[(t, None)]) if names.expert_form == "stacked" else \
        (lambda t: torch.stack([dense[(t, e)] for e in experts]))
    return dataclasses.replace(weights, gate_up_weight_E2FD=torch.cat([stack(names.gate), stack(names.up)], dim=1),
                               down_weight_EDF=stack(names.down))


def checkpoint_tensors(weights: MoEWeights, cfg: MoEConfig, names: LayerNames) -> dict[str, torch.Tensor]:
    """Split canonical ``weights`` (all experts) into ``{checkpoint name: tensor}`` for ``names``' layout."""
    F = cfg.intermediate_size
    gate_EFD, up_EFD = weights.gate_up_weight_E2FD[:, :F], weights.gate_up_weight_E2FD[:, F:]
    out: dict[str, torch.Tensor] = {names.router: weights.gate_weight_ED}
    if names.bias is not None and weights.bias_E is not None:
        out[names.bias] = weights.bias_E.float()
    if names.expert_form == "stacked_gate_up":
        out[names.gate_up] = weights.gate_up_weight_E2FD
        out[names.down] = weights.down_weight_EDF
    elif names.expert_form == "stacked":
        out.update({names.gate: gate_EFD, names.up: up_EFD, names.down: weights.down_weight_EDF})
    else:
        for e in range(weights.num_held_experts):
            expert = weights.first_expert + e
            out[names.gate.format(expert=expert)] = gate_EFD[e]
            out[names.up.format(expert=expert)] = up_EFD[e]
            out[names.down.format(expert=expert)] = weights.down_weight_EDF[e]
    if weights.shared_gate_up_weight_2SD is not None:
        shared_gate_SD, shared_up_SD = weights.shared_gate_up_weight_2SD.chunk(2, dim=0)
        out.update({names.shared_gate: shared_gate_SD, names.shared_up: shared_up_SD,
                    names.shared_down: weights.shared_down_weight_DS})
    for name, value in ((names.latent_down, weights.latent_down_weight_LD),
                        (names.latent_up, weights.latent_up_weight_DL),
                        (names.latent_norm, weights.latent_norm_weight_L)):
        if name is not None and value is not None:
            out[name] = value
    # safetensors wants contiguous tensors that share no storage
    return {name: value.detach().contiguous().clone() for name, value in out.items()}


def _config_for_layer(cfg: MoEConfig, layer_idx: int) -> dict:
    """``hf_config_dict(cfg)`` with ``layer_idx`` as the (last) MoE layer and the layers before it dense."""
    raw = hf_config_dict(cfg)
    if cfg.family == "step3":
        raw.update(num_hidden_layers=layer_idx + 1, moe_layers_enum=str(layer_idx))
    else:
        text = raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw
        text.update(num_hidden_layers=layer_idx + 1, first_k_dense_replace=layer_idx)
    return raw


def _save_sharded(tensors: dict[str, torch.Tensor], out: Path, num_shards: int) -> None:
    if num_shards == 1:
        save_file(tensors, str(out / SINGLE_FILE), metadata={"format": "pt"})
        return
    names = sorted(tensors)
    if num_shards > len(names):
        raise InvalidConfigError(f"num_shards={num_shards} > the {len(names)} tensors of the layer; every shard "
                                 f"needs at least one tensor", field="num_shards")
    weight_map, total_size = {}, 0
    for shard in range(num_shards):
        file = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = names[shard * len(names) // num_shards:(shard + 1) * len(names) // num_shards]
        save_file({n: tensors[n] for n in part}, str(out / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
        total_size += sum(tensors[n].numel() * tensors[n].element_size() for n in part)
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map},
                                             indent=1))
