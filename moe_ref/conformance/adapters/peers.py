"""The SGLang and vLLM Triton fused-MoE kernels, read from their wheels as ``moe_ref.bench.peers`` reads them
(``make peers`` puts the files in ``.whl/``), as ``experts`` implementations: ``peer:sglang``, ``peer:vllm``. GPU
only; without the files the factory raises ENV001 (a FAIL naming it: put the wheel in the ledger or run
``make peers``).

The adapter builds the expert-major pool the kernels walk (one row per live slot, slot-major within an expert),
builds the kernel's routing inputs on the device (the engines' ``moe_align_block_size``), runs the engine's two GEMMs
and act at its best config (its tuned file, else its default rule, looked up once per row count as the engines cache
it), and does the weighted top-k sum in fp32 itself, in slot order (the engines' ``moe_sum``: deterministic).

Shape legend: T tokens of this rank, K top-k, e local experts, D hidden width, P receive-pool rows.
"""
from __future__ import annotations

import functools

import torch

from moe_ref.conformance.api import Capabilities, Implementation, Problem, register


def peer_factory(engine: str):
    """``Problem -> run`` over the engine's kernel read from the newest peer file of ``engine`` in ``.whl/``."""
    def factory(problem: Problem):
        from moe_ref.bench.peers import (default_peer_files, load_peer_kernel, peer_config, peer_routing,
                                         run_peer_mlp)
        from moe_ref.core.errors import BackendUnavailableError

        files = [f for f in default_peer_files() if f.split("/")[-1].startswith(engine)]
        if not files:
            raise BackendUnavailableError(f"no {engine} wheel or fused-moe zip in .whl/: run `make peers`")
        peer = load_peer_kernel(files[0])
        w = problem.weights
        fp8 = w.quant == "fp8_block"
        gate_up, down = (w.gate_up_q, w.down_q) if fp8 else (w.gate_up_e2FD, w.down_eDF)
        device_name = torch.cuda.get_device_name(problem.device)
        dtype_name = "fp8" if fp8 else {torch.bfloat16: "bf16", torch.float16: "fp16"}[problem.dtype]

        @functools.lru_cache(maxsize=None)
        def config_for(rows: int):
            return peer_config(files[0], problem.num_local_experts, problem.intermediate, dtype_name, device_name,
                               rows, hidden=problem.hidden)

        def run(x_TD, topk_ids_TK, topk_weights_TK, out_TD):
            live_TK = topk_ids_TK >= 0
            token_N, slot_N = live_TK.nonzero(as_tuple=True)
            expert_N = topk_ids_TK[token_N, slot_N]
            order = torch.argsort(expert_N, stable=True)
            token_N, slot_N, expert_N = token_N[order], slot_N[order], expert_N[order]
            num_rows_e = torch.bincount(expert_N, minlength=problem.num_local_experts)
            row_start_e = torch.cumsum(num_rows_e, 0) - num_rows_e
            x_PD, x_scale = x_TD[token_N], None
            if fp8:
                from moe_ref.kernels.experts.fp8 import quantize_fp8_per_128

                x_PD, x_scale = quantize_fp8_per_128(x_PD)
            num_routed = int(token_N.numel())
            config = config_for(num_routed)
            routing = peer_routing(row_start_e, num_rows_e, num_routed, config.block_m, peer.engine,
                                   num_routed=num_routed)
            y_PD = run_peer_mlp(peer, x_PD, gate_up, down, row_start_e, num_rows_e, x_scale=x_scale,
                                gate_up_scale=w.gate_up_scale if fp8 else None,
                                down_scale=w.down_scale if fp8 else None, config=config, routing=routing,
                                out_dtype=problem.dtype)
            # Each (token, slot) is written once, then summed over slots in order: no atomics, the same bits each call.
            y_TKD = torch.zeros((*topk_ids_TK.shape, x_TD.shape[1]), dtype=torch.float32, device=x_TD.device)
            y_TKD[token_N, slot_N] = topk_weights_TK[token_N, slot_N, None].float() * y_PD.float()
            out_TD.copy_(y_TKD.sum(dim=1))

        return run

    return factory


for _engine in ("sglang", "vllm"):
    register(Implementation(f"peer:{_engine}", "experts",
                            Capabilities(dtypes=("bf16",), quants=("none", "fp8_block"), devices=("cuda",)),
                            peer_factory(_engine), f"{_engine}'s Triton fused_moe_kernel from its wheel, at its best "
                            f"config", spec=f"peer:{_engine}"))
