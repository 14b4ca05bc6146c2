"""Which implementation of each data-path op runs on a device: decided here, once, for the whole package.

| op               | CUDA                                  | CPU (and anything else)              |
|------------------|---------------------------------------|--------------------------------------|
| select_experts   | ``kernels.router_topk`` (Triton)      | ``kernels.router_topk_ref`` (torch: ``router.select_experts``) |
| routing_check    | ``kernels.routing_check`` (Triton)    | ``kernels.routing_check_ref`` (torch) |
| pre_dispatch     | ``kernels.pre_dispatch`` (Triton)     | ``kernels.pre_dispatch_ref`` (torch)  |
| ep_ops           | ``kernels.ep_*`` (Triton, no host sync)| ``moe_ref.kernels.native``: the compiled ``csrc`` ops (``torch.ops.moe_ref.*_cpu``), or the torch twins ``kernels.ep_*_ref`` when the library is not built or ``MOE_REF_NATIVE=0`` |

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


def uses_triton(device: torch.device | str) -> bool:
    """Whether the Triton kernels run on ``device`` (CUDA), rather than their torch twins."""
    return torch.device(device).type == "cuda"


def select_experts(logits_TE: torch.Tensor, *args, **kwargs):
    """``router.select_experts`` semantics (plus the optional ``nonfinite_flag``); the fused Triton kernel on CUDA."""
    return (kernels.router_topk if uses_triton(logits_TE.device) else kernels.router_topk_ref)(logits_TE, *args,
                                                                                              **kwargs)


def routing_check(topk_ids_TK: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``kernels.routing_check`` on CUDA, its twin elsewhere (same arguments): a flag, no host sync."""
    return (kernels.routing_check if uses_triton(topk_ids_TK.device) else kernels.routing_check_ref)(
        topk_ids_TK, *args, **kwargs)


def pre_dispatch(x_TD: torch.Tensor, *args, **kwargs):
    """``kernels.pre_dispatch`` on CUDA, its twin elsewhere (same arguments)."""
    return (kernels.pre_dispatch if uses_triton(x_TD.device) else kernels.pre_dispatch_ref)(x_TD, *args, **kwargs)


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
    from moe_ref.kernels import native  # the compiled CPU ops when built (it decides once, at import), else the twins

    return EPOps(native.ep_pre_dispatch, native.ep_dispatch, native.ep_combine_push, native.ep_combine_reduce,
                 on_device=False)
