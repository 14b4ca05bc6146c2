#!/usr/bin/env python
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

--check: `run_peer_mlp` vs `moe_ref.kernels.experts.grouped_mlp.grouped_mlp_ref` on tiny uneven layouts (ragged rows with an
empty expert, an expert of BLOCK_SIZE_M rows beside one of BLOCK_SIZE_M + 1, a decode batch that takes the default
rule's small tile, a forced BLOCK_SIZE_M 16 FP8 tile), for every peer file given. Without a GPU it runs under
TRITON_INTERPRET=1 (D = F = 256) in fp32, fp16 and FP8, not bf16: the interpreter's bf16 `tl.dot` and bf16
arithmetic are wrong (see `UPCAST` in moe_ref/kernels/experts/grouped_mlp.py; the peer kernels have no upcast switch), so
there the FP8 run keeps its activations (gate||up, h, y) in fp16, and h is re-quantized by moe_ref's
`quantize_fp8_per_128` (the interpreter's fp8 cast drops the mantissa carry, `_triton_utils.to_e4m3`). On CUDA it
runs the compiled kernels (D 1024, F 512, 8 experts at our 128-row alignment) in bf16, fp16 and FP8 with the
engine's own quantizer; the BLOCK_SIZE_M 16 FP8 case takes the swap-AB path on SM90. Limits: elementwise
(atol, rtol) of tests/interpreter for fp32/fp16/bf16 plus calc_diff < 1e-4; FP8 calc_diff < 1e-3 vs the FP8 twin.
Exit status 1 when a case fails.
"""

from __future__ import annotations

import abc
import argparse
import ast
import builtins
import copy
import dataclasses
import functools
import glob
import hashlib
import importlib.util
import itertools
import json
import os
import re
import sys
import tempfile
import textwrap
import types
import zipfile

import torch

_REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

GEMM_KERNEL = "fused_moe_kernel"  # the same name in both engines
FP8_BLOCK = [128, 128]  # block-FP8 w8a8: weights 128x128 blocks, activations per token per 128
_DTYPE_KEYS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
_ZIP_SUFFIX = "-fused-moe.zip"


def _errors():
    from moe_ref.core import errors

    return errors


# ------------------------------------------------------------------------------------------------
# reading the wheel (or the fused-moe zip cut from it)
# ------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _wheel_files(wheel: str) -> tuple[str, ...]:
    errors = _errors()
    if not os.path.isfile(wheel):
        raise errors.BackendUnavailableError(f"peer wheel {wheel!r} not found; download it with `make peers`")
    try:
        with zipfile.ZipFile(wheel) as archive:
            return tuple(archive.namelist())
    except zipfile.BadZipFile as exc:
        raise errors.BackendUnavailableError(f"peer wheel {wheel!r} is not a zip archive ({exc}); download it "
                                             "again with `make peers`") from exc


def _read(wheel: str, path: str) -> str:
    if path not in _wheel_files(wheel):
        raise _layout_error(wheel, [path])
    with zipfile.ZipFile(wheel) as archive:
        return archive.read(path).decode()


def _layout_error(wheel: str, missing: list[str]) -> Exception:
    engine, _ = _engine_of(wheel)
    return _errors().BackendUnavailableError(f"{os.path.basename(wheel)} has no {', '.join(missing)} (another "
                                             f"{engine.name} layout?); this reader knows {engine.name} "
                                             f"{engine.tested_version}")


def _engine_of(wheel: str) -> tuple[PeerEngine, str]:
    """(engine, version) from the file name: `sglang-0.5.23-....whl`, `vllm-0.33.0-fused-moe.zip`."""
    match = re.match(r"([A-Za-z0-9_]+)-([^-]+)-.*\.(whl|zip)$", os.path.basename(wheel))
    if not match:
        raise _errors().BackendUnavailableError(
            f"{wheel!r} is not named like a wheel (name-version-...whl) or a cut of one (name-version{_ZIP_SUFFIX})")
    name, version = match.group(1).lower(), match.group(2)
    if name not in ENGINES:
        raise _errors().BackendUnavailableError(
            f"{os.path.basename(wheel)}: not a known engine's wheel (known: {', '.join(sorted(ENGINES))}); "
            "download them with `make peers`")
    return ENGINES[name], version


def _free_names(node: ast.AST) -> set[str]:
    """Names a function reads that it does not bind itself (params, assignments, loop targets) or get from
    builtins; annotations do not count (plain functions run with postponed annotations), nor do decorators
    (`_exec_plain` runs a rule undecorated: the engines' rules carry only caches; `_jit_module` puts back only
    `triton.jit`)."""
    node = copy.deepcopy(node)
    for sub in ast.walk(node):
        if isinstance(sub, ast.arg):
            sub.annotation = None
        elif isinstance(sub, ast.FunctionDef):
            sub.returns, sub.decorator_list = None, []
    bound = {arg.arg for arg in ast.walk(node) if isinstance(arg, ast.arg)}
    loaded = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            (loaded if isinstance(sub.ctx, ast.Load) else bound).add(sub.id)
    return loaded - bound - set(dir(builtins))


def _module_defs(tree: ast.Module) -> dict[str, ast.AST]:
    """Module-level functions and single-name assignments by name."""
    defs: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            defs[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    defs[target.id] = node
    return defs


def _closure(source: str, names: list[str], given: set[str], where: str) -> list[ast.AST]:
    """`names` and every module-level function or constant they use (transitively), in source order; names in
    `given` come from the namespace the code runs in."""
    tree = ast.parse(source)
    defs = _module_defs(tree)
    errors = _errors()
    needed, pending = set(), list(names)
    while pending:
        name = pending.pop()
        if name in needed or name in given:
            continue
        if name not in defs:
            raise errors.BackendUnavailableError(f"{where} has no module-level {name!r} (another version?)")
        needed.add(name)
        pending.extend(_free_names(defs[name]))
    return [node for node in tree.body if node in {defs[n] for n in needed}]


def _exec_plain(wheel: str, path: str, name: str, namespace: dict):
    """A plain (not jitted) function `name` of the wheel's `path`, run in `namespace` (which must supply its free
    names that are not module-level functions or constants of `path`)."""
    source, where = _read(wheel, path), f"{os.path.basename(wheel)}:{path}"
    nodes = _closure(source, [name], set(namespace), where)
    code = "\n\n".join(ast.get_source_segment(source, node, padded=True) for node in nodes)
    import __future__

    exec(compile(code, f"<{where}>", "exec", flags=__future__.annotations.compiler_flag), namespace)
    return namespace[name]


_JIT_HEADER = '''"""Generated by moe_ref scripts/peer_moe.py from {wheel}: {what}. Not part of moe_ref."""
from __future__ import annotations  # as in the engine's modules
import torch
import triton
import triton.language as tl
'''


def _jit_module(wheel: str, parts: list[tuple[str, list[str]]], tag: str):
    """Import the `@triton.jit` functions `parts` = [(path in the wheel, [names])] (with what they use) as one
    generated module written to a temporary folder (Triton reads kernel source from the function's file)."""
    blocks = []
    for path, names in parts:
        source = _read(wheel, path)
        for node in _closure(source, names, {"torch", "triton", "tl"}, f"{os.path.basename(wheel)}:{path}"):
            text = textwrap.dedent(ast.get_source_segment(source, node, padded=True))
            if isinstance(node, ast.FunctionDef):  # the segment starts at `def`: put the decorator back
                decorators = [ast.unparse(d) for d in node.decorator_list]
                if not decorators or not all(d.startswith("triton.jit") for d in decorators):
                    raise _errors().BackendUnavailableError(f"{path}: {node.name} is not a triton.jit function")
                text = "".join(f"@{d}\n" for d in decorators) + text
            blocks.append(text)
    what = ", ".join(f"{path} ({', '.join(names)})" for path, names in parts)
    text = _JIT_HEADER.format(wheel=os.path.basename(wheel), what=what) + "\n\n" + "\n\n\n".join(blocks) + "\n"
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    folder = os.path.join(tempfile.gettempdir(), "moe_ref_peer")
    os.makedirs(folder, exist_ok=True)
    module_name = f"_peer_{tag}_{digest}"
    path = os.path.join(folder, module_name + ".py")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


def _params(source: str, name: str) -> tuple[tuple[str, ...], frozenset[str]]:
    """(parameter names, the ones without a default) of module-level function `name`."""
    node = _module_defs(ast.parse(source))[name]
    args = node.args.args
    required = args[:len(args) - len(node.args.defaults)]
    return tuple(a.arg for a in args), frozenset(a.arg for a in required)


def extract_members(wheel: str, out_dir: str) -> str:
    """Write `<engine>-<version>-fused-moe.zip` into `out_dir`: the members of `wheel` this reader opens (the
    engine's `sources` and the JSON files under its `configs` folder), each byte for byte (same name, same
    timestamp). Returns the zip's path. Raises BackendUnavailableError when the wheel lacks a source file."""
    engine, version = _engine_of(wheel)
    files = _wheel_files(wheel)
    missing = [path for path in engine.sources if path not in files]
    if missing:
        raise _layout_error(wheel, missing)
    members = list(engine.sources) + sorted(p for p in files if p.startswith(engine.configs + "/") and
                                            p.endswith(".json"))
    out = os.path.join(out_dir, f"{engine.name}-{version}{_ZIP_SUFFIX}")
    if os.path.abspath(out) == os.path.abspath(wheel):
        raise _errors().InvalidConfigError(f"{wheel} is already the cut zip")
    os.makedirs(out_dir, exist_ok=True)
    tmp = f"{out}.{os.getpid()}.tmp"
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as target:
        for member in members:
            target.writestr(source.getinfo(member), source.read(member), compress_type=zipfile.ZIP_DEFLATED)
    os.replace(tmp, out)
    return out


def default_peer_files(root: str = _REPO) -> list[str]:
    """One peer file per engine under `root`/.whl: its wheel or its fused-moe zip, the newest version (by the
    version in the name; a wheel before a zip of the same version). Empty when there is none."""
    found = []
    for name in sorted(ENGINES):
        paths = glob.glob(os.path.join(root, ".whl", f"{name}-*.whl"))
        paths += glob.glob(os.path.join(root, ".whl", f"{name}-*{_ZIP_SUFFIX}"))
        if paths:
            newest = max(_version_key(_engine_of(p)[1]) for p in paths)
            found.append(min(p for p in paths if _version_key(_engine_of(p)[1]) == newest))
    return found


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".") if part.isdigit())


