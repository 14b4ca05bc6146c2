"""``moe-ref`` (also ``python -m moe_ref``): plan | check | explain | demo | bench | info.

    moe-ref plan --preset kimi-k2 --ep 8 --max-num-tokens 1024 [--budget-gib 4]
    moe-ref check --config config.json --tp 8 --ep 8 --dp 8
    moe-ref explain CAP001
    moe-ref demo                      # EP over 2 processes (CPU, or GPUs when present)
    moe-ref demo --preset tiny-kimi-k3 --quant mxfp4   # the same from a quantized checkpoint, kept as stored
    moe-ref bench                     # every implementation here, checked then timed: GPU, Kimi-K2's share; CPU, tiny
    moe-ref info                      # versions, devices, backends and why not
    moe-ref conform --impl pkg.mod:factory   # your kernel over the conformance matrix (docs/conform.md)

Every moe_ref error ends the command with one line on stderr, ``moe-ref: [CODE] message (see: moe-ref
explain CODE)``, and exit status 2; ``--debug`` (or ``MOE_REF_DEBUG=1``) adds the traceback. Flags are
checked before any work (CFG015); commands that allocate estimate their bytes first and refuse (ENV016)
unless ``--skip-memory-check``. Progress goes to stderr, results to stdout.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from moe_ref.core import envs
from moe_ref.ep.capacity import CapacityPlan, format_bytes
from moe_ref.core.config import PRESETS, MoEConfig, ParallelConfig
from moe_ref.core.errors import (
    CATALOGUE,
    CheckpointFormatMismatchError,
    CheckpointModelMismatchError,
    CommandLineError,
    DeviceUnavailableError,
    ExpertsNotDivisibleError,
    InsufficientMemoryError,
    MoERefError,
    PathNotWritableError,
    UnsupportedQuantizationError,
    explain,
)
from moe_ref.ep.options import POOL_FORMATS, TRANSPORTS, EPOptions
from moe_ref.eplb.cli import add_simulate_arguments, run_simulate
from moe_ref.checkpoint.formats import (QuantFormat, QuantSpec, expert_weight_bytes, quant_spec_from_config,
                                        shape_problem)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEMO_CAP = 64  # below the demo's 150 tokens on rank 0, so the chunk policy shows


# --- flags, environment and preflight checks (shared with moe_ref.tools.dist_check) --------------------------
class CommandLineParser(argparse.ArgumentParser):
    """argparse whose errors are the coded ``CommandLineError`` (CFG015) instead of usage + ``exit(2)``."""

    def error(self, message: str):
        raise CommandLineError(f"{self.prog}: {message}; `{self.prog} --help` lists the flags")


def int_at_least(minimum: int):
    """argparse ``type=``: an integer >= ``minimum`` (argparse names the flag in the message)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer (needs an integer >= {minimum})") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is out of range: needs an integer >= {minimum}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def positive_float(text: str) -> float:
    """argparse ``type=``: a finite float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (needs a number > 0)") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{value} is out of range: needs a finite number > 0")
    return value


def resolve_cap(cap: int | None, default: int) -> int:
    """The cap a command uses, resolved as the layer resolves it (``EPOptions.resolve``: the flag, else
    ``MOE_REF_NUM_MAX_TOKENS_PER_RANK``, checked there: CFG007 naming where a bad value came from), with the
    command's own ``default`` when neither is given."""
    options = EPOptions.resolve(num_max_tokens_per_rank=cap)
    return default if options.source["num_max_tokens_per_rank"] == "the default" else options.num_max_tokens_per_rank


def require_devices(device: str, num_devices: int) -> None:
    """``device='cuda'`` needs ``num_devices`` visible CUDA GPUs (one per process); else ENV006."""
    if device != "cuda":
        return
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < num_devices:
        fix = f"fewer processes (--nproc {found})" if found else "a machine with GPUs and a CUDA build of torch"
        raise DeviceUnavailableError(
            f"--device cuda needs {num_devices} CUDA GPU(s) (one per process) and torch sees {found} "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}); use --device cpu "
            f"(or auto), or {fix}")


def available_memory_bytes(gpu_index: int | None = None) -> tuple[int, str]:
    """``(bytes available now, where)``: host ``MemAvailable``, or the free memory of GPU ``gpu_index``."""
    if gpu_index is not None:
        return torch.cuda.mem_get_info(gpu_index)[0], f"GPU {gpu_index}"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "host memory (MemAvailable)"
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "host memory"


