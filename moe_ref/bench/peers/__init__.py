"""The Triton fused-MoE kernels that SGLang and vLLM ship, read out of their published wheels at run time: peer
anchors for our grouped expert MLP (`moe_ref.kernels.experts.grouped_mlp`).

    python3 scripts/peer_moe.py --check [--wheel FILE ...]        # PASS/FAIL per case (default: every peer file)
    python3 scripts/peer_moe.py --extract WHEEL --out-dir .whl    # the members this reader opens, as a small zip
    make peers            # .whl/sglang-0.5.23-*.whl and .whl/vllm-0.33.0-fused-moe.zip (the vLLM wheel is not kept)

Peer files (`default_peer_files`; the engine is told by the file name, `<engine>-<version>-...`):
    sglang-<version>-*.whl        SGLang's wheel (tested: 0.5.23, 39 MB; `pip download --no-deps
                                  --only-binary=:all: --python-version 3.12 sglang==0.5.23`)
    vllm-<version>-*.whl          vLLM's wheel (tested: 0.33.0, 336 MB: too large to travel with the tree)
    <engine>-<version>-fused-moe.zip  `extract_members`: only the wheel members this reader opens (the Python files
                                  named in the engine's `PeerEngine` and its tuned-config JSON files), byte for byte
                                  as in the wheel (vLLM 0.33.0: 0.2 MB). Read exactly as the wheel is.
Nothing of the engines' code is stored in this repository: `load_peer_kernel` opens the file with zipfile, takes the
`@triton.jit` functions it needs with `ast` (and every jitted helper or module-level constant they use), writes
them into a generated module in a temporary folder (Triton reads a kernel's source from its file) and imports that.
The plain rules it needs (default tile config, swap-AB) are taken the same way and run in a namespace holding the
engine's CUDA facts. The engines' Python modules themselves cannot be imported (they import most of the engine
and its CUDA extensions).

What runs, as each engine's `fused_experts` runs it on an H200 (SGLang `_fused_moe_kernel_sequence`,
`invoke_fused_moe_kernel`; vLLM `fused_experts_impl`, `invoke_fused_moe_triton_kernel`), with top_k 1:
    GEMM1  `fused_moe_kernel`: x [P, D] @ gate_up[e].T -> gate||up [P, 2F] in the compute dtype (bf16 for FP8)
    act    h = silu(gate) * up [P, F].
           SGLang: its Triton `act_and_mul_kernel` (rows filtered by their expert, as its CUDA path filters them);
             on CUDA SGLang calls its JIT-compiled CUDA `silu_and_mul` here (same math).
           vLLM: torch `F.silu(gate) * up` (vLLM's own `SiluAndMul.forward_native`); on CUDA vLLM calls its compiled
             `torch.ops._C.silu_and_mul` (the same math; not compared bit for bit here), which the wheel holds only
             as a binary: one fused kernel there, two torch kernels here (the vLLM rows pay that).
    quant  FP8 only: h re-quantized per token per 128 columns (eps 1e-10, scale = amax / 448, fp32 scales, row-major)
           with the engine's Triton kernel: SGLang `_per_token_group_quant_8bit`, vLLM `_per_token_group_quant_fp8`
           (use_ue8m0 off: vLLM takes its Triton block-FP8 path without DeepGEMM, whose E8M0 scales it would use
           otherwise). On CUDA both engines call a compiled CUDA op here (same math).
    GEMM2  `fused_moe_kernel`: h @ down[e].T -> y [P, D] (bf16)
    Launch arguments as the engine's launcher passes them (no bias, c unsorted, MUL_ROUTED_WEIGHT off: our grouped
    MLP does not apply routing weights and with top_k 1 there is no top-k sum (vLLM's `moe_sum`); the combine does
    both):
      SGLang: no TMA descriptors; PDL (`USE_GDC`, `launch_pdl`, `GDC_EARLY` for <= 512 rows) on compute capability
        >= 9 (`is_arch_support_pdl`, reimplemented: a two-line capability test); for block-FP8 the wheel's
        `should_enable_swap_ab` (run with SGLang's CUDA/SM90 facts).
      vLLM: SPLIT_K 1, BLOCK_SIZE_K capped at the 128 of the FP8 block, EM cut to P * BLOCK_SIZE_M when the pool has
        fewer rows than BLOCK_SIZE_M, USE_TD off (its CUDA default), no PDL; for block-FP8 the wheel's
        `enable_swap_ab` (capability exactly 9.0, BLOCK_SIZE_M < 64, BLOCK_SIZE_N >= 64). Its
        `naive_block_assignment` path (tokens * top_k * 4 <= E) is never taken here: a token is a pool row, and
        P * 4 > E in every layout here.

W4A16: `load_peer_w4a16` reads the engines' weight-only INT4 kernel (`fused_moe_kernel_gptq_awq`, in the same file as
`fused_moe_kernel`, so `make peers` already extracts it); `run_peer_w4a16_mlp` runs it on our INT4 weights
(scripts/bench_w4a16.py's peer anchor).

Routing inputs: the kernel walks `sorted_token_ids` (token ids grouped by expert, each expert padded to a
multiple of BLOCK_SIZE_M with a sentinel >= num_valid_tokens), `expert_ids` (the expert of each M block) and
`num_tokens_post_padded`. `peer_routing` builds them in torch from OUR expert-major pool (expert i owns pool rows
row_start_e[i] : row_start_e[i] + num_rows_e[i]; with top_k 1 a token id is a pool row), as the engines'
`moe_align_block_size` CUDA op would lay them out (buffer sizes by each engine's formula). It runs once, outside any
timed region: the peer's timing excludes its align step, as ours excludes the dispatch. Pool rows outside every
segment (alignment padding) are not routed: the peer leaves them unwritten in y (its output is `torch.empty`,
as the engine allocates it); compare the rows inside segments.

Tile configs (`peer_config`): the engine's tuned file for (E, N=F, device, dtype), the entry whose batch key is
nearest to M (the engine's M is its token count; with top_k 1 here M = routed rows); else the engine's default rule,
`get_default_config` read from the wheel and run with the engine's CUDA defaults.
    SGLang: `configs/triton_<version>/` folders (the running Triton's version first, then newest first, as
      `get_moe_configs` searches); a `_down` file for GEMM2 when one exists (its BLOCK_SIZE_M forced to GEMM1's);
      `USE_TMA` entries dropped (the TMA variants are not reproduced); rule: no deterministic mode, not ROCm.
    vLLM: the one `configs/` folder (no VLLM_TUNED_CONFIG_FOLDER); one config for both GEMMs; file names spell the
      block `[128,128]` and name any H200-family device NVIDIA_H200; rule: CUDA, not batch invariant.
At our per-rank shapes neither wheel has a tuned H200 file: Kimi-K2 (E=48, N=2048) and Step3 (E=48, N=5120) take the
default rule (`nearest_tuned` names the nearest tuned files, bench_experts prints it; SGLang 0.5.23: block-FP8
E=72,N=2048 in triton_3_8_0, bf16 E=8,N=2048 in triton_3_1_0; vLLM 0.33.0: block-FP8 E=8/32,N=2048, bf16
E=8/16,N=2048).

--check: `run_peer_mlp` vs `moe_ref.kernels.experts.grouped_mlp.grouped_mlp_ref` on tiny uneven layouts (ragged rows
with an empty expert, an expert of BLOCK_SIZE_M rows beside one of BLOCK_SIZE_M + 1, a decode batch that takes the default
rule's small tile, a forced BLOCK_SIZE_M 16 FP8 tile), for every peer file given. Without a GPU it runs under
TRITON_INTERPRET=1 (D = F = 256) in fp32, fp16 and FP8, not bf16: the interpreter's bf16 `tl.dot` and bf16
arithmetic are wrong (see `UPCAST` in moe_ref/kernels/experts/grouped_mlp.py; the peer kernels have no upcast
switch), so there the FP8 run keeps its activations (gate||up, h, y) in fp16, and h is re-quantized by moe_ref's
`quantize_fp8_per_128` (the interpreter's fp8 cast drops the mantissa carry, `_triton_utils.to_e4m3`). On CUDA it
runs the compiled kernels (D 1024, F 512, 8 experts at our 128-row alignment) in bf16, fp16 and FP8 with the
engine's own quantizer; the BLOCK_SIZE_M 16 FP8 case takes the swap-AB path on SM90. Limits: elementwise
(atol, rtol) of tests/interpreter for fp32/fp16/bf16 plus calc_diff < 1e-4; FP8 calc_diff < 1e-3 vs the FP8 twin.
Exit status 1 when a case fails.

Modules: `source` (reading Python out of a zip without importing it), `engines` (`PeerEngine` per engine, `ENGINES`),
`loading` (`load_peer_kernel`, `extract_members`, `default_peer_files`), `configs` (`peer_config`), `search` (the
engines' tuner spaces, `search_config`), `run` (`peer_routing`, `run_peer_mlp`), `w4a16` (the INT4 W4A16 kernel),
`check` (`--check`).

Shape legend: P receive-pool rows, e local experts, D hidden width, F expert intermediate (2F: gate rows then up
rows).
"""
from moe_ref.bench.peers.check import check, check_case, check_cases
from moe_ref.bench.peers.configs import PeerConfig, find_config_file, nearest_tuned, peer_config, tuned_shapes
from moe_ref.bench.peers.engines import (DTYPE_KEYS, ENGINES, FP8_BLOCK, GEMM_KERNEL, SGLANG, VLLM, ZIP_SUFFIX,
                                         PeerEngine, SGLangEngine, VLLMEngine, engine_of)
