"""EPLB's replica routing in one launch: the router's logical ids -> the physical slot serving each (token, k).

    router_topk -> [replica_route] -> routed step (pre_dispatch -> dispatch -> ...)   (EPLB layers: ``to_physical``)

Per token t and top-k slot k (the rule of ``moe_ref.eplb.slots``' module doc):
    key_t   = token_key(x_t): the bits of the ``key_columns`` of row t (int16 for 16-bit x, int32 for fp32),
              m = sum_c (bits_c & 0xFFFFFFFF) * multiplier_c, key = (m ^ (m >> 31)) & 0x7FFFFFFF       (int64)
    replica = replica_index(key_t, k, replica_count_E[id])              (below; ``moe_ref.eplb`` uses it too)
    slot    = logical_to_physical_E_[id, replica]   for id in [0, E); -1 stays -1, an id >= E becomes Ph, an id
              below -1 stays itself (the routing check reports both)

Why one kernel: in torch the mapping is ~15 small ops (a column gather, the hash, two table gathers, the masks),
each a launch of a few microseconds at decode sizes; here one program reads the sampled columns of BLOCK_T rows
and writes their K slots. Every value is an integer and every operation exact (int64 throughout, which nothing
overflows: the key sums C <= 16 products of a 32-bit value and a multiplier below 2^26, the hash multiplies a 31-bit
key by 2654435761 < 2^32), so the kernel equals its twin ``replica_route_ref`` bitwise. No host sync and no
allocation that depends on data: graph-safe.

Shape legend: T tokens, K top-k, D hidden width, E experts (logical), Ph physical slots. The key columns
(min(NUM_KEY_COLUMNS, D)) and the table's width (Ph - E + 1: the most replicas an expert can have) have no letter.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_ref.core.errors import DTypeError
from moe_ref.kernels.runtime._triton_utils import cdiv, check_device, next_power_of_2
from moe_ref.kernels.runtime.launch import launch

__all__ = ["replica_index", "replica_route", "replica_route_ref", "token_key"]

# one program per 32 tokens: at T = 4096, 128 programs (about one per SM of an H100)
BLOCK_T = 32
# the integer each x element's bits are read as, per x dtype (what token_key hashes)
_KEY_BITS_DTYPES = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
_LOW_32_BITS = tl.constexpr(0xFFFFFFFF)
_KEY_MASK = tl.constexpr(0x7FFFFFFF)
# replica_index's hash: Knuth's multiplicative constant (odd, so token -> hash is a bijection mod 2^32) and a second
# odd constant that moves the top-k slot to another replica.
_TOKEN_MULTIPLIER = 2654435761
_SLOT_MULTIPLIER = 40503
_HASH_MASK = (1 << 32) - 1
_HASH_SHIFT = 16


def replica_index(token_key: torch.Tensor, slot_idx: torch.Tensor, replica_count: torch.Tensor) -> torch.Tensor:
    """Which of an expert's replicas serves one (token, k) entry: the one rule of EPLB's replica choice.

    ``h = ((key mod 2^31) * 2654435761 + k * 40503) mod 2^32``, ``replica = (h >> 16) mod c``: a function of the
    token's key, its top-k slot k and the expert's replica count c only, never of where the token sits in a batch,
    so every rank, chunking and micro-batching agree; distinct keys spread about evenly over the replicas.

    Args:
        token_key: ``>= 0`` int64 (any shape broadcastable with the others).
        slot_idx: top-k slots in ``[0, K)``, int64.
        replica_count: the expert's replica count, ``>= 1``, int64.

    Returns:
        replica: the broadcast shape, int64 in ``[0, c)``.
    """
    mixed = ((token_key & 0x7FFFFFFF) * _TOKEN_MULTIPLIER + slot_idx * _SLOT_MULTIPLIER) & _HASH_MASK
    return (mixed >> _HASH_SHIFT) % replica_count


_TL_TOKEN_MULTIPLIER, _TL_SLOT_MULTIPLIER = tl.constexpr(_TOKEN_MULTIPLIER), tl.constexpr(_SLOT_MULTIPLIER)
_TL_HASH_MASK, _TL_HASH_SHIFT = tl.constexpr(_HASH_MASK), tl.constexpr(_HASH_SHIFT)


def key_bits(x_TD: torch.Tensor) -> torch.Tensor:
    """``[T, D]`` int16 (16-bit x) or int32 (fp32 x): the bits of ``x_TD``, a view (no copy)."""
    if x_TD.dtype not in _KEY_BITS_DTYPES:
        raise DTypeError(f"x_TD must be bf16, fp16 or fp32 (the replica key reads its bits), got {x_TD.dtype}")
    return x_TD.view(_KEY_BITS_DTYPES[x_TD.dtype])


def token_key(x_TD: torch.Tensor, key_columns: torch.Tensor, key_multipliers: torch.Tensor) -> torch.Tensor:
    """A hash of each row's bits at ``key_columns``: ``[T]`` int64 in ``[0, 2^31)``, a function of the row alone.

    Args:
        x_TD: ``[T, D]`` fp32, fp16 or bf16 hidden states.
        key_columns: ``[min(NUM_KEY_COLUMNS, D)]`` int64 column indices in ``[0, D)``.
        key_multipliers: int64 odd multipliers ``< 2^26``, one per column.
    """
    bits_T_ = key_bits(x_TD).index_select(1, key_columns).to(torch.int64)
    mixed_T = ((bits_T_ & 0xFFFFFFFF) * key_multipliers).sum(dim=1)
    return (mixed_T ^ (mixed_T >> 31)) & 0x7FFFFFFF


@triton.jit
def _replica_route_kernel(
    # pointers
    bits_ptr, ids_ptr, key_columns_ptr, key_multipliers_ptr, replica_count_ptr, table_ptr, out_ptr,
    # sizes / scalars
    num_tokens, num_experts, num_physical,
    # strides
    stride_bits_t, stride_bits_d, stride_ids_t, stride_ids_k, stride_table_e,
    # meta
    NUM_TOPK: tl.constexpr, NUM_COLUMNS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One program = BLOCK_T tokens: each token's key from its C sampled columns, then its K slots.

    Example: E = 2, Ph = 3 (expert 1 in slots 1 and 2), ids of a token [1, -1, 5] -> [1 or 2, -1, 3].
    """
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    live_t = t < num_tokens
    c = tl.arange(0, BLOCK_C)
    live_c = c < NUM_COLUMNS
    columns = tl.load(key_columns_ptr + c, mask=live_c, other=0)
    multipliers = tl.load(key_multipliers_ptr + c, mask=live_c, other=0)
    bits = tl.load(bits_ptr + t[:, None] * stride_bits_t + columns[None, :] * stride_bits_d,
                   mask=live_t[:, None] & live_c[None, :], other=0).to(tl.int64)  # sign-extended, as torch
    mixed = tl.sum((bits & _LOW_32_BITS) * multipliers[None, :], axis=1)
    key = (mixed ^ (mixed >> 31)) & _KEY_MASK

    k = tl.arange(0, BLOCK_K)
    mask = live_t[:, None] & (k[None, :] < NUM_TOPK)
    ids = tl.load(ids_ptr + t[:, None] * stride_ids_t + k[None, :] * stride_ids_k, mask=mask, other=-1).to(tl.int64)
    valid = (ids >= 0) & (ids < num_experts)
    expert = tl.where(valid, ids, 0)
    count = tl.load(replica_count_ptr + expert, mask=valid, other=1)
    # replica_index's hash; the token multiplier exceeds int32, so both products are taken in int64
    hashed = ((key[:, None] & _KEY_MASK) * tl.cast(_TL_TOKEN_MULTIPLIER, tl.int64)
              + k[None, :].to(tl.int64) * _TL_SLOT_MULTIPLIER) & _TL_HASH_MASK
    replica = (hashed >> _TL_HASH_SHIFT) % count
    physical = tl.load(table_ptr + expert * stride_table_e + replica, mask=valid, other=0)
    out = tl.where(valid, physical, tl.where(ids < 0, ids, num_physical))
    tl.store(out_ptr + t[:, None] * NUM_TOPK + k[None, :], out, mask=mask)


