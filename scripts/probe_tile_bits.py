"""Which GEMM tiles give a row the same bits (a GPU question the batch-invariant mode depends on).

For one pool of expert rows (segments of 0-300 rows at 128-aligned starts) every candidate tile of the grouped MLP's
lists runs GEMM1 and GEMM2 alone (`launch_gemm(..., config=...)`), and every candidate tile of the fixed-tile
matmul runs the router and shared-expert shapes, and (``--only w4``, or by default) every tile of the W4A16 kernel
(``grouped_mlp_w4.TILES``) runs its two GEMMs on INT4 and MXFP4 weights with bf16 rows, and (``--only deep_gemm``)
DeepGEMM's experts run the same probe rows inside pools of every size its tile heuristic sees; outputs are grouped by
their bits. Tiles of one group are interchangeable in the batch-invariant mode (a token's sum has the same order
whichever of them runs), so the mode may pick among them by the row count. Each candidate is also timed at the
layer's row counts.

    python3 scripts/probe_tile_bits.py --out results/probe [--only grouped|fixed|w4|deep_gemm] [--precision fp8]
    (a GPU; writes probe.json, prints the groups)

Shape legend: P pool rows, D hidden, F expert intermediate, e experts, T tokens, O output features.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import torch
import triton

from moe_ref.kernels.experts import grouped_mlp_tiles as tiles
from moe_ref.kernels.experts.grouped_mlp import launch_gemm
from moe_ref.kernels.runtime import fixed_tiles

FP8_DTYPE = torch.float8_e4m3fn

SEGMENT_ROWS = [0, 1, 2, 3, 15, 16, 17, 31, 33, 63, 64, 65, 127, 128, 129, 200, 255, 256, 257, 300]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:12]


def pool(num_experts: int, seed: int):
    counts = [SEGMENT_ROWS[(i * 7 + seed) % len(SEGMENT_ROWS)] for i in range(num_experts)]
    starts, row = [], 0
    for c in counts:
        starts.append(row)
        row += cdiv(max(c, 1), 128) * 128
    return (torch.tensor(starts, dtype=torch.int64, device="cuda"), torch.tensor(counts, dtype=torch.int32,
            device="cuda"), row)


def live_rows(t: torch.Tensor, starts, counts) -> torch.Tensor:
    return torch.cat([t[s:s + c] for s, c in zip(starts.tolist(), counts.tolist()) if c])


def print_groups(label: str, what: str, groups: dict[str, list], show=lambda members: members) -> None:
    """``label: N group(s) of bits over M <what>``, then each group's digest and its members (``show``n)."""
    print(f"{label}: {len(groups)} group(s) of bits over {sum(map(len, groups.values()))} {what}", flush=True)
    for key, members in groups.items():
        print(f"  {key}: {show(members)}", flush=True)


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=3, rep=15) * 1e3  # us


