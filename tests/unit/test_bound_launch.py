"""``moe_ref.kernels.runtime.launch``, driven on the CPU with a stand-in for a jitted kernel and its compiled kernel: the
first launch of a key goes through Triton (``kernel[grid]``), later ones call the compiled kernel's launcher with
every parameter in order (tensors as their addresses); any change Triton would specialize on (dtype, alignment, an int that becomes 1 or a
multiple of 16, a constexpr, a launch option) goes through Triton again; the switch and launch hooks keep
Triton's path. The real kernels run bound in every GPU test (tests/gpu/test_bound_launch_cuda.py compares)."""
from __future__ import annotations

import inspect

import pytest
import torch

from moe_ref.kernels.runtime import launch as bl

pytestmark = pytest.mark.unit


class _Param:
    def __init__(self, name, default=inspect.Parameter.empty):
        self.name, self.default, self.is_constexpr = name, default, name.isupper()


class _Compiled:
    """A compiled kernel: records what its launcher was called with."""

    def __init__(self):
        self.runs: list[tuple] = []
        self.function, self.packed_metadata = "function", "metadata"

    def run(self, *args):
        self.runs.append(args)


class _Kernel:
    """A jitted kernel ``k(x, n, scale, BLOCK: constexpr, FLAG: constexpr = False)``."""

    params = [_Param("x"), _Param("n"), _Param("scale"), _Param("BLOCK"), _Param("FLAG", False)]

    def __init__(self):
        self.triton_launches: list[tuple] = []
        self.compiled: list[_Compiled] = []
        self.compiled_class = _Compiled

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.triton_launches.append((grid, args, kwargs))
            self.compiled.append(self.compiled_class())
            return self.compiled[-1]
        return run


_real_on_gpu = bl._on_gpu


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setattr(bl, "is_interpreter", lambda: False)
    monkeypatch.setattr(bl, "_hooks_set", lambda: False)
    monkeypatch.setattr(bl, "_current_device", lambda: 0)
    monkeypatch.setattr(bl, "_current_stream", lambda device: 1234)
    monkeypatch.setattr(bl, "_SITES", {})
    monkeypatch.setattr(bl, "_on", None)  # MOE_REF_BOUND_LAUNCH read again at the next launch
    monkeypatch.setattr(bl, "_on_gpu", lambda args: True)  # CPU tensors stand in for GPU ones
    return _Kernel()


def test_later_launches_call_the_compiled_kernel_with_every_parameter_in_order(kernel):
    x = torch.zeros(64)
    first = bl.launch(kernel, (4,), x, 100, 0.5, BLOCK=32)
    assert len(kernel.triton_launches) == 1 and first is kernel.compiled[0]
    y = torch.ones(64)
    again = bl.launch(kernel, (7, 2), y, 200, 1.5, BLOCK=32)
    assert len(kernel.triton_launches) == 1 and again is kernel.compiled[0]
    (call,) = kernel.compiled[0].runs
    assert call[:7] == (7, 2, 1, 1234, "function", "metadata", None)
    assert call[9] == y.data_ptr() and call[10:] == (200, 1.5, 32, False)  # the default of FLAG filled in
    assert bl.bound_kernels() == 1


@pytest.mark.parametrize("change", [
    dict(x=torch.zeros(64, dtype=torch.float16)),   # dtype
    dict(x=torch.zeros(65)[1:]),                     # a base that is not 16-byte aligned
    dict(n=1), dict(n=96), dict(n=2 ** 31),          # == 1, divisible by 16, 64-bit
    dict(BLOCK=64), dict(FLAG=True),                 # constexprs
    dict(num_warps=8),                               # a launch option
])
def test_what_triton_specializes_on_goes_through_triton_again(kernel, change):
    base = dict(x=torch.zeros(64), n=100, scale=0.5, BLOCK=32)
    bl.launch(kernel, (1,), base["x"], base["n"], base["scale"], BLOCK=32)
    args = {**base, **change}
    extra = {k: v for k, v in args.items() if k not in ("x", "n", "scale")}
    bl.launch(kernel, (1,), args["x"], args["n"], args["scale"], **extra)
    assert len(kernel.triton_launches) == 2 and not kernel.compiled[0].runs
    bl.launch(kernel, (1,), args["x"], args["n"], args["scale"], **extra)  # now bound too
    assert len(kernel.triton_launches) == 2 and len(kernel.compiled[1].runs) == 1


