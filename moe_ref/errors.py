"""Errors a user can cause, each with a stable code, the offending numbers, the fix, and an explain entry.

Every error raised for bad configuration, capacity, input or environment is a subclass of
:class:`MoERefError` *and* of the builtin a caller would expect (``ValueError``, ``TypeError``,
``RuntimeError``), so ``except ValueError`` keeps working. ``moe-ref explain CODE`` prints the
catalogue entry: cause, typical trigger, solutions and an example fix.

Families (code prefixes): ``CFG`` configuration, ``CAP`` capacity, ``INP`` inputs, ``ENV`` environment,
``LOAD`` checkpoints.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Explanation:
    """One catalogue entry, printed by ``moe-ref explain CODE``."""

    code: str
    title: str
    cause: str
    trigger: str
    solutions: tuple[str, ...]
    example: str

    def render(self) -> str:
        lines = [f"{self.code}: {self.title}", "", f"Cause:    {self.cause}", f"Trigger:  {self.trigger}", "Solutions:"]
        lines += [f"  - {s}" for s in self.solutions]
        lines += ["Example fix:", *("  " + line for line in self.example.splitlines())]
        return "\n".join(lines)


CATALOGUE: dict[str, Explanation] = {}


def _entry(code, title, cause, trigger, solutions, example) -> str:
    CATALOGUE[code] = Explanation(code, title, cause, trigger, tuple(solutions), example)
    return code


class MoERefError(Exception):
    """Base of every coded moe_ref error. ``str(err)`` = ``[CODE] message (see: moe-ref explain CODE)``."""

    code: str = "MOE000"

    def __init__(self, message: str, **details):
        self.message = message
        self.details = details
        super().__init__(f"[{self.code}] {message} (see: moe-ref explain {self.code})")

    @classmethod
    def explanation(cls) -> Explanation:
        return CATALOGUE[cls.code]


# --- configuration -------------------------------------------------------------------------------------

class ConfigError(MoERefError, ValueError):
    """Base of configuration errors (``CFG*``)."""


class TPExceedsExpertsError(ConfigError):
    code = _entry(
        "CFG001", "tensor-parallel size larger than the number of routed experts",
        "Each expert would be split over more TP ranks than there are experts to place; MoE weights cannot "
        "be sharded that way.",
        "Serving Step3 (48 experts) with --tp 64, or any tp_size > num_experts.",
        ["Lower tp_size to at most num_experts.",
         "Use expert parallelism (ep_size) or attention data parallelism (dp_size) for the extra GPUs."],
        "moe-ref check --preset step3 --tp 8 --ep 8 --dp 8   # instead of --tp 64")


class ExpertsNotDivisibleError(ConfigError):
    code = _entry(
        "CFG002", "number of experts not divisible by the expert-parallel size",
        "Experts are placed in equal contiguous blocks: global expert e lives on rank e // (E / ep_size).",
        "384 experts on ep_size 5.",
        ["Pick an ep_size that divides num_experts (e.g. 2, 4, 8 for 384).",
         "Or pad the expert count with never-routed experts."],
        "moe-ref check --preset kimi-k2 --ep 8")


class TopKError(ConfigError):
    code = _entry(
        "CFG003", "top-k larger than the number of experts (or not positive)",
        "Each token selects num_topk distinct experts, so num_topk must lie in [1, num_experts].",
        "num_experts_per_tok: 16 in a config with 8 experts.",
        ["Lower num_topk, or raise num_experts."],
        "MoEConfig(num_experts=64, num_topk=8, ...)")


class GroupConfigError(ConfigError):
    code = _entry(
        "CFG004", "invalid expert-group routing settings",
        "Grouped top-k splits experts into n_group equal groups, keeps topk_group of them, then picks top-k "
        "experts among the kept ones; each step needs consistent numbers.",
        "n_group that does not divide the experts, topk_group > n_group, or kept groups holding fewer "
        "than top_k experts.",
        ["Make num_groups divide num_experts.", "Keep 1 <= num_topk_groups <= num_groups.",
         "Ensure num_topk_groups * (num_experts / num_groups) >= num_topk."],
        "MoEConfig(num_experts=256, num_groups=8, num_topk_groups=4, num_topk=8, ...)")


class FP8AlignmentError(ConfigError):
    code = _entry(
        "CFG005", "FP8 path needs dimensions that are multiples of 128",
        "FP8 activations carry one fp32 scale per 128 columns and weights one per 128x128 block.",
        "hidden_size=7000 or an expert intermediate size of 1000 with dtype fp8.",
        ["Use the bf16 path for this shape.", "Pad hidden/intermediate sizes to multiples of 128."],
        "MegaMoE(cfg, dispatch_dtype='bf16')")


class UnknownNameError(ConfigError):
    code = _entry(
        "CFG006", "unknown scoring function, activation, backend, policy or preset name",
        "A string option did not match any supported value.",
        "scoring='tanh', activation='gelu', overflow='drop', backend='cutlass'.",
        ["Use one of the values listed in the message."],
        "MoEConfig(..., scoring='sigmoid', activation='silu')")


class InvalidConfigError(ConfigError):
    code = _entry(
        "CFG007", "a configuration value is out of range or missing",
        "A size is zero or negative, a required HF config field is absent, or fields contradict each other.",
        "hidden_size=0, a config.json without an expert count, latent_dim on a non-latent model.",
        ["Fix the field named in the message."],
        "MoEConfig.from_hf_config('config.json')  # with n_routed_experts / num_experts set")


# --- capacity --------------------------------------------------------------------------------------------

class CapacityError(MoERefError, RuntimeError):
    """Base of capacity errors (``CAP*``)."""


class CapacityExceededError(CapacityError):
    code = _entry(
        "CAP001", "a rank fed more tokens than the per-rank cap (overflow policy 'error')",
        "The symmetric buffer holds num_max_tokens_per_rank rows per rank; the batch of at least one rank "
        "is larger. The check runs on every rank from the max over the EP group before any kernel, so "
        "every rank raises the same error and none hangs.",
        "A prefill batch of 5000 tokens with num_max_tokens_per_rank=4096.",
        ["Raise the cap: num_max_tokens_per_rank=N or MOE_REF_NUM_MAX_TOKENS_PER_RANK=N (the message "
         "gives N and its memory cost).",
         "Or let moe_ref split the batch: overflow='chunk' or MOE_REF_OVERFLOW_POLICY=chunk.",
         "Or cap the scheduler's batch (e.g. max-num-batched-tokens) at the cap."],
        "MegaMoE(cfg, group=group, num_max_tokens_per_rank=8192, overflow='error')\n"
        "# or: MOE_REF_OVERFLOW_POLICY=chunk torchrun ...")


class CapacityMismatchError(CapacityError):
    code = _entry(
        "CAP002", "ranks disagree on the per-rank cap",
        "The symmetric buffer layout is derived from the cap and must be identical on every rank, or peers "
        "would read the wrong offsets.",
        "MOE_REF_NUM_MAX_TOKENS_PER_RANK set differently in the environment of some ranks.",
        ["Pass the same num_max_tokens_per_rank on every rank (the message lists each rank's value)."],
        "export MOE_REF_NUM_MAX_TOKENS_PER_RANK=4096  # in the launcher, for all ranks")


class BufferTooSmallError(CapacityError):
    code = _entry(
        "CAP003", "the buffer is smaller than its capacity plan",
        "A buffer passed in (or reused) has fewer bytes than the plan for this config and cap.",
        "Reusing a buffer built for a smaller cap or hidden size.",
        ["Build a new buffer from the plan (SymmetricBuffer.from_plan) or lower the cap."],
        "buf = SymmetricBuffer(plan, group)")


class MemoryBudgetError(CapacityError):
    code = _entry(
        "CAP004", "no cap fits the memory budget",
        "Even a cap of one token per rank needs more bytes than the budget.",
        "moe-ref plan --preset kimi-k3 --budget-gib 0.001",
        ["Raise the budget or use more EP ranks."],
        "moe-ref plan --preset kimi-k2 --ep 8 --budget-gib 4")


# --- inputs ----------------------------------------------------------------------------------------------

class InputError(MoERefError, ValueError):
    """Base of input errors (``INP*``)."""


class ShapeError(InputError):
    code = _entry(
        "INP001", "a tensor has the wrong rank or shape",
        "Hidden states are [num_tokens, hidden_size]; weights follow the shapes in the docstrings.",
        "Passing [batch, seq, hidden] without flattening, or weights of another model.",
        ["Flatten to [T, H] (x.view(-1, H)) and check hidden_size.", "Check the weights' config."],
        "y = moe(x.view(-1, x.shape[-1])).view_as(x)")


class DTypeError(InputError, TypeError):
    code = _entry(
        "INP002", "a tensor has an unsupported dtype",
        "Hidden states must be float32, float16 or bfloat16 (FP8 is produced internally); ids are int64.",
        "Passing int8 activations or float64 on the Triton path.",
        ["Cast the input (x.to(torch.bfloat16))."],
        "y = moe(x.to(torch.bfloat16))")


class DeviceError(InputError):
    code = _entry(
        "INP003", "tensors on different devices",
        "Hidden states, weights and buffers must live on the layer's device.",
        "A CUDA layer fed a CPU tensor.",
        ["Move the input: x.to(moe.device)."],
        "y = moe(x.to(next(moe.parameters()).device))")


class NonFiniteError(InputError):
    code = _entry(
        "INP004", "router logits contain NaN or inf",
        "Top-k over NaN scores is undefined; moe_ref refuses instead of routing silently wrong.",
        "An overflow upstream (fp16 activations), or uninitialised weights.",
        ["Find the producer of the NaN (torch.autograd.detect_anomaly, or check the previous layer).",
         "Run the router in fp32 (moe_ref does; check the hidden states themselves)."],
        "assert torch.isfinite(x).all()")


class ExpertIdError(InputError):
    code = _entry(
        "INP005", "expert ids out of range",
        "topk ids must be -1 (masked slot) or in [0, num_experts).",
        "Ids from a router with another expert count, or int32 overflow.",
        ["Check the router's num_experts and the ids' dtype (int64)."],
        "topk_ids_TK.clamp_(-1, cfg.num_experts - 1)  # only after finding why")


# --- environment -----------------------------------------------------------------------------------------

class EnvironmentError_(MoERefError, RuntimeError):
    """Base of environment errors (``ENV*``); the trailing underscore avoids the builtin's name."""


