"""Eager calls replayed from CUDA graphs, one graph per token count (one rank on CUDA).

An eager call launches about twenty kernels from Python; at decode the GPU finishes them faster than the host
issues them. One rank on CUDA has no host sync in a call (its device checks are read by a later call), so the
whole call can be captured once and replayed, as serving engines capture their decode steps:

    MegaMoE.forward(x [T, D]), eager, 1 <= T <= eager_graph_max_tokens, not itself being captured:
      T's first call                    -> the eager path (it compiles and tunes the kernels of this T)
      T's second call                   -> capture the call's device work into a CUDA graph (nothing runs), then
      every call of T from then on      -> the checks earlier calls left (raised as the eager path does), x copied
                                           into the graph's input, one replay, the output cloned, the call's check
                                           flags queued for a later call (``DeferredChecks``)

A replay computes the same bits as the eager call (the same kernels with the same arguments), device checks
included: NaN logits and bad routing values are raised by a later call or ``MegaMoE.check()``, as eagerly.

Memory: the graphs of every layer on a device share one memory pool, so their intermediates take the room of the
largest one, and one input and one output buffer of ``[eager_graph_max_tokens, D]``. That is safe because a
replay's output is cloned before the next replay on the stream; calls of layers on concurrent streams must set
``eager_graph_max_tokens=0``. Each graph keeps only what a failed check needs to name the bad tokens (the router
logits ``[T, E]`` fp32, the top-k ids and weights ``[T, K]``). A layer keeps at most ``MAX_GRAPHS`` graphs (the
least recently used goes). Loading weights or ``destroy()`` drops a layer's graphs (they hold the addresses of
the weights and buffers they were captured with). ``graph_memory(device)`` tells what the graphs hold (the pool's
reserved bytes, the I/O buffers); the layer's repr shows it (``EagerGraphs.describe``).

Shape legend: T tokens of this rank, D hidden.
"""
from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from moe_ref.ep.device_checks import DeviceChecks
from moe_ref.ep.routed_step import RoutedStep

__all__ = ["EagerGraphs", "MAX_GRAPHS", "graph_memory"]

logger = logging.getLogger(__name__)

# graphs one layer keeps (distinct token counts); beyond it the least recently used is dropped
MAX_GRAPHS = 32

# one memory pool and one capture stream per device, shared by every layer's graphs
_POOLS: dict[torch.device, tuple] = {}
_IO_BUFFERS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (device, dtype, width, max T) -> (x, y)
_LIVE_GRAPHS: dict[torch.device, int] = {}  # graphs captured into each device's pool and not yet garbage
_STREAMS: dict[torch.device, torch.cuda.Stream] = {}

# x_TD [T, D] -> (y_TD [T, D], the call's device checks): the call's device work, as the eager path runs it
DeviceWork = Callable[[torch.Tensor], "tuple[torch.Tensor, DeviceChecks]"]


@dataclass
class _Graph:
    """One captured call: replaying ``graph`` reads ``x_TD`` and writes ``y_TD`` (rows of the shared buffers) and
    ``checks``' flags."""

    graph: torch.cuda.CUDAGraph
    x_TD: torch.Tensor
    y_TD: torch.Tensor
    checks: DeviceChecks


