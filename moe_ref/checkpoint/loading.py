"""Read one MoE layer from a safetensors checkpoint, with each family's real tensor names, into ``MoEWeights``.

    checkpoint (file | folder | sharded folder + index json)
      --CheckpointReader: name -> file, shapes and dtypes from the headers (no data read)-->
      --find the layer prefix and the expert layout (auto-detected)-->
      --read router, bias, shared, latent tensors whole; read ONLY experts [first, first + count)-->
      MoEWeights (canonical layout, see ``moe_ref.core.weights``)

Shape legend: E experts (all), e experts read (``count``), D hidden, F expert intermediate,
S shared-MLP intermediate, L latent width (Kimi-K3), Dx = L for a latent MoE, else D.

Names are relative to ``{prefix}{layer_idx}.``; ``prefix`` is auto-detected among ``KNOWN_PREFIXES``
(``model.layers.``, ``language_model.layers.``, ``model.language_model.layers.``, ``language_model.model.layers.``)
or given by the caller. Each family's names in each published layout are data: ``moe_ref.core.families``
(``Family.layouts``, one ``TensorLayout`` per layout: "hub" as published and as transformers' ``save_pretrained``
writes it, "fused" as transformers 5.x holds its experts, ``mlp.experts.gate_up_proj [E, 2F, D]``). For example:

==============  ==========================================================================================
family          tensors (hub layout)
==============  ==========================================================================================
DeepSeek-V3,    router ``mlp.gate.weight [E, D]``, bias ``mlp.gate.e_score_correction_bias [E]``; experts
Kimi-K2, GLM    ``mlp.experts.{e}.{gate_proj,up_proj}.weight [F, D]``, ``mlp.experts.{e}.down_proj.weight [D, F]``;
(and custom)    shared ``mlp.shared_experts.{gate,up,down}_proj.weight``.
Qwen2-MoE       as above without the bias; shared ``mlp.shared_expert.*`` and ``mlp.shared_expert_gate.weight [1, D]``
Mixtral         ``block_sparse_moe.gate.weight``, ``block_sparse_moe.experts.{e}.w1`` (gate) / ``w3`` (up) / ``w2``
gpt-oss         ``mlp.router.weight``, ``mlp.router.bias [E]``; ``mlp.experts.gate_up_proj [E, D, 2F]`` (for x @ W,
                gate and up interleaved by column) + ``gate_up_proj_bias [E, 2F]``, ``mlp.experts.down_proj
                [E, F, D]`` + ``down_proj_bias [E, D]``: transposed and de-interleaved into the canonical layout.
Ernie-4.5       bias ``mlp.moe_statics.e_score_correction_bias [1, E]``
HunYuan         router ``mlp.gate.wg.weight``; shared ``mlp.shared_mlp.*``
Kimi-K3         module ``block_sparse_moe.``: ``experts.{e}.w1/w3/w2``, latent ``routed_expert_down_proj.weight
                [L, D]``, ``routed_expert_up_proj.weight [D, L]``, ``routed_expert_norm.weight [L]``. Real K3
                checkpoints store the routed experts as MXFP4 ``weight_packed`` + scales:
                ``moe_ref.checkpoint.quantized.load_quantized_experts`` reads them.
Step3           stacked ``moe.{gate_proj,up_proj}.weight [E, F, D]``, ``moe.down_proj.weight [E, D, F]``; shared
                ``share_expert.{gate,up,down}_proj.weight``.
==============  ==========================================================================================

A Linear weight with a ``.bias`` beside it that the family's math has no place for is refused (LOAD019): dropping
it would compute another model.

Without ``quant``, quantized tensors (FP8/INT/packed dtypes, or ``*_scale_inv`` / ``weight_packed`` siblings)
are refused with LOAD003 rather than read as if they were plain weights: the checkpoint's config.json lacks the
``quantization_config`` it was published with, which tells how to read them. With ``quant`` (the checkpoint's
``QuantSpec``, from its ``quantization_config``), each Linear layer of the block (shared experts; routed
experts when the config leaves them unquantized) is read in the precision the config decides
(``QuantSpec.quantizes``): a quantized one (e.g. DeepSeek-V3 / Kimi-K2-Instruct / Step3 FP8 shared experts) is
dequantized ONCE, here, into ``dtype``; a module stored otherwise than the config says is LOAD014 naming the
tensor and the rule. The router and Kimi-K3's latent projections are never quantized Linear layers (the
published model code builds them with ``quant_config=None``). ``LoadReport`` records what was read and held.
``moe_ref.checkpoint.quantized.load_quantized_experts`` reads quantized routed experts as stored.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from moe_ref.core.config import MoEConfig
from moe_ref.core.errors import (
    DTypeError,
    InvalidConfigError,
    MoERefError,
    LayerIndexError,
    UnexpectedTensorError,
    MissingScaleError,
    MissingTensorError,
    QuantizationMismatchError,
    QuantTensorDTypeError,
    QuantTensorShapeError,
    TensorShapeMismatchError,
    UnsupportedCheckpointError,
)
from moe_ref.core.weights import MoEWeights
from moe_ref.checkpoint.names import (  # noqa: F401  (KNOWN_PREFIXES, layer_names, ...: re-exported for readers)
    KNOWN_PREFIXES,
    LayerNames,
    detect_layout as _detect_layout,
    detect_prefix as _detect_prefix,
    family_layouts,
    layer_names,
    missing_hint,
    ranges,
    shape_hint,
)
from moe_ref.checkpoint.reader import CheckpointReader

if TYPE_CHECKING:
    from moe_ref.checkpoint.formats import QuantSpec

# safetensors dtype strings that hold plain (unquantized) weights
_PLAIN_DTYPES = ("F64", "F32", "F16", "BF16")
_QUANT_SUFFIXES = ("_scale_inv", "_scale", "_packed", "_shape", "_zero_point", "_global_scale")
_TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# why a quantized checkpoint keeps the router (and Kimi-K3's latent projections) plain: the published model code
# builds them without a quant_config (DeepSeek-V3 inference ``Gate``; vLLM/SGLang ``quant_config=None``)
_NEVER_QUANTIZED = ("the router gate and Kimi-K3's latent projections are not quantized Linear layers of the "
                    "published model (vLLM/SGLang build them with quant_config=None)")
_NO_QUANT_CONFIG = ("It was read without a quantization_config, which says how a quantized checkpoint's tensors are "
                    "stored: restore the quantization_config from the model's published config.json (MegaMoE."
                    "load_hf_weights then reads FP8 128x128 blocks, compressed-tensors INT4 and MXFP4 as stored), or "
                    "pass quant=checkpoint_quant_spec(path) to load_moe_weights")


# --- what a load read -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class LoadedTensor:
    """One weight a load read: how the checkpoint stores it and what the layer holds.

    Attributes:
        name: the weight's checkpoint name (quantized: the stored weight, e.g. ``...gate_proj.weight`` or
            ``...w1.weight_packed``; its scale is counted with it).
        stored: safetensors dtype and format as stored, e.g. ``"BF16"``, ``"F8_E4M3 fp8_block"``.
        stored_bytes: bytes read from the checkpoint (weight + scale).
        held: the held dtype, or ``"as stored"`` for routed experts kept quantized.
        held_bytes: bytes the layer holds for it.
        rule: the quantization_config rule that decided its precision (None for a plain checkpoint).
    """

    name: str
    stored: str
    stored_bytes: int
    held: str
    held_bytes: int
    rule: str | None = None

    @property
    def dequantized(self) -> bool:
        return self.held != "as stored" and self.stored.split()[0] not in _PLAIN_DTYPES


@dataclass
class LoadReport:
    """What a load read and holds (``MegaMoE.load_report()``; ``load_moe_weights(report=...)`` fills one).

    Example (Kimi-K2-Instruct FP8, shared experts S 2048, D 7168, bf16 layer): 3 shared weights dequantized
    once, ``dequantized_bytes()`` = (44.1 MB read: fp8 + fp32 scales, 88.1 MB held in bf16).
    """

    tensors: list[LoadedTensor] = field(default_factory=list)

    def add(self, entry: LoadedTensor) -> None:
        self.tensors.append(entry)

    def dequantized(self) -> list[LoadedTensor]:
        """The weights read quantized and dequantized once at load into the layer's dtype."""
        return [t for t in self.tensors if t.dequantized]

    def dequantized_bytes(self) -> tuple[int, int]:
        """(bytes read quantized, bytes held dequantized) of ``dequantized()``."""
        entries = self.dequantized()
        return sum(t.stored_bytes for t in entries), sum(t.held_bytes for t in entries)

    def bytes_read(self) -> int:
        return sum(t.stored_bytes for t in self.tensors)

    def bytes_held(self) -> int:
        return sum(t.held_bytes for t in self.tensors)

    def summary(self) -> str:
        """One line: totals, and the dequantized weights' bytes as stored vs held."""
        line = f"read {self.bytes_read():,} bytes, hold {self.bytes_held():,} bytes over {len(self.tensors)} weights"
        entries = self.dequantized()
        if entries:
            stored, held = self.dequantized_bytes()
            formats = sorted({t.stored for t in entries})
            line += (f"; {len(entries)} dequantized once at load ({', '.join(formats)}: {stored:,} bytes read, "
                     f"{held:,} bytes held as {entries[0].held})")
        return line