def demo_memory_bytes(cfg: MoEConfig, num_ranks: int, cap: int, dtype: torch.dtype) -> dict[str, int]:
    """Bytes ONE rank of ``moe_ref.tools.dist_check`` holds at least: every expert (the single-process reference
    runs them all), this rank's experts (the layer's parameters) and its symmetric buffer (the plan)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    D, F, Dx, S, L = (cfg.hidden_size, cfg.intermediate_size, cfg.expert_hidden_size,
                      cfg.shared_intermediate_size, cfg.latent_dim or 0)
    per_expert = 3 * F * Dx  # gate||up [2F, Dx] + down [Dx, F]
    dense = cfg.num_experts * D + (3 * S * D if cfg.has_shared_experts else 0) + 2 * L * D + L  # router, shared, latent
    bias = 4 * cfg.num_experts if cfg.use_selection_bias else 0  # fp32
    plan = CapacityPlan.build(cfg, num_ranks, cap, dtype, alignment=128)  # CFG002 if num_ranks does not divide E
    return {"all experts": (cfg.num_experts * per_expert + dense) * itemsize + bias,
            "this rank's experts": (cfg.num_experts // num_ranks * per_expert + dense) * itemsize + bias,
            "buffer": plan.total_bytes}


def require_memory(need: int, what: str, fixes: str, gpu_index: int | None = None) -> None:
    """Refuse (ENV016) when ``need`` bytes exceed the memory available now (host, or GPU ``gpu_index``)."""
    available, where = available_memory_bytes(gpu_index)
    if need > available:
        raise InsufficientMemoryError(
            f"{what} needs at least {format_bytes(need)} ({need} bytes) and {where} has {format_bytes(available)} "
            f"({available} bytes) available; {fixes}, or pass --skip-memory-check to try anyway")


def check_demo_memory(cfg: MoEConfig, num_ranks: int, cap: int, dtype: torch.dtype,
                      gpu_index: int | None = None) -> None:
    """ENV016 unless the demo's weights and buffers fit: every rank's bytes in host memory (CPU: all
    processes on this host), or one rank's bytes on GPU ``gpu_index``."""
    parts = demo_memory_bytes(cfg, num_ranks, cap, dtype)
    num_copies = num_ranks if gpu_index is None else 1
    what = (f"{cfg.name} over {num_ranks} process(es) on {'cpu' if gpu_index is None else 'cuda'} "
            f"({', '.join(f'{name} {format_bytes(num)}' for name, num in parts.items())} per process"
            f"{f', x {num_copies} processes' if num_copies > 1 else ''})")
    tiny = cfg.name if cfg.name.startswith("tiny-") else f"tiny-{cfg.name}"
    fixes = (f"use --preset {tiny} (the same routing at test sizes) or a model with fewer experts, a smaller "
             f"--cap, or GPUs (--device cuda: bf16, one GPU per process)")
    require_memory(sum(parts.values()) * num_copies, what, fixes, gpu_index)


def check_writer_memory(cfg: MoEConfig) -> None:
    """ENV016 unless host memory holds what the synthetic writer (rank 0) makes: every expert of ``cfg`` in bf16."""
    need = demo_memory_bytes(cfg, 1, 1, torch.bfloat16)["all experts"]
    tiny = cfg.name if cfg.name.startswith("tiny-") else f"tiny-{cfg.name}"
    require_memory(need, f"writing the synthetic {cfg.name} checkpoint (every expert in bf16 on the host, once)",
                   f"use --preset {tiny} (the same routing at test sizes), or pass a --checkpoint folder that holds "
                   f"the checkpoint already")


