"""`scripts/peer_moe.py --check`: `run_peer_mlp` against `grouped_mlp_ref` on tiny uneven layouts, per peer file
(the cases and limits are in `moe_ref.bench.peers`' docstring)."""
from __future__ import annotations

import os

import torch

from moe_ref.bench.peers.configs import PeerConfig, peer_config
from moe_ref.bench.peers.engines import DTYPE_KEYS
from moe_ref.bench.peers.loading import PeerKernel, load_peer_kernel
from moe_ref.bench.peers.run import run_peer_mlp

# (atol, rtol) per output dtype: tests/interpreter/conftest.py's TOLERANCE
_TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (3e-2, 2e-2)}


def check_case(peer: PeerKernel, name: str, counts: list[int], hidden: int, inter: int, dtype: str, device: str,
               align: int, config: PeerConfig | None = None, seed: int = 0) -> tuple[bool, str]:
    """`run_peer_mlp` vs `grouped_mlp_ref` on one layout (`counts` rows per expert, segments `align`-aligned, plus
    a trailing padding block): (passed, one PASS/FAIL line with the diff and the tile config). `config` None: the
    engine's config for an H200 (on CPU) or this GPU. Limits in the module docstring."""
    from moe_ref.experts import ExpertLayout
    from moe_ref.kernels.experts.fp8 import quantize_fp8_per_128, quantize_fp8_per_block_128
    from moe_ref.kernels.experts.grouped_mlp import grouped_mlp_ref
    from moe_ref.testing import calc_diff

    gen = torch.Generator().manual_seed(seed)
    layout = ExpertLayout.from_counts(torch.tensor(counts), align)
    num_pool_rows = layout.num_pool_rows + align  # a trailing padding block too
    valid = torch.zeros(num_pool_rows, dtype=torch.bool)
    valid[:layout.num_pool_rows] = layout.row_expert_P() >= 0
    x = torch.randn(num_pool_rows, hidden, generator=gen)
    gate_up = torch.randn(len(counts), 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(len(counts), hidden, inter, generator=gen) / inter**0.5
    row_start_e, num_rows_e = layout.row_start_e.to(device), layout.num_rows_e.to(device=device, dtype=torch.int32)
    if config is None:
        config = peer_config(peer.wheel, len(counts), inter, dtype, "NVIDIA H200" if device == "cpu" else
                             torch.cuda.get_device_name(), sum(counts), hidden=hidden)
    if dtype == "fp8":
        x = torch.where(valid[:, None], x, 0.0)
        x_q, x_scale = quantize_fp8_per_128(x.to(device))
        (gate_up, gate_up_scale), (down, down_scale) = (quantize_fp8_per_block_128(gate_up.to(device)),
                                                        quantize_fp8_per_block_128(down.to(device)))
        scales = dict(x_scale=x_scale, gate_up_scale=gate_up_scale, down_scale=down_scale)
        args = (x_q, gate_up, down, row_start_e, num_rows_e)
        # the interpreter's bf16 arithmetic is wrong too: there the FP8 run keeps its activations in fp16
        y = run_peer_mlp(peer, *args, **scales, config=config, out_dtype=torch.float16 if device == "cpu" else None)
        want = grouped_mlp_ref(*args, x_scale_PDb=x_scale, gate_up_scale=gate_up_scale, down_scale=down_scale)
    else:
        torch_dtype = DTYPE_KEYS[dtype]
        x = torch.where(valid[:, None], x, float("nan"))  # padding rows are never read
        args = (x.to(device, torch_dtype), gate_up.to(device, torch_dtype), down.to(device, torch_dtype),
                row_start_e, num_rows_e)
        y = run_peer_mlp(peer, *args, config=config)
        want = grouped_mlp_ref(*args)
    got, want = y.cpu()[valid].float(), want.cpu()[valid].float()
    diff = calc_diff(got, want) if not got.isnan().any() else float("nan")
    ok = diff < (1e-3 if dtype == "fp8" else 1e-4)
    detail = f"calc_diff={diff:.2e}"
    if dtype != "fp8":
        atol, rtol = _TOLERANCE[DTYPE_KEYS[dtype]]
        bad = int(((got - want).abs() > atol + rtol * want.abs()).sum() + got.isnan().sum())
        ok = ok and bad == 0
        detail += f" elementwise(atol={atol:g}, rtol={rtol:g}) mismatches={bad}"
    tiles = f"BM={config.up['BLOCK_SIZE_M']} BN={config.up['BLOCK_SIZE_N']} BK={config.up['BLOCK_SIZE_K']}"
    verdict = "PASS" if ok else "FAIL"
    return ok, f"{verdict} {peer.engine.name:6s} {name:40s} {dtype:4s} {detail} [{tiles}, {config.source}]"


def check_cases(device: str) -> tuple[int, int, int, list[tuple[str, list[int], str, PeerConfig | None]]]:
    """(hidden, inter, align, [(name, counts, dtype, forced config or None)]) of --check on `device`."""
    small_m = PeerConfig(*[{"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
                            "num_warps": 4, "num_stages": 3}] * 2, "forced BLOCK_SIZE_M 16 (swap-AB on SM90)", 0)
    if device == "cpu":  # tiny: the interpreter is slow
        hidden, inter, align = 256, 256, 16
        dtypes, ragged = ("fp32", "fp16", "fp8"), [5, 0, 19]
    else:
        hidden, inter, align = 1024, 512, 128
        dtypes, ragged = ("bf16", "fp16", "fp8"), [3, 0, 130, 64, 1, 257, 0, 40]
    cases = [("ragged + empty expert", ragged, dtype, None) for dtype in dtypes]
    cases += [("rows == BLOCK_M, BLOCK_M + 1 (64, 65)", [64, 65, 0, 1], dtype, None) for dtype in dtypes[1:]]
    cases += [("decode (M <= E: small default tile)", [1, 0, 2, 0], dtype, None) for dtype in dtypes[:2]]
    cases += [("ragged + empty expert, BLOCK_SIZE_M 16", ragged, "fp8", small_m)]
    return hidden, inter, align, cases


def check(wheels: list[str]) -> int:
    """Every check case for every peer file; prints PASS/FAIL per case, returns the number of failures."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mode = "compiled kernels on " + torch.cuda.get_device_name() if device == "cuda" else \
        "TRITON_INTERPRET=1 on CPU; bf16 not checked here: the interpreter's bf16 tl.dot and arithmetic are " \
        "wrong, so FP8 keeps its activations (gate||up, h, y) in fp16 here, and h is re-quantized by moe_ref's " \
        "quantize_fp8_per_128 (the interpreter's fp8 cast drops the mantissa carry)"
    hidden, inter, align, cases = check_cases(device)
    failures = total = 0
    for wheel in wheels:
        peer = load_peer_kernel(wheel)
        print(f"peer {peer.label} from {os.path.basename(wheel)} ({mode}); kernels imported from {peer.module_file}")
        for name, counts, dtype, config in cases:
            ok, line = check_case(peer, name, counts, hidden, inter, dtype, device, align, config)
            print(line, flush=True)
            failures += not ok
            total += 1
    print(f"{total - failures}/{total} passed")
    return failures