# --- checks of a quantized weight's tensors (both readers: here and moe_ref.checkpoint.quantized) ------------

def plain_where_quantized_error(ckpt: CheckpointReader, spec: "QuantSpec", layer_idx: int, name: str,
                                rule: str) -> QuantizationMismatchError:
    """LOAD014 (not raised) for ``name`` stored as a plain weight where the quantization_config quantizes it."""
    return QuantizationMismatchError(
        f"tensor {name!r} (layer {layer_idx}) is stored as plain {ckpt.dtype(name)}, but the checkpoint's "
        f"quantization_config says {spec.format.value} ({spec.weight_suffix} + {spec.scale_suffix}): {rule}. Use "
        f"the config.json that came with the checkpoint, or list the module in its {spec.ignore_key}",
        name=name, rule=rule)


def missing_scale_error(ckpt: CheckpointReader, layer_idx: int, weight_name: str, scale_name: str) -> MissingScaleError:
    """LOAD007 (not raised): the quantized weight ``weight_name`` has no ``scale_name`` in the checkpoint."""
    return MissingScaleError(
        f"{weight_name!r} (layer {layer_idx}) has no scale {scale_name!r} in the checkpoint "
        f"({ckpt.describe_files()}): its values cannot be used without it; download every shard", name=scale_name)


