"""moe_ref: a readable, tested reference for the expert-parallel ("mega") MoE layer.

    x [T, D] -> router -> capacity check (error | chunk) -> pre-dispatch into my symmetric buffer
      -> dispatch (peers pull their experts' rows) -> expert GEMMs -> combine (rows back to the source)
      -> deterministic fp32 weighted reduce (+ shared experts) -> y [T, D]

Modules, in data-flow order: ``config``, ``options`` (every option resolved once), ``errors``, ``router`` and
``ops`` (kernel or twin), ``block`` (the composition around the routed step), ``routed_step`` (modular or
monolithic; its per-call ``overflow`` policy; ``distributed`` agreements), ``capacity`` (the buffer plan),
``buffer``/``transport``, ``dispatch``, ``experts`` (backends: ``deep_gemm_backend``, with ``deep_gemm_probe`` for
detection and ``deep_gemm_bench`` for the benchmarks; ``experts_quant``) and ``kernels/``, ``mega_deep_gemm``,
``layer``, ``loading``, ``cli``.

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
Fb = ceil(F / 128), Ob = ceil(O / 128), Ib = ceil(I / 128) FP8 scale blocks.
"""
from moe_ref.config import MoEConfig, ParallelConfig, preset
from moe_ref.errors import MoERefError
from moe_ref.weights import MoEWeights

__version__ = "0.1.0"
__all__ = ["MoEConfig", "ParallelConfig", "preset", "MoERefError", "MoEWeights", "MegaMoE", "__version__"]


def __getattr__(name):  # the layer imports torch.distributed machinery; load it on first use
    if name == "MegaMoE":
        from moe_ref.layer import MegaMoE

        return MegaMoE
    raise AttributeError(name)
