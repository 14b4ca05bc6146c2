"""Triton kernels of moe_ref, each beside its plain-torch twin `<op>_ref` (same signature).

    router_topk -> pre_dispatch -> (dispatch) -> grouped_mlp -> (combine) -> combine_reduce

`fp8` holds the torch FP8 quantizers (activations per 128 columns, weights per 128x128 block).

Under `TRITON_INTERPRET=1` (set before triton is imported) the kernels run on CPU tensors (slow; tests).
"""

from moe_ref.kernels._triton_utils import is_interpreter
from moe_ref.kernels.combine_reduce import combine_reduce, combine_reduce_ref
from moe_ref.kernels.fp8 import (
    dequantize_fp8_per_128,
    dequantize_fp8_per_block_128,
    quantize_fp8_per_128,
    quantize_fp8_per_block_128,
)
from moe_ref.kernels.grouped_mlp import grouped_mlp, grouped_mlp_ref
from moe_ref.kernels.pre_dispatch import pre_dispatch, pre_dispatch_ref
from moe_ref.kernels.router_topk import router_topk, router_topk_ref

__all__ = [
    "is_interpreter",
    "router_topk",
    "router_topk_ref",
    "pre_dispatch",
    "pre_dispatch_ref",
    "quantize_fp8_per_128",
    "dequantize_fp8_per_128",
    "quantize_fp8_per_block_128",
    "dequantize_fp8_per_block_128",
    "grouped_mlp",
    "grouped_mlp_ref",
    "combine_reduce",
    "combine_reduce_ref",
]