def writable_folder(path: str) -> str:
    """``path`` as a folder this process can write (created if absent), else ENV015."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise PathNotWritableError(f"--checkpoint {path!r} cannot be created or written ({err.strerror or err}: "
                                   f"{err.filename or path}); pass a folder you can write, or leave "
                                   f"--checkpoint out to use a private temporary folder") from None
    return path


def synthetic_config(preset_name: str, quant: str | None) -> MoEConfig:
    """The block the demo and ``moe_ref.tools.dist_check`` write and run for ``--preset`` and ``--quant``: the
    preset, its sizes rounded up to the format (``quantizable_config``), checked as the synthetic writer checks
    it (so no process starts for a pair it would refuse)."""
    from moe_ref.core.config import preset
    from moe_ref.checkpoint.synthetic import check_synthetic_layout, quantizable_config

    cfg = preset(preset_name)
    cfg = quantizable_config(cfg, quant) if quant else cfg
    check_synthetic_layout(cfg, quant)
    return cfg


FRESH_FOLDER = "a new or empty one gets a fresh checkpoint for these flags"


def check_checkpoint_folder(folder: str, cfg: MoEConfig, preset_name: str, quant: str | None) -> None:
    """A ``--checkpoint`` folder that already holds a config.json is read, not written: refuse it when it holds
    another format than ``--quant`` (LOAD016) or another model than ``--preset`` (LOAD017), naming what it holds
    and the flags that would read it. A folder without config.json passes (it will be written)."""
    from moe_ref.core.config import PRESETS
    from moe_ref.checkpoint.synthetic import config_differences

    config = os.path.join(folder, "config.json")
    if not os.path.isfile(config):
        return
    wanted = f"--quant {quant}" if quant else "no --quant (plain weights)"
    try:
        spec = quant_spec_from_config(config)
    except UnsupportedQuantizationError as err:
        raise CheckpointFormatMismatchError(
            f"--checkpoint {folder!r} already holds a checkpoint whose quantization_config moe_ref does not read "
            f"({err.message.split(';')[0]}); pass another --checkpoint folder ({FRESH_FOLDER})",
            folder=folder) from None
    held = spec.format.value if spec is not None else None
    if held != quant:
        holds = f"{held} routed experts" if held else "plain (unquantized) weights"
        raise CheckpointFormatMismatchError(
            f"--checkpoint {folder!r} already holds a checkpoint with {holds}, but this run asks for {wanted}; "
            f"pass {f'--quant {held}' if held else 'no --quant'} to run that checkpoint, or another --checkpoint "
            f"folder ({FRESH_FOLDER})", folder=folder, holds=held, quant=quant)
    stored = MoEConfig.from_hf_config(config)
    differ = config_differences(cfg, stored)
    if not differ:
        return
    matches = [name for name in PRESETS if name != preset_name
               and not config_differences(synthetic_config(name, quant), stored)]
    shown = [f"{name} {theirs} there, {mine} here" for name, (mine, theirs) in list(differ.items())[:3]]
    more = f" and {len(differ) - 3} more field(s)" if len(differ) > 3 else ""
    fix = f"pass --preset {matches[0]} (the model it holds)" if matches else "pass the --preset it was written for"
    raise CheckpointModelMismatchError(
        f"--checkpoint {folder!r} holds another model than --preset {preset_name}"
        f"{f' with --quant {quant}' if quant else ''} ({'; '.join(shown)}{more}); {fix}, or another --checkpoint "
        f"folder ({FRESH_FOLDER})", folder=folder, fields=sorted(differ))


def require_nproc_divides_experts(nproc: int, cfg: MoEConfig, preset_name: str) -> None:
    """CFG002 in the demo's words: each of ``--nproc`` processes is one EP rank holding an equal block of experts."""
    E = cfg.num_experts
    if E % nproc:
        choices = [n for n in range(1, min(E, 64) + 1) if E % n == 0]
        raise ExpertsNotDivisibleError(
            f"--nproc {nproc}: the {E} experts of --preset {preset_name} cannot be split into {nproc} equal blocks "
            f"(one per process; {E} % {nproc} = {E % nproc}); pass --nproc in {choices}", nproc=nproc,
            num_experts=E)


def _add_model_args(p: argparse.ArgumentParser, default: str | None = "kimi-k2") -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=PRESETS, help=f"a built-in model{f' (default: {default})' if default else ''}")
    src.add_argument("--config", help="an HF config.json (or its folder)")


def _load_cfg(args, validate: bool = True) -> MoEConfig:
    from moe_ref.core.config import preset

    if args.config:
        return MoEConfig.from_hf_config(args.config, validate=validate)
    return preset(args.preset or "kimi-k2")


def expert_memory_lines(cfg: MoEConfig, ep_size: int, spec: QuantSpec | None, plain_dtype: str) -> list[str]:
    """The bytes of ONE EP rank's routed experts (gate, up, down and their scales) in each precision, one line
    each: ``plain_dtype`` and the three checkpoint formats; the config's own (``spec``, from its
    ``quantization_config``; else the plain dtype) is marked. What ``MegaMoE.load_hf_weights`` holds on the
    device for that checkpoint (``expert_nbytes()``)."""
    count, F, Dx = cfg.num_experts // ep_size, cfg.intermediate_size, cfg.expert_hidden_size
    own = spec.format.value if spec is not None else plain_dtype
    mark = ("  <- the checkpoint (its quantization_config)" if spec is not None else
            "  <- this config (no quantization_config: plain weights)")
    lines = [f"routed experts per rank ({count} of {cfg.num_experts}, Dx={Dx}, F={F}; weights + scales):"]
    for name in (plain_dtype, *(f.value for f in QuantFormat)):
        problem = None if name == plain_dtype else shape_problem(name, Dx, F)
        if problem:
            lines.append(f"  {name:<11} {'n/a':>11}: {problem}")
            continue
        fmt_spec = None if name == plain_dtype else QuantSpec.published(name)
        nbytes = expert_weight_bytes(fmt_spec, Dx, F, count, DTYPES[plain_dtype])
        lines.append(f"  {name:<11} {format_bytes(nbytes):>11}{mark if name == own else ''}")
    return lines