def test_values_triton_does_not_specialize_on_stay_bound(kernel):
    bl.launch(kernel, (1,), torch.zeros(64), 100, 0.5, BLOCK=32)
    bl.launch(kernel, (1,), torch.zeros(128), 37, 9.0, BLOCK=32)  # other size, int not 1 nor 16k, other float
    assert len(kernel.triton_launches) == 1 and len(kernel.compiled[0].runs) == 1


@pytest.mark.parametrize("launch_args", [
    ((torch.zeros(64), 100, 0.5, 32), {}),                 # a constexpr by position: its key would not tell 32 from 64
    ((torch.zeros(64),), dict(n=100, scale=0.5, BLOCK=32)),  # a parameter by keyword: keyed by value, not bound
])
def test_launches_the_key_cannot_describe_stay_on_tritons_path(kernel, launch_args):
    args, kwargs = launch_args
    for _ in range(3):
        bl.launch(kernel, (1,), *args, **kwargs)
    assert len(kernel.triton_launches) == 3 and bl.bound_kernels() == 0


def test_the_switch_and_launch_hooks_keep_tritons_path(kernel, monkeypatch):
    monkeypatch.setenv("MOE_REF_BOUND_LAUNCH", "0")  # read at the first launch
    for _ in range(3):
        bl.launch(kernel, (1,), torch.zeros(64), 100, 0.5, BLOCK=32)
    assert len(kernel.triton_launches) == 3 and bl.bound_kernels() == 0 and not bl.bound_launches_on()
    with bl.bound_launches(True):  # in code: the first launch of the key binds it
        for _ in range(2):
            bl.launch(kernel, (1,), torch.zeros(64), 100, 0.5, BLOCK=32)
    assert len(kernel.triton_launches) == 4 and bl.bound_kernels() == 1
    with bl.bound_launches(False):  # off again: Triton's path, the bound key kept for later
        bl.launch(kernel, (1,), torch.zeros(64), 100, 0.5, BLOCK=32)
    assert len(kernel.triton_launches) == 5 and bl.bound_kernels() == 1 and not bl.bound_launches_on()
    monkeypatch.setattr(bl, "_hooks_set", lambda: True)
    with bl.bound_launches(True):
        for _ in range(2):
            bl.launch(kernel, (1,), torch.zeros(64), 100, 0.5, BLOCK=32)
    assert len(kernel.triton_launches) == 7 and len(kernel.compiled[3].runs) == 1


def test_a_key_with_a_tensor_off_the_gpu_stays_on_tritons_path(kernel, monkeypatch):
    """Triton's launcher refuses a CPU tensor (it asks the driver for each tensor's device pointer); a bound launch
    hands it the address it read, so such keys are never bound."""
    monkeypatch.setattr(bl, "_on_gpu", _real_on_gpu)
    for _ in range(3):
        bl.launch(kernel, (1,), torch.zeros(64), 100, 0.5, BLOCK=32)
    assert len(kernel.triton_launches) == 3 and bl.bound_kernels() == 0


def test_a_callable_grid_goes_through_triton(kernel):
    for _ in range(2):
        bl.launch(kernel, lambda meta: (1,), torch.zeros(64), 100, 0.5, BLOCK=32)
    assert len(kernel.triton_launches) == 2


def test_triton_hook_chains_count_as_set_only_with_a_hook(monkeypatch):
    """Triton >= 3.5 keeps the launch hooks in chains that are never None (this Triton's ``knobs``)."""
    knobs = bl._runtime_knobs
    if knobs is None:
        pytest.skip("this Triton has no knobs.runtime")
    assert not bl._hooks_set()
    chain = knobs.launch_enter_hook
    if hasattr(chain, "add"):
        hook = lambda *args, **kwargs: None  # noqa: E731
        chain.add(hook)
        try:
            assert bl._hooks_set()
        finally:
            chain.remove(hook)
    else:
        monkeypatch.setattr(knobs, "launch_enter_hook", lambda *args: None)
        assert bl._hooks_set()
    assert not bl._hooks_set()