class EagerGraphs:
    """A layer's CUDA graphs, one per token count (see the module doc).

    Args:
        max_tokens: the largest T replayed (``eager_graph_max_tokens``; >= 1).
        device: the layer's CUDA device.
    """

    def __init__(self, max_tokens: int, device: torch.device):
        self.max_tokens, self.device = max_tokens, torch.device(device)
        self._graphs: OrderedDict[int, _Graph] = OrderedDict()
        self._seen: set[int] = set()  # token counts called once (eagerly)
        self.captures = 0  # graphs captured so far (for tests and benchmarks)
        self.failure: str | None = None  # why a capture failed: the layer's calls stay eager from then on

    def __len__(self) -> int:
        return len(self._graphs)

    def describe(self) -> str:
        """One line for the layer's repr: this layer's graphs and what every layer's graphs on the device hold."""
        memory = graph_memory(self.device)
        pool = "unknown" if memory["pool_bytes"] is None else f"{memory['pool_bytes'] / 2**20:.1f} MiB"
        return (f"eager graphs {len(self)} (at most {MAX_GRAPHS}, T <= {self.max_tokens}); the device's graphs: "
                f"{memory['graphs']}, pool {pool}, I/O buffers {memory['io_bytes'] / 2**20:.1f} MiB")

    def covers(self, x_TD: torch.Tensor, max_num_tokens: int | None) -> bool:
        """Whether this call may be replayed: 1 <= T <= max_tokens, within the caller's ``max_num_tokens`` (a
        larger T is the eager path's ShapeError), and the stream is not capturing already (a user's own graph)."""
        num_tokens = x_TD.shape[0]
        return (self.failure is None and 1 <= num_tokens <= self.max_tokens
                and (max_num_tokens is None or num_tokens <= max_num_tokens)
                and not torch.cuda.is_current_stream_capturing())

    def __call__(self, x_TD: torch.Tensor, step: RoutedStep, work: DeviceWork) -> torch.Tensor | None:
        """``y_TD [T, D]`` from T's graph (captured now on T's second call), or None: run the eager path.

        Args:
            x_TD: ``[T, D]`` input, checked by the layer (shape, dtype, device; any strides).
            step: the layer's routed step (its deferred checks and call count move as in an eager call).
            work: the call's device work (captured once per T).
        """
        num_tokens = x_TD.shape[0]
        graph = self._graphs.get(num_tokens)
        if graph is None:
            if num_tokens not in self._seen or self.failure is not None:
                self._seen.add(num_tokens)
                return None
            if len(self._graphs) >= MAX_GRAPHS:
                self._graphs.popitem(last=False)
            graph = self._capture(x_TD, step, work)
            if graph is None:
                return None
        self._graphs.move_to_end(num_tokens)
        step.deferred_checks.raise_pending()  # an earlier call's failed check, as the eager path raises it
        graph.x_TD.copy_(x_TD)
        graph.graph.replay()
        step.calls += 1
        step.deferred_checks.record(graph.checks, self.device)
        return graph.y_TD.clone()

    def _capture(self, x_TD: torch.Tensor, step: RoutedStep, work: DeviceWork) -> _Graph | None:
        """Capture ``work`` for T = ``x_TD.shape[0]`` (nothing runs: the step's call count stays); None if it cannot
        be captured."""
        num_tokens, calls = x_TD.shape[0], step.calls
        x_buffer, y_buffer = _io_buffers(self.device, x_TD.dtype, x_TD.shape[1], self.max_tokens)
        x_static, y_static = x_buffer[:num_tokens], y_buffer[:num_tokens]
        graph = torch.cuda.CUDAGraph()
        current, stream = torch.cuda.current_stream(self.device), _capture_stream(self.device)
        stream.wait_stream(current)
        try:
            with torch.cuda.stream(stream), torch.inference_mode(False), torch.no_grad():
                graph.capture_begin(pool=_pool(self.device))
                try:
                    y_TD, checks = work(x_static)
                    y_static.copy_(y_TD)  # y_TD's memory goes back to the pool at the end of the capture
                finally:
                    graph.capture_end()
        except Exception as err:  # noqa: BLE001 - a capture that fails leaves the layer on the eager path
            self.failure = f"{type(err).__name__}: {err}"
            logger.warning("moe_ref: the capture of an eager call of %d tokens failed (%s); this layer's calls stay "
                           "on the eager path", num_tokens, self.failure)
            return None
        finally:
            current.wait_stream(stream)
            step.calls = calls
        self.captures += 1
        self._graphs[num_tokens] = captured = _Graph(graph, x_static, y_static, checks)
        _count_graph(captured, self.device)
        return captured

    def clear(self) -> None:
        """Drop every graph (after the weights or the routed step changed); token counts are captured again on
        their next two calls (not after a failed capture)."""
        self._graphs.clear()
        self._seen.clear()


def _pool(device: torch.device):
    """The device's shared pool, as ``capture_begin`` takes it: a ``graph_pool_handle()``, renewed once every graph
    captured into it is gone (the allocator forgets a pool when its last graph is destroyed, and a capture into the
    forgotten handle fails an internal assertion)."""
    if not _LIVE_GRAPHS.get(device):
        with torch.cuda.device(device):
            _POOLS[device] = torch.cuda.graph_pool_handle()
    return _POOLS[device]


def _io_buffers(device: torch.device, dtype: torch.dtype, width: int, max_tokens: int) -> tuple:
    """``(x [max_tokens, width], y [max_tokens, width])`` in ``dtype``: every graph of that shape class reads its
    input from rows ``:T`` of x and writes its output to rows ``:T`` of y (shared by the layers: a replay's output is
    cloned before the next replay)."""
    key = (device, dtype, width, max_tokens)
    if key not in _IO_BUFFERS:
        with torch.inference_mode(False):  # written by later calls, in or out of inference mode
            _IO_BUFFERS[key] = tuple(torch.empty(max_tokens, width, dtype=dtype, device=device) for _ in range(2))
    return _IO_BUFFERS[key]


def _count_graph(graph: _Graph, device: torch.device) -> None:
    """Count ``graph`` as a live user of the device's pool until it is garbage."""
    _LIVE_GRAPHS[device] = _LIVE_GRAPHS.get(device, 0) + 1
    weakref.finalize(graph, _graph_dropped, device)


def _graph_dropped(device: torch.device) -> None:
    _LIVE_GRAPHS[device] -= 1


def graph_memory(device: torch.device | str) -> dict:
    """What the eager graphs of every layer hold on ``device``: ``{"graphs": live graphs, "pool_bytes": the bytes
    their shared pool reserves (None where the allocator's snapshot does not tell), "io_bytes": the shared input
    and output buffers}``. Reads a snapshot of the allocator where graphs live (milliseconds): for reports, not calls.
    """
    device = torch.device(device)
    io_bytes = sum(2 * x.numel() * x.element_size() for (where, *_), (x, _) in _IO_BUFFERS.items() if where == device)
    graphs = _LIVE_GRAPHS.get(device, 0)
    pool_bytes = 0
    if graphs and device in _POOLS:
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            segments = torch.cuda.memory_snapshot()
            pool = tuple(_POOLS[device])
            pool_bytes = sum(segment["total_size"] for segment in segments
                             if segment["device"] == index and tuple(segment["segment_pool_id"]) == pool)
        except (RuntimeError, KeyError, TypeError):  # no snapshot, or one without pool ids
            pool_bytes = None
    return {"graphs": graphs, "pool_bytes": pool_bytes, "io_bytes": io_bytes}


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]
