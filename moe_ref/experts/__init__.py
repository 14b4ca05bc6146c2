"""Expert backends: the routed-expert MLP over an expert-major receive pool.

    recv pool x_PDx (expert-major, segments aligned) --GEMM1 gate||up--> act --GEMM2 down--> y_PDx

Shape legend: P receive-pool rows, Dx expert input width (hidden, or latent for Kimi-K3), F expert
intermediate, e local experts, Db = ceil(Dx / 128), Fb = ceil(F / 128). The argument names all backends share
are ``x_PDx``, ``x_scale_PDb``, ``gate_up_weight_e2FD`` and ``down_weight_eDF``; the weights' D is Dx.

Every backend is called as ``experts(x_PDx, layout, x_scale_PDb=None) -> y_PDx`` (``Experts.__call__``
checks the input format, then runs ``forward``) over the same layout (``ExpertLayout``): the rows of
local expert i are ``x_PDx[row_start_e[i] : row_start_e[i] + num_rows_e[i]]``; rows outside every segment
(alignment padding) come out as zeros. Each backend declares what it wants from the dispatcher:

- ``segment_alignment``: rows each segment of the pool should start on (the dispatcher's pool layout).
- ``computes_whole_segments``: give me whole aligned segments with zeroed padding (the torch loop).
- ``supports_fp8``: ``fp8=True`` is accepted: weights quantized once to fp8 e4m3 with fp32 128x128
  block scales (``kernels.fp8.quantize_fp8_per_block_128``).
- ``accepts_fp8_input``: ``x_PDx`` may be the FP8 pool (e4m3 + per-row per-128 ``x_scale_PDb``) as
  dispatched; the others get activation-dtype rows (``Dispatcher.expert_input`` decides).

| name           | what                                             | where                 | alignment | fp8 weights / fp8 input |
|----------------|--------------------------------------------------|-----------------------|-----------|-------------------------|
| ``torch``      | per-expert loop of plain matmuls (the oracle)    | anywhere              | 128       | no / no                 |
| ``grouped_mm`` | ``torch.nn.functional.grouped_mm``               | torch >= 2.9          | 16        | no / no                 |
| ``triton``     | ``kernels.grouped_mlp``, activation fused        | CUDA (or interpreter) | 1         | ``fp8=True`` / with fp8 |
| ``deep_gemm``  | DeepGEMM grouped GEMMs (masked on a masked pool) | SM90 + deep_gemm      | 128       | ``fp8=True`` / with fp8 |
| ``auto``       | per call, the fastest held backend of a measured | CPU: ``torch``; CUDA: | lcm of    | ``fp8=True`` / with fp8 |
|                | table (``auto``: ``auto_table.json``)            | ``triton`` + others   | the held  |                         |

``auto`` on CUDA holds Triton plus each installed backend the table ranks fastest in some regime for this GPU class
(``moe_ref.experts.auto``); with none (no table entry, no DeepGEMM) it is plain ``triton``.
Backends built from one ``FP8ExpertWeights`` (``make_experts(..., fp8_weights=w)``) share one copy of fp8 weights.
"""
from moe_ref.experts.base import ExpertLayout, Experts, FP8ExpertWeights, check_pool_format
from moe_ref.experts.registry import experts_class, make_experts, register_experts, registered_backends
from moe_ref.experts import backends as _builtin  # noqa: F401  (registers torch, grouped_mm, triton)
from moe_ref.experts import deep_gemm as _deep_gemm  # noqa: F401  (registers deep_gemm, imported on first use)
from moe_ref.experts import auto as _auto  # noqa: F401  (registers auto)
from moe_ref.experts.backends import GroupedMMExperts, TorchLoopExperts, TritonExperts

__all__ = ["ExpertLayout", "Experts", "FP8ExpertWeights", "check_pool_format", "experts_class", "make_experts",
           "register_experts",
           "registered_backends", "TorchLoopExperts", "GroupedMMExperts", "TritonExperts"]
