"""Compiled CPU ops of the EP data path (csrc/ -> `moe_ref._C`, `torch.ops.moe_ref.*_cpu`), with the torch
twins as the fallback.

    ep_pre_dispatch -> symm_barrier -> ep_dispatch -> experts -> ep_combine_push -> symm_barrier -> ep_combine_reduce

Each function here has the SAME signature as its torch twin in `moe_ref.kernels` (`ep_pre_dispatch_ref`,
`ep_layout_ref`, `symm_barrier_ref`, `ep_dispatch_ref`, `ep_combine_push_ref`, `ep_combine_reduce_ref`), runs
the twin's argument checks (same errors), and then the compiled op when it is active, else the twin itself.
The compiled ops write the same bytes as the twins (bitwise; `tests/unit/test_native_ops.py`), with one
documented difference: after a peer timeout `ep_dispatch` receives nothing (the kernels' contract) where the
twin still reads the sources' rows. They take CPU buffers only (`PeerBuffers` over CPU shared memory or R
fake ranks in one process); CUDA buffers go to the twin.

Whether the compiled ops are active is decided ONCE, at import: the library `moe_ref._C` is built by
`make install` (setup.py; a failed build only warns), and `MOE_REF_NATIVE=0` forces the fallback.
`native_status()` says which and why; `is_active()` answers as a bool; `ops_table()` gives the five phases
in the order `ep_chunk` uses them.

Shape legend: T tokens of this rank, K top-k, Dx row width, P pool rows.
"""

from __future__ import annotations

import importlib

import torch

from moe_ref.core import envs
from moe_ref.core.errors import DTypeError
from moe_ref.kernels.ep.ep_regions import EPRegions, PeerBuffers, check_peers
from moe_ref.kernels.ep.pre_dispatch import _check_args as _check_pre_dispatch_args
from moe_ref.kernels.ep.symm_signal import DEFAULT_MAX_POLLS, DEFAULT_TIMEOUT_US, check_ep_status

# the twins' modules (not `from moe_ref.kernels import ...`: that package re-exports functions of the same names)
_combine = importlib.import_module("moe_ref.kernels.ep.ep_combine")
_dispatch = importlib.import_module("moe_ref.kernels.ep.ep_dispatch")
_layout = importlib.import_module("moe_ref.kernels.ep.ep_layout")
_signal = importlib.import_module("moe_ref.kernels.ep.symm_signal")

__all__ = ["ep_pre_dispatch", "ep_layout", "symm_barrier", "ep_dispatch", "ep_combine_push", "ep_combine_reduce",
           "check_ep_status", "native_status", "is_active", "ops_table", "ENV_VAR"]

ENV_VAR = "MOE_REF_NATIVE"  # "0": use the torch twins even when the library is built

# the order of the compiled ops' `int[] layout` argument (csrc/ep_layout.h, checked against the library)
_SIZE_FIELDS = ("num_ranks", "num_local_experts", "num_topk", "cap", "hidden", "num_pool_rows", "alignment",
                "masked_rows")
_REGION_FIELDS = ("signal", "epoch", "status", "counter", "num_tokens", "send_count", "topk_ids", "topk_weights",
                  "slot_rank", "x", "x_scale", "recv_num_tokens", "num_rows", "row_start", "recv_base", "pool_end",
                  "recv_pos", "recv_weight", "recv_src", "recv_x", "recv_x_scale", "combine_partial")
LAYOUT_FIELDS = _SIZE_FIELDS + ("fp8", "activation_dtype", "end") + _REGION_FIELDS
_ACT_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _load() -> tuple[bool, str]:
    allowed, value = envs.native_ops()
    if not allowed:
        return False, f"fallback: {ENV_VAR}={value} (torch twins forced)"
    try:
        import moe_ref._C  # noqa: F401  (loading the library registers torch.ops.moe_ref.*_cpu)
    except ImportError as err:
        return False, f"fallback: compiled library moe_ref._C not built or not loadable ({err}); run `make install`"
    try:
        fields = tuple(torch.ops.moe_ref.ep_layout_fields_cpu())
    except (AttributeError, RuntimeError) as err:
        return False, f"fallback: moe_ref._C loaded but its ops are missing ({err}); run `make install`"
    if fields != LAYOUT_FIELDS:
        return False, "fallback: moe_ref._C is stale (its layout fields differ from moe_ref.kernels.runtime.native's); run `make install`"
    return True, f"compiled ops: active ({moe_ref._C.__file__}, {torch.get_num_threads()} threads)"


_ACTIVE, _STATUS = _load()


def native_status() -> str:
    """One line for `moe-ref info`: "compiled ops: active (...)" or "fallback: <why>"."""
    return _STATUS


def is_active() -> bool:
    """True when the compiled ops run (the library loaded and MOE_REF_NATIVE is not 0)."""
    return _ACTIVE


_layout_cache: dict[int, tuple[EPRegions, list[int]]] = {}


def layout_args(regions: EPRegions) -> list[int]:
    """The `int[] layout` of the compiled ops for `regions` (cached per EPRegions object)."""
    hit = _layout_cache.get(id(regions))
    if hit is not None and hit[0] is regions:
        return hit[1]
    values = [getattr(regions, name) for name in _SIZE_FIELDS]
    values += [int(regions.fp8), _ACT_CODES[regions.activation_dtype], regions.end]
    values += [regions.offsets.get(name, -1) for name in _REGION_FIELDS]
    if len(_layout_cache) > 64:
        _layout_cache.clear()
    _layout_cache[id(regions)] = (regions, values)
    return values


def _compiled(peers: PeerBuffers) -> bool:
    return _ACTIVE and peers.local.device.type == "cpu"


def _buffers(peers: PeerBuffers) -> list[torch.Tensor]:
    return list(peers.buffers)


