# On a fresh clone any of `make test`, `make demo` (the main job), `make test-fast`, `make demo-quant`, `make bench` is a
# first command: each builds the environment it runs in (`make install`) when it is missing or out of date.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU test environment is pinned; setup.py keeps ranges so the GPU image (torch 2.11, triton 3.6) works too.
PINNED := torch==2.13.0 triton==3.9.0 pytest==9.2.0 pytest-timeout==2.4.0 safetensors==0.8.0 tqdm==4.70.1 transformers==5.24.0
# Written after a successful install only: the venv is complete and built from this setup.py, this Makefile (the pins)
# and these compiled-op sources. Edit one of them and the next target that needs the venv installs again.
INSTALLED := $(VENV)/.moe_ref-installed

.PHONY: install test test-fast test-gpu test-gpu-full demo demo-quant bench clean

install: $(INSTALLED)

$(INSTALLED): setup.py Makefile $(wildcard csrc/*.cpp csrc/*.h)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(PINNED)
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

test: $(INSTALLED)
	$(PY) -m pytest -q

test-fast: $(INSTALLED)
	$(PY) -m pytest -q -m "not dist"

# On a CUDA machine, from the tree (PYTHONPATH=.: works with only the system python, nothing installed).
# test-gpu: the one-GPU suite without the `slow` cases: 207 s on one H100 (2026-12-07: 109 passed, 34 skipped without
# DeepGEMM's wheels; MXFP4's 51 s decode case has since moved to `slow`). cuda2 cases (two GPUs) carry cuda too where
# their file's pytestmark is cuda, hence `not cuda2`.
test-gpu:
	PYTHONPATH=$(CURDIR):$$PYTHONPATH $(PYTHON) -m pytest -q -m "cuda and not cuda2 and not slow" tests/gpu --durations=15

# test-gpu-full: every GPU case: the slow ones, and the cuda2 ones of tests/gpu and tests/dist (skipped, with the
# reason, on fewer than two GPUs). About 8-10 min on one H200.
test-gpu-full:
	PYTHONPATH=$(CURDIR):$$PYTHONPATH $(PYTHON) -m pytest -q -m "cuda or cuda2" tests/gpu tests/dist --durations=15

demo: $(INSTALLED)
	$(PY) -m moe_ref demo

# The same from a Kimi-K3 MXFP4 checkpoint, loaded and run as stored (compared with the dequantized weights).
demo-quant: $(INSTALLED)
	$(PY) -m moe_ref demo --preset tiny-kimi-k3 --quant mxfp4
	$(PY) -m moe_ref demo --preset tiny-deepseek-v3 --quant fp8_block

# `moe-ref bench`: every implementation that runs here (moe_ref's backends through the routed step, the peers' kernels
# when `make peers` fetched them), checked by the conformance harness then timed (a GPU: Kimi-K2's experts per rank
# at EP 8, T 16-4096; a CPU: the tiny shape).
bench: $(INSTALLED)
	$(PY) -m moe_ref bench

# The CPU conformance matrix (docs/conform.md): every moe_ref adapter that runs on a CPU and the mutants, at 1, 2 and
# 4 ranks over the tiny cases; exit 1 on a FAIL (the mutants' excepted) or on a mutant that no check catches.
.PHONY: conform
conform: $(INSTALLED)
	$(PY) -m moe_ref conform --impl moe_ref/torch --impl moe_ref/torch+chunk --impl moe_ref/torch+invariant \
		--impl moe_ref/grouped_mm --impl moe_ref/quant/torch --impl moe_ref/dispatch/local --impl moe_ref/dispatch/symm \
		--impl moe_ref/dispatch/a2a --impl moe_ref/experts/torch --impl moe_ref/experts/torch+masked \
		--impl moe_ref/experts/grouped_mm --mutants --ranks 1,2,4 --cases 'tiny*'

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache results

# The peer anchors of scripts/bench_experts.py, only read with zipfile by scripts/peer_moe.py, never installed:
# SGLang's wheel, and from vLLM's wheel (336 MB, downloaded to a temporary folder and deleted) the fused-moe zip of
# the members the reader opens (0.2 MB). .whl/ is git-ignored and travels to the GPU machine with the tree.
# DeepGEMM for the GPU machine (optional backend and anchor): the only sgl-deep-gemm wheels that run with the GPU
# image's torch 2.11, with their apache-tvm-ffi (../shared/FACTS.md); scripts/gpu_suite.sh installs every other
# wheel in .whl/ into a scratch folder there.
.PHONY: deep-gemm-wheels
deep-gemm-wheels: $(INSTALLED)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
		--platform manylinux2014_x86_64 -d .whl sgl-deep-gemm==0.1.4 apache-tvm-ffi==0.1.11

VLLM_VERSION ?= 0.33.0
.PHONY: peers
peers: $(INSTALLED)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl sglang==0.5.23
	@if [ ! -f .whl/vllm-$(VLLM_VERSION)-fused-moe.zip ]; then \
		tmp=$$(mktemp -d) && \
		$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d $$tmp vllm==$(VLLM_VERSION) && \
		$(PY) scripts/peer_moe.py --extract $$tmp/vllm-$(VLLM_VERSION)-*.whl --out-dir .whl; \
		status=$$?; rm -rf $$tmp; exit $$status; \
	fi