def grouped(precision: str, results: dict, num_experts=48, hidden=7168, inter=2048) -> None:
    fp8 = precision == "fp8"
    g = torch.Generator(device="cuda").manual_seed(0)
    starts, counts, num_rows = pool(num_experts, 0)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, device="cuda") * scale

    if fp8:
        x = rand(num_rows, hidden).to(FP8_DTYPE)
        x_scale = rand(num_rows, cdiv(hidden, 128)).abs() * 1e-2 + 1e-3
        w1 = rand(num_experts, 2 * inter, hidden).to(FP8_DTYPE)
        w1_scale = rand(num_experts, cdiv(2 * inter, 128), cdiv(hidden, 128)).abs() * 1e-2 + 1e-3
        w2 = rand(num_experts, hidden, inter).to(FP8_DTYPE)
        w2_scale = rand(num_experts, cdiv(hidden, 128), cdiv(inter, 128)).abs() * 1e-2 + 1e-3
        h = torch.empty(num_rows, inter, dtype=FP8_DTYPE, device="cuda")
        h_scale = torch.empty(num_rows, cdiv(inter, 128), dtype=torch.float32, device="cuda")
        out_dtype = torch.bfloat16
        tile_list = tiles.DECODE_TILES_FP8 + tiles.MID_TILES_FP8 + tiles.PREFILL_TILES_FP8
    else:
        x = rand(num_rows, hidden).bfloat16()
        x_scale = w1_scale = w2_scale = h_scale = None
        w1 = (rand(num_experts, 2 * inter, hidden) * hidden ** -0.5).bfloat16()
        w2 = (rand(num_experts, hidden, inter) * inter ** -0.5).bfloat16()
        h = torch.empty(num_rows, inter, dtype=torch.bfloat16, device="cuda")
        out_dtype = torch.bfloat16
        tile_list = tiles.DECODE_TILES + tiles.MID_TILES + tiles.PREFILL_TILES
    y = torch.empty(num_rows, hidden, dtype=out_dtype, device="cuda")
    candidates = list(dict.fromkeys(tiles.normalize_tile(t) for t in tile_list))
    common = dict(situ_beta=4.0, situ_linear_beta=25.0, fp8=fp8)
    gemm1 = lambda cfg, hint, sched=None, tma=None: launch_gemm(  # noqa: E731
        x, x_scale, w1, w1_scale, h, h_scale, starts, counts, n=inter, k=hidden, activation="silu",
        quant_out=fp8, rows_hint=hint, interleaved=fp8, config=cfg, schedule=sched, tma=tma, **common)
    gemm2 = lambda cfg, hint, sched=None, tma=None: launch_gemm(  # noqa: E731
        h, h_scale, w2, w2_scale, y, None, starts, counts, n=hidden, k=inter, activation="none",
        quant_out=False, rows_hint=hint, config=cfg, schedule=sched, tma=tma, **common)
    total = int(counts.sum())
    for name, run, out, n, k, gated in (("gemm1", gemm1, h, inter, hidden, True), ("gemm2", gemm2, y, hidden, inter,
                                                                                          False)):
        if name == "gemm2":  # GEMM2's input: GEMM1 on one fixed legal tile
            gemm1(tiles.config_of_tile((64, 128, 64, 4, 4) if not fp8 else (64, 128, 128, 8, 3)), total)
        groups: dict[str, list] = {}
        for tile in candidates:
            cfg = tiles.config_of_tile(tile)
            problem = tiles.config_problem(cfg, n=n, k=k, gated=gated, fp8=fp8, quant_out=fp8 and gated,
                                           ieee_fp32=False, interleaved=fp8 and gated)
            if problem:
                continue
            for sched, tma in ((None, None), ("persistent", None), (None, False)):
                out.fill_(0)
                try:
                    run(cfg, total, sched, tma)
                    torch.cuda.synchronize()
                except Exception as exc:  # noqa: BLE001 - a tile that does not fit this GPU
                    print(f"{precision} {name} {tile} {sched} tma={tma}: {type(exc).__name__}", flush=True)
                    break
                key = digest(live_rows(out, starts, counts))
                groups.setdefault(key, []).append([list(tile), sched or "default", "ptr" if tma is False else "tma"])
                if sched is None and tma is None:
                    results["grouped_time"].append(dict(precision=precision, gemm=name, tile=list(tile),
                                                        us=round(bench(lambda: run(cfg, total)), 1), rows=total))
        results["grouped_groups"][f"{precision}/{name}"] = groups
        print_groups(f"{precision} {name}", "runs", groups, lambda members: sorted({tuple(m[0]) for m in members}))


def w4(fmt: str, results: dict, num_experts=48, hidden=7168, inter=2048) -> None:
    """Every W4A16 tile on one pool of bf16 rows, GEMM1 (gated, SiLU) and GEMM2, ``fmt`` "int4" or "mxfp4" weights:
    the groups of bits per GEMM, each tile's time."""
    from moe_ref.kernels.experts.grouped_mlp_w4 import TILES, launch_w4_gemm
    from moe_ref.kernels.experts.w4 import quantize_int4, quantize_mxfp4, to_group_planes

    g = torch.Generator(device="cuda").manual_seed(0)
    starts, counts, num_rows = pool(num_experts, 0)

    def stack(out_features: int, in_features: int):
        dense = torch.randn(num_experts, out_features, in_features, generator=g, device="cuda") * in_features ** -0.5
        return to_group_planes(*(quantize_int4(dense) if fmt == "int4" else quantize_mxfp4(dense)), fmt)

    x = torch.randn(num_rows, hidden, generator=g, device="cuda").bfloat16()
    h = torch.randn(num_rows, inter, generator=g, device="cuda").bfloat16()
    total = int(counts.sum())
    for name, a, weight, out_features, activation in (("gemm1", x, stack(2 * inter, hidden), inter, "silu"),
                                                      ("gemm2", h, stack(hidden, inter), hidden, "none")):
        out = torch.empty(num_rows, out_features, dtype=torch.bfloat16, device="cuda")
        groups: dict[str, list] = {}
        for tile in TILES:
            def run(tile=tile):
                launch_w4_gemm(a, weight, out, starts, counts, rows_hint=total, tile=tile, activation=activation)

            out.fill_(0)
            try:
                run()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a tile that does not fit this GPU
                print(f"w4 {fmt} {name} {tile}: {type(exc).__name__}", flush=True)
                continue
            groups.setdefault(digest(live_rows(out, starts, counts)), []).append(list(tile))
            results["w4_time"].append(dict(fmt=fmt, gemm=name, tile=list(tile), us=round(bench(run), 1), rows=total))
        results["w4_groups"][f"{fmt}/{name}"] = groups
        print_groups(f"w4 {fmt} {name}", "tiles", groups)


