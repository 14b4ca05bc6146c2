"""The one launch path of moe_ref's Triton kernels: Triton's own launcher the first time a shape key is seen, the
compiled kernel bound directly after.

    launch(kernel, grid, *args, **kwargs)     # same arguments as kernel[grid](*args, **kwargs)

Why: ``kernel[grid](...)`` binds and specializes every argument on every call (Triton's binder, its cache key, its
launch hooks' metadata, a TMA descriptor's specialization) before it reaches the compiled launcher; an eager layer
call launches a dozen kernels, several with many arguments and TMA descriptors. How much this saves, per launch and
per layer call: ``scripts/bench_launch.py``, ``scripts/bench_eager.py --ab-bound-launch``, docs/RESULTS.md.

How: the first launch of a key goes through ``kernel[grid]``, which compiles (or finds) the kernel and returns it;
that ``CompiledKernel`` is kept under the key, and later launches of the key call its launcher with the arguments
in the kernel's parameter order (Triton's launcher takes every parameter, constexprs included, and skips those
it compiled in). The key is at least as specific as Triton's own specialization, so a bound kernel is never run
on arguments Triton would have compiled differently:

| argument                  | key entry                                                          |
|---------------------------|--------------------------------------------------------------------|
| tensor                    | dtype, 16-byte aligned base (Triton's ``tt.divisibility``)          |
| int                       | == 1, divisible by 16, 32- or 64-bit range (Triton specializes on all three) |
| float                     | the type only (passed as fp32, never specialized)                    |
| host TMA descriptor       | base dtype and alignment, block shape, shape, strides, padding     |
| keyword argument (constexprs, launch options such as ``num_warps``) | the value itself            |
| anything else                                            | the value itself                          |

Each key is computed by a function generated for the argument classes of a kernel's first launch
(``_key_function``, as Triton generates its binder), in one expression instead of a call per argument; a launch
with other classes is keyed argument by argument (``_arg_key``), to the same key.

Constexprs must come by keyword and the other parameters by position (as every moe_ref launcher passes them);
a launch that mixes them is not bound (Triton's path every call).

Not bound (Triton's path every call): the CPU interpreter (``TRITON_INTERPRET=1``), while Triton's launch hooks
are set (a profiler such as proton), and with ``MOE_REF_BOUND_LAUNCH=0``.
"""
from __future__ import annotations

from typing import Any

import torch
import triton

from moe_ref.core import envs
from moe_ref.kernels._triton_utils import is_interpreter

try:  # Triton >= 3.3 keeps the launch hooks in knobs; older ones on CompiledKernel
    from triton import knobs as _knobs

    _runtime_knobs = _knobs.runtime
except ImportError:  # pragma: no cover - older Triton
    _runtime_knobs = None

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - Triton without host descriptors
    TensorDescriptor = None

__all__ = ["launch", "bound_kernels", "clear_bound_kernels"]

_INT32_MIN, _INT32_MAX, _INT64_MAX = -(2 ** 31), 2 ** 31 - 1, 2 ** 63 - 1

# (id of the kernel, device, the arguments' keys, the keyword items) -> _Bound, or _TRITON for a launch the key
# cannot describe (a constexpr by position, another parameter by keyword)
_BOUND: dict[tuple, "_Bound"] = {}
_TRITON = object()
# (id of the kernel, number of positional arguments) -> the key function of the classes its first launch passed
_KEY_FUNCTIONS: dict[tuple, Any] = {}


class _Bound:
    """A compiled kernel's launcher, and the values of the parameters after the positional ones (keywords and
    defaults: constant under one key, since the keywords are part of it)."""

    __slots__ = ("kernel", "compiled", "run", "function", "packed_metadata", "tail")

    def __init__(self, compiled, kernel, num_args: int, kwargs: dict):
        self.kernel, self.compiled = kernel, compiled
        self.run, self.function, self.packed_metadata = compiled.run, compiled.function, compiled.packed_metadata
        self.tail = tuple(kwargs[p.name] if p.name in kwargs else p.default for p in kernel.params[num_args:])


def _bindable(kernel, num_args: int, kwarg_names) -> bool:
    """Whether the key describes this launch: positional arguments are keyed as Triton specializes them, keywords
    by their value, so constexprs must come by keyword and the other parameters by position."""
    params = kernel.params
    by_name = {p.name: p for p in params}
    return (not any(p.is_constexpr for p in params[:num_args])
            and all(name not in by_name or by_name[name].is_constexpr for name in kwarg_names))


def _arg_key(value: Any):
    """What Triton specializes on in one argument (the table of the module docstring)."""
    kind = value.__class__
    if kind is torch.Tensor or isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() & 15 == 0
    if kind is int:
        return value == 1, value & 15 == 0, 0 if _INT32_MIN <= value <= _INT32_MAX else 1 if value <= _INT64_MAX else 2
    if kind is float:
        return float
    if TensorDescriptor is not None and kind is TensorDescriptor:
        return (value.base.dtype, value.base.data_ptr() & 15 == 0, tuple(value.block_shape), tuple(value.shape),
                tuple(value.strides), getattr(value, "padding", None))
    return value


# the source of one argument's key in a generated key function, by the argument's class (see _arg_key)
_TENSOR_KEY = "({a}.dtype, {a}.data_ptr() & 15 == 0)"
_INT_KEY = "({a} == 1, {a} & 15 == 0, 0 if {lo} <= {a} <= {hi} else 1 if {a} <= {max} else 2)"
_DESCRIPTOR_KEY = ("({a}.base.dtype, {a}.base.data_ptr() & 15 == 0, tuple({a}.block_shape), tuple({a}.shape), "
                   "tuple({a}.strides), getattr({a}, 'padding', None))")


