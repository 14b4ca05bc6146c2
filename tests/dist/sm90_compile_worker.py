"""Compile the grouped MLP kernels, the routing check, the gated activation and the EP data-path kernels for Hopper
(sm_90a) on a machine without a GPU, as their launchers would launch them.

    python tests/dist/sm90_compile_worker.py     # JSON lines: {"cases": [...]}, then per case {"case", "error", ...}
    python tests/dist/sm90_compile_worker.py --sass "w4 int4"   # only the cases naming it, each with its SASS: the
                                                 # registers and the instructions of its main loop, by opcode

The `--sass` report is how kernel changes are weighed before a GPU is at hand (instructions per k-step of the main
loop, i.e. the longest backward branch, read with Triton's bundled nvdisasm and cuobjdump). It counts work, not time:
a change that removes instructions can still run slower, so a GPU measures it before it lands.

Run by tests/dist/test_sm90_compile.py in a subprocess (the kernels must be decorated WITHOUT
TRITON_INTERPRET, which the interpreter tests set). Why: the interpreter runs a kernel's Python, not Triton's
compiler, so a kernel that only fails to compile on a GPU (a type mismatch between branches, a TMA block
shape, a constexpr misuse) passes every CPU test. Here each case calls `launch_gemm` with a forced config on
small CPU tensors of the real dtypes; a recorder stands in for the kernel and keeps the launch's arguments;
their Triton types and constexprs (specialized as a launch does, `native_specialize_impl`) then go through
`triton.compile` for CUDA capability 9.0 (TTIR -> TTGIR -> LLVM -> PTX -> ptxas, all on the CPU). Compile errors
are reported per case; nothing runs.
"""

from __future__ import annotations

import collections
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import native_specialize_impl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
# the recorders stand in for the kernels: every launch must reach them through kernel[grid] (no bound launch)
os.environ["MOE_REF_BOUND_LAUNCH"] = "0"

from moe_ref.kernels.ep.ep_regions import EPRegions, PeerBuffers  # noqa: E402

gm = importlib.import_module("moe_ref.kernels.experts.grouped_mlp")  # the package re-exports a function of that name
rc = importlib.import_module("moe_ref.kernels.router.routing_check")
ga = importlib.import_module("moe_ref.kernels.experts.gated_act")
qr = importlib.import_module("moe_ref.kernels.experts.quantize_rows")
w4 = importlib.import_module("moe_ref.kernels.experts.grouped_mlp_w4")
from moe_ref.kernels.experts.w4 import to_group_planes  # noqa: E402
EP_MODULES = {name: importlib.import_module(f"moe_ref.kernels.ep.{name}")
              for name in ("pre_dispatch", "ep_layout", "ep_dispatch", "ep_combine", "symm_signal")}
HOPPER = GPUTarget("cuda", 90, 32)
OPTION_KEYS = ("num_warps", "num_stages", "enable_fp_fusion")
FP8 = torch.float8_e4m3fn

# name -> (weights "bf16" | "fp8", GEMM "gate_up" | "down", interleaved, TMA, tile[, schedule[, add[,
#         batch_invariant]]])
CASES = {
    "bf16 gate_up decode tile, TMA": ("bf16", "gate_up", False, True, (16, 64, 128, 4, 4)),
    "bf16 gate_up interleaved prefill tile, TMA": ("bf16", "gate_up", True, True, (128, 128, 64, 8, 4, 8)),
    "bf16 down prefill tile, TMA": ("bf16", "down", False, True, (128, 256, 64, 8, 4, 8)),
    "bf16 gate_up, pointer loads": ("bf16", "gate_up", False, False, (64, 128, 64, 4, 3)),
    "fp8 gate_up interleaved, TMA": ("fp8", "gate_up", True, True, (64, 128, 128, 8, 3, 8)),
    "fp8 gate_up interleaved decode tile, TMA": ("fp8", "gate_up", True, True, (16, 128, 128, 4, 4)),
    "fp8 gate_up interleaved, pointer loads": ("fp8", "gate_up", True, False, (64, 128, 128, 4, 3)),
    "fp8 gate_up stacked, TMA": ("fp8", "gate_up", False, True, (32, 128, 128, 4, 5)),
    "fp8 down, TMA": ("fp8", "down", False, True, (64, 256, 128, 8, 4, 8)),
    "bf16 gate_up interleaved prefill tile, TMA, persistent": ("bf16", "gate_up", True, True, (128, 128, 64, 8, 4, 8),
                                                              "persistent"),
    "fp8 down, TMA, persistent": ("fp8", "down", False, True, (64, 256, 128, 8, 4, 8), "persistent"),
    "bf16 down decode tile, TMA, add in the epilogue": ("bf16", "down", False, True, (16, 64, 128, 4, 4), "hinted",
                                                        True),
    "fp8 gate_up interleaved decode tile, TMA, grid schedule": ("fp8", "gate_up", True, True, (16, 128, 128, 4, 4),
                                                                "grid"),
    "fp8 gate_up stacked decode tile, pointer loads": ("fp8", "gate_up", False, False, (16, 128, 128, 4, 4)),
    "fp8 down decode tile, TMA": ("fp8", "down", False, True, (32, 128, 128, 4, 4)),
    "fp8 gate_up interleaved decode tile, batch-invariant": ("fp8", "gate_up", True, True, (16, 128, 128, 4, 4), None,
                                                             False, True),
}

