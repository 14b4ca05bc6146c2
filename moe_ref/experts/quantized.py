"""Expert backends for checkpoint-quantized weights (``moe_ref.checkpoint.formats.QuantizedExpertWeights``), kept as stored.

    load_quantized_experts(...) --> QuantizedExpertWeights --make_quantized_experts--> Experts
      int4_group / mxfp4, "triton": W4A16Experts   (kernels.grouped_mlp_w4: the 4-bit weights decoded in the
                                                    MMA's registers, the group scale applied in the decode; W4A8
                                                    past a rows threshold when asked)
      fp8_block,          "triton": FP8BlockExperts (TritonExperts' FP8 kernel fed the checkpoint's own e4m3
                                                    weights and 128x128 scales: no bf16 round trip, no re-quant)
      fp8_block,          "auto" on CUDA: FP8BlockExperts, or the auto class (moe_ref.experts.auto) where it holds
                                                    DeepGEMM too: both run the checkpoint's tensors, one copy
      any format,         "torch":  QuantTorchExperts (the per-expert torch loop on each expert's weights
                                                    dequantized to fp32 when its rows run: the reference)

Every backend holds only the stored tensors (device bytes == ``qweights.nbytes()``), but W4A16Experts adds
block-major scales (1/16 of INT4's bytes, 1/32 of MXFP4's) and, given experts in the checkpoint's nibble order, a
copy of the words in its kernel's (the layer hands it its own, rewritten in place). Each is called like any
``moe_ref.experts.Experts``: ``experts(x_PDx, layout, x_scale_PDb=None) -> y_PDx``. Shape legend as in
``moe_ref.experts`` and ``moe_ref.checkpoint.formats``.
"""
from __future__ import annotations

import torch

from moe_ref.core import envs
from moe_ref.core.errors import UnknownNameError
from moe_ref.experts import Experts, TorchLoopExperts, TritonExperts, experts_class
from moe_ref.experts.base import FP8ExpertWeights
from moe_ref.checkpoint.formats import QuantFormat, QuantizedExpertWeights

QUANT_BACKENDS = ("auto", "triton", "torch")


