"""Deliberately wrong implementations: each plants one bug a real kernel has had, so that every check of the harness
is shown to catch something (``moe-ref conform --mutants`` prints, and ``--write-doc`` records, which scenario and
check caught each one; a check that catches none is removed or fixed).

All are built on one small correct routed step (``GatherMoE``: every rank gathers every rank's rows, runs its experts
over an expert-major pool, and the partials come back by a second gather) that passes every scenario; a mutant
changes one line of it. ``correct`` is that base, registered too: its clean pass is the positive control.

| mutant               | the bug                                                                          |
|----------------------|----------------------------------------------------------------------------------|
| segment_offset       | every expert segment after the first starts one row early (off-by-one offset)    |
| masked_row_dropped   | a token whose slots are all masked is skipped: its output row is never written    |
| wrong_scale          | FP8 weights dequantized with their block scales in reverse column order          |
| atomic_combine       | the partials summed in arrival order (as atomics would), not slot order          |
| write_past_t         | the output writer runs one row past T                                            |
| no_capacity_check    | rows staged in a C-row buffer without checking T <= C (row C lands on row 0)      |
| masked_to_last_rank  | dispatch: a masked slot's owner computed as -1 // e, i.e. the last rank's expert |
| pool_segment_offset  | experts on a pool: each segment read from one row before its start              |
| pool_in_place        | experts on a pool: the result written over the pool's rows and returned          |
| pool_split_k         | experts on a pool: the K sums split in three, associated anew on every call      |
| pool_shared_scale    | experts on a pool: one activation scale per segment (amax over its rows), not    |
|                      | per row                                                                          |

The experts-on-a-pool mutants change one line of ``RowByRowExperts`` (``pool:correct``).

Shape legend: T tokens of this rank, K top-k, E experts, e local experts, D hidden width, P receive-pool rows.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from moe_ref.conformance.api import Capabilities, ExpertPool, Implementation, Problem, Received, register
from moe_ref.conformance.oracle import fake_quant_fp8_rows
from moe_ref.conformance.scenarios import dequantize
from moe_ref.core.errors import CapacityExceededError

MUTANT_CAP = 32
CAPS = Capabilities(dtypes=("fp32", "bf16"), quants=("none", "fp8_block", "int4", "mxfp4"), ep_sizes=(1, 2, 4),
                    max_tokens_per_rank=MUTANT_CAP, overflow="error", deterministic=True, batch_invariant=True,
                    duplicate_experts=True, devices=("cpu",))
DISPATCH_CAPS = Capabilities(dtypes=("fp32", "bf16"), ep_sizes=(1, 2, 4), deterministic=True, devices=("cpu",))
POOL_CAPS = Capabilities(dtypes=("fp32", "bf16"), quants=("none",), deterministic=True, batch_invariant=True,
                         duplicate_experts=True, devices=("cpu",), segment_alignment=8)


def _gather_counts(num_rows: int, problem: Problem) -> list[int]:
    """Every rank's row count (one collective)."""
    if problem.world_size == 1:
        return [num_rows]
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(problem.world_size)]
    dist.all_gather(counts, torch.tensor([num_rows]), group=problem.group)
    return [int(c) for c in counts]


def _gather(tensors: list[torch.Tensor], counts: list[int], problem: Problem) -> list[list[torch.Tensor]]:
    """Every rank's ``tensors`` (each ``[counts[rank], ...]``): ``out[i][rank]``, bit for bit. One collective: the
    rows' bytes side by side, padded to the longest rank (gloo moves bytes of any dtype)."""
    if problem.world_size == 1:
        return [[t] for t in tensors]
    num_rows = tensors[0].shape[0]
    parts = [t.contiguous().view(num_rows, math.prod(t.shape[1:])).view(torch.uint8) for t in tensors]
    widths = [part.shape[1] for part in parts]
    packed = torch.zeros(max(counts), sum(widths), dtype=torch.uint8)
    packed[:num_rows] = torch.cat(parts, dim=1)
    everyone = [torch.empty_like(packed) for _ in counts]
    dist.all_gather(everyone, packed, group=problem.group)
    out = []
    for i, t in enumerate(tensors):
        lo = sum(widths[:i])
        # a fresh [n, width] byte tensor (a slice of one row counts as contiguous but keeps the packed stride)
        out.append([torch.empty(n, widths[i], dtype=torch.uint8).copy_(rows[:n, lo:lo + widths[i]]).view(t.dtype)
                    .view(n, *t.shape[1:]) for rows, n in zip(everyone, counts)])
    return out


