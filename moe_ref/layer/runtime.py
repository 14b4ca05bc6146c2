"""A ``MegaMoE``'s runtime objects: built on first use, rebuilt after a load, released by ``destroy()`` and at exit,
left out of pickles.

    layer.experts        build_experts: the experts backend over the loaded weights (quantized as stored, or plain);
                         ``UnloadedExperts`` (meta tensors, no memory) while ``missing_weights(layer)`` is not empty
    layer.routed_step    build_routed_step: ``ModularRoutedStep`` (transport x experts) or ``MonolithicRoutedStep``
                         (DeepGEMM's mega engine); collective: every rank builds it on its first call
    layer.eager_graphs   eager_graphs_for: the CUDA graphs one rank on CUDA replays (``moe_ref.eager_graphs``)
    first eager call     warm_up: one rank on CUDA runs the layer's work once per token count of warm_up_counts
                         first, so that no later call of a new T loads a kernel variant
    after a load         weights_changed: the experts rebuilt on next use and swapped into a built modular step (its
                         plan and buffers stay); a fused engine (it holds fp8 copies of the weights) rebuilt
    destroy()            the step and its share of the group's symmetric buffer released, the graphs dropped
    at exit              release_all_at_exit: every live layer releases its buffers and its references to the group
    pickle, deepcopy     picklable_state: the layer without them (a copy builds its own on its first call);
                         start: what a new layer and an unpickled copy share (no runtime objects, an op id, tracked)

Shape legend: P receive-pool rows, Dx expert input width, Db = ceil(Dx / 128), e local experts, F expert intermediate.
"""
from __future__ import annotations

import atexit
import logging
import weakref

import torch
from torch import nn

from moe_ref import custom_ops
from moe_ref.core.errors import BatchInvariantExpertsError, LayerNotPicklableError, WeightsNotLoadedError
from moe_ref.eager_graphs import EagerGraphs
from moe_ref.ep.routed_step import RoutedStep, make_modular_step
from moe_ref.experts import Experts, ExpertLayout, experts_class, make_experts
from moe_ref.experts.quantized import make_quantized_experts, quantized_experts_class
from moe_ref.kernels.experts.grouped_mlp import tiles_recorded
from moe_ref.layer.weights import expert_shapes, missing_weights, quantized_backend

logger = logging.getLogger(__name__)

# what a layer builds while it runs; never pickled (a copy builds its own)
_RUNTIME_FIELDS = ("_routed_step", "_experts", "_graphs", "_op_id", "_warm")
_LIVE_LAYERS: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def start(layer: nn.Module) -> None:
    """No runtime objects yet (built on first use), a fresh id for torch.compile's op (``moe_ref.custom_ops``) and its
    call counter, and a place among the layers released at exit: what a new layer and an unpickled copy both need."""
    layer._routed_step = layer._experts = layer._graphs = None
    layer._warm = False
    layer._op_id = custom_ops.register(layer)
    if "_op_calls" not in layer._buffers:  # an unpickled copy has its own
        # calls of the compiled op; the op mutates it, so no call is ever dropped from a graph (custom_ops). A
        # buffer (not saved in state_dict), so torch.compile treats it as a static input, as CUDA graphs want
        with torch.inference_mode(False):
            layer.register_buffer("_op_calls", torch.zeros(1, dtype=torch.int64, device=layer.options.device),
                                  persistent=False)
    _LIVE_LAYERS.add(layer)


class UnloadedExperts(Experts):
    """Stands in for the experts of a layer whose weights are not all loaded, so that its routed step can be built,
    and agree on INP006 with its peers, without allocating the experts (its weights are meta tensors). It never
    runs: a call of such a layer raises ``WeightsNotLoadedError`` (INP006) on every rank before any row moves.

    Args:
        like: the class that will run the loaded weights (the step's pool formats and segments are its).
        gate_up_weight_e2FD: ``[e, 2F, Dx]`` on the meta device.
        down_weight_eDF: ``[e, Dx, F]`` on the meta device.
    """

    name = "unloaded"

    def __init__(self, like: type[Experts], gate_up_weight_e2FD: torch.Tensor, down_weight_eDF: torch.Tensor):
        super().__init__(gate_up_weight_e2FD, down_weight_eDF)
        self.name = f"{like.name} (not loaded)"
        self.pool_formats, self.segment_alignment = like.pool_formats, like.segment_alignment
        self.computes_whole_segments = like.computes_whole_segments

    def forward(self, x_PDx: torch.Tensor, layout: ExpertLayout, x_scale_PDb: torch.Tensor | None = None):
        raise WeightsNotLoadedError("the routed experts were never loaded (the call's agreement raises this first)")


