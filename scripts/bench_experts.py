#!/usr/bin/env python
"""Benchmark the expert MLP backends on one GPU at per-rank EP8 shapes (needs CUDA).

    python scripts/bench_experts.py [--quick] [--out results/bench_experts.json] [--include-deep-gemm]
                                    [--peer-search {none,small,full}] [--peer-wheel .whl/sglang-0.5.23-....whl ...]

Shapes (per rank at EP8): Kimi-K2 48 local experts, D 7168, F 2048 (top-8); Step3 48 experts, D 7168,
F 5120 (top-3). Routed rows 64 / 512 / 4096 / 32768 spread randomly (multinomial, uniform) over the
experts; the 128-aligned pool (DeepGEMM's, the peers', grouped_mlp's) puts each expert segment at a 128-aligned row,
the API rows get the pool of their backend's segment alignment, the torch baselines the same rows packed.

Paths per case (every JSON row carries `label`: what it times, `timing`: how, `tuned`, and for a peer `config`):
    api_triton_bf16 / api_triton_fp8  moe_ref through the public API: make_experts("triton"[, fp8=True]) called on
                    the pool the layer builds for that backend (segments aligned to
                    experts_class("triton").segment_alignment, i.e. 1: no padding rows) with the static rows hint
                    of the device-side dispatch (ExpertLayout.num_rows_hint); fp8: the FP8 pool as dispatched
    api_triton_bf16_nohint / api_triton_fp8_nohint  the same without the hint (the backend reads the row count:
                    a host sync per call)
    api_deep_gemm_{bf16,fp8}[_nohint]  with --include-deep-gemm where deep_gemm runs: make_experts("deep_gemm"[,
                    fp8=True]) the same way, on its own pool (128-aligned segments): the whole MLP as the layer runs it
    api_auto_{bf16,fp8}[_nohint]  the same with make_experts("auto"): the backend moe_ref/experts/auto_table.json
                    picks for the call's regime, on the pool auto plans (the layer's default backend)
    graph_api_*     with --graph: an api_ row (rows hint) captured once in a CUDA graph and replayed (GPU work only,
                    as a layer's replayed eager call and a captured decode step run it)
    triton_bf16 / triton_fp8  moe_ref.kernels.experts.grouped_mlp direct on the 128-aligned pool
    grouped_mm_bf16 torch grouped GEMM (offs = cumulative ends, w.transpose(-2, -1)) + torch SiLU-and-mul
    loop_bf16       torch per-expert loop (host-side counts, no sync inside the timed region)
    deep_gemm_*     optional (--include-deep-gemm; none unless `deep_gemm` runs here), on the 128-aligned pool,
                    `moe_ref.experts.deep_gemm.bench`:
      deep_gemm_{bf16,fp8}, deep_gemm_masked_{bf16,fp8}  "whole MLP": GEMM1, activation (+ per-128 FP8
                    quantization of h), GEMM2; fp8 from the FP8 pool as dispatched; masked: the pool's segments
                    copied once, outside the timed region, into [e, M, D] (left out, with a note, when the masked
                    API is missing)
      deep_gemm_kernels_{bf16,fp8}, deep_gemm_masked_kernels_{bf16,fp8}  "kernels only", as DeepGEMM's tests call
                    them: the two grouped GEMMs on inputs quantized once outside the timed region (x and h, their
                    scales laid out once with deep_gemm.get_mn_major_tma_aligned_tensor); timed by the profiler
                    (GPU kernel time, L2 flushed by a fill whose kernel is not counted)
    peer_<engine>_{bf16,fp8}  the Triton fused-MoE kernels SGLang and vLLM ship (`scripts/peer_moe.py`: read out of
                    the files given by --peer-wheel, repeatable, default every peer file in .whl/: the SGLang wheel
                    and the vLLM fused-moe zip, `make peers`; rows left out with a note when there is none) on our
                    pool "as shipped": the engine's tuned H200 config for (E, F) or, where the wheel has none, its
                    default rule (the rows of before; `--peer-search none` gives only these)
    peer_<engine>_tuned_{bf16,fp8}  the same kernels "tuned": the fastest config of the engine's OWN tuner space
                    for the exact shape (SGLang tuning_fused_moe_triton.py, vLLM benchmark_moe.py; reproduced and
                    cited in peer_moe.py, `tuner_space`), one config for both GEMMs as both tuners time it, pruned to
                    what can run (`pruned_space`: shared memory, vLLM FP8 BLOCK_SIZE_K duplicates).
                    --peer-search small (default): <= 50 configs per engine, dtype and shape, in two stages
                    (`peer_moe.search_config`); full: every runnable config (1248 for bf16; hours). Each config is
                    checked against our twin and timed briefly; search time is excluded from every row (it is in
                    results["peer"]["searches"]); the winner is then timed like every other row.
    Peer routing inputs (sorted_token_ids, expert_ids) are built once outside the timed region: a peer's timing
    excludes its align step, as ours excludes the dispatch.
    Every peer_* and deep_gemm_* row is checked once per case against our twin (calc_diff, the limits of the small
    check) on its first call, before timing; a row that fails is left out with the reason.

The JSON's env records torch, triton, the peer files (wheel / fused-moe zip names: their versions), the deep_gemm
version and the peer search mode.

On one H200 (from the repository root, `make peers` run beforehand here: .whl/ travels with the tree):
    python scripts/peer_moe.py --check
    python scripts/bench_experts.py --quick --peer-search small --out results/bench_experts_quick.json
    python scripts/bench_experts.py --include-deep-gemm --peer-search small --models kimi-k2 \
        --out results/bench_experts_kimi.json
    python scripts/bench_experts.py --include-deep-gemm --peer-search small --models step3 \
        --out results/bench_experts_step3.json
(`--peer-search full --models kimi-k2 --rows 32768` for one exhaustive point; `--peer-search none` for the rows of
before.)

Also measured in the same run: HBM bandwidth (a 2 GiB device-to-device copy, read + write bytes) and the
bf16 GEMM peak (torch.matmul 8192^3). Per case: us | TFLOP/s | weight GB/s | x vs grouped_mm |
fraction of roofline, where roofline time = max(bytes moved / HBM bandwidth, FLOPs / peak) with bytes =
weights of the experts that got rows + activations (x, h written and read, y), and peak = the measured
bf16 peak (x2 for fp8, an estimate). Writes JSON, a markdown table and (if matplotlib imports) a PNG.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moe_ref.experts import ExpertLayout  # noqa: E402
from moe_ref.kernels.experts.fp8 import quantize_fp8_per_block_128  # noqa: E402
from moe_ref.testing import calc_diff, graphed  # noqa: E402

ALIGN = 128
MODELS = {  # name -> (local experts e, hidden D, intermediate F, top-k)
    "kimi-k2": (48, 7168, 2048, 8),
    "step3": (48, 7168, 5120, 3),
}
ROWS = (64, 512, 4096, 32768)
QUICK_ROWS = (64, 4096)


@dataclasses.dataclass
class Case:
    """One benchmark case: a model's expert weights and a routed-row layout."""

    model: str
    num_rows: int                # routed rows (sum over experts)
    counts: list[int]            # rows per local expert
    x_PDx: torch.Tensor           # [R, D] bf16 aligned pool (padding rows zero)
    row_start_e: torch.Tensor    # [e] int64
    num_rows_e: torch.Tensor     # [e] int32
    x_packed: torch.Tensor       # [num_rows, D] bf16, the same rows without padding
    gate_up: torch.Tensor        # [e, 2F, D] bf16
    down: torch.Tensor           # [e, D, F] bf16
    fp8: dict | None = None      # quantized inputs for the fp8 path
    pools: dict = dataclasses.field(default_factory=dict)  # alignment -> Pool (`_pool`)
    path_pools: dict = dataclasses.field(default_factory=dict)  # path name -> the Pool it runs on (default: ALIGN)