def _quant_spec(args) -> QuantSpec | None:
    """The ``quantization_config`` of ``--config`` (presets have none)."""
    return quant_spec_from_config(args.config) if args.config else None


# --- EPLB slots (plan, check) ---------------------------------------------------------------------------
def _add_eplb_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redundant-experts", type=int, default=None, metavar="N",
                   help="EPLB: Ph = E + N physical expert slots, Ph / R per rank (MegaMoE(num_redundant_experts=N); "
                        "default: the --placement's, else no EPLB)")
    p.add_argument("--placement", default=None, metavar="FILE",
                   help="EPLB: a placement file (Placement.save, moe-ref eplb simulate --out), each layer checked as "
                        "MegaMoE(placement=) checks its one")


def _eplb_requested(args) -> bool:
    return args.redundant_experts not in (None, 0) or args.placement is not None


def _parallel_problems(parallel: ParallelConfig, cfg: MoEConfig, args) -> list[MoERefError]:
    """``parallel.problems(cfg)``; with EPLB the slots, not E, split over the EP ranks (CFG021 instead of CFG002)."""
    return [p for p in parallel.problems(cfg)
            if not (_eplb_requested(args) and isinstance(p, ExpertsNotDivisibleError))]


def _eplb_line(cfg: MoEConfig, slots, placement_file: str | None) -> str:
    """One line naming the slots ``deployment_slots`` resolved for the logical ``cfg``."""
    source = repr(placement_file) if placement_file is not None else "the planner's for an even load"
    return (f"EPLB: Ph = E + redundant = {cfg.num_experts} + {slots.num_physical - cfg.num_experts} = "
            f"{slots.num_physical} physical expert slots, {slots.num_local} per rank (Ph / R); placement {source}")


# --- plan ------------------------------------------------------------------------------------------------
def cmd_plan(args) -> int:
    from moe_ref.ep.capacity import max_tokens_for_budget
    from moe_ref.eplb.slots import deployment_slots

    cfg = _load_cfg(args)
    parallel = ParallelConfig(ep_size=args.ep, dp_size=args.dp, attention_dp=args.attention_dp)
    for problem in _parallel_problems(parallel, cfg, args):
        raise problem
    # EPLB: the config the layer's routed step is built for (num_experts = Ph), by the layer's own calls
    step_cfg, slots = deployment_slots(cfg, args.ep, args.redundant_experts, args.placement)
    dtype = DTYPES[args.dtype]
    cap = resolve_cap(args.max_num_tokens, default=4096)
    plan = CapacityPlan.build(step_cfg, args.ep, cap, dtype, dispatch_fp8=args.dispatch_fp8,
                              alignment=args.alignment, pool_format=args.pool_format,
                              batch_invariant=args.batch_invariant)
    memory_lines = expert_memory_lines(step_cfg, args.ep, _quant_spec(args), args.dtype)
    best = None
    if args.budget_gib is not None:  # CAP004 when no cap fits: before anything is printed
        best = max_tokens_for_budget(step_cfg, args.ep, int(args.budget_gib * 2**30), dtype,
                                     dispatch_fp8=args.dispatch_fp8, alignment=args.alignment,
                                     pool_format=args.pool_format, batch_invariant=args.batch_invariant)
    print(f"{cfg.name}: E={cfg.num_experts}, K={cfg.num_topk}, D={cfg.hidden_size}, F={cfg.intermediate_size}"
          f"{f', latent L={cfg.latent_dim}' if cfg.latent_dim else ''}; ep={args.ep}, dp={args.dp}, "
          f"attention-dp={'on' if args.attention_dp else 'off'}")
    if slots is not None:
        print(_eplb_line(cfg, slots, args.placement) + "; the buffer and the routed experts' bytes below count slots")
    print(f"cap = {cap} rows fed by ONE rank per call (never multiplied by dp or ep size)")
    print(plan.report())
    print("\n" + "\n".join(memory_lines))
    if best is not None:
        print(f"\nlargest cap within {args.budget_gib} GiB per rank: {best} tokens "
              f"({plan.with_cap(best).total_bytes / 2**30:.3f} GiB)")
    return 0


