"""The one launch path of moe_ref's Triton kernels: Triton's own launcher the first time a shape key is seen, the
compiled kernel's launcher called directly after.

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

| argument                  | key entries                                                        |
|---------------------------|--------------------------------------------------------------------|
| tensor                    | dtype, on a GPU or not, 16-byte aligned base (Triton's ``tt.divisibility``) |
| int                       | == 1, divisible by 16, 32- or 64-bit range (Triton specializes on all three) |
| float                     | the type only (passed as fp32, never specialized)                    |
| host TMA descriptor       | base dtype, device and alignment, block shape, shape, strides, padding |
| keyword argument (constexprs, launch options such as ``num_warps``) | the value itself            |
| anything else                                            | the value itself                          |

plus the current device. ``_arg_key`` states the table argument by argument; the launch path computes the same key
with a function generated for the argument classes of a kernel's first launch (``_key_function``, one expression,
as Triton generates its binder; a launch with other classes gets a function of its own).

What a bound launch saves beyond the key, each measured by ``scripts/bench_launch.py``:
- tensors reach the launcher as the addresses the key function has already read: for a tensor Triton's C launcher
  calls ``data_ptr()`` and asks the driver for the device pointer (``cuPointerGetAttribute``), for an int it takes
  the value. A key holding a tensor that is not on a GPU is never bound (Triton's path checks those every call);
- on Triton versions whose launcher object only allocates the kernel's scratch memory and then calls its C
  launcher (Triton 3.6: ``CudaLauncher.__call__``, recognized by its source), a kernel that needs no scratch calls
  the C launcher directly (``_c_launcher``); elsewhere the launcher object is called.
- host TMA descriptors are encoded once per base address: Triton 3.6 wraps the C launcher of a kernel that takes
  them in a loop that encodes each descriptor again at every launch (``cuTensorMapEncodeTiled``, with its shape and
  strides); a bound kernel calls the C launcher itself with encodings it keeps (``_EncodedDescriptors``: exact,
  since the key fixes everything in the encoding but the base address). The grouped MLP's GEMMs take two each.

Constexprs must come by keyword and the other parameters by position (as every moe_ref launcher passes them);
a launch that mixes them is not bound (Triton's path every call).

Not bound (Triton's path every call): the CPU interpreter (``TRITON_INTERPRET=1``), while Triton's launch hooks
are set (a profiler such as proton), and while bound launches are off: ``MOE_REF_BOUND_LAUNCH=0``, read at the
process's first launch (reading the environment at every launch would cost about as much as the rest of a bound
launch's key), or ``with bound_launches(False):`` in code (an A/B in one process; the keys bound so far are kept).
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import triton

from moe_ref.core import envs
from moe_ref.kernels.runtime._triton_utils import is_interpreter

try:  # Triton >= 3.3 keeps the launch hooks in knobs; older ones on CompiledKernel
    from triton import knobs as _knobs

    _runtime_knobs = _knobs.runtime
except ImportError:  # pragma: no cover - older Triton
    _runtime_knobs = None

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - Triton without host descriptors
    TensorDescriptor = None

__all__ = ["launch", "bound_launches", "bound_launches_on", "bound_kernels", "clear_bound_kernels",
           "descriptor_encodings"]

_INT32_MIN, _INT32_MAX, _INT64_MAX = -(2 ** 31), 2 ** 31 - 1, 2 ** 63 - 1

# (id of the kernel, number of positional arguments, keyword names...) -> the kernel's _Sites for such launches
_SITES: dict[tuple, "_Sites"] = {}
_TRITON = object()  # a key whose launches stay on Triton's path (a tensor not on a GPU)


class _Sites:
    """The bound launches of one kernel for one argument count and set of keyword names: per argument classes met,
    the generated key function and its keys' bound kernels (or ``_TRITON``). ``bindable`` False: the key cannot
    describe these launches (a constexpr by position, another parameter by keyword), Triton's path every call."""

    __slots__ = ("kernel", "bindable", "entries")

    def __init__(self, kernel, num_args: int, kwargs: dict):
        self.kernel, self.entries = kernel, []
        self.bindable = _bindable(kernel, num_args, kwargs)


