"""Before a ``MegaMoE`` exists: the config it is built from, its arguments, and the one collective of its construction.

    MegaMoE(cfg, group, seed=..., device=..., **options)
      as_config(cfg)               a MoEConfig from itself, a preset name, a config.json path or folder, or a dict
      check_group(group)           None or a ProcessGroup, else INP009 (local: no group to agree over)
      layer_device(device)         'cpu:N' -> 'cpu' (the one CPU device, as CPU tensors report it)
      EPOptions.resolve(...)       every option once (moe_ref.ep.options)
      local_problem(seed, options) a seed that is not an int (INP009), an experts backend that cannot run here (ENV001)
      agree_on_construction(...)   ONE collective: every rank's local problem, then config + options, then the mega
                                   choice, so every rank raises the same coded error (or none) and takes the same path
"""
from __future__ import annotations

import dataclasses
import logging
import numbers
import os
from typing import Any, Mapping

import torch
import torch.distributed as dist

from moe_ref.core.config import PRESETS, MoEConfig, is_hf_config_object, preset
from moe_ref.core.errors import (BackendUnavailableError, ConfigFileError, ConstructorArgumentTypeError,
                                 InvalidConfigError, MoERefError, ShapeUnsupportedError)
from moe_ref.ep.distributed import (check_fields_agree, gather_objects, group_size_and_rank, problem_of,
                                    raise_agreed_problem)
from moe_ref.ep import batch_invariant
from moe_ref.ep.options import EPOptions
from moe_ref.experts import experts_class
from moe_ref.experts.registry import check_experts_support
from moe_ref.core.errors import ExpertsFeatureError
from moe_ref.kernels.runtime._triton_utils import is_interpreter

logger = logging.getLogger(__name__)


def as_config(cfg: MoEConfig | str | os.PathLike | Mapping[str, Any]) -> MoEConfig:
    """A ``MoEConfig`` from itself, a preset name, a config.json path (or its folder), or an HF config dict.

    A string that names nothing on disk is a preset name, unless it looks like a path (it holds a path separator or
    ends in ``.json``): that is reported as the missing file it names (``ConfigFileError``, CFG010), not as an
    unknown preset."""
    if isinstance(cfg, MoEConfig):
        return cfg
    if not isinstance(cfg, (str, os.PathLike, Mapping)) and not is_hf_config_object(cfg):
        raise InvalidConfigError(f"cfg={cfg!r} ({type(cfg).__name__}); pass a MoEConfig, a preset name "
                                 f"(e.g. 'tiny-kimi-k2'), a config.json path or folder, or an HF config dict",
                                 field="cfg")
    if isinstance(cfg, str) and not os.path.exists(cfg):
        if not _looks_like_path(cfg):
            return preset(cfg)
        raise ConfigFileError(f"cfg={cfg!r}: no such file or folder; pass the config.json that came with the "
                              f"checkpoint (or its folder), or a preset name ({', '.join(PRESETS)})", path=cfg)
    return MoEConfig.from_hf_config(cfg)


def _looks_like_path(text: str) -> bool:
    separators = {"/", os.sep, os.altsep} - {None}
    return text.endswith(".json") or any(sep in text for sep in separators)


def check_group(group: Any) -> None:
    """``ConstructorArgumentTypeError`` (INP009) unless ``group`` is None or a ``torch.distributed`` process group.
    Raised on this rank only: with no group there is nothing to agree over."""
    process_group = getattr(dist, "ProcessGroup", None)
    if group is None or (process_group is not None and isinstance(group, process_group)):
        return
    hint = " (the name is not the group: pass dist.group.WORLD)" if isinstance(group, str) else ""
    raise ConstructorArgumentTypeError(
        f"group={group!r} ({type(group).__name__}){hint}: pass a torch.distributed ProcessGroup (dist.group.WORLD "
        f"after dist.init_process_group, or dist.new_group(ranks)), or None for one process", field="group")


def layer_device(device: Any) -> torch.device:
    """``device`` as the layer keeps it: ``'cpu:N'`` becomes ``'cpu'`` (tensors on the CPU report ``cpu``, so an index
    would make every input look misplaced); a value ``torch.device`` refuses is ``ConstructorArgumentTypeError``
    (INP009)."""
    try:
        resolved = torch.device(device)
    except (TypeError, RuntimeError, ValueError) as err:
        raise ConstructorArgumentTypeError(f"device={device!r} ({type(device).__name__}): {err}; pass 'cpu', 'cuda', "
                                           f"'cuda:N' or a torch.device", field="device") from err
    return torch.device("cpu") if resolved.type == "cpu" else resolved


