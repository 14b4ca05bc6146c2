"""The SGLang and vLLM Triton fused-MoE kernels, read from their wheels as ``moe_ref.bench.peers`` reads them
(``make peers`` puts the files in ``.whl/``), as ``experts`` implementations. GPU only; without the files the
factory raises ENV001 (a FAIL naming it: put the wheel in the ledger or run ``make peers``).

    peer:<engine>        the config the engine itself picks: its tuned file for the shape and GPU, else its default
                         rule (what a user of the engine gets without tuning)
    peer:<engine>+tuned  the engine at its best: before a speed case is checked and timed, ``tune`` searches its own
                         tuner's space for that case's exact rows (``search_config``'s small search, at most 50
                         configs, each checked against the engine's own config first), as the engine's tuner writes
                         a config file for a shape; other row counts keep the engine's config
    peer:<engine>/experts[+tuned]  the same kernels alone (``pool_experts``) on the harness's 128-aligned pool, the
                         kernel-only rows beside ``moe_ref/experts/*`` on the same pool

The adapter builds the expert-major pool the kernels walk (one row per live slot, slot-major within an expert),
builds the kernel's routing inputs on the device (the engines' ``moe_align_block_size``), runs the engine's two GEMMs
and act, and does the weighted top-k sum (the engines' ``moe_sum``) with moe_ref's ``sum_slots``: fp32, slots in
order, each row read where it sits in the pool (one launch, the same bits at every call).

Shape legend: T tokens of this rank, K top-k, e local experts, D hidden width, P receive-pool rows, N live slots.
"""
from __future__ import annotations

import dataclasses

import torch

from moe_ref.conformance.api import Capabilities, ExpertPool, Implementation, Problem, register


class PeerMoE:
    """One engine's fused-MoE kernel over one case's weights, at the engine's own config (an ``ExpertsFn``)."""

    def __init__(self, engine: str, problem: Problem):
        from moe_ref.bench.peers import default_peer_files, load_peer_kernel
        from moe_ref.core.errors import BackendUnavailableError

        files = [f for f in default_peer_files() if f.split("/")[-1].startswith(engine)]
        if not files:
            raise BackendUnavailableError(f"no {engine} wheel or fused-moe zip in .whl/: run `make peers`")
        self.wheel, self.peer, self.problem = files[0], load_peer_kernel(files[0]), problem
        w = problem.weights
        self.fp8 = w.quant == "fp8_block"
        self.dtype_name = "fp8" if self.fp8 else {torch.bfloat16: "bf16", torch.float16: "fp16"}[problem.dtype]
        self.gate_up, self.down = (w.gate_up_q, w.down_q) if self.fp8 else (w.gate_up_e2FD, w.down_eDF)
        self.scales = dict(gate_up_scale=w.gate_up_scale, down_scale=w.down_scale) if self.fp8 else {}
        self.device_name = torch.cuda.get_device_name(problem.device)
        self.configs = {}  # routed rows N -> the PeerConfig their calls run

    def config(self, num_routed: int):
        """The config for ``num_routed`` rows: the engine's pick, looked up once per count (as the engines cache
        it), unless ``tune`` set another."""
        if num_routed not in self.configs:
            from moe_ref.bench.peers import peer_config

            p = self.problem
            self.configs[num_routed] = peer_config(self.wheel, p.num_local_experts, p.intermediate, self.dtype_name,
                                                   self.device_name, num_routed, hidden=p.hidden)
        return self.configs[num_routed]

    def pool(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor) -> tuple[ExpertPool, torch.Tensor]:
        """``(pool, row_TK)``: the live slots grouped by expert, packed (``scenarios.expert_pool``: (token, slot)
        order within an expert), and each slot's pool row (-1: masked); FP8: the rows quantized per 128 columns as the
        engines quantize them (moe_ref's quantizer, not the harness's)."""
        from moe_ref.conformance.scenarios import expert_pool

        pool, _, row_TK = expert_pool(x_TD, topk_ids_TK, self.problem.num_local_experts)
        if self.fp8:
            from moe_ref.kernels.experts.fp8 import quantize_fp8_per_128

            x_fp8, x_scale = quantize_fp8_per_128(pool.x_PD)
            pool = dataclasses.replace(pool, x_fp8_PD=x_fp8, x_scale_PDb=x_scale)
        return pool, row_TK

    def mlp(self, pool: ExpertPool, config, routing=None) -> torch.Tensor:
        """``y_PD``: the engine's two GEMMs and act over the pool at ``config``; ``routing``: the kernel's routing
        inputs for ``config.block_m`` (None: built here, on the device, as the engine builds them per call)."""
        from moe_ref.bench.peers import peer_routing, run_peer_mlp

        if routing is None:
            routing = peer_routing(pool.row_start_e, pool.num_rows_e, pool.x_PD.shape[0], config.block_m,
                                   self.peer.engine, num_routed=pool.num_rows)
        x_PD = pool.x_fp8_PD if self.fp8 else pool.x_PD
        return run_peer_mlp(self.peer, x_PD, self.gate_up, self.down, pool.row_start_e, pool.num_rows_e,
                            x_scale=pool.x_scale_PDb, config=config, routing=routing, out_dtype=self.problem.dtype,
                            **self.scales)

    def search(self, pool: ExpertPool) -> None:
        """The engine at its best for ``pool``'s rows: search its tuner space (small search) and keep the winner
        for that row count. Each config is first run once and compared with the engine's own config's output
        (calc_diff within the dtype's bound, else it counts as failed), then timed with ``moe_ref.testing.bench``;
        the routing inputs are built once per BLOCK_SIZE_M outside the timing (as bench_experts' search does)."""
        from moe_ref.bench.cases import segment_rows
        from moe_ref.bench.peers import PeerConfig, device_smem_limit, peer_routing, search_config, tuned_peer_config
        from moe_ref.testing import CALC_DIFF_TOLERANCES, bench, calc_diff

        if pool.num_rows == 0:
            return
        live_P = segment_rows(pool.row_start_e, pool.num_rows_e, pool.x_PD.shape[0])
        expected_ND = self.mlp(pool, self.config(pool.num_rows))[live_P].float()
        limit = CALC_DIFF_TOLERANCES[torch.float8_e4m3fn if self.fp8 else self.problem.dtype]
        routings = {}

        def time_config(config: dict) -> float:
            chosen = PeerConfig(dict(config), dict(config), "search", pool.num_rows)
            if chosen.block_m not in routings:
                routings[chosen.block_m] = peer_routing(pool.row_start_e, pool.num_rows_e, pool.x_PD.shape[0],
                                                        chosen.block_m, self.peer.engine, num_routed=pool.num_rows)
            diff = calc_diff(self.mlp(pool, chosen, routings[chosen.block_m])[live_P].float(), expected_ND)
            if not diff <= limit:
                raise ValueError(f"calc_diff {diff:.3g} against the engine's own config (bound {limit:g})")
            return bench(lambda: self.mlp(pool, chosen, routings[chosen.block_m]), warmup=2, iters=10)

        result = search_config(self.peer.engine, self.dtype_name, "small", time_config,
                               max_rows_per_expert=int(pool.num_rows_e.max()), smem_limit=device_smem_limit())
        self.configs[pool.num_rows] = tuned_peer_config(self.peer.engine, result, pool.num_rows)

    def __call__(self, x_TD, topk_ids_TK, topk_weights_TK, out_TD) -> None:
        from moe_ref.ep.batch_invariant import sum_slots

        pool, row_TK = self.pool(x_TD, topk_ids_TK)
        y_PD = self.mlp(pool, self.config(pool.num_rows))
        out_TD.copy_(sum_slots(y_PD, topk_ids_TK, topk_weights_TK.float(), out_TD.dtype, row_TK))


