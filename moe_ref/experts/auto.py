"""``experts_backend="auto"``: per call, the backend a measured table ranks fastest for the call's regime.

    auto_table.json (per GPU class "9.0/NVIDIA H200": regimes measured by `moe-ref bench --auto-table` on that GPU)
      --auto_plan(device)--> the backends auto holds here: Triton, plus each backend that is the fastest installed
                             one in some regime of this GPU class (deep_gemm where it runs, ...)
      --experts_class("auto", device)--> CPU: the torch loop; CUDA: TritonExperts when that is all it would hold
                             (nothing changes without a table entry or DeepGEMM), else an AutoExperts class made
                             once for the held set (its segment_alignment = their least common multiple)
      --AutoExperts(weights)--> one copy of the weights shared by every held backend
      --forward(x_PDx, layout)--> regime (fp8 or bf16, pool format, rows per expert bucketed) -> the first held
                             backend in the table's order for it -> that backend's forward

A regime is ``(dtype, pool_format, rows per expert)``: ``"fp8"`` for fp8 weights (whatever rows come in), else the
rows' dtype (only ``"bf16"`` is measured: fp16/fp32 calls run Triton); ``"masked"`` when ``layout.masked_rows``,
else ``"contiguous"``; ``layout.rows_hint() / layout.num_local_experts`` against each regime's
``max_rows_per_expert`` (the first bound it does not exceed; the last regime of a dtype and pool format is
unbounded). A GPU class missing from the table, or a regime missing from a class, runs Triton: auto is then plain
Triton, never another class's table (an H100 does not inherit the H200's choices: their memory bandwidths differ).

A GPU class is the compute capability and the device's name as CUDA reports it (``gpu_class_name``), e.g.
``"9.0/NVIDIA H200"`` or ``"9.0/NVIDIA H100 80GB HBM3"``.

Table file (``auto_table.json``, package data; ``auto_table()`` validates it, AutoTableError CFG019 naming the file
and the field, and caches it)::

    {"format": 1, "about": "...",
     "gpu_classes": {"9.0/NVIDIA H200": {
        "header": {"date", "gpu", "compute_capability", "torch", "triton", "deep_gemm", "command"},
        "regimes": [{"dtype": "fp8", "pool_format": "contiguous", "max_rows_per_expert": 30.17 (or null: unbounded),
                     "order": ["deep_gemm", "triton"],   # fastest first
                     "measured": {"routed_rows": 4096, "rows_per_expert": 85.33,
                                  "us": {"kimi-k2": {"triton": ..., "deep_gemm": ...}, "step3": {...}},
                                  "left_out": {"grouped_mm": "why"}}}, ...]}}}

Shape legend: P receive-pool rows, Dx expert input width, F expert intermediate, e local experts,
Db = ceil(Dx / 128), Fb = ceil(F / 128).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from moe_ref.core.errors import AutoTableError, MoERefError
from moe_ref.experts.base import ExpertLayout, Experts, FP8ExpertWeights
from moe_ref.experts.registry import experts_class, make_experts, register_experts, registered_backends
from moe_ref.kernels.ep.ep_regions import POOL_FORMATS
from moe_ref.kernels.runtime.gpu_class import gpu_class_name, gpu_class_of  # noqa: F401  (re-exported: the table's keys)

__all__ = ["AutoExperts", "AutoPlan", "AutoTable", "GpuClassTable", "Regime", "TABLE_PATH", "TRITON_BITS_PROBED",
           "auto_plan", "auto_table", "find_regime", "format_regimes", "gives_triton_bits", "gpu_class_name",
           "gpu_class_of", "validate_table"]

TABLE_PATH = Path(__file__).resolve().with_name("auto_table.json")
TABLE_FORMAT = 2  # 2: GPU classes keyed by compute capability and device name (1: capability alone)
REGIME_DTYPES = ("bf16", "fp8")
HEADER_FIELDS = ("date", "gpu", "compute_capability", "torch", "triton", "deep_gemm", "command")
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_GPU_CLASS = re.compile(r"^\d+\.\d+/.+$")


# --------------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Regime:
    """One row of a GPU class's table.

    Attributes:
        dtype: ``"bf16"`` or ``"fp8"`` (fp8 weights).
        pool_format: ``"contiguous"`` or ``"masked"``.
        max_rows_per_expert: the bucket's upper bound on routed rows per local expert (inclusive); None: unbounded.
        order: backend names, fastest first.
        measured: what decided it (``routed_rows``, ``rows_per_expert``, ``us`` per model shape and backend,
            optional ``left_out``); not part of equality.
    """

    dtype: str
    pool_format: str
    max_rows_per_expert: float | None
    order: tuple[str, ...]
    measured: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class GpuClassTable:
    """A GPU class's regimes (per dtype and pool format, bounds increasing) and the header of the run that made it."""

    header: Mapping[str, Any]
    regimes: tuple[Regime, ...]


