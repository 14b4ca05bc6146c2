"""What differs between the engines' fused-MoE Triton paths, and where each piece sits in its wheel: one
`PeerEngine` per engine (`ENGINES`: SGLang, vLLM), told from a peer file's name (`engine_of`); the members it names
are read here (`read_member`) and its plain rules run from their source (`exec_plain`, with the engine's CUDA facts).

Shape legend: P receive-pool rows, F expert intermediate (2F: gate rows then up rows).
"""
from __future__ import annotations

import abc
import os
import re
import types
import zipfile

import torch

from moe_ref.bench.peers.source import exec_function, version_key, wheel_files
from moe_ref.core import errors

GEMM_KERNEL = "fused_moe_kernel"  # the same name in both engines
FP8_BLOCK = [128, 128]  # block-FP8 w8a8: weights 128x128 blocks, activations per token per 128
DTYPE_KEYS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
ZIP_SUFFIX = "-fused-moe.zip"
# False once Triton refused a launch_pdl launch (`moe_ref.bench.peers.run`): SGLang's launches go without PDL then
PDL_STATE = {"ok": True}


def read_member(wheel: str, path: str) -> str:
    """The text of member `path` of `wheel` (BackendUnavailableError naming the engine's known layout when absent)."""
    if path not in wheel_files(wheel):
        raise layout_error(wheel, [path])
    with zipfile.ZipFile(wheel) as archive:
        return archive.read(path).decode()


def layout_error(wheel: str, missing: list[str]) -> Exception:
    """The error for a peer file that lacks the members `missing` (another layout of the engine)."""
    engine, _ = engine_of(wheel)
    return errors.BackendUnavailableError(f"{os.path.basename(wheel)} has no {', '.join(missing)} (another "
                                          f"{engine.name} layout?); this reader knows {engine.name} "
                                          f"{engine.tested_version}")


def engine_of(wheel: str) -> tuple[PeerEngine, str]:
    """(engine, version) from the file name: `sglang-0.5.23-....whl`, `vllm-0.33.0-fused-moe.zip`."""
    match = re.match(r"([A-Za-z0-9_]+)-([^-]+)-.*\.(whl|zip)$", os.path.basename(wheel))
    if not match:
        raise errors.BackendUnavailableError(
            f"{wheel!r} is not named like a wheel (name-version-...whl) or a cut of one (name-version{ZIP_SUFFIX})")
    name, version = match.group(1).lower(), match.group(2)
    if name not in ENGINES:
        raise errors.BackendUnavailableError(
            f"{os.path.basename(wheel)}: not a known engine's wheel (known: {', '.join(sorted(ENGINES))}); "
            "download them with `make peers`")
    return ENGINES[name], version


def exec_plain(wheel: str, path: str, name: str, namespace: dict):
    """A plain (not jitted) function `name` of the wheel's `path`, run in `namespace` (which must supply its free
    names that are not module-level functions or constants of `path`)."""
    return exec_function(read_member(wheel, path), f"{os.path.basename(wheel)}:{path}", name, namespace)


def is_interpreter() -> bool:
    """Whether Triton runs under TRITON_INTERPRET=1 (imported on first use: the peer script sets it first)."""
    from moe_ref.kernels import is_interpreter as interpreter

    return interpreter()


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


def config_dtype(dtype: str) -> tuple[str | None, list[int] | None]:
    """The config dtype string and block shape of both engines (`get_config_dtype_str` for these dtypes)."""
    if dtype not in DTYPE_KEYS:
        raise errors.UnknownNameError(f"peer dtype {dtype!r}; known: {sorted(DTYPE_KEYS)}")
    return {"fp8": ("fp8_w8a8", FP8_BLOCK), "fp32": ("float32", None)}.get(dtype, (None, None))


def _not_reproduced(*_args, **_kwargs):
    raise errors.InvalidConfigError("this branch of the engine's rule (int4/int8 weights) is not reproduced")


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
        dtype_str, block = config_dtype(dtype)
        return (f"E={num_experts},N={inter},device_name={device_name.replace(' ', '_')}"
                f"{f',dtype={dtype_str}' if dtype_str else ''}{f',block_shape={block}' if block else ''}"
                f"{'_down' if down else ''}.json")

    def config_folders(self, wheel, triton_version):
        """configs/triton_<version>: the running Triton's first (3.6.0 -> triton_3_6_0), then newest first."""
        prefix = self.configs + "/"
        folders = {p[len(prefix):].split("/")[0] for p in wheel_files(wheel)
                   if p.startswith(prefix + "triton_") and p.count("/") == prefix.count("/") + 1}
        versions = sorted((f.removeprefix("triton_").replace("_", ".") for f in folders), key=version_key,
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
        rule = exec_plain(wheel, self.rule, "get_default_config", namespace)
        dtype_str, block = config_dtype(dtype)
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
        if not PDL_STATE["ok"] or is_interpreter() or torch.cuda.get_device_capability(a.device)[0] < 9:
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
            raise errors.InvalidConfigError("vLLM has no _down config files (one config serves both GEMMs)")
        device = re.sub(r"[\s/]+", "_", device_name)
        if "H200" in device.split("_"):
            device = "NVIDIA_H200"
        dtype_str, block = config_dtype(dtype)
        block_str = f",block_shape={block}".replace(" ", "") if block and all(block) else ""
        dtype_part = f",dtype={dtype_str}" if dtype_str else ""
        return f"E={num_experts},N={inter},device_name={device}{dtype_part}{block_str}.json"

    def config_folders(self, wheel, triton_version):
        return [self.configs]

    def default_config(self, wheel, num_rows, num_experts, inter, hidden, dtype):
        """Not batch invariant, CUDA (not ROCm); the int4/int8 branches are not reproduced."""
        namespace = {"envs": types.SimpleNamespace(VLLM_BATCH_INVARIANT=False), "current_platform": _VLLMCudaPlatform,
                     "should_moe_wna16_use_cuda": _not_reproduced, "next_power_of_2": _not_reproduced}
        rule = exec_plain(wheel, self.rule, "get_default_config", namespace)
        dtype_str, block = config_dtype(dtype)
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