# name -> (4-bit format, GEMM, x dtype, input features K, grouped_mlp_w4 tile[, INT4 scale]): the W4A16 kernel
# (K 96: not whole 256-feature blocks, so x's loads keep their column mask)
W4_CASES = {
    "w4 int4 gate_up bf16, decode tile": ("int4", "gate_up", torch.bfloat16, 512, (16, 64, 4, 3)),
    "w4 int4 down fp16, mma.sync decode tile": ("int4", "down", torch.float16, 512, (16, 32, 2, 4)),
    "w4 mxfp4 gate_up bf16, decode tile": ("mxfp4", "gate_up", torch.bfloat16, 512, (16, 64, 4, 4)),
    "w4 int4 down fp16, prefill tile": ("int4", "down", torch.float16, 512, (64, 128, 8, 3)),
    "w4 mxfp4 down fp16, K 96": ("mxfp4", "down", torch.float16, 96, (32, 64, 4, 3)),
    "w4 int4 gate_up fp32": ("int4", "gate_up", torch.float32, 256, (16, 64, 4, 2)),
    "w4 mxfp4 gate_up bf16, K 96, one dot a half block": ("mxfp4", "gate_up", torch.bfloat16, 96, (16, 64, 4, 3)),
    "w4 8-row tile, int4 gate_up bf16": ("int4", "gate_up", torch.bfloat16, 512, (8, 32, 2, 2)),
    "w4 8-row tile, mxfp4 down bf16": ("mxfp4", "down", torch.bfloat16, 512, (8, 64, 4, 3)),
    "w4 32-row tile, mxfp4 down bf16": ("mxfp4", "down", torch.bfloat16, 512, (32, 64, 4, 2)),
    "w4 int4 bf16 gate_up, scales past the fold (fp32 route)": ("int4", "gate_up", torch.bfloat16, 512, (16, 64, 4, 2),
                                                                1.0),
    "w4 int4 bf16 gate_up, K 96, folded, one dot a half block": ("int4", "gate_up", torch.bfloat16, 96, (16, 64, 4, 3)),
    "w4 128-row tile, 2 stages: int4 gate_up bf16": ("int4", "gate_up", torch.bfloat16, 512, (128, 128, 8, 2)),
    "w4 prefill tile, one dot a half block: int4 gate_up bf16": ("int4", "gate_up", torch.bfloat16, 512,
                                                                 (64, 128, 8, 3)),
    "w4 128-row tile, one dot a half block: mxfp4 down bf16": ("mxfp4", "down", torch.bfloat16, 512, (128, 128, 8, 3)),
    "w4 batch-invariant tile, int4 gate_up fp32": ("int4", "gate_up", torch.float32, 512, (32, 64, 4, 3)),
    "w4 batch-invariant tile, mxfp4 down fp32": ("mxfp4", "down", torch.float32, 512, (32, 64, 4, 3)),
    "w4 32-row tile, one dot a half block, K 96: int4 gate_up bf16": ("int4", "gate_up", torch.bfloat16, 96,
                                                                      (32, 64, 4, 3)),
    # W4A8 (x e4m3 per row, the weights cast to fp8 in the decode): the A8 tiles, each decode route
    "w4a8 128-row tile: mxfp4 down": ("mxfp4", "down", FP8, 512, (128, 128, 8, 3)),
    "w4a8 128-row tile: int4 gate_up": ("int4", "gate_up", FP8, 512, (128, 128, 8, 3)),
    "w4a8 128 x 64 tile, K 96: int4 gate_up": ("int4", "gate_up", FP8, 96, (128, 64, 4, 3)),
    "w4a8 one dot a group: mxfp4 down": ("mxfp4", "down", FP8, 512, (64, 32, 4, 3)),
    "w4a8 fp32 route: int4 gate_up": ("int4", "gate_up", FP8, 512, (64, 128, 8, 3), 1.0),
}