@dataclass(frozen=True)
class AutoTable:
    """The validated table file: ``gpu_classes`` maps a compute capability (``"9.0"``) to its ``GpuClassTable``."""

    path: str
    gpu_classes: Mapping[str, GpuClassTable]


def auto_table(path: str | Path | None = None) -> AutoTable:
    """The table at ``path`` (default: the package's ``auto_table.json``), read and validated once per process.

    Raises:
        AutoTableError (CFG019): the file cannot be read as JSON or a field is wrong (the message names both).
    """
    return _load_table(str(path if path is not None else TABLE_PATH))


@functools.lru_cache(maxsize=None)
def _load_table(path: str) -> AutoTable:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        raise AutoTableError(f"{path}: cannot be read as JSON ({type(err).__name__}: {err})", path=path) from None
    return validate_table(data, path)


def validate_table(data: Any, path: str) -> AutoTable:
    """Check a table (the parsed JSON of ``path``) and return it; AutoTableError (CFG019) names the bad field."""
    def fail(where: str, problem: str):
        raise AutoTableError(f"{path}: {where}: {problem}", path=path, field=where)

    if not isinstance(data, dict) or data.get("format") != TABLE_FORMAT:
        fail("format", f"must be {TABLE_FORMAT} in a JSON object, got "
                       f"{data.get('format') if isinstance(data, dict) else type(data).__name__!r}")
    classes = data.get("gpu_classes")
    if not isinstance(classes, dict):
        fail("gpu_classes", f"must be an object of GPU class -> table, got {type(classes).__name__}")
    tables = {}
    for gpu_class, entry in classes.items():
        where = f"gpu_classes[{gpu_class!r}]"
        if not _GPU_CLASS.match(gpu_class) or not isinstance(entry, dict):
            fail(where, "keys are GPU classes such as '9.0/NVIDIA H200' (compute capability/device name), values "
                        "objects with 'header' and 'regimes'")
        header = entry.get("header")
        if not isinstance(header, dict) or any(name not in header for name in HEADER_FIELDS):
            fail(f"{where}.header", f"must be an object with {', '.join(HEADER_FIELDS)}")
        if gpu_class_name(header["compute_capability"], header["gpu"]) != gpu_class:
            fail(f"{where}.header", f"compute_capability/gpu {header['compute_capability']}/{header['gpu']} "
                                    f"!= its key {gpu_class!r}")
        regimes = entry.get("regimes")
        if not isinstance(regimes, list):
            fail(f"{where}.regimes", f"must be a list, got {type(regimes).__name__}")
        parsed = tuple(_regime(regime, f"{where}.regimes[{i}]", fail) for i, regime in enumerate(regimes))
        _check_buckets(parsed, f"{where}.regimes", fail)
        tables[gpu_class] = GpuClassTable(header, parsed)
    return AutoTable(path, tables)