def fp8_experts(layer: nn.Module) -> bool:
    """FP8 expert weights: with ``dispatch_fp8`` on a backend that has them (triton, deep_gemm)."""
    options = layer.options
    return options.dispatch_fp8 and experts_class(options.experts_backend, options.device).supports_fp8


def build_experts(layer: nn.Module) -> Experts:
    """This rank's experts backend over the loaded weights (``UnloadedExperts`` while some are missing)."""
    cfg, options = layer.cfg, layer.options
    activation = (cfg.activation, cfg.situ_beta, cfg.situ_linear_beta)
    with torch.inference_mode(False):
        if missing_weights(layer):
            meta = [torch.empty(shape, dtype=options.dtype, device="meta") for shape in expert_shapes(layer)]
            return UnloadedExperts(experts_class(options.experts_backend, options.device), *meta)
        if layer.quantized_experts is not None:
            stored = layer.quantized_experts
            backend = quantized_backend(layer, stored.spec)
            cls = quantized_experts_class(stored.spec.format, backend, stored.device)
            if options.batch_invariant and not cls.honours_batch_invariant:
                # every rank loads the same checkpoint: every rank raises here alike
                raise BatchInvariantExpertsError(
                    f"batch_invariant=True, but the routed experts were loaded quantized as stored ({stored.spec}) "
                    f"and run on {cls.__name__}, whose kernel does not give a row the same bits in every batch; run "
                    f"them on a backend that does (experts_backend='auto'), or build the layer with "
                    f"batch_invariant=False")
            experts = make_quantized_experts(stored, *activation, backend=backend)
            experts.batch_invariant = options.batch_invariant
            return experts
        experts = make_experts(options.experts_backend, layer.gate_up_weight, layer.down_weight, *activation,
                               fp8=fp8_experts(layer), swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit,
                               gate_up_bias_e2F=layer.gate_up_bias, down_bias_eD=layer.down_bias)
        experts.batch_invariant = options.batch_invariant
        return experts


def build_routed_step(layer: nn.Module) -> RoutedStep:
    """The layer's one routed step (collective: plan, symmetric buffer, transport or fused engine)."""
    with torch.inference_mode(False):  # buffers must stay usable outside inference mode
        if layer.uses_mega:
            from moe_ref.ep.mega_deep_gemm import make_mega_step

            # NOTE: the fused engine quantizes the weights it is built from: an unloaded layer allocates them here
            return make_mega_step(layer.cfg, layer.group, layer.options, *layer._expert_parameters())
        # EPLB: the step sees the Ph physical slots as its experts (plan, buffer, transport, telemetry)
        cfg = layer.cfg if layer.expert_slots is None else layer.expert_slots.step_config(layer.cfg)
        return make_modular_step(cfg, layer.group, layer.experts, layer.options)


def _calls_run_alone(layer: nn.Module, step: RoutedStep) -> bool:
    """One rank on CUDA whose device checks are read by a later call (no host sync, no collective in a call), on
    the modular routed step: where a call's device work can be replayed, or run ahead of time."""
    return layer.options.device.type == "cuda" and step.deferred_checks is not None and not layer.uses_mega


def eager_graphs_for(layer: nn.Module, step: RoutedStep) -> EagerGraphs | None:
    """The layer's eager CUDA graphs (``moe_ref.eager_graphs``), where calls can replay them (``_calls_run_alone``
    and ``eager_graph_max_tokens`` > 0); else None."""
    o = layer.options
    if layer._graphs is None and o.eager_graph_max_tokens > 0 and _calls_run_alone(layer, step):
        layer._graphs = EagerGraphs(o.eager_graph_max_tokens, o.device)
    return layer._graphs


# The first eager call of one rank on CUDA runs the layer's work on these token counts (up to the cap) before its
# own: each power of 2 (every rows bucket the grouped MLP's tile table keys on, T * K rows) and each of Triton's
# integer specializations of T (1, a multiple of 16, other), so each kernel variant a later call can take is
# loaded once, up front. Only for the Triton grouped MLP on recorded tiles (a GPU class with a tile table): where
# tiles are autotuned, or for other expert kernels, a bucket's first launch costs seconds, left to the calls that
# meet it. On one H100 (2026-12-07, scripts/bench_warmup.py, Triton's disk cache warm) the first call
# of a new T cost up to 18-26 ms more than its later calls, loading variants, in both eager modes.
WARM_UP_MAX_TOKENS = 1024  # above it calls are long and variants few: loaded lazily (the allocator stays small)