# name -> (ids dtype, weights dtype)
ROUTING_CHECK_CASES = {
    "routing_check int64 ids, fp32 weights": (torch.int64, torch.float32),
    "routing_check int32 ids, bf16 weights": (torch.int32, torch.bfloat16),
}

# name -> (pool format, fp8 output, activation)
# name -> (x dtype, columns): the FP8 experts' row quantizer
QUANTIZE_ROWS_CASES = {
    "quantize_rows bf16, D 7168": (torch.bfloat16, 7168),
    "quantize_rows fp32, D 200 (a partial group)": (torch.float32, 200),
    "quantize_rows per row (W4A8), bf16, D 7168": (torch.bfloat16, 7168, True),
}

GATED_ACT_CASES = {
    "gated_act masked pool, fp8 out, silu": ("masked", True, "silu"),
    "gated_act contiguous pool, bf16 out, situ": ("contiguous", False, "situ"),
}

# name -> (phase of the EP chunk, fp8 rows)
EP_CASES = {
    "ep pre_dispatch + layout (post), bf16": ("pre_dispatch", False),
    "ep pre_dispatch + layout (post), fp8": ("pre_dispatch", True),
    "ep dispatch (wait), bf16": ("dispatch", False),
    "ep dispatch (wait), fp8": ("dispatch", True),
    "ep combine push (post)": ("combine_push", False),
    "ep combine reduce (wait)": ("combine_reduce", False),
    "ep barrier": ("barrier", False),
}


class _Recorder:
    """Stands in for the kernel: `kernel[grid](*args, **kwargs)` keeps the arguments."""

    def __getitem__(self, grid):
        return self

    def __call__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


def _operands(weights: str, gemm: str, interleaved: bool) -> dict:
    """`launch_gemm`'s tensors for one GEMM at a small shape (D 256, F 256, 4 experts, 64 pool rows)."""
    experts, hidden, inter, rows = 4, 256, 256, 64
    n, k = (inter, hidden) if gemm == "gate_up" else (hidden, inter)
    b_rows = 2 * n if gemm == "gate_up" else n
    blocks = lambda size: triton.cdiv(size, 128)  # noqa: E731
    if weights == "bf16":
        a, a_scale = torch.zeros(rows, k, dtype=torch.bfloat16), None
    else:
        a, a_scale = torch.zeros(rows, k, dtype=FP8), torch.ones(rows, blocks(k))
    if weights == "bf16":
        b, b_scale = torch.zeros(experts, b_rows, k, dtype=torch.bfloat16), None
    else:
        b, b_scale = torch.zeros(experts, b_rows, k, dtype=FP8), torch.ones(experts, blocks(b_rows), blocks(k))
    quant_out = weights == "fp8" and gemm == "gate_up"
    c = torch.zeros(rows, n, dtype=FP8 if quant_out else torch.bfloat16)
    c_scale = torch.ones(rows, blocks(n)) if quant_out else None
    return dict(a=a, a_scale=a_scale, b=b, b_scale=b_scale, c=c, c_scale=c_scale, n=n, k=k, quant_out=quant_out,
                fp8=weights == "fp8", interleaved=interleaved,
                activation="silu" if gemm == "gate_up" else "none")


