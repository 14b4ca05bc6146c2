"""moe_ref: a readable, tested reference for the expert-parallel ("mega") MoE layer.

    x [T, D] -> router -> capacity check (error | chunk) -> pre-dispatch into my symmetric buffer
      -> dispatch (peers pull their experts' rows) -> expert GEMMs -> combine (rows back to the source)
      -> deterministic fp32 weighted reduce (+ shared experts) -> y [T, D]

Modules, in data-flow order: ``config``, ``options`` (every option resolved once), ``errors``, ``router`` and
``ops`` (kernel or twin), ``block`` (the composition around the routed step), ``routed_step`` (modular or
monolithic; its per-call ``overflow`` policy; ``distributed`` agreements), ``capacity`` (the buffer plan),
``buffer``/``transport``, ``dispatch``, ``experts`` and ``kernels/``, ``layer``, ``loading``, ``cli``.
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
