"""A ``MegaMoE``'s parameters: registered at construction, filled by a load, saved and loaded by ``state_dict``.

    construction        register_parameters: the router, shared experts and latent projections uninitialised
                        (``torch.empty``, listed in ``layer._unwritten``); the routed experts not at all (None)
    load_weights        every tensor checked, then copied (plain experts allocated here)       -> nothing unwritten
    load_hf_weights     this rank's experts from a checkpoint: plain as above, or a quantized checkpoint's kept as
                        stored in ``layer.quantized_experts`` (``held``: rewritten once for the kernel that runs them)
    load_state_dict     plain experts allocated when the state dict has them, quantized ones taken as stored; each
                        tensor it holds is written, the others stay unwritten
    a call              ``missing_weights(layer)``: names of what was never written; not empty -> INP006 on every rank

So a partial ``load_state_dict(..., strict=False)`` leaves the layer refusing calls instead of computing on
uninitialised memory, and nothing is allocated for the routed experts until a load brings them.

The dtype and device are fixed at construction: ``check_conversion`` refuses ``.to()``, ``.half()``, ``.cuda()``...
that would change them (CFG016).

These are functions over the layer, not an object it holds (that would be a reference cycle: the layer must be freed
as soon as it is dropped, with its buffers).

Shape legend: E experts, e local experts, D hidden width, Dx expert input width, F expert intermediate,
S shared-MLP intermediate, L latent width.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Callable

import torch
from torch import nn

from moe_ref.checkpoint.formats import QUANTIZED_TENSOR_FIELDS, QuantFormat, QuantizedExpertWeights, QuantSpec
from moe_ref.core import envs
from moe_ref.core.errors import BackendUnavailableError, LayerConversionError, TensorShapeMismatchError
from moe_ref.core.weights import MoEWeights
from moe_ref.experts.quantized import QUANT_BACKENDS, QuantTorchExperts, W4A16Experts, quantized_experts_class

logger = logging.getLogger(__name__)

EXPERT_NAMES = ("gate_up_weight", "down_weight")
BIAS_NAMES = ("gate_up_bias", "down_bias")  # the experts' biases (gpt-oss), held with the plain experts
_EXPERT_FIELDS = ("gate_up_weight_E2FD", "down_weight_EDF", "gate_up_bias_E2F", "down_bias_ED")
# state_dict keys of quantized experts kept as stored: "quantized_experts.<field>" (+ ".spec", the format as JSON bytes)
QUANT_PREFIX = "quantized_experts."


# --- registration ----------------------------------------------------------------------------------------------
def register_parameters(layer: nn.Module) -> None:
    """The layer's parameters and buffers, uninitialised; the routed experts None until loaded."""
    cfg, device = layer.cfg, layer.options.device
    D, S, L = cfg.hidden_size, cfg.shared_intermediate_size, cfg.latent_dim
    shared, new = cfg.has_shared_experts, lambda *shape: _new_parameter(layer, *shape)
    with torch.inference_mode(False):  # normal tensors even when built inside inference mode
        layer.gate_weight = new(cfg.num_experts, D)
        bias = torch.zeros(cfg.num_experts, dtype=torch.float32, device=device) if cfg.use_selection_bias else None
        layer.register_buffer("e_score_correction_bias", bias)
        for name in EXPERT_NAMES + BIAS_NAMES:
            layer.register_parameter(name, None)
        layer.router_bias = new(cfg.num_experts) if cfg.router_bias else None
        layer.shared_gate_weight = new(D) if cfg.shared_expert_gate else None
        layer.shared_gate_up_weight = new(2 * S, D) if shared else None
        layer.shared_down_weight = new(D, S) if shared else None
        layer.latent_down_weight = new(L, D) if L else None
        layer.latent_up_weight = new(D, L) if L else None
        layer.latent_norm_weight = new(L) if L and cfg.latent_norm else None
    layer.quantized_experts = None
    # names of the state_dict tensors never written (the selection bias too: zeros are not the checkpoint's values)
    layer._unwritten = {name for name, _ in layer.named_parameters()}
    if bias is not None:
        layer._unwritten.add("e_score_correction_bias")


def _new_parameter(layer: nn.Module, *shape: int) -> nn.Parameter:
    """An uninitialised parameter in the layer's dtype, on its device."""
    empty = torch.empty(*shape, dtype=layer.options.dtype, device=layer.options.device)
    return nn.Parameter(empty, requires_grad=False)