class BackendUnavailableError(EnvironmentError_):
    code = _entry(
        "ENV001", "the requested backend is not usable here",
        "The backend's package is missing, fails to load, or needs hardware this machine lacks "
        "(Triton and DeepGEMM need a CUDA GPU for real runs; DeepGEMM's mega-MoE needs SM90 and symmetric "
        "memory).",
        "backend='deep_gemm' on a CPU machine, or a deep_gemm wheel built for another torch.",
        ["Use backend='auto' to pick the best available one.", "Run `moe-ref info` to see what loads and why not."],
        "MegaMoE(cfg, experts_backend='auto')")


class ShapeUnsupportedError(EnvironmentError_):
    code = _entry(
        "ENV002", "the backend refuses this shape",
        "A kernel has a hard limit (e.g. DeepGEMM's SM90 mega-MoE needs intermediate_size <= 4096).",
        "Step3 (intermediate 5120) with the deep_gemm mega path.",
        ["Use backend='auto' to fall back to moe_ref's own path for this shape.", "Use another backend."],
        "MegaMoE(step3_cfg, experts_backend='auto')")


class DistributedError(EnvironmentError_):
    code = _entry(
        "ENV003", "torch.distributed is not set up as the layer needs",
        "An EP layer needs an initialised process group; the symm transport needs all ranks on one host.",
        "Passing a group before dist.init_process_group, or transport='symm' across hosts.",
        ["Call torch.distributed.init_process_group first (torchrun sets the env).",
         "Use transport='a2a' across hosts (the default picks it)."],
        "torchrun --nproc-per-node 2 -m moe_ref.dist_check")


