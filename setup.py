"""moe_ref: a readable, tested reference for the expert-parallel (mega) MoE layer."""
import os
import sys

from setuptools import find_packages, setup


def _native_build():
    """(ext_modules, cmdclass) for the optional compiled CPU ops (csrc/ -> moe_ref._C), built with torch's
    extension tooling. Any failure (no torch at build time, no compiler, a compile error) only prints a warning:
    the package installs anyway and moe_ref.kernels.runtime.native uses the Python fallback. MOE_REF_BUILD_NATIVE=0 skips it."""
    if os.environ.get("MOE_REF_BUILD_NATIVE", "1") == "0":
        print("moe_ref: MOE_REF_BUILD_NATIVE=0: compiled ops not built (the Python fallback is used)", file=sys.stderr)
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except Exception as err:  # noqa: BLE001 - torch missing or broken at build time
        print(f"moe_ref: compiled ops not built (torch extension tooling unavailable: {err})", file=sys.stderr)
        return [], {}

    class TolerantBuildExtension(BuildExtension):
        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as err:  # noqa: BLE001 - a failed optional build must not fail the install
                print(f"moe_ref: WARNING: building {ext.name} failed ({type(err).__name__}: {err}); the Python "
                      "fallback is used (moe_ref.kernels.runtime.native.native_status() says why)", file=sys.stderr)

    here = os.path.dirname(os.path.abspath(__file__))
    ext = CppExtension(
        "moe_ref._C", [os.path.join("csrc", "ep_ops.cpp")], include_dirs=[os.path.join(here, "csrc")],
        # -ffp-contract=off: separate multiply and add roundings, as the torch twins compute them; -g0: no debug info
        # for the torch headers (halves the compile time)
        extra_compile_args={"cxx": ["-O3", "-g0", "-ffp-contract=off", "-fopenmp"]}, extra_link_args=["-fopenmp"])
    return [ext], {"build_ext": TolerantBuildExtension.with_options(use_ninja=True)}


_ext_modules, _cmdclass = _native_build()

setup(
    name="moe_ref",
    version="0.1.0",
    description="Reference expert-parallel MoE layer: routing, capacity plan, dispatch/combine, expert GEMMs",
    packages=find_packages(include=["moe_ref", "moe_ref.*"]),
    package_data={"moe_ref": ["core/presets/*.json", "experts/auto_table.json", "kernels/experts/tile_table.json"]},
    python_requires=">=3.10",
    # Ranges, not pins: the CPU test environment pins (see Makefile), the GPU image brings torch 2.11 / triton 3.6.
    install_requires=["torch>=2.9", "triton>=3.4", "safetensors>=0.4", "tqdm>=4.60"],
    extras_require={"test": ["pytest>=8", "transformers>=5"], "plot": ["matplotlib>=3.7"]},
    entry_points={"console_scripts": ["moe-ref=moe_ref.tools.cli:main"]},
    ext_modules=_ext_modules,
    cmdclass=_cmdclass,
)