def expert_shapes(layer: nn.Module) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """``([e, 2F, Dx], [e, Dx, F])``: this rank's plain expert weights."""
    e, F, Dx = layer.num_local_experts, layer.cfg.intermediate_size, layer.cfg.expert_hidden_size
    return (e, 2 * F, Dx), (e, Dx, F)


def expert_parameters(layer: nn.Module) -> tuple[nn.Parameter, nn.Parameter]:
    """``gate_up_weight [e, 2F, Dx]`` and ``down_weight [e, Dx, F]``, allocated (uninitialised, so listed as
    unwritten) when the layer holds none: by a plain load, or to build DeepGEMM's mega engine."""
    if layer.gate_up_weight is None:
        gate_up_shape, down_shape = expert_shapes(layer)
        with torch.inference_mode(False):
            layer.gate_up_weight = _new_parameter(layer, *gate_up_shape)
            layer.down_weight = _new_parameter(layer, *down_shape)
            if layer.cfg.expert_bias:
                layer.gate_up_bias = _new_parameter(layer, *gate_up_shape[:2])
                layer.down_bias = _new_parameter(layer, *down_shape[:2])
        layer._unwritten.update(name for name in EXPERT_NAMES + BIAS_NAMES if getattr(layer, name) is not None)
    return layer.gate_up_weight, layer.down_weight


def _drop_plain_experts(layer: nn.Module) -> None:
    layer.gate_up_weight = layer.down_weight = layer.gate_up_bias = layer.down_bias = None
    layer._unwritten.difference_update(EXPERT_NAMES + BIAS_NAMES)


def missing_weights(layer: nn.Module) -> list[str]:
    """What a call would read that no load has written: tensor names, plus ``"routed experts"`` when the layer holds
    none (neither plain nor quantized). Empty: the layer is loaded."""
    missing = sorted(layer._unwritten)
    if layer.gate_up_weight is None and layer.quantized_experts is None:
        missing.append("routed experts")
    return missing


def as_moe_weights(layer: nn.Module) -> MoEWeights:
    """This rank's parameters as ``MoEWeights`` (views, no copy); the expert tensors None unless held plain."""
    return MoEWeights(
        gate_weight_ED=layer.gate_weight, gate_up_weight_E2FD=layer.gate_up_weight,
        down_weight_EDF=layer.down_weight, bias_E=layer.e_score_correction_bias,
        shared_gate_up_weight_2SD=layer.shared_gate_up_weight, shared_down_weight_DS=layer.shared_down_weight,
        latent_down_weight_LD=layer.latent_down_weight, latent_up_weight_DL=layer.latent_up_weight,
        latent_norm_weight_L=layer.latent_norm_weight, first_expert=layer.first_local_expert,
        router_bias_E=layer.router_bias, gate_up_bias_E2F=layer.gate_up_bias, down_bias_ED=layer.down_bias,
        shared_gate_weight_D=layer.shared_gate_weight)


def local_expert_tensors(layer: nn.Module) -> list[torch.Tensor]:
    """Every tensor of this rank's routed experts, ``[e, ...]`` each, as held (plain weights and biases, or a
    quantized block's fields); empty before loading. What EPLB's mover moves."""
    if layer.quantized_experts is not None:
        return [getattr(layer.quantized_experts, f) for f in QUANTIZED_TENSOR_FIELDS]
    plain = (layer.gate_up_weight, layer.down_weight, layer.gate_up_bias, layer.down_bias)
    return [t.data for t in plain if t is not None]


def expert_nbytes(layer: nn.Module) -> int:
    """Bytes of this rank's routed experts on the device (plain, or quantized as stored); 0 before loading."""
    if layer.quantized_experts is not None:
        return layer.quantized_experts.nbytes()
    plain = (layer.gate_up_weight, layer.down_weight)
    return sum(t.numel() * t.element_size() for t in plain if t is not None)


def experts_precision(layer: nn.Module, fp8: bool) -> str:
    """How the experts are held, for the repr: ``" (int4_group as stored)"``, ``" (fp8)"`` or ``""``."""
    if layer.quantized_experts is not None:
        return f" ({layer.quantized_experts.spec.format.value} as stored)"
    return " (fp8)" if fp8 else ""