class W4A16Experts(Experts):
    """INT4 (compressed-tensors pack-quantized) or MXFP4 experts on ``kernels.grouped_mlp_w4``.

    Activations stay bf16/fp16/fp32 (``x_PDx``'s dtype); the dots accumulate in fp32, and h and y are rounded to
    x's dtype. With bf16 x the decode applies the group scale: MXFP4's weights come out exact in bf16, INT4's as
    ``bf16((code - 8) * s)`` (compressed-tensors' own bf16 dequantization). Otherwise (fp16/fp32 x, INT4 scales
    outside ``W4Weight.foldable``'s range: |s| of 0.5 or more, or nonzero below 2**-122) each group of 32 input
    features is one dot of exact 4-bit values, scaled in fp32 (``kernels.grouped_mlp_w4`` says why). Segments may
    start anywhere (the kernel masks rows itself), as for ``TritonExperts``.

    The kernel reads the 4-bit words in its own nibble order: ``qweights.group_planes()`` gives views where
    ``qweights`` holds them so already (the layer rewrites its own in place: ``with_group_planes``), else copies
    (``extra_nbytes()``).

    W4A8 at prefill (``a8_rows_per_expert``): from that many routed rows per local expert on (the layout's static
    rows hint over e), a call quantizes x and h to fp8 e4m3 with one scale per row and runs fp8 MMAs on the weights
    cast to fp8 in the decode (``grouped_mlp_w4(..., a8=True)``: MXFP4 exactly where ``W4Weight.a8_exact``, INT4
    rounded to e4m3), an FP8 recipe's accuracy (calc_diff ~1e-3 against the dequantized weights). Off by default;
    never in the batch-invariant mode (its rows would change arithmetic with the batch size).

    Args:
        qweights: int4_group or mxfp4 ``QuantizedExpertWeights`` on CUDA (or CPU under the interpreter).
        activation, situ_beta, situ_linear_beta: see ``moe_ref.core.activations``.
        a8_rows_per_expert: W4A8 from this many rows per expert on; None (default): ``MOE_REF_W4A8_ROWS_PER_EXPERT``,
            and W4A16 always when that is unset. Weights the W4A8 kernel cannot take (``W4Weight.a8_supported``)
            stay W4A16.
    """

    name = "w4a16"
    honours_batch_invariant = True  # one tile pair at every row count (grouped_mlp_w4.BATCH_INVARIANT_TILES)
    segment_alignment = 1

    def __init__(self, qweights: QuantizedExpertWeights, activation: str = "silu", situ_beta: float = 4.0,
                 situ_linear_beta: float = 25.0, *, a8_rows_per_expert: float | None = None):
        if qweights.spec.format == QuantFormat.FP8_BLOCK:
            raise UnknownNameError("W4A16Experts takes int4_group or mxfp4 weights; fp8_block goes to FP8BlockExperts "
                                   "(make_quantized_experts picks it)")
        super().__init__(qweights.gate_up_qweight_e2FDq, qweights.down_qweight_eDFq, activation, situ_beta,
                         situ_linear_beta)
        self.qweights = qweights
        self.gate_up_planes, self.down_planes = qweights.group_planes()
        if a8_rows_per_expert is None:
            a8_rows_per_expert = envs.w4a8_rows_per_expert()
        a8_ok = self.gate_up_planes.a8_supported and self.down_planes.a8_supported
        self.a8_rows_per_expert = a8_rows_per_expert if a8_ok else None

    def extra_nbytes(self) -> int:
        """Device bytes held beside ``qweights``: the block-major scales, and a copy of the words unless
        ``qweights`` holds them in the kernel's order already (``QuantizedExpertWeights.with_group_planes``)."""
        words = self.gate_up_planes.words_eOw, self.down_planes.words_eOw
        stored = self.qweights.gate_up_qweight_e2FDq, self.qweights.down_qweight_eDFq
        copies = sum(w.nbytes for w, q in zip(words, stored) if w.data_ptr() != q.data_ptr())
        return copies + self.gate_up_planes.block_scale.nbytes + self.down_planes.block_scale.nbytes

    def runs_a8(self, num_rows_hint: int, num_local_experts: int) -> bool:
        """Whether a call with this rows hint runs W4A8 (``a8_rows_per_expert``; never in the batch-invariant mode)."""
        return (self.a8_rows_per_expert is not None and not self.batch_invariant
                and num_rows_hint >= self.a8_rows_per_expert * max(1, num_local_experts))

    def forward(self, x_PDx, layout, x_scale_PDb=None):
        from moe_ref.kernels.experts.grouped_mlp_w4 import grouped_mlp_w4

        rows_hint = layout.rows_hint()  # picks GPU tiles and W4A8 (no host sync when the layout has it)
        return grouped_mlp_w4(x_PDx, self.gate_up_planes, self.down_planes, layout.row_start_e, layout.num_rows_e,
                              self.activation, self.situ_beta, self.situ_linear_beta, num_rows_hint=rows_hint,
                              zero_unused_rows=layout.zero_unused_rows, batch_invariant=self.batch_invariant,
                              a8=self.runs_a8(rows_hint, self.gate_up_planes.shape[0]))


class FP8BlockExperts(TritonExperts):
    """``TritonExperts`` with ``fp8=True``, built from a checkpoint's e4m3 weights and fp32 128x128 block scales
    (DeepSeek-V3/R1, Kimi-K2-Instruct, Step3 FP8) instead of quantizing bf16 weights: the forward pass is
    TritonExperts' (FP8 pool as dispatched, or activation-dtype rows quantized per 128 columns here).

    Args:
        qweights: fp8_block ``QuantizedExpertWeights`` (F % 128 == 0, checked at load).
        activation, situ_beta, situ_linear_beta: see ``moe_ref.core.activations``.
    """

    def __init__(self, qweights: QuantizedExpertWeights, activation: str = "silu", situ_beta: float = 4.0,
                 situ_linear_beta: float = 25.0):
        if qweights.spec.format != QuantFormat.FP8_BLOCK:
            raise UnknownNameError(f"FP8BlockExperts takes fp8_block weights, got {qweights.spec.format.value}")
        # NOTE: the checkpoint's tensors run as held (``fp8_weights``: no copy). The layer interleaves its gate/up rows
        # in place at load (``with_interleaved_gate_up``), so GEMM1 runs one dot per k-step; stacked rows run too.
        super().__init__(qweights.gate_up_qweight_e2FDq, qweights.down_qweight_eDFq, activation, situ_beta,
                         situ_linear_beta, fp8_weights=fp8_checkpoint_weights(qweights))
        self.qweights = qweights


def fp8_checkpoint_weights(qweights: QuantizedExpertWeights) -> FP8ExpertWeights:
    """An fp8_block checkpoint's held tensors as ``FP8ExpertWeights`` (the same tensors, no copy; stacked or
    interleaved as held)."""
    return FP8ExpertWeights(qweights.gate_up_qweight_e2FDq, qweights.gate_up_scale_e2FDs, qweights.down_qweight_eDFq,
                            qweights.down_scale_eDFs, gate_up_interleaved=qweights.gate_up_interleaved)


