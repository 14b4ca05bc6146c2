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
    if code in CATALOGUE:  # two errors may not share a code (a merge once gave two classes CFG016)
        raise RuntimeError(f"error code {code} is defined twice")
    CATALOGUE[code] = Explanation(code, title, cause, trigger, tuple(solutions), example)
    return code


class MoERefError(Exception):
    """Base of every coded moe_ref error. ``str(err)`` = ``[CODE] message (see: moe-ref explain CODE)``."""

    code: str = "MOE000"

    def __init__(self, message: str, **details):
        self.message = message
        self.details = details
        super().__init__(f"[{self.code}] {message} (see: moe-ref explain {self.code})")

    # the message as given, also where a second builtin base formats its own (KeyError repr()s, OSError adds errno)
    __str__ = Exception.__str__

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



class GroupDisagreementError(ConfigError):
    code = _entry(
        "CFG008", "the ranks of the EP group were built or called with different options",
        "Every rank of an EP group must build MegaMoE with the same config, cap, overflow policy, transport, dtype, "
        "FP8 setting, experts backend, alignment and mega choice, and pass max_num_tokens alike on every call; "
        "construction compares them all in one collective and every rank raises this naming each rank's value.",
        "overflow='chunk' on rank 0 and 'error' on rank 1; MOE_REF_TRANSPORT set in one rank's environment only; "
        "max_num_tokens=... passed on one rank only.",
        ["Build the layer from the same arguments and environment on every rank (launch every rank from one "
         "command line).", "Pass max_num_tokens on every rank or on none."],
        "MegaMoE(cfg, group, num_max_tokens_per_rank=256, overflow='chunk')  # identical on every rank")


class ConfigFileError(InvalidConfigError):
    code = _entry(
        "CFG010", "a model config file cannot be read as a JSON object",
        "MoEConfig.from_hf_config (and MegaMoE(cfg)) read an HF config.json: a file or folder path, or a dict. "
        "The file is missing, is not JSON, holds something other than a JSON object (a list, a number), or the "
        "argument is None.",
        "A truncated config.json, a tokenizer file passed by mistake, config.json holding '[...]', MegaMoE(None).",
        ["Pass the config.json that came with the checkpoint (or its folder).",
         "Check the file with: python -m json.tool config.json"],
        "cfg = MoEConfig.from_hf_config('/models/kimi-k2/config.json')")


class ConfigFieldError(InvalidConfigError):
    code = _entry(
        "CFG011", "a config.json field is missing, null or of the wrong type",
        "Each family's config.json names its sizes with fixed keys (hidden_size, moe_intermediate_size, expert "
        "count, top-k, ...); a required key is absent or null, or a value has the wrong JSON type (a string or a "
        "float where an integer count belongs, a bool given as a string).",
        "\"hidden_size\": null, \"hidden_size\": \"7168\", a config without moe_intermediate_size.",
        ["Restore the field named in the message from the model's published config.json.",
         "Write numbers as JSON numbers (7168, not \"7168\") and booleans as true/false."],
        "{\"hidden_size\": 7168, \"moe_intermediate_size\": 2048, \"n_routed_experts\": 384, ...}")



class UnknownFamilyError(InvalidConfigError):
    code = _entry(
        "CFG018", "the config.json's model_type names a model family moe_ref does not know",
        "MoEConfig.from_hf_config reads the families registered in moe_ref.core.families (DeepSeek-V2/V3, "
        "Kimi-K2/K3, GLM-4.5, Step3, Qwen2/Qwen3-MoE, Mixtral, gpt-oss, OLMoE, Ernie-4.5, HunYuan), each by its own "
        "field names, routing rule and tensor names. Another family shares some field names but not its router, "
        "its shared experts or its tensor names; reading it as one of these would run a different model silently, "
        "so its model_type is refused.",
        "A config.json of a family not registered (model_type dbrx, jamba, ...), a dense model's config.json, or "
        "a config.json without model_type.",
        ["Use the config.json that came with the checkpoint (the message lists the model_types read).",
         "Add the family: one module moe_ref/core/families/<family>.py holding a Family record (its config keys "
         "and defaults, router rule, experts, shared experts and tensor names, read from its modeling code), listed "
         "in moe_ref.core.families.FAMILIES, with its case in tests/unit/test_families.py.",
         "For a block of your own, build MoEConfig(...) in code (family 'custom') with the router rule you mean."],
        "cfg = MoEConfig(num_experts=128, num_topk=8, hidden_size=2048, intermediate_size=768, scoring='softmax',\n"
        "                renormalize=True, use_selection_bias=False)  # family 'custom', named on purpose")


class UnsupportedFamilyFeatureError(InvalidConfigError):
    code = _entry(
        "CFG025", "a config.json turns on a feature of its model family that moe_ref does not compute",
        "A registered family (moe_ref.core.families) is read with the math its published models use; some config "
        "values switch on more (biases on every MLP, an unknown topk_method). Dropping them would compute another "
        "model silently, so the config is refused, naming the field, its value and the feature.",
        "A DeepSeek-V2 config.json with \"mlp_bias\": true, an Ernie-4.5 one with \"use_bias\": true, "
        "\"topk_method\": \"sinkhorn\".",
        ["Use the config.json that came with the checkpoint (its published values).",
         "If the model really uses the feature, add it to the family's module in moe_ref/core/families/ and to the "
         "math (moe_ref.core.router / moe_ref.core.activations), with a test against the family's transformers "
         "module."],
        "\"mlp_bias\": false")


class BatchInvariantUnsupportedError(InvalidConfigError):
    code = _entry(
        "CFG026", "batch_invariant=True with an option that cannot hold the batch-invariance contract",
        "A batch-invariant layer promises that a token's output bits do not depend on its batch, its row order in an "
        "expert segment, the chunk count or the EP size (docs/batch_invariance.md). Only paths whose every GEMM runs "
        "one fixed order per row hold that: the torch experts loop on the CPU (fixed 16-row blocks), the Triton "
        "grouped MLP on CUDA (tiles of one bits class, or one tile per precision where no class was probed), auto on "
        "CUDA (in the mode it runs Triton, and DeepGEMM where it was probed to give Triton's bits: DeepGEMM 0.1.4, "
        "bf16 and FP8, on sm_90 with Triton 3.6), moe_ref's own routed step (mega='off'). cuBLAS and CUTLASS pick "
        "kernels by the row count, so grouped_mm is refused; deep_gemm on its own and DeepGEMM's fused mega-MoE are "
        "refused too (the mode's tests cover DeepGEMM only as auto's prefill backend beside Triton).",
        "MegaMoE(cfg, batch_invariant=True, experts_backend='deep_gemm'), MOE_REF_BATCH_INVARIANT=1 with "
        "mega='auto', experts_backend='torch' on CUDA.",
        ["Use experts_backend='auto' (the torch loop on the CPU; on CUDA Triton, with DeepGEMM where it gives "
         "Triton's bits), and mega='off'.", "Or turn the mode off (batch_invariant=False, "
         "MOE_REF_BATCH_INVARIANT=0) for the fastest kernels."],
        "MegaMoE(cfg, group, batch_invariant=True, experts_backend='auto', mega='off')")