def test_a_tma_descriptor_is_keyed_by_everything_its_launch_encodes():
    """Triton's launcher encodes a host TMA descriptor from its base, shape, strides and block shape (the grouped
    MLP sets the block shape per config), so each of them enters the key."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    def desc(rows=64, block=(16, 16), dtype=torch.bfloat16, width=64):
        base = torch.zeros(rows, 128, dtype=dtype)[:, :width]
        return TensorDescriptor(base, list(base.shape), list(base.stride()), list(block))

    key = bl._arg_key(desc())
    assert bl._arg_key(desc()) == key  # another tensor of the same kind: the same key
    for other in (desc(rows=32), desc(block=(32, 16)), desc(dtype=torch.float16), desc(width=32)):
        assert bl._arg_key(other) != key


def test_a_kernel_id_reused_by_another_kernel_is_not_run_bound(kernel, monkeypatch):
    """Keys hold the kernel's id (a JITFunction hashes in Python); an id freed and reused by another kernel must not
    reach the first kernel's compiled launcher."""
    bl.launch(kernel, (1,), torch.zeros(64), 100, 0.5, BLOCK=32)
    other = _Kernel()
    monkeypatch.setattr(bl, "id", lambda obj: id(kernel) if obj is other else id(obj), raising=False)
    bl.launch(other, (1,), torch.zeros(64), 100, 0.5, BLOCK=32)
    assert len(other.triton_launches) == 1 and not kernel.compiled[0].runs
    bl.launch(other, (1,), torch.zeros(64), 100, 0.5, BLOCK=32)  # now bound to the other kernel's launcher
    assert len(other.compiled[0].runs) == 1 and not kernel.compiled[0].runs


def _launch_arguments():
    """Arguments of every class the key distinguishes, at the values Triton specializes on."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    base = torch.zeros(64, 128, dtype=torch.bfloat16)
    return [torch.zeros(64), torch.zeros(65)[1:], torch.zeros(8, dtype=torch.float16), torch.nn.Parameter(torch.ones(4)),
            0, 1, 16, 37, -5, 2 ** 31, 2 ** 63, 0.5, None, True, "name", torch.float32,
            TensorDescriptor(base, list(base.shape), list(base.stride()), [16, 16])]


@pytest.mark.parametrize("start", range(0, 17, 4))
def test_the_generated_key_function_equals_the_per_argument_key(start):
    values = _launch_arguments()
    args = tuple(values[start:] + values[:start])
    key_function = bl._key_function(args)
    kwargs = dict(BLOCK=32, num_warps=4)

    def expected(values):
        key = (3, 32, 4, *(entry for value in values for entry in bl._arg_key(value)))
        passed = tuple(v.data_ptr() if isinstance(v, torch.Tensor) else v for v in values)
        return key, passed

    assert key_function(3, kwargs, *args) == expected(args)
    # other values of the same classes: still the per-argument key (the function holds no values)
    others = tuple(torch.zeros(3, dtype=v.dtype) if type(v) is torch.Tensor else v + 16 if type(v) is int else v
                   for v in args)
    assert key_function(3, kwargs, *others) == expected(others)


def test_other_argument_classes_get_a_key_function_of_their_own(kernel):
    """A launch whose argument classes differ from the first launch's (None for a tensor, an int for a float) gets
    its own generated key function, and so goes through Triton once for its own key, then binds."""
    bl.launch(kernel, (1,), torch.zeros(64), 100, 0.5, BLOCK=32)
    assert bl._key_function((torch.zeros(1), 1, 0.5))(0, {}, None, 100, 0.5) is None
    for _ in range(2):
        bl.launch(kernel, (1,), None, 100, 3, BLOCK=32)
    assert len(kernel.triton_launches) == 2 and len(kernel.compiled[1].runs) == 1
    bl.launch(kernel, (1,), torch.zeros(64), 100, 0.5, BLOCK=32)  # the first key is still bound
    assert len(kernel.triton_launches) == 2 and len(kernel.compiled[0].runs) == 1


class _LauncherLike36:
    """A launcher object shaped as Triton 3.6's ``CudaLauncher``: ``__call__`` allocates the scratch (None: this kernel
    needs none) and calls its C launcher ``launch`` with the launch flags in front of the arguments."""

    def __init__(self, global_scratch_size=0):
        self.global_scratch_size, self.profile_scratch_size = global_scratch_size, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True
        self.calls: list[tuple] = []

    def launch(self, *args):
        self.calls.append(args)

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        global_scratch = bytearray(self.global_scratch_size) if self.global_scratch_size else None
        profile_scratch = None
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl, global_scratch, profile_scratch, *args)  # noqa: E501 - Triton's line as it is


class _CompiledWith(_Compiled):
    def __init__(self, launcher):
        super().__init__()
        self.launcher = launcher

    @property
    def run(self):
        return self.launcher


@pytest.mark.parametrize("scratch", [0, 64])
def test_the_c_launcher_is_called_as_the_launcher_object_would_call_it(kernel, scratch):
    """Where the launcher object only allocates scratch and calls its C launcher (Triton 3.6), a kernel without
    scratch has its C launcher called directly, with exactly what the object passes; with scratch, the object."""
    launcher = _LauncherLike36(scratch)
    assert (bl._c_launcher(launcher) is not None) == (scratch == 0)
    kernel.compiled_class = lambda: _CompiledWith(launcher)
    x = torch.zeros(64)
    bl.launch(kernel, (4,), x, 100, 0.5, BLOCK=32)
    bl.launch(kernel, (4, 2), x, 100, 0.5, BLOCK=32)
    (direct,) = launcher.calls
    launcher.calls.clear()
    launcher(4, 2, 1, 1234, "function", "metadata", None, None, None, x.data_ptr(), 100, 0.5, 32, False)
    (through_object,) = launcher.calls
    if scratch:
        assert direct[7] is not None  # the object allocated the scratch, so it was called
    else:
        assert direct == through_object


def test_launcher_objects_of_another_shape_are_called():
    """Another Triton's launcher object (another ``__call__``) or one without source is called, not bypassed."""
    class Other:
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid = launch_pdl = False

        def launch(self, *args):
            pass

        def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, *args):
            self.launch(gridX, gridY, gridZ, stream, function, kernel_metadata, *args)

    assert bl._c_launcher(Other()) is None
    assert bl._c_launcher(_Compiled().run) is None  # a bound method: no source of its own __call__


