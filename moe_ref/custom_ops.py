"""``MegaMoE`` as a custom op, so ``torch.compile(model, fullgraph=True)`` takes a model that uses it.

    torch.compile traces a model  ->  MegaMoE.forward sees torch.compiler.is_compiling()
      ->  torch.ops.moe_ref.mega_moe(hidden_states, calls, layer_id, max_num_tokens, grad_requested)
          one opaque node in the graph
          fake (meta) implementation: an empty contiguous [T, D] tensor of the input's dtype (the real output's
          layout, whatever the input's strides), so the graph is traced without running the layer; the real one
          runs the layer's eager forward (its collectives, host checks, kernels) and returns a contiguous tensor

The op is collective: EVERY call must run on every rank, also one with T = 0 whose output nobody reads (else
that rank skips the per-call collective and its peers wait for it: ENV005). So it is declared as mutating
``calls`` (the layer's one-element call counter, which it increments): a mutating op is never dead code, and
neither inductor nor AOTAutograd replaces it by an empty tensor when the output has no elements.

Gradients: the op has no backward. ``MegaMoE.forward`` computes ``grad_requested`` at trace time (grad mode and
the input's / parameters' ``requires_grad``, guarded by dynamo) and passes the op a detached input, so autograd
never records it; the real implementation then raises ``GradientNotSupportedError`` (INP007) on every rank, as the
eager layer does. NOTE: not a ``no_grad()`` block around the op: dynamo turns it into grad-off / op / grad-on in the
graph, and an error raised by the op (INP002, INP007, CAP001...) would skip the grad-on, leaving autograd off for
the rest of the process.

The layer moves rows between processes through buffers, syncs the host for its per-call agreement and raises
coded errors: none of that can be traced, and none of it needs to be, so the whole layer is one node (as serving
engines wrap their fused MoE). Under ``mode="reduce-overhead"`` on CUDA the node runs inside the captured CUDA
graph, where the routed step takes its capture path (``moe_ref.ep.routed_step``: no host sync).

Layers are found by an integer id (a custom op takes tensors and numbers, not modules); ``register`` hands it
out and holds the layer weakly.
"""
from __future__ import annotations

import itertools
import weakref

import torch

_LAYERS: "weakref.WeakValueDictionary[int, torch.nn.Module]" = weakref.WeakValueDictionary()
_NEXT_ID = itertools.count(1)


class _TracedBadBound:
    """What the op passes as ``max_num_tokens`` when the traced call gave one that is not an int (-2 in the graph)."""

    def __repr__(self) -> str:
        return "<not an int when torch.compile traced the call>"


TRACED_BAD_BOUND = _TracedBadBound()


def encode_bound(max_num_tokens) -> int:
    """``max_num_tokens`` as the op's int argument: a count >= 0 as itself, None as -1, anything not an int (a bool
    included) as -2, a negative int n as n - 2 (so the op raises INP008 naming it, on every rank)."""
    if max_num_tokens is None:
        return -1
    if not isinstance(max_num_tokens, int) or isinstance(max_num_tokens, bool):
        return -2
    return max_num_tokens if max_num_tokens >= 0 else max_num_tokens - 2


def decode_bound(encoded: int):
    """The inverse of ``encode_bound`` (``TRACED_BAD_BOUND`` for -2)."""
    return {-1: None, -2: TRACED_BAD_BOUND}.get(encoded, encoded if encoded >= 0 else encoded + 2)


def register(layer: torch.nn.Module) -> int:
    """A new id for ``layer`` (held weakly: the op fails with a clear message once the layer is gone)."""
    layer_id = next(_NEXT_ID)
    _LAYERS[layer_id] = layer
    return layer_id


@torch.library.custom_op("moe_ref::mega_moe", mutates_args=("calls",))
def mega_moe(hidden_states: torch.Tensor, calls: torch.Tensor, layer_id: int, max_num_tokens: int,
             grad_requested: bool) -> torch.Tensor:
    """``MegaMoE.forward`` of layer ``layer_id`` (``max_num_tokens`` as ``encode_bound`` writes it) ``[T, D]`` ->
    contiguous ``[T, D]``; ``calls`` (the layer's call counter) is incremented, which keeps every call in the graph."""
    layer = _LAYERS.get(layer_id)
    if layer is None:
        raise RuntimeError(f"moe_ref::mega_moe: layer {layer_id} no longer exists (it was garbage-collected)")
    calls.add_(1)
    bound = decode_bound(max_num_tokens)
    # read_checks_now: a call must not keep tensors for a later one here: under mode="reduce-overhead" the calls
    # before capture allocate from the compiled graph's memory pool, which refuses live tensors it does not track
    out = layer.eager_forward(hidden_states, max_num_tokens=bound, grad_requested=grad_requested,
                              read_checks_now=True)
    return out.contiguous()


@mega_moe.register_fake
def _mega_moe_fake(hidden_states: torch.Tensor, calls: torch.Tensor, layer_id: int, max_num_tokens: int,
                   grad_requested: bool) -> torch.Tensor:
    return hidden_states.new_empty(hidden_states.shape)  # contiguous, as the real output (not x's strides)
