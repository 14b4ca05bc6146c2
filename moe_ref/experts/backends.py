"""The built-in expert backends: the torch loop (the oracle), torch ``grouped_mm`` and the Triton grouped MLP.
Each registers itself (``register_experts``) under the name ``make_experts`` takes.

Shape legend: P receive-pool rows, Dx expert input width, F expert intermediate, e local experts,
Db = ceil(Dx / 128), Fb = ceil(F / 128)."""
from __future__ import annotations

import torch

from moe_ref.core.activations import dense_mlp, gated_activation
from moe_ref.core.errors import BackendUnavailableError
from moe_ref.experts.base import ExpertLayout, Experts, FP8ExpertWeights
from moe_ref.experts.registry import register_experts
from moe_ref.kernels.runtime import ops
from moe_ref.kernels.runtime._triton_utils import FP8_DTYPE
from moe_ref.kernels.runtime.fixed_tiles import in_row_blocks


class TorchLoopExperts(Experts):
    """One plain matmul pair per expert: slow and obviously right. Each row's result does not depend on
    which other rows share its expert, so chunked and unchunked runs agree bitwise on CPU."""

    name = "torch"
    honours_batch_invariant = True
    computes_whole_segments = True
    segment_alignment = 128  # whole 128-row segments keep chunked == unchunked bitwise (moe_ref.ep.dispatch NOTE)
    activations = ("silu", "situ", "swigluoai")
    supports_expert_bias = True

    def forward(self, x_PDx, layout, x_scale_PDb=None):
        y_PDx = torch.zeros_like(x_PDx)
        for i, (start, count) in enumerate(zip(layout.row_start_e.tolist(), layout.num_rows_e.tolist())):
            if count:
                # fetched once per expert (stored experts dequantize on access: QuantTorchExperts)
                gate_up_2FD, down_DF = self.gate_up_weight_e2FD[i], self.down_weight_eDF[i]

                def expert_mlp(x_MDx, i=i, gate_up_2FD=gate_up_2FD, down_DF=down_DF):
                    return dense_mlp(
                        x_MDx, gate_up_2FD, down_DF,
                        self.activation, self.situ_beta, self.situ_linear_beta, swiglu_alpha=self.swiglu_alpha,
                        swiglu_limit=self.swiglu_limit,
                        gate_up_bias_2S=None if self.gate_up_bias_e2F is None else self.gate_up_bias_e2F[i],
                        down_bias_D=None if self.down_bias_eD is None else self.down_bias_eD[i],
                        fixed_chunks=self.batch_invariant)

                rows = x_PDx[start:start + count]  # batch-invariant: one GEMM shape for any segment length
                y_PDx[start:start + count] = in_row_blocks(expert_mlp, rows) if self.batch_invariant else expert_mlp(rows)
        return y_PDx


class GroupedMMExperts(Experts):
    """``torch.nn.functional.grouped_mm`` (CUTLASS on SM90 for bf16; a composite elsewhere).

    Segments are passed with their aligned ends as ``offs``, so padding rows are computed and then
    zeroed; no host sync on CUDA. Segments start on multiples of 16 rows: any start works for torch's
    2-D x 3-D grouped_mm (its TMA stride rule concerns K), and 16 rows also meet the older per-group
    16-byte check of torch < 2.8 for every dtype.
    """

    name = "grouped_mm"
    segment_alignment = 16
    activations = ("silu", "situ", "swigluoai")
    supports_expert_bias = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        reason = self.unavailable_reason()
        if reason is not None:
            raise BackendUnavailableError(f"{reason}; use backend='torch'")
        self._grouped_mm = _grouped_mm_function()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None if _grouped_mm_function() is not None else f"torch {torch.__version__} has no grouped_mm"

    def forward(self, x_PDx, layout, x_scale_PDb=None):
        num_rows = x_PDx.shape[0]
        if num_rows == 0:
            return torch.zeros_like(x_PDx)
        aligned_e = (layout.num_rows_e + layout.alignment - 1) // layout.alignment * layout.alignment
        offs_e = (layout.row_start_e + aligned_e).clamp(max=num_rows).to(torch.int32)
        row_expert_P = ops.pool_row_experts(layout.row_start_e.to(x_PDx.device), layout.num_rows_e.to(x_PDx.device),
                                            num_rows)
        x_in = x_PDx.to(self.gate_up_weight_e2FD.dtype)
        gate_up_P2F = self._grouped_mm(x_in, self.gate_up_weight_e2FD.transpose(-2, -1), offs=offs_e)
        if self.gate_up_bias_e2F is not None:  # each row its expert's bias (rows outside segments are zeroed below)
            gate_up_P2F = gate_up_P2F.float() + self.gate_up_bias_e2F.float()[row_expert_P.long().clamp(min=0)]
        gate_PF, up_PF = gate_up_P2F.chunk(2, dim=-1)
        h_PF = gated_activation(gate_PF, up_PF, self.activation, self.situ_beta, self.situ_linear_beta,
                                swiglu_alpha=self.swiglu_alpha, swiglu_limit=self.swiglu_limit)
        y_PDx = self._grouped_mm(h_PF.to(self.down_weight_eDF.dtype).contiguous(),
                                 self.down_weight_eDF.transpose(-2, -1), offs=offs_e)
        if self.down_bias_eD is not None:
            y_PDx = y_PDx + self.down_bias_eD.to(y_PDx.dtype)[row_expert_P.long().clamp(min=0)]
        return ops.zero_rows_outside_segments(y_PDx, row_expert_P).to(x_PDx.dtype)


