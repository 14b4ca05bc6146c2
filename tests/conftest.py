"""Suite-wide pytest setup: Triton kernels run under the interpreter where no GPU exists (set before
anything imports triton: Triton reads it when a kernel is defined), and CUDA-marked tests are skipped,
with the reason, there."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "cuda" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine: make test-gpu)"))
        elif "cuda2" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2 CUDA GPUs, found {gpus}"))