class GatherMoE:
    """The correct base: ``bug`` names the one line a mutant changes (None: correct)."""

    def __init__(self, problem: Problem, bug: str | None = None):
        self.problem, self.bug = problem, bug
        w = problem.weights
        if w.quant == "none":
            self.gate_up, self.down = w.gate_up_e2FD.double(), w.down_eDF.double()
        else:
            flip = bug == "wrong_scale"
            self.gate_up = dequantize(w.gate_up_q, w.gate_up_scale.flip(-1) if flip else w.gate_up_scale, w.quant)
            self.down = dequantize(w.down_q, w.down_scale.flip(-1) if flip else w.down_scale, w.quant)
        self.staging = torch.empty(MUTANT_CAP, problem.hidden, dtype=problem.dtype)
        self.calls = 0

    def __call__(self, x_TD, topk_ids_TK, topk_weights_TK, out_TD) -> None:
        p = self.problem
        num_tokens = x_TD.shape[0]
        counts = _gather_counts(num_tokens, p)
        if max(counts) > MUTANT_CAP and self.bug != "no_capacity_check":
            raise CapacityExceededError(f"T={max(counts)} > C={MUTANT_CAP}", num_tokens=max(counts), cap=MUTANT_CAP)
        if self.bug == "no_capacity_check":  # staged without a bound check: row C overwrites row 0
            self.staging[torch.arange(num_tokens) % MUTANT_CAP] = x_TD
            x_TD = self.staging[torch.arange(num_tokens) % MUTANT_CAP]
        xs, ids, ws = _gather([x_TD, topk_ids_TK.long(), topk_weights_TK], counts, p)
        x_all, ids_all, w_all = torch.cat(xs), torch.cat(ids), torch.cat(ws).double()
        x64 = fake_quant_fp8_rows(x_all) if p.weights.quant == "fp8_block" else x_all.double()
        local_TK = ids_all - p.first_expert
        mine_TK = (ids_all >= 0) & (local_TK < p.num_local_experts) & (local_TK >= 0)
        token_N, slot_N = mine_TK.nonzero(as_tuple=True)
        expert_N = local_TK[token_N, slot_N]
        order = torch.argsort(expert_N, stable=True)
        token_N, slot_N, expert_N = token_N[order], slot_N[order], expert_N[order]
        counts_e = torch.bincount(expert_N, minlength=p.num_local_experts).tolist()
        y_ND = torch.zeros(token_N.numel(), p.hidden, dtype=torch.float64)
        start = 0
        for expert, count in enumerate(counts_e):
            read = start - 1 if self.bug == "segment_offset" and start > 0 else start
            rows = x64[token_N[read:read + count]]
            # row by row (elementwise products and sums): a row's bits never depend on its neighbours
            gate_NF, up_NF = (rows[:, None, :] * self.gate_up[expert][None]).sum(-1).chunk(2, dim=-1)
            h_NF = gate_NF * torch.sigmoid(gate_NF) * up_NF
            y_ND[start:start + count] = (h_NF[:, None, :] * self.down[expert][None]).sum(-1)
            start += count
        contrib_ND = w_all[token_N, slot_N, None] * y_ND
        # per token, the partials summed in slot order (or, for the mutant, in whatever order they arrive)
        partial_TD = torch.zeros(x_all.shape[0], p.hidden, dtype=torch.float32)
        if self.bug == "atomic_combine":  # another order on each call, the same in every run (seeded by the call)
            self.calls += 1
            arrival = torch.randperm(token_N.numel(), generator=torch.Generator().manual_seed(self.calls))
            for n in arrival.tolist():
                partial_TD[token_N[n]] += contrib_ND[n].float()
        else:
            for slot in range(p.num_topk):  # a token has one row per slot: slot j adds after slot j - 1
                rows = slot_N == slot
                partial_TD[token_N[rows]] += contrib_ND[rows].float()
        (partials,) = _gather([partial_TD], [partial_TD.shape[0]] * p.world_size, p)
        total_TD = torch.stack(partials).sum(0)
        mine = slice(sum(counts[:p.rank]), sum(counts[:p.rank + 1]))
        result_TD = total_TD[mine].to(out_TD.dtype)
        if self.bug == "masked_row_dropped":
            live_T = (topk_ids_TK >= 0).any(-1)
            out_TD[live_T] = result_TD[live_T]
        elif self.bug == "write_past_t":
            torch.as_strided(out_TD, (num_tokens + 1, p.hidden), out_TD.stride())[:num_tokens + 1] = \
                torch.cat([result_TD, result_TD[:1] if num_tokens else torch.zeros(1, p.hidden, dtype=out_TD.dtype)])
        else:
            out_TD.copy_(result_TD)