def compile_case(weights: str, gemm: str, interleaved: bool, tma: bool, tile: tuple, schedule: str | None = None,
                 add: bool = False, batch_invariant: bool = False):
    """Launch one grouped-MLP case into the recorder, then compile the recorded launch for sm_90 (``add``: GEMM2 adds
    a tensor of c's shape in its epilogue, as the shared experts' MLP adds the routed output; ``batch_invariant``:
    the mode's launch, FP8 GEMM1 rounding gate and up to bf16 before the activation)."""
    ops = _operands(weights, gemm, interleaved)
    experts = ops["b"].shape[0]
    row_start_e = torch.arange(experts, dtype=torch.int64) * 16
    num_rows_e = torch.full((experts,), 16, dtype=torch.int32)
    tma_possible, num_sms = gm._tma_possible, gm._num_sms
    gm._tma_possible = lambda a, b: tma  # no CUDA device here: TMA is what the case says
    gm._num_sms = lambda device: 132  # an H200's
    try:
        return compile_launch(gm, "_grouped_gemm_kernel", lambda: gm.launch_gemm(
            ops["a"], ops["a_scale"], ops["b"], ops["b_scale"], ops["c"], ops["c_scale"], row_start_e, num_rows_e,
            n=ops["n"], k=ops["k"], activation=ops["activation"], situ_beta=4.0, situ_linear_beta=25.0,
            fp8=ops["fp8"], quant_out=ops["quant_out"], rows_hint=64, interleaved=ops["interleaved"],
            config=gm.tiles.config_of_tile(tile), schedule=schedule,
            add=torch.zeros_like(ops["c"]) if add else None, batch_invariant=batch_invariant))
    finally:
        gm._tma_possible, gm._num_sms = tma_possible, num_sms