def deep_gemm_experts(precision: str, num_experts=48, hidden=7168, inter=2048):
    """``DeepGemmExperts`` over random bf16 weights of Kimi-K2's per-rank share (FP8: quantized once, 128x128 blocks)."""
    from moe_ref.experts.deep_gemm.backend import DeepGemmExperts

    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=g, device="cuda") * hidden ** -0.5).bfloat16()
    down = (torch.randn(num_experts, hidden, inter, generator=g, device="cuda") * inter ** -0.5).bfloat16()
    return DeepGemmExperts(gate_up, down, fp8=precision == "fp8")


def deep_gemm_rows(experts, results: dict) -> None:
    """DeepGEMM picks its own tiles by the problem's M, so it cannot be forced tile by tile: instead the same probe
    rows (16 rows of the first expert, then 16 of the last) run through ``experts`` (``deep_gemm_experts``) inside
    pools of every size class the heuristic sees (other experts' rows 0 to 700 each: 64 to 33,600 pool rows), in both
    contiguous forms (segment ends, a packed pool sized 2x; a row's expert, unpacked), in the masked form (the masked
    GEMMs) and with the probe rows reversed in their segments. One group of bits for the probe rows over every run:
    DeepGEMM gives a row the same bits whatever its batch (on this GPU and build), the question the batch-invariant
    mode's use of it waits on. The batch-invariant mode's own experts (the Triton grouped MLP on its bits class,
    sharing the FP8 weights) run the same pools beside it: were their bits DeepGEMM's too, the mode could switch
    between the two by the row count."""
    import dataclasses

    from moe_ref.experts import ExpertLayout, TritonExperts

    precision = "fp8" if experts.fp8 else "bf16"
    num_experts, hidden = experts.num_local_experts, experts.hidden_size
    invariant_triton = TritonExperts(experts.gate_up_weight_e2FD, experts.down_weight_eDF,
                                     fp8_weights=experts.fp8_weights)
    invariant_triton.batch_invariant = True
    g = torch.Generator(device="cuda").manual_seed(1)
    probe = {0: torch.randn(16, hidden, generator=g, device="cuda").bfloat16(),
             num_experts - 1: torch.randn(16, hidden, generator=g, device="cuda").bfloat16()}
    groups: dict[str, list] = {}
    triton_groups: dict[str, list] = {}
    for others in (0, 1, 8, 64, 170, 700):
        counts = torch.full((num_experts,), others, dtype=torch.int64, device="cuda")
        for e, rows in probe.items():
            counts[e] = others + rows.shape[0]
        base = ExpertLayout.from_counts(counts, experts.segment_alignment)
        masked_rows = cdiv(int(counts.max()), 128) * 128  # the masked pool: expert i's rows at i * M
        masked = ExpertLayout(torch.arange(num_experts, device="cuda") * masked_rows, counts, num_experts * masked_rows,
                              masked_rows, masked_rows=masked_rows)
        for form, reverse in (("psum", False), ("psum", True), ("rows", False), ("masked", False)):
            layout = {"psum": dataclasses.replace(base, num_pool_rows=2 * base.num_pool_rows),
                      "rows": dataclasses.replace(base, packed=False), "masked": masked}[form]
            x = torch.randn(layout.num_pool_rows, hidden, generator=g, device="cuda").bfloat16()
            placed = []
            for e, rows in probe.items():  # the probe rows after the expert's other rows
                at = int(layout.row_start_e[e]) + others + torch.arange(rows.shape[0], device="cuda")
                at = at.flip(0) if reverse else at
                x[at] = rows
                placed.append(at)
            run = dict(other_rows=others, pool_rows=layout.num_pool_rows, form=form, reversed=reverse)
            for backend, backend_groups in ((experts, groups), (invariant_triton, triton_groups)):
                y = backend(x, layout)
                torch.cuda.synchronize()
                backend_groups.setdefault(digest(torch.cat([y[at] for at in placed])), []).append(run)
    results["deep_gemm_groups"][precision] = groups
    results["deep_gemm_groups"][f"{precision}/triton+invariant"] = triton_groups
    show = lambda members: [(m["other_rows"], m["form"], m["reversed"]) for m in members]  # noqa: E731
    print_groups(f"deep_gemm {precision}", "pools", groups, show)
    print_groups(f"triton+invariant {precision} (the same pools)", "pools", triton_groups, show)
    print(f"deep_gemm {precision}: bits shared with triton+invariant: {sorted(set(groups) & set(triton_groups))}",
          flush=True)


