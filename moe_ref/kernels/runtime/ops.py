"""Which implementation of each data-path op runs on a device: decided here, once, for the whole package.

| op               | CUDA                                  | CPU (and anything else)              |
|------------------|---------------------------------------|--------------------------------------|
| router_logits    | ``kernels.router_logits`` (cuBLAS: bf16/fp16 operands, fp32 sums and output) | ``kernels.router_logits_ref`` (torch: ``router.router_logits``, fp32) |
| select_experts   | ``kernels.router_topk`` (Triton)      | ``kernels.router_topk_ref`` (torch: ``router.select_experts``) |
| routing_check    | ``kernels.routing_check`` (Triton)    | ``kernels.routing_check_ref`` (torch) |
| dense_mlp        | ``kernels.grouped_mlp``, one expert (Triton) | ``activations.dense_mlp`` (torch)  |
| pre_dispatch     | ``kernels.pre_dispatch`` (Triton)     | ``kernels.pre_dispatch_ref`` (torch)  |
| quantize_rows_fp8 | ``kernels.quantize_rows_fp8`` (Triton, one launch) | ``kernels.quantize_rows_fp8_ref`` (torch) |
| pool_row_experts, zero_rows_outside_segments | ``kernels.pool_rows`` (Triton) | their ``_ref`` twins (torch) |
| ep_ops           | ``kernels.ep_*`` (Triton, no host sync)| ``moe_ref.kernels.runtime.native``: the compiled ``csrc`` ops (``torch.ops.moe_ref.*_cpu``), or the torch twins ``kernels.ep_*_ref`` when the library is not built or ``MOE_REF_NATIVE=0`` |

``ep_ops`` are the device-side EP phases (pre-dispatch, dispatch, combine push, reduce) the ``symm`` transport
runs over peers' mapped buffers (``kernels.ep_chunk`` shows the order); all three implementations write the
same bytes (tests/interpreter, tests/unit/test_native_ops.py, tests/gpu).

Each Triton kernel and its torch twin take the same arguments and are tested against each other
(tests/interpreter, tests/gpu).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from moe_ref import kernels
from moe_ref.core.activations import dense_mlp as _dense_mlp_ref


def uses_triton(device: torch.device | str) -> bool:
    """Whether the Triton kernels run on ``device`` (CUDA), rather than their torch twins."""
    return torch.device(device).type == "cuda"


def router_logits(x_TD: torch.Tensor, gate_weight_ED: torch.Tensor) -> torch.Tensor:
    """``[T, D] x [E, D] -> [T, E]`` fp32 gate logits: cuBLAS on CUDA (one GEMM: two kernels where it
    splits K), the fp32 torch GEMM elsewhere."""
    return (kernels.router_logits if uses_triton(x_TD.device) else kernels.router_logits_ref)(x_TD, gate_weight_ED)


def select_experts(logits_TE: torch.Tensor, *args, **kwargs):
    """``router.select_experts`` semantics (plus the optional ``nonfinite_flag``); the fused Triton kernel on CUDA."""
    return (kernels.router_topk if uses_triton(logits_TE.device) else kernels.router_topk_ref)(logits_TE, *args,
                                                                                              **kwargs)


def routing_check(topk_ids_TK: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``kernels.routing_check`` on CUDA, its twin elsewhere (same arguments): a flag, no host sync."""
    return (kernels.routing_check if uses_triton(topk_ids_TK.device) else kernels.routing_check_ref)(
        topk_ids_TK, *args, **kwargs)


def dense_mlp(x_TD: torch.Tensor, gate_up_weight_2SD: torch.Tensor, down_weight_DS: torch.Tensor,
              activation: str = "silu", situ_beta: float = 4.0, situ_linear_beta: float = 25.0,
              add_TD: torch.Tensor | None = None, batch_invariant: bool = False) -> torch.Tensor:
    """One gated MLP over all rows (the shared experts): ``[T, D] -> [T, D]`` in ``x_TD``'s dtype, plus ``add_TD``
    (``[T, D]`` of x's dtype: the routed experts' output) when given.

    On CUDA the grouped MLP kernel with one expert owning every row: two launches (the activation fused into the
    first GEMM, on its fp32 accumulators; ``add_TD`` added in the second GEMM's epilogue to its fp32 sums, rounded
    once, where x's dtype is the weights'), against six torch ops, two cuBLAS calls and the add of
    ``activations.dense_mlp`` + ``add_TD`` (its twin: same math, which rounds each GEMM's output to the weights'
    dtype, so the two differ by those roundings). ``batch_invariant``: the kernel launches tiles of one bits class
    only (``grouped_mlp``'s argument: a row's bits do not depend on T).
    """
    weights_dtype, num_tokens = gate_up_weight_2SD.dtype, x_TD.shape[0]
    kernel = (uses_triton(x_TD.device) and weights_dtype in (torch.bfloat16, torch.float16) and num_tokens > 0
              and gate_up_weight_2SD.is_contiguous() and down_weight_DS.is_contiguous())
    fused_add = kernel and add_TD is not None and add_TD.dtype == weights_dtype == x_TD.dtype
    if kernel:
        layout = _one_expert_layout(num_tokens, x_TD.device)
        y_TD = kernels.grouped_mlp(x_TD.to(weights_dtype).contiguous(), gate_up_weight_2SD.unsqueeze(0),
                                   down_weight_DS.unsqueeze(0), layout[:1], layout[1:2], activation, situ_beta,
                                   situ_linear_beta, num_rows_hint=num_tokens, zero_unused_rows=False,
                                   add_PDx=add_TD.contiguous() if fused_add else None,
                                   batch_invariant=batch_invariant).to(x_TD.dtype)
    else:
        y_TD = _dense_mlp_ref(x_TD, gate_up_weight_2SD, down_weight_DS, activation, situ_beta, situ_linear_beta)
    # otherwise one add in x's dtype: torch adds bf16/fp16 in fp32 and rounds once
    return y_TD if add_TD is None or fused_add else add_TD + y_TD


