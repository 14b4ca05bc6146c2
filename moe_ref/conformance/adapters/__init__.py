"""The shipped adapters, registered on import: every moe_ref experts backend through its routed step and every
transport's dispatch/combine (``moe_ref_impls``), every experts backend alone on a pool (``moe_ref_pool``), the
quantized experts as stored, read through moe_ref's checkpoint loader (``moe_ref_quant``), the SGLang/vLLM Triton
fused-MoE kernels read from their wheels (``peers``, GPU), the worked example of docs/conform.md (``sglang_style``)
and the mutants (``..mutants``)."""
from moe_ref.conformance import mutants as _mutants  # noqa: F401
from moe_ref.conformance.adapters import moe_ref_impls as _moe_ref_impls  # noqa: F401
from moe_ref.conformance.adapters import moe_ref_pool as _moe_ref_pool  # noqa: F401
from moe_ref.conformance.adapters import moe_ref_quant as _moe_ref_quant  # noqa: F401
from moe_ref.conformance.adapters import peers as _peers  # noqa: F401
from moe_ref.conformance.adapters import sglang_style as _sglang_style  # noqa: F401