def deep_gemm_vs_triton_gemms(experts, results: dict) -> None:
    """Does the Triton FP8 GEMM give DeepGEMM's bits? Each FP8 GEMM of ``experts`` (``deep_gemm_experts("fp8")``:
    gate_up on the interleaved weights, down) runs once through DeepGEMM's contiguous GEMM and once through
    ``launch_gemm`` with no activation (bf16 out, as DeepGEMM writes) on every legal tile of the FP8 lists, over one
    pool (segments of 0-300 rows). Both promote per 128-K step in fp32; a tile whose rows all equal DeepGEMM's would
    let the batch-invariant mode run Triton at decode and DeepGEMM at prefill with the activation between the GEMMs
    done by one kernel for both."""
    from moe_ref.ep.batch_invariant import rows_with_other_bits
    from moe_ref.experts import ExpertLayout
    from moe_ref.experts.deep_gemm.backend import grouped_layout

    weights = experts.fp8_weights
    g = torch.Generator(device="cuda").manual_seed(2)
    starts, counts, num_rows = pool(experts.num_local_experts, 3)
    group_P = grouped_layout(ExpertLayout(starts, counts.long(), num_rows, 128), num_rows, starts.device)
    total = int(counts.sum())
    candidates = list(dict.fromkeys(tiles.normalize_tile(t) for t in
                                    tiles.DECODE_TILES_FP8 + tiles.MID_TILES_FP8 + tiles.PREFILL_TILES_FP8))
    shared = {}
    hidden, inter = experts.hidden_size, experts.intermediate_size
    for name, w, w_scale, n, k in (("gate_up", weights.gate_up_fp8_e2FD, weights.gate_up_scale_e2FbDb, 2 * inter,
                                    hidden), ("down", weights.down_fp8_eDF, weights.down_scale_eDbFb, hidden, inter)):
        x = torch.randn(num_rows, k, generator=g, device="cuda").to(FP8_DTYPE)
        x_scale = torch.rand(num_rows, cdiv(k, 128), generator=g, device="cuda") * 1e-2 + 1e-3
        reference = live_rows(experts._grouped_gemm((x, x_scale), (w, w_scale), group_P), starts, counts)
        equal = []
        for tile in candidates:
            cfg = tiles.config_of_tile(tile)
            if tiles.config_problem(cfg, n=n, k=k, gated=False, fp8=True, quant_out=False, ieee_fp32=False):
                continue
            c = torch.zeros(num_rows, n, dtype=torch.bfloat16, device="cuda")
            launch_gemm(x, x_scale, w, w_scale, c, None, starts, counts, n=n, k=k, activation="none",
                        situ_beta=4.0, situ_linear_beta=25.0, fp8=True, quant_out=False, rows_hint=total, config=cfg)
            mine = live_rows(c, starts, counts)
            rows_other = rows_with_other_bits(mine, reference)
            diff = (mine.float() - reference.float()).abs().max().item()
            print(f"fp8 {name} {tile}: {rows_other} of {total} rows differ from DeepGEMM's (max |diff| {diff:.3g})",
                  flush=True)
            if rows_other == 0:
                equal.append(list(tile))
        shared[name] = equal
        print(f"fp8 {name}: Triton tiles with DeepGEMM's bits: {equal}", flush=True)
    results["deep_gemm_vs_triton"] = shared