# (device, T) -> [0, T] int64 on that device; cleared past _MAX_LAYOUTS entries (prefill meets many T)
_ONE_EXPERT_LAYOUTS: dict[tuple[torch.device, int], torch.Tensor] = {}
_MAX_LAYOUTS = 4096


def _one_expert_layout(num_tokens: int, device: torch.device) -> torch.Tensor:
    """``[2]`` int64 ``[0, T]`` on ``device`` (T >= 1): the row start and the rows of one expert owning every row.

    Kept per (device, T), so that a call launches no kernel to build it; read-only. One made inside a CUDA-graph
    capture is not kept: its values are written when the graph replays, not before."""
    key = (device, num_tokens)
    layout = _ONE_EXPERT_LAYOUTS.get(key)
    if layout is None:
        with torch.inference_mode(False):  # a normal tensor, usable in and out of inference mode
            layout = torch.arange(0, 2 * num_tokens, max(num_tokens, 1), device=device)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            if len(_ONE_EXPERT_LAYOUTS) >= _MAX_LAYOUTS:
                _ONE_EXPERT_LAYOUTS.clear()
            _ONE_EXPERT_LAYOUTS[key] = layout
    return layout


def pre_dispatch(x_TD: torch.Tensor, *args, **kwargs):
    """``kernels.pre_dispatch`` on CUDA, its twin elsewhere (same arguments)."""
    return (kernels.pre_dispatch if uses_triton(x_TD.device) else kernels.pre_dispatch_ref)(x_TD, *args, **kwargs)


def quantize_rows_fp8(x_PDx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[P, Dx]`` activation-dtype rows -> (fp8 e4m3 ``[P, Dx]``, fp32 ``[P, Db]``) per row per 128 columns
    (``kernels.quantize_rows``): one launch on CUDA, the torch twin elsewhere; the same bits."""
    return (kernels.quantize_rows_fp8 if uses_triton(x_PDx.device) else kernels.quantize_rows_fp8_ref)(x_PDx)


def pool_row_experts(row_start_e: torch.Tensor, num_rows_e: torch.Tensor, num_pool_rows: int) -> torch.Tensor:
    """``[P]`` int32: the local expert of each pool row, -1 outside every segment (``kernels.pool_rows``); no host
    sync."""
    return (kernels.pool_row_experts if uses_triton(row_start_e.device) else kernels.pool_row_experts_ref)(
        row_start_e, num_rows_e, num_pool_rows)


def zero_rows_outside_segments(y_PD: torch.Tensor, row_expert_P: torch.Tensor) -> torch.Tensor:
    """Zero, in place, the rows of ``y_PD`` whose ``row_expert_P`` is < 0 (``kernels.pool_rows``); returns it."""
    return (kernels.zero_rows_outside_segments if uses_triton(y_PD.device) else kernels.zero_rows_outside_segments_ref)(
        y_PD, row_expert_P)


@dataclass(frozen=True)
class EPOps:
    """The device-side EP phases of one implementation (each with the Triton kernel's signature)."""

    pre_dispatch: Callable
    dispatch: Callable
    combine_push: Callable
    combine_reduce: Callable
    on_device: bool  # True: Triton kernels (no host sync); False: the torch twins (host syncs in the waits)


def ep_ops(device: torch.device | str) -> EPOps:
    """The Triton EP kernels on CUDA; on CPU the compiled ops, or the torch twins without them."""
    if uses_triton(device):
        return EPOps(kernels.ep_pre_dispatch, kernels.ep_dispatch, kernels.ep_combine_push, kernels.ep_combine_reduce,
                     on_device=True)
    from moe_ref.kernels.runtime import native  # the compiled CPU ops when built (it decides once, at import), else the twins

    return EPOps(native.ep_pre_dispatch, native.ep_dispatch, native.ep_combine_push, native.ep_combine_reduce,
                 on_device=False)
