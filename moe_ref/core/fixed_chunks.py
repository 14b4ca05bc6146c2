"""Elementwise math whose bits do not depend on the tensor's size: the CPU half of the batch-invariant mode's promise
for the transcendental steps (the router's sigmoid and exp, the gated activations).

torch's CPU elementwise kernels run a vectorized loop over the flattened tensor and compute the elements left after
its last full step (up to 63 of them) with scalar code: ``std::exp`` where the loop uses its own vector exp, so
``sigmoid``, ``exp`` and ``silu`` give such an element other bits (measured on an AVX-512 CPU with torch 2.13: the
tiny Kimi-K2 preset's router sigmoid of one token's 16 logits alone differed in 3 of 16 from the same token's inside
64 tokens). Which elements fall in that tail
depends on the tensor's size, and a tensor above torch's grain size (32768 elements) is also split over threads at
places that depend on it. ``in_fixed_chunks`` runs the function on fresh 1-D chunks of at most ``CHUNK`` elements,
each a multiple of ``STEP`` (the last zero padded): one thread each, no tail, so every element goes through the same
vector code whatever T is (the loop's length does not change an element's bits: checked for sigmoid and bf16 silu
at 64 to 32704 elements).

GEMMs need their own scheme (one shape per call: ``moe_ref.kernels.runtime.fixed_tiles.in_row_blocks``); a row
reduction (softmax over the last dim) runs row by row already.
"""
from __future__ import annotations

from typing import Callable

import torch

# torch's CPU grain size (at::internal::GRAIN_SIZE: a range this long runs on one thread)
CHUNK = 32768
# a multiple of every vectorized loop's step (two vectors of at most 32 bf16: 64 elements); CHUNK is one too
STEP = 64


def in_fixed_chunks(fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
    """``fn(*tensors)`` for an elementwise ``fn`` over same-shape tensors, computed chunk by chunk on fresh 1-D copies
    of ``CHUNK`` elements, the last one rounded up to a multiple of ``STEP`` with zeros (``fn`` must accept zeros), so
    an element's bits do not depend on the tensors' size or on where it sits in them.

    Example: ``in_fixed_chunks(torch.sigmoid, logits_TE)`` for ``[1, 300]`` logits calls ``torch.sigmoid`` once on
    320 elements (300 of them real); for ``[4096, 384]``, 48 times on 32768.

    Args:
        fn: elementwise over its arguments (row i, column j of its output depends on element (i, j) of each input only).
        tensors: the same shape, any dtypes ``fn`` takes; on any device (the scheme matters on CPU).

    Returns:
        ``fn``'s result, the tensors' shape.
    """
    shape, numel = tensors[0].shape, tensors[0].numel()
    if any(t.shape != shape for t in tensors):
        raise ValueError(f"in_fixed_chunks: tensors of shapes {[tuple(t.shape) for t in tensors]}; one shape needed")
    if numel == 0:
        return fn(*tensors)
    flats = [t.reshape(-1) for t in tensors]
    pieces = []
    for lo in range(0, numel, CHUNK):
        count = min(CHUNK, numel - lo)
        chunks = []
        for flat in flats:
            chunk = flat.new_zeros(-(-count // STEP) * STEP)
            chunk[:count] = flat[lo:lo + count]
            chunks.append(chunk)
        pieces.append(fn(*chunks)[:count])
    return torch.cat(pieces).view(shape)
