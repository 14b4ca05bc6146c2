"""Device-side checks read with the per-call agreement: their flags, their order, and the routed step raising what
they found (a bad routing value, NaN logits in the layer, a failure recorded on the device in an earlier call)."""
from __future__ import annotations

import pytest
import torch

from moe_ref.core.config import preset
from moe_ref.ep.device_checks import MAX_CHECKS, DeferredChecks, DeviceChecks
from moe_ref.core.errors import ExpertIdError, NonFiniteError, PeerTimeoutError, ShapeError
from moe_ref.experts import make_experts
from moe_ref.kernels.ep.ep_regions import STATUS_PEER_TIMEOUT
from moe_ref.layer import MegaMoE
from moe_ref.ep.options import EPOptions
from moe_ref.ep.routed_step import make_modular_step
from moe_ref.core.weights import MoEWeights

pytestmark = pytest.mark.unit


def test_flags_are_padded_in_order_and_the_first_failure_is_described():
    checks = DeviceChecks()
    assert torch.equal(checks.flags(torch.device("cpu")), torch.zeros(MAX_CHECKS, dtype=torch.int64))
    checks.add(torch.tensor(False), lambda: ShapeError("first"))
    checks.add(torch.tensor([3], dtype=torch.int32), lambda: ExpertIdError("second"))
    checks.add(torch.tensor(1), lambda: NonFiniteError("third"))
    flags = checks.flags(torch.device("cpu"))
    assert flags.tolist() == [0, 3, 1] + [0] * (MAX_CHECKS - 3)
    assert isinstance(checks.problem(flags.tolist()), ExpertIdError)  # the first failed one, not the last
    assert checks.problem([0] * MAX_CHECKS) is None
    checks.add(torch.tensor(0), lambda: ShapeError("fourth"))
    with pytest.raises(ValueError, match=f"at most {MAX_CHECKS}"):
        checks.add(torch.tensor(0), lambda: ShapeError("fifth"))


def test_kernel_slots_and_copied_flags_share_one_vector_in_order():
    checks = DeviceChecks()
    assert checks.stacked() is None
    first = checks.slot(torch.device("cpu"), lambda: ShapeError("raised by a kernel"))
    checks.add(torch.tensor([7], dtype=torch.int64), lambda: ExpertIdError("copied"))
    third = checks.slot(torch.device("cpu"), lambda: NonFiniteError("raised later"))
    vector = checks.stacked()
    assert vector.dtype == torch.int32 and vector.tolist() == [0, 7, 0, 0]
    third.fill_(1)  # what a kernel does to its slot
    first.fill_(1)
    assert vector.tolist() == [1, 7, 1, 0]  # the slots are views of the one vector
    assert isinstance(checks.problem(checks.flags(torch.device("cpu")).tolist()), ShapeError)


def _step(cfg, weights):
    experts = make_experts("torch", weights.gate_up_weight_E2FD, weights.down_weight_EDF, cfg.activation,
                           cfg.situ_beta, cfg.situ_linear_beta)
    return make_modular_step(cfg, None, experts, EPOptions.resolve(num_max_tokens_per_rank=8, transport="symm"))


def test_a_failure_recorded_on_the_device_is_raised_by_the_next_call():
    cfg = preset("tiny-kimi-k2")
    weights = MoEWeights.random(cfg, seed=1)
    x = torch.randn(4, cfg.hidden_size)
    ids = torch.tensor([[0, 1, 2, 3]] * 4)
    w = torch.rand(4, 4)
    with _step(cfg, weights) as step:
        good = step(x, ids, w)
        status = step.dispatcher.buffer.view("status")
        status[0], status[1] = STATUS_PEER_TIMEOUT, 7  # what a wait that timed out writes (epoch 7)
        exchange = step.dispatcher._pre_dispatch_and_exchange

        def must_not_run(*args):
            raise AssertionError("rows moved: the recorded failure was not raised by the agreement")

        step.dispatcher._pre_dispatch_and_exchange = must_not_run
        with pytest.raises(PeerTimeoutError, match=r"\[ENV010\].*epoch 7"):
            step(x, ids, w)
        step.dispatcher._pre_dispatch_and_exchange = exchange
        status.zero_()
        assert torch.equal(step(x, ids, w), good)


