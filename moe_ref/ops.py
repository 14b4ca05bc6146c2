"""Which implementation of each data-path op runs on a device: decided here, once, for the whole package.

| op               | CUDA                                  | CPU (and anything else)              |
|------------------|---------------------------------------|--------------------------------------|
| select_experts   | ``kernels.router_topk`` (Triton)      | ``router.select_experts`` (torch)     |
| pre_dispatch     | ``kernels.pre_dispatch`` (Triton)     | ``kernels.pre_dispatch_ref`` (torch)  |
| combine_reduce   | ``kernels.combine_reduce`` (Triton)   | ``kernels.combine_reduce_ref`` (torch)|

Each Triton kernel and its torch twin take the same arguments and are tested against each other
(tests/interpreter, tests/gpu). A compiled ``csrc`` op for the CPU would be chosen here too.
"""
from __future__ import annotations

import torch

from moe_ref import kernels
from moe_ref.router import select_experts as _select_experts_ref


def uses_triton(device: torch.device | str) -> bool:
    """Whether the Triton kernels run on ``device`` (CUDA), rather than their torch twins."""
    return torch.device(device).type == "cuda"


def select_experts(logits_TE: torch.Tensor, *args, **kwargs):
    """``router.select_experts`` semantics; the fused Triton kernel on CUDA."""
    return (kernels.router_topk if uses_triton(logits_TE.device) else _select_experts_ref)(logits_TE, *args, **kwargs)


def pre_dispatch(x_TD: torch.Tensor, *args, **kwargs):
    """``kernels.pre_dispatch`` on CUDA, its twin elsewhere (same arguments)."""
    return (kernels.pre_dispatch if uses_triton(x_TD.device) else kernels.pre_dispatch_ref)(x_TD, *args, **kwargs)


def combine_reduce(combine_KCD: torch.Tensor, *args, **kwargs):
    """``kernels.combine_reduce`` on CUDA, its twin elsewhere (same arguments)."""
    return (kernels.combine_reduce if uses_triton(combine_KCD.device) else kernels.combine_reduce_ref)(
        combine_KCD, *args, **kwargs)
