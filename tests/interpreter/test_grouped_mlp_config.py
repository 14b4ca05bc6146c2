"""grouped_mlp's forced-config launcher path (`launch_gemm(..., config=...)`, used by
scripts/tune_grouped_mlp.py) and the GROUP_M program order, vs the torch twin; bf16 and FP8 launches
autotune over their own mid/prefill tile lists; the tuner's FP8 candidates and dry run."""

import importlib
import types

import pytest
import torch
import triton

from moe_ref.kernels.experts.grouped_mlp import grouped_mlp_ref

pytestmark = pytest.mark.interpreter

gm = importlib.import_module("moe_ref.kernels.experts.grouped_mlp")  # the package re-exports a function of that name
tiles = importlib.import_module("moe_ref.kernels.experts.grouped_mlp_tiles")


def _case(counts, hidden, inter, device, align=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    starts, row = [], 0
    for count in counts:
        starts.append(row)
        row += -(-count // align) * align
    num_rows = row + align
    x_PDx = torch.randn(num_rows, hidden, generator=gen)
    gate_up = torch.randn(len(counts), 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(len(counts), hidden, inter, generator=gen) / inter**0.5
    return (x_PDx.to(device), gate_up.to(device), down.to(device),
            torch.tensor(starts, dtype=torch.int64, device=device),
            torch.tensor(counts, dtype=torch.int32, device=device))


def _valid_rows(row_start_e, num_rows_e, num_rows):
    valid = torch.zeros(num_rows, dtype=torch.bool)
    for start, count in zip(row_start_e.tolist(), num_rows_e.tolist()):
        valid[start:start + count] = True
    return valid


def _run_forced(x_PDx, gate_up, down, row_start_e, num_rows_e, config1, config2):
    """Both GEMMs as grouped_mlp launches them (silu, non-fp8), outputs pre-filled with NaN so a tile
    that no program writes shows up."""
    num_rows, hidden = x_PDx.shape
    inter = down.shape[2]
    h_PF = torch.full((num_rows, inter), float("nan"), dtype=x_PDx.dtype, device=x_PDx.device)
    y_PDx = torch.full((num_rows, hidden), float("nan"), dtype=x_PDx.dtype, device=x_PDx.device)
    common = dict(situ_beta=4.0, situ_linear_beta=25.0, fp8=False, quant_out=False, rows_hint=num_rows)
    gm.launch_gemm(x_PDx, None, gate_up, None, h_PF, None, row_start_e, num_rows_e, n=inter, k=hidden,
                    activation="silu", config=config1, **common)
    gm.launch_gemm(h_PF, None, down, None, y_PDx, None, row_start_e, num_rows_e, n=hidden, k=inter,
                    activation="none", config=config2, **common)
    return y_PDx


def _config(block_m, block_n, block_k, group_m=None):
    meta = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k}
    if group_m is not None:
        meta["GROUP_M"] = group_m
    return triton.Config(meta, num_warps=4, num_stages=3)


@pytest.mark.parametrize("config1,config2", [
    (_config(16, 16, 16), _config(16, 32, 16)),                    # N tiles fastest (GROUP_M default 1)
    (_config(16, 16, 16, group_m=2), _config(16, 32, 32, group_m=3)),  # swizzled, groups across experts
    (_config(32, 32, 32, group_m=4), _config(16, 16, 16, group_m=8)),  # group larger than some experts
])
def test_forced_configs_match_twin(config1, config2, device):
    counts = [5, 0, 40, 17, 16]  # empty expert, ragged, multi-block, exact block
    x_PDx, gate_up, down, row_start_e, num_rows_e = _case(counts, hidden=48, inter=40, device=device)
    y_PDx = _run_forced(x_PDx, gate_up, down, row_start_e, num_rows_e, config1, config2)
    y_ref = grouped_mlp_ref(x_PDx, gate_up, down, row_start_e, num_rows_e)
    valid = _valid_rows(row_start_e, num_rows_e, x_PDx.shape[0])
    got, want = y_PDx.cpu()[valid], y_ref.cpu()[valid]
    assert not got.isnan().any(), f"rows left unwritten: {config1=} {config2=}"
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_grouped_mlp_forced_configs_on_packed_and_aligned_pools(device):
    """`grouped_mlp(configs=...)` runs both GEMMs with the given tiles: the same rows give the same output whether
    their segments start back to back (the Triton experts' pool) or on multiples of 16 rows, and match the twin."""
    counts = [5, 0, 40, 17, 16]
    x_PDx, gate_up, down, row_start_e, num_rows_e = _case(counts, hidden=48, inter=40, device=device)
    valid = _valid_rows(row_start_e, num_rows_e, x_PDx.shape[0])
    x_packed = x_PDx[valid.to(device)]
    packed_start_e = torch.tensor([0, 5, 5, 45, 62], dtype=torch.int64, device=device)
    configs = (_config(16, 16, 16, group_m=2), _config(32, 32, 16))
    y_aligned = gm.grouped_mlp(x_PDx, gate_up, down, row_start_e, num_rows_e, num_rows_hint=78, configs=configs)
    y_packed = gm.grouped_mlp(x_packed, gate_up, down, packed_start_e, num_rows_e, num_rows_hint=78, configs=configs)
    assert torch.equal(y_aligned[valid.to(device)], y_packed)  # per-row results: the layout changes no bit
    y_ref = grouped_mlp_ref(x_PDx, gate_up, down, row_start_e, num_rows_e)
    torch.testing.assert_close(y_aligned.cpu(), y_ref.cpu(), atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="BLOCK_N must be 128"):  # a forced tile still meets the fp8 rules
        x, x_scale, gate_up8, gate_up_scale, down8, down_scale, starts, rows = _fp8_case([3], 256, 256, device)
        gm.grouped_mlp(x, gate_up8, down8, starts, rows, x_scale_PDb=x_scale, gate_up_scale=gate_up_scale,
                       down_scale=down_scale, configs=(_config(16, 64, 64), _config(16, 64, 64)))


def test_forced_config_errors(device):
    x_PDx, gate_up, down, row_start_e, num_rows_e = _case([3], hidden=16, inter=8, device=device)
    h_PF = torch.empty(x_PDx.shape[0], 8, device=device)
    common = dict(n=8, k=16, activation="silu", situ_beta=4.0, situ_linear_beta=25.0, rows_hint=16)
    args = (x_PDx, None, gate_up, None, h_PF, None, row_start_e, num_rows_e)
    with pytest.raises(ValueError, match="BLOCK_N must be 128"):
        gm.launch_gemm(*args, fp8=True, quant_out=True, config=_config(16, 64, 64), **common)
    with pytest.raises(ValueError, match="BLOCK_K must divide 128"):
        gm.launch_gemm(*args, fp8=True, quant_out=False, config=_config(16, 64, 96), **common)
    with pytest.raises(ValueError, match="missing"):
        gm.launch_gemm(*args, fp8=False, quant_out=False, config=triton.Config({"BLOCK_M": 16}), **common)


def test_regime_buckets():
    assert tiles.regime(64, 48)[0] == "decode"
    assert tiles.regime(4096, 48)[0] == "mid"  # 85 rows per expert
    assert tiles.regime(32768, 48)[0] == "prefill"  # 683 rows per expert
    assert tiles.regime(16, 0)[0] == "decode"


def test_config_problem_smem_and_registers():
    big = triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=5)
    facts = dict(n=2048, k=7168, fp8=False, quant_out=False, ieee_fp32=False)
    # GEMM1: 5 x (128 + 2 x 128) x 64 x 2 B = 240 KB
    assert "shared memory" in tiles.config_problem(big, gated=True, smem_limit=227 * 1024, **facts)
    assert tiles.config_problem(big, gated=False, smem_limit=227 * 1024, **facts) is None  # 160 KB
    wide = triton.Config({"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 64}, num_warps=8, num_stages=3)
    assert "register" in tiles.config_problem(wide, gated=True, **facts)


@pytest.mark.parametrize("sizes", [{"N": 2048, "K": 7168}, {"N": 8, "K": 16}])  # the second keeps only the fallback
@pytest.mark.parametrize("ieee_fp32", [False, True])
def test_every_autotune_config_sets_the_tma_block_shapes(sizes, ieee_fp32):
    """A TMA launch's descriptors get their block shapes from the config's pre-hook: every config autotune may
    run (list tiles and the fallback) must carry it, or the kernel compiles against the placeholder shape."""
    named = {"rows_hint": 4096, "num_experts": 48, **sizes}
    configs = tiles.prune_configs(tiles.gpu_configs(), named, ACTIVATION=1, FP8=False, QUANT_OUT=False,
                                IEEE_FP32=ieee_fp32)
    assert configs
    for config in configs:
        assert config.pre_hook is tiles.set_tma_block_shapes, config
        nargs = {"a_desc": types.SimpleNamespace(block_shape=None), "b_desc": types.SimpleNamespace(block_shape=None),
                 **config.kwargs}
        config.pre_hook(nargs)
        assert nargs["a_desc"].block_shape == [config.kwargs["BLOCK_M"], config.kwargs["BLOCK_K"]]
        assert nargs["b_desc"].block_shape == [config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"]]
        # interleaved gate/up rows: one b tile holds both halves
        nargs.update(ACTIVATION=1, INTERLEAVED=True)
        config.pre_hook(nargs)
        assert nargs["b_desc"].block_shape == [2 * config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"]]


def test_tile_lists_take_an_optional_group_m(monkeypatch):
    monkeypatch.setattr(tiles, "PREFILL_TILES", [(128, 256, 64, 8, 3, 8), (128, 128, 64, 8, 4, 1)])
    configs = tiles.gpu_configs()
    listed = [tiles.tile_of(c) for c in configs]
    assert (128, 256, 64, 8, 3, 8) in listed and (128, 128, 64, 8, 4) in listed  # GROUP_M 1 drops out
    swizzled = configs[listed.index((128, 256, 64, 8, 3, 8))]
    assert swizzled.kwargs["GROUP_M"] == 8 and swizzled.num_stages == 3
    named = {"rows_hint": 32768, "num_experts": 48, "N": 7168, "K": 2048}
    kept = [tiles.tile_of(c) for c in tiles.prune_configs(configs, named, ACTIVATION=0, FP8=False, QUANT_OUT=False)]
    assert sorted(kept) == sorted([(128, 256, 64, 8, 3, 8), (128, 128, 64, 8, 4)])


# --- FP8: its own mid/prefill tile lists, the forced-config launches the tuner makes -----------------------------

_KIMI_GATE_UP = {"N": 2048, "K": 7168}  # Kimi-K2 per-rank GEMM1: N = F, K = D
_FP8_GATE_UP = dict(ACTIVATION=1, FP8=True, QUANT_OUT=True)
_BF16_GATE_UP = dict(ACTIVATION=1, FP8=False, QUANT_OUT=False)


def _kept(rows_hint, sizes, **flags):
    named = {"rows_hint": rows_hint, "num_experts": 48, **sizes}
    return [tiles.tile_of(c) for c in tiles.prune_configs(tiles.gpu_configs(), named, **flags)]


def test_regime_picks_the_fp8_lists():
    assert tiles.regime(4096, 48, fp8=True) == ("mid", tiles.MID_TILES_FP8)
    assert tiles.regime(32768, 48, fp8=True) == ("prefill", tiles.PREFILL_TILES_FP8)
    assert tiles.regime(64, 48, fp8=True) == ("decode", tiles.DECODE_TILES_FP8)
    assert tiles.regime(64, 48) == ("decode", tiles.DECODE_TILES)
    assert tiles.regime(4096, 48)[1] is tiles.MID_TILES and tiles.regime(32768, 48)[1] is tiles.PREFILL_TILES


def test_fp8_launches_autotune_over_the_fp8_lists_only(monkeypatch):
    """A tile put into an FP8 list reaches FP8 launches of its regime and no bf16 launch (and the reverse)."""
    fp8_mid, fp8_prefill, bf16_mid = (32, 128, 64, 4, 5), (64, 128, 128, 8, 5, 4), (64, 128, 64, 8, 5)
    monkeypatch.setattr(tiles, "MID_TILES_FP8", [fp8_mid])
    monkeypatch.setattr(tiles, "PREFILL_TILES_FP8", [fp8_prefill])
    monkeypatch.setattr(tiles, "MID_TILES", [bf16_mid])
    assert _kept(4096, _KIMI_GATE_UP, **_FP8_GATE_UP) == [fp8_mid]
    assert _kept(32768, _KIMI_GATE_UP, **_FP8_GATE_UP) == [fp8_prefill]
    assert _kept(4096, _KIMI_GATE_UP, **_BF16_GATE_UP) == [bf16_mid]
    assert fp8_prefill not in _kept(32768, _KIMI_GATE_UP, **_BF16_GATE_UP)
    down = {"N": 7168, "K": 2048}
    assert _kept(32768, down, ACTIVATION=0, FP8=True, QUANT_OUT=False) == [fp8_prefill]
    fp8_decode = (16, 128, 128, 4, 7)
    monkeypatch.setattr(tiles, "DECODE_TILES_FP8", [fp8_decode])
    assert _kept(64, down, ACTIVATION=0, FP8=True, QUANT_OUT=False) == [fp8_decode]
    assert fp8_decode not in _kept(64, down, ACTIVATION=0, FP8=False, QUANT_OUT=False)


def test_fp8_list_tiles_illegal_for_fp8_are_pruned(monkeypatch):
    """The library's FP8 rules still apply to the FP8 lists: GEMM1 keeps BLOCK_N 128 tiles only."""
    monkeypatch.setattr(tiles, "MID_TILES_FP8", [(64, 64, 64, 4, 4), (64, 128, 96, 4, 4), (64, 128, 128, 8, 3)])
    assert _kept(4096, _KIMI_GATE_UP, **_FP8_GATE_UP) == [(64, 128, 128, 8, 3)]


def _fp8_case(counts, hidden, inter, device, seed=0):
    from moe_ref.kernels.experts.fp8 import quantize_fp8_per_128, quantize_fp8_per_block_128

    x_PDx, gate_up, down, row_start_e, num_rows_e = _case(counts, hidden, inter, device, seed=seed)
    x_fp8, x_scale = quantize_fp8_per_128(x_PDx)
    gate_up_fp8, gate_up_scale = quantize_fp8_per_block_128(gate_up)
    down_fp8, down_scale = quantize_fp8_per_block_128(down)
    return x_fp8, x_scale, gate_up_fp8, gate_up_scale, down_fp8, down_scale, row_start_e, num_rows_e


@pytest.mark.parametrize("config1,config2", [
    (_config(16, 128, 128), _config(32, 64, 64)),                   # BLOCK_K = one whole scale group
    (_config(32, 128, 64, group_m=2), _config(16, 128, 128, group_m=3)),  # two k-steps per group, swizzled
    # BLOCK_M 64 keeps the operands in place; GEMM2's BLOCK_N 256 spans two weight scale blocks, swapped
    (_config(64, 128, 64), _config(16, 256, 64)),
])
def test_forced_fp8_configs_match_twin(config1, config2, device):
    """The tuner's FP8 launches (e4m3 x + per-row per-128 scales, e4m3 weights + 128x128 block scales, h
    re-quantized by GEMM1's epilogue) with forced tiles vs grouped_mlp_ref on the same operands."""
    counts = [5, 0, 40, 17]
    hidden, inter = 256, 256  # 2 scale groups along D and F: group boundaries inside the tiles' loops
    x, x_scale, gate_up, gate_up_scale, down, down_scale, row_start_e, num_rows_e = _fp8_case(
        counts, hidden, inter, device)
    num_rows = x.shape[0]
    h = torch.full((num_rows, inter), float("nan"), device=device).to(x.dtype)
    h_scale = torch.full((num_rows, inter // 128), float("nan"), device=device)
    y = torch.full((num_rows, hidden), float("nan"), dtype=torch.bfloat16, device=device)
    common = dict(situ_beta=4.0, situ_linear_beta=25.0, fp8=True, rows_hint=num_rows)
    gm.launch_gemm(x, x_scale, gate_up, gate_up_scale, h, h_scale, row_start_e, num_rows_e, n=inter, k=hidden,
                    activation="silu", quant_out=True, config=config1, **common)
    gm.launch_gemm(h, h_scale, down, down_scale, y, None, row_start_e, num_rows_e, n=hidden, k=inter,
                    activation="none", quant_out=False, config=config2, **common)
    y_ref = grouped_mlp_ref(x, gate_up, down, row_start_e, num_rows_e, x_scale_PDb=x_scale,
                            gate_up_scale=gate_up_scale, down_scale=down_scale)
    valid = _valid_rows(row_start_e, num_rows_e, num_rows)
    got, want = y.cpu()[valid].float(), y_ref.cpu()[valid].float()
    assert not got.isnan().any(), f"rows left unwritten: {config1=} {config2=}"
    from moe_ref.testing import calc_diff

    assert calc_diff(got, want) < 1e-5, (config1, config2)


def _tuner():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "tune_grouped_mlp.py"
    spec = importlib.util.spec_from_file_location("tune_grouped_mlp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tuner_explore_adds_the_large_fp8_tiles_past_the_register_rules():
    tune = _tuner()
    for gemm in tune.GEMMS:
        kept, skipped = tune.enumerate_candidates(gemm, fp8=True, explore=True)
        tiles_kept = [c["tile"] for c in kept]
        assert set(tune.EXPLORE_TILES[gemm]) <= set(tiles_kept), gemm  # kept although they exceed the rules
        assert not any("register" in c["reason"] for c in skipped), skipped
        gated = gemm == "gate_up"
        for c in kept:  # the correctness rules still hold
            assert tiles.config_error(tune._make_config(c["tile"], c["group_m"]), fp8=True, quant_out=gated) is None
        plain, _ = tune.enumerate_candidates(gemm, fp8=True)
        assert not set(tune.EXPLORE_TILES[gemm]) & {c["tile"] for c in plain if c["source"] == "grid"}


def test_tuner_fp8_candidates_are_legal_and_dry_run_works(capsys):
    tune = _tuner()
    for gemm in tune.GEMMS:
        kept, skipped = tune.enumerate_candidates(gemm, fp8=True)
        gated = gemm == "gate_up"
        for c in kept:
            config = tune._make_config(c["tile"], c["group_m"])
            assert tiles.config_error(config, fp8=True, quant_out=gated) is None, c["label"]
        assert tune.FIXED_TILE_FP8 in [c["tile"] for c in kept]
        current = {tiles.normalize_tile((*t, g)) for t, g in tune._current_tiles(fp8=True)}
        legal = {tiles.normalize_tile((*c["tile"], c["group_m"])) for c in kept}
        assert current - legal == {tiles.normalize_tile((*c["tile"], c["group_m"])) for c in skipped
                                   if "current" in c["source"]}
    # Triton specialises the FP8 scale strides (multiples of 16 or not): the compile launches copy that
    assert [tune._like_dim(d) for d in (7168, 2048, 5120, 128, 100)] == [1024, 2048, 1024, 128, 100]
    assert tune.main(["--dry-run", "--fp8"]) == 0
    out = capsys.readouterr().out
    assert "MID_TILES_FP8" in out and "bf16 anchor" in out and "x 2 specialisation(s)" in out


@pytest.mark.parametrize("fp8", [False, True])
def test_tuner_decode_sweeps_the_decode_list_and_few_row_tiles(fp8):
    tune = _tuner()
    decode_list = tiles.DECODE_TILES_FP8 if fp8 else tiles.DECODE_TILES
    for gemm in tune.GEMMS:
        kept, _ = tune.enumerate_candidates(gemm, fp8=fp8, decode=True)
        found = {tiles.normalize_tile((*c["tile"], c["group_m"])) for c in kept}
        fitting = {tiles.normalize_tile(t) for t in decode_list
                   if tune._skip_reason(gemm, tuple(t[:5]), fp8, heuristics=False) is None}
        assert fitting and fitting <= found, gemm
        # besides the fixed check tile, only few-row tiles: the decode regime's
        assert {c["tile"][0] for c in kept if c["tile"] != tune.fixed_tile(fp8)} <= {16, 32}, gemm


@pytest.mark.parametrize("fp8", [False, True])
def test_tuner_decode_explore_widens_the_decode_space(fp8):
    """--decode --explore: BLOCK_M up to 64, 8 warps, 3-6 stages, BLOCK_K 64 and 128, effective N 128 and 256, as far
    as the library's correctness and shared-memory rules keep them, after the current decode list."""
    tune = _tuner()
    decode_list = {tiles.normalize_tile(t) for t in (tiles.DECODE_TILES_FP8 if fp8 else tiles.DECODE_TILES)}
    for gemm in tune.GEMMS:
        gated = gemm == "gate_up"
        kept, skipped = tune.enumerate_candidates(gemm, fp8=fp8, explore=True, decode=True)
        grid = [c for c in kept if "grid" in c["source"]]
        assert {c["tile"][0] for c in grid} == {16, 32, 64}, gemm
        assert {c["tile"][3] for c in grid} == {4, 8} and {c["tile"][4] for c in grid} == {3, 4, 5, 6}, gemm
        assert {c["tile"][2] for c in grid} == {64, 128}, gemm
        effective_n = {c["tile"][1] * (2 if gated else 1) for c in grid}
        assert effective_n == ({256} if fp8 and gated else {128, 256}), gemm  # FP8 gate_up: BLOCK_N 128 only
        for c in kept:
            config = tune._make_config(c["tile"], c["group_m"])
            assert tiles.config_error(config, fp8=fp8, quant_out=fp8 and gated) is None, c["label"]
            assert tiles.smem_bytes(config, gated=gated, bytes_per_element=1 if fp8 else 2) <= tune.SMEM_LIMIT
        assert all("shared memory" in c["reason"] or "BLOCK_N must be 128" in c["reason"] for c in skipped), gemm
        current = [tiles.normalize_tile((*c["tile"], c["group_m"])) for c in kept if "current" in c["source"]]
        assert set(current) <= decode_list and kept[:len(current)] == [c for c in kept if "current" in c["source"]]


def _credited_tiles(lines: list[str]) -> dict[tuple, str]:
    """The winners a paste block appends (``    (tile),  # tune_grouped_mlp.py<flags>, <gpu>, <date>: <why>``): tile ->
    the line."""
    import ast

    return {ast.literal_eval(line.split(",  # ")[0].strip()): line for line in lines
            if line.startswith("    (") and ",  # tune_grouped_mlp.py" in line}


def _assert_paste_blocks_credit_the_run(text: str, summary: dict, flag: str) -> None:
    """The tuner's paste rule, whichever tiles the timings made the winners: each winner its tile list lacks is
    appended once, on a line naming the run's flags; a list whose winners it already holds says so."""
    lines = text.splitlines()
    new = {}
    for suggestion in summary["suggestions"].values():
        listed = {tiles.normalize_tile(tuple(t)) for t in getattr(tiles, suggestion["list"])}
        unlisted = [tuple(t) for t in suggestion["tiles"] if tiles.normalize_tile(tuple(t)) not in listed]
        new.setdefault(suggestion["list"], set()).update(unlisted)
    credited = _credited_tiles(lines)
    assert set(credited) == set().union(*new.values()), f"{credited=} {new=}"
    assert all(flag in line for line in credited.values()), credited
    for name, added in new.items():
        assert any(line.startswith(f"{name} = [") for line in lines), name
        if not added:
            assert "]  # unchanged: the winners are already in the list" in lines, name


def test_tuner_alignment_packs_the_segments_and_sweeps_on_cpu(tmp_path, monkeypatch, capsys):
    """--alignment 1: segments back to back (the Triton experts' pool), the rows hint unchanged; the whole sweep runs
    on such a pool (tiny shape, interpreter) and every config's output passes the check. The paste block credits
    the run's flags on each new winner: checked on the winners this run's timings picked, whichever they are, and on
    a winner forced to be one the list lacks (so the ``--alignment 1`` credit is checked on every run)."""
    tune = _tuner()
    assert tune.layout([3, 0, 5], 4) == ([0, 4, 4], 12)
    assert tune.layout([3, 0, 5], 1) == ([0, 3, 3], 8)
    assert tune.main(["--dry-run", "--decode", "--alignment", "1", "--shapes", "kimi-k2"]) == 0
    assert "rows=    64 per expert 1-2 pool R=64 regime=decode" in capsys.readouterr().out
    monkeypatch.setattr(tune, "SHAPES", {"kimi-k2": (4, 256, 128)})
    monkeypatch.setattr(tune, "DEVICE", "cpu")
    out = tmp_path / "tune.json"
    assert tune.main(["--decode", "--alignment", "1", "--rows", "6", "--limit", "1", "--group-m", "", "--rep-ms", "1",
                      "--out", str(out)]) == 0
    import json

    results = json.loads(out.read_text())
    assert [(c["pool_rows"], c["alignment"], c["regime"]) for c in results["cases"]] == [(6, 1, "decode")] * 2
    assert results["runs"] and all(run["ok"] for run in results["runs"])
    assert results["summary"]["suggestions"], "no winner: the paste block was not written"
    _assert_paste_blocks_credit_the_run((tmp_path / "tune.txt").read_text(), results["summary"], "--alignment 1")
    new_tile = tune.FIXED_TILE
    assert tiles.normalize_tile(new_tile) not in {tiles.normalize_tile(t) for t in tiles.DECODE_TILES}
    forced = {"best": [], "suggestions": {"decode/down": {"list": "DECODE_TILES", "tiles": [list(new_tile)],
                                                          "cases": {str(new_tile): ["kimi-k2/6"]}}}}
    lines = tune.paste_blocks(results, forced)
    assert list(_credited_tiles(lines)) == [new_tile], lines
    _assert_paste_blocks_credit_the_run("\n".join(lines), forced, "--alignment 1")


# --- the batch-invariant mode: only tiles of the launch's bits class (kernels.runtime.fixed_tiles) -------------------

@pytest.mark.parametrize("rows_hint", [64, 4096, 32768])
def test_same_bits_pruning_keeps_only_the_fp8_class(rows_hint):
    """FP8 launches in the mode autotune over BLOCK_K 128 tiles only (any BLOCK_N); where the regime's list has
    none left, the precision's one tile of GROUPED_MLP_TILES runs. 16-bit launches keep every tile (one class)."""
    from moe_ref.kernels.runtime.fixed_tiles import GROUPED_MLP_TILES, same_bits_tile

    named = {"rows_hint": rows_hint, "num_experts": 48, **_KIMI_GATE_UP}
    for flags, precision in ((_FP8_GATE_UP, "fp8"), (_BF16_GATE_UP, "16bit")):
        every = [tiles.tile_of(c) for c in tiles.prune_configs(tiles.gpu_configs(), named, **flags)]
        kept = [tiles.tile_of(c) for c in tiles.prune_configs(tiles.gpu_configs(), named, same_bits=True, **flags)]
        assert kept and all(same_bits_tile(t, precision) for t in kept), kept
        assert kept == [t for t in every if same_bits_tile(t, precision)] or kept == [GROUPED_MLP_TILES[precision][0]]
    assert not same_bits_tile((64, 128, 64, 4, 4), "fp8") and same_bits_tile((64, 256, 128, 8, 4, 8), "fp8")
    assert same_bits_tile((16, 128, 128, 4, 5), "fp8") and same_bits_tile((128, 256, 64, 8, 3), "16bit")
    assert [same_bits_tile(t, "fp32") for t in GROUPED_MLP_TILES["fp32"]] == [True, True]
    assert not same_bits_tile((64, 64, 64, 4, 4), "fp32")


def test_the_mode_skips_recorded_tiles_outside_the_class(monkeypatch):
    """``table_config(..., same_bits=...)``: the first recorded candidate of the bits class, past a nearer one
    outside it; without ``same_bits`` the nearer one."""
    from moe_ref.kernels.experts import tile_table

    entry = lambda rows, tile: tile_table.TileEntry(  # noqa: E731
        n=2048, k=7168, experts=48, rows=rows, flags=tile_table.matched_flags(flags), tile=tile)
    flags = dict(ACTIVATION=1, INTERLEAVED=True, FP8=True, QUANT_OUT=True, USE_TMA=True, PERSISTENT=False,
                 IEEE_FP32=False, ADD=False)
    table = {"9.0/TEST GPU": [entry(4096, (64, 128, 64, 4, 4)), entry(32768, (64, 128, 128, 8, 3))]}
    monkeypatch.setattr(tile_table, "load_table", lambda path=None: table)
    monkeypatch.setattr(gm, "gpu_class_of", lambda device: "9.0/TEST GPU")
    facts = dict(n=2048, k=7168, num_experts=48, flags=flags, rows_bucket=4096)
    assert tiles.tile_of(gm.table_config("cuda", **facts)) == (64, 128, 64, 4, 4)
    assert tiles.tile_of(gm.table_config("cuda", same_bits="fp8", **facts)) == (64, 128, 128, 8, 3)
    assert gm.tiles_recorded("cuda")