def _regime(raw: Any, where: str, fail) -> Regime:
    if not isinstance(raw, dict):
        fail(where, f"must be an object, got {type(raw).__name__}")
    if raw.get("dtype") not in REGIME_DTYPES:
        fail(f"{where}.dtype", f"{raw.get('dtype')!r} is not one of {', '.join(REGIME_DTYPES)}")
    if raw.get("pool_format") not in POOL_FORMATS:
        fail(f"{where}.pool_format", f"{raw.get('pool_format')!r} is not one of {', '.join(POOL_FORMATS)}")
    bound = raw.get("max_rows_per_expert", "missing")
    if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float)) or not bound > 0):
        fail(f"{where}.max_rows_per_expert", f"{bound!r}: must be a number > 0, or null (unbounded)")
    order = raw.get("order")
    if (not isinstance(order, list) or not order or len(set(map(str, order))) != len(order)
            or not all(isinstance(name, str) and name and name != "auto" for name in order)):
        fail(f"{where}.order", f"{order!r}: must be a non-empty list of distinct backend names (not 'auto')")
    measured = raw.get("measured")
    us = measured.get("us") if isinstance(measured, dict) else None
    if not isinstance(us, dict) or not us or not all(
            isinstance(times, dict) and all(name in times for name in order) and all(
                not isinstance(t, bool) and isinstance(t, (int, float)) and t > 0 for t in times.values())
            for times in us.values()):
        fail(f"{where}.measured.us", "must map each model shape to the us > 0 of every backend in 'order'")
    return Regime(raw["dtype"], raw["pool_format"], None if bound is None else float(bound), tuple(order), measured)


def _check_buckets(regimes: tuple[Regime, ...], where: str, fail) -> None:
    """Per dtype and pool format: bounds increase in file order and the last one is unbounded."""
    for key in sorted({(r.dtype, r.pool_format) for r in regimes}):
        bounds = [r.max_rows_per_expert for r in regimes if (r.dtype, r.pool_format) == key]
        finite = bounds[:-1]
        if bounds[-1] is not None or None in finite:
            fail(where, f"the {key[0]} {key[1]} regimes must end with one unbounded bucket (max_rows_per_expert "
                        f"null), got bounds {bounds}")
        if any(later <= earlier for earlier, later in zip(finite, finite[1:])):
            fail(where, f"the {key[0]} {key[1]} regimes' max_rows_per_expert must increase, got {bounds}")


def find_regime(regimes: tuple[Regime, ...], dtype: str | None, pool_format: str,
                rows_per_expert: float) -> Regime | None:
    """The regime of a call: of those with this dtype and pool format (in table order, bounds increasing), the first
    whose ``max_rows_per_expert`` is at least ``rows_per_expert`` (or unbounded); None when the table has none.

    Example: fp8 contiguous bounds [3.77, 30.17, None]: 3.77 rows per expert -> the first, 3.78 -> the second,
    1e6 -> the third."""
    for regime in regimes:
        if (regime.dtype, regime.pool_format) == (dtype, pool_format) and (
                regime.max_rows_per_expert is None or rows_per_expert <= regime.max_rows_per_expert):
            return regime
    return None


# --------------------------------------------------------------------------------------------------
# what auto holds on this machine
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AutoPlan:
    """What ``experts_backend="auto"`` runs on one device.

    Attributes:
        gpu_class: the device's GPU class (``"9.0/NVIDIA H200"``), None off CUDA.
        table_path: the table file read.
        table: this GPU class's entry, None when the class is not in the file (auto is then plain Triton).
        held: backend names auto holds here: ``"triton"`` first, then each backend that is the first installed one
            in some regime's order (``("triton",)``: auto is plain Triton here).
        unavailable: backend name -> why it cannot run here, for those the table ranks above the one picked.
    """

    gpu_class: str | None
    table_path: str
    table: GpuClassTable | None
    held: tuple[str, ...]
    unavailable: Mapping[str, str]


def auto_plan(device: torch.device | str, table: AutoTable | None = None) -> AutoPlan:
    """The backends ``experts_backend="auto"`` holds on ``device`` (CUDA) under ``table`` (default ``auto_table()``).

    NOTE: a backend's availability check may run a tiny real call (deep_gemm's probe, once per process), only for
    backends the table ranks above Triton somewhere."""
    table = table or auto_table()
    gpu_class = gpu_class_of(device)
    entry = table.gpu_classes.get(gpu_class) if gpu_class is not None else None
    held, unavailable = ["triton"], {}
    for regime in entry.regimes if entry is not None else ():
        for name in regime.order:
            reason = _unavailable_reason(name, device)
            if reason is None:
                held += [name] if name not in held else []
                break
            unavailable[name] = reason
    return AutoPlan(gpu_class, table.path, entry, tuple(held), unavailable)


