"""DeepGEMM expert backend (optional): the routed-expert MLP on DeepGEMM's SM90 grouped GEMMs.

One job: the ``deep_gemm`` entry of the experts registry. Whether DeepGEMM can run here is
``moe_ref.experts.deep_gemm.probe``; the benchmark paths are ``moe_ref.experts.deep_gemm.bench``.

    recv pool x_PDx (bf16, or the FP8 pool as dispatched) --grouped_layout_P (local expert of each row, -1 on
    padding rows)-->
      m_grouped_{bf16,fp8}_gemm_nt_contiguous(x, gate_up)   -> gate_up_P2F (bf16; interleaved fp8 weights: 128-column
                                                               gate and up blocks alternate)
      --kernels.gated_act, fp32, valid rows only: SiLU-gated / SiTU activation (+ fp8 per 128)-->  h_PF
      m_grouped_{bf16,fp8}_gemm_nt_contiguous(h, down)      -> y_PDx (padding rows zeroed when asked)

``DeepGemmExperts.forward_masked`` does the same over DeepGEMM's masked layout (``[e, M, Dx]`` plus the
valid row count per expert), which needs no host sync and can be captured in a CUDA graph for decode.
``forward`` runs it on a masked receive pool (``pool_format="masked"``: the pool IS ``[e, M, Dx]``, no copy).

Shape legend: P receive-pool rows, Dx expert input width, F expert intermediate, e local experts, M rows reserved
per expert in DeepGEMM's masked layout, O and I one weight matrix's output and input features (DeepGEMM's n and
k), Db = ceil(Dx / 128), Ib = ceil(I / 128). ``x_PDx`` and ``x_scale_PDb`` in ``forward`` keep the names of
``Experts.forward``'s signature; the weights' ``D`` is Dx.

What this module relies on in ``sgl-deep-gemm`` 0.1.4 (import name ``deep_gemm``), read from its Python
wrappers and its compiled asserts:

- ``m_grouped_bf16_gemm_nt_contiguous(a, b, d, grouped_layout, compiled_dims='nk', use_psum_layout=False,
  ensure_zero_padding=True, expected_m_for_psum_layout=None)``: ``a [m, k]`` bf16 K-major, ``b [G, n, k]``
  bf16 contiguous, ``d [m, n]`` bf16, ``grouped_layout [m]`` int32 contiguous: the group of each row, -1 on
  padding rows. Every group's segment starts on a multiple of ``get_mk_alignment_for_contiguous_layout()``
  (128). Output rows labelled -1 are not promised to be zero (DeepGEMM's own tests zero them before
  comparing), so this backend zeroes them.
- ``m_grouped_fp8_gemm_nt_contiguous(a, b, d, grouped_layout, recipe=None, ..., disable_ue8m0_cast=False, ...)``
  with ``a = (x fp8 e4m3 [m, k], sf fp32 [m, k/128])`` and ``b = (w fp8 [G, n, k], sf fp32 [G, n/128, k/128])``;
  on SM90 the default recipe is (1, 128, 128) and the scales are plain fp32 (``disable_ue8m0_cast=True``,
  as DeepGEMM's SM90 tests pass). Activation scales are ``max(amax, 1e-4) / 448`` per 128 columns, as
  ``deep_gemm.utils.per_token_cast_to_fp8(x, use_ue8m0=False)`` makes them; moe_ref quantizes rows with its own
  kernels (the FP8 pool as dispatched, h between the GEMMs, bf16 rows here: ``kernels.quantize_rows``), which
  divide where DeepGEMM's helper multiplies by the reciprocal (scales an ulp apart at most). Weights are quantized
  by moe_ref's own
  ``kernels.fp8.quantize_fp8_per_block_128`` (the same recipe as ``deep_gemm.utils.per_block_cast_to_fp8(w,
  use_ue8m0=False)``: fp32 ``max(block amax, 1e-4) / 448`` per 128x128 block; plain fp32 scales need no
  DeepGEMM-specific format on SM90).
- Both contiguous GEMMs take ``use_psum_layout=True``: ``grouped_layout`` is then ``[G]`` int32, the end row of each
  group, whose rows start at the 128-aligned end of the group before (``ExpertLayout.packed``); the scheduler stops
  at the last group. With the row layout every 128-row block of ``a`` is scheduled and its weights loaded, the
  blocks labelled -1 only skip the math (``scheduler/gemm.cuh``, ``is_computation_valid``), so a pool sized for the
  cap cost the cap's time (2026-12-07, one H100: the default FP8 layer at T = 1024 ran 2,935 us against 1,660 us
  on Triton).
- ``m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, expected_m, compiled_dims='nk')`` and
  ``m_grouped_fp8_fp4_gemm_nt_masked(a, b, d, masked_m, expected_m, recipe=None, ..., disable_ue8m0_cast=False)``:
  ``a [G, M, k]`` (fp8: ``sf [G, M, k/128]``), ``d [G, M, n]``, ``masked_m [G]`` int32, ``expected_m > 0``.
  Rows ``>= masked_m[g]`` of ``d`` are not written; this backend zeroes them.

The first call of each shape JIT-compiles a kernel (seconds to a minute): warm up before timing or
before capturing a CUDA graph.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from moe_ref.experts.deep_gemm.probe import call_deep_gemm, deep_gemm_status, import_deep_gemm
from moe_ref.core.errors import (DeviceError, DTypeError, FP8AlignmentError, ShapeError, ShapeUnsupportedError,
                                 UnknownNameError)
from moe_ref.experts import Experts, ExpertLayout
from moe_ref.experts.base import FP8ExpertWeights
from moe_ref.kernels.runtime._triton_utils import FP8_DTYPE
from moe_ref.kernels.ep.pool_rows import pool_row_experts, zero_rows_outside_segments

__all__ = ["DeepGemmExperts", "grouped_layout"]


# --------------------------------------------------------------------------------------------------
# FP8 helper (activations: moe_ref's row quantizer, as the FP8 pool; weights: FP8ExpertWeights.quantize)
# --------------------------------------------------------------------------------------------------
def _quantize_rows_fp8(x_I: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., I]`` -> (fp8 ``[..., I]``, fp32 ``[..., Ib]``) per row per 128 columns (``ops.quantize_rows_fp8``: one
    launch on CUDA), the recipe of the FP8 pool the dispatch delivers."""
    from moe_ref.kernels.runtime import ops

    *lead, k = x_I.shape
    x_fp8, scale = ops.quantize_rows_fp8(x_I.reshape(-1, k).contiguous())
    return x_fp8.view(*lead, k), scale.view(*lead, scale.shape[-1])


