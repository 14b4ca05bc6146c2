"""moe_ref: a readable, tested reference for the expert-parallel ("mega") MoE layer.

    x [T, D] -> router -> capacity check (error | chunk) -> pre-dispatch into my symmetric buffer
      -> dispatch (peers pull their experts' rows) -> expert GEMMs -> combine (rows back to the source)
      -> deterministic fp32 weighted reduce (+ shared experts) -> y [T, D]

The package is laid out by stage; a module imports only from its own stage or lower ones
(``tests/unit/test_layout.py`` checks it):

    0 core/        config, errors, envs, weights, activations, router      (and testing.py: helpers for users' tests)
    1 kernels/     Triton kernels by stage (router/ ep/ experts/ runtime/), each beside its torch twin
    2 checkpoint/  loading, formats (FP8 / INT4 / MXFP4 as published), quantized, synthetic
    3 experts/     the Experts contract, registry, built-in backends, quantized experts, deep_gemm/
    4 ep/          options, capacity, buffer, transport, dispatch (symm, a2a), routed_step, overflow, mega_deep_gemm
    5 block.py, layer/ (MegaMoE: the class, construction, weights, calls, runtime), custom_ops.py,
      reference.py (the single-process oracle)
    6 tools/       cli (moe-ref), dist_check (the torchrun harness)
    6 bench/       benchmarking code scripts/ share (cases, timing, the engines' peer kernels read from wheels)

Tensor names end in their shape, one legend letter per dim (``topk_ids_TK`` is ``[T, K]``; ``2F`` is gate rows
then up rows). This legend is the package's only one: a module's ``Shape legend:`` line repeats the letters it
uses with these meanings and no others (``tests/unit/test_docstrings.py`` checks it).

Shape legend: T tokens of this rank (the rows it feeds one call), C cap (``num_max_tokens_per_rank``: the most
rows one rank feeds per call), K top-k (routed slots per token), N routed entries (T * K slots), U tokens one
rank exchanges with another (each token once per destination rank, the rows given to a receive helper), E experts (all of
the model's), e local experts (one rank's, or those one call holds or reads), G expert groups (grouped top-k),
Eg experts per group (E / G), R EP ranks (processes of the expert-parallel group), P receive-pool rows (the
expert-major rows the experts get, alignment padding included), M rows reserved per expert in DeepGEMM's masked
layout, D hidden width (``hidden_size``), L latent width (Kimi-K3), Dx expert input width (the row width that is
dispatched, run through the experts and combined: D, or L for a latent MoE), F expert intermediate, S shared-MLP
intermediate (all shared experts fused), O output features of one weight matrix ``[O, I]`` (``nn.Linear``
order), I input features of one weight matrix, Db = ceil(Dx / 128) FP8 scale blocks of an expert input row,
Fb = ceil(F / 128), Ob = ceil(O / 128), Ib = ceil(I / 128) FP8 scale blocks, Ly MoE layers of a model, Ph physical
expert slots of a layer (E + redundant replicas; EPLB's tables).
"""
from moe_ref.core.config import MoEConfig, ParallelConfig, preset
from moe_ref.core.errors import MoERefError
from moe_ref.core.weights import MoEWeights

__version__ = "0.1.0"
__all__ = ["MoEConfig", "ParallelConfig", "preset", "MoERefError", "MoEWeights", "MegaMoE", "Experts",
           "ExpertLayout", "make_experts", "register_experts", "__version__"]

# Loaded on first use: the layer pulls in torch.distributed machinery, the experts Triton.
_LAZY = {"MegaMoE": "moe_ref.layer", "Experts": "moe_ref.experts", "ExpertLayout": "moe_ref.experts",
         "make_experts": "moe_ref.experts", "register_experts": "moe_ref.experts"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moe_ref' has no attribute {name!r}")