def check_recorded_shape(ckpt: CheckpointReader, spec: "QuantSpec", layer_idx: int, module: str, out_f: int,
                         in_f: int) -> None:
    """LOAD006 when an INT4 weight's recorded ``<module>.weight_shape`` is not ``[out_f, in_f]`` (the config's)."""
    from moe_ref.checkpoint.formats import QuantFormat

    shape_name = f"{module}.weight_shape"
    if spec.format != QuantFormat.INT4_GROUP or shape_name not in ckpt:
        return
    recorded = [int(v) for v in ckpt.read(shape_name).flatten().tolist()]
    if recorded != [out_f, in_f]:
        raise QuantTensorShapeError(
            f"{shape_name!r} records the weight as {recorded}, but the config expects [{out_f}, {in_f}] (layer "
            f"{layer_idx}); use the config.json that came with the checkpoint", name=shape_name)


# --- the loader ------------------------------------------------------------------------------------------

def load_moe_weights(
    path: str | os.PathLike, cfg: MoEConfig, layer_idx: int, *, expert_range: tuple[int, int] | None = None,
    prefix: str | None = None, dtype: torch.dtype | None = None, device="cpu", experts: bool = True,
    progress: bool = False, quant: "QuantSpec | None" = None, report: LoadReport | None = None,
) -> MoEWeights:
    """Read MoE layer ``layer_idx`` of a checkpoint into ``MoEWeights``, reading only the experts asked for.

    Args:
        path: a ``.safetensors`` file, or a folder with ``model.safetensors``, or sharded files plus
            ``model.safetensors.index.json`` (its ``weight_map``), or any ``*.safetensors`` files.
        cfg: the model's config (``MoEConfig.from_hf_config(<checkpoint dir>)``); its ``family`` picks the
            names and its sizes give the expected shapes.
        layer_idx: the decoder layer (must be an MoE layer).
        expert_range: ``(first, count)``: read only experts ``[first, first + count)`` (one EP rank's block);
            None = all ``cfg.num_experts``. Router, bias, shared and latent tensors are always read whole.
        prefix: the text before the layer number (e.g. ``"model.language_model.layers."``); None tries
            ``KNOWN_PREFIXES``.
        dtype: cast every tensor except the bias to this dtype; None keeps the checkpoint's dtypes.
        device: where the returned tensors live.
        experts: False skips the routed experts (quantized checkpoints: ``load_quantized_experts`` reads them as
            stored); the returned expert tensors are then empty, ``[0, 2F, Dx]`` and ``[0, Dx, F]``.
        progress: a tqdm progress bar over the experts read, on stderr.
        quant: the checkpoint's ``QuantSpec`` (``moe_ref.checkpoint.quantized.checkpoint_quant_spec``): each
            Linear layer read (shared experts; routed experts with ``experts=True``) is read in the precision
            its ``quantization_config`` decides, quantized ones dequantized once into ``dtype`` (None: the
            router's stored dtype). None: plain weights only (LOAD003 for a quantized one).
        report: a ``LoadReport`` to fill with what was read and held.

    Returns:
        ``MoEWeights`` with ``gate_up_weight_E2FD [count, 2F, Dx]``, ``down_weight_EDF [count, Dx, F]``,
        ``first_expert = first``, ``bias_E`` in float32 (None when ``cfg.use_selection_bias`` is False), and
        the shared / latent tensors when ``cfg`` has them.

    Raises:
        MissingTensorError (LOAD001), TensorShapeMismatchError (LOAD002), UnsupportedCheckpointError (LOAD003),
        CheckpointNotFoundError (LOAD004), LayerIndexError (LOAD018) for a layer past the model's last one,
        UnexpectedTensorError (LOAD019) for a bias the family has no place for, InvalidConfigError (CFG007) for a
        bad ``expert_range``; with ``quant``: QuantizationMismatchError (LOAD014), and LOAD005-LOAD007 for a
        quantized weight's tensors.
    """
    if dtype is not None and not dtype.is_floating_point:
        raise DTypeError(f"dtype={dtype} is not a floating dtype; pass torch.bfloat16, torch.float32, ... or None")
    check_layer_index(cfg, layer_idx)
    first, count = _check_expert_range(expert_range, cfg)
    with CheckpointReader(path) as ckpt:
        layer_prefix = f"{prefix if prefix is not None else _detect_prefix(ckpt, cfg, layer_idx)}{layer_idx}."
        names = _detect_layout(ckpt, cfg, layer_prefix, first)
        reader = _LayerReader(ckpt, cfg, layer_idx, names, dtype, device, quant, report)
        return _read_layer(reader, first, count, experts, progress)


