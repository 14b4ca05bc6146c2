"""The engines' weight-only INT4 kernel (W4A16, group-wise scales), read from the same file as `fused_moe_kernel`:
loaded (`load_peer_w4a16`), run on our INT4 weights (`int4_words_as_peer_bytes`) per GEMM (`launch_w4a16_gemm`) and as
the whole MLP (`run_peer_w4a16_mlp`): scripts/bench_w4a16.py's peer anchor.

Shape legend: P receive-pool rows, e local experts, D hidden width, F expert intermediate (2F: gate rows then up
rows), O output features of one weight matrix, I its input features.
"""
from __future__ import annotations

import dataclasses
import sys

import torch

from moe_ref.bench.peers.engines import VLLM, is_interpreter, read_member
from moe_ref.bench.peers.loading import PeerKernel, import_jit, load_peer_kernel
from moe_ref.bench.peers.run import PeerRouting
from moe_ref.bench.peers.search import CONFIG_KEYS
from moe_ref.bench.peers.source import function_params
from moe_ref.core import errors

# Both engines ship it in the same file as fused_moe_kernel (SGLang `invoke_fused_moe_kernel` launches it for
# int4_w4a16 with a group block shape; vLLM `invoke_fused_moe_wna16_triton_kernel`, which on CUDA it takes only above
# 6 rows per expert, its compiled wna16 kernel below, and for compressed-tensors INT4 it prefers Marlin). Its weights:
# uint8 [e, N, K/2], element 2j in the low nibble of byte j, value = nibble - 8 (no zero points), times a scale
# [e, N, K/group]: our INT4 int32 words read as bytes (`int4_words_as_peer_bytes`). It loads b without a K mask, so
# K must be a multiple of BLOCK_SIZE_K.
W4A16_KERNEL = "fused_moe_kernel_gptq_awq"


@dataclasses.dataclass
class PeerW4A16:
    """An engine's W4A16 kernel (`W4A16_KERNEL`), imported from its wheel, with the engine's other kernels (`peer`:
    its act step)."""

    peer: PeerKernel
    gemm: object                 # fused_moe_kernel_gptq_awq (triton.jit)
    params: tuple[str, ...]
    required: frozenset[str]

    @property
    def label(self) -> str:
        return f"{self.peer.label} {W4A16_KERNEL}"


def load_peer_w4a16(wheel_path: str) -> PeerW4A16:
    """Read an engine's W4A16 Triton kernel out of `wheel_path` (as `load_peer_kernel`; BackendUnavailableError
    when the file lacks it)."""
    peer = load_peer_kernel(wheel_path)
    module = import_jit(peer.wheel, [(peer.engine.kernels, [W4A16_KERNEL])],
                        f"{peer.engine.name}_{peer.version.replace('.', '_')}_w4a16")
    params, required = function_params(read_member(peer.wheel, peer.engine.kernels), W4A16_KERNEL)
    return PeerW4A16(peer, getattr(module, W4A16_KERNEL), params, required)


def int4_words_as_peer_bytes(packed_eOIw: torch.Tensor) -> torch.Tensor:
    """Our INT4 int32 words `[..., O, I/8]` (nibble j of word w = element 8w + j) as the engines' uint8
    `[..., O, I/2]` (element 2j low nibble of byte j): the same bytes on a little-endian machine (a view).

    Example: word 0x000000A9 -> bytes [0xA9, 0, 0, 0]: element 0 = 9 - 8 = 1, element 1 = 10 - 8 = 2.
    """
    if sys.byteorder != "little":
        raise errors.BackendUnavailableError("the INT4 word-to-byte view assumes a little-endian machine")
    return packed_eOIw.view(torch.uint8)


def w4a16_config_problems(config: dict, k: int) -> list[str]:
    """Why `config` cannot run `W4A16_KERNEL` for a GEMM of reduction width `k` (empty: it can)."""
    problems = [f"no {key}" for key in CONFIG_KEYS if key not in config]
    if not problems and k % config["BLOCK_SIZE_K"]:
        problems.append(f"K={k} is not a multiple of BLOCK_SIZE_K={config['BLOCK_SIZE_K']} (b is loaded unmasked)")
    return problems


