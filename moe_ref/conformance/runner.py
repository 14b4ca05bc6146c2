"""One case on one rank: build the implementation for the case's ``Problem``, run it adversarially, return the
verdict. Every rank makes the same calls in the same order (the implementations under test are collective).

Checks, by kind (each names the planted bug it exists to catch; ``moe_ref.conformance.mutants``):

| check     | experts / routed_step                                                  | dispatch_combine                     |
|-----------|------------------------------------------------------------------------|--------------------------------------|
| poison    | the output buffer is NaN-filled first: a row left unwritten shows      | the same, for combine's output       |
| guard     | NaN rows past T in the same allocation stay NaN (no write outside)     | the same                             |
| oracle    | calc_diff and per-row max-abs against the float64 oracle (finite rows) | combine of a known expert function   |
| rerun     | a second call gives the same bits (``deterministic``)                  | the same                             |
| permute   | tokens deranged: each row as before (bitwise if ``batch_invariant``,   | -                                    |
|           | else against the oracle)                                               |                                      |
| alone     | one token alone per rank: its row as in the batch (likewise)           | -                                    |
| graph     | ``graph_safe``, a GPU, one rank: the call captured in a CUDA graph,    | -                                    |
|           | replayed on other routing (each live slot's expert id + 1: other       |                                      |
|           | segment sizes), equals an eager call there (bitwise if                 |                                      |
|           | ``deterministic``, else the oracle); a capture that raises FAILs       |                                      |
| overflow  | C + 1 rows: the declared error on every rank, or the chunked result    | -                                    |
| counts    | -                                                                      | rows per local expert, exactly       |
| payload   | -                                                                      | each received row is the sent row, bit for bit, and (rank, token) pairs exactly the routed ones (rank and token id ride in the last two columns) |

``pool_experts`` (the expert MLPs alone, on the pool ``scenarios.expert_pool`` builds, padding rows NaN): oracle
(each segment row against ``oracle.oracle_rows``), finite (no NaN/inf in a segment row: the padding read into it,
or a row never written), input (the pool's bytes unchanged by the call), rerun, permute (the rows rotated inside each
segment), alone (one row alone in the pool).

A speed case (``<shape>/<recipe>/T<n>``) first hands the built implementation's optional ``tune(x_TD, topk_ids_TK,
topk_weights_TK)`` (``pool_experts``: ``tune(pool)``) its inputs (an engine's offline tuning for one shape); the
checks then check what is timed.

Shape legend: T tokens of this rank, K top-k, E experts, e local experts, D hidden width, P receive-pool rows.
"""
from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from moe_ref.conformance.api import ExpertPool, Implementation, Problem
from moe_ref.conformance.oracle import compare, oracle_moe, oracle_rows
from moe_ref.conformance.scenarios import (Case, PooledRows, expert_pool, global_weights, local_weights,
                                          rank_inputs, rows_deranged_in_segments, speed_tokens, tokens_per_rank)

GUARD_ROWS = 4
SPEED_ITERS = 10
# how a speed case is timed (``moe-ref bench --timer``); graph and kernels need CUDA
TIMERS = {
    "events": "wall time of each call (CUDA events around it, L2 flushed before it; median): host work and launch "
              "gaps included",
    "graph": "the call captured once in a CUDA graph and replayed (CUDA events, L2 flushed; median): its GPU work "
             "without the host's; graph_safe implementations only",
    "kernels": "the GPU time of the kernels a call launches, summed (torch profiler, L2 flushed by a fill not "
               "counted; mean), as DeepGEMM's tests time their kernels: no host work, no launch gaps",
}


@dataclass
class Verdict:
    """One rank's outcome of one case: ``failed`` maps a check to why it failed (empty: PASS)."""

    failed: dict[str, str] = field(default_factory=dict)
    skip: str | None = None
    error: str | None = None
    us: float | None = None
    tune_s: float | None = None
    bytes: int = 0
    flops: int = 0
    kernels: dict[str, float] | None = None  # --timer kernels: us per call of each kernel

    def status(self) -> str:
        return "SKIP" if self.skip else "FAIL" if self.failed or self.error else "PASS"

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status(), "failed": self.failed, "skip": self.skip, "error": self.error,
                "us": self.us, "tune_s": self.tune_s, "bytes": self.bytes, "flops": self.flops,
                "kernels": self.kernels}