class BatchInvariantExpertsError(InvalidConfigError):
    code = _entry(
        "CFG027", "quantized checkpoint experts whose kernel does not hold the batch-invariance contract",
        "A batch-invariant layer runs quantized checkpoint experts only on a kernel that gives a row the same bits in "
        "every batch: the layer checks the experts class (Experts.honours_batch_invariant) when it first builds the "
        "experts (the first call), on every rank alike (every rank loads the same checkpoint). Every class the layer "
        "builds today holds it: FP8 blocks on the Triton grouped MLP (tiles of one bits class), INT4 and MXFP4 on "
        "the W4A16 kernel (one tile pair at every row count, since 2026-12-07; before, they were refused here), every "
        "format on the torch loop (CPU). The check guards an experts class added later.",
        "MegaMoE(cfg, batch_invariant=True).load_hf_weights(path, 5) with experts whose class sets "
        "honours_batch_invariant = False, then a call.",
        ["Load the checkpoint into a layer whose experts backend holds the mode (experts_backend='auto').",
         "Or build the layer with batch_invariant=False to run the experts as stored."],
        "MegaMoE(cfg, batch_invariant=True, device='cuda').load_hf_weights('/models/kimi-k2-thinking', 5)  # INT4")


class AutoTableError(InvalidConfigError):
    code = _entry(
        "CFG019", "the experts backend table of experts_backend='auto' is malformed",
        "experts_backend='auto' picks a backend per call regime (dtype, pool format, rows per expert) from a JSON "
        "table measured per GPU class (moe_ref/experts/auto_table.json, written by `moe-ref bench --auto-table`). "
        "The file is not JSON, or a field is missing or has the wrong type or value (the message names the file "
        "and the field): a hand edit or a partial copy, since the command checks the table before writing it.",
        "A regime whose 'order' is empty, a 'max_rows_per_expert' of 0, two regimes of one dtype and pool format "
        "whose bounds do not increase, a truncated file.",
        ["Restore the file from the package (git checkout moe_ref/experts/auto_table.json) or regenerate it on the "
         "GPU: moe-ref bench --auto-table --install",
         "Or run with an explicit experts_backend ('triton', 'deep_gemm') until the table is fixed."],
        "moe-ref bench --auto-table --install")


class TileTableError(InvalidConfigError):
    code = _entry(
        "CFG036", "the grouped MLP kernel's tile table is malformed",
        "On a GPU class the table holds (moe_ref/kernels/experts/tile_table.json, recorded by scripts/tune_tiles.py), "
        "the grouped MLP kernel launches the tile recorded for its shape instead of autotuning at the first call of "
        "each token-count bucket. The file is not JSON, or a field is missing or has the wrong type (the message "
        "names the file and the field): a hand edit or a partial copy.",
        "A truncated file, an entry without 'tile', a tile of four numbers, a 'format' other than 1.",
        ["Restore the file from the package (git checkout moe_ref/kernels/experts/tile_table.json) or record it "
         "again on the GPU: python scripts/tune_tiles.py --install",
         "Or autotune at the first call of each bucket instead (MOE_REF_AUTOTUNE=1) until the table is fixed."],
        "python scripts/tune_tiles.py --install")


class ConfigNotExpressibleError(InvalidConfigError):
    code = _entry(
        "CFG022", "a synthetic checkpoint's config cannot be written as the family's config.json",
        "write_synthetic_checkpoint writes config.json beside the weights, and every loader reads the sizes back "
        "from it. Some MoEConfig values have no field of their own in the family's config.json (DeepSeek-V3 and "
        "Kimi derive the shared experts' width S as n_shared_experts x moe_intermediate_size), so a config whose "
        "value differs would give a checkpoint that does not load back (LOAD002/LOAD006); the writer refuses "
        "before writing anything.",
        "dataclasses.replace(preset('tiny-kimi-k2'), intermediate_size=64) (S stays 40, config.json says 64), or "
        "rounding F for a quantized format without rounding S.",
        ["Set the fields the message names to what the config.json holds (it gives the value).",
         "For a quantized checkpoint of a preset, use quantizable_config(cfg, quant), which keeps S = "
         "n_shared_experts x F."],
        "cfg = quantizable_config(preset('tiny-kimi-k2'), 'int4_group')\n"
        "write_synthetic_checkpoint('ckpt/', cfg, quant='int4_group')")


class CommandLineError(ConfigError):
    code = _entry(
        "CFG015", "a command-line flag is missing, unknown or out of range",
        "moe-ref and moe_ref.tools.dist_check check every flag before doing any work: counts and sizes must be "
        "positive integers (token counts may be 0), and flags that depend on each other must agree.",
        "moe-ref bench --tokens 0, moe-ref demo --runs 0, moe-ref demo --cap -5, or a misspelled flag.",
        ["Use a value in the range the message gives.", "Run `moe-ref <command> --help` to list the flags."],
        "moe-ref bench --tokens 16,128\nmoe-ref demo --cap 64 --runs 5")


class LayerConversionError(ConfigError, TypeError):
    code = _entry(
        "CFG016", "a MegaMoE layer's dtype or device cannot be changed after construction",
        "MegaMoE builds its capacity plan, symmetric buffers, experts backend and input checks for the dtype and "
        "device it was constructed with; nn.Module's .to(dtype)/.half()/.float()/.bfloat16()/.cuda() would cast "
        "the parameters only and leave everything else on the old dtype or device.",
        "model.to(torch.bfloat16) or model.half() on a model holding a float32 MegaMoE; layer.cuda() on a CPU layer.",
        ["Build the layer with the dtype and device you want, then copy the weights into it with "
         "load_state_dict (the values are cast).", "Or build the model in the target dtype from the start."],
        "new = MegaMoE(cfg, group, dtype=torch.bfloat16, device='cuda', num_max_tokens_per_rank=256)\n"
        "new.load_state_dict(old.state_dict())")


class LayerNotPicklableError(ConfigError, TypeError):
    code = _entry(
        "CFG020", "a MegaMoE over a process group cannot be pickled",
        "Pickling a layer (pickle, torch.save(layer), copy.deepcopy) keeps its config, options and weights and leaves "
        "out what it builds at run time (routed step, buffers, CUDA graphs), which the copy builds again on its first "
        "call. A layer over a torch.distributed process group cannot be copied so: the group belongs to this process "
        "and its peers, and a copy would call collectives the peers never join.",
        "torch.save(model) or copy.deepcopy(model) of a model whose MegaMoE was built with group=dist.group.WORLD.",
        ["Save the weights instead: torch.save(model.state_dict(), path) on every rank, and load_state_dict them "
         "into layers built with MegaMoE(cfg, group, ...).", "Pickle a one-process layer (group=None)."],
        "torch.save(moe.state_dict(), f'moe_rank{rank}.pt')\n"
        "fresh = MegaMoE(cfg, group); fresh.load_state_dict(torch.load(f'moe_rank{rank}.pt'))")


class EnvVarError(InvalidConfigError):
    code = _entry(
        "CFG017", "a MOE_REF_* environment variable has a value moe_ref does not accept",
        "moe_ref reads its switches strictly (moe_ref.core.envs): MOE_REF_DEBUG, MOE_REF_DEBUG_CHECKS, "
        "MOE_REF_NATIVE, MOE_REF_TMA, MOE_REF_BOUND_LAUNCH and MOE_REF_PROGRESS take 1/true/yes/on or "
        "0/false/no/off (any case, surrounding spaces ignored); anything else would silently pick a side, so it is "
        "refused, naming the variable and its value. Every switch is checked whenever moe_ref reads its options "
        "(each layer construction), on any device, also a switch that device's path never reads.",
        "MOE_REF_DEBUG_CHECKS=maybe, MOE_REF_NATIVE=disable, MOE_REF_TMA=2.",
        ["Set the variable to one of the values the message lists, or unset it for the default."],
        "export MOE_REF_DEBUG_CHECKS=1   # or 0, or unset")


