"""moe_ref: a readable, tested reference for the expert-parallel (mega) MoE layer."""
from setuptools import find_packages, setup

setup(
    name="moe_ref",
    version="0.1.0",
    description="Reference expert-parallel MoE layer: routing, capacity plan, dispatch/combine, expert GEMMs",
    packages=find_packages(include=["moe_ref", "moe_ref.*"]),
    package_data={"moe_ref": ["presets/*.json"]},
    python_requires=">=3.10",
    # Ranges, not pins: the CPU test environment pins (see Makefile), the GPU image brings torch 2.11 / triton 3.6.
    install_requires=["torch>=2.9", "triton>=3.4", "safetensors>=0.4", "tqdm>=4.60"],
    extras_require={"test": ["pytest>=8", "transformers>=5"], "plot": ["matplotlib>=3.7"]},
    entry_points={"console_scripts": ["moe-ref=moe_ref.cli:main"]},
)