def skip_reason(impl: Implementation, case: Case, world: int, device: str) -> str | None:
    """Why ``impl`` does not run ``case`` at ``world`` ranks on ``device`` (its capabilities, then the shapes it
    refuses), or None."""
    caps, name = impl.caps, case.scenario
    why_not = impl.unavailable() if impl.unavailable is not None and device in caps.devices else None
    refused = impl.refuses(case.shape, world) if impl.refuses is not None else None
    reasons = [
        (case.shape.cuda_only and device != "cuda", "a real model's shape: CUDA only"),
        (device not in caps.devices, f"runs on {', '.join(caps.devices)}"),
        (why_not is not None, f"unavailable here: {why_not}"),
        (world not in caps.ep_sizes, f"ep_sizes {caps.ep_sizes}"),
        (case.dtype not in caps.dtypes, f"dtypes {caps.dtypes}"),
        (case.quant not in caps.quants, f"quants {caps.quants}"),
        (impl.kind == "dispatch_combine" and case.quant != "none", "dispatch moves activation rows: no weight recipe"),
        (name == "duplicates" and not caps.duplicate_experts, "duplicate_experts=False"),
        (name.startswith("mask") and name != "mask0" and not caps.masked_slots, "masked_slots=False"),
        (name in ("cap", "cap+1") and caps.max_tokens_per_rank is None, "no max_tokens_per_rank declared"),
        (name.startswith("tile") and impl.kind == "dispatch_combine", "tile edges are the experts' concern"),
        (name == "cap+1" and impl.kind in ("dispatch_combine", "pool_experts"), "the overflow policy is the routed "
                                                                                 "step's"),
        (not _fits(caps, case), f"T above max_tokens_per_rank {caps.max_tokens_per_rank}"),
        (refused is not None, f"refuses the shape: {refused}"),
    ]
    return next((why for hit, why in reasons if hit), None)


def _fits(caps, case: Case) -> bool:
    """A speed case's T is within the C it is built for (``case_cap``)."""
    tokens, cap = speed_tokens(case.scenario), case_cap(caps, case)
    return tokens is None or cap is None or tokens <= cap


def case_cap(caps, case: Case) -> int | None:
    """The C a case builds the implementation for: the declared one, raised to a speed case's T where the
    implementation builds for any C."""
    tokens = speed_tokens(case.scenario)
    if tokens is not None and caps.configurable_cap and caps.max_tokens_per_rank is not None:
        return max(caps.max_tokens_per_rank, tokens)
    return caps.max_tokens_per_rank


