"""grouped_mlp (Triton) vs grouped_mlp_ref (torch) over expert-major pools with padding rows."""

import importlib

import pytest
import torch
import triton

from moe_ref.core.errors import InvalidConfigError, ShapeError
from moe_ref.kernels.experts.fp8 import quantize_fp8_per_block_128
from moe_ref.kernels.experts.grouped_mlp import grouped_mlp, grouped_mlp_ref
from moe_ref.kernels.ep.pre_dispatch import quantize_fp8_per_128

# the module (the package's attribute of that name is the function)
grouped_mlp_module = importlib.import_module("moe_ref.kernels.experts.grouped_mlp")

pytestmark = [pytest.mark.interpreter,
              # padding rows hold NaN or garbage that TMA tiles read (and the store masks)
              pytest.mark.filterwarnings("ignore:invalid value encountered in matmul"),
              pytest.mark.filterwarnings("ignore:overflow encountered in add")]

FP8 = torch.float8_e4m3fn

# name -> rows per expert; segments start at multiples of ALIGN (the interpreter's BLOCK_M is 16)
LAYOUTS = {
    "empty_expert_and_ragged": [5, 0, 19],
    "all_rows_in_one_expert": [0, 0, 33],
    "block_multiple_and_single_row": [16, 1, 32],
}
ALIGN = 16