@dataclasses.dataclass
class Pool:
    """The case's routed rows laid out as a backend's pool: segments starting on multiples of `alignment`
    (`ExpertLayout.from_counts`), padding rows zero; the FP8 pool (e4m3 rows + per-128 scales) beside it. A masked
    pool (`masked_rows` = M > 0) holds expert i's rows at i * M (scripts/tune_experts_auto.py builds those)."""

    alignment: int
    x_PDx: torch.Tensor
    row_start_e: torch.Tensor
    num_rows_e: torch.Tensor
    x_fp8: torch.Tensor | None = None
    x_scale: torch.Tensor | None = None
    masked_rows: int = 0


# ------------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------------
def _layout(counts: list[int], device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(row_start_e int64, num_rows_e int32, pool rows): segments packed by ``ExpertLayout.from_counts``."""
    layout = ExpertLayout.from_counts(torch.tensor(counts, dtype=torch.int64), ALIGN)
    return (layout.row_start_e.to(device), layout.num_rows_e.to(device=device, dtype=torch.int32),
            max(layout.num_pool_rows, ALIGN))


def _pool(case: Case, alignment: int) -> Pool:
    """The case's rows in a pool with segments aligned to `alignment` (built once per case and alignment; the
    ALIGN pool is the case's own)."""
    if alignment not in case.pools:
        if alignment == ALIGN:
            pool = Pool(ALIGN, case.x_PDx, case.row_start_e, case.num_rows_e)
        else:
            layout = ExpertLayout.from_counts(torch.tensor(case.counts, dtype=torch.int64), alignment)
            device = case.x_PDx.device
            num_pool_rows = max(layout.num_pool_rows, 1)
            x_PDx = case.x_PDx.new_zeros(num_pool_rows, case.x_PDx.shape[1])
            valid = ExpertLayout(layout.row_start_e, layout.num_rows_e, num_pool_rows, alignment).row_expert_P() >= 0
            x_PDx[valid.to(device)] = case.x_packed
            pool = Pool(alignment, x_PDx, layout.row_start_e.to(device),
                        layout.num_rows_e.to(device=device, dtype=torch.int32))
        if case.fp8 is not None:
            if alignment == ALIGN:
                pool.x_fp8, pool.x_scale = case.fp8["x"], case.fp8["x_scale"]
            else:
                from moe_ref.kernels.ep.pre_dispatch import quantize_fp8_per_128

                pool.x_fp8, pool.x_scale = quantize_fp8_per_128(pool.x_PDx)
        case.pools[alignment] = pool
    return case.pools[alignment]


def _segment_rows(row_start_e: torch.Tensor, num_rows_e: torch.Tensor, pool_rows: int) -> torch.Tensor:
    """``[P]`` bool: True on the pool rows inside an expert's segment."""
    return ExpertLayout(row_start_e, num_rows_e, pool_rows, ALIGN).row_expert_P() >= 0


def _routed_counts(model: str, num_rows: int, seed: int) -> list[int]:
    """Rows per local expert of a case: `num_rows` routed rows spread randomly (uniform) over the model's experts
    (CPU generator, so a dry run gets the counts the GPU run uses)."""
    num_experts = MODELS[model][0]
    gen = torch.Generator().manual_seed(seed + num_rows)
    picks = torch.randint(0, num_experts, (num_rows,), generator=gen)
    return torch.bincount(picks, minlength=num_experts).tolist()


def _make_case(model: str, num_rows: int, weights: tuple, seed: int, with_fp8: bool, device="cuda") -> Case:
    hidden = MODELS[model][1]
    counts = _routed_counts(model, num_rows, seed)
    row_start_e, num_rows_e, pool_rows = _layout(counts, device)
    x_packed = torch.randn(num_rows, hidden, device=device).bfloat16()
    x_PDx = torch.zeros(pool_rows, hidden, dtype=torch.bfloat16, device=device)
    offset = 0
    for start, count in zip(row_start_e.tolist(), counts):
        x_PDx[start:start + count] = x_packed[offset:offset + count]
        offset += count
    case = Case(model, num_rows, counts, x_PDx, row_start_e, num_rows_e, x_packed, *weights[:2])
    if with_fp8:
        from moe_ref.kernels.ep.pre_dispatch import quantize_fp8_per_128

        x_fp8, x_scale = quantize_fp8_per_128(x_PDx)
        case.fp8 = dict(x=x_fp8, x_scale=x_scale, gate_up=weights[2], gate_up_scale=weights[3],
                        down=weights[4], down_scale=weights[5])
    return case


def _make_weights(num_experts: int, hidden: int, inter: int, with_fp8: bool, device="cuda") -> tuple:
    """bf16 gate_up [e, 2F, D] and down [e, D, F] (+ fp8 copies with block scales)."""
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, device=device) / hidden**0.5).bfloat16()
    down = (torch.randn(num_experts, hidden, inter, device=device) / inter**0.5).bfloat16()
    if not with_fp8:
        return gate_up, down, None, None, None, None
    return (gate_up, down, *quantize_fp8_per_block_128(gate_up), *quantize_fp8_per_block_128(down))


# ------------------------------------------------------------------------------------------------
# paths
# ------------------------------------------------------------------------------------------------
def _grouped_mm_fn():
    fn = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None:
        return None
    return lambda a, b, offs: fn(a, b, offs=offs)


_API_EXPERTS: dict = {}  # (backend, id of the bf16 weights, fp8) -> the Experts object (built once per model)
API_BACKENDS = ("triton",)  # the moe_ref backends timed through the public API