def run_case(impl: Implementation, case: Case, rank: int, world: int, group, device: torch.device,
             progress: Callable[[str], None] = lambda step: None, timer: str | None = None) -> Verdict:
    """Run ``case`` on this rank (collective over ``group``); an exception of the implementation is a FAIL.
    ``timer``: a key of ``TIMERS``: time the call after its checks pass (a speed case); None: checks only."""
    caps = impl.caps
    cap = case_cap(caps, case)
    inputs = rank_inputs(case, world, cap, caps.tile_rows)
    x_TD, ids_TK, w_TK = (t.to(device, copy=True) for t in inputs[rank])  # cached: the implementation gets a copy
    shape = case.shape
    weights = global_weights(case, world, device)
    one_rank = impl.kind in ("experts", "pool_experts")  # all E experts on the one rank
    num_local = shape.experts_per_rank * world if one_rank else shape.experts_per_rank
    first = 0 if one_rank else rank * num_local
    problem = Problem(num_experts=shape.experts_per_rank * world, num_topk=shape.topk, hidden=shape.hidden,
                      intermediate=shape.intermediate, dtype=case.torch_dtype,
                      weights=local_weights(weights, first, num_local, device), first_expert=first, rank=rank,
                      world_size=world, group=group, device=device,
                      max_tokens_per_rank=cap or max(tokens_per_rank(case, world, cap, caps.tile_rows)) or 1)
    verdict = Verdict()
    built = None
    try:
        progress("build")
        built = impl.factory(problem)
        pooled = _pool_of(impl, x_TD, ids_TK, problem) if impl.kind == "pool_experts" else None
        tune = getattr(built, "tune", None)
        if tune is not None and speed_tokens(case.scenario) is not None:
            # an implementation's own tuning for a speed case's exact inputs (as an engine's tuner writes a config
            # file for a shape), before the checks, so that they check what is timed; its seconds are in no time
            progress("tune")
            start = time.perf_counter()
            if pooled is not None:
                tune(pooled.pool)
            else:
                tune(x_TD.clone(), ids_TK.clone(), w_TK.clone())
            verdict.tune_s = time.perf_counter() - start
        if impl.kind == "dispatch_combine":
            _check_dispatch(built, case, inputs, rank, problem, verdict, progress)
        elif pooled is not None:
            _check_pool(built, impl, case, (x_TD, ids_TK), pooled, weights, verdict, progress)
        elif case.scenario == "cap+1":
            _check_overflow(built, impl, case, (x_TD, ids_TK, w_TK), inputs, weights, verdict, progress)
        else:
            _check_moe(built, impl, case, (x_TD, ids_TK, w_TK), weights, verdict, progress)
            if impl.caps.graph_safe and device.type == "cuda" and world == 1:
                _check_graph(built, impl, case, (x_TD, ids_TK, w_TK), weights, verdict, progress)
        if timer is not None and not verdict.failed:
            progress("speed")
            _time(built, impl, (x_TD, ids_TK, w_TK), problem, verdict, pooled and pooled.pool, timer)
    except Exception as err:  # noqa: BLE001 - the implementation's failure is the case's verdict
        verdict.error = f"{type(err).__name__}: {err}".splitlines()[0][:400]
        verdict.failed.setdefault("raised", traceback.format_exc(limit=-3)[-600:])
    finally:
        close = getattr(built, "close", None)
        if close is not None:
            close()
    return verdict


def _call(built, x_TD, ids_TK, w_TK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out_TD, storage)``: the output written into a NaN-filled allocation with guard rows past T."""
    storage = torch.full((x_TD.shape[0] + GUARD_ROWS, x_TD.shape[1]), float("nan"), dtype=x_TD.dtype,
                         device=x_TD.device)
    out_TD = storage[:x_TD.shape[0]]
    built(x_TD, ids_TK, w_TK, out_TD)
    return out_TD, storage


def _buffer_checks(out_TD, storage, expected_TD, verdict: Verdict, what: str = "") -> None:
    """poison: rows the oracle has finite but the output left NaN; guard: any write past T."""
    unwritten = torch.isnan(out_TD.float()).any(-1).cpu() & torch.isfinite(expected_TD.cpu()).all(-1)
    if bool(unwritten.any()):
        verdict.failed.setdefault("poison", f"{what}{int(unwritten.sum())} of {out_TD.shape[0]} output rows never "
                                            f"written (first {unwritten.nonzero().flatten()[:5].tolist()})")
    touched = ~torch.isnan(storage[out_TD.shape[0]:].float()).all(-1)
    if bool(touched.any()):
        verdict.failed.setdefault("guard", f"{what}wrote {int(touched.sum())} rows past T={out_TD.shape[0]}")


def _oracle_check(out_TD, expected_TD, key: str, verdict: Verdict, name: str = "oracle") -> None:
    finite = torch.isfinite(out_TD.float()).all(-1).cpu()
    why = compare(out_TD.cpu()[finite], expected_TD.cpu()[finite], key)
    if why:
        verdict.failed.setdefault(name, why)


def _same_rows(check: str, actual, base, expected, key: str, bitwise: bool, verdict: Verdict,
               base_name: str = "the batch run") -> None:
    """``actual`` against the earlier rows ``base`` (``base_name`` in the message) bit for bit, else against the
    oracle's ``expected`` (unused, and may be None, when ``bitwise``)."""
    if bitwise:
        if not torch.equal(actual.view(torch.uint8), base.view(torch.uint8)):
            differ = (actual.view(torch.uint8) != base.view(torch.uint8)).any(-1).nonzero().flatten()
            verdict.failed.setdefault(check, f"{differ.numel()} rows differ in bits from {base_name} (first "
                                             f"{differ[:5].tolist()})")
    else:
        _oracle_check(actual, expected, key, verdict, check)


