"""Small helpers shared by the Triton kernels in `moe_ref.kernels`.

What lives here:
- `is_interpreter()`: whether `triton.jit` produced interpreted (CPU, `TRITON_INTERPRET=1`) kernels.
  Detected from Triton itself (the type of a jitted probe function), so this module never reads or
  writes environment variables.
- `check_device(...)`: the launchers' "CUDA tensor or interpreter" check, with a clear error.
- `to_e4m3(x)`: fp32 -> fp8 e4m3 cast usable inside kernels, round-to-nearest-even like torch. On a GPU one PTX
  `cvt.rn.satfinite.e4m3x2.f32` per two values (sm_89+): Triton's own cast went through fp16 on an H200
  (triton 3.6) and differed from torch's in 0.1% of elements (double rounding). The interpreter runs no PTX,
  and its own cast drops the mantissa carry (447.9 -> 256 instead of 448; triton 3.9): there we round to the
  e4m3 grid in fp32 first and cast a value that is already exact.
- `quantize_e4m3(x)`: the per-row (per-128-group) FP8 recipe every quantizing kernel applies to its tile.
- FP8 constants shared by the quantizers and the kernels (per-128 groups, e4m3 max 448, amax floor 1e-4,
  DeepGEMM's SM90 convention).
- `launch_options(...)`: extra launch keywords (`enable_fp_fusion`), filtered out by the interpreter.
- `cdiv`, `next_power_of_2`: the launchers' grid arithmetic in plain Python.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from moe_ref.core.errors import DeviceError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_GROUP = 128
FP8_MIN_AMAX = 1e-4


@triton.jit
def _probe_kernel(x_ptr):
    pass


@functools.lru_cache(maxsize=None)
def is_interpreter() -> bool:
    """True when Triton runs kernels on the CPU interpreter (`TRITON_INTERPRET=1` before import)."""
    return type(_probe_kernel).__name__ == "InterpretedFunction"


# kernels run PTX (inline assembly) where they are compiled, not under the interpreter
_PTX = tl.constexpr(not is_interpreter())


def check_device(name: str, tensor: torch.Tensor) -> None:
    """Raise a clear error when `tensor` cannot be used by a Triton kernel in this process."""
    if tensor.device.type == "cuda" or is_interpreter():
        return
    raise DeviceError(
        f"{name} is on {tensor.device}, but Triton kernels need CUDA tensors; on a machine without a GPU "
        "set TRITON_INTERPRET=1 before importing triton (slow, for tests), or use the torch twin `*_ref`."
    )


def launch_options(fp_fusion: bool) -> dict:
    """Launch keywords for a GPU compile; the interpreter ignores unknown keywords.

    `enable_fp_fusion=False` keeps `a + w * b` as two roundings (as torch eager does) so that a kernel can
    match its torch twin bitwise in fp32; the GEMMs allow fusion (it does not touch the MMA path).
    """
    return {"enable_fp_fusion": fp_fusion}


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids: plain Python (``triton.cdiv`` is a jitted constexpr function in recent Triton,
    about 4 us per host call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (0 for n <= 0, as ``triton.next_power_of_2``), in plain Python (see ``cdiv``)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def num_fp8_groups(n: int) -> int:
    """ceil(n / 128): number of per-128 scale groups along a dimension of size n."""
    return cdiv(n, FP8_GROUP)


@triton.jit
def tanh(x):
    """tanh(x) = 1 - 2 / (exp(2x) + 1): portable (no libdevice), exact limits at +-inf."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def split_halves(gate_up):
    """`[M, 2W]`, W gate columns then their W up columns -> (gate `[M, W]`, up `[M, W]`)."""
    halves = tl.reshape(gate_up, (gate_up.shape[0], 2, gate_up.shape[1] // 2))
    return tl.split(tl.permute(halves, (0, 2, 1)))


# `gated_act`'s ACTIVATION flag per activation name (0: none, the GEMM's output as it is)
ACTIVATION_CODES = {"none": 0, "silu": 1, "situ": 2}


@triton.jit
def gated_act(gate, up, situ_beta, situ_linear_beta, ACTIVATION: tl.constexpr, SITU_LINEAR: tl.constexpr):
    """fp32 ``h = act(gate, up)`` as ``moe_ref.core.activations.gated_activation``: ACTIVATION 1 ``silu(gate) * up``,
    2 SiTU ``beta * tanh(gate / beta) * sigmoid(gate) * up'`` with ``up' = lb * tanh(up / lb)`` when SITU_LINEAR (else
    up); 0 (no activation): gate unchanged."""
    if ACTIVATION == 1:
        h = gate * tl.sigmoid(gate) * up
    elif ACTIVATION == 2:
        if SITU_LINEAR:
            up = situ_linear_beta * tanh(up / situ_linear_beta)
        h = situ_beta * tanh(gate / situ_beta) * tl.sigmoid(gate) * up
    else:
        h = gate
    return h


@triton.jit
def div_rn(x, y):
    """IEEE round-to-nearest fp32 division with broadcasting (plain `/` is `div.full.f32` on NVIDIA,
    which can differ from torch by an ulp)."""
    x, y = tl.broadcast(x, y)
    return tl.math.div_rn(x, y)


@triton.jit
def fp8_scale(amax):
    """Per-group fp8 scale: max(amax, 1e-4) / 448 with IEEE division (same as `quantize_fp8_per_128`)."""
    return div_rn(tl.maximum(amax, 1e-4), tl.full(amax.shape, 448.0, tl.float32))


@triton.jit
def _on_fp8_grid(x, MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr, SNAP: tl.constexpr):
    """fp32 `x` rounded to nearest even on an fp8 format's grid, in fp32 (the interpreter's fp8 casts are not IEEE,
    so `to_e4m3` and `to_e5m2` round here first and their cast is then exact). Normal range (|x| >= MIN_NORMAL):
    keep MANTISSA_BITS of 23 mantissa bits with an integer round-half-even on the bit pattern (carries into the
    exponent correctly). Subnormal range: add and subtract SNAP (1.5 times a power of two whose fp32 ulp is the
    format's smallest subnormal) to |x|, then put the sign back (a tiny negative value becomes -0.0, as in torch)."""
    DROP: tl.constexpr = 23 - MANTISSA_BITS
    bits = x.to(tl.int32, bitcast=True)
    sign_bit = bits & -2147483648
    x_normal = ((bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)) & -(1 << DROP)).to(tl.float32, bitcast=True)
    abs_subnormal = (tl.abs(x) + SNAP) - SNAP
    x_subnormal = (abs_subnormal.to(tl.int32, bitcast=True) | sign_bit).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < MIN_NORMAL, x_subnormal, x_normal)