def api_layout(pool: Pool, num_rows_hint: int | None) -> ExpertLayout:
    """The layout ``ModularRoutedStep`` hands the experts for `pool`: with the static rows hint of the device-side
    dispatch (rows outside every segment then left unwritten), or None: without (the backend counts the rows, a host
    sync, and zeroes the other rows)."""
    return ExpertLayout(pool.row_start_e, pool.num_rows_e, pool.x_PDx.shape[0], pool.alignment,
                        num_rows_hint=num_rows_hint, zero_unused_rows=num_rows_hint is None,
                        masked_rows=pool.masked_rows)


def api_call(experts, pool: Pool, layout: ExpertLayout, fp8: bool) -> Callable[[], torch.Tensor]:
    """``experts`` called as the routed step calls it on `pool`: the FP8 pool as dispatched (fp8 rows + scales) for
    fp8 experts, else the activation-dtype rows."""
    if fp8:
        return functools.partial(experts, pool.x_fp8, layout, pool.x_scale)
    return functools.partial(experts, pool.x_PDx, layout)


def _api_paths(case: Case, backends=API_BACKENDS) -> list[tuple[str, Callable[[], object]]]:
    """The public ``Experts`` path, as ``ModularRoutedStep`` calls it after the device-side dispatch: each backend
    on the pool the layer builds for it (segments aligned to ``experts_class(name).segment_alignment``), with the
    static rows hint the device-side dispatch passes (``ExpertLayout.num_rows_hint``, no host sync) and without it
    (``_nohint``: the backend reads the row count, a host sync per call); fp8: the FP8 pool as dispatched."""
    from moe_ref.experts import experts_class, make_experts

    paths = []
    for backend in backends:
        cls = experts_class(backend, case.x_PDx.device)
        pool = _pool(case, cls.segment_alignment)
        layouts = {"": api_layout(pool, case.num_rows), "_nohint": api_layout(pool, None)}
        for fp8 in (False, True) if case.fp8 is not None and cls.supports_fp8 else (False,):
            key = (backend, id(case.gate_up), fp8)
            if key not in _API_EXPERTS:
                _API_EXPERTS[key] = make_experts(backend, case.gate_up, case.down, "silu", fp8=fp8)
            experts = _API_EXPERTS[key]
            for suffix, layout in layouts.items():
                name = f"api_{backend}_{'fp8' if fp8 else 'bf16'}{suffix}"
                case.path_pools[name] = pool
                paths.append((name, api_call(experts, pool, layout, fp8)))
    return paths


def _paths(case: Case, include_deep_gemm: bool) -> list[tuple[str, Callable[[], object]]]:
    from moe_ref.kernels.experts.grouped_mlp import grouped_mlp

    api_backends = API_BACKENDS + (("deep_gemm", "auto") if include_deep_gemm and _deep_gemm_usable() else ())
    paths = _api_paths(case, api_backends) + [("triton_bf16", lambda: grouped_mlp(case.x_PDx, case.gate_up, case.down, case.row_start_e,
                                                 case.num_rows_e, num_rows_hint=case.num_rows))]
    if case.fp8 is not None:
        q = case.fp8
        paths.append(("triton_fp8", lambda: grouped_mlp(
            q["x"], q["gate_up"], q["down"], case.row_start_e, case.num_rows_e, x_scale_PDb=q["x_scale"],
            gate_up_scale=q["gate_up_scale"], down_scale=q["down_scale"], num_rows_hint=case.num_rows)))
    run_grouped_mm = _grouped_mm_path(case)
    if run_grouped_mm is not None:
        paths.append(("grouped_mm_bf16", run_grouped_mm))
    inter = case.down.shape[2]
    bounds = [0]
    for count in case.counts:
        bounds.append(bounds[-1] + count)

    def run_loop():
        y = torch.empty_like(case.x_packed)
        for i, count in enumerate(case.counts):
            if count == 0:
                continue
            x = case.x_packed[bounds[i]:bounds[i + 1]]
            gate_up = x @ case.gate_up[i].T
            y[bounds[i]:bounds[i + 1]] = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ case.down[i].T
        return y

    paths.append(("loop_bf16", run_loop))
    if include_deep_gemm:
        paths.extend(_deep_gemm_cases(case))
    return paths


def selected(name: str, paths: str | None) -> bool:
    """Whether row ``name`` is timed under ``--paths`` (a comma list of names or name prefixes; None: every row)."""
    return paths is None or any(name.startswith(prefix) for prefix in paths.split(","))


def _deep_gemm_usable() -> bool:
    from moe_ref.experts.deep_gemm.probe import deep_gemm_status

    return deep_gemm_status().available


def _grouped_mm_path(case: Case) -> Callable[[], torch.Tensor] | None:
    """The `grouped_mm_bf16` path: torch grouped GEMM (offs = cumulative ends, w.transpose(-2, -1)) + torch
    SiLU-and-mul on the case's packed rows, returning y `[num_rows, D]` bf16; None when torch has no grouped_mm."""
    grouped_mm = _grouped_mm_fn()
    if grouped_mm is None:
        return None
    inter = case.down.shape[2]
    offs = torch.tensor(case.counts, device=case.x_PDx.device).cumsum(0).to(torch.int32)
    gate_up_t, down_t = case.gate_up.transpose(-2, -1), case.down.transpose(-2, -1)

    def run_grouped_mm():
        gate_up_N2F = grouped_mm(case.x_packed, gate_up_t, offs)
        h_NF = F.silu(gate_up_N2F[:, :inter]) * gate_up_N2F[:, inter:]
        return grouped_mm(h_NF, down_t, offs)

    return run_grouped_mm


def _deep_gemm_cases(case: Case) -> list[tuple[str, Callable[[], object]]]:
    """DeepGEMM paths for `case` as (name, fn) pairs, contiguous and masked layouts, on the ALIGN (128) pool it
    needs; [] when deep_gemm is not usable here. Whole MLP (`deep_gemm_[masked_]{bf16,fp8}`): GEMM1, activation
    (+ per-128 FP8 quantization of h), GEMM2, the fp8 rows from the FP8 pool as dispatched. Kernels only
    (`deep_gemm_[masked_]kernels_{bf16,fp8}`): the two GEMMs on operands built once (timed by the profiler, kernel
    time only: `_kernel_us`)."""
    from moe_ref.experts.deep_gemm.bench import deep_gemm_grouped_cases, deep_gemm_kernel_cases

    args = (case.x_PDx, case.gate_up, case.down, case.row_start_e, case.num_rows_e)
    options = dict(layouts=("contiguous", "masked"), fp8_options=(False, True) if case.fp8 is not None else (False,),
                   x_fp8=(case.fp8["x"], case.fp8["x_scale"]) if case.fp8 is not None else None)
    return deep_gemm_grouped_cases(*args, **options) + deep_gemm_kernel_cases(*args, **options)


