"""``moe-ref bench`` on the conformance harness: speed cases named by id (``<shape>/<recipe>/T<n>``) that conform
runs again from a REPRO, the cap a speed case builds for, the implementations it picks, and a FAIL that exits 1."""
import pytest

from moe_ref.conformance import registered
from moe_ref.conformance.bench import NOT_BENCHED, table
from moe_ref.conformance.cli import run as run_conform
from moe_ref.conformance.runner import case_cap, skip_reason
from moe_ref.conformance.scenarios import SHAPES, case_by_id, rank_inputs, speed_case, tokens_per_rank
from moe_ref.core.config import preset
from moe_ref.core.errors import ConformanceLedgerError
from moe_ref.tools import cli

pytestmark = pytest.mark.unit


def test_a_speed_case_round_trips_through_its_id_and_a_matrix_id_stays_the_matrix_case():
    case = speed_case("tiny128", "bf16", "int4", 200, seed=3)
    assert case.id == "tiny128/bf16-int4/T200"
    assert case_by_id(case.id, seed=3) == case
    assert tokens_per_rank(case, 4, 160, 16) == [200] * 4
    ids_TK = rank_inputs(case, 1, None, 16)[0][1]
    assert ids_TK.shape == (200, 3) and bool((ids_TK >= 0).all())  # routed as base: no masked slot
    assert case_by_id("tiny/fp32/base").scenario == "base" and case_by_id("tiny/fp32/base").seed < 999