class UnsupportedModelError(ConfigError):
    code = _entry(
        "CFG030", "moe_ref cannot take over this transformers model's MoE blocks",
        "patch_model replaces the sparse MoE blocks of a loaded transformers model, and experts_implementation="
        "'moe_ref' runs a model's experts modules, only where moe_ref computes the family's block exactly (its "
        "router rule, expert activation, biases and shared experts): the model has no such block, its model_type "
        "is not a family moe_ref knows, or its experts module stores a layout moe_ref's kernels do not run "
        "(biases, interleaved gate/up, transposed weights, no gate).",
        "patch_model(a dense Llama model), patch_model(a model_type moe_ref does not list), or "
        "experts_implementation='moe_ref' for a family whose experts have biases.",
        ["Use a model of a family the message lists.",
         "Keep transformers' own experts implementation for this model (experts_implementation='grouped_mm')."],
        "model = AutoModelForCausalLM.from_pretrained('Qwen/Qwen3-30B-A3B')\npatch_model(model)")


class ExpertsInterfaceParallelError(ConfigError):
    code = _entry(
        "CFG031", "experts_implementation='moe_ref' under transformers' own expert parallelism",
        "With DistributedConfig(ep_size > 1) transformers shards each experts module itself and hands it routing "
        "with ids of other ranks' experts as sentinels; moe_ref's experts implementation runs one process's "
        "experts and does not take part in that exchange. moe_ref's expert parallelism is its own layer: "
        "patch_model(model, group=...) replaces each MoE block with a MegaMoE that dispatches over the group.",
        "AutoModelForCausalLM.from_pretrained(name, distributed_config=DistributedConfig(ep_size=2), "
        "experts_implementation='moe_ref') under torchrun.",
        ["Load the model without distributed_config and call moe_ref.integrations.transformers.patch_model(model, "
         "group=dist.group.WORLD).",
         "Or keep transformers' expert parallelism with its own experts implementation (grouped_mm)."],
        "model = AutoModelForCausalLM.from_pretrained(name)\npatch_model(model, group=dist.group.WORLD)")


class PlacementError(ConfigError):
    code = _entry(
        "CFG033", "an expert placement (EPLB physical-to-logical map) is invalid",
        "A placement maps each of P physical expert slots to a logical expert, per layer; rank r owns slots "
        "[r * P / R, (r + 1) * P / R). Every logical expert needs at least one replica, every slot must name an "
        "expert in [0, E), and P must split evenly over the R ranks.",
        "A hand-edited placement JSON that drops an expert, a slot id of 256 with 256 experts, 290 slots on 8 "
        "ranks, or a file that is not a moe_ref placement.",
        ["Rebuild the placement with moe_ref.eplb.planner.plan_global / plan_hierarchical.",
         "Make P a multiple of the ranks (E + redundant slots, redundant chosen so) and give every expert a slot."],
        "placement = plan_global(load_LE, num_physical=288, num_ranks=8); placement.save('placement.json')")


class PlacementTopologyError(ConfigError):
    code = _entry(
        "CFG034", "EPLB planner settings that cannot be placed",
        "The planner packs E experts in G groups onto N nodes of R ranks with P physical slots: groups must split "
        "the experts (E % G == 0) and the nodes (G % N == 0), ranks must split over nodes (R % N == 0), slots over "
        "ranks (P % R == 0), and there must be a slot per expert (P >= E); the before-placement puts E / R experts "
        "on each rank (E % R == 0).",
        "moe-ref eplb simulate --experts 256 --ep 8 --redundant 30 (P = 286 is not a multiple of 8), or "
        "--groups 6 with 256 experts.",
        ["Pick --redundant so that experts + redundant is a multiple of --ep.",
         "Pick --groups dividing the experts and divisible by --nodes; --nodes dividing --ep."],
        "moe-ref eplb simulate --zipf 1.0 --experts 256 --ep 8 --redundant 32 --nodes 2 --groups 8")


class LoadTraceError(ConfigError):
    code = _entry(
        "CFG035", "an expert-load trace is not a [windows, layers, experts] table of non-negative counts",
        "The EPLB planner and simulator read per-expert load: routed rows per (layer, expert), one [L, E] table per "
        "window, stored as JSON ({'format': 'moe_ref.eplb.loads', 'loads': [[[...]]]}) or a torch .pt tensor "
        "[W, L, E] or [L, E]. Counts must be finite and >= 0, and every window must have the same shape.",
        "A .pt file holding a dict, a 1-D tensor, negative counts, windows of different layer counts, or a JSON "
        "without 'loads'.",
        ["Write the trace with moe_ref.eplb.trace.save_loads(path, loads).",
         "Check that the table's last dim is the number of experts the simulation is asked for."],
        "save_loads('loads.json', torch.tensor(counts).reshape(1, 61, 256))")


class ExpertSlotsError(ConfigError):
    code = _entry(
        "CFG021", "num_redundant_experts does not give every rank the same number of expert slots",
        "With EPLB a layer holds Ph = E + num_redundant_experts physical expert slots, Ph / R on each of the R EP "
        "ranks; each slot holds one logical expert (a replica), and the capacity plan, the shared buffer and "
        "moe-ref plan count slots. num_redundant_experts must be an int >= 0 with (E + redundant) % R == 0.",
        "MegaMoE('tiny-kimi-k2', group, num_redundant_experts=3) at EP 4 (64 + 3 = 67 slots over 4 ranks), or a "
        "negative count.",
        ["Pick num_redundant_experts so that E + redundant is a multiple of the EP size (the message names the "
         "nearest ones).",
         "Leave it at 0 (and placement None) to run without EPLB."],
        "MegaMoE(cfg, group, num_redundant_experts=4)  # E = 64, EP 4: 68 slots, 17 per rank")


class PlacementMismatchError(ConfigError):
    code = _entry(
        "CFG023", "an expert placement does not fit the layer it is given to",
        "A layer's placement (constructor argument placement=, or rebalance(new_placement)) maps the layer's Ph "
        "physical slots to its E logical experts over its R EP ranks, for one MoE layer. A placement made for "
        "another expert count, slot count or EP size, or one holding several layers, cannot say which expert each "
        "of this layer's slots holds.",
        "MegaMoE(cfg, group, placement=plan_global(load, 72, 8)) at EP 4, a placement file of 61 layers given "
        "as is, or num_redundant_experts=8 with a placement of 4 redundant slots.",
        ["Plan for the layer's sizes: plan_global(load_LyE, num_physical=E + redundant, num_ranks=ep_size).",
         "Give one layer of a multi-layer placement: placement.layer(i) (or Placement.load(path).layer(i))."],
        "MegaMoE(cfg, group, num_redundant_experts=8, placement=Placement.load('placement.json').layer(3))")


class PlacementDisagreementError(ConfigError):
    code = _entry(
        "CFG024", "the ranks of the EP group were given different placements to move to",
        "rebalance(new_placement) is collective: every rank moves its slots' weights to where the placement puts "
        "them, so every rank must be given the same placement. The ranks first exchange a digest of theirs; on a "
        "difference every rank raises this before any weight moves, and the layer keeps its old placement.",
        "Each rank planning from its own local telemetry instead of the gathered expert_load(), or a placement "
        "file read from a node-local path that differs between nodes.",
        ["Plan once from the gathered load (layer.expert_load() is the same on every rank) or on rank 0 and "
         "broadcast it (dist.broadcast_object_list).",
         "Read the placement from a path every rank sees alike."],
        "load = layer.expert_load()  # collective, the same on every rank\n"
        "layer.rebalance(plan_global(load.logical_rows_E[None], layer.num_physical_experts, layer.world_size))")