def _load_peers(paths: list[str] | None) -> tuple[list, list[str]]:
    """(PeerKernels, one note per file): the engines' kernels from their wheels or fused-moe zips
    (`scripts/peer_moe.py`); `paths` None: every peer file in .whl/."""
    import peer_moe

    paths = paths or peer_moe.default_peer_files()
    if not paths:
        return [], ["no peer file (.whl/sglang-*.whl, .whl/vllm-*-fused-moe.zip; `make peers` makes them): peer rows "
                    "left out"]
    peers, notes = [], []
    for path in paths:
        try:
            peer = peer_moe.load_peer_kernel(path)
        except Exception as exc:  # noqa: BLE001 - any failure leaves this engine's rows out, with the reason
            notes.append(f"peer rows of {os.path.basename(path)} left out: {exc}")
            continue
        peers.append(peer)
        notes.append(f"peer {peer.label} from {os.path.basename(path)} (kernels imported from {peer.module_file})")
    return peers, notes


def _peer_operands(case: Case, dtype: str) -> tuple[tuple, dict]:
    """(x, gate_up, down) and the FP8 scales a peer runs on: the ALIGN pool (bf16, or the FP8 pool as dispatched
    with the block-quantized weights)."""
    if dtype == "bf16":
        return (case.x_PDx, case.gate_up, case.down), {}
    q = case.fp8
    return ((q["x"], q["gate_up"], q["down"]),
            dict(x_scale=q["x_scale"], gate_up_scale=q["gate_up_scale"], down_scale=q["down_scale"]))


def _peer_search_timer(case: Case, peer, dtype: str, quick: bool):
    """`time_config(config) -> us` for `peer_moe.search_config`: the engine's MLP on this case with `config` for
    both GEMMs (routing built once per BLOCK_SIZE_M, outside the timing), checked once per config against our twin
    (a wrong result counts as a failure), timed with `_bench_us` (short)."""
    from peer_moe import PeerConfig, peer_routing, run_peer_mlp

    operands, scales = _peer_operands(case, dtype)
    routings, twins = {}, {}

    def time_config(config: dict) -> float:
        block_m = config["BLOCK_SIZE_M"]
        if block_m not in routings:
            routings[block_m] = peer_routing(case.row_start_e, case.num_rows_e, case.x_PDx.shape[0], block_m,
                                             peer.engine)
        fn = functools.partial(run_peer_mlp, peer, *operands, case.row_start_e, case.num_rows_e, **scales,
                               config=PeerConfig(dict(config), dict(config), "search", case.num_rows),
                               routing=routings[block_m])
        problem = _twin_check(case, f"search_{dtype}", fn(), twins)
        if problem:
            raise RuntimeError(problem)
        return _bench_us(fn, True, search=True)

    return time_config


def _peer_paths(case: Case, peer, search: str = "none", quick: bool = False, log: dict | None = None
                ) -> list[tuple[str, Callable[[], object], object]]:
    """(name, fn, PeerConfig) per dtype: the engine's expert MLP on our pool "as shipped" (its tuned file or default
    rule: `peer_<engine>_<dtype>`, today's rows) and, unless `search` is "none", "tuned" (the fastest config of its
    own tuner's space for this exact shape, `peer_moe.search_config`: `peer_<engine>_tuned_<dtype>`). Routing inputs
    are built here, once, outside the timed region (the engine's align step is not timed, as our dispatch is not);
    the search runs here too, before any timing (its time is recorded in `log`, not in the rows)."""
    from peer_moe import peer_config, peer_routing, run_peer_mlp, search_config, tuned_peer_config

    num_experts, hidden, inter = case.gate_up.shape[0], case.gate_up.shape[2], case.down.shape[2]
    layout = (case.row_start_e, case.num_rows_e)
    paths = []
    for dtype in ("bf16", "fp8") if case.fp8 is not None else ("bf16",):
        operands, scales = _peer_operands(case, dtype)
        configs = [(f"peer_{peer.engine.name}_{dtype}", peer_config(
            peer.wheel, num_experts, inter, dtype, torch.cuda.get_device_name(), case.num_rows, hidden=hidden))]
        if search != "none":
            start = time.time()
            result = search_config(peer.engine, dtype, search, _peer_search_timer(case, peer, dtype, quick),
                                   max_rows_per_expert=max(case.counts), smem_limit=_smem_limit())
            seconds = time.time() - start
            print(f"  {peer.label} {dtype}: {result.summary()} in {seconds:.0f} s; best {result.best} "
                  f"{result.best_us:.1f} us", flush=True)
            if log is not None:
                log["searches"].append({"model": case.model, "num_rows": case.num_rows, "engine": peer.engine.name,
                                        "dtype": dtype, "mode": search, "seconds": seconds, "best": result.best,
                                        "best_us_in_search": result.best_us, "timed": len(result.timed),
                                        "failed": len(result.failed), "tuner_size": result.tuner_size,
                                        "candidates": result.candidates,
                                        "failures": [f"{c}: {why}" for c, why in result.failed[:5]]})
            configs.append((f"peer_{peer.engine.name}_tuned_{dtype}", tuned_peer_config(peer.engine, result,
                                                                                       case.num_rows)))
        for name, config in configs:
            routing = peer_routing(*layout, case.x_PDx.shape[0], config.block_m, peer.engine)
            paths.append((name, functools.partial(run_peer_mlp, peer, *operands, *layout, **scales, config=config,
                                                  routing=routing), config))
    return paths


def _smem_limit() -> int:
    """The opt-in shared memory per block of this GPU (the search prunes configs over it), SM90's if unknown."""
    from peer_moe import SMEM_LIMIT_SM90

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "shared_memory_per_block_optin", 0) or SMEM_LIMIT_SM90)


def _peer_paths_logged(case: Case, peer, log: dict, search: str = "none", quick: bool = False
                       ) -> list[tuple[str, Callable[[], object], object]]:
    """`_peer_paths`, with each config (and, where the engine falls back to its default rule, the nearest tuned
    files) recorded in `log` (results["peer"]); [] with a note when building them fails."""
    from peer_moe import nearest_tuned

    try:
        paths = _peer_paths(case, peer, search, quick, log)
    except Exception as exc:  # noqa: BLE001 - the peer rows of this case are left out, with the reason
        log["notes"].append(f"{case.model} rows {case.num_rows}: {peer.label} rows left out: {exc}")
        print(f"  {peer.label} rows left out: {exc}", flush=True)
        return []
    for name, _, config in paths:
        log["configs"].append({"model": case.model, "num_rows": case.num_rows, "path": name, "source": config.source,
                               "up": config.up, "down": config.down})
        if config.source.startswith("default rule"):
            tuned = f"{peer.label}: " + nearest_tuned(peer.wheel, case.gate_up.shape[0], case.down.shape[2],
                                                      torch.cuda.get_device_name(), name.rsplit("_", 1)[1])
            if tuned not in log["notes"]:
                print(f"  {tuned}: the engine runs its default tile rule here", flush=True)
                log["notes"].append(tuned)
    return paths


