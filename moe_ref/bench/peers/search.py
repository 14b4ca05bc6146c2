"""The engines' own tuners, reproduced: their CUDA search spaces (`tuner_space`), pruned to what can run
(`pruned_space`), and a search over them for one exact shape (`search_config`, `--peer-search` of
scripts/bench_experts.py) whose winner becomes a `PeerConfig` (`tuned_peer_config`).
"""
from __future__ import annotations

import dataclasses
import itertools

from moe_ref.bench.peers.configs import PeerConfig
from moe_ref.bench.peers.engines import FP8_BLOCK, PeerEngine, config_dtype
from moe_ref.core import errors

# Neither wheel holds its tuner (they live in the engines' repositories, outside the packages: the SGLang 0.5.23
# wheel has no benchmark/kernels/ folder, the vLLM wheel no benchmarks/), so their CUDA enumerations are reproduced
# here, value lists, loop order and block-FP8 filter as the files spell them:
#   SGLang: benchmark/kernels/fused_moe_triton/common_utils.py `get_configs_compute_bound` (not ROCm), filtered
#     as benchmark/kernels/fused_moe_triton/tuning_fused_moe_triton.py `main` filters it for a block shape:
#     `block_k % BLOCK_SIZE_K == 0` (github.com/sgl-project/sglang, read at commit 00e96592 of the tuner and
#     00f0b462 of common_utils).
#   vLLM: benchmarks/kernels/benchmark_moe.py `get_configs_compute_bound(use_fp16, block_quant_shape)` (not ROCm):
#     `BLOCK_SIZE_K % block_k == 0 and BLOCK_SIZE_N % block_n == 0` for block-FP8 (github.com/vllm-project/vllm,
#     read at commit 71acd375).
# Both tuners time the whole fused_moe / fused_experts with ONE config for both GEMMs (`override_config`), as
# `search_config` does here (SGLang's separate up/down tuner, tuning_fused_moe_triton_sep.py, which also writes
# the `_down` files, needs recorded topk ids and is not reproduced).
SMEM_LIMIT_SM90 = 232448  # bytes: the opt-in shared memory per block of an H100/H200 (227 KiB)
SEARCH_MODES = ("none", "small", "full")
_SMALL_TILE_REST = {"GROUP_SIZE_M": 1, "num_warps": 4, "num_stages": 3}  # stage 1 of the small search
_SMALL_BLOCK_N, _SMALL_BLOCK_K, _SMALL_KEEP = (64, 128, 256), (64, 128), 2
CONFIG_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")

TUNERS = {
    "sglang": "SGLang benchmark/kernels/fused_moe_triton/tuning_fused_moe_triton.py (common_utils.py "
              "get_configs_compute_bound)",
    "vllm": "vLLM benchmarks/kernels/benchmark_moe.py (get_configs_compute_bound)",
}


def tuner_space(engine: PeerEngine | str, dtype: str) -> list[dict]:
    """The configs the engine's own tuner enumerates on CUDA for `dtype` ("bf16"/"fp16"/"fp32": no quantization;
    "fp8": block-FP8 w8a8 [128, 128]), in its order, after its own block-shape filter (see the comment above).
    SGLang: 1920 (bf16), 1280 (fp8); vLLM: 1920 (bf16), 640 (fp8)."""
    name = engine if isinstance(engine, str) else engine.name
    config_dtype(dtype)  # a known dtype
    block_n, block_k = FP8_BLOCK
    configs = []
    if name == "sglang":
        for num_stages in (2, 3, 4, 5):
            for block_m in (16, 32, 64, 128, 256):
                for block_k_ in (64, 128, 256):
                    for block_n_ in (32, 64, 128, 256):
                        for num_warps in (4, 8):
                            for group_size in (1, 16, 32, 64):
                                configs.append(dict(zip(CONFIG_KEYS, (block_m, block_n_, block_k_, group_size,
                                                                       num_warps, num_stages))))
        if dtype == "fp8":
            configs = [c for c in configs if block_k % c["BLOCK_SIZE_K"] == 0]
    elif name == "vllm":
        ranges = {"BLOCK_SIZE_M": (16, 32, 64, 128, 256), "BLOCK_SIZE_N": (32, 64, 128, 256),
                  "BLOCK_SIZE_K": (64, 128, 256), "GROUP_SIZE_M": (1, 16, 32, 64), "num_warps": (4, 8),
                  "num_stages": (2, 3, 4, 5)}
        configs = [dict(zip(ranges, values)) for values in itertools.product(*ranges.values())]
        if dtype == "fp8":
            configs = [c for c in configs if c["BLOCK_SIZE_K"] % block_k == 0 and c["BLOCK_SIZE_N"] % block_n == 0]
    else:
        raise errors.UnknownNameError(f"peer engine {name!r}; known: {sorted(TUNERS)}")
    return configs


