"""The registry with the shipped adapters in it: ``registered()`` (every implementation by name) and ``resolve(spec)``
(what ``--impl`` names: a registered name or ``module:attribute``)."""
from __future__ import annotations

import importlib

from moe_ref.conformance.api import _REGISTRY, Implementation
from moe_ref.core.errors import ConformanceImplError


def registered() -> dict[str, Implementation]:
    """Every registered implementation by name, the shipped adapters included."""
    import moe_ref.conformance.adapters  # noqa: F401  (registers the shipped adapters)

    return dict(_REGISTRY)


def resolve(spec: str) -> Implementation:
    """``module:attribute`` (an ``Implementation``, or a zero-argument callable returning one) or a registered name.

    Raises ``ConformanceImplError`` (CFG028) naming what was found instead."""
    known = registered()
    if spec in known:
        return known[spec]
    if ":" not in spec:
        if spec not in known:
            raise ConformanceImplError(f"--impl {spec!r}: no registered implementation of that name; give "
                                       f"module:attribute, or one of {', '.join(sorted(known))}")
        return known[spec]
    module_name, _, attribute = spec.partition(":")
    try:
        target = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as err:
        raise ConformanceImplError(f"--impl {spec!r}: cannot load it ({type(err).__name__}: {err})") from None
    if not isinstance(target, Implementation) and callable(target):
        target = target()
    if not isinstance(target, Implementation):
        raise ConformanceImplError(f"--impl {spec!r} is a {type(target).__name__}; decorate the factory with "
                                   f"moe_ref.conformance.implementation(...) or return an Implementation")
    return target if target.spec else Implementation(**{**vars(target), "spec": spec})
