"""The engine's expert MLP on OUR expert-major pool: the routing inputs its kernel walks, built from our layout
(`peer_routing`, as the engine's `moe_align_block_size` lays them out, on the device), and the two
`fused_moe_kernel` launches with the engine's act and FP8 re-quantization between them (`run_peer_mlp`).

Shape legend: P receive-pool rows, N routed rows (those in an expert's segment), e local experts, D hidden width,
F expert intermediate (2F: gate rows then up rows).
"""
from __future__ import annotations

import dataclasses
import functools
import sys

import torch

from moe_ref.bench.peers.configs import PeerConfig
from moe_ref.bench.peers.engines import (FP8_BLOCK, GEMM_KERNEL, PDL_STATE, PeerEngine, engine_of, exec_plain,
                                         is_interpreter)
from moe_ref.bench.peers.loading import PeerKernel
from moe_ref.core import errors


@dataclasses.dataclass
class PeerRouting:
    """The peer kernel's routing inputs for one layout and BLOCK_SIZE_M (top_k 1: a token id is a pool row)."""

    sorted_token_ids: torch.Tensor        # [max_padded] int32: pool rows grouped by expert, sentinel padding
    expert_ids: torch.Tensor              # [max_padded / BLOCK_M] int32: the expert of each M block (-1 unused)
    num_tokens_post_padded: torch.Tensor  # [1] int32
    row_expert_P: torch.Tensor            # [P] int32: each pool row's expert, -1 outside every segment (topk_ids)
    topk_weights: torch.Tensor            # [P] fp32 ones (read only with MUL_ROUTED_WEIGHT)
    block_m: int
    num_valid_tokens: int                 # P: ids >= P are padding (the sentinel is P)


def peer_routing(row_start_e: torch.Tensor, num_rows_e: torch.Tensor, num_pool_rows: int, block_m: int,
                 engine: PeerEngine, num_routed: int | None = None) -> PeerRouting:
    """`moe_align_block_size`'s output for our expert-major pool, its buffers sized by `engine.align_buffer_size`,
    built on the pool's device with tensor ops (the engines build it with one CUDA kernel). `num_routed`: the sum
    of `num_rows_e` when the caller knows it (it must be exact: on CUDA a wrong one is not detected); None reads it
    from the device (one host sync).

    Example: counts [3, 0, 5] at rows [0, 4, 4] of a 12-row pool, block_m 4 -> sorted_token_ids
        [0, 1, 2, 12, 4, 5, 6, 7, 8, 12, 12, 12, 12, ...] (sentinel 12), expert_ids [0, 2, 2, -1, ...],
        num_tokens_post_padded [12]; 8 routed rows over 3 experts: SGLang 8 + 4 * 3 = 20 ids (5 blocks),
        vLLM 8 + 3 * 3 = 17 ids (5 blocks).
    """
    device = num_rows_e.device
    num_experts = num_rows_e.numel()
    counts_e = num_rows_e.to(torch.int64)
    if num_routed is None:
        num_routed = int(counts_e.sum())
    max_padded = engine.align_buffer_size(num_routed, num_experts, block_m)
    padded_e = (counts_e + block_m - 1) // block_m * block_m
    padded_end_e = torch.cumsum(padded_e, 0)
    # Routed row n is the offset-th row of its expert: pool row start[e] + offset, sorted position padded_start[e] +
    # offset.
    expert_N = torch.repeat_interleave(torch.arange(num_experts, device=device), counts_e, output_size=num_routed)
    offset_N = torch.arange(num_routed, device=device) - (torch.cumsum(counts_e, 0) - counts_e)[expert_N]
    pool_row_N = row_start_e.to(device=device, dtype=torch.int64)[expert_N] + offset_N
    sorted_ids = torch.full((max_padded,), num_pool_rows, dtype=torch.int32, device=device)
    sorted_ids[(padded_end_e - padded_e)[expert_N] + offset_N] = pool_row_N.to(torch.int32)
    block_start = torch.arange(0, _cdiv(max_padded, block_m) * block_m, block_m, device=device)
    block_expert = torch.searchsorted(padded_end_e, block_start, right=True)  # skips experts with no rows
    expert_ids = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    row_expert = torch.full((num_pool_rows,), -1, dtype=torch.int32, device=device)
    row_expert[pool_row_N] = expert_N.to(torch.int32)
    num_padded = padded_end_e[-1:] if num_experts else torch.zeros(1, dtype=torch.int64, device=device)
    return PeerRouting(sorted_ids, expert_ids, num_padded.to(torch.int32), row_expert,
                       torch.ones(max(num_pool_rows, 1), dtype=torch.float32, device=device), block_m, num_pool_rows)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def swap_ab_rule(wheel: str):
    """The wheel's block-FP8 swap-AB rule `(BLOCK_SIZE_M, BLOCK_SIZE_N) -> bool`, run with the engine's CUDA facts
    (`PeerEngine.swap_rule_namespace`)."""
    engine = engine_of(wheel)[0]
    path, name = engine.swap_rule
    return exec_plain(wheel, path, name, engine.swap_rule_namespace())