def _unavailable_reason(name: str, device: torch.device | str) -> str | None:
    if name not in registered_backends():
        return "no experts backend of that name is registered here"
    return experts_class(name, device).unavailable_reason()


# --------------------------------------------------------------------------------------------------
# the batch-invariant mode: which held backends give a row the Triton experts' bits
# --------------------------------------------------------------------------------------------------
# (compute capability, backend, the backend's version, Triton's version, precision) where a backend's experts were
# probed to give every row the bits of the mode's Triton grouped MLP of that precision (its tiles of one bits class,
# ``kernels.runtime.fixed_tiles``; GEMM1 rounds gate and up to bf16 before the activation, as DeepGEMM's output
# does): the batch-invariant mode lets auto run them where the table ranks them faster. DeepGEMM 0.1.4 on sm_90 with
# Triton 3.6: its psum, row and masked forms over pools of 0 to 700 rows per expert gave one set of bits, the mode's
# Triton experts' own, for FP8 (scripts/probe_tile_bits.py --only deep_gemm, 2026-12-07, one H100) and for bf16
# (the same probe with --precision bf16, 2026-12-08, one H100); docs/RESULTS.md, "The batch-invariant mode".
TRITON_BITS_PROBED = frozenset({
    ((9, 0), "deep_gemm", "0.1.4", "3.6.0", "fp8"),
    ((9, 0), "deep_gemm", "0.1.4", "3.6.0", "bf16"),
})


def gives_triton_bits(name: str, device: torch.device | str, precision: str) -> bool:
    """Whether backend ``name``'s experts of ``precision`` ("bf16" or "fp8" weights) give a row the mode's Triton
    experts' bits on ``device``, as probed for this compute capability and the installed versions
    (``TRITON_BITS_PROBED``); Triton itself always does."""
    import triton

    if name == "triton":
        return True
    device = torch.device(device)
    if device.type != "cuda" or name not in registered_backends():
        return False
    key = (torch.cuda.get_device_capability(device), name, experts_class(name, device).installed_version(),
           triton.__version__, precision)
    return key in TRITON_BITS_PROBED


