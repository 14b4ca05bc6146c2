"""Suite-wide pytest setup: CUDA-marked tests are skipped, with the reason, where no GPU exists."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "cuda" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine: make test-gpu)"))
        elif "cuda2" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2 CUDA GPUs, found {gpus}"))