def check_moe_layer(path: str | os.PathLike, cfg: MoEConfig, layer_idx: int, *, prefix: str | None = None,
                    quant: "QuantSpec | None" = None, experts: bool = True) -> list[MoERefError]:
    """What ``load_moe_weights(path, cfg, layer_idx, prefix=prefix, quant=quant, experts=experts)`` would raise,
    without reading any tensor's values (names, dtypes and shapes come from the safetensors headers): ``[]`` when it
    would load, else ``[its error]``. For ``moe-ref check`` on a checkpoint folder, so that the check and
    ``MegaMoE.load_hf_weights`` agree.

    Args:
        path, cfg, layer_idx, prefix, quant: as ``load_moe_weights`` (``quant``: the checkpoint's ``QuantSpec``,
            ``moe_ref.checkpoint.quantized.checkpoint_quant_spec(path)``).
        experts: False when the routed experts are read as stored (``load_quantized_experts`` checks them).

    Returns:
        The coded errors (``MoERefError``) the load would raise: at most one, the first.
    """
    try:
        check_layer_index(cfg, layer_idx)
        with CheckpointReader(path) as ckpt:
            layer_prefix = f"{prefix if prefix is not None else _detect_prefix(ckpt, cfg, layer_idx)}{layer_idx}."
            reader = _LayerReader(ckpt, cfg, layer_idx, _detect_layout(ckpt, cfg, layer_prefix, 0), None, "meta",
                                  quant, headers_only=True)
            _read_layer(reader, 0, cfg.num_experts, experts, progress=False)
    except MoERefError as err:
        return [err]
    return []