def _key_function(args: tuple):
    """A function of the launch arguments that returns ``tuple(map(_arg_key, args))`` for arguments of the same
    classes as ``args``, and None for any other classes (the caller then keys them one by one with ``_arg_key``).

    Why: the generic key costs one Python call and a chain of class tests per argument, as much as Triton's own
    binder; a function generated for a launch's argument classes (as Triton generates its binder) computes the same
    key in one expression. Example: for ``(tensor, 100, 0.5)`` it is
    ``lambda a0, a1, a2: ((a0.dtype, a0.data_ptr() & 15 == 0), (a1 == 1, ...), float) if a0.__class__ is T0 and
    a1.__class__ is int and a2.__class__ is float else None``.
    """
    names = [f"a{i}" for i in range(len(args))]
    classes, parts = {}, []
    for i, (name, value) in enumerate(zip(names, args)):
        kind = value.__class__
        classes[f"c{i}"] = kind
        if kind is torch.Tensor or isinstance(value, torch.Tensor):
            parts.append(_TENSOR_KEY.format(a=name))
        elif kind is int:
            parts.append(_INT_KEY.format(a=name, lo=_INT32_MIN, hi=_INT32_MAX, max=_INT64_MAX))
        elif kind is float:
            parts.append("float")
        elif TensorDescriptor is not None and kind is TensorDescriptor:
            parts.append(_DESCRIPTOR_KEY.format(a=name))
        else:  # None, a bool, a string, a dtype: keyed by the value itself, as _arg_key does
            parts.append(name)
    guard = " and ".join(f"{name}.__class__ is c{i}" for i, name in enumerate(names)) or "True"
    source = (f"def key({', '.join(names)}):\n"
              f"    return ({''.join(part + ', ' for part in parts)}) if {guard} else None\n")
    namespace = dict(classes)
    exec(source, namespace)  # noqa: S102 - built from the fixed templates above, no outside text
    return namespace["key"]


def _current_device() -> int:
    return torch.cuda.current_device()


def _current_stream(device: int) -> int:
    """The raw handle of ``device``'s current stream, as Triton's launcher takes it (Triton's own call, looked up
    once: ``driver.active`` is a lazy proxy)."""
    global _stream_of
    if _stream_of is None:
        _stream_of = triton.runtime.driver.active.get_current_stream
    return _stream_of(device)


_stream_of = None


def _hooks_set() -> bool:
    """Whether a launch hook is installed (Triton >= 3.5 keeps them in chains that are never None, empty when
    no hook is added)."""
    if _runtime_knobs is None:
        return True  # an older Triton: keep its own path
    return _hook_active(_runtime_knobs.launch_enter_hook) or _hook_active(_runtime_knobs.launch_exit_hook)


def _hook_active(hook) -> bool:
    return hook is not None and bool(getattr(hook, "calls", True))


def launch(kernel, grid: tuple, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, with the compiled kernel bound after the first launch of a key.

    Args:
        kernel: a ``@triton.jit`` function (not an autotuner: launch the config it chose, as
            ``kernels.grouped_mlp.launch_gemm`` does).
        grid: a tuple of 1 to 3 ints (a callable grid is not bound: it goes through Triton every call).
        args, kwargs: the kernel's arguments, launch options (``num_warps``, ...) among the kwargs.

    Returns:
        the compiled kernel (``CompiledKernel``) on a GPU, whatever Triton returns under the interpreter.
    """
    if callable(grid) or is_interpreter() or _hooks_set() or not envs.bound_launch():
        return kernel[grid](*args, **kwargs)
    device = _current_device()
    try:  # id(kernel): a JITFunction hashes in Python
        key_function = _KEY_FUNCTIONS.get((id(kernel), len(args)))
        if key_function is None:
            key_function = _KEY_FUNCTIONS[(id(kernel), len(args))] = _key_function(args)
        arg_keys = key_function(*args)
        if arg_keys is None:  # other argument classes than the first launch's
            arg_keys = tuple(map(_arg_key, args))
        key = (id(kernel), device, arg_keys, *kwargs.items())
        bound = _BOUND.get(key)
    except TypeError:  # an unhashable keyword value: Triton's own path
        return kernel[grid](*args, **kwargs)
    if bound is None or (bound is not _TRITON and bound.kernel is not kernel):  # new, or an id reused by another
        compiled = kernel[grid](*args, **kwargs)
        _BOUND[key] = _Bound(compiled, kernel, len(args), kwargs) if _bindable(kernel, len(args), kwargs) else _TRITON
        return compiled
    if bound is _TRITON:
        return kernel[grid](*args, **kwargs)
    size = len(grid)
    bound.run(grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1, _current_stream(device),
              bound.function, bound.packed_metadata, None, None, None, *args, *bound.tail)
    return bound.compiled


def bound_kernels() -> int:
    """How many (kernel, key) pairs launch through a bound compiled kernel (for tests)."""
    return sum(bound is not _TRITON for bound in _BOUND.values())


def clear_bound_kernels() -> None:
    """Forget every bound kernel (the next launch of each key goes through Triton again)."""
    _BOUND.clear()
    _KEY_FUNCTIONS.clear()