# --------------------------------------------------------------------------------------------------
# the backend
# --------------------------------------------------------------------------------------------------
class AutoExperts(Experts):
    """Per call, the backend the measured table ranks fastest for the call's regime, among those held here.

    Build it with ``make_experts("auto", ...)`` (or ``experts_class("auto", device)``), which resolves ``auto`` for
    the device: the torch loop on CPU; on CUDA plain ``TritonExperts`` when Triton is all auto would hold (no table
    entry for this GPU class, or no other installed backend ranked first anywhere: then nothing changes for users
    without DeepGEMM), else a subclass of this class made once per held set, whose class attributes
    (``held_backends``, ``segment_alignment``) are what a layer plans its pool with before any weights exist. That is
    why the choice is a class, not only an instance.

    The held backends share ONE copy of the weights: bf16 weights are the caller's tensors in every backend (held
    only when bf16 and contiguous, so that DeepGEMM's ``.to(bf16).contiguous()`` is the tensor itself); fp8 weights
    are quantized once (``FP8ExpertWeights.quantize``: gate_up interleaved in 128-row blocks, which both Triton's
    one-dot GEMM1 and DeepGEMM run) or taken as given (``fp8_weights``: an FP8 checkpoint's, which the layer
    interleaves in place at load) and handed to each backend as is.

    The choice is made on the host from static values (the weights' dtype, the layout's pool format and rows hint),
    so a captured CUDA graph replays the choice made at capture; no host sync beyond ``layout.rows_hint()`` (none when
    the layer passes its static hint). ``last_backend`` names the backend of the last call.

    In the batch-invariant mode (``batch_invariant = True``, passed on to every held backend) a call runs only a
    backend that gives a row the same bits as Triton's tiles of one bits class: Triton, or a backend probed to give
    its bits here for the weights' precision (``gives_triton_bits``: DeepGEMM 0.1.4 on sm_90 with Triton 3.6).
    A row's bits then do not depend on which of them the row count picks.

    Args:
        gate_up_weight_e2FD: ``[e, 2F, Dx]`` gate rows then up rows (bf16 to hold more than Triton; fp8 with
            ``fp8_weights``).
        down_weight_eDF: ``[e, Dx, F]``.
        activation, situ_beta, situ_linear_beta: see ``moe_ref.core.activations``.
        fp8: fp8 weights, quantized once here and shared by the held fp8 backends.
        fp8_weights: already-quantized weights to share instead (``FP8ExpertWeights``). Implies ``fp8``.

    Attributes:
        backends: name -> the held backend built over the shared weights.
        left_out: name -> why a held backend was not built for these weights (no fp8 weights, non-bf16 weights, a
            shape it refuses), so its regimes run the next backend of their order.
        last_backend: the name the last ``forward`` ran, None before one.
    """

    name = "auto"
    supports_fp8 = True
    honours_batch_invariant = True  # in the mode a call runs Triton or a backend giving Triton's bits
    gpu_class: str | None = None
    regimes: tuple[Regime, ...] = ()
    held_backends: tuple[str, ...] = ("triton",)

    def __init__(self, gate_up_weight_e2FD: torch.Tensor, down_weight_eDF: torch.Tensor, activation: str = "silu",
                 situ_beta: float = 4.0, situ_linear_beta: float = 25.0, *, fp8: bool = False,
                 fp8_weights: FP8ExpertWeights | None = None):
        super().__init__(gate_up_weight_e2FD, down_weight_eDF, activation, situ_beta, situ_linear_beta)
        self.fp8 = fp8 = fp8 or fp8_weights is not None
        if fp8 and fp8_weights is None:
            fp8_weights = FP8ExpertWeights.quantize(gate_up_weight_e2FD, down_weight_eDF)  # once, for every backend
        self.fp8_weights = fp8_weights
        self.backends: dict[str, Experts] = {}
        self.left_out: dict[str, str] = {}
        args = (gate_up_weight_e2FD, down_weight_eDF, activation, situ_beta, situ_linear_beta)
        for name in self.held_backends:
            problem = self._refusal(name, gate_up_weight_e2FD, down_weight_eDF)
            if problem is not None:
                self.left_out[name] = problem
                continue
            try:
                self.backends[name] = make_experts(name, *args, fp8_weights=fp8_weights)
            except MoERefError as err:  # a coded refusal (shape, activation): its regimes run the next backend
                if name == "triton":
                    raise
                self.left_out[name] = str(err)
        self.accepts_fp8_input = fp8 and all(backend.accepts_fp8_input for backend in self.backends.values())
        self.last_backend: str | None = None
        # the held backends a call may run in the batch-invariant mode
        precision = "fp8" if fp8 else "bf16"
        self.invariant_backends = tuple(name for name in self.backends
                                        if gives_triton_bits(name, gate_up_weight_e2FD.device, precision))
        self._batch_invariant = False

    @property
    def batch_invariant(self) -> bool:
        """The batch-invariant mode (set by the layer): passed on to every held backend."""
        return self._batch_invariant

    @batch_invariant.setter
    def batch_invariant(self, on: bool) -> None:
        self._batch_invariant = bool(on)
        for backend in self.backends.values():
            backend.batch_invariant = self._batch_invariant

    def _refusal(self, name: str, gate_up_weight_e2FD: torch.Tensor, down_weight_eDF: torch.Tensor) -> str | None:
        """Why ``name`` is not built over these weights (None: build it). Triton is always built."""
        if name == "triton":
            return None
        if self.fp8 and not experts_class(name, gate_up_weight_e2FD.device).supports_fp8:
            return f"{name} has no fp8 weights"
        if not self.fp8 and not all(w.dtype == torch.bfloat16 and w.is_contiguous()
                                    for w in (gate_up_weight_e2FD, down_weight_eDF)):
            return (f"the weights are {gate_up_weight_e2FD.dtype}, not contiguous bf16: the table ranks bf16 calls "
                    f"only, and {name} could need a copy of them")
        return None

    @classmethod
    def resolve_class(cls, device: torch.device) -> type[Experts]:
        if cls is not AutoExperts:  # already made for a held set
            return cls
        if device.type != "cuda":
            return experts_class("torch", device)
        plan = auto_plan(device)
        if plan.held == ("triton",):
            return experts_class("triton", device)
        return _auto_class(plan.gpu_class, plan.table.regimes,
                           tuple((name, experts_class(name, device)) for name in plan.held))

    @classmethod
    def describe(cls) -> str:
        return f"auto ({'+'.join(cls.held_backends)})"

    def regime_of(self, x_dtype: torch.dtype, layout: ExpertLayout) -> tuple[str | None, str, float]:
        """``(dtype, pool_format, rows per expert)`` of a call (see the module docstring); dtype None: not in a
        table (fp16/fp32 rows with plain weights)."""
        dtype = "fp8" if self.fp8 else _DTYPE_NAMES.get(x_dtype)
        pool_format = "masked" if layout.masked_rows else "contiguous"
        return dtype, pool_format, layout.rows_hint() / max(1, layout.num_local_experts)

    def pick(self, x_dtype: torch.dtype, layout: ExpertLayout) -> str:
        """The backend a call runs: the first of its regime's order that this object holds (in the batch-invariant
        mode: one of ``invariant_backends``), runs the pool format and, on a contiguous pool, whose
        ``segment_alignment`` divides ``layout.alignment``; Triton otherwise."""
        dtype, pool_format, rows_per_expert = self.regime_of(x_dtype, layout)
        regime = find_regime(self.regimes, dtype, pool_format, rows_per_expert)
        allowed = self.invariant_backends if self.batch_invariant else tuple(self.backends)
        for name in regime.order if regime is not None else ():
            backend = self.backends.get(name)
            if name in allowed and backend is not None and pool_format in backend.pool_formats and (
                    layout.masked_rows or layout.alignment % backend.segment_alignment == 0):
                return name
        return "triton"

    def forward(self, x_PDx, layout, x_scale_PDb=None):
        if layout.num_rows_hint is None:  # count the rows once (NOTE: a host sync, the one Triton would make)
            layout = dataclasses.replace(layout, num_rows_hint=layout.rows_hint())
        self.last_backend = self.pick(x_PDx.dtype, layout)
        return self.backends[self.last_backend](x_PDx, layout, x_scale_PDb)