# --- check -----------------------------------------------------------------------------------------------
def cmd_check(args) -> int:
    cfg = _load_cfg(args, validate=False)
    problems, slots = list(cfg.problems()), None
    if not problems:
        problems += _parallel_problems(ParallelConfig(tp_size=args.tp, ep_size=args.ep, dp_size=args.dp), cfg, args)
        try:  # EPLB: the layer's own calls and coded errors (CFG021, CFG023, CFG033)
            from moe_ref.eplb.slots import deployment_slots

            _, slots = deployment_slots(cfg, args.ep, args.redundant_experts, args.placement)
        except MoERefError as err:
            problems.append(err)
    if not problems and args.config:
        problems += checkpoint_problems(args.config, cfg)
    where = args.config or args.preset or "kimi-k2"
    if not problems:
        num_local = cfg.num_experts // args.ep if slots is None else slots.num_local
        what = "expert" if slots is None else "expert slot"
        print(f"OK: {where} with tp={args.tp} ep={args.ep} dp={args.dp} "
              f"({num_local} {what}{'s' if num_local != 1 else ''} per EP rank)")
        if slots is not None:
            print(_eplb_line(cfg, slots, args.placement))
        if args.dispatch_fp8:
            print(fp8_dispatch_note(cfg))
        return 0
    print(f"{len(problems)} problem(s) with {where} at tp={args.tp} ep={args.ep} dp={args.dp}:")
    for problem in problems:
        print(f"  - {problem}")
    return 1


def checkpoint_problems(config_path: str, cfg: MoEConfig) -> list[MoERefError]:
    """What ``MegaMoE.load_hf_weights(folder, layer)`` would raise for the checkpoint beside ``config_path`` (a
    config.json or its folder), for every MoE layer, from the safetensors headers alone (no tensor is read):
    ``[]`` when every layer would load or the folder holds no safetensors; else the first layer's error. The same
    checks as the loader (``moe_ref.checkpoint.loading.check_moe_layer``), so check and load agree."""
    from moe_ref.checkpoint.loading import check_moe_layer
    from moe_ref.checkpoint.quantized import checkpoint_quant_spec, routed_experts_quantized

    folder = Path(config_path)
    folder = folder if folder.is_dir() else folder.parent
    if not any(folder.glob("*.safetensors")):
        return []
    try:
        spec = checkpoint_quant_spec(folder)
        for layer in cfg.moe_layers:
            stored = spec is not None and routed_experts_quantized(folder, spec, cfg, layer)[0]
            found = check_moe_layer(folder, cfg, layer, quant=spec, experts=not stored)
            if found:
                return found
    except MoERefError as err:
        return [err]
    return []


def fp8_dispatch_note(cfg: MoEConfig) -> str:
    """What ``dispatch_fp8=True`` does at this shape, as the layer runs it: rows move as e4m3 with one fp32 scale
    per 128 columns, the last group covering what is left of Dx, so any width runs (as the layer and
    ``moe_ref.tools.dist_check --dispatch-fp8`` do); only the deep_gemm experts backend needs multiples of 128."""
    Dx, F = cfg.expert_hidden_size, cfg.intermediate_size
    line = (f"--dispatch-fp8 at Dx={Dx}: rows move as fp8 e4m3 with one fp32 scale per 128 columns "
            f"({-(-Dx // 128)} per row{f', the last over {Dx % 128} columns' if Dx % 128 else ''})")
    if Dx % 128 or F % 128:
        line += (f"; the deep_gemm experts backend needs Dx and F multiples of 128 (F={F}): use the triton or "
                 f"torch experts backend at this shape")
    return line


# --- explain ---------------------------------------------------------------------------------------------
def cmd_explain(args) -> int:
    if args.code is None or args.list:
        for code, entry in sorted(CATALOGUE.items()):
            print(f"{code}  {entry.title}")
        return 0
    try:
        text = explain(args.code)
    except KeyError as err:
        raise CommandLineError(f"moe-ref explain: {err.args[0]}; `moe-ref explain --list` lists them with their "
                               f"titles") from None
    print(text)
    return 0