def replica_route(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, key_columns: torch.Tensor,
                  key_multipliers: torch.Tensor, replica_count_E: torch.Tensor, logical_to_physical_E_: torch.Tensor,
                  num_experts: int, num_physical: int) -> torch.Tensor:
    """The physical slot of each (token, k), in one launch (module doc); no host sync, graph-safe.

    Args:
        x_TD: ``[T, D]`` bf16, fp16 or fp32 hidden states (the key's bits), any strides.
        topk_ids_TK: ``[T, K]`` int64 or int32 logical ids, any strides.
        key_columns: ``[min(NUM_KEY_COLUMNS, D)]`` int64 columns in ``[0, D)``.
        key_multipliers: int64, one per column, below 2^26.
        replica_count_E: ``[E]`` int64, each >= 1, contiguous.
        logical_to_physical_E_: ``[E, Ph - E + 1]`` int64, unit stride along its rows: row l's first
            ``replica_count_E[l]`` entries are expert l's slots in increasing order.
        num_experts: E. num_physical: Ph.

    Returns:
        physical_ids_TK: ``[T, K]`` int64, contiguous.
    """
    check_device("x_TD", x_TD)
    num_tokens, num_topk = topk_ids_TK.shape
    physical_TK = torch.empty(num_tokens, num_topk, dtype=torch.int64, device=topk_ids_TK.device)
    bits_TD = key_bits(x_TD)
    if physical_TK.numel() == 0:
        return physical_TK
    num_columns = key_columns.shape[0]
    launch(_replica_route_kernel, (cdiv(num_tokens, BLOCK_T),),
        bits_TD, topk_ids_TK, key_columns, key_multipliers, replica_count_E, logical_to_physical_E_, physical_TK,
        num_tokens, num_experts, num_physical,
        bits_TD.stride(0), bits_TD.stride(1), topk_ids_TK.stride(0), topk_ids_TK.stride(1),
        logical_to_physical_E_.stride(0),
        NUM_TOPK=num_topk, NUM_COLUMNS=num_columns,
        BLOCK_T=BLOCK_T, BLOCK_K=next_power_of_2(num_topk), BLOCK_C=next_power_of_2(num_columns))
    return physical_TK


def replica_route_ref(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, key_columns: torch.Tensor,
                      key_multipliers: torch.Tensor, replica_count_E: torch.Tensor,
                      logical_to_physical_E_: torch.Tensor, num_experts: int, num_physical: int) -> torch.Tensor:
    """The torch twin of ``replica_route`` (same arguments and result, bitwise; no host sync): ``token_key`` and
    ``replica_index``, the one torch statement of each formula."""
    ids_TK = topk_ids_TK.to(torch.int64)
    valid_TK = (ids_TK >= 0) & (ids_TK < num_experts)
    expert_TK = ids_TK.clamp(0, num_experts - 1)
    key_T1 = token_key(x_TD, key_columns, key_multipliers).unsqueeze(1)
    slot_idx_1K = torch.arange(ids_TK.shape[1], device=ids_TK.device).unsqueeze(0)
    replica_TK = replica_index(key_T1, slot_idx_1K, replica_count_E[expert_TK])
    physical_TK = logical_to_physical_E_[expert_TK, replica_TK]
    invalid_TK = torch.where(ids_TK < 0, ids_TK, torch.full_like(ids_TK, num_physical))
    return torch.where(valid_TK, physical_TK, invalid_TK)
