"""DeepGEMM as an experts backend, in one place: ``probe`` (does DeepGEMM load and run here, and why not),
``backend`` (``DeepGemmExperts``: its grouped GEMMs, contiguous or masked, with moe_ref's activation between
them) and ``bench`` (its kernels as its own tests call them, for the benchmarks). The fused mega-MoE engine is
an EP routed step and lives in ``moe_ref.ep.mega_deep_gemm``."""
from moe_ref.experts.registry import register_experts

# Registered by name; ``moe_ref.experts.deep_gemm.backend`` (and deep_gemm itself) is imported on first use.
register_experts("deep_gemm", "moe_ref.experts.deep_gemm.backend:DeepGemmExperts")
