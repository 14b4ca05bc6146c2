"""``MegaMoE``: the drop-in expert-parallel MoE block (torch.nn.Module).

    MegaMoE(cfg, group, **options)
      EPOptions.resolve: every option once (argument, environment, default), checked
      one collective: config + options + the mega decision agreed by every rank (else CFG008/CAP002/ENV002 on all)
      the routed step, built once: ModularRoutedStep (transport x experts) or MonolithicRoutedStep (DeepGEMM mega)

    forward(x [T, D]):
      1. check x (shape, dtype, device), weights loaded, no gradient requested  -> a problem, not raised yet
      2. route: gate GEMM in fp32, family top-k (block.route_unchecked)           -> topk_ids [T, K], topk_weights [T, K]
         (NaN/inf logits are a problem too: a device-side check, read in step 4's collective)
      3. (Kimi-K3) latent down-projection (block.expert_input)                    -> z [T, Dx]
      4. the routed step (moe_ref.ep.routed_step): ONE small collective agrees on every rank's problem, device-side
         checks and row count (a coded error on every rank, or n chunks), then per chunk
         dispatch -> experts -> combine -> reduce
                                                                                   -> routed [T, Dx]
      5. (Kimi-K3) RMSNorm over the full cross-rank sum, latent up; + shared experts (block.finish) -> y [T, D]
    One rank on CUDA: steps 2-5 of a token count's later calls replay one CUDA graph (moe_ref.eager_graphs).

Parameters (this rank's experts only; e = E / ep_size): ``gate_weight [E, D]``,
``e_score_correction_bias [E]`` (fp32 buffer, sigmoid families), ``gate_up_weight [e, 2F, Dx]``,
``down_weight [e, Dx, F]``, shared ``shared_gate_up_weight [2S, D]``, ``shared_down_weight [D, S]``,
Kimi-K3 ``latent_down_weight [L, D]``, ``latent_up_weight [D, L]``, ``latent_norm_weight [L]``.

The routed experts are allocated when they are loaded, in the form they are loaded in: plain weights become
``gate_up_weight``/``down_weight`` in the layer's dtype; a quantized checkpoint (FP8 blocks, INT4, MXFP4; see
``load_hf_weights``) is kept as stored in ``quantized_experts`` and the two parameters stay None. So the device
holds the checkpoint's bytes of the local experts and never a bf16 copy of them (``expert_nbytes()``). The W4A16
kernel reads INT4/MXFP4 words in its own nibble order: at load the layer rewrites its copy in place
(``QuantizedExpertWeights.with_group_planes``; the kernel adds a block-major copy of the scales, 1/16 of INT4's
bytes); the FP8 kernels read gate/up rows interleaved in 128-row blocks, which the layer also rewrites in place
(``QuantizedExpertWeights.with_interleaved_gate_up``); ``state_dict()`` puts both back in the checkpoint's order.

nn.Module conventions: ``state_dict()``/``load_state_dict()`` round trip into a fresh (unseeded) layer, strict:
plain experts are allocated by the load, quantized ones travel as ``quantized_experts.<field>`` tensors (+ their
format) and are kept as stored. The dtype and device are fixed at construction (plan, buffers, experts, checks):
``.to(dtype)``, ``.half()``, ``.float()``, ``.cuda()``... that would change them raise ``LayerConversionError``
(CFG016); build a layer with the dtype/device wanted and ``load_state_dict`` this one's weights into it.

Inference mode and autograd: the step's buffers are built outside inference mode, so calls in and out of
``torch.inference_mode()`` mix in any order. The layer has no backward: with grad mode on and an input or
parameter requiring grad, every rank raises ``GradientNotSupportedError`` (INP007).
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import traceback
import weakref
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from moe_ref import custom_ops
from moe_ref.block import expert_input, finish, route_unchecked
from moe_ref.core.config import MoEConfig, ParallelConfig, preset
from moe_ref.eager_graphs import EagerGraphs
from moe_ref.ep.device_checks import DeviceChecks
from moe_ref.ep.distributed import check_fields_agree, gather_objects, group_size_and_rank
from moe_ref.core.errors import (ArgumentTypeError, BackendUnavailableError, DeviceError, DTypeError,
                                 GradientNotSupportedError, InputError, InvalidConfigError, LayerConversionError,
                                 ShapeError, ShapeUnsupportedError, TensorShapeMismatchError, WeightsNotLoadedError)
from moe_ref.experts import Experts, experts_class, make_experts
from moe_ref.experts.quantized import (QUANT_BACKENDS, QuantTorchExperts, W4A16Experts, make_quantized_experts,
                                      quantized_experts_class)
from moe_ref.ep.options import EPOptions
from moe_ref.checkpoint.formats import QUANTIZED_TENSOR_FIELDS, QuantFormat, QuantizedExpertWeights, QuantSpec
from moe_ref.ep.routed_step import RoutedStep, make_modular_step
from moe_ref.core.weights import MoEWeights

logger = logging.getLogger(__name__)
_EXPERT_FIELDS = ("gate_up_weight_E2FD", "down_weight_EDF")
# state_dict keys of quantized experts kept as stored: "quantized_experts.<field>" (+ ".spec", the format as JSON bytes)
_QUANT_PREFIX = "quantized_experts."


def as_config(cfg: MoEConfig | str | os.PathLike | Mapping[str, Any]) -> MoEConfig:
    """A ``MoEConfig`` from itself, a preset name, a config.json path (or its folder), or an HF config dict."""
    if isinstance(cfg, MoEConfig):
        return cfg
    if not isinstance(cfg, (str, os.PathLike, Mapping)):
        raise InvalidConfigError(f"cfg={cfg!r} ({type(cfg).__name__}); pass a MoEConfig, a preset name "
                                 f"(e.g. 'tiny-kimi-k2'), a config.json path or folder, or an HF config dict",
                                 field="cfg")
    if isinstance(cfg, str) and not os.path.exists(cfg) and not cfg.endswith(".json"):
        return preset(cfg)
    return MoEConfig.from_hf_config(cfg)


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


_LIVE_LAYERS: "weakref.WeakSet[MegaMoE]" = weakref.WeakSet()


@atexit.register
def release_all_at_exit() -> None:
    """Before the interpreter tears down: every live layer releases its buffers and its references to the
    process group (``MegaMoE._release_group``), so ``dist.destroy_process_group()`` followed by exit (or
    torchrun's teardown) never destroys the group's C++ object from a module global's finalizer at exit.

    NOTE: registered at import, after torch.distributed's own hooks, so it runs before them (atexit is LIFO).
    A script must still call ``dist.destroy_process_group()`` before it ends: without it gloo can abort at exit
    with no MegaMoE at all (torch's own behaviour, seen in about one run in three on 2 CPU ranks)."""
    for layer in list(_LIVE_LAYERS):
        try:
            layer._release_group()
        except Exception:  # noqa: BLE001 - exit goes on; one layer's failure must not keep the others' groups
            logger.debug("moe_ref: releasing a layer at exit failed", exc_info=True)


def _bound_type_ok(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool))


def _max_num_tokens_problem(value: Any) -> ArgumentTypeError | None:
    """``ArgumentTypeError`` (INP008) unless ``max_num_tokens`` is None or an int (not a bool)."""
    if _bound_type_ok(value):
        return None
    return ArgumentTypeError(f"max_num_tokens={value!r} ({type(value).__name__}); pass an int bound on "
                             f"the rows of every rank, or None, on every rank alike", field="max_num_tokens")


class MegaMoE(nn.Module):
    """The expert-parallel MoE block of Kimi-K2/K3, DeepSeek-V3 and Step3-style models.

    Construction is collective over ``group``: every rank must build the layer with the same config and
    options (checked in one collective; a difference raises ``GroupDisagreementError`` (CFG008), or
    ``CapacityMismatchError`` (CAP002) for the cap, on every rank, naming each rank's value).

    Args:
        cfg: ``MoEConfig``, a preset name (``"kimi-k2"``, ``"tiny-step3"``...), an HF config.json path or dict.
        group: the EP process group (``dist.group.WORLD``...), or None for one process.
        num_max_tokens_per_rank: the cap: rows ONE rank feeds per call (default:
            ``MOE_REF_NUM_MAX_TOKENS_PER_RANK``, else 4096).
        overflow: ``"error"`` or ``"chunk"`` when a rank's batch exceeds the cap (default:
            ``MOE_REF_OVERFLOW_POLICY``, else ``"error"``).
        transport: ``"auto"``, ``"symm"``, ``"a2a"`` or ``"local"`` (default: ``MOE_REF_TRANSPORT``, else auto).
        experts_backend: ``"auto"``, ``"torch"``, ``"grouped_mm"``, ``"triton"``, ``"deep_gemm"`` (default:
            ``MOE_REF_EXPERTS_BACKEND``, else auto: torch on CPU; on CUDA, per call the backend a measured table
            ranks fastest for the call's regime among those installed, Triton where the table has no entry for this
            GPU class or DeepGEMM is absent; ``moe_ref.experts.auto``, ``moe-ref info`` prints the table).
        dispatch_fp8: FP8 end to end where the backend allows: tokens move as FP8 e4m3 with per-128 scales
            (halves dispatch bytes; lossy), and a backend with fp8 weights (``supports_fp8``: triton,
            deep_gemm) runs them, quantized once to 128x128 blocks, and takes the FP8 pool as is. The
            torch and grouped_mm backends run the dequantized pool with the layer's weights.
        dtype, device: of the parameters; inputs must match them.
        alignment: rows each expert segment of the receive pool is aligned to; None (default): the
            backend's ``segment_alignment`` (torch 128, grouped_mm 16, triton 1, deep_gemm 128, auto 128 when it
            holds deep_gemm).
        pool_format: ``"contiguous"`` (default: ``MOE_REF_POOL_FORMAT``, else contiguous; segments back to back,
            the fewest rows) or ``"masked"`` (decode with a small cap: each local expert owns ``align(R * cap,
            alignment)`` rows at a fixed start, DeepGEMM's masked layout, so ``deep_gemm`` experts run its masked
            GEMMs; ``moe-ref plan --pool-format masked`` prints the bytes).
        seed: if given, initialise with ``MoEWeights.random(cfg, seed)`` (same on every rank); else the
            parameters are uninitialised and a call raises ``WeightsNotLoadedError`` (INP006) until
            ``load_hf_weights``/``load_weights``.
        mega: the routed step's engine: ``"off"`` (default: moe_ref's transport + experts backend),
            ``"deep_gemm"`` (DeepGEMM's SM90 FP8 fused mega-MoE; ENV001/ENV002 on every rank when it cannot
            run), or ``"auto"`` (deep_gemm where every rank accepts the shape and machine, else moe_ref's own
            path; the reason is logged as a warning).
        debug_checks: per-call checks that nothing is lost (default: ``MOE_REF_DEBUG_CHECKS``, else off).
        eager_graph_max_tokens: one rank on CUDA: eager calls of 1 .. this many tokens replay a CUDA graph of their
            token count, captured on its second call (``moe_ref.eager_graphs``; default:
            ``MOE_REF_EAGER_GRAPH_MAX_TOKENS``, else ``min(1024, num_max_tokens_per_rank)``); 0: every call launches
            its kernels from Python.

    Attributes:
        options: the resolved ``EPOptions``. uses_mega: the agreed engine choice. routed_step: the one
            ``RoutedStep`` (built on first use). num_local_experts, first_local_expert, rank, world_size.
    """

    def __init__(self, cfg: MoEConfig | str | os.PathLike | Mapping[str, Any], group: dist.ProcessGroup | None = None,
                 *, num_max_tokens_per_rank: int | None = None, overflow: str | None = None,
                 transport: str | None = None, experts_backend: str | None = None, dispatch_fp8: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", alignment: int | None = None,
                 seed: int | None = None, mega: str | None = None, debug_checks: bool | None = None,
                 pool_format: str | None = None, eager_graph_max_tokens: int | None = None):
        super().__init__()
        self.cfg = cfg = as_config(cfg)
        self.options = EPOptions.resolve(
            num_max_tokens_per_rank=num_max_tokens_per_rank, overflow=overflow, transport=transport,
            experts_backend=experts_backend, dispatch_fp8=dispatch_fp8, alignment=alignment, pool_format=pool_format,
            mega=mega, dtype=dtype, device=device, debug_checks=debug_checks,
            eager_graph_max_tokens=eager_graph_max_tokens)
        self.group = group
        self._op_id = custom_ops.register(self)  # how torch.compile's graph names this layer
        self.world_size, self.rank = group_size_and_rank(group)
        self.num_local_experts = ParallelConfig(ep_size=self.world_size).num_local_experts(cfg)
        self.first_local_expert = self.rank * self.num_local_experts
        self.uses_mega = self._agree_on_construction()
        # calls of the compiled op; the op mutates it, so no call is ever dropped from a graph (custom_ops). A
        # buffer (not saved in state_dict), so torch.compile treats it as a static input, as CUDA graphs want
        with torch.inference_mode(False):
            self.register_buffer("_op_calls", torch.zeros(1, dtype=torch.int64, device=self.options.device),
                                 persistent=False)
        self._routed_step: RoutedStep | None = None
        self._experts: Experts | None = None
        self._graphs: EagerGraphs | None = None  # built by the first call that can replay (_eager_graphs_of)
        self._weights_loaded = False
        _LIVE_LAYERS.add(self)  # released at exit (release_all_at_exit)
        self._register_parameters()
        if seed is not None:
            self.load_weights(MoEWeights.random(cfg, seed=seed, dtype=self.options.dtype))

    # --- construction agreement ----------------------------------------------------------------------
    def _agree_on_construction(self) -> bool:
        """One collective: config and options must match on every rank; returns the agreed mega choice."""
        options = self.options
        fields = {f"cfg.{k}": str(v) for k, v in dataclasses.asdict(self.cfg).items()}
        fields.update(options.fingerprint())
        mega_ok, mega_reason = self._mega_supported_here()
        everyone = gather_objects((fields, mega_ok, mega_reason), self.group)
        check_fields_agree([f for f, _, _ in everyone], self.rank, what="MegaMoE")
        if options.mega == "off":
            return False
        refusals = [f"rank {r}: {reason}" for r, (_, ok, reason) in enumerate(everyone) if not ok]
        if not refusals:
            return True
        if options.mega == "deep_gemm":
            raise ShapeUnsupportedError(f"mega='deep_gemm' cannot run {self.cfg.name} at ep_size={self.world_size} "
                                        f"({'; '.join(refusals)}); use mega='auto' to fall back to moe_ref's own path")
        logger.warning("moe_ref: mega='auto' uses moe_ref's own EP path on every rank: %s", "; ".join(refusals))
        return False

    def _mega_supported_here(self) -> tuple[bool, str]:
        if self.options.mega == "off":
            return False, "mega='off'"
        from moe_ref.ep.mega_deep_gemm import supports

        on_cuda = self.options.device.type == "cuda"
        ok, reason = supports(self.cfg, self.world_size, check_runtime=on_cuda)
        if ok and not on_cuda:
            return False, f"the layer is on {self.options.device}; DeepGEMM's mega-MoE needs CUDA (SM90)"
        return ok, reason

    # --- parameters ----------------------------------------------------------------------------------
    def _register_parameters(self) -> None:
        cfg, device = self.cfg, self.options.device
        D, S, L = cfg.hidden_size, cfg.shared_intermediate_size, cfg.latent_dim

        with torch.inference_mode(False):  # normal tensors even when built inside inference mode
            self.gate_weight = self._new_parameter(cfg.num_experts, D)
            bias = torch.zeros(cfg.num_experts, dtype=torch.float32, device=device) if cfg.use_selection_bias else None
            self.register_buffer("e_score_correction_bias", bias)
            # allocated when loaded, and only for plain weights (see the module docstring)
            self.register_parameter("gate_up_weight", None)
            self.register_parameter("down_weight", None)
            self.shared_gate_up_weight = self._new_parameter(2 * S, D) if cfg.has_shared_experts else None
            self.shared_down_weight = self._new_parameter(D, S) if cfg.has_shared_experts else None
            self.latent_down_weight = self._new_parameter(L, D) if L else None
            self.latent_up_weight = self._new_parameter(D, L) if L else None
            self.latent_norm_weight = self._new_parameter(L) if L and cfg.latent_norm else None
        self.quantized_experts: QuantizedExpertWeights | None = None

    def _new_parameter(self, *shape: int) -> nn.Parameter:
        """An uninitialised parameter in the layer's dtype, on its device."""
        empty = torch.empty(*shape, dtype=self.options.dtype, device=self.options.device)
        return nn.Parameter(empty, requires_grad=False)

    def _expert_shapes(self) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """``([e, 2F, Dx], [e, Dx, F])``: this rank's plain expert weights."""
        e, F, Dx = self.num_local_experts, self.cfg.intermediate_size, self.cfg.expert_hidden_size
        return (e, 2 * F, Dx), (e, Dx, F)

    def _expert_parameters(self) -> tuple[nn.Parameter, nn.Parameter]:
        """``gate_up_weight [e, 2F, Dx]`` and ``down_weight [e, Dx, F]``, allocated (uninitialised) on first
        need: by a plain load, or by a call before any load (which then fails with INP006 on every rank)."""
        if self.gate_up_weight is None:
            gate_up_shape, down_shape = self._expert_shapes()
            with torch.inference_mode(False):
                self.gate_up_weight = self._new_parameter(*gate_up_shape)
                self.down_weight = self._new_parameter(*down_shape)
        return self.gate_up_weight, self.down_weight

    # --- nn.Module conventions: state_dict round trip, fixed dtype/device -----------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """The parameters and buffers, plus quantized experts kept as stored (``quantized_experts.<field>``
        tensors and ``quantized_experts.spec``, the format as uint8 JSON bytes), so a fresh layer loads them.
        4-bit words held in the W4A16 kernel's order are put back in the checkpoint's (a copy, made here)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        q = None if self.quantized_experts is None else self.quantized_experts.as_stored()
        if q is not None:
            for field in QUANTIZED_TENSOR_FIELDS:
                destination[prefix + _QUANT_PREFIX + field] = getattr(q, field)
            spec = json.dumps({**dataclasses.asdict(q.spec), "format": q.spec.format.value})  # every field
            destination[prefix + _QUANT_PREFIX + "spec"] = torch.tensor(list(spec.encode()), dtype=torch.uint8)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """Loads into a fresh layer too: plain experts are allocated when the state dict has them, quantized
        ones are taken as stored; either way the layer counts as loaded (as after ``load_weights``)."""
        plain = prefix + "gate_up_weight" in state_dict
        quant = prefix + _QUANT_PREFIX + "spec" in state_dict
        if plain:
            self._expert_parameters()  # allocated here when the layer never held plain experts
        elif quant:
            self.gate_up_weight = self.down_weight = None  # the plain ones are replaced by the quantized ones
        errors_before = len(error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        quant_keys = [k for k in state_dict if k.startswith(prefix + _QUANT_PREFIX)]
        unexpected_keys[:] = [k for k in unexpected_keys if k not in quant_keys]
        if quant:
            missing = [prefix + _QUANT_PREFIX + f for f in QUANTIZED_TENSOR_FIELDS
                       if prefix + _QUANT_PREFIX + f not in state_dict]
            missing_keys.extend(missing)
            if missing:
                return
            info = json.loads(bytes(state_dict[prefix + _QUANT_PREFIX + "spec"].tolist()).decode())
            spec = QuantSpec(**{**{k: tuple(v) if isinstance(v, list) else v for k, v in info.items()},
                                "format": QuantFormat(info["format"])})
            self._quantized_backend(spec)  # a coded refusal (ENV001) where this layer's options cannot run them
            device = self.options.device
            tensors = {f: state_dict[prefix + _QUANT_PREFIX + f].detach().to(device, copy=True) for f in QUANTIZED_TENSOR_FIELDS}
            self.quantized_experts = self._held(QuantizedExpertWeights(
                spec=spec, **tensors, hidden_size=self.cfg.expert_hidden_size,
                intermediate_size=self.cfg.intermediate_size, first_expert=self.first_local_expert))
        elif plain:
            self.quantized_experts = None
        if (plain or quant) and len(error_msgs) == errors_before:
            self._weights_changed()

    def _apply(self, fn, recurse=True):
        """``.to()``, ``.half()``, ``.float()``, ``.cuda()``...: allowed when they keep the layer's dtype and
        device; a change raises ``LayerConversionError`` (CFG016) before anything is converted (the plan,
        buffers, experts and checks are built for one dtype and device: build a new layer instead)."""
        reference = torch.empty(0, dtype=self.options.dtype, device=self.options.device)
        dtype, device = reference.dtype, reference.device  # "cuda" as "cuda:0", as fn's output says it
        probe = fn(reference)
        if probe.dtype != dtype or probe.device != device:
            raise LayerConversionError(
                f"MegaMoE was built for dtype={dtype} on {device}; converting it to dtype={probe.dtype} on "
                f"{probe.device} would cast its parameters only (its plan, buffers, experts and input checks stay "
                f"{dtype} on {device}). Build a layer of that dtype and load this one's weights into it: "
                f"new = MegaMoE(cfg, group, dtype={probe.dtype}, device='{probe.device}', ...); "
                f"new.load_state_dict(layer.state_dict())", dtype=str(probe.dtype), device=str(probe.device))
        return super()._apply(fn, recurse)

    def expert_nbytes(self) -> int:
        """Bytes this rank's routed expert weights occupy on the device: the plain parameters, or a quantized
        checkpoint's tensors as stored (then equal to the checkpoint's bytes of these experts; 4-bit words may be in
        the W4A16 kernel's order, the same bytes); 0 before loading. Not counted: what a backend holds beside them
        (the W4A16 kernel's block-major scales, ``self.experts.extra_nbytes()``)."""
        if self.quantized_experts is not None:
            return self.quantized_experts.nbytes()
        plain = (self.gate_up_weight, self.down_weight)
        return sum(t.numel() * t.element_size() for t in plain if t is not None)

    def weights(self) -> MoEWeights:
        """This rank's parameters as ``MoEWeights`` (views, no copy). The expert tensors are None unless the
        experts are held as plain parameters (not loaded yet, or kept quantized in ``quantized_experts``)."""
        return MoEWeights(
            gate_weight_ED=self.gate_weight, gate_up_weight_E2FD=self.gate_up_weight,
            down_weight_EDF=self.down_weight, bias_E=self.e_score_correction_bias,
            shared_gate_up_weight_2SD=self.shared_gate_up_weight, shared_down_weight_DS=self.shared_down_weight,
            latent_down_weight_LD=self.latent_down_weight, latent_up_weight_DL=self.latent_up_weight,
            latent_norm_weight_L=self.latent_norm_weight, first_expert=self.first_local_expert)

    def load_weights(self, weights: MoEWeights) -> "MegaMoE":
        """Copy ``weights`` (all experts, or a block holding at least this rank's experts) into the parameters
        (the experts' are allocated here on the first plain load; quantized experts held before are dropped).

        Every shape is checked before anything is copied (``TensorShapeMismatchError``, LOAD002). With ``mega``
        in use this is collective (the fused engine is rebuilt from the new weights on the next call).
        """
        source = weights.expert_slice(self.first_local_expert, self.num_local_experts)
        gate_up_shape, down_shape = self._expert_shapes()
        _check_shapes([("gate_up_weight_E2FD", gate_up_shape, source.gate_up_weight_E2FD),
                       ("down_weight_EDF", down_shape, source.down_weight_EDF)] + self._dense_targets(source))
        self.quantized_experts = None
        gate_up, down = self._expert_parameters()
        _copy([(gate_up, source.gate_up_weight_E2FD), (down, source.down_weight_EDF)]
              + [(dst, src) for _, dst, src in self._dense_pairs(source)])
        return self._weights_changed()

    def load_hf_weights(self, path: str | os.PathLike, layer_idx: int, prefix: str | None = None, *,
                        progress: bool | None = None) -> "MegaMoE":
        """Load layer ``layer_idx`` from an HF safetensors checkpoint (file or folder), reading only this
        rank's experts (see ``moe_ref.checkpoint.loading.load_moe_weights`` for each family's names).

        When the config.json beside the checkpoint has a ``quantization_config`` (FP8 128x128 blocks,
        compressed-tensors INT4 or MXFP4: ``moe_ref.checkpoint.formats``), the routed experts are read as stored straight into
        device tensors (``quantized_experts``; ``expert_nbytes()`` == the checkpoint's bytes of these experts;
        no plain copy is ever allocated) and run by the quantized backend matching ``experts_backend``
        (``moe_ref.experts.quantized``: triton -> FP8 block / W4A16 kernels, torch -> the dequantizing loop). The
        router, shared experts and latent projections are read into the layer's dtype either way: each Linear
        layer in the precision the ``quantization_config`` decides (``QuantSpec.quantizes``); shared experts
        stored FP8 (DeepSeek-V3, Kimi-K2-Instruct, Step3 FP8) are dequantized once, here. ``load_report()``
        tells the bytes read and held.

        Args:
            path: a ``.safetensors`` file or a checkpoint folder.
            layer_idx: the decoder layer.
            prefix: the text before the layer number; None tries ``moe_ref.checkpoint.loading.KNOWN_PREFIXES``.
            progress: a progress bar over this rank's experts on stderr; None: on rank 0 only.

        Raises:
            The loaders' LOAD* errors (LOAD014: a module stored in another precision than the config says);
            ``BackendUnavailableError`` (ENV001) for a quantized checkpoint with
            ``mega='deep_gemm'`` or an experts backend without quantized kernels (grouped_mm, deep_gemm).
        """
        from moe_ref.checkpoint.loading import LoadedTensor, LoadReport, load_moe_weights
        from moe_ref.checkpoint.quantized import checkpoint_quant_spec, load_quantized_experts, routed_experts_quantized

        spec = checkpoint_quant_spec(path)
        progress = self.rank == 0 if progress is None else progress
        expert_range = (self.first_local_expert, self.num_local_experts)
        report = LoadReport()
        dense_args = dict(prefix=prefix, dtype=self.options.dtype, device=self.options.device, progress=progress,
                          quant=spec, report=report)
        routed_quantized, rule = False, None
        if spec is not None:
            routed_quantized, rule = routed_experts_quantized(path, spec, self.cfg, layer_idx, prefix=prefix,
                                                              expert=self.first_local_expert)
        if not routed_quantized:  # plain checkpoint, or a config that leaves the routed experts unquantized
            self.load_weights(load_moe_weights(path, self.cfg, layer_idx, expert_range=expert_range, **dense_args))
            return self._loaded(report)
        self._quantized_backend(spec)  # refuse before reading anything
        dense = load_moe_weights(path, self.cfg, layer_idx, experts=False, **dense_args)
        quantized = load_quantized_experts(path, self.cfg, layer_idx, expert_range, self.options.device, spec=spec,
                                           prefix=prefix, progress=progress)
        report.add(LoadedTensor(f"layer {layer_idx} routed experts {expert_range[0]}..{sum(expert_range) - 1}",
                                spec.format.value, quantized.nbytes(), "as stored", quantized.nbytes(), rule))
        _check_shapes(self._dense_targets(dense))
        if self.uses_mega:  # mega='auto' here ('deep_gemm' was refused): every rank reads the same config.json
            logger.warning("moe_ref: mega='auto' uses moe_ref's own EP path: the checkpoint's routed experts are "
                           "%s and DeepGEMM's mega-MoE takes plain weights", spec.format.value)
            self.uses_mega = False
            self.destroy()
        _copy([(dst, src) for _, dst, src in self._dense_pairs(dense)])
        self.gate_up_weight = self.down_weight = None  # a plain block loaded before is freed
        self.quantized_experts = self._held(quantized)
        self._weights_changed()
        return self._loaded(report)

    def _loaded(self, report) -> "MegaMoE":
        """Keep (and log) what ``load_hf_weights`` read and holds."""
        self._load_report = report
        logger.info("moe_ref: load_hf_weights: %s", report.summary())
        return self

    def load_report(self):
        """What the last ``load_hf_weights`` read and holds (``moe_ref.checkpoint.loading.LoadReport``), None
        before one: each weight's stored dtype/format, bytes read and bytes held; ``dequantized_bytes()`` gives
        the weights stored quantized (e.g. FP8 shared experts) as (bytes read, bytes held dequantized)."""
        return getattr(self, "_load_report", None)

    def _held(self, quantized: QuantizedExpertWeights) -> QuantizedExpertWeights:
        """A just-loaded ``QuantizedExpertWeights`` as the layer keeps it, rewritten in place now, at load, before any
        caller can hold the checkpoint-order object (one copy of the weights; ``state_dict()`` puts the checkpoint's
        order back): 4-bit words that the W4A16 kernel will read in its order, FP8 gate/up rows that the FP8
        kernels will read interleaved in 128-row blocks (the torch loop reads either, so its experts stay as
        stored)."""
        backend = self._quantized_backend(quantized.spec)
        runs_on = quantized_experts_class(quantized.spec.format, backend, self.options.device)
        if runs_on is W4A16Experts:
            return quantized.with_group_planes()
        if runs_on is not QuantTorchExperts:
            return quantized.with_interleaved_gate_up()
        return quantized

    def _quantized_backend(self, spec: QuantSpec) -> str:
        """The ``moe_ref.experts.quantized`` backend that runs ``spec``'s experts for this layer's options."""
        fmt = spec.format.value
        if self.uses_mega and self.options.mega == "deep_gemm":
            raise BackendUnavailableError(
                f"mega='deep_gemm' quantizes plain (bf16) expert weights itself; this checkpoint stores its routed "
                f"experts as {fmt}. Use mega='auto' or 'off' to run them as stored on moe_ref's own path")
        backend = self.options.experts_backend
        if backend not in QUANT_BACKENDS:
            raise BackendUnavailableError(
                f"experts_backend={backend!r} has no kernel for {fmt} experts kept as stored; use "
                f"experts_backend='auto' (moe_ref's kernels on CUDA, torch elsewhere), 'triton' or 'torch'",
                field="experts_backend")
        return backend

    def _dense_pairs(self, source: MoEWeights) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
        """``(field, this layer's tensor, source tensor)`` for every non-expert tensor the config has."""
        target = self.weights()
        return [(field.name, getattr(target, field.name), getattr(source, field.name))
                for field in dataclasses.fields(MoEWeights)
                if field.name not in _EXPERT_FIELDS and isinstance(getattr(target, field.name), torch.Tensor)]

    def _dense_targets(self, source: MoEWeights) -> list[tuple[str, tuple[int, ...], torch.Tensor | None]]:
        return [(name, tuple(dst.shape), src) for name, dst, src in self._dense_pairs(source)]

    def _weights_changed(self) -> "MegaMoE":
        """After a load: the experts are rebuilt from the new weights on first use; a built modular step gets
        them swapped in (its plan and buffers stay), a fused engine (holding fp8 copies) is rebuilt."""
        self._weights_loaded = True
        self._experts = None
        self._drop_graphs()  # they hold the old experts' tensors
        if self.uses_mega and self._routed_step is not None:
            self._routed_step.destroy()
            self._routed_step = None
        elif self._routed_step is not None:
            self._routed_step.experts = self.experts
        return self

    # --- the routed step ------------------------------------------------------------------------------
    @property
    def experts(self) -> Experts:
        """This rank's experts backend (modular step), built on first use from the loaded weights: the
        quantized backend for ``quantized_experts``, else ``experts_backend`` over the plain parameters."""
        if self._experts is None:
            cfg = self.cfg
            activation = (cfg.activation, cfg.situ_beta, cfg.situ_linear_beta)
            with torch.inference_mode(False):
                if self.quantized_experts is not None:
                    backend = self._quantized_backend(self.quantized_experts.spec)
                    self._experts = make_quantized_experts(self.quantized_experts, *activation, backend=backend)
                else:
                    self._experts = make_experts(self.options.experts_backend, *self._expert_parameters(),
                                                 *activation, fp8=self.fp8_experts)
        return self._experts

    @property
    def fp8_experts(self) -> bool:
        """FP8 expert weights: with ``dispatch_fp8`` on a backend that has them (triton, deep_gemm)."""
        return self.options.dispatch_fp8 and experts_class(self.options.experts_backend,
                                                           self.options.device).supports_fp8

    @property
    def routed_step(self) -> RoutedStep:
        """The layer's one routed step (collective to build: every rank builds it on its first call)."""
        if self._routed_step is None:
            with torch.inference_mode(False):  # buffers must stay usable outside inference mode
                if self.uses_mega:
                    from moe_ref.ep.mega_deep_gemm import make_mega_step

                    self._routed_step = make_mega_step(self.cfg, self.group, self.options,
                                                       *self._expert_parameters())
                else:
                    self._routed_step = make_modular_step(self.cfg, self.group, self.experts, self.options)
        return self._routed_step

    @property
    def eager_graphs(self) -> EagerGraphs | None:
        """The CUDA graphs eager calls replay (``moe_ref.eager_graphs``; ``captures``, ``len()``), or None where
        calls do not replay graphs (more than one rank, the CPU, ``debug_checks``, ``eager_graph_max_tokens=0``) or
        before the first call."""
        return self._graphs

    @property
    def num_recv_tokens_per_expert(self) -> torch.Tensor:
        """``[e]`` int64: rows each local expert received, summed over all calls (for load balancers)."""
        return self.routed_step.num_recv_tokens_per_expert

    def forward(self, hidden_states: torch.Tensor, *, max_num_tokens: int | None = None) -> torch.Tensor:
        """``hidden_states [T, D]`` -> ``[T, D]`` in the same dtype (collective: every rank of the group calls it,
        with T = 0 if it has no tokens). Under ``torch.compile`` the whole layer is one custom op
        (``moe_ref.custom_ops``: no graph break); otherwise ``eager_forward``.
        """
        if torch.compiler.is_compiling():
            # the op has no autograd formula: whether a gradient is asked for is decided here (dynamo guards on it)
            # and the op runs without autograd; it raises INP007 on every rank when one was (see custom_ops)
            grad_requested = self._grad_requested(hidden_states)
            # a bound of the wrong type cannot enter the op's int argument: -2 tells the op to raise INP008 on
            # every rank (in the op, through the step's collective, not here at trace time on this rank only)
            bound = (-2 if not _bound_type_ok(max_num_tokens) else
                     -1 if max_num_tokens is None else max_num_tokens)
            with torch.no_grad():
                return torch.ops.moe_ref.mega_moe(hidden_states, self._op_calls, self._op_id, bound, grad_requested)
        return self.eager_forward(hidden_states, max_num_tokens=max_num_tokens)

    def _grad_requested(self, x: torch.Tensor) -> bool:
        return torch.is_grad_enabled() and ((isinstance(x, torch.Tensor) and x.requires_grad)
                                            or any(p.requires_grad for p in self.parameters()))

    def eager_forward(self, hidden_states: torch.Tensor, *, max_num_tokens: int | None = None,
                      grad_requested: bool | None = None, read_checks_now: bool = False) -> torch.Tensor:
        """The layer's work (see ``forward``).

        Args:
            hidden_states: ``[T, D]`` in the layer's dtype, on its device.
            max_num_tokens: a bound on T promised for every rank (checked in the per-call collective; give it
                on every rank or on none).

        At decode on CUDA, a call can be captured in a CUDA graph (``torch.cuda.graph``) and replayed with new
        inputs of the same shape (the ``symm`` transport; see ``moe_ref.ep.routed_step`` for what capture skips).

        Raises, on every rank alike: this or any rank's input problem (INP001-INP007), CAP001 under
        ``overflow='error'``, ENV004/ENV005/CFG008 (see ``moe_ref.ep.routed_step``).
        ``grad_requested``: decided by the caller (the compiled op, which runs without autograd), else here.
        ``read_checks_now``: read this call's device checks before returning, also where they are otherwise read by
        a later call (one rank on CUDA); the compiled op asks for it (see ``moe_ref.custom_ops``).

        On an error the locals of the finished frames below this one are cleared (``traceback.clear_frames``):
        the routed step keeps the failure it agrees on in a local, so its frame, the exception and its traceback
        form a reference cycle that would keep the step, its shared buffer and this layer alive until the next
        ``gc.collect()`` (a layer dropped on every rank would stay held on the failing rank only: CFG008 at the
        next build). The traceback's lines are kept; only the frames' variables go.
        """
        try:
            return self._eager_forward(hidden_states, max_num_tokens, grad_requested, read_checks_now)
        except BaseException as err:
            traceback.clear_frames(err.__traceback__.tb_next)  # the finished frames below this one
            raise

    def _eager_forward(self, hidden_states: torch.Tensor, max_num_tokens: int | None,
                       grad_requested: bool | None, read_checks_now: bool) -> torch.Tensor:
        problem = self._input_problem(hidden_states, grad_requested)
        bad_bound = _max_num_tokens_problem(max_num_tokens)
        if bad_bound is not None:  # raised on every rank by the step's collective (no bound of this rank in it)
            problem, max_num_tokens = bad_bound, None
        step = self.routed_step
        if problem is not None:  # no rows move: the step's collective raises it on every rank
            empty = torch.empty(0, self.cfg.num_topk, device=self.options.device)
            step(torch.empty(0, self.cfg.expert_hidden_size, dtype=self.options.dtype, device=self.options.device),
                 empty.long(), empty, problem=problem, max_num_tokens=max_num_tokens)
            raise AssertionError("unreachable: the routed step raises the agreed problem")
        graphs = self._eager_graphs_of(step)
        if graphs is not None and not read_checks_now and graphs.covers(hidden_states, max_num_tokens):
            replayed = graphs(hidden_states, step, lambda x_TD: self._device_work(x_TD, step, DeviceChecks()))
            if replayed is not None:
                return replayed
        # a user's own CUDA-graph capture reads no device checks: none are computed there
        checks = None if step.capturing() else DeviceChecks()
        y_TD, _ = self._device_work(hidden_states, step, checks, max_num_tokens, read_checks_now)
        return y_TD

    def _device_work(self, x_TD: torch.Tensor, step: RoutedStep, checks: DeviceChecks | None,
                     max_num_tokens: int | None = None, read_checks_now: bool = False
                     ) -> tuple[torch.Tensor, DeviceChecks | None]:
        """Route, the routed step, finish: ``(y_TD [T, D], checks)``. ``checks`` collects the device-side checks
        (NaN logits, routing values; read in the routed step's one collective, or by a later call on one rank
        on CUDA); None computes none (inside a user's CUDA-graph capture). Raises only the routed step's agreed
        errors (the input was checked by the caller)."""
        weights = self.weights()
        (topk_ids_TK, topk_weights_TK), _ = route_unchecked(
            x_TD, self.gate_weight, self.cfg, self.e_score_correction_bias, check_values=checks is not None,
            device_checks=checks)
        routed = step(expert_input(x_TD, weights, self.cfg), topk_ids_TK, topk_weights_TK,
                      max_num_tokens=max_num_tokens, device_checks=checks, read_checks_now=read_checks_now)
        return finish(routed, x_TD, weights, self.cfg), checks

    def _eager_graphs_of(self, step: RoutedStep) -> EagerGraphs | None:
        """The layer's eager CUDA graphs (``moe_ref.eager_graphs``), where calls can replay them: one rank on CUDA
        whose device checks are read by a later call (no host sync in a call), ``eager_graph_max_tokens`` > 0, the
        modular routed step; else None."""
        o = self.options
        if self._graphs is None and o.device.type == "cuda" and o.eager_graph_max_tokens > 0 \
                and step.deferred_checks is not None and not self.uses_mega:
            self._graphs = EagerGraphs(o.eager_graph_max_tokens, o.device)
        return self._graphs

    def _input_problem(self, x: torch.Tensor, grad_requested: bool | None = None) -> InputError | None:
        """What is wrong with this call on this rank (not raised: the routed step agrees on it first)."""
        width, dtype, device = self.cfg.hidden_size, self.options.dtype, self.gate_weight.device
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != width:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            return ShapeError(f"hidden_states has shape {shape}; expected [num_tokens, {width}] "
                              f"(flatten batch and sequence: x.view(-1, {width}))")
        if x.dtype != dtype:
            return DTypeError(f"hidden_states dtype {x.dtype} != layer dtype {dtype}; cast with x.to({dtype}) or "
                              f"build the layer with dtype={x.dtype}")
        if x.device != device:
            return DeviceError(f"hidden_states on {x.device}, layer on {device}; move with x.to('{device}')")
        if not self._weights_loaded:
            return WeightsNotLoadedError(f"rank {self.rank}: the layer's weights were never loaded; call "
                                         f"load_hf_weights(path, layer_idx) or load_weights(...) first, or build it "
                                         f"with seed=N for random test weights")
        if self._grad_requested(x) if grad_requested is None else grad_requested:
            return GradientNotSupportedError(
                "MegaMoE has no backward (rows cross ranks through buffers autograd cannot follow); run it under "
                "torch.no_grad() or torch.inference_mode(), or pass x.detach()")
        return None

    def check(self) -> None:
        """Wait for the calls made so far and raise the first device check they failed (routing values, NaN
        logits). Needed only on one rank on CUDA, where a call does not wait for its checks and a failed one is
        raised by the next call; elsewhere each call raises its own. NOTE: syncs the host."""
        if self._routed_step is not None:
            self._routed_step.check()

    def destroy(self) -> None:
        """Release the routed step and its share of the group's symmetric buffer (not collective: call it on every
        rank; the layer stays usable, the next call builds the step again). Done for every live layer at exit
        anyway (``release_all_at_exit``), before the interpreter tears down, so call it only to free memory early."""
        self._drop_graphs()
        if self._routed_step is not None:
            self._routed_step.destroy()
            self._routed_step = None

    def _drop_graphs(self) -> None:
        if self._graphs is not None:
            self._graphs.clear()

    def _release_group(self) -> None:
        """At exit: ``destroy()`` and drop every reference the layer and its step hold to the process group, so
        the group's C++ object (gloo's threads) is freed now, while the interpreter is intact, and not during
        its final teardown (where gloo's destructor can abort the process: "terminate called without an
        active exception", exit status -6). The layer cannot be called afterwards."""
        step = self._routed_step
        self.destroy()
        dispatcher = getattr(step, "dispatcher", None)
        for holder in (step, dispatcher, getattr(dispatcher, "buffer", None)):
            if holder is not None and hasattr(holder, "group"):
                holder.group = None
        self.group = None

    def _experts_precision(self) -> str:
        if self.quantized_experts is not None:
            return f" ({self.quantized_experts.spec.format.value} as stored)"
        return " (fp8)" if self.fp8_experts else ""

    def extra_repr(self) -> str:
        o = self.options
        return (f"{self.cfg.name}: E={self.cfg.num_experts} (local {self.num_local_experts} on rank "
                f"{self.rank}/{self.world_size}), ep_size={self.world_size}, K={self.cfg.num_topk}, "
                f"D={self.cfg.hidden_size}, dtype={o.dtype}, device={o.device}, "
                f"cap={o.num_max_tokens_per_rank}, overflow={o.overflow}, transport={o.transport}, "
                f"experts={o.experts_backend}{self._experts_precision()}, "
                f"dispatch={'fp8' if o.dispatch_fp8 else 'activation dtype'}, alignment={o.alignment}, "
                f"pool={o.pool_format}, mega={o.mega}{' (in use)' if self.uses_mega else ''}")
