"""Expert-load trace files: rows routed to each (layer, logical expert), one table per window of steps.

    telemetry or zipf_loads -> save_loads -> file -> load_loads -> planner / simulator

Formats (chosen by the suffix):
- ``.json``: ``{"format": "moe_ref.eplb.loads", "version": 1, "loads": [window][layer][expert]}``.
- ``.pt``: a ``torch.save``d tensor ``[W, Ly, E]`` (or ``[Ly, E]``: one window).
- the layer's telemetry dump (``moe_ref.eplb.telemetry.save_expert_loads``, ``"format": "moe_ref.eplb.telemetry"``):
  one window, each layer's per-slot rows summed per logical expert.
Counts are finite and ``>= 0``; anything else is ``LoadTraceError`` (CFG035).

Shape legend: E experts (the model's logical experts), Ly MoE layers of a model.

A trace is ``[W, Ly, E]``: W windows of steps, Ly MoE layers, E experts.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from moe_ref.core.errors import LoadTraceError
from moe_ref.eplb import telemetry

FILE_FORMAT = "moe_ref.eplb.loads"
FILE_VERSION = 1


def _as_windows(table, source: str) -> torch.Tensor:
    """``[W, Ly, E]`` float64 from a tensor or nested lists, or ``LoadTraceError`` naming ``source``."""
    try:
        loads = torch.as_tensor(table, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as err:  # ragged lists, strings
        raise LoadTraceError(f"{source}: the loads are not a rectangular table of numbers ({err})") from err
    if loads.dim() == 2:
        loads = loads.unsqueeze(0)
    if loads.dim() != 3 or loads.numel() == 0:
        raise LoadTraceError(f"{source}: loads must be [windows, layers, experts] or [layers, experts], "
                             f"got shape {list(loads.shape)}")
    if not bool(torch.isfinite(loads).all()) or bool((loads < 0).any()):
        raise LoadTraceError(f"{source}: loads must be finite counts >= 0 (min {float(loads.min())})")
    return loads


def save_loads(path: str | Path, loads: torch.Tensor) -> None:
    """Write a load trace (``.pt``: the tensor; any other suffix: JSON).

    Args:
        path: the file to write.
        loads: ``[W, Ly, E]`` (or ``[Ly, E]``) non-negative counts, any real dtype.
    """
    loads = _as_windows(loads, str(path))
    if Path(path).suffix == ".pt":
        torch.save(loads, path)
        return
    integral = bool((loads == loads.round()).all())
    table = loads.to(torch.int64).tolist() if integral else loads.tolist()
    Path(path).write_text(json.dumps({"format": FILE_FORMAT, "version": FILE_VERSION, "loads": table}))


def load_loads(path: str | Path) -> torch.Tensor:
    """Read a load trace ``save_loads`` wrote (or a ``.pt`` tensor of the same shape).

    Args:
        path: the ``.json`` or ``.pt`` file.

    Returns:
        loads: ``[W, Ly, E]`` ``torch.float64`` (windows, layers, experts).
    """
    source = str(path)
    try:
        if Path(path).suffix == ".pt":
            table = torch.load(path, map_location="cpu", weights_only=True)
        else:
            record = json.loads(Path(path).read_text())
            if isinstance(record, dict) and record.get("format") == telemetry.FILE_FORMAT:
                table = [telemetry.logical_rows_from_record(record)]
            elif not isinstance(record, dict) or record.get("format") != FILE_FORMAT or "loads" not in record:
                raise ValueError(f"not a {FILE_FORMAT} or {telemetry.FILE_FORMAT} record")
            else:
                table = record["loads"]
    except (OSError, ValueError, RuntimeError, EOFError, KeyError, TypeError) as err:
        raise LoadTraceError(f"{source}: cannot read a load trace ({err})") from err
    if isinstance(table, (dict, str)):
        raise LoadTraceError(f"{source}: holds a {type(table).__name__}, not a [windows, layers, experts] table")
    return _as_windows(table, source)