def _layout(counts, device):
    starts, row = [], 0
    for count in counts:
        starts.append(row)
        row += -(-count // ALIGN) * ALIGN
    num_rows = row + ALIGN  # a trailing padding block too
    return (torch.tensor(starts, dtype=torch.int64, device=device),
            torch.tensor(counts, dtype=torch.int32, device=device), num_rows)


def _valid_rows(row_start_e, num_rows_e, num_rows):
    valid = torch.zeros(num_rows, dtype=torch.bool)
    for start, count in zip(row_start_e.tolist(), num_rows_e.tolist()):
        valid[start:start + count] = True
    return valid


def _inputs(counts, hidden, inter, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    row_start_e, num_rows_e, num_rows = _layout(counts, device)
    num_experts = len(counts)
    x_PDx = torch.randn(num_rows, hidden, generator=gen)
    # padding garbage never reaches a valid row (TMA tiles read it; the rows are masked at the store)
    x_PDx[~_valid_rows(row_start_e, num_rows_e, num_rows)] = float("nan")
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    return (x_PDx.to(dtype).to(device), gate_up.to(dtype).to(device), down.to(dtype).to(device),
            row_start_e, num_rows_e)


def _maybe_fp8(fp8: bool, x_PDx, gate_up, down):
    """(x, gate_up, down, the scale keywords of grouped_mlp): quantized to e4m3 per 128 (x, NaN padding as 0) and
    per 128x128 block (weights) when `fp8`, else as given with no keywords."""
    if not fp8:
        return x_PDx, gate_up, down, {}
    x_PDx, x_scale = quantize_fp8_per_128(x_PDx.nan_to_num(0.0))
    gate_up, gate_up_scale = quantize_fp8_per_block_128(gate_up)
    down, down_scale = quantize_fp8_per_block_128(down)
    return x_PDx, gate_up, down, dict(x_scale_PDb=x_scale, gate_up_scale=gate_up_scale, down_scale=down_scale)


def _check_padding_zero(y_PDx, row_start_e, num_rows_e, **case):
    pad = ~_valid_rows(row_start_e, num_rows_e, y_PDx.shape[0])
    assert (y_PDx.cpu()[pad] == 0).all(), f"padding rows must be zero: {case=}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("activation,situ_linear_beta", [("silu", 25.0), ("situ", 25.0), ("situ", 0.0)])
def test_matches_twin(layout, dtype, activation, situ_linear_beta, device, assert_close):
    hidden, inter = 48, 40  # not powers of two
    x_PDx, gate_up, down, row_start_e, num_rows_e = _inputs(LAYOUTS[layout], hidden, inter, dtype, device)
    kwargs = dict(activation=activation, situ_beta=4.0, situ_linear_beta=situ_linear_beta)
    y_PDx = grouped_mlp(x_PDx, gate_up, down, row_start_e, num_rows_e, **kwargs)
    y_ref = grouped_mlp_ref(x_PDx, gate_up, down, row_start_e, num_rows_e, **kwargs)
    case = dict(layout=layout, dtype=dtype, activation=activation, situ_linear_beta=situ_linear_beta)
    _check_padding_zero(y_PDx, row_start_e, num_rows_e, **case)
    assert_close(y_PDx, y_ref, dtype, **case)


@pytest.mark.parametrize("activation", ["silu", "situ"])
@pytest.mark.parametrize("hidden,inter", [(48, 40), (160, 136)])  # second: 2 scale groups on D and F
def test_fp8_matches_twin(activation, hidden, inter, device, assert_close):
    x_PDx, gate_up, down, row_start_e, num_rows_e = _inputs(LAYOUTS["empty_expert_and_ragged"], hidden, inter,
                                                           torch.float32, device, seed=1)
    x_fp8, x_scale = quantize_fp8_per_128(x_PDx.nan_to_num(0.0))
    gate_up_fp8, gate_up_scale = quantize_fp8_per_block_128(gate_up)
    down_fp8, down_scale = quantize_fp8_per_block_128(down)
    args = (x_fp8, gate_up_fp8, down_fp8, row_start_e, num_rows_e, activation)
    kwargs = dict(x_scale_PDb=x_scale, gate_up_scale=gate_up_scale, down_scale=down_scale)
    y_PDx = grouped_mlp(*args, **kwargs)
    y_ref = grouped_mlp_ref(*args, **kwargs)
    assert y_PDx.dtype == torch.bfloat16
    _check_padding_zero(y_PDx, row_start_e, num_rows_e, activation=activation, hidden=hidden)
    assert_close(y_PDx, y_ref, "fp8", activation=activation, hidden=hidden, inter=inter)
    # and close to the unquantized fp32 MLP (fp8 error budget)
    y_fp32 = grouped_mlp_ref(x_PDx, gate_up, down, row_start_e, num_rows_e, activation)
    rel = (y_PDx.float() - y_fp32).norm() / y_fp32.norm()
    assert rel < 0.1, f"{rel=} {activation=} {hidden=}"


@pytest.mark.parametrize("fp8", [False, True])
def test_tma_and_pointer_loads_agree(fp8, device, monkeypatch, assert_close):
    """The TMA-descriptor loads (the default where possible) and the pointer loads (MOE_REF_TMA=0) give the
    same MLP; inter = 128 also takes the fp8 path's one-scale-per-tile promotion for both gate and up."""
    hidden, inter = 128, 128
    x_PDx, gate_up, down, row_start_e, num_rows_e = _inputs(LAYOUTS["empty_expert_and_ragged"], hidden, inter,
                                                           torch.float32 if fp8 else torch.bfloat16, device, seed=2)
    x_PDx, gate_up, down, kwargs = _maybe_fp8(fp8, x_PDx, gate_up, down)
    assert grouped_mlp_module._tma_possible(x_PDx, gate_up)
    y_tma = grouped_mlp(x_PDx, gate_up, down, row_start_e, num_rows_e, **kwargs)
    monkeypatch.setenv("MOE_REF_TMA", "0")
    assert not grouped_mlp_module._tma_possible(x_PDx, gate_up)
    y_pointers = grouped_mlp(x_PDx, gate_up, down, row_start_e, num_rows_e, **kwargs)
    y_ref = grouped_mlp_ref(x_PDx, gate_up, down, row_start_e, num_rows_e, **kwargs)
    for y in (y_tma, y_pointers):
        _check_padding_zero(y, row_start_e, num_rows_e, fp8=fp8)
        assert_close(y, y_ref, "fp8" if fp8 else torch.bfloat16, fp8=fp8)
    assert torch.equal(y_tma, y_pointers)  # same tiles, same dots: only the loads differ


def _interleaved(gate_up, kwargs):
    """gate_up (and its fp8 block scales in ``kwargs``, a copy) in alternating 128-row gate and up blocks."""
    if "gate_up_scale" in kwargs:
        kwargs = dict(kwargs, gate_up_scale=grouped_mlp_module.interleave_gate_up(kwargs["gate_up_scale"], 1))
    return grouped_mlp_module.interleave_gate_up(gate_up), kwargs


def test_interleave_gate_up_alternates_blocks_and_inverts():
    """Rows [g0..g3, u0..u3] in blocks of 2 -> [g0, g1, u0, u1, g2, g3, u2, u3]; deinterleave gives them back; F not
    a multiple of the block is refused."""
    rows = torch.arange(8).reshape(1, 8, 1)
    blocks = grouped_mlp_module.interleave_gate_up(rows, 2)
    assert blocks.flatten().tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert torch.equal(grouped_mlp_module.deinterleave_gate_up(blocks, 2), rows)
    assert grouped_mlp_module.interleave_gate_up(rows, 1).flatten().tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    with pytest.raises(ShapeError, match="F % 128 == 0"):
        grouped_mlp_module.interleave_gate_up(torch.zeros(1, 2 * 136, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "fp8"])
@pytest.mark.parametrize("tma", ["1", "0"])
@pytest.mark.parametrize("hidden,inter", [(48, 128), (160, 256)])  # odd D; 2 gate/up blocks and 2 D scale groups
def test_interleaved_gate_up_gives_the_stacked_mlp(dtype, tma, hidden, inter, device, monkeypatch, assert_close):
    """gate_up rows re-laid out in alternating 128-row gate and up blocks (one dot over both per k-step), FP8
    block scales alike, compute the MLP of the stacked rows: vs the twin (which puts them back: the same function)
    and vs the kernel on stacked rows."""
    monkeypatch.setenv("MOE_REF_TMA", tma)
    fp8 = dtype == "fp8"
    x_PDx, gate_up, down, row_start_e, num_rows_e = _inputs(LAYOUTS["empty_expert_and_ragged"], hidden, inter,
                                                           torch.float32 if fp8 else dtype, device, seed=3)
    x_PDx, gate_up, down, kwargs = _maybe_fp8(fp8, x_PDx, gate_up, down)
    interleaved, interleaved_kwargs = _interleaved(gate_up, kwargs)
    assert torch.equal(interleaved[:, 128:256].view(torch.uint8), gate_up[:, inter:inter + 128].view(torch.uint8))
    y_PDx = grouped_mlp(x_PDx, interleaved, down, row_start_e, num_rows_e, gate_up_interleaved=True,
                        **interleaved_kwargs)
    y_twin = grouped_mlp_ref(x_PDx, interleaved, down, row_start_e, num_rows_e, gate_up_interleaved=True,
                             **interleaved_kwargs)
    y_stacked = grouped_mlp(x_PDx, gate_up, down, row_start_e, num_rows_e, **kwargs)
    assert torch.equal(y_twin, grouped_mlp_ref(x_PDx, gate_up, down, row_start_e, num_rows_e, **kwargs))
    case = dict(dtype=dtype, tma=tma, hidden=hidden, inter=inter)
    _check_padding_zero(y_PDx, row_start_e, num_rows_e, **case)
    assert_close(y_PDx, y_twin, "fp8" if fp8 else dtype, **case)
    assert_close(y_PDx, y_stacked, "fp8" if fp8 else dtype, **case)


def test_interleaved_gate_up_needs_whole_blocks(device):
    """Interleaved rows with F not a multiple of 128, or a forced tile whose BLOCK_N is not 128, are refused."""
    x_PDx, gate_up, down, row_start_e, num_rows_e = _inputs([3], 64, 40, torch.float32, device)
    with pytest.raises(InvalidConfigError, match="n % 128 == 0"):
        grouped_mlp(x_PDx, gate_up, down, row_start_e, num_rows_e, gate_up_interleaved=True)
    x_PDx, gate_up, down, row_start_e, num_rows_e = _inputs([3], 64, 128, torch.float32, device)
    config = triton.Config({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32})
    with pytest.raises(InvalidConfigError, match="BLOCK_N must be 128"):
        grouped_mlp(x_PDx, grouped_mlp_module.interleave_gate_up(gate_up), down, row_start_e, num_rows_e,
                    gate_up_interleaved=True, configs=(config, config))


@pytest.mark.parametrize("layout,fp8,interleaved,group_m", [(layout, False, False, 1) for layout in LAYOUTS] + [
    ("empty_expert_and_ragged", True, True, 1), ("all_rows_in_one_expert", False, True, 2)])
def test_every_schedule_gives_the_same_bytes(layout, fp8, interleaved, group_m, device, monkeypatch):
    """Programs walking the live tiles computes every tile exactly as one program per tile of the upper bound does
    ("grid"), bitwise: "persistent" (the interpreter's: 4 programs, so each walks several tiles, L2 swizzle or not),
    "hinted" with a hint of 1 row (a grid of e row blocks: programs walk the tiles past it) and with the true rows."""
    x_PDx, gate_up, down, row_start_e, num_rows_e = _inputs(LAYOUTS[layout], 160, 128 if interleaved else 136,
                                                           torch.float32 if fp8 else torch.bfloat16, device, seed=5)
    x_PDx, gate_up, down, kwargs = _maybe_fp8(fp8, x_PDx, gate_up, down)
    if interleaved:
        gate_up, kwargs = _interleaved(gate_up, kwargs)
    plain_meta = grouped_mlp_module.tiles.interpreter_meta
    monkeypatch.setattr(grouped_mlp_module.tiles, "interpreter_meta",
                        lambda *flags: dict(plain_meta(*flags), GROUP_M=group_m))
    runs = {"grid": {}, "persistent": {}, "hinted 1 row": dict(num_rows_hint=1),
            "hinted": dict(num_rows_hint=int(num_rows_e.sum()))}
    outputs = {name: grouped_mlp(x_PDx, gate_up, down, row_start_e, num_rows_e, gate_up_interleaved=interleaved,
                                 schedule=name.split()[0], **hint, **kwargs) for name, hint in runs.items()}
    for name, y in outputs.items():
        assert torch.equal(outputs["grid"], y), (name, layout, fp8, interleaved, group_m)
        _check_padding_zero(y, row_start_e, num_rows_e, layout=layout)


def test_tma_needs_16_byte_rows(device):
    """Row strides that are not a multiple of 16 bytes fall back to pointer loads (TMA's alignment rule);
    forcing TMA then is refused with a clear error."""
    x_PDx, gate_up, down, row_start_e, num_rows_e = _inputs([3], 36, 8, torch.bfloat16, device)  # 72-byte rows
    assert not grouped_mlp_module._tma_possible(x_PDx, gate_up)
    h = torch.empty(x_PDx.shape[0], 8, dtype=x_PDx.dtype, device=device)
    with pytest.raises(ValueError, match="TMA"):
        grouped_mlp_module.launch_gemm(x_PDx, None, gate_up, None, h, None, row_start_e, num_rows_e, n=8, k=36,
                                        activation="silu", situ_beta=4.0, situ_linear_beta=0.0, fp8=False,
                                        quant_out=False, rows_hint=3, tma=True)


@pytest.mark.parametrize("fp8", [False, True])
def test_unused_rows_left_unwritten_on_request(fp8, device):
    """zero_unused_rows=False (the device-side dispatch's whole pool) skips zeroing the pool: rows inside the
    segments are the same bits, the others are whatever the allocator held."""
    x_PDx, gate_up, down, row_start_e, num_rows_e = _inputs(LAYOUTS["empty_expert_and_ragged"], 48, 40,
                                                           torch.float32, device, seed=3)
    x_PDx, gate_up, down, kwargs = _maybe_fp8(fp8, x_PDx, gate_up, down)
    y_zeroed = grouped_mlp(x_PDx, gate_up, down, row_start_e, num_rows_e, **kwargs)
    y_left = grouped_mlp(x_PDx, gate_up, down, row_start_e, num_rows_e, zero_unused_rows=False, **kwargs)
    valid = _valid_rows(row_start_e, num_rows_e, x_PDx.shape[0])
    assert torch.equal(y_left.cpu()[valid], y_zeroed.cpu()[valid])
    _check_padding_zero(y_zeroed, row_start_e, num_rows_e, fp8=fp8)


@pytest.mark.parametrize("fp8,dtype", [(False, torch.bfloat16), (False, torch.float32), (True, torch.float32)])
def test_add_in_the_second_gemms_epilogue(fp8, dtype, device, assert_close):
    """add_PDx (the routed output the shared experts' MLP adds): the twin's fp32 sum plus add, rounded once; adding
    zeros gives the bits of no add; rows outside the segments stay 0 (add's rows there are never read)."""
    x_PDx, gate_up, down, row_start_e, num_rows_e = _inputs(LAYOUTS["empty_expert_and_ragged"], 48, 40, dtype,
                                                           device, seed=5)
    x_PDx, gate_up, down, kwargs = _maybe_fp8(fp8, x_PDx, gate_up, down)
    out_dtype = torch.bfloat16 if fp8 else dtype
    gen = torch.Generator().manual_seed(6)
    add_PDx = (torch.randn(x_PDx.shape[0], 48, generator=gen) * 4).to(out_dtype).to(device)
    args = (x_PDx, gate_up, down, row_start_e, num_rows_e)
    y_PDx = grouped_mlp(*args, add_PDx=add_PDx, **kwargs)
    y_ref = grouped_mlp_ref(*args, add_PDx=add_PDx, **kwargs)
    _check_padding_zero(y_PDx, row_start_e, num_rows_e, fp8=fp8)
    assert_close(y_PDx, y_ref, "fp8" if fp8 else dtype, fp8=fp8)
    assert not torch.allclose(y_PDx.float(), grouped_mlp(*args, **kwargs).float(), atol=1e-2)  # add was added
    assert torch.equal(grouped_mlp(*args, add_PDx=torch.zeros_like(add_PDx), **kwargs), grouped_mlp(*args, **kwargs))


def test_add_is_only_for_the_second_gemm(device):
    x_PDx, gate_up, down, row_start_e, num_rows_e = _inputs([3], 16, 8, torch.float32, device)
    h = torch.empty(x_PDx.shape[0], 8, device=device)
    common = dict(situ_beta=4.0, situ_linear_beta=0.0, fp8=False, quant_out=False, rows_hint=3)
    with pytest.raises(ValueError, match="only GEMM2"):  # a gated GEMM1
        grouped_mlp_module.launch_gemm(x_PDx, None, gate_up, None, h, None, row_start_e, num_rows_e, n=8, k=16,
                                        activation="silu", add=torch.zeros_like(h), **common)
    y = torch.empty(x_PDx.shape[0], 16, device=device)
    for bad in (torch.zeros(x_PDx.shape[0], 8, device=device), torch.zeros_like(y, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="only GEMM2"):  # wrong shape, wrong dtype
            grouped_mlp_module.launch_gemm(h, None, down, None, y, None, row_start_e, num_rows_e, n=16, k=8,
                                            activation="none", add=bad, **common)


def test_no_rows_at_all_gives_zeros(device):
    x_PDx, gate_up, down, row_start_e, num_rows_e = _inputs([0, 0], 16, 8, torch.float32, device)
    y_PDx = grouped_mlp(x_PDx, gate_up, down, row_start_e, num_rows_e)
    assert torch.equal(y_PDx, torch.zeros_like(y_PDx))


def test_worked_example(device):
    x_PDx = torch.tensor([[2.0]], device=device)
    gate_up = torch.tensor([[[1.0], [3.0]]], device=device)
    down = torch.tensor([[[1.0]]], device=device)
    y = grouped_mlp(x_PDx, gate_up, down, torch.tensor([0], device=device), torch.tensor([1], device=device))
    assert abs(y.item() - 2.0 * torch.sigmoid(torch.tensor(2.0)).item() * 6.0) < 1e-5


def test_bad_shapes_raise_value_error(device):
    x_PDx, gate_up, down, row_start_e, num_rows_e = _inputs([3], 16, 8, torch.float32, device)
    with pytest.raises(ValueError, match="weight shapes"):
        grouped_mlp(x_PDx, gate_up[:, :15], down, row_start_e, num_rows_e)
    with pytest.raises(ValueError, match="activation"):
        grouped_mlp(x_PDx, gate_up, down, row_start_e, num_rows_e, activation="gelu")
    with pytest.raises(ValueError, match="x_scale_PDb"):
        grouped_mlp(x_PDx.to(FP8), gate_up.to(FP8), down.to(FP8), row_start_e, num_rows_e)
    with pytest.raises(ValueError, match="schedule='stream' must be one of grid, hinted, persistent"):
        grouped_mlp(x_PDx, gate_up, down, row_start_e, num_rows_e, schedule="stream")


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("activation", ["silu", "situ"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_expert_over_every_row_is_the_dense_mlp(num_tokens, activation, dtype, device, monkeypatch, assert_close):
    """``ops.dense_mlp`` on the Triton path (the shared experts on CUDA): the grouped MLP with one expert owning
    every row, against its torch twin ``activations.dense_mlp`` (which rounds the first GEMM's output before the
    activation: within the dtype's tolerance)."""
    from moe_ref.core.activations import dense_mlp
    from moe_ref.kernels.runtime import ops

    monkeypatch.setattr(ops, "uses_triton", lambda device: True)  # the interpreted kernel on a CPU
    gen = torch.Generator().manual_seed(num_tokens)
    hidden, shared = 48, 40
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(device)
    gate_up = (torch.randn(2 * shared, hidden, generator=gen) / hidden ** 0.5).to(dtype).to(device)
    down = (torch.randn(hidden, shared, generator=gen) / shared ** 0.5).to(dtype).to(device)
    got = ops.dense_mlp(x, gate_up, down, activation)
    assert_close(got, dense_mlp(x, gate_up, down, activation), dtype, num_tokens=num_tokens, activation=activation)
    assert ops.dense_mlp(x[:0], gate_up, down, activation).shape == (0, hidden)
    x32 = x.float()  # an fp32 input runs in the weights' dtype and comes back in fp32, as the twin does
    got32 = ops.dense_mlp(x32, gate_up, down, activation)
    assert got32.dtype == torch.float32
    assert_close(got32.to(dtype), dense_mlp(x32, gate_up, down, activation).to(dtype), dtype, num_tokens=num_tokens)
    # the routed output added: in the second GEMM's epilogue (x in the weights' dtype), or after it (fp32 x)
    routed = (torch.randn(num_tokens, hidden, generator=gen) * 3).to(dtype).to(device)
    assert_close(ops.dense_mlp(x, gate_up, down, activation, add_TD=routed),
                 routed + dense_mlp(x, gate_up, down, activation), dtype, num_tokens=num_tokens, add=True)
    routed32 = routed.float()
    assert torch.equal(ops.dense_mlp(x32, gate_up, down, activation, add_TD=routed32), routed32 + got32)