class ConformanceImplError(ConfigError):
    code = _entry(
        "CFG028", "a conformance implementation cannot be loaded, declares impossible capabilities, or none runs "
        "the benched case",
        "moe-ref conform loads the implementation under test from --impl (module:attribute, or a registered name) "
        "and checks what it declares (moe_ref.conformance.Capabilities: dtypes, quant recipes, overflow behaviour "
        "and its cap, the kind) before any case runs.",
        "--impl pkg.mod:factory where the module does not import, the attribute is a plain function not wrapped by "
        "@implementation, overflow='error' without max_tokens_per_rank, kind 'experts' with ep_sizes (2,), or "
        "moe-ref bench --shape kimi-k2 on a CPU (a real model's shape runs on CUDA only).",
        ["Decorate the factory with moe_ref.conformance.implementation(name, kind=..., caps=Capabilities(...)).",
         "Declare the cap (max_tokens_per_rank) whenever overflow is 'error' or 'chunk'.",
         "`moe-ref conform --list` names the registered implementations.",
         "moe-ref bench: pick a shape, dtype, quant and rank count an implementation here declares (the message "
         "says why each one skips)."],
        "@implementation('mine', kind='experts', caps=Capabilities(dtypes=('bf16',)))\ndef mine(problem): ...")


class ConformanceLedgerError(ConfigError):
    code = _entry(
        "CFG029", "the conformance ledger of known failures, the case filter or a speed case is malformed",
        "moe-ref conform reads a JSON ledger {\"impl/case\": \"why it fails\"} of known failures (an entry that "
        "passes fails the run: the ledger must be kept current) and a --cases filter (fnmatch patterns); an entry "
        "must be an object of strings, a filter must match at least one case. moe-ref bench (and conform) also "
        "take speed cases <shape>/<dtype>[-<quant>]/T<n>, whose shape is a named one or <preset>@ep<N> with N "
        "dividing the preset's experts.",
        "--ledger known.json holding a list, --cases 'tiny/nope*' matching nothing, moe-ref bench --shape "
        "kimi-k2@ep7 (384 experts are not split over 7 ranks).",
        ["Write the ledger as {\"moe_ref/torch@1/tiny/bf16/base\": \"reason\"}; moe-ref conform --list names "
         "the implementations and cases.",
         "Remove entries that now pass.",
         "Give a shape moe-ref conform --list names, or a preset with an EP size that divides its experts."],
        "moe-ref conform --impl moe_ref/torch --ledger known.json --cases 'tiny/*'\n"
        "moe-ref bench --shape deepseek-v3@ep16 --tokens 128")


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


class ShmDirectoryError(MemoryBudgetError):
    code = _entry(
        "CAP005", "the shared-memory folder cannot hold the symmetric buffer",
        "On the CPU, the symm transport keeps each rank's buffer in a file of MOE_REF_SHM_DIR (default /dev/shm, "
        "a tmpfs: memory, not disk) that every rank of the host maps. The folder does not exist, is not a "
        "directory, no file can be created in it (read-only, no permission, or a filesystem such as /proc that "
        "holds no files), or it has no free space; the cap is not the problem.",
        "MOE_REF_SHM_DIR=/proc, a typo in MOE_REF_SHM_DIR, a container whose /dev/shm is full.",
        ["Point MOE_REF_SHM_DIR at a writable tmpfs folder with room for the buffer (the message gives its bytes), "
         "or unset it for /dev/shm.",
         "In a container, give /dev/shm more room (docker run --shm-size=...).",
         "Or use transport='a2a' (MOE_REF_TRANSPORT=a2a), which needs no shared files."],
        "unset MOE_REF_SHM_DIR   # /dev/shm\nexport MOE_REF_SHM_DIR=/dev/shm/moe_ref && mkdir -p $MOE_REF_SHM_DIR")


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



class WeightsNotLoadedError(InputError):
    code = _entry(
        "INP006", "the layer's weights were never loaded",
        "MegaMoE(seed=None) allocates its parameters uninitialised; running it before load_hf_weights/load_weights "
        "would return garbage (NaN), so every rank refuses.",
        "MegaMoE(cfg, group) followed by moe(x) with no load call.",
        ["Call moe.load_hf_weights(path, layer_idx) or moe.load_weights(weights) on every rank first.",
         "Pass seed=N for random test weights."],
        "moe = MegaMoE(cfg, group); moe.load_hf_weights('/models/kimi-k2', layer_idx=5); y = moe(x)")


class GradientNotSupportedError(InputError):
    code = _entry(
        "INP007", "a gradient through the EP layer was requested, but it has no backward",
        "The routed step moves rows between ranks through buffers that autograd cannot follow, so a backward "
        "would return wrong gradients; every rank refuses while grad mode is on and the input or a parameter "
        "requires grad.",
        "Calling moe(x) in training mode with x.requires_grad=True, or after setting a parameter's requires_grad.",
        ["Run the layer under torch.no_grad() or torch.inference_mode() (inference).",
         "Detach the input: moe(x.detach()).", "Train with a single-process reference MoE instead."],
        "with torch.inference_mode():\n    y = moe(x)")

class ArgumentTypeError(InputError, TypeError):
    code = _entry(
        "INP008", "a call argument of the wrong type",
        "A keyword argument of MegaMoE's forward has the wrong Python type or sign (max_num_tokens must be an int "
        ">= 0 or None; a bool or a string is not a count, and no rank has a negative number of rows).",
        "moe(x, max_num_tokens='4'), moe(x, max_num_tokens=4.0), moe(x, max_num_tokens=True), "
        "moe(x, max_num_tokens=-1).",
        ["Pass the argument as the message says (an int >= 0, or None), on every rank alike."],
        "moe(x, max_num_tokens=4)")


class ConstructorArgumentTypeError(ArgumentTypeError):
    code = _entry(
        "INP009", "a MegaMoE constructor argument of the wrong type",
        "MegaMoE(cfg, group, ...) checks the types its arguments must have before using them: group is None or a "
        "torch.distributed ProcessGroup, seed an int or None, device something torch.device accepts. A wrong seed is "
        "agreed in the construction's collective (every rank raises); a wrong group cannot be (there is no group to "
        "agree over), so only the ranks that passed it raise.",
        "MegaMoE(cfg, group='WORLD'), MegaMoE(cfg, group=0), MegaMoE(cfg, seed='a'), MegaMoE(cfg, device=None).",
        ["Pass dist.group.WORLD (after dist.init_process_group) or dist.new_group(ranks) as group, or None for one "
         "process.", "Pass an int seed (the same on every rank), or None and load the weights."],
        "MegaMoE(cfg, dist.group.WORLD, seed=0, device='cuda')")


# --- environment -----------------------------------------------------------------------------------------

class EnvironmentError_(MoERefError, RuntimeError):
    """Base of environment errors (``ENV*``); the trailing underscore avoids the builtin's name."""


class BackendUnavailableError(EnvironmentError_):
    code = _entry(
        "ENV001", "the requested backend is not usable here",
        "The backend's package is missing, fails to load, or needs hardware this machine lacks "
        "(Triton and DeepGEMM need a CUDA GPU for real runs; DeepGEMM's mega-MoE needs SM90 and symmetric "
        "memory), or it cannot run the experts as a quantized checkpoint stores them (FP8 blocks, INT4, MXFP4 "
        "run on 'triton' or 'torch'; 'grouped_mm', 'deep_gemm' and mega='deep_gemm' take plain weights).",
        "backend='deep_gemm' on a CPU machine, a deep_gemm wheel built for another torch, or load_hf_weights of "
        "an MXFP4 checkpoint with experts_backend='grouped_mm'.",
        ["Use backend='auto' to pick the best available one.", "Run `moe-ref info` to see what loads and why not.",
         "For a quantized checkpoint use experts_backend='auto' (moe_ref's kernels on CUDA, torch on CPU) and "
         "mega='auto'."],
        "MegaMoE(cfg, experts_backend='auto')")