def fixed(results: dict) -> None:
    shapes = {"router": (7168, 384, torch.bfloat16, torch.float32), "shared_gate_up": (7168, 4096, torch.bfloat16,
              torch.bfloat16), "shared_down": (2048, 7168, torch.bfloat16, torch.bfloat16),
              "router_fp32": (7168, 384, torch.float32, torch.float32)}
    pick_tile = fixed_tiles.matmul_tile
    for name, (k, o, dtype, out_dtype) in shapes.items():
        g = torch.Generator(device="cuda").manual_seed(1)
        w = torch.randn(o, k, generator=g, device="cuda").to(dtype)
        x_all = torch.randn(4096, k, generator=g, device="cuda").to(dtype)
        ieee = dtype == torch.float32
        if ieee:
            cands = [(bm, bn, bk, 4, 2) for bm in (16, 32, 64) for bn in (16, 32, 64) for bk in (16, 32)]
        else:
            cands = [(bm, bn, bk, w_, s) for bm in (16, 32, 64, 128) for bn in (16, 32, 64, 128)
                     for bk in (64, 128) for w_, s in ((4, 3), (8, 3), (4, 5))]
        groups: dict[str, list] = {}
        for tile in cands:

            def run(x, tile=tile):  # the public kernel, its tile rule replaced by this one tile
                fixed_tiles.matmul_tile = lambda *args: tile
                try:
                    return fixed_tiles.fixed_tile_matmul(x, w, out_dtype)
                finally:
                    fixed_tiles.matmul_tile = pick_tile

            try:
                y = run(x_all[:200])
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001
                print(f"fixed {name} {tile}: {type(exc).__name__}", flush=True)
                continue
            groups.setdefault(digest(y), []).append(list(tile))
            for t in (1, 16, 128, 1024, 4096):
                results["fixed_time"].append(dict(shape=name, tile=list(tile), T=t,
                                                  us=round(bench(lambda: run(x_all[:t])), 2)))
        results["fixed_groups"][name] = groups
        print_groups(f"fixed {name}", "tiles", groups)
        for t in (1, 16, 128, 1024, 4096):
            rows = sorted((r for r in results["fixed_time"] if r["shape"] == name and r["T"] == t),
                          key=lambda r: r["us"])[:3]
            cublas = bench(lambda: torch.matmul(x_all[:t], w.t()))
            print(f"  T={t}: cuBLAS {cublas:.1f} us; best {[(tuple(r['tile']), r['us']) for r in rows]}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/probe")
    parser.add_argument("--only", choices=("grouped", "fixed", "w4", "deep_gemm"), default=None)
    parser.add_argument("--precision", choices=("bf16", "fp8"), default=None,
                        help="the grouped MLP's or DeepGEMM's: one only")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "date": time.strftime("%Y-%m-%d"), "grouped_groups": {}, "grouped_time": [], "fixed_groups": {},
               "fixed_time": [], "w4_groups": {}, "w4_time": [], "deep_gemm_groups": {}}
    if args.only in (None, "fixed"):
        fixed(results)
    if args.only in (None, "grouped"):
        for precision in [args.precision] if args.precision else ("bf16", "fp8"):
            grouped(precision, results)
    if args.only in (None, "w4"):
        for fmt in ("int4", "mxfp4"):
            w4(fmt, results)
    if args.only in (None, "deep_gemm"):
        from moe_ref.experts.deep_gemm.probe import deep_gemm_status

        if deep_gemm_status().available:
            for precision in [args.precision] if args.precision else ("fp8", "bf16"):
                experts = deep_gemm_experts(precision)
                if experts.fp8:
                    deep_gemm_vs_triton_gemms(experts, results)
                deep_gemm_rows(experts, results)
                del experts  # the next precision's weights in its place
        else:
            print(f"deep_gemm: not probed ({deep_gemm_status().reason})", flush=True)
    with open(os.path.join(args.out, "probe.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
