"""transformers, imported when an integration needs it: the one place that says which version is required and
raises ENV022 (``OptionalDependencyError``) when it is missing or too old."""
from __future__ import annotations

from types import ModuleType

from moe_ref.core.errors import OptionalDependencyError

MIN_VERSION = (5, 0)


def require_transformers() -> ModuleType:
    """The ``transformers`` module (5.x: fused experts modules and ``transformers.integrations.moe``'s
    ExpertsInterface), or ``OptionalDependencyError`` (ENV022) naming what is missing."""
    try:
        import transformers
    except ImportError as err:
        raise OptionalDependencyError(f"moe_ref.integrations.transformers needs transformers >= "
                                      f"{'.'.join(map(str, MIN_VERSION))} ({err}); pip install 'transformers>=5'",
                                      package="transformers") from None
    version = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    if version < MIN_VERSION:
        raise OptionalDependencyError(
            f"moe_ref.integrations.transformers needs transformers >= {'.'.join(map(str, MIN_VERSION))} (its fused "
            f"experts modules and ExpertsInterface); transformers {transformers.__version__} is installed: "
            f"pip install -U 'transformers>=5'", package="transformers", version=transformers.__version__)
    return transformers