class ShapeUnsupportedError(EnvironmentError_):
    code = _entry(
        "ENV002", "the backend refuses this shape",
        "A kernel has a hard limit (e.g. DeepGEMM's SM90 mega-MoE needs intermediate_size <= 4096).",
        "Step3 (intermediate 5120) with the deep_gemm mega path.",
        ["Use backend='auto' to fall back to moe_ref's own path for this shape.", "Use another backend."],
        "MegaMoE(step3_cfg, experts_backend='auto')")


class ExpertsFeatureError(BackendUnavailableError):
    code = _entry(
        "ENV020", "the experts backend does not compute this model family's expert math",
        "Families differ in their experts (moe_ref.core.families): gpt-oss's clamped SwiGLU (swigluoai, alpha and "
        "limit) and expert biases are computed by the torch and grouped_mm backends; the Triton grouped MLP and "
        "DeepGEMM fuse SwiGLU and SiTU without biases. Running the experts on a backend without the family's math "
        "would compute another model, so the backend is refused when it is built, naming the family, the feature "
        "and the backends that run it.",
        "MegaMoE(gpt_oss_config, experts_backend='triton') on a GPU, or experts_backend='auto' where it picks Triton.",
        ["Pass one of the backends the message names (experts_backend='grouped_mm' on a GPU, 'torch' anywhere).",
         "Or add the feature to the backend's kernel and its capability attributes (Experts.activations, "
         "Experts.supports_expert_bias)."],
        "MegaMoE('/models/gpt-oss-20b-bf16', experts_backend='grouped_mm', dtype=torch.bfloat16, device='cuda')")


class DistributedError(EnvironmentError_):
    code = _entry(
        "ENV003", "torch.distributed is not set up as the layer needs",
        "An EP layer needs an initialised process group; the symm transport needs all ranks on one host.",
        "Passing a group before dist.init_process_group, or transport='symm' across hosts.",
        ["Call torch.distributed.init_process_group first (torchrun sets the env).",
         "Use transport='a2a' across hosts (the default picks it)."],
        "torchrun --nproc-per-node 2 -m moe_ref.tools.dist_check")



class StepOutOfSyncError(EnvironmentError_):
    code = _entry(
        "ENV004", "the ranks of the EP group are at different calls of the EP layers",
        "Each call of an EP layer is collective, and its first collective (the per-call agreement; a layer's first "
        "call builds its routed step, which announces itself the same way) carries the layer's index (MoE layers "
        "are numbered in the order they were built on the EP group) and this rank's count of calls of that layer. "
        "The ranks that met in one agreement are not at the same call of the same layer. No row has moved, and "
        "the call is counted on no rank.",
        "Ranks that call the EP layers in different orders or sets: a layer skipped on some ranks (a branch on "
        "local data, an MTP layer run on some ranks only), layers run out of order, or a rank calling a layer "
        "once more than its peers (its call timed out on the others, ENV018, and it came late).",
        ["Make every rank call the same layers in the same order, each the same number of times (T = 0 on a rank "
         "without tokens); errors the layer raises are raised on every rank alike, so catch them on every rank "
         "or on none.",
         "The message names each rank's layer and call; as soon as every rank calls the same layer at the same "
         "count, that call runs.",
         "One layer at different counts on different ranks: destroy() it on every rank (its count starts again)."],
        "for moe in moe_layers:  # the same layers in the same order on every rank\n    x = moe(x)")


class PeerFailedError(EnvironmentError_):
    code = _entry(
        "ENV005", "another rank of the EP group failed inside the routed step",
        "A rank raised inside a collective step (an exception in its experts, a failed kernel, a lost peer); the "
        "layer agrees on the failure with its peers, so every rank raises this instead of waiting for rows that "
        "will not come.",
        "An out-of-memory error in one rank's expert GEMM, or a killed peer process.",
        ["Read the failing rank's own error (named in the message) and fix its cause.",
         "The layer stays usable after an agreed failure; after a lost peer, rebuild the process group and layer."],
        "torchrun ... (look for the first rank that printed an error other than ENV005)")


class ConservationError(EnvironmentError_):
    code = _entry(
        "ENV007", "debug checks found rows lost, duplicated or corrupted in the routed step",
        "With debug_checks on, every call compares the rows each rank sent with the rows the group received (count "
        "and float64 checksum per source rank) and checks that every non-masked slot came back from combine; a "
        "difference means the transport lost, duplicated or corrupted rows.",
        "A transport bug, a peer writing into a buffer it does not own, or memory corruption.",
        ["Report it with the message (it names the source ranks and the counts).",
         "Compare transports: transport='a2a' and 'symm' must give the same pool bitwise."],
        "MegaMoE(cfg, group, debug_checks=True)  # or MOE_REF_DEBUG_CHECKS=1")


class DeviceUnavailableError(EnvironmentError_):
    code = _entry(
        "ENV006", "the requested device is not available here",
        "device='cuda' (or cuda:N) was asked for, but torch sees no such CUDA device on this machine.",
        "MegaMoE(cfg, device='cuda') on a laptop, or cuda:3 on a 2-GPU machine.",
        ["Use device='cpu' (the default), or run on a machine with the GPU.",
         "Check torch.cuda.is_available() and torch.cuda.device_count()."],
        "MegaMoE(cfg, device='cuda' if torch.cuda.is_available() else 'cpu')")


class PathNotWritableError(EnvironmentError_):
    code = _entry(
        "ENV015", "a folder the command must write into cannot be created or written",
        "The demo writes its synthetic checkpoint into --checkpoint when that folder holds no config.json yet; "
        "the folder (or a parent) does not exist and cannot be created, is a file, or is read-only.",
        "moe-ref demo --checkpoint /proc/nope/x, or a path under a read-only mount.",
        ["Pass a folder you can write (it is created if absent), e.g. --checkpoint ~/moe_ref_ckpt.",
         "Or leave --checkpoint out: the demo then uses a fresh private temporary folder and removes it."],
        "moe-ref demo --checkpoint ./demo_ckpt")


class InsufficientMemoryError(EnvironmentError_):
    code = _entry(
        "ENV016", "the run needs more memory than this machine has available",
        "Before allocating anything, the CLI estimates the bytes the run would hold (weights and the symmetric "
        "buffer of every process, from the config and the capacity plan) and compares them with the memory "
        "available now (MemAvailable on the host, free memory of each GPU); allocating anyway would die in the "
        "allocator or the OOM killer.",
        "moe-ref demo --preset kimi-k2 on a laptop (hundreds of GB of expert weights), or moe-ref bench "
        "--experts 100000.",
        ["Use a tiny preset (--preset tiny-kimi-k2: the same routing at test sizes), or fewer/smaller experts.",
         "Run on GPUs (--device cuda, bf16 weights, one GPU per process).",
         "Pass --skip-memory-check to try anyway (the estimate is a lower bound)."],
        "moe-ref demo --preset tiny-kimi-k2\nmoe-ref demo --preset kimi-k2 --skip-memory-check  # at your own risk")


class PeerTimeoutError(EnvironmentError_):
    code = _entry(
        "ENV010", "a peer rank never signalled within the bound of a device-side wait",
        "A device-side barrier over the symmetric buffer polls the flags its peers write; it gives up after its "
        "bound (time or polls) and records which peers never signalled, instead of spinning forever. Later "
        "barriers of the call skip their wait, so the data of that call is invalid.",
        "A rank crashed, hung, skipped a chunk or ran a different number of chunks (ranks disagree on the call "
        "sequence), or the bound is shorter than a slow peer's work (first call, compilation, a debugger).",
        ["Check that every rank of the EP group runs the same calls (same chunk count, same layers).",
         "Look at the named peers' logs: a crash there is the root cause.",
         "Raise the bound (timeout_us) when peers are legitimately slow (e.g. JIT compilation on the first call)."],
        "symm_barrier(peers, regions, timeout_us=10_000_000)  # 10 s while debugging")