def local_problem(seed: Any, options: EPOptions, cfg: MoEConfig | None = None) -> MoERefError | None:
    """What this rank cannot build (not raised: ``agree_on_construction`` raises it on every rank): a ``seed`` that
    is not an int (INP009), or an experts backend that cannot run here (ENV001): its package is missing, or Triton on
    a device other than CUDA outside the interpreter (``TRITON_INTERPRET=1``, which runs Triton on the CPU); options
    the batch-invariant mode cannot hold (CFG026)."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
        return ConstructorArgumentTypeError(f"seed={seed!r} ({type(seed).__name__}): pass an int (the same on every "
                                            f"rank) for random test weights, or None to load weights", field="seed")
    backend, device = options.experts_backend, options.device
    runs_on = experts_class(backend, device)
    reason = runs_on.unavailable_reason()
    if reason is None and runs_on.name == "triton" and device.type != "cuda" and not is_interpreter():
        reason = (f"Triton kernels take CUDA tensors and the layer is on {device} (TRITON_INTERPRET=1, set before "
                  f"triton is imported, runs them on the CPU interpreter: slow, for tests)")
    invariance_problem = batch_invariant.options_problem(options)  # CFG026
    if reason is None and invariance_problem is not None:
        return invariance_problem
    if reason is None and cfg is not None:
        try:  # the family's expert math (gpt-oss's clamped SwiGLU and biases) on this backend: ENV020 if not
            check_experts_support(cfg, backend, device)
        except ExpertsFeatureError as err:
            return err
    if reason is None:
        return None
    return BackendUnavailableError(f"experts_backend={backend!r} cannot run on {device} here: {reason}; use "
                                   f"experts_backend='auto' (torch on the CPU, moe_ref's kernels on CUDA) or 'torch'",
                                   field="experts_backend")


def agree_on_construction(cfg: MoEConfig, options: EPOptions, group, problem: MoERefError | None,
                          mega_here: tuple[bool, str], extra_fields: Mapping[str, str] | None = None) -> bool:
    """The construction's one collective: returns the agreed mega choice (True: the fused engine runs the step).

    Args:
        cfg, options: this rank's config and resolved options (must match on every rank).
        group: the EP group (None: one process).
        problem: this rank's ``local_problem``, raised on every rank alike (INP009, ENV001).
        mega_here: ``(ok, reason)``: whether the fused engine can run on this rank (``mega_supported_here``).
        extra_fields: more name -> text that must match on every rank (the EPLB placement's digest).

    Raises, on every rank: any rank's problem; ``CapacityMismatchError`` (CAP002) / ``GroupDisagreementError``
    (CFG008) when ranks differ; ``ShapeUnsupportedError`` (ENV002) for ``mega='deep_gemm'`` some rank refuses.
    """
    world, rank = group_size_and_rank(group)
    fields = {f"cfg.{k}": str(v) for k, v in dataclasses.asdict(cfg).items()}
    fields.update(options.fingerprint())
    fields.update(extra_fields or {})
    everyone = gather_objects((problem_of(problem), fields, *mega_here), group)
    raise_agreed_problem([p for p, _, _, _ in everyone], rank)
    check_fields_agree([f for _, f, _, _ in everyone], rank, what="MegaMoE")
    if options.mega == "off":
        return False
    refusals = [f"rank {r}: {reason}" for r, (_, _, ok, reason) in enumerate(everyone) if not ok]
    if not refusals:
        return True
    if options.mega == "deep_gemm":
        raise ShapeUnsupportedError(f"mega='deep_gemm' cannot run {cfg.name} at ep_size={world} "
                                    f"({'; '.join(refusals)}); use mega='auto' to fall back to moe_ref's own path")
    logger.warning("moe_ref: mega='auto' uses moe_ref's own EP path on every rank: %s", "; ".join(refusals))
    return False


def mega_supported_here(cfg: MoEConfig, options: EPOptions, world_size: int) -> tuple[bool, str]:
    """``(ok, reason)``: whether DeepGEMM's mega-MoE can run ``cfg`` on this rank (CUDA, SM90, installed)."""
    if options.mega == "off":
        return False, "mega='off'"
    from moe_ref.ep.mega_deep_gemm import supports

    on_cuda = options.device.type == "cuda"
    ok, reason = supports(cfg, world_size, check_runtime=on_cuda)
    if ok and not on_cuda:
        return False, f"the layer is on {options.device}; DeepGEMM's mega-MoE needs CUDA (SM90)"
    return ok, reason


def describe(layer, experts_precision: str) -> str:
    """What ``layer`` was built with, for its repr: sizes, rank, dtype, device, cap, policy and each option."""
    cfg, o = layer.cfg, layer.options
    return (f"{cfg.name}: E={cfg.num_experts} (local {layer.num_local_experts} on rank {layer.rank}/"
            f"{layer.world_size}), ep_size={layer.world_size}, K={cfg.num_topk}, D={cfg.hidden_size}, dtype={o.dtype}, "
            f"device={o.device}, cap={o.num_max_tokens_per_rank}, overflow={o.overflow}, transport={o.transport}, "
            f"experts={o.experts_backend}{experts_precision}, "
            f"dispatch={'fp8' if o.dispatch_fp8 else 'activation dtype'}, alignment={o.alignment}, "
            f"pool={o.pool_format}, mega={o.mega}{' (in use)' if layer.uses_mega else ''}"
            + ("" if getattr(layer, "_graphs", None) is None else f", {layer._graphs.describe()}"))
