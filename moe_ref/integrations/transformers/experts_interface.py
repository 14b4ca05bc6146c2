"""moe_ref's expert kernels as an entry of transformers' ExpertsInterface: ``experts_implementation="moe_ref"``.

    transformers' experts module forward(hidden_states [T, D], top_k_index [T, K], top_k_weights [T, K])
      --ALL_EXPERTS_FUNCTIONS["moe_ref"] = experts_forward-->
      the module's ExpertsRunner (built on first call, rebuilt when its weights or K change):
        a one-process routed step (moe_ref.ep.routed_step: local dispatch into an expert-major pool -> the Experts
        backend over the module's own gate_up_proj [E, 2F, D] / down_proj [E, D, F], no copy -> weighted fp32
        reduce in slot order; chunked above the cap)
      -> [T, D] in hidden_states' dtype

The Experts backend is moe_ref's ``experts_backend`` (``MOE_REF_EXPERTS_BACKEND``, else ``auto``: the torch loop on CPU,
Triton / the measured table on CUDA). The router stays transformers' own. This entry runs one process's experts:
under transformers' own expert parallelism (``DistributedConfig(ep_size > 1)``) it refuses (CFG031) and points to
``patch_model(model, group=...)``, moe_ref's expert-parallel path. A layout moe_ref's kernels do not run (biases,
interleaved or transposed gate/up, no gate, a post-expert norm, an activation other than SiLU) is CFG030.
Inference only: with autograd on, INP007.

Shape legend: T tokens of this rank, K top-k, E experts, D hidden width, F expert intermediate.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moe_ref.core.config import MoEConfig
from moe_ref.core.errors import ExpertsInterfaceParallelError, GradientNotSupportedError, UnsupportedModelError
from moe_ref.ep.options import EPOptions
from moe_ref.ep.routed_step import RoutedStep, make_modular_step
from moe_ref.experts import make_experts
from moe_ref.integrations.transformers.library import require_transformers

EXPERTS_IMPLEMENTATION = "moe_ref"
# transformers' layout flags (use_experts_implementation) and the value moe_ref's kernels need
_LAYOUT_NEEDS = (("is_concatenated", True), ("is_transposed", False), ("has_bias", False), ("has_gate", True),
                 ("has_post_expert_norm", False))
# transformers' hidden_act names -> moe_ref's activation (both SiLU-gated: act(gate) * up)
_ACTIVATIONS = {"silu": "silu", "swish": "silu"}
_RUNNER_ATTR = "_moe_ref_runner"


@dataclass
class ExpertsRunner:
    """One experts module's routed step, and what it was built for (rebuilt when that changes)."""

    step: RoutedStep
    key: tuple

    @staticmethod
    def key_of(module: nn.Module, num_topk: int) -> tuple:
        w = module.gate_up_proj
        return (w.data_ptr(), module.down_proj.data_ptr(), tuple(w.shape), w.dtype, w.device, num_topk)


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``"moe_ref"`` experts implementation: ``sum_j w[t, j] * Expert_{ids[t, j]}(x[t])`` with moe_ref's kernels.

    Args:
        self: a transformers 5.x experts module (``@use_experts_implementation``): ``gate_up_proj [E, 2F, D]``
            (gate rows, then up rows), ``down_proj [E, D, F]``, ``config.hidden_act``.
        hidden_states: ``[T, D]`` in the weights' dtype, on their device.
        top_k_index: ``[T, K]`` int expert ids.
        top_k_weights: ``[T, K]`` routing weights (any float dtype; summed in fp32).

    Returns:
        ``[T, D]`` in ``hidden_states``' dtype.

    Raises:
        ExpertsInterfaceParallelError (CFG031) under transformers' expert parallelism; UnsupportedModelError
        (CFG030) for a layout or activation moe_ref does not run; GradientNotSupportedError (INP007) with autograd
        on; the routed step's input errors (INP001-INP005).
    """
    _check_module(self)
    if torch.is_grad_enabled() and (hidden_states.requires_grad or self.gate_up_proj.requires_grad
                                    or self.down_proj.requires_grad):
        raise GradientNotSupportedError(
            f"experts_implementation='moe_ref' has no backward ({type(self).__name__}); run the model under "
            f"torch.no_grad() or torch.inference_mode() (generate() does), or pick another experts_implementation "
            f"for training")
    runner = _runner(self, top_k_index.shape[-1])
    return runner.step(hidden_states, top_k_index.long(), top_k_weights.float())


def _check_module(module: nn.Module) -> None:
    """CFG031 under transformers' expert parallelism; CFG030 for a layout or activation moe_ref does not run."""
    name = type(module).__name__
    if getattr(module, "_is_expert_parallel", False):
        raise ExpertsInterfaceParallelError(
            f"{name} is sharded by transformers' expert parallelism (DistributedConfig ep_size > 1); "
            f"experts_implementation='moe_ref' runs one process's experts. Load the model without distributed_config "
            f"and call moe_ref.integrations.transformers.patch_model(model, group=dist.group.WORLD)",
            experts_class=name)
    wrong = [f"{flag}={getattr(module, flag, need)}" for flag, need in _LAYOUT_NEEDS
             if getattr(module, flag, need) != need]
    activation = getattr(getattr(module, "config", None), "hidden_act", None)
    if activation not in _ACTIVATIONS:
        wrong.append(f"hidden_act={activation!r}")
    if wrong:
        raise UnsupportedModelError(
            f"{name}: experts_implementation='moe_ref' runs SiLU-gated experts stored as gate_up_proj [E, 2F, D] "
            f"(gate rows, then up rows) and down_proj [E, D, F] without biases; this module has {', '.join(wrong)}. "
            f"Keep transformers' own implementation for it (experts_implementation='grouped_mm')",
            experts_class=name)


def _runner(module: nn.Module, num_topk: int) -> ExpertsRunner:
    """The module's runner for its current weights and ``num_topk`` (built now if it has none, or they changed)."""
    key = ExpertsRunner.key_of(module, num_topk)
    runner = module.__dict__.get(_RUNNER_ATTR)
    if runner is None or runner.key != key:
        runner = ExpertsRunner(_build_step(module, num_topk), key)
        module.__dict__[_RUNNER_ATTR] = runner  # a plain attribute: not a submodule, not in the state dict
    return runner


def _build_step(module: nn.Module, num_topk: int) -> RoutedStep:
    """A one-process routed step over the module's own weights (the Experts backend holds them, no copy)."""
    gate_up_E2FD, down_EDF = module.gate_up_proj.detach(), module.down_proj.detach()
    num_experts, _, hidden = gate_up_E2FD.shape
    activation = _ACTIVATIONS[module.config.hidden_act]
    # the routing is done by the caller: the config describes only the experts' shapes and activation
    cfg = MoEConfig(num_experts=num_experts, num_topk=num_topk, hidden_size=hidden,
                    intermediate_size=down_EDF.shape[-1], scoring="softmax", use_selection_bias=False,
                    renormalize=False, activation=activation, name=type(module).__name__)
    options = EPOptions.resolve(overflow="chunk", dtype=gate_up_E2FD.dtype, device=gate_up_E2FD.device)
    with torch.inference_mode(False):
        experts = make_experts(options.experts_backend, gate_up_E2FD, down_EDF, activation)
        return make_modular_step(cfg, None, experts, options)


def register() -> None:
    """Register ``experts_forward`` as transformers' ``experts_implementation="moe_ref"`` (idempotent; done on import
    of ``moe_ref.integrations.transformers``). Raises ``OptionalDependencyError`` (ENV022) without transformers 5.x."""
    require_transformers()
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, experts_forward)
