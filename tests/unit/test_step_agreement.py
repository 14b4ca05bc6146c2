"""Every rank at the same call of the same layer: the stamps of the per-call agreement, the call counter a call out of
step leaves alone, the layer index in the options, failed collectives told apart (a peer that died vs one that
never came), and the transport registry the options and the factory read. One process; the multi-rank cases are in
tests/dist/test_faults.py."""
from __future__ import annotations

import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from moe_ref.core.config import preset
from moe_ref.core.errors import (GroupTimeoutError, InvalidConfigError, PeerFailedError, StepBuiltOnSomeRanksError,
                                 StepOutOfSyncError, UnknownNameError, explain)
from moe_ref.core.weights import MoEWeights
from moe_ref.ep import distributed
from moe_ref.ep.dispatch import Dispatcher
from moe_ref.ep.options import TRANSPORTS, EPOptions
from moe_ref.ep.overflow import OverflowPolicy, check_same_call
from moe_ref.ep.routed_step import make_modular_step
from moe_ref.ep.transport import make_dispatcher
from moe_ref.experts import make_experts

pytestmark = pytest.mark.unit


# --- the stamps: [layer index or -1, building, call] per rank ------------------------------------------------------

def test_ranks_at_the_same_call_of_the_same_layer_pass():
    check_same_call([[2, 0, 5], [2, 0, 5], [2, 0, 5]], rank=1)
    check_same_call([[2, 1, 0], [2, 1, 0]], rank=0)  # every rank builds the step together


@pytest.mark.parametrize("stamps, named", [
    ([[0, 0, 3], [1, 0, 3]], ["rank 0: layer 0 call #3", "rank 1: layer 1 call #3"]),  # crossed layers, same count
    ([[0, 1, 0], [1, 1, 0]], ["rank 0: layer 0 (building", "rank 1: layer 1 (building"]),  # crossed at first call
    ([[0, 0, 1], [1, 1, 0]], ["rank 0: layer 0 call #1", "rank 1: layer 1 (building"]),  # one rank's first call of B
    ([[4, 0, 7], [4, 0, 6]], ["rank 0: layer 4 call #7", "rank 1: layer 4 call #6"]),  # one layer, counts differ
    ([[-1, 0, 2], [-1, 1, 0]], ["rank 0: a layer without an index call #2", "rank 1: a layer without an index"]),
])
def test_ranks_out_of_step_raise_env004_naming_each_rank_layer_and_call(stamps, named):
    for rank in range(len(stamps)):
        with pytest.raises(StepOutOfSyncError) as info:
            check_same_call(stamps, rank)
        err = info.value
        assert type(err) is StepOutOfSyncError and err.code == "ENV004", f"{stamps=} {rank=}: {err}"
        assert isinstance(err, RuntimeError)
        for needle in (f"rank {rank}:", *named, "No row moved and no rank counted this call"):
            assert needle in err.message, f"{stamps=} {rank=} {needle=}: {err.message}"
        assert err.details["layers"] == [s[0] for s in stamps]


def test_a_step_built_again_on_some_ranks_only_is_env017_on_every_rank():
    stamps = [[3, 0, 9], [3, 1, 0], [3, 0, 9], [3, 1, 0]]
    for rank in range(4):
        with pytest.raises(StepBuiltOnSomeRanksError) as info:
            check_same_call(stamps, rank)
        err = info.value
        assert err.code == "ENV017" and isinstance(err, StepOutOfSyncError), err
        for needle in (f"rank {rank}:", "ranks 1, 3 build the routed step of layer 3", "rank 0: layer 3 call #9",
                       "destroy() was called on some ranks only", "call destroy() on every rank"):
            assert needle in err.message, (needle, err.message)


def test_the_stamp_carries_the_layer_index_or_minus_one():
    assert OverflowPolicy(8, "error", lambda cap: 0, layer_index=5).stamp(12) == [5, 0, 12]
    assert OverflowPolicy(8, "error", lambda cap: 0).stamp(0, building=True) == [-1, 1, 0]


# --- the call counter: a call out of step is counted on no rank ----------------------------------------------------

def _step(layer_index: int | None = 0):
    cfg = preset("tiny-kimi-k2")
    weights = MoEWeights.random(cfg, seed=1)
    experts = make_experts("torch", weights.gate_up_weight_E2FD, weights.down_weight_EDF, cfg.activation,
                           cfg.situ_beta, cfg.situ_linear_beta)
    options = EPOptions.resolve(num_max_tokens_per_rank=8, transport="symm", layer_index=layer_index)
    return cfg, make_modular_step(cfg, None, experts, options)


