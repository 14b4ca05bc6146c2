"""The MoE block around its routed step: routing before it, the Kimi-K3 latent path and shared experts after.

    x [T, D] --route (gate GEMM, fp32 sums; family top-k)--> topk_ids [T, K] int64, topk_weights [T, K] fp32
      --expert_input: (Kimi-K3) latent_down--> z [T, Dx]
      --routed step (EP layer: moe_ref.ep.routed_step; oracle: reference.routed_experts_reference)--> routed [T, Dx]
      --finish: (Kimi-K3) RMSNorm over the FULL cross-rank sum, latent_up; + shared experts (ops.dense_mlp; the sum
      rounded once)--> y [T, D]

Both the EP layer (``MegaMoE``) and the single-process oracle (``reference.reference_moe``) are this
composition with a different routed step, so they cannot drift apart.

Shape legend: T tokens, D hidden, L latent width (Kimi-K3), Dx expert input width (D, or the latent L for
Kimi-K3), E experts, K top-k, S shared-MLP intermediate.
"""
from __future__ import annotations

from typing import Callable

import torch

from moe_ref.kernels.runtime import ops
from moe_ref.core.config import MoEConfig
from moe_ref.ep import batch_invariant as batch_invariant_ops
from moe_ref.ep.device_checks import DeviceChecks
from moe_ref.core.errors import DTypeError, NonFiniteError, ShapeError
from moe_ref.core.fixed_chunks import in_fixed_chunks
from moe_ref.core.router import RouterOutput, non_finite_logits_error
from moe_ref.core.weights import MoEWeights

# (expert input [T, Dx], topk_ids [T, K] int64, topk_weights [T, K] fp32) -> routed sum [T, Dx] in input dtype
RoutedFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def route_unchecked(x_TD: torch.Tensor, gate_weight_ED: torch.Tensor, cfg: MoEConfig,
                    bias_E: torch.Tensor | None = None, *, check_values: bool = True,
                    device_checks: DeviceChecks | None = None, router_bias_E: torch.Tensor | None = None,
                    batch_invariant: bool = False) -> tuple[RouterOutput, NonFiniteError | None]:
    """Route with ``cfg``'s family semantics, returning (not raising) the NaN/inf-logits problem.

    Args:
        x_TD: ``[T, D]`` hidden states (any float dtype; the gate GEMM sums in fp32: ``ops.router_logits``).
        gate_weight_ED: ``[E, D]``.
        bias_E: ``[E]`` fp32 selection-only bias (used when ``cfg.use_selection_bias``).
        router_bias_E: ``[E]`` the gate Linear's bias, added to the logits in fp32 (``cfg.router_bias``: gpt-oss);
            required then, ignored otherwise.
        batch_invariant: the gate GEMM on fixed tiles (``moe_ref.ep.batch_invariant``); top-k is row-wise anyway.

    Returns:
        ``RouterOutput(topk_ids_TK [T, K] int64, topk_weights_TK [T, K] fp32)`` and ``NonFiniteError`` (INP004)
        or None. NOTE: syncs the host once, unless ``check_values=False`` (CUDA-graph capture), which skips the
        NaN/inf check, or ``device_checks`` is given: the check is then added there (no sync; the EP layer reads it
        in its per-call collective) and the problem returned is None.
    """
    if x_TD.dim() != 2 or x_TD.shape[1] != gate_weight_ED.shape[1]:
        raise ShapeError(f"hidden states {tuple(x_TD.shape)} do not match the gate weight "
                         f"{tuple(gate_weight_ED.shape)}: expected [T, {gate_weight_ED.shape[1]}]")
    if not x_TD.is_floating_point():
        raise DTypeError(f"hidden states have dtype {x_TD.dtype}; expected a floating dtype")
    logits_TE = (batch_invariant_ops.router_logits if batch_invariant else ops.router_logits)(x_TD, gate_weight_ED)
    if cfg.router_bias:
        if router_bias_E is None:
            raise ShapeError(f"{cfg.name} ({cfg.family}) has a router bias [{cfg.num_experts}] but none was given "
                             f"(router_bias_E=None): pass the gate's bias (MoEWeights.router_bias_E)")
        logits_TE = logits_TE + router_bias_E.float()[None, :]
    problem, nonfinite_flag = None, None
    if check_values and device_checks is not None:  # raised by the router kernel itself: no launch of its own
        nonfinite_flag = device_checks.slot(logits_TE.device, lambda: _flagged_logits_error(logits_TE))
    elif check_values:
        problem = non_finite_logits_error(logits_TE)
    topk_ids_TK, topk_weights_TK = ops.select_experts(
        logits_TE, cfg.num_topk, cfg.scoring, bias_E if cfg.use_selection_bias else None, cfg.num_groups,
        cfg.num_topk_groups, cfg.renormalize, cfg.routed_scaling_factor, nonfinite_flag=nonfinite_flag,
        group_score=cfg.group_score)
    return RouterOutput(topk_ids_TK, topk_weights_TK), problem