class StepBuiltOnSomeRanksError(StepOutOfSyncError):
    code = _entry(
        "ENV017", "a layer's routed step exists on some ranks of the EP group only",
        "A layer builds its routed step (buffer share, transport) on its first call, collectively, and destroy() "
        "releases it on the rank that calls it. The step was destroyed on some ranks only, so in this call those "
        "ranks build it again while the others run the step they kept. The build announces itself in the per-call "
        "agreement, so every rank raises this before either side enters a collective the other never joins. The "
        "call is counted on no rank.",
        "moe.destroy() on one rank (to free memory, in an error handler) followed by moe(x) on every rank.",
        ["Call destroy() on every rank of the EP group or on none; after destroy() on every rank the next call "
         "builds the step again everywhere.",
         "To free one rank's memory, destroy the layers on every rank and build them again together."],
        "for moe in moe_layers:  # on every rank alike\n    moe.destroy()")


class RebalanceCanaryError(EnvironmentError_):
    code = _entry(
        "ENV019", "after an EPLB rebalance a slot does not hold the expert its placement names",
        "rebalance() moves experts' weights between ranks by point-to-point sends, then checks a canary: a digest of "
        "sampled bytes of every slot's tensors, taken before the move for each logical expert, compared after it "
        "with every slot's. The ranks agree on the result, so every rank raises this, naming the slots that differ. "
        "The layer's weights are then not what its placement says: do not call it.",
        "A transport that lost or reordered messages, a rank that changed its experts' weights between the "
        "digest and the move, or replicas of one expert that were never equal (weights loaded differently per rank).",
        ["Load the weights again (load_hf_weights / load_state_dict on every rank) and rebalance again.",
         "Check that every rank loaded the same checkpoint: replicas of one expert must be equal before a move."],
        "layer.load_hf_weights(path, layer_idx)  # every rank\nlayer.rebalance(placement)")


class GroupTimeoutError(EnvironmentError_):
    code = _entry(
        "ENV018", "a peer of the EP group did not join a collective within the group's timeout",
        "Every call of an EP layer starts with one small collective of the EP group (the per-call agreement, over "
        "a gloo group of the same ranks that the layer makes with the EP group's own timeout: the timeout= given "
        "to init_process_group or new_group). A peer that is alive but does not call the layer never joins it, "
        "so the ranks that did call raise this when that timeout ends instead of waiting until the peer exits.",
        "One rank skipped a layer call (a branch on local data, an MTP layer run on some ranks only, an exception "
        "of its own code caught before moe(x)) or is busy elsewhere (a debugger, a long host task, a slow "
        "checkpoint write) for longer than the timeout.",
        ["Make every rank call every EP layer in the same order, with T = 0 on a rank that has no tokens.",
         "If the peer is only slow, give the process group a longer timeout: "
         "init_process_group(..., timeout=timedelta(minutes=10)).",
         "After a timeout the group's collectives are out of step: rebuild the process group and the layers "
         "(restart the job) to go on."],
        "dist.init_process_group('gloo', timeout=timedelta(seconds=60))\n"
        "y = moe(x)  # on every rank, x of shape [0, hidden] where a rank has no tokens")


class OptionalDependencyError(EnvironmentError_):
    code = _entry(
        "ENV022", "an optional package an integration needs is missing or too old",
        "moe_ref's integrations import their library only when used: moe_ref.integrations.transformers needs "
        "transformers (5.x: its ExpertsInterface and fused experts modules), resolving a repo id needs "
        "huggingface_hub; `import moe_ref` needs neither.",
        "import moe_ref.integrations.transformers without transformers installed, or with transformers 4.x; "
        "moe_ref.integrations.from_pretrained('org/name', ...) without huggingface_hub.",
        ["Install the package the message names (pip install 'transformers>=5' huggingface_hub).",
         "Or pass a local checkpoint folder instead of a repo id (no huggingface_hub needed)."],
        "pip install 'transformers>=5' huggingface_hub")


class ConformanceSpawnError(EnvironmentError_):
    code = _entry(
        "ENV021", "the conformance harness could not start its rank processes",
        "moe-ref conform runs each rank count in its own processes (gloo on CPU, NCCL on GPUs), joined over a local "
        "TCP port; a process that cannot start, or a group that cannot form, ends the run before any case.",
        "--ranks 4 --device cuda on a machine with fewer GPUs, or a sandbox that forbids local TCP ports.",
        ["Lower --ranks to the GPUs present (torch.cuda.device_count()), or run on --device cpu.",
         "The message carries each rank's last output lines."],
        "moe-ref conform --impl torch --ranks 2 --device cpu")


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


class TensorShapeMismatchError(CheckpointError):
    code = _entry(
        "LOAD002", "a checkpoint tensor has the wrong shape",
        "The tensor's shape does not match the config (hidden, intermediate or expert count).",
        "Loading DeepSeek-V3 weights into a Kimi-K2 config.",
        ["Use the config.json that came with the checkpoint."],
        "cfg = MoEConfig.from_hf_config('<checkpoint dir>/config.json')")


class UnsupportedCheckpointError(CheckpointError):
    """A checkpoint stores MoE weights quantized/packed, read without the quantization_config that says how."""

    code = _entry(
        "LOAD003", "quantized or packed MoE weights read without their quantization_config",
        "moe_ref reads quantized checkpoints as published (FP8 128x128 blocks, compressed-tensors INT4 group 32, "
        "MXFP4 group 32) when the checkpoint's config.json carries the quantization_config it was published with: "
        "that config says which format the tensors are in and which modules are quantized. Here a tensor is "
        "stored quantized (an FP8/INT/packed dtype, or weight_packed / weight_scale_inv siblings) but the load had "
        "no quantization_config, so its values cannot be read safely (as plain weights they would be silently "
        "wrong) and the loader refuses.",
        "A config.json whose quantization_config was deleted or lost in a copy (e.g. a hand-written config.json "
        "beside Kimi-K2-Instruct's FP8 shards), or load_moe_weights(path, cfg, layer) called without "
        "quant=checkpoint_quant_spec(path) on a quantized checkpoint.",
        ["Restore the quantization_config from the model's published config.json; MegaMoE.load_hf_weights then "
         "reads the routed experts as stored and dequantizes the shared experts once.",
         "Calling the loader yourself: pass quant=moe_ref.checkpoint.quantized.checkpoint_quant_spec(path) to "
         "load_moe_weights, and read the routed experts with load_quantized_experts.",
         "A format moe_ref does not read (LOAD008 lists the ones it does, e.g. gpt-oss's own MXFP4 *_blocks): "
         "dequantize the checkpoint to bf16 first."],
        "\"quantization_config\": {\"quant_method\": \"fp8\", \"fmt\": \"e4m3\", \"activation_scheme\": \"dynamic\", "
        "\"weight_block_size\": [128, 128]}")


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    code = _entry(
        "LOAD004", "no safetensors checkpoint at the given path",
        "The loader takes a .safetensors file, or a folder holding model.safetensors, sharded *.safetensors "
        "files with model.safetensors.index.json, or any *.safetensors files.",
        "A typo in the path, a folder of .bin (pickle) files, or an index json whose shard files are missing.",
        ["Pass the file or the folder that holds the .safetensors files.",
         "Convert .bin checkpoints to safetensors first."],
        "load_moe_weights('/models/kimi-k2/', cfg, layer_idx=1)")