def test_the_caller_device_checks_come_first_and_the_layer_reports_nan_logits():
    cfg = preset("tiny-kimi-k2")
    weights = MoEWeights.random(cfg, seed=2)
    x = torch.randn(4, cfg.hidden_size)
    with _step(cfg, weights) as step:
        checks = DeviceChecks()
        checks.add(torch.tensor(True), lambda: NonFiniteError("the caller's problem"))
        with pytest.raises(NonFiniteError, match="the caller's problem"):  # before the bad id, which comes later
            step(x, torch.tensor([[0, 1, 2, 99]] * 4), torch.rand(4, 4), device_checks=checks)
    layer = MegaMoE(cfg, None, num_max_tokens_per_rank=8, seed=3)
    bad = x.clone()
    bad[2, 0] = float("nan")
    with torch.no_grad(), pytest.raises(NonFiniteError, match=r"router logits are NaN/inf for 1 of 4 tokens.*\[2\]"):
        layer(bad)
    with torch.no_grad():
        assert layer(x).shape == x.shape  # the layer goes on after the refused call


def test_deferred_checks_raise_the_first_failure_later_and_forget_the_rest():
    deferred = DeferredChecks()
    passed, failed = DeviceChecks(), DeviceChecks()
    passed.add(torch.tensor(False), lambda: ShapeError("never"))
    failed.add(torch.tensor(True), lambda: NonFiniteError("the second call's NaN"))
    deferred.record(passed, torch.device("cpu"))
    deferred.raise_pending()  # the first call passed: nothing raised, nothing left
    assert len(deferred) == 0
    deferred.record(failed, torch.device("cpu"))
    deferred.record(passed, torch.device("cpu"))
    with pytest.raises(NonFiniteError, match="the second call's NaN"):
        deferred.raise_pending()
    assert len(deferred) == 0  # raised once, not again by the next call
    deferred.raise_pending(wait=True)


def test_one_rank_with_deferred_checks_raises_a_bad_routing_value_in_the_next_call():
    """What one rank on CUDA does (no host sync per call), forced on the CPU: the bad call returns, rows of
    out-of-range ids are treated as masked, and the next call (or check()) raises the coded error."""
    cfg = preset("tiny-kimi-k2")
    weights = MoEWeights.random(cfg, seed=4)
    x = torch.randn(4, cfg.hidden_size)
    ids, bad_ids = torch.tensor([[0, 1, 2, 3]] * 4), torch.tensor([[0, 1, 2, 99]] * 4)
    w = torch.rand(4, 4)
    with _step(cfg, weights) as step:
        good = step(x, ids, w)
        step.deferred_checks = DeferredChecks()
        masked = step(x, bad_ids, w)  # no error yet
        assert masked.shape == good.shape and torch.isfinite(masked).all()
        with pytest.raises(ExpertIdError):
            step(x, ids, w)
        assert torch.equal(step(x, ids, w), good)  # raised once; the step goes on
        step(x, bad_ids, w)
        with pytest.raises(ExpertIdError):
            step.check()
        step.check()  # nothing left


def _layer_with_a_nan_input(row: int, col: int) -> tuple[MegaMoE, torch.Tensor, torch.Tensor]:
    """A one-rank layer, a good [4, D] input and a copy with one NaN at (row, col)."""
    cfg = preset("tiny-kimi-k2")
    layer = MegaMoE(cfg, None, num_max_tokens_per_rank=8, seed=3)
    x = torch.randn(4, cfg.hidden_size)
    bad = x.clone()
    bad[row, col] = float("nan")
    return layer, x, bad


def test_the_layer_check_raises_nan_logits_of_an_earlier_call_when_checks_are_deferred():
    layer, x, bad = _layer_with_a_nan_input(1, 0)
    with torch.no_grad():
        layer.check()  # no call yet: nothing to raise
        layer(x)
        layer.routed_step.deferred_checks = DeferredChecks()
        layer(bad)
        with pytest.raises(NonFiniteError, match=r"router logits are NaN/inf for 1 of 4 tokens"):
            layer.check()
        assert layer(x).shape == x.shape


