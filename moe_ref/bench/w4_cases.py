"""The shape, weights and rows of the 4-bit experts' benchmarks (scripts/bench_w4a16.py, scripts/ab_w4_decode.py):
Kimi-K2 per rank at EP8 (48 local experts, D 7168, F 2048, SiLU), random bf16 weights (`random_weights`) stored in a
checkpoint format (`quantized_weights`), and routed rows spread uniformly at random over the experts in the pool the
Triton backends plan (alignment 1), as the layer's dispatch hands it to them (`w4_case`). Needs CUDA.

Shape legend: P receive-pool rows, e local experts, D hidden width, Dx expert input width, Db FP8 scale blocks of an
expert input row, F expert intermediate (2F: gate rows then up rows).
"""
from __future__ import annotations

import torch

from moe_ref.checkpoint.formats import QuantFormat, QuantizedExpertWeights, QuantSpec, quantize_weight
from moe_ref.experts import ExpertLayout
from moe_ref.kernels.experts.fp8 import quantize_fp8_per_128

NUM_EXPERTS, HIDDEN, INTER = 48, 7168, 2048


def random_weights(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 gate_up ``[e, 2F, D]`` and down ``[e, D, F]`` on CUDA from ``gen`` (a CUDA generator), scaled by
    1/sqrt(fan-in) so the MLP's outputs stay O(1)."""
    gate_up = (torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=gen) / HIDDEN**0.5).bfloat16()
    down = (torch.randn(NUM_EXPERTS, HIDDEN, INTER, device="cuda", generator=gen) / INTER**0.5).bfloat16()
    return gate_up, down


def quantized_weights(gate_up: torch.Tensor, down: torch.Tensor, fmt: QuantFormat) -> QuantizedExpertWeights:
    """gate_up ``[e, 2F, D]`` and down ``[e, D, F]`` (bf16) stored in `fmt` as a checkpoint holds them (FP8: 128x128
    blocks; INT4, MXFP4: groups of 32), quantized one expert at a time (small temporaries)."""
    stored = []
    for weight in (gate_up, down):
        parts = [quantize_weight(w, fmt) for w in weight]  # one expert at a time: small temporaries
        stored += [torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])]
    return QuantizedExpertWeights(QuantSpec(fmt, 128 if fmt == QuantFormat.FP8_BLOCK else 32), *stored,
                                  hidden_size=HIDDEN, intermediate_size=INTER)


def w4_case(num_rows: int, gen: torch.Generator) -> dict:
    """`num_rows` routed rows (a multinomial over the experts, seeded by `num_rows`) as the layer's device-side
    dispatch hands them to the experts: ``layout`` (alignment 1, static rows hint, unused rows not zeroed), ``x``
    ``[P, D]`` bf16 (random from ``gen``), the FP8 pool ``x_fp8`` ``[P, D]`` e4m3 with ``x_scale`` ``[P, Db]`` fp32,
    ``rows`` and ``touched`` (the fraction of experts that got rows)."""
    counts = torch.bincount(torch.multinomial(torch.ones(NUM_EXPERTS), num_rows, replacement=True,
                                              generator=torch.Generator().manual_seed(num_rows)),
                            minlength=NUM_EXPERTS)
    packed = ExpertLayout.from_counts(counts.cuda(), alignment=1)
    # as the layer's device-side dispatch hands it to the experts: a static rows hint, unused rows not zeroed
    layout = ExpertLayout(packed.row_start_e, packed.num_rows_e, packed.num_pool_rows, 1, num_rows_hint=num_rows,
                          zero_unused_rows=False)
    x_PDx = torch.randn(layout.num_pool_rows, HIDDEN, device="cuda", generator=gen).bfloat16()
    x_fp8, x_scale = quantize_fp8_per_128(x_PDx)
    return dict(rows=num_rows, layout=layout, x=x_PDx, x_fp8=x_fp8, x_scale=x_scale,
                touched=int((counts > 0).sum()) / NUM_EXPERTS)
