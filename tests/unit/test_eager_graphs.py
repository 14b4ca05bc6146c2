"""The eager-graph policy on the CPU (the capture itself needs CUDA: tests/gpu/test_eager_graphs_cuda.py): which
calls capture, replay or stay eager, the step's call count and checks, the graph limit, a failed capture, and the
option that bounds it all."""
from __future__ import annotations

import logging
import types

import pytest
import torch

from moe_ref import eager_graphs
from moe_ref.core.errors import InvalidConfigError, NonFiniteError
from moe_ref.eager_graphs import EagerGraphs, _Graph
from moe_ref.ep.device_checks import DeferredChecks, DeviceChecks
from moe_ref.ep.options import EPOptions
from moe_ref.layer import MegaMoE

pytestmark = pytest.mark.unit


class _ReplayByRunning:
    """A stand-in for a captured CUDA graph: a replay runs the work again on the graph's input, into its outputs."""

    def __init__(self, work, x_TD, y_TD, checks):
        self.work, self.x_TD, self.y_TD, self.checks = work, x_TD, y_TD, checks

    def replay(self):
        y_TD, checks = self.work(self.x_TD)
        self.y_TD.copy_(y_TD)
        self.checks.stacked().copy_(checks.stacked())


def _fake_capture(self, x_TD, step, work):
    x_static = torch.empty_like(x_TD)
    y_TD, checks = work(x_static)
    self.captures += 1
    self._graphs[x_TD.shape[0]] = graph = _Graph(_ReplayByRunning(work, x_static, y_TD, checks), x_static, y_TD, checks)
    return graph


@pytest.fixture
def graphs(monkeypatch):
    monkeypatch.setattr(EagerGraphs, "_capture", _fake_capture)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return EagerGraphs(max_tokens=8, device=torch.device("cpu"))


def _step():
    return types.SimpleNamespace(calls=0, deferred_checks=DeferredChecks())


def _work(log):
    """y = 2x; its one check flags a NaN in x."""
    def work(x_TD):
        log.append(x_TD.shape[0])
        checks = DeviceChecks()
        checks.add(torch.isnan(x_TD).any(), lambda: NonFiniteError("nan in x"))
        return 2 * x_TD, checks
    return work


def test_a_token_count_is_captured_on_its_second_call_and_replayed_after(graphs):
    step, log = _step(), []
    x = torch.arange(6.0).view(3, 2)
    assert graphs(x, step, _work(log)) is None  # first call: the eager path runs (and compiles) it
    assert graphs.captures == 0 and step.calls == 0
    for call in range(3):
        y = graphs(x + call, step, _work(log))
        assert torch.equal(y, 2 * (x + call))
    assert graphs.captures == 1 and len(graphs) == 1 and step.calls == 3
    y_before = y.clone()
    graphs(x + 10, step, _work(log))
    assert torch.equal(y, y_before), "a replay's output is a clone, not the graph's buffer"


def test_a_check_failed_in_a_replay_is_raised_by_the_next_call(graphs):
    step = _step()
    x = torch.ones(2, 2)
    graphs(x, step, _work([]))
    graphs(x, step, _work([]))
    bad = x.clone()
    bad[1, 1] = float("nan")
    graphs(bad, step, _work([]))  # returns: its flags wait for the next call
    with pytest.raises(NonFiniteError, match="nan in x"):
        graphs(x, step, _work([]))
    assert torch.equal(graphs(x, step, _work([])), 2 * x)


def test_calls_outside_the_bounds_are_not_covered(graphs):
    assert not graphs.covers(torch.zeros(0, 2), None)
    assert not graphs.covers(torch.zeros(9, 2), None)
    assert graphs.covers(torch.zeros(8, 2), None)
    assert not graphs.covers(torch.zeros(8, 2), max_num_tokens=4)  # the eager path raises its ShapeError


def test_the_least_recently_used_graph_goes(graphs, monkeypatch):
    monkeypatch.setattr(eager_graphs, "MAX_GRAPHS", 2)
    step = _step()
    for num_tokens in (1, 2, 1, 3):  # 1 used again after 2: 2 is the one to go
        x = torch.ones(num_tokens, 2)
        graphs(x, step, _work([]))
        graphs(x, step, _work([]))
    assert sorted(graphs._graphs) == [1, 3]
    graphs.clear()
    assert len(graphs) == 0 and graphs(torch.ones(1, 2), step, _work([])) is None  # seen again from scratch


def test_a_failed_capture_leaves_the_layer_eager(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    class _Refusing:
        def capture_begin(self, pool=None):
            raise RuntimeError("operation not permitted when stream is capturing")

    fake_stream = types.SimpleNamespace(wait_stream=lambda other: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Refusing)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: fake_stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: torch.no_grad())
    monkeypatch.setattr(eager_graphs, "_capture_stream", lambda device: fake_stream)
    monkeypatch.setattr(eager_graphs, "_pool", lambda device: None)
    graphs, step = EagerGraphs(max_tokens=8, device=torch.device("cpu")), _step()
    step.calls = 5
    x = torch.ones(2, 2)
    with caplog.at_level(logging.WARNING, logger="moe_ref.eager_graphs"):
        for _ in range(3):
            assert graphs(x, step, _work([])) is None
    assert graphs.captures == 0 and step.calls == 5
    assert "operation not permitted" in graphs.failure
    assert not graphs.covers(torch.ones(3, 2), None)  # every token count stays eager after a failed capture
    assert sum("stay on the eager path" in r.getMessage() for r in caplog.records) == 1


