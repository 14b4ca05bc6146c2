"""Triton kernels of moe_ref, each beside its plain-torch twin `<op>_ref` (same signature), grouped by stage:

    router/   router_logits -> router_topk (+ routing_check)
    ep/       pre_dispatch | ep_layout -> symm_signal -> ep_dispatch -> (experts) -> ep_combine   (ep_chunk runs them)
    experts/  grouped_mlp (+ grouped_mlp_tiles), grouped_mlp_w4 (+ w4), gated_act, fp8, quantize_rows
    runtime/  launch (the one launch path), ops (kernel or twin, decided once), native (csrc ops), _triton_utils

`router_logits` is the one op here that is no Triton kernel: cuBLAS's fp32-output GEMM of the 16-bit operands
(measured faster than a Triton kernel of ours at every T). This package re-exports the ops' functions, so
`from moe_ref.kernels import grouped_mlp` keeps working; modules are imported by their stage path
(`moe_ref.kernels.experts.grouped_mlp`).

Under `TRITON_INTERPRET=1` (set before triton is imported) the kernels run on CPU tensors (slow; tests).
"""

from moe_ref.kernels.runtime._triton_utils import is_interpreter
from moe_ref.kernels.ep.ep_chunk import ep_chunk
from moe_ref.kernels.ep.ep_combine import (
    ep_combine_push,
    ep_combine_push_ref,
    ep_combine_reduce,
    ep_combine_reduce_ref,
)
from moe_ref.kernels.ep.ep_dispatch import ep_dispatch, ep_dispatch_ref
from moe_ref.kernels.ep.ep_layout import ep_layout, ep_layout_ref, ep_pre_dispatch, ep_pre_dispatch_ref
from moe_ref.kernels.ep.ep_regions import EPRegions, PeerBuffers
from moe_ref.kernels.experts.fp8 import (
    dequantize_fp8_per_128,
    dequantize_fp8_per_block_128,
    quantize_fp8_per_128,
    quantize_fp8_per_block_128,
)
from moe_ref.kernels.experts.grouped_mlp import grouped_mlp, grouped_mlp_ref
from moe_ref.kernels.ep.pool_rows import (
    pool_row_experts,
    pool_row_experts_ref,
    zero_rows_outside_segments,
    zero_rows_outside_segments_ref,
)
from moe_ref.kernels.ep.pre_dispatch import pre_dispatch, pre_dispatch_ref
from moe_ref.kernels.experts.quantize_rows import quantize_rows_fp8, quantize_rows_fp8_ref
from moe_ref.kernels.router.router_logits import router_logits, router_logits_ref
from moe_ref.kernels.router.router_topk import router_topk, router_topk_ref
from moe_ref.kernels.router.routing_check import routing_check, routing_check_ref
from moe_ref.kernels.ep.symm_signal import check_ep_status, symm_barrier, symm_barrier_ref

__all__ = [
    "routing_check",
    "routing_check_ref",
    "is_interpreter",
    "router_logits",
    "router_logits_ref",
    "router_topk",
    "router_topk_ref",
    "pre_dispatch",
    "pre_dispatch_ref",
    "quantize_rows_fp8",
    "quantize_rows_fp8_ref",
    "quantize_fp8_per_128",
    "dequantize_fp8_per_128",
    "quantize_fp8_per_block_128",
    "dequantize_fp8_per_block_128",
    "grouped_mlp",
    "grouped_mlp_ref",
    "pool_row_experts",
    "pool_row_experts_ref",
    "zero_rows_outside_segments",
    "zero_rows_outside_segments_ref",
    # device-side EP data path over symmetric memory (see ep_regions for the buffer contract)
    "EPRegions",
    "PeerBuffers",
    "ep_layout",
    "ep_layout_ref",
    "ep_pre_dispatch",
    "ep_pre_dispatch_ref",
    "ep_dispatch",
    "ep_dispatch_ref",
    "ep_combine_push",
    "ep_combine_push_ref",
    "ep_combine_reduce",
    "ep_combine_reduce_ref",
    "symm_barrier",
    "symm_barrier_ref",
    "check_ep_status",
    "ep_chunk",
]