def row_label(path: str, peer_labels: dict | None = None, search: str = "none") -> str:
    """What a row times, in words, for the JSON (`label`) and the markdown."""
    dtype = path.rsplit("_", 1)[-1] if path.endswith(("bf16", "fp8")) else ""
    if path.startswith("graph_"):
        return row_label(path[len("graph_"):], peer_labels, search) + ", captured in a CUDA graph and replayed"
    if path.startswith("api_"):
        backend = path[len("api_"):].removesuffix("_nohint").rsplit("_", 1)[0]  # api_deep_gemm_fp8 -> deep_gemm
        hint = "without the rows hint (host sync)" if path.endswith("_nohint") else "rows hint"
        return f"moe_ref make_experts('{backend}') on its pool (segment_alignment), {hint}"
    if path.startswith("peer_"):
        engine = path.split("_")[1]
        label = (peer_labels or {}).get(engine, engine)
        if "_tuned_" in path:
            return f"{label} fused_moe_kernel, tuned ({search} search of its tuner's space, this shape)"
        return f"{label} fused_moe_kernel, as shipped (tuned file or default rule)"
    if path.startswith("deep_gemm_"):
        layout = "masked" if "_masked" in path else "contiguous"
        if "_kernels_" in path:
            return f"DeepGEMM {layout}: kernels only (2 grouped GEMMs, pre-quantized inputs, profiler kernel time)"
        return f"DeepGEMM {layout}: whole MLP (GEMM1 + act{' + FP8 quant of h' if dtype == 'fp8' else ''} + GEMM2)"
    return {"triton_bf16": "moe_ref kernels.grouped_mlp direct", "triton_fp8": "moe_ref kernels.grouped_mlp direct",
            "grouped_mm_bf16": "torch grouped_mm + SiLU-and-mul (packed rows)",
            "loop_bf16": "torch per-expert loop (packed rows)"}.get(path, path)