# --------------------------------------------------------------------------------------------------
# the ops (signatures = the twins')
# --------------------------------------------------------------------------------------------------
def ep_pre_dispatch(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                    peers: PeerBuffers, regions: EPRegions, *, post: bool = False) -> None:
    """`ep_pre_dispatch_ref`, compiled: MY send regions (rows copied or fp8-quantized, routing) and the layout
    (`num_tokens`, `send_count`, `slot_rank`); `post` posts the next barrier epoch after all writes."""
    if not _compiled(peers):
        return _layout.ep_pre_dispatch_ref(x_TD, topk_ids_TK, topk_weights_TK, peers, regions, post=post)
    if x_TD.dtype != regions.activation_dtype:
        raise DTypeError(f"x_TD is {x_TD.dtype}, the regions were laid out for {regions.activation_dtype}")
    _check_pre_dispatch_args(x_TD, topk_ids_TK, topk_weights_TK,
                             num_rows_per_expert_E=torch.empty(0, dtype=torch.int32),
                             **_layout._send_views(peers, regions))
    _layout._check_args(topk_ids_TK, peers, regions)
    torch.ops.moe_ref.ep_pre_dispatch_cpu(x_TD, topk_ids_TK, topk_weights_TK, _buffers(peers), peers.rank,
                                          layout_args(regions), post)


def ep_layout(topk_ids_TK: torch.Tensor, peers: PeerBuffers, regions: EPRegions, *, post: bool = False) -> None:
    """`ep_layout_ref`, compiled: `num_tokens`, `send_count`, `slot_rank` only."""
    if not _compiled(peers):
        return _layout.ep_layout_ref(topk_ids_TK, peers, regions, post=post)
    _layout._check_args(topk_ids_TK, peers, regions)
    torch.ops.moe_ref.ep_pre_dispatch_cpu(None, topk_ids_TK, None, _buffers(peers), peers.rank,
                                          layout_args(regions), post)


def symm_barrier(peers: PeerBuffers, regions: EPRegions, *, timeout_us: float = DEFAULT_TIMEOUT_US,
                 max_polls: int = DEFAULT_MAX_POLLS, post: bool = True, wait: bool = True,
                 _bound: int | None = None) -> None:
    """`symm_barrier_ref`, compiled: std::atomic release posts / acquire polls, bounded by `max_polls` and
    `timeout_us` (steady clock); a timeout is recorded in MY status (`check_ep_status` raises it)."""
    if not _compiled(peers):
        return _signal.symm_barrier_ref(peers, regions, timeout_us=timeout_us, max_polls=max_polls, post=post,
                                        wait=wait, _bound=_bound)
    _signal._check_args(peers, regions, post, wait)
    torch.ops.moe_ref.symm_barrier_cpu(_buffers(peers), peers.rank, layout_args(regions), post, wait,
                                       float(timeout_us), int(max_polls))


def ep_dispatch(peers: PeerBuffers, regions: EPRegions, *, wait: bool = False,
                timeout_us: float = DEFAULT_TIMEOUT_US, max_polls: int = DEFAULT_MAX_POLLS,
                received_e: torch.Tensor | None = None) -> None:
    """`ep_dispatch_ref`, compiled: pull my experts' rows from every source into my expert-major pool (and add them
    to ``received_e``)."""
    if not _compiled(peers):
        return _dispatch.ep_dispatch_ref(peers, regions, wait=wait, timeout_us=timeout_us, max_polls=max_polls,
                                         received_e=received_e)
    check_peers(peers, regions)
    if received_e is not None:
        _dispatch.check_received(received_e, regions.num_local_experts, peers.local.device)
    torch.ops.moe_ref.ep_dispatch_cpu(_buffers(peers), peers.rank, layout_args(regions), wait, float(timeout_us),
                                      int(max_polls))
    if received_e is not None:
        received_e.add_(regions.view(peers.local, "num_rows"))


def ep_combine_push(y_PD: torch.Tensor, peers: PeerBuffers, regions: EPRegions, *, post: bool = False) -> None:
    """`ep_combine_push_ref`, compiled: one weighted fp32 partial per (source, token) into the source's buffer."""
    if not _compiled(peers) or y_PD.device.type != "cpu":
        return _combine.ep_combine_push_ref(y_PD, peers, regions, post=post)
    _combine._check_push_args(y_PD, peers, regions)
    torch.ops.moe_ref.ep_combine_push_cpu(y_PD, _buffers(peers), peers.rank, layout_args(regions), post)


def ep_combine_reduce(num_tokens: int, peers: PeerBuffers, regions: EPRegions,
                      out_dtype: torch.dtype | None = None, *, wait: bool = False,
                      timeout_us: float = DEFAULT_TIMEOUT_US, max_polls: int = DEFAULT_MAX_POLLS) -> torch.Tensor:
    """`ep_combine_reduce_ref`, compiled: my tokens' partials summed over the owning ranks in rank order (fp32)."""
    if not _compiled(peers):
        return _combine.ep_combine_reduce_ref(num_tokens, peers, regions, out_dtype, wait=wait,
                                              timeout_us=timeout_us, max_polls=max_polls)
    out_dtype = _combine._check_reduce_args(num_tokens, peers, regions, out_dtype)
    return torch.ops.moe_ref.ep_combine_reduce_cpu(int(num_tokens), _buffers(peers), peers.rank,
                                                   layout_args(regions), out_dtype, wait, float(timeout_us),
                                                   int(max_polls))


def ops_table() -> tuple:
    """(pre_dispatch, barrier, dispatch, combine_push, combine_reduce): `ep_chunk`'s five phases from here."""
    return ep_pre_dispatch, symm_barrier, ep_dispatch, ep_combine_push, ep_combine_reduce