def limit_key(impl: Implementation, case: Case) -> str:
    """The ``oracle.LIMITS`` key ``case`` is judged by for ``impl``: the weight recipe, else the compute the
    implementation declares (``Capabilities.compute``), else the activation dtype."""
    if case.quant != "none":
        return case.quant
    return impl.caps.compute or case.dtype


def _check_moe(built, impl, case, inputs, weights, verdict: Verdict, progress) -> None:
    x_TD, ids_TK, w_TK = inputs
    key = limit_key(impl, case)
    expected_TD = oracle_moe(x_TD, ids_TK, w_TK, weights, impl.caps.compute)
    progress("run")
    out_TD, storage = _call(built, x_TD, ids_TK, w_TK)
    _buffer_checks(out_TD, storage, expected_TD, verdict)
    _oracle_check(out_TD, expected_TD, key, verdict)
    caps = impl.caps
    if caps.deterministic:
        progress("rerun")
        again, _ = _call(built, x_TD, ids_TK, w_TK)
        if not torch.equal(again.view(torch.uint8), out_TD.view(torch.uint8)):
            verdict.failed.setdefault("rerun", "a second call on the same inputs gave other bits")
    num_tokens = x_TD.shape[0]
    progress("permute")
    # a derangement (no token keeps its place) when there are two tokens to swap; the guard makes the check real
    perm = (torch.arange(num_tokens) + max(1, num_tokens // 2)) % max(num_tokens, 1)
    assert num_tokens < 2 or bool((perm != torch.arange(num_tokens)).all())
    perm = perm.to(x_TD.device)
    permuted, _ = _call(built, x_TD[perm], ids_TK[perm], w_TK[perm])
    restored = torch.empty_like(permuted)
    restored[perm] = permuted
    _same_rows("permute", restored, out_TD, expected_TD, key, caps.batch_invariant, verdict)
    progress("alone")
    last = slice(num_tokens - 1, num_tokens) if num_tokens else slice(0, 0)
    alone, _ = _call(built, x_TD[last], ids_TK[last], w_TK[last])
    _same_rows("alone", alone, out_TD[last], expected_TD[last.start:last.stop], key, caps.batch_invariant, verdict)


def shifted_routing(ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Each live slot's expert id + 1 (mod ``num_experts``), masked slots kept: the per-expert row counts rotate by one
    expert (other segment sizes, unless every expert had as many rows), the same number of live slots, and a token's
    experts still distinct when they were (a bijection).

    Example: ids [[0, 3], [-1, 2]], 4 experts -> [[1, 0], [-1, 3]]."""
    return torch.where(ids_TK >= 0, (ids_TK + 1) % num_experts, ids_TK)


def _check_graph(built, impl, case, inputs, weights, verdict: Verdict, progress) -> None:
    """graph: capture the call once on ``inputs``, replay it on shifted routing, compare with an eager call there."""
    from moe_ref.testing import graphed

    x_TD, ids_TK, w_TK = inputs
    progress("graph")
    shifted_TK = shifted_routing(ids_TK, weights.gate_up_e2FD.shape[0])
    out_TD = torch.full_like(x_TD, float("nan"))
    try:
        replay = graphed(built, x_TD.clone(), ids_TK.clone(), w_TK.clone(), out_TD)
        replay(x_TD, shifted_TK, w_TK, out_TD)
        torch.cuda.synchronize()
    except Exception as err:  # noqa: BLE001 - a graph_safe claim that does not hold is the check's failure
        verdict.failed.setdefault("graph", f"declared graph_safe, but capturing or replaying the call raised "
                                           f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
        return
    eager_TD, _ = _call(built, x_TD, shifted_TK, w_TK)
    bitwise = impl.caps.deterministic
    expected_TD = None if bitwise else oracle_moe(x_TD, shifted_TK, w_TK, weights, impl.caps.compute)
    _same_rows("graph", out_TD, eager_TD, expected_TD, limit_key(impl, case), bitwise, verdict,
               "an eager call on the same (shifted) routing")


def _check_overflow(built, impl, case, mine, inputs, weights, verdict: Verdict, progress) -> None:
    """C + 1 rows on rank 0: the declared error on every rank (``error``), or the result of the rows split into
    chunks of C by the harness (``chunk``). ``mine``: this rank's inputs on its device; ``inputs``: every rank's."""
    caps = impl.caps
    x_TD, ids_TK, w_TK = mine
    progress("overflow")
    if caps.overflow == "error":
        try:
            _call(built, x_TD, ids_TK, w_TK)
        except caps.overflow_error:
            return
        verdict.failed["overflow"] = (f"declared overflow='error' (max_tokens_per_rank={caps.max_tokens_per_rank}) but "
                                      f"a call with {inputs[0][0].shape[0]} rows on rank 0 returned")
        return
    cap = caps.max_tokens_per_rank
    out_TD, storage = _call(built, x_TD, ids_TK, w_TK)
    expected_TD = oracle_moe(x_TD, ids_TK, w_TK, weights, impl.caps.compute)
    _buffer_checks(out_TD, storage, expected_TD, verdict)
    key = limit_key(impl, case)
    num_chunks = -(-max(x.shape[0] for x, _, _ in inputs) // cap)
    pieces = [_call(built, x_TD[i * cap:(i + 1) * cap], ids_TK[i * cap:(i + 1) * cap], w_TK[i * cap:(i + 1) * cap])[0]
              for i in range(num_chunks)]
    _same_rows("overflow", out_TD, torch.cat(pieces), expected_TD, key, caps.batch_invariant, verdict)


def _check_dispatch(built, case, inputs, rank, problem: Problem, verdict: Verdict, progress) -> None:
    """Structured rows: column D-2 = source rank, D-1 = token id (exact in every dtype up to 256 tokens)."""
    device, dtype, world = problem.device, problem.dtype, problem.world_size
    xs = []
    for src, (x_TD, _, _) in enumerate(inputs):
        x_TD = x_TD.clone()
        x_TD[:, -2] = src
        x_TD[:, -1] = torch.arange(x_TD.shape[0], dtype=x_TD.dtype)
        xs.append(x_TD)
    _, ids_TK, w_TK = inputs[rank]
    mine = (xs[rank].to(device), ids_TK.to(device, copy=True), w_TK.to(device, copy=True))
    progress("dispatch")
    received = built.dispatch(*mine)
    first, e = problem.first_expert, problem.num_local_experts
    want_rows = {i: sorted((src, t) for src, (_, ids, _) in enumerate(inputs)
                           for t, j in (ids == first + i).nonzero().tolist()) for i in range(e)}
    got_counts = received.num_rows_e.cpu().long()
    want_counts = torch.tensor([len(want_rows[i]) for i in range(e)])
    if not torch.equal(got_counts, want_counts):
        verdict.failed["counts"] = f"rows per local expert {got_counts.tolist()}, routed {want_counts.tolist()}"
    starts = received.row_start_e.cpu().long().tolist()
    for i in range(e):
        rows = received.x_PD[starts[i]:starts[i] + int(got_counts[i])].cpu()
        pairs = sorted((int(r[-2]), int(r[-1])) for r in rows.float())
        sent = torch.stack([xs[s][t] for s, t in pairs]) if pairs else rows
        if pairs != want_rows[i] or not torch.equal(rows.view(torch.uint8), sent.view(torch.uint8)
                                                    if rows.dtype == sent.dtype else rows):
            verdict.failed.setdefault("payload", f"local expert {i}: received (rank, token) {pairs[:6]}..., routed "
                                                 f"{want_rows[i][:6]}... (or rows not the sent bits)")
    # the experts' stand-in: rows of global expert g scaled by (g + 1) / E; rows outside every segment NaN
    y_PD = torch.full_like(received.x_PD, float("nan"))
    for i in range(e):
        rows = slice(starts[i], starts[i] + int(got_counts[i]))
        y_PD[rows] = (received.x_PD[rows].float() * (first + i + 1) / problem.num_experts).to(dtype)
    x_TD, ids_TK, w_TK = (t.cpu() for t in mine)
    scale_TK = torch.where(ids_TK >= 0, (ids_TK + 1).double() / problem.num_experts, 0.0)
    expert_out_TKD = (x_TD.float()[:, None, :] * scale_TK.float()[..., None]).to(dtype).double()
    expected_TD = (w_TK.double()[..., None] * expert_out_TKD * (ids_TK >= 0)[..., None]).sum(1)
    progress("combine")
    storage = torch.full((x_TD.shape[0] + GUARD_ROWS, x_TD.shape[1]), float("nan"), dtype=dtype, device=device)
    out_TD = storage[:x_TD.shape[0]]
    built.combine(y_PD, received, out_TD)
    _buffer_checks(out_TD, storage, expected_TD, verdict)
    _oracle_check(out_TD, expected_TD, case.dtype, verdict, "combine")


def _pool_of(impl: Implementation, x_TD, ids_TK, problem: Problem) -> PooledRows:
    """These rows pooled in the layout and alignment ``impl`` declares."""
    caps = impl.caps
    return expert_pool(x_TD, ids_TK, problem.num_experts, caps.segment_alignment, caps.layouts[0],
                       fp8=problem.weights.quant == "fp8_block")


def _run_pool(built, pool: ExpertPool, verdict: Verdict, what: str) -> torch.Tensor:
    """``y_PD`` of one call; the input check: the pool's bytes are what they were before it."""
    before = [t.clone() for t in (pool.x_PD, pool.x_fp8_PD, pool.x_scale_PDb) if t is not None]
    y_PD = built(pool)
    after = [t for t in (pool.x_PD, pool.x_fp8_PD, pool.x_scale_PDb) if t is not None]
    if any(not torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(after, before)):
        verdict.failed.setdefault("input", f"{what}the call wrote into the pool it was handed")
    if tuple(y_PD.shape) != tuple(pool.x_PD.shape):
        raise ValueError(f"{what}returned {tuple(y_PD.shape)}, the pool is {tuple(pool.x_PD.shape)}")
    return y_PD


def _check_pool(built, impl, case, inputs, pooled: PooledRows, weights, verdict: Verdict, progress) -> None:
    """The ``pool_experts`` checks (module docstring) on the pool ``_pool_of`` built."""
    x_TD, ids_TK = inputs
    pool, expert_P, row_TK = pooled
    key = limit_key(impl, case)
    live_P = expert_P >= 0
    expected_PD = oracle_rows(pool.x_PD, expert_P, weights, impl.caps.compute)
    progress("run")
    y_PD = _run_pool(built, pool, verdict, "")
    not_finite = (~torch.isfinite(y_PD[live_P].float()).all(-1)).nonzero().flatten()
    if not_finite.numel():  # the oracle check looks at finite rows only
        verdict.failed.setdefault("finite", f"{not_finite.numel()} of {int(live_P.sum())} segment rows hold NaN/inf "
                                            f"(padding read into them, or never written)")
    _oracle_check(y_PD[live_P], expected_PD[live_P], key, verdict)
    caps = impl.caps
    if caps.deterministic:
        progress("rerun")
        again_PD = _run_pool(built, pool, verdict, "rerun: ")
        if not torch.equal(again_PD[live_P].view(torch.uint8), y_PD[live_P].view(torch.uint8)):
            verdict.failed.setdefault("rerun", "a second call on the same pool gave other bits")
    progress("permute")
    src_P = rows_deranged_in_segments(pool)
    permuted = ExpertPool(pool.x_PD[src_P], pool.row_start_e, pool.num_rows_e, pool.num_rows, pool.masked_rows,
                          *(None if t is None else t[src_P] for t in (pool.x_fp8_PD, pool.x_scale_PDb)))
    restored_PD = torch.empty_like(y_PD)
    restored_PD[src_P] = _run_pool(built, permuted, verdict, "permute: ")
    _same_rows("permute", restored_PD[live_P], y_PD[live_P], expected_PD[live_P], key, caps.batch_invariant, verdict)
    progress("alone")
    token_N, slot_N = (ids_TK >= 0).nonzero(as_tuple=True)
    if token_N.numel():
        token, slot = int(token_N[-1]), int(slot_N[-1])
        ids_alone = torch.full_like(ids_TK[:1], -1)
        ids_alone[0, slot] = ids_TK[token, slot]
        one = expert_pool(x_TD[token:token + 1], ids_alone, len(pool.num_rows_e), caps.segment_alignment,
                          caps.layouts[0], fp8=pool.x_fp8_PD is not None)
        alone_row = int(one.row_TK[0, slot])
        alone = _run_pool(built, one.pool, verdict, "alone: ")[alone_row:alone_row + 1]
        row = int(row_TK[token, slot])
        _same_rows("alone", alone, y_PD[row:row + 1], expected_PD[row:row + 1], key, caps.batch_invariant, verdict)


def _time(built, impl, inputs, problem: Problem, verdict: Verdict, pool: ExpertPool | None = None,
          timer: str = "events") -> None:
    """us per call by ``timer`` (``TIMERS``; on CPU ``events`` is the wall clock), bytes moved and FLOPs of the
    experts. Bytes: the tokens read and written and the weights read (``experts``, ``routed_step``); each routed row
    read as handed and written, and the weights (``pool_experts``); each live slot's row sent and sent back
    (``dispatch_combine``)."""
    from moe_ref.testing import bench, graphed

    x_TD, ids_TK, w_TK = inputs
    out_TD = torch.empty_like(x_TD)
    if impl.kind == "pool_experts":
        def call():
            built(pool)
    elif impl.kind == "dispatch_combine":
        def call():
            received = built.dispatch(x_TD, ids_TK, w_TK)
            built.combine(received.x_PD, received, out_TD)
    else:
        def call():
            built(x_TD, ids_TK, w_TK, out_TD)
    if timer == "kernels":
        from moe_ref.bench.timing import kernel_us

        verdict.us, per_kernel = kernel_us(call, quick=True)
        verdict.kernels = {name: round(us, 2) for name, us in per_kernel.items()}
    else:
        verdict.us = bench(graphed(call) if timer == "graph" else call, warmup=2, iters=SPEED_ITERS)
    live = int((ids_TK >= 0).sum())
    if impl.kind == "dispatch_combine":
        verdict.bytes = 2 * live * x_TD.shape[1] * x_TD.element_size()
        return
    weights = problem.weights
    # a quantized kernel reads the codes (and scales), a plain one the activation-dtype weights
    read = (weights.gate_up_q, weights.down_q, weights.gate_up_scale, weights.down_scale) \
        if weights.gate_up_q is not None else (weights.gate_up_e2FD, weights.down_eDF)
    weight_bytes = sum(t.numel() * t.element_size() for t in read)
    if impl.kind == "pool_experts":  # each routed row read (as handed: FP8 with its scales) and written
        row_bytes = pool.x_PD.shape[1] * x_TD.element_size()
        read_row = row_bytes if pool.x_fp8_PD is None else pool.x_PD.shape[1] + 4 * pool.x_scale_PDb.shape[1]
        verdict.bytes = live * (row_bytes + read_row) + weight_bytes
    else:
        verdict.bytes = 2 * x_TD.numel() * x_TD.element_size() + weight_bytes
    verdict.flops = 6 * live * problem.hidden * problem.intermediate