def warm_up_counts(cap: int) -> list[int]:
    """The token counts ``warm_up`` runs: 1, 3 and the powers of 2 up to ``min(cap, WARM_UP_MAX_TOKENS)``."""
    bound = min(cap, WARM_UP_MAX_TOKENS)
    return sorted({t for t in (1, 3) if t <= bound} | {1 << i for i in range(bound.bit_length())})


def warm_up(layer: nn.Module, step: RoutedStep, device_work) -> None:
    """Once per layer, on its first eager call where calls have no collective (one rank on CUDA, the modular routed
    step, not inside a capture): ``device_work(x_TD)`` on zero tokens for each of ``warm_up_counts``; the step's call
    count and per-expert row counter (EPLB telemetry) restored after, so the warm-up leaves no trace but the loaded
    kernels (and the allocator's cached blocks)."""
    if layer._warm:
        return
    layer._warm = True
    o = layer.options
    if not _calls_run_alone(layer, step) or step.capturing():
        return
    if layer.experts.name != "triton" or not tiles_recorded(o.device):
        return  # each new rows bucket would autotune (seconds): left to the calls that meet it
    counts = warm_up_counts(o.num_max_tokens_per_rank)
    counter_e, calls = step.num_recv_tokens_per_expert, step.calls
    saved_e = counter_e.clone()
    x_TD = torch.zeros(counts[-1], layer.cfg.hidden_size, dtype=o.dtype, device=o.device)
    with torch.no_grad():
        for num_tokens in counts:
            device_work(x_TD[:num_tokens])
    counter_e.copy_(saved_e)
    step.calls = calls


def weights_changed(layer: nn.Module) -> None:
    """After a load that replaced the experts: they are rebuilt on first use; a built modular step gets them swapped
    in (its plan and buffers stay), a fused engine (holding fp8 copies) is rebuilt; graphs of the old tensors go."""
    layer._experts = None
    drop_graphs(layer)
    if layer.uses_mega and layer._routed_step is not None:
        layer._routed_step.destroy()
        layer._routed_step = None
    elif layer._routed_step is not None:
        layer._routed_step.experts = layer.experts


def drop_graphs(layer: nn.Module) -> None:
    if layer._graphs is not None:
        layer._graphs.clear()


def destroy(layer: nn.Module) -> None:
    """``MegaMoE.destroy``: the graphs dropped, the routed step and its share of the buffer released."""
    drop_graphs(layer)
    if layer._routed_step is not None:
        layer._routed_step.destroy()
        layer._routed_step = None


def release_group(layer: nn.Module) -> None:
    """At exit: ``destroy()`` and drop every reference the layer and its step hold to the process group, so
    the group's C++ object (gloo's threads) is freed now, while the interpreter is intact, and not during
    its final teardown (where gloo's destructor can abort the process: "terminate called without an
    active exception", exit status -6). The layer cannot be called afterwards."""
    step = layer._routed_step
    destroy(layer)
    dispatcher = getattr(step, "dispatcher", None)
    for holder in (step, dispatcher, getattr(dispatcher, "buffer", None)):
        if holder is not None and hasattr(holder, "group"):
            holder.group = None
    layer.group = None


@atexit.register
def release_all_at_exit() -> None:
    """Before the interpreter tears down: every live layer releases its buffers and its references to the
    process group (``release_group``), so ``dist.destroy_process_group()`` followed by exit (or
    torchrun's teardown) never destroys the group's C++ object from a module global's finalizer at exit.

    NOTE: registered at import, after torch.distributed's own hooks, so it runs before them (atexit is LIFO).
    A script must still call ``dist.destroy_process_group()`` before it ends: without it gloo can abort at exit
    with no MegaMoE at all (torch's own behaviour, seen in about one run in three on 2 CPU ranks)."""
    for layer in list(_LIVE_LAYERS):
        try:
            release_group(layer)
        except Exception:  # noqa: BLE001 - exit goes on; one layer's failure must not keep the others' groups
            logger.debug("moe_ref: releasing a layer at exit failed", exc_info=True)


def picklable_state(layer: nn.Module) -> dict:
    """The layer's ``__dict__`` without its runtime objects (a copy: the live layer keeps them and stays usable).

    Raises ``LayerNotPicklableError`` (CFG020) for a layer over a process group: the copy would call collectives
    its peers never join."""
    if layer.group is not None:
        raise LayerNotPicklableError(
            f"this MegaMoE runs over a process group ({layer.world_size} ranks, this is rank {layer.rank}), which "
            f"cannot be pickled: save its weights with state_dict() on every rank and load them into a layer built "
            f"over the group (MegaMoE(cfg, group, ...).load_state_dict(state)), or pickle a layer built with "
            f"group=None")
    return {name: value for name, value in layer.__dict__.items() if name not in _RUNTIME_FIELDS}