# A stand-in for Triton 3.6's driver module around a kernel with host TMA descriptors: its launcher object's
# ``launch`` is ``wrap_handle_tensordesc``'s ``inner``, which encodes each descriptor again at every launch (the
# encoding here is a tuple naming the base address, so the test can see which base each launch got).
_DRIVER_36_STANDIN = '''
_BASE_ARGS_FORMAT_LEN = 13
ENCODED = []


def make_tensordesc_arg(arg, metadata):
    ENCODED.append(arg.base.data_ptr())
    return [("tensor map of", arg.base.data_ptr(), metadata["swizzle"]), *arg.shape, *arg.strides]


def wrap_handle_tensordesc(launcher, signature, tensordesc_meta):
    tensordesc_indices = set([i for i, sig in enumerate(signature.values()) if sig.startswith("tensordesc")])

    def inner(*args):
        final_args = list(args[:_BASE_ARGS_FORMAT_LEN])
        tensordesc_idx = 0
        for i, arg in enumerate(args[_BASE_ARGS_FORMAT_LEN:]):
            if i in tensordesc_indices:
                final_args.extend(make_tensordesc_arg(arg, tensordesc_meta[tensordesc_idx]))
                tensordesc_idx += 1
            else:
                final_args.append(arg)
        return launcher(*final_args)

    return inner
'''