def _read_layer(reader: "_LayerReader", first: int, count: int, experts: bool, progress: bool) -> MoEWeights:
    """Every tensor of the layer ``reader`` reads (``load_moe_weights``' body), experts ``[first, first + count)``."""
    cfg, names, dtype, device = reader.cfg, reader.names, reader.dtype, reader.device
    E, D = cfg.num_experts, cfg.hidden_size
    # the router first: when it is missing, the layer is most likely dense, which the error says
    gate_weight_ED = reader.tensor(names.router, (E, D))
    bias_E = reader.vector(names.bias, E, torch.float32) if cfg.use_selection_bias else None
    expert_biases = (None, None)
    if experts:
        gate_up_E2FD, down_EDF, *expert_biases = reader.experts(first, count, progress)
    else:
        empty_dtype = dtype or gate_weight_ED.dtype
        F, Dx = cfg.intermediate_size, cfg.expert_hidden_size
        gate_up_E2FD = torch.empty(0, 2 * F, Dx, dtype=empty_dtype, device=device)
        down_EDF = torch.empty(0, Dx, F, dtype=empty_dtype, device=device)
    shared = reader.shared() if cfg.has_shared_experts else (None, None)
    return MoEWeights(
        gate_weight_ED=gate_weight_ED,
        gate_up_weight_E2FD=gate_up_E2FD,
        down_weight_EDF=down_EDF,
        bias_E=bias_E,
        router_bias_E=reader.tensor(names.router_bias, (E,)) if cfg.router_bias else None,
        gate_up_bias_E2F=expert_biases[0],
        down_bias_ED=expert_biases[1],
        shared_gate_weight_D=reader.tensor(names.shared_expert_gate, (1, D)).reshape(D)
        if cfg.shared_expert_gate else None,
        shared_gate_up_weight_2SD=shared[0],
        shared_down_weight_DS=shared[1],
        latent_down_weight_LD=reader.tensor(names.latent_down, (cfg.latent_dim, cfg.hidden_size))
        if cfg.latent_dim else None,
        latent_up_weight_DL=reader.tensor(names.latent_up, (cfg.hidden_size, cfg.latent_dim))
        if cfg.latent_dim else None,
        latent_norm_weight_L=reader.tensor(names.latent_norm, (cfg.latent_dim,))
        if cfg.latent_dim and cfg.latent_norm else None,
        first_expert=first,
    )


def _check_expert_range(expert_range, cfg: MoEConfig) -> tuple[int, int]:
    if expert_range is None:
        return 0, cfg.num_experts
    first, count = (int(v) for v in expert_range)
    if first < 0 or count <= 0 or first + count > cfg.num_experts:
        raise InvalidConfigError(
            f"expert_range=(first={first}, count={count}) is not inside the {cfg.num_experts} experts: need "
            f"first >= 0, count >= 1 and first + count <= {cfg.num_experts} (EP rank r of R reads "
            f"(r * E // R, E // R))", field="expert_range")
    return first, count


def check_layer_index(cfg: MoEConfig, layer_idx: int) -> None:
    """``LayerIndexError`` (LOAD018) when ``layer_idx`` is not a layer of the model (``cfg.num_layers``, when the
    config says how many decoder layers it has), naming its layers and MoE layers."""
    num_layers = cfg.num_layers
    if num_layers is None or 0 <= layer_idx < num_layers:
        return
    moe = f"; its MoE layers are {ranges(cfg.moe_layers)}" if cfg.moe_layers else ""
    where = "is past the model's last layer" if layer_idx >= num_layers else "is not a layer of the model"
    raise LayerIndexError(
        f"layer {layer_idx} {where}: {cfg.name} has num_hidden_layers={num_layers} (layers "
        f"0..{num_layers - 1}){moe}; pass one of those as layer_idx", layer=layer_idx, num_layers=num_layers)