from moe_ref.bench.peers.loading import PeerKernel, default_peer_files, extract_members, load_peer_kernel
from moe_ref.bench.peers.run import PeerRouting, peer_routing, run_peer_mlp, swap_ab_rule
from moe_ref.bench.peers.search import (SEARCH_MODES, SMEM_LIMIT_SM90, TUNERS, SearchResult, SearchSpace,
                                        block_m_cap, config_problems, effective_config, pruned_space, search_config,
                                        small_stage1, small_stage2, smem_bytes, device_smem_limit, tuned_peer_config,
                                        tuner_space)
from moe_ref.bench.peers.w4a16 import (W4A16_KERNEL, PeerW4A16, int4_words_as_peer_bytes, launch_w4a16_gemm,
                                       load_peer_w4a16, run_peer_w4a16_mlp, w4a16_config_problems)

__all__ = ["check", "check_case", "check_cases", "PeerConfig", "find_config_file", "nearest_tuned", "peer_config",
           "tuned_shapes", "DTYPE_KEYS", "ENGINES", "FP8_BLOCK", "GEMM_KERNEL", "SGLANG", "VLLM", "ZIP_SUFFIX",
           "PeerEngine", "SGLangEngine", "VLLMEngine", "engine_of", "PeerKernel", "default_peer_files",
           "extract_members", "load_peer_kernel", "PeerRouting", "peer_routing", "run_peer_mlp", "swap_ab_rule",
           "SEARCH_MODES", "SMEM_LIMIT_SM90", "TUNERS", "SearchResult", "SearchSpace", "block_m_cap",
           "config_problems", "effective_config", "pruned_space", "search_config", "small_stage1", "small_stage2",
           "smem_bytes", "device_smem_limit", "tuned_peer_config", "tuner_space", "W4A16_KERNEL", "PeerW4A16",
           "int4_words_as_peer_bytes", "launch_w4a16_gemm", "load_peer_w4a16", "run_peer_w4a16_mlp", "w4a16_config_problems"]