# --- checkpoints -----------------------------------------------------------------------------------------

class CheckpointError(MoERefError, ValueError):
    """Base of checkpoint errors (``LOAD*``)."""


class MissingTensorError(CheckpointError, KeyError):
    code = _entry(
        "LOAD001", "a tensor is missing from the checkpoint",
        "The loader looks tensors up by the model family's real names; one was not found.",
        "Wrong layer_idx, a dense layer, or another family's naming (prefix differs).",
        ["Check layer_idx (MoE layers: see first_k_dense_replace / moe_layers_enum).",
         "Pass prefix=... if the checkpoint nests the model (e.g. 'model.language_model.')."],
        "moe.load_hf_weights('model.safetensors', layer_idx=5, prefix='model.layers.')")

    def __str__(self) -> str:  # KeyError would repr() the message
        return Exception.__str__(self)


class TensorShapeMismatchError(CheckpointError):
    code = _entry(
        "LOAD002", "a checkpoint tensor has the wrong shape",
        "The tensor's shape does not match the config (hidden, intermediate or expert count).",
        "Loading DeepSeek-V3 weights into a Kimi-K2 config.",
        ["Use the config.json that came with the checkpoint."],
        "cfg = MoEConfig.from_hf_config('<checkpoint dir>/config.json')")