def _flagged_logits_error(logits_TE: torch.Tensor) -> NonFiniteError:
    """The error of a raised NaN/inf-logits flag (exact per logit): the bad tokens named from ``logits_TE``, or, where
    a later replay of the same CUDA graph has overwritten them already (``moe_ref.eager_graphs``), without them."""
    return non_finite_logits_error(logits_TE) or NonFiniteError(
        f"router logits were NaN/inf in an earlier call of {logits_TE.shape[0]} tokens (replayed from the layer's "
        f"CUDA graph, whose logits a later call has overwritten since); the hidden states or gate weight hold "
        f"non-finite values")


def route(x_TD: torch.Tensor, gate_weight_ED: torch.Tensor, cfg: MoEConfig, bias_E: torch.Tensor | None = None,
          *, check_finite: bool = True, router_bias_E: torch.Tensor | None = None) -> RouterOutput:
    """``route_unchecked`` that raises ``NonFiniteError`` (INP004) on NaN/inf logits when ``check_finite``."""
    output, problem = route_unchecked(x_TD, gate_weight_ED, cfg, bias_E, router_bias_E=router_bias_E)
    if check_finite and problem is not None:
        raise problem
    return output


def expert_input(x_TD: torch.Tensor, weights: MoEWeights, cfg: MoEConfig, *,
                 batch_invariant: bool = False) -> torch.Tensor:
    """What the routed experts see: ``x_TD`` itself, or (Kimi-K3) ``x_TD @ latent_down^T`` ``[T, L]`` (on fixed
    tiles when ``batch_invariant``).

    Raises ``ShapeError`` (INP001) when ``weights`` lacks a tensor ``cfg``'s family needs (gpt-oss's expert biases,
    Qwen2-MoE's shared-expert gate): without it the block would compute another model."""
    missing = missing_family_weights(weights, cfg)
    if missing:
        raise ShapeError(f"{cfg.name} ({cfg.family}) needs {', '.join(missing)}, which the weights do not hold "
                         f"(None): load them with the checkpoint (load_moe_weights reads every family's names)")
    if cfg.latent_dim is None:
        return x_TD
    return _linear(x_TD, weights.latent_down_weight_LD, x_TD.dtype, batch_invariant)


def _linear(x_TI: torch.Tensor, weight_OI: torch.Tensor, out_dtype: torch.dtype, batch_invariant: bool) -> torch.Tensor:
    """``x @ weight^T`` ``[T, O]``: torch's GEMM in ``out_dtype``, or on fixed tiles (``batch_invariant``)."""
    if batch_invariant:
        return batch_invariant_ops.matmul(x_TI.to(out_dtype), weight_OI, out_dtype)
    return x_TI.to(out_dtype) @ weight_OI.t().to(out_dtype)


