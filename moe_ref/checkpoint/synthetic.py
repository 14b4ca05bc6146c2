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
from moe_ref.core.errors import InvalidConfigError
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
    """``cfg`` with the expert sizes rounded up to what ``quant`` stores (``moe_ref.checkpoint.formats.shape_problem``):
    F (and for groups of 32 the experts' input width Dx: the latent for Kimi-K3, else D) to multiples of 32,
    or F to a multiple of 128 for FP8 blocks. The tiny presets' odd sizes need it; real models already fit.

    Example: tiny-kimi-k3 (F 24, L 32) with mxfp4 -> F 32, L 32.
    """
    fmt = QuantFormat(quant)
    multiple = FP8_BLOCK if fmt == QuantFormat.FP8_BLOCK else GROUP_SIZE
    changes = {"intermediate_size": -(-cfg.intermediate_size // multiple) * multiple}
    if fmt != QuantFormat.FP8_BLOCK:
        width = "latent_dim" if cfg.latent_dim else "hidden_size"
        changes[width] = -(-getattr(cfg, width) // GROUP_SIZE) * GROUP_SIZE
    return dataclasses.replace(cfg, **changes)


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
            Step3 FP8), not under the compressed-tensors configs (their ``ignore`` lists ``shared_experts``).
            Router, bias and Kimi-K3's latent tensors stay in ``dtype``.
        prefix: the text before the layer number; default: the family's published one (e.g.
            ``"language_model.model.layers."`` writes Kimi-K2.5's naming).
        quantization_config: with ``quant``, written instead of the published one (e.g. with another ignore
            list); the modules it quantizes are the ones stored quantized.

    Returns:
        The ``MoEWeights`` written (all experts, tensors in ``dtype``, bias fp32), to compare a load against;
        with ``quant``, each weight stored quantized is its dequantized stored value in fp32 (what the
        checkpoint means).
    """
    if num_shards < 1:
        raise InvalidConfigError(f"num_shards={num_shards} must be >= 1", field="num_shards")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = MoEWeights.random(cfg, seed=seed, dtype=dtype)
    prefix = FAMILY_PREFIX.get(cfg.family, DEFAULT_PREFIX) if prefix is None else prefix
    names = layer_names(cfg.family, layout, f"{prefix}{layer_idx}.")
    tensors = checkpoint_tensors(weights, cfg, names)
    config = _config_for_layer(cfg, layer_idx)
    if quant is not None:
        fmt = QuantFormat(quant)
        qc = QUANTIZATION_CONFIGS[fmt] if quantization_config is None else quantization_config
        spec = quant_spec_from_config({"quantization_config": qc})
        if spec is None or spec.format != fmt:
            raise InvalidConfigError(f"quantization_config {qc!r} does not describe quant={fmt.value!r}",
                                     field="quantization_config")
        weights = _quantize_experts(tensors, weights, cfg, names, spec)
        weights = _quantize_shared(tensors, weights, names, spec)
        config["quantization_config"] = qc
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
    with the experts dequantized (fp32) from what was stored. Every routed expert is quantized (a config that
    ignores them is refused: write that checkpoint with ``quant=None``)."""
    fmt = spec.format
    gate_module = (names.gate if names.expert_form != "stacked_gate_up" else names.gate_up).format(expert=0)
    if not spec.quantizes(gate_module.removesuffix(".weight"))[0]:
        raise InvalidConfigError(f"quant={fmt.value!r}: the quantization_config leaves the routed experts "
                                 f"unquantized ({spec.quantizes(gate_module.removesuffix('.weight'))[1]})",
                                 field="quantization_config")
    F, Dx = cfg.intermediate_size, cfg.expert_hidden_size
    problem = "it needs the hub layout" if names.expert_form == "stacked_gate_up" else shape_problem(fmt, Dx, F)
    if problem:
        raise InvalidConfigError(f"quant={fmt.value!r}: {problem}; quantizable_config(cfg, {fmt.value!r}) rounds the "
                                 f"sizes up", field="quant")
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