class UnsupportedCheckpointError(CheckpointError):
    """A checkpoint stores the MoE weights in a form this loader does not read (quantized/packed)."""

    code = _entry(
        "LOAD003", "the checkpoint stores MoE weights quantized or packed (not supported)",
        "moe_ref reads plain floating-point weights (fp32/fp16/bf16). Reading FP8, INT4 or MXFP4 packed "
        "values without their scales would give silently wrong weights, so the loader refuses.",
        "A real Kimi-K3 checkpoint (MXFP4 experts.{e}.w1.weight_packed + scales), DeepSeek-V3/Kimi-K2-Instruct "
        "block-FP8 weights with weight_scale_inv, or Kimi-K2-Thinking INT4 compressed-tensors.",
        ["Dequantize the checkpoint to bf16 first (e.g. the model vendor's fp8_cast_bf16 script, or load it "
         "with its quantization library and save the dequantized state dict).",
         "For tests and demos, write a bf16 synthetic checkpoint: moe_ref.synthetic.write_synthetic_checkpoint."],
        "write_synthetic_checkpoint('ckpt/', preset('tiny-kimi-k3'))\n"
        "load_moe_weights('ckpt/', preset('tiny-kimi-k3'), layer_idx=0)")


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    code = _entry(
        "LOAD004", "no safetensors checkpoint at the given path",
        "The loader takes a .safetensors file, or a folder holding model.safetensors, sharded *.safetensors "
        "files with model.safetensors.index.json, or any *.safetensors files.",
        "A typo in the path, a folder of .bin (pickle) files, or an index json whose shard files are missing.",
        ["Pass the file or the folder that holds the .safetensors files.",
         "Convert .bin checkpoints to safetensors first."],
        "load_moe_weights('/models/kimi-k2/', cfg, layer_idx=1)")

    def __str__(self) -> str:  # OSError would format its own args
        return Exception.__str__(self)


def explain(code: str) -> str:
    """Return the rendered catalogue entry for ``code`` (case-insensitive); raises KeyError listing codes."""
    entry = CATALOGUE.get(code.upper())
    if entry is None:
        raise KeyError(f"unknown error code {code!r}; known: {', '.join(sorted(CATALOGUE))}")
    return entry.render()