def test_a_preset_share_is_a_shape_and_a_bad_one_is_cfg029():
    cfg = preset("deepseek-v3")
    shape = speed_case("deepseek-v3@ep16", "bf16", "none", 8).shape
    assert (shape.experts_per_rank, shape.topk, shape.hidden, shape.intermediate, shape.cuda_only) == \
        (cfg.num_experts // 16, cfg.num_topk, cfg.expert_hidden_size, cfg.intermediate_size, True)
    assert not speed_case("tiny-kimi-k2@ep2", "fp32", "none", 8).shape.cuda_only
    for bad, words in (("kimi-k2@ep7", "does not divide"), ("nope@ep2", "not one of"), ("tiny", None)):
        if words is None:
            assert speed_case(bad, "fp32", "none", 1).shape == SHAPES["tiny"]
            continue
        with pytest.raises(ConformanceLedgerError, match=words):
            speed_case(bad, "fp32", "none", 8)
    for bad in ("tiny/fp32/T", "tiny/fp32/Tx", "tiny/fp32/base/T4", "tiny/fp99/T4"):
        with pytest.raises(ConformanceLedgerError):
            case_by_id(bad)


def test_a_speed_case_above_the_cap_builds_for_its_t_or_skips_where_the_cap_is_fixed():
    moe_ref_impl, fixed = registered()["moe_ref/torch"], registered()["correct"]
    big = speed_case("tiny", "fp32", "none", 500)
    assert case_cap(moe_ref_impl.caps, big) == 500 and skip_reason(moe_ref_impl, big, 1, "cpu") is None
    assert "T above max_tokens_per_rank" in skip_reason(fixed, big, 1, "cpu")
    small = speed_case("tiny", "fp32", "none", 5)
    assert case_cap(moe_ref_impl.caps, small) == moe_ref_impl.caps.max_tokens_per_rank
    assert skip_reason(fixed, small, 1, "cpu") is None


def test_the_table_orders_by_t_then_time_and_marks_the_fastest():
    def rec(impl, t, us, status="PASS"):
        return {"impl": impl, "ranks": 1, "case": f"tiny/fp32/T{t}", "status": status, "us": us,
                "TFLOP/s": 1.0 if us else None, "GB/s": 2.0 if us else None, "reason": "" if us else "why"}
    text = table([rec("b", 96, 30.0), rec("a", 96, 10.0), rec("a", 24, 5.0), rec("c", 24, None, "SKIP")])
    rows = [line.split(" | ")[0].strip("| ") for line in text.splitlines()[2:]]
    assert rows == ["a@1", "c@1", "a@1", "b@1"]
    assert "| 3.00 |" in text and text.count("| 1.00 |") == 2 and "SKIP: why" in text


def test_bench_on_cpu_checks_then_times_every_moe_ref_backend_and_no_harness_internal(capsys):
    status = cli.main(["bench", "--tokens", "3,170"])  # 170 > the adapters' matrix cap (160): built for 170
    out, err = capsys.readouterr()
    assert status == 0, err
    rows = [line for line in out.splitlines() if line.startswith("| moe_ref/")]
    for name in ("moe_ref/torch@1", "moe_ref/torch+chunk@1", "moe_ref/torch+invariant@1"):
        assert sum(f"| {name} | " in line and "| PASS |" in line for line in rows) == 2, out
    assert not any(name in out for name in NOT_BENCHED), out
    assert "tiny/fp32 (4 experts per rank, top-3, D 64, F 32) at T 3, 170" in out


def test_a_failing_implementation_exits_1_and_its_repro_fails_again_in_conform(capsys):
    status = cli.main(["bench", "--impl", "mutant:segment_offset", "--tokens", "12"])
    out, err = capsys.readouterr()
    assert status == 1 and "| FAIL: oracle" in out, out
    repro = next(line for line in err.splitlines() if "REPRO:" in line).split("REPRO: ", 1)[1]
    assert "--cases 'tiny/fp32/T12'" in repro
    argv = [word.strip("'") for word in repro.split()[2:]]  # past "moe-ref conform"
    run_conform(cli.build_parser().parse_args(["conform", *argv]))  # (conform exits 0 on a mutant's FAIL)
    assert "0 PASS, 1 FAIL" in capsys.readouterr().out


def test_a_shape_nothing_here_runs_is_cfg028_saying_why(capsys):
    status = cli.main(["bench", "--shape", "kimi-k2", "--device", "cpu", "--tokens", "4"])
    err = capsys.readouterr().err
    assert status == 2 and "[CFG028]" in err and "a real model's shape: CUDA only" in err


def test_bench_of_the_transports_times_dispatch_and_combine_at_two_ranks_above_the_matrix_cap(capsys):
    status = cli.main(["bench", "--kind", "dispatch", "--ranks", "2", "--tokens", "200"])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert "| implementation | T | status | us | GB/s | x fastest |" in out  # no FLOPs in a dispatch
    for transport in ("symm", "a2a"):
        assert f"| moe_ref/dispatch/{transport}@2 | 200 | PASS |" in out, out


class _TunedToy:
    """moe_ref's torch step, times ``scale``, which ``tune`` sets: a tuning that breaks the result must FAIL."""

    def __init__(self, problem, tuned_scale: float, tunes: list):
        self.inner = registered()["moe_ref/torch"].factory(problem)
        self.scale, self.tuned_scale, self.tunes = 1.0, tuned_scale, tunes

    def __call__(self, x_TD, topk_ids_TK, topk_weights_TK, out_TD):
        self.inner(x_TD, topk_ids_TK, topk_weights_TK, out_TD)
        out_TD.mul_(self.scale)

    def tune(self, x_TD, topk_ids_TK, topk_weights_TK):
        self.tunes.append(tuple(x_TD.shape))
        self.scale = self.tuned_scale
        x_TD.mul_(2.0)  # a tuner may scribble on what it is given: the checks' inputs are not these


@pytest.mark.parametrize("tuned_scale, status", [(1.0, "PASS"), (1.5, "FAIL")])
def test_a_speed_case_tunes_first_and_its_checks_check_the_tuned_implementation(tuned_scale, status):
    import dataclasses

    import torch

    from moe_ref.conformance.runner import run_case

    torch_step = registered()["moe_ref/torch"]
    tunes = []
    impl = dataclasses.replace(torch_step, name="toy+tuned",
                               factory=lambda problem: _TunedToy(problem, tuned_scale, tunes))
    verdict = run_case(impl, speed_case("tiny", "fp32", "none", 12), 0, 1, None, torch.device("cpu"), timer="events")
    assert verdict.status() == status, verdict.failed
    assert tunes == [(12, 64)] and verdict.tune_s is not None and verdict.tune_s >= 0
    assert (verdict.us is not None) == (status == "PASS")  # a FAIL has no time
    if status == "FAIL":
        assert "oracle" in verdict.failed
    matrix = run_case(impl, case_by_id("tiny/fp32/base"), 0, 1, None, torch.device("cpu"))
    assert len(tunes) == 1 and matrix.tune_s is None  # a matrix case is never tuned


def test_the_tuned_peers_are_benched_only_when_asked():
    from moe_ref.conformance.bench import COMPARED_KINDS, default_impls

    cases = [speed_case("kimi-k2", "bf16", "none", 16)]
    plain = default_impls(cases, 1, "cuda", COMPARED_KINDS["moe"])
    tuned = default_impls(cases, 1, "cuda", COMPARED_KINDS["moe"], tuned=True)
    assert {"peer:sglang", "peer:vllm"} <= set(plain) and not any(name.endswith("+tuned") for name in plain)
    assert set(tuned) - set(plain) == {"peer:sglang+tuned", "peer:vllm+tuned"}


def test_the_timers_other_than_the_wall_clock_are_cuda_only_and_graph_times_only_graph_safe_ones(capsys):
    from moe_ref.conformance.bench import _timer_skip

    for timer in ("graph", "kernels"):
        status = cli.main(["bench", "--device", "cpu", "--tokens", "4", "--timer", timer])
        err = capsys.readouterr().err
        assert status == 2 and "[ENV006]" in err and f"--timer {timer}" in err, err
    status = cli.main(["bench", "--auto-table", "--timer", "kernels"])
    assert status == 2 and "[CFG015]" in capsys.readouterr().err
    impls = registered()
    assert "graph_safe" in _timer_skip(impls["correct"], "graph")  # the harness's own base declares no capture
    graph_safe = [impl for impl in impls.values() if impl.caps.graph_safe]
    assert graph_safe and all(_timer_skip(impl, "graph") is None for impl in graph_safe)
    assert _timer_skip(impls["correct"], "events") is None and _timer_skip(impls["correct"], "kernels") is None


def test_the_roofline_column_is_the_larger_of_the_bandwidth_and_compute_fractions():
    from moe_ref.conformance.bench import roofline

    anchors = {"hbm_bytes_per_s": 3e12, "bf16_flops_per_s": 800e12}
    timed = {"GB/s": 1500.0, "TFLOP/s": 300.0}
    assert roofline(timed, anchors, fp8=False) == pytest.approx(0.5)  # bandwidth: 1500 / 3000
    assert roofline({"GB/s": 300.0, "TFLOP/s": 600.0}, anchors, fp8=False) == pytest.approx(0.75)
    assert roofline({"GB/s": 300.0, "TFLOP/s": 600.0}, anchors, fp8=True) == pytest.approx(0.375)  # peak doubled
    from moe_ref.bench.timing import roofline_s  # the one formula, also bench_experts' (expert_report.case_metrics)
    assert roofline_s(3e9, 4e11, anchors) == (pytest.approx(1e-3), "memory")
    assert roofline_s(3e9, 4e12, anchors)[1] == "compute"

    def rec(t, us, roof):
        return {"impl": "a", "ranks": 1, "case": f"kimi-k2/bf16/T{t}", "status": "PASS", "us": us, "TFLOP/s": 1.0,
                "GB/s": 2.0, "reason": "", "roofline": roof}
    text = table([rec(16, 10.0, 0.42), rec(128, 20.0, None)])
    assert "| implementation | T | status | us | TFLOP/s | GB/s | roofline | x fastest |" in text
    assert "| a@1 | 16 | PASS | 10.0 | 1 | 2 | 0.42 | 1.00 |" in text and "| 2 | - | 1.00 |" in text
    assert "roofline" not in table([rec(16, 10.0, None)])  # a CPU run: no anchors, no column
