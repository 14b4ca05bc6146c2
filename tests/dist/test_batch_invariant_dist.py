"""The batch-invariant mode at EP 2, 4 and 8 (torchrun, gloo, CPU ranks): every token's output bits equal one process's
output on the same 64 global tokens, over ``symm`` and ``a2a``, fp32, bf16 and bf16 with FP8 dispatch
(``batch_invariant_worker.py``), and each chunk's combine is ONE exchange (one ``all_to_all_single``, or one slot
push and one barrier over ``symm``)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch_invariant_worker import (CHECKPOINT_LAYER, NUM_TOKENS, PRESET, RECIPES, build_layer,  # noqa: E402
                                    global_tokens, row_bytes)
from launch import read_reports, torchrun  # noqa: E402


pytestmark = pytest.mark.dist
WORKER = Path(__file__).resolve().parent / "batch_invariant_worker.py"
NUM_CHUNKS = {2: 3, 4: 2, 8: 2}  # ceil(largest split / the workers' cap of 16)


def write_checkpoint(folder: Path, fmt: str) -> Path:
    """A synthetic Kimi-K2-family checkpoint of one MoE layer with ``fmt`` experts (sizes the format takes)."""
    import dataclasses

    from moe_ref.checkpoint.synthetic import quantizable_config, write_synthetic_checkpoint
    from moe_ref.core.config import preset

    sizes = dict(hidden_size=128, intermediate_size=128) if fmt == "fp8_block" else dict(hidden_size=64,
                                                                                         intermediate_size=32)
    cfg = quantizable_config(dataclasses.replace(preset(PRESET), **sizes), fmt)
    write_synthetic_checkpoint(folder, cfg, layer_idx=CHECKPOINT_LAYER, quant=fmt, seed=3, dtype=torch.float32)
    return folder


def one_process_rows(dtype: torch.dtype, model: str = PRESET, fp8: bool = False) -> list[str]:
    """EP 1 on all tokens, with the workers' one BLAS thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        moe = build_layer(model, dtype=dtype, dispatch_fp8=fp8, num_max_tokens_per_rank=NUM_TOKENS)
        with torch.no_grad():
            return row_bytes(moe(global_tokens(moe.cfg.hidden_size, dtype)))
    finally:
        torch.set_num_threads(threads)


# Kimi-K2's router and shared expert at every EP size; other families' routers (softmax, group-limited greedy), expert
# biases and gated shared experts at one each (transformers' tiny configs: 8 experts)
@pytest.mark.parametrize("world_size, model", [(2, PRESET), (4, PRESET), (8, PRESET), (4, "tiny-step3"),
                                               (4, "hf:gpt_oss"), (2, "hf:qwen2_moe"), (8, "hf:deepseek_v2"),
                                               (2, "ckpt:int4_group"), (4, "ckpt:mxfp4"), (2, "ckpt:fp8_block")])
def test_ep_size_does_not_change_a_token_bits(world_size, model, tmp_path):
    if model.startswith("ckpt:"):  # quantized experts kept as stored (the torch loop over each expert dequantized)
        model = f"ckpt:{write_checkpoint(tmp_path / 'checkpoint', model[5:])}"
    launch = torchrun(world_size, ["--model", model], tmp_path, 90, worker=WORKER)
    assert launch.returncode == 0, f"{launch.returncode=} after {launch.seconds:.0f} s\n{launch.log[-4000:]}"
    reports = read_reports(tmp_path, world_size)
    expected = {recipe: one_process_rows(dtype, model, fp8) for recipe, (dtype, fp8) in RECIPES.items()}
    assert expected["bfloat16+fp8"] != expected["bfloat16"]  # FP8 dispatch ran: its rows are other values
    for transport in ("symm", "a2a"):
        for recipe, rows in expected.items():
            case = f"{transport}/{recipe}"
            seen = []
            for rank in range(world_size):
                assert case in reports[rank], f"rank {rank} did not report {case}\n{launch.log[-4000:]}"
                got = reports[rank][case]
                seen += got["tokens"]
                mismatched = [t for t, row in zip(got["tokens"], got["rows"]) if row != rows[t]]
                assert not mismatched, f"{case} EP {world_size} rank {rank}: tokens {mismatched} differ from EP 1"
            assert sorted(seen) == list(range(NUM_TOKENS)), f"{case}: tokens reported {sorted(seen)}"
            chunks = {reports[rank][case]["combine"]["chunks"] for rank in range(world_size)}
            # every rank runs the group's chunk count (40 rows at EP 2, 24 at EP 4, over a cap of 16)
            assert chunks == {NUM_CHUNKS[world_size]}, f"{case} EP {world_size}: combine_slots calls {chunks}"
            for rank in range(world_size):
                counts = reports[rank][case]["combine"]
                # ONE exchange per chunk (the K-round combine made K, through the default combine's partial pushes)
                assert counts["exchanges"] == counts["chunks"], f"{case} EP {world_size} rank {rank}: {counts}"
                assert counts["partial_pushes"] == 0, f"{case} EP {world_size} rank {rank}: {counts}"
                want_barriers = counts["chunks"] if transport == "symm" else 0
                assert counts["barriers"] == want_barriers, f"{case} EP {world_size} rank {rank}: {counts}"
    assert not launch.leftovers, f"files left in the shm folder: {launch.leftovers}"
