"""What is wrong with one call of a ``MegaMoE`` on this rank, found before anything runs (step 1 of its forward).

A problem is returned, not raised: the routed step's per-call collective raises it on every rank of the EP group
(``moe_ref.ep.overflow``), so one rank's bad input never leaves its peers waiting.

    input_problem(layer, x)   shape (INP001), dtype (INP002), device (INP003), weights not all loaded (INP006),
                              a gradient requested (INP007)
    bound_problem(bound)      max_num_tokens neither None nor an int >= 0 (INP008)

Shape legend: T tokens of this rank, D hidden width.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moe_ref.core.errors import (ArgumentTypeError, DeviceError, DTypeError, GradientNotSupportedError, InputError,
                                 ShapeError, WeightsNotLoadedError)
from moe_ref.layer.weights import missing_weights


def grad_requested(layer: nn.Module, x_TD: Any) -> bool:
    """Whether this call asks for a gradient: grad mode on and the input or a parameter requiring grad."""
    return torch.is_grad_enabled() and ((isinstance(x_TD, torch.Tensor) and x_TD.requires_grad)
                                        or any(p.requires_grad for p in layer.parameters()))


def input_problem(layer: nn.Module, x_TD: Any, wants_grad: bool | None = None) -> InputError | None:
    """This rank's problem with ``x_TD`` (``[T, D]`` in the layer's dtype, on its device) and the layer's state, or
    None. ``wants_grad``: decided by the caller (the compiled op runs without autograd), else ``grad_requested``."""
    width, dtype, device = layer.cfg.hidden_size, layer.options.dtype, layer.gate_weight.device
    if not isinstance(x_TD, torch.Tensor) or x_TD.dim() != 2 or x_TD.shape[1] != width:
        shape = tuple(x_TD.shape) if isinstance(x_TD, torch.Tensor) else type(x_TD).__name__
        return ShapeError(f"hidden_states has shape {shape}; expected [num_tokens, {width}] "
                          f"(flatten batch and sequence: x.view(-1, {width}))")
    if x_TD.dtype != dtype:
        return DTypeError(f"hidden_states dtype {x_TD.dtype} != layer dtype {dtype}; cast with x.to({dtype}) or "
                          f"build the layer with dtype={x_TD.dtype}")
    if x_TD.device != device:
        return DeviceError(f"hidden_states on {x_TD.device}, layer on {device}; move with x.to('{device}')")
    missing = missing_weights(layer)
    if missing:
        return WeightsNotLoadedError(f"rank {layer.rank}: the layer's weights were never loaded (not written yet: "
                                     f"{', '.join(missing)}); call load_hf_weights(path, layer_idx), load_weights(...) "
                                     f"or load_state_dict(state) with every tensor first, or build it with seed=N for "
                                     f"random test weights")
    if grad_requested(layer, x_TD) if wants_grad is None else wants_grad:
        return GradientNotSupportedError(
            "MegaMoE has no backward (rows cross ranks through buffers autograd cannot follow); run it under "
            "torch.no_grad() or torch.inference_mode(), or pass x.detach()")
    return None


def bound_ok(bound: Any) -> bool:
    """``max_num_tokens`` is None or an int >= 0 (a bool is not a count)."""
    return bound is None or (isinstance(bound, int) and not isinstance(bound, bool) and bound >= 0)


def bound_problem(bound: Any) -> ArgumentTypeError | None:
    """``ArgumentTypeError`` (INP008) unless ``bound_ok(bound)``."""
    if bound_ok(bound):
        return None
    return ArgumentTypeError(f"max_num_tokens={bound!r} ({type(bound).__name__}); pass an int >= 0 bounding the "
                             f"rows of every rank, or None, on every rank alike", field="max_num_tokens")
