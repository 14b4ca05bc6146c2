"""The experts contract: ``ExpertLayout`` (where each local expert's rows lie in the receive pool), the
``Experts`` ABC every backend implements (see the package docstring for the backends) and ``FP8ExpertWeights``
(expert weights already quantized to fp8 blocks, which several backends can share).

Shape legend: P receive-pool rows, Dx expert input width, F expert intermediate, e local experts,
Db = ceil(Dx / 128), Fb = ceil(F / 128)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace

import torch

from moe_ref.core.errors import DTypeError, ExpertsFeatureError, InvalidConfigError
from moe_ref.kernels.runtime._triton_utils import FP8_DTYPE


@dataclass(frozen=True)
class FP8ExpertWeights:
    """Expert weights in fp8 e4m3 with fp32 128x128 block scales, as ``kernels.fp8.quantize_fp8_per_block_128`` makes
    them and FP8 checkpoints store them: gate rows then up rows (stacked), or interleaved in 128-row blocks.

    The one way to hand already-quantized weights to a backend: ``make_experts(..., fp8_weights=w)`` (or the
    constructor's ``fp8_weights``) runs these tensors as given, so backends built from one ``w`` share one copy.

    Interleaved (``gate_up_interleaved``): gate_up's rows alternate 128-row gate and up blocks, and its scale rows
    alike (``kernels.grouped_mlp.interleave_gate_up``): a permutation of whole scale blocks, so the values are the
    stacked ones. The Triton kernel then loads a gate block and its up block as one 256-row tile (one dot per k-step,
    not two); DeepGEMM runs them as any weight, its GEMM1 columns interleaved alike. ``quantize`` interleaves
    whenever F % 128 == 0.

    Attributes:
        gate_up_fp8_e2FD: ``[e, 2F, Dx]`` fp8 e4m3.
        gate_up_scale_e2FbDb: ``[e, ceil(2F / 128), Db]`` fp32 block scales.
        down_fp8_eDF: ``[e, Dx, F]`` fp8 e4m3.
        down_scale_eDbFb: ``[e, Db, Fb]`` fp32 block scales.
        gate_up_interleaved: gate_up's rows and scale rows in alternating 128-row gate and up blocks.
    """

    gate_up_fp8_e2FD: torch.Tensor
    gate_up_scale_e2FbDb: torch.Tensor
    down_fp8_eDF: torch.Tensor
    down_scale_eDbFb: torch.Tensor
    gate_up_interleaved: bool = False

    @staticmethod
    def quantize(gate_up_weight_e2FD: torch.Tensor, down_weight_eDF: torch.Tensor) -> "FP8ExpertWeights":
        """Quantize ``[e, 2F, Dx]`` and ``[e, Dx, F]`` weights (bf16/fp16/fp32) once, per 128x128 block; gate_up
        interleaved when F % 128 == 0."""
        from moe_ref.kernels.experts.fp8 import quantize_fp8_per_block_128
        from moe_ref.kernels.experts.grouped_mlp_tiles import GATE_UP_BLOCK

        stacked = FP8ExpertWeights(*quantize_fp8_per_block_128(gate_up_weight_e2FD),
                                   *quantize_fp8_per_block_128(down_weight_eDF))
        whole_blocks = down_weight_eDF.shape[-1] % GATE_UP_BLOCK == 0  # F % 128 == 0
        return stacked.interleaved() if whole_blocks else stacked

    def interleaved(self) -> "FP8ExpertWeights":
        """These weights with gate_up interleaved (copies of gate_up and its scales; this object if it already is)."""
        from moe_ref.kernels.experts.grouped_mlp import interleave_gate_up

        if self.gate_up_interleaved:
            return self
        return replace(self, gate_up_fp8_e2FD=interleave_gate_up(self.gate_up_fp8_e2FD),
                       gate_up_scale_e2FbDb=interleave_gate_up(self.gate_up_scale_e2FbDb, rows_per_block=1),
                       gate_up_interleaved=True)


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
        masked_rows: M > 0 when the pool is masked (``moe_ref.ep.capacity``): expert i's segment starts at i * M and
            ``num_pool_rows == e * M``, so the pool viewed as ``[e, M, Dx]`` is DeepGEMM's masked layout with
            ``num_rows_e`` as its ``masked_m``. 0: contiguous segments.
        packed: contiguous segments back to back, each on the next multiple of ``alignment`` after the one before
            (``row_start_e[i + 1] == align(row_start_e[i] + num_rows_e[i])``, the first at row 0), as ``from_counts``
            and the dispatcher lay them out: the segments' ends then say where every segment starts, so a backend
            may skip the pool past the last one (DeepGEMM's psum layout). False: only the attributes above hold.
    """

    row_start_e: torch.Tensor
    num_rows_e: torch.Tensor
    num_pool_rows: int
    alignment: int
    num_rows_hint: int | None = None
    zero_unused_rows: bool = True
    masked_rows: int = 0
    packed: bool = False

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
        return ExpertLayout(row_start_e, num_rows_e, needed, alignment, packed=True)

    @property
    def num_local_experts(self) -> int:
        return self.num_rows_e.numel()

    def row_expert_P(self) -> torch.Tensor:
        """``[P]`` int64: the local expert of each pool row, -1 for padding rows (``kernels.pool_rows``; no host
        sync)."""
        from moe_ref.kernels.runtime import ops

        device = self.num_rows_e.device
        return ops.pool_row_experts(self.row_start_e.to(device), self.num_rows_e, self.num_pool_rows).to(torch.int64)


class Experts(ABC):
    """The local experts' weights and one way to run them.

    Args:
        gate_up_weight_e2FD: ``[e, 2F, Dx]`` gate rows then up rows of each local expert.
        down_weight_eDF: ``[e, Dx, F]``.
        activation, situ_beta, situ_linear_beta, swiglu_alpha, swiglu_limit: see ``moe_ref.core.activations``.
        gate_up_bias_e2F: ``[e, 2F]`` the experts' first-GEMM biases (gate, then up; gpt-oss), or None.
        down_bias_eD: ``[e, Dx]`` the experts' down-GEMM biases, or None.
    """

    name = "abstract"
    # True: give me whole aligned segments with zeroed padding (see moe_ref.ep.dispatch's NOTE); False: I skip
    # padding rows myself and leave them zero in my output.
    computes_whole_segments = False
    # Rows each expert segment of the receive pool should start on: what MegaMoE plans its pool with
    # unless told otherwise. Smaller = fewer padding rows the experts are handed.
    segment_alignment = 128
    # The receive-pool formats (``moe_ref.ep.capacity``) this backend runs; the layer refuses the others (CFG007).
    # Reading segments through ``row_start_e``/``num_rows_e`` runs both; deep_gemm runs DeepGEMM's masked GEMMs on
    # a masked pool.
    pool_formats = ("contiguous", "masked")
    # True: the constructor takes keyword-only ``fp8`` (weights quantized once to fp8 128x128 blocks).
    supports_fp8 = False
    # Whether this instance runs fp8 weights, and whether its forward takes the FP8 pool (fp8 ``x_PDx`` +
    # ``x_scale_PDb``) as dispatched. Backends set them per instance (they follow ``fp8``).
    fp8 = False
    accepts_fp8_input = False
    # The gated activations (``moe_ref.core.activations``) this backend computes, and whether it adds the experts'
    # biases (gpt-oss): ``make_experts`` refuses a model needing more (ENV020, ``expert_math_problem``).
    activations: tuple[str, ...] = ("silu", "situ")
    supports_expert_bias = False
    # Set per instance by the layer (moe_ref.layer.runtime) in the batch-invariant mode: every row's GEMMs run one
    # fixed order whatever the rows beside it (moe_ref.ep.batch_invariant names the backends that honour it).
    batch_invariant = False
    # Whether ``batch_invariant = True`` is honoured (the torch loop, the Triton grouped MLP, the W4A16 kernel) on the
    # device the mode allows the backend on (``moe_ref.ep.batch_invariant.options_problem``: torch on CPU, triton on
    # CUDA); the layer refuses a quantized checkpoint's experts in a batch-invariant layer when their class does not
    # (CFG027).
    honours_batch_invariant = False

    @classmethod
    def resolve_class(cls, device: torch.device) -> "type[Experts]":
        """The class that runs this backend's name on ``device`` (``experts_class`` returns it): the class itself,
        except for ``auto``, which stands for another class on each machine (``moe_ref.experts.auto``)."""
        return cls

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run here (one line), or None when it can; ``auto`` holds only backends that can."""
        return None

    @classmethod
    def installed_version(cls) -> str | None:
        """The version of the library this backend runs on, where it is one of its own (DeepGEMM's), else None: what
        a measured property of its kernels is keyed on (``moe_ref.experts.auto.TRITON_BITS_PROBED``)."""
        return None

    @classmethod
    def describe(cls) -> str:
        """The backend as the ranks of an EP group must agree on it (``EPOptions.fingerprint``): its name; ``auto``
        adds the backends it holds here."""
        return cls.name

    def __init__(self, gate_up_weight_e2FD: torch.Tensor, down_weight_eDF: torch.Tensor, activation: str = "silu",
                 situ_beta: float = 4.0, situ_linear_beta: float = 25.0, *, swiglu_alpha: float = 1.702,
                 swiglu_limit: float = 7.0, gate_up_bias_e2F: torch.Tensor | None = None,
                 down_bias_eD: torch.Tensor | None = None):
        problem = expert_math_problem(type(self), activation, gate_up_bias_e2F is not None or down_bias_eD is not None)
        if problem is not None:
            raise ExpertsFeatureError(f"experts backend {self.name!r} {problem}", backend=self.name)
        self.gate_up_weight_e2FD = gate_up_weight_e2FD
        self.down_weight_eDF = down_weight_eDF
        self.activation, self.situ_beta, self.situ_linear_beta = activation, situ_beta, situ_linear_beta
        self.swiglu_alpha, self.swiglu_limit = swiglu_alpha, swiglu_limit
        self.gate_up_bias_e2F, self.down_bias_eD = gate_up_bias_e2F, down_bias_eD

    @abstractmethod
    def forward(self, x_PDx: torch.Tensor, layout: ExpertLayout, x_scale_PDb: torch.Tensor | None = None) -> torch.Tensor:
        """``x_PDx [P, Dx]`` pool rows -> ``y_PDx [P, Dx]`` (padding rows zero): in ``x_PDx``'s dtype, bf16 for
        an fp8 ``x_PDx`` (which comes with its ``x_scale_PDb [P, Db]`` fp32, only where
        ``accepts_fp8_input``)."""

    def __call__(self, x_PDx: torch.Tensor, layout: ExpertLayout, x_scale_PDb: torch.Tensor | None = None) -> torch.Tensor:
        """Check the input format against ``accepts_fp8_input``, then ``forward``.

        Args:
            x_PDx: ``[P, Dx]`` pool rows: the activation dtype, or fp8 e4m3 for a backend that accepts it.
            layout: the segments of the local experts in ``x_PDx``.
            x_scale_PDb: ``[P, Db]`` fp32 per-row per-128-column scales, given iff ``x_PDx`` is fp8.

        Returns:
            ``y_PDx [P, Dx]``; raises ``DTypeError`` (INP002) for fp8 rows this backend cannot take, or a
            missing/unexpected scale.
        """
        is_fp8 = x_PDx.dtype == FP8_DTYPE
        if is_fp8 and not self.accepts_fp8_input:
            raise DTypeError(f"experts backend {self.name!r} (fp8={self.fp8}) takes {self.gate_up_weight_e2FD.dtype} "
                             f"rows, got {x_PDx.dtype}: dequantize first (Dispatcher.expert_input does)")
        if is_fp8 != (x_scale_PDb is not None):
            raise DTypeError(f"x_scale_PDb must be given exactly for fp8 rows: x_PDx is {x_PDx.dtype}, x_scale_PDb is "
                             f"{'None' if x_scale_PDb is None else tuple(x_scale_PDb.shape)}")
        return self.forward(x_PDx, layout, x_scale_PDb)


def expert_math_problem(experts: "Experts | type[Experts]", activation: str, expert_bias: bool) -> str | None:
    """What ``experts`` (a backend or its class) does not compute of a model whose experts use ``activation`` and
    (``expert_bias``) biases, as the end of a sentence (``"does not compute activation='swigluoai' ..."``), or None
    when it computes both."""
    missing = []
    if activation not in experts.activations:
        missing.append(f"activation={activation!r} (it computes {', '.join(experts.activations)})")
    if expert_bias and not experts.supports_expert_bias:
        missing.append("expert biases")
    return f"does not compute {' nor '.join(missing)}" if missing else None


def check_pool_format(experts: "Experts | type[Experts]", pool_format: str, where: str = "the argument") -> None:
    """Raise ``InvalidConfigError`` (CFG007) when ``experts`` (a backend or its class) does not run ``pool_format``
    pools (its ``pool_formats``); ``where`` names the option's source."""
    if pool_format not in experts.pool_formats:
        raise InvalidConfigError(f"pool_format={pool_format!r} (from {where}): the {experts.name} experts run "
                                 f"{', '.join(experts.pool_formats)} pools only; pick one of those, or another "
                                 f"experts backend", field="pool_format")
