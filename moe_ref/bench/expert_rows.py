"""The rows scripts/bench_experts.py times on a `Case` (see its docstring for each row), and their checks: moe_ref
through the public API on each backend's own pool (`api_paths`), the grouped MLP kernel direct, torch grouped_mm and
a per-expert loop (`case_paths`), DeepGEMM's whole MLP and bare kernels (`deep_gemm_paths`), and SGLang's and vLLM's
fused-MoE kernels as shipped and tuned by a search of their own tuners' spaces (`peer_paths`). An anchor's first call
is checked against our twin (`checked_first_call`, `twin_check`) before it is timed (`time_path`).

Shape legend: P receive-pool rows, e local experts, D hidden width, F expert intermediate.
"""
from __future__ import annotations

import functools
import os
import time
from typing import Callable

import torch
import torch.nn.functional as F

from moe_ref.bench.cases import (Case, aligned_layout, api_call, api_layout, case_pool, grouped_mm_path, make_weights,
                                 routed_rows, segment_rows)
from moe_ref.bench.peers import (PeerConfig, default_peer_files, load_peer_kernel, nearest_tuned, peer_config,
                                 peer_routing, run_peer_mlp, device_smem_limit, tuned_peer_config)
from moe_ref.bench.peers import search as peer_search
from moe_ref.bench.timing import bench_us, kernel_us
from moe_ref.testing import calc_diff

_API_EXPERTS: dict = {}  # (backend, id of the bf16 weights, fp8) -> the Experts object (built once per model)
API_BACKENDS = ("triton",)  # the moe_ref backends timed through the public API


def api_paths(case: Case, backends=API_BACKENDS) -> list[tuple[str, Callable[[], object]]]:
    """The public ``Experts`` path, as ``ModularRoutedStep`` calls it after the device-side dispatch: each backend
    on the pool the layer builds for it (segments aligned to ``experts_class(name).segment_alignment``), with the
    static rows hint the device-side dispatch passes (``ExpertLayout.num_rows_hint``, no host sync) and without it
    (``_nohint``: the backend reads the row count, a host sync per call); fp8: the FP8 pool as dispatched."""
    from moe_ref.experts import experts_class, make_experts

    paths = []
    for backend in backends:
        cls = experts_class(backend, case.x_PDx.device)
        pool = case_pool(case, cls.segment_alignment)
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


def case_paths(case: Case, include_deep_gemm: bool) -> list[tuple[str, Callable[[], object]]]:
    """Every non-peer row of `case` as (name, fn): the public API rows (`api_paths`; with `include_deep_gemm`
    DeepGEMM's and auto's too where deep_gemm runs), the grouped MLP kernel direct on the ALIGN pool (bf16, FP8), torch
    grouped_mm and the per-expert loop on the packed rows, and with `include_deep_gemm` DeepGEMM's rows."""
    from moe_ref.kernels.experts.grouped_mlp import grouped_mlp

    api_backends = API_BACKENDS + (("deep_gemm", "auto") if include_deep_gemm and deep_gemm_usable() else ())
    paths = api_paths(case, api_backends) + [("triton_bf16", lambda: grouped_mlp(
        case.x_PDx, case.gate_up, case.down, case.row_start_e, case.num_rows_e, num_rows_hint=case.num_rows))]
    if case.fp8 is not None:
        q = case.fp8
        paths.append(("triton_fp8", lambda: grouped_mlp(
            q["x"], q["gate_up"], q["down"], case.row_start_e, case.num_rows_e, x_scale_PDb=q["x_scale"],
            gate_up_scale=q["gate_up_scale"], down_scale=q["down_scale"], num_rows_hint=case.num_rows)))
    run_grouped_mm = grouped_mm_path(case)
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
        paths.extend(deep_gemm_paths(case))
    return paths


def selected(name: str, paths: str | None) -> bool:
    """Whether row ``name`` is timed under ``--paths`` (a comma list of names or name prefixes; None: every row)."""
    return paths is None or any(name.startswith(prefix) for prefix in paths.split(","))


def deep_gemm_usable() -> bool:
    """Whether deep_gemm imports and runs here (`deep_gemm_status`)."""
    from moe_ref.experts.deep_gemm.probe import deep_gemm_status

    return deep_gemm_status().available