class _DequantizingStack:
    """``[e, N, K]``-like view of one weight of stored experts (``which``: "gate_up" or "down"): ``stack[i]``
    dequantizes expert i to fp32 on access."""

    dtype = torch.float32

    def __init__(self, qweights: QuantizedExpertWeights, which: str):
        self.qweights, self.which = qweights, which

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.qweights.dequantize_expert(i, self.which, torch.float32)


class QuantTorchExperts(TorchLoopExperts):
    """The per-expert torch loop (``TorchLoopExperts``) on the stored weights, each expert dequantized to fp32
    when its rows run: runs anywhere, keeps only the stored bytes, and is the reference of the quantized
    kernels (fp32 GEMMs, output in x's dtype).

    Args:
        qweights: ``QuantizedExpertWeights`` of any format.
        activation, situ_beta, situ_linear_beta: see ``moe_ref.core.activations``.
    """

    name = "torch_quant"

    def __init__(self, qweights: QuantizedExpertWeights, activation: str = "silu", situ_beta: float = 4.0,
                 situ_linear_beta: float = 25.0):
        super().__init__(_DequantizingStack(qweights, "gate_up"), _DequantizingStack(qweights, "down"), activation,
                         situ_beta, situ_linear_beta)
        self.qweights = qweights


def quantized_experts_class(fmt: QuantFormat | str, backend: str = "auto",
                            device: torch.device | str = "cpu") -> type[Experts]:
    """The class ``make_quantized_experts`` builds, without weights (its ``segment_alignment`` is what a layer
    plans its pool with).

    Args:
        fmt: the checkpoint's ``QuantFormat`` (or its value).
        backend: ``"auto"`` (torch on CPU; on CUDA the triton kernels, except fp8_block where ``experts_class("auto",
            device)`` holds more than Triton: that class, over the checkpoint's fp8 tensors), ``"triton"`` or
            ``"torch"``.
        device: where the weights live (decides ``auto``).

    Returns:
        ``W4A16Experts``, ``FP8BlockExperts``, ``QuantTorchExperts`` or the auto class; ``UnknownNameError`` (CFG006)
        otherwise.
    """
    if backend not in QUANT_BACKENDS:
        raise UnknownNameError(f"quantized experts backend={backend!r}; supported: {', '.join(QUANT_BACKENDS)}")
    fp8_block = QuantFormat(fmt) == QuantFormat.FP8_BLOCK
    if backend == "auto":
        auto = experts_class("auto", device)
        if fp8_block and auto.name == "auto":  # DeepGEMM (or another backend) beside Triton, sharing the fp8 tensors
            return auto
        backend = "triton" if torch.device(device).type == "cuda" else "torch"
    if backend == "torch":
        return QuantTorchExperts
    return FP8BlockExperts if fp8_block else W4A16Experts


def make_quantized_experts(qweights: QuantizedExpertWeights, activation: str = "silu", situ_beta: float = 4.0,
                           situ_linear_beta: float = 25.0, *, backend: str = "auto") -> Experts:
    """This rank's experts backend for checkpoint-quantized weights (kept as stored, no bf16 copy).

    Args:
        qweights: from ``moe_ref.checkpoint.quantized.load_quantized_experts``.
        activation, situ_beta, situ_linear_beta: the model's (``cfg.activation``, ``cfg.situ_beta``, ...).
        backend: ``"auto"`` (see ``quantized_experts_class``), ``"triton"`` (W4A16 kernel for int4/mxfp4, the FP8
            block kernel for fp8_block; CUDA or the interpreter) or ``"torch"`` (dequantize-per-expert loop).

    Returns:
        An ``Experts``: ``experts(x_PDx, layout, x_scale_PDb=None) -> y_PDx``. ``FP8BlockExperts`` and the auto class
        take the FP8 pool (``accepts_fp8_input``); the others take activation-dtype rows.
    """
    cls = quantized_experts_class(qweights.spec.format, backend, qweights.device)
    if cls.name == "auto":  # the checkpoint's fp8 tensors, shared by the backends auto holds
        return cls(qweights.gate_up_qweight_e2FDq, qweights.down_qweight_eDFq, activation, situ_beta, situ_linear_beta,
                   fp8_weights=fp8_checkpoint_weights(qweights))
    return cls(qweights, activation, situ_beta, situ_linear_beta)