class _Bound:
    """A compiled kernel's launcher and the arguments around the kernel's positional ones: ``call(gridX, gridY,
    gridZ, stream, function, *middle, *args, *tail)`` launches it. ``tail``: the parameters after the positional
    ones (keywords and defaults: constant under one key, since the keywords are part of it). ``descriptors``: None,
    or the kernel's host TMA descriptors encoded once per base address (``_EncodedDescriptors``), which turn
    ``args`` into what the C launcher takes."""

    __slots__ = ("kernel", "compiled", "call", "function", "middle", "tail", "descriptors")

    def __init__(self, compiled, kernel, num_args: int, kwargs: dict):
        self.kernel, self.compiled = kernel, compiled
        launcher = compiled.run
        self.function = compiled.function
        self.descriptors = None
        c_launcher = _c_launcher(launcher)
        if c_launcher is not None:  # what CudaLauncher.__call__ passes when the kernel needs no scratch memory
            self.call = c_launcher
            self.middle = (launcher.launch_cooperative_grid, launcher.launch_pdl, None, None,
                           compiled.packed_metadata, None, None, None)
            unwrapped = _descriptor_wrapper_parts(c_launcher, num_args) if _keep_encodings else None
            if unwrapped is not None:  # the C launcher itself, the descriptors encoded here once per base
                self.call, self.descriptors = unwrapped
        else:
            self.call, self.middle = launcher, (compiled.packed_metadata, None, None, None)
        self.tail = tuple(kwargs[p.name] if p.name in kwargs else p.default for p in kernel.params[num_args:])


class _EncodedDescriptors:
    """A bound kernel's host TMA descriptor arguments (at ``positions`` among its positional arguments), encoded as
    Triton's launcher wrapper encodes them (``encode(descriptor, metadata)`` -> the CUtensorMap, shape and strides
    the C launcher takes), but once per tuple of base addresses instead of at every launch.

    Why this is exact: under one key a descriptor's block shape, shape, strides, padding and base dtype are fixed
    (``_arg_key``) and so is the compiled kernel's descriptor metadata, so its encoding depends on its base address
    alone. The C launcher copies the CUtensorMap into the kernel's parameters at each launch, so one encoding serves
    every launch. At most ``MAX_BASES`` address tuples are kept per bound kernel (then the record starts afresh)."""

    MAX_BASES = 64
    __slots__ = ("positions", "metadata", "encode", "encoded")

    def __init__(self, positions: tuple, metadata: tuple, encode):
        self.positions, self.metadata, self.encode = positions, metadata, encode
        self.encoded: dict[tuple, list] = {}

    def expand(self, args: tuple) -> list:
        """The launcher's arguments: ``args`` with each descriptor replaced by its encoding's entries."""
        bases = tuple([args[i].base.data_ptr() for i in self.positions])
        parts = self.encoded.get(bases)
        if parts is None:
            if len(self.encoded) >= self.MAX_BASES:
                self.encoded.clear()
            parts = self.encoded[bases] = [tuple(self.encode(args[i], meta))
                                           for i, meta in zip(self.positions, self.metadata)]
        out, start = [], 0
        for i, part in zip(self.positions, parts):
            out += args[start:i]
            out += part
            start = i + 1
        out += args[start:]
        return out


# the loop of Triton 3.6's ``wrap_handle_tensordesc`` (``inner``), which encodes every host TMA descriptor argument
# again at each launch before calling the C launcher
_DESCRIPTOR_LOOP = "final_args.extend(make_tensordesc_arg(arg, tensordesc_meta[tensordesc_idx]))"
_DESCRIPTOR_WRAPPERS: dict[Any, bool] = {}  # code object -> whether it is that wrapper


def _descriptor_wrapper_parts(launch_fn, num_args: int):
    """(the C launcher, ``_EncodedDescriptors``) where ``launch_fn`` is Triton 3.6's descriptor wrapper around the C
    launcher (recognized by its closure and source) and every descriptor is a positional argument with compiled
    metadata; None otherwise (the wrapper is called as it is)."""
    code = getattr(launch_fn, "__code__", None)
    if code is None or launch_fn.__closure__ is None:
        return None
    known = _DESCRIPTOR_WRAPPERS.get(code)
    if known is None:
        import inspect

        try:
            source = " ".join(inspect.getsource(launch_fn).split())
        except (OSError, TypeError):
            source = ""
        known = _DESCRIPTOR_WRAPPERS[code] = (
            set(code.co_freevars) == {"launcher", "tensordesc_indices", "tensordesc_meta"}
            and _DESCRIPTOR_LOOP in source and launch_fn.__globals__.get("_BASE_ARGS_FORMAT_LEN") == 13
            and callable(launch_fn.__globals__.get("make_tensordesc_arg")))
    if not known:
        return None
    cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in launch_fn.__closure__)))
    positions, metadata = tuple(sorted(cells["tensordesc_indices"])), tuple(cells["tensordesc_meta"] or ())
    if (len(metadata) != len(positions) or any(meta is None for meta in metadata)
            or any(i >= num_args for i in positions)):
        return None
    return cells["launcher"], _EncodedDescriptors(positions, metadata, launch_fn.__globals__["make_tensordesc_arg"])


# the call Triton 3.6's CudaLauncher.__call__ ends with, after allocating the kernel's scratch memory
_LAUNCHER_CALL = ("self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, "
                  "self.launch_pdl, global_scratch, profile_scratch, *args)")