def _routed_rows(case: Case, out: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """``[num_rows, D]``: the rows of a path's output that hold routed rows, expert-major (the order of the rows
    inside segments in the pool): a pool-shaped ``[P, D]`` output keeps its rows inside segments, a masked
    ``[e, M, D]`` one the first ``counts[i]`` rows of expert i, a packed ``[num_rows, D]`` one is that already."""
    if out.dim() == 3:
        counts = torch.tensor(case.counts, device=out.device)
        return out[torch.arange(out.shape[1], device=out.device)[None, :] < counts[:, None]]
    pool = case.path_pools.get(name) if name else None
    if pool is not None and out.shape[0] == pool.x_PDx.shape[0]:
        return out[_segment_rows(pool.row_start_e, pool.num_rows_e, pool.x_PDx.shape[0]).to(out.device)]
    if out.shape[0] == case.x_PDx.shape[0]:
        return out[_segment_rows(case.row_start_e, case.num_rows_e, case.x_PDx.shape[0])]
    return out


def _checked_first_call(case: Case, name: str, fn: Callable[[], object], twins: dict):
    """(output, problem): an anchor's first call (compiles, outside the timed region) and its check."""
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - e.g. a compile error on this Triton
        return None, f"{type(exc).__name__}: {str(exc)[:300]}"
    return out, _twin_check(case, name, out, twins)


def _twin_check(case: Case, name: str, out: torch.Tensor, twins: dict) -> str | None:
    """Why the output `out` of path `name` is wrong vs our twin on the routed rows (None if it is right)."""
    from moe_ref.kernels.experts.grouped_mlp import grouped_mlp_ref

    fp8 = name.endswith("fp8")
    if fp8 not in twins:  # one twin per case and dtype
        args = (case.row_start_e, case.num_rows_e)
        if fp8:
            q = case.fp8
            twins[fp8] = grouped_mlp_ref(q["x"], q["gate_up"], q["down"], *args, x_scale_PDb=q["x_scale"],
                                         gate_up_scale=q["gate_up_scale"], down_scale=q["down_scale"])
        else:
            twins[fp8] = grouped_mlp_ref(case.x_PDx, case.gate_up, case.down, *args)
    got = _routed_rows(case, out, name).float()
    if got.isnan().any():
        return "NaN in the routed rows"
    diff, limit = calc_diff(got, _routed_rows(case, twins[fp8]).float()), 1e-3 if fp8 else 1e-4
    return None if diff < limit else f"calc_diff {diff:.2e} vs our twin (limit {limit:.0e})"


# ------------------------------------------------------------------------------------------------
# measurement
# ------------------------------------------------------------------------------------------------
def _bench_us(fn: Callable[[], object], quick: bool, search: bool = False) -> float:
    import triton.testing

    # do_bench flushes L2 before every repetition and returns the median in ms (warmup/rep in ms of GPU time);
    # a search times each config shorter still
    warmup, rep = (5, 20) if search else (10, 50) if quick else (25, 200)
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3


def time_rounds(paths: list[tuple[str, Callable[[], object]]], rounds: int,
                time_path: Callable[[str, Callable[[], object]], tuple[float, str]]
                ) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Time every path ``rounds`` times, every other round in reverse order, so that a GPU slowing down (or warming up)
    over the run favours no path. Returns ({name: us of each round}, {name: how it was timed}); a row takes the
    fastest round. Example: paths a, b and 3 rounds run a b, b a, a b."""
    per_round: dict[str, list[float]] = {name: [] for name, _ in paths}
    timing_of: dict[str, str] = {}
    for round_index in range(rounds):
        for name, fn in paths if round_index % 2 == 0 else paths[::-1]:
            us, timing_of[name] = time_path(name, fn)
            per_round[name].append(us)
    return per_round, timing_of


def _time_path(name: str, fn: Callable[[], object], quick: bool) -> tuple[float, str]:
    """(us per call, how it was timed) of one path: DeepGEMM's kernels-only rows by the profiler's kernel time, every
    other row by `_bench_us`."""
    if "_kernels_" not in name:
        return _bench_us(fn, quick), "do_bench median (L2 flushed)"
    try:
        us, kernels = _kernel_us(fn, quick)
        return us, f"profiler kernel time, L2 flushed ({', '.join(kernels)[:200]})"
    except Exception as exc:  # noqa: BLE001 - no profiler: say so and time the call
        return _bench_us(fn, quick), f"do_bench median (the profiler failed: {type(exc).__name__}: {str(exc)[:100]})"


def _kernel_us(fn: Callable[[], object], quick: bool) -> tuple[float, list[str]]:
    """(us per call, kernel names): the GPU time of the kernels `fn` launches, from the profiler (as DeepGEMM's own
    tests time its kernels), L2 flushed before each call by a 256 MB fill whose kernel is not counted."""
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    calls = 10 if quick else 30
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    flush.zero_()  # the fill kernel's name, to leave it out
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    total, names = 0.0, set()
    for event in prof.events():
        if str(getattr(event, "device_type", "")).endswith("CUDA") and "fill" not in event.name.lower():
            total += event.time_range.elapsed_us()  # a device event's own span: the kernel's run time
            names.add(event.name)
    if not names:
        raise RuntimeError("the profiler saw no kernel of the call")
    return total / calls, sorted(names)


def kernel_table(fn: Callable[[], object], calls: int = 10) -> tuple[dict[str, float], float, dict[str, list[float]]]:
    """Where a row's time goes (``--kernel-table``; torch profiler, ``calls`` calls back to back, no L2 flush):
    ``gpu_kernels``'s kernels and GPU span from a profile of the GPU, then ``runtime_calls`` from a second profile with
    the CPU recorded too."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    profiles = []
    for activities in ([ProfilerActivity.CUDA], [ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        with profile(activities=activities) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        profiles.append(prof.events())
    return (*gpu_kernels(profiles[0], calls), runtime_calls(profiles[1], calls))


def _device(event) -> str:
    return str(getattr(event, "device_type", "")).rsplit(".", 1)[-1]  # DeviceType.CUDA -> CUDA


def gpu_kernels(events, calls: int) -> tuple[dict[str, float], float]:
    """``({kernel name: GPU us per call}, GPU span us per call)`` of a profile's CUDA events over ``calls`` calls.

    Kernels come largest first. The span runs from the first kernel's start to the last one's end, divided by
    ``calls``. What it holds beyond the kernels' sum is the GPU waiting between them, for the host or for a copy.

    Example: two calls, kernels A at [0, 10) and [30, 40), B at [10, 20) and [40, 50) us ->
    ({"A": 10.0, "B": 10.0}, 25.0): 20 us of kernels per call in a 25 us span.
    """
    table: dict[str, float] = {}
    starts, ends = [], []
    for event in events:
        if _device(event) == "CUDA":
            table[event.name] = table.get(event.name, 0.0) + event.time_range.elapsed_us() / calls
            starts.append(event.time_range.start)
            ends.append(event.time_range.end)
    span = (max(ends) - min(starts)) / calls if starts else 0.0
    return {name: round(us, 1) for name, us in sorted(table.items(), key=lambda item: -item[1])}, round(span, 1)


def runtime_calls(events, calls: int) -> dict[str, list[float]]:
    """``{CUDA runtime/driver call: [calls per call, host us per call]}`` of a profile's CPU events over ``calls``
    calls, most host time first. A ``cudaFree``, ``cudaMalloc``, ``cudaStreamSynchronize`` or ``cudaMemcpy`` in an
    eager call is where its host can wait on the GPU. The profile's own closing ``cudaDeviceSynchronize`` is left out.
    """
    found: dict[str, list[float]] = {}
    for event in events:
        if _device(event) == "CPU" and event.name.startswith("cu") and event.name != "cudaDeviceSynchronize":
            entry = found.setdefault(event.name, [0.0, 0.0])
            entry[0] += 1 / calls
            entry[1] += event.time_range.elapsed_us() / calls
    return {name: [round(n, 2), round(us, 1)] for name, (n, us) in sorted(found.items(), key=lambda item: -item[1][1])}


def measure_anchors(quick: bool) -> dict:
    """HBM copy bandwidth (read + write) and bf16 matmul peak, measured now on this GPU."""
    numel = (2 << 30) // 2
    src = torch.empty(numel, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    copy_us = _bench_us(lambda: dst.copy_(src), quick)
    del src, dst
    a = torch.randn(8192, 8192, device="cuda").bfloat16()
    b = torch.randn(8192, 8192, device="cuda").bfloat16()
    gemm_us = _bench_us(lambda: a @ b, quick)
    del a, b
    return {"hbm_bytes_per_s": 2 * numel * 2 / (copy_us * 1e-6), "bf16_flops_per_s": 2 * 8192**3 / (gemm_us * 1e-6),
            "copy_us": copy_us, "gemm_8192_us": gemm_us}


def _case_metrics(case: Case, path: str, us: float, anchors: dict) -> dict:
    hidden, inter = case.gate_up.shape[2], case.down.shape[2]
    active = sum(1 for c in case.counts if c > 0)
    fp8 = "fp8" in path.split("_")  # api_triton_fp8, api_auto_fp8_nohint, graph_api_auto_fp8, peer_vllm_tuned_fp8
    weight_bytes = active * 3 * inter * hidden * (1 if fp8 else 2)
    act_bytes = case.num_rows * (hidden * 2 + inter * 2 * 2 + hidden * 2)  # x, h (w + r), y
    flops = 6 * case.num_rows * hidden * inter
    peak = anchors["bf16_flops_per_s"] * (2 if fp8 else 1)
    roofline_s = max((weight_bytes + act_bytes) / anchors["hbm_bytes_per_s"], flops / peak)
    return {"us": us, "tflops": flops / (us * 1e-6) / 1e12, "weight_gbps": weight_bytes / (us * 1e-6) / 1e9,
            "roofline_fraction": roofline_s / (us * 1e-6), "bound": "memory" if
            (weight_bytes + act_bytes) / anchors["hbm_bytes_per_s"] > flops / peak else "compute"}


def check_correctness(include_deep_gemm: bool, device="cuda") -> list[str]:
    """Every path vs grouped_mlp_ref at one small case (calc_diff limits: bf16 1e-4; fp8 1e-3 vs the fp8 twin)."""
    from moe_ref.kernels.experts.grouped_mlp import grouped_mlp_ref

    torch.manual_seed(0)
    counts = [3, 0, 130, 64]
    weights = _make_weights(4, 512, 256, True, device)
    row_start_e, num_rows_e, pool_rows = _layout(counts, device)
    x_packed = torch.randn(sum(counts), 512, device=device).bfloat16()
    x_PDx = torch.zeros(pool_rows, 512, dtype=torch.bfloat16, device=device)
    valid = _segment_rows(row_start_e, num_rows_e, pool_rows)
    x_PDx[valid] = x_packed
    case = Case("small", sum(counts), counts, x_PDx, row_start_e, num_rows_e, x_packed, *weights[:2])
    from moe_ref.kernels.ep.pre_dispatch import quantize_fp8_per_128

    x_fp8, x_scale = quantize_fp8_per_128(x_PDx)
    case.fp8 = dict(x=x_fp8, x_scale=x_scale, gate_up=weights[2], gate_up_scale=weights[3], down=weights[4],
                    down_scale=weights[5])
    ref = grouped_mlp_ref(x_PDx, case.gate_up, case.down, row_start_e, num_rows_e)[valid]
    ref_fp8 = grouped_mlp_ref(x_fp8, weights[2], weights[4], row_start_e, num_rows_e, x_scale_PDb=x_scale,
                              gate_up_scale=weights[3], down_scale=weights[5])[valid]
    failures = []
    for name, fn in _paths(case, include_deep_gemm):
        diff = calc_diff(_routed_rows(case, fn(), name), ref_fp8 if "fp8" in name else ref)  # fp8 paths vs the fp8 twin
        limit = 1e-3 if "fp8" in name else 1e-4
        status = "ok" if diff < limit else "FAIL"
        print(f"  check {name:22s} calc_diff={diff:.2e} (limit {limit:.0e}) {status}", flush=True)
        if status != "ok":
            failures.append(name)
    return failures


# ------------------------------------------------------------------------------------------------
# reporting
# ------------------------------------------------------------------------------------------------
def _markdown(results: dict) -> str:
    anchors = results["anchors"]
    lines = [f"# bench_experts ({results['env']['gpu']}, torch {results['env']['torch']}, "
             f"triton {results['env']['triton']})", "",
             f"HBM copy: {anchors['hbm_bytes_per_s'] / 1e12:.2f} TB/s; bf16 matmul 8192^3: "
             f"{anchors['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s", "",
             _versions_line(results["env"]), "",
             f"Peer search: {results['env'].get('peer_search', 'none')} (rows `peer_*_tuned_*` run the fastest config of "
             "the engine's own tuner space found for that exact shape; rows `peer_<engine>_<dtype>` run it as shipped; "
             "search time is not in any row). DeepGEMM rows say \"kernels only\" (profiler kernel time of its two "
             "grouped GEMMs on pre-quantized inputs) or \"whole MLP\".", "",
             "| model | rows | path | what | us | TFLOP/s | weight GB/s | x vs grouped_mm | roofline frac | bound |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---|"]
    for row in results["cases"]:
        speedup = f"{row['x_vs_grouped_mm']:.2f}" if row.get("x_vs_grouped_mm") else "-"
        what = row.get("label", "") + (f" `{_short_config(row['config'])}`" if row.get("config") else "")
        lines.append(f"| {row['model']} | {row['num_rows']} | {row['path']} | {what} | {row['us']:.1f} | "
                     f"{row['tflops']:.1f} | {row['weight_gbps']:.0f} | {speedup} | {row['roofline_fraction']:.2f} | "
                     f"{row['bound']} |")
    peer = results.get("peer")
    if peer:
        lines += [""] + [f"{note}." for note in peer["loaded"]]
        if peer.get("configs"):
            lines.append("A peer's timing excludes its align step (routing inputs built once outside the timed "
                         "region), as ours excludes the dispatch. Their tile configs:")
            rows_of = {}  # one line per (model, path, config) with the row counts that use it
            for c in peer["configs"]:
                key = (c["model"], c["path"], c["source"], str(c["up"]), str(c["down"]))
                rows_of.setdefault(key, []).append(str(c["num_rows"]))
            lines += [f"- {model} {path} rows {'/'.join(rows)}: {source}: up {up}, down {down}"
                      for (model, path, source, up, down), rows in rows_of.items()]
        lines += [f"- {note}" for note in peer.get("notes", [])]
    return "\n".join(lines) + "\n"


def _short_config(config: dict) -> str:
    """`BM/BN/BK/GM w s` of a peer row's GEMM1 config (GEMM2's too when it differs)."""
    def one(c):
        return (f"{c.get('BLOCK_SIZE_M')}/{c.get('BLOCK_SIZE_N')}/{c.get('BLOCK_SIZE_K')}/{c.get('GROUP_SIZE_M')} "
                f"w{c.get('num_warps')} s{c.get('num_stages')}")

    up, down = one(config["up"]), one(config["down"])
    return up if up == down else f"up {up}, down {down}"


def _versions_line(env: dict) -> str:
    peers = ", ".join(env.get("peer_files", [])) or "none"
    return (f"Versions: torch {env.get('torch')}, triton {env.get('triton')}, deep_gemm {env.get('deep_gemm')}, "
            f"peer files {peers}.")


def make_row(case: Case, name: str, us: float, anchors: dict, *, config=None, search: str = "none",
             peer_labels: dict | None = None, timing: str = "do_bench median (L2 flushed)") -> dict:
    """One JSON row: the metrics, what the row times (`label`), how it was timed, and for a peer its config."""
    row = {"model": case.model, "num_rows": case.num_rows, "path": name, "label": row_label(name, peer_labels, search),
           "tuned": "_tuned_" in name, "timing": timing, **_case_metrics(case, name, us, anchors)}
    if config is not None:
        row["config"] = {"up": config.up, "down": config.down, "source": config.source}
    return row


def versions(peers: list) -> dict:
    """What ran: the peer files (wheel or fused-moe zip names) and the deep_gemm version (None when absent)."""
    try:
        from moe_ref.experts.deep_gemm.probe import deep_gemm_status

        status = deep_gemm_status()
        deep_gemm = status.version if status.available else f"unavailable ({status.reason[:120]})"
    except Exception as exc:  # noqa: BLE001 - informational
        deep_gemm = f"unknown ({exc!r})"
    return {"peer_files": [os.path.basename(peer.wheel) for peer in peers], "deep_gemm": deep_gemm}


def _plot(results: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        print("matplotlib not available: no plot", flush=True)
        return
    models = sorted({row["model"] for row in results["cases"]})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = [r for r in results["cases"] if r["model"] == model]
        for name in sorted({r["path"] for r in rows}):
            points = sorted((r["num_rows"], r["tflops"]) for r in rows if r["path"] == name)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        ax.axhline(results["anchors"]["bf16_flops_per_s"] / 1e12, color="gray", linestyle="--", label="bf16 peak")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("routed rows")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(model)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", flush=True)


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="kimi-k2 only, rows 64 and 4096, short timing")
    parser.add_argument("--out", default="results/bench_experts.json")
    parser.add_argument("--models", default=None, help=f"comma list of {sorted(MODELS)}")
    parser.add_argument("--rows", default=None, help="comma list of routed row counts")
    parser.add_argument("--no-fp8", action="store_true")
    parser.add_argument("--include-deep-gemm", action="store_true")
    parser.add_argument("--peer-wheel", action="append", default=None,
                        help="an engine's wheel or fused-moe zip to read a peer kernel from, repeatable (default: "
                             "every peer file in .whl/, one per engine)")
    parser.add_argument("--peer-search", choices=("none", "small", "full"), default="small",
                        help="also time each peer with the fastest config of its own tuner's space for the exact "
                             "shape: small (<= 50 configs per engine, dtype and shape: minutes), full (every "
                             "runnable config: hours), none (as shipped only, the rows of before)")
    parser.add_argument("--paths", default=None,
                        help="comma list of the rows to time, by name or name prefix (e.g. api_,deep_gemm_kernels_); "
                             "default: every row")
    parser.add_argument("--graph", action="store_true",
                        help="also time each api_ row with the rows hint captured in a CUDA graph (`graph_<row>`: "
                             "its GPU work without the host's, as a layer's replayed eager call runs it)")
    parser.add_argument("--kernel-table", action="store_true",
                        help="also record each timed row's GPU kernels, their us per call, the GPU span and the "
                             "CUDA runtime calls per call (torch profiler)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1,
                        help="time every path this many times, every other round in reverse order, and keep each "
                             "path's fastest (the JSON keeps every round): no path gains from its place in the run")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: time each path at least once")
    if not torch.cuda.is_available():
        print("bench_experts needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    models = args.models.split(",") if args.models else (["kimi-k2"] if args.quick else list(MODELS))
    row_counts = [int(r) for r in args.rows.split(",")] if args.rows else (QUICK_ROWS if args.quick else ROWS)
    with_fp8 = not args.no_fp8
    results = {"env": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                       "python": platform.python_version(), "quick": args.quick}, "cases": []}

    print("correctness check (small case) ...", flush=True)
    failures = check_correctness(args.include_deep_gemm)
    results["correctness_failures"] = failures
    peers, loaded = _load_peers(args.peer_wheel)
    print("\n".join(loaded), flush=True)
    results["peer"] = {"loaded": loaded, "configs": [], "notes": [], "searches": []}
    results["env"].update(versions(peers), peer_search=args.peer_search)
    peer_labels = {peer.engine.name: peer.label for peer in peers}
    print("measuring anchors ...", flush=True)
    anchors = measure_anchors(args.quick)
    results["anchors"] = anchors
    print(f"  HBM {anchors['hbm_bytes_per_s'] / 1e12:.2f} TB/s, bf16 peak {anchors['bf16_flops_per_s'] / 1e12:.0f} "
          "TFLOP/s", flush=True)

    for model in models:
        torch.manual_seed(args.seed)
        num_experts, hidden, inter, _ = MODELS[model]
        weights = _make_weights(num_experts, hidden, inter, with_fp8)
        for num_rows in row_counts:
            case = _make_case(model, num_rows, weights, args.seed, with_fp8)
            timings, twins = {}, {}
            peer_paths = [path for peer in peers for path in _peer_paths_logged(case, peer, results["peer"],
                                                                                args.peer_search, args.quick)]
            configs = {name: config for name, _, config in peer_paths}
            paths = _paths(case, args.include_deep_gemm) + [(name, fn) for name, fn, _ in peer_paths]
            if args.graph:
                paths += [(f"graph_{name}", graphed(fn)) for name, fn in paths
                          if name.startswith("api_") and not name.endswith("_nohint") and selected(name, args.paths)]
            ready = []  # (name, fn) of the selected paths whose first call ran (compiled, tuned, checked)
            for name, fn in paths:
                if not selected(name.removeprefix("graph_"), args.paths):
                    continue
                if name.startswith(("peer_", "deep_gemm_")):  # a failing anchor leaves its row out, not the run
                    _, problem = _checked_first_call(case, name, fn, twins)
                else:
                    fn()  # compile + autotune outside the timed region
                    problem = None
                torch.cuda.synchronize()
                if problem:
                    print(f"  {model:8s} rows={num_rows:6d} {name:22s} left out: {problem}", flush=True)
                    results["peer"]["notes"].append(f"{model} rows {num_rows} {name} left out: {problem}")
                    continue
                ready.append((name, fn))
            per_round, timing_of = time_rounds(ready, args.rounds, functools.partial(_time_path, quick=args.quick))
            for name, fn in ready:
                us = timings[name] = min(per_round[name])
                row = make_row(case, name, us, anchors, config=configs.get(name), search=args.peer_search,
                               peer_labels=peer_labels, timing=timing_of[name])
                row["us_per_round"] = per_round[name]
                if args.kernel_table:
                    row["kernel_us"], row["gpu_span_us"], row["runtime_calls"] = kernel_table(fn)
                    for kernel, kernel_us in list(row["kernel_us"].items())[:8]:
                        print(f"      {kernel_us:9.1f} us  {kernel[:110]}", flush=True)
                    print(f"      kernels {sum(row['kernel_us'].values()):.1f} us in a GPU span of "
                          f"{row['gpu_span_us']:.1f} us per call; runtime calls per call (count, host us): "
                          + ", ".join(f"{name} {n:g} {us:.0f}" for name, (n, us) in row["runtime_calls"].items()),
                          flush=True)
                results["cases"].append(row)
                rounds = " / ".join(f"{r:.1f}" for r in per_round[name])
                print(f"  {model:8s} rows={num_rows:6d} {name:22s} {us:10.1f} us {row['tflops']:7.1f} TFLOP/s "
                      f"{row['weight_gbps']:7.0f} GB/s roofline {row['roofline_fraction']:.2f} (rounds {rounds})",
                      flush=True)
            for row in results["cases"]:
                if row["model"] == model and row["num_rows"] == num_rows and "grouped_mm_bf16" in timings:
                    row["x_vs_grouped_mm"] = timings["grouped_mm_bf16"] / row["us"]
            _write(results, args.out)
            del case, twins, peer_paths, ready
            torch.cuda.empty_cache()
        del weights
        torch.cuda.empty_cache()

    try:
        from moe_ref.kernels.experts.grouped_mlp import autotuned_kernel

        results["autotune_choices"] = {str(k): str(v) for k, v in autotuned_kernel().cache.items()}
    except Exception as exc:  # informational only
        results["autotune_choices"] = f"unavailable: {exc!r}"

    markdown_path = _write(results, args.out)
    print(_markdown(results))
    print(f"wrote {args.out} and {markdown_path}", flush=True)
    _plot(results, os.path.splitext(args.out)[0] + ".png")
    return 1 if failures else 0


def _write(results: dict, out: str) -> str:
    """Write the JSON and markdown (after every case, so a time-out keeps what was measured)."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=2)
    markdown_path = os.path.splitext(out)[0] + ".md"
    with open(markdown_path, "w") as f:
        f.write(_markdown(results))
    return markdown_path


if __name__ == "__main__":
    sys.exit(main())
