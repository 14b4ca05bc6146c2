"""Expert backends: the routed-expert MLP over an expert-major receive pool.

    recv pool x_PDx (expert-major, segments aligned) --GEMM1 gate||up--> act --GEMM2 down--> y_PDx

Shape legend: P receive-pool rows, Dx expert input width (hidden, or latent for Kimi-K3), F expert
intermediate, e local experts, Db = ceil(Dx / 128), Fb = ceil(F / 128). The argument names all backends share
(``x_RD``, ``x_scale_RDb``, ``gate_up_weight_e2FD``, ``down_weight_eDF``) predate the package legend: read R as P
and D as Dx in them.

Every backend is called as ``experts(x_RD, layout, x_scale_RDb=None) -> y_PDx`` (``Experts.__call__``
checks the input format, then runs ``forward``) over the same layout (``ExpertLayout``): the rows of
local expert i are ``x_RD[row_start_e[i] : row_start_e[i] + num_rows_e[i]]``; rows outside every segment
(alignment padding) come out as zeros. Each backend declares what it wants from the dispatcher:

- ``segment_alignment``: rows each segment of the pool should start on (the dispatcher's pool layout).
- ``computes_whole_segments``: give me whole aligned segments with zeroed padding (the torch loop).
- ``supports_fp8``: ``fp8=True`` is accepted: weights quantized once to fp8 e4m3 with fp32 128x128
  block scales (``kernels.fp8.quantize_fp8_per_block_128``).
- ``accepts_fp8_input``: ``x_RD`` may be the FP8 pool (e4m3 + per-row per-128 ``x_scale_RDb``) as
  dispatched; the others get activation-dtype rows (``Dispatcher.expert_input`` decides).

| name           | what                                             | where                 | alignment | fp8 weights / fp8 input |
|----------------|--------------------------------------------------|-----------------------|-----------|-------------------------|
| ``torch``      | per-expert loop of plain matmuls (the oracle)    | anywhere              | 128       | no / no                 |
| ``grouped_mm`` | ``torch.nn.functional.grouped_mm``               | torch >= 2.9          | 16        | no / no                 |
| ``triton``     | ``kernels.grouped_mlp``, activation fused        | CUDA (or interpreter) | 1         | ``fp8=True`` / with fp8 |
| ``deep_gemm``  | DeepGEMM grouped GEMMs (masked on a masked pool) | SM90 + deep_gemm      | 128       | ``fp8=True`` / with fp8 |
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from moe_ref.activations import dense_mlp, gated_activation
from moe_ref.errors import BackendUnavailableError, DTypeError, InvalidConfigError, UnknownNameError
from moe_ref.kernels._triton_utils import FP8_DTYPE



@dataclass(frozen=True)
class ExpertLayout:
    """Where each local expert's rows sit in the receive pool.

    Attributes:
        row_start_e: ``[e]`` int64, first pool row of each expert (a multiple of ``alignment``).
        num_rows_e: ``[e]`` int64, valid rows of each expert (may be 0).
        num_pool_rows: P, rows of the pool tensor the experts get (>= the last segment's aligned end; the
            dispatcher passes exactly that prefix of its receive pool).
        alignment: segment alignment in rows (the backend's ``segment_alignment`` by default).
        num_rows_hint: about how many rows are valid, known on the host without a sync (the device-side
            dispatch passes its static estimate, so a call can be captured in a CUDA graph); None: backends
            that need it read ``num_rows_e.sum()`` (a host sync).
        zero_unused_rows: False lets a backend leave output rows outside every segment unwritten (the device-side
            dispatch hands over its whole pool and never reads them; zeroing them would cost more than the GEMMs
            at decode). True: they come out as zeros.
        masked_rows: M > 0 when the pool is masked (``moe_ref.capacity``): expert i's segment starts at i * M and
            ``num_pool_rows == e * M``, so the pool viewed as ``[e, M, Dx]`` is DeepGEMM's masked layout with
            ``num_rows_e`` as its ``masked_m``. 0: contiguous segments.
    """

    row_start_e: torch.Tensor
    num_rows_e: torch.Tensor
    num_pool_rows: int
    alignment: int
    num_rows_hint: int | None = None
    zero_unused_rows: bool = True
    masked_rows: int = 0

    def rows_hint(self) -> int:
        """``num_rows_hint``, or the exact count of valid rows (NOTE: then a host sync)."""
        return int(self.num_rows_e.sum()) if self.num_rows_hint is None else self.num_rows_hint

    @staticmethod
    def from_counts(num_rows_e: torch.Tensor, alignment: int, num_pool_rows: int | None = None) -> "ExpertLayout":
        """Pack segments back to back, each starting on a multiple of ``alignment``.

        Example: counts [3, 0, 5], alignment 4 -> starts [0, 4, 4], ends 3, 4, 9; P = 12 unless given.
        """
        num_rows_e = num_rows_e.to(torch.int64)
        aligned_e = (num_rows_e + alignment - 1) // alignment * alignment
        row_start_e = torch.cumsum(aligned_e, 0) - aligned_e
        needed = int(aligned_e.sum()) if num_pool_rows is None else num_pool_rows
        return ExpertLayout(row_start_e, num_rows_e, needed, alignment)

    @property
    def num_local_experts(self) -> int:
        return self.num_rows_e.numel()

    def row_expert_R(self) -> torch.Tensor:
        """``[P]`` int64: the local expert of each pool row, -1 for padding rows (R in the name predates the legend)."""
        expert_P = torch.full((self.num_pool_rows,), -1, dtype=torch.int64, device=self.num_rows_e.device)
        for i, (start, count) in enumerate(zip(self.row_start_e.tolist(), self.num_rows_e.tolist())):
            expert_P[start:start + count] = i
        return expert_P


class Experts(ABC):
    """The local experts' weights and one way to run them.

    Args:
        gate_up_weight_e2FD: ``[e, 2F, Dx]`` gate rows then up rows of each local expert.
        down_weight_eDF: ``[e, Dx, F]``.
        activation, situ_beta, situ_linear_beta: see ``moe_ref.activations``.
    """

    name = "abstract"
    # True: give me whole aligned segments with zeroed padding (see moe_ref.dispatch's NOTE); False: I skip
    # padding rows myself and leave them zero in my output.
    computes_whole_segments = False
    # Rows each expert segment of the receive pool should start on: what MegaMoE plans its pool with
    # unless told otherwise. Smaller = fewer padding rows the experts are handed.
    segment_alignment = 128
    # The receive-pool formats (``moe_ref.capacity``) this backend runs; the layer refuses the others (CFG007).
    # Reading segments through ``row_start_e``/``num_rows_e`` runs both; deep_gemm runs DeepGEMM's masked GEMMs on
    # a masked pool.
    pool_formats = ("contiguous", "masked")
    # True: the constructor takes keyword-only ``fp8`` (weights quantized once to fp8 128x128 blocks).
    supports_fp8 = False
    # Whether this instance runs fp8 weights, and whether its forward takes the FP8 pool (fp8 ``x_RD`` +
    # ``x_scale_RDb``) as dispatched. Backends set them per instance (they follow ``fp8``).
    fp8 = False
    accepts_fp8_input = False

    def __init__(self, gate_up_weight_e2FD: torch.Tensor, down_weight_eDF: torch.Tensor, activation: str = "silu",
                 situ_beta: float = 4.0, situ_linear_beta: float = 25.0):
        self.gate_up_weight_e2FD = gate_up_weight_e2FD
        self.down_weight_eDF = down_weight_eDF
        self.activation, self.situ_beta, self.situ_linear_beta = activation, situ_beta, situ_linear_beta

    @abstractmethod
    def forward(self, x_RD: torch.Tensor, layout: ExpertLayout, x_scale_RDb: torch.Tensor | None = None) -> torch.Tensor:
        """``x_RD [P, Dx]`` pool rows -> ``y_PDx [P, Dx]`` (padding rows zero): in ``x_RD``'s dtype, bf16 for
        an fp8 ``x_RD`` (which comes with its ``x_scale_RDb [P, Db]`` fp32, only where
        ``accepts_fp8_input``)."""

    def __call__(self, x_RD: torch.Tensor, layout: ExpertLayout, x_scale_RDb: torch.Tensor | None = None) -> torch.Tensor:
        """Check the input format against ``accepts_fp8_input``, then ``forward``.

        Args:
            x_RD: ``[P, Dx]`` pool rows: the activation dtype, or fp8 e4m3 for a backend that accepts it.
            layout: the segments of the local experts in ``x_RD``.
            x_scale_RDb: ``[P, Db]`` fp32 per-row per-128-column scales, given iff ``x_RD`` is fp8.

        Returns:
            ``y_PDx [P, Dx]``; raises ``DTypeError`` (INP002) for fp8 rows this backend cannot take, or a
            missing/unexpected scale.
        """
        is_fp8 = x_RD.dtype == FP8_DTYPE
        if is_fp8 and not self.accepts_fp8_input:
            raise DTypeError(f"experts backend {self.name!r} (fp8={self.fp8}) takes {self.gate_up_weight_e2FD.dtype} "
                             f"rows, got {x_RD.dtype}: dequantize first (Dispatcher.expert_input does)")
        if is_fp8 != (x_scale_RDb is not None):
            raise DTypeError(f"x_scale_RDb must be given exactly for fp8 rows: x_RD is {x_RD.dtype}, x_scale_RDb is "
                             f"{'None' if x_scale_RDb is None else tuple(x_scale_RDb.shape)}")
        return self.forward(x_RD, layout, x_scale_RDb)


class TorchLoopExperts(Experts):
    """One plain matmul pair per expert: slow and obviously right. Each row's result does not depend on
    which other rows share its expert, so chunked and unchunked runs agree bitwise on CPU."""

    name = "torch"
    computes_whole_segments = True
    segment_alignment = 128  # whole 128-row segments keep chunked == unchunked bitwise (moe_ref.dispatch NOTE)

    def forward(self, x_RD, layout, x_scale_RDb=None):
        y_PDx = torch.zeros_like(x_RD)
        for i, (start, count) in enumerate(zip(layout.row_start_e.tolist(), layout.num_rows_e.tolist())):
            if count:
                y_PDx[start:start + count] = dense_mlp(
                    x_RD[start:start + count], self.gate_up_weight_e2FD[i], self.down_weight_eDF[i],
                    self.activation, self.situ_beta, self.situ_linear_beta)
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

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
        if self._grouped_mm is None:
            raise BackendUnavailableError(f"torch {torch.__version__} has no grouped_mm; use backend='torch'")

    def forward(self, x_RD, layout, x_scale_RDb=None):
        num_rows = x_RD.shape[0]
        if num_rows == 0:
            return torch.zeros_like(x_RD)
        aligned_e = (layout.num_rows_e + layout.alignment - 1) // layout.alignment * layout.alignment
        offs_e = (layout.row_start_e + aligned_e).clamp(max=num_rows).to(torch.int32)
        x_in = x_RD.to(self.gate_up_weight_e2FD.dtype)
        gate_up_P2F = self._grouped_mm(x_in, self.gate_up_weight_e2FD.transpose(-2, -1), offs=offs_e)
        gate_PF, up_PF = gate_up_P2F.chunk(2, dim=-1)
        h_PF = gated_activation(gate_PF, up_PF, self.activation, self.situ_beta, self.situ_linear_beta)
        y_PDx = self._grouped_mm(h_PF.to(self.down_weight_eDF.dtype).contiguous(),
                                 self.down_weight_eDF.transpose(-2, -1), offs=offs_e)
        valid_P = _valid_rows(layout, num_rows, x_RD.device)
        return torch.where(valid_P[:, None], y_PDx, 0).to(x_RD.dtype)


def _valid_rows(layout: ExpertLayout, num_rows: int, device) -> torch.Tensor:
    """``[P]`` bool, True on rows inside a segment (computed on device, no host sync)."""
    rows_P = torch.arange(num_rows, device=device)
    ends_e = layout.row_start_e + layout.num_rows_e
    seg_P = torch.searchsorted(layout.row_start_e, rows_P, right=True) - 1
    seg_P = seg_P.clamp(min=0)
    return (rows_P >= layout.row_start_e[seg_P]) & (rows_P < ends_e[seg_P])


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
        activation, situ_beta, situ_linear_beta: see ``moe_ref.activations`` (fused in the kernel, fp32).
        fp8: quantize the weights ONCE here to fp8 e4m3 with fp32 128x128 block scales
            (``quantize_fp8_per_block_128``) and run the FP8 kernel. ``forward`` then takes the FP8 pool with
            its per-row per-128 scales as dispatched (``accepts_fp8_input``) and returns bf16; given
            activation-dtype rows it quantizes them per 128 columns itself and returns their dtype. The fp8
            gate_up rows are kept interleaved (gate j, up j; ``gate_up_interleaved``), so GEMM1 runs one dot per
            k-step: 1.03-1.09x faster on an H200 than stacked rows (docs/results/ab_gate_up_layout_*); the bf16
            kernel gains nothing from it (within 1%), so bf16 runs the caller's weights as given.
    """

    name = "triton"
    segment_alignment = 1
    supports_fp8 = True
    gate_up_interleaved = False  # the fp8 gate_up rows alternate gate j, up j (True for fp8=True instances)

    def __init__(self, gate_up_weight_e2FD: torch.Tensor, down_weight_eDF: torch.Tensor, activation: str = "silu",
                 situ_beta: float = 4.0, situ_linear_beta: float = 25.0, *, fp8: bool = False):
        super().__init__(gate_up_weight_e2FD, down_weight_eDF, activation, situ_beta, situ_linear_beta)
        self.fp8 = self.accepts_fp8_input = fp8
        if fp8:
            from moe_ref.kernels.fp8 import quantize_fp8_per_block_128
            from moe_ref.kernels.grouped_mlp import interleave_gate_up

            # NOTE: the originals stay referenced by the base class (the caller's tensors, no copy).
            gate_up_fp8_e2FD, self.gate_up_scale_e2FbDb = quantize_fp8_per_block_128(gate_up_weight_e2FD)
            self.gate_up_fp8_e2FD = interleave_gate_up(gate_up_fp8_e2FD)  # the block scales stay stacked
            self.gate_up_interleaved = True
            self.down_fp8_eDF, self.down_scale_eDbFb = quantize_fp8_per_block_128(down_weight_eDF)

    def forward(self, x_RD, layout, x_scale_RDb=None):
        from moe_ref.kernels.grouped_mlp import grouped_mlp

        options = dict(activation=self.activation, situ_beta=self.situ_beta, situ_linear_beta=self.situ_linear_beta,
                       num_rows_hint=layout.rows_hint(),  # picks GPU tiles
                       zero_unused_rows=layout.zero_unused_rows)
        if not self.fp8:
            return grouped_mlp(x_RD, self.gate_up_weight_e2FD, self.down_weight_eDF, layout.row_start_e,
                               layout.num_rows_e, **options)
        out_dtype = torch.bfloat16
        if x_RD.dtype != FP8_DTYPE:  # activation-dtype rows (used outside the dispatcher): quantize them here
            from moe_ref.kernels.fp8 import quantize_fp8_per_128

            out_dtype = x_RD.dtype
            x_RD, x_scale_RDb = quantize_fp8_per_128(x_RD)
        y_PDx = grouped_mlp(x_RD, self.gate_up_fp8_e2FD, self.down_fp8_eDF, layout.row_start_e,
                            layout.num_rows_e, x_scale_RDb=x_scale_RDb, gate_up_scale=self.gate_up_scale_e2FbDb,
                            down_scale=self.down_scale_eDbFb, gate_up_interleaved=self.gate_up_interleaved, **options)
        return y_PDx.to(out_dtype)


# name -> "module:Class". Resolved on first use (importlib), so optional backends such as deep_gemm are imported
# only when asked for, and no backend module needs this one to import it back.
_REGISTRY: dict[str, str] = {
    "torch": "moe_ref.experts:TorchLoopExperts",
    "grouped_mm": "moe_ref.experts:GroupedMMExperts",
    "triton": "moe_ref.experts:TritonExperts",
    "deep_gemm": "moe_ref.deep_gemm_backend:DeepGemmExperts",
}


def check_pool_format(experts: "Experts | type[Experts]", pool_format: str, where: str = "the argument") -> None:
    """Raise ``InvalidConfigError`` (CFG007) when ``experts`` (a backend or its class) does not run ``pool_format``
    pools (its ``pool_formats``); ``where`` names the option's source."""
    if pool_format not in experts.pool_formats:
        raise InvalidConfigError(f"pool_format={pool_format!r} (from {where}): the {experts.name} experts run "
                                 f"{', '.join(experts.pool_formats)} pools only; pick one of those, or another "
                                 f"experts backend", field="pool_format")


def register_experts(name: str, target: str) -> None:
    """Make ``make_experts(name, ...)`` build ``target`` (``"package.module:ClassName"``, an ``Experts``)."""
    _REGISTRY[name] = target


def registered_backends() -> tuple[str, ...]:
    """Names ``make_experts`` accepts besides ``auto``."""
    return tuple(_REGISTRY)


def experts_class(backend: str, device: torch.device | str = "cpu") -> type[Experts]:
    """The class of expert backend ``backend`` (``auto`` = triton on CUDA, else torch), without building it:
    its ``segment_alignment`` and ``supports_fp8`` are what a layer plans with.

    Args:
        backend: ``auto`` or a registered name (``torch``, ``grouped_mm``, ``triton``, ``deep_gemm``, ...).
        device: where the weights live (decides ``auto``).

    Returns:
        The ``Experts`` subclass. Raises ``UnknownNameError`` (CFG006) for another name.
    """
    if backend == "auto":
        backend = "triton" if torch.device(device).type == "cuda" else "torch"
    if backend not in _REGISTRY:
        raise UnknownNameError(f"experts backend={backend!r}; supported: auto, {', '.join(_REGISTRY)}")
    module_name, class_name = _REGISTRY[backend].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def make_experts(backend: str, gate_up_weight_e2FD: torch.Tensor, down_weight_eDF: torch.Tensor,
                 activation: str = "silu", situ_beta: float = 4.0, situ_linear_beta: float = 25.0, *,
                 fp8: bool = False) -> Experts:
    """Build the expert backend ``backend`` (``auto`` = triton on CUDA, else torch).

    Args:
        backend: ``auto`` or a registered name (see ``experts_class``).
        gate_up_weight_e2FD: ``[e, 2F, Dx]`` this rank's experts, gate rows then up rows.
        down_weight_eDF: ``[e, Dx, F]``.
        activation, situ_beta, situ_linear_beta: see ``moe_ref.activations``.
        fp8: fp8 e4m3 weights with 128x128 block scales, quantized once at construction; only for
            backends with ``supports_fp8`` (triton, deep_gemm), else ``InvalidConfigError`` (CFG007).

    Returns:
        The ``Experts`` instance.
    """
    cls = experts_class(backend, gate_up_weight_e2FD.device)
    args = (gate_up_weight_e2FD, down_weight_eDF, activation, situ_beta, situ_linear_beta)
    if cls.supports_fp8:
        return cls(*args, fp8=fp8)
    if fp8:
        raise InvalidConfigError(f"experts backend {cls.name!r} has no fp8 weights (fp8=True); use 'triton' or "
                                 f"'deep_gemm', or fp8=False", field="fp8")
    return cls(*args)
