"""``EPOptions``: every option of the EP layer, resolved ONCE (argument, then environment, then default).

    MegaMoE(cfg, group, num_max_tokens_per_rank=..., overflow=..., ...)
      --EPOptions.resolve (reads moe_ref.core.envs once, validates)--> EPOptions (frozen)
      --agree_on_fields(options.fingerprint(...)) over the EP group--> the same options on every rank
      --passed down--> overflow policy, capacity plan, transport, experts, mega engine

Nothing below the layer reads the environment or re-validates an option: it gets this object (or the
fields it needs). ``source`` records where each value came from, so an error names the argument or the
environment variable the user actually set.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from moe_ref.core import envs
from moe_ref.core.errors import DeviceUnavailableError, DTypeError, InvalidConfigError, UnknownNameError
from moe_ref.experts import check_pool_format, experts_class, registered_backends
from moe_ref.kernels.ep.ep_regions import POOL_FORMATS

OVERFLOW_POLICIES = ("error", "chunk")


@dataclass(frozen=True)
class Transport:
    """One row of the transport registry ``TRANSPORTS``.

    Attributes:
        summary: what it is, in a few words (``--help``, ``moe-ref info``).
        dispatcher: its ``Dispatcher`` subclass as ``"module:Class"``, imported by the factory
            (``moe_ref.ep.transport.make_dispatcher``) when used; None for ``auto``, which picks another row.
        symmetric_buffer: every rank maps every peer's buffer (CUDA symmetric memory, or shm files on CPU); else a
            private buffer.
        one_rank: runs one process only.
    """

    summary: str
    dispatcher: str | None
    symmetric_buffer: bool = False
    one_rank: bool = False


# The transports by name: the one list that EPOptions checks names against, the factory builds from
# (moe_ref.ep.transport) and the command line offers. A new transport is a Dispatcher subclass and a row here.
TRANSPORTS: dict[str, Transport] = {
    "auto": Transport("local for one rank; symm where every rank can map every peer's memory; a2a otherwise", None),
    "local": Transport("one process, a private buffer", "moe_ref.ep.symm:SymmDispatcher", one_rank=True),
    "symm": Transport("peers' buffers mapped: CUDA symmetric memory, or shared memory on CPU",
                      "moe_ref.ep.symm:SymmDispatcher", symmetric_buffer=True),
    "a2a": Transport("all_to_all_single over the EP group, a private buffer", "moe_ref.ep.a2a:AllToAllDispatcher"),
}
MEGA_CHOICES = ("off", "deep_gemm", "auto")
ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Used when neither the argument nor MOE_REF_NUM_MAX_TOKENS_PER_RANK gives a cap.
DEFAULT_NUM_MAX_TOKENS_PER_RANK = 4096
# Eager calls of at most this many tokens replay a CUDA graph of their shape (one rank on CUDA) unless the argument or
# MOE_REF_EAGER_GRAPH_MAX_TOKENS says otherwise. Larger calls are mostly prefill chunks of changing sizes (a graph
# per size would rarely be replayed), and their GPU work hides more of their launches.
DEFAULT_EAGER_GRAPH_MAX_TOKENS = 1024
# Receive-pool rows are addressed with int32 (recv_src); R * cap * K stays far below 2**31 with this bound.
MAX_NUM_MAX_TOKENS_PER_RANK = 1 << 20
# The experts backends that hold the batch-invariance contract on each device type (docs/batch_invariance.md), the
# first the one experts_backend='auto' resolves to in that mode where auto itself is not one of them; on CUDA auto
# holds it too (in the mode it runs only Triton, or a backend probed to give Triton's bits: moe_ref.experts.auto).
# moe_ref.ep.batch_invariant refuses the others (CFG026).
BATCH_INVARIANT_BACKENDS = {"cpu": ("torch",), "cuda": ("triton", "auto")}


@dataclass(frozen=True)
class EPOptions:
    """The EP layer's options, resolved and checked (``__post_init__`` raises coded errors).

    Attributes:
        num_max_tokens_per_rank: the cap C, rows ONE rank feeds per call (1 .. 2**20).
        overflow: ``"error"`` or ``"chunk"`` when a rank's batch exceeds C.
        transport: a name of ``TRANSPORTS`` (``auto``, ``local``, ``symm``, ``a2a``; auto is decided collectively
            later).
        experts_backend: ``"torch"``, ``"grouped_mm"``, ``"triton"``, ``"deep_gemm"`` or ``"auto"`` (``resolve``
            turns ``auto`` into what ``experts_class("auto", device)`` is here: ``"torch"`` on CPU; on CUDA
            ``"triton"``, or ``"auto"`` where the measured table ranks another installed backend (DeepGEMM) first in
            some call regime: ``moe_ref.experts.auto``).
        dispatch_fp8: rows move as fp8 e4m3 + per-128 scales; FP8 expert weights where the backend has them.
        alignment: rows each expert segment of the receive pool starts on (``resolve`` fills in the backend's
            ``segment_alignment``: torch 128, grouped_mm 16, triton 1, deep_gemm 128, auto the least common
            multiple of the backends it holds, 128 with deep_gemm).
        pool_format: ``"contiguous"`` (segments back to back: prefill) or ``"masked"`` (M rows per local expert
            at fixed starts, DeepGEMM's masked layout: decode with a small cap); see ``moe_ref.ep.capacity``.
        mega: ``"off"``, ``"deep_gemm"`` or ``"auto"``.
        dtype: of the parameters and the activations (fp32, fp16, bf16).
        device: of the parameters.
        debug_checks: per-call conservation checks (rows sent == rows received, each slot returned once).
        eager_graph_max_tokens: one rank on CUDA: eager calls of 1 .. this many tokens replay a CUDA graph of their
            token count, captured on its second call (``moe_ref.eager_graphs``); 0: every call launches its kernels.
            ``resolve``'s default: ``min(1024, num_max_tokens_per_rank)``.
        layer_index: which MoE layer of the EP group these options are for: its place in build order
            (``moe_ref.ep.distributed.claim_layer_index``). Every per-call agreement carries it, so ranks calling
            different layers raise ENV004 before any row moves; None: not known (calls of different layers are then
            told apart only by their call counts).
        batch_invariant: a token's output bits do not depend on its batch, row order, chunks or the EP size
            (``moe_ref.ep.batch_invariant``, docs/batch_invariance.md).
        source: option name -> ``"the argument"``, the environment variable's name, or ``"the default"``.
    """

    num_max_tokens_per_rank: int = DEFAULT_NUM_MAX_TOKENS_PER_RANK
    overflow: str = "error"
    transport: str = "auto"
    experts_backend: str = "torch"
    dispatch_fp8: bool = False
    alignment: int | None = None
    pool_format: str = "contiguous"
    mega: str = "off"
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")
    debug_checks: bool = False
    eager_graph_max_tokens: int = 0
    layer_index: int | None = None
    batch_invariant: bool = False
    source: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "device", torch.device(self.device))
        cap = self.num_max_tokens_per_rank
        where = self.source.get("num_max_tokens_per_rank", "the argument")
        if not isinstance(cap, int) or isinstance(cap, bool) or not 1 <= cap <= MAX_NUM_MAX_TOKENS_PER_RANK:
            raise InvalidConfigError(
                f"num_max_tokens_per_rank={cap!r} (from {where}) must be an integer in [1, "
                f"{MAX_NUM_MAX_TOKENS_PER_RANK}]: the most rows ONE rank feeds per call; `moe-ref plan --budget-gib G` "
                f"prints the largest that fits G GiB", field="num_max_tokens_per_rank")
        for name, choices in (("overflow", OVERFLOW_POLICIES), ("transport", TRANSPORTS),
                              ("experts_backend", registered_backends()), ("mega", MEGA_CHOICES),
                              ("pool_format", POOL_FORMATS)):
            value = getattr(self, name)
            if value not in choices:
                raise UnknownNameError(f"{name}={value!r} (from {self.source.get(name, 'the argument')}); supported: "
                                       f"{', '.join(choices)}", field=name)
        graph_tokens = self.eager_graph_max_tokens
        if isinstance(graph_tokens, bool) or not isinstance(graph_tokens, int) or not 0 <= graph_tokens <= cap:
            raise InvalidConfigError(
                f"eager_graph_max_tokens={graph_tokens!r} (from "
                f"{self.source.get('eager_graph_max_tokens', 'the argument')}) must be an integer in [0, "
                f"num_max_tokens_per_rank={cap}]: the largest token count whose eager calls replay a CUDA graph "
                f"(0: none)", field="eager_graph_max_tokens")
        if self.alignment is not None and (isinstance(self.alignment, bool) or not isinstance(self.alignment, int)
                                           or self.alignment <= 0):  # True is an int to Python, not a row count
            raise InvalidConfigError(f"alignment={self.alignment!r} must be a positive integer (rows)", field="alignment")
        if self.layer_index is not None and (isinstance(self.layer_index, bool) or not isinstance(self.layer_index, int)
                                             or self.layer_index < 0):
            raise InvalidConfigError(f"layer_index={self.layer_index!r} must be None or an integer >= 0 (the layer's "
                                     f"place in build order on its EP group)", field="layer_index")
        if self.dtype not in ACTIVATION_DTYPES:
            raise DTypeError(f"dtype={self.dtype}; MegaMoE parameters must be one of "
                             f"{', '.join(str(d) for d in ACTIVATION_DTYPES)}", field="dtype")
        if self.device.type == "cuda":
            available = torch.cuda.device_count() if torch.cuda.is_available() else 0
            index = self.device.index if self.device.index is not None else 0
            if index >= available:
                raise DeviceUnavailableError(f"device={str(self.device)!r} but torch sees {available} CUDA device(s) "
                                             f"here; use device='cpu' or run on a machine with that GPU")
            if self.device.index is None:  # 'cuda' means the current device: name it, so tensors compare equal
                object.__setattr__(self, "device", torch.device("cuda", torch.cuda.current_device()))
        elif self.device.type != "cpu":
            raise DeviceUnavailableError(f"device={str(self.device)!r}: moe_ref runs on 'cpu' and 'cuda' devices")

    @staticmethod
    def resolve(*, num_max_tokens_per_rank: int | None = None, overflow: str | None = None,
                transport: str | None = None, experts_backend: str | None = None, dispatch_fp8: bool = False,
                alignment: int | None = None, pool_format: str | None = None, mega: str | None = None,
                dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                debug_checks: bool | None = None, eager_graph_max_tokens: int | None = None,
                layer_index: int | None = None, batch_invariant: bool | None = None) -> "EPOptions":
        """Each option from the argument if given (not None; ``"auto"`` counts as given except for the
        transport, where an operator's ``MOE_REF_TRANSPORT`` still decides), else its environment variable,
        else the default. ``experts_backend="auto"`` becomes torch on CPU; on CUDA triton, or auto where it holds
        more than Triton here (``experts_class``); ``alignment=None`` becomes that backend's ``segment_alignment``.
        ``layer_index`` is taken as given (no environment variable)."""
        source: dict[str, str] = {}

        def pick(name, argument, env_name, env_value, default, argument_wins=lambda v: v is not None):
            if argument_wins(argument):
                source[name] = "the argument"
                return argument
            if env_value is not None:
                source[name] = env_name
                return env_value
            source[name] = "the default"
            return default

        cap = pick("num_max_tokens_per_rank", num_max_tokens_per_rank, "MOE_REF_NUM_MAX_TOKENS_PER_RANK",
                   envs.num_max_tokens_per_rank(), DEFAULT_NUM_MAX_TOKENS_PER_RANK)
        policy = pick("overflow", overflow, "MOE_REF_OVERFLOW_POLICY", envs.overflow_policy(), "error")
        transport_name = pick("transport", transport, "MOE_REF_TRANSPORT", envs.transport(), "auto",
                              argument_wins=lambda v: v not in (None, "auto"))
        backend = pick("experts_backend", experts_backend, "MOE_REF_EXPERTS_BACKEND", envs.experts_backend(), "auto")
        device = torch.device(device)
        invariant = bool(pick("batch_invariant", batch_invariant, "MOE_REF_BATCH_INVARIANT", envs.batch_invariant(),
                              False))
        if backend == "auto" and invariant and "auto" not in BATCH_INVARIANT_BACKENDS.get(device.type, ("auto",)):
            backend = BATCH_INVARIANT_BACKENDS[device.type][0]  # the one that holds the contract here
        if backend == "auto":
            backend = experts_class("auto", device).name  # torch, triton, or auto holding more than Triton here
        if alignment is None and backend in registered_backends():
            alignment = experts_class(backend, device).segment_alignment  # the pool layout the backend wants
        pool = pick("pool_format", pool_format, "MOE_REF_POOL_FORMAT", envs.pool_format(), "contiguous")
        if backend in registered_backends() and pool in POOL_FORMATS:
            check_pool_format(experts_class(backend, device), pool, source["pool_format"])
        debug = pick("debug_checks", debug_checks, "MOE_REF_DEBUG_CHECKS", envs.debug_checks(), False)
        graph_tokens = pick("eager_graph_max_tokens", eager_graph_max_tokens, "MOE_REF_EAGER_GRAPH_MAX_TOKENS",
                            envs.eager_graph_max_tokens(),
                            min(DEFAULT_EAGER_GRAPH_MAX_TOKENS, cap) if isinstance(cap, int) else 0)
        return EPOptions(num_max_tokens_per_rank=cap, overflow=policy, transport=transport_name,
                         experts_backend=backend, dispatch_fp8=bool(dispatch_fp8), alignment=alignment,
                         pool_format=pool, mega=mega if mega is not None else "off", dtype=dtype, device=device,
                         debug_checks=bool(debug), eager_graph_max_tokens=graph_tokens, layer_index=layer_index,
                         batch_invariant=invariant, source=source)

    def replace(self, **changes) -> "EPOptions":
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    def fingerprint(self) -> dict[str, str]:
        """What must be equal on every rank of the group (the device index may differ: one GPU per rank). The experts
        backend is described as it runs here (``auto (triton+deep_gemm)``), so ranks where ``auto`` resolved
        differently (DeepGEMM usable on some only) differ here, and in ``alignment``."""
        backend = experts_class(self.experts_backend, self.device).describe()
        return {"num_max_tokens_per_rank": str(self.num_max_tokens_per_rank), "overflow": self.overflow,
                "transport": self.transport, "experts_backend": backend,
                "dispatch_fp8": str(self.dispatch_fp8), "alignment": str(self.alignment),
                "pool_format": self.pool_format, "mega": self.mega, "dtype": str(self.dtype),
                "device_type": self.device.type, "debug_checks": str(self.debug_checks),
                "eager_graph_max_tokens": str(self.eager_graph_max_tokens), "layer_index": str(self.layer_index),
                "batch_invariant": str(self.batch_invariant)}