# --- demo ------------------------------------------------------------------------------------------------
def cmd_demo(args) -> int:
    private = args.checkpoint is None
    step = _Steps("demo", 3 if private else 2)
    step("checking flags, checkpoint folder, device and memory")
    cap = resolve_cap(args.cap, default=DEMO_CAP)
    cfg = synthetic_config(args.preset, args.quant)  # the block dist_check writes (sizes rounded for --quant)
    require_nproc_divides_experts(args.nproc, cfg, args.preset)
    for problem in ParallelConfig(ep_size=args.nproc).problems(cfg):
        raise problem
    if not private:  # a folder holding a checkpoint is read as it is: it must be the one these flags run
        check_checkpoint_folder(args.checkpoint, cfg, args.preset, args.quant)
    require_devices(args.device, args.nproc)
    on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.device_count() >= args.nproc)
    device, dtype = ("cuda", "bf16") if on_gpu else ("cpu", "fp32")
    if not args.skip_memory_check and not on_gpu:
        check_demo_memory(cfg, args.nproc, cap, DTYPES[dtype])
    elif not args.skip_memory_check and (private or not os.path.isfile(os.path.join(args.checkpoint, "config.json"))):
        check_writer_memory(cfg)  # on GPUs each rank checks its own later (no CUDA context here)
    checkpoint = tempfile.mkdtemp(prefix="moe_ref_demo_") if private else writable_folder(args.checkpoint)
    try:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
                   "-m", "moe_ref.tools.dist_check", "--preset", args.preset, "--checkpoint", checkpoint,
                   "--tokens-per-rank", str(args.tokens_per_rank), "--cap", str(cap), "--overflow", "chunk",
                   "--runs", str(args.runs), "--device", device, "--dtype", dtype]
        command += ["--skip-memory-check"] * args.skip_memory_check + ["--debug"] * args.debug
        command += ["--quant", args.quant] if args.quant else []
        chunked = (f"{args.tokens_per_rank} tokens on rank 0 > cap {cap} -> chunk policy"
                   if args.tokens_per_rank > cap else f"{args.tokens_per_rank} tokens on rank 0 <= cap {cap}")
        quantized = (f", routed experts stored as {args.quant} and run as stored (F={cfg.intermediate_size}, "
                     f"Dx={cfg.expert_hidden_size})" if args.quant else "")
        print(f"demo: {args.preset} over {args.nproc} processes on {'GPU (NCCL)' if on_gpu else 'CPU (gloo)'}, "
              f"checkpoint {checkpoint}{' (private, removed at the end)' if private else ''}, {chunked}{quantized}")
        step(f"running {args.nproc} processes (torchrun); rank 0 reports its steps")
        print("$ " + " ".join(command), flush=True)
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        status = subprocess.call(command, env=env)
    finally:
        if private:
            step("removing the private checkpoint folder")
            shutil.rmtree(checkpoint, ignore_errors=True)
    if status != 0:
        print(f"moe-ref: demo failed: torchrun exited with status {status} (see the output above)", file=sys.stderr)
    return status


class _Steps:
    """Prints ``<name> [i/n] what`` on stderr as a long command moves on."""

    def __init__(self, name: str, total: int):
        self.name, self.total, self.done = name, total, 0

    def __call__(self, what: str) -> None:
        self.done += 1
        print(f"{self.name} [{self.done}/{self.total}] {what}", file=sys.stderr, flush=True)


# --- bench -----------------------------------------------------------------------------------------------
def cmd_bench(args) -> int:
    """``moe-ref bench`` (``moe_ref.conformance.bench``) after its memory estimate (ENV016)."""
    from moe_ref.conformance.bench import bench_cases, memory_bytes, run

    device, cases = bench_cases(args)
    if not args.skip_memory_check and not (device == "cpu" and cases[0].shape.cuda_only):  # else nothing is made
        need = max(memory_bytes(case, args.ranks) for case in cases)
        where = 0 if device == "cuda" else None
        require_memory(need * (args.ranks if where is None else 1), f"bench on {cases[0].id.rsplit('/', 1)[0]} at "
                       f"{args.ranks} rank(s)", "pass a smaller --shape (a tiny preset, or <preset>@ep<N> with a "
                       "larger N)", where)
    return run(args, device, cases)


# --- info ------------------------------------------------------------------------------------------------
def auto_backend_lines() -> list[str]:
    """What ``experts_backend="auto"`` runs on this machine's current GPU: the measured table of its GPU class (or why
    none applies) and the backends auto holds here (``moe_ref.experts.auto``)."""
    from moe_ref.experts.auto import auto_plan, format_regimes

    if not torch.cuda.is_available():
        return ["experts_backend='auto': no GPU: the torch loop (CPU)"]
    plan = auto_plan("cuda")
    here = f"experts_backend='auto' on {torch.cuda.get_device_name()} (GPU class {plan.gpu_class})"
    if plan.table is None:
        return [f"{here}: GPU class not in the table ({plan.table_path}): triton only"]
    header = plan.table.header
    lines = [f"{here}: table {plan.table_path}, measured {header['date']} on {header['gpu']} (torch "
             f"{header['torch']}, triton {header['triton']}, deep_gemm {header['deep_gemm']}) by "
             f"`{header['command']}`:"]
    lines += [f"  {line}" for line in format_regimes(plan.table)]
    held = "triton only" if plan.held == ("triton",) else ", ".join(plan.held)
    lines.append(f"  holds here: {held}" + "".join(f"; {name} not usable here: {why}"
                                                    for name, why in plan.unavailable.items()))
    return lines