def test_debug_checks_name_non_finite_expert_outputs():
    """With debug_checks, NaN from the experts is named as such, not as partials combine left unwritten."""
    cfg = preset("tiny-kimi-k2")
    weights = MoEWeights.random(cfg, seed=5)
    weights.down_weight_EDF[1].fill_(float("nan"))  # local expert 1 returns NaN rows
    experts = make_experts("torch", weights.gate_up_weight_E2FD, weights.down_weight_EDF, cfg.activation,
                           cfg.situ_beta, cfg.situ_linear_beta)
    options = EPOptions.resolve(num_max_tokens_per_rank=8, transport="symm", debug_checks=True)
    with make_modular_step(cfg, None, experts, options) as step:
        with pytest.raises(NonFiniteError, match=r"torch experts returned NaN/inf in 2 of 16 rows \(local experts \[1\]\)"):
            step(torch.randn(4, cfg.hidden_size), torch.tensor([[0, 1, 2, 3], [1, 2, 3, 4]] + [[2, 3, 4, 5]] * 2),
                 torch.rand(4, 4))


def test_a_flag_whose_exact_recheck_finds_nothing_does_not_hide_the_next_one():
    checks = DeviceChecks()
    checks.add(torch.tensor(True), lambda: None)  # a false alarm: its describe() re-checks and finds no problem
    checks.add(torch.tensor(True), lambda: ExpertIdError("the real one"))
    assert isinstance(checks.problem(checks.flags(torch.device("cpu")).tolist()), ExpertIdError)


@pytest.mark.parametrize("value, expected", [(float("inf"), NonFiniteError), (float("nan"), NonFiniteError),
                                             (3e38, None)])  # 3e38: large finite logits (their sum overflows)
def test_the_nan_logits_flag_and_its_exact_recheck(value, expected):
    from moe_ref.block import route_unchecked

    cfg = preset("tiny-kimi-k2")
    x = torch.zeros(4, cfg.hidden_size)
    x[:, 0] = value
    gate = torch.zeros(cfg.num_experts, cfg.hidden_size)
    gate[:, 0] = 1.0
    checks = DeviceChecks()
    route_unchecked(x, gate, cfg, torch.zeros(cfg.num_experts), device_checks=checks)
    flags = checks.flags(torch.device("cpu")).tolist()
    assert (flags[0] != 0) == (expected is not None)  # the flag is per logit: large finite ones do not raise it
    problem = checks.problem(flags)
    assert (problem is None) if expected is None else isinstance(problem, expected)


def test_the_compiled_op_reads_its_checks_in_the_call():
    """Inside torch.compile the layer's op keeps nothing for a later call (CUDA graphs' memory pools refuse tensors
    kept across calls): a NaN input raises in that call even where checks are otherwise deferred."""
    layer, x, bad = _layer_with_a_nan_input(0, 1)
    with torch.no_grad():
        layer(x)
        layer.routed_step.deferred_checks = DeferredChecks()
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        assert torch.equal(compiled(x), layer(x))
        with pytest.raises(NonFiniteError):
            compiled(bad)
        assert len(layer.routed_step.deferred_checks) == 0


def test_the_failure_agreement_raises_a_failed_device_check_or_lets_a_false_alarm_pass():
    from moe_ref.ep.distributed import agree_on_failure

    checks = DeviceChecks()
    checks.add(torch.tensor(0), lambda: ShapeError("never"))
    checks.add(torch.tensor(1), lambda: ExpertIdError("bad ids"))
    with pytest.raises(ExpertIdError, match="bad ids"):
        agree_on_failure(None, None, "cpu", device_checks=checks)
    false_alarm = DeviceChecks()
    false_alarm.add(torch.tensor(1), lambda: None)  # the exact re-check found nothing
    agree_on_failure(None, None, "cpu", device_checks=false_alarm)
    with pytest.raises(MemoryError):  # the rank's own failure comes first
        agree_on_failure(MemoryError("experts"), None, "cpu", device_checks=checks)
