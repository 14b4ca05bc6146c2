"""Read one rank's quantized routed experts from a published checkpoint, as stored (no bf16 round trip).

    config.json quantization_config --quant_spec_from_config--> QuantSpec
    checkpoint (file | folder | shards + index) --CheckpointReader (headers only)-->
      for each expert in [first, first + count)  (a progress bar on stderr):
        {gate, up, down} stored weight + scale --check dtype/shape--> copied into this rank's stacked tensors
      --> QuantizedExpertWeights (device bytes == the checkpoint's bytes of these experts' weights and scales)

Names: the family's hub names (``moe_ref.checkpoint.loading.layer_names``) with the weight's ``.weight`` replaced by the
format's suffixes: ``mlp.experts.{e}.gate_proj.weight`` + ``.weight_scale_inv`` (FP8 blocks),
``mlp.experts.{e}.gate_proj.weight_packed`` + ``.weight_scale`` + ``.weight_shape`` (INT4),
``block_sparse_moe.experts.{e}.w1.weight_packed`` + ``.weight_scale`` (Kimi-K3 MXFP4); Step3's stacked
``moe.gate_proj.weight [E, F, D]`` + ``.weight_scale_inv [E, F/128, D/128]`` (FP8) are read by rows.
The router, shared experts and latent projections stay in ``moe_ref.checkpoint.loading.load_moe_weights``'s hands
(given the ``QuantSpec``, it reads each in the precision the checkpoint's quantization_config decides: FP8
shared experts of DeepSeek-V3 / Kimi-K2-Instruct / Step3 are dequantized once at load, Kimi-K2-Thinking's and
Kimi-K3's are ignored by the config and stored bf16). ``routed_experts_quantized`` says whether the config
quantizes the routed experts at all.

Shape legend as in ``moe_ref.checkpoint.formats``.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import torch

from moe_ref.core.config import MoEConfig
from moe_ref.core.errors import (
    FP8AlignmentError,
    MissingTensorError,
    QuantTensorDTypeError,
    QuantTensorShapeError,
    UnsupportedQuantizationError,
)
from moe_ref.checkpoint.loading import (KNOWN_PREFIXES, LayerNames, _check_expert_range, _detect_prefix,
                                        check_recorded_shape, layer_names, missing_scale_error,
                                        plain_where_quantized_error)
from moe_ref.checkpoint.reader import CheckpointReader
from moe_ref.checkpoint.formats import (FP8_BLOCK, SAFETENSORS_DTYPES, QuantFormat, QuantizedExpertWeights, QuantSpec,
                                        quant_spec_from_config)
from moe_ref.kernels.experts.w4 import check_mxfp4_scales
from moe_ref.core.weights import MoEWeights

_SAFETENSORS_DTYPES = SAFETENSORS_DTYPES


def load_quantized_experts(
    path: str | os.PathLike, cfg: MoEConfig, layer_idx: int, expert_range: tuple[int, int] | None = None,
    device: torch.device | str = "cpu", *, spec: QuantSpec | None = None, prefix: str | None = None,
    progress: bool = True,
) -> QuantizedExpertWeights:
    """Read routed experts ``[first, first + count)`` of MoE layer ``layer_idx`` as the checkpoint stores them.

    Args:
        path: a ``.safetensors`` file or a checkpoint folder (see ``moe_ref.checkpoint.reader.CheckpointReader``).
        cfg: the model's config (its family gives the names, its sizes the shapes; the experts' input width is
            ``cfg.expert_hidden_size``, the latent width for Kimi-K3).
        layer_idx: the decoder layer.
        expert_range: ``(first, count)``, one EP rank's block; None = all experts. Only these experts are read.
        device: where the returned tensors live (each expert is copied straight into them).
        spec: the format; None reads ``quantization_config`` from the config.json beside the checkpoint.
        prefix: the text before the layer number; None tries ``moe_ref.checkpoint.loading.KNOWN_PREFIXES``.
        progress: show a tqdm progress bar on stderr.

    Returns:
        ``QuantizedExpertWeights`` on ``device``; ``nbytes()`` equals the checkpoint's bytes of these tensors.

    Raises:
        UnsupportedQuantizationError (LOAD008): no or an unsupported ``quantization_config``.
        MissingTensorError (LOAD001), MissingScaleError (LOAD007), QuantTensorDTypeError (LOAD005),
        QuantTensorShapeError (LOAD006), QuantTensorValueError (LOAD015: an MXFP4 scale byte above
        ``MXFP4_MAX_SCALE_BYTE``), FP8AlignmentError (CFG005: FP8 blocks with F % 128 != 0), and the
        checkpoint-file errors of ``CheckpointReader`` (LOAD004, LOAD010-LOAD013).
    """
    first, count = _check_expert_range(expert_range, cfg)
    if spec is None:
        spec = _spec_beside(Path(path))
    F, Dx = cfg.intermediate_size, cfg.expert_hidden_size
    if spec.format == QuantFormat.FP8_BLOCK and F % FP8_BLOCK:
        raise FP8AlignmentError(f"FP8 block experts need moe_intermediate_size % 128 == 0 (got {F}): the gate and up "
                                f"128x128 scale blocks are stacked into one [2F/128, D/128] grid")
    with CheckpointReader(path) as ckpt:
        layer_prefix = f"{prefix if prefix is not None else _detect_prefix(ckpt, cfg, layer_idx)}{layer_idx}."
        reader = _QuantReader(ckpt, spec, layer_names(cfg.family, "hub", layer_prefix), layer_idx, cfg.num_experts)
        out = _allocate(spec, count, F, Dx, device, reader.scale_dtype(first))
        from tqdm import tqdm

        bar = tqdm(total=count, desc=f"layer {layer_idx} experts", unit="expert", file=sys.stderr,
                   disable=not progress, leave=False)
        with bar:
            for i in range(count):
                reader.copy_expert(first + i, i, out, F, Dx)
                bar.update(1)
    return QuantizedExpertWeights(spec, *out, hidden_size=Dx, intermediate_size=F, first_expert=first)


def routed_experts_quantized(path: str | os.PathLike, spec: QuantSpec, cfg: MoEConfig, layer_idx: int, *,
                             prefix: str | None = None, expert: int = 0) -> tuple[bool, str]:
    """Whether ``spec`` (the checkpoint's quantization_config) quantizes the routed experts of this layer, and
    the rule that decided it (``QuantSpec.quantizes`` of expert ``expert``'s gate projection; Step3: the
    stacked ``moe.gate_proj``). ``prefix`` None: detected in the checkpoint at ``path`` (headers only)."""
    def decide(layer_prefix: str) -> tuple[bool, str]:
        gate = layer_names(cfg.family, "hub", f"{layer_prefix}{layer_idx}.").gate.format(expert=expert)
        return spec.quantizes(gate[:-len(".weight")])

    if prefix is None:
        decisions = [decide(p) for p in KNOWN_PREFIXES]
        if len({quantized for quantized, _ in decisions}) == 1:  # the same under every prefix: no need to open
            return decisions[0]
        with CheckpointReader(path) as ckpt:
            prefix = _detect_prefix(ckpt, cfg, layer_idx)
    return decide(prefix)


def checkpoint_quant_spec(path: str | os.PathLike) -> QuantSpec | None:
    """The expert quantization of the checkpoint at ``path`` (a ``.safetensors`` file or its folder), from the
    ``quantization_config`` of the config.json beside it; None when there is no config.json or it has no
    ``quantization_config`` (plain weights). LOAD008 for an unsupported one (``quant_spec_from_config``)."""
    path = Path(path)
    config = (path if path.is_dir() else path.parent) / "config.json"
    return quant_spec_from_config(config) if config.is_file() else None


def _spec_beside(path: Path) -> QuantSpec:
    spec = checkpoint_quant_spec(path)
    if spec is None:
        config = (path if path.is_dir() else path.parent) / "config.json"
        raise UnsupportedQuantizationError(f"{str(config)!r} has no quantization_config (or is absent): the "
                                           f"checkpoint stores plain weights; read them with "
                                           f"moe_ref.checkpoint.loading.load_moe_weights")
    return spec


def load_dequantized_weights(path: str | os.PathLike, cfg: MoEConfig, layer_idx: int, *,
                             dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                             prefix: str | None = None) -> MoEWeights:
    """The whole block of a quantized checkpoint with EVERY expert dequantized (``[E, 2F, Dx]``, ``[E, Dx, F]``
    in ``dtype``): the reference a quantized layer is compared with (tests, ``moe_ref.tools.dist_check --quant``).
    Not for serving: it holds the plain experts the quantized path avoids."""
    from moe_ref.checkpoint.loading import load_moe_weights

    spec = _spec_beside(Path(path))
    dense = load_moe_weights(path, cfg, layer_idx, prefix=prefix, dtype=dtype, device=device, experts=False,
                             quant=spec)
    gate_up, down = load_quantized_experts(path, cfg, layer_idx, device=device, prefix=prefix, spec=spec,
                                           progress=False).dequantize(dtype)
    return dataclasses.replace(dense, gate_up_weight_E2FD=gate_up, down_weight_EDF=down)


def _allocate(spec: QuantSpec, count: int, F: int, Dx: int, device, scale_dtype: torch.dtype) -> list[torch.Tensor]:
    """Empty ``[gate_up weight, gate_up scale, down weight, down scale]`` for ``count`` experts on ``device``."""
    (gw, gs), (dw, ds) = spec.stored_shapes(F, Dx), spec.stored_shapes(Dx, F)
    gate_up_scale_rows = 2 * gs[0]  # FP8: 2 * F/128 block rows (F % 128 == 0); groups: 2F rows
    return [torch.empty(count, 2 * gw[0], gw[1], dtype=spec.weight_dtype, device=device),
            torch.empty(count, gate_up_scale_rows, gs[1], dtype=scale_dtype, device=device),
            torch.empty(count, *dw, dtype=spec.weight_dtype, device=device),
            torch.empty(count, *ds, dtype=scale_dtype, device=device)]


class _QuantReader:
    """Finds, checks and copies one expert's stored tensors."""

    def __init__(self, ckpt: CheckpointReader, spec: QuantSpec, names: LayerNames, layer_idx: int, num_experts: int):
        self.ckpt, self.spec, self.names, self.layer_idx = ckpt, spec, names, layer_idx
        self.num_experts = num_experts
        self.stacked = names.expert_form == "stacked"

    def _stem(self, template: str, expert: int) -> str:
        name = template if self.stacked else template.format(expert=expert)
        return name[:-len(".weight")]

    def _present_names(self, stem: str) -> tuple[str, str]:
        """``(weight name, scale name)`` of a quantized weight, both checked to be in the checkpoint (coded errors
        for a plain weight where the config says quantized, a missing weight, a missing scale)."""
        weight_name, scale_name = f"{stem}.{self.spec.weight_suffix}", f"{stem}.{self.spec.scale_suffix}"
        self._check_not_plain(stem)
        if weight_name not in self.ckpt:
            self._raise_missing_weight(weight_name, stem)
        if scale_name not in self.ckpt:
            raise missing_scale_error(self.ckpt, self.layer_idx, weight_name, scale_name)
        return weight_name, scale_name

    def scale_dtype(self, expert: int) -> torch.dtype:
        """The stored scale dtype (INT4 scales may be bf16, fp16 or fp32; checked against the spec)."""
        _, name = self._present_names(self._stem(self.names.gate, expert))
        found = self.ckpt.dtype(name)
        for dtype in self.spec.scale_dtypes:
            if _SAFETENSORS_DTYPES[dtype] == found:
                return dtype
        raise self._dtype_error(name, found, self.spec.scale_dtypes)

    def copy_expert(self, expert: int, slot: int, out: list[torch.Tensor], F: int, Dx: int) -> None:
        """Read expert ``expert``'s gate, up and down (weights + scales) into slot ``slot`` of ``out``."""
        gate_up_w, gate_up_s, down_w, down_s = out
        half_w, half_s = gate_up_w.shape[1] // 2, gate_up_s.shape[1] // 2
        for template, rows_w, rows_s, (out_f, in_f) in (
                (self.names.gate, slice(0, half_w), slice(0, half_s), (F, Dx)),
                (self.names.up, slice(half_w, None), slice(half_s, None), (F, Dx))):
            weight, scale = self._read(template, expert, out_f, in_f, gate_up_s.dtype)
            gate_up_w[slot, rows_w].copy_(weight)
            gate_up_s[slot, rows_s].copy_(scale)
        weight, scale = self._read(self.names.down, expert, Dx, F, down_s.dtype)
        down_w[slot].copy_(weight)
        down_s[slot].copy_(scale)

    def _read(self, template: str, expert: int, out_f: int, in_f: int, scale_dtype: torch.dtype):
        """(stored weight, stored scale) of one ``[out_f, in_f]`` weight, checked."""
        stem = self._stem(template, expert)
        weight_name, scale_name = self._present_names(stem)
        weight_shape, scale_shape = self.spec.stored_shapes(out_f, in_f)
        weight = self._checked(weight_name, (self.spec.weight_dtype,), weight_shape, expert)
        scale = self._checked(scale_name, (scale_dtype,), scale_shape, expert)
        check_recorded_shape(self.ckpt, self.spec, self.layer_idx, stem, out_f, in_f)
        if self.spec.format == QuantFormat.MXFP4:
            check_mxfp4_scales(scale, f"{scale_name!r} (layer {self.layer_idx}; re-download its shard)", name=scale_name)
        return weight, scale

    def _checked(self, name: str, dtypes: tuple[torch.dtype, ...], shape: tuple[int, int], expert: int) -> torch.Tensor:
        found_dtype = self.ckpt.dtype(name)
        if found_dtype not in {_SAFETENSORS_DTYPES[d] for d in dtypes}:
            raise self._dtype_error(name, found_dtype, dtypes)
        found = self.ckpt.shape(name)
        expected = (self.num_experts, *shape) if self.stacked else shape
        if found != expected:
            raise QuantTensorShapeError(
                f"{name!r} (layer {self.layer_idx}, {self.spec.format.value}) has shape {list(found)}, expected "
                f"{list(expected)} for this config and format (group size {self.spec.group_size}); use the "
                f"config.json that came with the checkpoint", name=name, expected=expected, found=found)
        return self.ckpt.read_rows(name, expert, 1)[0] if self.stacked else self.ckpt.read(name)

    def _dtype_error(self, name: str, found: str, dtypes: tuple[torch.dtype, ...]) -> QuantTensorDTypeError:
        want = " or ".join(_SAFETENSORS_DTYPES[d] for d in dtypes)
        return QuantTensorDTypeError(
            f"{name!r} (layer {self.layer_idx}) is stored as {found}, but the checkpoint's quantization_config says "
            f"{self.spec.format.value}, which stores it as {want}; use the checkpoint as published, with its "
            f"config.json", name=name, found=found)

    def _check_not_plain(self, stem: str) -> None:
        """LOAD014 when the config quantizes this expert but the checkpoint stores a plain weight (and no
        quantized one beside it)."""
        plain, weight_name = f"{stem}.weight", f"{stem}.{self.spec.weight_suffix}"
        if plain not in self.ckpt or self.ckpt.dtype(plain) not in ("F64", "F32", "F16", "BF16"):
            return
        if weight_name != plain and weight_name in self.ckpt:
            return
        _, rule = self.spec.quantizes(stem)
        raise plain_where_quantized_error(self.ckpt, self.spec, self.layer_idx, plain, rule)

    def _raise_missing_weight(self, weight_name: str, stem: str) -> None:
        plain = f"{stem}.weight"
        hint = (f"The checkpoint has {plain!r} ({self.ckpt.dtype(plain)}) instead: its config's quantization_config "
                f"({self.spec.format.value}) does not match its tensors. " if plain in self.ckpt else "")
        raise MissingTensorError(
            f"quantized weight {weight_name!r} (layer {self.layer_idx}) is not in the checkpoint "
            f"({self.ckpt.describe_files()}). {hint}Check layer_idx, prefix= and the config.json", name=weight_name)