# --- loading ---------------------------------------------------------------------------------------------------
def load_weights(layer: nn.Module, weights: MoEWeights) -> None:
    """Check every shape (LOAD002), then copy ``weights`` (all experts, or a block holding this rank's)."""
    source = (weights.expert_slice(layer.first_local_expert, layer.num_local_experts) if layer.expert_slots is None
              else layer.expert_slots.local_weights(weights))  # EPLB: each slot's logical expert (LOAD020)
    gate_up_shape, down_shape = expert_shapes(layer)
    biases = [("gate_up_bias_E2F", gate_up_shape[:2], source.gate_up_bias_E2F),
              ("down_bias_ED", down_shape[:2], source.down_bias_ED)] if layer.cfg.expert_bias else []
    _check_shapes([("gate_up_weight_E2FD", gate_up_shape, source.gate_up_weight_E2FD),
                   ("down_weight_EDF", down_shape, source.down_weight_EDF)] + biases + _dense_targets(layer, source))
    layer.quantized_experts = None
    gate_up, down = layer._expert_parameters()
    held_biases = [(layer.gate_up_bias, source.gate_up_bias_E2F), (layer.down_bias, source.down_bias_ED)]
    _copy([(gate_up, source.gate_up_weight_E2FD), (down, source.down_weight_EDF)]
          + (held_biases if layer.cfg.expert_bias else []) + [(dst, src) for _, dst, src in _dense_pairs(layer, source)])
    layer._unwritten.clear()


def load_hf_weights(layer: nn.Module, path: str | os.PathLike, layer_idx: int, prefix: str | None,
                    progress: bool | None):
    """``MegaMoE.load_hf_weights`` (see there); returns the ``LoadReport`` (also logged)."""
    report = _load_hf_weights(layer, path, layer_idx, prefix, progress)
    logger.info("moe_ref: load_hf_weights: %s", report.summary())
    return report


def _load_hf_weights(layer: nn.Module, path: str | os.PathLike, layer_idx: int, prefix: str | None,
                     progress: bool | None):
    from moe_ref.checkpoint.loading import LoadedTensor, LoadReport, load_moe_weights
    from moe_ref.checkpoint.quantized import checkpoint_quant_spec, load_quantized_experts, routed_experts_quantized

    spec = checkpoint_quant_spec(path)
    progress = layer.rank == 0 and envs.show_progress() if progress is None else progress
    slots = layer.expert_slots  # EPLB: the block of logical experts holding the slots' experts, selected after
    expert_range = (layer.first_local_expert, layer.num_local_experts) if slots is None else slots.local_span()
    report = LoadReport()
    dense_args = dict(prefix=prefix, dtype=layer.options.dtype, device=layer.options.device, progress=progress,
                      quant=spec, report=report)
    routed_quantized, rule = False, None
    if spec is not None:
        routed_quantized, rule = routed_experts_quantized(path, spec, layer.cfg, layer_idx, prefix=prefix,
                                                          expert=expert_range[0])
    if not routed_quantized:  # plain checkpoint, or a config that leaves the routed experts unquantized
        load_weights(layer, load_moe_weights(path, layer.cfg, layer_idx, expert_range=expert_range, **dense_args))
        return report
    quantized_backend(layer, spec)  # refuse before reading anything
    dense = load_moe_weights(path, layer.cfg, layer_idx, experts=False, **dense_args)
    quantized = load_quantized_experts(path, layer.cfg, layer_idx, expert_range, layer.options.device, spec=spec,
                                       prefix=prefix, progress=progress)
    if slots is not None:
        quantized = slots.local_quantized(quantized)
    report.add(LoadedTensor(f"layer {layer_idx} routed experts {expert_range[0]}..{sum(expert_range) - 1}",
                            spec.format.value, quantized.nbytes(), "as stored", quantized.nbytes(), rule))
    _check_shapes(_dense_targets(layer, dense))
    if layer.uses_mega:  # mega='auto' here ('deep_gemm' was refused): every rank reads the same config.json
        logger.warning("moe_ref: mega='auto' uses moe_ref's own EP path: the checkpoint's routed experts are "
                       "%s and DeepGEMM's mega-MoE takes plain weights", spec.format.value)
        layer.uses_mega = False
        layer.destroy()
    _copy([(dst, src) for _, dst, src in _dense_pairs(layer, dense)])
    _drop_plain_experts(layer)  # a plain block loaded before is freed
    layer.quantized_experts = held(layer, quantized)
    layer._unwritten.clear()
    return report