# ------------------------------------------------------------------------------------------------
# the engines: what differs between their fused-MoE Triton paths
# ------------------------------------------------------------------------------------------------
class PeerEngine(abc.ABC):
    """One engine's fused-MoE Triton path as its wheel holds it: where each piece is, how its tuned configs are
    named and found, how its default rule and swap-AB rule run, and the launch arguments, act and quant step that
    differ between engines (see the module docstring). One instance per engine, in ENGINES."""

    name: str                  # the wheel's distribution name
    tested_version: str
    kernels: str               # wheel path of the file holding fused_moe_kernel
    act_kernel: str | None     # a Triton act kernel in `kernels`; None: torch silu-and-mul (`act`)
    quant: str                 # wheel path of the file holding the per-token-group FP8 quant kernel
    quant_kernel: str
    rule: str                  # wheel path of the file holding get_default_config
    swap_rule: tuple[str, str]  # (wheel path, function) of the block-FP8 swap-AB rule
    configs: str               # the tuned-config folder
    has_down_configs: bool     # GEMM2 may have its own `_down` config file

    @property
    def sources(self) -> tuple[str, ...]:
        """The Python files of the wheel this reader opens (without repeats)."""
        return tuple(dict.fromkeys((self.kernels, self.quant, self.rule, self.swap_rule[0])))

    def jit_parts(self) -> list[tuple[str, list[str]]]:
        """[(wheel path, [jitted function names])] to import."""
        return [(self.kernels, [GEMM_KERNEL] + ([self.act_kernel] if self.act_kernel else [])),
                (self.quant, [self.quant_kernel])]

    @abc.abstractmethod
    def align_buffer_size(self, num_routed: int, num_experts: int, block_m: int) -> int:
        """The length of `moe_align_block_size`'s sorted_token_ids buffer (the kernel's EM)."""

    @abc.abstractmethod
    def config_file_name(self, num_experts: int, inter: int, device_name: str, dtype: str, down: bool = False) -> str:
        """The engine's `get_config_file_name` for (E, N = intermediate size per expert, device, dtype)."""

    @abc.abstractmethod
    def config_folders(self, wheel: str, triton_version: str) -> list[str]:
        """The wheel folders holding tuned config files, in the engine's search order."""

    @abc.abstractmethod
    def default_config(self, wheel: str, num_rows: int, num_experts: int, inter: int, hidden: int,
                       dtype: str) -> dict:
        """The engine's `get_default_config`, read from the wheel and run with its CUDA defaults."""

    @abc.abstractmethod
    def swap_rule_namespace(self) -> dict:
        """What the swap-AB rule reads besides its own module's functions and constants."""

    @abc.abstractmethod
    def gemm_args(self, common: dict, swap_ab: bool) -> dict:
        """`fused_moe_kernel`'s keyword arguments: `common` (the arguments both engines pass, under the same names)
        plus or overridden by what only this engine's launcher passes."""

    def launch_options(self, a: torch.Tensor) -> dict:
        """Launch options besides num_warps/num_stages (none by default)."""
        return {}

    @abc.abstractmethod
    def act(self, peer: PeerKernel, gate_up_P2F: torch.Tensor, h_PF: torch.Tensor, routing: PeerRouting) -> None:
        """h = silu(gate) * up, written into `h_PF` [P, F] (rows outside every segment: anything)."""

    @abc.abstractmethod
    def quantize(self, peer: PeerKernel, h_PF: torch.Tensor, h_fp8: torch.Tensor, h_scale: torch.Tensor,
                 group: int, launch: dict) -> None:
        """The engine's quant kernel over `h_PF` [P, F] into `h_fp8` and row-major `h_scale` [P, F / group];
        `launch` holds the grid, BLOCK, fp8 range and launch options."""


def _config_dtype(dtype: str) -> tuple[str | None, list[int] | None]:
    """The config dtype string and block shape of both engines (`get_config_dtype_str` for these dtypes)."""
    if dtype not in _DTYPE_KEYS:
        raise _errors().UnknownNameError(f"peer dtype {dtype!r}; known: {sorted(_DTYPE_KEYS)}")
    return {"fp8": ("fp8_w8a8", FP8_BLOCK), "fp32": ("float32", None)}.get(dtype, (None, None))


def _not_reproduced(*_args, **_kwargs):
    raise _errors().InvalidConfigError("this branch of the engine's rule (int4/int8 weights) is not reproduced")


