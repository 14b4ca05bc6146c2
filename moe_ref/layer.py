"""``MegaMoE``: the drop-in expert-parallel MoE block (torch.nn.Module).

    forward(x [T, D]):
      1. route: gate GEMM in fp32, family top-k        -> topk_ids [T, K] int64, topk_weights [T, K] fp32
      2. (Kimi-K3) latent down-projection             -> z [T, L]
      3. routed step on the Dispatcher: overflow policy (error | chunk), pre-dispatch (FP8-quantized with
         ``dispatch_fp8``) into this rank's symmetric buffer, dispatch to the experts' ranks, expert GEMMs on
         the used prefix of the pool (Experts backend; FP8 weights and the FP8 pool as is with
         ``dispatch_fp8`` on a backend that has them), combine back, fp32 weighted reduce over the K slots
                                                        -> routed [T, Dx]
         (``mega="deep_gemm"``/``"auto"``: DeepGEMM's SM90 FP8 fused kernel does step 3's dispatch, GEMMs and
         combine in one launch, under the same overflow policy; ``moe_ref.mega_deep_gemm``)
      4. (Kimi-K3) RMSNorm over the full cross-rank sum, latent up-projection
      5. + shared experts                               -> y [T, D] in x's dtype

Owners: ``moe_ref.router`` (1), ``moe_ref.dispatch.Dispatcher`` (3, with ``capacity`` / ``buffer`` /
``transport``), ``moe_ref.experts`` (expert GEMMs), ``moe_ref.reference.moe_block`` (the composition,
shared with the single-process oracle ``moe_ref.reference.reference_moe``).

Parameters (this rank's experts only; e = E / ep_size): ``gate_weight [E, D]``,
``e_score_correction_bias [E]`` (fp32 buffer, sigmoid families), ``gate_up_weight [e, 2F, Dx]``,
``down_weight [e, Dx, F]``, shared ``shared_gate_up_weight [2S, D]``, ``shared_down_weight [D, S]``,
Kimi-K3 ``latent_down_weight [L, D]``, ``latent_up_weight [D, L]``, ``latent_norm_weight [L]``.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from moe_ref import envs
from moe_ref.config import MoEConfig, ParallelConfig, preset
from moe_ref.errors import DeviceError, DTypeError, ShapeError, ShapeUnsupportedError, UnknownNameError
from moe_ref.experts import Experts, experts_class, make_experts
from moe_ref.reference import moe_block
from moe_ref.weights import MoEWeights

logger = logging.getLogger(__name__)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MEGA_CHOICES = ("off", "deep_gemm", "auto")
# Used when neither the argument nor MOE_REF_NUM_MAX_TOKENS_PER_RANK gives a cap.
DEFAULT_NUM_MAX_TOKENS_PER_RANK = 4096


def as_config(cfg: MoEConfig | str | os.PathLike | Mapping[str, Any]) -> MoEConfig:
    """A ``MoEConfig`` from itself, a preset name, a config.json path (or its folder), or an HF config dict."""
    if isinstance(cfg, MoEConfig):
        return cfg
    if isinstance(cfg, str) and not os.path.exists(cfg) and not cfg.endswith(".json"):
        return preset(cfg)
    return MoEConfig.from_hf_config(cfg)


class MegaMoE(nn.Module):
    """The expert-parallel MoE block of Kimi-K2/K3, DeepSeek-V3 and Step3-style models.

    Args:
        cfg: ``MoEConfig``, a preset name (``"kimi-k2"``, ``"tiny-step3"``...), an HF config.json path or dict.
        group: the EP process group (``dist.group.WORLD``...), or None for one process.
        num_max_tokens_per_rank: the cap: rows ONE rank feeds per call (default:
            ``MOE_REF_NUM_MAX_TOKENS_PER_RANK``, else 4096). Equal on every rank (checked).
        overflow: ``"error"`` or ``"chunk"`` when a rank's batch exceeds the cap (default:
            ``MOE_REF_OVERFLOW_POLICY``, else ``"error"``).
        transport: ``"auto"``, ``"symm"``, ``"a2a"`` or ``"local"`` (default: ``MOE_REF_TRANSPORT``, else auto).
        experts_backend: ``"auto"``, ``"torch"``, ``"grouped_mm"``, ``"triton"``, ``"deep_gemm"`` (default:
            ``MOE_REF_EXPERTS_BACKEND``, else auto = triton on CUDA, torch on CPU).
        dispatch_fp8: FP8 end to end where the backend allows: tokens move as FP8 e4m3 with per-128 scales
            (halves dispatch bytes; lossy), and a backend with fp8 weights (``supports_fp8``: triton,
            deep_gemm) runs them, quantized once to 128x128 blocks; triton takes the FP8 pool as is. The
            torch and grouped_mm backends run the dequantized pool with the layer's weights. FP8 experts
            iff ``dispatch_fp8`` (``fp8_experts``): there is no fp8-weights-over-bf16-dispatch mode.
        dtype, device: of the parameters; inputs must match them.
        alignment: rows each expert segment of the receive pool is aligned to; None (default): the
            backend's ``segment_alignment`` (torch 128, grouped_mm 16, triton 1, deep_gemm 128).
        seed: if given, initialise with ``MoEWeights.random(cfg, seed)`` (same on every rank); else
            the parameters are uninitialised until ``load_hf_weights``/``load_weights``.
        mega: the routed step's engine: ``"off"`` (default: moe_ref's dispatcher + experts backend),
            ``"deep_gemm"`` (DeepGEMM's SM90 FP8 fused mega-MoE under moe_ref's router, cap and overflow
            policy; ENV001/ENV002 when it cannot run), or ``"auto"`` (deep_gemm where ``supports`` accepts
            the shape, the EP size and this machine, else moe_ref's own path; the reason is logged).
    """

    def __init__(self, cfg: MoEConfig | str | os.PathLike | Mapping[str, Any], group: dist.ProcessGroup | None = None,
                 *, num_max_tokens_per_rank: int | None = None, overflow: str | None = None,
                 transport: str | None = None, experts_backend: str | None = None, dispatch_fp8: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", alignment: int | None = None,
                 seed: int | None = None, mega: str = "off"):
        super().__init__()
        self.cfg = cfg = as_config(cfg)
        self.group = group
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self.num_local_experts = ParallelConfig(ep_size=self.world_size).num_local_experts(cfg)
        self.first_local_expert = self.rank * self.num_local_experts
        self.num_max_tokens_per_rank = (num_max_tokens_per_rank or envs.num_max_tokens_per_rank()
                                        or DEFAULT_NUM_MAX_TOKENS_PER_RANK)
        self.overflow = overflow or envs.overflow_policy() or "error"
        self.transport = transport or envs.transport() or "auto"
        self.experts_backend = experts_backend or envs.experts_backend() or "auto"
        experts_cls = experts_class(self.experts_backend, device)  # the plan needs its alignment before any weights
        self.dispatch_fp8 = dispatch_fp8
        self.fp8_experts = dispatch_fp8 and experts_cls.supports_fp8
        self.alignment = experts_cls.segment_alignment if alignment is None else alignment
        if dtype not in SUPPORTED_DTYPES:
            raise DTypeError(f"dtype={dtype}; MegaMoE parameters must be one of {SUPPORTED_DTYPES}")
        if mega not in MEGA_CHOICES:
            raise UnknownNameError(f"mega={mega!r}; supported: {', '.join(MEGA_CHOICES)}")
        self.mega = mega
        self._dispatcher = None
        self._experts: Experts | None = None
        self._mega_engine = None  # DeepGemmMegaMoE, built on first use when the mega path is chosen
        self._mega_decided: bool | None = None
        self._register_parameters(dtype, torch.device(device))
        if seed is not None:
            self.load_weights(MoEWeights.random(cfg, seed=seed, dtype=dtype))

    # --- parameters ----------------------------------------------------------------------------------
    def _register_parameters(self, dtype: torch.dtype, device: torch.device) -> None:
        cfg, e = self.cfg, self.num_local_experts
        D, F, Dx, S, L = (cfg.hidden_size, cfg.intermediate_size, cfg.expert_hidden_size,
                          cfg.shared_intermediate_size, cfg.latent_dim)

        def param(*shape):
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        self.gate_weight = param(cfg.num_experts, D)
        bias = torch.zeros(cfg.num_experts, dtype=torch.float32, device=device) if cfg.use_selection_bias else None
        self.register_buffer("e_score_correction_bias", bias)
        self.gate_up_weight = param(e, 2 * F, Dx)
        self.down_weight = param(e, Dx, F)
        self.shared_gate_up_weight = param(2 * S, D) if cfg.has_shared_experts else None
        self.shared_down_weight = param(D, S) if cfg.has_shared_experts else None
        self.latent_down_weight = param(L, D) if L else None
        self.latent_up_weight = param(D, L) if L else None
        self.latent_norm_weight = param(L) if L and cfg.latent_norm else None

    def weights(self) -> MoEWeights:
        """This rank's parameters as ``MoEWeights`` (views, no copy)."""
        return MoEWeights(
            gate_weight_ED=self.gate_weight, gate_up_weight_E2FD=self.gate_up_weight,
            down_weight_EDF=self.down_weight, bias_E=self.e_score_correction_bias,
            shared_gate_up_weight_2SD=self.shared_gate_up_weight, shared_down_weight_DS=self.shared_down_weight,
            latent_down_weight_LD=self.latent_down_weight, latent_up_weight_DL=self.latent_up_weight,
            latent_norm_weight_L=self.latent_norm_weight, first_expert=self.first_local_expert)

    @torch.no_grad()
    def load_weights(self, weights: MoEWeights) -> "MegaMoE":
        """Copy ``weights`` (all experts, or a block holding at least this rank's experts) into the parameters."""
        source = weights.expert_slice(self.first_local_expert, self.num_local_experts)
        target = self.weights()
        for field in dataclasses.fields(MoEWeights):
            dst, src = getattr(target, field.name), getattr(source, field.name)
            if not isinstance(dst, torch.Tensor):
                continue
            if src is None or tuple(src.shape) != tuple(dst.shape):
                from moe_ref.errors import TensorShapeMismatchError

                raise TensorShapeMismatchError(
                    f"{field.name}: expected shape {tuple(dst.shape)} for this config, got "
                    f"{None if src is None else tuple(src.shape)}")
            dst.copy_(src)
        self._experts = None
        self._drop_mega_engine()  # it holds fp8 copies of the old weights
        return self

    def load_hf_weights(self, path: str | os.PathLike, layer_idx: int, prefix: str | None = None) -> "MegaMoE":
        """Load layer ``layer_idx`` from an HF safetensors checkpoint (file or folder), reading only this
        rank's experts. See ``moe_ref.loading.load_moe_weights`` for the names of each family."""
        from moe_ref.loading import load_moe_weights

        weights = load_moe_weights(path, self.cfg, layer_idx, prefix=prefix,
                                   expert_range=(self.first_local_expert, self.num_local_experts),
                                   dtype=self.gate_weight.dtype, device=self.gate_weight.device)
        return self.load_weights(weights)

    # --- the routed step ------------------------------------------------------------------------------
    @property
    def dispatcher(self):
        """The Dispatcher (built on first use: its symmetric buffer is sized from the plan, whose segment
        alignment is ``self.alignment``)."""
        if self._dispatcher is None:
            from moe_ref.dispatch import make_dispatcher

            self._dispatcher = make_dispatcher(
                self.cfg, self.group, self.num_max_tokens_per_rank, overflow=self.overflow,
                transport=self.transport, activation_dtype=self.gate_weight.dtype, device=self.gate_weight.device,
                dispatch_fp8=self.dispatch_fp8, alignment=self.alignment)
        return self._dispatcher

    @property
    def experts(self) -> Experts:
        """This rank's experts backend, built on first use after the weights are loaded (``load_weights``
        drops it: fp8 weights are quantized from the parameters at construction)."""
        if self._experts is None:
            self._experts = make_experts(self.experts_backend, self.gate_up_weight, self.down_weight,
                                         self.cfg.activation, self.cfg.situ_beta, self.cfg.situ_linear_beta,
                                         fp8=self.fp8_experts)
        return self._experts

    @property
    def uses_mega(self) -> bool:
        """Whether the routed step runs on DeepGEMM's mega-MoE (decided once, see ``mega``)."""
        if self._mega_decided is None:
            self._mega_decided = self._decide_mega()
        return self._mega_decided

    def _decide_mega(self) -> bool:
        if self.mega == "off":
            return False
        from moe_ref.mega_deep_gemm import supports

        ok, reason = supports(self.cfg, self.world_size, check_runtime=self.gate_weight.is_cuda)
        if ok and not self.gate_weight.is_cuda:
            ok, reason = False, f"the layer is on {self.gate_weight.device}; DeepGEMM's mega-MoE needs CUDA (SM90)"
        if ok:
            return True
        if self.mega == "deep_gemm":
            raise ShapeUnsupportedError(f"mega='deep_gemm' cannot run {self.cfg.name} at ep_size={self.world_size}: "
                                        f"{reason}; use mega='auto' to fall back to moe_ref's own path")
        logger.info("moe_ref: mega='auto' uses moe_ref's own EP path: %s", reason)
        return False

    @property
    def mega_engine(self):
        """The ``DeepGemmMegaMoE`` of this rank (collective to build; only when ``uses_mega``)."""
        if self._mega_engine is None:
            from moe_ref.mega_deep_gemm import DeepGemmMegaMoE

            self._mega_engine = DeepGemmMegaMoE(self.cfg, self.group, self.num_max_tokens_per_rank, self.overflow,
                                                self.gate_up_weight, self.down_weight)
        return self._mega_engine

    def _drop_mega_engine(self) -> None:
        if self._mega_engine is not None:
            self._mega_engine.destroy()
            self._mega_engine = None

    @property
    def num_recv_tokens_per_expert(self) -> torch.Tensor:
        """``[e]`` int64: rows each local expert received, summed over all calls (for load balancers)."""
        if self.uses_mega:
            return self.mega_engine.num_recv_tokens_per_expert_e.to(torch.int64)
        return self.dispatcher.num_recv_tokens_per_expert

    def forward(self, hidden_states: torch.Tensor, *, max_num_tokens: int | None = None) -> torch.Tensor:
        """``hidden_states [T, D]`` -> ``[T, D]`` in the same dtype. Every rank of the group must call it
        (with T = 0 if it has no tokens). ``max_num_tokens``: a known bound on T over the group, which
        skips the one small all-reduce the overflow policy needs."""
        self._check_input(hidden_states)

        def routed(x_TD, topk_ids_TK, topk_weights_TK):
            if self.uses_mega:  # bf16 out of the fused kernel (FP8 inside)
                return self.mega_engine.run(x_TD, topk_ids_TK, topk_weights_TK).to(x_TD.dtype)
            return self.dispatcher.run(x_TD, topk_ids_TK, topk_weights_TK, self.experts,
                                       max_num_tokens=max_num_tokens)

        return moe_block(hidden_states, self.weights(), self.cfg, routed)

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.cfg.hidden_size:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ShapeError(f"hidden_states has shape {shape}; expected [num_tokens, {self.cfg.hidden_size}] "
                             f"(flatten batch and sequence: x.view(-1, {self.cfg.hidden_size}))")
        if x.dtype != self.gate_weight.dtype:
            raise DTypeError(f"hidden_states dtype {x.dtype} != layer dtype {self.gate_weight.dtype}; cast with "
                             f"x.to({self.gate_weight.dtype}) or build the layer with dtype={x.dtype}")
        if x.device != self.gate_weight.device:
            raise DeviceError(f"hidden_states on {x.device}, layer on {self.gate_weight.device}; move with "
                              f"x.to('{self.gate_weight.device}')")

    def destroy(self) -> None:
        """Release the symmetric buffers (also released at exit)."""
        if self._dispatcher is not None:
            self._dispatcher.destroy()
            self._dispatcher = None
        self._drop_mega_engine()

    def extra_repr(self) -> str:
        return (f"{self.cfg.name}: E={self.cfg.num_experts} (local {self.num_local_experts} on rank "
                f"{self.rank}/{self.world_size}), K={self.cfg.num_topk}, D={self.cfg.hidden_size}, "
                f"cap={self.num_max_tokens_per_rank}, overflow={self.overflow}, transport={self.transport}, "
                f"experts={self.experts_backend}{' (fp8)' if self.fp8_experts else ''}, "
                f"dispatch={'fp8' if self.dispatch_fp8 else 'activation dtype'}, alignment={self.alignment}, mega={self.mega}")
