"""The symmetric-buffer contract of the device-side EP kernels: which regions, where, and how peers are found.

    ep_layout (source) -> symm_barrier -> ep_dispatch (receiver pulls) -> experts -> ep_combine_push
        (expert owner pushes one partial per (token, rank)) -> symm_barrier -> ep_combine_reduce (source)

Every rank's buffer has the SAME layout, so a kernel reaches region `name` of rank s at byte
`ptrs_R[s] + offset(name)`. `PeerBuffers` holds the R mappings of this process (uint8 tensors, what the torch
twins read and write) and `ptrs_R`, the int64 table of their base addresses (what the Triton kernels read).
The same kernels then run over CUDA symmetric memory (`handle.buffer_ptrs`), over CPU shared memory, and in one
process that simulates R ranks with R separately allocated buffers (the interpreter tests).

`EPRegions` lists the regions (one contiguous block starting at `base_offset`, each region 128-byte aligned):

| region            | shape          | dtype            | written by / read by                                         |
|-------------------|----------------|------------------|--------------------------------------------------------------|
| `signal`          | `[R]`          | int32            | slot s: the last epoch rank s posted to me (peers write)     |
| `epoch`           | `[1]`          | int32            | my barrier count (local; device-side, CUDA-graph replayable) |
| `status`          | `[2 + R]`      | int32            | 0 ok / 1 peer timeout / 2 pool overflow; detail; missing[R]  |
| `counter`         | `[1]`          | int32            | programs arrived in a kernel that posts when all are done    |
| `num_tokens`      | `[1]`          | int32            | T of this chunk (ep_layout; peers read)                      |
| `send_count`      | `[R, e]`       | int32            | my slots per (destination rank, its local expert)            |
| `topk_ids`        | `[C, K]`       | int64            | my routing (pre-dispatch), -1 = masked                       |
| `topk_weights`    | `[C, K]`       | fp32             | my routing weights                                           |
| `slot_rank`       | `[C, K]`       | int32            | rank of slot (t, j) among my slots to the same expert, -1    |
| `x`               | `[C, Dx]`      | wire             | my rows: activation dtype, or fp8 e4m3                       |
| `x_scale` (fp8)   | `[C, Db]`      | fp32             | per-row per-128-column scales                                |
| `recv_num_tokens` | `[R]`          | int32            | T of every source (ep_dispatch, local)                       |
| `num_rows`        | `[e]`          | int64            | rows my experts received                                     |
| `row_start`       | `[e]`          | int64            | first pool row of each expert segment (masked: i * M)        |
| `recv_base`       | `[R, e]`       | int64            | first pool row of source s inside segment i                  |
| `pool_end`        | `[1]`          | int64            | end of the last segment (rows the experts need; masked: P)   |
| `recv_pos`        | `[R, C, K]`    | int32            | pool row of slot (s, t, j), -1 if not mine (t < T_s only)    |
| `recv_weight`     | `[R, C, K]`    | fp32             | w[t, j] of source s (t < T_s only)                           |
| `recv_src`        | `[P, 3]`       | int32            | (source, token, slot) of a pool row; -1 on padding rows      |
| `recv_x`          | `[P, Dx]`      | wire             | the receive pool, expert-major                               |
| `recv_x_scale`    | `[P, Db]`      | fp32             | its scales (fp8)                                             |
| `combine_partial` | `[R, C, Dx]`   | activation       | partial[s, t] = sum of token t's slots on rank s (s writes)  |
| `combine_slots`   | `[C, K, Dx]`   | activation       | [t, j] = t's slot-j row unweighted (owner writes; slot_rows) |

The pool is `contiguous` (segments back to back, each start aligned) or `masked` (`masked_rows` = M > 0: expert i
owns rows [i * M, (i + 1) * M), P = e * M); see `POOL_FORMATS`. In both, a segment's padding rows are those from
its last received row up to the next multiple of `alignment`. Rows of `recv_src`/`recv_x` at or past `pool_end`,
rows of a masked segment past its padding, and padding rows of `recv_x` hold stale data.
`signal`, `epoch`, `status` and `counter` must be zero on every rank before the first barrier
(`zero_signal_regions` + a host barrier).
`combine_slots` exists only with `slot_rows=True` (the batch-invariant combine at R >= 2, `ep_combine_slots`): every
slot of a token has one owner, so the K rows of a token land unreduced and never collide; the default combine
neither has nor reads it, so its layout and bytes do not change.

Shape legend: R ranks, e local experts, K top-k, C cap (rows one rank feeds per call), Dx row width,
Db = ceil(Dx / 128), P receive-pool rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moe_ref.core.errors import ShapeError

__all__ = ["EPRegions", "PeerBuffers", "region_names", "zero_signal_regions", "check_peers", "default_pool_rows",
           "masked_segment_rows", "POOL_FORMATS", "STATUS_OK", "STATUS_PEER_TIMEOUT", "STATUS_POOL_OVERFLOW"]

REGION_ALIGN_BYTES = 128
FP8_GROUP = 128

# values of status[0]
SIGNAL_REGIONS = ("signal", "epoch", "status", "counter")

STATUS_OK = 0
STATUS_PEER_TIMEOUT = 1
STATUS_POOL_OVERFLOW = 2


def _align(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


# How the receive pool is laid out (EPRegions.masked_rows):
#   contiguous: segments back to back, each start a multiple of `alignment` (prefix sums on the device): the
#               fewest rows; what prefill wants.
#   masked:     local expert i owns the fixed rows [i * M, (i + 1) * M), M = masked_segment_rows(...): the pool
#               is DeepGEMM's masked layout `[e, M, Dx]` with the row counts `num_rows [e]` on the device, so
#               decode GEMMs need no per-row group table (e * M rows: meant for small caps).
POOL_FORMATS = ("contiguous", "masked")


def masked_segment_rows(num_ranks: int, cap: int, alignment: int) -> int:
    """M = align(R * C, alignment): the most rows one local expert can receive (every token of every rank picks
    it; a token never picks an expert twice), so a masked pool never overflows.

    Example: R=2, C=128, alignment=128 -> 256.
    """
    return _align(num_ranks * cap, alignment)


def default_pool_rows(num_ranks: int, cap: int, num_topk: int, num_local_experts: int, alignment: int) -> int:
    """P = align(R * C * min(K, e) + e * (alignment - 1), alignment): the worst case of distinct experts per token.

    Example: R=2, C=16, K=4, e=8, alignment=128 -> 2*16*4 + 8*127 = 1144 -> 1152.
    """
    rows = num_ranks * cap * min(num_topk, num_local_experts) + num_local_experts * (alignment - 1)
    return _align(rows, alignment)


def region_names(fp8: bool, slot_rows: bool = False) -> tuple[str, ...]:
    """The regions in buffer order: `x_scale`/`recv_x_scale` with `fp8`, `combine_slots` (last) with `slot_rows`."""
    names = ["signal", "epoch", "status", "counter", "num_tokens", "send_count", "topk_ids", "topk_weights", "slot_rank", "x",
             "x_scale", "recv_num_tokens", "num_rows", "row_start", "recv_base", "pool_end", "recv_pos",
             "recv_weight", "recv_src", "recv_x", "recv_x_scale", "combine_partial", "combine_slots"]
    return tuple(n for n in names if (fp8 or n not in ("x_scale", "recv_x_scale"))
                 and (slot_rows or n != "combine_slots"))


@dataclass(frozen=True)
class EPRegions:
    """Byte offsets, shapes and dtypes of the EP kernels' regions (identical in every rank's buffer).

    Build with `EPRegions.build`; `offsets[name]` is the byte offset of region `name` from a buffer's base.

    Attributes:
        num_ranks, num_local_experts, num_topk, cap, hidden, num_pool_rows, alignment: R, e, K, C, Dx, P, rows
            each expert segment starts on.
        masked_rows: M, rows of each expert segment in the masked pool format (P = e * M); 0 = contiguous.
        activation_dtype: dtype of expert rows and `combine_partial` (fp32, fp16, bf16).
        fp8: rows travel as fp8 e4m3 + fp32 per-128 scales.
        slot_rows: the buffer has `combine_slots` (the batch-invariant combine's receive region).
        offsets: region name -> byte offset. end: first byte after the last region.
    """

    num_ranks: int
    num_local_experts: int
    num_topk: int
    cap: int
    hidden: int
    num_pool_rows: int
    alignment: int
    activation_dtype: torch.dtype
    fp8: bool
    offsets: dict
    end: int
    specs: dict = None  # name -> (shape, dtype, nbytes), filled by build (views are made on every call)
    masked_rows: int = 0
    slot_rows: bool = False

    @staticmethod
    def build(num_ranks: int, num_local_experts: int, num_topk: int, cap: int, hidden: int, *,
              activation_dtype: torch.dtype = torch.bfloat16, fp8: bool = False, alignment: int = 1,
              num_pool_rows: int | None = None, masked_rows: int = 0, base_offset: int = 0,
              slot_rows: bool = False) -> "EPRegions":
        """Lay the regions out back to back from `base_offset` (a multiple of 128).

        Args:
            num_ranks, num_local_experts, num_topk, cap, hidden: R, e, K, C, Dx.
            activation_dtype: fp32 / fp16 / bf16.
            fp8: ship rows as fp8 e4m3 + scales.
            alignment: rows each expert segment of the pool starts on.
            num_pool_rows: P; default `default_pool_rows(...)` (contiguous), e * M (masked).
            masked_rows: M > 0 lays the pool out masked (module doc; `masked_segment_rows` gives the M that never
                overflows), a multiple of `alignment`; 0: contiguous.
            base_offset: byte offset of the first region (lets a larger plan embed this block).
            slot_rows: add `combine_slots` `[C, K, Dx]` after every other region (the batch-invariant combine).

        Returns:
            The layout. Example: R=2, e=2, K=2, C=4, Dx=8, fp32 -> `signal` at 0, `epoch` at 128, ...
        """
        if base_offset % REGION_ALIGN_BYTES:
            raise ShapeError(f"{base_offset=} must be a multiple of {REGION_ALIGN_BYTES}")
        if min(num_ranks, num_local_experts, num_topk, cap, hidden, alignment) <= 0:
            raise ShapeError(f"sizes must be positive: {num_ranks=} {num_local_experts=} {num_topk=} {cap=} "
                             f"{hidden=} {alignment=}")
        if masked_rows < 0 or masked_rows % alignment:
            raise ShapeError(f"{masked_rows=} must be 0 (contiguous pool) or a positive multiple of {alignment=}")
        if masked_rows and num_pool_rows not in (None, num_local_experts * masked_rows):
            raise ShapeError(f"a masked pool has e * M = {num_local_experts * masked_rows} rows, not {num_pool_rows=}")
        pool = (num_local_experts * masked_rows if masked_rows else
                num_pool_rows or default_pool_rows(num_ranks, cap, num_topk, num_local_experts, alignment))
        offsets, offset, specs = {}, base_offset, {}
        regions = EPRegions(num_ranks, num_local_experts, num_topk, cap, hidden, pool, alignment, activation_dtype,
                            fp8, offsets, 0, specs, masked_rows, bool(slot_rows))
        for name in region_names(fp8, slot_rows):
            shape, dtype = regions._spec(name)
            specs[name] = (shape, dtype, math.prod(shape) * dtype.itemsize)
            offsets[name] = offset
            offset = _align(offset + specs[name][2], REGION_ALIGN_BYTES)
        object.__setattr__(regions, "end", offset)
        return regions

    # --- queries ----------------------------------------------------------------------------------------
    @property
    def pool_format(self) -> str:
        """``"masked"`` or ``"contiguous"`` (``POOL_FORMATS``)."""
        return "masked" if self.masked_rows else "contiguous"

    @property
    def num_scale_cols(self) -> int:
        """Db = ceil(Dx / 128)."""
        return math.ceil(self.hidden / FP8_GROUP)

    @property
    def wire_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.fp8 else self.activation_dtype

    def spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of region `name`."""
        shape, dtype, _ = self.specs[name]
        return shape, dtype

    def _spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        R, e, K, C, D, P = (self.num_ranks, self.num_local_experts, self.num_topk, self.cap, self.hidden,
                            self.num_pool_rows)
        Db = self.num_scale_cols
        specs = {
            "signal": ((R,), torch.int32), "epoch": ((1,), torch.int32), "status": ((2 + R,), torch.int32),
            "counter": ((1,), torch.int32),
            "num_tokens": ((1,), torch.int32), "send_count": ((R, e), torch.int32),
            "topk_ids": ((C, K), torch.int64), "topk_weights": ((C, K), torch.float32),
            "slot_rank": ((C, K), torch.int32), "x": ((C, D), self.wire_dtype), "x_scale": ((C, Db), torch.float32),
            "recv_num_tokens": ((R,), torch.int32), "num_rows": ((e,), torch.int64), "row_start": ((e,), torch.int64),
            "recv_base": ((R, e), torch.int64), "pool_end": ((1,), torch.int64), "recv_pos": ((R, C, K), torch.int32),
            "recv_weight": ((R, C, K), torch.float32), "recv_src": ((P, 3), torch.int32),
            "recv_x": ((P, D), self.wire_dtype), "recv_x_scale": ((P, Db), torch.float32),
            "combine_partial": ((R, C, D), self.activation_dtype),
            "combine_slots": ((C, K, D), self.activation_dtype),
        }
        return specs[name]

    def nbytes(self, name: str) -> int:
        return self.specs[name][2]

    def view(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        """Region `name` of one rank's buffer (`[>= end]` uint8) as a `[shape] dtype` tensor view."""
        if name not in self.specs:
            raise KeyError(f"no region {name!r}; regions: {', '.join(self.offsets)}")
        shape, dtype, nbytes = self.specs[name]
        start = self.offsets[name]
        return buffer[start:start + nbytes].view(dtype).view(shape)


@dataclass(frozen=True)
class PeerBuffers:
    """The R symmetric buffers as this process sees them.

    Attributes:
        rank: my rank r.
        buffers: R uint8 tensors, rank s's buffer mapped here (the torch twins read and write through them).
        ptrs_R: `[R]` int64 on my buffer's device: base address of each buffer (what the kernels read).
    """

    rank: int
    buffers: tuple
    ptrs_R: torch.Tensor

    @staticmethod
    def from_tensors(rank: int, buffers) -> "PeerBuffers":
        """From mapped uint8 tensors (CPU shm mappings, R fake ranks in one process, or CUDA peer views)."""
        buffers = tuple(buffers)
        ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=buffers[rank].device)
        return PeerBuffers(rank, buffers, ptrs)

    @staticmethod
    def from_symm_handle(local: torch.Tensor, handle) -> "PeerBuffers":
        """From `torch.distributed._symmetric_memory`: `local` = my uint8 buffer, `handle` = its rendezvous.

        `ptrs_R` comes from `handle.buffer_ptrs`; `buffers` from `handle.get_buffer` (twins and tests).
        """
        ptr_list = list(handle.buffer_ptrs)
        world = len(ptr_list)
        rank = getattr(handle, "rank", None)
        if rank is None:
            rank = ptr_list.index(local.data_ptr() - local.storage_offset() * local.element_size())
        nbytes = local.numel()
        buffers = tuple(local if s == rank else handle.get_buffer(s, (nbytes,), torch.uint8) for s in range(world))
        ptrs = torch.tensor(ptr_list, dtype=torch.int64, device=local.device)
        return PeerBuffers(rank, buffers, ptrs)

    @property
    def num_ranks(self) -> int:
        return len(self.buffers)

    @property
    def local(self) -> torch.Tensor:
        return self.buffers[self.rank]


def check_peers(peers: PeerBuffers, regions: EPRegions) -> None:
    """Raise ShapeError unless `peers` holds R uint8 buffers of at least `regions.end` bytes."""
    if peers.num_ranks != regions.num_ranks:
        raise ShapeError(f"{peers.num_ranks=} buffers but {regions.num_ranks=} in the region layout")
    for s, buf in enumerate(peers.buffers):
        if buf.dtype != torch.uint8 or buf.numel() < regions.end:
            raise ShapeError(f"buffer of rank {s} must be uint8 with >= {regions.end} bytes, got {buf.dtype} "
                             f"[{buf.numel()}]")
    if peers.ptrs_R.dtype != torch.int64 or tuple(peers.ptrs_R.shape) != (regions.num_ranks,):
        raise ShapeError(f"ptrs_R must be int64 [{regions.num_ranks}], got {peers.ptrs_R.dtype} "
                         f"{tuple(peers.ptrs_R.shape)}")


def zero_signal_regions(peers: PeerBuffers, regions: EPRegions) -> None:
    """Zero MY `signal`, `epoch`, `status` and `counter` (on every rank, then a host barrier, before first use)."""
    for name in SIGNAL_REGIONS:
        regions.view(peers.local, name).zero_()