def test_a_call_out_of_step_is_not_counted_and_a_call_that_timed_out_is(monkeypatch):
    cfg, step = _step()
    x, ids, w = torch.randn(3, cfg.hidden_size), torch.tensor([[0, 1, 2, 3]] * 3), torch.rand(3, 4)
    with step:
        step(x, ids, w)
        assert step.calls == 1 and step.policy.layer_index == 0

        def out_of_step(*args, **kwargs):
            raise StepOutOfSyncError("another rank called another layer")
        monkeypatch.setattr(step.policy.__class__, "agree", out_of_step)
        with pytest.raises(StepOutOfSyncError):
            step(x, ids, w)
        assert step.calls == 1, "a call the group found out of step was counted"

        def timed_out(*args, **kwargs):
            raise GroupTimeoutError("a peer never came")
        monkeypatch.setattr(step.policy.__class__, "agree", timed_out)
        with pytest.raises(GroupTimeoutError):
            step(x, ids, w)
        assert step.calls == 2, "a call this rank made (its peer never came) must stay counted"


# --- the layer index in the options --------------------------------------------------------------------------------

def test_the_layer_index_is_an_agreed_option():
    assert EPOptions.resolve().layer_index is None
    options = EPOptions.resolve(layer_index=3)
    assert options.layer_index == 3 and options.fingerprint()["layer_index"] == "3"
    for bad in (-1, True, 1.0, "2"):
        with pytest.raises(InvalidConfigError, match="layer_index"):
            EPOptions.resolve(layer_index=bad)


def test_layer_indices_count_the_layers_built_on_each_group():
    first = SimpleNamespace(group_name="index-test-a")
    second = SimpleNamespace(group_name="index-test-b")
    assert [distributed.claim_layer_index(first) for _ in range(3)] == [0, 1, 2]
    assert distributed.claim_layer_index(second) == 0
    assert distributed.claim_layer_index(first) == 3


# --- failed collectives: a peer that died (ENV005) or one that never came (ENV018) ----------------------------------

def _fake_group(seconds: float):
    backend = SimpleNamespace(options=SimpleNamespace(_timeout=timedelta(seconds=seconds)))
    return SimpleNamespace(_get_backend=lambda device: backend)


def test_the_group_timeout_is_read_from_the_group():
    assert distributed.group_timeout(None) is None
    assert distributed.group_timeout(_fake_group(7)) == timedelta(seconds=7)


def test_a_collective_that_timed_out_is_env018_naming_the_group_timeout():
    with pytest.raises(GroupTimeoutError) as info:
        with distributed.peer_errors("rank 0's per-call agreement (layer 2 call #5)", _fake_group(3)):
            raise RuntimeError("[pair.cc:553] Timed out waiting 3000ms for recv operation to complete")
    err = info.value
    assert err.code == "ENV018" and isinstance(err, RuntimeError)
    for needle in ("rank 0's per-call agreement (layer 2 call #5)", "the EP group's timeout is 3 s",
                   "did not make this call", "timeout=timedelta(seconds=N)", "rebuild the process group"):
        assert needle in err.message, (needle, err.message)
    assert err.details["timeout_s"] == 3


def test_a_connection_closed_after_waiting_half_the_timeout_is_env018_and_at_once_env005():
    # a peer whose own wait ran out closes its connections: its neighbours see "closed" near the timeout
    with pytest.raises(GroupTimeoutError):
        with distributed.peer_errors("the agreement", _fake_group(0.04)):
            time.sleep(0.03)
            raise RuntimeError("Connection closed by peer [127.0.0.1]:5511")
    with pytest.raises(PeerFailedError, match=r"\[ENV005\].*died or left"):  # a dead peer: no wait before it
        with distributed.peer_errors("the agreement", _fake_group(60)):
            raise RuntimeError("Connection closed by peer [127.0.0.1]:5511")


def test_env004_explains_what_raises_it_now():
    text = explain("ENV004")
    for needle in ("the layer's index", "different orders", "MTP layer", "counted on no rank"):
        assert needle in text, (needle, text)
    assert "catches an exception raised by its own code before moe(x)" not in text  # a scenario that gives ENV018


# --- the transport registry: one list for the options, the factory and the command line -----------------------------

def test_every_registered_transport_is_accepted_and_built():
    cfg = preset("tiny-kimi-k2")
    for name, transport in TRANSPORTS.items():
        options = EPOptions.resolve(num_max_tokens_per_rank=4, transport=name)
        assert options.transport == name
        dispatcher = make_dispatcher(cfg, None, options)  # one rank: every name runs as local
        try:
            assert isinstance(dispatcher, Dispatcher) and dispatcher.transport_name == "local", name
        finally:
            dispatcher.destroy()
        assert transport.summary and (transport.dispatcher is None) == (name == "auto"), name


def test_an_unknown_transport_lists_the_registry():
    with pytest.raises(UnknownNameError) as info:
        EPOptions.resolve(transport="nvlink")
    assert f"supported: {', '.join(TRANSPORTS)}" in str(info.value)