def deep_gemm_paths(case: Case) -> list[tuple[str, Callable[[], object]]]:
    """DeepGEMM paths for `case` as (name, fn) pairs, contiguous and masked layouts, on the ALIGN (128) pool it
    needs; [] when deep_gemm is not usable here. Whole MLP (`deep_gemm_[masked_]{bf16,fp8}`): GEMM1, activation
    (+ per-128 FP8 quantization of h), GEMM2, the fp8 rows from the FP8 pool as dispatched. Kernels only
    (`deep_gemm_[masked_]kernels_{bf16,fp8}`): the two GEMMs on operands built once (timed by the profiler, kernel
    time only: `kernel_us`)."""
    from moe_ref.experts.deep_gemm.bench import deep_gemm_grouped_cases, deep_gemm_kernel_cases

    args = (case.x_PDx, case.gate_up, case.down, case.row_start_e, case.num_rows_e)
    options = dict(layouts=("contiguous", "masked"), fp8_options=(False, True) if case.fp8 is not None else (False,),
                   x_fp8=(case.fp8["x"], case.fp8["x_scale"]) if case.fp8 is not None else None)
    return deep_gemm_grouped_cases(*args, **options) + deep_gemm_kernel_cases(*args, **options)


def load_peers(paths: list[str] | None) -> tuple[list, list[str]]:
    """(PeerKernels, one note per file): the engines' kernels from their wheels or fused-moe zips
    (`moe_ref.bench.peers`); `paths` None: every peer file in .whl/."""
    paths = paths or default_peer_files()
    if not paths:
        return [], ["no peer file (.whl/sglang-*.whl, .whl/vllm-*-fused-moe.zip; `make peers` makes them): peer rows "
                    "left out"]
    peers, notes = [], []
    for path in paths:
        try:
            peer = load_peer_kernel(path)
        except Exception as exc:  # noqa: BLE001 - any failure leaves this engine's rows out, with the reason
            notes.append(f"peer rows of {os.path.basename(path)} left out: {exc}")
            continue
        peers.append(peer)
        notes.append(f"peer {peer.label} from {os.path.basename(path)} (kernels imported from {peer.module_file})")
    return peers, notes


def peer_operands(case: Case, dtype: str) -> tuple[tuple, dict]:
    """(x, gate_up, down) and the FP8 scales a peer runs on: the ALIGN pool (bf16, or the FP8 pool as dispatched
    with the block-quantized weights)."""
    if dtype == "bf16":
        return (case.x_PDx, case.gate_up, case.down), {}
    q = case.fp8
    return ((q["x"], q["gate_up"], q["down"]),
            dict(x_scale=q["x_scale"], gate_up_scale=q["gate_up_scale"], down_scale=q["down_scale"]))


def peer_search_timer(case: Case, peer, dtype: str, quick: bool):
    """`time_config(config) -> us` for `peers.search_config`: the engine's MLP on this case with `config` for
    both GEMMs (routing built once per BLOCK_SIZE_M, outside the timing), checked once per config against our twin
    (a wrong result counts as a failure), timed with `bench_us` (short)."""
    operands, scales = peer_operands(case, dtype)
    routings, twins = {}, {}

    def time_config(config: dict) -> float:
        block_m = config["BLOCK_SIZE_M"]
        if block_m not in routings:
            routings[block_m] = peer_routing(case.row_start_e, case.num_rows_e, case.x_PDx.shape[0], block_m,
                                             peer.engine)
        fn = functools.partial(run_peer_mlp, peer, *operands, case.row_start_e, case.num_rows_e, **scales,
                               config=PeerConfig(dict(config), dict(config), "search", case.num_rows),
                               routing=routings[block_m])
        problem = twin_check(case, f"search_{dtype}", fn(), twins)
        if problem:
            raise RuntimeError(problem)
        return bench_us(fn, True, search=True)

    return time_config


