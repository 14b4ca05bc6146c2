"""A peer file's kernels imported (`load_peer_kernel`), the small zip cut from an engine's wheel
(`extract_members`, what `make peers` keeps of the vLLM wheel), and the peer files found in .whl/
(`default_peer_files`)."""
from __future__ import annotations

import dataclasses
import glob
import os
import zipfile

from moe_ref.bench.peers.engines import (ENGINES, GEMM_KERNEL, ZIP_SUFFIX, PeerEngine, engine_of, layout_error,
                                         read_member)
from moe_ref.bench.peers.source import function_params, jit_module, version_key, wheel_files
from moe_ref.core import errors

# the checkout holding this package: its .whl/ is where `make peers` puts the peer files
REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))


@dataclasses.dataclass
class PeerKernel:
    """An engine's kernels, imported from its wheel (see `moe_ref.bench.peers`)."""

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


def import_jit(wheel: str, parts: list[tuple[str, list[str]]], tag: str):
    """The `@triton.jit` functions `parts` = [(path in the wheel, [names])] (with what they use) as one imported
    generated module (`source.jit_module`)."""
    return jit_module(os.path.basename(wheel), [(path, read_member(wheel, path), names) for path, names in parts], tag)


def load_peer_kernel(wheel_path: str) -> PeerKernel:
    """Read an engine's fused-MoE Triton kernels out of `wheel_path` (its wheel or its fused-moe zip; the engine
    is told by the file name). Raises BackendUnavailableError (ENV001) when the file is missing, is no known
    engine's, or lacks a function."""
    wheel = os.path.abspath(wheel_path)
    engine, version = engine_of(wheel)
    module = import_jit(wheel, engine.jit_parts(), f"{engine.name}_{version.replace('.', '_')}")
    params, required = function_params(read_member(wheel, engine.kernels), GEMM_KERNEL)
    act = getattr(module, engine.act_kernel) if engine.act_kernel else None
    return PeerKernel(engine, version, wheel, getattr(module, GEMM_KERNEL), act, getattr(module, engine.quant_kernel),
                      params, required, module.__file__)


def extract_members(wheel: str, out_dir: str) -> str:
    """Write `<engine>-<version>-fused-moe.zip` into `out_dir`: the members of `wheel` this reader opens (the
    engine's `sources` and the JSON files under its `configs` folder), each byte for byte (same name, same
    timestamp). Returns the zip's path. Raises BackendUnavailableError when the wheel lacks a source file."""
    engine, version = engine_of(wheel)
    files = wheel_files(wheel)
    missing = [path for path in engine.sources if path not in files]
    if missing:
        raise layout_error(wheel, missing)
    members = list(engine.sources) + sorted(p for p in files if p.startswith(engine.configs + "/") and
                                            p.endswith(".json"))
    out = os.path.join(out_dir, f"{engine.name}-{version}{ZIP_SUFFIX}")
    if os.path.abspath(out) == os.path.abspath(wheel):
        raise errors.InvalidConfigError(f"{wheel} is already the cut zip")
    os.makedirs(out_dir, exist_ok=True)
    tmp = f"{out}.{os.getpid()}.tmp"
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as target:
        for member in members:
            target.writestr(source.getinfo(member), source.read(member), compress_type=zipfile.ZIP_DEFLATED)
    os.replace(tmp, out)
    return out


def default_peer_files(root: str = REPO) -> list[str]:
    """One peer file per engine under `root`/.whl: its wheel or its fused-moe zip, the newest version (by the
    version in the name; a wheel before a zip of the same version). Empty when there is none."""
    found = []
    for name in sorted(ENGINES):
        paths = glob.glob(os.path.join(root, ".whl", f"{name}-*.whl"))
        paths += glob.glob(os.path.join(root, ".whl", f"{name}-*{ZIP_SUFFIX}"))
        if paths:
            newest = max(version_key(engine_of(p)[1]) for p in paths)
            found.append(min(p for p in paths if version_key(engine_of(p)[1]) == newest))
    return found

