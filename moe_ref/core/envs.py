"""Every environment variable moe_ref reads, in one place (read only, never written).

| variable                           | meaning                                              | default |
|------------------------------------|------------------------------------------------------|---------|
| MOE_REF_NUM_MAX_TOKENS_PER_RANK    | per-rank cap when the caller passes none             | unset   |
| MOE_REF_OVERFLOW_POLICY            | ``error`` or ``chunk`` when the caller passes none   | error   |
| MOE_REF_TRANSPORT                  | ``auto``, ``symm``, ``a2a`` or ``local``             | auto    |
| MOE_REF_EXPERTS_BACKEND            | ``auto``, ``torch``, ``grouped_mm``, ``triton``, ``deep_gemm`` | auto |
| MOE_REF_POOL_FORMAT                | ``contiguous`` or ``masked`` receive pool            | contiguous |
| MOE_REF_SHM_DIR                    | folder for the CPU symmetric heap's files            | /dev/shm |
| MOE_REF_DEBUG                      | ``moe-ref`` shows tracebacks of coded errors (1/0)   | off     |
| MOE_REF_DEBUG_CHECKS               | ``1``: per-call conservation checks (nothing lost)   | 0       |
| MOE_REF_NATIVE                     | ``0``: the CPU EP path runs the torch twins, not the compiled ops | 1 |
| MOE_REF_TMA                        | ``0``: the grouped MLP kernel loads tiles with pointers, not TMA descriptors | 1 |
| MOE_REF_EAGER_GRAPH_MAX_TOKENS     | largest T whose eager calls replay a CUDA graph of their shape (one rank on CUDA; 0: never) | min(1024, cap) |
| MOE_REF_BOUND_LAUNCH               | ``0``: Triton launches go through Triton's own launcher, and the grouped MLP's through its autotuner where no tile table applies (not the kernel and config bound for the shape key); read at the process's first Triton launch (``moe_ref.kernels.runtime.launch.bound_launches(False)`` switches it in code) | 1 |
| MOE_REF_AUTOTUNE                   | ``1``: the grouped MLP kernel autotunes at the first launch of each shape key, also where its GPU class has a recorded tile table (``moe_ref.kernels.experts.tile_table``) | 0 |
| MOE_REF_PROGRESS                   | ``1``: progress bars always; ``0``: never            | on a terminal only |
| MOE_REF_BATCH_INVARIANT            | ``1``: batch-invariant layers when the caller passes none (docs/batch_invariance.md) | 0 |
| MOE_REF_W4A8_ROWS_PER_EXPERT       | INT4/MXFP4 experts run W4A8 (fp8 rows, fp8 MMAs) from this many routed rows per local expert on (``W4A16Experts``) | unset: never |

Switches (``SWITCHES``: ``MOE_REF_DEBUG``, ``MOE_REF_DEBUG_CHECKS``, ``MOE_REF_NATIVE``, ``MOE_REF_TMA``,
``MOE_REF_BOUND_LAUNCH``, ``MOE_REF_AUTOTUNE``, ``MOE_REF_PROGRESS``, ``MOE_REF_BATCH_INVARIANT``) take ``1``, ``true``,
``yes``, ``on`` or ``0``, ``false``, ``no``, ``off`` (any case, surrounding spaces ignored); an empty value is
unset. Anything else raises ``EnvVarError`` (CFG017) naming the variable: a typo must not silently pick a side.
Reading an option (the policy, transport, backend, pool format, cap: every layer construction does) checks every
switch, so a bad value is refused on any device, also one whose path never reads that switch (a CPU layer and
``MOE_REF_TMA``). The named choices (policy, transport, backend, pool format) are read in any case, like the
switches: ``MOE_REF_OVERFLOW_POLICY=Chunk`` is ``chunk``.
"""
from __future__ import annotations

import os
import sys

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")
SWITCHES = ("MOE_REF_DEBUG", "MOE_REF_DEBUG_CHECKS", "MOE_REF_NATIVE", "MOE_REF_TMA", "MOE_REF_BOUND_LAUNCH",
            "MOE_REF_AUTOTUNE", "MOE_REF_PROGRESS", "MOE_REF_BATCH_INVARIANT")


