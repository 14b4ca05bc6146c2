"""Whether DeepGEMM (optional, ``sgl-deep-gemm``, import name ``deep_gemm``) can run here, and why not.

One job: detection. ``deep_gemm_status()`` probes once per process and never raises (used by
``moe-ref info``, ``mega_deep_gemm.supports`` and the benchmarks); ``import_deep_gemm()`` returns the module
after a successful probe or raises ENV001 with the probe's reason (used by the experts backend
``moe_ref.experts.deep_gemm.backend`` and the fused engine ``moe_ref.ep.mega_deep_gemm``); ``call_deep_gemm`` calls one
of its functions and names every argument's shape/dtype/stride on failure.

Importing this module never imports ``deep_gemm`` (nor CUDA): the probe does, lazily, and only on an SM90 GPU.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass

import torch

from moe_ref.core.errors import BackendUnavailableError

__all__ = ["DeepGemmStatus", "deep_gemm_status", "import_deep_gemm", "call_deep_gemm", "KNOWN_GOOD_VERSIONS"]

# Versions that ran on the GPU image (torch 2.11+cu130): sgl-deep-gemm 0.1.3 and 0.1.4 (docs/RESULTS.md).
KNOWN_GOOD_VERSIONS = ("0.1.3", "0.1.4")
_GROUPED_API = ("m_grouped_bf16_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_contiguous",
                "m_grouped_bf16_gemm_nt_masked", "m_grouped_fp8_fp4_gemm_nt_masked",
                "get_mk_alignment_for_contiguous_layout")
_MEGA_API = ("get_symm_buffer_for_sm90_mega_moe", "transform_weights_for_mega_moe_sm90", "fp8_mega_moe")
_INSTALL_HINT = ("install the wheels sgl-deep-gemm==0.1.4 and apache-tvm-ffi==0.1.11 (pip install --no-deps), "
                 "the pair known to work with torch 2.11+cu130")


@dataclass(frozen=True)
class DeepGemmStatus:
    """Whether DeepGEMM can run here, and why not.

    Attributes:
        available: True when ``deep_gemm`` imported on an SM90 GPU and a tiny real grouped GEMM matched torch.
        version: the installed version (``deep_gemm.__version__`` or the wheel's metadata), None if unknown.
        reason: one line: what was checked, or what failed and how to fix it.
        mega_moe: True when ``available`` and the SM90 mega-MoE API (``get_symm_buffer_for_sm90_mega_moe``,
            ``transform_weights_for_mega_moe_sm90``, ``fp8_mega_moe``) is present. Not exercised by the
            probe (that needs a process group); ``moe_ref.ep.mega_deep_gemm`` does.
    """

    available: bool
    version: str | None
    reason: str
    mega_moe: bool = False


def deep_gemm_status(*, refresh: bool = False) -> DeepGemmStatus:
    """Probe DeepGEMM once per process (cached); never raises.

    Checks, in order: the package is installed (without importing it), a CUDA device is visible, it is
    SM90, ``import deep_gemm`` works, the grouped-GEMM API exists, and a 1-expert bf16 grouped GEMM
    (128 x 128 x 256) on the current device matches ``torch.matmul`` (calc_diff < 1e-5).

    Args:
        refresh: forget the cached answer and probe again.

    Returns:
        status: ``DeepGemmStatus``.
    """
    if refresh:
        _probe.cache_clear()
    return _probe()


def _installed_version() -> str | None:
    for dist_name in ("sgl-deep-gemm", "deep-gemm", "deep_gemm"):
        try:
            return importlib.metadata.version(dist_name)
        except Exception:  # noqa: BLE001 - metadata lookups can fail in odd environments; treat as unknown
            continue
    return None


@functools.lru_cache(maxsize=1)
def _probe() -> DeepGemmStatus:
    version = None
    try:
        version = _installed_version()
        if importlib.util.find_spec("deep_gemm") is None:
            return DeepGemmStatus(False, version, f"deep_gemm is not installed (optional backend): {_INSTALL_HINT}")
        if not torch.cuda.is_available():
            return DeepGemmStatus(False, version, f"no CUDA device visible (torch {torch.__version__}, "
                                                  f"CUDA {torch.version.cuda}); deep_gemm needs an SM90 GPU")
        major, minor = torch.cuda.get_device_capability()
        device_name = torch.cuda.get_device_name()
        if major != 9:
            return DeepGemmStatus(False, version, f"{device_name} is SM{major}{minor}; this backend is written "
                                                  "against deep_gemm's SM90 (Hopper) kernels")
        try:
            deep_gemm = importlib.import_module("deep_gemm")
        except BaseException as err:  # noqa: BLE001 - a broken binary may raise anything, even SystemExit
            return DeepGemmStatus(False, version, f"import deep_gemm failed: {type(err).__name__}: {err}; "
                                                  f"{_INSTALL_HINT}")
        version = getattr(deep_gemm, "__version__", None) or version
        missing = [name for name in _GROUPED_API if not hasattr(deep_gemm, name)]
        if missing:
            return DeepGemmStatus(False, version, f"deep_gemm {version} lacks {', '.join(missing)}; {_INSTALL_HINT}")
        try:
            diff = _tiny_grouped_gemm(deep_gemm)
        except Exception as err:  # noqa: BLE001
            return DeepGemmStatus(False, version, f"deep_gemm {version} imported, but a 1-expert bf16 grouped GEMM "
                                                  f"failed: {type(err).__name__}: {err}; {_INSTALL_HINT}")
        if not diff < 1e-5:
            return DeepGemmStatus(False, version, f"deep_gemm {version}: a 1-expert bf16 grouped GEMM returned wrong "
                                                  f"values (calc_diff={diff:.3g} vs torch); {_INSTALL_HINT}")
        mega = all(hasattr(deep_gemm, name) for name in _MEGA_API)
        note = "" if version in KNOWN_GOOD_VERSIONS else f" (untested version; known good: {KNOWN_GOOD_VERSIONS})"
        return DeepGemmStatus(True, version, f"deep_gemm {version} on {device_name} (SM{major}{minor}): 1-expert "
                                             f"bf16 grouped GEMM matched torch (calc_diff={diff:.2g}); mega-MoE "
                                             f"API {'present' if mega else 'absent'}{note}", mega)
    except Exception as err:  # noqa: BLE001 - the probe must never raise
        return DeepGemmStatus(False, version, f"probing deep_gemm failed: {type(err).__name__}: {err}")


def _tiny_grouped_gemm(deep_gemm) -> float:
    """One real call: ``d = a @ b[0].T`` through ``m_grouped_bf16_gemm_nt_contiguous``; returns calc_diff."""
    from moe_ref.testing import calc_diff

    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(1, 128, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
    d = torch.empty(128, 128, device="cuda", dtype=torch.bfloat16)
    grouped_layout = torch.zeros(128, device="cuda", dtype=torch.int32)
    deep_gemm.m_grouped_bf16_gemm_nt_contiguous(a, b, d, grouped_layout)
    torch.cuda.synchronize()
    return calc_diff(d, a.float() @ b[0].float().t())


def import_deep_gemm():
    """``deep_gemm`` after a successful probe, else the coded ENV001 error with the probe's reason.

    Raises:
        BackendUnavailableError (ENV001): the probe said no; the message and ``reason`` carry why.
    """
    status = deep_gemm_status()
    if not status.available:
        raise BackendUnavailableError(f"deep_gemm is not usable here: {status.reason}", reason=status.reason)
    return importlib.import_module("deep_gemm")


def call_deep_gemm(deep_gemm, name: str, *args, **kwargs) -> None:
    """Call ``deep_gemm.<name>`` and, on failure, re-raise with every argument's shape/dtype/stride."""
    try:
        getattr(deep_gemm, name)(*args, **kwargs)
    except Exception as err:
        def describe(value):
            if isinstance(value, torch.Tensor):
                return f"Tensor{tuple(value.shape)} {value.dtype} strides={value.stride()} {value.device}"
            if isinstance(value, (tuple, list)):
                return "(" + ", ".join(describe(v) for v in value) + ")"
            return repr(value)
        described = ", ".join([describe(a) for a in args] + [f"{k}={describe(v)}" for k, v in kwargs.items()])
        raise RuntimeError(f"deep_gemm.{name}({described}) failed: {type(err).__name__}: {err}") from err
