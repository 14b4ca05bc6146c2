"""moe_ref itself under test, from outside: each experts backend through the modular routed step
(``routed_step`` kind: the transport, the overflow policy, the chunk loop and the backend together) and each
transport's dispatch/combine on its own (``dispatch_combine`` kind). Names: ``moe_ref/<backend>`` (overflow
``error``), ``moe_ref/torch+chunk`` (overflow ``chunk``), ``moe_ref/torch+invariant`` and ``moe_ref/triton+invariant``
(the batch-invariant mode: tiles of one bits class, every slot's row back unreduced and summed at home in slot
order), ``moe_ref/mega/deep_gemm`` (DeepGEMM's fused mega-MoE at 2+ ranks), ``moe_ref/dispatch/<transport>``.

Shape legend: T tokens of this rank, K top-k, e local experts, D hidden width, F expert intermediate,
P receive-pool rows.
"""
from __future__ import annotations

import torch

from moe_ref.conformance.api import Capabilities, Implementation, Problem, Received, register
from moe_ref.core.config import MoEConfig

# the cap every moe_ref adapter runs the matrix with: above the torch loop's 128-row tile + 1 (cap+1 feeds 161 rows);
# a speed case of more tokens builds the layer's buffers for its T (configurable_cap)
CAP = 160


def _config(problem: Problem) -> MoEConfig:
    return MoEConfig(num_experts=problem.num_experts, num_topk=problem.num_topk, hidden_size=problem.hidden,
                     intermediate_size=problem.intermediate)


def _options(problem: Problem, backend: str, transport: str, overflow: str, **more):
    """``EPOptions`` of the problem's cap, dtype and device (``more``: other ``EPOptions.resolve`` arguments)."""
    from moe_ref.ep.options import EPOptions

    return EPOptions.resolve(num_max_tokens_per_rank=problem.max_tokens_per_rank, overflow=overflow,
                             transport=transport, experts_backend=backend, dtype=problem.dtype,
                             device=problem.device, **more)


def step_runner(problem: Problem, experts, options):
    """``run(x, ids, w, out)`` over moe_ref's ``ModularRoutedStep`` of ``experts`` (``run.close`` releases it)."""
    from moe_ref.ep.routed_step import make_modular_step

    step = make_modular_step(_config(problem), problem.group, experts, options)

    def run(x_TD, topk_ids_TK, topk_weights_TK, out_TD):
        out_TD.copy_(step(x_TD, topk_ids_TK, topk_weights_TK))

    run.close = step.destroy
    return run


def routed_step_factory(backend: str, overflow: str = "error", transport: str = "auto", batch_invariant: bool = False):
    """``Problem -> run``: moe_ref's ``ModularRoutedStep`` over ``backend`` and ``transport`` (in the
    batch-invariant mode with ``batch_invariant``, as the layer builds it there)."""
    def factory(problem: Problem):
        from moe_ref.experts import FP8ExpertWeights, make_experts

        w = problem.weights
        fp8 = None if w.quant == "none" else FP8ExpertWeights(w.gate_up_q, w.gate_up_scale, w.down_q, w.down_scale)
        experts = make_experts(backend, w.gate_up_e2FD, w.down_eDF, fp8_weights=fp8)
        experts.batch_invariant = batch_invariant
        return step_runner(problem, experts,
                           _options(problem, backend, transport, overflow, batch_invariant=batch_invariant))

    return factory


def mega_step_factory(problem: Problem):
    """``Problem -> run``: DeepGEMM's SM90 mega-MoE under moe_ref's cap and overflow policy, as
    ``MegaMoE(..., mega='deep_gemm')`` builds it (``make_mega_step``): the engine quantizes the bf16 weights and
    the activations to FP8 blocks itself (``Capabilities.compute``)."""
    from moe_ref.ep.mega_deep_gemm import make_mega_step

    w = problem.weights
    step = make_mega_step(_config(problem), problem.group, _options(problem, "deep_gemm", "auto", "error"),
                          w.gate_up_e2FD, w.down_eDF)

    def run(x_TD, topk_ids_TK, topk_weights_TK, out_TD):
        out_TD.copy_(step(x_TD, topk_ids_TK, topk_weights_TK))

    run.close = step.destroy
    return run


def _mega_missing() -> str | None:
    """Why DeepGEMM's SM90 mega-MoE cannot run here (``deep_gemm_status``), or None."""
    from moe_ref.experts.deep_gemm.probe import deep_gemm_status

    status = deep_gemm_status()
    return None if status.available and status.mega_moe else status.reason


def _mega_refuses(shape, world: int) -> str | None:
    """Why DeepGEMM's mega-MoE refuses ``shape`` at ``world`` ranks (``mega_deep_gemm.supports``), or None."""
    from moe_ref.ep.mega_deep_gemm import supports

    ok, reason = supports(MoEConfig(num_experts=shape.experts_per_rank * world, num_topk=shape.topk,
                                    hidden_size=shape.hidden, intermediate_size=shape.intermediate), world)
    return None if ok else reason


