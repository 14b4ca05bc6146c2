"""The experts registry: backend name -> ``Experts`` class. Backends register themselves
(``register_experts``); ``make_experts`` builds one by name.

Shape legend: Dx expert input width, F expert intermediate, e local experts."""
from __future__ import annotations

import importlib

import torch

from moe_ref.core.errors import InvalidConfigError, UnknownNameError
from moe_ref.experts.base import Experts, FP8ExpertWeights

# name -> an Experts subclass, or "module:Class" resolved on first use (importlib), so optional backends such as
# deep_gemm are imported only when asked for. Filled by the backend modules themselves.
_REGISTRY: dict[str, "type[Experts] | str"] = {}


def register_experts(name: str, target: "type[Experts] | str") -> None:
    """Make ``make_experts(name, ...)`` build ``target``: an ``Experts`` subclass, or ``"package.module:ClassName"``
    for a backend whose module should be imported only when asked for (an optional dependency such as deep_gemm)."""
    _REGISTRY[name] = target


def registered_backends() -> tuple[str, ...]:
    """Names ``make_experts`` accepts (``auto`` included)."""
    return tuple(_REGISTRY)


def experts_class(backend: str, device: torch.device | str = "cpu") -> type[Experts]:
    """The class of expert backend ``backend`` on ``device``, without building it: its ``segment_alignment`` and
    ``supports_fp8`` are what a layer plans with.

    ``auto`` is the torch loop on CPU; on CUDA, Triton, or where the measured table ranks another installed backend
    first in some call regime, the ``moe_ref.experts.auto`` class holding both (``Experts.resolve_class``).

    Args:
        backend: a registered name (``auto``, ``torch``, ``grouped_mm``, ``triton``, ``deep_gemm``, ...).
        device: where the weights live (decides ``auto``).

    Returns:
        The ``Experts`` subclass. Raises ``UnknownNameError`` (CFG006) for another name.
    """
    if backend not in _REGISTRY:
        raise UnknownNameError(f"experts backend={backend!r}; supported: {', '.join(_REGISTRY)}")
    target = _REGISTRY[backend]
    if isinstance(target, str):
        module_name, class_name = target.split(":")
        target = getattr(importlib.import_module(module_name), class_name)
    return target.resolve_class(torch.device(device))


def make_experts(backend: str, gate_up_weight_e2FD: torch.Tensor, down_weight_eDF: torch.Tensor,
                 activation: str = "silu", situ_beta: float = 4.0, situ_linear_beta: float = 25.0, *,
                 fp8: bool = False, fp8_weights: FP8ExpertWeights | None = None) -> Experts:
    """Build the expert backend ``backend`` (see ``experts_class``; ``auto`` decides on the weights' device).

    Args:
        backend: a registered name (see ``experts_class``).
        gate_up_weight_e2FD: ``[e, 2F, Dx]`` this rank's experts, gate rows then up rows.
        down_weight_eDF: ``[e, Dx, F]``.
        activation, situ_beta, situ_linear_beta: see ``moe_ref.core.activations``.
        fp8: fp8 e4m3 weights with 128x128 block scales, quantized once at construction; only for
            backends with ``supports_fp8`` (triton, deep_gemm, auto), else ``InvalidConfigError`` (CFG007).
        fp8_weights: weights already quantized so (``FP8ExpertWeights``, stacked or interleaved gate/up) to run as
            given instead of quantizing: backends built from the same object share one copy. Implies ``fp8``.

    Returns:
        The ``Experts`` instance.
    """
    cls = experts_class(backend, gate_up_weight_e2FD.device)
    args = (gate_up_weight_e2FD, down_weight_eDF, activation, situ_beta, situ_linear_beta)
    if cls.supports_fp8:  # fp8_weights goes only to the constructors asked to take it (a user's backend may not)
        return cls(*args, fp8=fp8) if fp8_weights is None else cls(*args, fp8=True, fp8_weights=fp8_weights)
    if fp8 or fp8_weights is not None:
        raise InvalidConfigError(f"experts backend {cls.name!r} has no fp8 weights (fp8=True); use 'triton', "
                                 f"'deep_gemm' or 'auto', or fp8=False", field="fp8")
    return cls(*args)
