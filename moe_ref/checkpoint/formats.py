"""Quantized expert weights as published: the formats, their packing rules and their dequantizing twins.

    config.json quantization_config --quant_spec_from_config--> QuantSpec (format, group size, tensor names)
    checkpoint tensors (per expert) --moe_ref.checkpoint.quantized--> QuantizedExpertWeights (this rank's experts, as stored)
      --> W4A16 / FP8 expert kernels (moe_ref.experts.quantized); ``dequantize()`` is the fp32 reference

Formats (each weight is an ``nn.Linear`` weight ``[out, in]``; names relative to the weight's module):

==============  ===============================================================================================
format          stored tensors                                       and what they mean
==============  ===============================================================================================
``fp8_block``   ``weight`` float8_e4m3fn ``[out, in]``,               ``w = q * s`` per 128x128 block (edge blocks
                ``weight_scale_inv`` fp32 ``[ceil(out/128),          padded); ``quant_method: fp8``,
                ceil(in/128)]``                                      ``weight_block_size: [128, 128]`` (DeepSeek-V3/R1,
                                                                     Kimi-K2-Instruct, Step3 FP8)
``int4_group``  ``weight_packed`` int32 ``[out, in/8]``,              compressed-tensors ``pack-quantized``, int, 4 bits,
                ``weight_scale`` bf16 ``[out, in/32]``,               symmetric, group 32: element k of a row is nibble
                ``weight_shape`` int32 ``[2]`` = (out, in)            ``k % 8`` (bits ``4*(k%8)``) of word ``k // 8``,
                                                                     stored offset-binary ``q + 8``; ``w = q * s``
                                                                     (Kimi-K2-Thinking, K2.5)
``mxfp4``       ``weight_packed`` uint8 ``[out, in/2]``,              compressed-tensors ``mxfp4-pack-quantized``, float,
                ``weight_scale`` uint8 ``[out, in/32]``               4 bits (E2M1), group 32: element 2j is the low
                                                                     nibble of byte j, 2j+1 the high one (bit 3 = sign,
                                                                     magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6);
                                                                     ``w = e2m1 * 2**(byte - 125)`` (Kimi-K3)
==============  ===============================================================================================

The MXFP4 scale bias (125, not E8M0's usual 127), decided from compressed-tensors' own code
(vllm-project/compressed-tensors, ``quantization/utils/mxfp4_utils.py`` and
``compressors/quantized_compressors/fp4_quantized.py``): quantization uses the dense power-of-two scale
``s = 2**(floor(log2(round_to_power_2(amax))) - 2)`` (``generate_mxfp4_scales`` then
``maybe_convert_from_mxfp4_exp``), and ``MXFP4PackedCompressor.compress_scale`` stores that ``s`` as
``127 + floor(log2(s)) - 2``: the stored byte is ``log2(s) + 125``. vLLM's loader agrees (it adds 2 to
reach standard E8M0 for Marlin, "a bias of 125"). ``tests/unit/test_quant.py`` pins it with a group of 6.0s,
stored as byte 125, which decodes to 6.0 (a 127 bias would give 1.5).

Shape legend: e local experts, Dx expert input width (hidden, or latent for Kimi-K3), F expert intermediate,
O output features and I input features of one weight matrix ``[O, I]``; Ob = ceil(O/128), Ib = ceil(I/128)
FP8 block scales. Packed widths: ``I/8`` int4 words (suffix ``w``), ``I/2`` fp4 byte pairs (suffix ``p``),
``I/32`` group scales (suffix ``g``).
"""
from __future__ import annotations

import dataclasses
import enum
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from moe_ref.core.errors import UnsupportedQuantizationError
from moe_ref.kernels.experts.fp8 import dequantize_fp8_per_block_128
from moe_ref.kernels.experts.w4 import (  # noqa: F401  (the 4-bit numerics, re-exported with their formats)
    GROUP_SIZE,
    INT4_PER_WORD,
    FP4_PER_BYTE,
    E8M0_BIAS,
    E2M1_MAGNITUDES,
    pack_int4,
    unpack_int4,
    PLANE_BLOCK,
    W4Weight,
    block_major_scales,
    packed_from_planes,
    to_group_planes,
    quantize_int4,
    dequantize_int4,
    pack_fp4,
    unpack_fp4,
    e2m1_to_float,
    float_to_e2m1,
    quantize_mxfp4,
    e8m0_to_float,
    dequantize_mxfp4,
)