class SGLangEngine(PeerEngine):
    """SGLang (0.5.23 layout)."""

    name, tested_version = "sglang", "0.5.23"
    kernels = "sglang/kernels/ops/moe/fused_moe_triton_kernels.py"
    act_kernel = "act_and_mul_kernel"
    quant = "sglang/kernels/ops/quantization/fp8_kernel.py"
    quant_kernel = "_per_token_group_quant_8bit"
    rule = "sglang/srt/layers/moe/moe_runner/triton_utils/fused_moe_triton_config.py"
    swap_rule = (kernels, "should_enable_swap_ab")
    configs = "sglang/srt/layers/moe/moe_runner/triton_utils/configs"
    has_down_configs = True

    def align_buffer_size(self, num_routed, num_experts, block_m):
        """Its formula, padded to 4 (the align kernel stores int4s)."""
        if num_routed < num_experts + 1:
            size = num_routed * block_m
        else:
            size = num_routed + (num_experts + 1) * (block_m - 1)
        return (size + 3) // 4 * 4

    def config_file_name(self, num_experts, inter, device_name, dtype, down=False):
        dtype_str, block = _config_dtype(dtype)
        return (f"E={num_experts},N={inter},device_name={device_name.replace(' ', '_')}"
                f"{f',dtype={dtype_str}' if dtype_str else ''}{f',block_shape={block}' if block else ''}"
                f"{'_down' if down else ''}.json")

    def config_folders(self, wheel, triton_version):
        """configs/triton_<version>: the running Triton's first (3.6.0 -> triton_3_6_0), then newest first."""
        prefix = self.configs + "/"
        folders = {p[len(prefix):].split("/")[0] for p in _wheel_files(wheel)
                   if p.startswith(prefix + "triton_") and p.count("/") == prefix.count("/") + 1}
        versions = sorted((f.removeprefix("triton_").replace("_", ".") for f in folders), key=_version_key,
                          reverse=True)
        own = triton_version.split("+")[0]
        ordered = ([own] if own in versions else []) + [v for v in versions if v != own]
        return [f"{prefix}triton_{version.replace('.', '_')}" for version in ordered]

    def default_config(self, wheel, num_rows, num_experts, inter, hidden, dtype):
        """No deterministic-inference mode, not ROCm; the low-shared-memory FP8 rule is off (H200's 227 KB
        opt-in is above its 128 KB cutoff and only per-tensor FP8 reads it)."""
        deterministic = types.SimpleNamespace(enable_deterministic_inference=False)
        namespace = {"get_exec": lambda: types.SimpleNamespace(deterministic=deterministic), "_is_hip": False,
                     "_use_low_smem_fp8_default": lambda: False}
        rule = _exec_plain(wheel, self.rule, "get_default_config", namespace)
        dtype_str, block = _config_dtype(dtype)
        return dict(rule(num_rows, num_experts, inter, hidden, 1, dtype_str, False, block))

    def swap_rule_namespace(self):
        """CUDA, no batch-invariant mode, SM90 supported = capability 9.x with CUDA >= 12.3 (`is_sm90_supported`)."""

        def is_sm90_supported() -> bool:
            cuda = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])
            return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and cuda >= (12, 3)

        return {"_is_cuda": torch.cuda.is_available(),
                "is_batch_invariant_mode_enabled": lambda: False, "is_sm90_supported": is_sm90_supported}

    def gemm_args(self, common, swap_ab):
        return dict(common, a_desc=None, b_desc=None, bias_ptr=None, add_mask_ptr=None, stride_bias_e=0,
                    stride_bias_n=0, even_Ks=common["K"] % common["BLOCK_SIZE_K"] == 0, c_sorted=False,
                    swap_ab=swap_ab, FUSE_ADD_TO_OUTPUT=False, MASK_OUTPUT=False, FUSE_SUM_ALL_REDUCE=False,
                    ROUTER_TOPK=1)

    def launch_options(self, a):
        """PDL on compute capability >= 9 (`is_arch_support_pdl`), as `invoke_fused_moe_kernel` launches."""
        if not _PDL["ok"] or _is_interpreter() or torch.cuda.get_device_capability(a.device)[0] < 9:
            return {}
        return dict(USE_GDC=True, launch_pdl=True, GDC_EARLY=a.shape[0] <= 512)

    def act(self, peer, gate_up_P2F, h_PF, routing):
        """SGLang's Triton act kernel, rows filtered by their expert (padding rows skipped)."""
        peer.act[(gate_up_P2F.shape[0],)](gateup_output=gate_up_P2F, down_input=h_PF,
                                          hidden_size=gate_up_P2F.shape[1], expert_ids_ptr=routing.row_expert_P,
                                          expert_step=1, BLOCK_SIZE=512, ACTIVATION_TYPE="silu", SWIGLU_LIMIT=0.0,
                                          HAS_SWIGLU_LIMIT=False, HAS_EXPERT_FILTER=True)

    def quantize(self, peer, h_PF, h_fp8, h_scale, group, launch):
        """As `_per_token_group_quant_8bit_raw` launches it (eps 1e-10)."""
        peer.quant[launch["grid"]](h_PF, h_fp8, h_scale, group, group, 1e-10, bit8_min=launch["fp8_min"],
                                   bit8_max=launch["fp8_max"], BLOCK=launch["BLOCK"], **launch["options"])


class _VLLMCudaPlatform:
    """What vLLM's rules ask of `current_platform` on an NVIDIA GPU (not ROCm)."""

    @staticmethod
    def is_rocm() -> bool:
        return False

    @staticmethod
    def is_device_capability(capability: tuple[int, int] | int, device_id: int = 0) -> bool:
        if not torch.cuda.is_available():
            return False
        major, minor = torch.cuda.get_device_capability(device_id)
        return (major, minor) == capability if isinstance(capability, tuple) else major * 10 + minor == capability


class VLLMEngine(PeerEngine):
    """vLLM (0.33.0 layout)."""

    name, tested_version = "vllm", "0.33.0"
    kernels = "vllm/model_executor/layers/fused_moe/fused_moe.py"
    act_kernel = None
    quant = "vllm/model_executor/layers/quantization/utils/fp8_utils.py"
    quant_kernel = "_per_token_group_quant_fp8"
    rule = kernels
    swap_rule = ("vllm/model_executor/layers/fused_moe/utils.py", "enable_swap_ab")
    configs = "vllm/model_executor/layers/fused_moe/configs"
    has_down_configs = False

    def align_buffer_size(self, num_routed, num_experts, block_m):
        """Its formula (no pad_sorted_ids in `fused_experts`)."""
        size = num_routed + num_experts * (block_m - 1)
        return min(num_routed * block_m, size) if num_routed < num_experts else size

    def config_file_name(self, num_experts, inter, device_name, dtype, down=False):
        """`get_config_file_name`: device name with '_' for runs of spaces and '/', any H200-family name as
        NVIDIA_H200, the block shape without spaces. vLLM has no `_down` files."""
        if down:
            raise _errors().InvalidConfigError("vLLM has no _down config files (one config serves both GEMMs)")
        device = re.sub(r"[\s/]+", "_", device_name)
        if "H200" in device.split("_"):
            device = "NVIDIA_H200"
        dtype_str, block = _config_dtype(dtype)
        block_str = f",block_shape={block}".replace(" ", "") if block and all(block) else ""
        dtype_part = f",dtype={dtype_str}" if dtype_str else ""
        return f"E={num_experts},N={inter},device_name={device}{dtype_part}{block_str}.json"

    def config_folders(self, wheel, triton_version):
        return [self.configs]

    def default_config(self, wheel, num_rows, num_experts, inter, hidden, dtype):
        """Not batch invariant, CUDA (not ROCm); the int4/int8 branches are not reproduced."""
        namespace = {"envs": types.SimpleNamespace(VLLM_BATCH_INVARIANT=False), "current_platform": _VLLMCudaPlatform,
                     "should_moe_wna16_use_cuda": _not_reproduced, "next_power_of_2": _not_reproduced}
        rule = _exec_plain(wheel, self.rule, "get_default_config", namespace)
        dtype_str, block = _config_dtype(dtype)
        return dict(rule(num_rows, num_experts, inter, hidden, 1, dtype_str, block))

    def swap_rule_namespace(self):
        return {"current_platform": _VLLMCudaPlatform}

    def gemm_args(self, common, swap_ab):
        """As `invoke_fused_moe_triton_kernel` passes them (vLLM passes stride_bsn 0 where the scales have a single
        N block: the same loads)."""
        args = dict(common, b_bias_ptr=None, stride_bbe=0, stride_bbn=0, naive_block_assignment=False, SPLIT_K=1,
                    HAS_BIAS=False, SWAP_AB=swap_ab, USE_TD=False)
        if common["use_fp8_w8a8"]:
            args["BLOCK_SIZE_K"] = min(args["BLOCK_SIZE_K"], *FP8_BLOCK)
        if common["num_valid_tokens"] < common["BLOCK_SIZE_M"]:  # its small-batch cut (A.size(0) < BLOCK_SIZE_M)
            args["EM"] = min(common["EM"], common["num_valid_tokens"] * common["BLOCK_SIZE_M"])
        return args

    def act(self, peer, gate_up_P2F, h_PF, routing):
        """`SiluAndMul.forward_native`: the math of the CUDA `silu_and_mul` vLLM calls (see the module docstring)."""
        inter = h_PF.shape[1]
        torch.mul(torch.nn.functional.silu(gate_up_P2F[:, :inter]), gate_up_P2F[:, inter:], out=h_PF)

    def quantize(self, peer, h_PF, h_fp8, h_scale, group, launch):
        """As `per_token_group_quant_fp8`'s Triton branch launches it (eps 1e-10, row-major scales, no UE8M0)."""
        peer.quant[launch["grid"]](h_PF, h_fp8, h_scale, group, h_PF.shape[1], h_PF.stride(0), 1e-10,
                                   fp8_min=launch["fp8_min"], fp8_max=launch["fp8_max"], use_ue8m0=False,
                                   BLOCK=launch["BLOCK"], **launch["options"])