@functools.lru_cache(maxsize=None)
def _auto_class(gpu_class: str, regimes: tuple[Regime, ...],
                held: tuple[tuple[str, type[Experts]], ...]) -> type[AutoExperts]:
    """``AutoExperts`` for one held set (name, class), made once: its alignment is the least common multiple of
    theirs, and it gets whole segments if any of them asks for them."""
    classes = [cls for _, cls in held]
    names = tuple(name for name, _ in held)
    return type(f"AutoExperts[{'+'.join(names)}]", (AutoExperts,), dict(
        __doc__=f"AutoExperts holding {', '.join(names)} under the table of GPU class {gpu_class}.",
        __module__=__name__, gpu_class=gpu_class, regimes=regimes, held_backends=names,
        segment_alignment=math.lcm(*(cls.segment_alignment for cls in classes)),
        computes_whole_segments=any(cls.computes_whole_segments for cls in classes)))


# --------------------------------------------------------------------------------------------------
# reading it
# --------------------------------------------------------------------------------------------------
def format_regimes(table: GpuClassTable) -> list[str]:
    """A GPU class's regimes as markdown lines (``moe-ref info`` and the tuning script's summary)."""
    lines = ["| dtype | pool | rows per expert | order (fastest first) | measured at | us per model shape |",
             "|---|---|---|---|---|---|"]
    for regime in table.regimes:
        bound = "any" if regime.max_rows_per_expert is None else f"<= {regime.max_rows_per_expert:g}"
        measured = regime.measured
        times = "; ".join(f"{model}: " + ", ".join(f"{name} {us:.1f}" for name, us in per_backend.items())
                          for model, per_backend in measured.get("us", {}).items())
        left_out = "".join(f"; {name} left out: {why}" for name, why in measured.get("left_out", {}).items())
        lines.append(f"| {regime.dtype} | {regime.pool_format} | {bound} | {', '.join(regime.order)} | "
                     f"{measured.get('routed_rows', '?')} rows ({measured.get('rows_per_expert', 0):.2f} per expert) | "
                     f"{times}{left_out} |")
    return lines


register_experts("auto", AutoExperts)
