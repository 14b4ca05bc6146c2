"""The experts registry: backend name -> ``Experts`` class. Backends register themselves
(``register_experts``); ``make_experts`` builds one by name.

Shape legend: Dx expert input width, F expert intermediate, e local experts."""
from __future__ import annotations

import importlib

import torch

from moe_ref.core.config import MoEConfig
from moe_ref.core.errors import ExpertsFeatureError, InvalidConfigError, UnknownNameError
from moe_ref.experts.base import Experts, FP8ExpertWeights, expert_math_problem

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


def backends_computing(activation: str, expert_bias: bool, device: torch.device | str = "cpu") -> list[str]:
    """The registered backends (resolved on ``device``; those imported only on demand are not imported here) whose
    experts compute ``activation`` and, with ``expert_bias``, the experts' biases."""
    out = []
    for name, target in _REGISTRY.items():
        if isinstance(target, str) or name == "auto" or target.unavailable_reason() is not None:
            continue
        if expert_math_problem(target.resolve_class(torch.device(device)), activation, expert_bias) is None:
            out.append(name)
    return out


def check_experts_support(cfg: MoEConfig, backend: str, device: torch.device | str = "cpu") -> None:
    """Raise ``ExpertsFeatureError`` (ENV020) when the experts of ``backend`` on ``device`` do not compute ``cfg``'s
    expert math (its activation, its expert biases), naming the family, the feature and the backends that do; what
    a layer calls at construction, so that no call runs another model's experts.

    Args:
        cfg: the model's block (``cfg.activation``, ``cfg.expert_bias``, ``cfg.family``).
        backend: a registered name (``auto`` is checked as the class it stands for on ``device``).
        device: where the experts will run.
    """
    cls = experts_class(backend, device)
    problem = expert_math_problem(cls, cfg.activation, cfg.expert_bias)
    if problem is None:
        return
    others = backends_computing(cfg.activation, cfg.expert_bias, device)
    via = f" (experts_backend={backend!r} runs {cls.name!r} on {torch.device(device).type})" if cls.name != backend else ""
    raise ExpertsFeatureError(
        f"{cfg.name} (family {cfg.family}): experts backend {cls.name!r}{via} {problem}; the backends that compute "
        f"this family's experts: {', '.join(others) or 'none registered'}: pass experts_backend="
        f"{(others[-1] if others else 'torch')!r}", backend=cls.name, family=cfg.family)


def make_experts(backend: str, gate_up_weight_e2FD: torch.Tensor, down_weight_eDF: torch.Tensor,
                 activation: str = "silu", situ_beta: float = 4.0, situ_linear_beta: float = 25.0, *,
                 fp8: bool = False, fp8_weights: FP8ExpertWeights | None = None, swiglu_alpha: float = 1.702,
                 swiglu_limit: float = 7.0, gate_up_bias_e2F: torch.Tensor | None = None,
                 down_bias_eD: torch.Tensor | None = None) -> Experts:
    """Build the expert backend ``backend`` (see ``experts_class``; ``auto`` decides on the weights' device).

    Args:
        backend: a registered name (see ``experts_class``).
        gate_up_weight_e2FD: ``[e, 2F, Dx]`` this rank's experts, gate rows then up rows.
        down_weight_eDF: ``[e, Dx, F]``.
        activation, situ_beta, situ_linear_beta, swiglu_alpha, swiglu_limit: see ``moe_ref.core.activations``.
        fp8: fp8 e4m3 weights with 128x128 block scales, quantized once at construction; only for
            backends with ``supports_fp8`` (triton, deep_gemm, auto), else ``InvalidConfigError`` (CFG007).
        fp8_weights: weights already quantized so (``FP8ExpertWeights``, stacked or interleaved gate/up) to run as
            given instead of quantizing: backends built from the same object share one copy. Implies ``fp8``.
        gate_up_bias_e2F, down_bias_eD: the experts' biases ``[e, 2F]`` (gate, then up) and ``[e, Dx]`` (gpt-oss),
            or None.

    Returns:
        The ``Experts`` instance. Raises ``ExpertsFeatureError`` (ENV020) when the backend does not compute the
        activation or the biases (``Experts.activations``, ``Experts.supports_expert_bias``).
    """
    cls = experts_class(backend, gate_up_weight_e2FD.device)
    has_bias = gate_up_bias_e2F is not None or down_bias_eD is not None
    problem = expert_math_problem(cls, activation, has_bias)
    if problem is not None:
        others = backends_computing(activation, has_bias, gate_up_weight_e2FD.device)
        raise ExpertsFeatureError(f"experts backend {cls.name!r} {problem}; backends that do: {', '.join(others)}",
                                  backend=cls.name)
    args = (gate_up_weight_e2FD, down_weight_eDF, activation, situ_beta, situ_linear_beta)
    # the newer keywords go only to constructors asked to take them (a user's backend may predate them)
    extras = dict(swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit, gate_up_bias_e2F=gate_up_bias_e2F,
                  down_bias_eD=down_bias_eD) if activation == "swigluoai" or has_bias else {}
    if cls.supports_fp8:  # fp8_weights goes only to the constructors asked to take it (a user's backend may not)
        return cls(*args, fp8=fp8, **extras) if fp8_weights is None else \
            cls(*args, fp8=True, fp8_weights=fp8_weights, **extras)
    if fp8 or fp8_weights is not None:
        raise InvalidConfigError(f"experts backend {cls.name!r} has no fp8 weights (fp8=True); use 'triton', "
                                 f"'deep_gemm' or 'auto', or fp8=False", field="fp8")
    return cls(*args, **extras)