def held(layer: nn.Module, quantized: QuantizedExpertWeights) -> QuantizedExpertWeights:
    """A just-loaded ``QuantizedExpertWeights`` as the layer keeps it, rewritten in place now, at load, before any
    caller can hold the checkpoint-order object (one copy of the weights; ``state_dict()`` puts the checkpoint's
    order back): 4-bit words that the W4A16 kernel will read in its order, FP8 gate/up rows that the FP8
    kernels will read interleaved in 128-row blocks (the torch loop reads either, so its experts stay as stored)."""
    runs_on = quantized_experts_class(quantized.spec.format, quantized_backend(layer, quantized.spec),
                                      layer.options.device)
    if runs_on is W4A16Experts:
        return quantized.with_group_planes()
    if runs_on is not QuantTorchExperts:
        return quantized.with_interleaved_gate_up()
    return quantized


def quantized_backend(layer: nn.Module, spec: QuantSpec) -> str:
    """The ``moe_ref.experts.quantized`` backend that runs ``spec``'s experts for this layer's options (ENV001 when
    none does)."""
    fmt = spec.format.value
    if layer.uses_mega and layer.options.mega == "deep_gemm":
        raise BackendUnavailableError(
            f"mega='deep_gemm' quantizes plain (bf16) expert weights itself; this checkpoint stores its routed "
            f"experts as {fmt}. Use mega='auto' or 'off' to run them as stored on moe_ref's own path")
    backend = layer.options.experts_backend
    if backend not in QUANT_BACKENDS:
        raise BackendUnavailableError(
            f"experts_backend={backend!r} has no kernel for {fmt} experts kept as stored; use "
            f"experts_backend='auto' (moe_ref's kernels on CUDA, torch elsewhere), 'triton' or 'torch'",
            field="experts_backend")
    return backend


def _dense_pairs(layer: nn.Module, source: MoEWeights) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """``(field, this layer's tensor, source tensor)`` for every non-expert tensor the config has."""
    target = as_moe_weights(layer)
    return [(field.name, getattr(target, field.name), getattr(source, field.name))
            for field in dataclasses.fields(MoEWeights)
            if field.name not in _EXPERT_FIELDS and isinstance(getattr(target, field.name), torch.Tensor)]


def _dense_targets(layer: nn.Module, source: MoEWeights) -> list[tuple[str, tuple[int, ...], torch.Tensor | None]]:
    return [(name, tuple(dst.shape), src) for name, dst, src in _dense_pairs(layer, source)]


def _check_shapes(expected: list[tuple[str, tuple[int, ...], torch.Tensor | None]]) -> None:
    """``TensorShapeMismatchError`` (LOAD002) unless each ``(name, shape, tensor)`` has that shape."""
    for name, shape, tensor in expected:
        if tensor is None or tuple(tensor.shape) != tuple(shape):
            raise TensorShapeMismatchError(f"{name}: expected shape {tuple(shape)} for this config, got "
                                           f"{None if tensor is None else tuple(tensor.shape)}")