def effective_config(engine: PeerEngine | str, dtype: str, config: dict) -> dict:
    """The tile config the kernel actually runs with: vLLM's launcher caps BLOCK_SIZE_K at the FP8 block's 128
    (`gemm_args`), so its BLOCK_SIZE_K 256 configs run as 128 ones; SGLang passes the config as it is."""
    name = engine if isinstance(engine, str) else engine.name
    if name == "vllm" and dtype == "fp8":
        return dict(config, BLOCK_SIZE_K=min(config["BLOCK_SIZE_K"], FP8_BLOCK[1]))
    return dict(config)


def smem_bytes(config: dict, dtype: str) -> int:
    """Shared memory a config's pipelined GEMM stages: (BLOCK_SIZE_M + BLOCK_SIZE_N) * BLOCK_SIZE_K * bytes *
    num_stages, the estimate of SGLang's benchmark/kernels/fused_moe_triton/search_space.py
    (`estimate_matmul_smem_bytes`) and of Triton's own matmul `early_config_prune`; 1 byte per element for FP8, 2
    otherwise (the estimate the tuners' OutOfResources skip stands for)."""
    size = 1 if dtype == "fp8" else 2
    return (config["BLOCK_SIZE_M"] + config["BLOCK_SIZE_N"]) * config["BLOCK_SIZE_K"] * size * config["num_stages"]


def config_problems(engine: PeerEngine | str, dtype: str, config: dict, smem_limit: int = SMEM_LIMIT_SM90) -> list[str]:
    """Why `config` cannot run as the engine's `fused_moe_kernel` config for `dtype` (empty: it can): every key,
    power-of-two tiles of at least 16 (tl.dot), for block-FP8 a BLOCK_SIZE_K dividing the 128-wide scale block (the
    kernel reads one activation/weight scale per K step), the shared-memory estimate (`smem_bytes`) within
    `smem_limit`."""
    problems = [f"no {key}" for key in CONFIG_KEYS if key not in config]
    if problems:
        return problems
    run = effective_config(engine, dtype, config)
    for key in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K"):
        if run[key] < 16 or run[key] & (run[key] - 1):
            problems.append(f"{key}={run[key]} is not a power of two >= 16")
    if dtype == "fp8" and FP8_BLOCK[1] % run["BLOCK_SIZE_K"]:
        problems.append(f"BLOCK_SIZE_K={run['BLOCK_SIZE_K']} does not divide the FP8 block's {FP8_BLOCK[1]}")
    if smem_bytes(run, dtype) > smem_limit:
        problems.append(f"shared memory {smem_bytes(run, dtype)} B > {smem_limit} B")
    return problems


@dataclasses.dataclass
class SearchSpace:
    """The configs a search may time for one engine and dtype: the tuner's space (`tuner_size` configs) less the
    ones that cannot run (`dropped` reason -> count) and the ones that run as another (vLLM FP8's BLOCK_SIZE_K 256)."""

    configs: list[dict]
    tuner_size: int
    dropped: dict[str, int]


def pruned_space(engine: PeerEngine | str, dtype: str, smem_limit: int = SMEM_LIMIT_SM90) -> SearchSpace:
    """`tuner_space` without the configs `config_problems` refuses and without duplicates of what the kernel runs
    (`effective_config`); order kept. At the SM90 limit, bf16: SGLang and vLLM 1920 -> 1248 (672 over the shared
    memory); FP8: SGLang 1280 -> 1248 (32), vLLM 640 -> 288 (the BLOCK_SIZE_K 256 half runs as BLOCK_SIZE_K 128,
    and 64 over the shared memory)."""
    space = tuner_space(engine, dtype)
    kept, seen, dropped = [], set(), {}
    for config in space:
        run = effective_config(engine, dtype, config)
        key = tuple(run[k] for k in CONFIG_KEYS)
        problems = config_problems(engine, dtype, config, smem_limit)
        reason = "shared memory" if any("shared memory" in p for p in problems) else \
            problems[0] if problems else "runs as another config" if key in seen else None
        if reason:
            dropped[reason] = dropped.get(reason, 0) + 1
            continue
        seen.add(key)
        kept.append(config)
    return SearchSpace(kept, len(space), dropped)


def device_smem_limit() -> int:
    """The opt-in shared memory per block of the current GPU (the search prunes configs over it), SM90's if unknown."""
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "shared_memory_per_block_optin", 0) or SMEM_LIMIT_SM90)


def block_m_cap(max_rows_per_expert: int) -> int:
    """The largest BLOCK_SIZE_M the small search tries: the smallest power of two >= the rows of the fullest expert
    (at least 16): a larger M tile only computes padding rows."""
    cap = 16
    while cap < max_rows_per_expert:
        cap *= 2
    return cap


def small_stage1(space: list[dict], max_rows_per_expert: int) -> list[dict]:
    """Stage 1 of the small search: the tiles (BLOCK_SIZE_M <= `block_m_cap`, BLOCK_SIZE_N in 64/128/256,
    BLOCK_SIZE_K in 64/128) of `space` at GROUP_SIZE_M 1, 4 warps, 3 stages (the most frequent values in the
    engines' tuned H200 files)."""
    cap = block_m_cap(max_rows_per_expert)
    return [c for c in space if c["BLOCK_SIZE_M"] <= cap and c["BLOCK_SIZE_N"] in _SMALL_BLOCK_N
            and c["BLOCK_SIZE_K"] in _SMALL_BLOCK_K and all(c[k] == v for k, v in _SMALL_TILE_REST.items())]