@triton.jit
def to_e5m2(x):
    """Cast fp32 `x` (|x| <= 57344) to fp8 e5m2, rounding to nearest even, bitwise like torch: on a GPU one
    `cvt.rn.satfinite.e5m2x2.f32` per two values; under the interpreter `_on_fp8_grid` with 2 mantissa bits (normal
    from 2**-14, subnormal multiples of 2**-16: 192 = 1.5 * 2**7 has that ulp).

    Example: 0.3 -> 0.3125 (1.25 * 2**-2); 2**-17 -> 0.0 (a tie between 0 and 2**-16: the even one).
    """
    if _PTX:  # operands in order: $1 the even element, $2 the odd one; cvt puts its first source in the high byte
        y = tl.inline_asm_elementwise("cvt.rn.satfinite.e5m2x2.f32 $0, $2, $1;", "=h,r,r", [x],
                                      dtype=tl.float8e5, is_pure=True, pack=2)
    else:
        y = _on_fp8_grid(x, 2, 6.103515625e-05, 192.0).to(tl.float8e5)
    return y


@triton.jit
def to_e4m3(x):
    """Cast fp32 `x` (|x| <= 448) to fp8 e4m3, rounding to nearest even, bitwise like torch.

    On a GPU: one `cvt.rn.satfinite.e4m3x2.f32` per two values. Under the interpreter: `_on_fp8_grid` with 3
    mantissa bits (normal from 2**-6, subnormal multiples of 2**-9: 24576 = 1.5 * 2**14 has that ulp).
    """
    if _PTX:  # operands in order: $1 the even element, $2 the odd one; cvt puts its first source in the high byte
        y = tl.inline_asm_elementwise("cvt.rn.satfinite.e4m3x2.f32 $0, $2, $1;", "=h,r,r", [x],
                                      dtype=tl.float8e4nv, is_pure=True, pack=2)
    else:
        y = _on_fp8_grid(x, 3, 0.015625, 24576.0).to(tl.float8e4nv)
    return y


@triton.jit
def quantize_e4m3(x):
    """Each row of fp32 ``x [R, C]`` (one per-128 group: C <= 128 columns, masked-off ones 0) to fp8 e4m3 with its own
    scale, the recipe of ``kernels.fp8.quantize_fp8_per_128``: scale = ``fp8_scale(row amax)``, values ``x / scale``
    (IEEE division) cast by ``to_e4m3``. Returns ``(e4m3 [R, C], fp32 scales [R])``.

    Example: a row [1.0, -2.0] -> scale 2 / 448 = 0.004464, values [224.0, -448.0].
    """
    scale = fp8_scale(tl.max(tl.abs(x), axis=1))
    return to_e4m3(div_rn(x, scale[:, None])), scale