def _get(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


# (name, raw value) -> the switch's value, for values already parsed: some switches are read on every kernel launch
_SWITCH_VALUES: dict[tuple[str, str | None], bool | None] = {}


def _switch(name: str) -> bool | None:
    """A switch's value: None when unset or empty, else on/off (see the module docstring); CFG017 otherwise."""
    value = os.environ.get(name)
    known = _SWITCH_VALUES.get((name, value), _UNPARSED)
    if known is not _UNPARSED:
        return known
    _SWITCH_VALUES[(name, value)] = parsed = _parse_switch(name, value)
    return parsed


_UNPARSED = object()


def _parse_switch(name: str, value: str | None) -> bool | None:
    if value is None or not value.strip():
        return None
    word = value.strip().lower()
    if word in _ON:
        return True
    if word in _OFF:
        return False
    from moe_ref.core.errors import EnvVarError

    raise EnvVarError(f"{name}={value!r} is not a switch value; set {name} to one of {', '.join(_ON)} (on) or "
                      f"{', '.join(_OFF)} (off), or unset it", field=name)


def check_switches() -> None:
    """Parse every switch of ``SWITCHES``; ``EnvVarError`` (CFG017) for the first with another value."""
    for name in SWITCHES:
        _switch(name)


def _option(name: str) -> str | None:
    """A named choice's value, stripped and lower-cased (None when unset or empty), after ``check_switches``."""
    check_switches()
    value = _get(name)
    return None if value is None or not value.strip() else value.strip().lower()


def _integer(name: str, hint: str = "") -> int | None:
    """An integer variable's value (None when unset or empty), after ``check_switches``; ``InvalidConfigError``
    naming it when it is not an integer."""
    check_switches()
    value = _get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        from moe_ref.core.errors import InvalidConfigError

        raise InvalidConfigError(f"{name}={value!r} is not an integer{hint}") from None


def w4a8_rows_per_expert() -> float | None:
    """``MOE_REF_W4A8_ROWS_PER_EXPERT``: from this many routed rows per local expert on, 4-bit experts run W4A8; None
    (unset or empty): W4A16 always. ``InvalidConfigError`` naming it when it is not a number >= 0."""
    check_switches()
    value = _get("MOE_REF_W4A8_ROWS_PER_EXPERT")
    if value is None or not value.strip():
        return None
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not number >= 0:  # NaN fails too
        from moe_ref.core.errors import InvalidConfigError

        raise InvalidConfigError(f"MOE_REF_W4A8_ROWS_PER_EXPERT={value!r} is not a number >= 0 (routed rows per local "
                                 f"expert from which INT4/MXFP4 experts run W4A8); unset it for W4A16 always")
    return number


def num_max_tokens_per_rank() -> int | None:
    return _integer("MOE_REF_NUM_MAX_TOKENS_PER_RANK")


def eager_graph_max_tokens() -> int | None:
    return _integer("MOE_REF_EAGER_GRAPH_MAX_TOKENS", " (0 turns the eager CUDA graphs off)")


def overflow_policy() -> str | None:
    return _option("MOE_REF_OVERFLOW_POLICY")


def transport() -> str | None:
    return _option("MOE_REF_TRANSPORT")


def experts_backend() -> str | None:
    return _option("MOE_REF_EXPERTS_BACKEND")


def pool_format() -> str | None:
    return _option("MOE_REF_POOL_FORMAT")


def shm_dir() -> str:
    return _get("MOE_REF_SHM_DIR") or "/dev/shm"


def debug_checks() -> bool | None:
    return _switch("MOE_REF_DEBUG_CHECKS")


def batch_invariant() -> bool | None:
    return _switch("MOE_REF_BATCH_INVARIANT")


def native_ops() -> tuple[bool, str | None]:
    """(whether the compiled CPU ops may be used, the raw value): ``MOE_REF_NATIVE=0`` forces the torch twins."""
    return _switch("MOE_REF_NATIVE") is not False, _get("MOE_REF_NATIVE")


def tma() -> bool:
    """``MOE_REF_TMA=0`` keeps the grouped MLP kernel on pointer loads (TMA descriptors otherwise, where possible)."""
    return _switch("MOE_REF_TMA") is not False


def bound_launch() -> bool:
    """``MOE_REF_BOUND_LAUNCH=0`` sends Triton launches through Triton's own launcher and the grouped MLP's
    through its autotuner; by default later launches of a shape key call the compiled kernel (and the config the
    autotuner chose) directly (``moe_ref.kernels.runtime.launch``, which reads the switch at the process's first launch)."""
    return _switch("MOE_REF_BOUND_LAUNCH") is not False


def autotune() -> bool:
    """``MOE_REF_AUTOTUNE=1``: the grouped MLP kernel autotunes each new shape key, ignoring the recorded tile table
    (how ``scripts/tune_tiles.py`` records one); by default a GPU class with a table launches its tiles."""
    return _switch("MOE_REF_AUTOTUNE") is True


def debug() -> bool:
    """``MOE_REF_DEBUG`` on: the CLI shows tracebacks."""
    return _switch("MOE_REF_DEBUG") is True


def progress() -> bool | None:
    """``MOE_REF_PROGRESS``: True draws progress bars, False never; None (unset): on a terminal only."""
    return _switch("MOE_REF_PROGRESS")


def show_progress(stream=None) -> bool:
    """Whether to draw progress bars on ``stream`` (default stderr): ``MOE_REF_PROGRESS`` when set, else only
    when ``stream`` is a terminal (a bar redrawn into a log file or a pipe is noise)."""
    forced = progress()
    if forced is not None:
        return forced
    stream = sys.stderr if stream is None else stream
    return bool(getattr(stream, "isatty", lambda: False)())


def launcher_rank() -> int:
    """``RANK`` as set by torchrun (0 when unset), for output before the process group exists."""
    value = _get("RANK")
    return int(value) if value is not None and value.isdigit() else 0
