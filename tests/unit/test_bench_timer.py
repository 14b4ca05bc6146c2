"""``moe_ref.testing.bench`` and ``sync_debug_mode`` on a stand-in CUDA. bench: by default every timed call starts
on an idle GPU (a sync after each); with ``host_ahead`` the calls are queued back to back and the host syncs once,
after the last. sync_debug_mode: the previous mode comes back, also after an exception."""
from __future__ import annotations

import pytest
import torch

from moe_ref import testing

pytestmark = pytest.mark.unit


class _Event:
    def __init__(self, enable_timing=False):
        self.at = None

    def record(self):
        self.at = _log.count("call")

    def elapsed_time(self, end):  # ms: one per call between the two events
        return float(end.at - self.at)


_log: list[str] = []


@pytest.mark.parametrize("host_ahead, syncs", [(False, 1 + 7 + 1), (True, 1 + 1)])
def test_host_ahead_queues_the_timed_calls_without_a_sync_between_them(monkeypatch, host_ahead, syncs):
    _log.clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: _log.append("sync"))
    us = testing.bench(lambda: _log.append("call"), warmup=2, iters=7, flush_l2=False, host_ahead=host_ahead)
    assert _log.count("call") == 9 and _log.count("sync") == syncs
    assert us == 1000.0  # each call's own events: 1 ms


def test_sync_debug_mode_restores_the_previous_mode_also_after_an_exception(monkeypatch):
    modes = [1]  # the current mode, as torch keeps it ("warn")
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: modes[-1])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    with testing.sync_debug_mode("error"):
        assert modes[-1] == "error"
    assert modes[-1] == 1
    with pytest.raises(RuntimeError), testing.sync_debug_mode("error"):
        raise RuntimeError("a call that synchronized")
    assert modes[-1] == 1
