"""``moe_ref.kernels.runtime.ops``'s own helpers (the kernel-or-twin decisions are tested with each kernel)."""
from __future__ import annotations

import pytest
import torch

from moe_ref.kernels.runtime import ops

pytestmark = pytest.mark.unit


def test_the_one_expert_layout_is_made_once_per_token_count(monkeypatch):
    """The shared experts' layout ``[0, T]`` (one expert owning every row) is kept per (device, T): a call builds
    no tensor (on a GPU: launches no kernel) once its T was seen; it is a normal tensor, usable out of inference mode
    after being made in it."""
    monkeypatch.setattr(ops, "_ONE_EXPERT_LAYOUTS", {})
    cpu = torch.device("cpu")
    with torch.inference_mode():
        first = ops._one_expert_layout(5, cpu)
    assert first.tolist() == [0, 5] and not first.is_inference()
    assert ops._one_expert_layout(5, cpu) is first
    assert ops._one_expert_layout(7, cpu).tolist() == [0, 7] and len(ops._ONE_EXPERT_LAYOUTS) == 2
    assert first[:1].tolist() == [0] and first[1:2].tolist() == [5]  # the row start, the rows: as dense_mlp slices


def test_the_kept_layouts_are_bounded(monkeypatch):
    monkeypatch.setattr(ops, "_ONE_EXPERT_LAYOUTS", {})
    monkeypatch.setattr(ops, "_MAX_LAYOUTS", 3)
    for num_tokens in range(1, 8):
        assert ops._one_expert_layout(num_tokens, torch.device("cpu")).tolist() == [0, num_tokens]
        assert len(ops._ONE_EXPERT_LAYOUTS) <= 3