def _grouped_mm_function():
    """torch's grouped GEMM (``torch.nn.functional.grouped_mm``, or ``torch._grouped_mm`` before 2.9), or None."""
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class TritonExperts(Experts):
    """moe_ref's Triton grouped MLP (``kernels.grouped_mlp``): gate/up GEMM with the activation fused in
    its epilogue, then the down GEMM.

    The kernel maps its M blocks to experts itself and masks every row outside a segment, so segments
    may start anywhere (``segment_alignment = 1``: the pool holds no padding rows at all). FP8 scales are
    per row, so they line up with any segment start too.

    Args:
        gate_up_weight_e2FD: ``[e, 2F, Dx]``, gate rows then up rows (bf16/fp16/fp32; CUDA, or CPU under the
            interpreter).
        down_weight_eDF: ``[e, Dx, F]``.
        activation, situ_beta, situ_linear_beta: see ``moe_ref.core.activations`` (fused in the kernel, fp32).
        fp8: quantize the weights ONCE here to fp8 e4m3 with fp32 128x128 block scales
            (``FP8ExpertWeights.quantize``: gate_up interleaved in 128-row blocks when F % 128 == 0, so GEMM1 runs
            one dot per k-step) and run the FP8 kernel. ``forward`` then takes the FP8 pool with its per-row per-128
            scales as dispatched (``accepts_fp8_input``) and returns bf16; given activation-dtype rows it quantizes
            them per 128 columns itself and returns their dtype. bf16 runs the caller's weights as given.
        fp8_weights: already-quantized weights (``FP8ExpertWeights``: an FP8 checkpoint's, or ones another backend
            shares) to run as given, stacked or interleaved. Implies ``fp8``.
    """

    name = "triton"
    honours_batch_invariant = True
    segment_alignment = 1
    supports_fp8 = True

    def __init__(self, gate_up_weight_e2FD: torch.Tensor, down_weight_eDF: torch.Tensor, activation: str = "silu",
                 situ_beta: float = 4.0, situ_linear_beta: float = 25.0, *, fp8: bool = False,
                 fp8_weights: FP8ExpertWeights | None = None):
        super().__init__(gate_up_weight_e2FD, down_weight_eDF, activation, situ_beta, situ_linear_beta)
        self.fp8 = self.accepts_fp8_input = fp8 or fp8_weights is not None
        if fp8 and fp8_weights is None:
            # NOTE: the originals stay referenced by the base class (the caller's tensors, no copy).
            fp8_weights = FP8ExpertWeights.quantize(gate_up_weight_e2FD, down_weight_eDF)
        self.fp8_weights = fp8_weights

    def forward(self, x_PDx, layout, x_scale_PDb=None):
        from moe_ref.kernels.experts.grouped_mlp import grouped_mlp

        options = dict(activation=self.activation, situ_beta=self.situ_beta, situ_linear_beta=self.situ_linear_beta,
                       num_rows_hint=layout.rows_hint(),  # picks GPU tiles
                       zero_unused_rows=layout.zero_unused_rows, batch_invariant=self.batch_invariant)
        if not self.fp8:
            return grouped_mlp(x_PDx, self.gate_up_weight_e2FD, self.down_weight_eDF, layout.row_start_e,
                               layout.num_rows_e, **options)
        out_dtype = torch.bfloat16
        if x_PDx.dtype != FP8_DTYPE:  # activation-dtype rows (a pool dispatched in bf16): quantize them here
            out_dtype = x_PDx.dtype
            x_PDx, x_scale_PDb = ops.quantize_rows_fp8(x_PDx.contiguous())
        weights = self.fp8_weights
        y_PDx = grouped_mlp(x_PDx, weights.gate_up_fp8_e2FD, weights.down_fp8_eDF, layout.row_start_e,
                            layout.num_rows_e, x_scale_PDb=x_scale_PDb, gate_up_scale=weights.gate_up_scale_e2FbDb,
                            down_scale=weights.down_scale_eDbFb, gate_up_interleaved=weights.gate_up_interleaved,
                            **options)
        return y_PDx.to(out_dtype)


register_experts("torch", TorchLoopExperts)
register_experts("grouped_mm", GroupedMMExperts)
register_experts("triton", TritonExperts)