_DIRECT_LAUNCHER_CLASSES: dict[type, bool] = {}


def _c_launcher(launcher):
    """The C launcher behind Triton's launcher object when calling it directly is what the object would do: the
    object is Triton 3.6's kind (its ``__call__(gridX, gridY, gridZ, stream, function, *args)`` allocates the global
    and profile scratch, None when the kernel needs none, then makes ``_LAUNCHER_CALL``) and this kernel needs no
    scratch. None otherwise (the launcher object is called: other Triton versions, a kernel with scratch)."""
    kind = type(launcher)
    known = _DIRECT_LAUNCHER_CLASSES.get(kind)
    if known is None:
        import inspect

        try:
            source = " ".join(inspect.getsource(kind.__call__).split())
            params = list(inspect.signature(kind.__call__).parameters)
        except (OSError, TypeError, ValueError):  # no source (a C type, a stand-in): call the object
            source, params = "", []
        known = _DIRECT_LAUNCHER_CLASSES[kind] = (
            params == ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"] and _LAUNCHER_CALL in source)
    if not known or getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1):
        return None
    return launcher.launch


def _bindable(kernel, num_args: int, kwarg_names) -> bool:
    """Whether the key describes this launch: positional arguments are keyed as Triton specializes them, keywords
    by their value, so constexprs must come by keyword and the other parameters by position."""
    params = kernel.params
    by_name = {p.name: p for p in params}
    return (not any(p.is_constexpr for p in params[:num_args])
            and all(name not in by_name or by_name[name].is_constexpr for name in kwarg_names))


def _arg_key(value: Any) -> tuple:
    """What Triton specializes on in one argument (the table of the module docstring), as a tuple of key entries.
    The key of a launch is ``(device, *kwargs.values(), *entries of each argument)``; ``_key_function`` generates
    the code that computes it (tests/unit/test_bound_launch.py checks the two agree)."""
    kind = value.__class__
    if kind is torch.Tensor or isinstance(value, torch.Tensor):
        return value.dtype, value.is_cuda, value.data_ptr() & 15 == 0
    if kind is int:
        return (value == 1, value & 15 == 0,
                0 if _INT32_MIN <= value <= _INT32_MAX else 1 if value <= _INT64_MAX else 2)
    if kind is float:
        return (float,)
    if TensorDescriptor is not None and kind is TensorDescriptor:
        base = value.base
        return (base.dtype, base.is_cuda, base.data_ptr() & 15 == 0, tuple(value.block_shape), tuple(value.shape),
                tuple(value.strides), getattr(value, "padding", None))
    return (value,)


# the source of one argument's key entries in a generated key function, by the argument's class (see _arg_key);
# a tensor's address is read once, into p{i}, for the key and for the launcher
_TENSOR_KEY = "{a}.dtype, {a}.is_cuda, ({p} := {a}.data_ptr()) & 15 == 0"
_INT_KEY = "{a} == 1, {a} & 15 == 0, 0 if {lo} <= {a} <= {hi} else 1 if {a} <= {max} else 2"
_DESCRIPTOR_KEY = ("{a}.base.dtype, {a}.base.is_cuda, {a}.base.data_ptr() & 15 == 0, tuple({a}.block_shape), "
                   "tuple({a}.shape), tuple({a}.strides), getattr({a}, 'padding', None)")


def _key_function(args: tuple):
    """A function ``key(device, kwargs, *args)`` that, for arguments of the same classes as ``args``, returns the
    launch's key ``(device, *kwargs.values(), *entries)`` (entries as ``_arg_key``) and the arguments to hand the
    launcher (each tensor replaced by its address); None for arguments of other classes.

    Why: computing the key argument by argument costs one Python call and a chain of class tests per argument, as
    much as Triton's own binder; a function generated for a launch's argument classes (as Triton generates its
    binder) computes it in one expression. Example: for ``(tensor, 100, 0.5)`` it is ``def key(device, kwargs, a0,
    a1, a2): return ((device, *kwargs.values(), a0.dtype, a0.is_cuda, (p0 := a0.data_ptr()) & 15 == 0, a1 == 1,
    ..., float), (p0, a1, a2)) if a0.__class__ is c0 and a1.__class__ is c1 and a2.__class__ is c2 else None``.
    """
    names = [f"a{i}" for i in range(len(args))]
    classes, entries, passed = {}, [], []
    for i, (name, value) in enumerate(zip(names, args)):
        kind = value.__class__
        classes[f"c{i}"] = kind
        if kind is torch.Tensor or isinstance(value, torch.Tensor):
            entries.append(_TENSOR_KEY.format(a=name, p=f"p{i}"))
            passed.append(f"p{i}")
            continue
        if kind is int:
            entries.append(_INT_KEY.format(a=name, lo=_INT32_MIN, hi=_INT32_MAX, max=_INT64_MAX))
        elif kind is float:
            entries.append("float")
        elif TensorDescriptor is not None and kind is TensorDescriptor:
            entries.append(_DESCRIPTOR_KEY.format(a=name))
        else:  # None, a bool, a string, a dtype: keyed by the value itself, as _arg_key does
            entries.append(name)
        passed.append(name)
    guard = " and ".join(f"{name}.__class__ is c{i}" for i, name in enumerate(names)) or "True"
    source = (f"def key(device, kwargs, {', '.join(names)}):\n"
              f"    return ((device, *kwargs.values(), {', '.join(entries)}), ({''.join(p + ', ' for p in passed)}))"
              f" if {guard} else None\n")
    namespace = dict(classes)
    exec(source, namespace)  # noqa: S102 - built from the fixed templates above, no outside text
    return namespace["key"]