def tile_table_lines() -> list[str]:
    """Where the grouped MLP kernel's tiles come from on this machine's current GPU: the recorded table of its GPU
    class (``moe_ref.kernels.experts.tile_table``), or the autotuner at each new token-count bucket."""
    from moe_ref.core import envs
    from moe_ref.kernels.experts import tile_table
    from moe_ref.kernels.runtime.gpu_class import gpu_class_of

    if not torch.cuda.is_available():
        return []
    gpu_class = gpu_class_of("cuda")
    recorded = tile_table.header_of(gpu_class)
    if envs.autotune():
        return ["grouped MLP tiles: MOE_REF_AUTOTUNE=1: autotuned at the first launch of each shape key"]
    if recorded is None:
        return [f"grouped MLP tiles: GPU class {gpu_class} has no recorded tile table, nor does its compute "
                f"capability ({tile_table.TABLE_PATH}): autotuned at the first launch of each token-count bucket "
                "(seconds each); record one with python scripts/tune_tiles.py --install"]
    source, header, count = recorded
    about = ", ".join(f"{field} {header[field]}" for field in ("date", "command", "torch", "triton") if field in header)
    if source != gpu_class:
        return [f"grouped MLP tiles: {count} recorded for {source}, taken by {gpu_class} (same compute capability; "
                f"none recorded for this class: python scripts/tune_tiles.py --install) ({about}); no autotune in a "
                "call"]
    return [f"grouped MLP tiles: {count} recorded for {gpu_class} ({about}); no autotune in a call"]


def cmd_info(args) -> int:
    import triton

    import moe_ref

    model_lines = []
    if args.config or args.preset:  # the model and --ep are checked before anything is printed
        cfg = _load_cfg(args)
        for problem in ParallelConfig(ep_size=args.ep).problems(cfg):
            raise problem
        model_lines = expert_memory_lines(cfg, args.ep, _quant_spec(args), "bf16")
        model_lines[0] = f"{cfg.name} at ep={args.ep}: {model_lines[0]}"
    print(f"moe_ref {moe_ref.__version__}, torch {torch.__version__}, triton {triton.__version__}, "
          f"python {sys.version.split()[0]}")
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        print(f"CUDA: {len(names)} device(s): {', '.join(names)}")
    else:
        print("CUDA: not available (CPU: experts backend 'torch', Triton kernels run only under TRITON_INTERPRET=1)")
    print(f"torch.nn.functional.grouped_mm: {'yes' if hasattr(torch.nn.functional, 'grouped_mm') else 'no'}")
    try:
        from moe_ref.experts.deep_gemm.probe import deep_gemm_status

        status = deep_gemm_status()
        print(f"deep_gemm: {'usable' if status.available else 'not usable'}"
              f"{f' (version {status.version})' if status.version else ''}: {status.reason}")
    except ImportError as err:
        print(f"deep_gemm: backend module not importable: {err}")
    print("\n".join(auto_backend_lines() + tile_table_lines()))
    print("transports: " + "; ".join(f"{name} ({row.summary})" for name, row in TRANSPORTS.items()))
    from moe_ref.kernels.runtime.native import native_status

    print(f"CPU EP data path: {native_status()}")
    from moe_ref.kernels.experts.grouped_mlp import tma_unavailable_reason

    reason = tma_unavailable_reason()
    print(f"grouped MLP tile loads: {'TMA descriptors' if reason is None else f'pointers ({reason})'}")
    a8_rows = envs.w4a8_rows_per_expert()
    print("4-bit experts (INT4, MXFP4): W4A16" + ("" if a8_rows is None else
          f"; W4A8 (fp8 rows and MMAs) from {a8_rows:g} routed rows per local expert (MOE_REF_W4A8_ROWS_PER_EXPERT)"))
    if model_lines:
        print("\n".join(model_lines))
    return 0