class _LayerReader:
    """Reads and checks the tensors of one layer: presence, plain dtype, shape; then casts and moves."""

    def __init__(self, ckpt: CheckpointReader, cfg: MoEConfig, layer_idx: int, names: LayerNames,
                 dtype: torch.dtype | None, device, quant: "QuantSpec | None" = None,
                 report: LoadReport | None = None, headers_only: bool = False):
        self.ckpt, self.cfg, self.layer_idx, self.names = ckpt, cfg, layer_idx, names
        self.dtype, self.device, self.quant = dtype, device, quant
        self.report = report if report is not None else LoadReport()
        # check every name, dtype and shape but read no values: the tensors come back empty on "meta"
        self.headers_only = headers_only

    # --- one tensor ---
    def tensor(self, name: str, expected: tuple[int, ...], dtype: torch.dtype | None = None,
               rows: tuple[int, int] | None = None, rule: str | None = None) -> torch.Tensor:
        """Check ``name`` exists, is plain floating point and has shape ``expected``; read it (or ``rows``).
        ``rule``: why the quantization_config leaves it plain (a quantized checkpoint's message)."""
        self._check(name, expected, rule)
        self._refuse_unexpected_bias(name)
        if self.headers_only:
            return self._empty(expected, rows, dtype or self.dtype or _TORCH_DTYPES[self.ckpt.dtype(name)])
        value = self.ckpt.read(name) if rows is None else self.ckpt.read_rows(name, *rows)
        out = value.to(device=self.device, dtype=dtype or self.dtype or value.dtype)
        self.report.add(LoadedTensor(name, self.ckpt.dtype(name), value.numel() * value.element_size(),
                                     str(out.dtype).removeprefix("torch."), out.numel() * out.element_size(),
                                     rule))
        return out

    @staticmethod
    def _empty(expected: tuple[int, ...], rows: tuple[int, int] | None, dtype: torch.dtype) -> torch.Tensor:
        """A value-less stand-in of a tensor checked with ``headers_only`` (its rows ``rows``, if given)."""
        shape = tuple(expected) if rows is None else (rows[1], *expected[1:])
        return torch.empty(shape, dtype=dtype, device="meta")

    def vector(self, name: str, length: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A ``[length]`` vector stored ``[length]`` or ``[1, length]`` (Ernie's ``moe_statics`` bias), as
        ``[length]``."""
        stored = self.ckpt.shape(name) if name in self.ckpt else None
        expected = (1, length) if stored == (1, length) else (length,)
        return self.tensor(name, expected, dtype).reshape(length)

    def _refuse_unexpected_bias(self, name: str) -> None:
        """LOAD019 when the Linear weight ``name`` has a ``.bias`` beside it that the family's math has no place for
        (the biases it has are read under their own names)."""
        if not name.endswith(".weight"):
            return
        bias = name[:-len("weight")] + "bias"
        if bias in self.ckpt and bias != self.names.router_bias:
            raise UnexpectedTensorError(
                f"{bias!r} (layer {self.layer_idx}) is a bias of {name!r}, but {self.cfg.name} ({self.cfg.family}) "
                f"has no bias there: moe_ref would compute without it, a different model. Use the config.json that "
                f"came with the checkpoint (a family whose Linear layers have biases is a different family, or a "
                f"config value such as mlp_bias / use_bias that moe_ref refuses)", name=bias)

    def linear(self, name: str, expected: tuple[int, int], rows: tuple[int, int] | None = None) -> torch.Tensor:
        """A Linear layer's weight ``name`` (``...weight``) in the precision the checkpoint's quantization_config
        decides: plain, or quantized and dequantized here, once, into the layer's dtype. For a stacked
        ``[E, O, I]`` weight, ``expected`` is ``(E, O, I)`` and ``rows`` the experts read."""
        if self.quant is None:
            return self.tensor(name, expected, rows=rows)
        module = name[:-len(".weight")] if name.endswith(".weight") else name
        quantized, rule = self.quant.quantizes(module)
        if not quantized:
            self._check_not_quantized(module, name, rule)
            return self.tensor(name, expected, rows=rows, rule=rule)
        return self._dequantized(module, name, expected, rows, rule)

    def _check_not_quantized(self, module: str, name: str, rule: str) -> None:
        spec = self.quant
        stored = [n for n in (f"{module}.weight_packed", f"{module}.weight_scale_inv", f"{module}.weight_scale")
                  if n in self.ckpt]
        if name in self.ckpt and self.ckpt.dtype(name) not in _PLAIN_DTYPES:
            stored.insert(0, f"{name} ({self.ckpt.dtype(name)})")
        if stored:
            raise QuantizationMismatchError(
                f"{module!r} (layer {self.layer_idx}) is stored quantized ({', '.join(stored[:3])}), but the "
                f"checkpoint's quantization_config ({spec.format.value}) leaves it unquantized: {rule}. Use the "
                f"config.json that came with the checkpoint, or fix its ignore list", name=name, rule=rule)

    def _dequantized(self, module: str, name: str, expected: tuple[int, ...], rows, rule: str) -> torch.Tensor:
        from moe_ref.checkpoint.formats import SAFETENSORS_DTYPES as _SAFETENSORS_DTYPES, dequantize_weight

        spec, fmt = self.quant, self.quant.format
        weight_name, scale_name = f"{module}.{spec.weight_suffix}", f"{module}.{spec.scale_suffix}"
        plain = name in self.ckpt and self.ckpt.dtype(name) in _PLAIN_DTYPES
        if plain and (weight_name == name or weight_name not in self.ckpt):
            raise plain_where_quantized_error(self.ckpt, spec, self.layer_idx, name, rule)
        if weight_name not in self.ckpt:
            self._raise_missing(weight_name)
        if scale_name not in self.ckpt:
            raise missing_scale_error(self.ckpt, self.layer_idx, weight_name, scale_name)
        *lead, out_f, in_f = expected
        weight_shape, scale_shape = spec.stored_shapes(out_f, in_f)
        for tensor_name, dtypes, shape in ((weight_name, (spec.weight_dtype,), weight_shape),
                                           (scale_name, spec.scale_dtypes, scale_shape)):
            want = {_SAFETENSORS_DTYPES[d] for d in dtypes}
            found = self.ckpt.dtype(tensor_name)
            if found not in want:
                raise QuantTensorDTypeError(
                    f"{tensor_name!r} (layer {self.layer_idx}) is stored as {found}, but the checkpoint's "
                    f"quantization_config says {fmt.value} ({rule}), which stores it as {' or '.join(sorted(want))}; "
                    f"use the checkpoint as published, with its config.json", name=tensor_name, found=found)
            if self.ckpt.shape(tensor_name) != (*lead, *shape):
                raise QuantTensorShapeError(
                    f"{tensor_name!r} (layer {self.layer_idx}, {fmt.value}) has shape "
                    f"{list(self.ckpt.shape(tensor_name))}, expected {[*lead, *shape]} for this config and format; "
                    f"use the config.json that came with the checkpoint", name=tensor_name)
        check_recorded_shape(self.ckpt, spec, self.layer_idx, module, out_f, in_f)
        if self.headers_only:
            return self._empty(expected, rows, self.dtype or torch.bfloat16)
        read = (lambda n: self.ckpt.read(n)) if rows is None else (lambda n: self.ckpt.read_rows(n, *rows))
        qweight, scale = read(weight_name), read(scale_name)
        dtype = self.dtype or _TORCH_DTYPES.get(self.ckpt.dtype(self.names.router), torch.bfloat16)
        out = dequantize_weight(qweight, scale, fmt, dtype).to(self.device)
        self.report.add(LoadedTensor(weight_name, f"{self.ckpt.dtype(weight_name)} {fmt.value}",
                                     qweight.numel() * qweight.element_size() + scale.numel() * scale.element_size(),
                                     str(out.dtype).removeprefix("torch."), out.numel() * out.element_size(), rule))
        return out

    def _check(self, name: str, expected: tuple[int, ...], rule: str | None = None) -> None:
        if name not in self.ckpt:
            self._raise_missing(name)
        found_dtype = self.ckpt.dtype(name)
        if found_dtype not in _PLAIN_DTYPES and self.quant is not None:
            raise QuantizationMismatchError(
                f"tensor {name!r} (layer {self.layer_idx}) is stored as {found_dtype} (quantized), but the "
                f"checkpoint's quantization_config ({self.quant.format.value}) leaves it unquantized: "
                f"{rule or _NEVER_QUANTIZED}. Use the checkpoint as published, with its config.json",
                name=name, dtype=found_dtype)
        if found_dtype not in _PLAIN_DTYPES:
            raise UnsupportedCheckpointError(
                f"tensor {name!r} has dtype {found_dtype} (quantized). {self._quant_siblings(name)}"
                f"{_NO_QUANT_CONFIG}", name=name, dtype=found_dtype)
        found = self.ckpt.shape(name)
        if found != tuple(expected):
            raise TensorShapeMismatchError(
                f"tensor {name!r} (layer {self.layer_idx}) has shape {list(found)}, but the config expects "
                f"{list(expected)} ({self._shape_legend()}). {shape_hint(found, tuple(expected))}Use the "
                f"config.json that came with the checkpoint: MoEConfig.from_hf_config('<checkpoint dir>')",
                name=name, expected=tuple(expected), found=found)

    def _shape_legend(self) -> str:
        c = self.cfg
        parts = [f"E={c.num_experts}", f"D={c.hidden_size}", f"F={c.intermediate_size}"]
        if c.has_shared_experts:
            parts.append(f"S={c.shared_intermediate_size}")
        if c.latent_dim:
            parts.append(f"L={c.latent_dim}")
        return f"{c.name}: " + ", ".join(parts)

    def _quant_siblings(self, name: str) -> str:
        stem = name[:-len(".weight")] if name.endswith(".weight") else name
        found = [n for n in self.ckpt.names() if n.startswith(stem) and n != name
                 and any(n.endswith(s) for s in _QUANT_SUFFIXES)]
        return f"It has quantization tensors beside it ({', '.join(sorted(found)[:3])}). " if found else ""

    def _raise_missing(self, name: str) -> None:
        stem = name[:-len(".weight")] if name.endswith(".weight") else name
        packed = [n for n in (f"{stem}.weight_packed", f"{name}_packed") if n in self.ckpt]
        if packed:
            raise UnsupportedCheckpointError(
                f"tensor {name!r} is stored packed/quantized as {packed[0]!r} (e.g. Kimi-K3's MXFP4 "
                f"compressed-tensors experts). {_NO_QUANT_CONFIG}", name=name, found=packed[0])
        raise MissingTensorError(
            f"tensor {name!r} (layer {self.layer_idx}, family {self.cfg.family}, layout {self.names.layout}) "
            f"is not in the checkpoint (searched {len(self.ckpt.files)} file(s): {self.ckpt.describe_files()}). "
            f"{missing_hint(self.ckpt, self.cfg, self.layer_idx, name)}",
            name=name, layer=self.layer_idx, files=[str(f) for f in self.ckpt.files])

    # --- groups of tensors ---
    def experts(self, first: int, count: int, progress: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``gate_up [count, 2F, Dx]``, ``down [count, Dx, F]`` of experts ``[first, first + count)`` in the canonical
        layout (gate rows, then up rows; nn.Linear's ``[out, in]``), and their biases ``[count, 2F]``,
        ``[count, Dx]`` (None unless ``cfg.expert_bias``)."""
        from tqdm import tqdm

        n, E, F, Dx = self.names, self.cfg.num_experts, self.cfg.intermediate_size, self.cfg.expert_hidden_size
        rows = (first, count)
        biases = self._expert_biases(rows) if self.cfg.expert_bias else (None, None)
        with tqdm(total=count, desc=f"layer {self.layer_idx} experts", unit="expert", file=sys.stderr,
                  disable=not progress, leave=False) as bar:
            if n.expert_form == "stacked_gate_up" and n.transposed:  # gpt-oss: [E, Dx, 2F] and [E, F, Dx] for x @ W
                gate_up = self.tensor(n.gate_up, (E, Dx, 2 * F), rows=rows).transpose(1, 2)
                down = self.tensor(n.down, (E, F, Dx), rows=rows).transpose(1, 2).contiguous()
                bar.update(count)
                return self._gate_rows_first(gate_up, dim=1).contiguous(), down, *biases
            if n.expert_form == "stacked_gate_up":
                gate_up, down = self.linear(n.gate_up, (E, 2 * F, Dx), rows=rows), self.linear(n.down, (E, Dx, F), rows=rows)
                bar.update(count)
                return self._gate_rows_first(gate_up, dim=1), down, *biases
            if n.expert_form == "stacked":
                gate, up = self.linear(n.gate, (E, F, Dx), rows=rows), self.linear(n.up, (E, F, Dx), rows=rows)
                down = self.linear(n.down, (E, Dx, F), rows=rows)
                bar.update(count)
                return torch.cat([gate, up], dim=1), down, *biases
            gate_up, down = [], []
            for e in range(first, first + count):
                gate_up.append(torch.cat([self.linear(n.gate.format(expert=e), (F, Dx)),
                                          self.linear(n.up.format(expert=e), (F, Dx))]))
                down.append(self.linear(n.down.format(expert=e), (Dx, F)))
                bar.update(1)
            return torch.stack(gate_up), torch.stack(down), *biases

    def _gate_rows_first(self, gate_up: torch.Tensor, dim: int) -> torch.Tensor:
        """``gate_up`` with its ``2F`` dim as gate rows then up rows: de-interleaved where the layout alternates
        them (gpt-oss: gate j at 2j, up j at 2j + 1), else as is."""
        if not self.names.interleaved:
            return gate_up
        width = gate_up.shape[dim]
        order = torch.cat([torch.arange(0, width, 2), torch.arange(1, width, 2)]).to(gate_up.device)
        return gate_up.index_select(dim, order)

    def _expert_biases(self, rows: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``gate_up_bias [count, 2F]`` (gate, then up) and ``down_bias [count, Dx]`` of the experts in ``rows``."""
        n, E, F, Dx = self.names, self.cfg.num_experts, self.cfg.intermediate_size, self.cfg.expert_hidden_size
        if n.gate_up_bias is None or n.down_bias is None:
            raise UnsupportedCheckpointError(
                f"{self.cfg.name} ({self.cfg.family}) has expert biases, but its layout {n.layout!r} names none",
                layout=n.layout, family=self.cfg.family)
        gate_up_bias = self._gate_rows_first(self.tensor(n.gate_up_bias, (E, 2 * F), rows=rows), dim=1)
        return gate_up_bias.contiguous(), self.tensor(n.down_bias, (E, Dx), rows=rows)

    def shared(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``shared_gate_up [2S, D]`` (gate rows, then up rows) and ``shared_down [D, S]``."""
        S, D = self.cfg.shared_intermediate_size, self.cfg.hidden_size
        gate, up = self.linear(self.names.shared_gate, (S, D)), self.linear(self.names.shared_up, (S, D))
        return torch.cat([gate, up], dim=0), self.linear(self.names.shared_down, (D, S))
