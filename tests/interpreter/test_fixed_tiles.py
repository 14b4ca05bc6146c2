"""The batch-invariant mode's Triton code paths under the interpreter (docs/batch_invariance.md): the fixed-tile GEMM
``fixed_tile_matmul`` (close to its torch twin and to fp64, and row-invariant), the grouped MLP on the mode's tiles
(under the interpreter its one ``GROUPED_MLP_TILES`` pair, through ``TritonExperts`` as the layer runs it), the Triton router's tie rule (the
lowest expert id, as the torch router), and the layer with ``experts_backend='triton'`` (a token alone vs in a batch).

The interpreter's ``tl.dot`` is ``numpy.matmul`` (OpenBLAS sgemm), and that GEMM's order of additions for a row
depends on the row's place in the call (on the development machine, rows 0-5 of a [16, 32] x [32, 32] sgemm add in
one order and rows 6-15 in another), so no kernel built on it is row-invariant under the stock interpreter, however
fixed its tile. The GPU's MMA has no such dependence. The fixture ``row_invariant_dot`` (conftest) therefore swaps in a
dot with the stock one's dtypes (fp32 sums; 16-bit operands as the stock one reads them) whose every output element
is its own K products summed in an order fixed by the tile shape: what stays under test is what the kernels decide
(tiles, masks, a row's program and K loop, the expert a block maps to, the forced tiles reaching the launches).
``test_the_emulated_dot_is_in_use_and_agrees_with_numpy_matmul`` checks the fixture is live and faithful.
"""
from __future__ import annotations

import pytest
import torch

from moe_ref import MegaMoE
from moe_ref.core.config import preset
from moe_ref.core.router import select_experts
from moe_ref.ep.batch_invariant import rows_with_other_bits
from moe_ref.experts import ExpertLayout, TritonExperts
from moe_ref.kernels.experts import grouped_mlp as gm
from moe_ref.kernels.experts.grouped_mlp_tiles import tile_of
from moe_ref.kernels.router.router_topk import router_topk
from moe_ref.kernels.runtime._triton_utils import is_interpreter
from moe_ref.kernels.runtime.fixed_tiles import (GROUPED_MLP_TILES, fixed_tile_matmul, fixed_tile_matmul_ref,
                                                 forced_grouped_tiles, same_bits_tile)

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("row_invariant_dot")]

UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}
N_COLS, K_WIDTH = 45, 70  # not multiples of any tile (interpreter 16x32x32, GPU 64x64x64 and 32x64x32)