SGLANG, VLLM = SGLangEngine(), VLLMEngine()
ENGINES: dict[str, PeerEngine] = {engine.name: engine for engine in (SGLANG, VLLM)}


@dataclasses.dataclass
class PeerKernel:
    """An engine's kernels, imported from its wheel (see the module docstring)."""

    engine: PeerEngine
    version: str
    wheel: str
    gemm: object                 # fused_moe_kernel (triton.jit)
    act: object | None           # the engine's Triton act kernel (None: the engine's act runs in torch)
    quant: object                # the engine's per-token-group FP8 quant kernel (triton.jit)
    gemm_params: tuple[str, ...]
    gemm_required: frozenset[str]
    module_file: str             # the generated module (outside the repository)

    @property
    def label(self) -> str:
        return f"{self.engine.name} {self.version}"


def load_peer_kernel(wheel_path: str) -> PeerKernel:
    """Read an engine's fused-MoE Triton kernels out of `wheel_path` (its wheel or its fused-moe zip; the engine
    is told by the file name). Raises BackendUnavailableError (ENV001) when the file is missing, is no known
    engine's, or lacks a function."""
    wheel = os.path.abspath(wheel_path)
    engine, version = _engine_of(wheel)
    module = _jit_module(wheel, engine.jit_parts(), f"{engine.name}_{version.replace('.', '_')}")
    params, required = _params(_read(wheel, engine.kernels), GEMM_KERNEL)
    act = getattr(module, engine.act_kernel) if engine.act_kernel else None
    return PeerKernel(engine, version, wheel, getattr(module, GEMM_KERNEL), act, getattr(module, engine.quant_kernel),
                      params, required, module.__file__)


# ------------------------------------------------------------------------------------------------
# tile configs
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class PeerConfig:
    """The engine's tile configs for one launch: GEMM1 (`up`) and GEMM2 (`down`), and where they came from."""

    up: dict
    down: dict
    source: str      # the config file in the wheel, or "default rule (get_default_config)"
    num_rows: int    # M used for the lookup

    @property
    def block_m(self) -> int:
        return self.up["BLOCK_SIZE_M"]


def find_config_file(wheel: str, name: str, triton_version: str) -> str | None:
    """The wheel path of config file `name`, searched as the engine's `get_moe_configs` searches
    (`PeerEngine.config_folders`); None when no folder has it."""
    files = set(_wheel_files(wheel))
    for folder in _engine_of(wheel)[0].config_folders(wheel, triton_version):
        if f"{folder}/{name}" in files:
            return f"{folder}/{name}"
    return None


def tuned_shapes(wheel: str, device_name: str, dtype: str) -> list[tuple[int, int, str]]:
    """(E, N, folder) of every tuned GEMM1 file the wheel has for this device and dtype, sorted.

    Example: an H200 block-FP8 lookup in the SGLang 0.5.23 wheel lists (72, 2048, 'triton_3_8_0') among others;
    in the vLLM 0.33.0 wheel (32, 2048, 'configs')."""
    engine = _engine_of(wheel)[0]
    rest = engine.config_file_name(0, 0, device_name, dtype).split(",", 2)[2]
    found = set()
    for folder in engine.config_folders(wheel, "0"):
        for path in _wheel_files(wheel):
            name = path.removeprefix(folder + "/")
            match = re.fullmatch(r"E=(\d+),N=(\d+),(.*)", name)
            if name != path and "/" not in name and match and match.group(3) == rest:
                found.add((int(match.group(1)), int(match.group(2)), folder.rsplit("/", 1)[-1]))
    return sorted(found)


def nearest_tuned(wheel: str, num_experts: int, inter: int, device_name: str, dtype: str) -> str:
    """A note naming the tuned files nearest to (E, N) for this device and dtype (same N first), for reports."""
    shapes = tuned_shapes(wheel, device_name, dtype)
    if not shapes:
        return f"the wheel has no tuned {device_name} {dtype} file at all"
    best = min(shapes, key=lambda s: (s[1] != inter, abs(s[1] - inter), abs(s[0] - num_experts)))
    same = [s for s in shapes if s[1] == best[1]]
    return (f"no tuned file for E={num_experts},N={inter} on {device_name} ({dtype}); nearest: "
            + ", ".join(f"E={e},N={n} ({folder})" for e, n, folder in same))


def _nearest(configs: dict, num_rows: int) -> dict:
    """The entry whose batch-size key is nearest to `num_rows` (ties: the first in file order, as `min` picks);
    other keys (vLLM's "triton_version") are not entries."""
    table = {int(key): value for key, value in configs.items() if key.isdigit()}
    return dict(table[min(table, key=lambda key: abs(key - num_rows))])


def peer_config(wheel: str, num_experts: int, inter: int, dtype: str, device_name: str, rows: int, *,
                hidden: int | None = None, triton_version: str | None = None) -> PeerConfig:
    """The engine's configs for `rows` routed rows of `num_experts` local experts of intermediate size `inter`
    on `device_name` (e.g. torch.cuda.get_device_name(): "NVIDIA H200"), `dtype` "bf16"/"fp16"/"fp32"/"fp8"
    (block-FP8 w8a8): the tuned file if the wheel has one, else the default rule (`hidden` = D, only the default
    rule's signature takes it). `triton_version` defaults to the installed Triton's."""
    if triton_version is None:
        import triton

        triton_version = triton.__version__
    engine = _engine_of(wheel)[0]
    up_file = find_config_file(wheel, engine.config_file_name(num_experts, inter, device_name, dtype), triton_version)
    if up_file is None:
        config = engine.default_config(wheel, rows, num_experts, inter, hidden or 0, dtype)
        return PeerConfig(config, dict(config), "default rule (get_default_config)", rows)
    up = _nearest(json.loads(_read(wheel, up_file)), rows)
    down_file = find_config_file(wheel, engine.config_file_name(num_experts, inter, device_name, dtype, down=True),
                                 triton_version) if engine.has_down_configs else None
    down = _nearest(json.loads(_read(wheel, down_file)), rows) if down_file else dict(up)
    up.pop("USE_TMA", None)  # the TMA variants are not reproduced
    down.pop("USE_TMA", None)
    down["BLOCK_SIZE_M"] = up["BLOCK_SIZE_M"]  # one align for both GEMMs (as try_get_optimal_moe_config forces)
    source = up_file.rsplit("/configs/", 1)[1] + (f" + {down_file.rsplit('/', 1)[1]}" if down_file else "")
    return PeerConfig(up, down, source, rows)



# ------------------------------------------------------------------------------------------------
# the engines' own tuners: their search spaces, pruned, and a search over them (`--peer-search`)
# ------------------------------------------------------------------------------------------------
# Neither wheel holds its tuner (they live in the engines' repositories, outside the packages: the SGLang 0.5.23
# wheel has no benchmark/kernels/ folder, the vLLM wheel no benchmarks/), so their CUDA enumerations are reproduced
# here, value lists, loop order and block-FP8 filter as the files spell them:
#   SGLang: benchmark/kernels/fused_moe_triton/common_utils.py `get_configs_compute_bound` (not ROCm), filtered
#     as benchmark/kernels/fused_moe_triton/tuning_fused_moe_triton.py `main` filters it for a block shape:
#     `block_k % BLOCK_SIZE_K == 0` (github.com/sgl-project/sglang, read at commit 00e96592 of the tuner and
#     00f0b462 of common_utils).
#   vLLM: benchmarks/kernels/benchmark_moe.py `get_configs_compute_bound(use_fp16, block_quant_shape)` (not ROCm):
#     `BLOCK_SIZE_K % block_k == 0 and BLOCK_SIZE_N % block_n == 0` for block-FP8 (github.com/vllm-project/vllm,
#     read at commit 71acd375).
# Both tuners time the whole fused_moe / fused_experts with ONE config for both GEMMs (`override_config`), as
# `search_config` does here (SGLang's separate up/down tuner, tuning_fused_moe_triton_sep.py, which also writes
# the `_down` files, needs recorded topk ids and is not reproduced).
SMEM_LIMIT_SM90 = 232448  # bytes: the opt-in shared memory per block of an H100/H200 (227 KiB)
SEARCH_MODES = ("none", "small", "full")
_SMALL_TILE_REST = {"GROUP_SIZE_M": 1, "num_warps": 4, "num_stages": 3}  # stage 1 of the small search
_SMALL_BLOCK_N, _SMALL_BLOCK_K, _SMALL_KEEP = (64, 128, 256), (64, 128), 2
_CONFIG_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")