# --------------------------------------------------------------------------------------------------
# the experts backend
# --------------------------------------------------------------------------------------------------
class DeepGemmExperts(Experts):
    """Local experts on DeepGEMM grouped GEMMs (bf16, or FP8 1x128 activations / 128x128 weights).

    Args:
        gate_up_weight_e2FD: ``[e, 2F, D]`` CUDA, gate rows then up rows of each local expert.
        down_weight_eDF: ``[e, D, F]`` CUDA.
        activation, situ_beta, situ_linear_beta: see ``moe_ref.core.activations`` (applied between the GEMMs by
            ``kernels.gated_act``, fp32, on the valid rows only).
        fp8: quantize the weights once here (128x128 block scales); the rows come as the FP8 pool (fp8 +
            per-row per-128 scales, ``accepts_fp8_input``) or are quantized per call. Else the weights are used
            as bf16 (the caller's tensors when they are bf16 and contiguous; a bf16 copy when they are not).
        fp8_weights: already-quantized weights (``FP8ExpertWeights``, stacked or interleaved gate/up rows; this
            backend quantizes to the same, interleaved) to run as given, so another backend can share them. Implies
            ``fp8``. Interleaved rows make GEMM1's columns alternate 128-wide gate and up blocks, which the
            activation reads so.

    Raises:
        BackendUnavailableError (ENV001): deep_gemm is not usable here; the message carries
            ``deep_gemm_status().reason``.
        DeviceError, ShapeError, ShapeUnsupportedError, FP8AlignmentError: weights not on CUDA,
            inconsistent shapes, dims DeepGEMM cannot tile (bf16: D and F multiples of 8; fp8: of 128).
    """

    name = "deep_gemm"
    segment_alignment = 128  # get_mk_alignment_for_contiguous_layout() of 0.1.x (checked per call)
    supports_fp8 = True  # fp8=True: fp8 weights, and the FP8 pool is taken as dispatched (accepts_fp8_input)

    def __init__(self, gate_up_weight_e2FD: torch.Tensor, down_weight_eDF: torch.Tensor, activation: str = "silu",
                 situ_beta: float = 4.0, situ_linear_beta: float = 25.0, *, fp8: bool = False,
                 fp8_weights: FP8ExpertWeights | None = None):
        deep_gemm = import_deep_gemm()
        super().__init__(gate_up_weight_e2FD, down_weight_eDF, activation, situ_beta, situ_linear_beta)
        if activation not in ("silu", "situ"):
            raise UnknownNameError(f"activation={activation!r}; supported: silu, situ")
        self._deep_gemm = deep_gemm
        self.fp8 = self.accepts_fp8_input = fp8 = fp8 or fp8_weights is not None
        self.mk_alignment = int(deep_gemm.get_mk_alignment_for_contiguous_layout())
        self.num_local_experts, self.hidden_size, self.intermediate_size = _check_weights(
            gate_up_weight_e2FD, down_weight_eDF, fp8)
        if fp8:
            # NOTE: the bf16 originals stay referenced by the base class (the caller's tensors, no copy).
            if fp8_weights is None:
                fp8_weights = FP8ExpertWeights.quantize(gate_up_weight_e2FD, down_weight_eDF)
            self._gate_up_weight = (fp8_weights.gate_up_fp8_e2FD, fp8_weights.gate_up_scale_e2FbDb)
            self._down_weight = (fp8_weights.down_fp8_eDF, fp8_weights.down_scale_eDbFb)
        else:
            self._gate_up_weight = gate_up_weight_e2FD.to(torch.bfloat16).contiguous()
            self._down_weight = down_weight_eDF.to(torch.bfloat16).contiguous()
        self.fp8_weights = fp8_weights
        # DeepGEMM's psum form of the contiguous layout (segment ends, not each row's expert), where this build has
        # it; a call that it raises in turns it off for this instance, the reason kept in ``psum_refused``
        self._psum = all("use_psum_layout" in inspect.signature(getattr(deep_gemm, name)).parameters
                         for name in ("m_grouped_fp8_gemm_nt_contiguous", "m_grouped_bf16_gemm_nt_contiguous"))
        self.psum_refused: str | None = None

    @property
    def gate_up_interleaved(self) -> bool:
        """GEMM1's output columns alternate 128-wide gate and up blocks (its fp8 weights are interleaved)."""
        return self.fp8_weights is not None and self.fp8_weights.gate_up_interleaved

    @classmethod
    def unavailable_reason(cls) -> str | None:
        status = deep_gemm_status()
        return None if status.available else status.reason

    @classmethod
    def installed_version(cls) -> str | None:
        return deep_gemm_status().version

    # --- contiguous layout ---------------------------------------------------------------------------
    def forward(self, x_PDx: torch.Tensor, layout: ExpertLayout, x_scale_PDb: torch.Tensor | None = None) -> torch.Tensor:
        """Run every local expert over its segment of the pool (DeepGEMM's masked GEMMs when the pool is masked).

        Args:
            x_PDx: ``[P, Dx]`` CUDA pool rows, expert-major: bf16/fp16/fp32, or fp8 e4m3 (with ``fp8=True``); the rows
                of local expert i are ``x_PDx[row_start_e[i] : row_start_e[i] + num_rows_e[i]]``.
            layout: ``ExpertLayout``; ``layout.alignment`` must be a multiple of DeepGEMM's M alignment (128),
                or the layout masked (``masked_rows``: the pool is ``[e, M, Dx]`` as it lies).
            x_scale_PDb: ``[P, Db]`` fp32 per-128 scales of fp8 ``x_PDx``, else None.

        Returns:
            y_PDx: ``[P, Dx]`` in ``x_PDx``'s dtype (bf16 for fp8 rows); rows outside every segment are zero unless
            ``layout.zero_unused_rows`` is False. No host sync.
        """
        self._check_input(x_PDx, x_scale_PDb, 2)
        if layout.num_local_experts != self.num_local_experts:
            raise ShapeError(f"layout has {layout.num_local_experts} experts, the weights {self.num_local_experts}")
        if layout.masked_rows:
            return self._forward_masked_pool(x_PDx, x_scale_PDb, layout)
        if layout.alignment % self.mk_alignment:
            raise ShapeError(f"layout.alignment={layout.alignment} is not a multiple of deep_gemm's contiguous-layout "
                             f"alignment {self.mk_alignment}; build the pool with alignment={self.mk_alignment}")
        num_rows, out_dtype = x_PDx.shape[0], _out_dtype(x_PDx)
        if num_rows == 0:
            return torch.zeros_like(x_PDx, dtype=out_dtype)
        a_PD = self._gemm_input(x_PDx, x_scale_PDb)
        # Pad the pool to whole GEMM M blocks (only when P is not already a multiple of the alignment).
        num_padded_rows = -(-num_rows // self.mk_alignment) * self.mk_alignment
        if num_padded_rows != num_rows:
            a_PD = tuple(_pad_rows(part, num_padded_rows) for part in a_PD) if self.fp8 else \
                _pad_rows(a_PD, num_padded_rows)
        grouped_layout_P = grouped_layout(layout, num_padded_rows, x_PDx.device)
        # A packed pool's segment ends locate every segment (psum layout): the GEMMs then stop at the last one. With
        # the expert of each row they load the weights for every 128-row block of the pool, also the blocks no expert
        # uses, and the dispatcher's pool is sized for the cap, not the call.
        groups = (layout.row_start_e + layout.num_rows_e).to(torch.int32) if layout.packed and self._psum else None

        gate_up_P2F = self._grouped_gemm(a_PD, self._gate_up_weight, grouped_layout_P, groups)
        h_PF = self._activation(gate_up_P2F, group_P=grouped_layout_P)
        y_PDx = self._grouped_gemm(h_PF, self._down_weight, grouped_layout_P, groups)[:num_rows]
        if layout.zero_unused_rows:  # DeepGEMM leaves the rows of group -1 unwritten
            zero_rows_outside_segments(y_PDx, grouped_layout_P[:num_rows])
        return y_PDx.to(out_dtype)

    def _grouped_gemm(self, a_PI, weight, grouped_layout_P: torch.Tensor,
                      segment_end_e: torch.Tensor | None = None) -> torch.Tensor:
        """``[P, I] x [e, O, I] -> [P, O]`` bf16 on DeepGEMM's contiguous layout (``a_PI``: fp8 + scales, or bf16):
        its psum form where ``segment_end_e`` (``[e]`` int32, each segment's end in a packed pool) is given, else the
        expert of each row (``grouped_layout_P``). Rows past the last segment are left unwritten."""
        num_out = (weight[0] if self.fp8 else weight).shape[1]
        num_rows = (a_PI[0] if self.fp8 else a_PI).shape[0]
        out_PO = torch.empty(num_rows, num_out, dtype=torch.bfloat16, device=grouped_layout_P.device)
        name = "m_grouped_fp8_gemm_nt_contiguous" if self.fp8 else "m_grouped_bf16_gemm_nt_contiguous"
        flags = {"disable_ue8m0_cast": True} if self.fp8 else {}
        if segment_end_e is not None and self._psum:
            try:
                call_deep_gemm(self._deep_gemm, name, a_PI, weight, out_PO, segment_end_e, use_psum_layout=True,
                               **flags)
                return out_PO
            except RuntimeError as err:  # a build whose kernels refuse it here: the row layout from now on
                self._psum, self.psum_refused = False, str(err)[-300:]
        call_deep_gemm(self._deep_gemm, name, a_PI, weight, out_PO, grouped_layout_P, **flags)
        return out_PO

    def _gemm_input(self, x: torch.Tensor, x_scale: torch.Tensor | None):
        """What the first GEMM takes: ``(fp8 rows, fp32 scales)`` with fp8 weights (quantized here unless the rows
        came as fp8), else contiguous bf16 rows."""
        if not self.fp8:
            return x.to(torch.bfloat16).contiguous()
        if x_scale is not None:
            return x.contiguous(), x_scale.contiguous()
        return _quantize_rows_fp8(x)

    def _activation(self, gate_up_P2F: torch.Tensor, **valid_rows):
        """The gated activation of the valid rows (``kernels.gated_act``): fp8 + per-128 scales for the fp8 GEMM,
        bf16 rows for the bf16 one. Rows that are not valid are left unwritten: the next GEMM skips them."""
        from moe_ref.kernels.experts.gated_act import gated_activation_rows

        h_PF, h_scale_PFb = gated_activation_rows(
            gate_up_P2F, activation=self.activation, situ_beta=self.situ_beta, situ_linear_beta=self.situ_linear_beta,
            quant=self.fp8, out_dtype=torch.bfloat16, interleaved=self.gate_up_interleaved, **valid_rows)
        return (h_PF, h_scale_PFb) if self.fp8 else h_PF

    # --- masked layout (decode, CUDA graphs) ---------------------------------------------------------
    def _forward_masked_pool(self, x_PDx: torch.Tensor, x_scale_PDb: torch.Tensor | None,
                             layout: ExpertLayout) -> torch.Tensor:
        """A masked pool (``layout.masked_rows`` = M) is ``[e, M, Dx]`` as it lies: run the masked GEMMs on that
        view, with the layout's counts as ``masked_m`` and the host's estimate of rows per expert as the hint."""
        num_experts, max_rows = self.num_local_experts, layout.masked_rows
        if x_PDx.shape[0] != num_experts * max_rows:
            raise ShapeError(f"a masked pool of {num_experts} experts x {max_rows} rows must be "
                             f"[{num_experts * max_rows}, D], got {tuple(x_PDx.shape)}")
        expected_m = max(1, -(-layout.rows_hint() // num_experts))
        y_eMDx = self.forward_masked(
            x_PDx.view(num_experts, max_rows, -1), layout.num_rows_e, expected_m,
            None if x_scale_PDb is None else x_scale_PDb.view(num_experts, max_rows, -1),
            zero_unused_rows=layout.zero_unused_rows)
        return y_eMDx.view(x_PDx.shape)

    def forward_masked(self, x_eMDx: torch.Tensor, masked_m_e: torch.Tensor, expected_m: int,
                       x_scale_eMDb: torch.Tensor | None = None, *, zero_unused_rows: bool = True) -> torch.Tensor:
        """Run expert i over rows ``x_eMDx[i, :masked_m_e[i]]`` (DeepGEMM's masked layout).

        No host sync, fixed shapes: after one warm-up call (JIT compile) it can be captured in a
        ``torch.cuda.CUDAGraph``.

        Args:
            x_eMDx: ``[e, M, Dx]`` CUDA bf16/fp16/fp32, or fp8 e4m3 (``fp8=True``); M = rows reserved per expert.
            masked_m_e: ``[e]`` int32 CUDA (int64 is converted), valid rows per expert, each in ``[0, M]``.
            expected_m: a host int > 0, the typical rows per expert (DeepGEMM's tiling hint only).
            x_scale_eMDb: ``[e, M, Db]`` fp32 scales of fp8 ``x_eMDx``, else None.
            zero_unused_rows: rows ``>= masked_m_e[i]`` come out as zeros (False: left unwritten).

        Returns:
            y_eMDx: ``[e, M, Dx]`` in ``x_eMDx``'s dtype (bf16 for fp8 rows).
        """
        self._check_input(x_eMDx, x_scale_eMDb, 3)
        num_experts, max_rows, _ = x_eMDx.shape
        if num_experts != self.num_local_experts:
            raise ShapeError(f"x_eMDx has {num_experts} experts, the weights {self.num_local_experts}")
        if tuple(masked_m_e.shape) != (num_experts,) or masked_m_e.device != x_eMDx.device:
            raise ShapeError(f"masked_m_e must be [{num_experts}] on {x_eMDx.device}, got {tuple(masked_m_e.shape)} "
                             f"on {masked_m_e.device}")
        if not isinstance(expected_m, int) or expected_m <= 0:
            raise ShapeError(f"expected_m={expected_m!r} must be a positive int (deep_gemm asserts expected_m > 0)")
        out_dtype = _out_dtype(x_eMDx)
        if max_rows == 0:
            return torch.zeros_like(x_eMDx, dtype=out_dtype)
        masked_m_e = masked_m_e.to(torch.int32).contiguous()
        gate_up_eM2F = self._masked_gemm(self._gemm_input(x_eMDx, x_scale_eMDb), self._gate_up_weight, masked_m_e,
                                         expected_m)
        h_PF = self._activation(gate_up_eM2F.view(num_experts * max_rows, -1), num_rows_e=masked_m_e,
                                masked_rows=max_rows)
        h_eMF = tuple(part.view(num_experts, max_rows, -1) for part in h_PF) if self.fp8 else \
            h_PF.view(num_experts, max_rows, -1)
        y_eMDx = self._masked_gemm(h_eMF, self._down_weight, masked_m_e, expected_m)
        if zero_unused_rows:
            row_start_e = torch.arange(num_experts, device=x_eMDx.device) * max_rows
            y_PDx = y_eMDx.view(num_experts * max_rows, -1)  # expert i's rows at i * M, its segment masked_m_e[i]
            zero_rows_outside_segments(y_PDx, pool_row_experts(row_start_e, masked_m_e, y_PDx.shape[0]))
        return y_eMDx.to(out_dtype)

    def _masked_gemm(self, a_eMI, weight, masked_m_e: torch.Tensor, expected_m: int) -> torch.Tensor:
        """``[e, M, I] x [e, O, I] -> [e, M, O]`` bf16 (``a_eMI``: fp8 + scales, or bf16)."""
        num_out = (weight[0] if self.fp8 else weight).shape[1]
        lead = (a_eMI[0] if self.fp8 else a_eMI).shape[:2]
        out_eMO = torch.empty(*lead, num_out, dtype=torch.bfloat16, device=masked_m_e.device)
        if self.fp8:
            call_deep_gemm(self._deep_gemm, "m_grouped_fp8_fp4_gemm_nt_masked", a_eMI, weight, out_eMO, masked_m_e,
                           expected_m, disable_ue8m0_cast=True)
        else:
            call_deep_gemm(self._deep_gemm, "m_grouped_bf16_gemm_nt_masked", a_eMI, weight, out_eMO, masked_m_e,
                           expected_m)
        return out_eMO

    def _check_input(self, x: torch.Tensor, x_scale: torch.Tensor | None, ndim: int) -> None:
        _require_cuda("the input", x)
        if x.dim() != ndim or x.shape[-1] != self.hidden_size:
            raise ShapeError(f"expected a {ndim}-D input with last dim D={self.hidden_size}, got {tuple(x.shape)}")
        if x.dtype == FP8_DTYPE:
            if not self.fp8:
                raise DTypeError("fp8 rows need fp8 deep_gemm experts (fp8=True); dequantize them for bf16 weights")
            if x_scale is None or tuple(x_scale.shape) != (*x.shape[:-1], -(-self.hidden_size // 128)):
                raise ShapeError(f"fp8 rows {tuple(x.shape)} need fp32 scales [..., {-(-self.hidden_size // 128)}], "
                                 f"got {None if x_scale is None else tuple(x_scale.shape)}")
        elif x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise DTypeError(f"input dtype {x.dtype}; deep_gemm experts take bf16/fp16/fp32/fp8 (computed in bf16/fp8)")


def _pad_rows(rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``rows`` ``[n, c]`` with zero rows appended up to ``num_rows`` (moved as bytes: fp8 has no pad kernel)."""
    raw = rows.view(torch.uint8) if rows.dtype == FP8_DTYPE else rows
    return F.pad(raw, (0, 0, 0, num_rows - rows.shape[0])).view(rows.dtype)


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    """The experts' output dtype: the rows' own, bf16 for fp8 rows."""
    return torch.bfloat16 if x.dtype == FP8_DTYPE else x.dtype


def _require_cuda(name: str, tensor: torch.Tensor) -> None:
    if tensor.device.type != "cuda":
        raise DeviceError(f"{name} is on {tensor.device}; deep_gemm runs on CUDA tensors only")


def _check_weights(gate_up_weight_e2FD: torch.Tensor, down_weight_eDF: torch.Tensor, fp8: bool) -> tuple[int, int, int]:
    """Validate the expert weights; returns (e, D, F)."""
    for name, weight in (("gate_up_weight_e2FD", gate_up_weight_e2FD), ("down_weight_eDF", down_weight_eDF)):
        _require_cuda(name, weight)
        if weight.dim() != 3:
            raise ShapeError(f"{name} must be 3-D, got {tuple(weight.shape)}")
    num_experts, two_f, hidden = gate_up_weight_e2FD.shape
    intermediate = two_f // 2
    if two_f % 2 or tuple(down_weight_eDF.shape) != (num_experts, hidden, intermediate):
        raise ShapeError(f"gate_up [e, 2F, D]={tuple(gate_up_weight_e2FD.shape)} and down [e, D, F]="
                         f"{tuple(down_weight_eDF.shape)} disagree")
    if fp8 and (hidden % 128 or intermediate % 128):
        raise FP8AlignmentError(f"fp8 deep_gemm experts need D and F divisible by 128, got D={hidden}, F={intermediate}; "
                                "use fp8=False")
    if not fp8 and (hidden % 8 or intermediate % 8):
        raise ShapeUnsupportedError(f"deep_gemm's TMA loads need 16-byte rows: D={hidden} and F={intermediate} must be "
                                    "multiples of 8 for bf16")
    return num_experts, hidden, intermediate


def grouped_layout(layout: ExpertLayout, num_rows: int, device: torch.device) -> torch.Tensor:
    """DeepGEMM's ``grouped_layout`` of a (possibly padded) pool: ``[num_rows]`` int32 on ``device``, the local expert
    of each row, -1 outside every segment (``kernels.pool_rows``: one launch, no host sync).

    Example: starts [0, 128, 128], counts [3, 0, 5], 256 rows -> rows 0-2 -> 0, rows 3-127 -> -1, rows 128-132 -> 2,
    rows 133-255 -> -1.
    """
    return pool_row_experts(layout.row_start_e.to(device), layout.num_rows_e.to(device), num_rows)
