"""``moe_ref.conformance``: plug in a dispatch/combine, a fused-MoE kernel or a whole routed step and have it checked
adversarially at 1..N ranks against an independent float64 oracle, with its speed beside the peers'.

    moe-ref conform --impl pkg.module:factory [--ranks 1,2,4] [--device cpu|cuda] [--speed]

Modules, in reading order: ``api`` (what you register: ``implementation``, ``Capabilities``, ``Problem``, the
kinds), ``scenarios`` (the seeded cases), ``oracle`` (float64, shares no code with what it checks), ``runner``
(one case on one rank, the checks), ``spawn`` (the rank processes, one deadline per case), ``report`` (JSON lines,
the matrix, the ledger), ``mutants`` (planted bugs that every check must catch), ``adapters`` (moe_ref's own
backends and transports, the peers, the worked example), ``cli``. The guide: docs/conform.md.
"""
from moe_ref.conformance.api import (KINDS, QUANTS, Capabilities, DispatchCombine, ExpertPool, ExpertsFn,
                                     ExpertWeights, Implementation, PoolExpertsFn, Problem, Received, implementation,
                                     register)
from moe_ref.conformance.registry import registered, resolve

__all__ = ["KINDS", "QUANTS", "Capabilities", "DispatchCombine", "ExpertPool", "ExpertsFn", "ExpertWeights",
           "Implementation", "PoolExpertsFn", "Problem", "Received", "implementation", "register", "registered",
           "resolve"]