@pytest.fixture
def driver_36(tmp_path, monkeypatch):
    import importlib

    (tmp_path / "driver_36_standin.py").write_text(_DRIVER_36_STANDIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module("driver_36_standin")


class _DescriptorKernel(_Kernel):
    """A jitted kernel ``k(x, a_desc, n, b_desc, BLOCK: constexpr)``: two host TMA descriptors among its arguments."""

    params = [_Param("x"), _Param("a_desc"), _Param("n"), _Param("b_desc"), _Param("BLOCK")]


def test_descriptors_are_encoded_once_per_base_and_passed_as_tritons_wrapper_passes_them(kernel, driver_36):
    """Behind Triton 3.6's descriptor wrapper, a bound kernel calls the C launcher with exactly what the wrapper would
    pass, encoding each descriptor once per tuple of base addresses (not at every launch), and a new base gets its
    own encoding."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    kernel = _DescriptorKernel()
    launcher = _LauncherLike36()
    c_calls = launcher.calls
    signature = {"x": "*fp32", "a_desc": "tensordesc<bf16[16, 16]>", "n": "i32", "b_desc": "tensordesc<bf16[16, 32]>",
                 "BLOCK": "constexpr"}
    metadata = [{"swizzle": 1}, {"swizzle": 2}]
    launcher.launch = driver_36.wrap_handle_tensordesc(lambda *args: c_calls.append(args), signature, metadata)
    kernel.compiled_class = lambda: _CompiledWith(launcher)
    x = torch.zeros(64)
    pools = [torch.zeros(32, 64, dtype=torch.bfloat16) for _ in range(2)]
    weight = torch.zeros(64, 64, dtype=torch.bfloat16)

    def descriptors(pool):
        return (TensorDescriptor(pool, list(pool.shape), list(pool.stride()), [16, 16]),
                TensorDescriptor(weight, list(weight.shape), list(weight.stride()), [16, 32]))

    def go(pool):
        a_desc, b_desc = descriptors(pool)
        bl.launch(kernel, (4,), x, a_desc, 100, b_desc, BLOCK=32)

    go(pools[0])  # Triton's path: it compiles, and the key binds
    assert len(kernel.triton_launches) == 1 and not c_calls
    for pool in (pools[0], pools[1], pools[0], pools[1]):
        go(pool)
    assert len(kernel.triton_launches) == 1 and len(c_calls) == 4
    assert sorted(driver_36.ENCODED) == sorted([pools[0].data_ptr(), weight.data_ptr(),
                                                pools[1].data_ptr(), weight.data_ptr()])  # once per base tuple
    bound = next(iter(bl._SITES.values())).entries[0][1]
    assert len(bound) == 1 and next(iter(bound.values())).descriptors is not None
    direct = list(c_calls)
    bl.clear_bound_kernels()  # kernels bound with encodings off leave them to the wrapper: one per launch
    driver_36.ENCODED.clear()
    with bl.descriptor_encodings(False):
        for pool in (pools[0], pools[0], pools[0]):
            go(pool)
    assert len(driver_36.ENCODED) == 2 * 2 and c_calls[-1] == direct[0]  # 2 bound launches x 2 descriptors
    c_calls.clear()
    c_calls.clear()
    for pool in (pools[0], pools[1]):  # what Triton's launcher object would pass the C launcher for the same launches
        a_desc, b_desc = descriptors(pool)
        launcher(4, 1, 1, 1234, "function", "metadata", None, None, None, x.data_ptr(), a_desc, 100, b_desc, 32)
    assert direct[0] == direct[2] == c_calls[0] and direct[1] == direct[3] == c_calls[1]
    assert direct[0][13:19] == (x.data_ptr(), ("tensor map of", pools[0].data_ptr(), 1), 32, 64, 64, 1)


def test_other_descriptor_wrappers_are_called_as_they_are(driver_36):
    """A wrapper of another shape, or one whose descriptors lack compiled metadata, is called, not bypassed."""
    signature = {"a_desc": "tensordesc<bf16[16, 16]>", "BLOCK": "constexpr"}
    inner = driver_36.wrap_handle_tensordesc(print, signature, [{"swizzle": 1}])
    assert bl._descriptor_wrapper_parts(inner, 1) is not None
    assert bl._descriptor_wrapper_parts(driver_36.wrap_handle_tensordesc(print, signature, [None]), 1) is None
    assert bl._descriptor_wrapper_parts(inner, 0) is None  # the descriptor is not among the positional arguments

    def other(*args):
        return print(*args)

    assert bl._descriptor_wrapper_parts(other, 1) is None and bl._descriptor_wrapper_parts(print, 1) is None