class _Dispatch:
    """A moe_ref ``Dispatcher`` in the ``DispatchCombine`` protocol."""

    def __init__(self, problem: Problem, transport: str):
        from moe_ref.ep.transport import make_dispatcher

        self.dispatcher = make_dispatcher(_config(problem), problem.group, _options(problem, "torch", transport,
                                                                                    "error"))

    def dispatch(self, x_TD, topk_ids_TK, topk_weights_TK) -> Received:
        handle = self.dispatcher.dispatch(x_TD, topk_ids_TK, topk_weights_TK)
        layout = handle.layout
        return Received(handle.recv_x_PD[:layout.num_pool_rows], layout.row_start_e, layout.num_rows_e, handle)

    def combine(self, y_PD, received: Received, out_TD) -> None:
        out_TD.copy_(self.dispatcher.combine(y_PD, received.handle))

    def close(self) -> None:
        self.dispatcher.destroy()


def _add(name: str, kind: str, caps: Capabilities, factory, label: str = "", unavailable=None, refuses=None) -> None:
    register(Implementation(name, kind, caps, factory, label, spec=name, unavailable=unavailable, refuses=refuses))


def backend_missing(backend: str):
    """``() -> why the experts backend cannot run here | None`` (``Experts.unavailable_reason`` on the device it
    would use: e.g. a torch without ``grouped_mm``, DeepGEMM not installed)."""
    def why() -> str | None:
        from moe_ref.experts import experts_class

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return experts_class(backend, device).unavailable_reason()

    return why


_BASE = dict(dtypes=("fp32", "bf16"), ep_sizes=(1, 2, 4), max_tokens_per_rank=CAP, overflow="error",
             configurable_cap=True, deterministic=True, duplicate_experts=False, masked_slots=True)
# the torch loop computes whole 128-row segments, so a row's bits never depend on its neighbours (CPU)
_add("moe_ref/torch", "routed_step", Capabilities(**_BASE, batch_invariant=True, devices=("cpu",), tile_rows=128),
     routed_step_factory("torch"))
_add("moe_ref/torch+chunk", "routed_step",
     Capabilities(**{**_BASE, "overflow": "chunk"}, batch_invariant=True, devices=("cpu",), tile_rows=128),
     routed_step_factory("torch", overflow="chunk"))
_add("moe_ref/torch+invariant", "routed_step",
     Capabilities(**{**_BASE, "overflow": "chunk"}, batch_invariant=True, devices=("cpu",), tile_rows=16),
     routed_step_factory("torch", overflow="chunk", batch_invariant=True), "the batch-invariant mode")
_add("moe_ref/grouped_mm", "routed_step", Capabilities(**_BASE, tile_rows=16), routed_step_factory("grouped_mm"),
     unavailable=backend_missing("grouped_mm"))
_add("moe_ref/triton", "routed_step",
     Capabilities(**{**_BASE, "dtypes": ("bf16",)}, quants=("none", "fp8_block"), devices=("cuda",), tile_rows=64,
                  graph_safe=True), routed_step_factory("triton"))
_add("moe_ref/triton+invariant", "routed_step",
     Capabilities(**{**_BASE, "overflow": "chunk", "dtypes": ("bf16",)}, quants=("none", "fp8_block"),
                  batch_invariant=True, devices=("cuda",), tile_rows=64, graph_safe=True),
     routed_step_factory("triton", overflow="chunk", batch_invariant=True), "the batch-invariant mode on a GPU")
_add("moe_ref/deep_gemm", "routed_step",
     Capabilities(**{**_BASE, "dtypes": ("bf16",)}, quants=("none", "fp8_block"), devices=("cuda",), tile_rows=128),
     routed_step_factory("deep_gemm"), "DeepGEMM's grouped GEMMs (SM90)")
# its re-run bits are not known yet: declared non-deterministic (checked against the oracle, not bitwise)
_add("moe_ref/mega/deep_gemm", "routed_step",
     Capabilities(**{**_BASE, "dtypes": ("bf16",), "ep_sizes": (2, 4, 8), "deterministic": False}, compute="fp8_block",
                  devices=("cuda",), tile_rows=128),
     mega_step_factory, "DeepGEMM's SM90 mega-MoE (2+ GPUs; FP8 blocks on bf16 weights)", unavailable=_mega_missing,
     refuses=_mega_refuses)
for _transport, _sizes in (("local", (1,)), ("symm", (2, 4)), ("a2a", (2, 4))):
    _add(f"moe_ref/dispatch/{_transport}", "dispatch_combine",
         Capabilities(dtypes=("fp32", "bf16"), ep_sizes=_sizes, max_tokens_per_rank=CAP, overflow="error",
                      configurable_cap=True),
         lambda problem, transport=_transport: _Dispatch(problem, transport))