def compile_w4(fmt: str, gemm: str, dtype: torch.dtype, k: int, tile: tuple, int4_scale: float = 0.25):
    """One GEMM of grouped_mlp_w4 as the MLP launches it (4 experts, 64 pool rows; gate_up 2 x 128 rows into h
    ``[64, 128]`` through its SiLU epilogue, down 128 rows), its forced tile compiled for sm_90. ``int4_scale``: every
    INT4 scale (below ``w4.INT4_FOLD_SCALE_LIMIT`` bf16 x takes the folded decode, else the fp32 route). ``dtype``
    e4m3: the W4A8 launch (its rows' scales all 1)."""
    experts, n, rows = 4, 128, 64
    b_rows = 2 * n if gemm == "gate_up" else n
    packed = (torch.zeros(experts, b_rows, k // 8, dtype=torch.int32) if fmt == "int4" else
              torch.zeros(experts, b_rows, k // 2, dtype=torch.uint8))
    scale = (torch.full((experts, b_rows, k // 32), int4_scale, dtype=torch.bfloat16) if fmt == "int4" else
             torch.ones(experts, b_rows, k // 32, dtype=torch.uint8))
    weight = to_group_planes(packed, scale, fmt)
    a8 = dtype == FP8  # W4A8: e4m3 rows with one scale each, bf16 out
    return compile_launch(w4, "_w4_gemm_kernel", lambda: w4.launch_w4_gemm(
        torch.zeros(rows, k, dtype=dtype), weight, torch.zeros(rows, n, dtype=torch.bfloat16 if a8 else dtype),
        torch.arange(experts, dtype=torch.int64) * 16, torch.full((experts,), 16, dtype=torch.int32), rows_hint=rows,
        tile=tile, activation="silu" if gemm == "gate_up" else "none",
        x_scale=torch.ones(rows, dtype=torch.float32) if a8 else None))


def compile_routing_check(ids_dtype: torch.dtype, weights_dtype: torch.dtype):
    """The routing check's launch at 70 tokens, top-8, compiled for sm_90 (its device check skipped: CPU tensors)."""
    check_device = rc.check_device
    rc.check_device = lambda name, tensor: None
    try:
        return compile_launch(rc, "_routing_check_kernel", lambda: rc.routing_check(
            torch.zeros(70, 8, dtype=ids_dtype), torch.zeros(70, 8, dtype=weights_dtype), 16))
    finally:
        rc.check_device = check_device


def compile_launch(module, kernel_name: str, launch):
    """Run ``launch()`` with ``module.<kernel_name>`` replaced by a recorder; compile what it launched for sm_90."""
    (compiled,) = compile_launches([(module, kernel_name)], launch)
    return compiled


def compile_launches(kernels: list, launch) -> list:
    """``compile_launch`` for a launcher that launches several kernels: ``kernels`` = [(module, name)], each
    replaced by its recorder; returns the compiled kernels in that order."""
    originals = [(module, name, getattr(module, name)) for module, name in kernels]
    recorders = [_Recorder() for _ in kernels]
    for (module, name, _), recorder in zip(originals, recorders):
        setattr(module, name, recorder)
    try:
        launch()
    finally:
        for module, name, kernel in originals:
            setattr(module, name, kernel)
    return [_compile_recorded(kernel, recorder) for (_, _, kernel), recorder in zip(originals, recorders)]


def _compile_recorded(kernel, recorder: "_Recorder"):
    """Compile for sm_90 the launch ``recorder`` kept: its arguments specialized by Triton's own launch rule
    (``native_specialize_impl``: an int equal to 1 becomes a constant, a tensor's 16-byte aligned base and an int
    divisible by 16 are marked so; without them a kernel compiles as a GPU never runs it, e.g. not pipelined)."""
    bound = dict(zip(kernel.arg_names, recorder.args))
    bound.update({key: value for key, value in recorder.kwargs.items() if key not in OPTION_KEYS})
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        value = bound[param.name] if param.name in bound else param.default
        if param.is_constexpr or value is None:
            signature[param.name], constexprs[(index,)] = "constexpr", value
            continue
        kind, key = native_specialize_impl(BaseBackend, value, False, not param.do_not_specialize,
                                           not param.do_not_specialize_on_alignment)
        signature[param.name] = kind
        if kind == "constexpr":
            constexprs[(index,)] = value
        elif key == "D":
            attrs[(index,)] = [["tt.divisibility", 16]]
    options = {key: recorder.kwargs[key] for key in OPTION_KEYS if key in recorder.kwargs}
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=HOPPER, options=options)


def _ep_world(fp8: bool):
    """Two ranks' buffers on the CPU (nothing runs: only the launches' argument types matter), R 2, e 4, K 4,
    C 16, Dx 256."""
    regions = EPRegions.build(2, 4, 4, 16, 256, activation_dtype=torch.bfloat16, fp8=fp8, alignment=1)
    buffers = tuple(torch.zeros(regions.end, dtype=torch.uint8) for _ in range(2))
    peers = PeerBuffers(0, buffers, torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64))
    ids = torch.stack([torch.randperm(8)[:4] for _ in range(8)])
    return regions, peers, torch.zeros(8, 256, dtype=torch.bfloat16), ids, torch.rand(8, 4)


def compile_ep(phase: str, fp8: bool):
    """One phase of the device-side EP data path (kernels.ep_chunk's order), its launches compiled for sm_90."""
    regions, peers, x, ids, weights = _ep_world(fp8)
    saved = [(module, getattr(module, "check_device")) for module in EP_MODULES.values()]
    for module, _ in saved:
        module.check_device = lambda name, tensor: None
    num_sms = EP_MODULES["ep_combine"]._num_sms
    EP_MODULES["ep_combine"]._num_sms = lambda index: 132
    launches = {
        "pre_dispatch": ([("pre_dispatch", "_pre_dispatch_kernel"), ("ep_layout", "_ep_layout_kernel")],
                         lambda: EP_MODULES["ep_layout"].ep_pre_dispatch(x, ids, weights, peers, regions, post=True)),
        "dispatch": ([("ep_dispatch", "_recv_layout_kernel"), ("ep_dispatch", "_dispatch_rows_kernel")],
                     lambda: EP_MODULES["ep_dispatch"].ep_dispatch(peers, regions, wait=True,
                                                                   received_e=torch.zeros(4, dtype=torch.int64))),
        "combine_push": ([("ep_combine", "_combine_push_kernel")], lambda: EP_MODULES["ep_combine"].ep_combine_push(
            torch.zeros(regions.num_pool_rows, 256, dtype=torch.bfloat16), peers, regions, post=True)),
        "combine_reduce": ([("ep_combine", "_combine_reduce_kernel")],
                           lambda: EP_MODULES["ep_combine"].ep_combine_reduce(8, peers, regions, wait=True)),
        "barrier": ([("symm_signal", "_symm_barrier_kernel")],
                    lambda: EP_MODULES["symm_signal"].symm_barrier(peers, regions)),
    }
    kernels, launch = launches[phase]
    try:
        return compile_launches([(EP_MODULES[module], name) for module, name in kernels], launch)
    finally:
        for module, check in saved:
            module.check_device = check
        EP_MODULES["ep_combine"]._num_sms = num_sms


def compile_gated_act(pool: str, quant: bool, activation: str):
    """The DeepGEMM experts' activation launch over 4 experts x 64 rows, F 256, compiled for sm_90."""
    check_device = ga.check_device
    ga.check_device = lambda name, tensor: None
    index = (dict(num_rows_e=torch.full((4,), 9, dtype=torch.int32), masked_rows=64) if pool == "masked" else
             dict(group_P=torch.zeros(256, dtype=torch.int32)))
    try:
        return compile_launch(ga, "_gated_act_kernel", lambda: ga.gated_activation_rows(
            torch.zeros(256, 512, dtype=torch.bfloat16), activation=activation, quant=quant, **index))
    finally:
        ga.check_device = check_device


def compile_quantize_rows(dtype: torch.dtype, dim: int, per_row: bool = False):
    """The FP8 experts' row quantizer over 64 rows of ``dim`` columns (``per_row``: one scale a row, W4A8's),
    compiled for sm_90."""
    check_device = qr.check_device
    qr.check_device = lambda name, tensor: None
    kernel = "_quantize_whole_rows_kernel" if per_row else "_quantize_rows_kernel"
    try:
        return compile_launch(qr, kernel, lambda: qr.quantize_rows_fp8(torch.zeros(64, dim, dtype=dtype),
                                                                       per_row=per_row))
    finally:
        qr.check_device = check_device


def loop_opcodes(sass: str) -> collections.Counter:
    """Opcodes (with their modifiers, e.g. ``LOP3.LUT``) of the longest loop in nvdisasm's text: the instructions
    from a branch's target label back to that branch. Empty when the code has no backward branch.

    Example: ``.L_x_1:`` then ``/*0010*/ IADD3 R1, R1, 0x1, RZ ;`` and ``/*0020*/ @P0 BRA `(.L_x_1) ;`` ->
        {"IADD3": 1, "BRA": 1}."""
    labels, instructions = {}, []
    for line in sass.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        op = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)\s*(.*)", line)
        if op:
            instructions.append((op.group(1), op.group(2)))
    longest = None
    for end, (opcode, operands) in enumerate(instructions):
        target = re.search(r"\((\.L_x_\d+)\)", operands)
        if opcode.startswith("BRA") and target and labels.get(target.group(1), end) < end:
            start = labels[target.group(1)]
            if longest is None or end - start > longest[1] - longest[0]:
                longest = (start, end)
    body = instructions[longest[0]:longest[1] + 1] if longest else []
    return collections.Counter(opcode for opcode, _ in body)


def sass_report(kernel) -> dict:
    """Registers per thread and the main loop's opcode counts of a compiled kernel (Triton's bundled tools)."""
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", cubin.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", cubin.name], capture_output=True, text=True,
                              check=True).stdout
    registers = re.search(r"REG:(\d+)", usage)
    ops = loop_opcodes(sass)
    return {"registers": int(registers.group(1)) if registers else None, "loop_instructions": sum(ops.values()),
            "loop_ops": dict(ops.most_common())}


def main() -> int:
    sass_of = sys.argv[sys.argv.index("--sass") + 1] if "--sass" in sys.argv[1:-1] else None
    if os.environ.get("TRITON_INTERPRET"):
        print("unset TRITON_INTERPRET: this compiles the kernels", file=sys.stderr)
        return 2
    # name -> (kind, build: returns the compiled kernels)
    builders = {name: ("grouped_mlp", lambda case=case: [compile_case(*case)]) for name, case in CASES.items()}
    builders.update({name: ("grouped_mlp_w4", lambda case=case: [compile_w4(*case)]) for name, case in W4_CASES.items()})
    builders.update({name: ("routing_check", lambda case=case: [compile_routing_check(*case)])
                     for name, case in ROUTING_CHECK_CASES.items()})
    builders.update({name: ("gated_act", lambda case=case: [compile_gated_act(*case)])
                     for name, case in GATED_ACT_CASES.items()})
    builders.update({name: ("quantize_rows", lambda case=case: [compile_quantize_rows(*case)])
                     for name, case in QUANTIZE_ROWS_CASES.items()})
    builders.update({name: ("ep", lambda case=case: compile_ep(*case)) for name, case in EP_CASES.items()})
    if sass_of is not None:
        builders = {name: built for name, built in builders.items() if sass_of in name}
    print(json.dumps({"cases": list(builders)}), flush=True)
    for name, (kind, build) in builders.items():
        try:
            compiled = build()
            report = {"case": name, "kind": kind, "error": None, "kernels": len(compiled),
                      "shared_bytes": min(k.metadata.shared for k in compiled),
                      "cubin_bytes": min(len(k.asm["cubin"]) for k in compiled)}
            if sass_of is not None:
                report["sass"] = [sass_report(k) for k in compiled]
        except Exception as exc:  # reported per case; the test fails on any
            report = {"case": name, "kind": kind, "error": f"{type(exc).__name__}: {str(exc)[-2000:]}"}
        print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