def build_parser() -> argparse.ArgumentParser:
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the traceback of moe_ref errors (or MOE_REF_DEBUG=1)")
    parser = CommandLineParser(prog="moe-ref", description="moe_ref: reference expert-parallel MoE layer",
                               parents=[debug])
    parser.set_defaults(debug=False)
    sub = parser.add_subparsers(dest="command", required=True)
    positive = int_at_least(1)

    p = sub.add_parser("plan", parents=[debug], help="print the per-rank symmetric buffer layout for a model and topology")
    _add_model_args(p)
    p.add_argument("--ep", type=positive, default=8, help="expert-parallel size")
    p.add_argument("--dp", type=positive, default=1, help="data-parallel size (does not change the per-rank cap)")
    p.add_argument("--attention-dp", action="store_true", help="attention data parallel")
    p.add_argument("--max-num-tokens", type=positive, default=None,
                   help="cap: rows one rank feeds per call (default: MOE_REF_NUM_MAX_TOKENS_PER_RANK, else 4096)")
    p.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    p.add_argument("--dispatch-fp8", action="store_true")
    p.add_argument("--alignment", type=positive, default=128)
    p.add_argument("--pool-format", choices=POOL_FORMATS, default="contiguous",
                   help="receive pool: contiguous (prefill) or masked (decode: M rows per local expert)")
    p.add_argument("--budget-gib", type=positive_float, default=None,
                   help="also print the largest cap within this budget")
    p.add_argument("--batch-invariant", action="store_true",
                   help="the batch-invariant layer's plan (its combine_slots region at ep >= 2: docs/batch_invariance.md)")
    _add_eplb_args(p)
    p.set_defaults(fn=cmd_plan)

    p = sub.add_parser("check", parents=[debug], help="validate a deployment; prints every problem at once")
    _add_model_args(p)
    p.add_argument("--tp", type=positive, default=1)
    p.add_argument("--ep", type=positive, default=1)
    p.add_argument("--dp", type=positive, default=1)
    p.add_argument("--dispatch-fp8", action="store_true")
    _add_eplb_args(p)
    p.set_defaults(fn=cmd_check)

    p = sub.add_parser("explain", parents=[debug], help="explain an error code (no code: list them)")
    p.add_argument("code", nargs="?")
    p.add_argument("--list", action="store_true")
    p.set_defaults(fn=cmd_explain)

    p = sub.add_parser("demo", parents=[debug], help="run the EP layer over several processes against the reference")
    p.add_argument("--nproc", type=positive, default=2)
    p.add_argument("--preset", default="tiny-kimi-k2", choices=PRESETS)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--tokens-per-rank", type=int_at_least(0), default=150)
    p.add_argument("--cap", type=positive, default=None,
                   help=f"rows one rank feeds per call (default: MOE_REF_NUM_MAX_TOKENS_PER_RANK, else {DEMO_CAP})")
    p.add_argument("--runs", type=positive, default=5, help="timed forward calls after the checked one")
    p.add_argument("--checkpoint", default=None,
                   help="checkpoint folder, written if it holds no config.json; one that holds a checkpoint is "
                        "run as it is, and must hold --preset's model in --quant's format (LOAD016/LOAD017 "
                        "otherwise); default: a private temporary folder, removed at the end")
    p.add_argument("--quant", default=None, choices=tuple(f.value for f in QuantFormat),
                   help="write the checkpoint's routed experts in this published format (sizes rounded up to it) and "
                        "load them as stored; the reference uses the dequantized weights")
    p.add_argument("--skip-memory-check", action="store_true", help="run even when the memory estimate does not fit")
    p.set_defaults(fn=cmd_demo)

    from moe_ref.conformance.bench import __doc__ as bench_doc, add_arguments as add_bench_arguments

    p = sub.add_parser("bench", parents=[debug], help="time every implementation that runs here (moe_ref's backends, "
                       "the peers' kernels) on one model shape, each after the conformance checks passed",
                       description=bench_doc.split("\n\n")[0])
    add_bench_arguments(p, count=positive)
    p.add_argument("--skip-memory-check", action="store_true", help="run even when the memory estimate does not fit")
    p.set_defaults(fn=cmd_bench)

    p = sub.add_parser("info", parents=[debug], help="versions, devices and which backends load (and why not); "
                                                     "with a model: its routed experts' bytes per rank")
    _add_model_args(p, default=None)
    p.add_argument("--ep", type=positive, default=8, help="expert-parallel size of the per-rank expert bytes")
    p.set_defaults(fn=cmd_info)

    p = sub.add_parser("conform", parents=[debug], help="check a dispatch/combine or fused-MoE implementation against "
                                                        "the oracle over the scenario matrix (docs/conform.md)")
    from moe_ref.conformance.cli import add_arguments as add_conform_arguments, run as run_conform

    add_conform_arguments(p)
    p.set_defaults(fn=run_conform)

    p = sub.add_parser("eplb", parents=[debug], help="expert-parallel load balancing on CPU: placement planner, "
                                                     "simulator")
    eplb = p.add_subparsers(dest="eplb_command", required=True)
    p = eplb.add_parser("simulate", parents=[debug], help="plan a placement for a load trace; balance before/after")
    add_simulate_arguments(p)
    p.set_defaults(fn=run_simulate)
    return parser


def debug_requested(argv: list[str], prog: str) -> bool | None:
    """``--debug`` in ``argv`` (known before parsing, so flag errors obey it too) or ``MOE_REF_DEBUG``; None after
    printing a bad ``MOE_REF_DEBUG`` as one coded line (the caller exits with status 2)."""
    try:
        return "--debug" in argv or envs.debug()
    except MoERefError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return None


def main(argv=None) -> int:
    """Run one ``moe-ref`` command; returns the exit status (moe_ref errors: one line on stderr, status 2)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = debug_requested(argv, "moe-ref")
    if debug is None:
        return 2
    try:
        args = build_parser().parse_args(argv)
        return args.fn(args)
    except MoERefError as err:
        if debug:
            traceback.print_exc(file=sys.stderr)
        print(f"moe-ref: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("moe-ref: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