class GatherDispatch:
    """The correct dispatch/combine (``bug="masked_to_last_rank"``: the mutant)."""

    def __init__(self, problem: Problem, bug: str | None = None):
        self.problem, self.bug = problem, bug

    def dispatch(self, x_TD, topk_ids_TK, topk_weights_TK) -> Received:
        p = self.problem
        xs, ids, ws = _gather([x_TD, topk_ids_TK.long(), topk_weights_TK], _gather_counts(x_TD.shape[0], p), p)
        rows, experts, routes = [], [], []
        for src in range(p.world_size):
            for t, j in (ids[src] != -2).nonzero().tolist():
                expert = int(ids[src][t, j])
                if expert == -1 and self.bug == "masked_to_last_rank":
                    expert = p.num_experts - 1  # -1 // e wrapped to the last rank, -1 % e to its last expert
                if expert < 0 or not p.first_expert <= expert < p.first_expert + p.num_local_experts:
                    continue
                rows.append(xs[src][t])
                experts.append(expert - p.first_expert)
                routes.append((src, t, float(ws[src][t, j])))
        order = sorted(range(len(rows)), key=lambda n: experts[n])
        x_PD = torch.stack([rows[n] for n in order]) if rows else torch.zeros(0, p.hidden, dtype=x_TD.dtype)
        num_rows_e = torch.bincount(torch.tensor(experts, dtype=torch.int64), minlength=p.num_local_experts)
        row_start_e = torch.cumsum(num_rows_e, 0) - num_rows_e
        return Received(x_PD, row_start_e, num_rows_e, ([routes[n] for n in order], [x.shape[0] for x in xs]))

    def combine(self, y_PD, received: Received, out_TD) -> None:
        p = self.problem
        routes, counts = received.handle
        partials = [torch.zeros(n, p.hidden, dtype=torch.float64) for n in counts]
        for (src, t, weight), y_D in zip(routes, y_PD):
            partials[src][t] += weight * y_D.double()
        mine_all = torch.cat(partials)
        (gathered,) = _gather([mine_all], [mine_all.shape[0]] * p.world_size, p)
        total = torch.stack(gathered).sum(0)
        mine = slice(sum(counts[:p.rank]), sum(counts[:p.rank + 1]))
        out_TD.copy_(total[mine].to(out_TD.dtype))


class RowByRowExperts:
    """The correct experts on a pool (``pool_experts`` kind; ``bug`` names the line a mutant changes): each row
    through its expert in float64, one row at a time (elementwise products and sums), rounded once."""

    def __init__(self, problem: Problem, bug: str | None = None):
        self.problem, self.bug, self.calls = problem, bug, 0
        self.gate_up, self.down = problem.weights.gate_up_e2FD.double(), problem.weights.down_eDF.double()

    def _dot(self, rows_ND, w_OD):
        """``[N, O]``: each row's products with each weight row, summed; the split-K mutant sums three fp32 partial
        sums of D, associated another way on every other call (as atomics add split-K partials)."""
        products_NOD = rows_ND[:, None, :] * w_OD[None]
        if self.bug != "pool_split_k":
            return products_NOD.sum(-1)
        a, b, c = (part.float().sum(-1) for part in products_NOD.tensor_split(3, dim=-1))
        return ((a + b) + c if self.calls % 2 else a + (b + c)).double()

    def __call__(self, pool: ExpertPool) -> torch.Tensor:
        self.calls += 1
        y_PD = torch.zeros(pool.x_PD.shape, dtype=torch.float64)
        for expert, (start, count) in enumerate(zip(pool.row_start_e.tolist(), pool.num_rows_e.tolist())):
            read = max(start - 1, 0) if self.bug == "pool_segment_offset" else start
            rows_ND = pool.x_PD[read:read + count].double()
            if self.bug == "pool_shared_scale" and count:  # one scale for the segment, rows rounded to 1/64 of it
                step = rows_ND.abs().amax() / 64
                rows_ND = torch.round(rows_ND / step) * step
            gate_NF, up_NF = self._dot(rows_ND, self.gate_up[expert]).chunk(2, dim=-1)
            y_PD[start:start + count] = self._dot(gate_NF * torch.sigmoid(gate_NF) * up_NF, self.down[expert])
        if self.bug == "pool_in_place":
            pool.x_PD.copy_(y_PD)
            return pool.x_PD
        return y_PD.to(pool.x_PD.dtype)


MUTANTS = ("segment_offset", "masked_row_dropped", "wrong_scale", "atomic_combine", "write_past_t",
           "no_capacity_check")


def _register(name: str, kind: str, caps: Capabilities, label: str, factory) -> None:
    register(Implementation(name, kind, caps, factory, label, spec=name))  # found again by name in the workers


for _bug in (None, *MUTANTS):
    _register("correct" if _bug is None else f"mutant:{_bug}", "routed_step", CAPS,
              "the mutants' correct base" if _bug is None else f"planted bug: {_bug}",
              lambda problem, bug=_bug: GatherMoE(problem, bug))
for _bug in (None, "masked_to_last_rank"):
    _register("dispatch:correct" if _bug is None else f"mutant:{_bug}", "dispatch_combine", DISPATCH_CAPS,
              "correct dispatch" if _bug is None else f"planted bug: {_bug}",
              lambda problem, bug=_bug: GatherDispatch(problem, bug))
POOL_MUTANTS = ("pool_segment_offset", "pool_in_place", "pool_split_k", "pool_shared_scale")
for _bug in (None, *POOL_MUTANTS):
    _register("pool:correct" if _bug is None else f"mutant:{_bug}", "pool_experts", POOL_CAPS,
              "the pool mutants' correct base" if _bug is None else f"planted bug: {_bug}",
              lambda problem, bug=_bug: RowByRowExperts(problem, bug))
MUTANT_NAMES = tuple(f"mutant:{bug}" for bug in (*MUTANTS, "masked_to_last_rank", *POOL_MUTANTS))
CORRECT_BASES = ("correct", "dispatch:correct", "pool:correct")