class TunedPeerMoE(PeerMoE):
    """The engine at its best: ``tune`` (which the harness calls before a speed case's checks) pins the fastest
    config of the engine's own tuner space for that case's rows."""

    def tune(self, x_TD, topk_ids_TK, topk_weights_TK) -> None:
        self.search(self.pool(x_TD, topk_ids_TK)[0])


class PeerPoolExperts(PeerMoE):
    """The engine's kernels alone on the harness's pool (``pool_experts``: kernel-only rows beside moe_ref's
    experts on the same pool); its routing inputs (the engines' ``moe_align_block_size``) are built in each call."""

    def __call__(self, pool: ExpertPool) -> torch.Tensor:
        return self.mlp(pool, self.config(pool.num_rows))


class TunedPeerPoolExperts(PeerPoolExperts):
    """``PeerPoolExperts`` at the engine's best config for the pool's rows (``tune`` before a speed case)."""

    def tune(self, pool: ExpertPool) -> None:
        self.search(pool)


def peer_factory(engine: str, tuned: bool = False, pool: bool = False):
    """``Problem -> PeerMoE`` of ``engine`` (the newest peer file of it in ``.whl/``); ``tuned``: at its best;
    ``pool``: its kernels alone on a pool."""
    classes = {(False, False): PeerMoE, (True, False): TunedPeerMoE, (False, True): PeerPoolExperts,
               (True, True): TunedPeerPoolExperts}

    def factory(problem: Problem) -> PeerMoE:
        return classes[(tuned, pool)](engine, problem)

    return factory


for _engine in ("sglang", "vllm"):
    for _tuned in (False, True):
        _config_note = ("at the fastest config of its own tuner's space for the case (small search)" if _tuned else
                        "at the config the engine picks (its tuned file, else its default rule)")
        _name = f"peer:{_engine}{'+tuned' if _tuned else ''}"
        register(Implementation(
            _name, "experts", Capabilities(dtypes=("bf16",), quants=("none", "fp8_block"), devices=("cuda",)),
            peer_factory(_engine, _tuned), f"{_engine}'s Triton fused_moe_kernel from its wheel, {_config_note}",
            spec=_name))
        # the kernels alone on the pool moe_ref's experts get (moe_ref_pool.POOL_ALIGNMENT)
        _name = f"peer:{_engine}/experts{'+tuned' if _tuned else ''}"
        register(Implementation(
            _name, "pool_experts", Capabilities(dtypes=("bf16",), quants=("none", "fp8_block"), devices=("cuda",),
                                                segment_alignment=128, duplicate_experts=True),
            peer_factory(_engine, _tuned, pool=True),
            f"{_engine}'s fused_moe_kernel alone on a pool, {_config_note}", spec=_name))