FP8_BLOCK = 128
# safetensors dtype strings of the stored tensors
SAFETENSORS_DTYPES = {torch.float8_e4m3fn: "F8_E4M3", torch.int32: "I32", torch.uint8: "U8", torch.float32: "F32",
                      torch.bfloat16: "BF16", torch.float16: "F16"}


class QuantFormat(str, enum.Enum):
    FP8_BLOCK = "fp8_block"
    INT4_GROUP = "int4_group"
    MXFP4 = "mxfp4"


@dataclass(frozen=True)
class QuantSpec:
    """How a checkpoint stores its quantized linear weights (parsed from ``quantization_config``).

    Attributes:
        format: one of ``QuantFormat``.
        group_size: 128 (FP8 128x128 blocks) or 32 (INT4 / MXFP4 groups along ``in``).
        ignore: the config's ``ignore`` (compressed-tensors) / ``ignored_layers`` (vLLM fp8) /
            ``modules_to_not_convert`` (transformers) list: modules stored unquantized (``quantizes``).
        ignore_key: which of those keys the list came from (for messages).
        targets: compressed-tensors' ``targets`` of the weight scheme (``("Linear",)``: every Linear layer).
    """

    format: QuantFormat
    group_size: int
    ignore: tuple[str, ...] = ()
    ignore_key: str = "ignore"
    targets: tuple[str, ...] = ("Linear",)

    def quantizes(self, module: str) -> tuple[bool, str]:
        """Whether the checkpoint stores the Linear layer ``module`` (its weight's name without ``.weight``,
        e.g. ``model.layers.1.mlp.shared_experts.gate_proj``) quantized, and the config rule that decided it.

        The rule, as the published loaders apply it: quant_method ``fp8`` quantizes every Linear layer of the
        model (vLLM ``Fp8Config``; the MoE router gate is not one: DeepSeek-V3's ``Gate`` holds a bare weight,
        vLLM/SGLang build it with ``quant_config=None``) except those named by ``ignored_layers`` /
        ``modules_to_not_convert``; compressed-tensors quantizes the Linear layers its ``targets`` match except
        those its ``ignore`` matches. A name entry matches a module equal to it or containing it as whole dotted
        parts; an ``re:`` entry is a regex matched from the name's start (compressed-tensors' ``re.match``).
        The caller decides which modules are Linear layers of the quantized model (router and Kimi-K3's latent
        projections are not).

        Example: Kimi-K2-Thinking's ``re:.*shared_experts.*`` -> (False, "quantization_config.ignore entry
        're:.*shared_experts.*'"); DeepSeek-V3 fp8 -> (True, "quant_method 'fp8' quantizes every Linear layer
        (no ignored_layers / modules_to_not_convert entry matches)").
        """
        for entry in self.ignore:
            if _name_matches(entry, module):
                return False, f"quantization_config.{self.ignore_key} entry {entry!r}"
        if self.format == QuantFormat.FP8_BLOCK:
            return True, ("quant_method 'fp8' quantizes every Linear layer (no ignored_layers / "
                          "modules_to_not_convert entry matches)")
        if "Linear" not in self.targets and not any(_name_matches(t, module) for t in self.targets):
            return False, f"compressed-tensors targets {list(self.targets)} do not match it"
        return True, f"compressed-tensors targets {list(self.targets)} match it and no 'ignore' entry does"

    @staticmethod
    def published(fmt: "QuantFormat | str") -> "QuantSpec":
        """The published scheme of ``fmt``: 128x128 FP8 blocks, or groups of 32 (INT4, MXFP4)."""
        fmt = QuantFormat(fmt)
        return QuantSpec(fmt, FP8_BLOCK if fmt == QuantFormat.FP8_BLOCK else GROUP_SIZE)

    @property
    def weight_suffix(self) -> str:
        """Suffix of the stored weight: ``weight`` (FP8) or ``weight_packed`` (INT4, MXFP4)."""
        return "weight" if self.format == QuantFormat.FP8_BLOCK else "weight_packed"

    @property
    def scale_suffix(self) -> str:
        return "weight_scale_inv" if self.format == QuantFormat.FP8_BLOCK else "weight_scale"

    @property
    def weight_dtype(self) -> torch.dtype:
        return {QuantFormat.FP8_BLOCK: torch.float8_e4m3fn, QuantFormat.INT4_GROUP: torch.int32,
                QuantFormat.MXFP4: torch.uint8}[self.format]

    @property
    def scale_dtypes(self) -> tuple[torch.dtype, ...]:
        """Accepted scale dtypes (compressed-tensors writes INT4 scales in the model dtype)."""
        return {QuantFormat.FP8_BLOCK: (torch.float32,),
                QuantFormat.INT4_GROUP: (torch.bfloat16, torch.float16, torch.float32),
                QuantFormat.MXFP4: (torch.uint8,)}[self.format]

    def stored_shapes(self, out_features: int, in_features: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """``(weight shape, scale shape)`` as stored for an ``[out, in]`` weight.

        Example: int4_group, [2048, 7168] -> ((2048, 896), (2048, 224)); fp8_block -> ((2048, 7168), (16, 56)).
        """
        if self.format == QuantFormat.FP8_BLOCK:
            return (out_features, in_features), (-(-out_features // FP8_BLOCK), -(-in_features // FP8_BLOCK))
        per_element = INT4_PER_WORD if self.format == QuantFormat.INT4_GROUP else FP4_PER_BYTE
        return (out_features, in_features // per_element), (out_features, in_features // GROUP_SIZE)

    def weight_bytes(self, out_features: int, in_features: int) -> int:
        """Bytes of one stored ``[out, in]`` weight plus its scale (``weight_shape`` metadata excluded)."""
        (w_rows, w_cols), (s_rows, s_cols) = self.stored_shapes(out_features, in_features)
        scale_size = torch.empty(0, dtype=self.scale_dtypes[0]).element_size()
        return w_rows * w_cols * torch.empty(0, dtype=self.weight_dtype).element_size() + s_rows * s_cols * scale_size


SUPPORTED_FORMATS = ("quant_method 'fp8' with weight_block_size [128, 128]; compressed-tensors 'pack-quantized' "
                     "(int, 4 bits, symmetric, group 32); compressed-tensors 'mxfp4-pack-quantized' (float, "
                     "4 bits, group 32)")


def quant_spec_from_config(path_or_dict: str | os.PathLike | Mapping[str, Any]) -> QuantSpec | None:
    """The expert quantization of a checkpoint, from ``quantization_config`` in its config.json.

    Args:
        path_or_dict: config.json path, the checkpoint folder holding it, or the parsed dict. The
            ``quantization_config`` may sit at the top level or in ``text_config`` (multimodal wrappers; that one
            wins, the routed experts are the text model's). Scheme keys left out take compressed-tensors'
            defaults (e.g. a weights scheme of only ``num_bits`` and ``group_size`` under an mxfp4 format).

    Returns:
        ``QuantSpec``, or None when the config has no ``quantization_config`` (plain weights). Raises
        ``UnsupportedQuantizationError`` (LOAD008) for another method, scheme, bit width or group size, and
        the CFG010 config-file errors of ``MoEConfig.from_hf_config`` for an unreadable file.
    """
    from moe_ref.core.config import read_hf_config_json

    raw = read_hf_config_json(path_or_dict)
    text = raw.get("text_config") if isinstance(raw.get("text_config"), Mapping) else {}
    # the routed experts live in the text model: its quantization_config wins over a wrapper's
    qc = text.get("quantization_config") or raw.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise UnsupportedQuantizationError(f"quantization_config is {type(qc).__name__} {qc!r}, not an object; "
                                           f"supported: {SUPPORTED_FORMATS}")
    method = qc.get("quant_method")
    ignore_key = next((key for key in ("ignore", "ignored_layers", "modules_to_not_convert") if qc.get(key)),
                      "ignored_layers" if method == "fp8" else "ignore")
    ignore = tuple(str(name) for name in (qc.get(ignore_key) or ()))
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is None or list(block) != [FP8_BLOCK, FP8_BLOCK] or qc.get("fmt", "e4m3") != "e4m3":
            raise UnsupportedQuantizationError(
                f"quant_method 'fp8' with weight_block_size={block!r}, fmt={qc.get('fmt')!r}: moe_ref reads "
                f"e4m3 weights with [128, 128] block scales (weight_scale_inv); supported: {SUPPORTED_FORMATS}")
        return dataclasses.replace(QuantSpec.published(QuantFormat.FP8_BLOCK), ignore=ignore, ignore_key=ignore_key)
    if method == "compressed-tensors":
        fmt, group_size, targets = _compressed_tensors_format(qc)
        return QuantSpec(fmt, group_size, ignore, ignore_key, targets)
    # gpt-oss publishes transformers' own MXFP4 (gate_up_proj_blocks / _scales, quant_method 'mxfp4'), which is
    # not compressed-tensors' mxfp4-pack-quantized: name the way to its plain weights
    hint = (" (gpt-oss's transformers MXFP4, *_blocks + *_scales: read its bf16 weights instead, e.g. saved from "
            "transformers with quantization_config=Mxfp4Config(dequantize=True))") if method == "mxfp4" else ""
    raise UnsupportedQuantizationError(f"quantization_config.quant_method={method!r} is not supported{hint}; "
                                       f"supported: {SUPPORTED_FORMATS}", quant_method=method)


def _name_matches(entry: str, module: str) -> bool:
    """``entry`` of an ignore/targets list matches ``module``: ``re:`` regexes by ``re.match``, names as whole
    dotted parts (``shared_experts`` matches ``model.layers.1.mlp.shared_experts.gate_proj``)."""
    if entry.startswith("re:"):
        return re.match(entry[3:], module) is not None
    return f".{entry}." in f".{module}."


def _compressed_tensors_format(qc: Mapping[str, Any]) -> tuple[QuantFormat, int, tuple[str, ...]]:
    """(format, group size, targets) of a compressed-tensors config: its one weight scheme must be a supported
    one."""
    groups = qc.get("config_groups") or {}
    schemes = [group for group in groups.values() if isinstance(group, Mapping) and group.get("weights")]
    if len(schemes) != 1:
        raise UnsupportedQuantizationError(
            f"compressed-tensors config_groups hold {len(schemes)} weight schemes ({sorted(groups)}); moe_ref reads "
            f"checkpoints with exactly one (the routed experts'); supported: {SUPPORTED_FORMATS}")
    scheme = schemes[0]
    weights = scheme["weights"]
    fmt = scheme.get("format") or qc.get("format")
    settings = {key: weights.get(key) for key in ("num_bits", "type", "symmetric", "strategy", "group_size")}
    expected = {"pack-quantized": (QuantFormat.INT4_GROUP, dict(num_bits=4, type="int", symmetric=True,
                                                                strategy="group", group_size=GROUP_SIZE)),
                "mxfp4-pack-quantized": (QuantFormat.MXFP4, dict(num_bits=4, type="float", strategy="group",
                                                                 group_size=GROUP_SIZE))}
    if fmt not in expected:
        raise UnsupportedQuantizationError(f"compressed-tensors format={fmt!r} is not supported; supported: "
                                           f"{SUPPORTED_FORMATS}", format=fmt)
    quant_format, wanted = expected[fmt]
    required = ("num_bits", "group_size")  # the others may be left to the defaults the format implies
    wrong = {key: settings[key] for key, value in wanted.items()
             if settings[key] != value and (settings[key] is not None or key in required)}
    if wrong:
        raise UnsupportedQuantizationError(
            f"compressed-tensors {fmt!r} with weights {wrong} (want {wanted}): moe_ref reads the published "
            f"scheme only (e.g. group_size 32); supported: {SUPPORTED_FORMATS}", format=fmt, **{"wrong": wrong})
    return quant_format, GROUP_SIZE, tuple(str(t) for t in (scheme.get("targets") or ("Linear",)))


# --------------------------------------------------------------------------------------------------
# one format-agnostic pair: quantize (synthetic checkpoints, tests) and dequantize (references)
# --------------------------------------------------------------------------------------------------
def w4_format_name(fmt: QuantFormat) -> str:
    """A 4-bit checkpoint format's name in ``moe_ref.kernels.experts.w4`` ("int4" or "mxfp4"); only for those formats."""
    return "int4" if fmt == QuantFormat.INT4_GROUP else "mxfp4"


def quantize_weight(weight_OI: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., O, I]`` -> (stored weight, stored scale) in ``fmt``, as the published checkpoints hold them."""
    if fmt == QuantFormat.FP8_BLOCK:
        from moe_ref.kernels.experts.fp8 import quantize_fp8_per_block_128

        return quantize_fp8_per_block_128(weight_OI)
    return quantize_int4(weight_OI) if fmt == QuantFormat.INT4_GROUP else quantize_mxfp4(weight_OI)


def dequantize_weight(qweight: torch.Tensor, scale: torch.Tensor, fmt: QuantFormat,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored weight + scale in ``fmt`` -> the dense ``[..., O, I]`` weight in ``dtype``."""
    if fmt == QuantFormat.FP8_BLOCK:
        return dequantize_fp8_per_block_128(qweight, scale, dtype)
    if fmt == QuantFormat.INT4_GROUP:
        return dequantize_int4(qweight, scale, dtype)
    return dequantize_mxfp4(qweight, scale, dtype)


QUANTIZED_TENSOR_FIELDS = ("gate_up_qweight_e2FDq", "gate_up_scale_e2FDs", "down_qweight_eDFq", "down_scale_eDFs")


@dataclass(frozen=True)
class QuantizedExpertWeights:
    """One rank's routed experts, exactly as the checkpoint stores them (no dequantization); 4-bit words may be in
    the W4A16 kernel's nibble order instead (``nibble_order``, ``with_group_planes``: the same bytes, rewritten), and
    FP8 gate/up rows interleaved in 128-row blocks (``gate_up_interleaved``, ``with_interleaved_gate_up``: the same
    rows, moved).

    Gate rows then up rows, as in ``MoEWeights.gate_up_weight_E2FD``. Stored widths ``Dq``/``Fq`` and scale
    widths ``Ds``/``Fs`` follow the format: fp8_block ``Dq = D`` (float8_e4m3fn), scales fp32 ``[e, 2F/128,
    ceil(D/128)]`` / ``[e, ceil(D/128), F/128]`` (needs F % 128 == 0, so the gate and up blocks stack);
    int4_group ``Dq = D/8`` (int32), scales ``[e, 2F, D/32]`` bf16/fp16/fp32; mxfp4 ``Dq = D/2`` (uint8),
    scales ``[e, 2F, D/32]`` uint8.

    Attributes:
        spec: the format.
        gate_up_qweight_e2FDq: ``[e, 2F, Dq]``.
        gate_up_scale_e2FDs: see above.
        down_qweight_eDFq: ``[e, D, Fq]``.
        down_scale_eDFs: see above.
        hidden_size: D (the latent width for Kimi-K3).
        intermediate_size: F.
        first_expert: global id of local expert 0.
        nibble_order: "checkpoint" (as stored), or "group_planes": the 4-bit words rewritten in place in the order
            of ``moe_ref.kernels.experts.grouped_mlp_w4`` (``kernels.w4.to_group_planes``); ``as_stored()`` gives them back
            in the checkpoint's order.
        gate_up_interleaved: fp8_block only: gate_up's rows, and its scale rows alike, rewritten in place in
            alternating 128-row gate and up blocks (``kernels.grouped_mlp.interleave_gate_up``), as the FP8 kernels
            run them; ``as_stored()`` gives them back stacked.
    """

    spec: QuantSpec
    gate_up_qweight_e2FDq: torch.Tensor
    gate_up_scale_e2FDs: torch.Tensor
    down_qweight_eDFq: torch.Tensor
    down_scale_eDFs: torch.Tensor
    hidden_size: int
    intermediate_size: int
    first_expert: int = 0
    nibble_order: str = "checkpoint"
    gate_up_interleaved: bool = False

    @property
    def num_experts(self) -> int:
        return self.gate_up_qweight_e2FDq.shape[0]

    @property
    def device(self) -> torch.device:
        return self.gate_up_qweight_e2FDq.device

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, field) for field in QUANTIZED_TENSOR_FIELDS)

    def nbytes(self) -> int:
        """Bytes these tensors occupy: equal to the checkpoint's bytes of these experts' weights and scales."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def to(self, device) -> "QuantizedExpertWeights":
        moved = [t.to(device) for t in self.tensors()]
        return dataclasses.replace(self, gate_up_qweight_e2FDq=moved[0], gate_up_scale_e2FDs=moved[1],
                                   down_qweight_eDFq=moved[2], down_scale_eDFs=moved[3])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """The dense weights: ``gate_up [e, 2F, D]`` and ``down [e, D, F]`` in ``dtype`` (the reference)."""
        stored = self.as_stored()
        fmt = self.spec.format
        return (dequantize_weight(stored.gate_up_qweight_e2FDq, stored.gate_up_scale_e2FDs, fmt, dtype),
                dequantize_weight(stored.down_qweight_eDFq, stored.down_scale_eDFs, fmt, dtype))

    @property
    def w4_format(self) -> str:
        """The 4-bit format's name in ``moe_ref.kernels.experts.w4`` (``w4_format_name``); only for those formats."""
        return w4_format_name(self.spec.format)

    def dequantize_expert(self, i: int, which: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Expert ``i``'s dense ``gate_up [2F, D]`` (``which="gate_up"``) or ``down [D, F]`` in ``dtype`` (only its
        bytes converted)."""
        qweight, scale = (self.gate_up_qweight_e2FDq, self.gate_up_scale_e2FDs) if which == "gate_up" else (
            self.down_qweight_eDFq, self.down_scale_eDFs)
        if self.gate_up_interleaved and which == "gate_up":
            from moe_ref.kernels.experts.grouped_mlp import deinterleave_gate_up

            return deinterleave_gate_up(dequantize_weight(qweight[i:i + 1], scale[i:i + 1], self.spec.format, dtype))[0]
        if self.nibble_order == "checkpoint":
            return dequantize_weight(qweight[i], scale[i], self.spec.format, dtype)
        in_features = self.hidden_size if which == "gate_up" else self.intermediate_size
        packed = packed_from_planes(qweight[i:i + 1].view(torch.int32), self.w4_format, in_features)[0]
        return dequantize_weight(packed, scale[i], self.spec.format, dtype)

    def group_planes(self) -> tuple[W4Weight, W4Weight]:
        """(gate_up, down) 4-bit weights in the W4A16 kernel's order: views of this object's words when they are
        in that order already (``with_group_planes``; the scales a block-major copy), else new tensors
        (``to_group_planes``)."""
        if self.nibble_order == "checkpoint":
            return (to_group_planes(self.gate_up_qweight_e2FDq, self.gate_up_scale_e2FDs, self.w4_format),
                    to_group_planes(self.down_qweight_eDFq, self.down_scale_eDFs, self.w4_format))
        return (W4Weight(self.w4_format, self.gate_up_qweight_e2FDq.view(torch.int32),
                         block_major_scales(self.gate_up_scale_e2FDs, self.hidden_size), self.hidden_size),
                W4Weight(self.w4_format, self.down_qweight_eDFq.view(torch.int32),
                         block_major_scales(self.down_scale_eDFs, self.intermediate_size), self.intermediate_size))

    def with_group_planes(self) -> "QuantizedExpertWeights":
        """These experts with their 4-bit words rewritten IN PLACE in the W4A16 kernel's order (no second copy of
        the weights). This object's tensors change while its ``nibble_order`` still says "checkpoint": only an owner
        that keeps the result and drops this object may call it (the layer, at load). Returned unchanged where that
        is impossible or already done: FP8, or D or F not a multiple of 256 (the kernel then gets padded copies)."""
        w4 = self.spec.format in (QuantFormat.INT4_GROUP, QuantFormat.MXFP4)
        whole = self.hidden_size % PLANE_BLOCK == 0 and self.intermediate_size % PLANE_BLOCK == 0
        if not w4 or not whole or self.nibble_order == "group_planes":
            return self
        to_group_planes(self.gate_up_qweight_e2FDq, self.gate_up_scale_e2FDs, self.w4_format, in_place=True)
        to_group_planes(self.down_qweight_eDFq, self.down_scale_eDFs, self.w4_format, in_place=True)
        return dataclasses.replace(self, nibble_order="group_planes")

    def with_interleaved_gate_up(self) -> "QuantizedExpertWeights":
        """These fp8_block experts with gate_up's rows and scale rows rewritten IN PLACE in alternating 128-row gate
        and up blocks (one expert at a time: no second copy of the weights). As ``with_group_planes``, only an owner
        that keeps the result and drops this object may call it (the layer, at load). Returned unchanged for other
        formats or when already done."""
        from moe_ref.kernels.experts.grouped_mlp import interleave_gate_up

        if self.spec.format != QuantFormat.FP8_BLOCK or self.gate_up_interleaved:
            return self
        for i in range(self.num_experts):
            for tensor, rows_per_block in ((self.gate_up_qweight_e2FDq, FP8_BLOCK), (self.gate_up_scale_e2FDs, 1)):
                tensor[i:i + 1].copy_(interleave_gate_up(tensor[i:i + 1], rows_per_block))
        return dataclasses.replace(self, gate_up_interleaved=True)

    def as_stored(self) -> "QuantizedExpertWeights":
        """These experts in the checkpoint's order: this object, or a copy with the words (group planes) or the
        gate/up rows (interleaved) put back."""
        if self.gate_up_interleaved:
            from moe_ref.kernels.experts.grouped_mlp import deinterleave_gate_up

            return dataclasses.replace(
                self, gate_up_qweight_e2FDq=deinterleave_gate_up(self.gate_up_qweight_e2FDq, FP8_BLOCK),
                gate_up_scale_e2FDs=deinterleave_gate_up(self.gate_up_scale_e2FDs, 1), gate_up_interleaved=False)
        if self.nibble_order == "checkpoint":
            return self
        gate_up_q = packed_from_planes(self.gate_up_qweight_e2FDq.view(torch.int32), self.w4_format, self.hidden_size)
        down_q = packed_from_planes(self.down_qweight_eDFq.view(torch.int32), self.w4_format, self.intermediate_size)
        return dataclasses.replace(self, gate_up_qweight_e2FDq=gate_up_q, down_qweight_eDFq=down_q,
                                   nibble_order="checkpoint")


def shape_problem(fmt: QuantFormat | str, hidden_size: int, intermediate_size: int) -> str | None:
    """Why ``fmt`` cannot store routed experts of width ``hidden_size`` (Dx) and ``intermediate_size`` (F) as
    moe_ref stacks them; None when it can. Groups of 32 run along both weights' inputs (D and F); FP8 gate and
    up 128x128 blocks are stacked into one grid, so F % 128 == 0 (D's edge blocks are padded).

    Only the dimensions at fault are named. Example: mxfp4, D 32, F 24 -> "F=24 is not a multiple of 32 (D=32 is)".
    """
    fmt = QuantFormat(fmt)
    if fmt == QuantFormat.FP8_BLOCK:
        return None if intermediate_size % FP8_BLOCK == 0 else f"F={intermediate_size} must be a multiple of 128"
    dims = (("D", hidden_size), ("F", intermediate_size))
    bad = [f"{name}={value}" for name, value in dims if value % GROUP_SIZE]
    good = [f"{name}={value}" for name, value in dims if not value % GROUP_SIZE]
    if not bad:
        return None
    if len(bad) == 2:
        return f"{bad[0]} and {bad[1]} are not multiples of {GROUP_SIZE}"
    return f"{bad[0]} is not a multiple of {GROUP_SIZE} ({good[0]} is)"


def expert_weight_bytes(spec: QuantSpec | None, hidden_size: int, intermediate_size: int, num_experts: int,
                        plain_dtype: torch.dtype = torch.bfloat16) -> int:
    """Device bytes of ``num_experts`` routed experts (gate, up, down + scales) stored in ``spec``
    (``plain_dtype`` weights when ``spec`` is None), without reading a checkpoint: what ``moe-ref plan``
    reports.

    Example: kimi-k2 int4_group, D 7168, F 2048, 192 experts -> 192 * 3 * (2048*896*4 + 2048*224*2) = 4.93e9.
    """
    if spec is None:
        return num_experts * 3 * hidden_size * intermediate_size * torch.empty(0, dtype=plain_dtype).element_size()
    per_expert = 2 * spec.weight_bytes(intermediate_size, hidden_size) + spec.weight_bytes(hidden_size, intermediate_size)
    return num_experts * per_expert