def missing_family_weights(weights: MoEWeights, cfg: MoEConfig) -> list[str]:
    """The ``MoEWeights`` fields ``cfg``'s family needs beyond the router and experts that ``weights`` holds as None:
    ``router_bias_E`` (gpt-oss), ``gate_up_bias_E2F`` and ``down_bias_ED`` (gpt-oss's experts, checked where the
    experts are held: ``weights.gate_up_weight_E2FD`` not None), ``shared_gate_weight_D`` (Qwen2-MoE)."""
    needed = [("router_bias_E", cfg.router_bias), ("shared_gate_weight_D", cfg.shared_expert_gate)]
    if weights.gate_up_weight_E2FD is not None:
        needed += [("gate_up_bias_E2F", cfg.expert_bias), ("down_bias_ED", cfg.expert_bias)]
    return [name for name, wanted in needed if wanted and getattr(weights, name) is None]


def rms_norm(x_TL: torch.Tensor, weight_L: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, output in ``x_TL``'s dtype."""
    x32 = x_TL.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight_L.float()).to(x_TL.dtype)


def finish(routed_TDx: torch.Tensor, x_TD: torch.Tensor, weights: MoEWeights, cfg: MoEConfig, *,
           batch_invariant: bool = False) -> torch.Tensor:
    """After the routed step: (Kimi-K3) RMSNorm of the full sum + latent up-projection, + shared experts (every GEMM
    on fixed tiles when ``batch_invariant``: ``moe_ref.ep.batch_invariant``).

    Returns ``[T, D]`` in ``x_TD``'s dtype.
    """
    routed = routed_TDx
    if cfg.latent_dim is not None:
        if cfg.latent_norm:
            routed = rms_norm(routed, weights.latent_norm_weight_L, cfg.rms_norm_eps)
        routed = _linear(routed, weights.latent_up_weight_DL, routed.dtype, batch_invariant)
    if not cfg.has_shared_experts:
        return routed
    shared_mlp = batch_invariant_ops.dense_mlp if batch_invariant else ops.dense_mlp  # the former: fixed tiles
    shared_args = (x_TD, weights.shared_gate_up_weight_2SD, weights.shared_down_weight_DS, cfg.activation,
                   cfg.situ_beta, cfg.situ_linear_beta)
    if cfg.shared_expert_gate:  # Qwen2-MoE: sigmoid(x @ w) scales the shared output per token, in fp32
        gate_logit_T1 = _linear(x_TD, weights.shared_gate_weight_D[None, :], torch.float32, batch_invariant)
        # [T, 1]: T elements, whose vectorized sigmoid leaves a tail to scalar code: in fixed chunks when invariant
        gate_T1 = in_fixed_chunks(torch.sigmoid, gate_logit_T1) if batch_invariant else torch.sigmoid(gate_logit_T1)
        return (routed.float() + gate_T1 * shared_mlp(*shared_args).float()).to(x_TD.dtype)
    if batch_invariant:  # one add in x's dtype (fp32 inside, rounded once)
        return routed.to(x_TD.dtype) + shared_mlp(*shared_args)
    # the shared experts' MLP with the routed output added (on CUDA in its last GEMM's epilogue: no launch of its own)
    return ops.dense_mlp(*shared_args, add_TD=routed.to(x_TD.dtype))


def moe_block(x_TD: torch.Tensor, weights: MoEWeights, cfg: MoEConfig, routed_fn: RoutedFn,
              *, check_finite: bool = True) -> torch.Tensor:
    """One MoE block in one process: ``route``, ``expert_input``, ``routed_fn``, ``finish``. Returns ``[T, D]``."""
    topk_ids_TK, topk_weights_TK = route(x_TD, weights.gate_weight_ED, cfg, weights.bias_E, check_finite=check_finite,
                                         router_bias_E=weights.router_bias_E)
    return finish(routed_fn(expert_input(x_TD, weights, cfg), topk_ids_TK, topk_weights_TK), x_TD, weights, cfg)