@pytest.fixture
def grouped_launches(monkeypatch):
    """The (BLOCK_M, BLOCK_N, BLOCK_K) of every grouped-GEMM kernel launch (``grouped_mlp``'s ``launch``: a forced or
    recorded tile; an autotuned one is not seen), recorded, the launch run as is."""
    seen = []
    launch = gm.launch

    def spy(kernel, grid, *args, **keywords):
        if kernel is gm._grouped_gemm_kernel:
            seen.append(tuple(keywords[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K")))
        return launch(kernel, grid, *args, **keywords)

    monkeypatch.setattr(gm, "launch", spy)
    return seen


def assert_mode_tiles(launched: list, precision: str, device) -> None:
    """Every grouped launch of the mode took a tile it may take: the precision's one pair where the class is that
    pair (the interpreter, a GPU not probed), else a tile of its bits class."""
    forced = forced_grouped_tiles(precision, torch.device(device))
    if forced is not None:
        pair = {tile[:3] for tile in forced}
        assert launched and all(tile in pair for tile in launched), (launched, pair)
    else:
        assert all(same_bits_tile(tile, precision) for tile in launched), launched


def randn(*shape, dtype, device, seed, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype).to(device)


def error_bound(x_TI, w_OI, exact_MN, out_dtype, roundings):
    """A bound on |c - a @ b.T| for fp32 sums of the K products (gamma_K = K u of the absolute products, K + 1 to
    cover products of fp32 operands rounded on their own), then ``roundings`` roundings to ``out_dtype``."""
    sums = (K_WIDTH + 1) * UNIT_ROUNDOFF[torch.float32] * (x_TI.double().abs() @ w_OI.double().abs().T)
    return sums + roundings * UNIT_ROUNDOFF[out_dtype] * (exact_MN.abs() + sums)


def assert_within(actual, expected, bound, **case):
    err = (actual.double().cpu() - expected.double().cpu()).abs()
    bad = err > bound.cpu()
    assert not bad.any(), (f"{int(bad.sum())} entries past the bound, worst excess "
                           f"{(err - bound.cpu()).max().item():.3g} (max err {err.max().item():.3g}); {case}")


OPERANDS = [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)]
OPERAND_IDS = ["bf16-to-fp32", "bf16-to-bf16", "fp32-to-fp32"]


@pytest.mark.parametrize("num_rows", [1, 3, 17, 65])
@pytest.mark.parametrize("operand_dtype,out_dtype", OPERANDS, ids=OPERAND_IDS)
def test_fixed_tile_matmul_is_close_to_fp64_and_to_its_twin(operand_dtype, out_dtype, num_rows, device):
    """Kernel vs the fp64 product of the same (rounded) operands, within the fp32-sum bound plus the rounding to the
    output dtype: one half-ulp rounding on a GPU (round to nearest even), two (one ulp) under the interpreter, whose
    fp32 -> bf16 cast truncates. Kernel vs ``fixed_tile_matmul_ref`` within the sum of both bounds, the twin's with
    two output roundings (MKL's bf16 GEMM lands one bf16 ulp off, not half). A dot that reads bf16 as integers (the
    stock interpreter's, before the kernel's UPCAST) is off by ~1e11 here."""
    x_TI = randn(num_rows, K_WIDTH, dtype=operand_dtype, device=device, seed=1)
    w_OI = randn(N_COLS, K_WIDTH, dtype=operand_dtype, device=device, seed=2)
    exact_MN = x_TI.double() @ w_OI.double().T
    got_MN = fixed_tile_matmul(x_TI, w_OI, out_dtype)
    twin_MN = fixed_tile_matmul_ref(x_TI.cpu(), w_OI.cpu(), out_dtype)
    assert got_MN.dtype == twin_MN.dtype == out_dtype and got_MN.shape == (num_rows, N_COLS)
    kernel_bound = error_bound(x_TI, w_OI, exact_MN, out_dtype, roundings=2 if is_interpreter() else 1)
    assert_within(got_MN, exact_MN, kernel_bound, vs="fp64", operand=operand_dtype, out=out_dtype, rows=num_rows)
    twin_bound = kernel_bound + error_bound(x_TI, w_OI, exact_MN, out_dtype, roundings=2)
    assert_within(got_MN, twin_MN, twin_bound, vs="twin", operand=operand_dtype, out=out_dtype, rows=num_rows)


@pytest.mark.parametrize("num_rows", [1, 3, 17, 65])
@pytest.mark.parametrize("operand_dtype,out_dtype", [OPERANDS[0], OPERANDS[2]], ids=[OPERAND_IDS[0], OPERAND_IDS[2]])
def test_fixed_tile_matmul_rows_do_not_depend_on_the_batch(operand_dtype, out_dtype, num_rows, device):
    """The contract, bitwise: every row of an M-row call equals the row computed alone (M = 1) and the row inside
    another batch of 2M + 19 rows (other rows around it, the batch reversed and shifted by 7, so its place in the
    tile and its tile differ). bf16 operands with an fp32 output cover bf16 outputs too: those are the same fp32
    sums, rounded element by element."""
    x_TI = randn(num_rows, K_WIDTH, dtype=operand_dtype, device=device, seed=3)
    w_OI = randn(N_COLS, K_WIDTH, dtype=operand_dtype, device=device, seed=4)
    filler = randn(num_rows + 19, K_WIDTH, dtype=operand_dtype, device=device, seed=5)
    batch_MN = fixed_tile_matmul(x_TI, w_OI, out_dtype)
    alone_MN = torch.cat([fixed_tile_matmul(x_TI[i:i + 1], w_OI, out_dtype) for i in range(num_rows)])
    host = torch.cat([filler[:7], x_TI.flip(0), filler[7:]])
    in_other_MN = fixed_tile_matmul(host, w_OI, out_dtype)[7:7 + num_rows].flip(0)
    case = dict(operand=operand_dtype, out=out_dtype, rows=num_rows)
    assert rows_with_other_bits(alone_MN, batch_MN) == 0, f"alone vs batch: {case}"
    assert rows_with_other_bits(in_other_MN, batch_MN) == 0, f"in another batch vs batch: {case}"


def test_the_emulated_dot_is_in_use_and_agrees_with_numpy_matmul(row_invariant_dot, monkeypatch):
    """The fixture's dot runs (its calls counted) and differs from the stock ``numpy.matmul`` dot by fp32 sum
    roundings only (the fp32 bound on both sides), so the tests above check the kernels, not another product."""
    if row_invariant_dot is None:
        pytest.skip("the interpreter's dot: only under TRITON_INTERPRET=1 (a GPU runs its own MMA)")
    from triton.runtime import interpreter

    x_TI = randn(33, K_WIDTH, dtype=torch.float32, device="cpu", seed=6)
    w_OI = randn(N_COLS, K_WIDTH, dtype=torch.float32, device="cpu", seed=7)
    emulated_MN = fixed_tile_matmul(x_TI, w_OI, torch.float32)
    assert row_invariant_dot.calls == 3 * 2 * 3  # (M tiles) x (N tiles) x (K steps) of the 16x32x32 tile
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", row_invariant_dot.stock)
    stock_MN = fixed_tile_matmul(x_TI, w_OI, torch.float32)
    exact_MN = x_TI.double() @ w_OI.double().T
    bound = 2 * error_bound(x_TI, w_OI, exact_MN, torch.float32, roundings=1)
    assert_within(emulated_MN, stock_MN, bound, vs="stock interpreter dot")


# --- the grouped MLP on the mode's forced tiles -----------------------------------------------------------------------
NUM_EXPERTS, HIDDEN, INTER = 3, 48, 40  # tiny-kimi-k2's D and F: not multiples of any forced tile


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_mlp_rows_do_not_depend_on_their_segment(dtype, device, assert_close, grouped_launches):
    """``TritonExperts`` in the batch-invariant mode (here its ``GROUPED_MLP_TILES`` pair reaches both launches): a row's
    output bits are the same in its base segment (counts 21, 70, 9), after every segment's rows are reversed inside
    a pool with other rows in the gaps between the segments (other starts, other place in the tile and other tile),
    with each segment cut to its first 1, 3 or 17 rows, and alone (six rows of expert 1, at segment positions on both
    sides of the 32- and 64-row tile edges). The base output is close to ``grouped_mlp_ref`` (conftest TOLERANCE:
    h is rounded to x's dtype between the GEMMs, so one flipped rounding propagates)."""
    gate_up = randn(NUM_EXPERTS, 2 * INTER, HIDDEN, dtype=dtype, device=device, seed=10, scale=HIDDEN ** -0.5)
    down = randn(NUM_EXPERTS, HIDDEN, INTER, dtype=dtype, device=device, seed=11, scale=INTER ** -0.5)
    experts = TritonExperts(gate_up, down)
    experts.batch_invariant = True  # as the layer's runtime sets it in this mode
    counts = torch.tensor([21, 70, 9], device=device)
    base = ExpertLayout.from_counts(counts, 1)
    x = randn(int(counts.sum()), HIDDEN, dtype=dtype, device=device, seed=12)
    y = experts(x, base)
    precision = "fp32" if dtype == torch.float32 else "16bit"
    if forced_grouped_tiles(precision, torch.device(device)) is not None:
        assert grouped_launches == [tile[:3] for tile in GROUPED_MLP_TILES[precision]], grouped_launches
    assert_close(y, gm.grouped_mlp_ref(x, gate_up, down, base.row_start_e, counts), dtype, dtype=dtype)

    segments = [torch.arange(s, s + n) for s, n in zip(base.row_start_e.tolist(), counts.tolist())]
    # reversed segments at new starts, other rows in the gaps: the kernel's masks keep them out
    starts = [5, 30, 110]
    pool = randn(125, HIDDEN, dtype=dtype, device=device, seed=13, scale=4.0)
    moved_rows = []
    for start, rows in zip(starts, segments):
        pool[start:start + rows.numel()] = x[rows.flip(0)]
        moved_rows.append(rows.flip(0))
    moved = experts(pool, ExpertLayout(torch.tensor(starts, device=device), counts, 125, 1))
    moved_y = torch.cat([moved[s:s + n] for s, n in zip(starts, counts.tolist())])
    assert rows_with_other_bits(moved_y, y[torch.cat(moved_rows)]) == 0, "reversed segments at other starts"

    for size in (1, 3, 17):  # every segment cut to its first rows (expert 2 has 9)
        kept = [rows[:size] for rows in segments]
        cut_counts = torch.tensor([r.numel() for r in kept], device=device)
        cut = experts(x[torch.cat(kept)], ExpertLayout.from_counts(cut_counts, 1))
        assert rows_with_other_bits(cut, y[torch.cat(kept)]) == 0, f"segments of <= {size} rows"

    for position in (0, 31, 32, 33, 63, 69):  # alone in expert 1
        row = segments[1][position]
        lone = ExpertLayout(torch.tensor([0, 0, 1], device=device), torch.tensor([0, 1, 0], device=device), 1, 1)
        alone = experts(x[row:row + 1], lone)
        assert rows_with_other_bits(alone, y[row:row + 1]) == 0, f"row {position} of expert 1 alone"
    assert_mode_tiles(grouped_launches, precision, device)


# --- the Triton router's ties -----------------------------------------------------------------------------------------
LOGIT_LEVELS = (-1.7, -0.6, 0.2, 0.9, 2.3)  # few levels: many exact ties in each row
BIAS_LEVELS = (0.0, 0.21)


def lowest_id_topk(logits_E, bias_E, cfg):
    """The rule in plain Python on fp64 scores: the K experts of the largest selection scores, ties to the lowest
    id; groups first (the best ``num_topk_groups`` by their top-2 sum or max, ties to the lowest group id).
    Returns (ids, selection scores, group scores)."""
    scores = logits_E.double().sigmoid() if cfg.scoring == "sigmoid" else logits_E.double().softmax(-1)
    select = (scores + (0 if bias_E is None else bias_E.double())).tolist()
    allowed, group_scores = list(range(len(select))), []
    if cfg.num_groups > 1:
        size = len(select) // cfg.num_groups
        tops = [sorted(select[g * size:(g + 1) * size], reverse=True) for g in range(cfg.num_groups)]
        group_scores = [t[0] + t[1] if cfg.group_score == "top2_sum" else t[0] for t in tops]
        kept = sorted(range(cfg.num_groups), key=lambda g: (-group_scores[g], g))[:cfg.num_topk_groups]
        allowed = [e for e in allowed if e // size in kept]
    return sorted(allowed, key=lambda e: (-select[e], e))[:cfg.num_topk], select, group_scores


def min_gap_between_distinct(values):
    distinct = sorted(set(values))
    return min((b - a for a, b in zip(distinct, distinct[1:])), default=float("inf"))


@pytest.mark.parametrize("name", ["tiny-kimi-k2", "tiny-deepseek-v3", "tiny-step3"])
def test_router_kernel_breaks_exact_ties_toward_the_lowest_expert_id(name, device, assert_close):
    """Kimi-K2 (sigmoid + selection bias), DeepSeek-V3 (the same with 4 groups, 2 kept) and Step3 (softmax) on logits
    of five levels and, with a bias, two bias levels: every row holds exact ties (tied experts have the same logit
    and bias, so any implementation scores them alike), and the grouped rows hold tied group scores too; distinct
    scores and group scores sit > 1e-3 apart (checked), so fp32 roundings cannot reorder them. The Triton router's
    ids equal the torch router's and the rule's (``lowest_id_topk``), and all-zero logits and bias pick experts
    0 .. K-1. Its weights are close to the torch router's, and a batch shifted by 5 rows gives every row the same
    ids and weight bits."""
    cfg = preset(name)
    gen = torch.Generator().manual_seed(20)
    logits_TE = torch.tensor(LOGIT_LEVELS)[torch.randint(len(LOGIT_LEVELS), (37, cfg.num_experts), generator=gen)]
    bias_E = None
    if cfg.use_selection_bias:
        bias_E = torch.tensor(BIAS_LEVELS)[torch.randint(len(BIAS_LEVELS), (cfg.num_experts,), generator=gen)]

    def triton_router(logits, bias):
        return router_topk(logits.to(device), cfg.num_topk, cfg.scoring, None if bias is None else bias.to(device),
                           cfg.num_groups, cfg.num_topk_groups, cfg.renormalize, cfg.routed_scaling_factor,
                           group_score=cfg.group_score)

    ids, weights = triton_router(logits_TE, bias_E)
    torch_ids, torch_weights = select_experts(logits_TE, cfg.num_topk, cfg.scoring, bias_E, cfg.num_groups,
                                              cfg.num_topk_groups, cfg.renormalize, cfg.routed_scaling_factor,
                                              group_score=cfg.group_score)
    expert_ties = group_ties = 0
    for t in range(logits_TE.shape[0]):
        expected, select, group_scores = lowest_id_topk(logits_TE[t], bias_E, cfg)
        assert min_gap_between_distinct(select) > 1e-3 and min_gap_between_distinct(group_scores) > 1e-3, \
            f"row {t}: near ties in the crafted data"
        expert_ties += len(set(select)) < len(select)
        group_ties += len(set(group_scores)) < len(group_scores)
        assert ids[t].tolist() == torch_ids[t].tolist() == expected, \
            f"{name} row {t}: triton {ids[t].tolist()} torch {torch_ids[t].tolist()} rule {expected}"
    assert expert_ties == logits_TE.shape[0] and (cfg.num_groups == 1 or group_ties > 5), (expert_ties, group_ties)
    assert_close(weights, torch_weights, torch.float32, name=name)

    all_tied, _ = triton_router(torch.zeros(2, cfg.num_experts), None if bias_E is None else torch.zeros_like(bias_E))
    assert all_tied.tolist() == [list(range(cfg.num_topk))] * 2, all_tied

    shifted_ids, shifted_weights = triton_router(logits_TE[5:], bias_E)
    assert torch.equal(shifted_ids, ids[5:]) and rows_with_other_bits(shifted_weights, weights[5:]) == 0


# --- the layer --------------------------------------------------------------------------------------------------------
def test_layer_a_token_alone_equals_the_token_in_a_batch_of_17(device, grouped_launches):
    """``MegaMoE(..., experts_backend='triton', batch_invariant=True)`` (the interpreter tier's Triton grouped MLP on
    the forced tiles; the gate GEMM on the CPU twin's fixed row blocks), fp32 (no output rounding to bf16 hides a
    difference in the last bits of the sums): tokens 0, 6, 11 and 16 alone give the bits they have inside a batch
    of 17."""
    dtype = torch.float32
    moe = MegaMoE("tiny-kimi-k2", seed=0, dtype=dtype, device=device, experts_backend="triton",
                  batch_invariant=True, num_max_tokens_per_rank=32)
    assert moe.options.experts_backend == "triton" and moe.options.batch_invariant
    x = randn(17, moe.cfg.hidden_size, dtype=dtype, device=device, seed=30)
    with torch.no_grad():
        batch = moe(x)
        for i in (0, 6, 11, 16):
            assert rows_with_other_bits(moe(x[i:i + 1]), batch[i:i + 1]) == 0, f"token {i} alone, {dtype}"
    assert_mode_tiles(grouped_launches, "fp32", device)
