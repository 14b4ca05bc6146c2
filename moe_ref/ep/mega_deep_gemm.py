"""DeepGEMM's SM90 mega-MoE as moe_ref's routed step on 2+ GPUs (optional; sgl-deep-gemm 0.1.4).

    x_TD [T, D], topk_ids_TK [T, K] (-1 = masked), topk_weights_TK [T, K]
      --moe_ref's routed step (MonolithicRoutedStep: input check + overflow policy, one collective, same
        answer on every rank):
        'error' -> CapacityExceededError (CAP001) on every rank, before any kernel
        'chunk' -> n = ceil(max_r T_r / cap) chunks; every rank launches all n, empty ones included-->
      per chunk:
        moe_ref.kernels.ep.pre_dispatch: x -> fp8 e4m3 + fp32 scale per 128 columns, ids (int64), weights (fp32)
            written into DeepGEMM's symmetric-buffer views x, x_sf, topk_idx, topk_weights  (rows [:T])
        deep_gemm.fp8_mega_moe (one persistent kernel): every rank pulls the rows routed to its experts
            from its peers over NVLink -> L1 GEMM (fp8 x fp8, 128x128 weight blocks) -> SwiGLU x routing
            weight -> fp8 requant (per 64 columns) -> L2 GEMM -> bf16 rows written into the SOURCE rank's
            combine slots -> NVLink barrier -> unweighted fp32 sum of the valid slots -> bf16
      -> y_TD [T, D] bf16

Semantics (read from deep_gemm 0.1.4's ``include/deep_gemm/impls/sm90_fp8_mega_moe.cuh`` and its wrapper):

- Routing weights are applied inside the kernel, after SwiGLU and before GEMM2 (``swiglu *= weight``);
  combine is a plain sum. ``fp8_mega_moe`` has no ``routed_scaling_factor`` argument: moe_ref's router
  already folds ``routed_scaling_factor`` into ``topk_weights`` (``moe_ref.core.router``), so passing those
  weights gives ``sum_j w_j * Expert_j(x)`` with the factor included, as in ``routed_experts_reference``.
- The kernel reads rows ``[0, y.size(0))`` of ``topk_idx`` only (``for (i = ...; i < num_tokens; ...)``,
  ``num_tokens = y.size(0)``), so stale rows ``[T, cap)`` from an earlier call are never read and need
  no reset. With T = 0 we still launch (peers wait for us at the in-kernel NVLink barriers) with a
  1-row ``y`` (SGLang notes the tvm-ffi binding rejects empty tensors) and ``topk_idx[0] = -1``.
- SwiGLU only (``fp8_mega_moe`` asserts ``activation == 'swiglu'``; Kimi-K3's SiTU is refused), and the
  wrapper asserts ``intermediate_hidden / 64 <= 64`` (F <= 4096: Step3's 5120 is refused),
  ``hidden % 128 == 0 and intermediate_hidden % 128 == 0``, ``num_tokens <= num_max_tokens_per_rank``;
  the kernel static-asserts ``num_topk <= 32``. ``supports(cfg, ep_size)`` checks all of these first.
- ``get_symm_buffer_for_sm90_mega_moe`` aligns the cap up internally; moe_ref's overflow decision uses
  the cap the user asked for.
- Numerics: fp8 activations (per-128 scales), fp8 weights (128x128 blocks), fp8 intermediate; against
  the bf16 reference calc_diff is about 2e-3 (a CPU simulation of this recipe at D 7168, F 2048 gave
  2.1e-3 per expert slot).

Shape legend: T tokens of this rank, D hidden (expert input width), F expert intermediate, K top-k,
E experts, e = E / R local experts, R EP ranks, C cap (``num_max_tokens_per_rank``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from moe_ref.kernels.runtime import ops
from moe_ref.core.config import MoEConfig
from moe_ref.experts.deep_gemm.probe import call_deep_gemm, deep_gemm_status, import_deep_gemm
from moe_ref.ep.distributed import comm_device, group_max, group_size_and_rank
from moe_ref.core.errors import (BackendUnavailableError, CapacityMismatchError, DeviceError, ShapeError,
                                 ShapeUnsupportedError)
from moe_ref.ep.options import EPOptions

__all__ = ["supports", "DeepGemmMegaMoE", "MAX_INTERMEDIATE_SIZE", "MAX_TOPK"]

MAX_INTERMEDIATE_SIZE = 4096  # fp8_mega_moe asserts intermediate_hidden / 64 <= 64
MAX_TOPK = 32  # sm90_fp8_mega_moe_impl: DG_STATIC_ASSERT(kNumTopk <= 32, ...)


def supports(cfg: MoEConfig, ep_size: int, *, check_runtime: bool = False) -> tuple[bool, str]:
    """Whether DeepGEMM 0.1.4's SM90 mega-MoE can run this block at this EP size (for ``auto`` fallback).

    Args:
        cfg: the MoE block (its expert width is ``cfg.expert_hidden_size``).
        ep_size: R, ranks of the EP group.
        check_runtime: also require ``deep_gemm_status()`` to be available with the mega-MoE API.

    Returns:
        ok: True when every limit holds.
        reason: ``"ok: ..."`` or every violated limit, ``"; "``-separated, each naming the value and the limit.
    """
    hidden, intermediate = cfg.expert_hidden_size, cfg.intermediate_size
    problems = []
    if cfg.activation != "silu":
        problems.append(f"activation={cfg.activation!r}: deep_gemm 0.1.4's SM90 mega-MoE implements SwiGLU only "
                        "(fp8_mega_moe asserts activation == 'swiglu'); SiTU (Kimi-K3) needs moe_ref's own EP path")
    if intermediate > MAX_INTERMEDIATE_SIZE:
        problems.append(f"intermediate_size={intermediate} > {MAX_INTERMEDIATE_SIZE}: fp8_mega_moe asserts "
                        f"intermediate_hidden / 64 <= 64")
    if hidden % 128 or intermediate % 128:
        problems.append(f"hidden={hidden} and intermediate_size={intermediate} must be multiples of 128 (per-128 FP8 "
                        "scales; fp8_mega_moe asserts hidden % 128 == 0 and intermediate_hidden % 128 == 0)")
    if cfg.num_topk > MAX_TOPK:
        problems.append(f"num_topk={cfg.num_topk} > {MAX_TOPK} (the kernel static-asserts kNumTopk <= 32)")
    if ep_size < 2:
        problems.append(f"ep_size={ep_size}: the mega path needs 2+ ranks sharing symmetric memory; in one process use "
                        "experts_backend='deep_gemm' (grouped GEMMs)")
    elif cfg.num_experts % ep_size:
        problems.append(f"num_experts={cfg.num_experts} % ep_size={ep_size} != 0")
    if check_runtime and not problems:
        status = deep_gemm_status()
        if not (status.available and status.mega_moe):
            problems.append(f"deep_gemm mega-MoE not usable here: {status.reason}")
    if problems:
        return False, "; ".join(problems)
    return True, (f"ok: SwiGLU, hidden {hidden}, intermediate {intermediate} <= {MAX_INTERMEDIATE_SIZE}, "
                  f"top-{cfg.num_topk}, {cfg.num_experts} experts over {ep_size} ranks")


class DeepGemmMegaMoE:
    """The fused engine of one MoE block on DeepGEMM's SM90 mega-kernel (``launch``: one chunk; the routed step
    around it, with moe_ref's checks and overflow policy, is ``make_mega_step``).

    Construction is collective (every rank of ``group`` must build it with the same cap): it checks the
    cap on every rank, quantizes this rank's experts to fp8 (128x128 block scales) once, interleaves
    gate/up with ``transform_weights_for_mega_moe_sm90`` and allocates DeepGEMM's symmetric buffer with
    ``get_symm_buffer_for_sm90_mega_moe``. Call ``destroy()`` when done.

    Args:
        cfg: the MoE block; must pass ``supports(cfg, R)``.
        group: the EP process group (NCCL, one GPU per rank, ``torch.cuda.set_device`` done), R >= 2.
        num_max_tokens_per_rank: C, the most rows one rank feeds per call (``EPOptions``, resolved).
        gate_up_weight_e2FD: ``[e, 2F, D]`` CUDA bf16 (or fp16/fp32), gate rows then up rows of this rank's experts
            (global experts ``rank * e ... rank * e + e - 1``).
        down_weight_eDF: ``[e, D, F]`` CUDA.
        activation_clamp: optional SwiGLU clamp (``gate <= c``, ``-c <= up <= c``); None = no clamp (moe_ref's models).
        fast_math: DeepGEMM's fast exp/reciprocal in SwiGLU.

    Raises:
        ShapeUnsupportedError (ENV002): ``supports`` refused the shape (the message names each limit).
        BackendUnavailableError (ENV001): deep_gemm or its mega-MoE API is not usable here.
        CapacityMismatchError (CAP002): ranks passed different caps.
        DistributedError, DeviceError, ShapeError: no process group, weights not on CUDA, wrong shapes.
    """

    def __init__(self, cfg: MoEConfig, group: dist.ProcessGroup | None, num_max_tokens_per_rank: int,
                 gate_up_weight_e2FD: torch.Tensor, down_weight_eDF: torch.Tensor, *,
                 activation_clamp: float | None = None, fast_math: bool = True):
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        ep_size = dist.get_world_size(group) if group is not None else 1
        ok, reason = supports(cfg, ep_size)
        if not ok:
            raise ShapeUnsupportedError(f"deep_gemm SM90 mega-MoE refuses {cfg.name} at ep_size={ep_size}: {reason}",
                                        reason=reason)
        deep_gemm = import_deep_gemm()
        status = deep_gemm_status()
        if not status.mega_moe:
            raise BackendUnavailableError(f"deep_gemm {status.version} has no SM90 mega-MoE API "
                                          f"(get_symm_buffer_for_sm90_mega_moe, transform_weights_for_mega_moe_sm90, "
                                          f"fp8_mega_moe); use sgl-deep-gemm 0.1.4")
        self._deep_gemm = deep_gemm
        self.cfg, self.group, self.ep_size = cfg, group, ep_size
        self.rank = dist.get_rank(group)
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.activation_clamp, self.fast_math = activation_clamp, fast_math
        self.num_local_experts = cfg.num_experts // ep_size
        self.hidden_size, self.intermediate_size = cfg.expert_hidden_size, cfg.intermediate_size
        self._check_weights(gate_up_weight_e2FD, down_weight_eDF)
        self.device = gate_up_weight_e2FD.device
        self._check_cap_agreement()

        from moe_ref.kernels.experts.fp8 import quantize_fp8_per_block_128

        l1_weights = quantize_fp8_per_block_128(gate_up_weight_e2FD)
        l2_weights = quantize_fp8_per_block_128(down_weight_eDF)
        self._l1_weights, self._l2_weights = deep_gemm.transform_weights_for_mega_moe_sm90(l1_weights, l2_weights)
        del l1_weights, l2_weights
        try:
            self.buffer = deep_gemm.get_symm_buffer_for_sm90_mega_moe(
                group, cfg.num_experts, self.num_max_tokens_per_rank, cfg.num_topk, self.hidden_size,
                self.intermediate_size, True, "swiglu")
        except Exception as err:
            raise BackendUnavailableError(
                f"deep_gemm.get_symm_buffer_for_sm90_mega_moe(ranks={ep_size}, num_experts={cfg.num_experts}, "
                f"cap={self.num_max_tokens_per_rank}, topk={cfg.num_topk}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}) failed: {type(err).__name__}: {err}") from err
        # pre_dispatch's per-expert counter (required by its signature; zeroed before each chunk).
        self.num_rows_per_expert_E = torch.zeros(cfg.num_experts, dtype=torch.int32, device=self.device)
        # DeepGEMM's cumulative per-local-expert receive counts (rows = (token, slot) pairs), over all calls.
        self.num_recv_tokens_per_expert_e = torch.zeros(self.num_local_experts, dtype=torch.int32, device=self.device)

    # --- public ----------------------------------------------------------------------------------------
    @property
    def buffer_bytes(self) -> int:
        """Bytes of DeepGEMM's symmetric buffer on this rank."""
        return self.buffer.buffer.numel() * self.buffer.buffer.element_size()

    def destroy(self) -> None:
        """Release the symmetric buffer (collective use ends here; call on every rank)."""
        if getattr(self, "buffer", None) is not None:
            self.buffer.destroy()
            self.buffer = None

    # --- internals -------------------------------------------------------------------------------------
    def launch(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor) -> torch.Tensor:
        """One collective kernel launch over at most C rows (T may be 0; every rank launches).

        Args:
            x_TD: ``[T, D]`` CUDA bf16/fp16/fp32, T <= C (the routed step checks and chunks).
            topk_ids_TK: ``[T, K]`` int64 global expert ids, -1 = masked slot.
            topk_weights_TK: ``[T, K]`` fp32 (``routed_scaling_factor`` folded in).

        Returns:
            ``y_TD`` ``[T, D]`` bf16.
        """
        if self.buffer is None:
            raise BackendUnavailableError("DeepGemmMegaMoE.launch after destroy()")
        num_tokens = x_TD.shape[0]
        buf = self.buffer
        self.num_rows_per_expert_E.zero_()
        ops.pre_dispatch(x_TD.contiguous(), topk_ids_TK.contiguous(), topk_weights_TK.contiguous(), buf.x, buf.x_sf,
               buf.topk_idx, buf.topk_weights, self.num_rows_per_expert_E)
        if num_tokens == 0:
            buf.topk_idx[:1].fill_(-1)  # the 1-row dummy launch below must route nothing
        y_TD = torch.empty(max(num_tokens, 1), self.hidden_size, dtype=torch.bfloat16, device=self.device)
        call_deep_gemm(self._deep_gemm, "fp8_mega_moe", y_TD, self._l1_weights, self._l2_weights, buf,
                       cumulative_local_expert_recv_stats=self.num_recv_tokens_per_expert_e, recipe=(128, 128, 128),
                       activation="swiglu", activation_clamp=self.activation_clamp, fast_math=self.fast_math)
        return y_TD[:num_tokens]

    def _check_weights(self, gate_up_weight_e2FD: torch.Tensor, down_weight_eDF: torch.Tensor) -> None:
        e, D, F = self.num_local_experts, self.hidden_size, self.intermediate_size
        for name, weight, shape in (("gate_up_weight_e2FD", gate_up_weight_e2FD, (e, 2 * F, D)),
                                    ("down_weight_eDF", down_weight_eDF, (e, D, F))):
            if weight.device.type != "cuda":
                raise DeviceError(f"{name} is on {weight.device}; the deep_gemm mega path needs CUDA weights")
            if tuple(weight.shape) != shape:
                raise ShapeError(f"{name} has shape {tuple(weight.shape)}, expected {shape} (e = {self.cfg.num_experts} "
                                 f"experts / ep_size {self.ep_size})")

    def _check_cap_agreement(self) -> None:
        cap = self.num_max_tokens_per_rank
        largest, neg_smallest = group_max([cap, -cap], self.group, self.device)
        if largest != -neg_smallest:
            raise CapacityMismatchError(
                f"rank {self.rank} has num_max_tokens_per_rank={cap}, but the EP group's caps range from "
                f"{-neg_smallest} to {largest}; pass the same cap on every rank", cap=cap, smallest=-neg_smallest,
                largest=largest)


def make_mega_step(cfg: MoEConfig, group, options: EPOptions, gate_up_weight_e2FD: torch.Tensor,
                   down_weight_eDF: torch.Tensor):
    """The monolithic routed step on DeepGEMM's mega-MoE, under ``options``' cap and overflow policy
    (collective). Bf16 out of the fused kernel, cast to ``options.dtype``.

    First the build agreement (``OverflowPolicy.agree_to_build``, on the group and device of the step's per-call
    agreement), before the engine's own collectives, as the modular step does: a rank whose step was destroyed alone
    meets its peers' calls there (ENV017 on every rank) instead of a deadlock."""
    from moe_ref.ep.routed_step import MonolithicRoutedStep, overflow_policy

    # moe_ref's FP8 plan prices a larger cap in CAP001 messages (DeepGEMM's own buffer has another layout;
    # ``engine.buffer_bytes`` is its real size).
    policy = overflow_policy(cfg, group_size_and_rank(group)[0], options.replace(dispatch_fp8=True))
    policy.agree_to_build(group=group, device=comm_device(group, options.device))
    engine = DeepGemmMegaMoE(cfg, group, options.num_max_tokens_per_rank, gate_up_weight_e2FD, down_weight_eDF)
    return MonolithicRoutedStep(cfg, engine.group, policy, options.dtype, engine.device, engine)
