"""moe_ref's expert backends alone (``pool_experts`` kind: the kernel-only rows), each called as the routed step
calls it: ``make_experts(backend, ...)`` on the pool, with the static rows hint of the device-side dispatch (the
rows outside every segment left unwritten) and, for the ``fp8_block`` recipe, the FP8 pool as dispatched.

    moe_ref/experts/<backend>          contiguous segments on multiples of 128 rows: the pool ``auto`` plans where
                                       DeepGEMM is installed (DeepGEMM needs it; the others take any alignment)
    moe_ref/experts/<backend>+masked   expert i's rows at i * M (DeepGEMM's masked layout, the decode pool)

``torch`` is one matmul pair per expert (the baseline any grouped kernel must beat), ``grouped_mm`` torch's grouped
GEMM, ``triton`` moe_ref's grouped MLP, ``deep_gemm`` DeepGEMM's grouped GEMMs with moe_ref's activation between.

``moe-ref bench --kind experts`` times these beside the peers' kernels on the same pools, and ``moe-ref bench
--auto-table`` orders them per regime into ``experts_backend="auto"``'s table.

Shape legend: e local experts, D hidden width, P receive-pool rows, Db = ceil(D / 128).
"""
from __future__ import annotations

from moe_ref.conformance.adapters.moe_ref_impls import backend_missing
from moe_ref.conformance.api import Capabilities, ExpertPool, Implementation, Problem, register

POOL_ALIGNMENT = 128
# (backend, devices, dtypes, quants, pool layouts)
BACKENDS = (("torch", ("cpu", "cuda"), ("fp32", "bf16"), ("none",), ("contiguous", "masked")),  # per-expert loop
            ("grouped_mm", ("cpu", "cuda"), ("fp32", "bf16"), ("none",), ("contiguous",)),
            ("triton", ("cuda",), ("bf16",), ("none", "fp8_block"), ("contiguous", "masked")),
            ("deep_gemm", ("cuda",), ("bf16",), ("none", "fp8_block"), ("contiguous", "masked")))


def pool_experts_factory(backend: str):
    """``Problem -> run(pool) -> y_PD``: ``backend`` built once over the problem's experts (FP8 block weights as
    their codes and scales for the ``fp8_block`` recipe)."""
    def factory(problem: Problem):
        from moe_ref.experts import ExpertLayout, FP8ExpertWeights, make_experts

        w = problem.weights
        fp8 = None if w.quant == "none" else FP8ExpertWeights(w.gate_up_q, w.gate_up_scale, w.down_q, w.down_scale)
        experts = make_experts(backend, w.gate_up_e2FD, w.down_eDF, fp8_weights=fp8)

        def run(pool: ExpertPool):
            # a contiguous scenario pool packs its segments (scenarios.expert_pool), as the dispatcher's does
            layout = ExpertLayout(pool.row_start_e, pool.num_rows_e, pool.x_PD.shape[0], POOL_ALIGNMENT,
                                  num_rows_hint=pool.num_rows, zero_unused_rows=False, masked_rows=pool.masked_rows,
                                  packed=not pool.masked_rows)
            if pool.x_fp8_PD is not None and experts.accepts_fp8_input:
                return experts(pool.x_fp8_PD, layout, pool.x_scale_PDb)
            return experts(pool.x_PD, layout)

        return run

    return factory


def pool_name(backend: str, layout: str) -> str:
    """The registered name of ``backend`` on a ``layout`` pool."""
    return f"moe_ref/experts/{backend}" + ("+masked" if layout == "masked" else "")


for _backend, _devices, _dtypes, _quants, _layouts in BACKENDS:
    for _layout in _layouts:
        register(Implementation(
            pool_name(_backend, _layout), "pool_experts",
            Capabilities(dtypes=_dtypes, quants=_quants, devices=_devices, layouts=(_layout,),
                         segment_alignment=POOL_ALIGNMENT,
                         masked_slots=True, duplicate_experts=True, tile_rows=128 if _backend == "torch" else 64,
                         graph_safe=_backend in ("triton", "deep_gemm")),
            pool_experts_factory(_backend), f"moe_ref's {_backend} experts alone on a {_layout} pool",
            spec=pool_name(_backend, _layout), unavailable=backend_missing(_backend)))