class QuantTensorDTypeError(CheckpointError):
    code = _entry(
        "LOAD005", "a quantized weight or its scale has the wrong dtype",
        "Each quantization format fixes the stored dtypes: FP8 blocks float8_e4m3fn + fp32 weight_scale_inv; "
        "compressed-tensors INT4 weight_packed int32 + bf16/fp16/fp32 weight_scale; MXFP4 weight_packed uint8 + "
        "uint8 (E8M0) weight_scale. Another dtype means another format or a broken conversion.",
        "An INT4 checkpoint whose weight_packed was re-saved as uint8, or MXFP4 scales stored as bf16.",
        ["Use the checkpoint as published, with the config.json (quantization_config) that came with it.",
         "If you converted it yourself, keep the dtypes listed in the message."],
        "load_quantized_experts('/models/kimi-k3', cfg, layer_idx=1, expert_range=(0, 448))")


class QuantTensorShapeError(CheckpointError):
    code = _entry(
        "LOAD006", "a quantized weight or its scale has the wrong shape",
        "Packed weights and scales have shapes fixed by the weight's [out, in] and the format: INT4 [out, in/8] "
        "int32 + [out, in/32] scales; MXFP4 [out, in/2] + [out, in/32]; FP8 [out, in] + [ceil(out/128), "
        "ceil(in/128)]. A mismatch means another model's config or a different group size.",
        "A checkpoint quantized with group_size 128 read with a config that says 32, or the config of another model.",
        ["Use the config.json that came with the checkpoint.",
         "Check quantization_config's group_size / weight_block_size against the tensors."],
        "cfg = MoEConfig.from_hf_config('<checkpoint dir>'); spec = quant_spec_from_config('<checkpoint dir>')")


class MissingScaleError(CheckpointError, KeyError):
    code = _entry(
        "LOAD007", "a quantized weight has no scale tensor",
        "Quantized weights are meaningless without their scales (weight_scale_inv for FP8 blocks, weight_scale for "
        "INT4/MXFP4); reading them alone would give silently wrong weights.",
        "A shard with the scales missing from the download, or a checkpoint saved without them.",
        ["Download every shard of the checkpoint (the index lists where each scale lives).",
         "Re-export the checkpoint with its scales."],
        "huggingface-cli download moonshotai/Kimi-K2-Thinking --local-dir /models/k2-thinking")


class UnsupportedQuantizationError(CheckpointError):
    code = _entry(
        "LOAD008", "unknown or unsupported quantization method, scheme or group size",
        "moe_ref loads three published expert formats: quant_method 'fp8' with weight_block_size [128, 128] "
        "(DeepSeek-V3/R1, Kimi-K2-Instruct, Step3 FP8), compressed-tensors 'pack-quantized' INT4 symmetric group 32 "
        "(Kimi-K2-Thinking/K2.5) and compressed-tensors 'mxfp4-pack-quantized' FP4 E2M1 group 32 (Kimi-K3). "
        "Another method, bit width, asymmetric scheme, block or group size is refused rather than misread.",
        "quantization_config with quant_method 'awq' or 'gptq', group_size 128, symmetric false, or "
        "weight_block_size [64, 64].",
        ["Dequantize the checkpoint to bf16 and load it with load_moe_weights.",
         "Use one of the supported published formats."],
        "spec = quant_spec_from_config('/models/kimi-k2-thinking/config.json')  # prints the supported formats")


class CorruptSafetensorsError(CheckpointError):
    code = _entry(
        "LOAD010", "a safetensors file is truncated or not a safetensors file",
        "A safetensors file starts with an 8-byte header length, a JSON header, then the data; the header or the "
        "data is cut short (an interrupted download) or the file holds something else.",
        "A partial download, a Git LFS pointer file saved as .safetensors, a disk that filled up while writing.",
        ["Download the file named in the message again (compare its size with the published one).",
         "Run `git lfs pull` if the file is an LFS pointer."],
        "huggingface-cli download <repo> model-00003-of-00062.safetensors --local-dir /models/<name>")


class MissingShardError(CheckpointNotFoundError):
    code = _entry(
        "LOAD011", "shard files named in the checkpoint index are missing",
        "model.safetensors.index.json maps every tensor to a shard file; some of those files are not in the "
        "checkpoint folder, so tensors that live there cannot be read.",
        "An interrupted or partial download (e.g. --include of a few shards only).",
        ["Download/copy every shard the index names (the message lists the missing ones)."],
        "huggingface-cli download <repo> --local-dir /models/<name>  # all shards")


class CorruptIndexError(CheckpointError):
    code = _entry(
        "LOAD012", "the checkpoint index json is corrupt",
        "model.safetensors.index.json must be a JSON object with a 'weight_map' object of "
        "{tensor name: shard file name}; the file is not JSON, or has no such map, or maps names to non-strings.",
        "A truncated index download, an index edited by hand, an HTML error page saved under the index's name.",
        ["Download model.safetensors.index.json again.",
         "Or delete it: without an index every *.safetensors file of the folder is read."],
        "huggingface-cli download <repo> model.safetensors.index.json --local-dir /models/<name>")


class UnsafeShardPathError(CheckpointError):
    code = _entry(
        "LOAD013", "the checkpoint index names a shard outside the checkpoint folder",
        "Shard names in model.safetensors.index.json are file names inside the checkpoint folder; an absolute path "
        "or one with '..' leading out of the folder would make the loader read arbitrary files, so it refuses. "
        "The check is on the names only: shard files that are links (the Hugging Face hub cache's snapshots link "
        "each file into ../../blobs/ or a shared store) are read where the links lead.",
        "An index with \"../other-model/model-00001.safetensors\" or \"/etc/passwd\" as a shard name.",
        ["Fix the index so every shard is a plain file name in the folder (as published).",
         "Copy the shards into the checkpoint folder."],
        "{\"weight_map\": {\"model.layers.1.mlp.gate.weight\": \"model-00001-of-00002.safetensors\"}}")


class QuantTensorValueError(CheckpointError):
    code = _entry(
        "LOAD015", "a quantized tensor holds a value its format cannot mean here",
        "MXFP4 scales are E8M0 bytes decoding as 2**(byte - 125) (compressed-tensors' bias). moe_ref's W4A16 kernel "
        "keeps them finite in fp32 up to byte 238 (2**113); larger bytes (up to 255, which OCP MX calls NaN) would "
        "become inf or wrong silently, and no trained weight has such a scale: the checkpoint is corrupt or uses "
        "another scale bias.",
        "A shard with overwritten scale bytes (255 everywhere), or a conversion that wrote the scales with another "
        "bias.",
        ["Re-download the shard the message names (its safetensors checksum should match the published one).",
         "If you converted the checkpoint yourself, store E8M0 scales with bias 125 (compressed-tensors)."],
        "load_quantized_experts('/models/kimi-k3', cfg, layer_idx=1, expert_range=(0, 448))")


class QuantizationMismatchError(CheckpointError):
    code = _entry(
        "LOAD014", "a module's stored precision disagrees with the checkpoint's quantization_config",
        "The checkpoint's quantization_config decides which Linear modules are stored quantized: quant_method "
        "'fp8' quantizes every Linear (the router gate and lm_head are not Linear layers of the quantized model) "
        "except those in ignored_layers / modules_to_not_convert; compressed-tensors quantizes its targets except "
        "the 'ignore' list (names, or 're:' regexes). A module that rule calls quantized is stored as a plain "
        "weight, or the reverse: one of the two is not the checkpoint as published.",
        "A DeepSeek-V3 FP8 checkpoint whose shared experts were converted to bf16 while config.json still says "
        "quant_method fp8; a Kimi-K2-Thinking config (ignore: re:.*shared_experts.*) beside FP8 shared experts.",
        ["Use the checkpoint with the config.json that came with it (the message names the tensor and the rule).",
         "If you converted some modules yourself, list them in the config's ignore / ignored_layers / "
         "modules_to_not_convert (or quantize them too)."],
        "\"quantization_config\": {\"quant_method\": \"fp8\", \"weight_block_size\": [128, 128], "
        "\"ignored_layers\": [\"model.layers.1.mlp.shared_experts.gate_proj\"]}")


