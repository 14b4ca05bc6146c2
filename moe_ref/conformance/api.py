"""What a user plugs in: an ``Implementation`` (a factory, the kind of thing it builds and its ``Capabilities``), the
``Problem`` the harness hands the factory, and the registry the command line resolves names against (``registry``).

    @implementation("my-fused-moe", kind="experts", caps=Capabilities(dtypes=("bf16",)))
    def my_fused_moe(problem: Problem) -> ExpertsFn:   # built once per case
        ...
        return run                                      # run(x_TD, topk_ids_TK, topk_weights_TK, out_TD) -> None

Kinds (what the factory's return value does):

| kind               | returns                                  | runs at        | the harness checks                      |
|--------------------|------------------------------------------|----------------|-----------------------------------------|
| ``experts``        | ``run(x, ids, w, out)``: all E experts   | 1 rank         | y against the oracle, bits, buffers      |
| ``routed_step``    | ``run(x, ids, w, out)``, collective; the | 1..N ranks     | the same, per rank                       |
|                    | problem's weights are the local experts  |                |                                          |
| ``dispatch_combine`` | a ``DispatchCombine``                  | 1..N ranks     | receive counts and rows exactly, combine |
| ``pool_experts``   | ``run(pool) -> y_PD``: the expert MLPs   | 1 rank         | segment rows against the oracle, bits,   |
|                    | on a dispatched ``ExpertPool`` (kernel   |                | the pool left unchanged                  |
|                    | only: no routing, no top-k sum)          |                |                                          |

Shape legend: T tokens of this rank, K top-k, E experts, e local experts, D hidden width, F expert intermediate,
P receive-pool rows, Db = ceil(D / 128), Fb = ceil(F / 128).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from moe_ref.core.errors import CapacityExceededError, ConformanceImplError

KINDS = ("experts", "routed_step", "dispatch_combine", "pool_experts")
# Weight recipes: "none" = the activation dtype; fp8_block = e4m3 weights with fp32 128x128 block scales and x
# quantized per token per 128 columns (DeepSeek-V3); int4 = weight-only, signed 4-bit codes with one fp32 scale per
# 32 input columns; mxfp4 = weight-only e2m1 codes with one power-of-two scale per 32 input columns.
QUANTS = ("none", "fp8_block", "int4", "mxfp4")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
OVERFLOWS = ("error", "chunk", "unbounded")
COMPUTES = (None, "fp8_block")  # Capabilities.compute
LAYOUTS = ("contiguous", "masked")  # Capabilities.layouts


@dataclass(frozen=True)
class Capabilities:
    """What an implementation claims; the harness runs the scenarios these allow and SKIPs the rest (with why).

    Attributes:
        dtypes: activation dtypes (keys of ``DTYPES``).
        quants: weight recipes (``QUANTS``).
        ep_sizes: rank counts it runs at (``experts``: 1 only).
        max_tokens_per_rank: C, the most rows one rank feeds per call (None: no bound).
        overflow: above C: ``error`` (raise ``overflow_error``), ``chunk`` (split, results as if unchunked) or
            ``unbounded`` (no C).
        overflow_error: the exception class raised above C under ``error`` (moe_ref's CAP001 by default).
        configurable_cap: the factory sizes itself for ``Problem.max_tokens_per_rank``, whatever it is (moe_ref's
            ``num_max_tokens_per_rank``): a speed case of T above C is built with C = T. False: such a case SKIPs.
        deterministic: a re-run on the same inputs gives the same bits (checked bitwise).
        batch_invariant: a token's output bits do not depend on the other tokens of the call (permuted, alone,
            chunked runs checked bitwise; else against the oracle).
        duplicate_experts: a token may pick one expert in two slots (summed twice).
        masked_slots: ``topk_ids == -1`` marks a slot to skip.
        graph_safe: capturable in a CUDA graph: on a GPU at one rank the ``graph`` check replays a captured call on
            other routing (``runner._check_graph``); ``moe-ref bench --timer graph`` times only these.
        tile_rows: the row tile its kernels work in (the tile-edge scenarios put tile - 1, tile, tile + 1 rows on an
            expert).
        devices: ``cpu`` and/or ``cuda``.
        layouts: receive-pool layouts: ``contiguous`` (segments back to back) or ``masked`` (expert i's rows at
            i * M, M the largest segment rounded up to ``segment_alignment``). A ``pool_experts`` implementation is
            handed its first one; reported for the other kinds.
        segment_alignment: ``pool_experts``: each segment of the pool it is handed starts on a multiple of this
            many rows (DeepGEMM's contiguous layout: 128); the rows between segments hold NaN.
        compute: None: it computes in the case's recipe. ``"fp8_block"``: it computes FP8 block GEMMs whatever the
            recipe (e.g. DeepGEMM's mega-MoE on bf16 weights): on a plain-weight case the oracle rounds the
            activations per token per 128 columns and the weights per 128 x 128 block to e4m3 as it does, and the
            case is judged at the ``fp8_block`` limits.
    """

    dtypes: tuple[str, ...] = ("fp32", "bf16")
    quants: tuple[str, ...] = ("none",)
    ep_sizes: tuple[int, ...] = (1,)
    max_tokens_per_rank: int | None = None
    overflow: str = "unbounded"
    overflow_error: type[BaseException] = CapacityExceededError
    configurable_cap: bool = False
    deterministic: bool = True
    batch_invariant: bool = False
    duplicate_experts: bool = False
    masked_slots: bool = True
    graph_safe: bool = False
    tile_rows: int = 16
    devices: tuple[str, ...] = ("cpu", "cuda")
    layouts: tuple[str, ...] = ("contiguous",)
    segment_alignment: int = 1
    compute: str | None = None

    def __post_init__(self):
        bad = [f"dtypes {d!r}" for d in self.dtypes if d not in DTYPES] + \
              [f"quants {q!r}" for q in self.quants if q not in QUANTS] + \
              ([f"overflow {self.overflow!r}"] if self.overflow not in OVERFLOWS else []) + \
              (["overflow 'error'/'chunk' without max_tokens_per_rank"]
               if self.overflow != "unbounded" and self.max_tokens_per_rank is None else []) + \
              ([f"compute {self.compute!r}"] if self.compute not in COMPUTES else []) + \
              [f"layouts {layout!r}" for layout in self.layouts if layout not in LAYOUTS] + \
              ([f"segment_alignment {self.segment_alignment!r}"] if self.segment_alignment < 1 else [])
        if bad:
            raise ConformanceImplError(f"Capabilities: {', '.join(bad)}; dtypes from {tuple(DTYPES)}, quants from "
                                       f"{QUANTS}, overflow from {OVERFLOWS}, compute from {COMPUTES}, layouts from "
                                       f"{LAYOUTS}, segment_alignment >= 1")

    def describe(self) -> dict[str, Any]:
        """The capabilities as JSON values (for the per-case records)."""
        return {name: (value.__name__ if isinstance(value, type) else value) for name, value in vars(self).items()}


@dataclass(frozen=True)
class ExpertWeights:
    """One rank's experts as the harness made them (seeded), in the recipe of the case.

    Attributes:
        gate_up_e2FD: ``[e, 2F, D]`` gate rows then up rows in the activation dtype (quantized recipes: their
            dequantized values, for implementations that take plain weights).
        down_eDF: ``[e, D, F]`` likewise.
        quant: the recipe (``QUANTS``).
        gate_up_q, down_q: the quantized codes: fp8 e4m3 ``[e, 2F, D]`` / ``[e, D, F]``; int4 as int8 in [-8, 7];
            mxfp4 as int8 indices 0..15 into ``E2M1_VALUES`` (sign in bit 3); None for ``none``.
        gate_up_scale, down_scale: fp32 scales: fp8 ``[e, ceil(2F/128), Db]`` / ``[e, Db, Fb]``; int4 and mxfp4 one per
            32 input columns ``[e, 2F, D / 32]`` / ``[e, D, F / 32]``; None for ``none``.
    """

    gate_up_e2FD: torch.Tensor
    down_eDF: torch.Tensor
    quant: str = "none"
    gate_up_q: torch.Tensor | None = None
    gate_up_scale: torch.Tensor | None = None
    down_q: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None


@dataclass(frozen=True)
class Problem:
    """What a factory builds for (one case on one rank).

    Attributes:
        num_experts: E over all ranks. num_topk: K. hidden: D. intermediate: F.
        dtype: the activation dtype of ``x`` and of ``out``.
        weights: this rank's experts ``first_expert .. first_expert + e - 1`` (all E for ``experts``).
        first_expert: the global id of this rank's first expert (rank * e).
        rank, world_size: in ``group``. group: the process group (None at one rank).
        device: where the tensors live.
        max_tokens_per_rank: the C the case runs with (the capability's, else the largest T of the case).
        activation: ``silu`` (``down(silu(gate(x)) * up(x))``).
    """

    num_experts: int
    num_topk: int
    hidden: int
    intermediate: int
    dtype: torch.dtype
    weights: ExpertWeights
    first_expert: int
    rank: int
    world_size: int
    group: Any
    device: torch.device
    max_tokens_per_rank: int
    activation: str = "silu"

    @property
    def num_local_experts(self) -> int:
        return self.weights.down_eDF.shape[0]


class ExpertsFn(Protocol):
    """``experts`` and ``routed_step`` kinds: write ``y_TD = sum_j w[t, j] * Expert_{ids[t, j]}(x[t])`` into ``out_TD``.

    Optional: ``tune(x_TD, topk_ids_TK, topk_weights_TK)``, which a speed case calls once with its inputs before
    its checks and timing (an autotuner's search for that exact shape; its seconds are reported as ``tune_s``)."""

    def __call__(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                 out_TD: torch.Tensor) -> None: ...


@dataclass
class Received:
    """What ``DispatchCombine.dispatch`` hands the experts of this rank.

    Attributes:
        x_PD: ``[P, D]`` the receive pool; local expert i's rows are ``x_PD[row_start_e[i]:][:num_rows_e[i]]``.
        row_start_e, num_rows_e: ``[e]`` int64.
        handle: the implementation's own state for ``combine``.
    """

    x_PD: torch.Tensor
    row_start_e: torch.Tensor
    num_rows_e: torch.Tensor
    handle: Any = None


@dataclass(frozen=True)
class ExpertPool:
    """What a ``pool_experts`` implementation is handed: one rank's routed rows grouped by local expert, as a
    dispatch delivers them (rows of one expert in (token, slot) order).

    Attributes:
        x_PD: ``[P, D]`` the rows in the activation dtype; local expert i's are ``x_PD[row_start_e[i]:][:num_rows_e[i]]``.
            Rows outside every segment (alignment padding, a masked pool's unused rows) hold NaN: a kernel that
            mixes them into a segment's result shows it.
        row_start_e, num_rows_e: ``[e]`` int64 on the device.
        num_rows: the routed rows (``num_rows_e.sum()``), known on the host (a layer's static rows hint).
        masked_rows: M > 0 for a masked pool (``row_start_e[i] == i * M``, P = e * M); 0 for a contiguous one.
        x_fp8_PD, x_scale_PDb: the ``fp8_block`` recipe's rows as FP8 dispatch sends them: e4m3 ``[P, D]`` with one
            fp32 scale per row per 128 columns ``[P, Db]`` (the harness's own quantizer); None for other recipes.
    """

    x_PD: torch.Tensor
    row_start_e: torch.Tensor
    num_rows_e: torch.Tensor
    num_rows: int
    masked_rows: int = 0
    x_fp8_PD: torch.Tensor | None = None
    x_scale_PDb: torch.Tensor | None = None


class PoolExpertsFn(Protocol):
    """``pool_experts`` kind: the expert MLPs alone (kernel-only rows beside the full-path ones).

    Optional: ``tune(pool)``, called once before a speed case's checks and timing (as ``ExpertsFn.tune``)."""

    def __call__(self, pool: ExpertPool) -> torch.Tensor:
        """``y_PD [P, D]`` in the activation dtype: row r of expert i's segment is ``Expert_i(x_PD[r])``; the rows
        outside every segment may hold anything."""


class DispatchCombine(Protocol):
    """``dispatch_combine`` kind (collective calls)."""

    def dispatch(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor) -> Received:
        """Bring every rank's rows routed to my experts into my pool, one row per (token, slot)."""

    def combine(self, y_PD: torch.Tensor, received: Received, out_TD: torch.Tensor) -> None:
        """Write ``out[t] = sum_j w[t, j] * y[row of (t, j)]`` into my tokens' ``out_TD``."""


@dataclass(frozen=True)
class Implementation:
    """A registered implementation: ``factory(problem)`` builds it for one case (an ``ExpertsFn``, a
    ``DispatchCombine`` or a ``PoolExpertsFn``; an optional ``close()`` on the result is called after the case).

    Attributes:
        name: how the matrix names it. kind: one of ``KINDS``. caps: its ``Capabilities``.
        factory: ``Problem -> ExpertsFn | DispatchCombine | PoolExpertsFn``.
        label: a note shown beside the name (``peer at its best``, ``mutant: ...``).
        spec: how a worker process finds it again (``module:attribute``), filled in by ``implementation``.
        unavailable: ``() -> why it cannot run in this environment (one line) | None``: its cases SKIP with that
            reason instead of FAILing (e.g. a torch without ``grouped_mm``); None: always available.
        refuses: ``(shape, ranks) -> why it cannot run that shape at that rank count | None``: those cases SKIP with
            the reason (a kernel's shape limits, e.g. widths in multiples of 128); None: every shape.
    """

    name: str
    kind: str
    caps: Capabilities
    factory: Callable[[Problem], Any]
    label: str = ""
    spec: str = field(default="", compare=False)
    unavailable: Callable[[], str | None] | None = field(default=None, compare=False)
    refuses: Callable[[Any, int], str | None] | None = field(default=None, compare=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConformanceImplError(f"implementation {self.name!r}: kind={self.kind!r}; one of {KINDS}")
        if self.kind in ("experts", "pool_experts") and tuple(self.caps.ep_sizes) != (1,):
            raise ConformanceImplError(f"implementation {self.name!r}: kind {self.kind!r} runs at one rank; declare "
                                       f"ep_sizes=(1,) or kind 'routed_step'")


_REGISTRY: dict[str, Implementation] = {}


def implementation(name: str, *, kind: str, caps: Capabilities, label: str = ""):
    """Decorator: register ``factory`` as an ``Implementation`` and return the ``Implementation`` (so
    ``--impl module:attribute`` finds it under the function's name)."""
    def wrap(factory: Callable[[Problem], Any]) -> Implementation:
        impl = Implementation(name, kind, caps, factory, label,
                              spec=f"{factory.__module__}:{factory.__name__}")
        return register(impl)

    return wrap


def register(impl: Implementation) -> Implementation:
    """Add ``impl`` to the registry (a second one of the same name replaces the first) and return it."""
    _REGISTRY[impl.name] = impl
    return impl