def launch_w4a16_gemm(w4: PeerW4A16, a: torch.Tensor, b_u8: torch.Tensor, b_scale: torch.Tensor, c: torch.Tensor,
                      routing: PeerRouting, config: dict, group_size: int = 32) -> None:
    """One `W4A16_KERNEL` launch as the engine's launcher passes it (top_k 1, no zero points, no routing weights):
    c[r] = a[r] @ dequantized(b[expert of r]).T for the routed rows. `a` `[P, K]` bf16/fp16/fp32, `b_u8` `[e, N, K/2]`,
    `b_scale` `[e, N, K/group_size]`, `c` `[P, N]` in a's dtype."""
    import triton
    import triton.language as tl

    problems = w4a16_config_problems(config, a.shape[1])
    if problems:
        raise errors.InvalidConfigError(f"{w4.label}: {'; '.join(problems)}")
    if routing.block_m != config["BLOCK_SIZE_M"]:
        raise errors.InvalidConfigError(f"routing built for BLOCK_SIZE_M {routing.block_m}, config has "
                                           f"{config['BLOCK_SIZE_M']}")
    compute_type = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[c.dtype]
    num_n, num_k = b_u8.shape[1], a.shape[1]
    em = routing.sorted_token_ids.shape[0]
    if w4.peer.engine is VLLM and routing.num_valid_tokens < config["BLOCK_SIZE_M"]:  # its small-batch cut
        em = min(em, routing.num_valid_tokens * config["BLOCK_SIZE_M"])
    even_k = num_k % config["BLOCK_SIZE_K"] == 0
    args = dict(
        a_ptr=a, b_ptr=b_u8, c_ptr=c, b_scale_ptr=b_scale, b_zp_ptr=None, topk_weights_ptr=routing.topk_weights,
        sorted_token_ids_ptr=routing.sorted_token_ids, expert_ids_ptr=routing.expert_ids,
        num_tokens_post_padded_ptr=routing.num_tokens_post_padded, N=num_n, K=num_k, EM=em,
        num_valid_tokens=routing.num_valid_tokens, stride_am=a.stride(0), stride_ak=a.stride(1),
        stride_be=b_u8.stride(0), stride_bk=b_u8.stride(2), stride_bn=b_u8.stride(1), stride_cm=c.stride(-2),
        stride_cn=c.stride(-1), stride_bse=b_scale.stride(0), stride_bsk=b_scale.stride(2),
        stride_bsn=b_scale.stride(1), stride_bze=0, stride_bzk=0, stride_bzn=0, group_size=group_size,
        MUL_ROUTED_WEIGHT=False, top_k=1, compute_type=compute_type, has_zp=False, use_int4_w4a16=True,
        use_int8_w8a16=False, SPLIT_K=1,
        even_Ks=even_k, block_k_diviable=even_k,  # SGLang's and vLLM's names of the same flag (each takes its own)
        **{key: value for key, value in config.items() if key.startswith(("BLOCK_SIZE_", "GROUP_SIZE_"))},
    )
    args = {key: value for key, value in args.items() if key in w4.params}
    missing = w4.required - set(args)
    if missing:
        raise errors.BackendUnavailableError(f"{w4.label}: its signature is not the one this reader knows: it also "
                                                f"takes {sorted(missing)}")
    options = {} if is_interpreter() else {key: config[key] for key in ("num_warps", "num_stages") if key in config}
    grid = (triton.cdiv(em, config["BLOCK_SIZE_M"]) * triton.cdiv(num_n, config["BLOCK_SIZE_N"]),)
    w4.gemm[grid](**args, **options)


def run_peer_w4a16_mlp(w4: PeerW4A16, x_PD: torch.Tensor, gate_up_u8: torch.Tensor, gate_up_scale: torch.Tensor,
                       down_u8: torch.Tensor, down_scale: torch.Tensor, routing: PeerRouting, up_config: dict,
                       down_config: dict) -> torch.Tensor:
    """The engine's INT4 W4A16 expert MLP on our expert-major pool: GEMM1 (gate||up `[P, 2F]`), the engine's act,
    GEMM2, each GEMM with its own config (one BLOCK_SIZE_M: `routing`'s). Weights as `int4_words_as_peer_bytes`
    gives them, scales `[e, 2F, D/32]` / `[e, D, F/32]`. Returns y `[P, D]` in x's dtype; pool rows outside every
    segment are left unwritten."""
    num_pool_rows, hidden = x_PD.shape
    inter = down_u8.shape[2] * 2
    y_PD = torch.empty(num_pool_rows, hidden, dtype=x_PD.dtype, device=x_PD.device)
    gate_up_P2F = torch.empty(num_pool_rows, 2 * inter, dtype=x_PD.dtype, device=x_PD.device)
    launch_w4a16_gemm(w4, x_PD, gate_up_u8, gate_up_scale, gate_up_P2F, routing, up_config)
    h_PF = torch.empty(num_pool_rows, inter, dtype=x_PD.dtype, device=x_PD.device)
    w4.peer.engine.act(w4.peer, gate_up_P2F, h_PF, routing)
    launch_w4a16_gemm(w4, h_PF, down_u8, down_scale, y_PD, routing, down_config)
    return y_PD