TUNERS = {
    "sglang": "SGLang benchmark/kernels/fused_moe_triton/tuning_fused_moe_triton.py (common_utils.py "
              "get_configs_compute_bound)",
    "vllm": "vLLM benchmarks/kernels/benchmark_moe.py (get_configs_compute_bound)",
}


def tuner_space(engine: PeerEngine | str, dtype: str) -> list[dict]:
    """The configs the engine's own tuner enumerates on CUDA for `dtype` ("bf16"/"fp16"/"fp32": no quantization;
    "fp8": block-FP8 w8a8 [128, 128]), in its order, after its own block-shape filter (see the comment above).
    SGLang: 1920 (bf16), 1280 (fp8); vLLM: 1920 (bf16), 640 (fp8)."""
    name = engine if isinstance(engine, str) else engine.name
    _config_dtype(dtype)  # a known dtype
    block_n, block_k = FP8_BLOCK
    configs = []
    if name == "sglang":
        for num_stages in (2, 3, 4, 5):
            for block_m in (16, 32, 64, 128, 256):
                for block_k_ in (64, 128, 256):
                    for block_n_ in (32, 64, 128, 256):
                        for num_warps in (4, 8):
                            for group_size in (1, 16, 32, 64):
                                configs.append(dict(zip(_CONFIG_KEYS, (block_m, block_n_, block_k_, group_size,
                                                                       num_warps, num_stages))))
        if dtype == "fp8":
            configs = [c for c in configs if block_k % c["BLOCK_SIZE_K"] == 0]
    elif name == "vllm":
        ranges = {"BLOCK_SIZE_M": (16, 32, 64, 128, 256), "BLOCK_SIZE_N": (32, 64, 128, 256),
                  "BLOCK_SIZE_K": (64, 128, 256), "GROUP_SIZE_M": (1, 16, 32, 64), "num_warps": (4, 8),
                  "num_stages": (2, 3, 4, 5)}
        configs = [dict(zip(ranges, values)) for values in itertools.product(*ranges.values())]
        if dtype == "fp8":
            configs = [c for c in configs if c["BLOCK_SIZE_K"] % block_k == 0 and c["BLOCK_SIZE_N"] % block_n == 0]
    else:
        raise _errors().UnknownNameError(f"peer engine {name!r}; known: {sorted(TUNERS)}")
    return configs


def effective_config(engine: PeerEngine | str, dtype: str, config: dict) -> dict:
    """The tile config the kernel actually runs with: vLLM's launcher caps BLOCK_SIZE_K at the FP8 block's 128
    (`gemm_args`), so its BLOCK_SIZE_K 256 configs run as 128 ones; SGLang passes the config as it is."""
    name = engine if isinstance(engine, str) else engine.name
    if name == "vllm" and dtype == "fp8":
        return dict(config, BLOCK_SIZE_K=min(config["BLOCK_SIZE_K"], FP8_BLOCK[1]))
    return dict(config)


def smem_bytes(config: dict, dtype: str) -> int:
    """Shared memory a config's pipelined GEMM stages: (BLOCK_SIZE_M + BLOCK_SIZE_N) * BLOCK_SIZE_K * bytes *
    num_stages, the estimate of SGLang's benchmark/kernels/fused_moe_triton/search_space.py
    (`estimate_matmul_smem_bytes`) and of Triton's own matmul `early_config_prune`; 1 byte per element for FP8, 2
    otherwise (the estimate the tuners' OutOfResources skip stands for)."""
    size = 1 if dtype == "fp8" else 2
    return (config["BLOCK_SIZE_M"] + config["BLOCK_SIZE_N"]) * config["BLOCK_SIZE_K"] * size * config["num_stages"]


def config_problems(engine: PeerEngine | str, dtype: str, config: dict, smem_limit: int = SMEM_LIMIT_SM90) -> list[str]:
    """Why `config` cannot run as the engine's `fused_moe_kernel` config for `dtype` (empty: it can): every key,
    power-of-two tiles of at least 16 (tl.dot), for block-FP8 a BLOCK_SIZE_K dividing the 128-wide scale block (the
    kernel reads one activation/weight scale per K step), the shared-memory estimate (`smem_bytes`) within
    `smem_limit`."""
    problems = [f"no {key}" for key in _CONFIG_KEYS if key not in config]
    if problems:
        return problems
    run = effective_config(engine, dtype, config)
    for key in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K"):
        if run[key] < 16 or run[key] & (run[key] - 1):
            problems.append(f"{key}={run[key]} is not a power of two >= 16")
    if dtype == "fp8" and FP8_BLOCK[1] % run["BLOCK_SIZE_K"]:
        problems.append(f"BLOCK_SIZE_K={run['BLOCK_SIZE_K']} does not divide the FP8 block's {FP8_BLOCK[1]}")
    if smem_bytes(run, dtype) > smem_limit:
        problems.append(f"shared memory {smem_bytes(run, dtype)} B > {smem_limit} B")
    return problems


@dataclasses.dataclass
class SearchSpace:
    """The configs a search may time for one engine and dtype: the tuner's space (`tuner_size` configs) less the
    ones that cannot run (`dropped` reason -> count) and the ones that run as another (vLLM FP8's BLOCK_SIZE_K 256)."""

    configs: list[dict]
    tuner_size: int
    dropped: dict[str, int]


def pruned_space(engine: PeerEngine | str, dtype: str, smem_limit: int = SMEM_LIMIT_SM90) -> SearchSpace:
    """`tuner_space` without the configs `config_problems` refuses and without duplicates of what the kernel runs
    (`effective_config`); order kept. At the SM90 limit, bf16: SGLang and vLLM 1920 -> 1248 (672 over the shared
    memory); FP8: SGLang 1280 -> 1248 (32), vLLM 640 -> 288 (the BLOCK_SIZE_K 256 half runs as BLOCK_SIZE_K 128,
    and 64 over the shared memory)."""
    space = tuner_space(engine, dtype)
    kept, seen, dropped = [], set(), {}
    for config in space:
        run = effective_config(engine, dtype, config)
        key = tuple(run[k] for k in _CONFIG_KEYS)
        problems = config_problems(engine, dtype, config, smem_limit)
        reason = "shared memory" if any("shared memory" in p for p in problems) else \
            problems[0] if problems else "runs as another config" if key in seen else None
        if reason:
            dropped[reason] = dropped.get(reason, 0) + 1
            continue
        seen.add(key)
        kept.append(config)
    return SearchSpace(kept, len(space), dropped)


def block_m_cap(max_rows_per_expert: int) -> int:
    """The largest BLOCK_SIZE_M the small search tries: the smallest power of two >= the rows of the fullest expert
    (at least 16): a larger M tile only computes padding rows."""
    cap = 16
    while cap < max_rows_per_expert:
        cap *= 2
    return cap


def small_stage1(space: list[dict], max_rows_per_expert: int) -> list[dict]:
    """Stage 1 of the small search: the tiles (BLOCK_SIZE_M <= `block_m_cap`, BLOCK_SIZE_N in 64/128/256,
    BLOCK_SIZE_K in 64/128) of `space` at GROUP_SIZE_M 1, 4 warps, 3 stages (the most frequent values in the
    engines' tuned H200 files)."""
    cap = block_m_cap(max_rows_per_expert)
    return [c for c in space if c["BLOCK_SIZE_M"] <= cap and c["BLOCK_SIZE_N"] in _SMALL_BLOCK_N
            and c["BLOCK_SIZE_K"] in _SMALL_BLOCK_K and all(c[k] == v for k, v in _SMALL_TILE_REST.items())]