class CheckpointFormatMismatchError(CheckpointError):
    code = _entry(
        "LOAD016", "the --checkpoint folder holds a checkpoint in another format than --quant",
        "moe-ref demo and moe_ref.tools.dist_check write a synthetic checkpoint into --checkpoint only when the "
        "folder holds no config.json; a folder that holds one is read as it is, so its quantization_config must "
        "be the format --quant asks for (none for plain weights). They check this before any process starts.",
        "moe-ref demo --checkpoint ckpt/ --quant mxfp4, then moe-ref demo --checkpoint ckpt/ --quant int4_group "
        "(or without --quant).",
        ["Pass the --quant the message names (the folder's format) to run that checkpoint.",
         "Or pass another --checkpoint folder (a new or empty one is written in the format asked for), or leave "
         "--checkpoint out for a private temporary folder."],
        "moe-ref demo --preset tiny-kimi-k3 --quant int4_group --checkpoint ckpt_int4/")


class CheckpointModelMismatchError(CheckpointError):
    code = _entry(
        "LOAD017", "the --checkpoint folder holds another model than --preset",
        "A --checkpoint folder that holds a config.json is read as it is; its sizes (experts, hidden, intermediate, "
        "shared and latent widths, routing) must be those of --preset (rounded up for --quant, as the writer "
        "rounds them). They are compared before any process starts, instead of failing on a tensor shape inside "
        "every process.",
        "moe-ref demo --checkpoint ckpt/ --preset tiny-kimi-k3, then moe-ref demo --checkpoint ckpt/ (the "
        "default preset tiny-kimi-k2).",
        ["Pass the --preset the message names (the model the folder holds).",
         "Or pass another --checkpoint folder, or leave --checkpoint out for a private temporary folder."],
        "moe-ref demo --preset tiny-kimi-k3 --checkpoint ckpt/")


class LayerIndexError(CheckpointError, IndexError):
    code = _entry(
        "LOAD018", "the layer index is not a layer of the model",
        "load_hf_weights / load_moe_weights read one decoder layer; the config.json says how many the model has "
        "(num_hidden_layers) and which are MoE layers (first_k_dense_replace, decoder_sparse_step, "
        "moe_layers_enum, ... by family). A layer_idx past the last layer names no tensor at all.",
        "load_hf_weights(path, 99) for a 61-layer model, or a 1-based layer number off by one at the end.",
        ["Pass a layer the message lists (layers are numbered from 0; the MoE layers are listed)."],
        "moe.load_hf_weights('/models/kimi-k2', layer_idx=60)  # the last of its 61 layers")


class UnexpectedTensorError(CheckpointError):
    code = _entry(
        "LOAD019", "the checkpoint holds a bias the model family's math has no place for",
        "Each family's block is read by its own math (moe_ref.core.families): which Linear layers have biases "
        "(gpt-oss's router and experts) and which do not (every other family's). A '.bias' beside a weight the "
        "family computes without one means another model, or a config value turned off; dropping it would "
        "compute a different model silently.",
        "A DeepSeek-V2 checkpoint trained with mlp_bias=true read with a config.json that says false; a checkpoint "
        "of another family read with a wrong config.json.",
        ["Use the config.json that came with the checkpoint.",
         "If the model really has the bias, its family must say so: see moe_ref/core/families/ (moe-ref explain "
         "CFG025)."],
        "cfg = MoEConfig.from_hf_config('<checkpoint dir>')")


class SlotWeightsError(CheckpointError):
    code = _entry(
        "LOAD020", "the weights given do not hold every logical expert this rank's EPLB slots need",
        "With EPLB each physical slot of a rank holds a logical expert named by the placement, not a contiguous "
        "block of experts; load_weights(weights) takes each slot's expert from the block given, so the block must "
        "hold every expert the rank's slots name.",
        "load_weights(MoEWeights of experts 0..7) on a rank whose slots hold experts 3, 9 and 12.",
        ["Pass all experts (MoEWeights.random(cfg) or the full checkpoint block), or a block covering the experts "
         "listed in the message (layer.slot_experts())."],
        "layer.load_weights(MoEWeights.random(cfg, seed=0))")


class RepoNotCachedError(CheckpointNotFoundError):
    code = _entry(
        "LOAD021", "a repo id is not in the local Hugging Face hub cache",
        "moe_ref resolves a repo id through the hub cache only (huggingface_hub's snapshot_download with "
        "local_files_only=True): it never downloads. The cache folder the message names holds no snapshot of that "
        "repo at that revision (not downloaded, another revision, or another cache folder: HF_HUB_CACHE / "
        "HF_HOME / cache_dir).",
        "moe_ref.integrations.from_pretrained('deepseek-ai/DeepSeek-V3', layer_idx=3) before downloading it, or "
        "with HF_HUB_CACHE pointing elsewhere than the download went.",
        ["Download it first with the command the message prints (hf download <repo> [--revision R] "
         "[--cache-dir DIR]).", "Point HF_HUB_CACHE (or cache_dir=) at the cache that holds it.",
         "Or pass the checkpoint's local folder instead of the repo id."],
        "hf download deepseek-ai/DeepSeek-V3\nmoe_ref.integrations.from_pretrained('deepseek-ai/DeepSeek-V3', layer_idx=3)")


class BlockWeightsUnavailableError(CheckpointError):
    code = _entry(
        "LOAD022", "a transformers MoE block's weights cannot be taken as they are held",
        "patch_model takes each MoE block's own tensors (no second read from disk): they must be materialized "
        "plain floating-point tensors on one device. A block offloaded by accelerate (tensors on the 'meta' device, "
        "device_map with disk/CPU offload), or experts quantized by a transformers quantizer, hold no such tensors.",
        "from_pretrained(name, device_map='auto') that offloaded some layers, or a bitsandbytes / FP8-quantized "
        "model, then patch_model(model).",
        ["Load the model fully on its devices (no offload), in bf16/fp16/fp32, then patch it.",
         "For a quantized checkpoint use MegaMoE.load_hf_weights, which reads FP8/INT4/MXFP4 experts as stored."],
        "model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16, device_map='cuda:0')\n"
        "patch_model(model)")


class IncompleteSnapshotError(CheckpointNotFoundError):
    code = _entry(
        "LOAD023", "the hub cache holds only part of a repo's snapshot",
        "The cached snapshot folder of the repo exists, but huggingface_hub's record of the repo's files says some "
        "are absent (an interrupted download, or one limited with --include), or the files moe_ref needs "
        "(config.json and the safetensors weights) are not there.",
        "hf download <repo> --include config.json, then from_pretrained('<repo>', layer_idx=3).",
        ["Finish the download with the command the message prints."],
        "hf download deepseek-ai/DeepSeek-V3")


def explain(code: str) -> str:
    """Return the rendered catalogue entry for ``code`` (case-insensitive); raises KeyError listing codes."""
    entry = CATALOGUE.get(code.upper())
    if entry is None:
        raise KeyError(f"unknown error code {code!r}; known: {', '.join(sorted(CATALOGUE))}")
    return entry.render()


def error_class(code: str) -> type[MoERefError]:
    """The error class of ``code`` (e.g. ``"CAP001"`` -> ``CapacityExceededError``), so that every rank of a
    group can raise the same class as the rank that found the problem. Unknown codes give ``MoERefError``."""
    pending = [MoERefError]
    while pending:
        cls = pending.pop()
        if cls.__dict__.get("code") == code:
            return cls
        pending.extend(cls.__subclasses__())
    return MoERefError