def peer_paths(case: Case, peer, search: str = "none", quick: bool = False, log: dict | None = None
               ) -> list[tuple[str, Callable[[], object], object]]:
    """(name, fn, PeerConfig) per dtype: the engine's expert MLP on our pool "as shipped" (its tuned file or default
    rule: `peer_<engine>_<dtype>`, today's rows) and, unless `search` is "none", "tuned" (the fastest config of its
    own tuner's space for this exact shape, `peers.search_config`: `peer_<engine>_tuned_<dtype>`). Routing inputs
    are built here, once, outside the timed region (the engine's align step is not timed, as our dispatch is not);
    the search runs here too, before any timing (its time is recorded in `log`, not in the rows)."""
    num_experts, hidden, inter = case.gate_up.shape[0], case.gate_up.shape[2], case.down.shape[2]
    layout = (case.row_start_e, case.num_rows_e)
    paths = []
    for dtype in ("bf16", "fp8") if case.fp8 is not None else ("bf16",):
        operands, scales = peer_operands(case, dtype)
        configs = [(f"peer_{peer.engine.name}_{dtype}", peer_config(
            peer.wheel, num_experts, inter, dtype, torch.cuda.get_device_name(), case.num_rows, hidden=hidden))]
        if search != "none":
            start = time.time()
            result = peer_search.search_config(peer.engine, dtype, search,
                                               peer_search_timer(case, peer, dtype, quick),
                                               max_rows_per_expert=max(case.counts), smem_limit=device_smem_limit())
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


def peer_paths_logged(case: Case, peer, log: dict, search: str = "none", quick: bool = False
                      ) -> list[tuple[str, Callable[[], object], object]]:
    """`peer_paths`, with each config (and, where the engine falls back to its default rule, the nearest tuned
    files) recorded in `log` (results["peer"]); [] with a note when building them fails."""
    try:
        paths = peer_paths(case, peer, search, quick, log)
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


def checked_first_call(case: Case, name: str, fn: Callable[[], object], twins: dict):
    """(output, problem): an anchor's first call (compiles, outside the timed region) and its check."""
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - e.g. a compile error on this Triton
        return None, f"{type(exc).__name__}: {str(exc)[:300]}"
    return out, twin_check(case, name, out, twins)


def twin_check(case: Case, name: str, out: torch.Tensor, twins: dict) -> str | None:
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
    got = routed_rows(case, out, name).float()
    if got.isnan().any():
        return "NaN in the routed rows"
    diff, limit = calc_diff(got, routed_rows(case, twins[fp8]).float()), 1e-3 if fp8 else 1e-4
    return None if diff < limit else f"calc_diff {diff:.2e} vs our twin (limit {limit:.0e})"


def time_path(name: str, fn: Callable[[], object], quick: bool) -> tuple[float, str]:
    """(us per call, how it was timed) of one path: DeepGEMM's kernels-only rows by the profiler's kernel time, every
    other row by `bench_us`."""
    if "_kernels_" not in name:
        return bench_us(fn, quick), "do_bench median (L2 flushed)"
    try:
        us, kernels = kernel_us(fn, quick)
        return us, f"profiler kernel time, L2 flushed ({', '.join(kernels)[:200]})"
    except Exception as exc:  # noqa: BLE001 - no profiler: say so and time the call
        return bench_us(fn, quick), f"do_bench median (the profiler failed: {type(exc).__name__}: {str(exc)[:100]})"


def check_correctness(include_deep_gemm: bool, device="cuda") -> list[str]:
    """Every path vs grouped_mlp_ref at one small case (calc_diff limits: bf16 1e-4; fp8 1e-3 vs the fp8 twin)."""
    from moe_ref.kernels.experts.grouped_mlp import grouped_mlp_ref

    torch.manual_seed(0)
    counts = [3, 0, 130, 64]
    weights = make_weights(4, 512, 256, True, device)
    row_start_e, num_rows_e, pool_rows = aligned_layout(counts, device)
    x_packed = torch.randn(sum(counts), 512, device=device).bfloat16()
    x_PDx = torch.zeros(pool_rows, 512, dtype=torch.bfloat16, device=device)
    valid = segment_rows(row_start_e, num_rows_e, pool_rows)
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
    for name, fn in case_paths(case, include_deep_gemm):
        diff = calc_diff(routed_rows(case, fn(), name), ref_fp8 if "fp8" in name else ref)  # fp8 paths vs the fp8 twin
        limit = 1e-3 if "fp8" in name else 1e-4
        status = "ok" if diff < limit else "FAIL"
        print(f"  check {name:22s} calc_diff={diff:.2e} (limit {limit:.0e}) {status}", flush=True)
        if status != "ok":
            failures.append(name)
    return failures