def _on_gpu(args: tuple) -> bool:
    """Whether every tensor argument is on a GPU (a key of such arguments may be bound; see the module doc)."""
    return all(value.is_cuda for value in args if isinstance(value, torch.Tensor))


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
    if callable(grid) or not (_on if _on is not None else bound_launches_on()) or is_interpreter() or _hooks_set():
        return kernel[grid](*args, **kwargs)
    sites = _SITES.get((id(kernel), len(args), *kwargs))
    if sites is None or sites.kernel is not kernel:  # new, or an id reused by another kernel (a JITFunction
        sites = _SITES[(id(kernel), len(args), *kwargs)] = _Sites(kernel, len(args), kwargs)  # hashes in Python)
    if not sites.bindable:
        return kernel[grid](*args, **kwargs)
    device = _current_device()
    for key_function, bound_of in sites.entries:
        keyed = key_function(device, kwargs, *args)
        if keyed is not None:
            break
    else:  # argument classes not met before
        key_function, bound_of = _key_function(args), {}
        sites.entries.append((key_function, bound_of))
        keyed = key_function(device, kwargs, *args)
    key, launcher_args = keyed
    try:
        bound = bound_of.get(key)
    except TypeError:  # an unhashable keyword value: Triton's own path
        return kernel[grid](*args, **kwargs)
    if bound is None:
        compiled = kernel[grid](*args, **kwargs)
        bound_of[key] = _Bound(compiled, kernel, len(args), kwargs) if _on_gpu(args) else _TRITON
        return compiled
    if bound is _TRITON:
        return kernel[grid](*args, **kwargs)
    if bound.descriptors is not None:
        launcher_args = bound.descriptors.expand(launcher_args)
    size = len(grid)
    bound.call(grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1, _current_stream(device),
               bound.function, *bound.middle, *launcher_args, *bound.tail)
    return bound.compiled


_on: bool | None = None  # bound launches on or off; None: MOE_REF_BOUND_LAUNCH not read yet


def bound_launches_on() -> bool:
    """Whether Triton launches bind (``MOE_REF_BOUND_LAUNCH``, read at the first call, unless ``bound_launches``
    set it); the grouped MLP reuses its autotuned config per shape key under the same switch."""
    global _on
    if _on is None:
        _on = envs.bound_launch()
    return _on


@contextlib.contextmanager
def bound_launches(on: bool):
    """Bound launches on or off inside the ``with`` (an A/B in one process: ``scripts/bench_eager.py``), the previous
    state after, also on an exception. Keys bound before stay bound for later launches."""
    global _on
    saved, _on = _on, bool(on)
    try:
        yield
    finally:
        _on = saved


_keep_encodings = True  # bound kernels made from now on keep their descriptors' encodings (descriptor_encodings)


@contextlib.contextmanager
def descriptor_encodings(keep: bool):
    """Kernels bound inside the ``with`` keep their host TMA descriptors' encodings per base address (``keep``, the
    default) or leave the encoding to Triton's launcher wrapper at every launch (the path before encodings were kept:
    an A/B in one process, ``scripts/bench_launch.py``). Kernels bound earlier keep their way: call
    ``clear_bound_kernels()`` first."""
    global _keep_encodings
    saved, _keep_encodings = _keep_encodings, bool(keep)
    try:
        yield
    finally:
        _keep_encodings = saved


def bound_kernels() -> int:
    """How many (kernel, key) pairs launch through a bound compiled kernel (for tests)."""
    return sum(bound is not _TRITON for sites in _SITES.values() for _, bound_of in sites.entries
               for bound in bound_of.values())


def clear_bound_kernels() -> None:
    """Forget every bound kernel (the next launch of each key goes through Triton again)."""
    _SITES.clear()
