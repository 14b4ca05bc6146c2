"""The batch-invariant mode on one GPU (docs/batch_invariance.md): the fixed-tile GEMM against its twin; a token alone
equals the token in a batch (bf16, fp32, FP8 dispatch; Kimi-K2, Kimi-K3's latent path, Step3; experts stored as FP8
blocks, INT4 or MXFP4); eager launches, the layer's eager-graph replays, a user's CUDA graph and torch.compile give
the same bits; the default mode's lone token differs where it does (positive control, reported, not asserted: cuBLAS
and the autotuner may agree); the slot sum's one-launch kernel equals its torch loop bitwise at Kimi-K2's sizes; every
tile of a bits class gives a row the same bits on this GPU (the assumption that lets the mode pick tiles by the row
count)."""
from __future__ import annotations

import pytest
import torch

from moe_ref import MegaMoE
from moe_ref.ep.batch_invariant import rows_with_other_bits, sum_slots, sum_slots_ref
from moe_ref.kernels.runtime import fixed_tiles
from moe_ref.kernels.runtime.fixed_tiles import classes_probed, fixed_tile_matmul, fixed_tile_matmul_ref

pytestmark = pytest.mark.cuda
SIZES = (1, 2, 3, 17, 64, 129)


def tokens(num: int, hidden: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(num, hidden, device="cuda", generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fixed_tile_matmul_is_row_invariant_and_near_its_twin(dtype):
    a, b = tokens(300, 7168 // 8, dtype), tokens(384, 7168 // 8, dtype, seed=2)
    full = fixed_tile_matmul(a, b, torch.float32)
    for size in SIZES:
        assert rows_with_other_bits(fixed_tile_matmul(a[-size:], b, torch.float32), full[-size:]) == 0, size
    torch.testing.assert_close(full, fixed_tile_matmul_ref(a.cpu(), b.cpu(), torch.float32).cuda(), rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("preset", ["tiny-kimi-k2", "tiny-kimi-k3", "tiny-step3"])
@pytest.mark.parametrize("dtype, dispatch_fp8", [(torch.bfloat16, False), (torch.bfloat16, True),
                                                 (torch.float32, False)])
def test_a_token_alone_equals_the_token_in_a_batch(preset, dtype, dispatch_fp8):
    moe = MegaMoE(preset, seed=0, dtype=dtype, device="cuda", batch_invariant=True, dispatch_fp8=dispatch_fp8,
                  num_max_tokens_per_rank=256, eager_graph_max_tokens=0)
    x = tokens(160, moe.cfg.hidden_size, dtype)
    with torch.no_grad():
        full = moe(x)
        for size in SIZES:
            assert rows_with_other_bits(moe(x[-size:]), full[-size:]) == 0, size
        default = MegaMoE(preset, seed=0, dtype=dtype, device="cuda", dispatch_fp8=dispatch_fp8,
                          num_max_tokens_per_rank=256, eager_graph_max_tokens=0)
        print(f"default mode, a lone token vs in the batch: {rows_with_other_bits(default(x[-1:]), default(x)[-1:])} "
              f"row(s) differ")
    moe.destroy()


def test_eager_replay_graph_and_compile_agree_bitwise():
    moe = MegaMoE("tiny-kimi-k2", seed=0, dtype=torch.bfloat16, device="cuda", batch_invariant=True,
                  num_max_tokens_per_rank=64)
    x = tokens(24, moe.cfg.hidden_size, torch.bfloat16)
    with torch.no_grad():
        launched = moe.eager_forward(x, read_checks_now=True).clone()  # read_checks_now: no eager graph
        replayed = [moe(x).clone() for _ in range(3)][-1]  # the second call captures, the third replays
        static = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = moe(static)
        graph.replay()
        compiled = torch.compile(moe, fullgraph=True)(x)
    torch.cuda.synchronize()
    for name, y in (("eager graph", replayed), ("user graph", captured), ("torch.compile", compiled)):
        assert rows_with_other_bits(y, launched) == 0, name
    moe.destroy()


@pytest.mark.parametrize("fmt, dispatch_fp8", [("fp8_block", False), ("fp8_block", True), ("int4_group", False),
                                               ("mxfp4", False)])
def test_a_quantized_checkpoints_token_alone_equals_the_token_in_a_batch(tmp_path, fmt, dispatch_fp8):
    """Experts as stored in the batch-invariant layer: FP8 blocks on the Triton FP8 grouped MLP (FP8BlockExperts),
    INT4 and MXFP4 on the W4A16 kernel's one tile pair (W4A16Experts)."""
    import dataclasses

    from moe_ref.checkpoint.synthetic import quantizable_config, write_synthetic_checkpoint
    from moe_ref.core.config import preset

    cfg = quantizable_config(dataclasses.replace(preset("tiny-deepseek-v3"), hidden_size=256, intermediate_size=128),
                             fmt)
    write_synthetic_checkpoint(tmp_path, cfg, layer_idx=1, quant=fmt, seed=3, dtype=torch.float32)
    moe = MegaMoE(cfg, dtype=torch.bfloat16, device="cuda", batch_invariant=True, dispatch_fp8=dispatch_fp8,
                  num_max_tokens_per_rank=256, eager_graph_max_tokens=0)
    moe.load_hf_weights(tmp_path, layer_idx=1)
    # FP8 blocks: auto's class where it holds DeepGEMM here (its FP8 bits are Triton's), else FP8BlockExperts
    expected = ("FP8BlockExperts", "AutoExperts[triton+deep_gemm]") if fmt == "fp8_block" else ("W4A16Experts",)
    assert type(moe.experts).__name__ in expected and moe.experts.batch_invariant
    x = tokens(160, cfg.hidden_size, torch.bfloat16)
    with torch.no_grad():
        full = moe(x)
        for size in SIZES:
            assert rows_with_other_bits(moe(x[-size:]), full[-size:]) == 0, size
    moe.destroy()


@pytest.mark.parametrize("dispatch_fp8", [True, False], ids=["fp8", "bf16"])
def test_experts_keep_a_rows_bits_when_auto_switches_to_deep_gemm(dispatch_fp8):
    """Experts in the batch-invariant mode with auto holding DeepGEMM: a batch of 1024 tokens over 4 experts (512 rows
    each, past the auto table's thresholds: ~30 rows per expert in FP8, ~241 in bf16) runs DeepGEMM, a token alone
    runs Triton, and a token's bits are the same whichever ran it (``experts.auto.gives_triton_bits``; skipped
    where this GPU and these versions are not listed for the precision)."""
    import dataclasses

    from moe_ref.core.config import preset
    from moe_ref.experts.auto import gives_triton_bits

    cfg = dataclasses.replace(preset("tiny-kimi-k2"), hidden_size=512, intermediate_size=256, num_experts=4,
                              num_topk=2)
    moe = MegaMoE(cfg, seed=0, dtype=torch.bfloat16, device="cuda", batch_invariant=True, dispatch_fp8=dispatch_fp8,
                  num_max_tokens_per_rank=1024, eager_graph_max_tokens=0)
    x = tokens(1024, cfg.hidden_size, torch.bfloat16)
    precision = "fp8" if dispatch_fp8 else "bf16"
    with torch.no_grad():
        full = moe(x)
        if "deep_gemm" not in getattr(moe.experts, "invariant_backends", ()):
            moe.destroy()
            pytest.skip(f"auto runs no backend but Triton in the mode here ({type(moe.experts).__name__}; DeepGEMM "
                        f"giving Triton's {precision} bits: {gives_triton_bits('deep_gemm', 'cuda', precision)})")
        assert moe.experts.last_backend == "deep_gemm"
        ran = {}
        for size in SIZES + (600,):  # the rows hint is T * K over 4 experts: 1 token runs Triton, 600 DeepGEMM
            alone = moe(x[-size:])
            ran[size] = moe.experts.last_backend
            assert rows_with_other_bits(alone, full[-size:]) == 0, (size, ran[size])
    assert ran[1] == "triton" and ran[600] == "deep_gemm", ran
    moe.destroy()


@pytest.mark.parametrize("num_tokens", [1, 128, 4096])
def test_slot_sum_kernel_equals_the_torch_loop_bitwise_at_kimi_k2_sizes(num_tokens):
    """K = 8, Dx = 7168, bf16 rows: about a quarter of the slots masked (their rows NaN, never summed), token 0 wholly
    masked where T > 1, a few zero and subnormal weights (the kernel must not flush them)."""
    K, Dx = 8, 7168
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    rows_TKDx = (torch.randn(num_tokens, K, Dx, device="cuda", generator=gen) * 4).to(torch.bfloat16)
    ids_TK = torch.randint(0, 384, (num_tokens, K), device="cuda", generator=gen)
    ids_TK[torch.rand(num_tokens, K, device="cuda", generator=gen) < 0.25] = -1
    if num_tokens > 1:
        ids_TK[0] = -1
    rows_TKDx[ids_TK < 0] = float("nan")
    weights_TK = torch.rand(num_tokens, K, device="cuda", generator=gen)
    special_TK = torch.randint(0, 8, (num_tokens, K), device="cuda", generator=gen)
    weights_TK = torch.where(special_TK == 0, 0.0, torch.where(special_TK == 1, weights_TK * 1e-39, weights_TK))
    got_TDx = sum_slots(rows_TKDx, ids_TK, weights_TK, torch.bfloat16)  # CUDA: the kernel
    assert rows_with_other_bits(got_TDx, sum_slots_ref(rows_TKDx, ids_TK, weights_TK, torch.bfloat16)) == 0
    assert not got_TDx.isnan().any()
    got_fp32_TDx = sum_slots(rows_TKDx, ids_TK, weights_TK, torch.float32)
    assert rows_with_other_bits(got_fp32_TDx, sum_slots_ref(rows_TKDx, ids_TK, weights_TK, torch.float32)) == 0


# --- the bits classes the mode picks its tiles from (kernels.runtime.fixed_tiles) -------------------------------------
def needs_probed_classes() -> None:
    if not classes_probed(torch.device("cuda")):
        pytest.skip(f"compute capability {torch.cuda.get_device_capability()} is not in SAME_BITS_CAPABILITIES: the "
                    "mode keeps one tile per precision on this GPU, no class to check")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_tile_of_the_matmul_rules_gives_a_row_the_same_bits(dtype):
    """The fixed-tile matmul's rules pick another tile as T or O grows; every tile they can pick (and the one tile
    of a GPU not probed) gives the same output bits on one input, so a row's bits do not depend on T."""
    needs_probed_classes()
    precision = "fp32" if dtype == torch.float32 else "16bit"
    tiles = {rule[2] for rule in fixed_tiles._MATMUL_TILE_RULES[precision]} | {fixed_tiles._MATMUL_TILES[precision]}
    a, b = tokens(300, 1024, dtype), tokens(2048, 1024, dtype, seed=2)
    outputs = {}
    for tile in sorted(tiles):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(fixed_tiles, "matmul_tile", lambda *args, tile=tile: tile)
            outputs[tile] = fixed_tile_matmul(a, b, torch.float32)
    first = next(iter(outputs.values()))
    differing = [tile for tile, out in outputs.items() if rows_with_other_bits(out, first)]
    assert not differing, f"tiles with other bits than {sorted(tiles)[0]}: {differing}"


@pytest.mark.slow  # one compile per tile: ~40 tiles per precision
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_every_tile_of_a_grouped_bits_class_gives_a_row_the_same_bits(fp8):
    """Every tile of the grouped MLP's lists that ``same_bits_tile`` admits, run alone for GEMM1 (interleaved
    gate/up rows and the FP8 epilogue where FP8) and for GEMM2 on one pool (segments of 0-300 rows): one set of bits
    per GEMM (what scripts/probe_tile_bits.py found on an H100 at Kimi-K2's sizes, here on this GPU)."""
    from moe_ref.kernels.experts import grouped_mlp_tiles as tile_lists
    from moe_ref.kernels.experts.fp8 import quantize_fp8_per_block_128
    from moe_ref.kernels.experts.grouped_mlp import interleave_gate_up, launch_gemm
    from moe_ref.kernels.ep.pre_dispatch import quantize_fp8_per_128

    needs_probed_classes()
    precision, experts, hidden, inter = ("fp8" if fp8 else "16bit"), 6, 1024, 512
    counts = torch.tensor([0, 1, 17, 64, 129, 300], dtype=torch.int32, device="cuda")
    starts = torch.tensor([0, 128, 256, 384, 512, 768], dtype=torch.int64, device="cuda")
    num_rows = 1152
    x = tokens(num_rows, hidden, torch.bfloat16)
    gate_up = tokens(experts * 2 * inter, hidden, torch.bfloat16, seed=3).view(experts, 2 * inter, hidden) * 0.03
    down = tokens(experts * hidden, inter, torch.bfloat16, seed=4).view(experts, hidden, inter) * 0.04
    x_scale = w1_scale = w2_scale = h_scale = None
    if fp8:
        x, x_scale = quantize_fp8_per_128(x)
        gate_up, w1_scale = quantize_fp8_per_block_128(gate_up)
        gate_up, w1_scale = interleave_gate_up(gate_up), interleave_gate_up(w1_scale, rows_per_block=1)
        down, w2_scale = quantize_fp8_per_block_128(down)
        h = torch.empty(num_rows, inter, dtype=x.dtype, device="cuda")
        h_scale = torch.empty(num_rows, inter // 128, dtype=torch.float32, device="cuda")
        lists = tile_lists.DECODE_TILES_FP8 + tile_lists.MID_TILES_FP8 + tile_lists.PREFILL_TILES_FP8
    else:
        h = torch.empty(num_rows, inter, dtype=torch.bfloat16, device="cuda")
        lists = tile_lists.DECODE_TILES + tile_lists.MID_TILES + tile_lists.PREFILL_TILES
    y = torch.empty(num_rows, hidden, dtype=torch.bfloat16, device="cuda")
    live = torch.cat([torch.arange(s, s + c) for s, c in zip(starts.tolist(), counts.tolist())]).cuda()
    common = dict(situ_beta=4.0, situ_linear_beta=25.0, fp8=fp8, rows_hint=int(counts.sum()))

    def gemm1(config):
        launch_gemm(x, x_scale, gate_up, w1_scale, h, h_scale, starts, counts, n=inter, k=hidden,
                    activation="silu", quant_out=fp8, interleaved=fp8, config=config, **common)

    def gemm2(config):
        launch_gemm(h, h_scale, down, w2_scale, y, None, starts, counts, n=hidden, k=inter, activation="none",
                    quant_out=False, config=config, **common)

    for name, run, out, n, k, gated in (("GEMM1", gemm1, h, inter, hidden, True),
                                        ("GEMM2", gemm2, y, hidden, inter, False)):
        if name == "GEMM2":  # its input: GEMM1 on the mode's one tile
            gemm1(tile_lists.config_of_tile(fixed_tiles.GROUPED_MLP_TILES[precision][0]))
        bits = {}
        for tile in dict.fromkeys(tile_lists.normalize_tile(t) for t in lists):
            config = tile_lists.config_of_tile(tile)
            if not fixed_tiles.same_bits_tile(tile, precision) or tile_lists.config_problem(
                    config, n=n, k=k, gated=gated, fp8=fp8, quant_out=fp8 and gated, ieee_fp32=False,
                    interleaved=fp8 and gated):
                continue
            out.fill_(0)
            run(config)
            bits[tile] = out[live].view(torch.int8 if fp8 and gated else torch.int16).clone()
        first_tile, first = next(iter(bits.items()))
        differing = [tile for tile, b in bits.items() if not torch.equal(b, first)]
        assert len(bits) > 3 and not differing, f"{name}: tiles with other bits than {first_tile}: {differing}"