def small_stage2(space: list[dict], tile: dict, max_rows_per_expert: int, group_size: int | None = None) -> list[dict]:
    """Stage 2 of the small search for one tile (BLOCK_SIZE_M/N/K of `tile`): with `group_size` None every
    (num_warps, num_stages) of `space` at GROUP_SIZE_M 1; else, for the best (num_warps, num_stages) in `tile`,
    every other GROUP_SIZE_M."""
    same = [c for c in space if all(c[k] == tile[k] for k in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K"))]
    if group_size is None:
        return [c for c in same if c["GROUP_SIZE_M"] == 1]
    return [c for c in same if c["num_warps"] == tile["num_warps"] and c["num_stages"] == tile["num_stages"]
            and c["GROUP_SIZE_M"] != group_size]


@dataclasses.dataclass
class SearchResult:
    """What `search_config` found: the fastest config (None when every one failed), its time, every config timed
    (in order) and every one that failed to run (the tuners skip those too)."""

    mode: str
    best: dict | None
    best_us: float
    timed: list[tuple[dict, float]]
    failed: list[tuple[dict, str]]
    tuner_size: int
    candidates: int

    def summary(self) -> str:
        return (f"{self.mode} search: {len(self.timed)} of the tuner's {self.tuner_size} configs timed "
                f"({self.candidates} runnable), {len(self.failed)} failed")


def search_config(engine: PeerEngine | str, dtype: str, mode: str, time_config, *, max_rows_per_expert: int,
                  smem_limit: int = SMEM_LIMIT_SM90) -> SearchResult:
    """The fastest config of the engine's tuner space for one exact shape, as `time_config(config) -> us` times it
    (an exception: the config failed; skipped, as the tuners skip OutOfResources/RuntimeError).

    mode "full": every config of `pruned_space` (1248 per engine for bf16, 1248/288 for SGLang/vLLM FP8: hours at
    the largest shapes).
    mode "small": two stages inside `pruned_space`, at most 30 + 2 * (7 + 3) = 50 configs: (1) `small_stage1`'s
    tiles; (2) for the `_SMALL_KEEP` (2) fastest tiles, every num_warps x num_stages at GROUP_SIZE_M 1, then every
    other GROUP_SIZE_M at the best of those (`small_stage2`). The winner is the fastest config timed."""
    if mode not in SEARCH_MODES[1:]:
        raise _errors().InvalidConfigError(f"peer search mode {mode!r}; known: {', '.join(SEARCH_MODES[1:])}")
    space = pruned_space(engine, dtype, smem_limit)
    timed, failed, times = [], [], {}

    def run(configs):
        for config in configs:
            key = tuple(config[k] for k in _CONFIG_KEYS)
            if key in times:
                continue
            try:
                us = float(time_config(dict(config)))
            except Exception as exc:  # noqa: BLE001 - a config that fails to compile or launch is skipped
                times[key] = float("inf")
                failed.append((dict(config), f"{type(exc).__name__}: {str(exc)[:200]}"))
                continue
            times[key] = us
            timed.append((dict(config), us))

    def fastest(configs, count=1):
        ranked = sorted((times[tuple(c[k] for k in _CONFIG_KEYS)], i) for i, c in enumerate(configs)
                        if times.get(tuple(c[k] for k in _CONFIG_KEYS), float("inf")) < float("inf"))
        return [configs[i] for _, i in ranked[:count]]

    if mode == "full":
        run(space.configs)
    else:
        stage1 = small_stage1(space.configs, max_rows_per_expert)
        run(stage1)
        for tile in fastest(stage1, _SMALL_KEEP):
            warps_stages = small_stage2(space.configs, tile, max_rows_per_expert)
            run(warps_stages)
            best = fastest(warps_stages + [tile])[0]
            run(small_stage2(space.configs, best, max_rows_per_expert, group_size=best["GROUP_SIZE_M"]))
    best = min(timed, key=lambda item: item[1], default=(None, float("inf")))
    return SearchResult(mode, best[0], best[1], timed, failed, space.tuner_size, len(space.configs))


def tuned_peer_config(engine: PeerEngine | str, result: SearchResult, rows: int) -> PeerConfig:
    """The `PeerConfig` of a search's winner: one config for both GEMMs (as both tuners time it)."""
    name = engine if isinstance(engine, str) else engine.name
    if result.best is None:
        raise _errors().BackendUnavailableError(f"{name}: no config of the {result.mode} search ran "
                                                f"({len(result.failed)} failed)")
    return PeerConfig(dict(result.best), dict(result.best), f"tuned: {result.summary()} of {TUNERS[name]}", rows)


# ------------------------------------------------------------------------------------------------
# routing inputs from our layout
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class PeerRouting:
    """The peer kernel's routing inputs for one layout and BLOCK_SIZE_M (top_k 1: a token id is a pool row)."""

    sorted_token_ids: torch.Tensor        # [max_padded] int32: pool rows grouped by expert, sentinel padding
    expert_ids: torch.Tensor              # [max_padded / BLOCK_M] int32: the expert of each M block (-1 unused)
    num_tokens_post_padded: torch.Tensor  # [1] int32
    row_expert_P: torch.Tensor            # [P] int32: each pool row's expert, -1 outside every segment (topk_ids)
    topk_weights: torch.Tensor            # [P] fp32 ones (read only with MUL_ROUTED_WEIGHT)
    block_m: int
    num_valid_tokens: int                 # P: ids >= P are padding (the sentinel is P)


def peer_routing(row_start_e: torch.Tensor, num_rows_e: torch.Tensor, num_pool_rows: int, block_m: int,
                 engine: PeerEngine) -> PeerRouting:
    """`moe_align_block_size`'s output for our expert-major pool (syncs the host; build it outside timing), its
    buffers sized by `engine.align_buffer_size`.

    Example: counts [3, 0, 5] at rows [0, 4, 4] of a 12-row pool, block_m 4 -> sorted_token_ids
        [0, 1, 2, 12, 4, 5, 6, 7, 8, 12, 12, 12, 12, ...] (sentinel 12), expert_ids [0, 2, 2, -1, ...],
        num_tokens_post_padded [12]; 8 routed rows over 3 experts: SGLang 8 + 4 * 3 = 20 ids (5 blocks),
        vLLM 8 + 3 * 3 = 17 ids (5 blocks).
    """
    device = num_rows_e.device
    counts, starts = num_rows_e.tolist(), row_start_e.tolist()
    max_padded = engine.align_buffer_size(sum(counts), len(counts), block_m)
    sentinel = num_pool_rows
    sorted_ids = torch.full((max_padded,), sentinel, dtype=torch.int32)
    expert_ids = torch.full((_cdiv(max_padded, block_m),), -1, dtype=torch.int32)
    row_expert = torch.full((num_pool_rows,), -1, dtype=torch.int32)
    cursor = 0
    for expert, (start, count) in enumerate(zip(starts, counts)):
        if count == 0:
            continue
        sorted_ids[cursor:cursor + count] = torch.arange(start, start + count, dtype=torch.int32)
        blocks = _cdiv(count, block_m)
        expert_ids[cursor // block_m:cursor // block_m + blocks] = expert
        row_expert[start:start + count] = expert
        cursor += blocks * block_m
    return PeerRouting(sorted_ids.to(device), expert_ids.to(device),
                       torch.tensor([cursor], dtype=torch.int32, device=device), row_expert.to(device),
                       torch.ones(max(num_pool_rows, 1), dtype=torch.float32, device=device), block_m, num_pool_rows)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)



# ------------------------------------------------------------------------------------------------
# running it
# ------------------------------------------------------------------------------------------------
def _is_interpreter() -> bool:
    from moe_ref.kernels import is_interpreter

    return is_interpreter()


@functools.lru_cache(maxsize=None)
def _swap_ab_rule(wheel: str):
    """The wheel's block-FP8 swap-AB rule `(BLOCK_SIZE_M, BLOCK_SIZE_N) -> bool`, run with the engine's CUDA facts
    (`PeerEngine.swap_rule_namespace`)."""
    engine = _engine_of(wheel)[0]
    path, name = engine.swap_rule
    return _exec_plain(wheel, path, name, engine.swap_rule_namespace())


def _launch_gemm(peer: PeerKernel, a, a_scale, b, b_scale, c, routing: PeerRouting, config: dict, fp8: bool):
    """One `fused_moe_kernel` launch with the arguments the engine's launcher passes (top_k 1, see the module
    docstring): the arguments both engines pass here, the rest in `PeerEngine.gemm_args`."""
    import triton
    import triton.language as tl

    compute_type = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[c.dtype]
    interpreter = _is_interpreter()
    num_n, num_k = b.shape[1], b.shape[2]
    scale_2d = a_scale is not None and a_scale.ndim == 2
    common = dict(
        a_ptr=a, b_ptr=b, c_ptr=c, a_scale_ptr=a_scale, b_scale_ptr=b_scale, topk_weights_ptr=routing.topk_weights,
        sorted_token_ids_ptr=routing.sorted_token_ids, expert_ids_ptr=routing.expert_ids,
        num_tokens_post_padded_ptr=routing.num_tokens_post_padded, N=num_n, K=num_k,
        EM=routing.sorted_token_ids.shape[0], num_valid_tokens=routing.num_valid_tokens, stride_am=a.stride(0),
        stride_ak=a.stride(1), stride_be=b.stride(0), stride_bk=b.stride(2), stride_bn=b.stride(1),
        stride_cm=c.stride(-2), stride_cn=c.stride(-1),
        stride_asm=a_scale.stride(0) if scale_2d else 0, stride_ask=a_scale.stride(1) if scale_2d else 0,
        stride_bse=b_scale.stride(0) if fp8 else 0, stride_bsk=b_scale.stride(2) if fp8 else 0,
        stride_bsn=b_scale.stride(1) if fp8 else 0,
        group_n=FP8_BLOCK[0] if fp8 else 0, group_k=FP8_BLOCK[1] if fp8 else 0,
        MUL_ROUTED_WEIGHT=False, top_k=1, compute_type=compute_type, use_fp8_w8a8=fp8, use_int8_w8a8=False,
        use_int8_w8a16=False, per_channel_quant=False,
        **{key: value for key, value in config.items() if key.startswith(("BLOCK_SIZE_", "GROUP_SIZE_"))},
    )
    swap_ab = fp8 and not interpreter and _swap_ab_rule(peer.wheel)(config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"])
    args = peer.engine.gemm_args(common, swap_ab)
    missing, unknown = peer.gemm_required - set(args), set(args) - set(peer.gemm_params)
    if missing or unknown:
        raise _errors().BackendUnavailableError(
            f"{peer.label}: {GEMM_KERNEL}'s signature is not the one this reader knows ({peer.engine.name} "
            f"{peer.engine.tested_version}): it also takes {sorted(missing)}, it lacks {sorted(unknown)}")
    options = {} if interpreter else {key: config[key] for key in ("num_warps", "num_stages") if key in config}
    options.update(peer.engine.launch_options(a))
    grid = (triton.cdiv(args["EM"], args["BLOCK_SIZE_M"]) * triton.cdiv(num_n, args["BLOCK_SIZE_N"]),)
    try:
        peer.gemm[grid](**args, **options)
    except Exception as exc:  # noqa: BLE001 - a Triton without PDL (launch_pdl, gdc_wait): run without, say so once
        if "launch_pdl" not in options:
            raise
        for key in ("USE_GDC", "launch_pdl", "GDC_EARLY"):
            options.pop(key)
        peer.gemm[grid](**args, **options)  # raises what is wrong besides PDL
        _PDL["ok"] = False
        print(f"peer_moe: the PDL launch failed on Triton {triton.__version__} ({type(exc).__name__}: "
              f"{str(exc)[:200]}); the peer runs without PDL", file=sys.stderr)


_PDL = {"ok": True}  # False once Triton refused a launch_pdl launch


def run_peer_mlp(peer: PeerKernel, x_PD: torch.Tensor, gate_up_e2FD: torch.Tensor, down_eDF: torch.Tensor,
                 row_start_e: torch.Tensor, num_rows_e: torch.Tensor, *, x_scale: torch.Tensor | None = None,
                 gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
                 config: PeerConfig, routing: PeerRouting | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The engine's expert MLP on our expert-major pool (`grouped_mlp`'s operands and layout; FP8: e4m3 x with
    per-row per-128 fp32 scales `[P, D/128]`, e4m3 weights with 128x128 block scales).

    `routing`: `peer_routing(row_start_e, num_rows_e, P, config.block_m, peer.engine)`, built once outside the
    timed region (built here, with a host sync, when None). Returns y `[P, D]` in `out_dtype` (default: bf16 for
    FP8, else x's dtype; FP8 runs keep gate||up and h in it too, as the engines keep them in their activations'
    dtype); pool rows outside every segment are left unwritten.
    """
    num_pool_rows, hidden = x_PD.shape
    inter = down_eDF.shape[2]
    fp8 = x_PD.dtype == torch.float8_e4m3fn
    if routing is None:
        routing = peer_routing(row_start_e, num_rows_e, num_pool_rows, config.block_m, peer.engine)
    if routing.block_m != config.block_m:
        raise _errors().InvalidConfigError(f"routing built for BLOCK_SIZE_M {routing.block_m}, config has "
                                           f"{config.block_m}")
    out_dtype = out_dtype or (torch.bfloat16 if fp8 else x_PD.dtype)
    y_PD = torch.empty(num_pool_rows, hidden, dtype=out_dtype, device=x_PD.device)
    if routing.sorted_token_ids.numel() == 0:
        return y_PD
    gate_up_P2F = torch.empty(num_pool_rows, 2 * inter, dtype=out_dtype, device=x_PD.device)
    _launch_gemm(peer, x_PD, x_scale, gate_up_e2FD, gate_up_scale, gate_up_P2F, routing, config.up, fp8)
    h_PF = torch.empty(num_pool_rows, inter, dtype=out_dtype, device=x_PD.device)
    peer.engine.act(peer, gate_up_P2F, h_PF, routing)
    h_scale = None
    if fp8:
        h_PF, h_scale = _quantize_per_token_group(peer, h_PF)
    _launch_gemm(peer, h_PF, h_scale, down_eDF, down_scale, y_PD, routing, config.down, fp8)
    return y_PD


def _quantize_per_token_group(peer: PeerKernel, h_PF: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's per-token-group (128) FP8 quantization of h (`PeerEngine.quantize`: row-major scales, eps
    1e-10, e4m3 range +-448, one program per group, warps as both engines pick them); moe_ref's
    `quantize_fp8_per_128` under the interpreter."""
    import triton

    if _is_interpreter():  # its fp8 cast drops the mantissa carry (120 -> 64, not 128): see _triton_utils.to_e4m3
        from moe_ref.kernels.experts.fp8 import quantize_fp8_per_128

        return quantize_fp8_per_128(h_PF)
    group = FP8_BLOCK[1]
    rows, inter = h_PF.shape
    h_fp8 = torch.empty_like(h_PF, dtype=torch.float8_e4m3fn)
    h_scale = torch.empty(rows, inter // group, dtype=torch.float32, device=h_PF.device)
    block = triton.next_power_of_2(group)
    info = torch.finfo(torch.float8_e4m3fn)
    launch = dict(grid=(h_PF.numel() // group,), BLOCK=block, fp8_min=info.min, fp8_max=info.max,
                  options=dict(num_warps=min(max(block // 256, 1), 8), num_stages=1))
    peer.engine.quantize(peer, h_PF, h_fp8, h_scale, group, launch)
    return h_fp8, h_scale


# ------------------------------------------------------------------------------------------------
# the engines' weight-only INT4 kernel (W4A16, group-wise scales)
# ------------------------------------------------------------------------------------------------
# Both engines ship it in the same file as fused_moe_kernel (SGLang `invoke_fused_moe_kernel` launches it for
# int4_w4a16 with a group block shape; vLLM `invoke_fused_moe_wna16_triton_kernel`, which on CUDA it takes only above
# 6 rows per expert, its compiled wna16 kernel below, and for compressed-tensors INT4 it prefers Marlin). Its weights:
# uint8 [e, N, K/2], element 2j in the low nibble of byte j, value = nibble - 8 (no zero points), times a scale
# [e, N, K/group]: our INT4 int32 words read as bytes (`int4_words_as_peer_bytes`). It loads b without a K mask, so
# K must be a multiple of BLOCK_SIZE_K.
W4A16_KERNEL = "fused_moe_kernel_gptq_awq"


@dataclasses.dataclass
class PeerW4A16:
    """An engine's W4A16 kernel (`W4A16_KERNEL`), imported from its wheel, with the engine's other kernels (`peer`:
    its act step)."""

    peer: PeerKernel
    gemm: object                 # fused_moe_kernel_gptq_awq (triton.jit)
    params: tuple[str, ...]
    required: frozenset[str]

    @property
    def label(self) -> str:
        return f"{self.peer.label} {W4A16_KERNEL}"


def load_peer_w4a16(wheel_path: str) -> PeerW4A16:
    """Read an engine's W4A16 Triton kernel out of `wheel_path` (as `load_peer_kernel`; BackendUnavailableError
    when the file lacks it)."""
    peer = load_peer_kernel(wheel_path)
    module = _jit_module(peer.wheel, [(peer.engine.kernels, [W4A16_KERNEL])],
                         f"{peer.engine.name}_{peer.version.replace('.', '_')}_w4a16")
    params, required = _params(_read(peer.wheel, peer.engine.kernels), W4A16_KERNEL)
    return PeerW4A16(peer, getattr(module, W4A16_KERNEL), params, required)


def int4_words_as_peer_bytes(packed_eOIw: torch.Tensor) -> torch.Tensor:
    """Our INT4 int32 words `[..., O, I/8]` (nibble j of word w = element 8w + j) as the engines' uint8
    `[..., O, I/2]` (element 2j low nibble of byte j): the same bytes on a little-endian machine (a view).

    Example: word 0x000000A9 -> bytes [0xA9, 0, 0, 0]: element 0 = 9 - 8 = 1, element 1 = 10 - 8 = 2.
    """
    if sys.byteorder != "little":
        raise _errors().BackendUnavailableError("the INT4 word-to-byte view assumes a little-endian machine")
    return packed_eOIw.view(torch.uint8)


def w4a16_config_problems(config: dict, k: int) -> list[str]:
    """Why `config` cannot run `W4A16_KERNEL` for a GEMM of reduction width `k` (empty: it can)."""
    problems = [f"no {key}" for key in _CONFIG_KEYS if key not in config]
    if not problems and k % config["BLOCK_SIZE_K"]:
        problems.append(f"K={k} is not a multiple of BLOCK_SIZE_K={config['BLOCK_SIZE_K']} (b is loaded unmasked)")
    return problems


def launch_w4a16_gemm(w4: PeerW4A16, a: torch.Tensor, b_u8: torch.Tensor, b_scale: torch.Tensor, c: torch.Tensor,
                      routing: PeerRouting, config: dict, group_size: int = 32) -> None:
    """One `W4A16_KERNEL` launch as the engine's launcher passes it (top_k 1, no zero points, no routing weights):
    c[r] = a[r] @ dequantized(b[expert of r]).T for the routed rows. `a` `[P, K]` bf16/fp16/fp32, `b_u8` `[e, N, K/2]`,
    `b_scale` `[e, N, K/group_size]`, `c` `[P, N]` in a's dtype."""
    import triton
    import triton.language as tl

    problems = w4a16_config_problems(config, a.shape[1])
    if problems:
        raise _errors().InvalidConfigError(f"{w4.label}: {'; '.join(problems)}")
    if routing.block_m != config["BLOCK_SIZE_M"]:
        raise _errors().InvalidConfigError(f"routing built for BLOCK_SIZE_M {routing.block_m}, config has "
                                           f"{config['BLOCK_SIZE_M']}")
    compute_type = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[c.dtype]
    num_n, num_k = b_u8.shape[1], a.shape[1]
    em = routing.sorted_token_ids.shape[0]
    if w4.peer.engine is VLLM and routing.num_valid_tokens < config["BLOCK_SIZE_M"]:  # its small-batch cut
        em = min(em, routing.num_valid_tokens * config["BLOCK_SIZE_M"])
    even_k = num_k % config["BLOCK_SIZE_K"] == 0
    args = dict(
        a_ptr=a, b_ptr=b_u8, c_ptr=c, b_scale_ptr=b_scale, b_zp_ptr=None, topk_weights_ptr=routing.topk_weights,
        sorted_token_ids_ptr=routing.sorted_token_ids, expert_ids_ptr=routing.expert_ids,
        num_tokens_post_padded_ptr=routing.num_tokens_post_padded, N=num_n, K=num_k, EM=em,
        num_valid_tokens=routing.num_valid_tokens, stride_am=a.stride(0), stride_ak=a.stride(1),
        stride_be=b_u8.stride(0), stride_bk=b_u8.stride(2), stride_bn=b_u8.stride(1), stride_cm=c.stride(-2),
        stride_cn=c.stride(-1), stride_bse=b_scale.stride(0), stride_bsk=b_scale.stride(2),
        stride_bsn=b_scale.stride(1), stride_bze=0, stride_bzk=0, stride_bzn=0, group_size=group_size,
        MUL_ROUTED_WEIGHT=False, top_k=1, compute_type=compute_type, has_zp=False, use_int4_w4a16=True,
        use_int8_w8a16=False, SPLIT_K=1,
        even_Ks=even_k, block_k_diviable=even_k,  # SGLang's and vLLM's names of the same flag (each takes its own)
        **{key: value for key, value in config.items() if key.startswith(("BLOCK_SIZE_", "GROUP_SIZE_"))},
    )
    args = {key: value for key, value in args.items() if key in w4.params}
    missing = w4.required - set(args)
    if missing:
        raise _errors().BackendUnavailableError(f"{w4.label}: its signature is not the one this reader knows: it also "
                                                f"takes {sorted(missing)}")
    options = {} if _is_interpreter() else {key: config[key] for key in ("num_warps", "num_stages") if key in config}
    grid = (triton.cdiv(em, config["BLOCK_SIZE_M"]) * triton.cdiv(num_n, config["BLOCK_SIZE_N"]),)
    w4.gemm[grid](**args, **options)


def run_peer_w4a16_mlp(w4: PeerW4A16, x_PD: torch.Tensor, gate_up_u8: torch.Tensor, gate_up_scale: torch.Tensor,
                       down_u8: torch.Tensor, down_scale: torch.Tensor, routing: PeerRouting, up_config: dict,
                       down_config: dict) -> torch.Tensor:
    """The engine's INT4 W4A16 expert MLP on our expert-major pool: GEMM1 (gate||up `[P, 2F]`), the engine's act,
    GEMM2, each GEMM with its own config (one BLOCK_SIZE_M: `routing`'s). Weights as `int4_words_as_peer_bytes`
    gives them, scales `[e, 2F, D/32]` / `[e, D, F/32]`. Returns y `[P, D]` in x's dtype; pool rows outside every
    segment are left unwritten."""
    num_pool_rows, hidden = x_PD.shape
    inter = down_u8.shape[2] * 2
    y_PD = torch.empty(num_pool_rows, hidden, dtype=x_PD.dtype, device=x_PD.device)
    gate_up_P2F = torch.empty(num_pool_rows, 2 * inter, dtype=x_PD.dtype, device=x_PD.device)
    launch_w4a16_gemm(w4, x_PD, gate_up_u8, gate_up_scale, gate_up_P2F, routing, up_config)
    h_PF = torch.empty(num_pool_rows, inter, dtype=x_PD.dtype, device=x_PD.device)
    w4.peer.engine.act(w4.peer, gate_up_P2F, h_PF, routing)
    launch_w4a16_gemm(w4, h_PF, down_u8, down_scale, y_PD, routing, down_config)
    return y_PD


# ------------------------------------------------------------------------------------------------
# --check
# ------------------------------------------------------------------------------------------------
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
        torch_dtype = _DTYPE_KEYS[dtype]
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
        atol, rtol = _TOLERANCE[_DTYPE_KEYS[dtype]]
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare run_peer_mlp with grouped_mlp_ref")
    parser.add_argument("--wheel", action="append", default=None,
                        help="peer file (an engine's wheel or its fused-moe zip), repeatable (default: every peer "
                             "file in .whl/, one per engine)")
    parser.add_argument("--extract", metavar="WHEEL", default=None,
                        help=f"write <engine>-<version>{_ZIP_SUFFIX} with the members of WHEEL this reader opens")
    parser.add_argument("--out-dir", default=os.path.join(_REPO, ".whl"), help="where --extract writes (.whl/)")
    args = parser.parse_args(argv)
    if args.extract:
        print(extract_members(args.extract, args.out_dir))
        return 0
    if not args.check:
        parser.print_help()
        return 0
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    wheels = args.wheel or default_peer_files()
    if not wheels:
        print("no peer file: pass --wheel or run `make peers` (.whl/sglang-*.whl, .whl/vllm-*-fused-moe.zip)",
              file=sys.stderr)
        return 2
    try:
        return 1 if check(wheels) else 0
    except _errors().MoERefError as exc:
        print(f"FAIL {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