def test_the_option_defaults_to_1024_within_the_cap_and_is_checked(monkeypatch):
    assert EPOptions.resolve().eager_graph_max_tokens == 1024
    assert EPOptions.resolve(num_max_tokens_per_rank=64).eager_graph_max_tokens == 64
    assert EPOptions.resolve(eager_graph_max_tokens=0).eager_graph_max_tokens == 0
    monkeypatch.setenv("MOE_REF_EAGER_GRAPH_MAX_TOKENS", "16")
    options = EPOptions.resolve()
    assert options.eager_graph_max_tokens == 16
    assert options.source["eager_graph_max_tokens"] == "MOE_REF_EAGER_GRAPH_MAX_TOKENS"
    monkeypatch.setenv("MOE_REF_EAGER_GRAPH_MAX_TOKENS", "many")
    with pytest.raises(InvalidConfigError, match="MOE_REF_EAGER_GRAPH_MAX_TOKENS='many' is not an integer"):
        EPOptions.resolve()
    monkeypatch.delenv("MOE_REF_EAGER_GRAPH_MAX_TOKENS")
    for bad in (-1, 65, True, 2.0):
        with pytest.raises(InvalidConfigError, match="eager_graph_max_tokens"):
            EPOptions.resolve(num_max_tokens_per_rank=64, eager_graph_max_tokens=bad)


def test_a_cpu_layer_has_no_eager_graphs():
    moe = MegaMoE("tiny-kimi-k2", None, num_max_tokens_per_rank=16, seed=0)
    with torch.no_grad():
        for _ in range(3):
            moe(torch.randn(4, moe.cfg.hidden_size))
    assert moe.eager_graphs is None
    moe.destroy()


def test_warm_up_counts_cover_every_rows_bucket_and_each_specialization_of_t():
    from moe_ref.layer.runtime import WARM_UP_MAX_TOKENS, warm_up_counts

    assert warm_up_counts(1) == [1]
    assert warm_up_counts(2) == [1, 2]
    assert warm_up_counts(6) == [1, 2, 3, 4]
    assert warm_up_counts(512) == [1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 512]
    assert warm_up_counts(1 << 20)[-1] == WARM_UP_MAX_TOKENS


def test_no_warm_up_on_the_cpu():
    """The warm-up runs only where calls have no collective on CUDA: a CPU layer's first call runs its own tokens."""
    from moe_ref import MegaMoE

    moe = MegaMoE("tiny-kimi-k2", seed=0, dtype=torch.float32, num_max_tokens_per_rank=32)
    seen = []
    device_work = moe._device_work
    moe._device_work = lambda x_TD, *args, **kwargs: (seen.append(x_TD.shape[0]), device_work(x_TD, *args,
                                                                                                **kwargs))[1]
    with torch.no_grad():
        moe(torch.randn(5, moe.cfg.hidden_size))
    assert seen == [5] and moe._warm and moe.routed_step.calls == 1


def test_graph_memory_counts_the_pool_of_its_device_and_the_io_buffers(monkeypatch):
    """``graph_memory``: the allocator snapshot's segments of the graphs' pool on that device (not another pool's or
    device's), the I/O buffers of that device; None where the snapshot has no pool ids; the repr line built on it."""
    device = torch.device("cuda", 0)
    x = torch.empty(8, 16, dtype=torch.bfloat16)
    monkeypatch.setattr(eager_graphs, "_IO_BUFFERS", {(device, torch.bfloat16, 16, 8): (x, x),
                                                      (torch.device("cuda", 1), torch.bfloat16, 16, 8): (x, x)})
    monkeypatch.setattr(eager_graphs, "_POOLS", {device: (0, 7)})
    monkeypatch.setattr(eager_graphs, "_LIVE_GRAPHS", {device: 2})
    segments = [{"device": 0, "segment_pool_id": (0, 7), "total_size": 3 << 20},
                {"device": 0, "segment_pool_id": (0, 7), "total_size": 1 << 20},
                {"device": 0, "segment_pool_id": (0, 0), "total_size": 64 << 20},
                {"device": 1, "segment_pool_id": (0, 7), "total_size": 8 << 20}]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    assert eager_graphs.graph_memory(device) == {"graphs": 2, "pool_bytes": 4 << 20, "io_bytes": 512}
    assert EagerGraphs(8, device).describe() == ("eager graphs 0 (at most 32, T <= 8); the device's graphs: 2, "
                                                 "pool 4.0 MiB, I/O buffers 0.0 MiB")

    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: [{"device": 0, "total_size": 1}])  # no pool ids
    assert eager_graphs.graph_memory(device)["pool_bytes"] is None
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: (_ for _ in ()).throw(RuntimeError("no snapshot")))
    assert eager_graphs.graph_memory(device)["pool_bytes"] is None
    assert "pool unknown" in EagerGraphs(8, device).describe()
    monkeypatch.setattr(eager_graphs, "_LIVE_GRAPHS", {})
    assert eager_graphs.graph_memory(device) == {"graphs": 0, "pool_bytes": 0, "io_bytes": 512}