def _launch_gemm(peer: PeerKernel, a, a_scale, b, b_scale, c, routing: PeerRouting, config: dict, fp8: bool):
    """One `fused_moe_kernel` launch with the arguments the engine's launcher passes (top_k 1, see the module
    docstring): the arguments both engines pass here, the rest in `PeerEngine.gemm_args`."""
    import triton
    import triton.language as tl

    compute_type = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[c.dtype]
    interpreter = is_interpreter()
    num_n, num_k = b.shape[1], b.shape[2]
    scale_2d = a_scale is not None and a_scale.ndim == 2
    common = dict(
        a_ptr=a, b_ptr=b, c_ptr=c, a_scale_ptr=a_scale, b_scale_ptr=b_scale, topk_weights_ptr=routing.topk_weights,
        sorted_token_ids_ptr=routing.sorted_token_ids, expert_ids_ptr=routing.expert_ids,
        num_tokens_post_padded_ptr=routing.num_tokens_post_padded, N=num_n, K=num_k,
        EM=routing.sorted_token_ids.shape[0], num_valid_tokens=routing.num_valid_tokens, stride_am=a.stride(0),
        stride_ak=a.stride(1), stride_be=b.stride(0), stride_bk=b.stride(2), stride_bn=b.stride(1),
        stride_cm=c.stride(-2), stride_cn=c.stride(-1),
        stride_asm=a_scale.stride(0) if scale_2d else 0, stride_ask=a_scale.stride(1) if scale_2d else 0,
        stride_bse=b_scale.stride(0) if fp8 else 0, stride_bsk=b_scale.stride(2) if fp8 else 0,
        stride_bsn=b_scale.stride(1) if fp8 else 0,
        group_n=FP8_BLOCK[0] if fp8 else 0, group_k=FP8_BLOCK[1] if fp8 else 0,
        MUL_ROUTED_WEIGHT=False, top_k=1, compute_type=compute_type, use_fp8_w8a8=fp8, use_int8_w8a8=False,
        use_int8_w8a16=False, per_channel_quant=False,
        **{key: value for key, value in config.items() if key.startswith(("BLOCK_SIZE_", "GROUP_SIZE_"))},
    )
    swap_ab = fp8 and not interpreter and swap_ab_rule(peer.wheel)(config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"])
    args = peer.engine.gemm_args(common, swap_ab)
    missing, unknown = peer.gemm_required - set(args), set(args) - set(peer.gemm_params)
    if missing or unknown:
        raise errors.BackendUnavailableError(
            f"{peer.label}: {GEMM_KERNEL}'s signature is not the one this reader knows ({peer.engine.name} "
            f"{peer.engine.tested_version}): it also takes {sorted(missing)}, it lacks {sorted(unknown)}")
    options = {} if interpreter else {key: config[key] for key in ("num_warps", "num_stages") if key in config}
    options.update(peer.engine.launch_options(a))
    grid = (triton.cdiv(args["EM"], args["BLOCK_SIZE_M"]) * triton.cdiv(num_n, args["BLOCK_SIZE_N"]),)
    try:
        peer.gemm[grid](**args, **options)
    except Exception as exc:  # noqa: BLE001 - a Triton without PDL (launch_pdl, gdc_wait): run without, say so once
        if "launch_pdl" not in options:
            raise
        for key in ("USE_GDC", "launch_pdl", "GDC_EARLY"):
            options.pop(key)
        peer.gemm[grid](**args, **options)  # raises what is wrong besides PDL
        PDL_STATE["ok"] = False
        print(f"peer_moe: the PDL launch failed on Triton {triton.__version__} ({type(exc).__name__}: "
              f"{str(exc)[:200]}); the peer runs without PDL", file=sys.stderr)


def run_peer_mlp(peer: PeerKernel, x_PD: torch.Tensor, gate_up_e2FD: torch.Tensor, down_eDF: torch.Tensor,
                 row_start_e: torch.Tensor, num_rows_e: torch.Tensor, *, x_scale: torch.Tensor | None = None,
                 gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
                 config: PeerConfig, routing: PeerRouting | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The engine's expert MLP on our expert-major pool (`grouped_mlp`'s operands and layout; FP8: e4m3 x with
    per-row per-128 fp32 scales `[P, D/128]`, e4m3 weights with 128x128 block scales).

    `routing`: `peer_routing(row_start_e, num_rows_e, P, config.block_m, peer.engine)`, which a benchmark of the
    kernels alone builds once outside its timed region (built here, with a host sync, when None). Returns y
    `[P, D]` in `out_dtype` (default: bf16 for FP8, else x's dtype; FP8 runs keep gate||up and h in it too, as the
    engines keep them in their activations' dtype); pool rows outside every segment are left unwritten.
    """
    num_pool_rows, hidden = x_PD.shape
    inter = down_eDF.shape[2]
    fp8 = x_PD.dtype == torch.float8_e4m3fn
    if routing is None:
        routing = peer_routing(row_start_e, num_rows_e, num_pool_rows, config.block_m, peer.engine)
    if routing.block_m != config.block_m:
        raise errors.InvalidConfigError(f"routing built for BLOCK_SIZE_M {routing.block_m}, config has "
                                           f"{config.block_m}")
    out_dtype = out_dtype or (torch.bfloat16 if fp8 else x_PD.dtype)
    y_PD = torch.empty(num_pool_rows, hidden, dtype=out_dtype, device=x_PD.device)
    if routing.sorted_token_ids.numel() == 0:
        return y_PD
    gate_up_P2F = torch.empty(num_pool_rows, 2 * inter, dtype=out_dtype, device=x_PD.device)
    _launch_gemm(peer, x_PD, x_scale, gate_up_e2FD, gate_up_scale, gate_up_P2F, routing, config.up, fp8)
    h_PF = torch.empty(num_pool_rows, inter, dtype=out_dtype, device=x_PD.device)
    peer.engine.act(peer, gate_up_P2F, h_PF, routing)
    h_scale = None
    if fp8:
        h_PF, h_scale = _quantize_per_token_group(peer, h_PF)
    _launch_gemm(peer, h_PF, h_scale, down_eDF, down_scale, y_PD, routing, config.down, fp8)
    return y_PD


def _quantize_per_token_group(peer: PeerKernel, h_PF: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's per-token-group (128) FP8 quantization of h (`PeerEngine.quantize`: row-major scales, eps
    1e-10, e4m3 range +-448, one program per group, warps as both engines pick them); moe_ref's
    `quantize_fp8_per_128` under the interpreter."""
    import triton

    if is_interpreter():  # its fp8 cast drops the mantissa carry (120 -> 64, not 128): see _triton_utils.to_e4m3
        from moe_ref.kernels.experts.fp8 import quantize_fp8_per_128

        return quantize_fp8_per_128(h_PF)
    group = FP8_BLOCK[1]
    rows, inter = h_PF.shape
    h_fp8 = torch.empty_like(h_PF, dtype=torch.float8_e4m3fn)
    h_scale = torch.empty(rows, inter // group, dtype=torch.float32, device=h_PF.device)
    block = triton.next_power_of_2(group)
    info = torch.finfo(torch.float8_e4m3fn)
    launch = dict(grid=(h_PF.numel() // group,), BLOCK=block, fp8_min=info.min, fp8_max=info.max,
                  options=dict(num_warps=min(max(block // 256, 1), 8), num_stages=1))
    peer.engine.quantize(peer, h_PF, h_fp8, h_scale, group, launch)
    return h_fp8, h_scale
