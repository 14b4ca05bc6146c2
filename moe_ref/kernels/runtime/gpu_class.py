"""The GPU class of a device: the key of every table measured per GPU (the experts backend table of
``experts_backend="auto"``, the grouped MLP's tile table): compute capability and the name CUDA reports, e.g.
``"9.0/NVIDIA H200"``. Two boards of one class run the same kernels at the same speed; an H100 and an H200 share the
capability but not the memory bandwidth, hence the name in the key."""
from __future__ import annotations

import torch


def gpu_class_name(compute_capability: str, device_name: str) -> str:
    """A table's key of a GPU class: ``"9.0/NVIDIA H200"`` from ``("9.0", "NVIDIA H200")``."""
    return f"{compute_capability}/{device_name}"


def gpu_class_of(device: torch.device | str) -> str | None:
    """The GPU class of a CUDA ``device`` (``gpu_class_name`` of its compute capability and name), None off CUDA."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return gpu_class_name(f"{major}.{minor}", torch.cuda.get_device_name(device))