def small_stage2(space: list[dict], tile: dict, max_rows_per_expert: int, group_size: int | None = None) -> list[dict]:
    """Stage 2 of the small search for one tile (BLOCK_SIZE_M/N/K of `tile`): with `group_size` None every
    (num_warps, num_stages) of `space` at GROUP_SIZE_M 1; else, for the best (num_warps, num_stages) in `tile`,
    every other GROUP_SIZE_M."""
    same = [c for c in space if all(c[k] == tile[k] for k in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K"))]
    if group_size is None:
        return [c for c in same if c["GROUP_SIZE_M"] == 1]
    return [c for c in same if c["num_warps"] == tile["num_warps"] and c["num_stages"] == tile["num_stages"]
            and c["GROUP_SIZE_M"] != group_size]


@dataclasses.dataclass
class SearchResult:
    """What `search_config` found: the fastest config (None when every one failed), its time, every config timed
    (in order) and every one that failed to run (the tuners skip those too)."""

    mode: str
    best: dict | None
    best_us: float
    timed: list[tuple[dict, float]]
    failed: list[tuple[dict, str]]
    tuner_size: int
    candidates: int

    def summary(self) -> str:
        return (f"{self.mode} search: {len(self.timed)} of the tuner's {self.tuner_size} configs timed "
                f"({self.candidates} runnable), {len(self.failed)} failed")


def search_config(engine: PeerEngine | str, dtype: str, mode: str, time_config, *, max_rows_per_expert: int,
                  smem_limit: int = SMEM_LIMIT_SM90) -> SearchResult:
    """The fastest config of the engine's tuner space for one exact shape, as `time_config(config) -> us` times it
    (an exception: the config failed; skipped, as the tuners skip OutOfResources/RuntimeError).

    mode "full": every config of `pruned_space` (1248 per engine for bf16, 1248/288 for SGLang/vLLM FP8: hours at
    the largest shapes).
    mode "small": two stages inside `pruned_space`, at most 30 + 2 * (7 + 3) = 50 configs: (1) `small_stage1`'s
    tiles; (2) for the `_SMALL_KEEP` (2) fastest tiles, every num_warps x num_stages at GROUP_SIZE_M 1, then every
    other GROUP_SIZE_M at the best of those (`small_stage2`). The winner is the fastest config timed."""
    if mode not in SEARCH_MODES[1:]:
        raise errors.InvalidConfigError(f"peer search mode {mode!r}; known: {', '.join(SEARCH_MODES[1:])}")
    space = pruned_space(engine, dtype, smem_limit)
    timed, failed, times = [], [], {}

    def run(configs):
        for config in configs:
            key = tuple(config[k] for k in CONFIG_KEYS)
            if key in times:
                continue
            try:
                us = float(time_config(dict(config)))
            except Exception as exc:  # noqa: BLE001 - a config that fails to compile or launch is skipped
                times[key] = float("inf")
                failed.append((dict(config), f"{type(exc).__name__}: {str(exc)[:200]}"))
                continue
            times[key] = us
            timed.append((dict(config), us))

    def fastest(configs, count=1):
        ranked = sorted((times[tuple(c[k] for k in CONFIG_KEYS)], i) for i, c in enumerate(configs)
                        if times.get(tuple(c[k] for k in CONFIG_KEYS), float("inf")) < float("inf"))
        return [configs[i] for _, i in ranked[:count]]

    if mode == "full":
        run(space.configs)
    else:
        stage1 = small_stage1(space.configs, max_rows_per_expert)
        run(stage1)
        for tile in fastest(stage1, _SMALL_KEEP):
            warps_stages = small_stage2(space.configs, tile, max_rows_per_expert)
            run(warps_stages)
            best = fastest(warps_stages + [tile])[0]
            run(small_stage2(space.configs, best, max_rows_per_expert, group_size=best["GROUP_SIZE_M"]))
    best = min(timed, key=lambda item: item[1], default=(None, float("inf")))
    return SearchResult(mode, best[0], best[1], timed, failed, space.tuner_size, len(space.configs))


def tuned_peer_config(engine: PeerEngine | str, result: SearchResult, rows: int) -> PeerConfig:
    """The `PeerConfig` of a search's winner: one config for both GEMMs (as both tuners time it)."""
    name = engine if isinstance(engine, str) else engine.name
    if result.best is None:
        raise errors.BackendUnavailableError(f"{name}: no config of the {result.mode} search ran "
                                                f"({len(result.failed)} failed)")
    return PeerConfig(dict(result.best), dict(result.best), f"tuned: {result.summary()} of {TUNERS[name]}", rows)