def _copy(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for each pair (casting and moving), outside inference mode and autograd."""
    with torch.inference_mode(False), torch.no_grad():
        for dst, src in pairs:
            dst.copy_(src)


# --- state_dict ------------------------------------------------------------------------------------------------
def save_quantized_experts(layer: nn.Module, destination: dict, prefix: str) -> None:
    """Add the quantized experts kept as stored (``quantized_experts.<field>`` tensors and ``quantized_experts.spec``,
    the format as uint8 JSON bytes), in the checkpoint's order (4-bit words and FP8 gate/up rows held in a kernel's
    order are put back: a copy, made here)."""
    q = None if layer.quantized_experts is None else layer.quantized_experts.as_stored()
    if q is not None:
        for field in QUANTIZED_TENSOR_FIELDS:
            destination[prefix + QUANT_PREFIX + field] = getattr(q, field)
        spec = json.dumps({**dataclasses.asdict(q.spec), "format": q.spec.format.value})  # every field
        destination[prefix + QUANT_PREFIX + "spec"] = torch.tensor(list(spec.encode()), dtype=torch.uint8)


def load_state_dict_into(layer: nn.Module, load_module_tensors: Callable[[], None], state_dict: dict, prefix: str,
                         missing_keys: list, unexpected_keys: list, error_msgs: list) -> bool:
    """``nn.Module._load_from_state_dict`` for the layer: ``load_module_tensors`` (nn.Module's own) copies the
    parameters and buffers the state dict holds; around it, plain experts are allocated when the state dict has
    either of them, and quantized ones taken as stored. Each tensor copied without error is no longer unwritten. Returns
    whether the experts changed or the layer became loaded (the experts backend, built over a stand-in or over
    copies of the old weights, and a built step must then take the new ones)."""
    plain = any(prefix + name in state_dict for name in EXPERT_NAMES)
    quant = prefix + QUANT_PREFIX + "spec" in state_dict
    was_missing = bool(missing_weights(layer))
    if plain:
        layer._expert_parameters()  # allocated here when the layer held no plain experts
    elif quant:
        _drop_plain_experts(layer)  # the plain ones are replaced by the quantized ones
    errors_before = len(error_msgs)
    load_module_tensors()
    quant_keys = [k for k in state_dict if k.startswith(prefix + QUANT_PREFIX)]
    unexpected_keys[:] = [k for k in unexpected_keys if k not in quant_keys]
    if len(error_msgs) == errors_before:
        layer._unwritten.difference_update({name for name in layer._unwritten if prefix + name in state_dict})
    if quant:
        missing = [prefix + QUANT_PREFIX + f for f in QUANTIZED_TENSOR_FIELDS
                   if prefix + QUANT_PREFIX + f not in state_dict]
        missing_keys.extend(missing)
        if not missing:
            layer.quantized_experts = held(layer, _quantized_from_state_dict(layer, state_dict, prefix))
    elif plain:
        layer.quantized_experts = None
    return plain or quant or (was_missing and not missing_weights(layer))


def _quantized_from_state_dict(layer: nn.Module, state_dict: dict, prefix: str) -> QuantizedExpertWeights:
    info = json.loads(bytes(state_dict[prefix + QUANT_PREFIX + "spec"].tolist()).decode())
    spec = QuantSpec(**{**{k: tuple(v) if isinstance(v, list) else v for k, v in info.items()},
                        "format": QuantFormat(info["format"])})
    quantized_backend(layer, spec)  # a coded refusal (ENV001) where this layer's options cannot run them
    device = layer.options.device
    tensors = {f: state_dict[prefix + QUANT_PREFIX + f].detach().to(device, copy=True) for f in QUANTIZED_TENSOR_FIELDS}
    return QuantizedExpertWeights(spec=spec, **tensors, hidden_size=layer.cfg.expert_hidden_size,
                                  intermediate_size=layer.cfg.intermediate_size, first_expert=layer.first_local_expert)


# --- the fixed dtype and device ------------------------------------------------------------------------------------
def check_conversion(layer: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """``LayerConversionError`` (CFG016) unless ``fn`` (what ``nn.Module._apply`` applies: ``.to()``, ``.half()``,
    ``.cuda()``...) keeps the layer's dtype and device, raised before anything is converted (the plan, buffers,
    experts and checks are built for one dtype and device)."""
    reference = torch.empty(0, dtype=layer.options.dtype, device=layer.options.device)
    dtype, device = reference.dtype, reference.device  # "cuda" as "cuda:0", as fn's output says it
    try:
        probe = fn(reference)
    except (AssertionError, RuntimeError) as err:  # .cuda() on a torch without CUDA, a device absent here
        raise LayerConversionError(
            f"MegaMoE was built for dtype={dtype} on {device}, and the conversion asked for fails here "
            f"({type(err).__name__}: {err}); a layer's dtype and device are fixed at construction. Build a layer of "
            f"the dtype and device wanted (device='cuda' needs a CUDA build of torch and a GPU) and load this one's "
            f"weights into it: new = MegaMoE(cfg, group, dtype=..., device=..., ...); "
            f"new.load_state_dict(layer.state_dict())") from err
    if probe.dtype == dtype and probe.device == device:
        return
    if probe.device.type == "meta":
        raise LayerConversionError(
            f"MegaMoE was built for dtype={dtype} on {device} and does not run on the meta device (its plan, buffers "
            f"and experts are real memory). An unloaded layer holds no routed experts (they are allocated by the "
            f"load), so build it on 'cpu' or 'cuda' where a meta model would be built: MegaMoE(cfg, group, "
            f"dtype={probe.dtype}, device='cpu')", dtype=str(probe.dtype), device=str(probe.device))
    raise LayerConversionError(
        f"MegaMoE was built for dtype={dtype} on {device}; converting it to dtype={probe.dtype} on "
        f"{probe.device} would cast its parameters only (its plan, buffers, experts and input checks stay "
        f"{dtype} on {device}). Build a layer of that dtype and load this one's weights into it: "
        f"new = MegaMoE(cfg, group, dtype={probe.dtype}, device='{probe.device}', ...); "
        f"new.load_state_dict(layer.state_dict())", dtype=str(probe.dtype), device=str(probe.device))
