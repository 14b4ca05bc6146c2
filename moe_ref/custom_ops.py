"""``MegaMoE`` as a custom op, so ``torch.compile(model, fullgraph=True)`` takes a model that uses it.

    torch.compile traces a model  ->  MegaMoE.forward sees torch.compiler.is_compiling()
      ->  torch.ops.moe_ref.mega_moe(hidden_states, layer_id, max_num_tokens)        one opaque node in the graph
          fake (meta) implementation: an empty [T, D] tensor of the input's dtype, so the graph is traced without
          running the layer; the real one runs the layer's eager forward (its collectives, host checks, kernels)

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


def register(layer: torch.nn.Module) -> int:
    """A new id for ``layer`` (held weakly: the op fails with a clear message once the layer is gone)."""
    layer_id = next(_NEXT_ID)
    _LAYERS[layer_id] = layer
    return layer_id


@torch.library.custom_op("moe_ref::mega_moe", mutates_args=())
def mega_moe(hidden_states: torch.Tensor, layer_id: int, max_num_tokens: int) -> torch.Tensor:
    """``MegaMoE.forward`` of layer ``layer_id`` (``max_num_tokens`` -1 = None): ``[T, D]`` -> ``[T, D]``."""
    layer = _LAYERS.get(layer_id)
    if layer is None:
        raise RuntimeError(f"moe_ref::mega_moe: layer {layer_id} no longer exists (it was garbage-collected)")
    return layer.eager_forward(hidden_states, max_num_tokens=None if max_num_tokens < 0 else max_num_tokens)


@mega_moe.register_fake
def _mega_moe_fake(hidden_states: torch.Tensor, layer_id: int, max_num_tokens: int) -> torch.Tensor:
    return torch.empty_like(hidden_states)
